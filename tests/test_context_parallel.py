"""Context parallelism (training/parallel.py `context_shard`, modeling/shard.py): a sequence split over 2 or 4 gloo
processes, each holding 2 of its 2N chunks, gives the loss and every gradient of the whole sequence in one process,
for full attention (with and without document starts) and NSA (with its selection-scoring loss, at a length where
top-n chooses); the spans, their refusals, and one process holding a sequence in several spans.

Tolerances: the models run in float64, where the only difference from one process is the order of sums (the loss's
over ranks, a key's gradient over the ranks whose queries read it, each chunk's softmax merged by log-sum-exp): a
relative error of a few ulps times the number of terms, far below 1e-10.
"""

from __future__ import annotations

import json
import shutil
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed

import train
from model import ModelConfig, Objective, Transformer
from modeling.documents import document_starts
from modeling.flash import explicit_attention
from modeling.loss import IGNORE_INDEX, shift_labels
from modeling.shard import SequenceShard, balanced_spans
from nsa.primitive import exact_block_scores
from training import options as train_config
from training import parallel, trainer

T = 128  # tiny preset's NSA: l' = 16, n = 4, so top-n chooses from position 64 on


def test_balanced_spans_pair_early_and_late_chunks() -> None:
    assert [balanced_spans(16, 2, r) for r in range(2)] == [((0, 4), (12, 16)), ((4, 8), (8, 12))]
    assert balanced_spans(8, 1, 0) == ((0, 4), (4, 8))
    with pytest.raises(ValueError, match=r"2 x 4 = 8 equal chunks.*multiple of 8, e.g. 128 or 136"):
        balanced_spans(130, 4, 0)


def _alone(length: int, spans: tuple[tuple[int, int], ...]) -> SequenceShard:
    """One process holding a whole sequence in `spans` (its all-gather the identity)."""
    return SequenceShard(length, (spans,), 0, lambda x: x[None])


def test_a_shard_checks_its_spans_and_takes_its_positions() -> None:
    shard = SequenceShard(8, (((0, 2), (6, 8)), ((2, 6),)), 0, lambda x: x[None])
    assert shard.tokens == 4 and list(shard.pieces()) == [(0, 0, 2), (2, 6, 8)]
    assert shard.take(torch.arange(8)[None]).tolist() == [[0, 1, 6, 7]]
    for spans in (((2, 4), (0, 2)), ((0, 3), (2, 4)), ((0, 9),), ((1, 1),)):
        with pytest.raises(ValueError, match="ascending, disjoint"):
            _alone(8, spans)
    with pytest.raises(ValueError, match="must tile"):
        _alone(8, ((0, 2), (3, 8)))


def test_the_positions_before_each_span() -> None:
    """`before`: the m positions before each span, from the ranks' tails (a whole span when m exceeds it)."""
    x = torch.arange(16.0).view(1, 1, 16, 1)
    shard = _alone(16, ((0, 3), (3, 7), (7, 16)))
    assert [b.flatten().tolist() for b in shard.before(x, 2)] == [[], [1.0, 2.0], [5.0, 6.0]]
    assert [b.flatten().tolist() for b in shard.before(x, 5)] == [[], [0.0, 1.0, 2.0], [2.0, 3.0, 4.0, 5.0, 6.0]]
    assert torch.equal(shard.gather(x), x)


ONE_SET = {"nsa_separate_kv": False, "nsa_compressor": "mean"}  # the recall recipe's NSA: one K/V set, mean blocks


def _model(attention: str, **overrides: object) -> Transformer:
    """The tiny preset in float64: NSA (three K/V sets, the MLP compressor, unless `overrides` say otherwise) with
    its selection-scoring loss."""
    torch.manual_seed(0)
    config = ModelConfig.from_preset("tiny", attention_type=attention, context_length=T, **overrides)
    objective = Objective(nsa_score_loss_coef=0.5) if attention == "nsa" else Objective()
    return Transformer(config, objective=objective).double()


