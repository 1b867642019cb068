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


# ---- the paths a Qwen3 user takes (the same calls on a Qwen3 of the same geometry where one exists) --------------


@pytest.fixture(scope="module")
def qwen3_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny full-attention model of the NSA fixture's geometry, exported as a native Qwen3 directory."""
    torch.manual_seed(1)
    model = Transformer(ModelConfig.from_preset("tiny", context_length=128, qk_norm=True)).eval()
    path = tmp_path_factory.mktemp("qwen3") / "hf"
    export_hf_checkpoint(model, path)
    return path


def rows_padded_right(vocab: int, lengths: tuple[int, ...]) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(2, vocab, (n,), generator=g)} for n in lengths]


def collate_right(batch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    longest = max(len(row["input_ids"]) for row in batch)
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(batch):
        ids[i, :len(row["input_ids"])], mask[i, :len(row["input_ids"])] = row["input_ids"], 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def test_trainer_with_gradient_accumulation_gives_the_loss_and_gradients_of_the_whole_batch(nsa_export, tmp_path):
    """Trainer passes num_items_in_batch (the forward takes loss kwargs) and skips its own division: one SGD step
    of 4 rows of different lengths at accumulation 1, 2 and 4 gives the same logged loss and the same update
    (relative 1e-5), as a Qwen3 does."""
    from transformers import Trainer, TrainingArguments

    path, model = nsa_export
    rows = rows_padded_right(model.config.vocab_size, (70, 21, 90, 35))
    losses, updates = [], []
    for accumulation in (1, 2, 4):
        theirs = load(path)
        before = {name: p.detach().clone() for name, p in theirs.named_parameters()}
        args = TrainingArguments(output_dir=str(tmp_path / f"ga{accumulation}"), use_cpu=True, report_to="none",
                                 per_device_train_batch_size=4 // accumulation, max_steps=1, optim="sgd",
                                 gradient_accumulation_steps=accumulation, learning_rate=1.0, weight_decay=0.0,
                                 lr_scheduler_type="constant", max_grad_norm=0.0, save_strategy="no",
                                 remove_unused_columns=False, dataloader_drop_last=False)
        args.train_sampling_strategy = "sequential"  # the same four rows in every run
        result = Trainer(model=theirs, args=args, train_dataset=rows, data_collator=collate_right).train()
        losses.append(result.training_loss)
        updates.append(torch.cat([(p.detach() - before[name]).flatten() for name, p in theirs.named_parameters()]))
    for loss, update in zip(losses[1:], updates[1:], strict=True):
        assert loss == pytest.approx(losses[0], rel=1e-5)
        torch.testing.assert_close(update, updates[0], rtol=0, atol=1e-5 * updates[0].abs().max().item())


def test_a_manual_decoding_loop_equals_one_forward(nsa_export):
    """forward(use_cache=True) returns its cache, and a loop feeding it one token at a time gives one forward's
    logits (relative 1e-5); an empty DynamicCache (also under its old name past_key_values) becomes the model's own;
    a cropped cache continues exactly; a cache holding another model's tokens is refused."""
    from transformers import DynamicCache

    path, model = nsa_export
    theirs = load(path).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 90))
    with torch.no_grad():
        whole = theirs(ids).logits
        scale = whole.abs().max().item()
        for first in ({"use_cache": True}, {"cache": DynamicCache()}, {"past_key_values": DynamicCache()}):
            out = theirs(ids[:, :50], **first)
            steps = [out.logits]
            for i in range(50, 90):
                out = theirs(ids[:, i:i + 1], cache=out.cache)
                steps.append(out.logits)
            torch.testing.assert_close(torch.cat(steps, 1), whole, rtol=0, atol=1e-5 * scale)
        out = theirs(ids[:, :70], use_cache=True)  # 70 read, the last 7 forgotten: what speculative decoding does
        out.cache.crop(-7)
        torch.testing.assert_close(theirs(ids[:, 63:90], cache=out.cache).logits, whole[:, 63:90], rtol=0,
                                   atol=1e-5 * scale)
        filled = DynamicCache()
        filled.update(torch.zeros(2, 2, 3, 16), torch.zeros(2, 2, 3, 16), 0)
        with pytest.raises(ValueError, match="a DynamicCache holding 3 tokens cannot continue here"):
            theirs(ids[:, :5], cache=filled)


def test_assisted_generation_and_prompt_lookup_equal_greedy(nsa_export, qwen3_export):
    """Assisted generation (another copy as the assistant; the export as a Qwen3's assistant) and prompt lookup
    give greedy's tokens; generate(inputs_embeds=...) gives what generate(input_ids) generates after the prompt."""
    path, model = nsa_export
    theirs, helper = load(path).eval(), load(path).eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, 40))
    greedy = theirs.generate(prompt, max_new_tokens=12, do_sample=False)
    assert theirs.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=helper).tolist() == \
        greedy.tolist()
    assert theirs.generate(prompt, max_new_tokens=12, do_sample=False, prompt_lookup_num_tokens=3).tolist() == \
        greedy.tolist()
    embeds = theirs.get_input_embeddings()(prompt)
    assert theirs.generate(inputs_embeds=embeds, max_new_tokens=12, do_sample=False).tolist() == \
        greedy[:, 40:].tolist()
    qwen3 = transformers.AutoModelForCausalLM.from_pretrained(qwen3_export).eval()
    assert qwen3.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=helper).tolist() == \
        qwen3.generate(prompt, max_new_tokens=12, do_sample=False).tolist()


