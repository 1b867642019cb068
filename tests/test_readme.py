"""README.md's and docs/'s Python snippets and commands run as written on a CPU: each ```python block in a fresh
interpreter whose working directory is a temporary directory (so files the snippet writes land there) and whose
import path is the repository root (as for a user who runs it from a clone); every command, in order, in a fresh
clone."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["README.md", *(f"docs/{name}.md" for name in ("model", "training", "finetuning", "nsa", "evaluation",
                                                      "memory", "npt", "gpu"))]  # the order a reader follows
TEXT = "\n".join((ROOT / name).read_text() for name in DOCS)
SNIPPETS = re.findall(r"```python\n(.*?)```", TEXT, flags=re.S)


def test_the_docs_are_all_listed_and_short():
    assert sorted(DOCS[1:]) == sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
    assert all(len((ROOT / name).read_text().splitlines()) < 300 for name in DOCS[1:])


def test_readme_has_snippets():
    assert len(SNIPPETS) >= 3


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_readme_snippet_runs(index: int, tmp_path: Path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", SNIPPETS[index]], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"snippet {index}:\n{SNIPPETS[index]}\n{proc.stderr[-3000:]}"


# ---- every command of the README, in order, in a fresh clone ---------------------------------------------------------

SKIPPED = {  # what a CPU test cannot run, and why
    "~/models": "needs downloaded weights",
    "gpu_check.py": "needs a GPU",
    "pip ": "installs",
    "python3 -m venv": "installs",
    "pytest": "the test suite itself",
    "benchmarks/": "a benchmark (minutes; its --help is tested)",
    "lm_eval ": "downloads its task's data (tests/test_lm_eval.py runs a local task)",
    "--harness": "scores a trained passkey model for a minute (tests/test_lm_eval.py runs RULER on a tiny one)",
    "--documents docs.jsonl": "the reader's own documents (tests/test_eval.py scores some)",
}
SCALED = {"--context_length 131072": "--context_length 256", "--context_length 32768": "--context_length 256",
          "--context_length 1048576": "--context_length 256", "--nproc_per_node=8": "--nproc_per_node=2",
          "--context_parallel 8": "--context_parallel 2",
          "--model_size 4B": "--model_size tiny", "~/corpus": "CORPUS"}  # CPU-test scale; CORPUS: a stdlib package


def readme_commands() -> list[str]:
    """The shell commands of the bash blocks of README.md and docs/ (DOCS), in order, continuation lines joined,
    comments dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", TEXT, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def scaled(command: str) -> list[str]:
    """`command` as the test runs it: at CPU-test scale, a few steps, small evaluations."""
    import shlex
    import sysconfig

    for old, new in SCALED.items():
        command = command.replace(old, new)
    args = [a.replace("CORPUS", str(Path(sysconfig.get_paths()["stdlib"]) / "json")) for a in shlex.split(command)]
    args = [sys.executable if a == "python" else a for a in args]
    if args[0] == "torchrun":
        args = [sys.executable, "-m", "torch.distributed.run", *args[1:]]
    script = next((a for a in args if a.endswith(".py")), "")
    if script == "train.py" or "train_npt.py" in args:
        if "--max_steps" in args:
            args[args.index("--max_steps") + 1] = "2"
        args += ["--max_steps", "2"] if "--max_steps" not in args else []
    if script == "eval.py":  # the options of the tasks it runs only (eval.py refuses others)
        tasks = args[args.index("--tasks") + 1:] if "--tasks" in args else ["loss", "passkey", "needle"]
        tasks = tasks[:next((i for i, a in enumerate(tasks) if a.startswith("--")), len(tasks))]
        args += ["--samples", "2"]
        args += ["--depths", "0.5"] if {"passkey", "needle"} & set(tasks) and "--depths" not in args else []
        args += ["--eval_tokens", "2048"] if "loss" in tasks else []
    if script == "profile_memory.py" and "--model_size" not in args:
        args += ["--model_size", "tiny"]
    return args


def failure(proc: subprocess.CompletedProcess) -> str:
    """What a failed command printed: the ends of its stdout and stderr, and under torchrun every rank's own lines
    (a rank's one-line error or traceback, which the other ranks' tracebacks push out of the stderr's end)."""
    lines = f"{proc.stdout}\n{proc.stderr}".splitlines()
    ranks = sorted({m.group(0) for line in lines if (m := re.match(r"\[rank\d+\]", line))})
    own = [line for line in lines if line.startswith(("error:", "stopped:"))]
    for rank in ranks:
        own += [line for line in lines if line.startswith(rank)][-15:]
    return "\n".join([proc.stdout[-2000:], proc.stderr[-3000:], "each rank:", *own])


@pytest.mark.slow
def test_every_readme_command_runs_in_sequence_from_a_fresh_clone(tmp_path: Path):
    """A new user's session: each command of README.md and docs/, in order, in a fresh clone (the demo data is
    prepared by the first train.py, as it would be), none refused for a directory an earlier one used. Runs at
    CPU-test scale (SCALED; 2 steps per run); what a CPU cannot run is listed in SKIPPED."""
    clone = tmp_path / "clone"  # the checkout's files as a clone has them: tracked or not ignored, no data, no runs
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, clone / name)
    env = {**os.environ, "PYTHONPATH": str(clone), "OMP_NUM_THREADS": "1"}
    ran = []
    for command in readme_commands():
        if any(marker in command for marker in SKIPPED) or command.startswith(("for ", "ruff")):
            continue
        args = scaled(command)
        if args[1] == "profile_memory.py" and any(scaled(c) == args for c in ran):
            continue  # an estimate the docs print twice reads no state: once is enough
        proc = subprocess.run(args, cwd=clone, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"{command}\n{' '.join(args)}\n{failure(proc)}"
        ran.append(command)
    assert len(ran) >= 12 and any("torch.distributed.run" in " ".join(scaled(c)) for c in ran)
