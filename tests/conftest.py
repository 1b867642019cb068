import json
import os
from pathlib import Path

import pytest
import torch

# The Triton kernels (nsa/triton_path.py) run in Triton's interpreter in this process, on any machine and whatever the
# environment says (read when the module is imported); on a GPU, test_triton_kernels_on_gpu runs them for real in a
# subprocess.
os.environ["TRITON_INTERPRET"] = "1"


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (pyproject's `-n auto`) each worker takes its share of the CPUs for its intra-op threads,
    so that the workers together use each core once instead of oversubscribing them."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        from training.monitor import process_cpus

        torch.set_num_threads(max(1, len(process_cpus()) // workers))


@pytest.fixture(autouse=True)
def _cpu_unless_about_the_gpu(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test runs on the CPU, whatever the machine has, unless it is marked `gpu`: CUDA is reported absent in this
    process, and hidden from the processes it starts (torchrun, scripts, gloo ranks). The suite then checks the same
    numbers on a GPU machine as on a laptop; the GPU tests check the GPU."""
    if "gpu" not in request.keywords:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


@pytest.fixture(autouse=True)
def _seed_and_restore_dtype():
    """Every test starts from the same RNG state and leaves the global default dtype untouched."""
    torch.manual_seed(0)
    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 512-token tokenizer (the tiny preset's vocabulary) and ~30 standard-library files of tokens."""
    from text.corpus import iter_documents, stdlib_files
    from text.shards import prepare
    from text.tokenizer import Tokenizer

    root = tmp_path_factory.mktemp("data")
    files = stdlib_files()[:30]
    tokenizer = Tokenizer.train(iter_documents(files), 512, root / "tokenizer", max_train_bytes=300_000)
    prepare(files, tokenizer, root, progress=False)
    return root


@pytest.fixture(scope="session")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a Hugging Face Qwen3 directory: a random tiny model saved by transformers and a byte-level BPE
    tokenizer.json of 400 tokens, <|endoftext|> its end of document; data tokenized with that tokenizer)."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from text.corpus import stdlib_files
    from text.shards import prepare
    from text.tokenizer import HFTokenizer, check_vocab

    root = tmp_path_factory.mktemp("qwen3")
    model_dir, data_dir = root / "qwen3", root / "data"
    files = stdlib_files()[:40]
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    bpe.train([str(f) for f in files], trainer)
    config = transformers.Qwen3Config(vocab_size=448, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=256, tie_word_embeddings=True, rope_theta=1e6)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).save_pretrained(model_dir)
    bpe.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    tokenizer = HFTokenizer(model_dir / "tokenizer.json")
    assert tokenizer.eod_id == 0 and tokenizer.vocab_size == 400
    check_vocab(tokenizer, config.vocab_size)
    prepare(files, tokenizer, data_dir, progress=False)
    return model_dir, data_dir


@pytest.fixture
def swa():
    """The test-only sliding-window attention registered as "swa" for one test (removed after)."""
    from modeling.config import ATTENTION_TYPES, attention_class, register_attention

    register_attention("swa", "examples.sliding_window_attention:SlidingWindowAttention")
    yield attention_class("swa")
    del ATTENTION_TYPES["swa"]


@pytest.fixture
def norms():
    """The test-only fine-tuning mode registered as "norms" for one test (removed after)."""
    from training.options import FINETUNE_MODES, finetune_class, register_finetune

    register_finetune("norms", "examples.norm_finetune:NormsOnly")
    yield finetune_class("norms")
    del FINETUNE_MODES["norms"]
