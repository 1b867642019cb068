"""Token shards: corpus -> token shards on disk (`prepare`) -> deterministic, resumable batches (`TokenLoader`).

Data directory layout (written by `prepare`, read by `TokenLoader`):
    index.json        {"format": 1, "dtype": "uint16", "vocab_size": V, "num_tokens": N,
                       "shards": [{"file": "shard_00000.bin", "num_tokens": n0, "crc32": [...]}, ...],
                       "num_documents": D, "eod_id": e, "tokenizer": {"path": ..., "vocab_size": V, "sha256": ...},
                       "replaced": {file: invalid UTF-8 sequences read as U+FFFD} (with errors="replace"),
                       "validation": {"dir": "validation", "every": k, "num_documents": Dv, "num_tokens": Nv}}
    shard_00000.bin   raw native-endian token ids (np.memmap-able); uint16 when V < 65536, else uint32; its entry
                      holds the CRC-32 of every 16 MiB (storage.manifest.file_records, as checkpoints' manifests),
                      checked whenever a TokenLoader opens the data (a mask's as "mask_crc32")
    mask_00000.bin    prompt/response data only (a shard entry's "mask"): one uint8 per token, 1 where it is a
                      target of the loss, 0 where it is only context (a prompt)
    validation/       the held-out split, a data directory of the same layout: every k-th document (documents
                      0, k, 2k, ... in corpus order; k = round(1 / validation_fraction)), never in the stream above
The shards, concatenated in index order, form one token stream: every document followed by the
end-of-document id (`Tokenizer.eod_id`). Documents may straddle shard boundaries. Data prepared before the
validation split existed (no "validation" entry) still loads; `validation_dir` then says how to make one. Data
prepared before shards carried checksums loads unchecked.

`prepare` owns only the files its index lists: it writes into a new or empty directory (a tokenizer file may be
there), and --overwrite replaces a previous prepare's listed files and nothing else.

Notation: T = sequence length (tokens the model sees), B = batch size per rank, W = world size.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from modeling.loss import IGNORE_INDEX
from storage.manifest import file_records
from text.corpus import (
    Decoder,
    Document,
    documents_with_sizes,
    find_input_files,
    has_pairs,
    stdlib_files,
)
from text.tokenizer import HF_COMPANIONS, HF_FILE, SPM_FILE, HFTokenizer, Tokenizer, chat_turn

INDEX_NAME = "index.json"
INDEX_FORMAT = 1
VALIDATION_DIR = "validation"
DEFAULT_VALIDATION_FRACTION = 0.01  # held-out documents: 1 in 100, at least one
DEFAULT_SHARD_TOKENS = 100_000_000  # 200 MB per uint16 shard
MAX_SHARD_TOKENS = 2**30  # the shard buffered while it is written: 4 GiB of uint32


# ---------------------------------------------------------------- shards on disk


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype for ids in [0, vocab_size): uint16 when vocab_size < 65536, else uint32."""
    return np.dtype(np.uint16 if vocab_size < 2**16 else np.uint32)


