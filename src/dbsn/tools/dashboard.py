"""The W&B dashboard as code: `python -m dbsn.tools.dashboard --entity E --project P [--group G] [--dry-run]`.

Builds a W&B report (with `wandb-workspaces`, W&B's own API for reports and workspaces) with the
sections Calibration, Intervals, Accuracy, Selective prediction, OOD, Conformal, Dataset shift,
Adversarial, Segmentation, Structure posterior and Training. Every
panel points at names our runs log (`dbsn.evaluation.tracking`); runs are grouped by `config.method`, so a
bar or curve is a method's mean over seeds with its standard deviation as the band. Sections
about training read the `train` runs (Calibration and Selective prediction also the post-hoc
evaluations); OOD, Dataset shift and Adversarial the `evaluate` runs (`evaluate.py
logger=wandb`); `--group` restricts both to one sweep.

`--dry-run` prints the specification (sections, panels and the metric names each one reads) as
JSON and saves nothing: no network, no W&B account. Without it the report is saved to the
project and its URL printed (needs `wandb login` or WANDB_API_KEY).

A bar reads a run's summary: for a metric whose summary is its best value (`dbsn.evaluation.tracking`),
the key is `<name>.min` or `<name>.max`. A table panel is a W&B custom chart over the table that
each run logged, one line or bar set per run.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from typing import Literal

from dbsn.data.shift import SEVERITIES
from dbsn.evaluation.detection import DetectionScores
from dbsn.evaluation.ood import OOD_SCORES
from dbsn.evaluation.shift import SHIFT_METRICS
from dbsn.evaluation.test_pass import SELECTIVE_SCORES
from dbsn.evaluation.tracking import EPOCH, summary_key
from dbsn.runtime.config import CONF_DIR

PanelKind = Literal["bar", "line", "table", "images"]
JobType = Literal["train", "evaluate"]
ATTACKS = ("fgsm", "bim")
DEFAULT_OOD_SETS = ("svhn",)  # the paper's OOD set for CIFAR models; digits: photos,noise
GLOBAL_STEP = "trainer/global_step"  # Lightning's x axis of the metrics logged at every training step


@dataclass(frozen=True)
class Panel:
    """One panel. `metrics`: what it plots (history keys for bar and line panels, the table's
    key for a table panel, image keys for an image panel); `x`: the x-axis metric of a line
    panel or the x column of a table panel; `y`: the y column of a table panel; `series`: the
    column that splits a table line chart into one line per value (W&B's `stroke`)."""

    kind: PanelKind
    title: str
    metrics: tuple[str, ...]
    x: str | None = None
    y: str | None = None
    chart: str | None = None  # table panels: the W&B Vega preset
    series: str | None = None

    def fields(self) -> dict[str, str]:
        """A table panel's Vega field mapping (preset field -> table column)."""
        if self.chart == "wandb/bar/v0":
            return {"label": self.x, "value": self.y}
        return {"x": self.x, "y": self.y, **({"stroke": self.series} if self.series else {})}

    def reads(self) -> list[tuple[str, str]]:
        """(key, what) pairs a run must log for this panel to show something: what is 'scalar',
        'table' or 'image'; a table's columns as ('<table>:<column>', 'column')."""
        if self.kind == "table":
            return [(self.metrics[0], "table"), *((f"{self.metrics[0]}:{c}", "column") for c in self.fields().values())]
        if self.kind == "images":
            return [(m, "image") for m in self.metrics]
        return [(m, "scalar") for m in (*((self.x,) if self.x else ()), *self.metrics)]


@dataclass(frozen=True)
class Section:
    """Panels over the runs of one job type in the group. `posthoc`: the section's panels also
    read the post-hoc evaluations (`evaluate.py posthoc=<name>`: evaluate runs with a `posthoc`
    in their config, method `<run's method>+<name>`), whose test pass is the only one those
    methods have."""

    name: str
    job_type: JobType
    note: str
    panels: tuple[Panel, ...] = field(default_factory=tuple)
    posthoc: bool = False


def posthoc_names() -> list[str]:
    """The post-hoc posteriors' names, as evaluate runs record them: each `conf/posthoc/` file's
    `name`, else the file's name."""
    import yaml

    from dbsn.extensions import config_dirs

    names = []
    for path in sorted(
        (path for folder in config_dirs() for path in (folder / "posthoc").glob("*.yaml")), key=lambda path: path.stem
    ):
        names.append(str((yaml.safe_load(path.read_text()) or {}).get("name") or path.stem))
    return names


def ood_score_names(extra: tuple[str, ...] = ()) -> list[str]:
    """The scores the OOD evaluation logs for a method with several members, in its table order:
    the predictive's, then the post-hoc scores its config builds by default (`ood_score=[...]` of
    conf/evaluations/ood.yaml) with their `_members` variants, then `extra` (your own)."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        chosen = compose("evaluate", ["ckpt_path=none", "evaluations=[ood]"]).ood_score
    names = [*OOD_SCORES, *DetectionScores({name: instantiate(node) for name, node in chosen.items()}).names(2)]
    return names + [name for name in extra if name not in names]


def _bar(title: str, *metrics: str) -> Panel:
    return Panel("bar", title, metrics)


def _per_epoch(title: str, *metrics: str) -> Panel:
    return Panel("line", title, metrics, x=EPOCH)


def _per_step(title: str, *metrics: str) -> Panel:
    return Panel("line", title, metrics, x=GLOBAL_STEP)


def _interval(title: str, metric: str) -> Panel:
    """A bar panel of a metric between its 95 % interval's ends: three bars per method (low, value,
    high; `<name>/ci_low`, `<name>/ci_high`), each the mean over the method's seeds with their std."""
    return Panel("bar", f"{title} [95 % interval: low, value, high]", (f"{metric}/ci_low", metric, f"{metric}/ci_high"))


