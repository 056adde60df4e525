"""The state dicts of the two cells, and the conversions between them: a checkpoint written with the
per-edge `dbsn.nets.cell.Cell` loads into the `dbsn.nets.fused_cell.FusedCell` and back.

Per-edge keys: ``edge_ops.<e>.<k>.<layer>.<name>`` (edge e's op k). Fused keys, per source node i
(edge (i, i + 1 + t) is slot t): ``sources.<i>.norm.*`` (the running statistics that the identity
and every op's first BatchNorm share), ``sources.<i>.affine.{weight,bias}`` (every chain's first
BatchNorm's γ and β, chain by chain, edge by edge) and ``sources.<i>.chains.<op>.<layer>.<name>``
(the op's layers with the n edges' tensors stacked). The stacking follows each tensor's shape, so
transformed layers (Gaussian weights' μ and ρ, BatchEnsemble's fast weights) convert too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

#: the ops with a chain of layers, and the dilation of each of its separable convolutions
CHAINS = {"sep_conv_3x3": (1, 1), "dil_conv_3x3": (2,)}


def cell_chains(op_names: Sequence[str]) -> list[str]:
    """The ops with a chain of layers (not zero, not identity), in the op list's order."""
    return [name for name in op_names if name in CHAINS]


def _edge_slots(cell):
    """(source i, slot t, edge e) of every edge."""
    for i in range(cell.num_nodes - 1):
        for t, j in enumerate(range(i + 1, cell.num_nodes)):
            yield i, t, cell.edge_index(i, j)


def _stack(parts: list[Tensor], stacked: torch.Size) -> Tensor:
    """`parts`, one per edge, as the fused tensor of shape `stacked`."""
    dim = _stack_dim(stacked, parts[0].shape, len(parts))
    if dim == "edge-major":
        return torch.stack(parts).reshape(stacked)
    return parts[0] if dim is None else torch.cat(parts, dim)


def _unstack(stacked: Tensor, one: torch.Size, edges: int, t: int) -> Tensor:
    """Edge t's part, of shape `one`, of the fused tensor `stacked`."""
    dim = _stack_dim(stacked.shape, one, edges)
    if dim == "edge-major":
        return stacked.reshape(edges, *one)[t].clone()
    return stacked if dim is None else stacked.chunk(edges, dim)[t].clone()


def _stack_dim(stacked: torch.Size, one: torch.Size, edges: int) -> int | str | None:
    """The dimension along which `edges` tensors of shape `one` concatenate to `stacked` (None:
    the same shape, one edge or a count; "edge-major": a shape of its own whose outermost
    varying index is the edge, as `EdgeAffine`'s (n, C, 1, 1))."""
    if stacked == one:
        return None
    if len(stacked) != len(one) and stacked.numel() == edges * one.numel():
        return "edge-major"
    dims = [
        d
        for d in range(len(one))
        if stacked[d] == edges * one[d] and all(stacked[k] == one[k] for k in range(len(one)) if k != d)
    ]
    if len(stacked) != len(one) or len(dims) != 1:
        raise ValueError(f"cannot stack {edges} edges' tensors of shape {tuple(one)} into {tuple(stacked)}")
    return dims[0]


def _first_norm_keys(op_names: Sequence[str], e: int) -> list[str]:
    """Per-edge keys (after ``edge_ops.e.``) of the BatchNorms whose statistics `SourceOps.norm`
    keeps: the identity itself, and the first BatchNorm of each chain."""
    return [f"{k}." if name == "identity" else f"{k}.0." for k, name in enumerate(op_names) if name != "zero"]


def fused_state(cell, state_dict: dict, prefix: str = "") -> None:
    """In place: the per-edge `Cell` entries of `state_dict` under `prefix` replaced by the
    `FusedCell`'s (nothing to do when it holds none)."""
    edge_prefix = prefix + "edge_ops."
    if not any(key.startswith(edge_prefix) for key in state_dict):
        return
    own = {key: value for key, value in cell.state_dict().items() if key.startswith("sources.")}
    for key, mine in own.items():
        _, i, part, rest = key.split(".", 3)
        source = cell.sources[int(i)]
        edges = [e for s, _, e in _edge_slots(cell) if s == int(i)]
        if part == "norm":  # one statistic for the identity and every op's first BatchNorm
            name = _first_norm_keys(cell.op_names, edges[0])[0] + rest
            state_dict[prefix + key] = state_dict[f"{edge_prefix}{edges[0]}.{name}"]
            continue
        if part == "affine":  # every chain's first BatchNorm's γ or β, chain by chain, edge by edge
            ks = [source.op_names.index(op) for op in source.chains]
            parts = [state_dict[f"{edge_prefix}{e}.{k}.0.{rest}"] for k in ks for e in edges]
            state_dict[prefix + key] = torch.stack(parts).reshape(mine.shape)
            continue
        op, index, leaf = rest.split(".", 2)
        k = source.op_names.index(op)
        state_dict[prefix + key] = _stack(
            [state_dict[f"{edge_prefix}{e}.{k}.{index}.{leaf}"] for e in edges], mine.shape
        )
    for key in [key for key in state_dict if key.startswith(edge_prefix)]:
        del state_dict[key]


def per_edge_state(cell, state_dict: dict, prefix: str = "") -> None:
    """In place: the `FusedCell` entries of `state_dict` under `prefix` replaced by the per-edge
    `Cell`'s (nothing to do when it holds none)."""
    source_prefix = prefix + "sources."
    if not any(key.startswith(source_prefix) for key in state_dict):
        return
    slots = {e: (i, t) for i, t, e in _edge_slots(cell)}
    for key, mine in cell.state_dict().items():
        if not key.startswith("edge_ops."):
            continue
        _, e, k, rest = key.split(".", 3)
        (i, t), name = slots[int(e)], cell.op_names[int(k)]
        if (
            name == "identity"
            or rest.split(".", 1)[0] == "0"
            and rest.rsplit(".", 1)[-1] in ("running_mean", "running_var", "num_batches_tracked")
        ):
            state_dict[prefix + key] = state_dict[f"{source_prefix}{i}.norm.{rest.rsplit('.', 1)[-1]}"]
            continue
        if rest in ("0.weight", "0.bias"):  # the chain's first γ or β: in the node's EdgeAffine
            chains = list(cell_chains(cell.op_names))
            affine = state_dict[f"{source_prefix}{i}.affine.{rest[2:]}"]
            edges = cell.num_nodes - 1 - i
            state_dict[prefix + key] = affine.reshape(len(chains), edges, *mine.shape)[chains.index(name), t].clone()
            continue
        stacked = state_dict[f"{source_prefix}{i}.chains.{name}.{rest}"]
        state_dict[prefix + key] = _unstack(stacked, mine.shape, cell.num_nodes - 1 - i, t)
    for key in [key for key in state_dict if key.startswith(source_prefix)]:
        del state_dict[key]
