"""The kernel-launching operations of a training step by what they compute, forward and backward.

A GPU step of the fused cell is bound by executing many small kernels, so the question for each
change is which part of the cell launches them. `Categories` is a `TorchDispatchMode` that sorts
every aten operation that launches a kernel on a GPU (`dbsn.tools.bench.common.VIEWS` do not)
into one of `CATEGORIES` (defined beside it). A backward operation belongs where its forward ran:
a `TorchFunctionMode` writes the module category of every autograd node created in the forward
into the node's ``metadata``, and backward operations read it from the node the engine is running
(``torch._C._current_autograd_node``). With ``annotate`` every operation also runs inside a
profiler range ``bench::<category>``, so that a `torch.profiler` trace of an eager step on a GPU
attributes each kernel to a category (`kernels_by_category`).
"""

from __future__ import annotations

from contextlib import ExitStack

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from dbsn.tools.bench.common import VIEWS

CONV, DEPTHWISE, CASTS, BATCHNORM, EDGE_AFFINE, ALPHA_SUMS, OTHER = (
    # convolutions that are not depthwise, and whatever a 1×1's other form (`dbsn.nets.conv_forms`) runs
    "1x1 and dense conv",
    # depthwise convolutions (one input channel per group, a 3×3 kernel), and what their stencil form runs
    "depthwise",
    # dtype conversions (``_to_copy``, a ``copy_`` between dtypes): autocast's and the code's own
    "casts",
    # the batch-norm operations and what BatchNorm modules run around them (the per-group repeat of γ and β,
    # the running-statistics update's glue)
    "BatchNorm",
    # the fused cell's first affine transform and ReLU of every chain
    "EdgeAffine",
    # the rest of a cell's own work (`SourceOps`, the cell's forward, fused or per-edge): the α-weighted sums
    # of the ops, each node's sum of its incoming edges, the gather of α, the output's concatenation
    "α sums",
    # the stem, head, loss, optimisers, the structure draw, the chains' ReLUs
    "other",
)
CATEGORIES = (CONV, DEPTHWISE, CASTS, BATCHNORM, EDGE_AFFINE, ALPHA_SUMS, OTHER)
_CONV_OPS = frozenset(
    {
        "aten.convolution",
        "aten.convolution_backward",
        "aten._convolution",
        "aten.cudnn_convolution",
        "aten.mkldnn_convolution",
        "aten._conv_depthwise2d",
        "aten.conv_depthwise3d",
        "aten._slow_conv2d_forward",
        "aten._slow_conv2d_backward",
    }
)
_KEY = "dbsn_bench_category"
#: the profiler ranges' prefix (`annotate`)
PREFIX = "bench::"


def module_category(module: nn.Module) -> str | None:
    """The category of the operations a module runs itself (not its children's); None: its parent's."""
    from dbsn.nets.cell import CellBase
    from dbsn.nets.fused_cell import EdgeAffine, SourceOps

    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return BATCHNORM
    if isinstance(module, EdgeAffine):
        return EDGE_AFFINE
    if isinstance(module, (SourceOps, CellBase)):
        return ALPHA_SUMS
    if isinstance(module, nn.Conv2d):
        depthwise = module.groups > 1 and module.groups == module.in_channels and module.kernel_size[0] > 1
        return DEPTHWISE if depthwise else CONV
    return OTHER


def _is_depthwise(name: str, args) -> bool:
    weight, groups = (args[1], args[8]) if name in ("aten.convolution", "aten._convolution") else (None, None)
    if name == "aten.convolution_backward":
        weight, groups = args[2], args[9]
    elif name == "aten._conv_depthwise2d":
        return True
    if weight is None or not isinstance(groups, int):
        return False
    return groups > 1 and weight.shape[1] == 1 and weight.shape[-1] > 1


def _is_cast(name: str, args, kwargs) -> bool:
    if name == "aten._to_copy":
        dtype = kwargs.get("dtype")
        return dtype is not None and dtype != args[0].dtype
    if name == "aten.copy_":
        return isinstance(args[1], torch.Tensor) and args[1].dtype != args[0].dtype
    return False


class _Tagging(TorchFunctionMode):
    """Writes the current module category into the metadata of every autograd node a call creates."""

    def __init__(self, owner: Categories) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch.is_grad_enabled():
            category = self.owner.scope
            for tensor in out if isinstance(out, (tuple, list)) else (out,):
                node = tensor.grad_fn if isinstance(tensor, torch.Tensor) else None
                self._tag(node, category)
        return out

    @staticmethod
    def _tag(node, category: str) -> None:
        # the nodes this call created: from its output back to nodes tagged by earlier calls
        todo = [node]
        while todo:
            node = todo.pop()
            if node is None or _KEY in node.metadata:
                continue
            node.metadata[_KEY] = category
            todo.extend(next_node for next_node, _ in node.next_functions)


class Categories(TorchDispatchMode):
    """Counts the kernel-launching aten operations dispatched in the block by category (module
    docstring): ``counts[category]``, whose sum is ``launching``; ``annotate`` wraps each one in a
    profiler range named ``bench::<category>``."""

    def __init__(self, annotate: bool = False) -> None:
        super().__init__()
        self.views = VIEWS
        self.annotate = annotate
        self.counts: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self._scopes: list[str] = []
        self._stack: ExitStack | None = None

    @property
    def scope(self) -> str:
        return self._scopes[-1] if self._scopes else OTHER

    @property
    def launching(self) -> int:
        return sum(self.counts.values())

    def __enter__(self):
        self._stack = ExitStack()

        def push(module, inputs):
            self._scopes.append(module_category(module) or self.scope)

        def pop(module, inputs, output):
            if self._scopes:
                self._scopes.pop()

        hooks = nn.modules.module
        self._stack.callback(hooks.register_module_forward_pre_hook(push).remove)
        self._stack.callback(hooks.register_module_forward_hook(pop, always_call=True).remove)
        self._stack.enter_context(_Tagging(self))
        return super().__enter__()

    def __exit__(self, *exc):
        result = super().__exit__(*exc)
        self._stack.close()
        self._scopes.clear()
        return result

    def category(self, name: str, args, kwargs) -> str:
        if name in _CONV_OPS:
            return DEPTHWISE if _is_depthwise(name, args) else CONV
        if _is_cast(name, args, kwargs):
            return CASTS
        if "batch_norm" in name:
            return BATCHNORM
        node = torch._C._current_autograd_node()
        if node is not None:  # a backward operation: where its forward ran
            return node.metadata.get(_KEY, OTHER)
        return self.scope

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        if name in self.views:
            return func(*args, **kwargs)
        category = self.category(name, args, kwargs)
        self.counts[category] += 1
        if self.annotate:
            with torch.profiler.record_function(PREFIX + category):
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def kernels_by_category(events) -> dict[str, dict[str, float]]:
    """Kernels (count, device ms) of a `torch.profiler` trace by the ``bench::`` range that
    encloses the operation that launched them (`Categories` with ``annotate``); kernels outside
    every range are ``unattributed``."""
    table: dict[str, dict[str, float]] = {}
    for event in events:
        kernels = getattr(event, "kernels", None)
        if not kernels:
            continue
        parent, category = event, "unattributed"
        while parent is not None:
            if parent.name.startswith(PREFIX):
                category = parent.name[len(PREFIX) :]
                break
            parent = parent.cpu_parent
        row = table.setdefault(category, {"count": 0, "ms": 0.0})
        row["count"] += len(kernels)
        row["ms"] += sum(k.duration for k in kernels) / 1000
    return table
