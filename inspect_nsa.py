"""What an NSA model looks at: for a prompt, the selection blocks each KV group chose for each query and the gate
values of the three branches, layer by layer. The tool researchers reach for when NSA misses a needle: was the
needle's block ever selected, and does one branch's gate dominate?

    python inspect_nsa.py runs/experiment/nsa/model --text @prompt.txt
    python inspect_nsa.py CHECKPOINT --tokenizer TOK.model --text "..." --positions -1 --find 12345

Selection scores are recomputed explicitly from the layer's own queries and compressed keys (Eqs. 8-10, as in
nsa/reference.py), so this is for prompts of up to a few thousand tokens. Nothing of the attention's arithmetic is
changed: the layer's inputs are captured at its `sparse_attention` seam while the model runs normally.

Notation: L layers, KV key/value heads, H query heads, T prompt tokens, n selected blocks, Nc compressed blocks.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from nsa.inspection import inspect, report
from storage.weights import Stored, load_model, stored
from text.tokenizer import HFTokenizer, Tokenizer, check_vocab, model_tokenizer
from training.cli import Parser


def check_nsa_model(path: str | Path, tokenizer_path: str | None, use: str,
                    length: int | None = None) -> tuple[Stored, Tokenizer | HFTokenizer]:
    """The stored config and tokenizer of the NSA model at `path` (a run's model/ export or a checkpoint), read
    without loading its weights; ValueError or OSError (naming the fix) when the tokenizer does not fit the vocab,
    the model is not NSA or `length` (--length, documents of that many tokens) exceeds its context. `use` completes
    "this tool ..." in that error. Returns (what `path` holds, its files checked: `storage.weights.stored`, which
    `load_model` takes; the tokenizer)."""
    found, tokenizer = stored(path), model_tokenizer(path, tokenizer_path)
    config = found.config
    check_vocab(tokenizer, config.vocab_size)
    if config.attention_type != "nsa":
        raise ValueError(f"{path} has {config.attention_type!r} attention; this tool {use}, so it needs an NSA model "
                         f"(attention_type nsa)")
    if length is not None and length > config.context_length:
        raise ValueError(f"--length {length} is longer than the model's context of {config.context_length}")
    return found, tokenizer


def main(argv: list[str] | None = None) -> str:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint")
    p.add_argument("--tokenizer", help="a SentencePiece .model, a tokenizer.json or a directory holding one "
                                       "(default: the one stored with the checkpoint)")
    p.add_argument("--text", required=True, help="the prompt (or @FILE to read it from a file)")
    p.add_argument("--positions", type=int, nargs="+", default=[-1], help="query positions to show (-1: the last)")
    p.add_argument("--find", help="text whose selection blocks are marked with * (e.g. the needle's number)")
    args = p.parse_args(argv)
    try:  # every input checked before the model is loaded; a bad one is a one-line error (exit 2)
        if args.text.startswith("@") and not Path(args.text[1:]).is_file():
            raise ValueError(f"--text {args.text}: no file {args.text[1:]} to read the prompt from")
        text = Path(args.text[1:]).read_text() if args.text.startswith("@") else args.text
        found, tokenizer = check_nsa_model(args.checkpoint, args.tokenizer, "shows NSA's selection and gates")
        config = found.config
        ids = tokenizer.encode(text)
        if not 1 <= len(ids) <= config.context_length:
            raise ValueError(f"the prompt is {len(ids)} tokens; the model takes 1 to {config.context_length}")
        if any(not -len(ids) <= t < len(ids) for t in args.positions):
            raise ValueError(f"--positions must lie in [-{len(ids)}, {len(ids)}) for this {len(ids)}-token prompt")
        starts = None
        if args.find is not None:
            target = tokenizer.encode(" " + args.find)[1:] or tokenizer.encode(args.find)
            starts = [i for i in range(len(ids) - len(target) + 1) if target and ids[i:i + len(target)] == target]
            if not starts:
                raise ValueError(f"--find {args.find!r}: not in the prompt's tokens, so no block would be marked")
    except (OSError, ValueError) as e:
        p.error(str(e))
    model = load_model(found).eval()
    needle_blocks = {i // model.config.nsa_select_block_size for i in starts} if starts else None
    out = report(inspect(model, torch.tensor([ids])), args.positions, model.config.nsa_select_block_size,
                 needle_blocks)
    print(out)
    return out


if __name__ == "__main__":
    main()
