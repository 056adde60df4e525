"""The methods: every config of conf/model/ with the class it builds, in the report's order.

A method is a config of conf/model/ (`model=<name>`): its name, its composed `model:` node and
the class its `_target_` builds. What the method is comes from that class's declarations
(`Method.samples_structure`, `samples_weights`, `networks`, `optimizer_key`, `variant_keys`),
read together with the config (its task, its weight posterior, a deep ensemble's members),
without building anything. The comparison's `--methods`, its per-method settings, the report's
order and the name of a run's method all ask here, so a new config and class appear in each of
them without another edit; only the report's order of the methods is written down
(`REPORT_ORDER`), and a config it does not name follows the named ones.

It sits with the methods, below the evaluation (the report, the run folders) and the tools that
ask it, and reads the config tree from the package (`dbsn.CONF_DIR`) and every extension's
(`dbsn.extensions`): an extension's method is a method like dbsn's own.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hydra.utils import get_object, instantiate
from omegaconf import OmegaConf

from dbsn.methods.settings import WeightOptimizer
from dbsn.methods.tasks import Classification
from dbsn.nets.backbone import Backbone

#: The order in which the report lists the methods (config names); the configs it does not name
#: follow, by name.
REPORT_ORDER = (
    "dbsn",
    "fbn",
    "map",
    "map_fixed",
    "mc_dropout",
    "bbb",
    "deep_ensemble",
    "batch_ensemble",
    "rank1_bnn",
    "packed_ensemble",
    "masksembles",
    "mimo",
    "sngp",
    "ddu",
    "csghmc",
    "csgld",
    "csghmc_structure",
    "vogn",
    "vogn_fbn",
    "nekfac",
)


def _short(target) -> str:
    return str(target or "?").rsplit(".", 1)[-1]


def built_class(node: Mapping) -> type:
    """The class a `model:` node builds: its `_target_`, or for a factory (VOGNMethod) the class
    the factory's `builds(**settings)` names."""
    target = get_object(node["_target_"])
    return target if isinstance(target, type) else target.builds(**node)


@dataclass(frozen=True)
class MethodConfig:
    """A method of conf/model/: its config name, its composed `model:` node, the class it builds
    and, for an ensemble of methods (a deep ensemble), its members' method."""

    name: str
    config: dict
    cls: type
    member: MethodConfig | None = None

    @property
    def classifies(self) -> bool:
        """Whether it classifies images (not another task, e.g. segmentation)."""
        task = self.config.get("task")
        return task is None or get_object(task["_target_"]) is Classification

    @property
    def samples_structure(self) -> bool:
        """Whether it draws structures α from q(α | θ) (`Method.samples_structure`)."""
        return self.cls.samples_structure

    @property
    def networks(self) -> str:
        """ "cells", "any" or "own" (`Method.networks`)."""
        return self.cls.networks

    @property
    def weights_sample(self) -> bool:
        """Whether its config's weight posterior draws members (MC dropout, BBB)."""
        weights = self.config.get("weights")
        return weights is not None and instantiate(weights).stochastic

    @property
    def fixed_members(self) -> bool:
        """Whether its members are fixed by its network (one network, or M members inside it), so
        that S does not apply; otherwise it draws S members (structures, weights, or its members'
        draws)."""
        return not (
            self.samples_structure
            or self.cls.samples_weights
            or self.cls.samples_members
            or self.weights_sample
            or (self.member is not None and not self.member.fixed_members)
        )

    @property
    def optimizer_key(self) -> str:
        """Where under `model` its config sets the weights' optimiser (a deep ensemble's: its
        members'), whose `lr` is the base learning rate."""
        return f"member.{self.member.optimizer_key}" if self.member else self.cls.optimizer_key

    @property
    def optimizer(self) -> dict:
        """Its config's settings of the weights' optimiser (at `optimizer_key`)."""
        node = self.config
        for key in self.optimizer_key.split("."):
            node = node.get(key) or {}
        return node

    @property
    def sgd(self) -> bool:
        """Whether its weights train with `WeightOptimizer` (SGD and its schedule), not with an
        optimiser of its own (VOGN's, NEK-FAC's)."""
        target = self.optimizer.get("_target_")
        return target is not None and get_object(target) is WeightOptimizer


def _folders(conf_dir: Path | None) -> tuple[Path, ...]:
    """`conf_dir` alone, or dbsn's config tree and every extension's."""
    from dbsn.extensions import config_dirs

    return (Path(conf_dir),) if conf_dir is not None else tuple(config_dirs())


