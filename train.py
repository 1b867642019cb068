"""Pretrain the decoder on packed token windows, on one CPU/GPU or sharded with FSDP2 under torchrun.

    python train.py                                               # CPU demo: small model, a few minutes
    python train.py --config configs/tiny.json --max_steps 50     # file < command line
    torchrun --nproc_per_node=2 train.py --context_length 131072  # 2 GPUs: 4B, NSA, checkpointing, chunked loss

Options are the fields of `TrainConfig` (defaults < `--config` file < command line). Values left at "auto"/None are
resolved by `resolve_config` from the device and the context length; the resolved config is printed and saved as
`out_dir/config.json`. Per step, loss / lr / grad norm / tokens/s / memory (/ MFU on GPU) go to the console and to
`out_dir/metrics.jsonl`; checkpoints go to `out_dir/step-N` (see storage/checkpoint.py); the final weights
to `out_dir/model/` (model.safetensors + config.json) and `out_dir/hf/` for full attention (storage/weights.py).
The run itself is training/trainer.py; this file is its command line.
"""

from __future__ import annotations

from training.cli import load_plugins
from training.options import parse_run
from training.parallel import init_runtime
from training.trainer import one_line_errors, run_command


def main(argv: list[str] | None = None) -> dict:
    load_plugins(argv)
    cfg, given = parse_run(argv)
    return run_command(cfg, init_runtime(cfg.context_parallel), given=given)


if __name__ == "__main__":
    load_plugins(None)
    options, given_options = parse_run()
    with one_line_errors(options.verbose):
        run_command(options, init_runtime(options.context_parallel), given=given_options)
