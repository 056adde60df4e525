"""Tests for dbsn.evaluation.attacks: FGSM/BIM on a linear model, the predictive NLL, the
evaluation loop (also under inference mode), the results files and the figure."""

import csv
import json
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from dbsn.evaluation.attacks import (
    ATTACKS,
    PAPER_EPSILONS,
    RESULT_COLUMNS,
    ExampleChunkedNLL,
    adversarial_evaluation,
    adversarial_figure,
    bim,
    fgsm,
    predictive_nll,
)
from dbsn.evaluation.results import CsvTable, Results, write_results

N, D, C = 12, 16, 3  # examples, pixels (a flattened 4x4 image), classes


def linear_model(num_classes: int = C, seed: int = 0) -> nn.Module:
    """Logistic regression on flattened pixels with fixed weights, float64."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Flatten(), nn.Linear(D, num_classes)).double()
    with torch.no_grad():
        model[1].weight.copy_(torch.randn(num_classes, D, dtype=torch.float64))
        model[1].bias.copy_(torch.randn(num_classes, dtype=torch.float64))
    return model


def images(seed: int = 1, low: float = 0.0, high: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return low + (high - low) * torch.rand(N, 1, 4, 4, generator=generator, dtype=torch.float64)


def labels(seed: int = 2, num_classes: int = C) -> torch.Tensor:
    return torch.randint(num_classes, (N,), generator=torch.Generator().manual_seed(seed))


def log_probs_fn(model: nn.Module):
    return lambda x: F.log_softmax(model(x), dim=1)


def analytic_gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """d/dx of the mean softmax NLL of a linear model: (softmax(Wx + b) - onehot(y)) W / N."""
    weight, bias = model[1].weight, model[1].bias
    with torch.no_grad():
        flat = x.flatten(1)
        probs = torch.softmax(flat @ weight.T + bias, dim=1)
        grad = (probs - F.one_hot(y, weight.shape[0]).double()) @ weight / len(y)
    return grad.reshape(x.shape)


def test_fgsm_moves_each_pixel_by_epsilon_along_the_gradient_sign():
    model, x, y = linear_model(), images(low=0.2, high=0.8), labels()
    epsilon = 0.07
    loss_fn = predictive_nll(log_probs_fn(model), y)
    x_adv = fgsm(loss_fn, x, epsilon)
    sign = analytic_gradient(model, x, y).sign()
    assert (sign != 0).all()
    # Interior pixels: nothing is clipped, every pixel moves by exactly ε.
    torch.testing.assert_close(x_adv - x, epsilon * sign, rtol=0, atol=1e-15)
    assert not x_adv.requires_grad and x_adv.grad_fn is None
    # The loss goes up.
    assert loss_fn(x_adv) > loss_fn(x)


def test_fgsm_clips_to_the_pixel_range():
    model, y = linear_model(), labels()
    x = images()
    x.view(N, -1)[:, :4] = 0.0
    x.view(N, -1)[:, 4:8] = 1.0
    epsilon = 0.1
    x_adv = fgsm(predictive_nll(log_probs_fn(model), y), x, epsilon)
    sign = analytic_gradient(model, x, y).sign()
    expected = (x + epsilon * sign).clamp(0, 1)
    torch.testing.assert_close(x_adv, expected, rtol=0, atol=1e-15)
    assert x_adv.min() >= 0 and x_adv.max() <= 1
    # Both kinds of edge pixel occur: pushed outwards (stays put) and pushed inwards (moves by ε).
    at_zero, at_one = x == 0, x == 1
    assert (at_zero & (sign < 0)).any() and (at_zero & (sign > 0)).any()
    assert (at_one & (sign > 0)).any() and (at_one & (sign < 0)).any()
    assert (x_adv[at_zero & (sign < 0)] == 0).all()
    assert (x_adv[at_one & (sign > 0)] == 1).all()
    torch.testing.assert_close(x_adv[at_zero & (sign > 0)], torch.full_like(x_adv[at_zero & (sign > 0)], epsilon))
    # Pixels that are not clipped move by exactly ε.
    free = (x + epsilon * sign >= 0) & (x + epsilon * sign <= 1)
    torch.testing.assert_close((x_adv - x)[free], (epsilon * sign)[free], rtol=0, atol=1e-15)


@pytest.mark.parametrize("attack", [fgsm, bim])
def test_zero_epsilon_returns_the_input_without_a_forward(attack):
    x = images()

    def loss_fn(_):
        raise AssertionError("no forward is needed at ε = 0")

    assert torch.equal(attack(loss_fn, x, 0.0), x)


def test_bim_stays_in_the_epsilon_ball_and_the_pixel_range():
    model, x, y = linear_model(), images(), labels()  # pixels near 0 and 1 get clipped
    loss_fn = predictive_nll(log_probs_fn(model), y)
    for epsilon in (0.01, 0.05, 0.1, 0.3):
        for step_size in (None, epsilon):  # ε / 3 and a step too big for the ball
            x_adv = bim(loss_fn, x, epsilon, step_size=step_size)
            assert (x_adv - x).abs().max() <= epsilon + 1e-12
            assert x_adv.min() >= 0 and x_adv.max() <= 1
            assert loss_fn(x_adv) > loss_fn(x)
            assert not x_adv.requires_grad


def test_bim_takes_steps_of_epsilon_over_steps():
    # Two steps of ε/2 with no projection active move interior pixels by ε along the sign,
    # since the sign of a linear two-class model's gradient does not depend on x.
    model, x, y = linear_model(num_classes=2), images(low=0.3, high=0.7), labels(num_classes=2)
    loss_fn = predictive_nll(log_probs_fn(model), y)
    sign = analytic_gradient(model, x, y).sign()
    x_adv = bim(loss_fn, x, 0.08, steps=2)
    torch.testing.assert_close(x_adv - x, 0.08 * sign, rtol=0, atol=1e-15)
    # A step size of ε/4 with two steps only goes half way.
    x_half = bim(loss_fn, x, 0.08, steps=2, step_size=0.02)
    torch.testing.assert_close(x_half - x, 0.04 * sign, rtol=0, atol=1e-15)


def test_bim_follows_the_sign_step_by_step():
    # loss = -(x - 0.53)^2 pulls every pixel towards 0.53, so the sign flips once it is passed.
    # From 0.5 with ε = 0.06: steps of ε/3 = 0.02 go 0.52, 0.54, 0.52; steps of ε/5 = 0.012
    # go 0.512, 0.524, 0.536, 0.524, 0.536.
    x = torch.full((2, 1, 4, 4), 0.5, dtype=torch.float64)

    def loss_fn(inputs):
        return -(inputs - 0.53).pow(2).sum()

    torch.testing.assert_close(bim(loss_fn, x, 0.06), torch.full_like(x, 0.52), rtol=0, atol=1e-12)
    torch.testing.assert_close(bim(loss_fn, x, 0.06, steps=5), torch.full_like(x, 0.536), rtol=0, atol=1e-12)
    # Steps of ε overshoot and are projected back onto the ball: 0.56, 0.5, 0.56.
    torch.testing.assert_close(bim(loss_fn, x, 0.06, step_size=0.06), torch.full_like(x, 0.56), rtol=0, atol=1e-12)


def test_bim_with_one_full_step_is_fgsm():
    model, x, y = linear_model(), images(), labels()
    loss_fn = predictive_nll(log_probs_fn(model), y)
    for epsilon in (0.01, 0.1):
        assert torch.equal(bim(loss_fn, x, epsilon, steps=1, step_size=epsilon), fgsm(loss_fn, x, epsilon))


def test_bim_loss_is_at_least_the_fgsm_loss_on_a_linear_model():
    # For a linear logit model the attack direction sign(w_other - w_y) is the same at every
    # step, so with interior pixels BIM reaches the same corner of the ball as FGSM.
    model, x, y = linear_model(num_classes=2), images(low=0.2, high=0.8), labels(num_classes=2)
    loss_fn = predictive_nll(log_probs_fn(model), y)
    for epsilon in PAPER_EPSILONS[1:]:
        loss_fgsm, loss_bim = loss_fn(fgsm(loss_fn, x, epsilon)), loss_fn(bim(loss_fn, x, epsilon))
        assert loss_bim >= loss_fgsm - 1e-12
        assert loss_bim > loss_fn(x)


def test_attacks_leave_parameter_grads_alone():
    model, x, y = linear_model(), images(), labels()
    loss_fn = predictive_nll(log_probs_fn(model), y)
    fgsm(loss_fn, x, 0.1)
    bim(loss_fn, x, 0.1)
    adversarial_evaluation(log_probs_fn(model), log_probs_fn(model), [(x, y)], epsilons=(0.0, 0.1), progress=False)
    assert all(p.requires_grad for p in model.parameters())
    assert all(p.grad is None for p in model.parameters())


def test_attacks_work_under_no_grad():
    model, x, y = linear_model(), images(low=0.2, high=0.8), labels()
    loss_fn = predictive_nll(log_probs_fn(model), y)
    expected = fgsm(loss_fn, x, 0.05)
    with torch.no_grad():
        assert torch.equal(fgsm(loss_fn, x, 0.05), expected)
        assert torch.equal(bim(loss_fn, x, 0.05), bim(loss_fn, x, 0.05))


def test_attacks_take_inference_tensors_under_inference_mode():
    model, x, y = linear_model(), images(), labels()
    loss_fn = predictive_nll(log_probs_fn(model), y)
    expected = {name: attack(loss_fn, x, 0.05) for name, attack in ATTACKS.items()}
    with torch.inference_mode():
        x_inf, y_inf = x.clone(), y.clone()
        loss_inf = predictive_nll(log_probs_fn(model), y_inf)
        for name, attack in ATTACKS.items():
            torch.testing.assert_close(attack(loss_inf, x_inf, 0.05), expected[name], rtol=0, atol=0)
    assert all(p.grad is None for p in model.parameters())


def test_predictive_nll_is_the_nll_of_the_averaged_probabilities():
    x, y = images(), labels()
    members = [linear_model(seed=10), linear_model(seed=11)]

    def predict_log_probs(inputs):  # the posterior predictive of a two-member ensemble
        stacked = torch.stack([F.log_softmax(m(inputs), dim=1) for m in members])
        return torch.logsumexp(stacked, dim=0) - math.log(len(members))

    loss = predictive_nll(predict_log_probs, y)(x)
    with torch.no_grad():
        member_probs = torch.stack([torch.softmax(m(x), dim=1) for m in members])
        p_y = member_probs[:, torch.arange(N), y]  # (members, N)
        averaged = -p_y.mean(dim=0).log().mean()
        per_member = -p_y.log().mean(dim=0).mean()
    torch.testing.assert_close(loss.detach(), averaged)
    assert averaged < per_member - 1e-3  # Jensen: the two are different numbers
    assert loss.requires_grad  # differentiable, as the attacks need


def evaluation_setup():
    model, x = linear_model(), images()
    with torch.no_grad():
        y = model(x).argmax(dim=1)
    y[:4] = (y[:4] + 1) % C  # make the first four wrong: clean accuracy 2/3
    batches = [(x[:5], y[:5]), (x[5:], y[5:])]
    return model, x, y, batches


def test_adversarial_evaluation_rows_and_clean_accuracy():
    model, x, y, batches = evaluation_setup()
    attacks = ("fgsm", "bim")
    rows = adversarial_evaluation(log_probs_fn(model), log_probs_fn(model), batches, progress=False)
    assert len(rows) == len(attacks) * len(PAPER_EPSILONS)
    assert [(r["attack"], r["epsilon"]) for r in rows] == [(a, e) for a in attacks for e in PAPER_EPSILONS]
    assert set(rows[0]) == {"attack", "epsilon", "accuracy", "mean_entropy", "n_examples"}
    assert all(r["n_examples"] == N for r in rows)

    with torch.no_grad():
        probs = torch.softmax(model(x), dim=1)
        clean_accuracy = (probs.argmax(dim=1) == y).double().mean().item()
        clean_entropy = -(probs * probs.log()).sum(dim=1).mean().item()
    assert clean_accuracy == pytest.approx(2 / 3)
    for attack in attacks:
        by_eps = {r["epsilon"]: r for r in rows if r["attack"] == attack}
        assert by_eps[0.0]["accuracy"] == pytest.approx(clean_accuracy)
        assert by_eps[0.0]["mean_entropy"] == pytest.approx(clean_entropy)
        assert by_eps[0.1]["accuracy"] <= by_eps[0.0]["accuracy"]


def test_adversarial_evaluation_accuracy_drops_for_a_large_epsilon():
    model, _, _, batches = evaluation_setup()
    rows = adversarial_evaluation(
        log_probs_fn(model),
        log_probs_fn(model),
        batches,
        epsilons=(0.0, 0.5),
        attacks=["bim"],
        bim_steps=5,
        progress=False,
    )
    assert len(rows) == 2
    assert rows[1]["accuracy"] < rows[0]["accuracy"]


def test_adversarial_evaluation_under_inference_mode():
    model, x, y, batches = evaluation_setup()
    expected = adversarial_evaluation(log_probs_fn(model), log_probs_fn(model), batches, progress=False)
    with torch.inference_mode():
        inference_batches = [(bx.clone(), by.clone()) for bx, by in batches]
        assert all(bx.is_inference() and by.is_inference() for bx, by in inference_batches)
        rows = adversarial_evaluation(log_probs_fn(model), log_probs_fn(model), iter(inference_batches))
    assert len(rows) == len(expected)
    for row, want in zip(rows, expected):
        assert row["attack"] == want["attack"] and row["epsilon"] == want["epsilon"]
        assert row["accuracy"] == pytest.approx(want["accuracy"])
        assert row["mean_entropy"] == pytest.approx(want["mean_entropy"])


def test_unknown_attack_is_rejected():
    model, _, _, batches = evaluation_setup()
    with pytest.raises(ValueError, match="pgd"):
        adversarial_evaluation(log_probs_fn(model), log_probs_fn(model), batches, attacks=["pgd"], progress=False)
    assert set(ATTACKS) == {"fgsm", "bim"}


def test_paper_epsilons():
    assert PAPER_EPSILONS == (0.0, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07, 0.08, 0.09, 0.1)


def test_write_results_round_trips(tmp_path):
    model, _, _, batches = evaluation_setup()
    rows = adversarial_evaluation(
        log_probs_fn(model), log_probs_fn(model), batches, epsilons=(0.0, 0.05, 0.1), progress=False
    )
    write_results(
        Results(files={"adv/results.csv": CsvTable(list(RESULT_COLUMNS), rows), "adv/results.json": rows}), tmp_path
    )
    with open(tmp_path / "adv" / "results.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == ["attack", "epsilon", "accuracy", "mean_entropy", "n_examples"]
        read = list(reader)
    assert len(read) == len(rows)
    for line, row in zip(read, rows):
        assert line["attack"] == row["attack"]
        assert int(line["n_examples"]) == row["n_examples"]
        for key in ("epsilon", "accuracy", "mean_entropy"):
            assert float(line[key]) == row[key]
    assert json.loads((tmp_path / "adv" / "results.json").read_text()) == rows


def fake_rows(offset: float):
    return [
        {"attack": a, "epsilon": e, "accuracy": 0.9 - e - offset, "mean_entropy": 0.2 + e, "n_examples": 10}
        for a in ("fgsm", "bim")
        for e in (0.0, 0.05, 0.1)
    ]


def test_figure_axes_and_lines():
    fig = adversarial_figure({"DBSN": fake_rows(0.0), "Dropout": fake_rows(0.1)}, title="CIFAR-10")
    assert len(fig.axes) == 2
    ax_acc, ax_ent = fig.axes
    xlabel = "Perturbation size ε (pixel scale [0, 1])"
    assert ax_acc.get_xlabel() == xlabel and ax_ent.get_xlabel() == xlabel
    assert ax_acc.get_ylabel() == "Accuracy"
    assert ax_ent.get_ylabel() == "Mean predictive entropy (nats)"
    assert ax_acc.get_title() and ax_ent.get_title()
    assert fig.get_suptitle() == "CIFAR-10"
    names = ["DBSN – FGSM", "DBSN – BIM", "Dropout – FGSM", "Dropout – BIM"]
    for ax in (ax_acc, ax_ent):
        assert [line.get_label() for line in ax.get_lines()] == names
        assert all(line.get_marker() not in (None, "None", "") for line in ax.get_lines())
    assert [t.get_text() for t in ax_acc.get_legend().get_texts()] == names
    dbsn_fgsm = ax_acc.get_lines()[0]
    assert list(dbsn_fgsm.get_xdata()) == [0.0, 0.05, 0.1]
    assert list(dbsn_fgsm.get_ydata()) == pytest.approx([0.9, 0.85, 0.8])
    assert list(ax_ent.get_lines()[3].get_ydata()) == pytest.approx([0.2, 0.25, 0.3])


def test_figure_with_a_single_label():
    fig = adversarial_figure({"DBSN": fake_rows(0.0)})
    assert [line.get_label() for line in fig.axes[0].get_lines()] == ["FGSM", "BIM"]
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["FGSM", "BIM"]
    assert not fig.get_suptitle()


def ensemble_fn(seeds=(0, 1, 2, 3, 4)):
    """The log of the averaged probabilities of an ensemble of linear models (its members the same at every call)."""
    models = [linear_model(seed=s) for s in seeds]
    return lambda x: torch.logsumexp(torch.stack([F.log_softmax(m(x), dim=1) for m in models]), dim=0) - math.log(5)


@pytest.mark.parametrize("chunk", [1, 5, 12, 40])
def test_example_chunked_nll_takes_the_whole_batch_gradient(chunk):
    """A chunk of examples at a time, the gradient is the whole batch's (each example's is its own),
    the loss is the predictive NLL, and FGSM / BIM give the same images."""
    predictive, x, y = ensemble_fn(), images(), labels()
    loss, whole = ExampleChunkedNLL(predictive, y, chunk), predictive_nll(predictive, y)
    x_leaf = x.clone().requires_grad_(True)
    expected = torch.autograd.grad(whole(x_leaf), x_leaf)[0]
    torch.testing.assert_close(loss.gradient(x), expected, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(loss(x), whole(x), rtol=0, atol=0)
    assert torch.equal(fgsm(loss, x, 0.05), fgsm(whole, x, 0.05))
    assert torch.equal(bim(loss, x, 0.05), bim(whole, x, 0.05))


def test_example_chunked_nll_holds_a_chunk_of_examples_in_the_graph():
    predictive, sizes = ensemble_fn(), []

    def counted(x):
        sizes.append((len(x), x.requires_grad))
        return predictive(x)

    with torch.enable_grad():
        ExampleChunkedNLL(counted, labels(), 5).gradient(images())
    assert sizes == [(5, True), (5, True), (2, True)]


def test_adversarial_evaluation_attacks_the_given_loss():
    predictive, x, y = ensemble_fn(), images(), labels()
    plain = adversarial_evaluation(predictive, predictive, [(x, y)], epsilons=(0.0, 0.1), progress=False)
    chunked = adversarial_evaluation(
        predictive,
        predictive,
        [(x, y)],
        epsilons=(0.0, 0.1),
        progress=False,
        attack_loss=lambda y: ExampleChunkedNLL(predictive, y, 5),
    )
    assert plain == chunked


def test_example_chunked_nll_holds_members_drawn_per_call_for_the_whole_batch():
    """A posterior that draws its members at every call is held to one draw for all of a gradient's
    chunks: the gradient is the whole batch's under that one draw."""
    from contextlib import contextmanager

    x, y, draws = images(), labels(), []
    held = {}

    def drawn(x):  # a random member per call unless one is held
        model = held.get("model") or linear_model(seed=len(draws) + 10)
        draws.append(model)
        return F.log_softmax(model(x), dim=1)

    @contextmanager
    def hold():
        held["model"] = linear_model(seed=99)
        yield
        held.clear()

    gradient = ExampleChunkedNLL(drawn, y, 5, hold=hold).gradient(x)
    torch.testing.assert_close(gradient, analytic_gradient(linear_model(seed=99), x, y), rtol=1e-12, atol=1e-15)
    assert len(draws) == 3  # a call a chunk, every one under the held draw
