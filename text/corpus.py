"""The corpus: input files -> documents. Text files are one document each; `.jsonl` lines and `.parquet` rows are
one document each (a text field, or a prompt/response pair whose prompt is context only); bytes become text as
strict UTF-8 (a binary or non-UTF-8 file is an error naming it) or with replacements counted. Without inputs, the
corpus is the running interpreter's standard library source (`stdlib_files`), which needs no download.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import sysconfig
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")  # files picked up when walking a directory, besides records:
RECORD_SUFFIXES = (".jsonl", ".parquet")  # one document per line / row
# Formats that would be misread as text, refused when named: what to do instead.
UNSUPPORTED = {".json": "a JSON document, not records: write one record per line as .jsonl",
               ".csv": "a table: convert it to .jsonl or .parquet records", ".tsv": "a table: convert it to .jsonl "
               "or .parquet records", **{s: "compressed: decompress it first" for s in (".gz", ".bz2", ".xz", ".zst",
                                                                                      ".zip", ".tar", ".7z")}}
NUL = b"\0"  # in a file that should be text: a binary file
MAX_DOCUMENT_BYTES = 256 * 2**20  # a plain file is one document, which the tokenizer holds whole (with its ids)
_STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_files() -> list[Path]:
    """The default corpus: the running interpreter's standard-library `*.py` files, sorted, one document each.

    site-packages and test directories are skipped. Needs no download; about 12 MB of code and docstrings on
    CPython 3.11, with files up to 750 kB (real long-context documents).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if not _STDLIB_SKIP & set(p.relative_to(root).parts[:-1]))


def find_input_files(paths: Iterable[str | os.PathLike], log: Callable[[str], None] | None = None) -> list[Path]:
    """Expand `paths` into files: a file is kept as given (one of the UNSUPPORTED formats is a ValueError saying what
    to do); a directory is walked (sorted) for `.jsonl`, `.parquet` and `TEXT_SUFFIXES` files, and the other files
    it holds are named in one line through `log` (default: stderr). Raises FileNotFoundError for a missing path,
    ValueError if nothing is found."""
    log = log or (lambda message: print(message, file=sys.stderr))
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file())
            files += [p for p in found if p.suffix in (*RECORD_SUFFIXES, *TEXT_SUFFIXES)]
            if skipped := Counter(p.suffix or "no suffix" for p in found
                                  if p.suffix not in (*RECORD_SUFFIXES, *TEXT_SUFFIXES)):
                kinds = ", ".join(f"{n} {suffix}" for suffix, n in sorted(skipped.items(), key=lambda s: (-s[1], s[0])))
                log(f"{path}: skipped {sum(skipped.values())} files of other formats ({kinds}): documents are "
                    f"records in .jsonl or .parquet, or text in {' '.join(TEXT_SUFFIXES)}; name a text file to read "
                    "it as one document")
            if unread := sorted(p for p in path.rglob("*") if not p.is_file() and not p.is_dir()):
                named = ", ".join(f"{p} (a link to {os.readlink(p)}, which does not exist)"
                                  if p.is_symlink() and not p.exists() else f"{p} (not a regular file)"
                                  for p in unread[:3])
                log(f"{path}: skipped {len(unread)} entries that are not files to read: {named}"
                    + (f" and {len(unread) - 3} more" if len(unread) > 3 else ""))
        elif not path.is_file():
            raise FileNotFoundError(f"input {path} does not exist")
        elif path.suffix in UNSUPPORTED:
            raise ValueError(f"input {path} is {UNSUPPORTED[path.suffix]} (read: .jsonl and .parquet records, text "
                             "files)")
        else:
            files.append(path)
    if not files:
        raise ValueError(f"no input files found in {[str(p) for p in paths]} (looked for .jsonl, .parquet and "
                         f"{', '.join(TEXT_SUFFIXES)})")
    seen: dict[Path, Path] = {}
    for file in files:
        if (first := seen.setdefault(file.resolve(), file)) is not file:
            raise ValueError(f"input {file} is given twice (also as {first}): each file would be read twice; name "
                             "it once")
    return files


@dataclass(frozen=True)
class Document:
    """A document of the corpus: `text`, every token of which is predicted, after `prompt`, whose tokens are only
    context (a prompt/response record; "" for any other document)."""

    text: str
    prompt: str = ""


def wide_text(data: bytes) -> str | None:
    """The encoding `data` is written in when it is UTF-16 or UTF-32 text, for iconv's -f: from a byte-order mark,
    or from its first 4 KiB (at least 8 bytes) where NULs fill 90% of the odd or the even positions and at most 10%
    of the others, as where ASCII text takes two bytes a character ("UTF-16LE", "UTF-16BE"; a binary file has NULs
    everywhere); None for anything else."""
    for mark, encoding in ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"),
                           (b"\xff\xfe", "UTF-16"), (b"\xfe\xff", "UTF-16")):
        if data.startswith(mark):
            return encoding
    head = data[:4096]
    half, even, odd = len(head) // 2, head[0::2].count(0), head[1::2].count(0)
    if half < 4:
        return None
    if odd >= 0.9 * half and even <= 0.1 * half:
        return "UTF-16LE"
    return "UTF-16BE" if even >= 0.9 * half and odd <= 0.1 * half else None


