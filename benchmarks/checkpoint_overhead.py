"""What the checkpoint manifest (size and CRC-32 of every file, fsync) costs on top of a save, and what verifying
costs on resume, measured in one process on the same model; then the same rates applied to the 4B preset.

    python benchmarks/checkpoint_overhead.py                 # demo model, 5 saves after a warm-up
    python benchmarks/checkpoint_overhead.py --model_size 0.6B --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from model import Transformer  # noqa: E402
from modeling.config import ModelConfig  # noqa: E402
from storage import checkpoint  # noqa: E402

GB = 1e9


def timed_saves(model: Transformer, optimizer: torch.optim.Optimizer, out_dir: Path, repeats: int
                ) -> tuple[float, float]:
    """Median seconds of a whole save_checkpoint call and of its manifest step (checksums, fsyncs, manifest.json),
    over `repeats` saves after one warm-up save."""
    write_manifest, manifest_times, save_times = checkpoint._write_manifest, [], []

    def timed(tmp: Path) -> None:
        t0 = time.perf_counter()
        write_manifest(tmp)
        manifest_times.append(time.perf_counter() - t0)

    with mock.patch.object(checkpoint, "_write_manifest", timed):
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            checkpoint.save_checkpoint(out_dir, i, model, optimizer, {"step": i})
            save_times.append(time.perf_counter() - t0)
            checkpoint.prune_checkpoints(out_dir, keep=1)
    return statistics.median(save_times[1:]), statistics.median(manifest_times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_size", default="demo")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_preset(args.model_size))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 8, dtype=torch.long), labels=torch.zeros(1, 8, dtype=torch.long)).loss.backward()
    optimizer.step()  # AdamW state exists, as in a training checkpoint
    with tempfile.TemporaryDirectory() as tmp:
        save, manifest = timed_saves(model, optimizer, Path(tmp), args.repeats)
        path = checkpoint.latest_checkpoint(Path(tmp))
        size = sum(p.stat().st_size for p in path.iterdir())
        t0 = time.perf_counter()
        checkpoint.verify_checkpoint(path)
        verify = time.perf_counter() - t0
    plain = save - manifest
    print(f"| model | checkpoint | save | of which manifest | overhead | verify on resume |\n"
          f"|---|---|---|---|---|---|\n"
          f"| {args.model_size} | {size / GB:.3f} GB | {save:.3f} s | {manifest:.3f} s | {manifest / plain:.0%} | "
          f"{verify:.3f} s ({size / GB / verify:.2f} GB/s) |")
    big = ModelConfig.from_preset("4B")
    with torch.device("meta"):  # parameters counted, nothing allocated
        per_rank = sum(p.numel() for p in Transformer(big).parameters()) * 12 / 2  # fp32 weights + 2 AdamW moments
    print(f"\n4B on 2 ranks: {per_rank / GB:.1f} GB per rank; at this machine's rates (save {size / plain / GB:.2f} "
          f"GB/s, manifest {size / manifest / GB:.2f} GB/s) a save takes {per_rank / size * plain:.0f} s and the "
          f"manifest adds {per_rank / size * manifest:.0f} s")


if __name__ == "__main__":
    main()
