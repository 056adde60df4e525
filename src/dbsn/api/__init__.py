"""dbsn's public surface: every base class and hook that docs/extending.md names, the statistics for
a user's own predictions (`dbsn.api.stats`) and the readers of a run folder, in one import.

| to add | subclass | its hooks |
|---|---|---|
| a method | `Method` (or `MAP`, `DBSN`) | `training_structures`, `prediction_structures`, the loss hook `data_loss` |
| a backbone | `Backbone` | `logits(x, groups)`; a last layer `classifier` |
| a dataset | `ImageClassificationDataModule` | `read_split`, `required_files`, `download_hint` |
| a post-hoc posterior | `PosthocPosterior` | `why_not`, `check`, `fit` |
| a calibrator | `Calibrator` | `fit_map`, `transform`, `settings`, `check` |
| an evaluation | `Evaluation` | `check(subject)`, `run(subject) -> Results` |
| an OOD score | `OODScore` | `reads`, `treatments`, `fit(Training)`, `score(Members)` |

`dbsn.testing` checks each kind of addition in one call.
"""

from dbsn.api.runs import load_run, load_run_predictions
from dbsn.api.stats import Estimate, ce2_interval, ce2_paired_test, compare, metric_intervals, seed_level, to_log_probs
from dbsn.data import ImageClassificationDataModule
from dbsn.evaluation.base import Evaluation, EvaluationError, Subject
from dbsn.evaluation.detection import Members, OODScore, ScoreUnavailable, Training
from dbsn.evaluation.ood import detection_metrics
from dbsn.evaluation.results import ConsoleTable, Results
from dbsn.evaluation.statistics import Statistics
from dbsn.methods import DBSN, MAP, Method, Prediction
from dbsn.methods.predictive import PredictedBatch
from dbsn.nets import Backbone, GroupBatchNorm2d, GroupedSequential
from dbsn.posthoc.base import PosthocError, PosthocPosterior, point_estimate_classifier
from dbsn.posthoc.calibrators import Calibrator, PosthocCalibration
from dbsn.posthoc.fixed import FixedStructurePosterior

#: the hooks a subclass of each door defines (the loss hook of a method: `data_loss`)
HOOKS = {
    "Method": ("training_structures", "prediction_structures", "data_loss", "structure_is_stochastic"),
    "Backbone": ("logits",),
    "ImageClassificationDataModule": ("read_split", "required_files", "download_hint"),
    "PosthocPosterior": ("why_not", "check", "fit"),
    "Calibrator": ("fit_map", "transform", "settings", "check"),
    "Evaluation": ("check", "run"),
    "OODScore": ("fit", "score"),
}

__all__ = [
    "DBSN",
    "HOOKS",
    "MAP",
    "Backbone",
    "Calibrator",
    "ConsoleTable",
    "Estimate",
    "Evaluation",
    "EvaluationError",
    "FixedStructurePosterior",
    "GroupBatchNorm2d",
    "GroupedSequential",
    "ImageClassificationDataModule",
    "Members",
    "Method",
    "OODScore",
    "PosthocCalibration",
    "PosthocError",
    "PosthocPosterior",
    "PredictedBatch",
    "Prediction",
    "Results",
    "ScoreUnavailable",
    "Statistics",
    "Subject",
    "Training",
    "ce2_interval",
    "ce2_paired_test",
    "compare",
    "detection_metrics",
    "load_run",
    "load_run_predictions",
    "metric_intervals",
    "point_estimate_classifier",
    "seed_level",
    "to_log_probs",
]
