"""`python -m dbsn.tools.bench --suite gpu --part NAME --out DIR`: what only a GPU shows about the
paper's training step (the network of `speed=fast`: fused cells, T = 4 grouped, batch 64, bf16,
the whole step in a CUDA graph).

Each part writes ``DIR/gpu_<part>.json`` as it goes, so that a part stopped by its time limit
keeps what it had (``tools/gpu_window.sh`` runs them all, each under its own ``timeout``):

profile   the graphed step's ms per step and kernels of one replay; the eager step's kernels by
          what launched them (`dbsn.tools.bench.categories`); the graphed step with ``cudnn.benchmark``.
forms     each convolution form (`dbsn.nets.conv_forms`) at the first stage's shapes, eager, in
          the graphed step for every ``conv_1x1`` × ``depthwise``, under ``torch.compile``, and with
          ``model.execution.weight_copies`` (`dbsn.methods.weight_copies`) in ``COPIES_FORMS``.
compile   the nodes-only regional compile (``compile.scope=nodes``) inside the CUDA graph with the
          fastest compiled forms: warm-up seconds, graphs, recompiles, ms and kernels per step; its
          cache saved to ``DIR/compile_cache.bin`` (``--cache FILE``: a warm start from it).
streams   R = 1..``--runs`` independent graphed steps replayed on one stream and on one stream each.
summary   ``DIR/summary.md``: the tables of docs/performance.md from the parts' JSON.

On a CPU (``--device cpu --tiny``) the parts run the code that needs no CUDA and say
``skipped: no CUDA`` elsewhere: a smoke test of the whole window. Details: docs/performance.md.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import threading
import time
import traceback
from contextlib import contextmanager
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F

from dbsn.tools.bench.common import NETS, _device_name, _sync

PARTS = ("profile", "forms", "compile", "streams")
CONV_1X1 = ("conv", "bmm", "mulsum")
DEPTHWISE = ("conv", "stencil")
#: the whole graphed step's form combinations, the most promising first
STEP_FORMS = (
    ("conv", "conv"),
    ("bmm", "stencil"),
    ("bmm", "conv"),
    ("conv", "stencil"),
    ("mulsum", "stencil"),
    ("mulsum", "conv"),
)
#: the form pairs of the graphed step measured with the convolution weights cast once per step
COPIES_FORMS = (("conv", "conv"), ("bmm", "conv"))
#: kernel names to categories, first match wins (a graph replay's kernels have only their names)
KERNEL_NAMES = [
    ("triton (inductor)", r"^triton_"),
    ("depthwise (native)", r"conv_depthwise2d"),
    ("cuDNN layout transform", r"nchwToNhwc|nhwcToNchw|nchwToNchw|transpose_readWrite|convertTensor|Transpose|permute"),
    ("gemm (linear, bmm)", r"xmma_gemm|cublas|gemv|gemmSN|gemm_kernel|tensorop_\w*gemm|s161616gemm|nvjet"),
    ("cuDNN split-k / reduce", r"splitK|split_k|reduce_wgrad|scalePackedTensor|computeOffsets|kern_precompute"),
    (
        "cuDNN conv",
        r"xmma|cutlass|implicit_convolve|implicit_gemm|fprop|dgrad|wgrad|sm90|sm80|conv2d|convolve|cudnn|"
        r"fft|winograd",
    ),
    ("BatchNorm", r"batch_norm|welford"),
    ("optimiser (foreach, fused)", r"multi_tensor_apply|fused_sgd|fused_adam|FusedSgd|FusedAdam"),
    ("cat / stack", r"CatArrayBatchedCopy|cat_"),
    ("reduction", r"reduce_kernel"),
    ("index / scatter", r"index|scatter|gather"),
    ("copy / cast", r"copy|_to_copy|bfloat16_copy"),
    ("elementwise", r"elementwise_kernel|vectorized|unrolled"),
    ("memset / memcpy", r"^Memset|^Memcpy|memset|memcpy"),
]


class Part:
    """One part's result: a JSON file rewritten after every row, and a progress log."""

    def __init__(self, name: str, out: Path, device: torch.device, tiny: bool) -> None:
        self.name, self.out, self.device, self.tiny = name, out, device, tiny
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / f"gpu_{name}.json"
        self._lock = threading.Lock()
        self.result: dict = {
            "part": name,
            "date": date.today().isoformat(),
            "device": _device_name(device),
            "torch": torch.__version__,
            "tiny": tiny,
            "started": time.strftime("%H:%M:%S"),
        }
        self.save()

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def save(self) -> None:
        with self._lock:
            text = json.dumps(self.result, indent=1, default=str)
            temporary = self.path.with_suffix(".tmp")
            temporary.write_text(text)
            temporary.replace(self.path)  # a part stopped mid-write keeps the last whole file

    @contextmanager
    def progress(self, key: str, every: float = 5.0, **counts):
        """Within the block, ``result[key]`` holds the seconds so far and the values of `counts`'
        callables, saved every `every` seconds (what a part stopped inside one long call had done)."""
        stop, start = threading.Event(), time.perf_counter()

        def watch():
            while not stop.wait(every):
                try:
                    self.result[key] = {
                        "seconds_so_far": round(time.perf_counter() - start, 1),
                        **{name: count() for name, count in counts.items()},
                    }
                    self.save()
                except Exception:  # noqa: BLE001 - the main thread changed the result meanwhile: next time
                    pass

        thread = threading.Thread(target=watch, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            self.result.pop(key, None)

    def log(self, message: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {self.name}: {message}"
        print(line, flush=True)
        with open(self.out / "progress.txt", "a") as f:
            f.write(line + "\n")

    def row(self, table: str, key: str, measure) -> dict:
        """``result[table][key] = measure()``, or ``{"error": ...}`` if it raised (one row's failure
        must not lose the others); saved and logged either way."""
        start = time.perf_counter()
        try:
            value = measure()
        except Exception as error:  # noqa: BLE001 - reported in the row
            value = {"error": f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:300]}"}
            self.log(f"{key}: {traceback.format_exc(limit=-3)}")
        if isinstance(value, dict):
            value.setdefault("seconds_to_measure", round(time.perf_counter() - start, 2))
        self.result.setdefault(table, {})[key] = value
        self.save()
        self.log(f"{key}: {_short(value)}")
        if self.cuda:
            torch.cuda.empty_cache()
        return value


def _short(value) -> str:
    if not isinstance(value, dict):
        return str(value)
    return ", ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
        for k, v in value.items()
        if not isinstance(v, (dict, list))
    )[:300]


