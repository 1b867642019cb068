"""Prepare training data: train a tokenizer, or tokenize a corpus into token shards (text/shards.py holds the layout
and the loader).

    python data.py train-tokenizer [--input PATH ...] --vocab_size 8192 --model_prefix runs/tok
    python data.py prepare [--input PATH ...] --tokenizer runs/tok.model --out_dir runs/data
Inputs are read as corpus.py says; without --input, the corpus is the running interpreter's standard library
source (`corpus.stdlib_files`).
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from pathlib import Path

from storage.places import Holds, holds, kept_output
from text.corpus import (
    RECORD_SUFFIXES,
    check_document_size,
    find_input_files,
    has_pairs,
    iter_documents,
    stdlib_files,
)
from text.shards import DEFAULT_SHARD_TOKENS, DEFAULT_VALIDATION_FRACTION, prepare
from text.tokenizer import Tokenizer, load_tokenizer
from training.cli import Parser

# ---------------------------------------------------------------- command line


def build_parser() -> Parser:
    """data.py's two commands and their options."""
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    inputs_help = ("files or directories (.jsonl and .parquet records: a text field, or prompt and response; text "
                   "files); default: the Python standard library source")
    errors_help = ("a file that is not UTF-8 text: 'strict' stops with its name, 'replace' reads invalid bytes as "
                   "U+FFFD and reports how many")

    tok = commands.add_parser("train-tokenizer", help="train a SentencePiece BPE tokenizer")
    tok.add_argument("--input", nargs="+", help=inputs_help)
    tok.add_argument("--vocab_size", type=int, required=True)
    tok.add_argument("--model_prefix", required=True, help="writes MODEL_PREFIX.model")
    tok.add_argument("--max_train_mb", type=float, default=8.0, help="training sample size (first N MB of lines)")
    tok.add_argument("--text_field", default="text", help="text field of .jsonl records")
    tok.add_argument("--errors", choices=["strict", "replace"], default="strict", help=errors_help)
    tok.add_argument("--overwrite", action="store_true", help="replace an existing MODEL_PREFIX.model")

    prep = commands.add_parser("prepare", help="tokenize a corpus into shards")
    prep.add_argument("--input", nargs="+", help=inputs_help)
    prep.add_argument("--tokenizer", required=True,
                      help="a SentencePiece .model file, or a Hugging Face tokenizer.json (pip install tokenizers)")
    prep.add_argument("--out_dir", required=True,
                      help="a new or empty directory (its tokenizer's files may be there), outside any run or "
                           "model")
    prep.add_argument("--shard_tokens", type=int, default=DEFAULT_SHARD_TOKENS)
    prep.add_argument("--text_field", default="text", help="text field of .jsonl and .parquet records")
    prep.add_argument("--errors", choices=["strict", "replace"], default="strict", help=errors_help)
    prep.add_argument("--overwrite", action="store_true",
                      help="replace the prepared data in OUT_DIR (the files its index.json lists, nothing else)")
    prep.add_argument("--validation_fraction", type=float, default=DEFAULT_VALIDATION_FRACTION,
                      help="share of documents held out in OUT_DIR/validation (every k-th; 0: none)")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        run(args)
    except (ValueError, ImportError) as e:
        parser.error(str(e))
    except OSError as e:  # ours carry a message; the system's a file name and its reason
        parser.error(str(e) if e.strerror is None else f"{e.filename}: {e.strerror}")


def check_tokenizer_options(args: argparse.Namespace) -> Path:
    """The tokenizer file train-tokenizer writes (MODEL_PREFIX.model), after checking its options before any input
    is read: ValueError naming the option."""
    prefix = Path(args.model_prefix)
    if args.model_prefix.endswith(("/", ".model")) or prefix.is_dir():
        raise ValueError(f"--model_prefix {args.model_prefix}: a file name without .model (it writes "
                         f"MODEL_PREFIX.model, e.g. --model_prefix {prefix.parent / prefix.stem}/tok)")
    target = prefix.with_name(prefix.name + ".model")
    if reason := kept_output(target, directory=False):
        raise FileExistsError(f"--model_prefix {args.model_prefix}: {reason}; write the tokenizer elsewhere")
    if target.exists() and not args.overwrite:
        raise FileExistsError(f"{target} exists (prepared data may name it); pass --overwrite to replace it, or "
                              "another --model_prefix")
    if args.vocab_size < 2:
        raise ValueError(f"--vocab_size must be at least 2, got {args.vocab_size}")
    if not (math.isfinite(args.max_train_mb) and args.max_train_mb > 0):
        raise ValueError(f"--max_train_mb must be a finite number > 0, got {args.max_train_mb}")
    return target


def check_out_dir(out_dir: str) -> None:
    """FileExistsError unless --out_dir lies outside every run, model and checkpoint directory (storage/places.py),
    whose files training rewrites or prunes (prepared data there would be deleted with them)."""
    for place in (Path(out_dir).resolve(), *Path(out_dir).resolve().parents):
        if (owner := holds(place)) in (Holds.CHECKPOINT, Holds.MODEL, Holds.RUN):
            raise FileExistsError(f"--out_dir {out_dir} is inside {place}, {owner.value}, whose files training "
                                  "replaces or prunes: prepare the data outside it (e.g. --out_dir data/NAME)")


def input_files(args: argparse.Namespace) -> list[Path]:
    """The files --input names (the standard library without it), after checking that --text_field and --errors
    can act on them: ValueError naming the option otherwise."""
    files = stdlib_files() if args.input is None else find_input_files(args.input)
    for file in files:  # before minutes of tokenizing
        check_document_size(file)
    records = [f for f in files if f.suffix in RECORD_SUFFIXES]
    if args.text_field != "text" and all(has_pairs(f, args.text_field) for f in records):
        raise ValueError(f"--text_field {args.text_field} has no effect: it names the text field of .jsonl and "
                         ".parquet records, and the inputs hold none (or prompt/response records only); leave it out")
    if args.errors != "strict" and all(f.suffix == ".parquet" for f in files):
        raise ValueError("--errors has no effect on .parquet inputs (their strings are Unicode already); leave it out")
    return files


def run(args: argparse.Namespace) -> None:
    """data.py's work for parsed arguments."""
    t0 = time.perf_counter()
    if args.command == "train-tokenizer":
        check_tokenizer_options(args)
        files = input_files(args)
        tokenizer = Tokenizer.train(iter_documents(files, args.text_field, args.errors), args.vocab_size,
                                    args.model_prefix, max_train_bytes=int(args.max_train_mb * 1e6))
        print(f"wrote {tokenizer.path} (vocab_size {tokenizer.vocab_size}) in {time.perf_counter() - t0:.1f} s")
        return
    check_out_dir(args.out_dir)
    index = prepare(input_files(args), load_tokenizer(args.tokenizer), args.out_dir, shard_tokens=args.shard_tokens,
                    text_field=args.text_field, overwrite=args.overwrite,
                    validation_fraction=args.validation_fraction, errors=args.errors)
    for file, count in index.get("replaced", {}).items():
        print(f"{file}: {count} invalid UTF-8 sequences read as U+FFFD")
    n_docs, n_tokens = index["num_documents"], index["num_tokens"]
    held_out = index.get("validation", {"num_documents": 0, "num_tokens": 0})
    print(f"wrote {args.out_dir}: {n_docs} documents, {n_tokens} tokens ({n_tokens / max(n_docs, 1):.0f} per "
          f"document, {index['dtype']}), {len(index['shards'])} shards, and {held_out['num_documents']} documents "
          f"({held_out['num_tokens']} tokens) held out for validation, in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
