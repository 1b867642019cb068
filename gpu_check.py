"""Validate the project on a GPU in one command: a Markdown report of what only a GPU can show.

    python gpu_check.py --budget 540           # what fits one 10-minute device call, most telling first
    python gpu_check.py                        # every section: gpu_check.md and gpu_check.json (20+ minutes)
    python gpu_check.py --out report.md --only kernels bench
    python gpu_check.py --dry_run              # the plan: each section's command, run or skipped and why

Sections, in this order (the most telling first), each run as its own subprocess (an out-of-memory error or a crash
in one is reported, and the next runs); each has an expected time (a guess until a GPU run measures it):
  kernels   the Triton kernels against the PyTorch path: forward and all gradients, float32 and bfloat16
            (tests/nsa_triton_gpu_check.py)
  bench     one NSA layer against SDPA (flash), forward and forward+backward at 16k, 32k, 64k and 128k (4B
            geometry, G = 4) and at 16k and 64k with G = 16, and the profiler's top kernels at 64k
            (benchmarks/bench_nsa_gpu.py); targets: forward + backward 1x SDPA's speed at 16k, 2x at 64k, 3x at 128k
  context   context parallelism's attention on CUDA (full attention's spans through SDPA's lower-right causal mask,
            NSA's from their first query, the ring's flash kernels with one rank) against the whole sequence
            (tests/test_context_parallel.py -m gpu)
  documents document masks on CUDA: full attention's varlen kernel against the chunks (bf16), NSA's packed documents
            in one call against the loop (tests/test_documents.py -m gpu)
  headline  the 4B / 131k headline (NSA, checkpointing, tiled FFN, chunked loss, activation offload) for 3 steps on
            one GPU, where it has at least 140 GB
  loss      that layer training with the selection-scoring loss at 32k (nsa/scoring.py's PyTorch path), on
            candidate blocks and with the dense target: the step's time over NSA's without it; above 1.10 for the
            candidate blocks, the loss wants a Triton kernel
  estimate  profile_memory.py --measure against its CPU estimate, 0.6B and 1.7B at 8k (full attention) and 32k (the
            long-context recipe: NSA, checkpointing, tiled FFN, chunked loss); target: within 10% of the measured peak
  train     train.py for 20 steps at 32k on 1.7B with NSA: tokens/s, MFU and peak memory
Sections that cannot run here (no CUDA, no Triton, too little GPU memory) are listed as skipped with the reason.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from training.cli import Parser, check_writable

ROOT = Path(__file__).resolve().parent
GB = 10**9


@dataclass
class Section:
    """One part of the report: `commands` run in order; `needs` returns why it cannot run here (None: it can);
    `summarise` turns the outputs (and the run directory) into Markdown."""

    name: str
    title: str
    commands: Callable[[Path], list[list[str]]]
    needs: Callable[[dict], str | None]
    summarise: Callable[[list[str], Path], str]
    expected_s: int  # on one H100 or H200 with compilation: --budget's plan (a guess until a run measures it)
    timeout_s: int = 600


def machine() -> dict:
    """What this machine has: CUDA, its name and memory, Triton."""
    import torch

    info = {"cuda": torch.cuda.is_available(), "torch": torch.__version__, "gpu": None, "memory": 0}
    if info["cuda"]:
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, memory=props.total_memory)
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def _needs_cuda(info: dict) -> str | None:
    return None if info["cuda"] else "no CUDA device"


def _needs_triton(info: dict) -> str | None:
    return _needs_cuda(info) or (None if info["triton"] else "Triton is not installed (pip install triton)")


def _needs_memory(gb: float) -> Callable[[dict], str | None]:
    def needs(info: dict) -> str | None:
        if not info["cuda"]:
            return "no CUDA device"
        return None if info["memory"] >= gb * GB else f"needs {gb:g} GB of GPU memory, this GPU has " \
                                                        f"{info['memory'] / GB:.0f} GB"
    return needs


def _tail(output: str, lines: int = 40) -> str:
    return "```\n" + "\n".join(output.strip().splitlines()[-lines:]) + "\n```"


def _table_lines(output: str) -> str:
    """The Markdown table lines of a benchmark's output."""
    return "\n".join(line for line in output.splitlines() if line.startswith("|"))


BENCH_LENGTHS = ["16384", "32768", "65536", "131072"]


