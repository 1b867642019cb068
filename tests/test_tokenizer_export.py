"""Every output holds the tokenizer it was trained with, and Hugging Face tools read it right.

- The project's SentencePiece tokenizer saved for transformers (`Tokenizer.save`: tokenizer.json beside the .model)
  encodes a corpus sample and decodes its ids exactly as ours, special tokens included; a released model's
  tokenizer.json is copied with its companions and reads as the original.
- step-N/, model/ and hf/ of a run hold the tokenizer; model/config.json and train_state.json name it.
- --init_from and --resume take the recorded tokenizer; a --tokenizer that does not match it, or a --init_from
  without one, is a one-line error before any data is prepared.
- The Hugging Face export keeps the base's special ids, generation_config.json, max_position_embeddings and
  rope settings, and the training dtype (or --export_dtype); `pipeline("text-generation")` on it stops at eos.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import train
from model import Transformer
from modeling.config import ModelConfig
from storage.hf import ExportInfo, export_hf_checkpoint
from text.corpus import iter_documents, stdlib_files
from text.tokenizer import HFTokenizer, Tokenizer, load_tokenizer, tokenizer_file

transformers = pytest.importorskip("transformers")

EDGES = ["a </s> b <s> <pad> <unk> c", "tabs\t and  spaces \n\n  x\n", "héllo 世界 😀 \x00 \r\n", "12345 3.14", ""]


def corpus_sample() -> list[str]:
    return list(iter_documents(stdlib_files()[40:80])) + EDGES


def tiny_run(data_dir: Path, out_dir: Path, *extra: str) -> dict:
    return train.main(["--model_size", "tiny", "--data_dir", str(data_dir), "--out_dir", str(out_dir),
                       "--context_length", "32", "--batch_size", "2", "--max_steps", "2", "--sample_tokens", "0",
                       *extra])


@pytest.mark.slow
def test_the_project_tokenizer_reads_the_same_in_transformers(data_dir: Path, tmp_path: Path):
    ours = Tokenizer(data_dir / "tokenizer.model")
    ours.save(tmp_path, 256)
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in corpus_sample():
        ids = ours.encode(text)
        assert auto(text)["input_ids"] == ids, text[:80]
        assert auto.decode(ids, skip_special_tokens=True) == ours.decode(ids) == text
    assert (auto.eos_token_id, auto.pad_token_id, auto.unk_token_id, auto.bos_token) == (2, 3, 0, None)
    assert auto.decode([5, ours.eos_id], skip_special_tokens=True) == ours.decode([5, ours.eos_id])
    assert load_tokenizer(tmp_path).sha256 == ours.sha256  # the directory's .model is the tokenizer itself


def test_a_hugging_face_tokenizer_is_copied_whole(qwen3: tuple[Path, Path], tmp_path: Path):
    model_dir, _ = qwen3
    ours = HFTokenizer(model_dir / "tokenizer.json")
    ours.save(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (model_dir / name).read_bytes()
    copy = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in corpus_sample():
        assert copy(text)["input_ids"] == ours.encode(text)
    assert copy.eos_token_id == ours.eod_id


def test_every_output_holds_its_tokenizer(data_dir: Path, tmp_path: Path):
    tiny_run(data_dir, tmp_path / "run", "--checkpoint_interval", "1", "--keep_checkpoints", "5")
    ours = Tokenizer(data_dir / "tokenizer.model")
    for name in ("step-1", "step-2", "model", "hf"):
        assert load_tokenizer(tmp_path / "run" / name).sha256 == ours.sha256, name
        manifest = json.loads((tmp_path / "run" / name / "manifest.json").read_text())["files"]
        assert {"tokenizer.model", "tokenizer.json", "tokenizer_config.json"} <= set(manifest), name
    record = json.loads((tmp_path / "run" / "model" / "config.json").read_text())["tokenizer"]
    assert record == ours.record() == json.loads((tmp_path / "run" / "step-2" / "train_state.json").read_text())[
        "tokenizer"]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["train"]["tokenizer"] == str(ours.path)
    hf = tmp_path / "run" / "hf"
    auto = transformers.AutoTokenizer.from_pretrained(hf)
    assert auto("def f(x):\n    return 1")["input_ids"] == ours.encode("def f(x):\n    return 1")
    config, generation = (json.loads((hf / name).read_text()) for name in ("config.json", "generation_config.json"))
    assert config["eos_token_id"] == config["bos_token_id"] == generation["eos_token_id"] == ours.eod_id
    assert config["pad_token_id"] == ours.pad_id


def test_init_from_takes_the_recorded_tokenizer_and_refuses_another(qwen3: tuple[Path, Path], data_dir: Path,
                                                                     tmp_path: Path):
    model_dir, qwen_data = qwen3
    common = ["--data_dir", str(qwen_data), "--context_length", "32", "--batch_size", "2", "--max_steps", "1",
              "--sample_tokens", "0", "--dtype", "float32"]
    train.main(["--init_from", str(model_dir), "--out_dir", str(tmp_path / "first"), *common])
    export = tmp_path / "first" / "model"
    original, exported = (transformers.AutoTokenizer.from_pretrained(d) for d in (model_dir, tmp_path / "first" / "hf"))
    for text in corpus_sample()[:10]:  # both directories have a Qwen3 config.json: transformers reads them alike
        assert exported(text)["input_ids"] == original(text)["input_ids"]
    train.main(["--init_from", str(export), "--out_dir", str(tmp_path / "second"), *common])
    recorded = json.loads((tmp_path / "second" / "config.json").read_text())["train"]["tokenizer"]
    assert load_tokenizer(recorded).sha256 == HFTokenizer(export / "tokenizer.json").sha256  # not the default one

    missing = tmp_path / "not-prepared"  # the tokenizer is refused before data is looked for
    with pytest.raises(ValueError, match=r"is not .*tokenizer.json \(400 tokens.*the weights were trained with"):
        train.main(["--init_from", str(export), "--tokenizer", str(data_dir / "tokenizer.model"),
                    "--out_dir", str(tmp_path / "third"), *common[2:], "--data_dir", str(missing)])
    bare = tmp_path / "bare"
    shutil.copytree(model_dir, bare, ignore=shutil.ignore_patterns("tokenizer*"))
    with pytest.raises(ValueError, match="holds no tokenizer: pass --tokenizer"):
        train.main(["--init_from", str(bare), "--out_dir", str(tmp_path / "fourth"), *common])
    assert not missing.exists()


def test_resume_refuses_another_tokenizer_of_the_same_size(data_dir: Path, tmp_path: Path):
    tiny_run(data_dir, tmp_path / "run", "--max_steps", "1")
    other = Tokenizer.train(iter_documents(stdlib_files()[200:230]), 512, tmp_path / "other")  # 512 ids, others'
    with pytest.raises(ValueError, match="the tokenizer the weights were trained with"):
        tiny_run(data_dir, tmp_path / "run", "--resume", "--tokenizer", str(other.path))
    (tmp_path / "copy").mkdir()
    Tokenizer(data_dir / "tokenizer.model").save(tmp_path / "copy")
    equivalent = tmp_path / "copy" / "tokenizer.json"  # the same vocabulary in the other format: accepted
    with pytest.raises(ValueError, match="data was tokenized with"):  # ... and then refused by the data's check
        tiny_run(data_dir, tmp_path / "run", "--resume", "--tokenizer", str(equivalent))
    assert tiny_run(data_dir, tmp_path / "run", "--resume")["step"] == 2  # the recorded one: the same as DATA_DIR's


def test_a_released_models_own_sentencepiece_file_is_not_taken_for_the_projects(qwen3: tuple[Path, Path],
                                                                                 tmp_path: Path):
    import sentencepiece as spm

    text = "\n".join(iter_documents(stdlib_files()[:20]))
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text.splitlines()), model_prefix=str(tmp_path / "llama"),
                                   vocab_size=300, minloglevel=2)  # SentencePiece's defaults: no pad, dummy prefix
    released = tmp_path / "released"
    released.mkdir()
    shutil.copyfile(tmp_path / "llama.model", released / "tokenizer.model")
    assert tokenizer_file(released) == released / "tokenizer.model"  # alone, it is the tokenizer
    Tokenizer(released / "tokenizer.model").save(tmp_path)  # no pad token: saved without one
    shutil.copyfile(qwen3[0] / "tokenizer.json", released / "tokenizer.json")
    assert tokenizer_file(released) == released / "tokenizer.json"  # the released tokenizer.json wins


def with_metadata(model_dir: Path, out: Path) -> Path:
    """A copy of the qwen3 fixture with the special ids and generation settings of a released model."""
    shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text()) | {"bos_token_id": 0, "eos_token_id": 0}
    (out / "config.json").write_text(json.dumps(config))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [0], "temperature": 0.7, "top_p": 0.8}))
    return out


def test_the_export_keeps_the_base_metadata(qwen3: tuple[Path, Path], tmp_path: Path):
    model_dir, qwen_data = qwen3
    base = with_metadata(model_dir, tmp_path / "base")
    common = ["--init_from", str(base), "--data_dir", str(qwen_data), "--context_length", "32", "--batch_size", "2",
              "--max_steps", "1", "--sample_tokens", "0"]
    train.main([*common, "--dtype", "bfloat16", "--out_dir", str(tmp_path / "bf16")])
    train.main([*common, "--dtype", "bfloat16", "--export_dtype", "float32", "--out_dir", str(tmp_path / "fp32")])
    source = json.loads((base / "config.json").read_text())
    for name, dtype in (("bf16", "BF16"), ("fp32", "F32")):
        hf = tmp_path / name / "hf"
        config = json.loads((hf / "config.json").read_text())
        for key in ("bos_token_id", "eos_token_id", "max_position_embeddings", "rope_parameters", "vocab_size"):
            assert config[key] == source[key], key
        assert config["max_position_embeddings"] == 256  # the base's, not the 32 tokens trained
        generation = json.loads((hf / "generation_config.json").read_text())
        assert generation == {"eos_token_id": [0], "temperature": 0.7, "top_p": 0.8, "bos_token_id": 0}  # + bos
        with safe_open(hf / "model.safetensors", framework="pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {dtype}  # noqa: SIM118
        assert transformers.AutoModelForCausalLM.from_pretrained(hf).config.eos_token_id == 0


def test_an_extended_context_is_declared(data_dir: Path, tmp_path: Path):
    tiny_run(data_dir, tmp_path / "short")
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    tiny_run(data_dir, tmp_path / "long", "--init_from", str(tmp_path / "short" / "model"), "--context_length", "128",
             "--rope_scaling", json.dumps(yarn), "--max_steps", "1")
    config = json.loads((tmp_path / "long" / "hf" / "config.json").read_text())
    assert config["max_position_embeddings"] == 128 and config["rope_scaling"] == yarn


def test_pipeline_generates_and_stops_at_eos(data_dir: Path, tmp_path: Path):
    """A model whose every next token is eos (each embedding the same vector, the blocks' outputs zero, the output
    row of eos along the normalised hidden state): the pipeline's greedy generation stops after one token."""
    ours = Tokenizer(data_dir / "tokenizer.model")
    model = Transformer(ModelConfig.from_preset("tiny", tie_embeddings=False))
    with torch.no_grad():
        model.embed_tokens.weight.copy_(torch.ones_like(model.embed_tokens.weight))
        for block in model.layers:
            block.attn.o_proj.weight.zero_()
            block.mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
        model.lm_head.weight[ours.eos_id] = 1.0
    export_hf_checkpoint(model, tmp_path / "hf", info=ExportInfo(ours))
    generate = transformers.pipeline("text-generation", model=str(tmp_path / "hf"))
    out = generate("def f(x):", max_new_tokens=20, do_sample=False, return_tensors=True)[0]["generated_token_ids"]
    prompt = ours.encode("def f(x):")
    assert out[:len(prompt)] == prompt and out[len(prompt):] == [ours.eos_id]


def test_the_nsa_export_s_tokenizer_loads_without_its_code(data_dir: Path, tmp_path: Path):
    """An NSA export's config.json names code (auto_map), which AutoTokenizer would ask to run: with
    trust_remote_code=False, or as PreTrainedTokenizerFast (which reads no config), it loads, and encodes as ours."""
    tiny_run(data_dir, tmp_path / "run", "--attention_type", "nsa")
    ours, hf, text = Tokenizer(data_dir / "tokenizer.model"), tmp_path / "run" / "hf", "def f(x):\n    return 1"
    for loaded in (transformers.AutoTokenizer.from_pretrained(hf, trust_remote_code=False),
                   transformers.PreTrainedTokenizerFast.from_pretrained(hf)):
        assert loaded(text)["input_ids"] == ours.encode(text)
