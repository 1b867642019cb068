"""profile_memory.py: the fake-tensor estimate against real runs of the same step, full-size 4B / 131k numbers against
arithmetic, the logits blow-up of the standard loss, the NSA memory double against the nsa/ package's reference path,
the fit advice and the command line. Memory in bytes; GiB = 2**30.
"""

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

import profile_memory
from modeling.config import GiB
from modeling.memtrack import LiveBytesTracker
from training import estimate as pm
from training import fit, parallel

STAGES = ("parameters", "after embedding", "after first layer", "after forward", "after loss", "peak during forward",
          "peak during backward", "after backward", "after optimizer step", "peak during optimizer step")


def assert_stages_close(estimated: dict, measured: dict, rel: float = 0.02) -> None:
    assert list(estimated) == list(STAGES) and list(measured) == list(STAGES)
    for stage in STAGES:
        est, real = estimated[stage]["total"], measured[stage]["total"]
        assert abs(est - real) <= rel * real, f"{stage}: estimate {est} vs measured {real}"


class LiveBytesProbe:
    """The probe protocol of profile_memory over memtrack.LiveBytesTracker, an independent live-bytes counter that
    sees only storages made while it is active; `baseline` adds what existed before (weights, optimizer state)."""

    def __init__(self, baseline: int) -> None:
        self.tracker, self.baseline = LiveBytesTracker(), baseline

    def __enter__(self) -> "LiveBytesProbe":
        self.tracker.__enter__()
        return self

    def __exit__(self, *args: object) -> None:
        self.tracker.__exit__(*args)

    def current(self) -> dict[str, int]:
        return {"total": self.baseline + self.tracker.live}

    def start_phase(self, phase: str) -> None:
        self.tracker.reset_peak()

    def phase_peak(self) -> dict[str, int]:
        return {"total": self.baseline + self.tracker.peak}


def real_step_live_bytes(config: pm.StepConfig) -> dict:
    """The step of `config` (world size 1: no FSDP, as train.py) run for real on the CPU, measured by memtrack."""
    model, optimizer = pm.build(config, parallel.Runtime(0, 1, torch.device("cpu"), None))
    B, T = config.train.batch_size, config.train.context_length
    pm._warm_up(model, optimizer, T, "cpu")
    input_ids = torch.randint(0, model.config.vocab_size, (B, T))
    labels = torch.randint(0, model.config.vocab_size, (B, T))
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    def plain(t: torch.Tensor) -> list[torch.Tensor]:  # a quantized weight: the tensors it is made of
        if not hasattr(t, "__tensor_flatten__"):
            return [t]
        return [x for name in t.__tensor_flatten__()[0] for x in plain(getattr(t, name))]

    tensors = [x for t in (*model.parameters(), *model.buffers(), *state, input_ids, labels) for x in plain(t)]
    existing = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    with LiveBytesProbe(sum(existing.values())) as probe:
        stages, _ = pm._training_step(model, optimizer, input_ids, labels, pm._autocast(config, "cpu"), probe)
    return stages


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
@pytest.mark.parametrize("checkpointing, loss, dtype, finetune, quantize_base", [
    (False, "standard", "bfloat16", "full", None),
    (True, "chunked", "float32", "full", None),
    (True, "chunked", "float32", "lora", None),
    (True, "chunked", "bfloat16", "lora", "nf4"),
    (False, "standard", "bfloat16", "npt", None),
])
def test_estimate_matches_independent_measurement_of_real_step(checkpointing, loss, dtype, finetune, quantize_base):
    if quantize_base:
        pytest.importorskip("torchao")
    config = pm.StepConfig.of(model_size="tiny", context_length=128, batch_size=2,
                              gradient_checkpointing=checkpointing, loss=loss, dtype=dtype, finetune=finetune,
                              quantize_base=quantize_base)
    estimated = pm.estimate(config)["stages"]
    assert_stages_close(estimated, real_step_live_bytes(config))
    if finetune == "lora":  # a frozen base: only the adapters have gradients and AdamW moments
        adapters = 2 * (2 * 16 * (64 + 64) + 2 * 16 * (64 + 32))  # 2 layers x (q, o: 64->64; k, v: 64->32), r=16
        assert estimated["after backward"]["gradients"] == adapters * 4
    if finetune == "npt":  # upper layer's NP parameters: coefficients 64 -> 2 x 16; A, B of gate and up (64 -> 192)
        np_params = 64 * 2 * 16 + 2 * (64 * 16 + 16 * 192)
        assert estimated["after backward"]["gradients"] == np_params * 4


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fsdp_estimate_matches_real_step_and_sharding_arithmetic(dtype):
    config = pm.StepConfig.of(model_size="tiny", context_length=128, world_size=2, gradient_checkpointing=True,
                              loss="chunked", dtype=dtype)
    result = pm.estimate(config)
    assert_stages_close(result["stages"], pm.profile_step(config, "cpu", fake=False)["stages"])
    # Per rank: half of the fp32 master weights, of their gradients and of the two AdamW moments (every tiny
    # parameter has an even first dimension, so FSDP pads nothing), plus one 4-byte step counter per parameter.
    P = result["num_parameters"]
    after = result["stages"]["after backward"]
    rope = 2 * 128 * 16 * 4  # cos and sin tables: 128 positions x head_dim 16, float32
    assert after["parameters"] == 4 * P // 2 + rope
    assert after["gradients"] == 4 * P // 2
    meta = parallel.Runtime(0, 1, torch.device("meta"), None)
    assert after["optimizer"] == 8 * P // 2 + 4 * len(list(pm.build(config, meta)[0].parameters()))
    assert not dist.is_initialized()  # the fake process group is torn down