def median_ms(run, device: torch.device, reps: int, warm: int = 2) -> float:
    for _ in range(warm):
        run()
    times = []
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        run()
        _sync(device)
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


# ------------------------------------------------------------------------------------------ options
def forms_available() -> str | None:
    """None where ``model.execution.conv_1x1``/``depthwise`` exist, else why not."""
    from dbsn.methods import Execution

    try:
        import dbsn.nets.conv_forms  # noqa: F401
    except ImportError as error:
        return f"not available: {error}"
    if "conv_1x1" not in getattr(Execution, "__dataclass_fields__", {}):
        return "not available: Execution has no conv_1x1"
    return None


def nodes_compile_available() -> str | None:
    """None where ``compile.scope=nodes`` exists, else why not."""
    from dbsn.methods import Compilation

    try:
        Compilation(enabled=True, scope="nodes")
    except (TypeError, ValueError) as error:
        return f"not available: {error}"
    return None


def setting(tiny: bool) -> dict:
    return {"net": "tiny", "batch": 4} if tiny else {"net": "paper", "batch": 64}


def build(
    part: Part,
    conv_1x1: str = "conv",
    depthwise: str = "conv",
    compile=None,
    graph: bool | None = None,
    seed: int = 0,
    weight_copies: bool = False,
):
    """(method, step): DBSN on the part's network with these execution options, and a zero-argument
    training step (`dbsn.tools.bench.gpu.training_step`, bf16; in a CUDA graph on a GPU)."""
    from dbsn.methods import DBSN, Compilation, Execution, Prediction
    from dbsn.nets import StructureNet
    from dbsn.tools.bench.gpu import TRAIN_IMAGES, training_step

    graph = part.cuda if graph is None else graph
    options = {}
    if (conv_1x1, depthwise) != ("conv", "conv"):
        reason = forms_available()
        if reason:
            raise RuntimeError(f"model.execution.conv_1x1/depthwise {reason}")
        options = {"conv_1x1": conv_1x1, "depthwise": depthwise}
    if weight_copies:  # only where asked: an Execution without the field builds the other rows
        options["weight_copies"] = True
    torch.manual_seed(seed)
    size = setting(part.tiny)
    method = DBSN(
        StructureNet(num_classes=10, cell="fused", **NETS[size["net"]]),
        train_samples=4,
        prediction=Prediction(n_samples=100, samples_per_forward=25),
        execution=Execution(channels_last=False, cuda_graph=graph, compile=compile or Compilation(), **options),
    ).to(part.device)
    method.dataset_size = TRAIN_IMAGES
    return method, training_step(method, size["batch"], part.device, "bf16", graph=graph)


# ------------------------------------------------------------------------------------------ kernels
def kernel_name_category(name: str) -> str:
    for category, pattern in KERNEL_NAMES:
        if re.search(pattern, name):
            return category
    return "other"


