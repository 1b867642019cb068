"""train.py end to end on the tiny preset (context 32, 4 steps): single process, 2 processes (FSDP2 on gloo, spawned
with a free port), FSDP vs single-process gradients, bitwise resume (also 2 ranks -> 1 rank), configuration
precedence, and the clear errors for bad options, missing data, corrupt checkpoints, non-finite steps, the memory
budget; SIGTERM handling; the analytic FLOP count against FlopCounterMode.

Reference layout for the parity tests: 2 ranks x batch 2 x 1 micro-step sees the same windows as 1 process x batch
2 x 2 micro-steps (text.shards.TokenLoader hands rank r the r-th block of each global batch), and the global loss is
rank0 + rank1 = micro0 + micro1 in float32 either way, so the first loss and any loss after a resume are bitwise
equal; gradients are compared with a tolerance because the rank reduction adds in another order.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from safetensors.torch import load_file
from torch.utils.flop_counter import FlopCounterMode

import train
from model import ComputeConfig, ModelConfig, Transformer
from storage.checkpoint import latest_checkpoint
from storage.hf import load_hf_checkpoint
from text.shards import TokenLoader
from training import monitor, parallel, trainer
from training import options as train_config

STEPS = 4
BASE = ["--model_size", "tiny", "--context_length", "32", "--batch_size", "2", "--max_steps", str(STEPS),
        "--warmup_steps", "2", "--checkpoint_interval", "2", "--log_interval", "100", "--sample_tokens", "0"]


def metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def run(data_dir: Path, out_dir: Path, *extra: str) -> dict:
    return train.main([*BASE, "--data_dir", str(data_dir), "--out_dir", str(out_dir), *extra])


# ---- fixtures ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    """One torch thread, as in each spawned rank: the cross-layout comparisons below are bitwise only between
    kernels that split their work the same way."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def single_run(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """1 process, batch 2 x 2 micro-steps, 4 steps, checkpoints at 2 and 4, an 8-token sample."""
    out = tmp_path_factory.mktemp("single")
    run(data_dir, out, "--gradient_accumulation_steps", "2", "--sample_tokens", "8")
    return out


@pytest.fixture(scope="module")
def fsdp_run(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same run as `single_run` on 2 ranks x batch 2 (FSDP2, gloo)."""
    out = tmp_path_factory.mktemp("fsdp")
    run_distributed(train.main, [*BASE, "--data_dir", str(data_dir), "--out_dir", str(out)])
    return out


# ---- runs --------------------------------------------------------------------------------------------------


def test_single_process_run(single_run: Path) -> None:
    rows = metrics(single_run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert set(r) >= {"loss", "lr", "grad_norm", "tokens_per_s", "mem_gib", "mem_peak_gib"}
        assert 0 < r["loss"] < 10 and r["grad_norm"] > 0 and not r["skipped"]
    assert rows[0]["lr"] == pytest.approx(3e-3 / 2)  # warmup: step 1 of 2
    resolved = json.loads((single_run / "config.json").read_text())
    assert resolved["train"]["attention_type"] == "full" and resolved["train"]["gradient_checkpointing"] is False
    assert resolved["model"]["vocab_size"] == 512 and resolved["model"]["context_length"] == 32
    assert latest_checkpoint(single_run).name == f"step-{STEPS}" and (single_run / "step-2").is_dir()
    # The exported file holds the final weights under the model's names (lm_head is the tied embedding).
    config = ModelConfig(**resolved["model"])
    model = Transformer(config)
    missing, unexpected = model.load_state_dict(load_file(single_run / "model" / "model.safetensors"), strict=False)
    assert missing == ["lm_head.weight"] and unexpected == []
    assert model.lm_head.weight is model.embed_tokens.weight
    hf_model = load_hf_checkpoint(single_run / "hf")  # the Hugging Face export holds the same weights
    assert all(torch.equal(a, b) for a, b in zip(hf_model.state_dict().values(), model.state_dict().values(),
                                                   strict=True))


def test_resume_is_bitwise_exact(single_run: Path, data_dir: Path, tmp_path: Path) -> None:
    """Resume from step-2 (a `step-9.tmp` left by an interrupted save is ignored): steps 3-4 and the final weights
    are bitwise those of the uninterrupted run."""
    shutil.copytree(single_run / "step-2", tmp_path / "step-2")
    (tmp_path / "step-9.tmp").mkdir()
    run(data_dir, tmp_path, "--gradient_accumulation_steps", "2", "--resume")
    changed, *rows = metrics(tmp_path)
    assert changed == {"step": 2, "resumed_with": {"sample_tokens": [8, 0]}}  # every changed option is recorded
    for got, want in zip(rows, metrics(single_run)[2:], strict=True):
        assert (got["step"], got["loss"], got["grad_norm"], got["lr"]) == (
            want["step"], want["loss"], want["grad_norm"], want["lr"])
    resumed, uninterrupted = (load_file(out / "model" / "model.safetensors") for out in (tmp_path, single_run))
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in uninterrupted)