def test_nsa_double_replaces_the_layer_seams_only_while_active():
    """The double goes in through NativeSparseAttention.sparse_attention, the score loss's peak chunks through its
    selection_score_loss (the layer's two seams), and both come out."""
    from nsa.attention import sparse_attention
    from nsa.layer import NativeSparseAttention
    from nsa.memory_stand_in import sparse_attention_stand_in
    from nsa.scoring import selection_score_loss

    config = pm.StepConfig.of(model_size="tiny", context_length=64, attention_type="nsa")
    with FakeTensorMode(), sparse_attention_stand_in(NativeSparseAttention, *config.configs(), 1, 64, torch.float32,
                                                     "cpu"):
        assert NativeSparseAttention.sparse_attention is not sparse_attention
        assert NativeSparseAttention.selection_score_loss.keywords == {"peak_only": True}
    assert NativeSparseAttention.sparse_attention is sparse_attention
    assert NativeSparseAttention.selection_score_loss is selection_score_loss


@pytest.mark.slow
@pytest.mark.parametrize("score_loss", [{}, {"nsa_score_loss_coef": 0.1},
                                        {"nsa_score_loss_coef": 0.1, "nsa_score_loss_stride": 2,
                                         "nsa_score_loss_top": 4, "nsa_score_loss_random": 2}],
                         ids=["no-score-loss", "dense-score-loss", "candidate-score-loss"])
def test_nsa_double_matches_reference_path(score_loss):
    """11 query chunks of 32: the double is calibrated at 4 and 8 chunks past the all-selected prefix (n l' = 64
    tokens) and extrapolated; the selection-scoring loss runs on its three last chunks under the double, on all of
    them without it (its host draws take their largest value under fake tensors, so both score the same rows)."""
    config = pm.StepConfig.of(model_size="tiny", context_length=352, attention_type="nsa", world_size=2,
                              loss="standard", attention_query_chunk=32, batch_size=1, **score_loss)
    double = pm.profile_step(config, stand_in=True)
    assert "at T = 192 and 320" in double["stand_in"] and "extrapolated" in double["stand_in"]
    assert_stages_close(double["stages"], pm.profile_step(config, stand_in=False)["stages"])