def test_position_ids_that_restart_read_each_packed_sequence_alone(nsa_export):
    """DataCollatorWithFlattening packs rows into one by restarting position_ids: each sequence's logits are what
    it gives alone (relative 1e-5), as a Qwen3 gives them under flash-attention (its sdpa and eager paths, the only
    ones on a CPU, read across them); positions that neither count on nor restart are refused in one line."""
    from transformers import DataCollatorWithFlattening

    path, model = nsa_export
    theirs = load(path).eval()
    rows = rows_padded_right(model.config.vocab_size, (70, 21, 35))
    packed = DataCollatorWithFlattening(return_position_ids=True)([{"input_ids": r["input_ids"].tolist()}
                                                                   for r in rows])
    with torch.no_grad():
        logits = theirs(packed["input_ids"], position_ids=packed["position_ids"]).logits[0]
        for row, start in zip(rows, (0, 70, 91), strict=True):
            alone = theirs(row["input_ids"][None]).logits[0]
            torch.testing.assert_close(logits[start:start + len(row["input_ids"])], alone, rtol=0,
                                       atol=1e-5 * alone.abs().max().item())
        with pytest.raises(ValueError, match="position_ids must count up by one"):
            theirs(packed["input_ids"], position_ids=packed["position_ids"] + 5)


def test_the_base_model_the_classifier_and_the_standard_config_fields(nsa_export, qwen3_export, tmp_path):
    """AutoModel gives the final hidden states; AutoModelForSequenceClassification scores each row's last real
    token (a new head, the rest the export's weights); config.json carries the fields tools read, as a Qwen3's;
    output_attentions gives (); a bf16 model returns bf16 logits, as Qwen3 does."""
    path, model = nsa_export
    ids = torch.randint(0, model.config.vocab_size, (2, 30))
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0
    with torch.no_grad():
        base = transformers.AutoModel.from_pretrained(path, trust_remote_code=True).eval()
        torch.testing.assert_close(base(ids).last_hidden_state, model.hidden_states(ids), rtol=0, atol=0)
        classifier = transformers.AutoModelForSequenceClassification.from_pretrained(
            path, trust_remote_code=True, num_labels=3).eval()
        scores = classifier(ids, attention_mask=mask).logits
        hidden = model.hidden_states(ids)
        expected = classifier.score(torch.stack([hidden[0, 29], hidden[1, 19]]))
        torch.testing.assert_close(scores, expected, rtol=0, atol=1e-6)
        assert classifier(ids, attention_mask=mask, labels=torch.tensor([0, 2])).loss.isfinite()
    ours, qwen3 = (json.loads((p / "config.json").read_text()) for p in (path, qwen3_export))
    standard = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_parameters",
                "max_position_embeddings", "tie_word_embeddings")
    assert {k: ours[k] for k in standard} == {k: qwen3[k] for k in standard} and ours["use_cache"] is True
    theirs = load(path).eval()
    assert theirs(ids, output_attentions=True).attentions == ()  # with a warning (transformers' logger)
    half = transformers.AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.bfloat16)
    assert half(ids).logits.dtype == torch.bfloat16


def test_generate_s_other_modes_and_position_layouts_read_as_transformers_writes_them(nsa_export):
    """Prefill in chunks, input_ids beside inputs_embeds, position_ids of one row for a batch, and the positions
    transformers computes for a left-padded batch in a decoding loop all give what the plain call gives; a cache
    whose buffers a newer one took is refused instead of read."""
    path, model = nsa_export
    theirs = load(path).eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, 30))
    greedy = theirs.generate(prompt, max_new_tokens=6, do_sample=False)
    assert theirs.generate(prompt, max_new_tokens=6, do_sample=False, prefill_chunk_size=8).tolist() == \
        greedy.tolist()
    embeds = theirs.get_input_embeddings()(prompt)
    assert theirs.generate(prompt, inputs_embeds=embeds, max_new_tokens=6, do_sample=False).tolist() == \
        greedy.tolist()
    ids = torch.randint(0, model.config.vocab_size, (2, 40))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # row 1 padded on the left
    positions = (mask.cumsum(1) - 1).masked_fill(mask == 0, 1)  # as transformers computes them
    with torch.no_grad():
        plain = theirs(ids).logits
        torch.testing.assert_close(theirs(ids, position_ids=torch.arange(40)[None]).logits, plain, rtol=0, atol=0)
        whole = theirs(ids, attention_mask=mask).logits
        out = theirs(ids[:, :30], attention_mask=mask[:, :30], position_ids=positions[:, :30], use_cache=True)
        steps = [out.logits]
        for i in range(30, 40):
            out = theirs(ids[:, i:i + 1], attention_mask=mask[:, :i + 1], position_ids=positions[:, i:i + 1],
                         cache=out.cache)
            steps.append(out.logits)
        torch.testing.assert_close(torch.cat(steps, 1)[:, 3:], whole[:, 3:], rtol=0,
                                   atol=1e-5 * whole.abs().max().item())
        first = theirs(ids[:, :10], use_cache=True).cache
        theirs(ids[:, :10], use_cache=True)  # a newer cache takes the model's buffers
        with pytest.raises(ValueError, match="this cache's buffers were taken by a newer one"):
            theirs(ids[:, 10:11], cache=first)


@pytest.mark.slow
def test_torch_compile_breaks_the_graph_only_at_nsa_s_kernels(nsa_export):
    """Under torch.compile the export's forward breaks its graph only at NSA's sparse attention (its kernels are
    opaque to the compiler; once a layer and query chunk), nowhere in the wrapper or the model around it."""
    path, model = nsa_export
    theirs = load(path).eval()
    with torch.no_grad():
        explained = torch._dynamo.explain(theirs)(torch.randint(0, model.config.vocab_size, (1, 64)))
    reasons = [str(r.reason) for r in explained.break_reasons]
    assert explained.graph_break_count >= model.config.n_layers, reasons
    assert all("sparse_attention" in reason for reason in reasons), reasons
