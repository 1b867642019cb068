"""An NSA export loads in transformers with trust_remote_code: the export carries the project's own modules (their
imports made relative), so `AutoModelForCausalLM` runs the same code on the same weights. Logits are compared
exactly (the same operations in the same order) and greedy generations token for token, on every NSA option:
compressor, separate or shared K/V, block geometry, tied or separate output weights."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from model import Transformer
from modeling.config import ModelConfig
from storage.hf import export_hf_checkpoint, load_hf_checkpoint
from storage.remote_code import MODELING_FILE, PROJECT, remote_code_files

transformers = pytest.importorskip("transformers")

NSA_OPTIONS = {
    "paper": {},  # the tiny preset: MLP compressor, separate K/V
    "mean-shared": {"nsa_compressor": "mean", "nsa_separate_kv": False},
    "blocks": {"nsa_block_size": 8, "nsa_stride": 4, "nsa_select_block_size": 16, "nsa_num_selected": 3,
               "nsa_window": 16, "tie_embeddings": False},
}


def test_the_code_an_export_carries_imports_nothing_of_the_project_by_name():
    """Every carried file imports project modules relatively, and each one it imports is carried: the export
    needs neither this repository nor its installation."""
    files = remote_code_files()
    assert MODELING_FILE in files and "model.py" in files and "nsa_layer.py" in files
    for name, source in files.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                assert node.module.split(".")[0] not in PROJECT, f"{name}: from {node.module} import"
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                assert f"{node.module}.py" in files, f"{name} imports {node.module}, which is not carried"


@pytest.mark.parametrize("options", NSA_OPTIONS.values(), ids=NSA_OPTIONS.keys())
def test_transformers_runs_the_nsa_export_as_the_project_does(tmp_path: Path, options: dict):
    model = Transformer(ModelConfig.from_preset("tiny", attention_type="nsa", **options)).eval()
    export_hf_checkpoint(model, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LongctxForCausalLM"] and config["auto_map"]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 70))  # past the window: every branch reads
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, model(ids).logits, rtol=0, atol=0)
        ours_back = load_hf_checkpoint(tmp_path / "hf")  # the project reads the export too
        torch.testing.assert_close(ours_back(ids).logits, model(ids).logits, rtol=0, atol=0)
    prompt = ids[:1, :40]
    greedy = theirs.generate(prompt, max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(prompt))
    assert greedy.tolist() == model.generate(prompt, 12, temperature=0.0).tolist()
    with torch.no_grad():  # a row padded on the left reads from its first real token: what it gives alone
        padded = theirs(ids, attention_mask=torch.tensor([[0] * 3 + [1] * 67, [1] * 70])).logits
        alone = model(ids[:1, 3:]).logits
    torch.testing.assert_close(padded[:1, 3:], alone, rtol=0, atol=1e-5 * alone.abs().max().item())  # RoPE rounding
    left = theirs.generate(ids[:, :40], max_new_tokens=12, do_sample=False,  # a batch padded on the left
                           attention_mask=torch.tensor([[0] * 3 + [1] * 37, [1] * 40]))
    for row, first in enumerate((3, 0)):  # each row generates what it generates alone
        assert left[row, first:].tolist() == model.generate(ids[row:row + 1, first:40], 12, temperature=0.0)[0].tolist()
    assert (theirs.model.lm_head.weight is theirs.model.embed_tokens.weight) == model.config.tie_embeddings
    theirs.save_pretrained(tmp_path / "again")  # transformers' own save (a tied output weight left out) reads back
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again", trust_remote_code=True)
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model(ids).logits, rtol=0, atol=0)
        torch.testing.assert_close(load_hf_checkpoint(tmp_path / "again")(ids).logits, model(ids).logits, rtol=0,
                                   atol=0)


@pytest.fixture(scope="module")
def nsa_export(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Transformer]:
    """A tiny NSA model (context 128) and its Hugging Face export."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_preset("tiny", attention_type="nsa", context_length=128)).eval()
    path = tmp_path_factory.mktemp("nsa") / "hf"
    export_hf_checkpoint(model, path)
    return path, model


def load(path: Path) -> object:
    return transformers.AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)