@pytest.mark.slow
@pytest.mark.parametrize("triton", [True, False], ids=["triton-path", "explicit-path"])
def test_nsa_double_extrapolates_to_a_third_length(triton):
    """One 4B NSA layer (l' = 64, n = 16, query chunks of 512, bf16): the double's spec extrapolated from its two
    calibration lengths (3072 and 5120, past the 1024-token all-selected prefix) agrees within 2% with a direct
    measurement at T = 8192, on the Triton kernels' path and on the explicit one."""
    from modeling.config import ComputeConfig, ModelConfig
    from nsa.layer import NativeSparseAttention
    from nsa.memory_stand_in import calibrated_spec, calibration_lengths

    model = ModelConfig.from_preset("4B", attention_type="nsa")
    compute = ComputeConfig(attention_query_chunk=512, triton_kernels=triton)
    assert calibration_lengths(model, compute, 8192) == [3072, 5120]
    args = (NativeSparseAttention, model, compute, 1, 8192, torch.bfloat16, "cpu")
    with FakeTensorMode():
        extrapolated = calibrated_spec(*args)
        direct = calibrated_spec(*args, points=[8192])
    for name, got, expected in zip(("kept", "forward peak", "backward peak"), extrapolated, direct, strict=False):
        assert abs(got - expected) <= 0.02 * expected, (name, got, expected)
    assert extrapolated[3] == direct[3]


