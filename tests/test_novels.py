"""Tests for data/novels.py on small synthetic "novels" with a tiny injected byte encoding."""

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import tiktoken

DATA_DIR = Path(__file__).resolve().parents[1] / "data"
if str(DATA_DIR) not in sys.path:
    sys.path.insert(0, str(DATA_DIR))

import novels  # noqa: E402
from fineweb import GPT2_PAT_STR  # noqa: E402
from shards import BOS_ID as BOS, DataError, read_shard  # noqa: E402

TRAIN_NAMES = ["Aaa_First_1850", "Bbb_Second_1860", "Zzz_Last_1900"]
VAL_NAMES = list(novels.VAL_NOVELS)
EXCLUDED = list(novels.EXCLUDED)
CHUNK = 200


def tiny_byte_encoding():
    return tiktoken.Encoding(name="tiny-bytes", pat_str=GPT2_PAT_STR,
                             mergeable_ranks={bytes([i]): i for i in range(256)},
                             special_tokens={"<|endoftext|>": BOS})


def novel_text(name, n_lines=40):
    """Lines tagged with the novel's name, CRLF endings, BOM, trailing spaces, blank lines."""
    lines = []
    for i in range(n_lines):
        lines.append(f"{name} line {i}: " + "word " * (i % 9) + ("   " if i % 5 == 0 else ""))
        if i % 7 == 6:
            lines.append("")
    return "\ufeff" + "\r\n".join(lines) + "\r\n\r\n"


