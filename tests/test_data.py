"""Tokenizer, corpus reading and preparation, the batch loader (tokenizer.py, corpus.py, data.py). A few seconds
on CPU.

Loader tests use a synthetic stream whose token at stream position p is p itself (uint32 shards), so every
yielded id tells exactly where in the stream it came from.
"""

import json

import numpy as np
import pytest
import torch

from data import main
from text.corpus import Document, stdlib_files
from text.shards import (
    INDEX_NAME,
    ShardWriter,
    TokenLoader,
    _batches,
    check_tokenizer,
    load_index,
    prepare,
    validation_dir,
)
from text.tokenizer import SPACE_MARK, HFTokenizer, Tokenizer, chat_turn, check_vocab

# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def train_files():
    """~150 kB of stdlib code: enough for a 400-token BPE vocabulary, trained in well under a second."""
    return [p for p in stdlib_files() if p.name in {"textwrap.py", "string.py", "shlex.py", "bisect.py",
                                                      "heapq.py", "glob.py", "fnmatch.py", "random.py"}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory, train_files):
    return Tokenizer.train(train_files, vocab_size=400, model_prefix=tmp_path_factory.mktemp("tok") / "tiny")


def write_position_stream(path, num_tokens, shard_tokens=1000):
    """A data dir whose stream is 0, 1, ..., num_tokens-1 (uint32: vocab 2**20), cut into small shards."""
    writer = ShardWriter(path, vocab_size=2**20, shard_tokens=shard_tokens)
    writer.write(np.arange(num_tokens))
    return writer.finish()


@pytest.fixture
def stream_dir(tmp_path):
    T = 64
    write_position_stream(tmp_path, num_tokens=120 * (T - 1) + 1)  # exactly 120 windows of T = 64
    return tmp_path


def take(loader, n):
    return [next(loader) for _ in range(n)]


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip_any_text(tok):
    rng = np.random.default_rng(0)
    code_points = rng.integers(0, 0x110000 - 0x800, size=2000)
    code_points[code_points >= 0xD800] += 0x800  # skip the surrogate block: not valid Unicode text
    texts = [
        "def f(x):\n    return x  # indented code\n\n\n\tend\r\n",
        "héllo wörld 日本語 🤖 \x00\x01\x7f \ufeff a\u0301 \U0010ffff",
        f"{SPACE_MARK} a{SPACE_MARK}{SPACE_MARK}b {SPACE_MARK}",  # SentencePiece's own space mark
        "".join(map(chr, code_points)),
        bytes(rng.integers(0, 256, size=3000, dtype=np.uint8)).decode("utf-8", errors="replace"),
        "",
        "   ",
    ]
    for text in texts:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert 0 not in ids  # byte fallback: never <unk>
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]


def test_tokenizer_save_load_and_special_ids(tok, train_files):
    loaded = Tokenizer(tok.path)
    text = train_files[0].read_text()
    assert loaded.encode(text) == tok.encode(text)
    assert loaded.sha256 == tok.sha256
    assert (loaded.vocab_size, loaded.bos_id, loaded.eos_id, loaded.pad_id, loaded.eod_id) == (400, 1, 2, 3, 2)
    assert len(tok.encode(text)) < 0.8 * len(text)  # merges were learned (~0.7 tokens per character here)
    assert not {tok.bos_id, tok.eos_id, tok.pad_id} & set(tok.encode(text))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer(tok.path.with_name("missing.model"))


def test_a_file_that_is_not_a_sentencepiece_model_is_refused(tmp_path):
    file = tmp_path / "tokenizer.json"
    file.write_text('{"model": {"type": "BPE"}}')
    with pytest.raises(ValueError, match=r"tokenizer.json is not a SentencePiece model file"):
        Tokenizer(file)


def test_check_vocab(tok):
    check_vocab(tok, 400)
    check_vocab(tok, 512)  # a padded model vocabulary is fine
    with pytest.raises(ValueError, match=r"400 tokens.*vocab_size is 399"):
        check_vocab(tok, 399)