def _summarise_bench(outputs: list[str], work: Path) -> str:
    """The bench section: the G = 4 and G = 16 tables, then the profiler's top kernels at 64k (its own command, so
    that a failure at 128k loses nothing else)."""
    g4, g16, profiled = outputs
    mark = "top kernels of one nsa forward + backward"
    profile = profiled[profiled.index(mark):] if mark in profiled else _tail(profiled)
    return ("G = 4 (H 32, KV 8):\n\n" + (_table_lines(g4) or _tail(g4)) + "\n\nG = 16 (H 32, KV 2):\n\n"
            + (_table_lines(g16) or _tail(g16))
            + ("\n\n```\n" + profile.strip() + "\n```" if profile.startswith(mark) else "\n\n" + profile)
            + "\n\nTargets (forward + backward against SDPA, G = 4): at least 1x at 16k, 2x at 64k, 3x at 128k.")


# ---- profile_memory --measure against the estimate ------------------------------------------------------------------

ESTIMATE_RUNS = [(size, T) for size in ("0.6B", "1.7B") for T in (8192, 32768)]


def _estimate_command(size: str, T: int) -> list[str]:
    recipe = ["--attention_type", "nsa", "--ffn_chunk_size", "8192", "--loss", "chunked"] if T >= 32768 else []
    return [sys.executable, "profile_memory.py", "--model_size", size, "--context_length", str(T),
            "--gradient_checkpointing", *recipe, "--measure", "--json"]


def estimate_error(result: dict) -> float:
    """(estimated peak - measured peak) / measured peak, from profile_memory's --json output."""
    return (result["peak"]["total"] - result["measured"]["peak"]["total"]) / result["measured"]["peak"]["total"]


def _summarise_estimates(outputs: list[str], work: Path) -> str:
    rows = ["| model | T | estimated peak GiB | measured peak GiB | error |", "|---|---|---|---|---|"]
    for (size, T), output in zip(ESTIMATE_RUNS, outputs, strict=True):
        try:
            result = json.loads(output[output.index("{"):])
        except ValueError:
            rows.append(f"| {size} | {T} | failed | | |\n\n{_tail(output, 15)}\n")
            continue
        rows.append(f"| {size} | {T} | {result['peak']['total'] / 2**30:.2f} | "
                    f"{result['measured']['peak']['total'] / 2**30:.2f} | {estimate_error(result):+.1%} |")
    return "\n".join(rows) + "\n\nTarget: within 10% of the measured peak."


# ---- training -------------------------------------------------------------------------------------------------------

def _train_command(out_dir: Path, *options: str) -> list[str]:
    return [sys.executable, "train.py", "--checkpoint_interval", "0", "--sample_tokens", "0", "--log_interval", "5",
            "--warmup_steps", "2", "--out_dir", str(out_dir), *options]


def training_summary(metrics: list[dict], skip: int = 2) -> dict:
    """Medians over the steps after the first `skip` (compilation, allocator warm-up): tokens/s, MFU, step time;
    the largest peak memory."""
    steady = [m for m in metrics if "loss" in m][skip:] or [m for m in metrics if "loss" in m]
    median = {k: statistics.median(m[k] for m in steady) for k in ("tokens_per_s", "step_time_s")}
    if all("mfu" in m for m in steady):
        median["mfu"] = statistics.median(m["mfu"] for m in steady)
    return {**median, "mem_peak_gib": max(m["mem_peak_gib"] for m in metrics if "loss" in m),
            "final_loss": steady[-1]["loss"], "steps": len([m for m in metrics if "loss" in m])}


def _summarise_training(name: str) -> Callable[[list[str], Path], str]:
    def summarise(outputs: list[str], work: Path) -> str:
        metrics_file = work / name / "metrics.jsonl"
        if not metrics_file.exists():
            return "failed before its first step:\n\n" + _tail(outputs[-1])
        s = training_summary([json.loads(line) for line in metrics_file.read_text().splitlines()])
        mfu = f"{s['mfu']:.1%}" if "mfu" in s else "n/a (unknown GPU peak)"
        return (f"| steps | tokens/s | MFU | step time | peak memory | final loss |\n|---|---|---|---|---|---|\n"
                f"| {s['steps']} | {s['tokens_per_s']:,.0f} | {mfu} | {s['step_time_s']:.2f} s | "
                f"{s['mem_peak_gib']:.1f} GiB | {s['final_loss']:.3f} |\n\nMedians after the first 2 steps."
                + ("" if s["steps"] else "\n\n" + _tail(outputs[-1])))
    return summarise