def _write_atomic(path: Path, data: bytes | np.ndarray) -> None:
    """Write to `path.tmp`, fsync, then rename: a reader never sees a partial file under `path`."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(data if isinstance(data, bytes) else data.tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class ShardWriter:
    """Appends token ids to `shard_XXXXX.bin` files of `shard_tokens` ids each; `finish` writes the index.

    The index is written last, so a directory whose write was interrupted has no index and is never loaded.
    """

    def __init__(self, out_dir: str | os.PathLike, vocab_size: int, shard_tokens: int = DEFAULT_SHARD_TOKENS,
                 masked: bool = False):
        if shard_tokens < 1:
            raise ValueError(f"shard_tokens must be positive, got {shard_tokens}")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.vocab_size = vocab_size
        self.dtype = token_dtype(vocab_size)
        self.shards: list[dict] = []
        self._buf = np.empty(shard_tokens, dtype=self.dtype)  # pages are only touched as they fill
        self._mask = np.empty(shard_tokens, dtype=np.uint8) if masked else None  # 1: the token is a target
        self._fill = 0

    def write(self, ids: np.ndarray, mask: np.ndarray | None = None) -> None:
        """Append `ids` (1-D integer array, values in [0, vocab_size)) to the stream; for a masked writer also
        `mask` (1-D, as long: 1 where the token is a target of the loss, 0 where it is only context; default 1)."""
        if self._mask is None and mask is not None:
            raise ValueError("a prompt/response record follows text records in a file whose first record is text: "
                             "the first record of each file decides whether the corpus gets a loss mask; give each "
                             "kind of record its own file")
        if self._mask is not None and mask is None:
            mask = np.ones(len(ids), dtype=np.uint8)
        while len(ids):
            n = min(len(ids), len(self._buf) - self._fill)
            self._buf[self._fill : self._fill + n] = ids[:n]
            if self._mask is not None:
                self._mask[self._fill : self._fill + n] = mask[:n]
                mask = mask[n:]
            self._fill += n
            ids = ids[n:]
            if self._fill == len(self._buf):
                self._flush()

    def _flush(self) -> None:
        name = f"shard_{len(self.shards):05d}.bin"
        _write_atomic(self.out_dir / name, self._buf[: self._fill])
        self.shards.append({"file": name, "num_tokens": self._fill})
        if self._mask is not None:
            self.shards[-1]["mask"] = name.replace("shard_", "mask_")
            _write_atomic(self.out_dir / self.shards[-1]["mask"], self._mask[: self._fill])
        self._fill = 0

    def finish(self, **metadata) -> dict:
        """Write the last shard and `index.json` (with `metadata` merged in); return the index."""
        if self._fill:
            self._flush()
        records = file_records([self.out_dir / name for shard in self.shards for name in _shard_files(shard)])
        for shard in self.shards:
            shard["crc32"] = records[shard["file"]]["crc32"]
            if "mask" in shard:
                shard["mask_crc32"] = records[shard["mask"]]["crc32"]
        index = {
            "format": INDEX_FORMAT,
            "dtype": self.dtype.name,
            "vocab_size": self.vocab_size,
            "num_tokens": sum(s["num_tokens"] for s in self.shards),
            "shards": self.shards,
            **metadata,
        }
        _write_atomic(self.out_dir / INDEX_NAME, json.dumps(index, indent=1).encode())
        return index


def _batches(docs: Iterator[tuple[Document, int]], max_bytes: int = 4_000_000
             ) -> Iterator[tuple[list[Document], int]]:
    """Group (document, input bytes) pairs into (non-empty documents, input bytes) batches of about `max_bytes`:
    large enough to keep SentencePiece's encoding threads busy."""
    texts: list[Document] = []
    nbytes = 0
    for text, size in docs:
        if text.text.strip() or text.prompt.strip():  # whitespace alone is no document
            texts.append(text)
        nbytes += size
        if nbytes >= max_bytes:
            yield texts, nbytes
            texts, nbytes = [], 0
    if nbytes:
        yield texts, nbytes