def _batch(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """rows x T token ids with end-of-document ids (id 1) at a few places, and labels ignoring a stretch."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 512, (rows, T), generator=generator)
    ids[:, [5, 40, 41, 90]] = 1
    labels = ids.clone()
    labels[:, 10:30] = IGNORE_INDEX
    return ids, labels


def test_one_process_holding_several_spans_equals_the_whole_sequence() -> None:
    """A shard of one process in 3 spans (gather the identity): each span attends as queries from its first
    position on; the outputs, loss and gradients are the whole sequence's."""
    ids, labels = _batch(2)
    shard = _alone(T, ((0, 40), (40, 97), (97, T)))
    for attention, path, overrides in (("full", nullcontext(), {}), ("full", explicit_attention(), {}),
                                       ("nsa", nullcontext(), {}), ("nsa", nullcontext(), ONE_SET),
                                       ("nsa", exact_block_scores(), {})):
        whole, split = _model(attention, **overrides), _model(attention, **overrides)
        with path:  # full attention: the CPU's flash kernels, or SDPA with a lower-right causal mask (as on CUDA)
            expected = whole(ids, labels)  # NSA: also selecting by exact block scores (--nsa_exact_selection_steps)
            expected.loss.backward()
            got = split(ids, shift_labels(labels), shard=shard)
            got.loss.backward()
        torch.testing.assert_close(got.loss, expected.loss, rtol=1e-12, atol=0)
        for (name, p), q in zip(split.named_parameters(), whole.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-14, msg=f"{attention} {name}")


def _parity(context_ranks: int, ring: bool) -> None:
    """In each rank of a (data x context) layout, through the trainer's step (`trainer.forward_backward`: the
    rank's positions taken, the loss's normaliser and NSA's term weighted over the ranks): the rank's share of the
    loss, of NSA's selection-scoring term and of every gradient, summed over the ranks, equals one process's over
    the whole batch (each data group reads its own rows). The trainer adds the step's loss in float32. With `ring`
    full attention runs on PyTorch's ring attention (CUDA's engine, here on the CPU's flash kernels; with
    document starts the gathered keys still), otherwise on gathered keys."""
    rt = parallel.init_runtime(context_ranks)
    shard = parallel.context_shard(rt, T, ring=ring)
    assert shard.spans == balanced_spans(T, context_ranks, rt.rank % context_ranks)
    assert (shard.attention is not None) == ring
    ids, labels = _batch(2 * rt.data_ranks)
    mine = slice(2 * rt.data_rank, 2 * rt.data_rank + 2)  # this data group's rows
    cases = (("full", False, {}), ("full", True, {}), ("nsa", False, {}), ("nsa", False, ONE_SET))
    for attention, documents, overrides in cases[:2] if ring else cases:
        reference, model = _model(attention, **overrides), _model(attention, **overrides)
        starts = document_starts(ids, 1) if documents else None
        expected = reference(ids, labels, doc_start=starts)
        expected.loss.backward()
        batch = [ids[mine], labels[mine], *([] if starts is None else [starts[mine]])]
        loss, extras = trainer.forward_backward(model, [batch], nullcontext(), shard=shard)
        dist.all_reduce(loss)
        torch.testing.assert_close(loss, expected.loss.detach().float(), rtol=1e-6, atol=0)
        if attention == "nsa":
            dist.all_reduce(extras["aux_loss"])
            torch.testing.assert_close(extras["aux_loss"], expected.aux_loss, rtol=1e-12, atol=0)
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            dist.all_reduce(p.grad)
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-14,
                                       msg=f"{attention} {overrides} {name}")
    dist.destroy_process_group()


@pytest.mark.parametrize("context_ranks", [2, 4])
def test_context_parallel_equals_one_process(context_ranks: int) -> None:
    """One sequence over 2 and over 4 processes (data x context layouts with FSDP: the train.py tests below)."""
    run_distributed(_parity, context_ranks, False, world_size=context_ranks)


@pytest.mark.parametrize("context_ranks, world_size", [(2, 2), (4, 4), (2, 4)])
def test_ring_attention_equals_one_process(context_ranks: int, world_size: int) -> None:
    """Full attention on PyTorch's ring attention, the engine CUDA runs (`parallel.ring_attention_applies`), one
    sequence over 2 and 4 processes, and over 2 in each of 2 data groups (where a rank's index in its context group
    is not its global rank)."""
    assert parallel.ring_attention_applies(torch.device("cuda"))
    assert not parallel.ring_attention_applies(torch.device("cpu"))
    run_distributed(_parity, context_ranks, True, world_size=world_size)


def _whole_attention(heads: int, length: int, head_dim: int, seed: int
                     ) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:
    """Random q (2, heads, length, head_dim), k, v (2 key/value heads) and an output gradient in
    float64, and the whole sequence's causal attention over them with its gradients: ([q, k, v], grad, [out, dq,
    dk, dv])."""
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, h, length, head_dim, generator=generator, dtype=torch.float64) for h in (heads, 2, 2))
    grad = torch.randn(2, heads, length, head_dim, generator=generator, dtype=torch.float64)
    whole = [x.clone().requires_grad_() for x in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*whole, is_causal=True, enable_gqa=True)
    out.backward(grad)
    return [q, k, v], grad, [out.detach(), *(x.grad for x in whole)]


