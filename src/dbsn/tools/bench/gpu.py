"""`python -m dbsn.tools.bench --suite gpu`: the paper's CIFAR training step on one GPU, configuration by
configuration, and what 100 epochs of it would take.

The paper network (B = 7, 12 cells, 1.04 M parameters) at T = 4, batch 64, in each configuration

    fp32 eager | bf16 | bf16 + channels-last | bf16 + channels-last + compile
    (| bf16 + channels-last + compile with CUDA graphs, "reduce-overhead")

each with the T structures in one grouped forward and one after another (structure chunks of 1).
A step here is what `Method.training_step` does on a batch: the on-device
augmentation of a uint8 batch (`data.on_device`), the structure draw, the forward and backward
passes under the configuration's precision, gradient clipping and both optimisers. For each:

- steps/s (median of timed steps after warm-up and compilation) and peak GPU memory;
- the projected time of the paper's 100 epochs: 100 x 781 steps of 64 images, plus the final
  test pass (10,000 images, S = 100) at the measured prediction rate;
- the FLOP/s achieved (convolution and matmul FLOPs of one step, counted by torch's
  `FlopCounterMode`) against the dense-matmul FLOP/s of the same GPU measured in the same run, in
  the configuration's precision.

Then the S = 100 Bayes ensemble's images/s (fp32 eager and the fastest training configuration's
settings) and one CamVid DBSN training step (3 crops of 224 x 224, T = 1).

The whole suite is meant to finish within 20 minutes; `--configs` runs a subset, and `--json`
accumulates results over several calls (a machine that limits each command's time). On a CPU it
runs the same code on a small setting (the tests: `--net tiny --batch 4 --steps 2`): that is how the tests
exercise it.
"""

from __future__ import annotations

import json
import statistics
import time
from contextlib import nullcontext
from datetime import date
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from dbsn.precision import cpu_bf16_channels_last_is_wrong
from dbsn.tools.bench.common import NETS, _device_name, _sync, timed_call
from dbsn.data.augment import crop_offsets, flip_draws, normalize, random_crop, random_hflip, to_unit_range
from dbsn.methods import DBSN, Compilation, Execution, Prediction
from dbsn.nets import StructureNet

#: configuration: (precision, channels_last, compile mode or None)
CONFIGS = {
    "fp32 eager": ("fp32", False, None),
    "bf16": ("bf16", False, None),
    "bf16 + channels-last": ("bf16", True, None),
    "bf16 + channels-last + compile": ("bf16", True, "default"),
    "bf16 + channels-last + compile (CUDA graphs)": ("bf16", True, "reduce-overhead"),
}
CHUNKS = {"grouped": None, "chunked": 1}  # train_samples_per_forward
#: the paper's CIFAR run: 100 epochs of 50,000 images in batches of 64 (the last one dropped)
EPOCHS, TRAIN_IMAGES, TEST_IMAGES, TEST_SAMPLES = 100, 50_000, 10_000, 100
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def _autocast(device: torch.device, precision: str):
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def build_method(net_name: str, device: torch.device, channels_last: bool, compile_mode: str | None,
                 chunk: int | None, train_samples: int = 4, samples_per_forward: int = 25,
                 backend: str = "inductor") -> DBSN:
    torch.manual_seed(0)
    compile = Compilation(enabled=True, mode=compile_mode if backend == "inductor" else "default",
                          backend=backend) if compile_mode else None
    method = DBSN(StructureNet(num_classes=10, **NETS[net_name]), train_samples=train_samples,
                  train_samples_per_forward=chunk, prediction=Prediction(n_samples=100, samples_per_forward=samples_per_forward),
                  execution=Execution(channels_last=channels_last, compile=compile or Compilation())).to(device)
    method.dataset_size = TRAIN_IMAGES
    return method


