"""Schema check for composed Hydra configs, run before anything is built.

Hydra already rejects an unknown group choice (`model=dbsnn` lists the valid options) and an
override of a key that does not exist. What it cannot see is a misspelled key that a YAML
file or a `+key=value` override *adds* to a node that `hydra.utils.instantiate` will pass to a
constructor: that would fail much later, deep inside instantiate, or worse, be swallowed by a
`**kwargs`. `validate_config` walks every node with a `_target_`, imports the target and checks
each key against the constructor's signature, naming the valid keys and the likely intended one,
and each value against the parameter's annotation (`model.train_samples=abc` names the key and
the type it expects, instead of failing later in a comparison deep inside the method).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import shutil
import types
import typing
from collections.abc import Iterable
from typing import Any, Literal, Union

import torch
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from dbsn import CONF_DIR  # noqa: F401 (entry points and tools import it from here)
from dbsn.precision import cpu_bf16_channels_last_is_wrong
from dbsn.runtime.config_errors import ConfigError, UnknownKeysError, suggest  # noqa: F401 (imported from here)

HYDRA_KEYS = {"_target_", "_partial_", "_recursive_", "_convert_", "_args_"}

# Keys a node may carry without being constructor arguments, and where: an ensemble's `member` (the
# method each member is, which `build_model` builds `size` times).
RUNTIME_KEYS = {"model": {"member"}}

#: The top-level keys of train.py's config, each read by the run (`validate_config` refuses any
#: other): the sections that build its objects, `paths` (read through interpolations), `hydra`,
#: the run's own settings, `tags` (W&B's, and the run's record), `statistics` (the test pass),
#: `report` (a sweep's report), `budget` (a field job's: which length it trains, `check_budget`).
TOP_LEVEL_KEYS = {
    "data",
    "model",
    "trainer",
    "logger",
    "callbacks",
    "paths",
    "hydra",
    "seed",
    "ckpt_path",
    "init_from",
    "test",
    "task_name",
    "tags",
    "resume",
    "resume_changes",
    "statistics",
    "report",
    "budget",
}

# Top-level keys of train.py and the types they take (None = may be null).
TOP_LEVEL_TYPES = {
    "seed": (int, None),
    "ckpt_path": (str, None),
    "init_from": (str, None),
    "test": (bool,),
    "resume": (bool,),
    "task_name": (str,),
    "resume_changes": (list, None),
    "tags": (list, None),
}

#: The keys of the top-level sections that are settings without a `_target_` (train and evaluate).
PLAIN_SECTIONS = {
    "statistics": {"seed", "resamples", "level"},
    "report": {"reference"},
    "budget": {"recipe", "backbone", "epochs"},
}

#: A field job's budgets (conf/budget/): its authors' recipe, or the epochs every method on its backbone shares.
BUDGET_RECIPES = ("authors", "shared")

#: The top-level keys of evaluate.py's config, each read by the evaluation
#: (`dbsn.runtime.evaluation`, `dbsn.runtime.run.evaluate`); `check_evaluate_config` refuses others.
EVALUATE_TOP_LEVEL_KEYS = {
    "task_name",
    "tags",
    "ckpt_path",
    "output_dir",
    "n_samples",
    "samples_per_forward",
    "rows_per_forward",
    "data_root",
    "batch_size",
    "test_tau",
    "bn_recalibration",
    "statistics",
    "report",
    "ablation",
    "evaluations",
    "ood",
    "ood_score",
    "posthoc",
    "trainer",
    "logger",
    "callbacks",
    "paths",
    "hydra",
}

#: evaluate.py's sections of settings without a `_target_`, beyond `PLAIN_SECTIONS`.
EVALUATE_PLAIN_SECTIONS = {
    "ablation": {"sizes"},
    "bn_recalibration": {"enabled", "images", "augment", "batch_size", "seed"},
}


def _accepted_keys(target: Any) -> tuple[set[str], bool]:
    """Parameter names of `target`'s constructor, and whether it takes **kwargs. A class whose
    constructor passes **kwargs on to its base's accepts the base's names too (up the MRO to
    the first constructor without **kwargs)."""
    functions = (
        [c.__dict__["__init__"] for c in target.__mro__ if "__init__" in c.__dict__]
        if inspect.isclass(target)
        else [target]
    )
    names: set[str] = set()
    for function in functions:
        parameters = inspect.signature(function).parameters
        names |= {n for n, p in parameters.items() if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        if not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
            return names, False
    return names, True


def _annotations(target: Any) -> dict[str, Any]:
    """The constructor's parameter annotations, resolved, with those of the base classes'
    constructors that a `**kwargs` passes keys on to; {} where they cannot be resolved."""
    functions = (
        [c.__dict__["__init__"] for c in reversed(target.__mro__) if "__init__" in c.__dict__]
        if inspect.isclass(target)
        else [target]
    )
    hints: dict[str, Any] = {}
    for function in functions:  # the most derived last: its annotation wins
        try:
            hints.update(typing.get_type_hints(function))
        except Exception:  # noqa: BLE001 - annotations naming what is not importable: no type check
            continue
    hints.pop("return", None)
    return hints


def _fits(value: Any, annotation: Any) -> bool | None:
    """Whether a config value fits a parameter annotation: True, False, or None when the
    annotation is not one of the simple kinds checked here (the constructor decides)."""
    if annotation is Any:
        return True
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        verdicts = [_fits(value, arg) for arg in typing.get_args(annotation)]
        return True if any(v is True for v in verdicts) else (None if None in verdicts else False)
    if origin is Literal:
        return value in typing.get_args(annotation)
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if origin in (list, tuple, typing.Sequence, Iterable) or annotation in (list, tuple):
        return isinstance(value, (list, tuple, ListConfig))
    if origin is dict or annotation is dict:
        return isinstance(value, (dict, DictConfig))
    return None


def _describe(annotation: Any) -> str:
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(annotation))
    if typing.get_origin(annotation) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


def _check_type(where: str, value: Any, annotation: Any) -> None:
    if OmegaConf.is_config(value) or _fits(value, annotation) is not False:
        return
    raise ConfigError(f"{where}={value!r}: expected {_describe(annotation)}, got {type(value).__name__}.")


def _is_settings_class(annotation: Any) -> bool:
    """Whether a parameter takes an object that a config builds from a mapping with `_target_`
    (a settings dataclass, a network): a string, a number or a list there is a malformed config."""
    return inspect.isclass(annotation) and (
        dataclasses.is_dataclass(annotation) or issubclass(annotation, torch.nn.Module)
    )


def _takes_a_mapping(annotation: Any) -> bool:
    if typing.get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return bool(args) and all(_takes_a_mapping(a) for a in args)
    return _is_settings_class(annotation)


def check_node(node: DictConfig, where: str) -> None:
    """Refuse a key that `node`'s `_target_` (or one of its children's) does not take, and a value
    that does not fit its annotation, naming the key and what would be right."""
    target_name = node.get("_target_")
    if target_name is not None:
        try:
            target = get_object(target_name)
        except Exception as err:
            raise ConfigError(f"{where}._target_: cannot import '{target_name}' ({err}).") from err
        accepted, takes_kwargs = _accepted_keys(target)
        annotations = _annotations(target)
        for key in node.keys():
            if key in annotations and key not in HYDRA_KEYS and not OmegaConf.is_missing(node, key):
                value = node[key]
                if _takes_a_mapping(annotations[key]) and value is not None and not OmegaConf.is_config(value):
                    raise ConfigError(
                        f"{where}.{key}={value!r}: expected a mapping of settings with _target_ (the "
                        f"class it builds), got {type(value).__name__}."
                    )
                _check_type(f"{where}.{key}", value, annotations[key])
        if "num_classes" in node and where.endswith(".net"):
            raise ConfigError(
                f"{where}.num_classes: the network's class count is the data's (train.py passes the data "
                f"module's num_classes); remove {where}.num_classes."
            )
        if not takes_kwargs:
            runtime = RUNTIME_KEYS.get(where, set())
            unknown = [
                key for key in node.keys() if key not in HYDRA_KEYS and key not in accepted and key not in runtime
            ]
            if unknown:
                raise UnknownKeysError(where, [str(k) for k in unknown], target_name, accepted)
    for key in node.keys():
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            check_node(child, f"{where}.{key}")
        elif isinstance(child, ListConfig):
            for i, item in enumerate(child):
                if isinstance(item, DictConfig):
                    check_node(item, f"{where}.{key}[{i}]")


#: trainer.precision values the methods support, and why the others are refused.
PRECISIONS = ("32-true", "bf16-mixed", "64-true")
_REFUSED_PRECISION = {
    "16-mixed": "float16's loss scaling does not reach the methods' own gradient clipping "
    "(model.optim.grad_clip_norm), which would clip gradients still multiplied by the loss scale",
    "bf16-true": "it stores every parameter and buffer in 16 bits: the structure logits θ, the BatchNorm running "
    "statistics and the Gaussian weights' scales too",
    "16-true": "it stores every parameter and buffer in 16 bits: the structure logits θ, the BatchNorm running "
    "statistics and the Gaussian weights' scales too",
}
_PRECISION_ALIASES = {"32": "32-true", "64": "64-true", "bf16": "bf16-mixed", "16": "16-mixed", "half": "16-true"}


def check_trainer(trainer: DictConfig | dict | None) -> None:
    """Refuse trainer settings that would quietly change the method: a precision that stores θ
    and the statistics in 16 bits, or float16 loss scaling that the methods' manual clipping
    does not see (`dbsn.precision` says what bf16-mixed keeps in float32)."""
    if not trainer:
        return
    value = trainer.get("precision")
    if value is None:
        return
    name = _PRECISION_ALIASES.get(str(value), str(value))
    if name in PRECISIONS:
        return
    why = _REFUSED_PRECISION.get(name, "it is not one of the supported precisions")
    raise ConfigError(
        f"trainer.precision={value} is refused: {why}. Use trainer.precision=bf16-mixed (bfloat16 products, "
        "float32 for θ, statistics and KL terms; GPUs since Ampere, and CPUs) or 32-true."
    )


def _compile_settings(model: DictConfig | dict | None) -> list[tuple[str, Any]]:
    """(where, settings) of every compile node of a model config (an ensemble's member too)."""
    found = []
    for where, node in (("model", model), ("model.member", (model or {}).get("member"))):
        compile_node = ((node or {}).get("execution") or {}).get("compile")
        if compile_node is not None:
            found.append((f"{where}.execution.compile", compile_node))
    return found


def cpp_compiler() -> str | None:
    """The C++ compiler inductor would call on a CPU ($CXX, else g++, c++ or clang++), or None."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++", "clang++"]
    return next((path for name in names if (path := shutil.which(name))), None)


def check_compile(cfg: DictConfig) -> None:
    """Refuse `model.execution.compile.enabled=true` where its backend cannot run: inductor generates C++
    on a CPU (a compiler is needed) and Triton kernels on a GPU."""
    trainer = cfg.get("trainer") or {}
    for where, settings in _compile_settings(cfg.get("model")):
        if not settings.get("enabled") or settings.get("backend", "inductor") != "inductor":
            continue
        gpu = str(trainer.get("accelerator", "auto")) in ("auto", "gpu", "cuda") and torch.cuda.is_available()
        if gpu:
            from torch.utils._triton import has_triton

            if not has_triton():
                raise ConfigError(
                    f"{where}.enabled=true: inductor needs Triton on a GPU and it is not installed "
                    f"(pip install triton), or set {where}.enabled=false."
                )
        elif cpp_compiler() is None:
            raise ConfigError(
                f"{where}.enabled=true: on a CPU inductor compiles C++ kernels, and no C++ compiler was found "
                f"($CXX, g++, c++, clang++). Install one (Debian/Ubuntu: apt-get install g++), set "
                f"{where}.backend=aot_eager (no code generation, no speed-up), or {where}.enabled=false."
            )


def check_cuda_graph(cfg: DictConfig, on_this_machine: bool = True) -> None:
    """Refuse `model.execution.cuda_graph=true` before anything is built where it cannot run: without a
    CUDA device (on this machine: `on_this_machine`), or on several devices."""
    trainer = cfg.get("trainer") or {}
    model = cfg.get("model") or {}
    execution = model.get("execution")
    if (
        "member" in model
        and execution is not None
        and set(execution) <= {"cuda_graph", "conv_1x1"}
        and all(value == "auto" for value in execution.values())
    ):
        with open_dict(model):  # speed=fast on an ensemble: "where it can" is nowhere (its members step together)
            del model["execution"]
    for where, node in (("model", cfg.get("model")), ("model.member", (cfg.get("model") or {}).get("member"))):
        if ((node or {}).get("execution") or {}).get("cuda_graph") is not True:
            continue
        on_cpu = (
            (_on_cpu(trainer) or not torch.cuda.is_available())
            if on_this_machine
            else str(trainer.get("accelerator", "auto")) == "cpu"
        )  # a cluster's "auto" is its GPUs
        if on_cpu:
            raise ConfigError(
                f"{where}.execution.cuda_graph=true captures the training step on a CUDA device, and "
                f"this run trains on the CPU: use trainer=gpu on a machine with a GPU, or set "
                f"{where}.execution.cuda_graph=false."
            )
        devices, nodes = trainer.get("devices", 1), trainer.get("num_nodes", 1)
        if (
            nodes not in (1, None)
            or devices not in (1, "1", None, "auto")
            and not (isinstance(devices, list) and len(devices) == 1)
        ):
            raise ConfigError(
                f"{where}.execution.cuda_graph=true captures one process's step: set trainer.devices=1 "
                f"trainer.num_nodes=1, or {where}.execution.cuda_graph=false."
            )


def check_weight_copies(cfg: DictConfig) -> None:
    """Refuse `model.execution.weight_copies=true` without bf16-mixed before anything is built: it
    casts the convolution weights for autocast (`dbsn.methods.weight_copies`), and a step without
    autocast would refuse it at its first step."""
    trainer = cfg.get("trainer") or {}
    precision = _PRECISION_ALIASES.get(str(trainer.get("precision")), str(trainer.get("precision")))
    if precision == "bf16-mixed":
        return
    for where, node in (("model", cfg.get("model")), ("model.member", (cfg.get("model") or {}).get("member"))):
        if ((node or {}).get("execution") or {}).get("weight_copies") is True:
            raise ConfigError(
                f"{where}.execution.weight_copies=true casts the weights for mixed precision, and this run has "
                f"trainer.precision={trainer.get('precision')}: set trainer.precision=bf16-mixed or "
                f"{where}.execution.weight_copies=false."
            )


def _on_cpu(trainer) -> bool:
    """Whether a trainer config trains on the CPU (explicitly, or "auto" without CUDA)."""
    accelerator = str((trainer or {}).get("accelerator", "auto"))
    return accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())


def check_channels_last(cfg: DictConfig) -> None:
    """Refuse channels-last networks under bf16-mixed on a CPU whose oneDNN computes the bfloat16
    weight gradient of a dilated depthwise convolution wrongly in that layout (measured here, in
    milliseconds: `dbsn.precision.cpu_bf16_channels_last_is_wrong`; some CPUs do, others not):
    every DBSN cell has such convolutions (dil_conv_3x3), and the wrong values at times end the
    run with a non-finite loss. Either option alone is exact."""
    trainer = cfg.get("trainer") or {}
    precision = _PRECISION_ALIASES.get(str(trainer.get("precision")), str(trainer.get("precision")))
    if precision != "bf16-mixed" or not _on_cpu(trainer):
        return
    for where, node in (("model", cfg.get("model")), ("model.member", (cfg.get("model") or {}).get("member"))):
        if (
            node is not None
            and (node.get("execution") or {}).get("channels_last") is True
            and cpu_bf16_channels_last_is_wrong()
        ):
            raise ConfigError(
                f"{where}.execution.channels_last=true with trainer.precision=bf16-mixed is refused on this CPU: its oneDNN computes "
                "wrong bfloat16 weight gradients for the cells' dilated depthwise convolutions in that layout. Use one of "
                "them (channels-last alone is the faster on a CPU), or train on a GPU."
            )


def resolve_channels_last(cfg: DictConfig) -> None:
    """`model.execution.channels_last=auto` (the default) becomes true where the network trains
    compiled on a CPU, and false elsewhere. The layout changes no number beyond float rounding
    (tested); it is chosen by measurement (docs/performance.md, "The CPU layout"): with the fused
    cell, an eager step in channels-last is slower than the contiguous one on CPUs with and
    without native bfloat16, in float32 and in bf16-mixed, and on a GPU; compiled on a CPU,
    channels-last is the fastest. Under bf16-mixed on a CPU whose channels-last bfloat16 gradients
    are wrong it stays false. The run's saved config holds the resolved value."""
    trainer = cfg.get("trainer") or {}
    on_cpu = _on_cpu(trainer)
    precision = _PRECISION_ALIASES.get(str(trainer.get("precision")), str(trainer.get("precision")))
    for node in (cfg.get("model"), (cfg.get("model") or {}).get("member")):
        execution = (node or {}).get("execution")
        if execution is not None and execution.get("channels_last") == "auto":
            compiled = bool((execution.get("compile") or {}).get("enabled"))
            execution.channels_last = bool(
                on_cpu and compiled and not (precision == "bf16-mixed" and cpu_bf16_channels_last_is_wrong())
            )


def _check_finite(node: DictConfig | ListConfig, where: str) -> None:
    """Refuse NaN and infinite numbers anywhere in a section: no setting means them, and a NaN
    passes every `<` check a constructor makes."""
    items = node.items() if isinstance(node, DictConfig) else enumerate(node)
    for key, value in items:
        path = f"{where}.{key}" if isinstance(node, DictConfig) else f"{where}[{key}]"
        if isinstance(value, (DictConfig, ListConfig)):
            _check_finite(value, path)
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{path}={value}: expected a finite number.")


def _check_settings(node: DictConfig, where: str) -> None:
    """Build every small settings object (a dataclass `_target_` without nested targets, e.g.
    the τ and β schedules, the optimisers' settings) now, so that its own range checks refuse a
    value before anything is built or read."""
    target_name = node.get("_target_")
    children = {key: node._get_node(key) for key in node.keys()}
    nested = [key for key, child in children.items() if isinstance(child, DictConfig) and "_target_" in child]
    if target_name is not None and not nested:
        target = get_object(target_name)
        if dataclasses.is_dataclass(target):
            try:
                instantiate(node)
            except Exception as err:  # noqa: BLE001 - the settings' own message says what is wrong
                cause = err.__cause__ if err.__cause__ is not None else err
                raise ConfigError(f"{where}: {cause}") from err
    for key, child in children.items():
        if isinstance(child, DictConfig):
            _check_settings(child, f"{where}.{key}")


def check_sync_batchnorm(cfg: DictConfig) -> None:
    """Refuse `trainer.sync_batchnorm=true` for networks with per-structure (grouped) BatchNorm:
    Lightning swaps every BatchNorm for a plain SyncBatchNorm, so the T structures of a grouped
    forward would share their batch statistics (a different method), and the chunked step's
    accumulated running statistics and per-structure recalibration would stop working, silently.
    On any device count: the swap happens on one device too."""
    trainer = cfg.get("trainer") or {}
    if not trainer.get("sync_batchnorm"):
        return
    from dbsn.nets.batchnorm import GroupBatchNorm2d

    model = cfg.get("model") or {}
    for where, node in (("model.net", model.get("net")), ("model.member.net", (model.get("member") or {}).get("net"))):
        if node is None:
            continue
        net = instantiate(node, num_classes=10)  # the class count does not change the BatchNorms
        if any(isinstance(m, GroupBatchNorm2d) for m in net.modules()):
            raise ConfigError(
                f"trainer.sync_batchnorm=true is refused: {where} ({type(net).__name__}) normalises each sampled "
                "structure with its own batch statistics, and SyncBatchNorm would pool them across structures and "
                "ranks. Set trainer.sync_batchnorm=false (per-rank statistics, as the research code has)."
            )


def _samples_structures(node: DictConfig) -> bool:
    """Whether the method `node` builds learns a distribution over DBSN's cell structures (DBSN,
    FBN, VOGN-FBN)."""
    from dbsn.methods import DBSN, VOGNMethod

    target = get_object(node["_target_"])
    if target is VOGNMethod:
        return node.get("structure", "map") == "dbsn"
    return isinstance(target, type) and issubclass(target, DBSN)


def check_backbone(cfg: DictConfig) -> None:
    """Refuse, before anything is built, what needs DBSN's cells on a network without them (a
    `Backbone`: ResNet-18, WideResNet, VGG16-BN; ``num_edges = 0``): a structure posterior (dbsn,
    fbn, vogn_fbn), and MC dropout on the cells' node outputs (its default placement)."""
    model = cfg.get("model") or {}
    for where, node in (("model", model), ("model.member", model.get("member"))):
        if not isinstance(node, DictConfig) or "_target_" not in node or not isinstance(node.get("net"), DictConfig):
            continue
        try:
            net_class = get_object(node.net["_target_"])
            samples_structures = _samples_structures(node)
        except Exception:  # noqa: BLE001 - a target that does not import: check_node names it
            continue
        if getattr(net_class, "num_edges", None) != 0:  # a class without structure says so: Backbone
            continue
        net = f"{where}.net ({net_class.__name__})"
        if samples_structures:
            raise ConfigError(
                f"{where}: {node['_target_'].rsplit('.', 1)[-1]} learns a distribution over the structure of DBSN's "
                f"cells, and {net} has no structure (num_edges = 0). Use model/net=structure_net, or on this network a "
                "method without structure: map, map_fixed, mc_dropout, bbb, deep_ensemble, batch_ensemble, rank1_bnn, "
                "packed_ensemble, mimo, sngp."
            )
        weights = node.get("weights")
        if (
            isinstance(weights, DictConfig)
            and str(weights.get("_target_", "")).endswith(".MCDropoutWeights")
            and weights.get("placement", "node_outputs") == "node_outputs"
        ):
            raise ConfigError(
                f"{where}.weights.placement=node_outputs puts dropout on the node outputs of DBSN's cells, and {net} "
                f"has none: set {where}.weights.placement=every_conv (dropout after every convolution; ResNet-18) or "
                f"existing (the network's own dropout layers, with rate {where}.weights.p: WideResNet's between the "
                "two convolutions of every block)."
            )


def check_sections(cfg: DictConfig, sections: Iterable[str] = ("data", "model", "trainer")) -> None:
    """Each section holds what its group files hold: `sections` a mapping with `_target_`, `logger`
    and `callbacks` a mapping of named objects (each with `_target_`, or null), `statistics` and
    `report` their settings only. A malformed file of a user's extension (a YAML list or string)
    is named here, not met later as an AttributeError."""
    from dbsn.runtime.origin import malformed

    for section in sections:
        if section in cfg:
            node = cfg._get_node(section)
            if not isinstance(node, DictConfig) or node._is_none() or "_target_" not in node:
                raise malformed(
                    cfg,
                    section,
                    None if node is None or node._is_none() else cfg[section],
                    "a mapping of settings with _target_ (the class it builds)",
                )
    model = cfg.get("model")
    for where, node in (
        ("model", model),
        ("model.member", model.get("member") if isinstance(model, DictConfig) else None),
    ):
        if not isinstance(node, DictConfig):
            continue
        for key in ("member", "net", "optim", "structure_optim", "weights", "prediction", "execution", "task"):
            value = node.get(key)
            if value is not None and not isinstance(value, DictConfig):
                raise malformed(
                    cfg, f"{where}.{key}", value, "a mapping of settings with _target_ (the class it builds)"
                )
        compile_node = (node.get("execution") or {}).get("compile")
        if compile_node is not None and not isinstance(compile_node, DictConfig):
            raise malformed(cfg, f"{where}.execution.compile", compile_node, "a mapping of settings")
    for section in ("logger", "callbacks"):
        node = cfg.get(section)
        if node is None:
            continue
        if not isinstance(node, DictConfig):
            raise malformed(cfg, section, node, "a mapping of named objects (name: {_target_: ..., ...})")
        for name, child in node.items():
            if child is not None and (not isinstance(child, DictConfig) or "_target_" not in child):
                raise malformed(
                    cfg, f"{section}.{name}", child, "a mapping with _target_ (the class it builds), or null (none)"
                )
    check_plain_sections(cfg, PLAIN_SECTIONS)


def check_plain_sections(cfg: DictConfig, sections: dict[str, set[str]]) -> None:
    """Refuse a section of plain settings that is not a mapping, or that holds a key it does not
    take, naming where the key came from."""
    from dbsn.runtime.origin import malformed, set_by

    for section, keys in sections.items():
        node = cfg.get(section)
        if node is None:
            continue
        if not isinstance(node, DictConfig):
            raise malformed(cfg, section, node, f"a mapping of {', '.join(sorted(keys))}")
        unknown = sorted(set(node) - keys)
        if unknown:
            raise ConfigError(
                f"{section}.{unknown[0]} is not a setting{set_by(cfg, f'{section}.{unknown[0]}')}: "
                f"{section} takes {', '.join(sorted(keys))}."
            )


def check_budget(cfg: DictConfig) -> None:
    """A field job's `budget` (conf/field/, conf/budget/): `recipe` one of `BUDGET_RECIPES`; the
    shared one needs the job's backbone among its `epochs` (the length it gives `trainer.max_epochs`),
    refused here in one line before anything reads the trainer's epochs."""
    node = cfg.get("budget")
    if not isinstance(node, DictConfig):
        return
    recipe = node.get("recipe")
    if recipe not in BUDGET_RECIPES:
        raise ConfigError(f"budget.recipe={recipe}: expected {' or '.join(BUDGET_RECIPES)} (budget=authors|shared).")
    if recipe != "shared":
        return
    backbone, epochs = node.get("backbone"), node.get("epochs")
    if backbone is None:
        raise ConfigError(
            "budget=shared gives every method on a backbone the same epochs, and this run names no "
            "backbone: it is for the field's jobs (field=<backbone>/<method>, e.g. "
            "experiment=cifar10_field field=resnet18/map_fixed budget=shared); set trainer.max_epochs "
            "for any other run."
        )
    if not isinstance(epochs, DictConfig) or backbone not in epochs:
        raise ConfigError(
            f"budget=shared has no epochs for the backbone {backbone}: add "
            f"budget.epochs.{backbone}=<epochs> (it has {', '.join(map(str, epochs or {})) or 'none'})."
        )


def check_evaluate_config(cfg: DictConfig) -> None:
    """evaluate.py's counterpart of `validate_config`'s first checks: a top-level key, or a key of
    a section of plain settings, that the evaluation does not read is refused, naming where it
    came from; the sections are what their group files hold."""
    from dbsn.runtime.origin import set_by

    for key in cfg.keys():
        if key not in EVALUATE_TOP_LEVEL_KEYS:
            raise ConfigError(
                f"Unknown top-level config key '{key}'{set_by(cfg, str(key))} for evaluate.py."
                f"{suggest(str(key), EVALUATE_TOP_LEVEL_KEYS)} Valid keys: "
                f"{', '.join(sorted(EVALUATE_TOP_LEVEL_KEYS))}."
            )
    check_sections(cfg, sections=("trainer",))
    check_plain_sections(cfg, EVALUATE_PLAIN_SECTIONS)


def validate_config(cfg: DictConfig, on_this_machine: bool = True) -> None:
    """Raise `ConfigError` for unknown top-level keys, keys no constructor accepts (naming where
    they came from), values of the wrong type or range, and settings the run would not apply.
    `on_this_machine=False` (a job only submitted from here, as to SLURM) leaves out what asks
    this machine's hardware."""
    from dbsn.runtime.origin import explain_unknown, set_by
    from dbsn.runtime.trainer_settings import check_devices, check_trainer_settings

    for key in cfg.keys():
        if key not in TOP_LEVEL_KEYS:
            raise ConfigError(
                f"Unknown top-level config key '{key}'{set_by(cfg, str(key))}.{suggest(str(key), TOP_LEVEL_KEYS)} "
                f"Valid keys: {', '.join(sorted(TOP_LEVEL_KEYS))}."
            )
    for key, allowed in TOP_LEVEL_TYPES.items():
        value = cfg.get(key)
        if key in cfg and not (value is None and None in allowed) and not any(_fits(value, t) for t in allowed if t):
            expected = " or ".join("null" if t is None else t.__name__ for t in allowed)
            raise ConfigError(f"{key}={value!r}: expected {expected}, got {type(value).__name__}.")
    check_sections(cfg)
    check_budget(cfg)  # before the trainer's epochs are read: the shared budget sets them
    check_cuda_graph(
        cfg, on_this_machine
    )  # before the keys are checked: it may drop speed=fast's setting from an ensemble
    check_backbone(cfg)  # first: the network's other keys would be refused as unknown otherwise (vogn_fbn)
    for section in ("data", "model", "trainer", "logger", "callbacks"):
        node = cfg.get(section)
        if isinstance(node, DictConfig):
            try:
                check_node(node, section)
            except UnknownKeysError as err:
                raise explain_unknown(err, cfg) from err
            _check_finite(node, section)
            _check_settings(node, section)
    check_trainer(cfg.get("trainer"))
    check_trainer_settings(cfg)
    check_weight_copies(cfg)
    if on_this_machine:
        check_devices(cfg)
        check_compile(cfg)
        check_channels_last(cfg)
        resolve_channels_last(cfg)
    check_sync_batchnorm(cfg)


def to_plain(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as plain dicts and lists (safe to store in a checkpoint)."""
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)  # type: ignore[return-value]