def _ring_in_half_precision() -> None:
    """`parallel.ring_attention` in bfloat16 (merges and gradient sums in float32, as on CUDA) against the whole
    sequence's attention in float64: within bfloat16's rounding of inputs and outputs (relative 2e-2 of each
    result's norm); its traffic as counted: the keys and values passed N - 1 times forward and backward, their
    gradients N times in float32."""
    rt = parallel.init_runtime(2)
    (q, k, v), grad, expected = _whole_attention(4, 64, 16, seed=2)
    mine = torch.cat([torch.arange(first, end) for first, end in balanced_spans(64, 2, rt.rank)])
    local = [x[:, :, mine].bfloat16().requires_grad_() for x in (q, k, v)]
    traffic = parallel.Traffic()
    out = parallel.ring_attention(*local, 16**-0.5, rt.context_group, traffic)
    out.backward(grad[:, :, mine].bfloat16())
    for got, want in zip((out, *(x.grad for x in local)), expected, strict=True):
        want = want[:, :, mine]
        assert (got.double() - want).norm() <= 2e-2 * want.norm(), (got - want).abs().max()
    kv_bytes = 2 * local[1].numel() * 2
    assert (traffic.gathered, traffic.scattered, traffic.gathers, traffic.scatters) == (2 * kv_bytes, 2 * kv_bytes * 2,
                                                                                        2, 1)
    dist.destroy_process_group()


def test_ring_attention_in_half_precision() -> None:
    run_distributed(_ring_in_half_precision, world_size=2)


