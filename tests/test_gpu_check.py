"""gpu_check.py without a GPU: the plan on a machine like an H100 (what runs, what is skipped and why), the report on
this CPU, and the parsing of each section's output (profile_memory --json, metrics.jsonl)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import gpu_check


def test_the_plan_on_an_80_gb_gpu_skips_only_the_140_gb_headline(tmp_path: Path):
    info = {"cuda": True, "gpu": "NVIDIA H100 80GB HBM3", "memory": 80 * 10**9, "torch": "2.13", "triton": "3.9"}
    lines: list[str] = []
    text, _ = gpu_check.report(info, gpu_check.SECTIONS, dry_run=True, work=tmp_path, log=lines.append)
    assert lines == ["kernels: would run", "bench: would run", "context: would run", "documents: would run",
                     "headline: skipped (needs 140 GB of GPU memory, this GPU has 80 GB)", "loss: would run",
                     "estimate: would run", "train: would run"]
    assert text.count("## ") == 8 and "profile_memory.py --model_size 1.7B --context_length 32768" in text
    no_triton, _ = gpu_check.report({**info, "triton": None}, gpu_check.SECTIONS[:1], True, tmp_path, lines.append)
    assert "Skipped: Triton is not installed" in no_triton


def test_a_budget_runs_the_most_telling_sections_that_fit_and_says_what_it_left(tmp_path: Path, monkeypatch):
    """--budget 540 on an H200: the sections run in order while their expected time fits what is left (each capped
    at it), the rest are skipped with the reason; the report opens with one table, and OUT.json holds a record per
    section."""
    info = {"cuda": True, "gpu": "NVIDIA H200", "memory": 141 * 10**9, "torch": "2.13", "triton": "3.9"}
    caps = []

    def fake_run(section: gpu_check.Section, work: Path, timeout_s: float) -> tuple[str, float]:
        caps.append((section.name, timeout_s))
        return "ran", float(section.expected_s)

    monkeypatch.setattr(gpu_check, "run_section", fake_run)
    monkeypatch.setattr(gpu_check, "machine", lambda: info)
    gpu_check.main(["--budget", "540", "--out", str(tmp_path / "report.md")])
    assert [name for name, _ in caps] == ["kernels", "bench", "context", "documents", "headline"]
    assert caps[0][1] == 540 and caps[-1][1] == 540 - sum(s.expected_s for s in gpu_check.SECTIONS[:4])
    record = json.loads((tmp_path / "report.json").read_text())
    assert [r["section"] for r in record["sections"] if r["skipped"]] == ["loss", "estimate", "train"]
    assert "over the budget: expected about 60 s, 0 s of it left" in record["sections"][5]["skipped"]
    text = (tmp_path / "report.md").read_text()
    assert "| section | ran | seconds | expected |" in text and "| headline | yes | 180.0 | 180 |" in text


def test_without_a_gpu_every_section_is_skipped_and_the_exit_code_says_so(tmp_path: Path):
    """(CUDA is hidden from tests not marked gpu: tests/conftest.py.)"""
    with pytest.raises(SystemExit, match="gpu_check: nothing was checked \\(no CUDA device\\)") as exit_info:
        gpu_check.main(["--out", str(tmp_path / "report.md")])
    assert exit_info.value.code != 0
    assert (tmp_path / "report.md").read_text().count("Skipped: no CUDA device") == 8
    assert gpu_check.main(["--out", str(tmp_path / "plan.md"), "--dry_run"])  # the plan: exit 0


def test_section_outputs_become_tables(tmp_path: Path):
    peak = {"total": 11 * 2**30}
    result = {"peak": peak, "measured": {"peak": {"total": 10 * 2**30}}}
    assert gpu_check.estimate_error(result) == 0.1
    text = gpu_check._summarise_estimates(["log line\n" + json.dumps(result)] * 3 + ["Traceback: OOM"], tmp_path)
    assert "| 0.6B | 8192 | 11.00 | 10.00 | +10.0% |" in text and "| 1.7B | 32768 | failed |" in text
    rows = [{"step": s, "loss": 5.0 - s / 10, "tokens_per_s": 1000.0 * s, "step_time_s": 1.0, "mem_peak_gib": 30.0 + s,
             "mfu": 0.01 * s} for s in range(1, 6)]
    summary = gpu_check.training_summary([*rows, {"step": 5, "resumed_with": {}}])
    assert summary == {"tokens_per_s": 4000.0, "step_time_s": 1.0, "mfu": 0.04, "mem_peak_gib": 35.0,
                       "final_loss": 4.5, "steps": 5}
    table = "| T | layer |\n|---|---|\n| 65536 | nsa |"
    bench = gpu_check._summarise_bench([f"log\n{table}\n", f"{table}\n", "| 65536 | nsa |\ntop kernels of one nsa "
                                        "forward + backward at T = 65536:\nkernel table"], tmp_path)
    assert bench.count("| 65536 | nsa |") == 2 and "```\ntop kernels" in bench and "kernel table" in bench
    failed = gpu_check._summarise_bench([table, table, "Traceback: out of memory"], tmp_path)
    assert "Traceback: out of memory" in failed
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert "| 5 | 4,000 | 4.0% | 1.00 s | 35.0 GiB | 4.500 |" in gpu_check._summarise_training("train")([""], tmp_path)