def prepare(
    inputs: Sequence[str | os.PathLike] | None,
    tokenizer: Tokenizer,
    out_dir: str | os.PathLike,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    text_field: str = "text",
    overwrite: bool = False,
    progress: bool = True,
    validation_fraction: float = DEFAULT_VALIDATION_FRACTION,
    errors: str = "strict",
) -> dict:
    """Tokenize a corpus into shards under `out_dir`; return the index (which includes the summary counts).

    Args:
        inputs: files/directories (see `find_input_files`); None = `stdlib_files()`.
        tokenizer: every document is `tokenizer.encode(text) + [tokenizer.eod_id]`; empty documents are skipped.
            A prompt/response record is its prompt and response through the tokenizer's chat template
            (tokenizer.chat_turn), and the corpus then gets a loss mask (mask_XXXXX.bin beside each shard: 1 for
            the response's tokens and the end-of-document id, 0 for the prompt's; 1 for other documents), which
            the loader applies to the labels.
        out_dir: created if needed; otherwise it must be empty (a tokenizer file aside) or hold prepared data,
            which is replaced only with `overwrite=True`, and only the files its index lists, once the new data is
            complete: it is prepared in a staging directory beside `out_dir` and moved in at the end (the old index
            goes first, the new one last). A failed prepare leaves `out_dir` as it was.
        shard_tokens: ids per shard file (the last one is shorter).
        text_field: the field holding the text in `.jsonl` and `.parquet` records.
        progress: show a progress bar over input bytes.
        validation_fraction: share of the documents held out in `out_dir/validation/` (documents 0, k, 2k, ...,
            k = round(1 / fraction), so at least one; 0 for none; at most 0.5). Training never sees them.
        errors: "strict" (a file that is not UTF-8 text is a ValueError naming it) or "replace" (invalid bytes
            become U+FFFD; the index's "replaced" counts them per file).
    """
    if not (validation_fraction == 0 or 0 < validation_fraction <= 0.5):
        raise ValueError(f"--validation_fraction must be 0 (no validation split) or in (0, 0.5] (every k-th "
                         f"document held out, k = round(1 / fraction) >= 2), got {validation_fraction}")
    if not 1 <= shard_tokens <= MAX_SHARD_TOKENS:
        raise ValueError(f"--shard_tokens must be in [1, {MAX_SHARD_TOKENS:,}] (one shard is buffered in memory), "
                         f"got {shard_tokens}")
    given, out_dir = Path(out_dir), Path(out_dir).resolve()  # a symlink's target: staging goes on its file system
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"--out_dir {given} is a file; pass a directory")
    own = own_files(out_dir)
    if own and not overwrite:
        raise FileExistsError(f"{given} already holds prepared data ({INDEX_NAME}); pass overwrite=True "
                              "(--overwrite) to replace it")
    if not own and (foreign := _foreign_entries(out_dir, own)):
        raise FileExistsError(f"--out_dir {given} holds files that are not prepared data ({_names(foreign)}): "
                              "prepare writes into a new or empty directory (its tokenizer may be there); choose "
                              "another --out_dir")
    files = stdlib_files() if inputs is None else find_input_files(inputs)
    remove_stale_staging(out_dir)
    staging = out_dir.parent / f".{out_dir.name}.preparing-{os.getpid()}"
    try:
        index = _prepare(files, tokenizer, staging, shard_tokens, text_field, progress, validation_fraction, errors)
        _install(staging, out_dir, own)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return index


def remove_stale_staging(out_dir: Path) -> None:
    """Delete the staging directories of prepares into `out_dir` whose process is gone (killed mid-prepare), and
    this process's own name (a killed process had its id: ids repeat, in containers often), before it stages."""
    for stale in out_dir.parent.glob(f".{out_dir.name}.preparing-*"):
        pid = stale.name.rsplit("-", 1)[1]
        gone = pid.isdigit() and (int(pid) == os.getpid() or not Path(f"/proc/{pid}").exists())
        if gone and stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)


def _shard_files(shard: dict) -> list[str]:
    """The file names of one index entry: the shard and its loss mask, if any."""
    return [shard["file"], *([shard["mask"]] if "mask" in shard else [])]


def own_files(data_dir: Path) -> list[Path]:
    """What a prepare wrote into `data_dir`, as its index lists it: the index first, then the shards and masks, then
    the validation split's own files and its directory; [] when `data_dir` holds no index. ValueError when the
    index is unreadable (nothing can then be told apart)."""
    path = data_dir / INDEX_NAME
    if not path.is_file():
        return []
    try:
        index = json.loads(path.read_text())
        names = [name for shard in index["shards"] for name in _shard_files(shard)]
        split = index["validation"]["dir"] if "validation" in index else None
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is unreadable ({e!r}), so prepare cannot tell its own files from others: move "
                         f"{data_dir} aside, or choose another --out_dir") from None
    files = [path, *(data_dir / name for name in names if isinstance(name, str) and Path(name).name == name)]
    if isinstance(split, str) and Path(split).name == split and (data_dir / split).is_dir():
        files += [*own_files(data_dir / split), data_dir / split]
    return [file for file in files if file.exists()]


def _foreign_entries(data_dir: Path, own: list[Path]) -> list[Path]:
    """The entries of `data_dir` (and of its validation split) that no prepare wrote, its tokenizer's files aside
    (a SentencePiece model, or tokenizer.json and the files that go with it)."""
    if not data_dir.is_dir():
        return []
    owned = set(own)
    dirs = [data_dir, *(p for p in own if p.is_dir())]
    return sorted(entry for d in dirs for entry in d.iterdir()
                  if entry not in owned and not (d == data_dir and entry.name in (SPM_FILE, HF_FILE, *HF_COMPANIONS)))


