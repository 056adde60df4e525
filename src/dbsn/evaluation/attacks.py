"""Adversarial robustness of the posterior predictive: FGSM and BIM against ε.

Protocol (Deep Bayesian Structure Networks, ICLR 2021). Images live in pixel space
``[0, 1]`` and the perturbation size is ``ε ∈ {0, 0.01, ..., 0.1}`` (:data:`PAPER_EPSILONS`).

* FGSM (Goodfellow et al., 2015): ``x_adv = clip_[0,1](x + ε sign(∇_x L(x)))``.
* BIM (Kurakin et al., 2017): ``steps`` (3) steps of size ``α = ε / steps``,
  ``x_{t+1} = clip_[0,1](clip_{x,ε}(x_t + α sign(∇_x L(x_t))))``, where ``clip_{x,ε}``
  projects onto the L∞ ball of radius ε around the clean image ``x``.

The loss ``L`` is the mean NLL of the *posterior predictive*,
``L(x) = -1/N sum_i log( 1/S sum_s p(y_i | x_i, w_s) )`` with ``S = 30`` Monte Carlo
samples: the log of the averaged probabilities, not the average of per-sample NLLs
(:func:`predictive_nll`). Gradients are taken with :func:`torch.autograd.grad` with
respect to the input only, so the ``.grad`` of the model parameters is never touched.

The attacked inputs are evaluated with fresh samples; :func:`adversarial_evaluation` reports
per attack and ε the accuracy (argmax of the averaged prediction, first on ties) and the
mean predictive entropy ``H[p] = -sum_c p_c log p_c`` of the averaged prediction, in nats,
with ``0 log 0 = 0``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext

import torch
from matplotlib.figure import Figure
from torch import Tensor
from torch.nn import functional as F

from dbsn.evaluation.progress import progress as progress_bar

__all__ = [
    "ATTACKS",
    "ExampleChunkedNLL",
    "PAPER_EPSILONS",
    "adversarial_evaluation",
    "adversarial_figure",
    "bim",
    "fgsm",
    "predictive_nll",
]

PAPER_EPSILONS = tuple(round(0.01 * i, 2) for i in range(11))
RESULT_COLUMNS = ("attack", "epsilon", "accuracy", "mean_entropy", "n_examples")

LossFn = Callable[[Tensor], Tensor]


def _normal_tensor(t: Tensor) -> Tensor:
    """``t`` itself, or a normal (non-inference) copy of it if it is an inference tensor."""
    if not t.is_inference():
        return t
    with torch.inference_mode(False):
        return t.clone()


def _loss_gradient_sign(loss_fn: LossFn, x: Tensor) -> Tensor:
    """``sign(∇_x loss_fn(x))``, taken on a detached copy of ``x`` even under no_grad/inference mode
    (by the loss's own ``gradient`` where it has one: :class:`ExampleChunkedNLL`)."""
    with torch.inference_mode(False), torch.enable_grad():
        x = x.detach().clone()
        if hasattr(loss_fn, "gradient"):
            return loss_fn.gradient(x).sign()
        (grad,) = torch.autograd.grad(loss_fn(x.requires_grad_(True)), x)
    return grad.sign()


def fgsm(loss_fn: LossFn, x: Tensor, epsilon: float, clip: tuple[float, float] = (0.0, 1.0)) -> Tensor:
    """Fast gradient sign method: ``clip(x + ε sign(∇_x loss_fn(x)))``, detached.

    ``loss_fn`` maps a pixel-space batch to a scalar loss. ``ε = 0`` returns ``x`` as it is,
    without calling ``loss_fn``.
    """
    if epsilon == 0:
        return x.detach()
    return (x + epsilon * _loss_gradient_sign(loss_fn, x)).clamp(*clip).detach()


def bim(
    loss_fn: LossFn,
    x: Tensor,
    epsilon: float,
    steps: int = 3,
    step_size: float | None = None,
    clip: tuple[float, float] = (0.0, 1.0),
) -> Tensor:
    """Basic iterative method: ``steps`` signed-gradient steps of ``step_size`` (default ``ε / steps``),
    each followed by projection onto the L∞ ε-ball around ``x`` and onto ``clip``; detached.

    With ``steps = 1`` and ``step_size = ε`` this is :func:`fgsm`. ``ε = 0`` returns ``x``.
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if epsilon == 0:
        return x.detach()
    step_size = epsilon / steps if step_size is None else step_size
    x = x.detach()
    lower, upper = x - epsilon, x + epsilon
    x_adv = x
    for _ in range(steps):
        x_adv = x_adv + step_size * _loss_gradient_sign(loss_fn, x_adv)
        x_adv = torch.minimum(torch.maximum(x_adv, lower), upper).clamp(*clip)
    return x_adv.detach()


ATTACKS: dict[str, Callable[..., Tensor]] = {"fgsm": fgsm, "bim": bim}


def predictive_nll(predict_log_probs: LossFn, y: Tensor) -> LossFn:
    """The attack loss ``x -> -1/N sum_i log p(y_i | x_i)``.

    ``predict_log_probs`` gives the log-probabilities (N, C) of the posterior predictive,
    i.e. the log of the probabilities averaged over Monte Carlo samples, so this is the NLL
    of the averaged prediction, not the mean of the per-sample NLLs.
    """
    y = _normal_tensor(y)  # nll_loss saves the targets for backward: no inference tensors
    return lambda x: F.nll_loss(predict_log_probs(x), y)


class ExampleChunkedNLL:
    """The predictive NLL ``L(x) = -1/N Σ_i log p(y_i | x_i)`` of ``predict_log_probs`` (as
    :func:`predictive_nll`), whose input gradient is taken ``chunk`` examples at a time: each
    example's gradient is its own (the members are the same functions for every example of a
    call), so the autograd graph holds the members' forwards of ``chunk`` images instead of the
    whole batch's (the whole batch's graph is gigabytes on the digits cell network:
    docs/performance.md). ``predict_log_probs`` is called once a chunk; ``hold()``, a context around
    the chunks of one gradient, keeps a posterior whose members are drawn at every call (DBSN's
    structures) to one draw for the whole batch, as one call over the batch would.
    """

    def __init__(
        self, predict_log_probs: LossFn, y: Tensor, chunk: int, hold: Callable[[], AbstractContextManager] = nullcontext
    ) -> None:
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self.predict_log_probs, self.y, self.chunk, self.hold = predict_log_probs, _normal_tensor(y), chunk, hold

    def __call__(self, x: Tensor) -> Tensor:
        return predictive_nll(self.predict_log_probs, self.y)(x)

    def gradient(self, x: Tensor) -> Tensor:
        """``∇_x L(x)``, ``chunk`` examples in the graph at a time."""
        parts = []
        with self.hold():
            for x_part, y_part in zip(x.detach().split(self.chunk), self.y.split(self.chunk)):
                leaf = x_part.clone().requires_grad_(True)
                loss = F.nll_loss(self.predict_log_probs(leaf), y_part, reduction="sum") / len(self.y)
                parts.append(torch.autograd.grad(loss, leaf)[0])
        return torch.cat(parts)


def adversarial_evaluation(
    attack_log_probs: LossFn,
    eval_log_probs: LossFn,
    batches: Iterable[tuple[Tensor, Tensor]],
    epsilons: Iterable[float] = PAPER_EPSILONS,
    attacks: Iterable[str] = ("fgsm", "bim"),
    bim_steps: int = 3,
    progress: bool = True,
    attack_loss: Callable[[Tensor], LossFn] | None = None,
) -> list[dict]:
    """Accuracy and mean predictive entropy of the predictive under each attack and ε.

    ``batches`` yields ``(x, y)`` with ``x`` in pixel space ``[0, 1]`` on the model's device;
    it is iterated once. ``attack_log_probs`` is the differentiable predictive (log of the
    averaged probabilities) whose :func:`predictive_nll` the attacks ascend;
    ``eval_log_probs`` is called under ``torch.no_grad()`` on the attacked batch. At ε = 0
    the clean batch is evaluated once and shared by all attacks. Works inside
    ``torch.no_grad()``/``torch.inference_mode()`` (the attacks re-enable gradients).

    ``attack_loss(y)``, when given, is the loss the attacks ascend on a batch of labels ``y``
    instead of ``predictive_nll(attack_log_probs, y)`` (an :class:`ExampleChunkedNLL`: the same
    loss with a graph of fewer images).

    Returns one row per (attack, ε), attacks outer, ``{"attack", "epsilon", "accuracy",
    "mean_entropy", "n_examples"}``, averaged over all examples.
    """
    epsilons, attacks = [float(e) for e in epsilons], list(attacks)
    unknown = [a for a in attacks if a not in ATTACKS]
    if unknown:
        raise ValueError(f"unknown attacks {unknown}; choose from {sorted(ATTACKS)}")
    keys = [(a, e) for a in attacks for e in epsilons]
    totals = {key: [0.0, 0.0] for key in keys}  # (number correct, sum of entropies)
    n_examples = 0
    total = len(batches) * len(keys) if hasattr(batches, "__len__") else None
    with progress_bar(total=total, desc="adversarial", enabled=progress) as bar:
        for x, y in batches:
            loss_fn = predictive_nll(attack_log_probs, y) if attack_loss is None else attack_loss(y)
            clean = None
            for attack, epsilon in keys:
                if epsilon == 0:
                    clean = clean if clean is not None else _evaluate(eval_log_probs, x, y)
                    stats = clean
                else:
                    kwargs = {"steps": bim_steps} if attack == "bim" else {}
                    stats = _evaluate(eval_log_probs, ATTACKS[attack](loss_fn, x, epsilon, **kwargs), y)
                totals[attack, epsilon][0] += stats[0]
                totals[attack, epsilon][1] += stats[1]
                bar.update()
            n_examples += len(y)
    return [
        {
            "attack": attack,
            "epsilon": epsilon,
            "accuracy": correct / n_examples,
            "mean_entropy": entropy / n_examples,
            "n_examples": n_examples,
        }
        for (attack, epsilon), (correct, entropy) in totals.items()
    ]


def _evaluate(eval_log_probs: LossFn, x: Tensor, y: Tensor) -> tuple[float, float]:
    """Number of correct argmax predictions and the sum of predictive entropies on a batch."""
    with torch.no_grad():
        log_probs = eval_log_probs(x)
        correct = (log_probs.argmax(dim=1) == y).sum().item()
        entropy = torch.special.entr(log_probs.exp()).sum(dim=1).sum().item()
    return correct, entropy


def adversarial_figure(results: dict[str, list[dict]], title: str | None = None) -> Figure:
    """Accuracy (``fig.axes[0]``) and mean predictive entropy (``fig.axes[1]``) against ε.

    ``results`` maps a label (e.g. a method name) to its rows from
    :func:`adversarial_evaluation`. Each (label, attack) is one line with markers, in the
    legend as ``"DBSN – FGSM"``, or just ``"FGSM"`` when there is a single label. Colours
    tell labels apart (attacks when there is one label); line styles and markers tell
    attacks apart.
    """
    fig = Figure(figsize=(10, 4), layout="constrained")
    ax_acc, ax_ent = fig.subplots(1, 2)
    styles = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "D")]
    for i, (label, rows) in enumerate(results.items()):
        attacks = list(dict.fromkeys(row["attack"] for row in rows))
        for j, attack in enumerate(attacks):
            points = sorted((r["epsilon"], r["accuracy"], r["mean_entropy"]) for r in rows if r["attack"] == attack)
            eps, acc, ent = zip(*points)
            name = attack.upper() if len(results) == 1 else f"{label} – {attack.upper()}"
            linestyle, marker = styles[j % len(styles)]
            style = {"color": f"C{i if len(results) > 1 else j}", "linestyle": linestyle, "marker": marker}
            ax_acc.plot(eps, acc, label=name, **style)
            ax_ent.plot(eps, ent, label=name, **style)
    xlabel = "Perturbation size ε (pixel scale [0, 1])"
    ax_acc.set(xlabel=xlabel, ylabel="Accuracy", ylim=(0, 1.02), title="Accuracy under attack")
    ax_ent.set(xlabel=xlabel, ylabel="Mean predictive entropy (nats)", title="Predictive entropy under attack")
    ax_ent.set_ylim(bottom=0)
    for ax in (ax_acc, ax_ent):
        ax.grid(alpha=0.3)
    ax_acc.legend()
    if title is not None:
        fig.suptitle(title)
    return fig
