"""The command lines: `dbsn-train` / `python train.py`, `dbsn-evaluate` / `python evaluate.py`,
`dbsn-report`, `dbsn-compare`, `dbsn-bench` (console scripts in pyproject.toml).

Hydra parses the command line of train and evaluate (conf/train.yaml, conf/evaluate.yaml). Before
it does, `unchosen_option` looks for an option of something the command line did not choose,
which Hydra would refuse with a hint to add it with `+` (the wrong way: the option would then be
ignored): `ood.textures.download=true` without the set `textures` among `ood=`,
`evaluations.shift.generate=true` without `shift` among `evaluations=`, `posthoc.hessian=full`
without `posthoc=`. It says what to choose instead, in one line. `renamed_option` answers a
setting given under its old name (`model.n_samples=4`, now `model.prediction.n_samples`) with
the new one, where Hydra would say only "Could not override".
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import yaml

from dbsn import conf_choices
from dbsn.runtime.config import CONF_DIR
from dbsn.runtime.errors import one_line_errors

__all__ = [
    "RENAMED",
    "discard_refused_evaluation",
    "discard_refused_run",
    "evaluate",
    "renamed_option",
    "train",
    "unchosen_option",
]

_STARTED = time.time()  # before Hydra makes the run folder
#: What a start leaves in its run folder before it trains: Hydra's config and log, the resolved config,
#: run.json, the folder's lock and a SLURM job's facts. A folder holding only these, all made by this
#: process, was a refused start.
STARTUP_FILES = frozenset({".hydra", "train.log", "resolved_config.yaml", "slurm.json", "run.json", ".dbsn.lock"})


def _ood_sets(choice: str, conf_dir: Path | None) -> set[str]:
    """The sets an `ood=` choice selects: the set itself, or a bundle's sets (e.g. openood_cifar10)."""
    from dbsn.extensions import config_dirs

    paths = [folder / "ood" / f"{choice}.yaml" for folder in ([conf_dir] if conf_dir is not None else config_dirs())]
    path = next((path for path in paths if path.is_file()), None)
    config = (yaml.safe_load(path.read_text()) if path is not None else None) or {}
    bundle = [d for d in config.get("defaults", []) if isinstance(d, str) and d != "_self_"]
    return set(bundle) if bundle else {choice}


def _values(override) -> list[str]:
    """The chosen value(s) of a group override: one, a list, or a sweep's."""
    value = override.value()
    if override.is_sweep_override():
        return [str(v) for v in override.sweep_string_iterator()]
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    return [] if value is None else [str(value)]


def unchosen_option(arguments: Sequence[str], conf_dir: Path | None = None) -> str | None:
    """The one-line problem with the first option of an OOD set, an evaluation or a post-hoc
    posterior that `arguments` (evaluate.py's command line) do not choose; None if there is none.
    `conf_dir`: one config tree (default: dbsn's and every extension's)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType

    texts = [a for a in arguments if "=" in a and not a.startswith("-")]
    try:
        overrides = OverridesParser.create().parse_overrides(texts)
    except Exception:  # noqa: BLE001 - Hydra says what is wrong with a malformed override itself
        return None
    chosen: dict[str, set[str]] = {"ood": set(), "evaluations": set(), "posthoc": set()}
    for override in overrides:
        key = override.get_key_element().lstrip("+~")
        if key in chosen and override.type is not OverrideType.DEL:
            for value in _values(override):
                chosen[key] |= _ood_sets(value, conf_dir) if key == "ood" else {value}
    for override, text in zip(overrides, texts):
        if override.type is not OverrideType.CHANGE:  # +key / ++key / ~key: the user asked for it
            continue
        parts = override.get_key_element().split(".")
        setting = text.split("=", 1)[0]
        if parts[0] == "posthoc" and len(parts) > 1 and not chosen["posthoc"] - {"null"}:
            return (
                f"{setting} sets an option of a post-hoc posterior, and none is chosen: add posthoc=<name> "
                f"({', '.join(conf_choices('posthoc', conf_dir))})."
            )
        if parts[0] == "evaluations" and len(parts) > 2 and parts[1] not in chosen["evaluations"]:
            return (
                f"{setting} sets an option of the evaluation {parts[1]}, which is not chosen: add it to "
                f"evaluations=[...] (e.g. evaluations=[{','.join(sorted(chosen['evaluations'] | {parts[1]}))}])."
            )
        if parts[0] == "ood_score" and "ood" not in chosen["evaluations"]:
            return (
                f"{setting} sets the OOD evaluation's scores, and it is not chosen: add evaluations=[ood] "
                f"(e.g. evaluations=[{','.join(sorted(chosen['evaluations'] | {'ood'}))}] ood=<set>)."
            )
        if parts[0] == "ood" and len(parts) > 2 and parts[1] not in chosen["ood"]:
            sets = ",".join(sorted(chosen["ood"] | {parts[1]}))
            return (
                f"{setting} sets an option of the OOD set {parts[1]}, which is not chosen: add it to ood=[...] "
                f"(e.g. ood=[{sets}] with evaluations=[ood])."
            )
    return None


#: Settings that moved, old key -> new key (a key below an old one moves with it: model.compile.enabled).
RENAMED = {
    **{
        f"{model}.{old}": f"{model}.{new}"
        for model in ("model", "model.member")
        for old, new in (
            ("n_samples", "prediction.n_samples"),
            ("val_samples", "prediction.val_samples"),
            ("samples_per_forward", "prediction.samples_per_forward"),
            ("temperature_scaling", "prediction.temperature_scaling"),
            ("channels_last", "execution.channels_last"),
            ("compile", "execution.compile"),
        )
    },
    "model.vogn.num_samples": "model.vogn.draws_per_step",
    # the OOD evaluation's post-hoc scores are configs of their own (conf/ood_score/)
    "evaluations.ood.knn_k": "ood_score.knn.k",
    "evaluations.ood.vim_dim": "ood_score.vim.dim",
    "evaluations.ood.energy_temperature": "ood_score.energy.temperature",
    "evaluations.ood.odin": "ood_score.odin",
    # a calibrator's settings sit under posthoc.calibrator (conf/posthoc/<name>.yaml)
    **{
        f"posthoc.{key}": f"posthoc.calibrator.{key}"
        for key in ("bins", "floor", "map", "reg_lambda", "reg_mu", "folds", "max_iter", "seed")
    },
}


def renamed_option(arguments: Sequence[str]) -> str | None:
    """The one-line answer to the first option of `arguments` set under an old name (`RENAMED`),
    naming the new key with the user's value; None if there is none."""
    for argument in arguments:
        if "=" not in argument or argument.startswith("-"):
            continue
        key, value = argument.split("=", 1)
        bare = key.lstrip("+~")
        for old, new in RENAMED.items():
            if bare == old or bare.startswith(old + "."):
                moved = new + bare[len(old) :]
                return f"{bare} was renamed {moved}: use {key[: len(key) - len(bare)]}{moved}={value}"
    return None


