"""nsa/inspection.py: the selection it reports equals the one the attention computes (nsa/attention.py's explicit
path, chunk by chunk), the gates are the layer's, and the command prints them for a prompt."""

from __future__ import annotations

import contextlib

import pytest
import torch

from model import ModelConfig, Transformer
from modeling.config import ComputeConfig
from modeling.flash import explicit_attention
from nsa import attention as nsa_attention
from nsa.blocks import as_blocks
from nsa.inspection import inspect, report, score_loss_target, selected_blocks
from nsa.primitive import exact_block_scores


@pytest.mark.parametrize("exact", [False, True])
def test_reported_selection_is_the_attention_s_own(exact: bool):
    """The compression branch's importance, or with the selection keys exact block scores (as the attention
    selects under `exact_block_scores`)."""
    torch.manual_seed(0)
    config = ModelConfig.from_preset("tiny", attention_type="nsa", nsa_num_selected=3)
    B, H, KV, T, D = 1, 4, 2, 90, 8
    q = torch.randn(B, H, T, D, dtype=torch.float64)
    n_cmp = (T - config.nsa_block_size) // config.nsa_stride + 1
    k_cmp, v_cmp = torch.randn(B, KV, n_cmp, D, dtype=torch.float64), torch.randn(B, KV, n_cmp, D, dtype=torch.float64)
    k = torch.randn(B, KV, T, D, dtype=torch.float64)
    blocks = as_blocks(k, config.nsa_select_block_size)
    with explicit_attention(), exact_block_scores() if exact else contextlib.nullcontext():
        compute = ComputeConfig(attention_query_chunk=T)
        span, = nsa_attention._spans(T, 0, 0, config, T)
        chunk = nsa_attention._chunk(span, q, k_cmp, v_cmp, blocks, blocks, k, k, config, compute)
        _, _, idx = chunk.forward()  # (B, KV, T, n); unused slots hold the number of blocks
    n_blocks = blocks.shape[2]
    want = idx.masked_fill(idx >= n_blocks, -1).sort(-1).values
    got = selected_blocks(q, k_cmp, config, k if exact else None)
    assert torch.equal(got, want)
    if exact:  # the loss's target (n = 4): a distribution where top-n chooses (from n l' = 64 on), zero before
        target = score_loss_target(q, k, ModelConfig.from_preset("tiny", attention_type="nsa"))  # (B, KV, T, Ns)
        torch.testing.assert_close(target.sum(-1)[..., 64:], torch.ones(B, KV, T - 64, dtype=torch.float64))
        assert not target[..., :64, :].any()


def test_inspect_reports_every_layer_and_the_gates():
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_preset("tiny", attention_type="nsa")).eval()
    ids = torch.randint(0, 512, (1, 70))
    found = inspect(model, ids)
    assert len(found) == model.config.n_layers
    layer = model.layers[0].attn
    x = model.layers[0].attn_norm(model.embed_tokens(ids))
    want = torch.sigmoid(layer.branch_gate(x)).view(1, 70, -1, 3).permute(0, 2, 1, 3)  # (B, H, T, 3)
    torch.testing.assert_close(found[0]["gates"], want)
    assert "sparse_attention" not in vars(layer)  # the seam is restored
    text = report(found, [-1, 5], 16, needle_blocks={1})
    assert "layer 1: mean gates" in text and "query     69 (block 4)" in text and "1*" in text


@pytest.mark.parametrize("attention, text, message", [
    ("nsa", "x " * 2000, "the prompt is"),
    ("nsa", "", "the prompt is 0 tokens"),
    ("full", "def f():", "has 'full' attention; this tool shows NSA's selection and gates, so it needs an NSA"),
])
def test_bad_inputs_are_one_line_errors(attention, text, message, data_dir, tmp_path, capsys):
    from inspect_nsa import main
    from storage.weights import export_model

    export_model(Transformer(ModelConfig.from_preset("tiny", attention_type=attention)), tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "model"), "--tokenizer", str(data_dir / "tokenizer.model"), "--text", text])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and "Traceback" not in err