@pytest.fixture
def novels_src(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for k, name in enumerate(TRAIN_NAMES + VAL_NAMES + EXCLUDED):
        (src / f"{name}.txt").write_bytes(novel_text(name, 30 + 7 * k).encode("utf-8"))
    return src


def run(src, out, *extra):
    return novels.main(["--src", str(src), "--out", str(out), "--chunk_chars", str(CHUNK),
                        "--quiet", *extra], enc=tiny_byte_encoding())


def docs_of(path):
    toks = read_shard(path)
    assert toks[0] == BOS
    starts = np.flatnonzero(toks == BOS)
    return [bytes(p[1:].astype(np.uint8).tolist()).decode("utf-8") for p in np.split(toks, starts[1:])]


# --------------------------------------------------------------------------- chunking rule

def test_normalize_text():
    assert novels.normalize_text("\ufeff\r\n a  \r\nb\t\r\n\r\n\r\nc \r\n\r\n") == "a\nb\n\n\nc"


def test_split_documents_rule():
    lines = [f"{i:02d}" + "x" * 7 for i in range(10)]  # 9 chars + newline = 10 each
    text = "\n".join(lines)
    docs = novels.split_documents(text, 30)
    assert docs == ["\n".join(lines[0:3]), "\n".join(lines[3:6]), "\n".join(lines[6:10])]
    # last piece (1 line, 9 chars) < 30 // 2 was merged into the previous document
    assert "\n".join(docs) == text
    # a long line ends the document it falls in; pieces are stripped, blank ones dropped,
    # a short last piece is joined to the previous document with a single newline
    assert novels.split_documents("a\n" + "L" * 100 + "\n\n\nb", 30) == ["a\n" + "L" * 100 + "\nb"]
    assert novels.split_documents("a\n" + "L" * 100 + "\n\n\n" + "b" * 20, 30) == ["a\n" + "L" * 100,
                                                                                   "b" * 20]
    assert novels.split_documents("", 30) == []


# --------------------------------------------------------------------------- build

def test_build_is_deterministic(novels_src, tmp_path):
    m1 = run(novels_src, tmp_path / "o1")
    m2 = run(novels_src, tmp_path / "o2")
    assert m1 == m2
    names = sorted(p.name for p in (tmp_path / "o1").iterdir())
    assert names == ["manifest.json", "novels_train_000001.bin", "novels_val_000000.bin"]
    for n in names:
        assert (tmp_path / "o1" / n).read_bytes() == (tmp_path / "o2" / n).read_bytes(), n
    # another seed changes the document order of both splits, not their token counts
    m3 = run(novels_src, tmp_path / "o3", "--seed", "5")
    for split in ("train", "val"):
        assert m3["splits"][split]["shards"][0]["sha256"] != m1["splits"][split]["shards"][0]["sha256"]
        assert m3["splits"][split]["tokens"] == m1["splits"][split]["tokens"]


@pytest.mark.parametrize("seed", [1337, 5])
def test_seed_only_permutes_documents_as_documented(novels_src, tmp_path, seed):
    """--seed: train documents in default_rng(seed).permutation order, val in default_rng(seed + 1)'s,
    starting from the documents listed novel by novel in sorted name order; nothing else changes."""
    out = tmp_path / "out"
    m = run(novels_src, out, "--seed", str(seed))
    names = sorted(TRAIN_NAMES + VAL_NAMES)
    listed = {"train": [], "val": []}
    for name in names:
        text = novels.normalize_text(novel_text(name, 30 + 7 * (TRAIN_NAMES + VAL_NAMES).index(name)))
        listed["val" if name in VAL_NAMES else "train"] += novels.split_documents(text, CHUNK)
    for split, shard, offset in (("train", "novels_train_000001.bin", 0), ("val", "novels_val_000000.bin", 1)):
        perm = np.random.default_rng(seed + offset).permutation(len(listed[split]))
        assert docs_of(out / shard) == [listed[split][i] for i in perm]
        assert m["splits"][split]["order"] == f"numpy default_rng({seed + offset}).permutation"
    help_text = " ".join(novels.build_parser().format_help().split())
    assert "default_rng(SEED).permutation" in help_text and "default_rng(SEED + 1)" in help_text


def test_splits_bos_and_excluded(novels_src, tmp_path):
    out = tmp_path / "out"
    m = run(novels_src, out)
    train_docs = docs_of(out / "novels_train_000001.bin")
    val_docs = docs_of(out / "novels_val_000000.bin")
    # every document starts with BOS and matches the manifest's counts
    for split, docs in (("train", train_docs), ("val", val_docs)):
        s = m["splits"][split]
        assert len(docs) == s["documents"] > len(s["files"])  # several documents per novel
        assert sum(len(d.encode()) + 1 for d in docs) == s["tokens"]
        assert all(d and d == d.strip() for d in docs)
    # held-out novels never in train, and val holds exactly them, shuffled
    assert m["splits"]["val"]["files"] == sorted(VAL_NAMES)
    assert m["splits"]["train"]["files"] == TRAIN_NAMES
    for d in train_docs:
        assert not any(v in d for v in VAL_NAMES)
    expected_val = [d for name in sorted(VAL_NAMES)
                    for d in novels.split_documents(novels.normalize_text(novel_text(
                        name, 30 + 7 * (TRAIN_NAMES + VAL_NAMES).index(name))), CHUNK)]
    assert sorted(val_docs) == sorted(expected_val) and val_docs != expected_val
    # training documents are a shuffle of the training novels' documents
    expected_train = [d for k, name in enumerate(TRAIN_NAMES)
                      for d in novels.split_documents(novels.normalize_text(novel_text(name, 30 + 7 * k)), CHUNK)]
    assert sorted(train_docs) == sorted(expected_train) and train_docs != expected_train
    # excluded novels appear nowhere
    for d in train_docs + val_docs:
        assert not any(x in d for x in EXCLUDED)
    assert not any(x in json.dumps(m["files"]) for x in EXCLUDED)
    assert [f["path"] for f in m["files"]] == [f"corpus/{n}.txt" for n in sorted(TRAIN_NAMES + VAL_NAMES)]


def test_manifest_sha256_matches_files(novels_src, tmp_path):
    out = tmp_path / "out"
    run(novels_src, out)
    m = json.loads((out / "manifest.json").read_text())
    assert m["source"]["repo"] == "computationalstylistics/100_english_novels"
    assert m["source"]["commit"] == "143e601875d70e195f2cc5ebd8b034609271194d"
    for split in ("train", "val"):
        for s in m["splits"][split]["shards"]:
            p = out / s["file"]
            assert hashlib.sha256(p.read_bytes()).hexdigest() == s["sha256"]
            assert read_shard(p).size == s["tokens"]


def test_missing_val_novel_is_one_line_error(novels_src, tmp_path, capsys):
    (novels_src / "Hardy_Tess_1891.txt").unlink()
    with pytest.raises(SystemExit) as ei:
        run(novels_src, tmp_path / "out")
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("novels.py: error: validation novel(s) Hardy_Tess_1891 not found") and err.count("\n") == 1
    assert "--val" in err


@pytest.mark.parametrize("problem", ["missing_src", "out_is_file", "chunk_chars", "not_utf8"])
def test_bad_input_is_one_line_error(novels_src, tmp_path, capsys, problem):
    src, out, extra = novels_src, tmp_path / "out", []
    if problem == "missing_src":
        src, needle = tmp_path / "nope", f"--src {tmp_path / 'nope'}: not a directory"
    elif problem == "out_is_file":
        out.write_text("a file")
        needle = f"--out {out}: not a directory"
    elif problem == "chunk_chars":
        extra, needle = ["--chunk_chars", "0"], "--chunk_chars 0: must be positive"
    else:
        (novels_src / "Aaa_First_1850.txt").write_bytes(b"caf\xe9")
        needle = "Aaa_First_1850.txt: not valid UTF-8 (byte 3)"
    with pytest.raises(SystemExit) as ei:
        novels.main(["--src", str(src), "--out", str(out), "--quiet", *extra], enc=tiny_byte_encoding())
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("novels.py: error: ") and err.count("\n") == 1 and needle in err, err
    assert not out.is_dir()


def test_download_uses_pinned_commit(tmp_path, monkeypatch):
    urls = []

    def fake_fetch(url, timeout=60.0):
        urls.append(url)
        return novel_text(url.rsplit("/", 1)[1][:-4]).encode("utf-8")

    monkeypatch.setattr(novels, "fetch_url", fake_fetch)
    texts = novels.download_novels(tmp_path / "raw", names=["Aaa_First_1850", "Hardy_Tess_1891"],
                                   progress=False)
    assert urls == [f"https://raw.githubusercontent.com/computationalstylistics/100_english_novels/"
                    f"143e601875d70e195f2cc5ebd8b034609271194d/corpus/{n}.txt"
                    for n in ("Aaa_First_1850", "Hardy_Tess_1891")]
    assert set(texts) == {"Aaa_First_1850", "Hardy_Tess_1891"}
    novels.download_novels(tmp_path / "raw", names=["Aaa_First_1850"], progress=False)
    assert len(urls) == 2  # cached file not fetched again

    def offline(url, timeout=60.0):
        raise OSError("Name or service not known")

    monkeypatch.setattr(novels, "fetch_url", offline)
    with pytest.raises(DataError, match="--src"):
        novels.download_novels(tmp_path / "raw2", names=["Aaa_First_1850"], progress=False)


def test_novel_list_is_public_domain_and_holds_out_whole_novels():
    """Every novel kept was first published in or before 1930 (the corpus' public-domain cut), the
    two left out are exactly the later ones, and the held-out validation novels are kept novels."""
    year = lambda name: int(name.rsplit("_", 1)[1])  # noqa: E731  Author_Title_Year
    assert len(set(novels.NOVELS)) == len(novels.NOVELS) == 98
    assert max(map(year, novels.NOVELS)) <= 1930 and min(map(year, novels.EXCLUDED)) > 1930
    assert not set(novels.EXCLUDED) & set(novels.NOVELS)
    assert set(novels.VAL_NOVELS) < set(novels.NOVELS) and len(novels.VAL_NOVELS) == 5
