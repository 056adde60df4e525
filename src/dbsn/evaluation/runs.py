"""What a run folder holds and what its run is called: the runtime writes run folders, the
evaluations and the report read them, so the names live here, below both.

A run folder (`outputs/<task>/runs/<time>/`, or `<sweep>/<job>/` in a multirun) holds the files named below.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from dbsn.methods.registry import builds_backbone, field_backbones
from dbsn.methods.registry import method_name as infer_method

CONFIG_FILE = "resolved_config.yaml"  # the resolved run config; DDP children and the report read it
CHECKPOINT_DIR = "checkpoints"
LAST_CHECKPOINT = "last.ckpt"  # written atomically at every epoch end (and on preemption)
WANDB_ID_FILE = "wandb_id"  # the W&B run id, kept so a resumed run continues the same W&B run
SLURM_FILE = "slurm.json"  # the SLURM job that ran (or last resumed) this run: ids, node list, logs
METRICS_FILE = "metrics.json"  # the test pass's metrics and the run's facts (train and evaluate write it)
CALIBRATED_CHECKPOINT = "calibrated.ckpt"  # the model after `temperature_scaling` was fitted
RUN_FILE = "run.json"  # the run's identity and state: run_id, status, config digest, history
RUN_ID_KEY = "dbsn_run_id"  # the run id inside every checkpoint the run writes
#: a run's `status` in RUN_FILE: training (or holding the folder), done, stopped by an error, stopped by a signal
RUN_STATUSES = ("running", "finished", "failed", "interrupted")


#: Config keys (and every key below them) that change neither what a run trains nor what it tests:
#: where its files go and how progress is shown, where its data is read from and how, and knobs of
#: speed and memory that compute the same numbers. A resume may change them freely
#: (`dbsn.runtime.resume.FREE` adds the test-time settings), the report pools runs that differ in
#: them (`dbsn.evaluation.report.pooling.NOT_THE_RUN` adds the seed), and `dbsn-compare --resume`
#: keeps a finished method's run that differs only in them.
OUTSIDE_THE_RUN = (
    "paths",
    "hydra",
    "logger",
    "task_name",
    "tags",
    "resume",
    "resume_changes",
    "ckpt_path",
    "test",
    "report",
    "statistics",
    "data.root",
    "data.num_workers",
    "data.pin_memory",
    "data.download",
    "data.on_device",
    "data.eval_batch_size",
    "trainer.default_root_dir",
    "trainer.enable_checkpointing",
    "trainer.enable_progress_bar",
    "trainer.enable_model_summary",
    "trainer.log_every_n_steps",
    "trainer.profiler",
    "trainer.accelerator",
    "trainer.benchmark",
    "trainer.deterministic",
    "trainer.detect_anomaly",
    "trainer.enable_autolog_hparams",
    "trainer.model_registry",
    "model.execution",
    "model.member.execution",
)


def under(key: str, prefix: str) -> bool:
    """Whether the dotted `key` is `prefix` or a key below it."""
    return key == prefix or key.startswith(prefix + ".")


def flatten_config(node, prefix: str = "") -> dict:
    """A config as dotted keys -> values; lists and empty mappings are values."""
    if isinstance(node, dict) and (node or not prefix):
        out: dict = {}
        for key, value in node.items():
            out.update(flatten_config(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: node}


def last_checkpoint(run_dir: str | Path) -> Path:
    """`<run_dir>/checkpoints/last.ckpt`: what a resumed or requeued run continues from."""
    return Path(run_dir) / CHECKPOINT_DIR / LAST_CHECKPOINT


def run_checkpoint(run_dir: str | Path) -> Path | None:
    """The final model of a training run: the temperature-calibrated one if there is one."""
    for name in (CALIBRATED_CHECKPOINT, LAST_CHECKPOINT):
        if (Path(run_dir) / CHECKPOINT_DIR / name).is_file():
            return Path(run_dir) / CHECKPOINT_DIR / name
    return None


def read_run_record(run_dir: str | Path) -> dict | None:
    """The run's identity record (`RUN_FILE`: `run_id`, `status`, `config_sha256`, `history`), or
    None for a folder without one (not a run, or a run written before runs named themselves)."""
    import json

    path = Path(run_dir) / RUN_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("run_id"), str) else None


def load_run_config(run_dir: str | Path) -> dict:
    """The run's resolved config (`resolved_config.yaml`), unresolved interpolations kept."""
    return yaml.safe_load((Path(run_dir) / CONFIG_FILE).read_text()) or {}


# ---------------------------------------------------------------------- what a run is called
def hydra_choices(run_dir: str | Path) -> dict:
    """The config-group choices Hydra recorded for the run (`model: dbsn`, `data: cifar10`, ...);
    {} for a run composed without Hydra's runtime."""
    path = Path(run_dir) / ".hydra" / "hydra.yaml"
    hydra_cfg = ((yaml.safe_load(path.read_text()) if path.is_file() else None) or {}).get("hydra") or {}
    return (hydra_cfg.get("runtime") or {}).get("choices") or {}


def _short(target) -> str:
    return str(target or "?").rsplit(".", 1)[-1]


def backbone_of(model: dict, choices: dict | None = None) -> str | None:
    """The field backbone (config name, `dbsn.methods.registry.field_backbones`) a run's model
    uses, from Hydra's choices or the config; None for any other network. A run on one of them is
    named `<method>@<backbone>` (`mimo@wrn28_10`), so that a method on DBSN's cell network and on
    a residual network are different rows of every table; the cell network (and a method's own
    network, e.g. NEK-FAC's VGG) adds nothing. Where the node's network is a class that is not a
    `Backbone`, that class decides (None) before any choice is read."""
    net = model.get("net") or (model.get("member") or {}).get("net") or {}
    if net.get("_target_") and builds_backbone(net["_target_"]) is False:
        return None  # a network with structure: no method's config is composed (that costs seconds a process on a CPU: docs/performance.md)
    choices, backbones = choices or {}, field_backbones()
    for key in ("model/net", "model/net@model.member.net"):  # the second: a deep ensemble's members'
        if choices.get(key) in backbones:
            return choices[key]
    return {cls: name for name, cls in backbones.items()}.get(_short(net.get("_target_")))


def infer_dataset(data: dict) -> str:
    return _short(data.get("_target_")).removesuffix("DataModule").lower()


def method_and_dataset(run_dir: str | Path, config: dict) -> tuple[str, str]:
    """The run's method and dataset by their config names: Hydra's choices, else from the config."""
    if config.get("posthoc"):  # <run>/posthoc/<name>: a post-hoc posterior of the run, method <run's method>+<name>
        run = Path(run_dir).parent.parent
        base, dataset = method_and_dataset(
            run if (run / CONFIG_FILE).is_file() else Path(run_dir) / "none",
            {k: v for k, v in config.items() if k != "posthoc"},
        )
        return f"{base}+{config['posthoc']}", dataset
    choices = hydra_choices(run_dir)
    model = config.get("model") or {}
    method = choices.get("model") or infer_method(model)
    backbone = backbone_of(model, choices)
    return (
        f"{method}@{backbone}" if backbone else method,
        choices.get("data") or infer_dataset(config.get("data") or {}),
    )


def sweep_of(run_dir: str | Path) -> Path | None:
    """The multirun folder a job's run folder belongs to (it holds Hydra's multirun.yaml), else None."""
    parent = Path(run_dir).absolute().parent
    return parent if (parent / "multirun.yaml").is_file() else None
