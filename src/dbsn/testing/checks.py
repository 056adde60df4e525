"""The checks of `dbsn.testing` (see the package docstring)."""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from dbsn.evaluation.base import Evaluation, Subject
from dbsn.evaluation.detection import READS, Members, OODScore, Training
from dbsn.evaluation.recorder import PredictionRecorder
from dbsn.evaluation.results import Results
from dbsn.methods import MAP, Method
from dbsn.methods.features import FeaturesUnavailable
from dbsn.metrics.uncertainty import uncertainty_decomposition
from dbsn.nets import StructureNet
from dbsn.posthoc.calibrators import Calibrator

__all__ = [
    "check_calibrator",
    "check_evaluation",
    "check_method",
    "check_ood_score",
    "make_subject",
    "miscalibrated",
    "tiny_net",
]

ATOL, RTOL = 1e-5, 1e-4


def tiny_net(num_classes: int = 10) -> StructureNet:
    """DBSN's cell network at a size that runs in milliseconds on a CPU (3 nodes, one cell per stage)."""
    return StructureNet(num_classes=num_classes, num_nodes=3, cells_per_stage=1, growth=4, stem_channels=8)


def _build_method(method, settings: dict) -> Method:
    if isinstance(method, Method):
        return method
    if isinstance(method, type):
        return method(tiny_net(), **{"dataset_size": 10, **settings})
    if isinstance(method, Mapping) or hasattr(method, "_target_"):
        from hydra.utils import instantiate

        return instantiate(method, **settings)
    raise TypeError(f"check_method takes a Method, its class or its config, got {type(method).__name__}")


def check_method(method, batch: int = 4, seed: int = 0, **settings) -> dict[str, bool]:
    """A method (an instance, its class, built on `tiny_net()` with `settings`, or a config with
    `_target_`): its training loss is a finite scalar with gradients for the weights; its members are
    normalised log-probabilities (S, b, C) whose average is its prediction; each member's linear head on
    its features gives its logits (what the OOD evaluation's feature scores read)."""
    torch.manual_seed(seed)
    method = _build_method(method, settings)
    x = torch.randn(batch, 3, 32, 32)
    y = torch.randint(method.num_classes, (batch,))
    method.train()
    out = method.training_loss(x, y)
    loss = out["loss"]
    assert loss.ndim == 0 and torch.isfinite(loss), f"training_loss: loss must be a finite scalar, got {loss}"
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in method.parameters()), (
        "training_loss: no gradient reaches the method's parameters"
    )
    method.zero_grad()
    method.eval()
    method.enable_test_noise()
    checked = {"loss": True, "members": False, "features": False}
    afresh = getattr(getattr(method, "weights", None), "stochastic", False)  # MC dropout draws at every call
    n = method.num_members
    with torch.no_grad(), method.fixed_members(n + 1):
        members = method.predict_members(x)
        assert members.shape == (n, batch, method.num_classes), (
            f"predict_members: expected {(n, batch, method.num_classes)}, got {tuple(members.shape)}"
        )
        torch.testing.assert_close(
            members.logsumexp(-1),
            torch.zeros(n, batch),
            atol=ATOL,
            rtol=0,
            msg="predict_members: each member's log-probabilities must sum to 1",
        )
        if not afresh:
            torch.testing.assert_close(
                method.predict_members(x),
                members,
                atol=ATOL,
                rtol=RTOL,
                msg="a method that draws its members afresh must hold them in fixed_members(n)",
            )
        if not afresh and not method.is_calibrated:
            ensemble = members.logsumexp(0) - math.log(n)
            torch.testing.assert_close(
                method.predict_log_probs(x),
                ensemble,
                atol=ATOL,
                rtol=RTOL,
                msg="predict_log_probs must be the members' average (the Bayes ensemble)",
            )
            checked["members"] = True
        try:
            logits, features = method.member_outputs(x, n + 1)
        except FeaturesUnavailable:
            return checked
        heads = method.member_heads(n + 1)
        assert logits.shape[:2] == (n + 1, batch) and features.shape[:2] == (n + 1, batch), (
            "member_outputs: logits and features must be (n, b, ...)"
        )
        if heads is not None:
            for s, (weight, bias) in enumerate(heads):
                torch.testing.assert_close(
                    F.linear(features[s], weight, bias),
                    logits[s],
                    atol=ATOL,
                    rtol=RTOL,
                    msg=f"member {s}: its linear head on its features must give its logits",
                )
        if not afresh:
            torch.testing.assert_close(
                logits[:n].log_softmax(-1),
                members,
                atol=ATOL,
                rtol=RTOL,
                msg="member_outputs' logits must be the members the prediction averages",
            )
        checked["features"] = True
    return checked


