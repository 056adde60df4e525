"""BatchEnsemble's fast-weight initialisations compared by training (docs/field.md).

    python -m dbsn.tools.batch_ensemble_init [--backbone structure_net|resnet18] [--seeds 0,1] [--steps 150]
                                             [--inits 0.5,-0.5,-0.25,-0.1,1] [--out FILE.jsonl]

For each initialisation of the fast weights r, s (the authors' flag `random_sign_init`: p > 0 random
signs ±1 with P(+1) = p, -σ for N(1, σ²); 1 is all ones) BatchEnsemble (M = 4) is built on the
backbone at compare's CPU size, under compare's fair protocol at its own settings (lr 0.1 with a
1-epoch warm-up, fast weights at lr × 0.5, ×0.1 at 50 % and 75 %), and trained for `--steps` steps
of batch 64 on the embedded digits at 16 × 16 pixels (a quarter of the cost at 32 × 32), the
validation split 15 % of the training split. One JSON line per (init, seed):

- `grad_cosine_at_init`: the mean pairwise cosine of the members' loss gradients on the shared
  (slow) weights, on one batch at initialisation (near 0: each member pulls the shared weights its
  own way; 1: the members are one network);
- after training, the ensemble's training NLL, validation NLL and error, and the members' mean
  pairwise disagreement on the validation images (the share whose top labels differ).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

#: The initialisations compared, by name: their `random_sign_init` values.
INITS = {
    "random signs (p = 0.5)": 0.5,
    "N(1, 0.5²) (the authors')": -0.5,
    "N(1, 0.25²)": -0.25,
    "N(1, 0.1²)": -0.1,
    "ones": 1.0,
}
BATCH, PIXELS = 64, 16


def _digits(val_size: float = 0.15):
    import torch.nn.functional as F

    from dbsn.data.digits import DigitsDataModule

    data = DigitsDataModule(num_workers=0, val_size=val_size, batch_size=BATCH)
    data.setup("fit")
    small = lambda x: F.interpolate(x, size=PIXELS, mode="bilinear", align_corners=False, antialias=True)  # noqa: E731
    return (
        (small(data.preprocess(data.train_set.images)), data.train_set.labels),
        (small(data.preprocess(data.val_set.images)), data.val_set.labels),
    )


def _shared_weights(model) -> list:
    from dbsn.nets.batch_ensemble import fast_parameters, member_biases

    fast = {id(p) for p in fast_parameters(model.net) + member_biases(model.net)}
    return [p for p in model.net.parameters() if p.dim() > 1 and id(p) not in fast]


def gradient_cosine(model, x, y) -> float:
    """The mean pairwise cosine of the members' NLL gradients on the shared weights (rows i·M + m
    of the one forward are member m's)."""
    import torch
    import torch.nn.functional as F

    alpha, _ = model.training_structures(model.size)
    logits = model.network(x, alpha)
    weights = _shared_weights(model)
    grads = []
    for m in range(model.size):
        g = torch.autograd.grad(F.cross_entropy(logits[m :: model.size], y), weights, retain_graph=True)
        grads.append(torch.cat([t.flatten() for t in g]))
    g = torch.nn.functional.normalize(torch.stack(grads), dim=1)
    n = model.size
    return float(((g @ g.T).sum() - n) / (n * (n - 1)))


def train_steps(model, x, y, steps: int, batch_size: int, steps_per_epoch: int, generator) -> None:
    """`steps` training steps of `model` on the in-memory (x, y), as train.py's would run them
    (`step_body`, the epoch schedules stepped every `steps_per_epoch` steps), without Lightning: batches
    drawn with replacement by `generator`."""
    import torch

    opts, schedules = model.configure_optimizers()
    model.attach_guard(opts)
    for step in range(steps):
        batch = torch.randint(len(y), (batch_size,), generator=generator)
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        model.step_body(x[batch], y[batch], opts, opts[: len(schedules)], lambda loss, last: loss.backward())
        if (step + 1) % steps_per_epoch == 0:
            for schedule in schedules:
                schedule.step()


def measure(backbone: str, init: float, seed: int, steps: int, data, net_overrides=()) -> dict:
    """One BatchEnsemble trained `steps` steps from the initialisation `init` (module docstring)."""
    import torch
    from hydra import compose, initialize_config_dir

    from dbsn.runtime.build import build_model
    from dbsn.runtime.config import CONF_DIR
    from dbsn.tools.compare import method_overrides, shared_overrides

    (x, y), (x_val, y_val) = data
    steps_per_epoch = len(y) // BATCH
    epochs = max(1, steps // steps_per_epoch)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[
                *method_overrides(
                    "batch_ensemble", epochs, steps_per_epoch, backbone=backbone, net_overrides=list(net_overrides)
                ),
                *shared_overrides(),
                f"model.random_sign_init={init}",
            ],
        )
    torch.manual_seed(seed)
    model = build_model(cfg.model, 10)
    model.dataset_size = len(y)
    model._trainer = SimpleNamespace(
        max_epochs=epochs,
        world_size=1,
        precision="32-true",
        datamodule=None,
        num_training_batches=steps_per_epoch,
        current_epoch=0,
    )
    model.train()
    generator = torch.Generator().manual_seed(100 + seed)
    batch = torch.randint(len(y), (BATCH,), generator=generator)
    cosine = gradient_cosine(model, x[batch], y[batch])
    train_steps(model, x, y, steps, BATCH, steps_per_epoch, generator)
    model.eval()
    with torch.no_grad():
        train_log_probs = model.predict_log_probs(x)
        members = model.network(x_val, model.prediction_structures(model.size)).view(len(y_val), model.size, -1)
        val_log_probs = torch.logsumexp(members.log_softmax(-1), 1) - torch.log(torch.tensor(float(model.size)))
        votes = members.argmax(-1)
        disagreement = float((votes[:, :, None] != votes[:, None, :]).float().mean()) * model.size / (model.size - 1)
    return {
        "backbone": backbone,
        "random_sign_init": init,
        "seed": seed,
        "steps": steps,
        "grad_cosine_at_init": round(cosine, 4),
        "train_nll": round(float(-train_log_probs.gather(1, y[:, None]).mean()), 4),
        "val_nll": round(float(-val_log_probs.gather(1, y_val[:, None]).mean()), 4),
        "val_error": round(float((val_log_probs.argmax(1) != y_val).float().mean()), 4),
        "member_disagreement": round(disagreement, 4),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backbone", choices=("structure_net", "resnet18"), default="structure_net")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument(
        "--inits",
        default=",".join(f"{v:g}" for v in INITS.values()),
        help="random_sign_init values (p > 0: random signs; -σ: N(1, σ²); 1: ones)",
    )
    parser.add_argument("--out", type=Path, default=None, help="append the JSON lines to this file too")
    args = parser.parse_args(argv)
    data = _digits()
    rows = []
    for init in (float(v) for v in args.inits.split(",")):
        for seed in (int(s) for s in args.seeds.split(",")):
            started = time.time()
            row = {**measure(args.backbone, init, seed, args.steps, data), "seconds": round(time.time() - started)}
            rows.append(row)
            line = json.dumps(row)
            print(line, flush=True)
            if args.out is not None:
                with args.out.open("a") as f:
                    f.write(line + "\n")
    return rows


if __name__ == "__main__":
    sys.exit(main() and 0)