class Decoder:
    """Bytes of the input files -> text. errors="strict": a file that is not UTF-8 text (invalid UTF-8, or NUL
    bytes: binary) is a ValueError naming it; "replace": invalid bytes and NULs become U+FFFD and are counted per
    file (`replaced`). UTF-16 and UTF-32 text (`wide_text`) is refused in both, with how to convert it."""

    def __init__(self, errors: str = "strict") -> None:
        if errors not in ("strict", "replace"):
            raise ValueError(f"errors must be 'strict' or 'replace', got {errors!r}")
        self.errors, self.replaced = errors, {}

    def __call__(self, data: bytes, path: Path, where: str = "") -> str:
        if encoding := wide_text(data):
            raise ValueError(f"{path}{where} looks like {encoding} text (a byte-order mark, or a NUL beside every "
                             f"character), which neither --errors mode reads: convert it to UTF-8 first (iconv -f "
                             f"{encoding} -t UTF-8 {path} > {path.with_suffix('.utf8' + path.suffix)})")
        if self.errors == "replace":
            text = data.decode("utf-8", errors="replace").replace("\0", "\ufffd")  # NUL: binary, not text
            if n := text.count("\ufffd") - data.count("\ufffd".encode()):
                self.replaced[str(path)] = self.replaced.get(str(path), 0) + n
            return text
        try:
            if NUL in data:
                raise ValueError(f"a NUL byte at offset {data.index(NUL)}: a binary file")
            return data.decode("utf-8")
        except (UnicodeDecodeError, ValueError) as e:
            raise ValueError(f"{path}{where} is not UTF-8 text ({e}); pass --errors replace to read it anyway "
                             "(invalid bytes become U+FFFD and are counted), or leave the file out") from None


def _record_documents(record: object, text_field: str, where: str) -> Document:
    """The Document of a JSONL or parquet record: prompt/response fields, or the text field."""
    if isinstance(record, dict) and isinstance(record.get("prompt"), str) and isinstance(record.get("response"), str):
        return Document(record["response"], record["prompt"])
    if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
        raise ValueError(f"{where}: expected a JSON object with a string field {text_field!r} (or \"prompt\" and "
                         "\"response\")")
    return Document(record[text_field])


def _parquet_documents(path: Path, text_field: str) -> Iterator[tuple[Document, int]]:
    """The documents of a parquet file (its `text_field` column, or "prompt" and "response"), read in batches."""
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from e
    try:
        table = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's ArrowInvalid: not a parquet file
        raise ValueError(f"{path} is not a readable parquet file ({e})") from None
    names = set(table.schema_arrow.names)
    columns = ["prompt", "response"] if {"prompt", "response"} <= names else [text_field]
    if not set(columns) <= names:
        raise ValueError(f"{path} has no column {text_field!r} (columns: {sorted(names)}); pass --text_field")
    rows, size = table.metadata.num_rows, path.stat().st_size
    for i, row in enumerate(r for batch in table.iter_batches(columns=columns) for r in batch.to_pylist()):
        share = size * (i + 1) // rows - size * i // rows  # the file's bytes, spread over its rows
        yield _record_documents(row, text_field, f"{path} row {i}"), share


def documents_with_sizes(files: Sequence[Path], text_field: str, decode: Decoder | None = None
                          ) -> Iterator[tuple[Document, int]]:
    """Yield (document, input bytes consumed). A `.jsonl` file gives one document per line (the string in
    `text_field`, or a "prompt"/"response" pair), a `.parquet` file one per row likewise; any other file is one
    document. Bytes become text through `decode` (default: strict UTF-8)."""
    decode = decode or Decoder()
    for path in files:
        if path.suffix == ".parquet":
            yield from _parquet_documents(path, text_field)
            continue
        if path.suffix != ".jsonl":
            check_document_size(path)
            data = path.read_bytes()
            yield Document(decode(data, path)), len(data)
            continue
        with path.open("rb") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    yield Document(""), len(line)
                    continue
                try:
                    record = json.loads(decode(line, path, f":{lineno}"))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({e})") from e
                yield _record_documents(record, text_field, f"{path}:{lineno}"), len(line)


def check_document_size(path: Path) -> None:
    """ValueError naming `path` when it is a plain file (one document) larger than MAX_DOCUMENT_BYTES, which the
    tokenizer would hold whole: refused before any file is read, not after minutes of work and an allocation
    failure."""
    if path.suffix not in RECORD_SUFFIXES and (size := path.stat().st_size) > MAX_DOCUMENT_BYTES:
        raise ValueError(f"{path} is {size / 2**30:.1f} GiB, one document (a plain file is one), and a document over "
                         f"{MAX_DOCUMENT_BYTES // 2**20} MiB is more than the tokenizer holds at once: split it into "
                         "files (or .jsonl records, one document a line) of at most that size")


def iter_documents(files: Sequence[Path], text_field: str = "text", errors: str = "strict") -> Iterator[str]:
    """Document texts of `files` (see `find_input_files`; a prompt/response pair as its two texts joined), in
    order; e.g. to train a tokenizer."""
    return (d.prompt + d.text for d, _ in documents_with_sizes(files, text_field, Decoder(errors))
            if d.prompt or d.text)


def has_pairs(path: Path, text_field: str) -> bool:
    """Whether a record file holds prompt/response pairs: its first JSONL record or its parquet columns."""
    if path.suffix == ".parquet":
        return next(_parquet_documents(path, text_field), (Document(""), 0))[0].prompt != ""
    if path.suffix == ".jsonl":
        with path.open("rb") as f:
            line = next((ln for ln in f if ln.strip()), b"")
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            return isinstance(record, dict) and {"prompt", "response"} <= set(record)
    return False
