"""Which runs a row of the report pools: only runs that differ in their seed alone.

A run's *setting* is its resolved config, flattened to dotted keys, without its seed and without
the keys that do not change what was trained or tested (`NOT_THE_RUN`: output paths, loggers,
progress bars, where the data lives, how many workers load it, memory and speed knobs), plus what
its metrics.json says was tested: S (`n_samples`), the epochs trained and, for an evaluation (a
post-hoc posterior's run), the evaluation's own settings (`settings`: the posterior's config,
`test_tau`, ...). Keys that not every run of a method records (configs of different versions) are
not compared.

The finished runs of one method on one dataset are split by setting. The setting most runs share
(counted in seeds) keeps the method's name; every other setting is a row of its own, named by what
differs from it: `dbsn (trainer.max_epochs=3)`, `dbsn (trainer.limit_test_batches=1, S=10)`. Where
no setting has more runs than every other, the rows are named by what differs from the value of
each key that more runs share than any other (the setting that has all of them, if any, keeps the
name; a key whose values tie is named in every row). A post-hoc
posterior's run is named first by its training run's row, then by what differs between the
evaluations (`map+laplace (posthoc.hessian=full)`). Runs of one row with the same seed are
repeats, not seeds: the newest is kept, the others are listed as repeats (`REPEAT`).
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

from dbsn.evaluation.report.collect import Run
from dbsn.evaluation.runs import OUTSIDE_THE_RUN, flatten_config, under

__all__ = ["NOT_THE_RUN", "REPEAT", "pool_runs", "row_name", "setting_of"]

#: status of a run left out because another run of its row has its seed and its setting
REPEAT = "repeat"

#: config keys (and everything below them) that do not change what a run trained or tested
NOT_THE_RUN = (
    "seed",
    *OUTSIDE_THE_RUN,
    "callbacks.model_checkpoint",
    "callbacks.lr_monitor",
    "callbacks.progress_bar",
    "callbacks.structure_posterior",
    "callbacks.timer.verbose",
    "callbacks.timer.interval",
    "trainer.barebones",
    "trainer.num_sanity_val_steps",
    "model.prediction.samples_per_forward",
    "model.prediction.rows_per_forward",
    "model.train_samples_per_forward",
    "model.bn_recalibration.batch_size",
    "model.prediction.n_samples",  # S as tested is metrics.json's (`S`)
    "posthoc",  # a post-hoc posterior's name is in its method's name; its settings are its evaluation's
)
#: what metrics.json says was tested, after the config's keys; a fact is named only where the key that sets it is not
FACTS = {"S": (), "epochs": ("trainer.max_epochs",)}
#: evaluation settings that repeat a fact
_SAME_AS_FACT = ("posthoc.n_samples",)
#: most keys a row's name shows (the pooling table shows every one)
NAME_KEYS = 3


def _ignored(key: str, ignored=NOT_THE_RUN) -> bool:
    return any(under(key, p) for p in ignored)


def _text(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        return json.dumps(value, separators=(",", ":"), sort_keys=True)
    return str(value)


def setting_of(run: Run) -> dict[str, str]:
    """The run's training setting: its config's keys that change the run, then S and the epochs
    trained (module docstring); values as text."""
    setting = {k: _text(v) for k, v in flatten_config(run.config).items() if not _ignored(k)}
    if run.n_samples is not None:
        setting["S"] = _text(run.n_samples)
    if run.epochs is not None:
        setting["epochs"] = _text(run.epochs)
    return setting


def _evaluation_setting(run: Run) -> dict[str, str]:
    """A post-hoc posterior's run's evaluation: S and the evaluation's own settings."""
    setting = {
        k: _text(v) for k, v in flatten_config(run.evaluation_settings).items() if not _ignored(k, _SAME_AS_FACT)
    }
    if run.n_samples is not None:
        setting["S"] = _text(run.n_samples)
    return setting


def _seeds(runs: list[Run]) -> int:
    """How many seeds `runs` have (an unseeded run counts as one of its own)."""
    return len({("seed", r.seed) if r.seed is not None else ("run", id(r)) for r in runs})


def _differences(setting: dict[str, str], reference: dict[str, str]) -> list[str]:
    """`key=value` of `setting` where it differs from `reference`, the config's keys sorted, then the
    facts; a fact only where the key that sets it does not differ too."""
    keys = [k for k in setting if reference.get(k) != setting[k]]
    keys = sorted((k for k in keys if k not in FACTS), key=str) + [k for k in FACTS if k in keys]
    keys = [k for k in keys if k not in FACTS or not set(FACTS[k]) & set(keys)]
    return [f"{k}={setting[k]}" for k in keys]