#: the conformal evaluation's default levels (100·(1 − α)) and scores, as its metric names write them
CONFORMAL_LEVELS = ("90", "95")
CONFORMAL_SCORES = ("thr", "aps", "aps_randomized", "raps", "raps_randomized")

#: the metrics whose intervals the dashboard shows (label, name)
INTERVAL_METRICS = (
    ("Test error", "test/error"),
    ("Test NLL", "test/nll"),
    ("ECE", "test/ece"),
    ("Calibrated NLL", "test/calibrated/nll"),
    ("Calibrated ECE", "test/calibrated/ece"),
    ("AURC (max probability)", "selective/max_probability/aurc"),
)


def sections(ood_sets: tuple[str, ...] = DEFAULT_OOD_SETS, ood_scores: tuple[str, ...] = ()) -> list[Section]:
    """The dashboard's sections and panels (W&B-independent: the dry run prints this); `ood_scores`:
    OOD scores of your own beside the evaluation's (`ood_score_names`)."""
    scores = ood_score_names(ood_scores)
    ood = []
    for name in ood_sets:
        ood += [
            _bar(f"AUROC, {name} as OOD (↑)", *(f"ood/{name}/{score}/auroc" for score in scores)),
            _bar(f"FPR at 95 % TPR, {name} as OOD (↓)", *(f"ood/{name}/{score}/fpr95" for score in scores)),
            Panel(
                "table",
                f"Predictive entropy CDF on {name}: further right is better",
                (f"ood/{name}/entropy_cdf_ood",),
                x="entropy",
                y="cdf",
                chart="wandb/line/v0",
            ),
            Panel("images", f"Entropy CDFs, in-distribution vs {name}", (f"ood/{name}/entropy_cdf",)),
        ]
    groups = [
        _bar(f"AUROC, {group}-OOD mean (↑)", *(f"ood/{group}/{score}/auroc" for score in scores))
        for group in ("near", "far")
    ] + [
        _bar(f"FPR at 95 % TPR, {group}-OOD mean (↓)", *(f"ood/{group}/{score}/fpr95" for score in scores))
        for group in ("near", "far")
    ]
    return [
        Section(
            "Calibration",
            "train",
            "Test-set calibration of the Bayes ensemble (S members), per method: mean ± std "
            "over seeds; post-hoc Laplace and SWAG (their evaluate runs) beside the trained methods. Reliability bins "
            "overlay runs; the PNG diagrams are below.",
            (
                _bar("ECE, 15 bins (↓)", "test/ece"),
                _bar("Equal-mass ECE, 15 bins (↓)", "test/adaptive_ece"),
                _bar("Classwise ECE, 15 bins (↓)", "test/classwise_ece"),
                _bar("Test NLL, nats (↓)", "test/nll"),
                _bar("Brier score (↓)", "test/brier"),
                Panel(
                    "table",
                    "Reliability: accuracy against confidence (10 bins)",
                    ("test/reliability_bins",),
                    x="confidence",
                    y="accuracy",
                    chart="wandb/line/v0",
                ),
                _per_epoch("Validation ECE per epoch", "val/ece"),
                Panel("line", "ECE against the number of MC samples S", ("ablation/ece",), x="ablation/n_samples"),
                Panel("images", "Reliability diagrams", ("test/reliability_diagram",)),
            ),
            posthoc=True,
        ),
        Section(
            "Intervals",
            "train",
            "Each run's 95 % bootstrap interval over the test examples beside its value "
            "(`<name>/ci_low`, `<name>/ci_high`; dbsn.evaluation.statistics): a method's three bars are its low end, "
            "value and high end, each averaged over its seeds with the seeds' std as the band. The report's paired "
            "differences say which gaps between methods the test set resolves.",
            tuple(_interval(title, metric) for title, metric in INTERVAL_METRICS),
            posthoc=True,
        ),
        Section(
            "Accuracy",
            "train",
            "Test error and NLL of the Bayes ensemble, training curves, and the MC-sample "
            "ablation (the first s of the S test members).",
            (
                _bar("Test error (↓)", "test/error"),
                _per_epoch("Validation error per epoch", "val/error"),
                _per_epoch("Validation NLL per epoch", "val/nll"),
                _per_epoch("Training loss per epoch", "train/loss_epoch"),
                Panel(
                    "line", "Test error against the number of MC samples S", ("ablation/error",), x="ablation/n_samples"
                ),
                Panel("line", "Test NLL against the number of MC samples S", ("ablation/nll",), x="ablation/n_samples"),
            ),
        ),
        Section(
            "Selective prediction",
            "train",
            "Rejecting the least certain test predictions first, by each "
            "uncertainty score: area under the risk–coverage curve (AURC), its excess over the oracle's (E-AURC), "
            "the area under the generalised risk–coverage curve (AUGRC) and the error at 80 % coverage.",
            (
                _bar("AURC (↓)", *(f"selective/{score}/aurc" for score in SELECTIVE_SCORES)),
                _bar("Excess AURC (↓)", *(f"selective/{score}/eaurc" for score in SELECTIVE_SCORES)),
                _bar("AUGRC (↓)", *(f"selective/{score}/augrc" for score in SELECTIVE_SCORES)),
                _bar("Risk at 80 % coverage (↓)", *(f"selective/{score}/risk@80" for score in SELECTIVE_SCORES)),
                Panel(
                    "table",
                    "Risk against coverage, one line per score",
                    ("selective/risk_coverage_curve",),
                    x="coverage",
                    y="risk",
                    chart="wandb/line/v0",
                    series="score",
                ),
                Panel("images", "Risk–coverage curves", ("selective/risk_coverage",)),
            ),
            posthoc=True,
        ),
        Section(
            "OOD",
            "evaluate",
            "Out-of-distribution detection (evaluate.py evaluations=[ood] ood=[...]): OOD "
            "is the positive class; scores are the predictive's (entropy, mutual information, 1 − max probability) "
            "and OpenOOD's post-hoc ones (max-logit, energy, Mahalanobis, KNN, ViM, ODIN; `_members`: averaged over "
            "the members rather than computed on their mean). Near / far: the means over each group's sets "
            "(OpenOOD's for CIFAR, `evaluations.ood.groups=` otherwise).",
            tuple(groups + ood),
        ),
        Section(
            "Conformal",
            "evaluate",
            "Conformal prediction sets (evaluate.py evaluations=[conformal]) on the "
            "Bayes-ensemble predictive, calibrated on a split that never overlaps the evaluated images: empirical "
            "coverage (aim: at least the nominal level), mean set size (smaller is better at the same coverage), "
            "the lowest coverage over set-size strata (SSC) and over classes, and coverage under dataset shift.",
            tuple(
                panel
                for level in CONFORMAL_LEVELS
                for panel in (
                    _bar(
                        f"Coverage at {level} % (nominal {level} %)",
                        *(f"conformal/{level}/{score}/coverage" for score in CONFORMAL_SCORES),
                    ),
                    _bar(
                        f"Mean set size at {level} % (↓)",
                        *(f"conformal/{level}/{score}/size" for score in CONFORMAL_SCORES),
                    ),
                    _bar(
                        f"Size-stratified coverage at {level} % (↑)",
                        *(f"conformal/{level}/{score}/ssc" for score in CONFORMAL_SCORES),
                    ),
                    _bar(
                        f"Coverage under shift at {level} %, mean over corruptions and severities",
                        *(f"conformal/{level}/{score}/shift/coverage" for score in CONFORMAL_SCORES),
                    ),
                )
            ),
        ),
        Section(
            "Dataset shift",
            "evaluate",
            "Corrupted test sets (evaluate.py evaluations=[shift]; CIFAR-10-C / "
            "-100-C, or generated ones, which the run's `shift/generated` flags): means over the corruptions, "
            "overall and per severity, and Ovadia et al.'s box plots.",
            (
                *(
                    _bar(f"Mean {metric} over corruptions and severities (↓)", f"shift/mean/{metric}")
                    for metric in SHIFT_METRICS
                ),
                *(
                    _bar(
                        f"Mean {metric} per severity {SEVERITIES[0]}–{SEVERITIES[-1]} (↓)",
                        *(f"shift/mean/{severity}/{metric}" for severity in SEVERITIES),
                    )
                    for metric in ("error", "ece")
                ),
                Panel(
                    "table",
                    "Every corruption and severity: ECE against error",
                    ("shift/table",),
                    x="error",
                    y="ece",
                    chart="wandb/scatter/v0",
                ),
                Panel("images", "Box plots over corruptions, per severity", ("shift/boxplots",)),
            ),
        ),
        Section(
            "Adversarial",
            "evaluate",
            "FGSM and BIM against the posterior predictive (evaluate.py "
            "evaluations=[adversarial]), evaluated by members other than the attacked ones; ε in [0, 1] pixels.",
            (
                Panel(
                    "line",
                    "Accuracy against ε",
                    tuple(f"adversarial/{a}/accuracy" for a in ATTACKS),
                    x="adversarial/epsilon",
                ),
                Panel(
                    "line",
                    "Mean predictive entropy against ε (nats)",
                    tuple(f"adversarial/{a}/mean_entropy" for a in ATTACKS),
                    x="adversarial/epsilon",
                ),
                Panel("images", "Attack curves", ("adversarial/curves",)),
            ),
        ),
        Section(
            "Segmentation",
            "train",
            "CamVid: mean IoU over the 11 classes, global pixel accuracy, per-class IoU "
            "and pixel-wise uncertainty maps.",
            (
                _bar("Mean IoU (↑)", "test/miou"),
                _bar("Global pixel accuracy (↑)", "test/global_acc"),
                _per_epoch("Validation mean IoU per epoch", "val/miou"),
                Panel("table", "IoU per class", ("test/per_class_iou",), x="class", y="iou", chart="wandb/bar/v0"),
                Panel("images", "Uncertainty maps (input, truth, prediction, entropy, MI)", ("test/uncertainty_maps",)),
            ),
        ),
        Section(
            "Structure posterior",
            "train",
            "How q(α | θ) sharpens over training (DBSN, FBN, MAP's learned "
            "structure): edge entropy in nats, the share of distinct sampled structures, τ.",
            (
                _per_epoch("Mean edge entropy (nats)", "structure/edge_entropy_mean"),
                _per_epoch("Lowest edge entropy (nats)", "structure/edge_entropy_min"),
                _per_epoch("Distinct structures among samples", "structure/unique_fraction"),
                _per_epoch("Concrete temperature τ", "structure/tau"),
                Panel("images", "Per-edge operation probabilities", ("structure/heatmap",)),
            ),
        ),
        Section(
            "Training",
            "train",
            "What a method's training logs beside its loss (a panel is empty for the methods "
            "that do not log its metric): the weights' learning rate (Lightning's LR monitor, once an epoch; a "
            "snapshot ensemble's cosine cycles), the KL terms of the loss (DBSN's and FBN's over structures; over "
            "weights: Bayes-by-Backprop, FBN, the rank-1 BNN, whose KL weight is annealed from 0 to 1), and "
            "cSG-MCMC's sampler at every step: its cyclical step size, the injected noise's standard deviation "
            "(0 in each cycle's exploration stage) and the samples kept so far.",
            (
                _per_step(
                    "Learning rate of the weights' SGD (its first group where it has several)", "lr-SGD", "lr-SGD/pg1"
                ),
                _per_epoch("Structure KL per epoch (nats)", "train/kl_epoch"),
                _per_epoch("Weight KL per epoch (nats)", "train/weight_kl_epoch"),
                _per_epoch("KL weight per epoch (the rank-1 BNN's annealing)", "train/kl_scale_epoch"),
                _per_step("Sampler step size (cSG-MCMC)", "sampler/lr"),
                _per_step("Sampler noise standard deviation (cSG-MCMC)", "sampler/noise_std"),
                _per_step("Samples kept (cSG-MCMC)", "sampler/samples"),
            ),
        ),
    ]


