"""A run's tokenizer and data: the tokenizer chosen (the one stored with the weights the run continues, --tokenizer,
or the data's) and checked before any data is prepared, the default corpus prepared when it is missing, and this
rank's loader (with the synthetic mix).
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import random
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from text.corpus import iter_documents, stdlib_files
from text.shards import INDEX_NAME, TokenLoader, check_tokenizer, prepare
from text.synthetic import SyntheticMix
from text.tokenizer import (
    SPM_FILE,
    HFTokenizer,
    Tokenizer,
    check_vocab,
    load_tokenizer,
    same_vocabulary,
    tokenizer_file,
)
from training.options import DEFAULT_DATA_DIR, TOKENIZER_VOCAB, TrainConfig
from training.parallel import Runtime

if TYPE_CHECKING:
    from storage.weights import Stored


def prepare_data(cfg: TrainConfig, rt: Runtime, resume_from: Path | None, source: Stored | None
                 ) -> tuple[TrainConfig, Tokenizer | HFTokenizer, TokenLoader | SyntheticMix]:
    """(cfg with its tokenizer file and data directory named, absolute, the tokenizer, this rank's loader): the
    tokenizer chosen and checked (`resolve_tokenizer`; `source`: what --init_from holds), the default corpus
    prepared when it is missing, the tokenizer checked against the data's, the sample checked against the context,
    the synthetic mix."""
    cfg = resolve_tokenizer(cfg, resume_from, source)
    data_dir = Path(cfg.data_dir)
    if data_dir.exists() and not data_dir.is_dir():
        raise ValueError(f"--data_dir {data_dir} is a file; pass a directory of prepared data (python data.py "
                         "prepare --out_dir DIR)")
    ensure_default_data(cfg, rt)
    if cfg.sample_prompt is None:
        cfg = dataclasses.replace(cfg, sample_prompt=DEFAULT_PROMPT if default_corpus(cfg.data_dir) else "")
    loader = TokenLoader(cfg.data_dir, cfg.context_length, cfg.batch_size, rt.data_rank, rt.data_ranks, cfg.seed)
    passes = cfg.max_steps * cfg.gradient_accumulation_steps / loader.steps_per_epoch
    if passes > 1 and rt.rank == 0:
        print(f"data: {loader.num_windows} windows of {cfg.context_length} tokens, {loader.steps_per_epoch} "
              f"batches a pass: --max_steps {cfg.max_steps} reads it {passes:.1f} times (each pass in a new order)")
    if not tokenizer_path(cfg).is_file():  # the data's ids are its tokenizer's: a new one would not fit them
        raise FileNotFoundError(f"the tokenizer of {cfg.data_dir}, {tokenizer_path(cfg)}, is missing, and the data's "
                                "ids are that tokenizer's (a new one would not fit them): copy it back there, or pass "
                                "--tokenizer FILE holding the same tokenizer (its checksum is checked)")
    tokenizer = load_tokenizer(tokenizer_path(cfg))
    check_tokenizer(loader.index, tokenizer)
    documents = loader.index.get("num_documents", 2)  # data prepared before the count was kept: not known
    if cfg.document_mask and cfg.synthetic_mix < 1 and documents < 2:
        raise ValueError(f"--document_mask: {cfg.data_dir} holds {documents} document, so no row holds the end of one "
                         "and the start of another and the mask keeps nothing apart; leave --document_mask out, or "
                         "prepare data of several documents")
    cfg = dataclasses.replace(cfg, tokenizer=str(Path(tokenizer.path).resolve()))  # config.json names it
    prompt = len(tokenizer.encode(cfg.sample_prompt))
    if cfg.sample_tokens is None and prompt >= cfg.context_length:  # the default sample: the context after it
        raise ValueError(f"--sample_prompt is {prompt} tokens, as long as --context_length {cfg.context_length} "
                         "allows or longer: shorten it, or pass --sample_tokens 0 (no sample)")
    if cfg.sample_tokens and prompt + cfg.sample_tokens > cfg.context_length:
        raise ValueError(f"--sample_tokens {cfg.sample_tokens} after the --sample_prompt's {prompt} tokens exceed "
                         f"--context_length {cfg.context_length}")
    if cfg.synthetic_mix:
        loader = SyntheticMix(loader, tokenizer, cfg.synthetic_mix, cfg.seed, cfg.synthetic_task, cfg.answer_loss,
                              cfg.synthetic_pairs)
    return cfg, tokenizer, loader


DEFAULT_PROMPT = "def "  # the default corpus is Python source


def data_tokenizer(data_dir: str | Path) -> Path:
    """The tokenizer of prepared data: the one DATA_DIR holds (tokenizer_file), else the one its index.json names;
    DATA_DIR/tokenizer.model when there is neither (where the default corpus's tokenizer is trained)."""
    data_dir = Path(data_dir)
    if found := tokenizer_file(data_dir):
        return found
    if (data_dir / INDEX_NAME).is_file():
        recorded = json.loads((data_dir / INDEX_NAME).read_text()).get("tokenizer", {}).get("path")
        if recorded and Path(recorded).is_file():
            return Path(recorded)
    return data_dir / SPM_FILE


def tokenizer_path(cfg: TrainConfig) -> Path:
    """--tokenizer (as resolve_tokenizer set it), else the data's (`data_tokenizer`)."""
    return Path(cfg.tokenizer) if cfg.tokenizer else data_tokenizer(cfg.data_dir)


def recorded_tokenizer(cfg: TrainConfig, resume_from: Path | None, source: Stored | None
                       ) -> Tokenizer | HFTokenizer | None:
    """The tokenizer stored with the weights this run continues: the checkpoint it resumes, else --init_from's
    (`source`); None for a fresh run, or a resume of a checkpoint written before checkpoints held one. A fresh run
    from a --init_from that holds none needs --tokenizer: a run never falls back to another tokenizer silently."""
    if resume_from is not None and tokenizer_file(resume_from):
        return load_tokenizer(resume_from)
    if source is not None:
        if (stored := tokenizer_file(source.home)) is not None:
            return load_tokenizer(stored)
        if not cfg.tokenizer and resume_from is None:
            raise ValueError(f"--init_from {cfg.init_from} holds no tokenizer: pass --tokenizer FILE, the tokenizer "
                             "its weights were trained with")
    return None


def resolve_tokenizer(cfg: TrainConfig, resume_from: Path | None, source: Stored | None) -> TrainConfig:
    """cfg with the run's tokenizer named: --tokenizer, which must have the recorded one's vocabulary
    (`recorded_tokenizer`, `same_vocabulary`); else the recorded one; else the data's. Checked against the
    --init_from model's vocabulary (`source`) before any data is prepared. The data's own copy is named when it is
    the same file. The data directory is named too (absolute): --data_dir, else the default corpus's,
    DEFAULT_DATA_DIR, or for a tokenizer other than its own a directory of its own
    (DEFAULT_DATA_DIR-<sha256[:12]>)."""
    recorded = recorded_tokenizer(cfg, resume_from, source)
    tokenizer = load_tokenizer(cfg.tokenizer) if cfg.tokenizer else recorded
    if cfg.tokenizer and recorded and not same_vocabulary(tokenizer, recorded):
        raise ValueError(f"--tokenizer {cfg.tokenizer} ({tokenizer.vocab_size} tokens, end of document "
                         f"{tokenizer.eod_id}) is not {recorded.path} ({recorded.vocab_size} tokens, end of document "
                         f"{recorded.eod_id}), the tokenizer the weights were trained with: leave --tokenizer out")
    if source is not None and tokenizer is not None:
        check_vocab(tokenizer, source.config.vocab_size)
    data_dir = cfg.data_dir
    if data_dir is None:
        data_dir = DEFAULT_DATA_DIR
        if tokenizer is not None and not same_file(data_tokenizer(DEFAULT_DATA_DIR), tokenizer):
            data_dir = f"{DEFAULT_DATA_DIR}-{tokenizer.sha256[:12]}"
    cfg = dataclasses.replace(cfg, data_dir=str(Path(data_dir).resolve()))
    if tokenizer is None:
        return cfg
    own = data_tokenizer(cfg.data_dir)  # the data's copy when it is the same file: a path that stays
    return dataclasses.replace(cfg, tokenizer=str((own if same_file(own, tokenizer) else tokenizer.path).resolve()))


def default_corpus(data_dir: str | Path) -> bool:
    """Whether `data_dir` is a directory of the default corpus, which train.py prepares when it is missing:
    DEFAULT_DATA_DIR, or its variant for another tokenizer (DEFAULT_DATA_DIR-<12 hex digits>), compared as
    resolved paths."""
    path, default = Path(data_dir).resolve(), Path(DEFAULT_DATA_DIR).resolve()
    return path == default or (path.parent == default.parent
                               and re.fullmatch(rf"{re.escape(default.name)}-[0-9a-f]{{12}}", path.name) is not None)


def same_file(path: Path, tokenizer: Tokenizer | HFTokenizer) -> bool:
    """Whether `path` is a tokenizer file with the same contents as `tokenizer`'s."""
    return path.is_file() and load_tokenizer(path).sha256 == tokenizer.sha256


def ensure_default_data(cfg: TrainConfig, rt: Runtime) -> None:
    """Make `python train.py` work out of the box: if the default corpus's directory (`default_corpus`) is selected
    and empty, tokenize this interpreter's standard library into it (~20 s), with the run's tokenizer (copied into
    it) or one trained for it there. Rank 0 works while the others wait, and so does a run started beside it on
    the same machine (`_preparing`)."""
    data_dir = Path(cfg.data_dir)
    if rt.rank == 0 and default_corpus(data_dir) and not (data_dir / INDEX_NAME).exists():
        with _preparing(data_dir):
            if not (data_dir / INDEX_NAME).exists():  # not prepared while this process waited
                _prepare_default(cfg, data_dir)
    if dist.is_initialized():
        dist.barrier()


@contextmanager
def _preparing(data_dir: Path) -> Iterator[None]:
    """Hold an exclusive lock (flock) on DATA_DIR's lock file, data/.<name>.lock, for the duration: runs started
    side by side (recall_experiment.py --jobs) prepare the default corpus once, the others waiting for it. The
    lock goes with the process, however it ends."""
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(data_dir.parent / f".{data_dir.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _prepare_default(cfg: TrainConfig, data_dir: Path) -> None:
    """Tokenize the standard library into `data_dir` (`ensure_default_data`)."""
    files = stdlib_files()
    tok_file = tokenizer_path(cfg)
    if not tok_file.exists():  # the tokenizer trains on a sample of lines: shuffle the files to show it all
        shuffled = random.Random(0).sample(files, len(files))
        Tokenizer.train(iter_documents(shuffled), TOKENIZER_VOCAB, tok_file.with_suffix(""))
    elif tok_file.parent.resolve() != data_dir.resolve():  # a copy goes with the data (checkpoints get pruned)
        data_dir.mkdir(parents=True, exist_ok=True)
        if tok_file.suffix == ".json":
            HFTokenizer(tok_file).save(data_dir)
        else:
            shutil.copyfile(tok_file, data_dir / SPM_FILE)
    prepare(files, load_tokenizer(data_tokenizer(data_dir)), data_dir)