def test_the_standard_forward_arguments(nsa_export):
    """As transformers' own classes (Qwen3): inputs_embeds gives input_ids' outputs; output_hidden_states the
    embeddings and every layer's output, the last after the final norm; return_dict=False a tuple; labels the
    mean next-token loss."""
    path, model = nsa_export
    theirs = load(path).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 70))
    with torch.no_grad():
        by_ids = theirs(ids, output_hidden_states=True)
        by_embeds = theirs(inputs_embeds=theirs.get_input_embeddings()(ids))
        as_tuple = theirs(ids, labels=ids, return_dict=False)
    torch.testing.assert_close(by_embeds.logits, by_ids.logits, rtol=0, atol=0)
    states = by_ids.hidden_states
    assert len(states) == model.config.n_layers + 1 and all(s.shape == (2, 70, model.config.dim) for s in states)
    torch.testing.assert_close(states[0], model.embed_tokens(ids), rtol=0, atol=0)
    torch.testing.assert_close(theirs.model.logits(states[-1]).float(), by_ids.logits, rtol=0, atol=0)
    assert isinstance(as_tuple, tuple) and len(as_tuple) == 2  # (loss, logits)
    expected = torch.nn.functional.cross_entropy(by_ids.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    torch.testing.assert_close(as_tuple[0], expected, rtol=1e-6, atol=0)


def test_gradient_checkpointing_through_transformers_gives_the_same_gradients(nsa_export):
    """gradient_checkpointing_enable (transformers' interface, its kwargs passed to torch's checkpoint) recomputes
    every block in backward, and the gradients equal those without it."""
    path, model = nsa_export
    ids = torch.randint(0, model.config.vocab_size, (1, 100))
    grads = []
    for kwargs in (None, {"use_reentrant": False}):
        theirs = load(path).train()
        if kwargs is not None:
            theirs.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            assert theirs.is_gradient_checkpointing and all(b.gradient_checkpointing for b in theirs.model.layers)
        theirs(ids, labels=ids).loss.backward()
        grads.append({name: p.grad for name, p in theirs.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_resized_embeddings_take_the_new_ids_and_generation_is_refused_past_the_context(nsa_export):
    path, model = nsa_export
    theirs = load(path).eval()
    theirs.resize_token_embeddings(model.config.vocab_size + 64)
    assert theirs.model.config.vocab_size == theirs.config.longctx_model["vocab_size"] == model.config.vocab_size + 64
    with torch.no_grad():
        new_id = model.config.vocab_size + 10
        assert theirs(torch.tensor([[new_id, 3]])).logits.shape[-1] == model.config.vocab_size + 64
    prompt = torch.randint(0, model.config.vocab_size, (1, 100))
    with pytest.raises(ValueError, match="make 140, past the model's context of 128"):
        theirs.generate(prompt, max_new_tokens=40, do_sample=False)


def test_the_tied_output_weight_is_stored_once_and_an_attention_implementation_is_refused_naming_the_model_s(
        nsa_export):
    from safetensors import safe_open

    path, model = nsa_export
    with safe_open(path / "model.safetensors", framework="pt") as f:
        assert "model.embed_tokens.weight" in f.keys() and "model.lm_head.weight" not in f.keys()  # noqa: SIM118
    theirs = load(path)
    assert model.config.tie_embeddings and theirs.model.lm_head.weight is theirs.model.embed_tokens.weight
    with pytest.raises(ValueError, match="attn_implementation='sdpa': this model runs its own attention"):
        transformers.AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, attn_implementation="sdpa")


def test_generate_decodes_through_the_cache_as_without_it(nsa_export):
    """generate with the cache (the project's preallocated NSA caches) gives the tokens it gives without one: greedy
    (and equal to the project's own cached generate), sampled from one seed, beam search (rows reordered); the
    prompt is read once and each new token once."""
    path, model = nsa_export
    theirs = load(path).eval()
    prompt = torch.randint(0, model.config.vocab_size, (2, 60))  # past the window: every branch reads
    runs = {}
    for cached in (True, False):
        greedy = theirs.generate(prompt, max_new_tokens=20, do_sample=False, use_cache=cached)
        torch.manual_seed(1)
        sampled = theirs.generate(prompt, max_new_tokens=20, do_sample=True, top_k=50, use_cache=cached)
        beams = theirs.generate(prompt, max_new_tokens=12, num_beams=3, do_sample=False, use_cache=cached)
        runs[cached] = (greedy, sampled, beams)
    for with_cache, without in zip(runs[True], runs[False], strict=True):
        assert with_cache.tolist() == without.tolist()
    assert runs[True][0].tolist() == model.generate(prompt, 20, temperature=0.0).tolist()
    read = []
    hook = theirs.model.embed_tokens.register_forward_hook(lambda module, args, out: read.append(args[0].shape[1]))
    theirs.generate(prompt, max_new_tokens=5, do_sample=False)
    hook.remove()
    assert read == [60, 1, 1, 1, 1]


def test_right_padded_rows_give_their_real_tokens_what_they_give_alone(nsa_export):
    """Padding on the right (training batches, scoring) is taken: each row's real tokens get the logits and loss of
    the row alone; zeros between real tokens are refused."""
    path, model = nsa_export
    theirs = load(path).eval()
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in (70, 45)]
    ids = torch.zeros(2, 70, dtype=torch.long)
    mask = torch.zeros(2, 70, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)], mask[i, :len(row)] = row, 1
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        batch = theirs(ids, attention_mask=mask, labels=labels)
        for i, row in enumerate(rows):
            alone = theirs(row[None])
            scale = alone.logits.abs().max().item()  # float32: batched kernels may sum in another order
            torch.testing.assert_close(batch.logits[i, :len(row)], alone.logits[0], rtol=0, atol=1e-5 * scale)
        with pytest.raises(ValueError, match="zeros between real tokens"):
            theirs(ids, attention_mask=torch.tensor([[1, 0] + [1] * 68, [1] * 70]))
    assert batch.loss.isfinite()


