"""What one NSA layer's forward + backward costs on a GPU, kernel by kernel, from its shapes alone: FLOPs and bytes
moved at full size, and the time they take at a stated fraction of a GPU's peak, for today's kernels and for the
designs that replace its query-centric selection, beside flash attention. Runs on any machine; nothing is allocated.

    python benchmarks/nsa_cost_model.py                                  # the 4B geometry (G = 4), H100, 16k-128k
    python benchmarks/nsa_cost_model.py --union_over_n 1.6               # the folded design at a measured union
    python benchmarks/nsa_cost_model.py --heads 64 --kv_heads 4          # a G = 16 geometry

Designs of the selection branch (the compression and window branches are flash attention over per-query ranges in
every design; `python benchmarks/nsa_block_sharing.py` measures the union below on a trained model):
- query-centric (the kernels the "GPU check" measured): one program per (query, KV head); its G rows padded to a
  16-row tile walk the query's n blocks, loading each block's K and V (2 l' D elements) per query, in the forward and
  again for dQ; dK/dV per block over the queries that chose it. Launched per query chunk (`attention_query_chunk`),
  each chunk with its own importance, top-n and CSR list (about LAUNCHES_PER_CHUNK kernels).
- block-centric, per chunk (the previous kernels): the block-centric selection below and top-n fused with the
  importance, launched per query chunk.
- folded + block dK/dV (today, nsa/triton_path.py): the forward and dQ folded as below (each in its own pass,
  recomputing the probabilities from the lse as flash attention's dQ does), dK and dV block-centric over the pairs
  that chose each block with no partial results; top-n fused with the importance; whole-sequence launches.
- folded: R consecutive queries x G heads form one tile of R G rows over the union of their selections (U blocks,
  U = union_over_n x n): each block is loaded once per R queries, the tile also computes the pairs of queries that
  did not choose a block (masked), so FLOPs grow by U / n. dQ, dK and dV in one backward pass over the same tiles.
- block-centric (FSA): one program per (key block, KV head) gathers the queries that chose it; K and V are loaded
  once per block, each pair moves a query's G rows in and a float32 partial output (forward) or partial dQ
  (backward) out, reduced by another kernel: no atomics. Whole-sequence launches.
Importance scores: query-centric wrote them as a (queries, T / l') float32 tensor, masked twice and read by topk;
the other designs fuse them with top-n (recomputed from the compression's log-sum-exp, nothing of size T^2 in
memory).
Bytes are those a kernel asks of memory. The selection's blocks are scattered over K and V larger than L2 (33 MB a
KV head at 64k), so they are counted as DRAM traffic; the other branches' keys fit in L2 and are counted as flash
attention's are. A prediction, not a measurement: `gpu_check.py --only bench` measures.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from training.cli import Parser  # noqa: E402

GPUS = {"H100": (989e12, 3.35e12), "H200": (989e12, 4.8e12), "A100": (312e12, 2.0e12)}  # bf16 dense FLOP/s, B/s
LAUNCH_SECONDS = 5e-6  # one kernel launch with its host work, a typical small-kernel floor
LAUNCHES_PER_CHUNK = 65  # today's kernels per query chunk, forward and backward (counted in nsa/attention.py)
DESIGNS = ("query-centric", "block-centric, per chunk", "folded", "block-centric", "folded + block dK/dV")
PER_CHUNK = ("query-centric", "block-centric, per chunk")  # launched per query chunk


@dataclass(frozen=True)
class Layer:
    """One attention layer of a (1, T) sequence: heads H, KV heads, head dim D, NSA blocks l, d, l', n, window w."""

    T: int
    H: int = 32
    KV: int = 8
    D: int = 128
    l: int = 32
    d: int = 16
    l_sel: int = 64
    n: int = 16
    w: int = 512
    element: int = 2  # bf16

    @property
    def G(self) -> int:
        return self.H // self.KV


def flash(layer: Layer) -> dict[str, tuple[float, float]]:
    """kernel -> (FLOPs, bytes): causal flash attention, forward and backward (which recomputes the scores): seven
    matrix products of 2 D FLOPs per (query, key) pair, T^2 / 2 pairs per head; Q, K, V, O, dO, dQ, dK, dV read or
    written about twice."""
    T, H, D, e = layer.T, layer.H, layer.D, layer.element
    return {"attention fwd+bwd": (7 * 2 * D * T * T / 2 * H, 2 * 8 * T * H * D * e)}


def _range_branch(pairs: float, layer: Layer) -> tuple[float, float]:
    """(FLOPs, bytes) of a flash-style branch over `pairs` (query, key) pairs per head, forward and backward: its
    keys (T / d compressed ones, or a window) stay in L2 between the tiles that reread them, so its DRAM traffic is
    that of flash attention's inputs and outputs."""
    return 7 * 2 * layer.D * pairs * layer.H, 2 * 8 * layer.T * layer.H * layer.D * layer.element