def test_train_rejects_vocab_without_room_for_bytes(tmp_path):
    with pytest.raises(ValueError, match="too small"):
        Tokenizer.train(["abc"], vocab_size=261, model_prefix=tmp_path / "t")
    with pytest.raises(ValueError, match="no training text"):
        Tokenizer.train(["", "\n\n"], vocab_size=300, model_prefix=tmp_path / "t")
    many_chars = "".join(map(chr, range(0x4E00, 0x4E00 + 100)))  # 100 characters that each need a vocabulary slot
    with pytest.raises(ValueError, match="could not train a vocabulary of 300.*required_chars"):
        Tokenizer.train([(many_chars + "\n") * 20], vocab_size=300, model_prefix=tmp_path / "t")


# ---------------------------------------------------------------- prepare


@pytest.fixture
def small_corpus(tmp_path, train_files):
    """A .txt file, a directory with .md/.jsonl/.py files (and an ignored .bin), an explicit .jsonl file."""
    docs = {"a": train_files[1].read_text(), "b": "# notes\n\nSome *markdown* ✓\n", "c1": "first record ▁",
            "c2": "second\nrecord", "d": train_files[2].read_text()}
    (tmp_path / "a.txt").write_text(docs["a"])
    sub = tmp_path / "dir"
    (sub / "nested").mkdir(parents=True)
    (sub / "b.md").write_text(docs["b"])
    (sub / "nested" / "c.jsonl").write_text(
        json.dumps({"text": docs["c1"], "id": 1}) + "\n\n" + json.dumps({"text": docs["c2"]}) + "\n")
    (sub / "nested" / "empty.py").write_text("")  # empty documents are skipped
    (sub / "ignored.bin").write_bytes(b"\x00\xff")
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": docs["d"]}) + "\n")
    inputs = [tmp_path / "a.txt", sub, tmp_path / "d.jsonl"]
    return inputs, [docs[k] for k in ("a", "b", "c1", "c2", "d")]


def read_stream(data_dir):
    index = load_index(data_dir)
    return np.concatenate([np.fromfile(data_dir / s["file"], dtype=index["dtype"]) for s in index["shards"]])


