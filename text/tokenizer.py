"""Tokenizers: the project's SentencePiece BPE (train, save, load, encode, decode), and a released model's Hugging
Face `tokenizer.json` (`HFTokenizer`, read with the `tokenizers` library); `load_tokenizer` picks by file
or directory, and `save` writes either into a directory that transformers' `AutoTokenizer` reads.

SentencePiece BPE with byte fallback:

Any text round-trips exactly: `decode(encode(s)) == s` for every Python str that is valid Unicode (no lone
surrogates). Three settings make that true:
- byte fallback: a character outside the vocabulary becomes its UTF-8 bytes (`<0x..>` pieces), never `<unk>`;
- identity normalisation, no whitespace collapsing, no dummy prefix: code indentation and blank lines survive;
- SentencePiece writes spaces as U+2581 ("▁") internally, so a literal U+2581 in the input would decode to a space;
  `encode` spells that one character as its three byte pieces instead.

Ids: 0 `<unk>`, 1 `<s>` (bos), 2 `</s>` (eos, also the end-of-document token `eod_id` that `data.py` puts after
every document), 3 `<pad>`, 4 the newline symbol, then the 256 byte pieces, then learned merges.

Saved for Hugging Face tools (`Tokenizer.save`), the same tokenizer is also a `tokenizer.json`: a BPE over the same
pieces whose merges are ranked by the id of the piece they make (SentencePiece merges the highest-scoring piece
first, and its ids are in score order), a normalizer that writes " " as U+2581, SentencePiece's split into words (a
run of U+2581 starts a word), byte fallback, and special tokens never parsed from text (`split_special_tokens`). It
encodes every text as `encode` does except a literal U+2581, which it reads as a space; it decodes every id
sequence as `decode` does (with `skip_special_tokens=True`). The model sees a document after the end-of-document id,
never after `<s>`, so the saved tokenizer has no bos token (as Qwen3's), and tools that start a text with "the bos
token" start it with eos.

Reference: https://github.com/google/sentencepiece (options in doc/options.md).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import sentencepiece as spm
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFJson

SPACE_MARK = "\u2581"  # SentencePiece's internal spelling of " "
SPM_FILE, HF_FILE, HF_CONFIG = "tokenizer.model", "tokenizer.json", "tokenizer_config.json"
# A Hugging Face tokenizer's files besides tokenizer.json, copied with it (those its directory has).
HF_COMPANIONS = (HF_CONFIG, "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
                 "chat_template.json", "vocab.json", "merges.txt")
NUM_RESERVED = 4 + 1 + 256  # unk/bos/eos/pad + newline + byte pieces: the smallest vocabulary that encodes anything
SPM_OPTIONS = dict(  # SentencePieceTrainer options besides the input, output, vocab_size and threads
    model_type="bpe",
    byte_fallback=True,
    character_coverage=0.9995,  # rarer characters go to byte pieces instead of taking vocabulary slots
    normalization_rule_name="identity",
    remove_extra_whitespaces=False,
    add_dummy_prefix=False,
    allow_whitespace_only_pieces=True,  # runs of indentation become single pieces
    split_digits=True,
    user_defined_symbols=["\n"],  # training sees lines; newlines in encoded text get one id
    unk_id=0,
    bos_id=1,
    eos_id=2,
    pad_id=3,
    minloglevel=2,  # quiet
)


def _training_lines(texts_or_files: Iterable[str | os.PathLike], max_bytes: int) -> Iterator[str]:
    """Non-empty lines of the inputs (str = text, PathLike = UTF-8 file), stopping after `max_bytes` bytes."""
    seen = 0
    for item in texts_or_files:
        text = Path(item).read_text(encoding="utf-8", errors="replace") if isinstance(item, os.PathLike) else item
        for line in text.split("\n"):
            if not line:
                continue
            yield line
            seen += len(line.encode("utf-8")) + 1
            if seen >= max_bytes:
                return


class Tokenizer:
    """A trained SentencePiece model loaded from its `.model` file.

    Attributes:
        path: the model file.
        vocab_size: number of ids; every id from `encode` is in [0, vocab_size).
        bos_id, eos_id, pad_id: special ids (never produced by `encode`).
        eod_id: the end-of-document id written between documents (equal to `eos_id`).
        sha256: hex digest of the model file, stored in data indexes to detect a mismatched tokenizer.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"tokenizer model {self.path} does not exist (train one with `python data.py "
                                    "train-tokenizer`)")
        proto = self.path.read_bytes()
        try:
            if not proto:  # SentencePiece loads an empty file as a model of no pieces
                raise RuntimeError("empty")
            self.sp = spm.SentencePieceProcessor(model_proto=proto)
        except RuntimeError:
            raise ValueError(f"{self.path} is not a SentencePiece model file (.model); pass the tokenizer that "
                             "data.py trained (DATA_DIR/tokenizer.model)") from None
        self.sha256 = hashlib.sha256(proto).hexdigest()
        self.vocab_size: int = self.sp.vocab_size()
        self.bos_id: int = self.sp.bos_id()
        self.eos_id: int = self.sp.eos_id()
        self.pad_id: int = self.sp.pad_id()
        self.eod_id: int = self.eos_id
        # U+2581 spelled as byte pieces (see the module docstring).
        self._space_mark_ids = [self.sp.piece_to_id(f"<0x{b:02X}>") for b in SPACE_MARK.encode("utf-8")]

    @classmethod
    def train(
        cls,
        texts_or_files: Iterable[str | os.PathLike],
        vocab_size: int,
        model_prefix: str | os.PathLike,
        max_train_bytes: int = 8_000_000,
        num_threads: int | None = None,
    ) -> Tokenizer:
        """Train a BPE model and write it to `{model_prefix}.model` (atomically); return it loaded.

        Args:
            texts_or_files: documents; a `str` item is text, an `os.PathLike` item is a UTF-8 file to read.
            vocab_size: exact size of the vocabulary, > 261 (specials + newline + 256 byte pieces).
            model_prefix: output path without the `.model` suffix (SentencePiece convention).
            max_train_bytes: only the first this-many bytes of non-empty lines are used, which keeps training
                to seconds (about 1 s for 8 MB of code at 8k vocab on 2 cores). Shuffle ordered inputs first.
            num_threads: trainer threads (default: all cores).
        """
        if vocab_size <= NUM_RESERVED:
            raise ValueError(f"vocab_size={vocab_size} is too small: byte fallback needs more than {NUM_RESERVED} "
                             "ids (4 specials, newline, 256 bytes)")
        lines = list(_training_lines(texts_or_files, max_train_bytes))
        if not lines:
            raise ValueError("no training text: the inputs have no non-empty lines")
        model = io.BytesIO()
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(lines),
                model_writer=model,
                vocab_size=vocab_size,
                num_threads=num_threads or os.cpu_count() or 1,
                **SPM_OPTIONS,
            )
        except RuntimeError as e:  # e.g. "Vocabulary size is smaller than required_chars" for a tiny vocabulary
            raise ValueError(f"SentencePiece could not train a vocabulary of {vocab_size}: {e}") from e
        path = Path(f"{os.fspath(model_prefix)}.model")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(model.getvalue())
        os.replace(tmp, path)
        return cls(path)

    def encode(self, text: str) -> list[int]:
        """Ids of `text`, without bos/eos."""
        if SPACE_MARK not in text:
            return self.sp.encode(text)
        ids: list[int] = []
        for i, part in enumerate(text.split(SPACE_MARK)):
            if i:
                ids += self._space_mark_ids
            ids += self.sp.encode(part)
        return ids

    def encode_batch(self, texts: list[str], num_threads: int | None = None) -> list[list[int]]:
        """`[encode(t) for t in texts]`, with SentencePiece's C++ threads for the common case."""
        if any(SPACE_MARK in t for t in texts):
            return [self.encode(t) for t in texts]
        return self.sp.encode(texts, num_threads=num_threads or os.cpu_count() or 1)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; special ids (bos/eos/pad) decode to nothing."""
        return self.sp.decode(list(ids))

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"

    def to_hf(self) -> HFJson:
        """This tokenizer as a `tokenizers.Tokenizer` (see the module docstring for what it encodes alike)."""
        sp, n = self.sp, self.sp.vocab_size()
        vocab = {sp.id_to_piece(i): i for i in range(n)}
        special = [i for i in range(n) if sp.is_control(i) or sp.is_unknown(i)]
        merges = []  # (rank: the id of the piece made, left id, right id, left, right)
        for piece, i in vocab.items():
            if len(piece) > 1 and not sp.is_byte(i) and i not in special and piece != "\n":
                merges += [(i, vocab[piece[:k]], vocab[piece[k:]], piece[:k], piece[k:]) for k in range(1, len(piece))
                           if piece[:k] in vocab and piece[k:] in vocab]
        merges.sort()
        hf = HFJson(models.BPE(vocab=vocab, merges=[(left, right) for *_, left, right in merges],
                                   unk_token=sp.id_to_piece(sp.unk_id()), byte_fallback=True, fuse_unk=True))
        hf.normalizer = normalizers.Replace(" ", SPACE_MARK)
        hf.pre_tokenizer = pre_tokenizers.Split(Regex(f"{SPACE_MARK}+[^{SPACE_MARK}]*|[^{SPACE_MARK}]+"), "isolated")
        hf.decoder = decoders.Sequence([decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()])
        hf.add_special_tokens([AddedToken(sp.id_to_piece(i), special=True, normalized=False) for i in special])
        hf.add_tokens([AddedToken("\n", special=False, normalized=False)])
        hf.encode_special_tokens = True
        return hf

    def save(self, directory: Path, model_max_length: int | None = None) -> None:
        """Write this tokenizer into `directory`: the `.model` file as tokenizer.model, and for Hugging Face tools
        tokenizer.json (`to_hf`), tokenizer_config.json and special_tokens_map.json."""
        shutil.copyfile(self.path, directory / SPM_FILE)
        self.to_hf().save(str(directory / HF_FILE))
        sp = self.sp
        tokens = {"eos_token": sp.id_to_piece(self.eos_id), "unk_token": sp.id_to_piece(sp.unk_id()),
                  **({"pad_token": sp.id_to_piece(self.pad_id)} if self.pad_id >= 0 else {})}
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, **tokens,
                  "add_bos_token": False, "add_eos_token": False, "split_special_tokens": True,
                  "clean_up_tokenization_spaces": False, "model_max_length": model_max_length or 10**30}
        (directory / HF_CONFIG).write_text(json.dumps(config, indent=1) + "\n")
        (directory / "special_tokens_map.json").write_text(json.dumps(tokens, indent=1) + "\n")

    @property
    def is_own(self) -> bool:
        """Whether this is a tokenizer `train` made (ids 0-3 unk/bos/eos/pad, 4 the newline), not a released
        model's SentencePiece file (whose normalisation `to_hf` does not reproduce)."""
        return self.pad_id == 3 and self.sp.id_to_piece(4) == "\n"

    def pieces(self) -> list[str]:
        """The vocabulary: the piece of every id."""
        return [self.sp.id_to_piece(i) for i in range(self.vocab_size)]

    def record(self) -> dict:
        """What a checkpoint or export says of the tokenizer it holds: file, sha256, vocab_size, special ids."""
        return {"file": SPM_FILE, "sha256": self.sha256, "vocab_size": self.vocab_size, "eos_id": self.eos_id,
                "bos_id": self.bos_id, "pad_id": self.pad_id}


