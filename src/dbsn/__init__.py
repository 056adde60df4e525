"""dbsn: Deep Bayesian Structure Networks on PyTorch Lightning + Hydra."""

from pathlib import Path

from dbsn.extensions import DBSN_CONF_DIR, config_dirs

#: The one source of the version: pyproject.toml reads it, checkpoints and metrics.json record it.
__version__ = "0.1.0"

#: The Hydra config tree, shipped inside the package (`dbsn/conf/`, also `pkg://dbsn.conf` for Hydra), so a
#: checkout and an installed wheel read the same files: the method registry reads its model/ group, entry
#: points and tools compose configs from it.
CONF_DIR = DBSN_CONF_DIR


def conf_choices(group: str, conf_dir: Path | None = None) -> list[str]:
    """The options of a config group (`posthoc`, `evaluations`, `ood`, `model`...), sorted: of
    `conf_dir` alone, or by default of dbsn's conf/ and every extension's (`dbsn.extensions`)."""
    folders = [conf_dir] if conf_dir is not None else config_dirs()
    return sorted({path.stem for folder in folders for path in (Path(folder) / group).glob("*.yaml")})
