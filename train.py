"""Pretrain the decoder on packed token windows, on one CPU/GPU or sharded with FSDP2 under torchrun.

    python train.py                                               # CPU demo: small model, a few minutes
    python train.py --config configs/tiny.json --max_steps 50     # file < command line
    torchrun --nproc_per_node=2 train.py --context_length 131072  # 2 GPUs: 4B, NSA, checkpointing, chunked loss

Options are the fields of `TrainConfig` (defaults < `--config` file < command line). Values left at "auto"/None are
resolved by `resolve_config` from the device and the context length; the resolved config is printed and saved as
`out_dir/config.json`. Per step, loss / lr / grad norm / tokens/s / memory (/ MFU on GPU) go to the console and to
`out_dir/metrics.jsonl`; checkpoints go to `out_dir/step-N` (see checkpoint.py); the final weights to
`out_dir/model/` (model.safetensors + config.json) and `out_dir/hf/` for full attention (see weights.py).
The run itself is training/trainer.py; this file is its command line.
"""

from __future__ import annotations

import sys

import torch.distributed as dist

from storage.checkpoint import SaveFailed
from training.cli import exit_with_error
from training.monitor import MemoryBudgetExceeded, TooManyBadSteps
from training.options import parse_run
from training.parallel import init_runtime
from training.trainer import train


def main(argv: list[str] | None = None) -> dict:
    cfg, given = parse_run(argv)
    rt = init_runtime()
    try:
        metrics = train(cfg, rt, given=given)
    except BaseException:
        if dist.is_initialized():
            dist.destroy_process_group()  # no barrier: the other ranks may never reach it
        raise
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return metrics


if __name__ == "__main__":
    try:
        main()
    except (MemoryBudgetExceeded, TooManyBadSteps, SaveFailed) as e:  # saved where possible: one line
        exit_with_error(f"stopped: {e}", code=1)
    except (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, PermissionError) as e:
        if "--verbose" in sys.argv:  # a bad input, or a damaged / unsafe checkpoint: one line
            raise
        exit_with_error(f"error: {e}")