def specification(
    ood_sets: tuple[str, ...] = DEFAULT_OOD_SETS, group: str | None = None, ood_scores: tuple[str, ...] = ()
) -> dict:
    """The dashboard as plain data (what `--dry-run` prints)."""
    return {
        "group": group,
        "groupby": "config.method",
        "ood_sets": list(ood_sets),
        "sections": [
            {**asdict(s), "panels": [{**asdict(p), "reads": p.reads()} for p in s.panels]}
            for s in sections(ood_sets, ood_scores)
        ],
    }


# ---------------------------------------------------------------------- W&B objects
def _wandb_panel(panel: Panel):
    import wandb_workspaces.reports.v2 as wr

    band = {"groupby_aggfunc": "mean", "groupby_rangefunc": "stddev"}
    if panel.kind == "bar":
        return wr.BarPlot(title=panel.title, metrics=[summary_key(m) for m in panel.metrics], orientation="v", **band)
    if panel.kind == "line":
        return wr.LinePlot(title=panel.title, x=panel.x, y=list(panel.metrics), **band)
    if panel.kind == "table":
        chart = wr.CustomChart.from_table(
            panel.metrics[0], chart_fields=panel.fields(), chart_strings={"title": panel.title}
        )
        chart.chart_name = panel.chart
        return chart
    return wr.MediaBrowser(title=panel.title, media_keys=list(panel.metrics), num_columns=3)


