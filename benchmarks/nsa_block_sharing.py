"""How many distinct selection blocks R consecutive queries choose: the measurement that decides how NSA's selection
fills a GPU tile at a small GQA group (G = 4). Folding R queries x G heads into one tile over the union of their
blocks loads each block once for R queries; FSA's block-centric loop gathers the queries of each block instead. If
R = 16 queries share about 2n blocks or fewer, folding fills the tensor cores with less machinery.

    python benchmarks/nsa_block_sharing.py runs/nsa-2048/model --data_dir data/stdlib --windows 4
    python benchmarks/nsa_block_sharing.py runs/nsa-2048/model --random    # the same geometry, untrained weights

For each layer and each R (default 8, 16, 32): over aligned groups of R consecutive queries whose top-n really
chooses (from n x l' on) and every KV head, the mean, median and 90th percentile of the number of distinct blocks
in the union of their selections, that mean over n, and the K/V bytes a folded tile reads per query against one
query's own n blocks (query-centric). Selections are recomputed explicitly (nsa.inspection), so T of a few thousand
tokens at most.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from evaluation.loss import validation_windows  # noqa: E402
from model import Transformer  # noqa: E402
from nsa.blocks import first_choosing_position  # noqa: E402
from nsa.inspection import inspect  # noqa: E402
from storage.weights import load_model  # noqa: E402
from training.cli import Parser  # noqa: E402


def union_sizes(selected: torch.Tensor, group: int, first: int) -> torch.Tensor:
    """Distinct blocks in the union of the selections of each aligned group of `group` consecutive queries from
    position `first` on: selected (B, KV, T, n), -1 for empty slots -> (B * KV * groups,) int64."""
    B, KV, T, n = selected.shape
    start = -(-first // group) * group
    groups = (T - start) // group
    if groups <= 0:
        return torch.zeros(0, dtype=torch.int64)
    blocks = selected[:, :, start:start + groups * group].reshape(B, KV, groups, group * n)  # (B, KV, g, R n)
    ordered = blocks.sort(dim=-1).values
    distinct = (ordered[..., 1:] != ordered[..., :-1]).sum(-1) + 1 - (ordered == -1).any(-1).long()
    return distinct.flatten()


def measure(model: Transformer, windows: torch.Tensor, groups: list[int]) -> list[dict]:
    """Per layer and group size R: statistics of `union_sizes` over `windows` (N, T)."""
    config = model.config
    n, first = config.nsa_num_selected, first_choosing_position(config.nsa_select_block_size, config.nsa_num_selected)
    per_layer: list[dict[int, list[torch.Tensor]]] = []
    for window in windows:
        for layer, found in enumerate(inspect(model, window[None])):
            if layer == len(per_layer):
                per_layer.append({r: [] for r in groups})
            for r in groups:
                per_layer[layer][r].append(union_sizes(found["selected"], r, first))
    rows = []
    for layer, sizes in enumerate(per_layer):
        for r in groups:
            s = torch.cat(sizes[r]).double()
            if not len(s):
                continue
            rows.append({"layer": layer, "R": r, "groups": len(s), "mean": s.mean().item(),
                         "median": s.median().item(), "p90": s.quantile(0.9).item(), "over_n": s.mean().item() / n,
                         "bytes_ratio": s.mean().item() / (r * n)})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="an NSA model: a run's model/ or step-N/")
    p.add_argument("--data_dir", help="prepared data with a validation split (default: the run's)")
    p.add_argument("--context_length", type=int, help="tokens per window (default: the model's, at most 4096)")
    p.add_argument("--windows", type=int, default=2, help="validation windows measured")
    p.add_argument("--groups", type=int, nargs="+", default=[8, 16, 32], help="R: consecutive queries folded")
    p.add_argument("--random", action="store_true", help="the same geometry with freshly initialised weights")
    args = p.parse_args(argv)
    if args.windows < 1 or min(args.groups) < 1:
        p.error("--windows and --groups must be >= 1")
    model = load_model(args.checkpoint).eval()
    if model.config.attention_type != "nsa":
        p.error(f"{args.checkpoint} has {model.config.attention_type!r} attention: pass an NSA model")
    if args.random:
        torch.manual_seed(0)
        model = Transformer(model.config).eval()
    config = model.config
    length = args.context_length or min(config.context_length, 4096)
    first = first_choosing_position(config.nsa_select_block_size, config.nsa_num_selected)
    if first is None or length <= first:
        p.error(f"--context_length {length}: top-n chooses only beyond n x l' tokens, with n >= 4 (this model: n "
                f"{config.nsa_num_selected}, l' {config.nsa_select_block_size})")
    data_dir = args.data_dir or _run_data_dir(Path(args.checkpoint))
    if data_dir is None:
        p.error("--data_dir: the checkpoint is not in a run directory that names its data")
    windows, _ = validation_windows(data_dir, length, args.windows * (length - 1))
    rows = measure(model, windows[:args.windows], args.groups)
    n, G = config.nsa_num_selected, config.n_rep
    print(f"{args.checkpoint}{' (random weights)' if args.random else ''}: T = {length}, n = {n} blocks of "
          f"l' = {config.nsa_select_block_size}, G = {G}, {len(windows[:args.windows])} windows")
    print(f"{'layer':>5} {'R':>4} {'groups':>7} {'union mean':>11} {'median':>7} {'p90':>6} {'mean / n':>9} "
          f"{'K/V read vs query-centric':>26}")
    for row in rows:
        print(f"{row['layer']:>5} {row['R']:>4} {row['groups']:>7} {row['mean']:>11.1f} {row['median']:>7.0f} "
              f"{row['p90']:>6.0f} {row['over_n']:>9.2f} {row['bytes_ratio']:>26.2f}")
    return rows


def _run_data_dir(checkpoint: Path) -> str | None:
    """The data directory the run holding `checkpoint` recorded, if any."""
    for place in (checkpoint.parent, checkpoint.parent.parent):
        if (place / "config.json").is_file():
            return json.loads((place / "config.json").read_text()).get("train", {}).get("data_dir")
    return None


if __name__ == "__main__":
    main()