def training_step(method: DBSN, batch: int, device: torch.device, precision: str):
    """A zero-argument callable: one training step from a uint8 batch on the device."""
    images = torch.randint(0, 256, (batch, 3, 32, 32), dtype=torch.uint8, device=device)
    labels = torch.randint(0, 10, (batch,), device=device)
    mean, std = (torch.tensor(v, device=device) for v in (CIFAR_MEAN, CIFAR_STD))
    groups = method.weight_parameter_groups()
    opts = [method.optim.build(group, EPOCHS, method.no_decay_parameters())[0] for group in groups]
    opts.append(method.structure_optimizer().build(method.structure_parameters()))
    method.train()

    def step():
        x = to_unit_range(images)  # the paper's augmentation, batched on the device
        x = random_hflip(random_crop(x, 4, crop_offsets(batch, 4, device)), flip_draws(batch, device))
        x = normalize(x, mean, std)
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        with _autocast(device, precision):
            method.accumulate_gradients(x, labels, lambda loss, last: loss.backward())
        for group in groups:
            torch.nn.utils.clip_grad_norm_(group, 5.0)
        for opt in opts:
            opt.step()
        method.on_after_optimizer_step(batch)
    return step


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
    """Convolution and matmul FLOPs of one call (torch's FlopCounterMode)."""
    with FlopCounterMode(display=False) as counter:
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


def camvid_step(device: torch.device, precision: str, channels_last: bool, compile_mode: str | None,
                steps: int, size: int = 224, batch: int = 3, backend: str = "inductor",
                net_kwargs: dict | None = None) -> dict:
    """One DBSN-seg training step (T = 1) on `batch` crops: seconds and peak MiB."""
    from dbsn.methods.tasks import Segmentation
    from dbsn.nets import DBSNSegNet

    torch.manual_seed(0)
    compile = Compilation(enabled=True, mode=compile_mode if backend == "inductor" else "default",
                          backend=backend) if compile_mode else None
    method = DBSN(DBSNSegNet(**(net_kwargs or {})), train_samples=1, task=Segmentation(), parallel="data",
                  execution=Execution(channels_last=channels_last, compile=compile or Compilation())).to(device)
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


