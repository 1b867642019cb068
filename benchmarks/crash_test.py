"""Kill training with SIGKILL at random moments, resume, and check that every step's loss is bitwise equal to an
uninterrupted run's: checkpoints are complete or ignored, resume is exact, and metrics.jsonl holds each step once.

    python benchmarks/crash_test.py --cycles 20                # single process, then 2 processes (torchrun, gloo)
    python benchmarks/crash_test.py --cycles 5 --procs 1
    python benchmarks/crash_test.py --scenario launcher --procs 2  # kill -9 of torchrun alone
    python benchmarks/crash_test.py --scenario twice               # two runs started at once on one directory

Each cycle starts `train.py --resume` (tiny model, a checkpoint every step so that kills often land mid-write) and
waits a random 2-8 s, then, by scenario:
- machine: kills it and every process below it with SIGKILL (Linux: /proc), as a machine crash would;
- launcher: kills only the torchrun launcher with SIGKILL; its workers must stop by themselves (they save first)
  within 60 s, and any still running then counts as an orphan;
- twice: starts the same command twice at once; the second must be refused (the directory's lock) while the first
  trains, then both are killed as in "machine".
The table counts the kills that left a `step-N.tmp` behind (a save interrupted mid-write), resumes that failed, the
steps lost (trained, then redone after the kill), orphans, and second runs refused. Exit code 1 when any loss
differs, any resume failed, a worker outlived its launcher or a second run was not refused.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from storage.checkpoint import latest_checkpoint  # noqa: E402

RUN = ["--model_size", "tiny", "--context_length", "64", "--batch_size", "2", "--warmup_steps", "5",
       "--checkpoint_interval", "1", "--keep_checkpoints", "2", "--sample_tokens", "0", "--log_interval", "1000"]


def command(procs: int, out_dir: Path, steps: int, data_dir: str) -> list[str]:
    args = [*RUN, "--max_steps", str(steps), "--data_dir", data_dir, "--out_dir", str(out_dir), "--resume"]
    if procs == 1:
        return [sys.executable, str(ROOT / "train.py"), *args]
    with socket.socket() as s:  # a free port per launch: a killed agent's port may linger
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs}", f"--master_port={port}",
            str(ROOT / "train.py"), *args]


def losses(out_dir: Path) -> dict[int, float]:
    """Step -> loss from metrics.jsonl; a step logged twice is an error."""
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row["step"] for row in rows if "loss" in row]
    if len(steps) != len(set(steps)):
        raise AssertionError(f"{out_dir}/metrics.jsonl logs a step twice: {steps}")
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


def newest_checkpoint(out_dir: Path) -> int:
    """The step of the newest complete (renamed from .tmp) checkpoint in `out_dir` (0: none)."""
    latest = latest_checkpoint(out_dir)
    return int(latest.name.split("-")[1]) if latest else 0


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it (torchrun starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo += children.get(found[-1], [])
    return found


def kill_all(pid: int) -> None:
    """SIGKILL `pid` and its descendants at once, as a machine crash would."""
    for p in descendants(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def run_to_end(cmd: list[str]) -> None:
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})


def start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def kill_launcher(proc: subprocess.Popen) -> int:
    """SIGKILL the launcher alone; returns how many of its workers are still running 60 s later (then killed)."""
    workers = descendants(proc.pid)[1:]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in workers):
        time.sleep(0.5)
    orphans = [p for p in workers if Path(f"/proc/{p}").exists()]
    for p in orphans:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    return len(orphans)


def end_cycle(proc: subprocess.Popen, scenario: str, out_dir: Path, counts: dict) -> None:
    """After a cycle's wait: count a run that ended by itself (finished, or in `twice` refused by the lock), or kill
    a running one as the scenario says and count what the kill left (a save cut short, steps to redo, orphans)."""
    if proc.poll() is not None:
        message = proc.stderr.read()
        if scenario == "twice" and proc.returncode != 0 and b"is in use by a running training run" in message:
            counts["refused"] += 1  # exit code 2 (torchrun's launcher: 1), the holder named
        else:
            counts["finished early"] += 1
            counts["failures"] += proc.returncode != 0
            if proc.returncode != 0:  # what went wrong, for the report
                print(f"a resumed run exited {proc.returncode}:\n{message.decode(errors='replace')[-3000:]}",
                      file=sys.stderr)
        return
    if scenario == "launcher":
        counts["orphans"] += kill_launcher(proc)
    else:
        kill_all(proc.pid)
        proc.wait()
    counts["kills"] += 1
    counts["mid-write"] += any(out_dir.glob("step-*.tmp"))
    logged = max(losses(out_dir), default=0) if (out_dir / "metrics.jsonl").exists() else 0
    saved = newest_checkpoint(out_dir)
    counts["lost"] += max(0, logged - saved)


def crash_cycles(procs: int, cycles: int, steps: int, data_dir: str, rng: random.Random, work: Path,
                 scenario: str = "machine") -> dict:
    reference = work / f"reference-{procs}"
    run_to_end(command(procs, reference, steps, data_dir))
    expected = losses(reference)
    out_dir = work / f"crashed-{procs}-{scenario}"
    counts = dict.fromkeys(("kills", "mid-write", "failures", "lost", "finished early", "orphans", "refused"), 0)
    for _ in range(cycles):
        saved = newest_checkpoint(out_dir)
        started = [start(command(procs, out_dir, steps, data_dir)) for _ in range(2 if scenario == "twice" else 1)]
        deadline = time.monotonic() + 60
        while scenario == "twice" and all(p.poll() is None for p in started) and time.monotonic() < deadline:
            time.sleep(0.2)  # until one of the two is refused (or, wrongly, both still run a minute later)
        time.sleep(rng.uniform(2, 8))
        for proc in started:
            end_cycle(proc, scenario, out_dir, counts)
        if (out_dir / "metrics.jsonl").exists() and saved > max(losses(out_dir), default=0):
            counts["failures"] += 1  # progress went back behind the newest checkpoint before the cycle
        if counts["finished early"] and (out_dir / "model").exists():
            break
    run_to_end(command(procs, out_dir, steps, data_dir))
    got = losses(out_dir)
    differ = [s for s in expected if got.get(s) != expected[s]]
    return {"scenario": scenario, "processes": procs, "cycles": counts["kills"] + counts["finished early"],
            "kills": counts["kills"], "kills mid-write": counts["mid-write"], "resume failures": counts["failures"],
            "steps lost (redone)": counts["lost"], "orphans": counts["orphans"],
            "second runs refused": counts["refused"] if scenario == "twice" else "-", "steps": len(got),
            "losses bitwise equal": not differ and len(got) == len(expected)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=400, help="steps of the run (enough to outlast the cycles)")
    parser.add_argument("--data_dir", default="data/stdlib", help="prepared data (created by train.py if missing)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scenario", choices=["machine", "launcher", "twice"], default="machine",
                        help="what is killed or started: see above (launcher needs --procs 2 or more)")
    args = parser.parse_args()
    if args.scenario == "launcher" and min(args.procs) < 2:
        parser.error("--scenario launcher kills torchrun: use --procs 2")
    rng = random.Random(args.seed)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [crash_cycles(p, args.cycles, args.steps, args.data_dir, rng, Path(tmp), args.scenario)
                for p in args.procs]
    print("| " + " | ".join(rows[0]) + " |\n|" + "---|" * len(rows[0]))
    for row in rows:
        print("| " + " | ".join(str(v) for v in row.values()) + " |")
    print(f"\n{time.perf_counter() - t0:.0f} s")
    if any(not r["losses bitwise equal"] or r["resume failures"] or r["orphans"]
           or r["second runs refused"] not in ("-", r["kills"]) for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
