"""Tests for data/synthetic.py, the synthetic corpus: deterministic, valid shards, documents that
agree on their words and copy their own spans."""

import sys
from pathlib import Path

import numpy as np
import pytest

DATA_DIR = Path(__file__).resolve().parents[1] / "data"
if str(DATA_DIR) not in sys.path:
    sys.path.insert(0, str(DATA_DIR))

import synthetic  # noqa: E402
from shards import BOS_ID as BOS, read_shard  # noqa: E402

SIZES = dict(train_tokens=40_000, val_tokens=6_000)
SPAN = 8  # an 8-gram of >= 8 words recurs by chance with probability <= 512 / 8**8


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return synthetic.synthetic_corpus(tmp_path_factory.mktemp("a"), seed=0, **SIZES)


def documents(tokens):
    """The documents after each BOS, the last (possibly cut) one left out."""
    starts = np.flatnonzero(tokens == BOS)
    return [tokens[a + 1: b] for a, b in zip(starts[:-1], starts[1:])]


def copied_fraction(doc):
    """Share of the document's tokens that end an 8-gram seen earlier in it."""
    seen, copied = set(), 0
    for end in range(SPAN, doc.size + 1):
        gram = doc[end - SPAN: end].tobytes()
        copied += gram in seen
        seen.add(gram)
    return copied / doc.size


def test_the_corpus_is_deterministic_from_its_seed(corpus, tmp_path):
    again = synthetic.synthetic_corpus(tmp_path / "b", seed=0, **SIZES)
    other = synthetic.synthetic_corpus(tmp_path / "c", seed=1, **SIZES)
    assert [p.name for p in corpus] == ["synthetic_val_000000.bin", "synthetic_train_000001.bin"]
    for a, b, c in zip(corpus, again, other):
        assert a.read_bytes() == b.read_bytes() and a.read_bytes() != c.read_bytes()


def test_shards_are_valid_and_hold_bos_started_documents(corpus):
    vocabulary = set(synthetic.vocabulary(np.random.default_rng(0)).tolist())
    for path, n_tokens in zip(corpus, (SIZES["val_tokens"], SIZES["train_tokens"])):
        tokens = read_shard(path).astype(np.int64)
        assert tokens.size == n_tokens and tokens[0] == BOS
        assert set(np.unique(tokens).tolist()) <= vocabulary | {BOS}
        lengths = [doc.size for doc in documents(tokens)]
        assert len(lengths) >= 10
        assert synthetic.DOC_TOKENS[0] <= min(lengths) and max(lengths) <= synthetic.DOC_TOKENS[1]


def test_documents_agree_on_their_words_and_copy_their_spans(corpus):
    """Each document uses at most 16 of the 128 ids; half its segments are copies, so a good
    share of its tokens end an 8-gram it already holds (random draws of its words almost never)."""
    docs = documents(read_shard(corpus[1]).astype(np.int64))
    words = [np.unique(doc).size for doc in docs]
    assert min(words) >= 2 and max(words) <= synthetic.WORDS[1]
    fractions = np.array([copied_fraction(doc) for doc in docs])
    assert fractions.mean() > 0.15, fractions.mean()  # 0.27 measured; 0 without copies
    assert (fractions > 0).mean() > 0.9


def test_the_cli_writes_the_shards_and_rejects_bad_flags(tmp_path, capsys):
    synthetic.main(["--out", str(tmp_path), "--train_tokens", "5000", "--val_tokens", "1000"])
    assert capsys.readouterr().out.splitlines() == [
        f"{tmp_path / 'synthetic_val_000000.bin'}: 1000 tokens",
        f"{tmp_path / 'synthetic_train_000001.bin'}: 5000 tokens"]
    out = ["--out", str(tmp_path)]
    for argv, message in (([*out, "--val_tokens", "0"], "--val_tokens must be positive, got 0"),
                          ([*out, "--seed", "x"], "argument --seed: invalid int value: 'x'"),
                          ([], "the following arguments are required: --out")):
        with pytest.raises(SystemExit) as exit_:
            synthetic.main(argv)
        assert exit_.value.code == 2
        assert capsys.readouterr().err == f"synthetic.py: error: {message}\n"


def test_a_stamp_names_the_generator_and_its_arguments(tmp_path):
    synthetic.synthetic_corpus(tmp_path, seed=0, **SIZES)
    assert synthetic.is_current(tmp_path, seed=0, **SIZES)
    assert not synthetic.is_current(tmp_path, seed=1, **SIZES)
    assert not synthetic.is_current(tmp_path)  # the default sizes: another corpus
    stamp = (tmp_path / synthetic.STAMP).read_text()
    (tmp_path / synthetic.STAMP).write_text(stamp.replace("sha256 ", "sha256 0"))  # another version
    assert not synthetic.is_current(tmp_path, seed=0, **SIZES)
    (tmp_path / synthetic.STAMP).write_text(stamp)
    (tmp_path / synthetic.SHARD_NAMES[1]).unlink()
    assert not synthetic.is_current(tmp_path, seed=0, **SIZES)


def test_the_markov_corpus_is_not_taken_for_the_stamped_one(tmp_path):
    synthetic.synthetic_corpus(tmp_path, seed=0, **SIZES)
    synthetic.markov_corpus(tmp_path, seed=0, **SIZES)
    assert not synthetic.is_current(tmp_path, seed=0, **SIZES)


def test_the_fallback_rewrites_a_corpus_an_older_version_wrote(tmp_path, monkeypatch):
    """A data/synthetic/ from before a change to data/synthetic.py is rewritten, not trained on."""
    import train_gpt as tg

    made = []
    monkeypatch.setattr(synthetic, "synthetic_corpus", lambda folder, **_: made.append(folder))
    monkeypatch.delenv("DATA_PATH", raising=False)
    monkeypatch.chdir(tmp_path)
    folder = Path("data") / "synthetic"
    folder.mkdir(parents=True)
    for name in synthetic.SHARD_NAMES:  # an older corpus: shards, no stamp
        (folder / name).write_bytes(b"")
    hp = tg.parse_args(["--preset", "cpu"])
    tg.resolve_data(hp, 0)
    assert made == [folder]
    (folder / synthetic.STAMP).write_text(synthetic.stamp(0, synthetic.TRAIN_TOKENS,
                                                          synthetic.VAL_TOKENS))
    tg.resolve_data(hp, 0)
    assert made == [folder]  # current: used as it is