def nsa(layer: Layer, design: str, union_over_n: float, group: int, chunk: int) -> dict[str, tuple[float, float]]:
    """kernel -> (FLOPs, bytes) of one NSA layer, forward and backward, with the selection of `design`."""
    T, H, KV, D, e, G, n, l_sel = layer.T, layer.H, layer.KV, layer.D, layer.element, layer.G, layer.n, layer.l_sel
    cmp_pairs = T * T / (2 * layer.d)  # causal: a query sees t / d compressed keys
    costs = {"compression": _range_branch(cmp_pairs, layer), "window": _range_branch(T * min(layer.w, T / 2), layer)}
    sel_pairs = T * n * l_sel  # per head: each query reads n blocks of l' keys
    block_bytes = 2 * l_sel * D * e  # one block's K and V
    blocks_chosen = T * KV * n  # (query, block) pairs per KV head, over the KV heads
    score_flops = 2 * D * cmp_pairs * H  # the compression's probabilities recomputed for the importance
    if design == "query-centric":
        padded = max(16, G) / G  # G rows in a tile of at least 16
        costs["selection"] = (7 * 2 * D * sel_pairs * H * padded, 3 * blocks_chosen * block_bytes)
    elif design == "folded":
        union = union_over_n * n
        loads = (T / group) * KV * union * block_bytes  # each block once per group of queries
        costs["selection"] = (7 * 2 * D * sel_pairs * H * union_over_n, 3 * loads)
    elif design == "folded + block dK/dV":
        union_loads = (T / group) * KV * union_over_n * n * block_bytes  # forward, and again for dQ
        block_loads = KV * (T / l_sel) * block_bytes  # dK/dV: each block read once and its gradients written once
        pair_rows = blocks_chosen * G * D * 2 * e  # dK/dV: each pair's Q and dO rows read
        # forward 2 products and dQ 3 over the union (masked pairs included); dK/dV 4 over the chosen pairs
        flops = 2 * D * sel_pairs * H * (5 * union_over_n + 4)
        costs["selection"] = (flops, 2 * union_loads + 2 * block_loads + pair_rows)
    else:  # block-centric, per chunk or whole
        loads = KV * (T / l_sel) * block_bytes  # each block's K and V once: read forward, read backward, dK dV written
        # per (query, block) pair: Q in (forward), Q and dO in (backward); a float32 partial output and a float32
        # partial dQ written, and read back by the reductions
        partials = blocks_chosen * G * D * (3 * e + 4 * 4)
        costs["selection"] = (7 * 2 * D * sel_pairs * H, 3 * loads + partials)
    if design == "query-centric":
        scores = KV * T * (T / l_sel) / 2 * 4  # float32 (queries, blocks), causal half
        costs["importance + top-n"] = (score_flops, 6 * scores)  # written, two masked copies, read by topk
    else:  # top-n fused with the importance
        costs["importance + top-n"] = (score_flops, 0.0)
    if design in PER_CHUNK:
        costs["launches"] = (0.0, 0.0)
        costs["_launch_seconds"] = (-(-T // chunk) * LAUNCHES_PER_CHUNK * LAUNCH_SECONDS, 0.0)
    return costs


def seconds(costs: dict[str, tuple[float, float]], peak: float, bandwidth: float, efficiency: float) -> dict:
    """kernel -> seconds: the larger of its FLOPs and its bytes at `efficiency` of the peak."""
    out = {name: max(f / (efficiency * peak), b / (efficiency * bandwidth)) for name, (f, b) in costs.items()
           if not name.startswith("_")}
    for name, (s, _) in costs.items():
        if name.startswith("_"):
            out["launches"] = s
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768, 65536, 131072])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv_heads", type=int, default=8)
    p.add_argument("--gpu", choices=sorted(GPUS), default="H100")
    p.add_argument("--efficiency", type=float, default=0.45, help="fraction of peak FLOP/s and bandwidth reached")
    p.add_argument("--union_over_n", type=float, default=2.0,
                   help="folded design: distinct blocks of --group consecutive queries over n (measured by "
                        "nsa_block_sharing.py)")
    p.add_argument("--group", type=int, default=16, help="folded design: consecutive queries per tile")
    p.add_argument("--chunk", type=int, default=512, help="today's query chunk in training")
    args = p.parse_args(argv)
    if args.heads % args.kv_heads or not 0 < args.efficiency <= 1 or args.union_over_n < 1:
        p.error("--heads must be a multiple of --kv_heads, --efficiency in (0, 1], --union_over_n >= 1")
    peak, bandwidth = GPUS[args.gpu]
    rows = []
    print(f"one layer, forward + backward, bf16, H {args.heads}, KV {args.kv_heads} (G {args.heads // args.kv_heads}),"
          f" D 128, l 32, d 16, l' 64, n 16, w 512; {args.gpu} at {args.efficiency:.0%} of peak; folded: "
          f"{args.group} queries, union {args.union_over_n:g} n")
    print(f"{'T':>7} {'flash ms':>9} " + " ".join(f"{d + ' ms':>27} {'x flash':>8}" for d in DESIGNS))
    for T in args.lengths:
        layer = Layer(T, H=args.heads, KV=args.kv_heads)
        base = sum(seconds(flash(layer), peak, bandwidth, args.efficiency).values())
        row = {"T": T, "flash_ms": base * 1e3}
        for design in DESIGNS:
            parts = seconds(nsa(layer, design, args.union_over_n, args.group, args.chunk), peak, bandwidth,
                            args.efficiency)
            row[design] = {name: s * 1e3 for name, s in parts.items()}
            row[f"{design}_ms"] = sum(parts.values()) * 1e3
        rows.append(row)
        print(f"{T:>7} {row['flash_ms']:>9.1f} " + " ".join(
            f"{row[f'{d}_ms']:>27.1f} {row['flash_ms'] / row[f'{d}_ms']:>8.2f}" for d in DESIGNS))
    last = rows[-1]
    print(f"\nat T = {last['T']}, ms per kernel:")
    for design in DESIGNS:
        print(f"  {design:>24}: " + ", ".join(f"{k} {v:.1f}" for k, v in last[design].items()))
    return rows


if __name__ == "__main__":
    main()