def _names(paths: list[Path]) -> str:
    return ", ".join(p.name for p in paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")


def _install(staging: Path, out_dir: Path, old: list[Path]) -> None:
    """Move the complete prepared data in `staging` to `out_dir`, replacing `old` (the previous prepare's own
    files) and nothing else: FileExistsError before anything moves when a new file would replace one that prepare
    did not write. The old index goes first, so no half-replaced directory is ever loadable, and the new index
    comes last."""
    if not out_dir.exists():
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        staging.rename(out_dir)
        return
    new = own_files(staging)
    targets = [out_dir / path.relative_to(staging) for path in new]
    in_the_way = [t for t in targets if t.exists() and t not in old and not t.is_dir()]
    if in_the_way:
        raise FileExistsError(f"{out_dir} holds {_names(in_the_way)}, which a prepare did not write and the new data "
                              "would replace: move it, or choose another --out_dir")
    for path in old:  # the index first; a split's directory after its files, kept if other files remain
        if path.is_dir():
            with contextlib.suppress(OSError):
                path.rmdir()
        else:
            path.unlink()
    for path, target in reversed(list(zip(new, targets, strict=True))):  # directories first, the index last
        if path.is_dir():
            target.mkdir(exist_ok=True)
        else:
            path.rename(target)


def _prepare(files: list[Path], tokenizer: Tokenizer | HFTokenizer, out_dir: Path, shard_tokens: int,
             text_field: str, progress: bool, validation_fraction: float, errors: str) -> dict:
    """`prepare` into a new directory `out_dir`."""
    masked = any(has_pairs(f, text_field) for f in files)
    writer = ShardWriter(out_dir, tokenizer.vocab_size, shard_tokens, masked)
    every = round(1 / validation_fraction) if validation_fraction else 0
    held_out = ShardWriter(out_dir / VALIDATION_DIR, tokenizer.vocab_size, shard_tokens, masked) if every else None
    num_documents = num_validation = 0
    decode = Decoder(errors)
    with tqdm(total=sum(p.stat().st_size for p in files), unit="B", unit_scale=True, desc="tokenizing",
              disable=not progress) as bar:
        for docs, nbytes in _batches(documents_with_sizes(files, text_field, decode)):
            for ids, mask in _encode(docs, tokenizer, writer.dtype):
                validation = held_out is not None and num_documents % every == 0
                (held_out if validation else writer).write(ids, mask)
                num_documents += 1
                num_validation += validation
            bar.update(nbytes)
    tok_info = {"path": str(tokenizer.path.resolve()), "vocab_size": tokenizer.vocab_size, "sha256": tokenizer.sha256}
    metadata = {"eod_id": tokenizer.eod_id, "tokenizer": tok_info, **({"replaced": decode.replaced} if
                                                                      decode.replaced else {})}
    if num_documents == 0:
        more = ", ..." if len(files) > 1 else ""
        raise ValueError(f"no non-empty document in {len(files)} input file(s) ({files[0]}{more}): nothing to prepare")
    if held_out is not None and num_documents - num_validation == 0:
        raise ValueError(f"{num_documents} document(s) leave nothing to train on after the validation split; "
                         "pass validation_fraction=0 (--validation_fraction 0) or add documents")
    if held_out is not None and num_validation:
        split = held_out.finish(num_documents=num_validation, **metadata)
        metadata["validation"] = {"dir": VALIDATION_DIR, "every": every, "num_documents": num_validation,
                                  "num_tokens": split["num_tokens"]}
    return writer.finish(num_documents=num_documents - num_validation, **metadata)


def _encode(docs: list[Document], tokenizer: Tokenizer | HFTokenizer, dtype: np.dtype
            ) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
    """(ids, loss mask or None) of each document: its tokens and the end-of-document id; for a prompt/response
    pair the prompt's tokens (through the chat template) are masked out."""
    pairs = [chat_turn(tokenizer, d.prompt, d.text) if d.prompt else ("", d.text) for d in docs]
    contexts = tokenizer.encode_batch([context for context, _ in pairs])
    targets = tokenizer.encode_batch([target for _, target in pairs])
    for context, target in zip(contexts, targets, strict=True):
        ids = np.array([*context, *target, tokenizer.eod_id], dtype=dtype)
        mask = np.ones(len(ids), dtype=np.uint8)
        mask[:len(context)] = 0
        yield ids, mask if context else None


def load_index(data_dir: str | os.PathLike) -> dict:
    """Read and validate `data_dir/index.json` and the shard files it lists (existence and exact byte size).

    Raises FileNotFoundError for a missing directory, index or shard; ValueError for a corrupt index or a shard
    whose size disagrees with it.
    """
    data_dir = Path(data_dir)
    hint = f"create it with `python data.py prepare --out_dir {data_dir}`"
    if not data_dir.is_dir():
        raise FileNotFoundError(f"data directory {data_dir} does not exist; {hint}")
    path = data_dir / INDEX_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {data_dir} holds no prepared data (or `prepare` was "
                                f"interrupted); {hint}")
    try:
        index = json.loads(path.read_text())
        if index["format"] != INDEX_FORMAT:
            raise ValueError(f"format {index['format']} is not {INDEX_FORMAT}")
        dtype = np.dtype(index["dtype"])
        if dtype != token_dtype(index["vocab_size"]):
            raise ValueError(f"dtype {dtype} does not match vocab_size {index['vocab_size']}")
        lengths = [int(s["num_tokens"]) for s in index["shards"]]
        if not all(isinstance(s["file"], str) and "/" not in s["file"] for s in index["shards"]):
            raise ValueError("shard file names must be plain names inside the data directory")
        if sum(lengths) != index["num_tokens"]:
            raise ValueError(f"shard lengths sum to {sum(lengths)}, not num_tokens={index['num_tokens']}")
    except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"corrupt data index {path}: {e!r}; re-run `python data.py prepare`") from e
    for shard in index["shards"]:
        file = data_dir / shard["file"]
        if not file.is_file():
            raise FileNotFoundError(f"shard {file} listed in {path} is missing")
        expected = shard["num_tokens"] * dtype.itemsize
        if file.stat().st_size != expected:
            raise ValueError(f"shard {file} has {file.stat().st_size} bytes but {path} says {shard['num_tokens']} "
                             f"{dtype} tokens ({expected} bytes); the directory is corrupt, re-run prepare")
        mask = data_dir / str(shard.get("mask", ""))
        if "mask" in shard and ("/" in shard["mask"] or not mask.is_file() or mask.stat().st_size != shard[
                "num_tokens"]):
            raise ValueError(f"the loss mask of shard {file} is missing or not {shard['num_tokens']} bytes; the "
                             "directory is corrupt, re-run prepare")
    if len({"mask" in shard for shard in index["shards"]}) > 1:
        raise ValueError(f"{path} gives a loss mask to some shards only; re-run prepare")
    return index