SECTIONS = [
    Section("kernels", "Triton kernels against the PyTorch path",
            lambda work: [[sys.executable, "tests/nsa_triton_gpu_check.py"]], _needs_triton,
            lambda outputs, work: _tail(outputs[0]), expected_s=90),
    Section("bench", "NSA against SDPA (flash), one 4B-geometry layer (G = 4) and a G = 16 one",
            lambda work: [[sys.executable, "benchmarks/bench_nsa_gpu.py", "--impls", "sdpa", "nsa", "--seq-lens",
                           *BENCH_LENGTHS],
                          [sys.executable, "benchmarks/bench_nsa_gpu.py", "--impls", "sdpa", "nsa", "--kv-heads", "2",
                           "--seq-lens", "16384", "65536"],
                          [sys.executable, "benchmarks/bench_nsa_gpu.py", "--impls", "nsa", "--seq-lens", "65536",
                           "--repeats", "1", "--profile", "65536"]], _needs_triton, _summarise_bench,
            expected_s=180),
    Section("context", "Context parallelism's attention on CUDA: a sequence in 3 spans against the whole (bf16)",
            lambda work: [[sys.executable, "-m", "pytest", "-q", "-n", "0", "-m", "gpu",
                           "tests/test_context_parallel.py"]], _needs_cuda,
            lambda outputs, work: _tail(outputs[0]), expected_s=45),
    Section("documents", "Document masks on CUDA: full attention's varlen kernel against the chunks (bf16), NSA's "
            "packed documents in one call against the loop (float32)",
            lambda work: [[sys.executable, "-m", "pytest", "-q", "-n", "0", "-m", "gpu", "tests/test_documents.py"]],
            _needs_cuda, lambda outputs, work: _tail(outputs[0]), expected_s=45),
    Section("headline", "The 4B / 131k headline on one GPU, 3 steps",
            lambda work: [_train_command(work / "headline", "--context_length", "131072", "--max_steps", "3",
                                         "--offload_activations")],
            _needs_memory(140), _summarise_training("headline"), expected_s=180, timeout_s=1500),
    Section("loss", "The selection-scoring loss's share of an NSA step, one 4B-geometry layer at 32k",
            lambda work: [[sys.executable, "benchmarks/bench_nsa_gpu.py", "--seq-lens", "32768", "--impls", "nsa",
                           "nsa+loss", "nsa+dense-loss"]], _needs_triton,
            lambda outputs, work: (_table_lines(outputs[0]) or _tail(outputs[0]))
            + "\n\nLast column: the step's time over NSA's without the loss. Above 1.10 for `nsa+loss` (candidate "
              "blocks), the loss's PyTorch path costs more than a tenth of the step: give it a Triton kernel.",
            expected_s=60),
    Section("estimate", "profile_memory.py: estimate against measured peak",
            lambda work: [_estimate_command(size, T) for size, T in ESTIMATE_RUNS], _needs_cuda,
            _summarise_estimates, expected_s=300, timeout_s=1200),
    Section("train", "train.py, 1.7B, NSA, 32k tokens, 20 steps",
            lambda work: [_train_command(work / "train", "--model_size", "1.7B", "--attention_type", "nsa",
                                         "--context_length", "32768", "--max_steps", "20")],
            _needs_memory(40), _summarise_training("train"), expected_s=240),
]


def run_section(section: Section, work: Path, timeout_s: float) -> tuple[str, float]:
    """Run the section's commands, each within what is left of `timeout_s`; return its Markdown body and the
    seconds it took."""
    start, outputs = time.perf_counter(), []
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the real kernels
    for command in section.commands(work):
        left = timeout_s - (time.perf_counter() - start)
        if left < 1:
            outputs.append("(not run: the section's time was spent)")
            continue
        try:
            proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=left)
            outputs.append(proc.stdout + proc.stderr + ("" if proc.returncode == 0 else
                                                        f"\n(exit code {proc.returncode})"))
        except subprocess.TimeoutExpired as e:  # its output arrives as bytes, whatever text= says
            told = "".join(part.decode(errors="replace") if isinstance(part, bytes) else part or ""
                           for part in (e.stdout, e.stderr))
            outputs.append(f"{told}\n(timed out after {left:.0f} s)")
    return section.summarise(outputs, work), time.perf_counter() - start


