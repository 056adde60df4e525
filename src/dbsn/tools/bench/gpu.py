"""`python -m dbsn.tools.bench --suite gpu`: the paper's CIFAR training step on one GPU, configuration by
configuration, and what 100 epochs of it would take.

The paper network (B = 7, 12 cells) at T = 4, batch 64, in each configuration of `CONFIGS` (fp32 or
bf16; the per-edge reference cell or the fused cell, `dbsn.nets.fused_cell`; eager, the whole step
in a CUDA graph, `dbsn.methods.step.GraphedStep`, or compiled cells), the T structures in one
grouped forward (``--chunked`` adds them one after another). A step is what
`Method.training_step` does on a batch: on-device augmentation, the structure draw, forward and
backward, clipping, both optimisers, the BatchNorm update and the NaN guard. For each: seconds per
step (median after warm-up), peak memory, the warm-up's seconds, kernels and host launches per
step (`torch.profiler`), the projected 100 epochs (100 x 781 steps plus the S = 100 test pass), and
the FLOP/s achieved against the same GPU's dense matmul in the same run; then the S = 100
ensemble's images/s per configuration and (``--segmentation yes``) a CamVid step. `--configs` runs
a subset, `--json` accumulates results over calls. On a CPU the same code runs a small setting
(`--net tiny --batch 4 --steps 2`; the CUDA-graph rows say they need a GPU). Results and how long
the suite takes: docs/performance.md.
"""

from __future__ import annotations

import json
import statistics
import time
from contextlib import nullcontext
from datetime import date
from pathlib import Path

import torch

from dbsn.data.augment import crop_offsets, flip_draws, normalize, random_crop, random_hflip, to_unit_range
from dbsn.evaluation.cost import flop_counter_mode
from dbsn.methods import DBSN, Compilation, Execution, Prediction
from dbsn.methods.step import GraphedStep
from dbsn.nets import StructureNet
from dbsn.tools.bench.common import NETS, _device_name, _sync, timed_call

#: configuration: (precision, cell, how the step runs: eager | graph | compile)
CONFIGS = {
    "fp32 eager per-edge": ("fp32", "per_edge", "eager"),
    "bf16 eager per-edge": ("bf16", "per_edge", "eager"),
    "bf16 eager fused": ("bf16", "fused", "eager"),
    "bf16 fused + CUDA graph": ("bf16", "fused", "graph"),
    "fp32 fused + CUDA graph": ("fp32", "fused", "graph"),
    "bf16 fused + compiled cells": ("bf16", "fused", "compile"),
}
CHUNKS = {"grouped": None, "chunked": 1}  # train_samples_per_forward
#: the paper's CIFAR run: 100 epochs of 50,000 images in batches of 64 (the last one dropped)
EPOCHS, TRAIN_IMAGES, TEST_IMAGES, TEST_SAMPLES = 100, 50_000, 10_000, 100
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def _autocast(device: torch.device, precision: str, cache: bool = True):
    """bf16 autocast (`cache`: autocast's cast cache, which a CUDA graph's capture turns off; warm-ups
    of a graphed step run without it too, so that a compiled region sees one autocast state)."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=cache)
    return nullcontext()


def build_method(
    net_name: str,
    device: torch.device,
    cell: str,
    mode: str,
    chunk: int | None,
    train_samples: int = 4,
    samples_per_forward: int = 25,
    backend: str = "inductor",
    graph_prediction: bool = False,
) -> DBSN:
    torch.manual_seed(0)
    compile = Compilation(enabled=True, scope="cells", backend=backend) if mode == "compile" else Compilation()
    method = DBSN(
        StructureNet(num_classes=10, cell=cell, **NETS[net_name]),
        train_samples=train_samples,
        train_samples_per_forward=chunk,
        prediction=Prediction(n_samples=100, samples_per_forward=samples_per_forward),
        execution=Execution(
            channels_last=False, compile=compile, cuda_graph=mode == "graph", cuda_graph_prediction=graph_prediction
        ),
    ).to(device)
    method.dataset_size = TRAIN_IMAGES
    return method


def training_step(method: DBSN, batch: int, device: torch.device, precision: str, graph: bool = False):
    """A zero-argument callable: one training step from a uint8 batch on the device, as
    `Method.training_step` runs it (eagerly, or captured in a CUDA graph with `graph`)."""
    images = torch.randint(0, 256, (batch, 3, 32, 32), dtype=torch.uint8, device=device)
    labels = torch.randint(0, 10, (batch,), device=device)
    mean, std = (torch.tensor(v, device=device) for v in (CIFAR_MEAN, CIFAR_STD))
    groups = method.weight_parameter_groups()
    weights = [method.optim.build(group, EPOCHS, method.no_decay_parameters(), capturable=graph)[0] for group in groups]
    opts = [*weights, method.structure_optimizer().build(method.structure_parameters(), capturable=graph)]
    method.attach_guard(opts)
    method.train()

    def backward(loss, last):
        loss.backward()

    def body(x, y):
        return method.step_body(x, y, opts, weights, backward)

    def zero():
        for opt in opts:
            opt.zero_grad(set_to_none=True)

    run = GraphedStep(body, zero) if graph else None

    def step():
        x = to_unit_range(images)  # the paper's augmentation, batched on the device
        x = random_hflip(random_crop(x, 4, crop_offsets(batch, 4, device)), flip_draws(batch, device))
        x = normalize(x, mean, std)
        with _autocast(device, precision, cache=run is None):
            if run is not None:
                run(x, labels)
            else:
                zero()
                body(x, labels)
        method.on_after_optimizer_step(batch)

    return step


def kernel_counts(run, device: torch.device) -> dict[str, int] | None:
    """Kernels one call of `run` executes on the GPU and the launches the host makes for them
    (kernel launches and graph launches; `torch.profiler`); None on a CPU."""
    if device.type != "cuda":
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize(device)
    events = prof.events()
    kernels = sum(1 for e in events if e.device_type == DeviceType.CUDA)
    launches = sum(
        1
        for e in events
        if e.device_type == DeviceType.CPU
        and e.name
        in (
            "cudaLaunchKernel",
            "cudaLaunchKernelExC",
            "cuLaunchKernel",
            "cuLaunchKernelEx",
            "cudaGraphLaunch",
            "cudaLaunchCooperativeKernel",
        )
    )
    return {"kernels": kernels, "launches": launches}


def _error_text(error: Exception) -> str:
    """A failed configuration's row: the exception's type and the first line of its message."""
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:300]}"


def _timed(run, device: torch.device, steps: int) -> tuple[float, float]:
    """(median seconds per call, peak memory in MiB over the timed calls)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = [timed_call(run, device) for _ in range(steps)]
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else float("nan")
    return statistics.median(times), peak