@pytest.mark.slow
def test_two_process_fsdp_run_matches_single_process(fsdp_run: Path, single_run: Path) -> None:
    fsdp, single = metrics(fsdp_run), metrics(single_run)
    assert [r["step"] for r in fsdp] == list(range(1, STEPS + 1))
    assert fsdp[0]["loss"] == single[0]["loss"]  # same initialisation, same windows: bitwise
    for a, b in zip(fsdp, single, strict=True):  # later steps: gradients reduced in another order
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert sorted(p.name for p in (fsdp_run / "step-2").glob("rng_rank*.pt")) == ["rng_rank0.pt", "rng_rank1.pt"]


@pytest.mark.slow
def test_two_rank_checkpoint_resumes_on_one_rank(fsdp_run: Path, data_dir: Path, tmp_path: Path) -> None:
    """DCP reshards the 2-rank checkpoint; 1 process x 2 micro-steps continues with bitwise the same loss, and the
    record says what makes its steps now."""
    shutil.copytree(fsdp_run / "step-2", tmp_path / "step-2")
    run(data_dir, tmp_path, "--gradient_accumulation_steps", "2", "--resume", str(tmp_path / "step-2"))
    changed, first = metrics(tmp_path)[:2]
    assert changed == {"step": 2, "resumed_with": {"gradient_accumulation_steps": [1, 2], "world_size": [2, 1]}}
    assert first["step"] == 3 and first["loss"] == metrics(fsdp_run)[2]["loss"]