def kernel_table(run, device: torch.device, top: int = 40) -> dict:
    """Kernels of one call of `run` (`torch.profiler`): count and device ms in all, by name category
    and by name (the `top` longest)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    _sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        _sync(device)
    by_name: dict[str, list] = {}
    for event in prof.events():
        if event.device_type != DeviceType.CUDA:
            continue
        row = by_name.setdefault(event.name, [0, 0.0])
        row[0] += 1
        row[1] += event.time_range.elapsed_us()
    by_category: dict[str, list] = {}
    for name, (n, us) in by_name.items():
        row = by_category.setdefault(kernel_name_category(name), [0, 0.0])
        row[0] += n
        row[1] += us
    names = sorted(by_name.items(), key=lambda item: -item[1][1])[:top]
    return {
        "kernels": sum(n for n, _ in by_name.values()),
        "kernel_ms": sum(us for _, us in by_name.values()) / 1000,
        "by_category": {
            k: {"count": n, "ms": us / 1000} for k, (n, us) in sorted(by_category.items(), key=lambda item: -item[1][1])
        },
        "top_names": [
            {"name": k[:160], "count": n, "ms": us / 1000, "category": kernel_name_category(k)} for k, (n, us) in names
        ],
    }


# ------------------------------------------------------------------------------------------ profile
def part_profile(part: Part, args) -> None:
    if not part.cuda:
        part.result["skipped"] = "no CUDA"
        return

    def graphed(benchmark: bool):
        def measure():
            torch.backends.cudnn.benchmark = benchmark
            try:
                _, step = build(part)
                row = {"ms_per_step": median_ms(step, part.device, reps=10, warm=5)}
                if not benchmark:
                    row.update(kernel_table(step, part.device))
                return row
            finally:
                torch.backends.cudnn.benchmark = False

        return measure

    part.row("steps", "bf16 fused + CUDA graph", graphed(False))
    part.row("steps", "eager, kernels by what launched them", lambda: attributed_kernels(part))
    part.row("steps", "bf16 fused + CUDA graph, cudnn.benchmark", graphed(True))


def attributed_kernels(part: Part) -> dict:
    """The step run eagerly under `Categories` (profiler ranges) and the profiler: kernels and
    kernel-launching operations by category."""
    from torch.profiler import ProfilerActivity, profile

    from dbsn.tools.bench.categories import Categories, kernels_by_category

    _, step = build(part, graph=False)
    step(), step()
    _sync(part.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof, Categories(annotate=True) as ops:
        step()
        _sync(part.device)
    kernels = kernels_by_category(prof.events())
    return {
        "kernels": sum(r["count"] for r in kernels.values()),
        "kernel_ms": sum(r["ms"] for r in kernels.values()),
        "by_category": kernels,
        "launching_ops": ops.launching,
        "ops_by_category": ops.counts,
    }


# ------------------------------------------------------------------------------------------ forms
def _fallback_forms():
    """The forms as `dbsn.nets.conv_forms` computes them, where it is not there."""

    def grouped_1x1(x, weight, groups, form="bmm"):
        b, width, h, w = x.shape
        n, c = groups, width // groups
        if form == "bmm":
            return torch.matmul(weight.view(n, c, c), x.reshape(b, n, c, h * w)).view(b, width, h, w)
        return (x.reshape(b, n, 1, c, h, w) * weight.view(1, n, c, c, 1, 1)).sum(3).view(b, width, h, w)

    def depthwise_stencil(x, weight, dilation=1):
        d, (_, c, h, w) = dilation, x.shape
        padded, out = F.pad(x, (d, d, d, d)), None
        for k, tap in enumerate(weight.reshape(c, 9).unbind(1)):
            i, j = divmod(k, 3)
            term = padded[:, :, i * d : i * d + h, j * d : j * d + w] * tap.view(1, c, 1, 1)
            out = term if out is None else out + term
        return out

    return grouped_1x1, depthwise_stencil


def form_functions() -> dict:
    """name -> (function of (x, weight), weight shape, layout) for each form at the part's shapes."""
    try:
        from dbsn.nets.conv_forms import depthwise_stencil, grouped_1x1

        source = "dbsn.nets.conv_forms"
    except ImportError:
        grouped_1x1, depthwise_stencil = _fallback_forms()
        source = "the bench's copy (dbsn.nets.conv_forms not available)"
    return {"grouped_1x1": grouped_1x1, "depthwise_stencil": depthwise_stencil, "source": source}


def micro_cases(n: int, c: int) -> dict:
    forms = form_functions()
    width, nchw, nhwc = n * c, torch.contiguous_format, torch.channels_last
    cases = {
        "1x1 conv NCHW": (lambda x, w: F.conv2d(x, w, groups=n), (width, c, 1, 1), nchw),
        "1x1 conv channels-last": (lambda x, w: F.conv2d(x, w, groups=n), (width, c, 1, 1), nhwc),
        "1x1 bmm": (lambda x, w: forms["grouped_1x1"](x, w, n, "bmm"), (width, c, 1, 1), nchw),
        "1x1 mulsum": (lambda x, w: forms["grouped_1x1"](x, w, n, "mulsum"), (width, c, 1, 1), nchw),
    }
    for d in (1, 2):
        conv = lambda x, w, d=d: F.conv2d(x, w, padding=d, dilation=d, groups=width)
        cases[f"depthwise dil {d} conv NCHW"] = (conv, (width, 1, 3, 3), nchw)
        cases[f"depthwise dil {d} conv channels-last"] = (conv, (width, 1, 3, 3), nhwc)
        cases[f"depthwise dil {d} stencil"] = (
            lambda x, w, d=d: forms["depthwise_stencil"](x, w, d),
            (width, 1, 3, 3),
            nchw,
        )
    return cases


