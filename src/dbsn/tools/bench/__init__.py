"""`python -m dbsn.tools.bench`: the speed and memory benchmarks (`make bench`).

--suite cpu (default)  ratios of DBSN's hot paths on any device (`dbsn.tools.bench.cpu`)
--suite gpu            the paper network's training configurations on one GPU
                       (`dbsn.tools.bench.gpu`); with --part profile | forms | compile |
                       streams | summary, one part of the GPU window (`dbsn.tools.bench.window`,
                       tools/gpu_window.sh runs them all)
--suite field          each field method's training step and prediction over one network's
                       on the same backbone (`dbsn.tools.bench.field`)
--suite step           the paper step's operations per cell (aten, kernel-launching, host
                       synchronisations), one cell's traced graph, fused over per-edge
                       (`dbsn.tools.bench.step`)
--suite layout         DBSN's eager step contiguous and channels-last, fp32 and bf16: the
                       measurement behind `channels_last=auto` (`dbsn.tools.bench.layout`)
"""

from __future__ import annotations

import argparse
import json

import torch

from dbsn.tools.bench.common import NETS


def main(argv: list[str] | None = None) -> dict:
    from dbsn.tools.bench import cpu

    parser = argparse.ArgumentParser(description=cpu.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--suite",
        choices=("cpu", "gpu", "field", "step", "layout"),
        default="cpu",
        help="cpu: the ratios above (any device); gpu: the paper network's training configurations "
        "on one GPU (dbsn.tools.bench.gpu); field: the field's methods over one network on a "
        "backbone (dbsn.tools.bench.field)",
    )
    parser.add_argument(
        "--backbone",
        choices=("resnet18", "wrn28_10", "structure_net"),
        default="resnet18",
        help="field suite: the backbone every method runs on",
    )
    parser.add_argument(
        "--size",
        choices=("quick", "paper", "tiny"),
        default=None,
        help="field suite: quick = narrow backbones for a CPU (default there), paper = published size "
        "(default on a GPU)",
    )
    parser.add_argument(
        "--net", choices=sorted(NETS), default=None, help="default: quick (cpu suite), paper (gpu suite)"
    )
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--samples-per-forward",
        type=int,
        default=None,
        help="structures per batched forward in ens_100 (default: 4 on CPU, whose caches "
        "favour small batches; 20 on a GPU)",
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the per-case memory processes")
    parser.add_argument(
        "--memory-batch", type=int, default=4, help="images of the paper-network training-memory step (T = 4)"
    )
    parser.add_argument("--json", help="also write the result to this file")
    parser.add_argument(
        "--segmentation",
        choices=("auto", "yes", "no"),
        default="auto",
        help="also time full-size CamVid prediction, S = 1 and S = 100 (auto: on a GPU only; "
        "on a CPU one S = 100 image takes minutes)",
    )
    parser.add_argument("--seg-size", default="360x480", help="segmentation input size HxW")
    parser.add_argument("--no-compile", action="store_true", help="leave out the compiled cases")
    parser.add_argument("--steps", type=int, default=10, help="gpu suite: timed steps per configuration")
    parser.add_argument(
        "--budget-minutes",
        type=float,
        default=4.0,
        help="gpu suite: configurations not started "
        "within this many minutes are reported as not run (the compiled cells come last)",
    )
    parser.add_argument(
        "--chunked",
        action="store_true",
        help="gpu suite: also each configuration with the T structures one after another",
    )
    parser.add_argument("--configs", default=None, help="gpu suite: comma-separated configurations (default: all)")
    parser.add_argument("--compile-backend", default="inductor", help="gpu suite: torch.compile backend")
    parser.add_argument(
        "--part",
        choices=("table", "profile", "forms", "compile", "streams", "summary"),
        default="table",
        help="gpu suite: table (the configurations above) or one part of the GPU "
        "window (dbsn.tools.bench.window), each writing OUT/gpu_<part>.json as it goes",
    )
    parser.add_argument("--out", default=None, help="gpu suite parts: the results folder (default: $OUT or bench_out)")
    parser.add_argument("--tiny", action="store_true", help="gpu suite parts: the tiny network, batch 4 (a smoke test)")
    parser.add_argument(
        "--cache", default=None, help="gpu suite, compile part: load this compile cache first (a warm start)"
    )
    parser.add_argument(
        "--conv-1x1",
        default="auto",
        help="gpu suite, compile and streams parts: model.execution.conv_1x1 (auto: the forms part's fastest)",
    )
    parser.add_argument(
        "--depthwise",
        default="auto",
        help="gpu suite, compile and streams parts: model.execution.depthwise (auto: the forms part's fastest)",
    )
    parser.add_argument("--train-samples", type=int, default=1, help="layout suite: DBSN's T")
    parser.add_argument("--runs", type=int, default=4, help="gpu suite, streams part: up to this many runs at once")
    parser.add_argument("--prediction-batch", type=int, default=64, help="gpu suite: images per S = 100 prediction")
    args = parser.parse_args(argv)
    if args.suite == "gpu" and args.part != "table":
        from dbsn.tools.bench import window

        return window.main(args)
    if args.suite == "gpu":
        from dbsn.tools.bench import gpu

        return gpu.main(args)
    if args.suite == "step":
        from dbsn.tools.bench import step

        result = step.run(args.batch, args.repeats, trace=not args.no_compile)
        print(step.markdown(result, args.batch))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
        return result
    if args.suite == "layout":
        from dbsn.tools.bench import layout

        result = layout.run(args.net or "quick", args.train_samples, args.batch, args.repeats)
        print(layout.markdown(result))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
        return result
    if args.suite == "field":
        from dbsn.tools.bench import field

        size = args.size or ("paper" if torch.cuda.is_available() and args.device in ("auto", "cuda") else "quick")
        result = field.run(args.backbone, size, args.batch, args.repeats, args.device)
        field._print(result)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
        return result
    result = cpu.run(
        args.net or "quick",
        args.batch,
        args.repeats,
        args.device,
        args.samples_per_forward,
        not args.no_memory,
        args.memory_batch,
        compiled=not args.no_compile,
    )
    cpu._print(result)
    if args.segmentation == "yes" or (args.segmentation == "auto" and torch.cuda.is_available()):
        size = tuple(int(v) for v in args.seg_size.split("x"))
        result["segmentation"] = cpu.run_segmentation(size, device=args.device, memory=not args.no_memory)
        cpu._print_segmentation(result["segmentation"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def cli() -> None:
    """`dbsn-bench`: `main` on the command line's arguments, mistakes in one line (exit status 2)."""
    from dbsn.runtime.errors import one_line_errors

    one_line_errors(main)()