def build_report(
    entity: str,
    project: str,
    group: str | None = None,
    ood_sets: tuple[str, ...] = DEFAULT_OOD_SETS,
    title: str | None = None,
    posthoc: tuple[str, ...] = (),
    ood_scores: tuple[str, ...] = (),
):
    """The W&B report (a `wandb_workspaces.reports.v2.Report`, not saved); `posthoc`: names of
    post-hoc posteriors beyond conf/posthoc/'s (your own) whose evaluations the Calibration and
    Selective sections read too; `ood_scores`: OOD scores of your own the OOD section shows too."""
    import wandb_workspaces.reports.v2 as wr
    from wandb_workspaces import expr

    blocks = [
        wr.P(
            f"Runs of {'group ' + repr(group) if group else 'every group'} in {entity}/{project}, grouped by "
            "method (config.method): each bar and curve is the mean over seeds, the band ± one standard "
            "deviation. Made by `python -m dbsn.tools.dashboard`."
        )
    ]
    for section in sections(ood_sets, ood_scores):
        in_group = [expr.Metric("Group") == group] if group else []
        sets = [
            wr.Runset(
                entity=entity,
                project=project,
                name=f"{section.job_type} runs",
                groupby=["config.method"],
                filters=[expr.Metric("JobType") == section.job_type, *in_group],
            )
        ]
        if section.posthoc:
            sets.append(
                wr.Runset(
                    entity=entity,
                    project=project,
                    name="post-hoc evaluations",
                    groupby=["config.method"],
                    filters=[
                        expr.Metric("JobType") == "evaluate",
                        expr.Config("posthoc").isin(posthoc_names() + [n for n in posthoc if n not in posthoc_names()]),
                        *in_group,
                    ],
                )
            )
        blocks += [
            wr.H2(section.name),
            wr.P(section.note),
            wr.PanelGrid(runsets=sets, panels=[_wandb_panel(p) for p in section.panels]),
        ]
    return wr.Report(
        entity=entity,
        project=project,
        title=title or f"DBSN: {group or project}",
        description="Calibration, accuracy, selective prediction, near / far OOD detection, dataset "
        "shift, adversarial robustness, segmentation, the structure posterior and the "
        "training signals of dbsn runs.",
        blocks=blocks,
        width="fluid",
    )