def _labels(runs: list[Run], setting) -> tuple[dict[int, list[str]], bool]:
    """Each run's differences (by `id`) from the group's reference setting, and whether one setting
    has more runs (in seeds) than every other. The reference is that setting; where there is none,
    the value of each key that more runs share than any other value (none for a tie: every row
    names its own)."""
    settings = {id(r): setting(r) for r in runs}
    common = set.intersection(*(set(s) for s in settings.values()))
    settings = {i: {k: v for k, v in s.items() if k in common} for i, s in settings.items()}
    classes: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        classes[json.dumps(settings[id(run)], sort_keys=True)].append(run)
    if len(classes) == 1:
        return {id(r): [] for r in runs}, True
    sizes = {key: _seeds(members) for key, members in classes.items()}
    ranked = sorted(sizes.values(), reverse=True)
    if ranked[0] > ranked[1]:
        reference = json.loads(max(sizes, key=sizes.get))
    else:
        reference = {}
        for key in sorted(common):
            weights: Counter = Counter()
            for found, size in sizes.items():
                weights[json.loads(found)[key]] += size
            (value, most), *others = weights.most_common()
            if not others or others[0][1] < most:  # a tie: no value is the reference's, every row names its own
                reference[key] = value
    return {id(r): _differences(settings[id(r)], reference) for r in runs}, ranked[0] > ranked[1]


def row_name(method: str, differences: list[str]) -> str:
    """`method (a=1, b=2, c=3, +2 more)`: a row named by what differs (at most `NAME_KEYS` keys); `method` for none."""
    if not differences:
        return method
    shown = differences[:NAME_KEYS] + (
        [f"+{len(differences) - NAME_KEYS} more"] if len(differences) > NAME_KEYS else []
    )
    return f"{method} ({', '.join(shown)})"


def _newest(run: Run) -> tuple:
    metrics = Path(run.path) / "metrics.json"
    return (metrics.stat().st_mtime if metrics.is_file() else 0.0, str(run.path))


def pool_runs(runs: list[Run]) -> list[str]:
    """Name every finished run's row (`Run.method` gains the differences of its setting, kept in
    `Run.differences`; `Run.base_method` keeps the method) and mark repeats (`REPEAT`); returns
    the report's notes about them."""
    ok = [r for r in runs if r.status == "ok"]
    notes: list[str] = []
    by_path = {Path(r.path): r for r in runs}
    trained = defaultdict(list)
    for run in ok:
        run.base_method = run.method
        if Path(run.path).parent.name != "posthoc":
            trained[run.method, run.dataset].append(run)
    for (method, dataset), group in trained.items():
        labels, most = _labels(group, setting_of)
        for run in group:
            run.differences = labels[id(run)]
        if not most:
            notes.append(
                f"{method} on {dataset}: no setting has more of its runs than every other, so its rows are "
                "named by what differs from the value of each key that most of its runs share"
            )
    evaluated = defaultdict(list)
    for run in ok:
        if Path(run.path).parent.name == "posthoc":
            parent = by_path.get(Path(run.path).parent.parent)
            inherited = tuple(parent.differences) if parent is not None and parent.status == "ok" else None
            evaluated[run.method, run.dataset, inherited].append(run)
    for (method, dataset, inherited), group in evaluated.items():

        def setting(run: Run, known=inherited is not None) -> dict[str, str]:
            return _evaluation_setting(run) if known else {**setting_of(run), **_evaluation_setting(run)}

        labels, _ = _labels(group, setting)
        for run in group:
            run.evaluation_differences = labels[id(run)]
            run.differences = [*(inherited or ()), *labels[id(run)]]
    for run in ok:
        run.method = row_name(run.base_method, run.differences)
    _distinct_names(ok)
    notes += _mark_repeats(ok)
    return notes


def _distinct_names(runs: list[Run]) -> None:
    """Rows whose shortened names collide get a number: `dbsn (a=1, b=2, c=3, +2 more) #2`."""
    names = defaultdict(list)
    for run in runs:
        names[run.method, run.dataset].append(run)
    for (name, _), group in names.items():
        kinds = list(dict.fromkeys(tuple(r.differences) for r in group))
        if len(kinds) > 1:
            for run in group:
                index = kinds.index(tuple(run.differences))
                run.method = name if index == 0 else f"{name} #{index + 1}"


def _mark_repeats(runs: list[Run]) -> list[str]:
    """Runs of one row with one seed: all but the newest become `REPEAT` (a repeat is not a seed)."""
    notes = []
    cells = defaultdict(list)
    for run in runs:
        if run.seed is not None:
            cells[run.method, run.dataset, str(run.seed)].append(run)
    for (method, dataset, seed), group in cells.items():
        if len(group) < 2:
            continue
        kept, *others = sorted(group, key=_newest, reverse=True)
        for run in others:
            run.status = REPEAT
            run.note = (
                f"a repeat of {kept.path} (the same setting and seed {seed}): a repeat is not another seed, "
                "so the tables use the newest run alone"
            )
        notes.append(
            f"{method} on {dataset}, seed {seed}: {len(group)} runs with the same setting and seed are "
            f"repeats, not seeds; the tables use the newest ({kept.path}), the others are listed as repeats"
        )
    return notes