def check_shards(data_dir: str | os.PathLike, index: dict) -> None:
    """Check every shard and loss mask of `data_dir` against the CRC-32s its index (from `load_index`) records:
    ValueError naming the first damaged file. Shards prepared before they carried checksums are not checked."""
    data_dir = Path(data_dir)
    expected = {name: shard[key] for shard in index["shards"] for name, key in zip(_shard_files(shard), (
        "crc32", "mask_crc32"), strict=False) if key in shard}
    found = file_records([data_dir / name for name in expected])
    damaged = [name for name, crc in expected.items() if found[name]["crc32"] != crc]
    if damaged:
        more = f" (and {len(damaged) - 1} more)" if len(damaged) > 1 else ""
        split = data_dir.name == VALIDATION_DIR and (data_dir.parent / INDEX_NAME).is_file()
        raise ValueError(f"shard {data_dir / damaged[0]} is damaged: its CRC-32 differs from {INDEX_NAME}'s{more}; "
                         f"prepare the data again (`python data.py prepare --out_dir "
                         f"{data_dir.parent if split else data_dir} --overwrite` with its --input and --tokenizer)")


def validation_dir(data_dir: str | os.PathLike) -> Path:
    """The held-out split of `data_dir` (a data directory of its own), with a clear error when there is none."""
    index = load_index(data_dir)
    if "validation" not in index:
        raise FileNotFoundError(f"{data_dir} has no validation split (prepared before it existed, or with "
                                f"validation_fraction 0); re-run `python data.py prepare --overwrite` to make one")
    split = Path(data_dir) / index["validation"]["dir"]
    if not (split / INDEX_NAME).is_file():
        raise FileNotFoundError(f"{data_dir}'s validation split {split} is missing (its index lists one): prepare "
                                f"{data_dir} again (`python data.py prepare --out_dir {data_dir} --overwrite`)")
    return split


