"""The measurements behind NSA's GPU selection design: the union of consecutive queries' selections
(benchmarks/nsa_block_sharing.py) against a per-group loop, and the cost model's counts
(benchmarks/nsa_cost_model.py) against the formulas they implement."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch

from model import Transformer
from modeling.config import ModelConfig

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SHARING = runpy.run_path(str(BENCHMARKS / "nsa_block_sharing.py"))
COST = runpy.run_path(str(BENCHMARKS / "nsa_cost_model.py"))


def test_union_sizes_count_the_distinct_blocks_of_each_group():
    torch.manual_seed(0)
    selected = torch.randint(-1, 9, (2, 3, 40, 4))  # (B, KV, T, n), -1: an empty slot
    for group, first in ((8, 16), (5, 7), (16, 0)):
        sizes = SHARING["union_sizes"](selected, group, first)
        start = -(-first // group) * group
        want = [len({int(b) for b in selected[i, h, g:g + group].flatten() if b >= 0})
                for i in range(2) for h in range(3) for g in range(start, start + (40 - start) // group * group, group)]
        assert sizes.tolist() == want


def test_measure_reads_the_selections_of_an_nsa_model():
    config = ModelConfig.from_preset("tiny", attention_type="nsa")  # l' 16, n 4: top-n chooses from 64 tokens
    model = Transformer(config).eval()
    windows = torch.randint(0, config.vocab_size, (2, 128))
    rows = SHARING["measure"](model, windows, [8, 16])
    assert {(r["layer"], r["R"]) for r in rows} == {(layer, r) for layer in range(config.n_layers) for r in (8, 16)}
    for row in rows:
        assert row["groups"] == 2 * config.n_kv_heads * (128 - 64) // row["R"]
        assert config.nsa_num_selected <= row["mean"] <= min(row["R"] * config.nsa_num_selected, 128 // 16)


def test_the_cost_model_counts_as_its_formulas_say():
    layer = COST["Layer"](65536)
    flash = COST["flash"](layer)["attention fwd+bwd"][0]
    assert flash == pytest.approx(7 * layer.H * layer.D * layer.T ** 2)  # seven products over the causal half
    query = COST["nsa"](layer, "query-centric", 2.0, 16, 512)
    folded = COST["nsa"](layer, "folded", 2.0, 16, 512)
    per_pass = layer.T * layer.KV * layer.n * 2 * layer.l_sel * layer.D * 2  # 32 KB of K and V per (query, block)
    assert per_pass == pytest.approx(275e9, rel=0.01) and query["selection"][1] == 3 * per_pass
    assert folded["selection"][1] == pytest.approx(query["selection"][1] * 2.0 / 16)  # U / (R n) of the loads
    assert folded["selection"][0] == pytest.approx(query["selection"][0] / 4 * 2.0)  # no 16-row padding, U / n pairs
    assert folded["compression"] == query["compression"] and "_launch_seconds" not in folded
    per_chunk, whole = (COST["nsa"](layer, d, 2.0, 16, 512) for d in ("block-centric, per chunk", "block-centric"))
    assert per_chunk["selection"] == whole["selection"]  # the same kernels, launched per chunk
    assert per_chunk["importance + top-n"] == whole["importance + top-n"] and "_launch_seconds" in per_chunk
    hybrid = COST["nsa"](layer, "folded + block dK/dV", 2.0, 16, 512)
    block_bytes = 2 * layer.l_sel * layer.D * 2
    union_loads = layer.T / 16 * layer.KV * 2.0 * layer.n * block_bytes
    block_loads = layer.KV * layer.T / layer.l_sel * block_bytes
    pair_rows = layer.T * layer.KV * layer.n * layer.G * layer.D * 2 * 2
    assert hybrid["selection"][1] == pytest.approx(2 * union_loads + 2 * block_loads + pair_rows)
    assert hybrid["selection"][0] == pytest.approx(folded["selection"][0] * (5 * 2.0 + 4) / (7 * 2.0))
    assert "_launch_seconds" not in hybrid


def test_the_figures_quoted_from_the_cost_model(capsys):
    """docs/gpu.md and benchmarks/results/nsa.md quote these predictions: block-centric 0.92x / 3.12x / 5.10x flash
    at 16k / 64k / 128k, launched per chunk (the previous kernels) 0.59x / 2.12x / 3.69x, today's kernels (folded
    forward and dQ, block-centric dK/dV, whole sequence) 1.00x / 3.34x / 5.40x at a union of 2n (1.19x / 3.88x /
    6.07x at 1.5n), and the
    query-centric kernels 0.45x at 64k (4B geometry, H100 at 45%)."""
    rows = {row["T"]: row for row in COST["main"]([])}
    ratio = {T: {d: row["flash_ms"] / row[f"{d}_ms"] for d in COST["DESIGNS"]} for T, row in rows.items()}
    assert round(ratio[16384]["block-centric"], 2) == 0.92 and round(ratio[65536]["block-centric"], 2) == 3.12
    assert round(ratio[131072]["block-centric"], 2) == 5.10 and round(ratio[65536]["query-centric"], 2) == 0.45
    assert round(ratio[65536]["folded"], 2) == 2.95
    previous = [round(ratio[T]["block-centric, per chunk"], 2) for T in (16384, 65536, 131072)]
    assert previous == [0.59, 2.12, 3.69]
    today = [round(ratio[T]["folded + block dK/dV"], 2) for T in (16384, 65536, 131072)]
    assert today == [1.00, 3.34, 5.40]
    measured_union = COST["main"](["--union_over_n", "1.5", "--lengths", "16384", "65536", "131072"])
    assert [round(r["flash_ms"] / r["folded + block dK/dV_ms"], 2) for r in measured_union] == [1.19, 3.88, 6.07]