def runsets(report) -> list[list]:
    """The run sets of `report`'s panel grids, a list per section."""
    import wandb_workspaces.reports.v2 as wr

    return [list(block.runsets) for block in report.blocks if isinstance(block, wr.PanelGrid)]


def panel_specs(report) -> list[dict]:
    """What W&B stores for each panel of `report`, made offline as `save` would send it (the run
    sets need the server: they look up the project's id)."""
    import wandb_workspaces.reports.v2 as wr

    return [
        panel._to_model().model_dump(by_alias=True, exclude_none=True)
        for block in report.blocks
        if isinstance(block, wr.PanelGrid)
        for panel in block.panels
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dbsn.tools.dashboard", description=__doc__.split("\n\n")[0])
    parser.add_argument("--entity", required=True, help="W&B entity (user or team) that owns the project")
    parser.add_argument("--project", required=True, help="W&B project the runs were logged to (logger.wandb.project)")
    parser.add_argument("--group", default=None, help="only this group (a sweep: '<task_name> <sweep folder>')")
    parser.add_argument(
        "--ood-sets",
        default=",".join(DEFAULT_OOD_SETS),
        help="OOD sets evaluated with evaluate.py ood=[...] (default: %(default)s; digits: photos,noise)",
    )
    parser.add_argument("--title", default=None, help="report title (default: 'DBSN: <group or project>')")
    parser.add_argument("--posthoc", default="", help="your own post-hoc posteriors' names (conf/posthoc/'s are read)")
    parser.add_argument(
        "--ood-scores",
        default="",
        help="your own OOD scores' names, as evaluations=[ood] logs them "
        "(the scores of conf/evaluations/ood.yaml are read)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the specification; save nothing")
    args = parser.parse_args(argv)
    if args.group is not None and ("'" in args.group or not args.group.strip()):
        parser.error(
            f"--group {args.group!r}: W&B's filter expressions cannot hold a quote or an empty name; "
            "give the group as W&B shows it (a sweep's is '<task_name> <sweep folder>')."
        )
    ood_sets = tuple(s.strip() for s in args.ood_sets.split(",") if s.strip())
    if not ood_sets:
        parser.error("--ood-sets: give at least one OOD set, e.g. --ood-sets svhn")
    posthoc = tuple(s.strip() for s in args.posthoc.split(",") if s.strip())
    ood_scores = tuple(s.strip() for s in args.ood_scores.split(",") if s.strip())
    report = build_report(
        args.entity, args.project, args.group, ood_sets, args.title, posthoc, ood_scores
    )  # validated offline
    if args.dry_run:
        json.dump(specification(ood_sets, args.group, ood_scores), sys.stdout, indent=2)
        print()
        return 0
    report.save()
    print(f"Saved the dashboard: {report.url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