def test_recall_selection_marks_the_pair_blocks(data_dir):
    """benchmarks/nsa_recall_selection.py: one row per MQAR answer, and a pair in the query's own or previous
    selection block (always selected) counts as selected in every layer, by the importance and by exact block
    scores; one row per passkey prompt, whose needle blocks are those of the passkey's digits. The loss target's
    weight lies in [0, 1]."""
    import runpy
    from pathlib import Path

    from text.synthetic import PromptBuilder, SyntheticDocuments
    from text.tokenizer import Tokenizer

    script = runpy.run_path(str(Path(__file__).resolve().parent.parent / "benchmarks" / "nsa_recall_selection.py"))
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_preset("tiny", attention_type="nsa", vocab_size=8192)).eval()
    tokenizer = Tokenizer(data_dir / "tokenizer.model")
    documents = SyntheticDocuments("mqar", tokenizer, 8)
    block = model.config.nsa_select_block_size
    rows = script["selection_hits"](model, script["mqar_lookups"](documents, 256, 2, 0, block))
    assert len(rows) >= 12 and all(len(row["hits"]) == model.config.n_layers for row in rows)
    assert all(all(row["hits"]) and all(row["exact"]) for row in rows if row["distance"] <= block)
    assert all(0 <= w <= 1 + 1e-6 for row in rows for w in row["weight"])
    table = script["report"](rows, model.config.nsa_window)
    assert table.splitlines()[2].startswith("| ") and "accuracy if selected" in table
    assert "layer 1: selected / by best keys / target weight" in table
    builder = PromptBuilder(tokenizer)
    items = list(script["prompt_lookups"](builder, "passkey", 200, [0.0, 0.5], 2, 0, block))
    assert len(items) == 4
    for ids, [(answer, distance, blocks)] in items:
        assert answer.start == 200 and ids[200:] == tokenizer.encode(" " + tokenizer.decode(ids[200:]).strip())
        digits = set(tokenizer.encode(tokenizer.decode(ids[200:]).strip()))
        assert blocks and all(any(ids[p] in digits for p in range(b * block, (b + 1) * block)) for b in blocks)
        assert 0 < distance < 200 and all((200 - distance) // block <= b < 200 // block for b in blocks)
    rows = script["selection_hits"](model, iter(items))
    assert len(rows) == 4 and all(isinstance(row["right"], bool) for row in rows)


@pytest.mark.parametrize("attention, args, message", [
    ("full", [], "has 'full' attention; this tool recomputes NSA's selection"),
    ("nsa", ["--length", "2048"], "--length 2048 is longer than the model's context of 1024"),
    ("nsa", ["--samples", "0"], "--samples must be at least 1"),
    ("nsa", ["--task", "passkey", "--length", "1020"], "--length for passkey must be at least"),
    ("nsa", ["--task", "passkey", "--depths", "1.5"], "takes no --pairs and --depths between 0 and 1"),
])
def test_recall_selection_bad_inputs_before_loading(attention, args, message, data_dir, tmp_path, capsys,
                                                    monkeypatch):
    """benchmarks/nsa_recall_selection.py checks its inputs from the stored config and tokenizer, before the
    weights load: one line, exit 2."""
    import runpy
    from pathlib import Path

    from storage.weights import export_model

    export_model(Transformer(ModelConfig.from_preset("tiny", attention_type=attention)), tmp_path)
    script = runpy.run_path(str(Path(__file__).resolve().parent.parent / "benchmarks" / "nsa_recall_selection.py"))
    monkeypatch.setitem(script["main"].__globals__, "load_model", lambda *a: pytest.fail("loaded before the checks"))
    with pytest.raises(SystemExit) as exit_info:
        script["main"]([str(tmp_path / "model"), "--tokenizer", str(data_dir / "tokenizer.model"), *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and "Traceback" not in err


def test_branch_ablation_switches_gates_off(data_dir, tmp_path, capsys):
    """benchmarks/nsa_branch_ablation.py: switching a branch off zeroes that branch's gates in every layer (read
    by nsa.inspection) and leaves the first layer's other two as they were; with all three off every NSA layer
    outputs exactly 0; leaving the blocks returns the model to its own output; the table has a row per distance
    bucket (documents) or depth (passkey prompts) plus the total. A missing model, a zero --samples or a passkey
    prompt shorter than its text is one line with exit 2."""
    import runpy
    from pathlib import Path

    from evaluation.recall import recall_scores
    from evaluation.retrieval import retrieval_grid
    from storage.weights import export_model
    from text.synthetic import PromptBuilder, SyntheticDocuments
    from text.tokenizer import Tokenizer

    script = runpy.run_path(str(Path(__file__).resolve().parent.parent / "benchmarks" / "nsa_branch_ablation.py"))
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_preset("tiny", attention_type="nsa", vocab_size=8192)).eval()
    ids = torch.randint(0, 8192, (2, 40))
    attn = model.layers[0].attn
    x = torch.randn(2, 40, model.config.dim)
    cos, sin = model.rope(40, 0, x.device)
    before, gates = model(ids).logits, [found["gates"] for found in inspect(model, ids)]  # (B, H, T, 3) a layer
    for branch in range(3):
        with script["branch_off"](model, branch):
            got = [found["gates"] for found in inspect(model, ids)]
        assert all(torch.equal(g[..., branch], torch.zeros_like(g[..., branch])) for g in got)
        others = [b for b in range(3) if b != branch]  # the first layer's input is untouched: its other gates too
        assert torch.equal(got[0][..., others], gates[0][..., others])
    with script["branch_off"](model, 0), script["branch_off"](model, 1), script["branch_off"](model, 2):
        assert torch.equal(attn(x, cos, sin), torch.zeros_like(x))
    torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=0)
    tokenizer = Tokenizer(data_dir / "tokenizer.model")
    documents = SyntheticDocuments("copy", tokenizer)
    results = script["ablation"](model, lambda: recall_scores(model, documents, [64], 2, 0, 2))
    assert list(results) == ["all", "exact block scores", "without compression", "without selection", "without window"]
    table = script["report"](results).splitlines()
    assert len(table) == 2 + len(results["all"]["buckets"]) + 1 and table[-1].startswith("| all | ")
    builder, depths = PromptBuilder(tokenizer), [0.0, 1.0]  # the passkey grid: a row per depth, exact match
    grid = script["ablation"](model, lambda: retrieval_grid(model, builder, "passkey", [160], depths, 1, 0, 1))
    table = script["report"](grid).splitlines()
    assert table[0].startswith("| depth | answers | all | exact block scores |") and len(table) == 2 + 2 + 1
    assert table[2].startswith("| 0 | 1 | ") and table[-1].startswith("| all | 2 | ")
    for argv in ([str(tmp_path / "missing")], [str(tmp_path / "missing"), "--samples", "0"]):
        with pytest.raises(SystemExit) as exit_info:
            script["main"](argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and "Traceback" not in err
    assert "--samples and --batch_size must be at least 1" in err
    export_model(model, tmp_path / "nsa")
    with pytest.raises(SystemExit) as exit_info:
        script["main"]([str(tmp_path / "nsa" / "model"), "--tokenizer", str(data_dir / "tokenizer.model"), "--task",
                        "passkey", "--length", "20"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--length for passkey must be at least" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as exit_info:  # where the results would go is checked before any work
        script["main"]([str(tmp_path / "nsa" / "model"), "--tokenizer", str(data_dir / "tokenizer.model"),
                        "--json", str(tmp_path / "missing" / "ablation.json")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--json " in err and "cannot write" in err