def _gradient_parity(data_dir: str) -> None:
    """In each of 2 ranks: FSDP gradients of one step equal a single-process model's on the whole global batch,
    with the standard and with the chunked loss, and for NSA with its selection-scoring loss; the bf16
    mixed-precision variant keeps float32 RoPE tables and a close loss."""
    rt = parallel.init_runtime()
    cfg = train_config.TrainConfig(model_size="tiny", context_length=32, batch_size=2)
    cfg = train_config.resolve_config(cfg, rt.device)
    config, compute = train_config.build_model_config(cfg, 512)
    sharded = trainer.build_model(config, compute, cfg, rt)
    reference = trainer.build_model(config, compute, cfg, parallel.Runtime(0, 1, rt.device, None))
    for (name, p), q in zip(sharded.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.full_tensor(), q), f"{name}: the sharded initialisation differs"
    local = next(TokenLoader(data_dir, 32, 2, rt.rank, 2))  # this rank's (input_ids, labels), (2, 32) each
    global_ids, global_labels = next(TokenLoader(data_dir, 32, 4, 0, 1))  # (4, 32): rank 0's rows, then rank 1's
    loss, _ = trainer.forward_backward(sharded, [list(local)], torch.autocast("cpu", enabled=False))
    dist.all_reduce(loss)
    reference(global_ids, global_labels).loss.backward()  # the plain mean over the global batch
    torch.testing.assert_close(loss, reference(global_ids, global_labels).loss.detach(), rtol=1e-6, atol=0)
    for (name, p), q in zip(sharded.named_parameters(), reference.parameters(), strict=True):
        # float32 sums over ranks in another order: 1e-5 relative is ~100 ulps
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-7, msg=name)
    # The chunked loss, and the loss on the target rows only, read the FSDP2-sharded (tied) output weight through
    # the root module: same loss and grads.
    for variant, variant_compute in (("chunked", ComputeConfig(loss_mode="chunked", loss_chunk_size=24)),
                                     ("targets", ComputeConfig(loss_rows="targets"))):
        other = trainer.build_model(config, variant_compute, cfg, rt)
        loss_other, _ = trainer.forward_backward(other, [list(local)], torch.autocast("cpu", enabled=False))
        dist.all_reduce(loss_other)
        torch.testing.assert_close(loss_other, loss, rtol=1e-6, atol=0)
        for (name, p), q in zip(other.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-7, msg=f"{variant} {name}")
    # NSA with its selection-scoring loss and sparse labels (rank r predicts the last 10 + 40 r tokens of its rows):
    # each rank's term, a mean over its rows weighted 1 / ranks, sums to the single-process term over the global
    # batch; so do the gradients.
    def sparse(labels: torch.Tensor, rank: int) -> torch.Tensor:
        kept = labels.clone()
        kept[:, :-(10 + 40 * rank)] = -100
        return kept

    nsa_config = dataclasses.replace(config, attention_type="nsa", context_length=96)
    nsa_cfg = dataclasses.replace(cfg, nsa_score_loss_coef=0.5)  # the objective a run builds its model with
    nsa_sharded = trainer.build_model(nsa_config, compute, nsa_cfg, rt)
    nsa_reference = trainer.build_model(nsa_config, compute, nsa_cfg, parallel.Runtime(0, 1, rt.device, None))
    local_ids, local_labels = next(TokenLoader(data_dir, 96, 2, rt.rank, 2))  # (2, 96): past n l' = 64
    loss_nsa, extras = trainer.forward_backward(nsa_sharded, [[local_ids, sparse(local_labels, rt.rank)]],
                                                torch.autocast("cpu", enabled=False))
    stats = torch.stack([loss_nsa, extras["aux_loss"]])
    dist.all_reduce(stats)
    global_ids, global_labels = next(TokenLoader(data_dir, 96, 4, 0, 1))
    expected = nsa_reference(global_ids, torch.cat([sparse(global_labels[2 * r:2 * r + 2], r) for r in range(2)]))
    expected.loss.backward()
    torch.testing.assert_close(stats, torch.stack([expected.loss, expected.aux_loss]).detach(), rtol=1e-6, atol=0)
    for (name, p), q in zip(nsa_sharded.named_parameters(), nsa_reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-7, msg=f"nsa {name}")
    # bf16 mixed precision: the blocks still get float32 RoPE tables, and the loss stays close to float32's.
    bf16 = trainer.build_model(config, compute, dataclasses.replace(cfg, dtype="bfloat16"), rt)
    seen = []
    bf16.layers[0].attn.register_forward_pre_hook(lambda module, args: seen.append((args[0].dtype, args[1].dtype)))
    loss_bf16, _ = trainer.forward_backward(bf16, [list(local)], torch.autocast("cpu", enabled=False))
    dist.all_reduce(loss_bf16)
    assert seen == [(torch.bfloat16, torch.float32)]
    torch.testing.assert_close(loss_bf16, loss, rtol=1e-2, atol=0)  # bf16 activations: ~3 significant digits
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp_gradients_equal_single_process(data_dir: Path) -> None:
    run_distributed(_gradient_parity, str(data_dir))


# ---- configuration -----------------------------------------------------------------------------------------