def test_a_trainer_fine_tunes_the_export_with_checkpointing_and_right_padded_batches(nsa_export, tmp_path):
    """transformers' Trainer, gradient checkpointing on, batches of rows of different lengths padded on the right:
    a few steps run, the loss is finite and the weights move."""
    from transformers import Trainer, TrainingArguments

    path, model = nsa_export
    theirs = load(path)
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(2, model.config.vocab_size, (n,), generator=g) for n in (70, 41, 90, 55)]

    def collate(batch: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        longest = max(len(row) for row in batch)
        ids = torch.zeros(len(batch), longest, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(batch):
            ids[i, :len(row)], mask[i, :len(row)] = row, 1
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    before = theirs.model.layers[0].mlp.up_proj.weight.detach().clone()
    args = TrainingArguments(output_dir=str(tmp_path / "trainer"), per_device_train_batch_size=2, max_steps=3,
                             learning_rate=1e-3, gradient_checkpointing=True, use_cpu=True, report_to="none",
                             save_strategy="no", logging_steps=1, remove_unused_columns=False)
    result = Trainer(model=theirs, args=args, train_dataset=rows, data_collator=collate).train()
    assert result.global_step == 3 and torch.isfinite(torch.tensor(result.training_loss))
    assert all(block.gradient_checkpointing for block in theirs.model.layers)
    assert not torch.equal(theirs.model.layers[0].mlp.up_proj.weight, before)


def _as_written_before_the_rename(directory: Path, weights: str) -> None:
    """Rewrite `directory`'s `weights` file (and its manifest) with NSA's branch gate under its old name."""
    from safetensors.torch import load_file, save_file

    from storage.manifest import MANIFEST_NAME, file_records

    state = {name.replace(".attn.branch_gate.", ".attn.gate_proj."): t
             for name, t in load_file(directory / weights).items()}
    assert any(".attn.gate_proj." in name for name in state)
    save_file(state, directory / weights, metadata={"format": "pt"})
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    manifest["files"][weights] = file_records([directory / weights])[weights]
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest))


def test_nsa_branch_gate_is_named_apart_from_the_mlp_gate_and_old_exports_still_load(nsa_export, tmp_path):
    """A LoRA aimed at the MLP's gate_proj adapts no NSA gate (the branch gate is `branch_gate`); exports written
    under the old name (attn.gate_proj) load with the same logits, the project's and the Hugging Face layout."""
    import peft

    from storage.weights import export_model, load_model

    path, model = nsa_export
    adapted = peft.get_peft_model(load(path), peft.LoraConfig(r=2, target_modules=["gate_proj"]))
    names = [name for name, module in adapted.named_modules() if isinstance(module, peft.tuners.lora.LoraLayer)]
    assert names and all(".mlp.gate_proj" in name for name in names)
    export_model(model, tmp_path)
    _as_written_before_the_rename(tmp_path / "model", "model.safetensors")
    old_hf = tmp_path / "old-hf"
    export_hf_checkpoint(model, old_hf)
    _as_written_before_the_rename(old_hf, "model.safetensors")
    ids = torch.randint(0, model.config.vocab_size, (1, 60))
    with torch.no_grad():
        for loaded in (load_model(tmp_path / "model"), load_hf_checkpoint(old_hf)):
            torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_a_damaged_or_edited_export_is_refused_before_transformers_builds_it(nsa_export, tmp_path):
    """The export's own door (modeling_longctx.check_export): flipped bytes against its manifest.json, a config.json
    whose mirrored fields or longctx_model no longer fit the weights (a copy without the manifest, as transformers'
    own save writes), each one line naming the file."""
    import shutil

    path, _ = nsa_export
    for case in ("flipped", "vocab", "type"):
        copy = tmp_path / case
        shutil.copytree(path, copy)
        if case == "flipped":
            with (copy / "model.safetensors").open("r+b") as f:
                f.seek(-100, 2)
                f.write(b"\xff\xfe")
        else:
            (copy / "manifest.json").unlink()
            config = json.loads((copy / "config.json").read_text())
            if case == "vocab":
                config["vocab_size"] = 1000
            else:
                config["longctx_model"]["attention_type"] = "full"
            (copy / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError) as refusal:
            transformers.AutoModelForCausalLM.from_pretrained(copy, trust_remote_code=True)
        message = str(refusal.value)
        assert "\n" not in message and str(copy) in message, message
        assert {"flipped": "is damaged: model.safetensors", "vocab": "vocab_size 1000 disagrees with longctx_model's",
                "type": "the weights do not fit config.json's longctx_model"}[case] in message, message
