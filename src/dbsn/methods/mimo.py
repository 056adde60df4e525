"""MIMO (Havasi et al., ICLR 2021, "Training independent subnetworks for robust prediction"):
M subnetworks in one network, trained on M independent inputs at once, an ensemble in one
forward pass.

The network is `dbsn.nets.mimo.mimo(net, M)`: M images concatenated on the stem's input
channels, M heads on the shared features. The subnetworks become independent through the
training batch, as in the authors' code (google/uncertainty-baselines `baselines/cifar/mimo.py`):
the b examples are tiled r times and shuffled (n = r · b rows); member m gets its own permutation
of the first ⌊n · (1 − ρ)⌋ rows (ρ, the input repetition probability, shows every member the same
example on the rest); row j of the input concatenates the members' examples j, and head m is
scored against member m's label. The loss sums the members' NLLs, as the authors' code does, so
their learning rate and L2 apply unchanged; `member_loss="mean"` averages them instead
(torch-uncertainty's routine). The logged ``nll`` is the mean over members.

At test time each image is tiled M times on the channels and the M heads' softmaxes are averaged;
`network(x, α)` returns the heads as rows i · M + m (`SinglePassEnsemble`'s layout). Random draws
come from torch's global generator on the CPU (the same batches on any device). On DBSN's cell
network the members share `MAP`'s point structure. Sources and settings: docs/field.md.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dbsn.methods.single_pass import SinglePassEnsemble
from dbsn.methods.tasks import Segmentation
from dbsn.nets.mimo import mimo

#: How the members' NLLs make the loss: "sum" (uncertainty-baselines' mimo.py: their lr and L2 apply
#: unchanged) or "mean" (torch-uncertainty's routine, the mean over all rows; an optimiser recipe written
#: for one network's mean NLL, e.g. the DBSN paper's, then gives the same step).
MEMBER_LOSSES = ("sum", "mean")


class MIMO(SinglePassEnsemble):
    """M subnetworks with their own inputs and heads in one network (see the module docstring).

    Args:
        net: the plain network (conventions of `dbsn.nets.mimo`); MIMO widens its stem and
            classifier for M members.
        size: M, the number of subnetworks (authors' code: 3 on CIFAR).
        input_repetition: ρ, the fraction of the rows on which all members see the same
            example (authors' code: 0 on CIFAR).
        batch_repetitions: r, how many times each example of the batch is repeated in a
            training step (authors' code: 4 on CIFAR).
        member_loss: "sum" of the members' NLLs (authors' code) or their "mean" (`MEMBER_LOSSES`).
        settings: `SinglePassEnsemble`'s, `MAP`'s and `Method`'s settings.
    """

    def __init__(
        self,
        net: nn.Module,
        *,
        size: int = 3,
        input_repetition: float = 0.0,
        batch_repetitions: int = 4,
        member_loss: str = "sum",
        **settings,
    ) -> None:
        if member_loss not in MEMBER_LOSSES:
            raise ValueError(f"member_loss must be one of {MEMBER_LOSSES}, got {member_loss!r}")
        if not 0.0 <= input_repetition <= 1.0:
            raise ValueError(f"input_repetition (rho) is a probability in [0, 1], got {input_repetition}")
        if batch_repetitions < 1:
            raise ValueError(f"batch_repetitions (r) must be >= 1, got {batch_repetitions}")
        if isinstance(settings.get("task"), Segmentation):
            raise ValueError("MIMO is built for image classification (one head per member); it does not segment")
        if size < 1:
            raise ValueError(f"size (M, the number of members) must be >= 1, got {size}")
        super().__init__(mimo(net, size), size=size, **settings)
        self.input_repetition = float(input_repetition)
        self.batch_repetitions = int(batch_repetitions)
        self.member_loss = member_loss

    # ------------------------------------------------------------------ the training batch
    def mimo_indices(self, batch_size: int) -> Tensor:
        """(n, M) example indices of a training step, n = r · batch_size: column m is member m's
        order of the repeated batch (see the module docstring); drawn from torch's global
        generator on the CPU."""
        main = torch.arange(batch_size).repeat(self.batch_repetitions)
        main = main[torch.randperm(main.numel())]
        shuffled = int(main.numel() * (1.0 - self.input_repetition))
        columns = [torch.cat([main[:shuffled][torch.randperm(shuffled)], main[shuffled:]]) for _ in range(self.size)]
        return torch.stack(columns, dim=1)

    def mimo_batch(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """The network's input (n, M · C_in, H, W), member m's image in channels m · C_in ..,
        and the targets (n · M,), row j · M + m: member m's label of row j."""
        index = self.mimo_indices(x.shape[0]).to(x.device)
        inputs = x[index.flatten()]  # row j·M + m: member m's example of row j
        inputs = inputs.reshape(index.shape[0], self.size * x.shape[1], *x.shape[2:])
        return inputs, y[index.flatten()]

    def training_loss(self, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        """Σ over members of the mean NLL of its head on its own inputs (+ weight KL / N); logs
        the mean NLL over members. Logits and targets: rows j · M + m."""
        inputs, targets = self.mimo_batch(x, y)
        logits = self.heads(inputs, self.alpha().unsqueeze(0))
        nll = self.data_loss(logits, targets)  # mean over the n·M rows = mean over members
        out = {
            "nll": nll,
            "logits": logits,
            "targets": targets,
            "loss": (self.size if self.member_loss == "sum" else 1) * nll,
        }
        if self.weights.stochastic:  # as `Method.structures_loss`
            kl = self.weights.kl(self.net, self.current_epoch)
            out["weight_kl"] = torch.as_tensor(kl)
            out["loss"] = out["loss"] + kl / self.dataset_size
        return out

    # ------------------------------------------------------------------ the network
    def heads(self, inputs: Tensor, alpha: Tensor) -> Tensor:
        """The M heads on MIMO inputs (n, M · C_in, H, W) under one structure α (1, E, K), as
        rows j · M + m: (n · M, C)."""
        logits = super().network(inputs, alpha[:1])  # (n, M·C), head m in columns m·C ..
        return logits.reshape(inputs.shape[0] * self.size, -1)

    def network(self, x: Tensor, alpha: Tensor) -> Tensor:
        """Every member on every image of x (tiled M times on the channels): (b · M, C), row
        i · M + m. The members share the point structure, alpha[0]."""
        return self.heads(x.repeat(1, self.size, 1, 1), alpha)

    # ------------------------------------------------------------------ what detection scores read
    def member_features(self, head_input: Tensor, batch: int) -> Tensor:
        """The heads share the features: every member's are the same (b, D)."""
        return head_input.flatten(1).unsqueeze(0).expand(self.size, -1, -1)

    def member_heads(self, n: int) -> list[tuple[Tensor, Tensor]]:
        """Head m: rows m·C .. (m + 1)·C - 1 of the classifier."""
        head = self.feature_head()
        weight = head.weight.detach().view(self.size, -1, head.in_features)
        bias = weight.new_zeros(weight.shape[:2]) if head.bias is None else head.bias.detach().view(self.size, -1)
        return [(weight[m % self.size], bias[m % self.size]) for m in range(n)]