def test_a_process_takes_its_gpu_when_there_is_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """init_runtime puts one process on the GPU of its LOCAL_RANK when CUDA is available, else on the CPU."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("LOCAL_RANK", "0")
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert parallel.init_runtime().device == torch.device("cuda", 0) and chosen == [torch.device("cuda", 0)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert parallel.init_runtime().device == torch.device("cpu")


def test_config_precedence(tmp_path: Path) -> None:
    file = tmp_path / "run.json"
    file.write_text(json.dumps({"lr": 0.01, "max_steps": 7, "batch_size": 3, "model_overrides": {"n_layers": 3}}))
    cfg = train_config.parse_config(["--config", str(file), "--lr", "0.02", "--no-gradient_checkpointing", "--resume"])
    assert (cfg.lr, cfg.max_steps, cfg.batch_size, cfg.warmup_steps) == (0.02, 7, 3, 30)  # cli > file > default
    assert cfg.gradient_checkpointing is False and cfg.resume == "auto" and cfg.model_overrides == {"n_layers": 3}
    toml = tmp_path / "run.toml"
    toml.write_text('model_size = "tiny"\nlr = 1\n')
    assert train_config.parse_config(["--config", str(toml)]).lr == 1.0


def test_auto_options_resolve_by_device_and_context() -> None:
    cfg = train_config.TrainConfig(context_length=131072)
    gpu = train_config.resolve_config(cfg, torch.device("cuda", 0))
    assert (gpu.model_size, gpu.attention_type, gpu.gradient_checkpointing, gpu.dtype, gpu.batch_size, gpu.lr) == (
        "4B", "nsa", True, "bfloat16", 1, 3e-4)
    model, compute = train_config.build_model_config(gpu, 8192)
    assert model.vocab_size == 151936 and model.context_length == 131072
    assert compute.ffn_chunk_size == train_config.TILED_FFN_CHUNK  # from LONG_CONTEXT on
    assert compute.loss_mode == "chunked" and not compute.offload_activations  # no GPU memory given
    _, on_80gb = train_config.build_model_config(gpu, 8192, device_memory=80 * 10**9, world_size=2)
    _, on_32k = train_config.build_model_config(dataclasses.replace(gpu, context_length=32768), 8192,
                                                device_memory=80 * 10**9, world_size=2)
    assert on_80gb.offload_activations and not on_32k.offload_activations  # 22.5 GiB of inputs at 131k, 5.6 at 32k
    with torch.device("meta"):  # (full attention: only the loss rule matters here)
        full = Transformer(dataclasses.replace(model, attention_type="full"), compute)
    assert full.use_chunked_loss(131072, torch.bfloat16)  # 131072 x 151936 bf16 logits > 10 GiB
    cpu = train_config.resolve_config(train_config.TrainConfig(), torch.device("cpu"))
    assert (cpu.model_size, cpu.attention_type, cpu.gradient_checkpointing, cpu.dtype, cpu.batch_size, cpu.lr) == (
        "demo", "full", False, "float32", 16, 3e-3)
    short, short_compute = train_config.build_model_config(cpu, 8192)
    assert short.vocab_size == 8192  # demo's 512 raised to the tokenizer's
    assert short_compute.ffn_chunk_size is None and short_compute.loss_mode == "auto"


@pytest.mark.parametrize(("args", "message"), [
    (["--batch_size", "0"], "--batch_size must be >= 1"),
    (["--model_size", "5B"], "--model_size must be one of"),
    (["--lr", "-1"], "--lr must be a finite number > 0"),
    (["--model_overrides", '{"n_layer": 2}'], "unknown field(s) ['n_layer']"),
    (["--max_steps", "ten"], "invalid int value"),
    (["--config", "missing.json"], "does not exist"),
])
def test_bad_options_are_usage_errors(args: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        train_config.parse_config(args)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("content", "message"), [
    ({"batch_sise": 2}, "unknown option 'batch_sise'"),
    ({"max_steps": "10"}, "'max_steps' must be int"),
    ({"compile": 1}, "'compile' must be bool"),
])
def test_bad_config_files(content: dict, message: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "c.json").write_text(json.dumps(content))
    with pytest.raises(SystemExit):
        train_config.parse_config(["--config", str(tmp_path / "c.json")])
    assert message in capsys.readouterr().err


# ---- errors and stops --------------------------------------------------------------------------------------


def test_missing_data_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist; create it with `python data.py prepare"):
        run(tmp_path / "nowhere", tmp_path / "out")


def test_validation_loss_leaves_training_bitwise_unchanged(single_run: Path, data_dir: Path, tmp_path: Path) -> None:
    """--eval_interval logs validation loss and perplexity at steps 2 and 4 without touching the RNG or the loader:
    the training losses equal the run without evaluation bit for bit, and a resumed run evaluates the same."""
    run(data_dir, tmp_path / "a", "--gradient_accumulation_steps", "2", "--eval_interval", "2", "--eval_tokens", "64")
    rows = metrics(tmp_path / "a")
    assert [r["loss"] for r in rows] == [r["loss"] for r in metrics(single_run)]
    assert [("val_loss" in r) for r in rows] == [False, True, False, True]
    assert rows[1]["val_perplexity"] == pytest.approx(math.exp(rows[1]["val_loss"]))
    shutil.copytree(tmp_path / "a" / "step-2", tmp_path / "b" / "step-2")
    run(data_dir, tmp_path / "b", "--gradient_accumulation_steps", "2", "--eval_interval", "2", "--eval_tokens", "64",
        "--resume")
    assert metrics(tmp_path / "b")[-1]["val_loss"] == rows[-1]["val_loss"]


def test_compute_knobs_may_change_on_resume(single_run: Path, data_dir: Path, tmp_path: Path) -> None:
    """Only the architecture (ModelConfig) binds a checkpoint: a resumed run may tile the FFN and chunk the loss,
    and its losses stay those of the uninterrupted run (same maths, another split of the work: equal to float32
    rounding). (The attention's query chunk is NSA's: this run's full attention reads none.)"""
    shutil.copytree(single_run / "step-2", tmp_path / "step-2")
    knobs = '{"ffn_chunk_size": 8, "loss_mode": "chunked", "loss_chunk_size": 16}'
    run(data_dir, tmp_path, "--gradient_accumulation_steps", "2", "--resume", "--model_overrides", knobs)
    changed, *rows = metrics(tmp_path)
    assert changed["resumed_with"]["model_overrides"] == [{}, json.loads(knobs)]
    for got, want in zip(rows, metrics(single_run)[2:], strict=True):
        assert got["step"] == want["step"] and got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    resolved = json.loads((tmp_path / "config.json").read_text())
    assert resolved["compute"]["ffn_chunk_size"] == 8 and resolved["compute"]["loss_mode"] == "chunked"


def test_corrupt_checkpoints_are_clear_errors(single_run: Path, data_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(FileExistsError, match="already holds a run"):
        run(data_dir, single_run)  # an existing run needs --resume
    ckpt = tmp_path / "step-2"
    shutil.copytree(single_run / "step-2", ckpt)
    shard = next(ckpt.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"step-2 is damaged: __0_0.distcp has 100 bytes"):
        run(data_dir, tmp_path, "--resume")
    (ckpt / ".metadata").unlink()
    with pytest.raises(ValueError, match=r"step-2 is damaged: \.metadata is missing"):
        run(data_dir, tmp_path, "--resume", str(ckpt))
    with pytest.raises(ValueError, match="holds a different model: n_layers=2 \\(now 3\\)"):
        run(data_dir, tmp_path / "other", "--resume", str(single_run / "step-2"), "--model_overrides",
            '{"n_layers": 3}')


def test_non_finite_steps_are_skipped_then_stop(data_dir: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"n": 0}
    compute_loss = Transformer.compute_loss

    def poisoned(self: Transformer, *args: object, **kwargs: object) -> tuple:
        calls["n"] += 1
        loss, logits = compute_loss(self, *args, **kwargs)
        return loss * (float("nan") if calls["n"] == 1 or calls["n"] > 2 else 1.0), logits

    monkeypatch.setattr(Transformer, "compute_loss", poisoned)
    with pytest.raises(monitor.TooManyBadSteps, match="2 consecutive steps had a non-finite loss"):
        run(data_dir, tmp_path, "--max_bad_steps", "2")
    assert [r["skipped"] for r in metrics(tmp_path)] == [True, False, True, True]
    assert metrics(tmp_path)[1]["lr"] == metrics(tmp_path)[0]["lr"] * 2  # the schedule still advanced


def test_memory_budget_saves_and_stops(data_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(monitor.MemoryBudgetExceeded, match="exceeds --max_memory 0.01 GiB.*reduce --batch_size"):
        run(data_dir, tmp_path, "--max_memory", "0.01")
    assert latest_checkpoint(tmp_path).name == "step-1"


def test_sigterm_finishes_the_step_saves_and_returns(data_dir: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    fetch = TokenLoader.__next__

    def signalling(self: TokenLoader) -> tuple:
        if self.step == 1:  # during step 2
            os.kill(os.getpid(), signal.SIGTERM)
        return fetch(self)

    monkeypatch.setattr(TokenLoader, "__next__", signalling)
    previous = signal.getsignal(signal.SIGTERM)
    result = run(data_dir, tmp_path, "--max_steps", "100", "--checkpoint_interval", "0")
    assert result["step"] == 2 and latest_checkpoint(tmp_path).name == "step-2"
    assert signal.getsignal(signal.SIGTERM) is previous  # handlers restored


def test_leak_watch_warns_on_steady_growth_only() -> None:
    steady = monitor.LeakWatch(window=10, warmup=2, min_gib=0.01)
    warnings = [steady.update(step, 1.0 + 0.002 * step) for step in range(1, 40)]
    assert [i + 1 for i, w in enumerate(warnings) if w] == [13, 23, 33]  # once per window
    assert "rose in 10 of the last 10 steps, by 0.020 GiB" in warnings[12]
    plateau, noisy = monitor.LeakWatch(10, 2, 0.01), monitor.LeakWatch(10, 2, 0.01)
    assert not any(plateau.update(s, min(1.0 + 0.01 * s, 1.1)) for s in range(1, 40))
    assert not any(noisy.update(s, 1.0 + 0.05 * (s % 2)) for s in range(1, 40))


def test_thread_plan_gives_up_the_cores_other_processes_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each interval: the busy time of the process's CPUs less its own is what others hold. Another process on one
    of two cores leaves one thread; when it ends, the threads the run started with come back; OMP_NUM_THREADS or a
    GPU fixes the number."""
    clock = {"now": 0.0, "busy": 0.0, "own": 0.0}
    monkeypatch.setattr(monitor, "busy_core_seconds", lambda cpus: clock["busy"])
    monkeypatch.setattr(monitor.time, "monotonic", lambda: clock["now"])
    monkeypatch.setattr(monitor.time, "process_time", lambda: clock["own"])
    monkeypatch.setattr(monitor.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        plan = monitor.ThreadPlan(torch.device("cpu"), interval=10)

        def interval(own: float, others: float) -> str | None:  # 10 s: this process's core-seconds, others'
            clock["now"] += 10
            clock["own"] += own
            clock["busy"] += own + others
            return plan.update()

        assert interval(20, 0) is None and torch.get_num_threads() == 2  # alone
        assert "CPU threads: 1 (other processes kept 1.0 of 2 cores busy" in interval(10, 10)
        assert torch.get_num_threads() == 1
        assert interval(10, 10) is None  # another run beside it: one thread each
        assert "CPU threads: 2" in interval(10, 0) and torch.get_num_threads() == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert not monitor.ThreadPlan(torch.device("cpu")).enabled
        monkeypatch.delenv("OMP_NUM_THREADS")
        assert not monitor.ThreadPlan(torch.device("meta")).enabled
    finally:
        torch.set_num_threads(threads)


def test_memory_metrics_leak_warning_and_cache_interval(data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    level, freed = [0.5], []

    def leaking(device: torch.device) -> tuple[float, float]:
        level[0] += 0.01  # 10 MiB more every step
        return level[0], level[0]

    monkeypatch.setattr(trainer, "memory_gib", leaking)
    monkeypatch.setattr(trainer, "free_cache", freed.append)
    run(data_dir, tmp_path, "--max_steps", "30", "--empty_cache_interval", "10", "--checkpoint_interval", "0")
    rows = metrics(tmp_path)
    assert rows[5]["mem_growth_gib"] == pytest.approx(0.01) and rows[0]["mem_growth_gib"] == 0
    assert len(freed) == 3
    assert "warning: memory rose in 20 of the last 20 steps" in capsys.readouterr().out


def test_heartbeat_names_micro_batch_pass_and_block(data_dir: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    run(data_dir, tmp_path, "--max_steps", "1", "--gradient_accumulation_steps", "2", "--gradient_checkpointing",
        "--heartbeat_seconds", "1e-9")
    beats = [line.split(": ", 1)[1].rsplit(",", 1)[0] for line in capsys.readouterr().out.splitlines()
             if line.startswith("step 1: micro-batch")]
    assert beats == [f"micro-batch {m}/2, {p} block {b}/2" for m in (1, 2)
                     for p, blocks in (("forward", (1, 2)), ("backward (recomputing)", (2, 1))) for b in blocks]


def test_flops_per_token_counts_every_matmul() -> None:
    """The dense part equals FlopCounterMode's count of a forward + backward (CPU SDPA is not counted there)."""
    config = ModelConfig.from_preset("tiny")
    model = Transformer(config)
    T = 16
    ids = torch.randint(0, config.vocab_size, (1, T))
    with FlopCounterMode(display=False) as counter:
        model(ids, ids).loss.backward()
    attention = 12 * config.n_layers * config.n_heads * config.head_dim * (T + 1) / 2  # QK^T and PV, (T+1)/2 keys
    assert monitor.flops_per_token(config, T) - attention == counter.get_total_flops() / T