def run_suite(net: str = "paper", batch: int = 64, steps: int = 20, warmup: int = 3, device: str = "auto",
              configs: list[str] | None = None, backend: str = "inductor", samples_per_forward: int = 25,
              prediction_batch: int = 64, camvid: bool = True, camvid_size: int = 224, camvid_batch: int = 3,
              camvid_kwargs: dict | None = None, budget_minutes: float = 20.0, previous: dict | None = None, on_result=None) -> dict:
    """Measure each configuration (see the module docstring); `previous` results are kept and not
    re-measured, `on_result(result)` is called after each measurement (to save partial results)."""
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device))
    started = time.perf_counter()
    result = previous or {}
    result.update({"date": date.today().isoformat(), "device": _device_name(dev), "torch": torch.__version__,
                   "net": net, "batch": batch, "train_samples": 4, "steps": steps, "backend": backend})
    rows = result.setdefault("training", {})
    peaks = result.setdefault("matmul_flops_per_second", {})
    matmul_n = 8192 if dev.type == "cuda" else 512
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        if precision not in peaks:
            peaks[precision] = matmul_flops_per_second(dev, dtype, matmul_n)
    flops = result.setdefault("flops_per_step", {})
    for chunk_name, chunk in CHUNKS.items():
        if chunk_name not in flops:
            method = build_method(net, dev, False, None, chunk, samples_per_forward=samples_per_forward)
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
        precision, channels_last, compile_mode = CONFIGS[name]
        for chunk_name, chunk in CHUNKS.items():
            key = f"{name} | {chunk_name}"
            if key in rows and "error" not in rows[key]:
                continue
            if (time.perf_counter() - started) / 60 > budget_minutes:
                rows[key] = {"error": f"not run: the suite's {budget_minutes:g}-minute budget was spent"}
                continue
            if dev.type == "cpu" and precision == "bf16" and channels_last and cpu_bf16_channels_last_is_wrong():
                rows[key] = {"error": "refused on this CPU: wrong bf16 channels-last gradients (runtime.config.check_channels_last)"}
                continue
            try:
                method = build_method(net, dev, channels_last, compile_mode, chunk, backend=backend,
                                      samples_per_forward=samples_per_forward)
                step = training_step(method, batch, dev, precision)
                warm_start = time.perf_counter()
                for _ in range(warmup):
                    step()
                _sync(dev)
                warm = time.perf_counter() - warm_start
                seconds, peak = _timed(step, dev, steps)
                rows[key] = {"steps_per_second": 1 / seconds, "seconds_per_step": seconds, "peak_mib": peak,
                             "warmup_seconds": warm,
                             "flops_per_second": flops[chunk_name] / seconds,
                             "fraction_of_matmul_peak": flops[chunk_name] / seconds / peaks[precision]}
                if chunk_name == "grouped" and name not in prediction:  # the ensemble does not chunk T
                    prediction[name] = prediction_rate(method, dev, precision, prediction_batch, max(2, steps // 5))
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
        for name in ("fp32 eager", "bf16 + channels-last + compile"):
            precision, channels_last, compile_mode = CONFIGS[name]
            try:
                result["camvid"][name] = camvid_step(dev, precision, channels_last, compile_mode, max(2, steps // 4),
                                                     camvid_size, camvid_batch, backend, camvid_kwargs)
            except Exception as error:
                result["camvid"][name] = {"error": _error_text(error)}
        save()
    return result


def markdown(result: dict) -> str:
    """The suite's result as the markdown table of docs/performance.md."""
    lines = [f"Measured {result['date']} on {result['device']}, torch {result['torch']}: the {result['net']} "
             f"network, T = {result['train_samples']}, batch {result['batch']}, median of {result['steps']} steps "
             f"(`python -m dbsn.tools.bench --suite gpu`).", "",
             "| configuration | T structures | steps/s | peak GiB | 100 epochs (h) | TFLOP/s | of matmul peak |",
             "|---|---|---|---|---|---|---|"]
    for key, row in result["training"].items():
        name, chunk = key.split(" | ")
        if "error" in row:
            lines.append(f"| {name} | {chunk} | {row['error']} | | | | |")
            continue
        lines.append(f"| {name} | {chunk} | {row['steps_per_second']:.2f} | {row['peak_mib'] / 1024:.1f} | "
                     f"{row.get('projected_hours_100_epochs', float('nan')):.2f} | {row['flops_per_second'] / 1e12:.2f} | "
                     f"{100 * row['fraction_of_matmul_peak']:.1f} % |")
    peaks = result["matmul_flops_per_second"]
    lines += ["", f"Dense matmul peak measured in the same run: fp32 {peaks['fp32'] / 1e12:.1f} TFLOP/s, "
                  f"bf16 {peaks['bf16'] / 1e12:.1f} TFLOP/s. FLOPs per step (convolutions and matmuls): "
                  + ", ".join(f"{k} {v / 1e9:.0f} GFLOP" for k, v in result["flops_per_step"].items()) + ".", ""]
    if result.get("prediction_images_per_second"):
        lines += ["| prediction, S = 100 | images/s |", "|---|---|"]
        lines += [f"| {name} | {rate:.1f} |" for name, rate in result["prediction_images_per_second"].items()]
        lines.append("")
    if result.get("camvid"):
        lines += ["| CamVid DBSN step (3 x 224², T = 1) | seconds | peak GiB |", "|---|---|---|"]
        for name, row in result["camvid"].items():
            lines.append(f"| {name} | {row['error']} | |" if "error" in row else
                         f"| {name} | {row['seconds']:.3f} | {row['peak_mib'] / 1024:.2f} |")
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
    result = run_suite(args.net or "paper", args.batch, args.steps, device=args.device, configs=configs,
                       backend=args.compile_backend, prediction_batch=args.prediction_batch, previous=previous,
                       on_result=save, camvid=args.segmentation != "no")
    save(result)
    print(markdown(result))
    return result