def micro(part: Part, fn, weight_shape, layout, rows: int, width: int, hw: int, compiled: bool, backend: str) -> dict:
    dtype = torch.bfloat16 if part.cuda else torch.float32
    x = torch.randn(rows, width, hw, hw, device=part.device, dtype=dtype).contiguous(memory_format=layout)
    x.requires_grad_()
    weight = (0.1 * torch.randn(*weight_shape, device=part.device, dtype=dtype)).contiguous(memory_format=layout)
    weight.requires_grad_()
    grad = torch.randn_like(x)
    if compiled:
        fn = torch.compile(fn, backend=backend, dynamic=False)

    def run():
        x.grad = weight.grad = None
        fn(x, weight).backward(grad)

    start = time.perf_counter()
    run()
    _sync(part.device)
    row = {
        "first_call_s": time.perf_counter() - start,
        "ms_fwd_bwd": median_ms(run, part.device, reps=5 if part.tiny else 20, warm=2),
    }
    if part.cuda:
        table = kernel_table(run, part.device, top=4)
        row.update(
            kernels=table["kernels"],
            kernel_ms=table["kernel_ms"],
            top=[(t["name"][:90], t["count"], round(t["ms"], 4)) for t in table["top_names"]],
        )
    return row


def part_forms(part: Part, args) -> None:
    rows, n, c, hw = (8, 2, 4, 8) if part.tiny else (256, 6, 16, 32)
    cases = micro_cases(n, c)
    part.result["shapes"] = {
        "rows": rows,
        "edges": n,
        "channels": c,
        "hw": hw,
        "dtype": "bf16" if part.cuda else "float32",
        "forms_from": form_functions()["source"],
    }
    for name, (fn, shape, layout) in cases.items():
        part.row("eager", name, lambda: micro(part, fn, shape, layout, rows, n * c, hw, False, args.compile_backend))
    available = forms_available()
    for conv_1x1, depthwise in STEP_FORMS:
        key = f"conv_1x1={conv_1x1} depthwise={depthwise}"
        if available and (conv_1x1, depthwise) != ("conv", "conv"):
            part.result.setdefault("steps", {})[key] = {"error": available}
            part.save()
            continue
        part.row("steps", key, lambda: form_step(part, conv_1x1, depthwise))
    for name, (fn, shape, layout) in cases.items():
        part.row("compiled", name, lambda: micro(part, fn, shape, layout, rows, n * c, hw, True, args.compile_backend))
    for conv_1x1, depthwise in COPIES_FORMS:
        key = f"conv_1x1={conv_1x1} depthwise={depthwise}"
        if available and (conv_1x1, depthwise) != ("conv", "conv"):
            part.result.setdefault("copies", {})[key] = {"error": available}
            part.save()
            continue
        part.row("copies", key, lambda: form_step(part, conv_1x1, depthwise, weight_copies=True))


def forms_in(method) -> dict[str, int]:
    """How many of the network's convolutions compute in each form (`dbsn.nets.conv_forms`)."""
    counts: dict[str, int] = {}
    for module in method.modules():
        if hasattr(module, "form"):
            counts[module.form] = counts.get(module.form, 0) + 1
    return counts


def form_step(part: Part, conv_1x1: str, depthwise: str, weight_copies: bool = False) -> dict:
    method, step = build(part, conv_1x1, depthwise, weight_copies=weight_copies)
    row = {
        "ms_per_step": median_ms(step, part.device, reps=3 if part.tiny else 10, warm=2 if part.tiny else 5),
        "graphed": part.cuda,
        "forms": forms_in(method),
    }
    if part.cuda:
        table = kernel_table(step, part.device, top=0)
        row.update(kernels=table["kernels"], kernel_ms=table["kernel_ms"])
    return row


def fastest_forms(out: Path, compiled: bool) -> tuple[str, str] | None:
    """The fastest 1×1 and depthwise forms of the forms part's result in `out` (eager in the graph:
    the whole step's; `compiled`: each form's own under torch.compile); None without one."""
    path = out / "gpu_forms.json"
    if not path.is_file():
        return None
    result = json.loads(path.read_text())
    if not compiled:
        steps = {k: v for k, v in result.get("steps", {}).items() if "ms_per_step" in v}
        if not steps:
            return None
        best = min(steps, key=lambda k: steps[k]["ms_per_step"])
        pairs = dict(item.split("=") for item in best.split())
        return pairs["conv_1x1"], pairs["depthwise"]
    rows = {k: v["ms_fwd_bwd"] for k, v in result.get("compiled", {}).items() if "ms_fwd_bwd" in v}
    one = {form: rows.get(f"1x1 {'conv NCHW' if form == 'conv' else form}") for form in CONV_1X1}
    dw = {
        form: sum(
            rows.get(f"depthwise dil {d} {'conv NCHW' if form == 'conv' else form}") or float("inf") for d in (1, 2)
        )
        for form in DEPTHWISE
    }
    one = {k: v for k, v in one.items() if v is not None}
    if not one:
        return None
    return min(one, key=one.get), min(dw, key=dw.get)


