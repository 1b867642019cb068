"""LoRA on a quantized frozen base (train.py --finetune lora --quantize_base int8|nf4|int4, torchao), on a CPU:

1. memory of the 0.6B geometry's block linear weights (what --quantize_base quantizes) in float32, bf16, int8, nf4
   and int4, measured from the parameter storages after quantization;
2. time per LoRA step of the 0.6B geometry (random weights, 1 x --context_length tokens) with each base;
3. time per step and held-out loss after N LoRA steps on the demo model (first trained dense for --base_steps),
   with each base. All in one process, one base after the other.

    python benchmarks/quantized_base.py                        # 0.6B; demo: 200 base steps, 100 LoRA steps
    python benchmarks/quantized_base.py --base_steps 30 --lora_steps 10 --steps_06b 2   # a quick look
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import train  # noqa: E402
from evaluation.loss import validation_loss, validation_windows  # noqa: E402
from model import Transformer  # noqa: E402
from modeling.config import GiB, ModelConfig  # noqa: E402
from storage.weights import load_model  # noqa: E402
from training.lora import apply_lora, init_lora, load_adapter  # noqa: E402
from training.quantize import parameter_bytes, quantize_base  # noqa: E402

# The base: float32, or a --quantize_base value. Not bf16: on a CPU without native bf16 matrix multiplication,
# bf16 compute runs several times slower than float32, which says nothing of a GPU.
KINDS = ("float32", "int8", "nf4", "int4")


def base_options(kind: str) -> list[str]:
    """train.py options for a LoRA run on the base `kind` (one of KINDS)."""
    return [] if kind == "float32" else ["--quantize_base", kind]


def median_step_time(out_dir: Path, skip: int) -> float:
    """Median step_time_s of a run's metrics.jsonl, after its first `skip` steps."""
    times = [json.loads(line)["step_time_s"] for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    times = sorted(times[skip:])
    return times[len(times) // 2]


def step_times_06b(steps: int, context_length: int, runs: Path) -> None:
    """Time per LoRA step of the 0.6B geometry (random weights) with each base."""
    print(f"\n## 0.6B geometry: LoRA steps of 1 x {context_length} tokens (random weights), median of steps "
          f"2-{steps}\n")
    print("| base | step time | of float32 |\n|---|---|---|")
    times = {}
    for kind in KINDS:
        out = runs / f"0.6B-{kind}"
        train.main(["--model_size", "0.6B", "--context_length", str(context_length), "--batch_size", "1",
                    "--finetune", "lora", "--max_steps", str(steps), "--sample_tokens", "0", "--checkpoint_interval",
                    "0", "--log_interval", "100", "--out_dir", str(out), *base_options(kind)])
        times[kind] = median_step_time(out, 1)
        print(f"| {kind} | {times[kind]:.1f} s | {times[kind] / times['float32']:.2f} |", flush=True)


def block_linear_bytes(model: Transformer) -> int:
    """Bytes of the blocks' frozen linear weights (no norms, no adapters)."""
    return sum(parameter_bytes(m) - sum(p.numel() * p.element_size() for p in m.lora_A.parameters())
               - sum(p.numel() * p.element_size() for p in m.lora_B.parameters())
               if hasattr(m, "lora_A") else parameter_bytes(m)
               for name, m in model.layers.named_modules() if isinstance(m, torch.nn.Linear) and ".lora_" not in name)


def memory_table() -> None:
    print("## 0.6B geometry: the block linear weights (random values), GiB\n")
    print("| base | bytes | of float32 | of bf16 |\n|---|---|---|---|")
    sizes = {}
    for kind in KINDS:
        torch.manual_seed(0)
        model = Transformer(ModelConfig.from_preset("0.6B"))
        apply_lora(model)
        if kind != "float32":
            quantize_base(model, kind)
        sizes[kind] = block_linear_bytes(model)
        del model
    sizes = {"float32": sizes["float32"], "bfloat16": sizes["float32"] // 2, "int8": sizes["int8"],
             "nf4": sizes["nf4"], "int4 (CPU: one value per byte)": sizes["int4"]}
    for kind, size in sizes.items():
        print(f"| {kind} | {size / GiB:.3f} | {size / sizes['float32']:.0%} | {size / sizes['bfloat16']:.0%} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base_steps", type=int, default=200)
    parser.add_argument("--lora_steps", type=int, default=100)
    parser.add_argument("--context_length", type=int, default=256)
    parser.add_argument("--steps_06b", type=int, default=4, help="LoRA steps of the 0.6B geometry per base")
    args = parser.parse_args()
    memory_table()
    T = args.context_length
    common = ["--model_size", "demo", "--context_length", str(T), "--sample_tokens", "0", "--checkpoint_interval", "0",
              "--log_interval", "100"]
    with tempfile.TemporaryDirectory() as tmp:
        runs = Path(tmp)
        step_times_06b(args.steps_06b, T, runs)
        train.main([*common, "--max_steps", str(args.base_steps), "--out_dir", str(runs / "base")])
        windows = validation_windows(train.DEFAULT_DATA_DIR, T, 32768)
        rows = []
        for kind in KINDS:
            out = runs / kind
            train.main([*common, "--max_steps", str(args.lora_steps), "--init_from", str(runs / "base" / "model"),
                        "--finetune", "lora", "--lr", "2e-3", "--warmup_steps", "10", "--out_dir", str(out),
                        *base_options(kind)])
            step_time = median_step_time(out, 5)
            model = load_model(runs / "base" / "model")
            apply_lora(model)
            init_lora(model, 0)
            load_adapter(model, out / "adapter")
            if kind != "float32":
                quantize_base(model, kind)
            rows.append((kind, step_time, validation_loss(model, windows, contextlib.nullcontext())))
        base_loss = validation_loss(load_model(runs / "base" / "model"), windows, contextlib.nullcontext())
    print(f"\n## demo model, T = {T}: {args.base_steps} dense steps, then {args.lora_steps} LoRA steps (r = 16 on q, "
          f"k, v, o); held-out loss of the base alone: {base_loss:.4f}\n")
    print("| base | median step time | held-out loss after LoRA |\n|---|---|---|")
    for kind, step_time, loss in rows:
        print(f"| {kind} | {step_time * 1e3:.0f} ms | {loss:.4f} |")


if __name__ == "__main__":
    main()
