"""Tests for data/fineweb.py: local files -> shards, sharding logic, tokenizer loading."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import tiktoken

DATA_DIR = Path(__file__).resolve().parents[1] / "data"
if str(DATA_DIR) not in sys.path:
    sys.path.insert(0, str(DATA_DIR))

import fineweb  # noqa: E402
from fineweb import GPT2_PAT_STR, ShardWriter, tokenize_documents  # noqa: E402
from shards import BOS_ID as BOS, DataError, read_shard, validate_shard  # noqa: E402

BPE_FILE = Path(__file__).resolve().parents[2] / "shared/tokenizer/r50k_base.tiktoken"


def tiny_byte_encoding():
    """A byte-level tiktoken Encoding (ids 0..255 = bytes) with <|endoftext|> = 50256."""
    return tiktoken.Encoding(name="tiny-bytes", pat_str=GPT2_PAT_STR,
                             mergeable_ranks={bytes([i]): i for i in range(256)},
                             special_tokens={"<|endoftext|>": BOS})


def split_docs(tokens):
    """Split a token stream at BOS; every piece must start with BOS."""
    tokens = np.asarray(tokens)
    starts = np.flatnonzero(tokens == BOS)
    assert starts.size and starts[0] == 0, "stream must start with BOS"
    return [p[1:] for p in np.split(tokens, starts[1:])]


def read_all(paths):
    return np.concatenate([read_shard(p) for p in paths])


DOCS = ["Hello world.\nSecond line — with ünïcödé ✓.", "  leading spaces and trailing  ",
        "<|endoftext|> is plain text here", "x" * 57, "Numbers 12345 and tabs\tand\r\nCRLF"]


def write_inputs(tmp_path):
    (tmp_path / "in").mkdir()
    a = tmp_path / "in" / "a.txt"
    a.write_text(DOCS[0], encoding="utf-8")
    b = tmp_path / "in" / "b.jsonl"
    b.write_text("\n".join(json.dumps({"text": d, "id": i}) for i, d in enumerate(DOCS[1:4])) + "\n\n",
                 encoding="utf-8")
    c = tmp_path / "in" / "c.txt"
    c.write_bytes(DOCS[4].encode("utf-8"))
    return [a, b, c]


# --------------------------------------------------------------------------- sharding logic

def test_shard_writer_straddles_and_names(tmp_path):
    w = ShardWriter(tmp_path, "pre", shard_size=10)
    docs = [np.array([BOS] + list(range(1, n)), dtype=np.uint16) for n in (4, 7, 15, 2, 3)]
    for d in docs:
        w.add(d)
    paths = w.close()
    total = sum(d.size for d in docs)  # 31
    assert [p.name for p in paths] == ["pre_val_000000.bin", "pre_train_000001.bin",
                                       "pre_train_000002.bin", "pre_train_000003.bin"]
    assert [validate_shard(p) for p in paths] == [10, 10, 10, 1]
    np.testing.assert_array_equal(read_all(paths), np.concatenate(docs))
    assert w.total_tokens == total
    assert w.close() == paths  # idempotent


def test_shard_writer_exact_multiple_and_split_names(tmp_path):
    w = ShardWriter(tmp_path, "n", shard_size=5, split="train", start_index=1)
    w.add(np.arange(10, dtype=np.uint16))
    paths = w.close()
    assert [p.name for p in paths] == ["n_train_000001.bin", "n_train_000002.bin"]
    assert ShardWriter(tmp_path / "empty", "n", 5).close() == []


def test_main_sharding_with_tiny_encoding(tmp_path):
    enc = tiny_byte_encoding()
    files = write_inputs(tmp_path)
    out = tmp_path / "out"
    paths = fineweb.main(["--files", *map(str, files), "--out", str(out), "--prefix", "tiny",
                          "--shard_size", "64", "--workers", "1", "--quiet"], enc=enc)
    expected = [[BOS] + list(d.encode("utf-8")) for d in DOCS]
    flat = [t for d in expected for t in d]
    n = len(flat)
    sizes = [64] * (n // 64) + ([n % 64] if n % 64 else [])
    assert [validate_shard(p) for p in paths] == sizes
    assert paths[0].name == "tiny_val_000000.bin"
    assert [p.name for p in paths[1:]] == [f"tiny_train_{i:06d}.bin" for i in range(1, len(paths))]
    assert sorted(out.iterdir()) == sorted(paths)
    stream = read_all(paths)
    assert stream.tolist() == flat
    decoded = [enc.decode(d.tolist()) for d in split_docs(stream)]
    assert decoded == DOCS
    # some document straddles a shard boundary
    starts = np.cumsum([0] + [len(d) for d in expected])[:-1]
    assert any(s % 64 and (s // 64) != ((s + len(d) - 1) // 64) for s, d in zip(starts, expected))


def test_directory_separator_and_max_tokens(tmp_path):
    enc = tiny_byte_encoding()
    d = tmp_path / "dir"
    (d / "sub").mkdir(parents=True)
    (d / "one.txt").write_text("doc A\n\ndoc B\n\n", encoding="utf-8")
    (d / "sub" / "two.txt").write_text("doc C", encoding="utf-8")
    (d / "ignored.md").write_text("not read", encoding="utf-8")
    out = tmp_path / "out"
    paths = fineweb.main(["--files", str(d), "--separator", r"\n\n", "--out", str(out),
                          "--shard_size", "10", "--quiet"], enc=enc)
    stream = read_all(paths)
    assert [enc.decode(x.tolist()) for x in split_docs(stream)] == ["doc A", "doc B", "doc C"]
    assert [p.name for p in paths] == ["fineweb_val_000000.bin", "fineweb_train_000001.bin"]
    assert [validate_shard(p) for p in paths] == [10, 8]
    paths = fineweb.main(["--files", str(d), "--separator", r"\n\n", "--out", str(tmp_path / "o2"),
                          "--shard_size", "4", "--max_tokens", "9", "--quiet"], enc=enc)
    assert [validate_shard(p) for p in paths] == [4, 4, 1]


def test_multiprocessing_preserves_order():
    enc = tiny_byte_encoding()
    docs = [f"document number {i} " * (i % 7 + 1) for i in range(60)]
    got = list(tokenize_documents(docs, enc, workers=2, chunksize=4))
    want = list(tokenize_documents(docs, enc, workers=1))
    assert len(got) == len(want) == 60
    for g, w, d in zip(got, want, docs):
        assert g.dtype == np.uint16 and g[0] == BOS
        np.testing.assert_array_equal(g, w)
        assert enc.decode(g[1:].tolist()) == d


# --------------------------------------------------------------------------- real GPT-2 BPE

@pytest.fixture(scope="module")
def gpt2_encoding():
    if not BPE_FILE.is_file():
        pytest.skip(f"GPT-2 ranks file not found at {BPE_FILE} (offline BPE tests need it)")
    return fineweb.load_encoding(BPE_FILE)


def test_real_bpe_known_ids(gpt2_encoding):
    assert gpt2_encoding.encode_ordinary("Hello world") == [15496, 995]
    assert gpt2_encoding.n_vocab == 50257
    assert gpt2_encoding.encode("<|endoftext|>", allowed_special="all") == [BOS]


def test_real_bpe_local_files_round_trip(tmp_path, gpt2_encoding):
    files = write_inputs(tmp_path)
    out = tmp_path / "out"
    paths = fineweb.main(["--files", *map(str, files), "--out", str(out), "--bpe", str(BPE_FILE),
                          "--shard_size", "20", "--workers", "1", "--quiet"])
    stream = read_all(paths)
    docs = split_docs(stream)
    assert [gpt2_encoding.decode(d.tolist()) for d in docs] == DOCS
    assert [d.tolist() for d in docs] == [gpt2_encoding.encode_ordinary(t) for t in DOCS]
    assert int(stream.max()) <= BOS and (stream == BOS).sum() == len(DOCS)


# --------------------------------------------------------------------------- errors

def test_bpe_sha_mismatch(tmp_path, capsys):
    fake = tmp_path / "fake.tiktoken"
    fake.write_bytes(b"IQ== 0\nIg== 1\n")
    with pytest.raises(DataError, match="sha256"):
        fineweb.load_encoding(fake)
    (tmp_path / "a.txt").write_text("hi", encoding="utf-8")
    with pytest.raises(SystemExit) as ei:
        fineweb.main(["--files", str(tmp_path / "a.txt"), "--bpe", str(fake),
                      "--out", str(tmp_path / "o"), "--quiet"])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fineweb.py: error: --bpe {fake}: sha256 ") and err.count("\n") == 1
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("case", ["missing", "suffix", "badjson", "notext", "notutf8", "shard_size", "out_is_file"])
def test_bad_input_one_line_errors(tmp_path, capsys, case):
    enc = tiny_byte_encoding()
    args = ["--out", str(tmp_path / "o"), "--quiet"]
    if case == "missing":
        args += ["--files", str(tmp_path / "nope.txt")]
        needle = "nope.txt"
    elif case == "suffix":
        (tmp_path / "x.csv").write_text("a,b")
        args += ["--files", str(tmp_path / "x.csv")]
        needle = "x.csv"
    elif case == "badjson":
        (tmp_path / "x.jsonl").write_text('{"text": "ok"}\n{broken\n')
        args += ["--files", str(tmp_path / "x.jsonl")]
        needle = "x.jsonl:2"
    elif case == "notext":
        (tmp_path / "x.jsonl").write_text('{"body": "no text"}\n')
        args += ["--files", str(tmp_path / "x.jsonl")]
        needle = "text"
    elif case == "notutf8":
        (tmp_path / "x.txt").write_bytes(b"caf\xe9")
        args += ["--files", str(tmp_path / "x.txt")]
        needle = "UTF-8"
    elif case == "shard_size":
        (tmp_path / "x.txt").write_text("a")
        args += ["--files", str(tmp_path / "x.txt"), "--shard_size", "0"]
        needle = "--shard_size 0: must be a positive number of tokens"
    else:
        (tmp_path / "x.txt").write_text("a")
        (tmp_path / "o").write_text("a file, not a folder")
        args += ["--files", str(tmp_path / "x.txt"), "--shard_size", "1"]
        needle = f"--out {tmp_path / 'o'}: not a directory"
    with pytest.raises(SystemExit) as ei:
        fineweb.main(args, enc=enc)
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("fineweb.py: error: ") and err.count("\n") == 1, err
    assert needle in err
    assert not (tmp_path / "o").is_dir()


def test_missing_datasets_package_is_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(SystemExit) as ei:
        fineweb.main(["--out", str(tmp_path / "o"), "--quiet"], enc=tiny_byte_encoding())
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("fineweb.py: error: ") and err.count("\n") == 1
    assert "datasets" in err and "--files" in err


# --------------------------------------------------------------------------- input too small for a training shard

def tiny_input(tmp_path):
    """Three documents of 6 tokens each (BOS + 5 bytes): 18 tokens."""
    (tmp_path / "t.txt").write_text("doc A\n\ndoc B\n\ndoc C", encoding="utf-8")
    return ["--files", str(tmp_path / "t.txt"), "--separator", r"\n\n", "--out", str(tmp_path / "out"), "--quiet"]


@pytest.mark.parametrize("shard_size,quiet", [(18, True), (19, True), (10**8, True), (10**8, False)])
def test_input_that_fits_in_the_validation_shard_is_an_error(tmp_path, capsys, shard_size, quiet):
    """Exactly one line, also without --quiet: the progress bar shows only on a terminal."""
    argv = [a for a in tiny_input(tmp_path) if quiet or a != "--quiet"]
    with pytest.raises(SystemExit) as ei:
        fineweb.main([*argv, "--shard_size", str(shard_size)], enc=tiny_byte_encoding())
    assert ei.value.code == 2
    assert capsys.readouterr().err == (
        f"fineweb.py: error: the input has only 18 tokens, which would all go into the validation shard "
        f"(--shard_size {shard_size:,}) and leave no training shard; nothing written; pass a --shard_size "
        f"below 18 or more input\n")
    assert not (tmp_path / "out").exists()


def test_one_token_more_than_a_shard_gives_a_training_shard(tmp_path):
    paths = fineweb.main([*tiny_input(tmp_path), "--shard_size", "17"], enc=tiny_byte_encoding())
    assert [(p.name, validate_shard(p)) for p in paths] == [("fineweb_val_000000.bin", 17),
                                                             ("fineweb_train_000001.bin", 1)]


def test_max_tokens_not_above_shard_size_is_an_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as ei:
        fineweb.main([*tiny_input(tmp_path), "--shard_size", "10", "--max_tokens", "10"], enc=tiny_byte_encoding())
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("fineweb.py: error: --max_tokens 10 is not more than --shard_size 10: ")
    assert err.count("\n") == 1 and not (tmp_path / "out").exists()


def test_shard_writer_fineweb_layout_refuses_a_lone_validation_shard(tmp_path):
    w = ShardWriter(tmp_path / "o", "p", shard_size=5)
    w.add(np.array([BOS, 1, 2, 3, 4], dtype=np.uint16))  # exactly one shard: held back
    assert w.paths == []
    with pytest.raises(DataError, match="the input has only 5 tokens"):
        w.close()
    assert not (tmp_path / "o").exists()
    w = ShardWriter(tmp_path / "v", "p", shard_size=5, split="val")  # an explicit split may be alone
    w.add(np.arange(5))
    assert [p.name for p in w.close()] == ["p_val_000000.bin"]