def chosen_forms(part: Part, args, compiled: bool) -> tuple[str, str, str]:
    """(conv_1x1, depthwise, where they came from) for the compile and streams parts."""
    if forms_available():
        return "conv", "conv", f"conv, conv (the forms are {forms_available()})"
    if args.conv_1x1 != "auto" and args.depthwise != "auto":
        return args.conv_1x1, args.depthwise, "given"
    found = fastest_forms(part.out, compiled)
    default = ("bmm", "stencil") if compiled else ("conv", "conv")
    pair = found or default
    conv_1x1 = pair[0] if args.conv_1x1 == "auto" else args.conv_1x1
    depthwise = pair[1] if args.depthwise == "auto" else args.depthwise
    how = "the forms part's fastest" + (" under torch.compile" if compiled else " graphed step") if found else "default"
    return conv_1x1, depthwise, how


# ------------------------------------------------------------------------------------------ compile
def part_compile(part: Part, args) -> None:
    from torch._dynamo.utils import counters

    from dbsn.methods import Compilation

    reason = nodes_compile_available()
    if reason:
        part.result["error"] = f"compile.scope=nodes {reason}"
        return
    conv_1x1, depthwise, how = chosen_forms(part, args, compiled=True)
    part.result.update(
        conv_1x1=conv_1x1,
        depthwise=depthwise,
        forms_chosen=how,
        backend=args.compile_backend,
        warm_start=bool(args.cache),
    )
    if args.cache:
        path = Path(args.cache)
        if not path.is_file():
            part.result["error"] = f"no compile cache at {path} (the cold part did not save one)"
            return
        start = time.perf_counter()
        info = torch.compiler.load_cache_artifacts(path.read_bytes())
        part.result["loaded_cache"] = {
            "bytes": path.stat().st_size,
            "seconds": time.perf_counter() - start,
            "info": str(info)[:300],
        }
        part.save()
    counters.clear()
    compile = (
        Compilation(enabled=True, scope="nodes", backend=args.compile_backend, cache=False)
        if "cache" in getattr(Compilation, "__dataclass_fields__", {})
        else Compilation(enabled=True, scope="nodes", backend=args.compile_backend)
    )
    method, step = build(part, conv_1x1, depthwise, compile=compile)
    part.result["forms"] = forms_in(method)
    warmups = part.result.setdefault("warmup_steps_s", [])
    for i in range(4 if part.cuda else 2):  # three eager warm-ups (the first compiles), then the capture
        start = time.perf_counter()
        with part.progress(f"step {i} running", graphs_so_far=lambda: counters["stats"]["unique_graphs"]):
            step()
            _sync(part.device)
        warmups.append(round(time.perf_counter() - start, 3))
        part.result["graphs_after_step"] = part.result.get("graphs_after_step", []) + [
            counters["stats"]["unique_graphs"]
        ]
        part.save()
        part.log(f"warm-up step {i}: {warmups[-1]:.1f} s, graphs {counters['stats']['unique_graphs']}")
    part.result["compile_s"] = warmups[0]
    part.result["graphs"] = part.result["graphs_after_step"][0]
    part.result["ms_per_step"] = median_ms(step, part.device, reps=3 if part.tiny else 10, warm=1)
    part.result["recompiles"] = counters["stats"]["unique_graphs"] - part.result["graphs"]
    part.save()
    part.log(
        f"{part.result['ms_per_step']:.1f} ms/step, {part.result['graphs']} graphs, "
        f"{part.result['recompiles']} recompiled"
    )
    if part.cuda:
        table = kernel_table(step, part.device, top=20)
        part.result.update(kernels=table["kernels"], kernel_ms=table["kernel_ms"], kernel_table=table)
        part.save()
    try:
        from torch._dynamo.utils import compile_times

        names, values = compile_times(repr="csv", aggregate=True)
        part.result["compile_times"] = dict(zip(names, values))
    except Exception as error:  # noqa: BLE001 - informative only
        part.result["compile_times"] = repr(error)
    if not args.cache:
        artifacts = torch.compiler.save_cache_artifacts()
        if artifacts is None:
            part.result["saved_cache"] = {"error": "nothing to save (a backend without artifacts)"}
        else:
            data, info = artifacts
            (part.out / "compile_cache.bin").write_bytes(data)
            part.result["saved_cache"] = {"bytes": len(data), "info": str(info)[:300]}


# ------------------------------------------------------------------------------------------ streams
@contextmanager
def cuda_generator(generator: torch.Generator | None):
    """Within the block, the default CUDA generator draws from `generator`'s state (a graph
    captured here registers that state and replays from it)."""
    if generator is None:
        yield
        return
    default = torch.cuda.default_generators[generator.device.index or 0]
    saved = default.graphsafe_get_state()
    default.graphsafe_set_state(generator)
    try:
        yield
    finally:
        default.graphsafe_set_state(saved)