class HFTokenizer:
    """A Hugging Face `tokenizer.json` (a released model's tokenizer, e.g. Qwen3's or Llama's), with the attributes
    and methods of `Tokenizer`. The end-of-document id `eod_id` is the `eos_token` of the `tokenizer_config.json`
    beside it (else `<|endoftext|>`, `</s>` or `<|end_of_text|>` when the vocabulary has one); nothing is added to
    encoded text (no bos)."""

    EOD_FALLBACKS = ("<|endoftext|>", "</s>", "<|end_of_text|>")

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"tokenizer file {self.path} does not exist")
        data = self.path.read_bytes()
        try:
            self.tk = HFJson.from_str(data.decode("utf-8"))
        except Exception as e:
            raise ValueError(f"{self.path} is not a Hugging Face tokenizer.json ({e})") from None
        self.sha256 = hashlib.sha256(data).hexdigest()
        self.vocab_size: int = self.tk.get_vocab_size(with_added_tokens=True)
        self.eod_id = self.eos_id = self._eod_id()
        self.bos_id = self.pad_id = -1

    @functools.cached_property
    def chat_template(self) -> str | None:
        """The Jinja chat template beside the tokenizer (chat_template.jinja, chat_template.json, or
        tokenizer_config.json's "chat_template"; of a list of named templates, "default"), or None."""
        if (file := self.path.parent / "chat_template.jinja").is_file():
            return file.read_text()
        template = None
        for name in ("chat_template.json", HF_CONFIG):
            if template is None and (self.path.parent / name).is_file():
                template = json.loads((self.path.parent / name).read_text()).get("chat_template")
        if isinstance(template, list):
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        return template if isinstance(template, str) else None

    @functools.cached_property
    def special_tokens(self) -> dict[str, str]:
        """The special-token strings of tokenizer_config.json (bos_token, eos_token, ...), for chat templates."""
        config_file = self.path.parent / HF_CONFIG
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        found = {key: value.get("content") if isinstance(value, dict) else value for key, value in config.items()
                 if key.endswith("_token")}
        return {key: value for key, value in found.items() if isinstance(value, str)}

    def _eod_id(self) -> int:
        eos = self.special_tokens.get("eos_token")
        names = [eos] if eos is not None else list(self.EOD_FALLBACKS)
        for name in names:
            if (token := self.tk.token_to_id(name)) is not None:
                return token
        raise ValueError(f"{self.path}: no end-of-document token among {names}; add a tokenizer_config.json with "
                         "its eos_token beside it")

    def encode(self, text: str) -> list[int]:
        return self.tk.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str], num_threads: int | None = None) -> list[list[int]]:
        return [e.ids for e in self.tk.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"

    def save(self, directory: Path, model_max_length: int | None = None) -> None:
        """Write this tokenizer into `directory`: tokenizer.json and the files beside it (HF_COMPANIONS), or a
        tokenizer_config.json naming its eos token when it came alone."""
        shutil.copyfile(self.path, directory / HF_FILE)
        for name in HF_COMPANIONS:
            if (self.path.parent / name).is_file():
                shutil.copyfile(self.path.parent / name, directory / name)
        if not (directory / HF_CONFIG).is_file():
            config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
                      "eos_token": self.tk.id_to_token(self.eos_id), "model_max_length": model_max_length or 10**30}
            (directory / HF_CONFIG).write_text(json.dumps(config, indent=1) + "\n")

    def pieces(self) -> list[str]:
        """The vocabulary: the token of every id."""
        return [self.tk.id_to_token(i) for i in range(self.vocab_size)]

    def record(self) -> dict:
        """What a checkpoint or export says of the tokenizer it holds: file, sha256, vocab_size, special ids."""
        return {"file": HF_FILE, "sha256": self.sha256, "vocab_size": self.vocab_size, "eos_id": self.eos_id,
                "bos_id": self.bos_id, "pad_id": self.pad_id}


