"""A run's tokenizer and data: the tokenizer chosen (the one stored with the weights the run continues, --tokenizer,
or the data's) and checked before any data is prepared, the default corpus prepared when it is missing, and this
rank's loader (with the synthetic mix).
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import torch.distributed as dist

from config import ModelConfig
from corpus import iter_documents, stdlib_files
from data import INDEX_NAME, TokenLoader, check_tokenizer, prepare
from parallel import Runtime
from synthetic import SyntheticMix
from tokenizer import HFTokenizer, Tokenizer, check_vocab, load_tokenizer, tokenizer_file
from train_config import DEFAULT_DATA_DIR, TOKENIZER_VOCAB, TrainConfig


def prepare_data(cfg: TrainConfig, rt: Runtime, resume_from: Path | None, stored: ModelConfig | None
                 ) -> tuple[TrainConfig, Tokenizer | HFTokenizer, TokenLoader | SyntheticMix]:
    """(cfg with its tokenizer file named, the tokenizer, this rank's loader): the tokenizer chosen and checked
    (`resolve_tokenizer`), the default corpus prepared when it is missing, the tokenizer checked against the
    data's, the sample checked against the context, the synthetic mix."""
    cfg = resolve_tokenizer(cfg, resume_from, stored)
    ensure_default_data(cfg, rt)
    loader = TokenLoader(cfg.data_dir, cfg.context_length, cfg.batch_size, rt.rank, rt.world_size, cfg.seed)
    tokenizer = load_tokenizer(tokenizer_path(cfg))
    check_tokenizer(loader.index, tokenizer)
    cfg = dataclasses.replace(cfg, tokenizer=str(tokenizer.path))  # config.json names the tokenizer used
    prompt = len(tokenizer.encode(cfg.sample_prompt))
    if cfg.sample_tokens and prompt + cfg.sample_tokens > cfg.context_length:
        raise ValueError(f"--sample_tokens {cfg.sample_tokens} after the --sample_prompt's {prompt} tokens exceed "
                         f"--context_length {cfg.context_length}")
    if cfg.synthetic_mix:
        loader = SyntheticMix(loader, tokenizer, cfg.synthetic_mix, cfg.seed, cfg.synthetic_task, cfg.answer_loss)
    return cfg, tokenizer, loader


def tokenizer_path(cfg: TrainConfig) -> Path:
    """--tokenizer; else DATA_DIR/tokenizer.model, or the tokenizer the data was prepared with (its index.json)."""
    if cfg.tokenizer:
        return Path(cfg.tokenizer)
    beside, index = Path(cfg.data_dir) / "tokenizer.model", Path(cfg.data_dir) / INDEX_NAME
    if not beside.is_file() and index.is_file():
        recorded = json.loads(index.read_text()).get("tokenizer", {}).get("path")
        if recorded and Path(recorded).is_file():
            return Path(recorded)
    return beside


def recorded_tokenizer(cfg: TrainConfig, resume_from: Path | None) -> Tokenizer | HFTokenizer | None:
    """The tokenizer stored with the weights this run continues: the checkpoint it resumes, else --init_from (its
    directory, or that of its .safetensors file); None for a fresh run or an older checkpoint without one. A
    --init_from that holds none needs --tokenizer: a run never falls back to another tokenizer silently."""
    if resume_from is not None and tokenizer_file(resume_from):
        return load_tokenizer(resume_from)
    if cfg.init_from:
        home = Path(cfg.init_from) if Path(cfg.init_from).is_dir() else Path(cfg.init_from).parent
        if tokenizer_file(home):
            return load_tokenizer(home)
        if not cfg.tokenizer:
            raise ValueError(f"--init_from {cfg.init_from} holds no tokenizer: pass --tokenizer FILE, the tokenizer "
                             "its weights were trained with")
    return None


def resolve_tokenizer(cfg: TrainConfig, resume_from: Path | None, stored: ModelConfig | None) -> TrainConfig:
    """cfg with the run's tokenizer: --tokenizer, which must agree with the recorded one (`recorded_tokenizer`:
    vocabulary size and end-of-document id); else the recorded one; else DATA_DIR's. Checked against the stored
    model's vocabulary before any data is prepared. A tokenizer other than the default corpus's gets a default data
    directory of its own (DEFAULT_DATA_DIR-<sha256[:12]>)."""
    recorded = recorded_tokenizer(cfg, resume_from)
    tokenizer = load_tokenizer(cfg.tokenizer) if cfg.tokenizer else recorded
    if cfg.tokenizer and recorded and (tokenizer.vocab_size, tokenizer.eod_id) != (recorded.vocab_size,
                                                                                   recorded.eod_id):
        raise ValueError(f"--tokenizer {cfg.tokenizer} ({tokenizer.vocab_size} tokens, end of document "
                         f"{tokenizer.eod_id}) is not {recorded.path} ({recorded.vocab_size} tokens, end of document "
                         f"{recorded.eod_id}), the tokenizer the weights were trained with: leave --tokenizer out")
    if stored is not None and tokenizer is not None:
        check_vocab(tokenizer, stored.vocab_size)
    default = Path(DEFAULT_DATA_DIR) / "tokenizer.model"
    if tokenizer is None or default.is_file() and load_tokenizer(default).sha256 == tokenizer.sha256:
        return cfg
    cfg = dataclasses.replace(cfg, tokenizer=str(tokenizer.path))
    if cfg.data_dir == DEFAULT_DATA_DIR:
        cfg = dataclasses.replace(cfg, data_dir=f"{DEFAULT_DATA_DIR}-{tokenizer.sha256[:12]}")
    return cfg


def ensure_default_data(cfg: TrainConfig, rt: Runtime) -> None:
    """Make `python train.py` work out of the box: if the default data directory (DEFAULT_DATA_DIR, or its
    per-tokenizer variant) is selected and empty, tokenize this interpreter's standard library into it (~20 s), with
    the tokenizer given or one trained for it. Rank 0 works while the others wait."""
    data_dir = Path(cfg.data_dir)
    if rt.rank == 0 and cfg.data_dir.startswith(DEFAULT_DATA_DIR) and not (data_dir / INDEX_NAME).exists():
        files = stdlib_files()
        tok_file = tokenizer_path(cfg)
        if tok_file.exists():
            tokenizer = load_tokenizer(tok_file)
        else:  # the tokenizer trains on a sample of lines: shuffle the sorted files so it sees all packages
            shuffled = random.Random(0).sample(files, len(files))
            tokenizer = Tokenizer.train(iter_documents(shuffled), TOKENIZER_VOCAB, tok_file.with_suffix(""))
        prepare(files, tokenizer, data_dir)
    if dist.is_initialized():
        dist.barrier()