def part_streams(part: Part, args) -> None:
    if not part.cuda:
        part.result["skipped"] = "no CUDA"
        return
    conv_1x1, depthwise, how = chosen_forms(part, args, compiled=False)
    part.result.update(conv_1x1=conv_1x1, depthwise=depthwise, forms_chosen=how)
    steps, generators = [], []
    for r in range(args.runs):

        def capture(r=r):
            generator = torch.Generator(device=part.device)
            generator.manual_seed(1000 + r)
            try:
                with cuda_generator(generator):
                    _, step = build(part, conv_1x1, depthwise, seed=r)
                    for _ in range(4):  # three warm-ups and the capture
                        step()
                how = "own"
            except Exception as error:  # noqa: BLE001 - measured with the default generator instead
                how = f"default (own failed: {type(error).__name__}: {str(error)[:200]})"
                _, step = build(part, conv_1x1, depthwise, seed=r)
                for _ in range(4):
                    step()
            _sync(part.device)
            steps.append(step)
            generators.append(how)
            return {"generator": how}

        if "error" in part.row("copies", f"run {r}", capture):
            break
    reps = 10
    for runs in range(1, len(steps) + 1):
        chosen = steps[:runs]
        streams = [torch.cuda.Stream(part.device) for _ in chosen]

        def serial():
            for step in chosen:
                step()

        def parallel():
            main = torch.cuda.current_stream(part.device)
            for stream, step in zip(streams, chosen):
                stream.wait_stream(main)
                with torch.cuda.stream(stream):
                    step()
            for stream in streams:
                main.wait_stream(stream)

        def measure():
            one_stream = median_ms(serial, part.device, reps)
            own_streams = median_ms(parallel, part.device, reps)
            return {
                "serial_ms_per_step_per_run": one_stream / runs,
                "streams_ms_per_step_per_run": own_streams / runs,
                "serial_ms_per_round": one_stream,
                "streams_ms_per_round": own_streams,
                "speedup": one_stream / own_streams,
            }

        part.row("runs", str(runs), measure)


# ------------------------------------------------------------------------------------------ summary
def _load(out: Path, name: str) -> dict:
    path = out / f"gpu_{name}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _cell(row: dict, key: str, fmt: str = "{:.2f}") -> str:
    if not isinstance(row, dict):
        return "-"
    if "error" in row:
        return row["error"][:80]
    value = row.get(key)
    return "-" if value is None else fmt.format(value)


def _row(name: str, row, cells: list[str]) -> str:
    """A markdown row: the cells, or a row's error once, in the first of them."""
    if isinstance(row, dict) and "error" in row:
        cells = [row["error"][:160]] + [""] * (len(cells) - 1)
    return "| " + " | ".join([name, *cells]) + " |"


def headline(parts: dict) -> list[str]:
    """The step's ms per step with each change that was measured, the fastest of each kind."""
    rows = []
    graphed = parts["profile"].get("steps", {}).get("bf16 fused + CUDA graph", {})
    if "ms_per_step" in graphed:
        rows.append(("fused cell + CUDA graph, bf16 (speed=fast)", graphed["ms_per_step"], graphed.get("kernels")))
    steps = {k: v for k, v in parts["forms"].get("steps", {}).items() if "ms_per_step" in v}
    if steps:
        best = min(steps, key=lambda k: steps[k]["ms_per_step"])
        rows.append(
            (
                f"+ the fastest forms, eager in the graph ({best})",
                steps[best]["ms_per_step"],
                steps[best].get("kernels"),
            )
        )
    for name, label in (("compile", "nodes-only compile in the graph"), ("compile_warm", "the same, warm start")):
        row = parts[name]
        if "ms_per_step" in row:
            rows.append(
                (
                    f"{label} (conv_1x1={row.get('conv_1x1')} depthwise={row.get('depthwise')}; first step "
                    f"{row.get('compile_s', 0):.0f} s)",
                    row["ms_per_step"],
                    row.get("kernels"),
                )
            )
    runs = {k: v for k, v in parts["streams"].get("runs", {}).items() if "streams_ms_per_step_per_run" in v}
    if runs:
        best = min(runs, key=lambda k: runs[k]["streams_ms_per_step_per_run"])
        rows.append(
            (f"{best} runs, each graph on its own stream (per run)", runs[best]["streams_ms_per_step_per_run"], None)
        )
    if not rows:
        return []
    lines = ["| the paper step (T = 4, batch 64, bf16) | ms per step | kernels per step |", "|---|---|---|"]
    lines += [f"| {name} | {ms:.1f} | {'-' if kernels is None else f'{kernels:,}'} |" for name, ms, kernels in rows]
    return lines + [""]