def check_tokenizer(index: dict, tokenizer: Tokenizer) -> None:
    """Raise ValueError unless `index` (from `load_index`) was written with `tokenizer` (same model file hash)."""
    written = index.get("tokenizer")
    if written is None:
        raise ValueError("the data index records no tokenizer, so it cannot be checked against "
                         f"{tokenizer.path}")
    if written["sha256"] != tokenizer.sha256:
        raise ValueError(f"data was tokenized with {written['path']} (vocab_size {written['vocab_size']}, sha256 "
                         f"{written['sha256'][:12]}) but the tokenizer given is {tokenizer.path} (vocab_size "
                         f"{tokenizer.vocab_size}, sha256 {tokenizer.sha256[:12]}); re-run prepare with it")


# ---------------------------------------------------------------- loader


class TokenLoader:
    """Endless iterator of `(input_ids, labels)` batches of windows of the token stream, for one rank.

    Windows: window i is `stream[i*(T-1) : i*(T-1) + T]`, so consecutive windows share one token. The model
    shifts labels internally (position t predicts labels[t+1]), so a window predicts its tokens 1..T-1, and over
    an epoch every token of the stream (except the first, and a tail shorter than T-1) is predicted exactly once;
    no window's last position is lost to the next window. `input_ids` and `labels` hold the same ids (separate
    tensors), int64, shape (B, T), on the CPU, except that labels are -100 where the data's loss mask is 0 (the
    prompts of prompt/response records). Windows cross document and shard boundaries (documents are packed,
    separated by the end-of-document id).

    Order: epoch e visits the windows in the order `np.random.default_rng((seed, e)).permutation(num_windows)`;
    global step s takes the next W*B of them and rank r gets the r-th B. Ranks are therefore disjoint, the
    order depends only on (data, T, seed), and the same global batch size gives the same global batches for any
    W. An epoch has `num_windows // (W*B)` steps (equal on every rank); the remainder is skipped, then the next
    epoch begins with a fresh permutation.

    Resume: `state_dict()` after any step and `load_state_dict()` into a loader built with the same data, T and
    seed continue with exactly the batches the original would have produced. W and B may change on resume if
    the windows consumed so far in the epoch are a multiple of the new W*B.

    Args:
        data_dir: a directory written by `prepare` (or `ShardWriter`); its shards' checksums are checked here.
        seq_len: T, tokens per window (the model's context length), >= 2.
        batch_size: B, windows per rank per step.
        rank, world_size: this rank and the number of data-parallel ranks.
        seed: shuffling seed.
        tokenizer: if given, the data must have been written with it (else ValueError).
    """

    def __init__(
        self,
        data_dir: str | os.PathLike,
        seq_len: int,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        tokenizer: Tokenizer | None = None,
    ):
        if seq_len < 2 or batch_size < 1:
            raise ValueError(f"need seq_len >= 2 and batch_size >= 1, got seq_len={seq_len}, batch_size={batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        self.index = load_index(data_dir)
        check_shards(data_dir, self.index)
        if tokenizer is not None:
            check_tokenizer(self.index, tokenizer)
        self.vocab_size: int = self.index["vocab_size"]
        self.seq_len, self.batch_size, self.rank, self.world_size, self.seed = (seq_len, batch_size, rank,
                                                                                world_size, seed)
        data_dir = Path(data_dir)
        dtype = np.dtype(self.index["dtype"])
        shards = [s for s in self.index["shards"] if s["num_tokens"] > 0]
        self._shards = [np.memmap(data_dir / s["file"], dtype=dtype, mode="r") for s in shards]
        self._masks = [np.memmap(data_dir / s["mask"], dtype=np.uint8, mode="r") for s in shards
                       if "mask" in s] or None  # prompt/response data: 1 where the token is a target
        self._shard_starts = np.cumsum([0] + [s["num_tokens"] for s in shards])  # (num_shards + 1,)
        self.num_tokens: int = int(self._shard_starts[-1])
        self.num_windows = max(self.num_tokens - 1, 0) // (seq_len - 1)
        self.steps_per_epoch = self.num_windows // (world_size * batch_size)
        if self.steps_per_epoch == 0:
            fits = f"--batch_size {self.num_windows // world_size} or less, " if self.num_windows >= world_size else ""
            raise ValueError(f"{data_dir} has {self.num_tokens} tokens = {self.num_windows} windows of {seq_len}, "
                             f"fewer than one step's {world_size * batch_size} (batch size {batch_size} x "
                             f"{world_size} data-parallel processes): pass {fits}a shorter --context_length, or "
                             "prepare more data")
        self.epoch = 0
        self.step = 0  # steps taken in the current epoch
        self._order_epoch, self._order = -1, np.empty(0, dtype=np.int64)

    def _epoch_order(self) -> np.ndarray:
        """The window permutation of the current epoch, shared by all ranks. (num_windows,)"""
        if self._order_epoch != self.epoch:
            self._order = np.random.default_rng((self.seed, self.epoch)).permutation(self.num_windows)
            self._order_epoch = self.epoch
        return self._order

    def _read(self, start: int, out: np.ndarray, shards: list[np.memmap] | None = None) -> None:
        """Copy `stream[start : start + len(out)]` into `out`, across shard boundaries if needed (of the loss
        masks' stream when `shards` is self._masks)."""
        shards = shards or self._shards
        pos, n = start, 0
        while n < len(out):
            s = int(np.searchsorted(self._shard_starts, pos, side="right")) - 1
            local = pos - int(self._shard_starts[s])
            piece = shards[s][local : local + len(out) - n]
            out[n : n + len(piece)] = piece
            n += len(piece)
            pos += len(piece)

    def __iter__(self) -> TokenLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.step == self.steps_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0
        first = (self.step * self.world_size + self.rank) * self.batch_size
        windows = self._epoch_order()[first : first + self.batch_size]  # (B,)
        tokens = np.empty((self.batch_size, self.seq_len), dtype=np.int64)  # (B, T)
        for row, w in enumerate(windows):
            self._read(int(w) * (self.seq_len - 1), tokens[row])
        self.step += 1
        input_ids = torch.from_numpy(tokens)  # (B, T)
        if self._masks is None:
            return input_ids, input_ids.clone()
        mask = np.empty((self.batch_size, self.seq_len), dtype=np.uint8)  # (B, T)
        for row, w in enumerate(windows):
            self._read(int(w) * (self.seq_len - 1), mask[row], self._masks)
        return input_ids, input_ids.masked_fill(torch.from_numpy(mask) == 0, IGNORE_INDEX)

    def state_dict(self) -> dict:
        """Position after the last batch returned, plus what identifies the window order. Plain ints (JSON-able)."""
        return {
            "seed": self.seed,
            "seq_len": self.seq_len,
            "num_tokens": self.num_tokens,
            "epoch": self.epoch,
            "windows_consumed": self.step * self.world_size * self.batch_size,  # global, in this epoch
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state` (see the class docstring for what may differ)."""
        for key in ("seed", "seq_len", "num_tokens"):
            if state[key] != getattr(self, key):
                raise ValueError(f"cannot resume: the checkpoint's data loader has {key}={state[key]} but this one "
                                 f"has {getattr(self, key)}")
        global_batch = self.world_size * self.batch_size
        consumed = state["windows_consumed"]
        if consumed % global_batch or consumed // global_batch > self.steps_per_epoch:
            raise ValueError(f"cannot resume: {consumed} windows consumed in the epoch is not a whole number of "
                             f"global batches of {global_batch} within an epoch")
        self.epoch, self.step = state["epoch"], consumed // global_batch
