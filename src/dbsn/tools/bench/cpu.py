"""`make bench` (the cpu suite): speed and memory of DBSN's hot paths, as ratios within one run.

    python -m dbsn.tools.bench [--net quick|paper] [--batch 64] [--repeats 5] [--device auto]
                         [--memory-batch 4] [--no-compile]
    python -m dbsn.tools.bench --suite gpu [--configs ...] [--json results.json]   (see `dbsn.tools.bench.gpu`)

Each case (`CASES`: one training step of map_fixed, DBSN at T = 1 and T = 4 grouped or chunked,
every baseline, VOGN, NEK-FAC on VGG16-BN; the S = 100 Bayes ensemble against 100 single forwards;
per-structure BatchNorm statistics; channels-last and compiled variants, which `--no-compile`
skips) runs on the same network, batch and machine in interleaved repetitions (median time), with
its peak memory (CUDA max allocated, or a fresh process's resident-set growth on a CPU). Also: the
cost of the evaluation's statistics (`statistics_cost`), the paper network's training memory
grouped against chunked, the T = 4 step's FLOP/s against this machine's dense matmul, and the
input pipeline's images/s. Targets are ratios: dbsn_t1 / map_fixed <= 1.10; dbsn_t4 / (4 x
dbsn_t1) <= 1.0; ens_100 / single_100 <= 1.0; prediction with recalibration over without on
CIFAR's 10,000 test images <= 1.3; chunked / grouped training memory <= 0.35. Seconds move between
processes on a shared machine while ratios within one process stay put, so compare ratios. The
cases in full and the results: docs/performance.md.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from datetime import date

import torch

from dbsn.evaluation.progress import progress
from dbsn.methods import (
    DBSN,
    MAP,
    Compilation,
    Execution,
    GaussianWeights,
    MCDropoutWeights,
    NEKFACMethod,
    Prediction,
    VOGNMethod,
)
from dbsn.methods.predictive import BayesEnsemble
from dbsn.natgrad import VOGN
from dbsn.nets import VGG16BN, StructureNet
from dbsn.runtime.memory import keep_freed_memory
from dbsn.tools.bench.common import NETS, _device_name, _sync, timed_call

CASES = (
    "map_fixed",
    "dbsn_t1",
    "dbsn_t4",
    "dbsn_t4_chunked",
    "map",
    "mc_dropout",
    "bbb",
    "fbn",
    "vogn",
    "vogn_fbn",
    "vgg_sgd",
    "nekfac",
    "ens_100",
    "single_100",
    "recal_100",
    "dbsn_t1_channels_last",
)
COMPILED_CASES = ("dbsn_t1_compiled", "dbsn_t1_channels_last_compiled")
#: Images of the test set and of the recalibration, for the derived cost of recalibrated prediction.
RECALIBRATION_IMAGES, TEST_SET_SIZES = 256, {"CIFAR": 10_000, "digits": 450}
NATGRAD = {  # natural-gradient cases and the SGD case on the same network they are compared with
    "vogn": lambda net: VOGNMethod(net, structure="map"),
    "vogn_fbn": lambda net: VOGNMethod(net, structure="dbsn"),  # T = 1
    "nekfac": lambda net: NEKFACMethod(net),
}
VGG_WIDTH = {"quick": 0.25, "paper": 1.0, "tiny": 0.25}  # NEK-FAC's VGG16-BN: narrow on the quick setting
METHODS = {
    "map_fixed": lambda net: MAP(net, learn_structure=False),
    "map": lambda net: MAP(net, learn_structure=True),
    "mc_dropout": lambda net: MAP(net, learn_structure=True, weights=MCDropoutWeights()),
    "bbb": lambda net: MAP(net, learn_structure=True, weights=GaussianWeights()),
    "dbsn_t1": lambda net: DBSN(net, train_samples=1),
    "dbsn_t4": lambda net: DBSN(net, train_samples=4),
    "dbsn_t4_chunked": lambda net: DBSN(net, train_samples=4, train_samples_per_forward=1),
    "fbn": lambda net: DBSN(net, train_samples=1, weights=GaussianWeights()),
    "vgg_sgd": lambda net: MAP(net, learn_structure=False),  # VGG16-BN with SGD, NEK-FAC's reference
    "dbsn_t1_channels_last": lambda net: DBSN(net, train_samples=1, execution=Execution(channels_last=True)),
    "dbsn_t1_compiled": lambda net: DBSN(net, train_samples=1, execution=Execution(compile=Compilation(enabled=True))),
    "dbsn_t1_channels_last_compiled": lambda net: DBSN(
        net, train_samples=1, execution=Execution(channels_last=True, compile=Compilation(enabled=True))
    ),
}


def build_case(name: str, net_name: str, batch: int, device: torch.device, samples_per_forward: int):
    """A zero-argument callable running one repetition of `name`."""
    torch.manual_seed(0)
    if name in ("vgg_sgd", "nekfac"):
        net = VGG16BN(num_classes=10, width=VGG_WIDTH[net_name]).to(device)
    else:
        net = StructureNet(num_classes=10, **NETS[net_name]).to(device)
    x = torch.randn(batch, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (batch,), device=device)

    if name in NATGRAD:
        method = NATGRAD[name](net).to(device)
        method.dataset_size = 50_000
        natgrad = method._make_optimizer(50_000)
        others = (
            [method.structure_optimizer().build(method.structure_parameters())] if method.structure_parameters() else []
        )

        def closure():  # as the method's, with a plain backward (no Trainer here)
            out = method.training_loss(x, y)
            if isinstance(natgrad, VOGN):
                out["loss"].backward()
                return out["loss"]
            return method._closure_result(out)  # NEK-FAC: it runs the backward passes itself

        def natgrad_step():  # what NaturalGradientMethod.training_step does, minus logging
            for opt in others:
                opt.zero_grad(set_to_none=True)
            natgrad.step(closure=closure)
            for opt in others:
                opt.step()
            method.on_after_optimizer_step(x.shape[0])

        return natgrad_step

    if name in METHODS:
        method = METHODS[name](net).to(device)
        method.dataset_size = 50_000
        groups = method.weight_parameter_groups()
        opts = [method.optim.build(group, 100, method.no_decay_parameters())[0] for group in groups]
        if method.structure_parameters():
            opts.append(method.structure_optimizer().build(method.structure_parameters()))

        def step():  # what Method.training_step does, minus Lightning's logging
            for opt in opts:
                opt.zero_grad(set_to_none=True)
            method.accumulate_gradients(x, y, lambda loss, last: loss.backward())
            for group in groups:
                torch.nn.utils.clip_grad_norm_(group, 5.0)
            for opt in opts:
                opt.step()
            method.on_after_optimizer_step(x.shape[0])

        return step

    method = DBSN(net, prediction=Prediction(n_samples=100, samples_per_forward=samples_per_forward)).to(device)
    method.eval()
    if name == "recal_100":

        def recalibrate():
            with torch.inference_mode():
                method.use_calibration_images([x])
                method.prediction_structures(100)  # fixes 100 members and computes their statistics

        recalibrate.method = method  # for inspection
        return recalibrate
    chunk = samples_per_forward if name == "ens_100" else 1
    ensemble = BayesEnsemble(100, chunk)

    def predict():
        with torch.inference_mode():
            ensemble(method.stochastic_forward, x)

    return predict


# ---------------------------------------------------------------------- segmentation
SEG_CASES = {  # name: (method, S)
    "fcdensenet67_s1": ("fcdensenet67", 1),
    "mc_dropout_seg_s100": ("fcdensenet67_mc_dropout", 100),
    "dbsn_seg_s1": ("dbsn_seg", 1),
    "dbsn_seg_s100": ("dbsn_seg", 100),
}


def build_seg_case(
    name: str, size: tuple[int, int], device: torch.device, samples_per_forward: int, net_kwargs: dict | None = None
):
    """One full-size test image through a segmentation method's Bayes ensemble (S members in
    groups of `samples_per_forward`, as evaluate.py does)."""
    from dbsn.methods.tasks import Segmentation
    from dbsn.nets import DBSNSegNet, FCDenseNet

    method_name, samples = SEG_CASES[name]
    torch.manual_seed(0)
    if method_name == "dbsn_seg":
        method = DBSN(
            DBSNSegNet(**(net_kwargs or {})),
            task=Segmentation(),
            prediction=Prediction(n_samples=samples, samples_per_forward=samples_per_forward),
        )
    else:
        weights = MCDropoutWeights(placement="existing") if method_name.endswith("mc_dropout") else None
        method = MAP(
            FCDenseNet(**(net_kwargs or {})),
            learn_structure=False,
            weights=weights,
            task=Segmentation(),
            prediction=Prediction(n_samples=samples, samples_per_forward=samples_per_forward),
        )
    method = method.to(device).eval()
    method.enable_test_noise()
    x = torch.randn(1, 3, *size, device=device)

    def predict():
        with torch.inference_mode():
            method.predict_log_probs(x)

    return predict


def run_segmentation(
    size: tuple[int, int] = (360, 480),
    repeats: int = 3,
    device: str = "auto",
    samples_per_forward: int | None = None,
    memory: bool = True,
    net_kwargs: dict | None = None,
) -> dict:
    """Images per second and peak memory of full-size CamVid prediction, S = 1 and S = 100
    (`net_kwargs` shrinks the networks, for tests)."""
    dev = torch.device(
        "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
    )
    spf = samples_per_forward or (10 if dev.type == "cuda" else 2)
    result = {
        "date": date.today().isoformat(),
        "device": _device_name(dev),
        "torch": torch.__version__,
        "size": list(size),
        "samples_per_forward": spf,
        "repeats": repeats,
        "images_per_second": {},
    }
    for name in SEG_CASES:
        predict = build_seg_case(name, size, dev, spf, net_kwargs)
        predict()  # warm-up
        times = [timed_call(predict, dev) for _ in range(repeats)]
        result["images_per_second"][name] = 1.0 / statistics.median(times)
    if memory:
        result["peak_memory_mib"] = {name: _peak_memory(("seg", name, size, str(dev), spf)) for name in SEG_CASES}
    return result


def _peak_memory(spec: tuple) -> float:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_peak_memory_child, args=(*spec, queue))
    proc.start()
    value = queue.get(timeout=1800)
    proc.join()
    return float(value)


def _peak_memory_child(name, net_name, batch, device_str, samples_per_forward, queue) -> None:
    keep_freed_memory()  # as in a run
    device = torch.device(device_str)
    if name == "seg":  # (seg, case, size, device, samples_per_forward)
        run = build_seg_case(net_name, batch, device, samples_per_forward)
    else:
        run = build_case(name, net_name, batch, device, samples_per_forward)
    if device.type == "cuda":
        run()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        run()
        torch.cuda.synchronize()
        queue.put((torch.cuda.max_memory_allocated(device) - base) / 2**20)
        return
    base = _proc_status_kib("VmRSS")
    run()
    queue.put((_proc_status_kib("VmHWM") - base) / 1024)


def _proc_status_kib(field: str) -> int:
    """A memory figure of this process from /proc/self/status (VmHWM: its peak RSS; unlike
    getrusage's ru_maxrss it is not inherited across fork/exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_memory_mib(name, net_name, batch, device, samples_per_forward) -> float:
    """Peak memory of one repetition, measured in a fresh process so cases do not mix."""
    return _peak_memory((name, net_name, batch, str(device), samples_per_forward))


def run(
    net_name: str = "quick",
    batch: int = 64,
    repeats: int = 5,
    device: str = "auto",
    samples_per_forward: int | None = None,
    memory: bool = True,
    memory_batch: int = 4,
    compiled: bool = True,
    pipeline_images: int = 10_000,
    statistics_examples: int = 10_000,
) -> dict:
    keep_freed_memory()  # as train.py and evaluate.py do (dbsn.runtime.memory)
    dev = torch.device(
        "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
    )
    if samples_per_forward is None:  # CPU caches favour small batched forwards, GPUs large ones
        samples_per_forward = 20 if dev.type == "cuda" else 4
    cases = CASES + (COMPILED_CASES if compiled else ())
    steps = {}
    for name in progress(cases, desc="bench: build and warm up"):  # compiled cases compile here
        steps[name] = build_case(name, net_name, batch, dev, samples_per_forward)
        steps[name]()
    times = {name: [] for name in cases}
    with progress(total=repeats * len(cases), desc="bench: timed steps") as bar:
        for _ in range(repeats):  # interleaved, so drifts in machine load hit every case alike
            for name, step in steps.items():
                times[name].append(timed_call(step, dev))
                bar.update()
    median = {name: statistics.median(ts) for name, ts in times.items()}
    result = {
        "date": date.today().isoformat(),
        "device": _device_name(dev),
        "torch": torch.__version__,
        "net": net_name,
        "batch": batch,
        "repeats": repeats,
        "samples_per_forward": samples_per_forward,
        "seconds": median,
        "ratios": {
            "dbsn_t1 / map_fixed (target <= 1.10)": median["dbsn_t1"] / median["map_fixed"],
            "dbsn_t4 / (4 x dbsn_t1) (target <= 1.0)": median["dbsn_t4"] / (4 * median["dbsn_t1"]),
            "ens_100 / single_100 (target <= 1.0)": median["ens_100"] / median["single_100"],
            **{f"{m} / map_fixed": median[m] / median["map_fixed"] for m in ("map", "mc_dropout", "bbb", "fbn")},
            # the natural-gradient methods over SGD on the same network and structure handling
            "vogn / map": median["vogn"] / median["map"],
            "vogn_fbn / dbsn_t1": median["vogn_fbn"] / median["dbsn_t1"],
            "nekfac / vgg_sgd": median["nekfac"] / median["vgg_sgd"],
            "dbsn_t4_chunked / dbsn_t4": median["dbsn_t4_chunked"] / median["dbsn_t4"],
            "recal_100 / ens_100 (per image)": median["recal_100"] / median["ens_100"],
            **{
                f"prediction with / without recalibration, {data} test set"
                + (" (target <= 1.3)" if data == "CIFAR" else ""): 1
                + median["recal_100"] / median["ens_100"] * RECALIBRATION_IMAGES / size
                for data, size in TEST_SET_SIZES.items()
            },
            "dbsn_t1_channels_last / dbsn_t1": median["dbsn_t1_channels_last"] / median["dbsn_t1"],
        },
    }
    if compiled:
        result["ratios"].update(
            {
                "dbsn_t1_compiled / dbsn_t1 (target <= 0.8)": median["dbsn_t1_compiled"] / median["dbsn_t1"],
                "dbsn_t1_channels_last_compiled / dbsn_t1": median["dbsn_t1_channels_last_compiled"]
                / median["dbsn_t1"],
            }
        )
    result["flops"] = machine_fraction(steps["dbsn_t4"], median["dbsn_t4"], dev)
    result["ratios"]["dbsn_t4 FLOP/s / dense matmul FLOP/s"] = result["flops"]["fraction"]
    if pipeline_images:
        result["pipeline"] = pipeline_rates(dev, pipeline_images, batch)
        result["ratios"]["on-device pipeline / DataLoader (images/s)"] = (
            result["pipeline"]["on_device"] / result["pipeline"]["dataloader"]
        )
    if statistics_examples:
        result["statistics"] = statistics_cost(statistics_examples)
    if memory:
        result["peak_memory_mib"] = {  # a fresh process per case
            name: peak_memory_mib(name, net_name, batch, dev, samples_per_forward)
            for name in progress(CASES, desc="bench: peak memory")
        }
        result["training_memory"] = training_memory(memory_batch, dev, samples_per_forward)
    return result


def statistics_cost(n: int = 10_000, classes: int = 10, resamples: int = 1000, n_out: int = 26_032) -> dict:
    """Seconds of the evaluation's statistics on a CIFAR-sized test set (`n` examples, `classes`
    classes, synthetic predictions): the calibration (test-time 2-fold cross-validation) and the
    `resamples` bootstrap intervals of every test-pass metric (`dbsn.evaluation.statistics`), and
    the intervals of one OOD set's detection metrics for three scores against `n_out` OOD
    examples (SVHN's test set)."""
    from dbsn.evaluation.ood import detection_statistics
    from dbsn.evaluation.statistics import Statistics, calibrate, classification_statistics

    g = torch.Generator().manual_seed(0)
    log_probs = torch.log_softmax(3 * torch.randn(n, classes, generator=g, dtype=torch.float64), 1)
    targets = torch.randint(classes, (n,), generator=g)
    probs = log_probs.exp()
    scores = {
        "max_probability": probs.max(1).values,
        "predictive_entropy": -(probs * log_probs).sum(1),
        "mutual_information": torch.rand(n, generator=g, dtype=torch.float64),
    }
    statistics = Statistics(resamples=resamples)
    start = time.perf_counter()
    calibrated, _ = calibrate(log_probs, targets)
    classification_statistics(log_probs, targets, scores, statistics.weights(n), calibrated)
    test_pass = time.perf_counter() - start
    out_scores = torch.rand(n_out, generator=g, dtype=torch.float64)
    start = time.perf_counter()
    for score in scores.values():
        detection_statistics(score, out_scores, statistics.weights(n), statistics.weights(n_out, stream=1))
    ood = time.perf_counter() - start
    return {
        "examples": n,
        "classes": classes,
        "resamples": resamples,
        "ood_examples": n_out,
        "test_pass_seconds": test_pass,
        "ood_set_seconds": ood,
    }


def machine_fraction(step, seconds: float, device: torch.device, matmul_size: int = 2048) -> dict:
    """The convolution and matmul FLOP/s that `step` achieves at `seconds` per call, and its
    fraction of this machine's dense float32 matmul FLOP/s, measured now."""
    from dbsn.evaluation.cost import flop_counter_mode

    with flop_counter_mode() as counter:
        step()
    flops = counter.get_total_flops()
    a, b = (torch.randn(matmul_size, matmul_size, device=device) for _ in range(2))
    a @ b
    times = [timed_call(lambda: a @ b, device) for _ in range(5)]
    peak = 2 * matmul_size**3 / statistics.median(times)
    return {
        "flops_per_step": flops,
        "flops_per_second": flops / seconds,
        "matmul_flops_per_second": peak,
        "fraction": flops / seconds / peak,
    }


def pipeline_rates(device: torch.device, n_images: int = 10_000, batch: int = 64) -> dict:
    """Images/s of one epoch of the paper's training input pipeline (uint8 batches to augmented,
    normalised floats on `device`) through the DataLoader with the data config's 2 workers and
    through `data.on_device`, on an in-memory CIFAR-sized training set (second epoch of each:
    workers already started)."""
    import types

    from dbsn.data import CIFAR10DataModule
    from dbsn.data.base import TensorImageDataset

    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (n_images, 3, 32, 32), dtype=torch.uint8, generator=generator)
    labels = torch.randint(0, 10, (n_images,), generator=generator)
    rates = {}
    for name, on_device in (("dataloader", False), ("on_device", True)):
        dm = CIFAR10DataModule(root="unused", batch_size=batch, num_workers=2, on_device=on_device)
        dm.train_set = TensorImageDataset(images, labels)
        dm.trainer = types.SimpleNamespace(
            training=True, world_size=1, strategy=types.SimpleNamespace(root_device=device)
        )
        loader = dm.train_dataloader()
        for epoch in range(2):
            loader.sampler.set_epoch(epoch)
            _sync(device)
            start = time.perf_counter()
            seen = 0
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                x = dm.preprocess(x, train=True)
                seen += x.shape[0]
            _sync(device)
            rates[name] = seen / (time.perf_counter() - start)
        del loader
    return rates