def test_prepare_txt_jsonl_directory(tok, small_corpus, tmp_path):
    inputs, docs = small_corpus
    out = tmp_path / "out"
    index = prepare(inputs, tok, out, shard_tokens=1000, progress=False, validation_fraction=0)
    stream = read_stream(out)
    expected = np.concatenate([[*tok.encode(d), tok.eod_id] for d in docs])
    np.testing.assert_array_equal(stream, expected)
    assert [tok.decode(d) for d in np.split(stream, np.flatnonzero(stream == tok.eod_id) + 1)[:-1]] == docs
    assert index["dtype"] == "uint16" and index["vocab_size"] == 400 and index["eod_id"] == tok.eod_id
    assert index["num_documents"] == 5 and index["num_tokens"] == len(stream)
    assert len(index["shards"]) == -(-len(stream) // 1000) > 1
    assert index["tokenizer"]["sha256"] == tok.sha256
    assert not list(out.glob("*.tmp"))  # atomic writes leave no temporaries
    assert load_index(out) == index

    with pytest.raises(FileExistsError, match="overwrite"):
        prepare(inputs, tok, out, progress=False)
    index2 = prepare(inputs[:1], tok, out, overwrite=True, progress=False, validation_fraction=0)
    assert sorted(p.name for p in out.iterdir()) == [INDEX_NAME, "shard_00000.bin"]
    assert index2["num_documents"] == 1


def test_a_killed_prepare_with_this_process_id_leaves_nothing_behind(tok, small_corpus, tmp_path):
    """A staging directory left by a killed prepare whose process id this one now has (ids repeat) is cleared before
    staging: none of its files reaches the prepared directory."""
    import os

    leftover = tmp_path / f".out.preparing-{os.getpid()}"
    leftover.mkdir()
    (leftover / "shard_00007.bin").write_bytes(b"\0" * 8)
    prepare(small_corpus[0], tok, tmp_path / "out", progress=False, validation_fraction=0)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [INDEX_NAME, "shard_00000.bin"]
    assert not leftover.exists()


def test_prepare_cli(tok, small_corpus, tmp_path, capsys):
    inputs, docs = small_corpus
    main(["train-tokenizer", "--input", *map(str, inputs), "--vocab_size", "420", "--model_prefix",
          str(tmp_path / "cli_tok")])
    main(["prepare", "--input", *map(str, inputs), "--tokenizer", str(tmp_path / "cli_tok.model"), "--out_dir",
          str(tmp_path / "cli_out")])
    assert "4 documents" in capsys.readouterr().out  # and 1 held out (1 in 100, at least one)
    assert load_index(tmp_path / "cli_out")["vocab_size"] == 420


def test_prepare_batches_keep_order_and_byte_counts():
    docs = [(Document(text), size) for text, size in [("a", 5), ("", 3), ("b", 4), ("c", 1), ("", 2)]]
    batches = list(_batches(iter(docs), max_bytes=8))
    assert batches == [([Document("a")], 8), ([Document("b"), Document("c")], 7)]  # empty: dropped, bytes counted


def test_prepare_parquet_reads_its_rows_as_the_jsonl_records(tok, small_corpus, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    _, docs = small_corpus
    pq.write_table(pa.table({"text": docs, "id": list(range(len(docs)))}), tmp_path / "docs.parquet",
                   row_group_size=2)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    for name in ("docs.parquet", "docs.jsonl"):
        prepare([tmp_path / name], tok, tmp_path / name.replace(".", "_"), progress=False, validation_fraction=0)
    np.testing.assert_array_equal(read_stream(tmp_path / "docs_parquet"), read_stream(tmp_path / "docs_jsonl"))
    with pytest.raises(ValueError, match="has no column 'body'"):
        prepare([tmp_path / "docs.parquet"], tok, tmp_path / "other", text_field="body", progress=False)


def test_a_binary_or_non_utf8_file_is_refused_unless_replaced(tok, tmp_path, capsys):
    (tmp_path / "latin1.txt").write_bytes("café au lait\n".encode("latin-1"))
    (tmp_path / "binary.txt").write_bytes(b"PAR1\x00\x15\x04 data")
    for name in ("latin1.txt", "binary.txt"):
        with pytest.raises(ValueError, match=f"{name} is not UTF-8 text .*--errors replace"):
            prepare([tmp_path / name], tok, tmp_path / "out", progress=False)
    index = prepare([tmp_path / "latin1.txt"], tok, tmp_path / "out", progress=False, validation_fraction=0,
                    errors="replace")
    assert index["replaced"] == {str(tmp_path / "latin1.txt"): 1}
    assert tok.decode(read_stream(tmp_path / "out")[:-1]) == "caf\ufffd au lait\n"
    with pytest.raises(SystemExit) as exit_info:
        main(["prepare", "--input", str(tmp_path / "binary.txt"), "--tokenizer", str(tok.path), "--out_dir",
              str(tmp_path / "cli")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "binary.txt is not UTF-8 text" in err and "Traceback" not in err
    main(["prepare", "--input", str(tmp_path / "latin1.txt"), "--tokenizer", str(tok.path), "--out_dir",
          str(tmp_path / "cli"), "--errors", "replace", "--validation_fraction", "0"])
    assert "latin1.txt: 1 invalid UTF-8 sequences read as U+FFFD" in capsys.readouterr().out


def test_prompt_response_records_train_on_the_responses_only(tok, tmp_path):
    pairs = [("What is 2 + 2?", " 4"), ("Name a colour.", " Blue, like the sky."), ("Say hi.", " hi")]
    records = [{"prompt": p, "response": r} for p, r in pairs] + [{"prompt": "", "response": "no prompt"}]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    index = prepare([tmp_path / "chat.jsonl"], tok, tmp_path / "out", progress=False, validation_fraction=0)
    out = tmp_path / "out"
    ids = read_stream(out)
    mask = np.concatenate([np.fromfile(out / s["mask"], dtype=np.uint8) for s in index["shards"]])
    expected_ids, expected_mask = [], []
    for prompt, response in [*pairs, ("", "no prompt")]:
        context, target = tok.encode(prompt), [*tok.encode(response), tok.eod_id]
        expected_ids += context + target
        expected_mask += [0] * len(context) + [1] * len(target)
    np.testing.assert_array_equal(ids, expected_ids)
    np.testing.assert_array_equal(mask, expected_mask)
    T = 8
    loader = TokenLoader(out, T, 2)
    for _ in range(loader.steps_per_epoch):
        input_ids, labels = next(loader)
        for row_ids, row_labels in zip(input_ids, labels, strict=True):
            start = next(w for w in range(len(ids)) if np.array_equal(ids[w * (T - 1):w * (T - 1) + T], row_ids))
            window_mask = torch.from_numpy(mask[start * (T - 1):start * (T - 1) + T].astype(bool))
            assert torch.equal(row_labels, row_ids.masked_fill(~window_mask, -100))


def test_masks_reach_the_validation_labels_and_mixed_files_are_refused(tok, tmp_path):
    from evaluation.loss import validation_windows

    pairs = [{"prompt": f"Question {i}: what is {i} + {i}?", "response": f" {2 * i}"} for i in range(40)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    prepare([tmp_path / "chat.jsonl"], tok, tmp_path / "out", progress=False, validation_fraction=0.25)
    ids, labels = validation_windows(tmp_path / "out", 16, 64)
    assert ((labels == -100) | (labels == ids)).all() and (labels == -100).any() and (labels != -100).any()
    (tmp_path / "mixed.jsonl").write_text(json.dumps({"text": "plain"}) + "\n" + json.dumps(pairs[0]) + "\n")
    with pytest.raises(ValueError, match="give each kind of record its own file"):
        prepare([tmp_path / "mixed.jsonl"], tok, tmp_path / "mixed", progress=False)


def test_a_chat_template_frames_prompt_and_response_as_transformers_does(qwen3, tmp_path):
    transformers = pytest.importorskip("transformers")
    chatml = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
              "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    directory = tmp_path / "tok"
    directory.mkdir()
    (directory / "tokenizer.json").write_bytes((qwen3[0] / "tokenizer.json").read_bytes())
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>",
                                                                 "bos_token": "<|endoftext|>",
                                                                 "chat_template": chatml}))
    hf = HFTokenizer(directory / "tokenizer.json")
    context, target = chat_turn(hf, "What is 2 + 2?", "4")
    reference = transformers.AutoTokenizer.from_pretrained(directory)
    user = [{"role": "user", "content": "What is 2 + 2?"}]
    assert context == reference.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    assert context.startswith("<|endoftext|><|im_start|>user")
    assert context + target == reference.apply_chat_template([*user, {"role": "assistant", "content": "4"}],
                                                             tokenize=False)
    assert chat_turn(Tokenizer.__new__(Tokenizer), "a", "b") == ("a", "b")  # no template: the texts as they are


def test_prepare_bad_inputs(tok, tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        prepare([tmp_path / "nope"], tok, tmp_path / "out", progress=False)
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ValueError, match="no input files"):
        prepare([tmp_path / "empty_dir"], tok, tmp_path / "out", progress=False)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"content": "no text field"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: .*'text'"):
        prepare([bad], tok, tmp_path / "out", progress=False)
    bad.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        prepare([bad], tok, tmp_path / "out", progress=False)


def test_stdlib_default_corpus():
    files = stdlib_files()
    names = {p.name for p in files}
    assert {"os.py", "inspect.py", "__init__.py"} <= names and len(files) > 300
    assert not any("site-packages" in p.parts or "test" in p.parts for p in files)


# ---------------------------------------------------------------- index validation


def test_load_index_errors(stream_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist.*data.py prepare"):
        TokenLoader(tmp_path / "missing", seq_len=64, batch_size=1)
    (tmp_path / "no_index").mkdir()
    with pytest.raises(FileNotFoundError, match="index.json not found"):
        TokenLoader(tmp_path / "no_index", seq_len=64, batch_size=1)

    index_path = stream_dir / INDEX_NAME
    good = index_path.read_text()
    index_path.write_text(good[:-20])
    with pytest.raises(ValueError, match="corrupt data index"):
        load_index(stream_dir)
    index = json.loads(good)
    for key, value in [("dtype", "uint16"), ("num_tokens", 5), ("format", 99)]:
        index_path.write_text(json.dumps({**index, key: value}))
        with pytest.raises(ValueError, match="corrupt data index"):
            load_index(stream_dir)
    index_path.write_text(good)

    shard = stream_dir / "shard_00003.bin"
    shard.write_bytes(shard.read_bytes()[:-4])  # truncated by one token
    with pytest.raises(ValueError, match="shard_00003.bin has 3996 bytes.*1000 uint32"):
        load_index(stream_dir)
    shard.unlink()
    with pytest.raises(FileNotFoundError, match="shard_00003.bin"):
        load_index(stream_dir)


def test_loader_rejects_other_tokenizer(tok, small_corpus, tmp_path, train_files):
    inputs, _ = small_corpus
    prepare(inputs, tok, tmp_path / "out", progress=False)
    TokenLoader(tmp_path / "out", seq_len=16, batch_size=2, tokenizer=tok)
    other = Tokenizer.train(train_files[:3], vocab_size=380, model_prefix=tmp_path / "other")
    with pytest.raises(ValueError, match=r"vocab_size 400.*vocab_size 380"):
        TokenLoader(tmp_path / "out", seq_len=16, batch_size=2, tokenizer=other)
    with pytest.raises(ValueError, match="records no tokenizer"):
        check_tokenizer({"vocab_size": 400}, tok)


# ---------------------------------------------------------------- loader


def test_loader_windows_cover_stream_exactly_once(stream_dir):
    T, B = 64, 4
    loader = TokenLoader(stream_dir, seq_len=T, batch_size=B, seed=1)
    assert (loader.num_windows, loader.steps_per_epoch) == (120, 30)
    targets = []
    for input_ids, labels in take(loader, loader.steps_per_epoch):
        assert input_ids.shape == (B, T) and input_ids.dtype == torch.long
        assert torch.equal(input_ids, labels) and input_ids.data_ptr() != labels.data_ptr()
        starts = input_ids[:, :1]  # (B, 1)
        assert torch.equal(input_ids, starts + torch.arange(T))  # contiguous stream slices, across shards too
        assert (starts % (T - 1) == 0).all()
        targets.append(labels[:, 1:].flatten())  # what the model predicts: labels[t + 1] at position t
    # every stream token except the first is a target exactly once per epoch
    assert torch.equal(torch.cat(targets).sort().values, torch.arange(1, 120 * (T - 1) + 1))


def test_loader_ranks_disjoint_and_same_global_batches(stream_dir):
    T = 64
    ranks = [TokenLoader(stream_dir, seq_len=T, batch_size=3, rank=r, world_size=2, seed=7) for r in range(2)]
    single = TokenLoader(stream_dir, seq_len=T, batch_size=6, seed=7)
    assert ranks[0].steps_per_epoch == single.steps_per_epoch == 20
    seen = [[], []]
    for _ in range(20):
        per_rank = [next(loader)[0][:, 0] // (T - 1) for loader in ranks]  # window ids, (3,) each
        for r in range(2):
            seen[r] += per_rank[r].tolist()
        assert torch.equal(torch.cat(per_rank), next(single)[0][:, 0] // (T - 1))
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == list(range(120))


def test_loader_deterministic_and_reshuffles_each_epoch(stream_dir):
    def epoch_windows(loader):
        return torch.cat([x[:, 0] // 63 for x, _ in take(loader, loader.steps_per_epoch)])

    a, b = (TokenLoader(stream_dir, seq_len=64, batch_size=4, seed=3) for _ in range(2))
    first = epoch_windows(a)
    assert torch.equal(first, epoch_windows(b))
    second = epoch_windows(a)
    assert a.epoch == 1 and not torch.equal(first, second)
    assert torch.equal(first.sort().values, second.sort().values)
    other_seed = TokenLoader(stream_dir, seq_len=64, batch_size=4, seed=4)
    assert not torch.equal(first, epoch_windows(other_seed))


@pytest.mark.parametrize("steps_before", [0, 7, 30, 31, 65])  # 30 steps per epoch: boundaries included
def test_loader_resume_exact(stream_dir, steps_before):
    original = TokenLoader(stream_dir, seq_len=64, batch_size=4, seed=5)
    take(original, steps_before)
    state = json.loads(json.dumps(original.state_dict()))  # survives a JSON / checkpoint round trip
    expected = take(original, 40)
    resumed = TokenLoader(stream_dir, seq_len=64, batch_size=4, seed=5)
    resumed.load_state_dict(state)
    for (x, y), (rx, ry) in zip(expected, take(resumed, 40), strict=True):
        assert torch.equal(x, rx) and torch.equal(y, ry)


def test_loader_resume_with_other_world_size(stream_dir):
    single = TokenLoader(stream_dir, seq_len=64, batch_size=4, seed=2)
    take(single, 9)  # 36 windows consumed: 6 global batches of 2 ranks x 3
    state = single.state_dict()
    ranks = [TokenLoader(stream_dir, seq_len=64, batch_size=3, rank=r, world_size=2, seed=2) for r in range(2)]
    for loader in ranks:
        loader.load_state_dict(state)
    resumed = torch.cat([torch.cat([next(loader)[0] for loader in ranks]) for _ in range(4)])  # 24 windows
    assert torch.equal(resumed, torch.cat([x for x, _ in take(single, 6)]))


def test_loader_bad_arguments_and_state(stream_dir):
    with pytest.raises(ValueError, match=r"fewer than one step's 122 \(batch size 61 x 2 data-parallel processes\): "
                                         r"pass --batch_size \d+ or less, a shorter --context_length, or prepare more"):
        TokenLoader(stream_dir, seq_len=64, batch_size=61, world_size=2)
    with pytest.raises(ValueError, match="rank 2"):
        TokenLoader(stream_dir, seq_len=64, batch_size=1, rank=2, world_size=2)
    loader = TokenLoader(stream_dir, seq_len=64, batch_size=4, seed=0)
    take(loader, 1)
    state = loader.state_dict()
    with pytest.raises(ValueError, match="seed=0 but this one has 1"):
        TokenLoader(stream_dir, seq_len=64, batch_size=4, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="seq_len=64 but this one has 32"):
        TokenLoader(stream_dir, seq_len=32, batch_size=4).load_state_dict(state)
    with pytest.raises(ValueError, match="not a whole number of global batches of 3"):
        TokenLoader(stream_dir, seq_len=64, batch_size=3).load_state_dict(state)


def test_validation_split_is_disjoint_deterministic_and_optional(tok, small_corpus, tmp_path):
    """Documents 0, k, 2k, ... go to validation/ and never into the training stream; the split is the same on every
    run; data prepared without a split still trains, and asking for its split says how to make one."""
    inputs, docs = small_corpus
    index = prepare(inputs, tok, tmp_path / "a", progress=False, validation_fraction=0.5)  # k = 2: docs 0, 2, 4
    train_docs = [tok.decode(d) for d in np.split(read_stream(tmp_path / "a"),
                                                  np.flatnonzero(read_stream(tmp_path / "a") == tok.eod_id) + 1)[:-1]]
    held = validation_dir(tmp_path / "a")
    held_docs = [tok.decode(d) for d in np.split(read_stream(held), np.flatnonzero(read_stream(held) == tok.eod_id)
                                                 + 1)[:-1]]
    assert held_docs == docs[0::2] and train_docs == docs[1::2] and not set(held_docs) & set(train_docs)
    assert index["validation"] == {"dir": "validation", "every": 2, "num_documents": 3,
                                   "num_tokens": len(read_stream(held))}
    assert load_index(held)["tokenizer"] == index["tokenizer"]
    prepare(inputs, tok, tmp_path / "b", progress=False, validation_fraction=0.5)
    assert (held / "shard_00000.bin").read_bytes() == (tmp_path / "b" / "validation" / "shard_00000.bin").read_bytes()
    old = prepare(inputs, tok, tmp_path / "old", progress=False, validation_fraction=0)  # the earlier layout
    assert "validation" not in old and next(TokenLoader(tmp_path / "old", 8, 1))[0].shape == (1, 8)
    with pytest.raises(FileNotFoundError, match="no validation split .* --overwrite"):
        validation_dir(tmp_path / "old")