def _what_ring_attention_keeps() -> None:
    """What full attention keeps for backward on a rank of 2, without checkpointing: on the ring, keys and values
    of this rank's t = T / 2 positions only; on gathered keys, every layer keeps keys and values of more (up to
    the end of this rank's last chunk)."""
    rt = parallel.init_runtime(2)
    length = 160
    ids = torch.randint(2, 512, (1, length), generator=torch.Generator().manual_seed(4))
    kept: list[torch.Size] = []

    def keep(x: torch.Tensor) -> torch.Tensor:
        kept.append(x.shape)
        return x

    for ring in (True, False):
        shard = parallel.context_shard(rt, length, ring=ring)
        model = Transformer(ModelConfig.from_preset("tiny", context_length=length)).double()
        kept.clear()
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda x: x):
            model(shard.take(ids), shard=shard)
        beyond = [shape for shape in kept if len(shape) == 4 and shape[1] == model.config.n_kv_heads
                  and shape[3] == model.config.head_dim and shape[2] > length // 2]  # keys, values (B, KV, S, D)
        assert (beyond == []) == ring, beyond
    dist.destroy_process_group()


def test_ring_attention_keeps_only_its_own_keys() -> None:
    run_distributed(_what_ring_attention_keeps, world_size=2)


# ---- train.py --context_parallel ------------------------------------------------------------------------------

STEPS = 4
BASE = ["--model_size", "tiny", "--context_length", "32", "--batch_size", "2", "--max_steps", str(STEPS),
        "--warmup_steps", "2", "--checkpoint_interval", "2", "--log_interval", "100", "--sample_tokens", "0"]


def _metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def _train(data_dir: Path, out_dir: Path, *extra: str, world: int = 1) -> None:
    args = [*BASE, "--data_dir", str(data_dir), "--out_dir", str(out_dir), *extra]
    if world == 1:
        train.main(args)
    else:
        run_distributed(train.main, args, world_size=world)


@pytest.fixture(scope="module")
def runs(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same 4 steps of 4 sequences each: one process (2 x 2 micro-steps); one sequence split over 2 processes
    (2 x 2 micro-steps); 2 groups of 2 processes (FSDP x context parallelism, 2 sequences a group)."""
    torch.set_num_threads(1)  # as in each spawned rank
    out = {name: tmp_path_factory.mktemp(name) for name in ("single", "context2", "grid2x2")}
    _train(data_dir, out["single"], "--gradient_accumulation_steps", "2")
    _train(data_dir, out["context2"], "--gradient_accumulation_steps", "2", "--context_parallel", "2", world=2)
    _train(data_dir, out["grid2x2"], "--context_parallel", "2", world=4)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["context2", "grid2x2"])
def test_train_with_context_parallel_equals_one_process(runs: dict[str, Path], layout: str) -> None:
    """The same windows, the same initialisation: losses and gradient norms of every step equal one process's up to
    float32 sums in another order (the first loss: one step of sums, 1e-6)."""
    got, single = _metrics(runs[layout]), _metrics(runs["single"])
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert got[0]["loss"] == pytest.approx(single[0]["loss"], rel=1e-6)
    for a, b in zip(got, single, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


@pytest.mark.slow
def test_a_context_parallel_checkpoint_resumes_without_it_and_back(runs: dict[str, Path], data_dir: Path,
                                                                   tmp_path: Path) -> None:
    """DCP reshards: the 2-process, context-parallel checkpoint of step 2 continues on one process, and the
    one-process checkpoint on 2 context-parallel processes, each with the losses of the run it left (float32 sums
    in another order); the record says what changed."""
    for saved, layout, extra, world in (("context2", "single", (), 1),
                                        ("single", "context2", ("--context_parallel", "2"), 2)):
        out = tmp_path / saved
        shutil.copytree(runs[saved] / "step-2", out / "step-2")
        _train(data_dir, out, "--gradient_accumulation_steps", "2", "--resume", str(out / "step-2"), *extra,
               world=world)
        changed, *steps = _metrics(out)
        expected = {"world_size": [2, 1], "context_parallel": [2, 1]} if world == 1 else {
            "world_size": [1, 2], "context_parallel": [1, 2]}
        assert changed == {"step": 2, "resumed_with": expected}
        for a, b in zip(steps, _metrics(runs[layout])[2:], strict=True):
            assert a["step"] == b["step"] and a["loss"] == pytest.approx(b["loss"], rel=1e-5)


def test_context_parallel_refusals(swa: type) -> None:
    """Lengths that do not split, more ranks than processes, NSA's documents in a shard, and an attention type
    that changes which keys a query sees without saying how a shard does: each a one-line error."""
    with pytest.raises(ValueError, match="multiple of 4"):
        train_config.TrainConfig(context_length=30, context_parallel=2)
    with pytest.raises(ValueError, match=r"--context_parallel 2 must divide the 1 processes.*\[1\]"):
        parallel.init_runtime(2)
    ids, _ = _batch(1)
    shard = _alone(T, ((0, 64), (64, T)))
    with pytest.raises(ValueError, match="NSA does not split a sequence shard into documents"):
        _model("nsa")(ids, doc_start=document_starts(ids, 1), shard=shard)
    window = Transformer(ModelConfig.from_preset("tiny", attention_type="swa", context_length=T))
    with pytest.raises(ValueError, match="overrides attend"):
        window(ids, shard=shard)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("attention", ["full", "nsa"])
def test_a_shard_on_cuda_equals_the_whole_sequence(attention: str) -> None:
    """On a GPU, in bf16: full attention over a span through SDPA's lower-right causal mask (flash), NSA's spans on
    the Triton kernels from their first query: the loss and gradients of one process holding the sequence in 3
    spans equal the whole sequence's within bf16 rounding (relative 2e-2 of each gradient's norm)."""
    ids, labels = (t.cuda() for t in _batch(2))
    shard = _alone(T, ((0, 40), (40, 96), (96, T)))
    whole, split = (_model(attention).float().cuda() for _ in range(2))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        expected = whole(ids, labels)
        got = split(ids, shift_labels(labels), shard=shard)
    expected.loss.backward()
    got.loss.backward()
    torch.testing.assert_close(got.loss, expected.loss, rtol=1e-2, atol=0)
    for (name, p), q in zip(split.named_parameters(), whole.parameters(), strict=True):
        assert (p.grad - q.grad).norm() <= 2e-2 * q.grad.norm() + 1e-6, name


def _ring_kernels_on_cuda() -> None:
    """One rank on one GPU (NCCL): the ring's single pair of chunks runs CUDA's flash kernels with grouped keys,
    forward and backward (the kernel's state handed from one to the other), against float64 attention on the CPU
    within bfloat16's rounding; float32 inputs, which the kernel cannot take, are left to the gathered keys (None).
    (The passes between ranks are the CPU tests'; a GPU each for them needs more than one GPU.)"""
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    (q, k, v), grad, expected = _whole_attention(8, 256, 64, seed=3)
    local = [x.cuda().bfloat16().requires_grad_() for x in (q, k, v)]
    out = parallel.ring_attention(*local, 64**-0.5, dist.group.WORLD)
    out.backward(grad.cuda().bfloat16())
    for got, want in zip((out, *(x.grad for x in local)), expected, strict=True):
        assert (got.double().cpu() - want).norm() <= 2e-2 * want.norm()
    assert parallel.ring_attention(*(x.detach().float() for x in local), 64**-0.5, dist.group.WORLD) is None
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_ring_attention_kernels_on_cuda() -> None:
    run_distributed(_ring_kernels_on_cuda, world_size=1)