def summary(out: Path) -> str:
    """The parts' results in `out` as markdown (docs/performance.md's tables)."""
    parts = {name: _load(out, name) for name in (*PARTS, "compile_warm")}
    smi = (out / "nvidia_smi.txt").read_text().strip() if (out / "nvidia_smi.txt").is_file() else ""
    first = next((p for p in parts.values() if p), {})
    gpu = smi.splitlines()[1].split(",")[0].strip() if len(smi.splitlines()) > 1 else first.get("device", "?")
    lines = [
        f"# GPU window: {first.get('date', date.today().isoformat())} on {gpu}, torch {first.get('torch', '?')}",
        "",
        "`tools/gpu_window.sh` (`python -m dbsn.tools.bench --suite gpu --part ...`): the paper network, "
        "T = 4, batch 64, bf16" + (" (tiny smoke test)" if first.get("tiny") else "") + ".",
        "",
    ]
    if smi:
        lines += ["```", smi, "```", ""]
    lines += headline(parts)
    rc = (out / "rc.txt").read_text().split() if (out / "rc.txt").is_file() else []
    if rc:
        lines += ["Exit status of each part (124: stopped by its time limit): " + ", ".join(rc), ""]
    profile = parts["profile"]
    lines += ["## Profile: the graphed step (`speed=fast`)", ""]
    if profile.get("skipped"):
        lines += [f"skipped: {profile['skipped']}", ""]
    steps = profile.get("steps", {})
    if steps:
        lines += ["| step | ms per step | kernels | kernel ms |", "|---|---|---|---|"]
        for name, row in steps.items():
            lines.append(
                _row(
                    name,
                    row,
                    [
                        _cell(row, "ms_per_step", "{:.1f}"),
                        _cell(row, "kernels", "{:,}"),
                        _cell(row, "kernel_ms", "{:.1f}"),
                    ],
                )
            )
        lines.append("")
        graphed = steps.get("bf16 fused + CUDA graph", {})
        if graphed.get("by_category"):
            lines += ["| kernels of one replay, by name | count | ms |", "|---|---|---|"]
            lines += [f"| {k} | {v['count']:,} | {v['ms']:.2f} |" for k, v in graphed["by_category"].items()]
            lines.append("")
        attributed = steps.get("eager, kernels by what launched them", {})
        if attributed.get("by_category"):
            lines += [
                "| kernels of one eager step, by what launched them | kernels | ms | launching ops |",
                "|---|---|---|---|",
            ]
            ops = attributed.get("ops_by_category", {})
            for k, v in sorted(attributed["by_category"].items(), key=lambda item: -item[1]["count"]):
                lines.append(f"| {k} | {v['count']:,} | {v['ms']:.2f} | {ops.get(k, '-')} |")
            lines.append("")
    forms = parts["forms"]
    lines += ["## Convolution forms", ""]
    if forms.get("shapes"):
        s = forms["shapes"]
        lines += [
            f"Forward + backward at {s['rows']} rows, {s['edges']} edges × {s['channels']} channels, "
            f"{s['hw']}², {s['dtype']} (forms from {s['forms_from']}).",
            "",
            "| form | eager ms | kernels | compiled ms | kernels |",
            "|---|---|---|---|---|",
        ]
        for name, row in forms.get("eager", {}).items():
            comp = forms.get("compiled", {}).get(name, {"error": "not run"})
            lines.append(
                _row(
                    name,
                    {},
                    [
                        _cell(row, "ms_fwd_bwd", "{:.3f}"),
                        _cell(row, "kernels", "{:,}"),
                        _cell(comp, "ms_fwd_bwd", "{:.3f}"),
                        _cell(comp, "kernels", "{:,}"),
                    ],
                )
            )
        lines.append("")
    if forms.get("steps"):
        lines += ["| whole step (forms eager in the graph) | ms per step | kernels |", "|---|---|---|"]
        for name, row in forms["steps"].items():
            lines.append(_row(name, row, [_cell(row, "ms_per_step", "{:.1f}"), _cell(row, "kernels", "{:,}")]))
        lines.append("")
    if forms.get("copies"):
        lines += [
            "| whole step with weight_copies=true | ms per step | kernels | without: ms per step |",
            "|---|---|---|---|",
        ]
        for name, row in forms["copies"].items():
            plain = forms.get("steps", {}).get(name, {})
            cells = [_cell(row, "ms_per_step", "{:.1f}"), _cell(row, "kernels", "{:,}")]
            lines.append(_row(name, row, [*cells, _cell(plain, "ms_per_step", "{:.1f}")]))
        lines.append("")
    lines += ["## Nodes-only compile inside the graph", ""]
    rows = [("cold", parts["compile"]), ("warm (cache loaded)", parts["compile_warm"])]
    lines += [
        "| start | forms | first step s (compile) | graphs | recompiled | ms per step | kernels |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in rows:
        if not row:
            lines.append(f"| {name} | not run | | | | | |")
            continue
        if "error" in row and "ms_per_step" not in row:
            lines.append(_row(name, row, [""] * 6))
            continue
        running = next((key for key in row if key.endswith(" running")), None)
        if running and "ms_per_step" not in row:
            where = row[running]
            lines.append(
                _row(
                    name,
                    {
                        "error": f"stopped while {running}: {where.get('seconds_so_far')} s, "
                        f"{where.get('graphs_so_far')} graphs so far; warm-up steps "
                        f"{row.get('warmup_steps_s', [])} s"
                    },
                    [""] * 6,
                )
            )
            continue
        lines.append(
            _row(
                name,
                {},
                [
                    f"{row.get('conv_1x1', '?')}, {row.get('depthwise', '?')}",
                    f"{row.get('compile_s', '-')}",
                    f"{row.get('graphs', '-')}",
                    f"{row.get('recompiles', '-')}",
                    _cell(row, "ms_per_step", "{:.1f}"),
                    _cell(row, "kernels", "{:,}"),
                ],
            )
        )
    if parts["compile"].get("saved_cache", {}).get("bytes"):
        lines.append(f"\nCompile cache saved: {parts['compile']['saved_cache']['bytes'] / 2**20:.1f} MiB.")
    lines.append("")
    streams = parts["streams"]
    lines += ["## CUDA graphs on streams (R independent runs)", ""]
    if streams.get("skipped"):
        lines += [f"skipped: {streams['skipped']}", ""]
    if streams.get("runs"):
        lines += [
            f"Forms {streams.get('conv_1x1')}, {streams.get('depthwise')}; generators: "
            + ", ".join(str(v.get("generator", v.get("error"))) for v in streams.get("copies", {}).values()),
            "",
            "| R | one stream: ms per step per run | own streams: ms per step per run | speed-up |",
            "|---|---|---|---|",
        ]
        for runs, row in streams["runs"].items():
            lines.append(
                _row(
                    runs,
                    row,
                    [
                        _cell(row, "serial_ms_per_step_per_run", "{:.1f}"),
                        _cell(row, "streams_ms_per_step_per_run", "{:.1f}"),
                        _cell(row, "speedup", "{:.2f}"),
                    ],
                )
            )
        lines.append("")
    return "\n".join(lines)


def short_summary(out: Path) -> str:
    """A few lines for the end of the window's output."""
    parts = {name: _load(out, name) for name in (*PARTS, "compile_warm")}
    lines = []
    steps = parts["profile"].get("steps", {})
    for name, row in steps.items():
        lines.append(f"profile | {name}: {_short(row)[:160]}")
    if parts["profile"].get("skipped"):
        lines.append(f"profile: skipped: {parts['profile']['skipped']}")
    for name, row in parts["forms"].get("steps", {}).items():
        lines.append(
            f"forms | step {name}: "
            + (
                row["error"][:100]
                if "error" in row
                else f"{_cell(row, 'ms_per_step', '{:.1f}')} ms, {_cell(row, 'kernels', '{}')} kernels"
            )
        )
    for name in ("compile", "compile_warm"):
        row = parts[name]
        running = next((key for key in row if key.endswith(" running")), None)
        if running and "ms_per_step" not in row:
            lines.append(f"{name}: stopped while {running}: {row[running]}")
        elif row:
            lines.append(
                f"{name}: "
                + (
                    "error: " + row["error"]
                    if "error" in row
                    else f"first step {row.get('compile_s', '?')} s, graphs {row.get('graphs', '?')}, "
                    f"recompiled {row.get('recompiles', '?')}, "
                    f"{_cell(row, 'ms_per_step', '{:.1f}')} ms/step"
                )
            )
    for runs, row in parts["streams"].get("runs", {}).items():
        if "error" in row:
            lines.append(f"streams R={runs}: {row['error'][:100]}")
            continue
        lines.append(
            f"streams R={runs}: {_cell(row, 'serial_ms_per_step_per_run', '{:.1f}')} serial / "
            f"{_cell(row, 'streams_ms_per_step_per_run', '{:.1f}')} on streams ms per step per run"
        )
    if parts["streams"].get("skipped"):
        lines.append(f"streams: skipped: {parts['streams']['skipped']}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ main
def main(args) -> dict:
    """Run one part (`args.part`) from `dbsn.tools.bench`'s parsed arguments."""
    out = Path(args.out or os.environ.get("OUT") or "bench_out")
    if args.part == "summary":
        text = summary(out)
        (out / "summary.md").write_text(text + "\n")
        print(short_summary(out))
        return {"summary": text}
    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    name = "compile_warm" if args.part == "compile" and args.cache else args.part
    part = Part(name, out, device, args.tiny)
    part.log(f"on {part.result['device']}, torch {torch.__version__}")
    run = {"profile": part_profile, "forms": part_forms, "compile": part_compile, "streams": part_streams}[args.part]
    try:
        run(part, args)
    except Exception as error:  # noqa: BLE001 - the part's JSON says what stopped it
        part.result["error"] = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:300]}"
        part.log(traceback.format_exc())
    part.result["finished"] = time.strftime("%H:%M:%S")
    part.save()
    part.log("done" + (f" ({part.result['skipped']})" if "skipped" in part.result else ""))
    return part.result