@functools.lru_cache(maxsize=4)
def _compiled(template: str) -> Callable[..., str]:
    """The render function of a chat template, in the sandboxed Jinja environment transformers uses."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(f"a chat template stopped: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render


def chat_turn(tokenizer: Tokenizer | HFTokenizer, prompt: str, response: str) -> tuple[str, str]:
    """(context, target) texts of a prompt/response pair: through the tokenizer's chat template when it has one (a
    user turn with the generation prompt, then the assistant turn's remaining text, its end marker included, as
    transformers' `apply_chat_template` renders them, with the tokenizer's special-token strings), else the two texts
    as they are."""
    template = getattr(tokenizer, "chat_template", None)
    if template is None:
        return prompt, response
    render, tokens = _compiled(template), tokenizer.special_tokens
    user = [{"role": "user", "content": prompt}]
    context = render(messages=user, add_generation_prompt=True, **tokens)
    whole = render(messages=[*user, {"role": "assistant", "content": response}], add_generation_prompt=False,
                   **tokens)
    if not whole.startswith(context):
        raise ValueError(f"{tokenizer.path}'s chat template renders the reply's turn with a prompt other than the "
                         "generation prompt: prompt/response data cannot be split with it")
    return context, whole[len(context):]


def tokenizer_file(directory: Path) -> Path | None:
    """The tokenizer a directory holds (a run's output, a released model): a tokenizer.model that this project
    trained (`Tokenizer.is_own`: a tokenizer.json beside it is a copy for other tools); else tokenizer.json (a
    released model's, even beside its own SentencePiece file); else a tokenizer.model; None when it has neither."""
    spm_file, hf_file = directory / SPM_FILE, directory / HF_FILE
    if spm_file.is_file() and not hf_file.is_file():
        return spm_file
    with contextlib.suppress(ValueError):  # a tokenizer.model that is not SentencePiece's (tiktoken's)
        if spm_file.is_file() and Tokenizer(spm_file).is_own:
            return spm_file
    return hf_file if hf_file.is_file() else None


def same_vocabulary(a: Tokenizer | HFTokenizer, b: Tokenizer | HFTokenizer) -> bool:
    """Whether two tokenizers give every id the same piece and have the same end-of-document id (the same file,
    or the project's SentencePiece model and the tokenizer.json made from it)."""
    return a.sha256 == b.sha256 or (a.eod_id == b.eod_id and a.pieces() == b.pieces())


def load_tokenizer(path: str | os.PathLike) -> Tokenizer | HFTokenizer:
    """The tokenizer at `path`: a Hugging Face tokenizer.json (by its .json suffix), a SentencePiece .model, or a
    directory that holds one (`tokenizer_file`). FileNotFoundError naming --tokenizer when there is none."""
    path = Path(path)
    if path.is_dir():
        if (found := tokenizer_file(path)) is None:
            raise FileNotFoundError(f"{path} holds no tokenizer ({SPM_FILE} or {HF_FILE}): pass --tokenizer FILE, "
                                    "the tokenizer it was trained with")
        path = found
    return HFTokenizer(path) if path.suffix == ".json" else Tokenizer(path)


def model_tokenizer(model: str | os.PathLike, given: str | os.PathLike | None = None,
                    fallbacks: Iterable[str | os.PathLike | None] = ()) -> Tokenizer | HFTokenizer:
    """The tokenizer of the model stored at `model` (any layout weights.load_model reads): `given` (--tokenizer; it
    must read as the one stored with the model, when there is one), else the one stored with it (its directory, or
    that of its .safetensors file), else the first of `fallbacks` that exists (e.g. a run's, its data's).
    FileNotFoundError naming --tokenizer when there is none."""
    home = Path(model) if Path(model).is_dir() else Path(model).parent
    if given:
        if not Path(given).exists():
            raise FileNotFoundError(f"--tokenizer {given} does not exist")
        tokenizer = load_tokenizer(given)
        if (own := tokenizer_file(home)) and not same_vocabulary(tokenizer, stored := load_tokenizer(own)):
            raise ValueError(f"--tokenizer {given} ({tokenizer.vocab_size} tokens) is not {stored.path} "
                             f"({stored.vocab_size} tokens), the tokenizer stored with the model: leave --tokenizer "
                             "out")
        return tokenizer
    for candidate in (tokenizer_file(home), *fallbacks):
        if candidate and Path(candidate).exists():
            return load_tokenizer(candidate)
    raise FileNotFoundError(f"no tokenizer found for {model}: pass --tokenizer (a .model, a tokenizer.json or a "
                            "directory holding one)")


def check_vocab(tokenizer: Tokenizer | HFTokenizer, model_vocab_size: int) -> None:
    """Raise ValueError unless every id of `tokenizer` is a valid row of a `model_vocab_size` embedding.

    A model vocabulary larger than the tokenizer's is fine (e.g. padded to a multiple of 64).
    """
    if tokenizer.vocab_size > model_vocab_size:
        raise ValueError(f"tokenizer {tokenizer.path} has {tokenizer.vocab_size} tokens but the model's vocab_size is "
                         f"{model_vocab_size}: ids >= {model_vocab_size} have no embedding row; train a tokenizer "
                         f"with vocab_size <= {model_vocab_size} or set the model's vocab_size >= "
                         f"{tokenizer.vocab_size}")
