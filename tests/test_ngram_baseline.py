"""tools/ngram_baseline.py: the count models are proper distributions, score the trainer's validation pairs,
and match the formulas evaluated by hand on a tiny corpus; bad input is one line, exit 2."""
import numpy as np
import pytest

import ngram_baseline as nb
import train_gpt as tg

VOCAB = 7


def write(path, tokens):
    tg.write_shard(path, np.array(tokens, dtype=np.uint16))
    return path


def test_every_conditional_distribution_sums_to_one():
    rng = np.random.default_rng(0)
    model = nb.CountModel([rng.integers(0, VOCAB - 1, 300), rng.integers(0, 3, 50)], VOCAB)
    w = np.arange(VOCAB)
    assert model.unigram_prob(w).sum() == pytest.approx(1, abs=1e-12)
    for v in range(VOCAB):  # id VOCAB - 1 never occurs: its row is the unigram
        total = model.bigram_prob(np.full(VOCAB, v), w, 0.75).sum()
        assert total == pytest.approx(1, abs=1e-12), v


def test_probabilities_match_the_formulas_by_hand():
    # pairs of one stream only: (1,2) twice, (2,1) once, (2,3) once; token 3 ends the stream
    model = nb.CountModel([np.array([1, 2, 1, 2, 3])], VOCAB)
    n = 5
    uni = lambda t: ([0, 2, 2, 1, 0, 0, 0][t] + 1) / (n + VOCAB)  # noqa: E731
    d = 0.5
    by_hand = {(1, 2): (2 - d) / 2 + d * 1 / 2 * uni(2), (1, 3): d * 1 / 2 * uni(3),
               (2, 1): (1 - d) / 2 + d * 2 / 2 * uni(1), (2, 3): (1 - d) / 2 + d * 2 / 2 * uni(3),
               (3, 1): uni(1), (0, 4): uni(4)}  # 3 is never a context, nor 0
    for (v, w), p in by_hand.items():
        assert model.bigram_prob(np.array([v]), np.array([w]), d)[0] == pytest.approx(p, rel=1e-12), (v, w)


def test_scores_exactly_the_trainers_validation_pairs(tmp_path, capsys):
    train = write(tmp_path / "t_train_000001.bin", [0, 1, 2, 3] * 50)
    # the first 5 tokens give the 4 scored pairs 0->1, 1->2, 2->3, 3->0; what follows must not count
    val = write(tmp_path / "t_val_000000.bin", [0, 1, 2, 3, 0, 5, 5, 5])
    nb.main(["--train", str(train), "--val", str(val), "--val_tokens", "4", "--vocab_size", str(VOCAB)])
    lines = capsys.readouterr().out.splitlines()
    model = nb.CountModel([np.array([0, 1, 2, 3] * 50)], VOCAB)
    v, w = np.array([0, 1, 2, 3]), np.array([1, 2, 3, 0])
    assert lines[0].startswith("counted 200 training tokens (4 distinct bigrams)")
    assert lines[1] == f"unigram val_loss: {-np.log(model.unigram_prob(w)).mean():.4f}"
    assert lines[2] == f"bigram val_loss: {-np.log(model.bigram_prob(v, w, 0.75)).mean():.4f}"
    # a deterministic cycle: each pair keeps (c - d) / c, plus the back-off's d / c times P(w); the stream
    # holds 0->1, 1->2, 2->3 50 times each and 3->0 49 times (the last 3 ends it); every id occurs 50 times
    p = [(c - 0.75) / c + 0.75 / c * 51 / 207 for c in (50, 50, 50, 49)]
    assert float(lines[2].split()[-1]) == pytest.approx(-np.mean(np.log(p)), abs=6e-5)


@pytest.mark.parametrize("extra, message", [
    (["--discount", "1"], "--discount must lie in (0, 1), got 1.0"),
    (["--val_tokens", "0"], "--val_tokens must be positive"),
    (["--val_tokens", "100"], "--val_tokens 100 needs 101"),
])
def test_bad_input_is_one_line(tmp_path, capsys, extra, message):
    train = write(tmp_path / "t_train_000001.bin", [0, 1, 2])
    val = write(tmp_path / "t_val_000000.bin", [0, 1, 2])
    with pytest.raises(SystemExit) as exit_info:
        nb.main(["--train", str(train), "--val", str(val), "--val_tokens", "2", *extra])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ngram_baseline.py: error: ") and message in err


def test_no_training_shards_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        nb.main(["--train", str(tmp_path / "none_*.bin"), "--val", str(tmp_path / "v*.bin")])
    assert "no training shards match" in capsys.readouterr().err
