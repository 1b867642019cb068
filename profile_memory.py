"""Will it fit? Memory of one training step, per GPU, stage by stage, estimated on a CPU-only machine.

    python profile_memory.py --model_size 4B --context_length 131072 --attention_type nsa
    python profile_memory.py --model_size 4B --context_length 131072 --world_size 2 --gradient_checkpointing \
        --gpu_memory 80
    python profile_memory.py --model_size 4B --context_length 32768 --gradient_checkpointing --finetune lora \
        --quantize_base nf4

The estimate itself (how, what it counts, what it cannot see) is training/estimate.py.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed._tools.fake_collectives  # noqa: F401  (fake c10d collectives: FSDP under FakeTensorMode)

from training.cli import check_writable, load_plugins
from training.estimate import StepConfig, _quiet, estimate, measure, plot, report_text, warm_up_step
from training.fit import check_fit
from training.modes import settle_mode
from training.options import build_parser as build_train_parser
from training.options import (
    check_effects,
    parse_options,
    resolve_config,
)

PLOT_FORMATS = (".png", ".pdf", ".svg")  # what matplotlib writes by name


def progress_lines(after: float = 10.0) -> Callable[[str], None]:
    """A `progress` callback that prints "profile_memory: <part> (N s)" on stderr, from `after` seconds on (a short
    estimate prints nothing)."""
    start = time.perf_counter()

    def progress(part: str) -> None:
        elapsed = time.perf_counter() - start
        if elapsed >= after:
            print(f"profile_memory: {part} ({elapsed:.0f} s)", file=sys.stderr, flush=True)
    return progress


def build_parser() -> argparse.ArgumentParser:
    """train.py's options (the same names; those that do not change memory are accepted and ignored), then the
    profiler's own."""
    parser = build_train_parser()
    parser.description = __doc__.split("\n\n")[0] + " Takes train.py's options and applies its automatic choices."
    p = parser.add_argument_group("profiler")
    p.add_argument("--world_size", type=int, default=1, help="FSDP2 ranks; numbers are per rank (default: 1)")
    p.add_argument("--gpu_memory", type=float, default=None,
                   help="GiB per GPU: say whether it fits, else what would; also decides automatic activation "
                        "offload, as train.py does on that GPU")
    p.add_argument("--reserve", type=float, default=None,
                   help="with --gpu_memory: GiB of the GPU kept for what the tracker cannot see (default: 2)")
    p.add_argument("--measure", action="store_true", default=False,
                   help="also run the step for real on CUDA and print both")
    p.add_argument("--json", action="store_true", default=False, help="print the result as JSON (bytes)")
    p.add_argument("--plot", metavar="FILE.png", default=None, help="save a stacked bar chart (needs matplotlib)")
    return parser


def main(argv: list[str] | None = None) -> None:
    load_plugins(argv)
    parser = build_parser()
    cfg, args, given = parse_options(parser, argv)
    if args["gpu_memory"] is not None and not 0 < args["gpu_memory"] < math.inf:
        parser.error(f"--gpu_memory must be a positive finite number of GiB, got {args['gpu_memory']}")
    if args["reserve"] is not None and args["gpu_memory"] is None:
        parser.error("--reserve is what --gpu_memory keeps free: pass --gpu_memory too, or leave --reserve out")
    args["reserve"] = 2.0 if args["reserve"] is None else args["reserve"]
    if args["gpu_memory"] is not None and not 0 <= args["reserve"] < args["gpu_memory"]:
        parser.error(f"--reserve ({args['reserve']:g} GiB kept free) must be at least 0 and less than --gpu_memory "
                     f"({args['gpu_memory']:g} GiB)")
    if args["gpu_memory"] is not None and cfg.max_memory is not None and \
            cfg.max_memory < args["gpu_memory"] - args["reserve"]:
        parser.error(f"--max_memory {cfg.max_memory:g}: train.py stops past {cfg.max_memory:g} GiB, below --gpu_memory "
                     f"{args['gpu_memory']:g} less its --reserve {args['reserve']:g}, which the fit is judged against; "
                     f"pass --gpu_memory {cfg.max_memory + args['reserve']:g}, or leave --max_memory out")
    if args["plot"] and (Path(args["plot"]).suffix.lower() not in PLOT_FORMATS or Path(args["plot"]).is_dir()):
        parser.error(f"--plot {args['plot']}: a file name ending in {', '.join(PLOT_FORMATS)}")
    if cfg.compile:
        parser.error("--compile: the estimate is of the eager step (what torch.compile fuses is not modelled); leave "
                     "it out")
    if args["measure"] and not torch.cuda.is_available():
        parser.error("--measure needs a CUDA device")
    try:
        if args["plot"]:
            check_writable(Path(args["plot"]), "--plot")
        resolved = resolve_config(cfg, torch.device("cuda"), log=_quiet)
        check_effects(resolved, given, torch.device("cuda"), log=_quiet)  # the options of the run estimated
        resolved = settle_mode(resolved, given)  # with --adapter, its geometry
        config = StepConfig(resolved, args["world_size"], args["gpu_memory"])
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    progress = progress_lines()
    result = estimate(config, progress)
    measured = measure(config, warm_up_step(result)) if args["measure"] else None
    log = (lambda msg: print(msg, file=sys.stderr)) if args["json"] else print
    fit = (check_fit(result, args["gpu_memory"], args["reserve"], log, progress) if args["gpu_memory"] is not None
           else None)
    if args["plot"]:
        plot(result, args["plot"])
    if args["json"]:
        print(json.dumps({**result, "measured": measured, "fit": fit}, indent=2))
    else:
        print(report_text(result, measured, fit))
    if args["plot"]:
        log(f"wrote {args['plot']}")


if __name__ == "__main__":
    main()