def report(info: dict, sections: list[Section], dry_run: bool, work: Path, log: Callable[[str], None] = print,
           budget_s: float | None = None) -> tuple[str, list[dict]]:
    """(the Markdown report, a record per section): the machine, a table of what ran, then each section (its
    commands, and its result, skip reason or plan). With `budget_s`, sections run in order while their expected
    time fits what is left of it (each then capped at what is left); the others are skipped, saying so."""
    gpu = f"{info['gpu']}, {info['memory'] / GB:.0f} GB" if info["cuda"] else "no CUDA device"
    records, parts, used = [], [], 0.0
    for section in sections:
        reason = section.needs(info)
        left = None if budget_s is None else budget_s - used
        if reason is None and left is not None and section.expected_s > left:
            reason = f"over the budget: expected about {section.expected_s} s, {max(0, left):.0f} s of it left"
        commands = "\n".join(shlex.join(c).replace(sys.executable, "python") for c in section.commands(work))
        record = {"section": section.name, "expected_s": section.expected_s, "seconds": None, "skipped": reason}
        parts.append(f"## {section.title} (`{section.name}`)\n\n```\n{commands}\n```\n")
        if reason:
            parts.append(f"Skipped: {reason}.\n")
            log(f"{section.name}: skipped ({reason})")
        elif dry_run:
            parts.append("Would run (dry run).\n")
            log(f"{section.name}: would run")
            used += section.expected_s
        else:
            log(f"{section.name}: running")
            body, seconds = run_section(section, work, section.timeout_s if left is None else
                                        min(section.timeout_s, left))
            used += seconds
            record.update(seconds=round(seconds, 1), result=body)
            parts.append(f"{body}\n\n({seconds:.0f} s)\n")
            log(f"{section.name}: done in {seconds:.0f} s")
        records.append(record)
    table = ["| section | ran | seconds | expected |", "|---|---|---|---|"] + [
        f"| {r['section']} | {'no: ' + r['skipped'] if r['skipped'] else 'planned' if dry_run else 'yes'} | "
        f"{'-' if r['seconds'] is None else r['seconds']} | {r['expected_s']} |" for r in records]
    header = (f"# gpu_check report\n\n{gpu}; torch {info['torch']}, Triton {info['triton'] or 'not installed'}; "
              f"{time.strftime('%Y-%m-%d %H:%M')}" + ("" if budget_s is None else f"; budget {budget_s:.0f} s")
              + "\n\n" + "\n".join(table) + "\n")
    return "\n".join([header, *parts]), records


def main(argv: list[str] | None = None) -> str:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_check.md", help="the Markdown report (and OUT.json beside it: a record "
                                                             "per section)")
    parser.add_argument("--only", nargs="+", choices=[s.name for s in SECTIONS], help="run these sections only")
    parser.add_argument("--budget", type=float, metavar="SECONDS",
                        help="run the sections in their order (the most telling first) while each one's expected "
                             "time fits what is left, each capped at that; --budget 540 fits one 10-minute call")
    parser.add_argument("--dry_run", action="store_true", help="write the plan without running anything")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if out.is_dir():
        parser.error(f"--out {out} is a directory; name the report file (e.g. {out / 'gpu_check.md'})")
    if out.suffix == ".json":
        parser.error(f"--out {out}: the Markdown report's name (its record goes beside it as .json); e.g. "
                     f"{out.with_suffix('.md')}")
    if args.budget is not None and not 0 < args.budget < math.inf:
        parser.error(f"--budget must be a positive number of seconds, got {args.budget}")
    try:
        for path in (out, out.with_suffix(".json")):
            check_writable(path, "--out")
    except ValueError as e:
        parser.error(str(e))
    sections = [s for s in SECTIONS if not args.only or s.name in args.only]
    info = machine()
    with tempfile.TemporaryDirectory() as tmp:
        text, records = report(info, sections, args.dry_run, Path(tmp), budget_s=args.budget)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps({"machine": info, "budget_s": args.budget, "dry_run": args.dry_run,
                                                    "sections": records}, indent=1))
    print(f"wrote {out} and {out.with_suffix('.json')}")
    if not args.dry_run and all(record["skipped"] for record in records):
        raise SystemExit(f"gpu_check: nothing was checked ({records[0]['skipped']}); see {out}")
    return text


if __name__ == "__main__":
    main()