@pytest.mark.slow
def test_nsa_estimate_is_the_same_without_triton(monkeypatch):
    """The estimate models the Triton kernels' path (what a CUDA run takes) whether Triton is installed here or
    not: on fake tensors that path allocates its outputs and launches nothing (nsa/triton_path.py). With Triton's import
    blocked, every stage equals the estimate with Triton, byte for byte."""
    import nsa.primitive

    config = pm.StepConfig.of(model_size="tiny", context_length=320, attention_type="nsa", attention_query_chunk=16,
                              gradient_checkpointing=True, loss="chunked")
    with_triton = pm.estimate(config)
    assert "Triton kernels" in with_triton["stand_in"]
    monkeypatch.setattr(nsa.primitive, "triton_installed", lambda: False)
    for name in [m for m in sys.modules if m == "triton" or m.startswith(("triton.", "nsa.triton_kernels"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    without = pm.estimate(config)
    assert without["stages"] == with_triton["stages"] and without["stand_in"] == with_triton["stand_in"]
    assert "nsa.triton_kernels" not in sys.modules


@pytest.mark.parametrize("warm, later, during", [((300, 100), (200, 200), "during"),
                                                  ((250, 100), (100, 280), "after")])
def test_the_exact_selection_warm_up_is_estimated_on_its_own_path(warm, later, during, monkeypatch):
    """With --nsa_exact_selection_steps the estimate profiles a step of the warm-up (under exact block scores: NSA's
    attention on another path) beside a later step and reports the one of the larger peak, naming both peaks; the
    phase peaks that more ranks are derived from are the larger of the two steps' in each phase. (Profiles made up
    here, forward and backward peaks in MiB: a real tiny step's two peaks are the same.)"""
    from nsa.primitive import exact_scores_active

    config = pm.StepConfig.of(model_size="tiny", context_length=256, attention_type="nsa", nsa_score_loss_coef=0.1,
                              nsa_exact_selection_steps=5)

    def profile_step(*args: object, **kwargs: object) -> dict:
        peaks = (*(warm if exact_scores_active() else later), 10)
        stages = {f"peak during {phase}": {"total": peak * 2**20, "activations": peak * 2**20}
                  for phase, peak in zip(pm.PHASES, peaks, strict=True)}
        return {"stages": stages, "loss_path": "standard", "num_parameters": 1, "stand_in": str(peaks[:2])}

    monkeypatch.setattr(pm, "profile_step", profile_step)
    result = pm.estimate(config)
    phases = {"forward": max(warm[0], later[0]), "backward": max(warm[1], later[1]), "optimizer step": 10}
    assert result["warm_up"] == {"steps": 5, "peak": max(warm) * 2**20, "later_peak": max(later) * 2**20,
                                 "phase_peaks": {phase: peak * 2**20 for phase, peak in phases.items()}}
    chosen = warm if during == "during" else later
    assert result["stand_in"] == str(chosen) and pm.warm_up_step(result) == (during == "during")
    assert result["peak"]["total"] == max(chosen) * 2**20
    assert fit.peak_at_world_size({2: result, 4: result}, 8) == max(phases.values()) * 2**20
    assert (f"The table is the step {during} the first 5 steps (--nsa_exact_selection_steps: selection by exact "
            f"block scores), the larger: peak {max(warm)}.00 MiB during them, {max(later)}.00 MiB after"
            ) in pm.report_text(result)


# ---- full size: Qwen3-4B geometry, 131,072 tokens, 2 ranks, checkpointing (about 10 s per estimate) --------------

@pytest.fixture(scope="module")
def estimates_4b_131k() -> dict[str, dict]:
    config = pm.StepConfig.of(model_size="4B", context_length=131072, attention_type="full", world_size=2,
                              ffn_chunk_size=0)  # untiled, unlike train.py's 131k recipe
    return {loss: pm.estimate(config.replace(loss=loss)) for loss in ("auto", "standard")}


@pytest.mark.slow
def test_4b_131k_numbers_in_derived_range(estimates_4b_131k):
    result = estimates_4b_131k["auto"]
    stages, peak = result["stages"], result["peak"]["total"]
    assert result["loss_path"] == "chunked"  # 131072 x 151936 bf16 logits = 37 GiB > the 10 GiB threshold
    P = result["num_parameters"]
    assert P == 4_022_468_096  # Qwen3-4B, tied embeddings
    # Sharded float32 state per rank: weights 4P/2 = 7.49 GiB, AdamW moments 8P/2 = 14.98 GiB; RoPE tables
    # 2 x 131072 x 128 x 4 B = 0.125 GiB; token ids and labels 2 x 131072 x 8 B = 2 MiB.
    state = 12 * P // 2 + 2 * 131072 * 128 * 4 + 2 * 131072 * 8
    assert abs(stages["parameters"]["total"] - state) < 0.01 * GiB  # 22.60 GiB
    assert abs(stages["after backward"]["total"] - state - 4 * P // 2) < 0.01 * GiB  # + gradients 7.49 GiB
    # Checkpointing keeps each block's input, 36 x 131072 x 2560 x 2 B (bf16) = 22.5 GiB, plus the final norm's
    # float32 intermediates (a few 1.25 GiB tensors).
    saved = 36 * 131072 * 2560 * 2
    assert saved <= stages["after forward"]["activations"] <= saved + 8 * GiB  # measured 28.5
    # Peak (in backward): state + saved inputs = 45.1 GiB, plus one block's recomputation and its gradients: at
    # least its four FFN intermediates, 4 x 131072 x 9728 x 2 B = 9.5 GiB, at most ~40 GiB (attention and FFN
    # activations at T = 131072 are 0.6-2.4 GiB each, about twenty of them with their gradients).
    ffn = 4 * 131072 * 9728 * 2
    assert state + saved + ffn <= peak <= state + saved + 40 * GiB  # measured 77.9
    assert result["peak"]["phase"] == "backward"


@pytest.mark.slow
def test_4b_131k_standard_loss_shows_the_logits_blow_up(estimates_4b_131k):
    chunked, standard = estimates_4b_131k["auto"], estimates_4b_131k["standard"]
    assert standard["loss_path"] == "standard"
    logits_fp32 = 131072 * 151936 * 4  # one float32 (N, V) tensor: 74.2 GiB
    # Standard: the float32 log-probabilities saved for backward stay after the loss (while the final norm's
    # float32 temporaries, ~1.25 GiB, are freed), and in backward they coexist with their gradient. Chunked: one
    # 4096-row chunk of logits at a time (2.3 GiB in float32), none kept.
    kept = {name: r["stages"]["after loss"]["activations"] - r["stages"]["after forward"]["activations"]
            for name, r in (("standard", standard), ("chunked", chunked))}
    assert kept["standard"] >= logits_fp32 - 2 * GiB  # measured 73.6 GiB
    assert kept["chunked"] < 4096 * 151936 * 4
    assert standard["peak"]["total"] - chunked["peak"]["total"] >= 2 * logits_fp32  # measured 274 vs 78 GiB
    assert chunked["stages"]["peak during forward"]["total"] - chunked["stages"]["after forward"]["total"] < 10 * GiB


# ---- will it fit? ----------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_fit_verdict_and_cheapest_change():
    result = pm.estimate(pm.StepConfig.of(model_size="tiny", context_length=128, batch_size=2, loss="standard"))
    peak = result["peak"]["total"]
    roomy = fit.check_fit(result, gpu_memory_gib=2 * peak / GiB, reserve_gib=0)
    assert roomy["fits"] and roomy["margin_gib"] == pytest.approx(peak / GiB)
    tight = fit.check_fit(result, gpu_memory_gib=(peak - 1) / GiB, reserve_gib=0, log=lambda msg: None)
    assert not tight["fits"] and tight["change"] == ["--loss chunked"] and tight["how"] == "estimated"
    assert tight["fitting_config"] is not None and tight["fitting_peak_gib"] * GiB <= peak - 1
    hopeless = fit.check_fit(result, gpu_memory_gib=1e-6, reserve_gib=0, log=lambda msg: None)
    assert not hopeless["fits"] and hopeless["fitting_config"] is None and hopeless["change"] is None
    recipe = "--loss chunked --gradient_checkpointing --offload_activations"
    assert hopeless["tried"][:4] == ["--loss chunked", "--loss chunked --gradient_checkpointing", recipe,
                                     f"{recipe} --world_size 2 to 64"]
    assert hopeless["tried"][-1] == f"{recipe} --batch_size 1"
    assert "nothing tried fits (tried --loss chunked; " in pm.report_text(result, fit=hopeless)


@pytest.mark.slow
def test_more_gpus_are_derived_from_two_estimates(monkeypatch):
    """Per-rank memory is affine in 1 / world size (FSDP2 divides the fp32 weights, gradients and AdamW moments):
    two estimates give every world size. The search for a step that needs 16 ranks runs one estimate beyond the
    asked one (at 4 ranks), derives 8 and 16, and names one change. The derived peak equals a direct estimate."""
    config = pm.StepConfig.of(model_size="tiny", context_length=128, world_size=2, gradient_checkpointing=True,
                              loss="chunked", offload_activations=True)
    result = pm.estimate(config)
    direct = {W: pm.estimate(config.replace(world_size=W))["peak"]["total"] for W in (4, 8, 16)}
    assert fit.peak_at_world_size({2: result, 4: pm.estimate(config.replace(world_size=4))}, 16) == direct[16]
    calls, real_estimate = [], pm.estimate
    monkeypatch.setattr(pm, "estimate", lambda config, *args: calls.append(config.world_size) or real_estimate(config,
                                                                                                            *args))
    budget = (direct[8] + direct[16]) / 2  # 16 ranks fit, 8 do not
    advice = fit.check_fit(result, gpu_memory_gib=budget / GiB, reserve_gib=0, log=lambda msg: None)
    assert advice["change"] == ["--world_size 16"] and advice["fitting_config"]["world_size"] == 16
    assert advice["fitting_peak_gib"] * GiB == direct[16] and advice["how"].startswith("derived")
    assert calls == [4]
    line = pm.report_text(result, fit=advice).splitlines()[-2]
    assert line.startswith("cheapest change that fits: --world_size 16 (peak") and line.count("--") == 1


# ---- command line and errors ---------------------------------------------------------------------------------------

@pytest.mark.slow
def test_cli_table_json_and_plot(tmp_path, capsys):
    profile_memory.main(["--model_size", "tiny", "--context_length", "64", "--gpu_memory", "1", "--reserve", "0.5"])
    text = capsys.readouterr().out
    for stage in (*STAGES, "peak (backward)"):
        assert stage in text
    assert "fits on a 1 GiB GPU" in text and "Attention counted as: full attention" in text
    png = tmp_path / "memory.png"
    profile_memory.main(["--model_size", "tiny", "--context_length", "64", "--world_size", "2", "--json", "--plot",
                         str(png)])
    out = json.loads(capsys.readouterr().out)
    assert list(out["stages"]) == list(STAGES) and out["config"]["world_size"] == 2
    assert out["config"]["train"]["model_size"] == "tiny"
    assert out["peak"]["total"] == max(out["stages"][f"peak during {p}"]["total"] for p in pm.PHASES)
    assert png.read_bytes()[:4] == b"\x89PNG"
    beside = pm.format_table(out, measured=out)  # --measure's layout: measured totals beside the estimate
    assert beside.splitlines()[0].split()[:3] == ["stage", "total", "measured"]


def test_the_recommended_nsa_config_is_estimated(capsys):
    """configs/nsa-retrieval.json (the selection-scoring loss on candidate blocks of every 8th query, whose host
    draws have no value under fake tensors) is estimated from the command line, above the same model without the
    loss."""
    recipe = Path(__file__).resolve().parent.parent / "configs" / "nsa-retrieval.json"
    tiny = ["--model_size", "tiny", "--context_length", "256", "--json"]
    profile_memory.main([*tiny, "--config", str(recipe)])
    out = json.loads(capsys.readouterr().out)
    train = out["config"]["train"]
    assert train["model_overrides"]["nsa_num_selected"] == 18 and train["nsa_score_loss_stride"] == 8
    profile_memory.main([*tiny, "--attention_type", "nsa", "--model_overrides",
                         json.dumps(train["model_overrides"])])
    assert out["peak"]["total"] > json.loads(capsys.readouterr().out)["peak"]["total"]


@pytest.mark.slow
def test_progress_lines_once_an_estimate_takes_a_while(capsys):
    """Long estimates (the 4B ones take half a minute) say on stderr which part runs, from `after` seconds on."""
    config = pm.StepConfig.of(model_size="tiny", context_length=64, attention_type="nsa")
    pm.estimate(config, profile_memory.progress_lines(after=0))
    err = capsys.readouterr().err.splitlines()
    assert [line.split(" (")[0] for line in err] == [
        "profile_memory: calibrating the nsa attention's stand-in", "profile_memory: building the model and optimizer",
        "profile_memory: forward", "profile_memory: backward", "profile_memory: optimizer step"]
    pm.estimate(config, profile_memory.progress_lines())
    assert capsys.readouterr().err == ""


def test_bad_input_is_rejected_before_anything_is_built():
    for kwargs in (dict(batch_size=0), dict(model_size="5B"), dict(attention_type="sparse"), dict(dtype="fp8"),
                   dict(context_length=1), dict(loss="fused"), dict(finetune="qlora"),
                   dict(finetune="lora", quantize_base="int4"), dict(world_size=0)):
        with pytest.raises(ValueError):
            pm.StepConfig.of(**kwargs)
    with pytest.raises(ValueError, match="--batch_size x --context_length must be at most"):
        pm.StepConfig.of(model_size="tiny", context_length=100_000_000)  # 24k loss chunks: refused at once


def test_one_command_one_answer_with_train_py():
    """profile_memory resolves options as train.py does on a GPU: at 32k the 4B model, NSA, checkpointing, the
    chunked loss and FFN tiles; a LoRA fine-tune at 32k gets the chunked loss without being asked."""
    long = pm.StepConfig.of(context_length=32768)
    model, compute = long.configs()
    assert (long.train.model_size, model.attention_type, long.train.gradient_checkpointing, long.train.dtype) == (
        "4B", "nsa", True, "bfloat16")
    assert (compute.loss_mode, compute.ffn_chunk_size) == ("chunked", 8192)
    lora = pm.StepConfig.of(model_size="4B", context_length=32768, finetune="lora", quantize_base="nf4")
    assert lora.configs()[1].loss_mode == "chunked"
    offload = pm.StepConfig.of(model_size="4B", context_length=131072, gpu_memory_gib=80, world_size=2)
    assert offload.configs()[1].offload_activations  # 22.5 GiB of block inputs > 20% of 80 GiB, as train.py


@pytest.mark.parametrize("args, message", [
    (["--world_size", "0"], "--world_size must be an integer in [1, 1024]"),
    (["--world_size", "100000"], "--world_size must be an integer in [1, 1024]"),
    (["--gpu_memory", "-1"], "--gpu_memory must be a positive finite number of GiB, got -1"),
    (["--gpu_memory", "1", "--reserve", "2"], "--reserve (2 GiB kept free) must be at least 0 and less than"),
    (["--context_length", "100000000"], "--batch_size x --context_length must be at most 4,194,304"),
    (["--batch_size", "1000000000000"], "tokens a step per process, whose ids and labels are held at once"),
    (["--model_overrides", "{\"n_layers\": 100000}"], "the estimate runs every layer under fake tensors, at most 512"),
    (["--gpu_memory", "inf"], "--gpu_memory must be a positive finite number"),
    (["--reserve", "5"], "--reserve is what --gpu_memory keeps free"),
    (["--plot", "memory.txt"], "--plot memory.txt: a file name ending in .png, .pdf, .svg"),
    (["--plot", "no/such/dir/memory.png"], "--plot no/such/dir/memory.png: cannot write in no/such/dir"),
    (["--attention_type", "sparse"], "--attention_type must be one of"),
    (["--quantize_base", "nf4"], "--quantize_base is not an option of --finetune full"),
    (["--finetune", "npt", "--world_size", "2"], "--finetune npt runs in one process"),
    (["--compile"], "--compile: the estimate is of the eager step"),
    (["--gpu_memory", "80", "--max_memory", "40"], "--max_memory 40: train.py stops past 40 GiB, below --gpu_memory "
                                                   "80 less its --reserve 2, which the fit is judged against; pass "
                                                   "--gpu_memory 42"),
])
def test_cli_errors_are_one_line_with_exit_code_2(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        profile_memory.main(["--model_size", "tiny", *args])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_an_attention_type_from_the_tests_is_profiled(swa):
    """The test-only sliding-window type, registered with one line: profile_memory lists it, describes it through
    its memory_stand_in, and the estimate equals the real CPU step (as for the built-in types)."""
    assert "swa" in profile_memory.build_parser().parse_args(["--attention_type", "swa"]).attention_type
    config = pm.StepConfig.of(model_size="tiny", context_length=96, attention_type="swa", batch_size=2,
                              dtype="float32")
    result = pm.estimate(config)
    assert result["stand_in"].startswith("sliding-window attention: runs as in training")
    assert_stages_close(result["stages"], real_step_live_bytes(config))


def test_refuses_to_run_inside_an_initialised_process_group():
    with pm.fake_process_group(2), pytest.raises(RuntimeError, match="outside torch.distributed"):
        pm.estimate(pm.StepConfig.of(model_size="tiny", context_length=64, world_size=2))
    assert not dist.is_initialized()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="--measure needs a CUDA device")
def test_measured_on_gpu_matches_estimate():
    config = pm.StepConfig.of(model_size="0.6B", context_length=4096, gradient_checkpointing=True)
    estimated, measured = pm.estimate(config), pm.measure(config)
    # The GPU adds what the tracker cannot see (cuBLAS workspaces, 512-byte rounding): allow 5%.
    assert_stages_close(estimated["stages"], measured["stages"], rel=0.05)


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["full", "nsa"])
def test_the_document_mask_adds_only_its_boundaries_to_the_estimate(attention):
    """--document_mask at 16k tokens (one sequence): every stage's estimate within O(T) bytes of the unmasked one:
    the document starts, 16 bytes a position (full attention's chunk masks live inside its call and stay below the
    peak); NSA (all documents in one call, under fake tensors one document a row) adds up to 8 bytes a position a
    layer (each layer's compressed blocks' starts and RoPE rows, kept for backward)."""
    T = 16384
    configs = [pm.StepConfig.of(model_size="tiny", context_length=T, attention_type=attention, batch_size=1,
                                document_mask=mask) for mask in (False, True)]
    stages = [pm.estimate(config)["stages"] for config in configs]
    allowed = 16 * T + (8 * T * configs[0].configs()[0].n_layers if attention == "nsa" else 0)
    for name, plain in stages[0].items():
        assert 0 <= stages[1][name]["total"] - plain["total"] <= allowed, name


def test_context_parallel_traffic_and_per_rank_activations():
    """Full attention split over N ranks: each rank all-gathers k and v in every layer, sending N - 1 times its part
    of each (bf16 under FSDP), and the same back in backward; what forward keeps per rank falls as 1/N but for the
    gathered keys and values a layer holds."""
    kept = {}
    for n in (1, 2, 4):
        config = pm.StepConfig.of(model_size="tiny", context_length=256, attention_type="full", world_size=4,
                                  context_parallel=n, loss="standard", batch_size=2)
        result = pm.estimate(config)
        kept[n] = result["stages"]["after forward"]["activations"]
        if n == 1:
            assert "traffic" not in result
            continue
        model = config.configs()[0]
        part = 2 * model.n_kv_heads * (256 // n) * model.head_dim * 2  # B x KV x t x D in bf16
        assert result["traffic"] == {"gathered": model.n_layers * 2 * (n - 1) * part, "gathers": model.n_layers * 2,
                                     "scattered": model.n_layers * 2 * (n - 1) * part,
                                     "scatters": model.n_layers * 2}
        assert "this rank sends" in pm.report_text(result)
    for n in (2, 4):
        assert kept[1] / n <= kept[n] <= 1.25 * kept[1] / n, (n, kept)


@pytest.mark.slow
def test_nsa_double_matches_reference_path_under_context_parallel():
    """NSA over 2 ranks: the double, measured at the rank's spans [0, 160) and [480, 640) (the second past 8 query
    chunks of 16: extrapolated from 4 and 8), gives every stage of the step within 2% of running every operator."""
    config = pm.StepConfig.of(model_size="tiny", context_length=640, attention_type="nsa", world_size=2,
                              context_parallel=2, loss="standard", attention_query_chunk=16, batch_size=1)
    double = pm.profile_step(config, stand_in=True)
    assert "spans [0, 160), [480, 640)" in double["stand_in"]
    assert_stages_close(double["stages"], pm.profile_step(config, stand_in=False)["stages"])


@pytest.mark.parametrize("attention", ["full", "nsa"])
def test_no_rank_holds_a_quadratic_or_logits_sized_tensor_under_context_parallel(attention):
    """A Qwen3-sized vocabulary at 262,144 tokens over 4 ranks (fake tensors): the peak of a rank's whole step
    stays far below one (t, T) bf16 score matrix of its queries (t = T / 4) and one rank's float32 logits."""
    T, N = 262144, 4
    config = pm.StepConfig.of(model_size="tiny", context_length=T, attention_type=attention, world_size=N,
                              context_parallel=N, batch_size=1, model_overrides={"vocab_size": 151936})
    peak = pm.estimate(config)["peak"]["total"]
    assert config.configs()[1].loss_mode == "chunked"
    assert peak < min(T // N * T * 2, T // N * 151936 * 4) / 4, peak