def training_memory(batch: int, device: torch.device, samples_per_forward: int) -> dict:
    """Peak memory of one DBSN step (T = 4) of the paper's network, grouped and chunked."""
    peaks = {
        name: peak_memory_mib(name, "paper", batch, device, samples_per_forward)
        for name in ("dbsn_t4", "dbsn_t4_chunked")
    }
    return {
        "batch": batch,
        "train_samples": 4,
        "peak_mib": peaks,
        "mib_per_image_structure": {name: peak / (batch * 4) for name, peak in peaks.items()},
        "chunked / grouped (target <= 0.35)": peaks["dbsn_t4_chunked"] / peaks["dbsn_t4"],
    }


def _print(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(
        f"[bold]dbsn bench[/] {result['date']} on {result['device']}, torch {result['torch']}, "
        f"net={result['net']}, batch={result['batch']}, median of {result['repeats']}"
    )
    table = Table("case", "seconds", "peak MiB")
    for name, seconds in result["seconds"].items():
        mem = result.get("peak_memory_mib", {}).get(name)
        table.add_row(name, f"{seconds:.4f}", "-" if mem is None else f"{mem:.0f}")
    console.print(table)
    ratios = Table("ratio", "value", "target met")
    for name, value in result["ratios"].items():
        if "<=" in name:
            target = float(name.rsplit("<= ", 1)[1].rstrip(")"))
            ratios.add_row(name, f"{value:.3f}", "yes" if value <= target else "[red]no[/]")
        else:
            ratios.add_row(name, f"{value:.3f}", "-")
    console.print(ratios)
    if "flops" in result:
        f = result["flops"]
        console.print(
            f"dbsn_t4 step: {f['flops_per_step'] / 1e9:.1f} GFLOP (convolutions and matmuls), "
            f"{f['flops_per_second'] / 1e9:.1f} GFLOP/s against {f['matmul_flops_per_second'] / 1e9:.1f} "
            f"GFLOP/s of dense float32 matmul: {100 * f['fraction']:.1f} % of the machine's limit"
        )
    if "statistics" in result:
        st = result["statistics"]
        console.print(
            f"statistics: {st['resamples']} bootstrap resamples of {st['examples']:,} test examples "
            f"({st['classes']} classes): calibration and every test-pass interval {st['test_pass_seconds']:.1f} s; "
            f"one OOD set of {st['ood_examples']:,} examples, three scores {st['ood_set_seconds']:.1f} s"
        )
    if "pipeline" in result:
        p = result["pipeline"]
        console.print(
            f"input pipeline: DataLoader {p['dataloader']:.0f} images/s, on-device {p['on_device']:.0f} images/s"
        )
    if "training_memory" in result:
        mem = result["training_memory"]
        table = Table(
            "paper network, DBSN step, T = 4",
            "peak MiB",
            "MiB per image x structure",
            title=f"Training memory at batch {mem['batch']}",
        )
        for name, peak in mem["peak_mib"].items():
            table.add_row(name, f"{peak:.0f}", f"{mem['mib_per_image_structure'][name]:.1f}")
        console.print(table)
        value = mem["chunked / grouped (target <= 0.35)"]
        console.print(f"chunked / grouped: {value:.3f} (target <= 0.35: {'yes' if value <= 0.35 else 'no'})")


def _print_segmentation(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    h, w = result["size"]
    table = Table(
        "case",
        "images / s",
        "peak MiB",
        title=f"Segmentation prediction at {h}x{w}, {result['samples_per_forward']} members per forward",
    )
    for name, rate in result["images_per_second"].items():
        mem = result.get("peak_memory_mib", {}).get(name)
        table.add_row(name, f"{rate:.3f}", "-" if mem is None else f"{mem:.0f}")
    Console().print(table)