def _hydra_main(config_name: str, task: Callable) -> None:
    """Run `task(cfg)` as Hydra's main of conf/<config_name>.yaml (evaluate: after `unchosen_option`)."""
    import hydra

    from dbsn.extensions import ExtensionError, extension_dirs

    try:
        extension_dirs()  # an extension that cannot be read is refused here, in one line, not inside Hydra
        problem = renamed_option(sys.argv[1:]) or (unchosen_option(sys.argv[1:]) if config_name == "evaluate" else None)
    except ExtensionError as error:
        problem = str(error)
    if problem:
        print(f"Error: {problem}", file=sys.stderr, flush=True)
        sys.exit(2)
    hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=config_name)(task)()


def _output_dir() -> Path:
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


def discard_refused_run(folder: Path, started: float = _STARTED, files: frozenset[str] = STARTUP_FILES) -> bool:
    """Remove the run folder of a start refused before it trained: one that holds nothing but
    `files` (`STARTUP_FILES`), every file made since `started` (so never a run being resumed, nor
    anything this process did not create). Returns whether it was removed."""
    folder = Path(folder)
    if not folder.is_dir() or not {p.name for p in folder.iterdir()} <= files:
        return False
    if any(p.stat().st_mtime < started - 1.0 for p in folder.rglob("*")):
        return False
    shutil.rmtree(folder)
    return True


@one_line_errors
def train_task(cfg) -> float | None:
    """The body of `train` (module level: a cluster launcher pickles it by reference). A start
    refused before it trained leaves no run folder behind (`discard_refused_run`): `make evaluate`
    and the report find only runs."""
    from dbsn.runtime.console import quiet_console
    from dbsn.runtime.errors import user_errors
    from dbsn.runtime.run import train as run_train

    quiet_console()
    try:
        return run_train(cfg, _output_dir()).get("test/error")  # what a sweep would optimise
    except user_errors():
        discard_refused_run(_output_dir())
        raise


#: What Hydra leaves in an evaluation's own folder before the evaluation writes: its config and the log.
EVALUATION_STARTUP_FILES = frozenset({".hydra", "evaluate.log"})


def discard_refused_evaluation(folder: Path, started: float = _STARTED) -> bool:
    """Remove the Hydra folder of a refused evaluation: one this process made (the folder itself
    is newer than `started`: never a `hydra.run.dir` that was there before) that holds nothing but
    `EVALUATION_STARTUP_FILES`. Returns whether it was removed."""
    folder = Path(folder)
    if not folder.is_dir() or folder.stat().st_mtime < started - 1.0:
        return False
    return discard_refused_run(folder, started, EVALUATION_STARTUP_FILES)


@one_line_errors
def evaluate_task(cfg) -> None:
    """The body of `evaluate`. A refused evaluation leaves no Hydra folder behind
    (`discard_refused_evaluation`)."""
    from dbsn.runtime.console import quiet_console
    from dbsn.runtime.errors import user_errors
    from dbsn.runtime.run import evaluate as run_evaluate

    quiet_console()
    try:
        run_evaluate(cfg, _output_dir())
    except user_errors():
        _close_log_files()
        discard_refused_evaluation(_output_dir())
        raise


def _close_log_files() -> None:
    """Take the root logger's file handlers (Hydra's evaluate.log) off and close them, so that their
    folder can go and no later message makes the file again."""
    import logging

    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler):
            root.removeHandler(handler)
            handler.close()


def train() -> None:
    """`dbsn-train ...` = `python train.py ...`: fit a method, test it, write metrics and plots."""
    _hydra_main("train", train_task)


def evaluate() -> None:
    """`dbsn-evaluate ...` = `python evaluate.py ...`: evaluate a checkpoint, a list of them, or a sweep."""
    _hydra_main("evaluate", evaluate_task)