def count_flops(run) -> int:
    """Convolution and matmul FLOPs of one call (torch's FlopCounterMode, grouped convolutions'
    backward counted right: `dbsn.evaluation.cost.flop_counter_mode`)."""
    with flop_counter_mode() as counter:
        run()
    return int(counter.get_total_flops())


def matmul_flops_per_second(device: torch.device, dtype: torch.dtype, n: int, repeats: int = 10) -> float:
    """Dense n x n x n matmul FLOP/s of this device in `dtype` (median of `repeats`)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm-up
    seconds, _ = _timed(lambda: a @ b, device, repeats)
    return 2 * n**3 / seconds


def projected_hours(seconds_per_step: float, batch: int, prediction_images_per_second: float | None) -> float:
    """100 epochs of the paper's CIFAR run at this step time, plus the final S = 100 test pass."""
    steps = EPOCHS * (TRAIN_IMAGES // batch)
    test = TEST_IMAGES / prediction_images_per_second if prediction_images_per_second else 0.0
    return (steps * seconds_per_step + test) / 3600


def prediction_rate(method: DBSN, device: torch.device, precision: str, batch: int, steps: int) -> float:
    """Images/s of the S = 100 Bayes ensemble (the method's samples_per_forward per forward)."""
    x = torch.randn(batch, 3, 32, 32, device=device)
    method.eval()

    def predict():
        with torch.inference_mode(), _autocast(device, precision):
            method.predict_log_probs(x, TEST_SAMPLES)

    predict()
    seconds, _ = _timed(predict, device, steps)
    method.train()
    return batch / seconds


def camvid_step(
    device: torch.device,
    precision: str,
    cell: str,
    steps: int,
    size: int = 224,
    batch: int = 3,
    net_kwargs: dict | None = None,
) -> dict:
    """One DBSN-seg training step (T = 1) on `batch` crops, eager: seconds and peak MiB."""
    from dbsn.methods.tasks import Segmentation
    from dbsn.nets import DBSNSegNet

    torch.manual_seed(0)
    method = DBSN(
        DBSNSegNet(cell=cell, **(net_kwargs or {})),
        train_samples=1,
        task=Segmentation(),
        parallel="data",
        execution=Execution(channels_last=False),
    ).to(device)
    method.dataset_size = 367  # CamVid's training images
    x = torch.randn(batch, 3, size, size, device=device)
    y = torch.randint(0, 11, (batch, size, size), device=device)
    opts = [method.optim.build(g, 850, method.no_decay_parameters())[0] for g in method.weight_parameter_groups()]
    opts.append(method.structure_optimizer().build(method.structure_parameters()))

    def step():
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        with _autocast(device, precision):
            method.accumulate_gradients(x, y, lambda loss, last: loss.backward())
        for opt in opts:
            opt.step()

    step(), step()  # warm-up (and compilation)
    seconds, peak = _timed(step, device, steps)
    return {"seconds": seconds, "peak_mib": peak}


def run_suite(
    net: str = "paper",
    batch: int = 64,
    steps: int = 10,
    warmup: int = 5,
    device: str = "auto",
    configs: list[str] | None = None,
    backend: str = "inductor",
    samples_per_forward: int = 25,
    prediction_batch: int = 64,
    camvid: bool = False,
    camvid_size: int = 224,
    camvid_batch: int = 3,
    camvid_kwargs: dict | None = None,
    budget_minutes: float = 4.0,
    previous: dict | None = None,
    on_result=None,
    chunks: tuple[str, ...] = ("grouped",),
) -> dict:
    """Measure each configuration (see the module docstring); `previous` results are kept and not
    re-measured, `on_result(result)` is called after each measurement (to save partial results)."""
    dev = torch.device(
        "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
    )
    started = time.perf_counter()
    result = previous or {}
    result.update(
        {
            "date": date.today().isoformat(),
            "device": _device_name(dev),
            "torch": torch.__version__,
            "net": net,
            "batch": batch,
            "train_samples": 4,
            "steps": steps,
            "backend": backend,
        }
    )
    rows = result.setdefault("training", {})
    peaks = result.setdefault("matmul_flops_per_second", {})
    matmul_n = 8192 if dev.type == "cuda" else 512
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        if precision not in peaks:
            peaks[precision] = matmul_flops_per_second(dev, dtype, matmul_n)
    flops = result.setdefault("flops_per_step", {})
    for chunk_name in chunks:
        chunk = CHUNKS[chunk_name]
        if chunk_name not in flops:
            method = build_method(net, dev, "fused", "eager", chunk, samples_per_forward=samples_per_forward)
            step = training_step(method, batch, dev, "fp32")
            step()
            flops[chunk_name] = count_flops(step)
            del method, step

    def save():
        result["minutes"] = result.get("minutes", 0.0) + (time.perf_counter() - save.last) / 60
        save.last = time.perf_counter()
        if on_result is not None:
            on_result(result)

    save.last = started

    prediction = result.setdefault("prediction_images_per_second", {})
    for name in configs or list(CONFIGS):
        precision, cell, mode = CONFIGS[name]
        for chunk_name in chunks:
            chunk = CHUNKS[chunk_name]
            key = f"{name} | {chunk_name}"
            if key in rows and "error" not in rows[key]:
                continue
            if (time.perf_counter() - started) / 60 > budget_minutes:
                rows[key] = {"error": f"not run: the suite's {budget_minutes:g}-minute budget was spent"}
                continue
            if mode == "graph" and dev.type != "cuda":
                rows[key] = {"error": "needs a CUDA device"}
                continue
            method = step = None
            try:
                method = build_method(
                    net, dev, cell, mode, chunk, backend=backend, samples_per_forward=samples_per_forward
                )
                step = training_step(method, batch, dev, precision, graph=mode == "graph")
                warm_start = time.perf_counter()
                for _ in range(warmup):
                    step()
                _sync(dev)
                warm = time.perf_counter() - warm_start
                seconds, peak = _timed(step, dev, steps)
                rows[key] = {
                    "steps_per_second": 1 / seconds,
                    "seconds_per_step": seconds,
                    "peak_mib": peak,
                    "warmup_seconds": warm,
                    "flops_per_second": flops[chunk_name] / seconds,
                    "fraction_of_matmul_peak": flops[chunk_name] / seconds / peaks[precision],
                }
                counts = kernel_counts(step, dev)
                if counts is not None:
                    rows[key].update(counts)
                if (
                    chunk_name == "grouped" and name not in prediction and mode != "compile"
                ):  # the ensemble does not chunk T
                    prediction_steps = max(2, steps // 5)
                    prediction[name] = prediction_rate(method, dev, precision, prediction_batch, prediction_steps)
                    if mode == "graph":  # the same members' forwards replayed from CUDA graphs
                        twin = build_method(
                            net,
                            dev,
                            cell,
                            "eager",
                            chunk,
                            samples_per_forward=samples_per_forward,
                            graph_prediction=True,
                        )
                        twin.load_state_dict(method.state_dict())
                        prediction[f"{name}, graphed prediction"] = prediction_rate(
                            twin, dev, precision, prediction_batch, prediction_steps
                        )
                        del twin
            except Exception as error:  # one configuration's failure must not lose the others
                rows[key] = {"error": _error_text(error)}
            finally:
                method = step = None
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            save()
    for key, row in rows.items():
        if "error" not in row:
            name = key.split(" | ")[0]
            row["projected_hours_100_epochs"] = projected_hours(row["seconds_per_step"], batch, prediction.get(name))
    if camvid and "camvid" not in result:
        result["camvid"] = {}
        for name in ("bf16 eager per-edge", "bf16 eager fused"):
            precision, cell, _ = CONFIGS[name]
            try:
                result["camvid"][name] = camvid_step(
                    dev, precision, cell, max(2, steps // 4), camvid_size, camvid_batch, camvid_kwargs
                )
            except Exception as error:
                result["camvid"][name] = {"error": _error_text(error)}
        save()
    return result


def markdown(result: dict) -> str:
    """The suite's result as the markdown table of docs/performance.md."""
    lines = [
        f"Measured {result['date']} on {result['device']}, torch {result['torch']}: the {result['net']} "
        f"network, T = {result['train_samples']}, batch {result['batch']}, median of {result['steps']} steps "
        f"(`python -m dbsn.tools.bench --suite gpu`).",
        "",
        "| configuration | T structures | ms per step | kernels / launches per step | warm-up s | peak GiB | "
        "100 epochs (h) | TFLOP/s | of matmul peak |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, row in result["training"].items():
        name, chunk = key.split(" | ")
        if "error" in row:
            lines.append(f"| {name} | {chunk} | {row['error']} | | | | | | |")
            continue
        kernels = f"{row['kernels']:,} / {row['launches']:,}" if "kernels" in row else "-"
        lines.append(
            f"| {name} | {chunk} | {1000 * row['seconds_per_step']:.1f} | {kernels} | {row['warmup_seconds']:.0f} | "
            f"{row['peak_mib'] / 1024:.1f} | {row.get('projected_hours_100_epochs', float('nan')):.2f} | "
            f"{row['flops_per_second'] / 1e12:.2f} | {100 * row['fraction_of_matmul_peak']:.1f} % |"
        )
    peaks = result["matmul_flops_per_second"]
    lines += [
        "",
        f"Dense matmul peak measured in the same run: fp32 {peaks['fp32'] / 1e12:.1f} TFLOP/s, "
        f"bf16 {peaks['bf16'] / 1e12:.1f} TFLOP/s. FLOPs per step (convolutions and matmuls): "
        + ", ".join(f"{k} {v / 1e9:.0f} GFLOP" for k, v in result["flops_per_step"].items())
        + ".",
        "",
    ]
    if result.get("prediction_images_per_second"):
        lines += ["| prediction, S = 100 | images/s |", "|---|---|"]
        lines += [f"| {name} | {rate:.1f} |" for name, rate in result["prediction_images_per_second"].items()]
        lines.append("")
    if result.get("camvid"):
        lines += ["| CamVid DBSN step (3 x 224², T = 1) | seconds | peak GiB |", "|---|---|---|"]
        for name, row in result["camvid"].items():
            lines.append(
                f"| {name} | {row['error']} | |"
                if "error" in row
                else f"| {name} | {row['seconds']:.3f} | {row['peak_mib'] / 1024:.2f} |"
            )
    return "\n".join(lines)


def main(args) -> dict:
    """Run the suite from `dbsn.tools.bench`'s parsed arguments (`--suite gpu`)."""
    path = Path(args.json) if args.json else None
    previous = json.loads(path.read_text()) if path is not None and path.is_file() else None

    def save(result: dict) -> None:
        if path is not None:
            path.write_text(json.dumps(result, indent=2))

    configs = [c.strip() for c in args.configs.split(",")] if args.configs else None
    unknown = [c for c in configs or [] if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; choose from {list(CONFIGS)}")
    result = run_suite(
        args.net or "paper",
        args.batch,
        args.steps,
        device=args.device,
        configs=configs,
        backend=args.compile_backend,
        prediction_batch=args.prediction_batch,
        previous=previous,
        on_result=save,
        camvid=args.segmentation == "yes",
        chunks=("grouped", "chunked") if args.chunked else ("grouped",),
        budget_minutes=args.budget_minutes,
    )
    save(result)
    print(markdown(result))
    return result