def _model_configs(folders: tuple[Path, ...]) -> dict[str, dict]:
    """Every conf/model/<name>.yaml composed by Hydra (parents, groups, overrides) into a plain
    `model:` node, by name. Hydra's config loader, not `hydra.compose`: that needs the global
    Hydra instance, which a running Hydra app (an evaluation sweep building its report) holds."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path
    from hydra.core.config_search_path import SearchPathQuery
    from hydra.types import RunMode

    search_path = create_config_search_path(str(folders[0]))  # with the extensions' (dbsn's search-path plugin)
    for folder in folders[1:]:
        if f"file://{folder}" not in {element.path for element in search_path.get_path()}:
            search_path.prepend("dbsn-extension", f"file://{folder}", anchor=SearchPathQuery(provider="schema"))
    loader = ConfigLoaderImpl(config_search_path=search_path)
    names = sorted({path.stem for folder in folders for path in (folder / "model").glob("*.yaml")})
    order = [n for n in REPORT_ORDER if n in names] + [n for n in names if n not in REPORT_ORDER]
    return {
        name: OmegaConf.to_container(
            loader.load_configuration(config_name=None, overrides=[f"+model={name}"], run_mode=RunMode.RUN).model
        )
        for name in order
    }


@functools.cache
def _registry(folders: tuple[Path, ...]) -> tuple[MethodConfig, ...]:
    methods = [MethodConfig(name, config, built_class(config)) for name, config in _model_configs(folders).items()]
    return tuple(
        MethodConfig(
            m.name, m.config, m.cls, None if m.config.get("member") is None else _member(m.config["member"], methods)
        )
        for m in methods
    )


def _member(node: dict, methods) -> MethodConfig:
    return MethodConfig(_name(node, methods), node, built_class(node))


def method_configs(conf_dir: Path | None = None) -> tuple[MethodConfig, ...]:
    """Every method of `conf_dir`/model/ (default: the package's conf/ and every extension's), in
    the report's order."""
    return _registry(_folders(conf_dir))


def method_config(name: str, conf_dir: Path | None = None) -> MethodConfig:
    """The method `model=<name>` configures."""
    methods = {m.name: m for m in method_configs(conf_dir)}
    if name not in methods:
        raise ValueError(f"unknown method {name!r}: conf/model/ has {', '.join(methods)}")
    return methods[name]


def method_order(conf_dir: Path | None = None) -> tuple[str, ...]:
    """The methods' config names in the report's order."""
    return tuple(m.name for m in method_configs(conf_dir))


class _MethodOrder(Sequence):
    """`method_order()` of the package's conf/ as a sequence, composed when first read, not when
    imported."""

    def __getitem__(self, index):
        return method_order()[index]

    def __len__(self) -> int:
        return len(method_order())

    def __iter__(self) -> Iterator[str]:
        return iter(method_order())

    def index(self, name, *args) -> int:
        return method_order().index(name, *args)


#: The methods' config names in the report's order (`method_order`), read when first used.
METHOD_ORDER: Sequence[str] = _MethodOrder()


def _setting(node: Mapping, key: str):
    value = node
    for part in key.split("."):  # a dotted key: a setting inside a group (cSG-MCMC's sampler.friction)
        value = value.get(part) if isinstance(value, Mapping) else None
    return _short(value.get("_target_")) if isinstance(value, Mapping) else value


def _name(model: Mapping, methods) -> str:
    candidates = [m for m in methods if _short(m.config["_target_"]) == _short(model.get("_target_"))]
    if not candidates:
        return _short(model.get("_target_"))
    cls = built_class({**model, "_target_": candidates[0].config["_target_"]})
    candidates = [m for m in candidates if m.cls is cls] or candidates
    for key in cls.variant_keys:
        candidates = [m for m in candidates if _setting(m.config, key) == _setting(model, key)] or candidates
    return candidates[0].name


def method_name(model: Mapping, conf_dir: Path | None = None) -> str:
    """The config name of a run's resolved `model:` node: among the methods whose class it builds,
    those that share its settings of each of the class's `variant_keys` in turn (a key no method
    shares is passed over), the first in the report's order; the class's name when no config
    builds it."""
    return _name(model, method_configs(conf_dir))


@functools.cache
def _backbones(folders: tuple[Path, ...]) -> dict[str, str]:
    own = {_short((m.config.get("net") or {}).get("_target_")) for m in _registry(folders) if m.networks == "own"}
    nets = sorted(
        (path for folder in folders for path in (folder / "model" / "net").glob("*.yaml")), key=lambda path: path.stem
    )
    targets = {path.stem: OmegaConf.load(path).get("_target_") for path in nets}
    return {
        name: _short(target)
        for name, target in targets.items()
        if issubclass(get_object(target), Backbone) and _short(target) not in own
    }


def builds_backbone(target: str) -> bool | None:
    """Whether the network `_target_` builds a `Backbone` (a network without structure); None
    where that is not known without building it (a factory function, or a network this process
    cannot import). Composes no config."""
    from hydra._internal.utils import _locate  # get_object without its error log: not knowing is no error here

    try:
        cls = _locate(target)
    except Exception:  # noqa: BLE001 - a user's network this process cannot import
        return None
    return issubclass(cls, Backbone) if isinstance(cls, type) else None


def field_backbones(conf_dir: Path | None = None) -> dict[str, str]:
    """The field's backbones, {config name of conf/model/net/: class name}, by name: the networks
    without structure (`Backbone`) that a method of any network trains, not a method's own
    network (NEK-FAC's VGG16-BN)."""
    return dict(_backbones(_folders(conf_dir)))