def _linear_members(n: int, classes: int, dim: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    heads = [(torch.randn(classes, dim, generator=g), torch.randn(classes, generator=g)) for _ in range(n)]
    project = torch.randn(3 * 8 * 8, dim, generator=g) / 8

    def features_of(images: Tensor) -> Tensor:
        return torch.tanh(F.adaptive_avg_pool2d(images, 8).flatten(1) @ project)

    def logits_of(images: Tensor, k: int, first: int = 0) -> Tensor:
        h = features_of(images)
        return torch.stack([F.linear(h, w, b) for w, b in heads[first : first + k]])

    return heads, features_of, logits_of


def check_ood_score(score: OODScore, members: int = 2, classes: int = 4, dim: int = 8, seed: int = 0) -> dict:
    """An OOD score on `members` linear members of random images: it declares what it reads and how the
    members enter, fits on a training split, and scores a batch with one finite number per image that
    does not depend on how the images are batched (as the evaluation may split them), in every treatment."""
    assert isinstance(score, OODScore), f"check_ood_score takes an OODScore, got {type(score).__name__}"
    assert score.reads in READS, f"reads must be one of {READS}, got {score.reads!r}"
    assert score.treatments and score.members in score.treatments, "treatments must name the score's `members`"
    g = torch.Generator().manual_seed(seed)
    heads, features_of, logits_of = _linear_members(members, classes, dim, seed)
    train_images, test_images = torch.rand(60, 3, 32, 32, generator=g), torch.rand(10, 3, 32, 32, generator=g)
    train_logits = logits_of(train_images, members)
    training = Training(
        train_logits,
        features_of(train_images).expand(members, -1, -1).clone(),
        torch.arange(len(train_images)) % classes,
        classes,
        heads,
        "Linear",
    )
    found = {}
    for treatment in score.treatments:
        each = score.with_members(treatment) if treatment != score.members else copy.deepcopy(score)
        each.fit(training)

        def scored(images: Tensor) -> Tensor:
            logits = logits_of(images, members)
            batch = Members(
                members, images, logits, features_of(images).expand(members, -1, -1).clone(), logits_of, members
            )
            return each.score(batch).detach()

        whole = scored(test_images)
        assert whole.shape == (len(test_images),), f"{treatment}: score must be (b,), got {tuple(whole.shape)}"
        assert torch.isfinite(whole).all(), f"{treatment}: score must be finite"
        parts = torch.cat([scored(test_images[:3]), scored(test_images[3:])])
        torch.testing.assert_close(
            parts,
            whole,
            atol=ATOL,
            rtol=RTOL,
            msg=f"{treatment}: a score must not depend on how the images are batched",
        )
        assert isinstance(each.params(), dict) and each.computed_on
        found[treatment] = whole
    return found


def miscalibrated(n: int, classes: int = 5, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Log-probabilities (n, classes) of a predictor distorted class by class (over- and under-confident,
    biased) and labels drawn from the true probabilities: what the calibrator tests fit on."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(6, classes, generator=torch.Generator().manual_seed(99)) * 0.8
    logits = torch.randn(n, 6, generator=g) @ weight
    y = torch.multinomial(logits.softmax(-1), 1, generator=g).squeeze(1)
    bad = logits.double() * torch.linspace(0.5, 4, classes, dtype=torch.float64) + torch.linspace(-1, 1, classes)
    return bad.log_softmax(-1), y


def check_calibrator(calibrator: Calibrator, classes: int = 5, seed: int = 0) -> dict:
    """A calibrator fitted on miscalibrated predictions: it has a name and its settings, gives
    normalised finite log-probabilities of the input's shape and dtype, keeps the argmax where it says it
    does, is deterministic, moves its state to the CPU, and records the run facts of its fit."""
    assert isinstance(calibrator, Calibrator), f"check_calibrator takes a Calibrator, got {type(calibrator).__name__}"
    assert calibrator.name, "a calibrator needs a `name` (its post-hoc posterior's name)"
    assert isinstance(calibrator.settings(), dict)
    fit_lp, fit_y = miscalibrated(400, classes, seed)
    test_lp, _ = miscalibrated(200, classes, seed + 1)
    fitted = copy.deepcopy(calibrator).fit(fit_lp, fit_y)
    again = copy.deepcopy(calibrator).fit(fit_lp, fit_y)
    out = fitted(test_lp)
    assert out.shape == test_lp.shape and out.dtype == test_lp.dtype, "calibrated log-probabilities: input's shape"
    assert torch.isfinite(out).all(), "calibrated log-probabilities must be finite"
    torch.testing.assert_close(
        out.logsumexp(-1),
        torch.zeros(len(out), dtype=out.dtype),
        atol=1e-6,
        rtol=0,
        msg="calibrated probabilities must sum to 1",
    )
    torch.testing.assert_close(again(test_lp), out, msg="fitting twice on the same data must give the same map")
    assert fitted(test_lp.float()).dtype == torch.float32, "float32 in, float32 out"
    torch.testing.assert_close(fitted(test_lp[None])[0], out, msg="a map of (..., C): leading dimensions pass through")
    if calibrator.preserves_argmax:
        assert torch.equal(out.argmax(-1), test_lp.argmax(-1)), "preserves_argmax: the predicted class must not move"
    facts = fitted.facts
    assert {"calibrator_nll_before", "calibrator_nll_after"} <= set(facts) and facts["calibrator"] == calibrator.name
    return facts


def make_subject(method: Method | None = None, n: int = 200, classes: int = 10, seed: int = 0) -> Subject:
    """What an evaluation looks at, with a test pass of `n` random test examples recorded as evaluate.py
    records one (ensemble log-probabilities, targets, uncertainty scores of S = 3 members)."""
    torch.manual_seed(seed)
    method = method if method is not None else MAP(tiny_net(classes), learn_structure=False, dataset_size=10)
    g = torch.Generator().manual_seed(seed)
    member_log_probs = (2 * torch.randn(3, n, classes, generator=g)).log_softmax(-1)
    recorded = PredictionRecorder()
    recorded.scores = uncertainty_decomposition(member_log_probs)
    recorded.log_probs = member_log_probs.logsumexp(0) - math.log(3)
    recorded.targets = torch.randint(classes, (n,), generator=g)
    return Subject(method.eval(), None, "a check", torch.device("cpu"), progress=False, test_pass=recorded)


def check_evaluation(evaluation: Evaluation, subject: Subject | None = None) -> Results:
    """An evaluation on a subject (default `make_subject()`): its `check` accepts it before the test pass,
    its `run` returns `Results` whose numbers are finite and named `<name>/...`, whose intervals belong to
    those numbers, and whose files have a kind the evaluation folder knows (.json, .csv, .npz, .txt, .png)."""
    assert isinstance(evaluation, Evaluation), f"check_evaluation takes an Evaluation, got {type(evaluation).__name__}"
    assert evaluation.name, "an evaluation needs a `name` (its folder and the first part of its metric names)"
    subject = subject if subject is not None else make_subject()
    test_pass, subject.test_pass = subject.test_pass, None
    evaluation.check(subject)  # before the test pass, as evaluate.py calls it
    subject.test_pass = test_pass
    results = evaluation.run(subject)
    assert isinstance(results, Results), f"run must return Results, got {type(results).__name__}"
    for key, value in results.metrics.items():
        assert key.startswith(f"{evaluation.name}/"), f"metric {key!r} must start with {evaluation.name}/"
        assert math.isfinite(float(value)), f"metric {key!r} is not finite: {value}"
    assert set(results.intervals) <= set(results.metrics), "intervals must be of the evaluation's own numbers"
    for path in results.files:
        assert not path.startswith("/") and path.rsplit(".", 1)[-1] in ("json", "csv", "npz", "txt", "png"), path
    return results
