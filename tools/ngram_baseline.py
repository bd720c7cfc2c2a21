"""Count models as reference lines for a corpus: a unigram and an absolute-discount bigram model, or (--order
N) interpolated modified Kneser-Ney of order N, fitted on the training shards and scored on exactly the tokens
train_gpt.py's validation scores.

    python tools/ngram_baseline.py --train 'data/novels/novels_train_*.bin' \\
        --val 'data/novels/novels_val_*.bin' --val_tokens 65536 [--order 5]

The validation pairs are the trainer's: the first --val_tokens + 1 tokens of the validation shards (in name
order), each token predicting the next, across document boundaries as the trainer's stream does. The
models are fitted on every consecutive pair of the training shards (each shard read as one stream).

- unigram: P(w) = (c(w) + 1) / (N + V), add-one smoothed over the --vocab_size ids;
- bigram: P(w | v) = max(c(v, w) - d, 0) / c(v) + d n(v) / c(v) P(w), with d = --discount and n(v) the
  number of distinct successors of v (absolute discounting, interpolated with the unigram); a context never
  seen in training falls back to P(w).
- --order N (2 ... 5): train_gpt.py's KneserNey model, the one `--ngram_prior_order N` adds to the logits
  (three discounts per order from its count-of-counts, continuation counts below the top order, the lowest
  order interpolated with the uniform distribution over --vocab_size ids). A token's context is the N - 1
  tokens up to the one before it, as in the trainer: it stops at the first validation token and at a
  document token (it may start with one).

Prints one line per model, `unigram val_loss: X` and `bigram val_loss: Y` (or `kneser_ney_N val_loss: Z`, and
its discounts), in mean nats per token, after a line naming how many tokens were counted and in how many
seconds. Bad input (no shard matches, a corrupt
shard, too few validation tokens, a discount outside (0, 1)) is one line `ngram_baseline.py: error: ...` on
stderr and exit status 2.
"""
import glob
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "data")]

import numpy as np  # noqa: E402

from shards import CliParser, exit_with_error  # noqa: E402
from ngram_prior import NGRAM_TOKEN_BITS, count_ngrams, kneser_ney, ngram_context_rows  # noqa: E402
from train_gpt import (GPT2_VOCAB_SIZE, MAX_NGRAM_ORDER, DataError, read_shard,  # noqa: E402
                       read_validation_tokens)

PROG = "ngram_baseline.py"
DISCOUNT = 0.75  # the bigram model's absolute discount (the trainer's former --bigram_prior used it)


def build_parser():
    parser = CliParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", required=True, metavar="GLOB", help="training shards to count")
    parser.add_argument("--val", required=True, metavar="GLOB", help="validation shards (as train_gpt's --val_files)")
    parser.add_argument("--val_tokens", type=int, default=65536,
                        help="validation tokens scored, as train_gpt's --val_tokens (default: 65536)")
    parser.add_argument("--order", type=int, default=0,
                        help=f"score interpolated modified Kneser-Ney of this order (2 ... {MAX_NGRAM_ORDER}, as "
                             f"train_gpt's --ngram_prior_order) instead of the unigram and bigram (default: 0)")
    parser.add_argument("--discount", type=float, default=DISCOUNT,
                        help=f"the bigram model's discount d (default: {DISCOUNT})")
    parser.add_argument("--vocab_size", type=int, default=GPT2_VOCAB_SIZE,
                        help=f"ids the unigram is smoothed over (default: {GPT2_VOCAB_SIZE})")
    return parser


def check_args(args):
    if args.val_tokens <= 0:
        raise DataError(f"--val_tokens must be positive, got {args.val_tokens}")
    if not 0 < args.discount < 1:
        raise DataError(f"--discount must lie in (0, 1), got {args.discount}")
    if args.vocab_size <= 0:
        raise DataError(f"--vocab_size must be positive, got {args.vocab_size}")
    if args.order and not 2 <= args.order <= MAX_NGRAM_ORDER:
        raise DataError(f"--order must be 0 (unigram and bigram) or 2 ... {MAX_NGRAM_ORDER}, got {args.order}")


class CountModel:
    """Unigram and absolute-discount bigram probabilities from train_gpt.count_ngrams' order 2."""

    def __init__(self, streams, vocab_size):
        self.vocab_size = vocab_size
        self.unigrams, (bigrams,) = count_ngrams(streams, vocab_size, 2)
        contexts = bigrams.contexts.astype(np.int64)
        self.pairs, self.pair_counts = (contexts << NGRAM_TOKEN_BITS) | bigrams.successors, bigrams.counts
        self.context_counts = np.bincount(contexts, weights=self.pair_counts, minlength=vocab_size)
        self.successors = np.bincount(contexts, minlength=vocab_size)
        self.tokens = int(self.unigrams.sum())

    def unigram_prob(self, w):
        return (self.unigrams[w] + 1) / (self.tokens + self.vocab_size)

    def pair_count(self, v, w):
        keys = (v << NGRAM_TOKEN_BITS) | w
        at = np.searchsorted(self.pairs, keys).clip(max=len(self.pairs) - 1)
        return np.where(self.pairs[at] == keys, self.pair_counts[at], 0)

    def bigram_prob(self, v, w, discount):
        seen = self.context_counts[v]
        safe = np.maximum(seen, 1)
        backoff = np.where(seen > 0, discount * self.successors[v] / safe, 1.0)
        direct = np.maximum(self.pair_count(v, w) - discount, 0) / safe
        return direct + backoff * self.unigram_prob(w)


def kneser_ney_log_probs(model, tokens, targets):
    """log P(targets[i] | the context of tokens[: i + 1]) under a train_gpt.KneserNey model, looked up entry by
    entry (the trainer adds the same model as whole rows: tests/test_ngram_prior.py compares the two)."""
    log_p = model.log_unigram[targets]
    rows = ngram_context_rows([level.contexts for level in model.levels], tokens)
    for level, row in zip(model.levels, rows):
        seen = np.flatnonzero(row >= 0)
        log_p[seen] += level.log_backoff[row[seen]]
        lengths = np.diff(level.row_starts)
        keys = (np.repeat(np.arange(lengths.size), lengths) << NGRAM_TOKEN_BITS) | level.successors
        wanted = (row[seen] << NGRAM_TOKEN_BITS) | targets[seen]
        at = np.searchsorted(keys, wanted).clip(max=max(keys.size - 1, 0))
        hit = keys[at] == wanted
        log_p[seen[hit]] += level.corrections[at[hit]]
    return log_p


def read_training_streams(pattern, vocab_size):
    files = sorted(glob.glob(pattern))
    if not files:
        raise DataError(f"no training shards match {pattern!r}; check --train")
    return [read_shard(path, vocab_size) for path in files]


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
        streams = read_training_streams(args.train, args.vocab_size)
        val = read_validation_tokens(args.val, args.val_tokens + 1, args.vocab_size).astype(np.int64)
        start = time.perf_counter()
        if args.order:
            unigrams, levels = count_ngrams(streams, args.vocab_size, args.order)
            model = kneser_ney(unigrams, levels)
            tokens, what = int(unigrams.sum()), f"{levels[-1].counts.size:,} distinct {args.order}-grams"
        else:
            model = CountModel(streams, args.vocab_size)
            tokens, what = model.tokens, f"{len(model.pairs):,} distinct bigrams"
        seconds = time.perf_counter() - start
    except DataError as e:
        exit_with_error(PROG, e)
    v, w = val[:-1], val[1:]
    print(f"counted {tokens:,} training tokens ({what}) in {seconds:.1f} s; scoring {v.size:,} validation tokens")
    if args.order:
        print(f"kneser_ney_{args.order} val_loss: {-kneser_ney_log_probs(model, v, w).mean():.4f} (discounts D1 D2 "
              f"D3+ of orders 1 ... {args.order}: " + "; ".join(" ".join(f"{d:.3f}" for d in row)
                                                               for row in model.discounts) + ")")
        return 0
    print(f"unigram val_loss: {-np.log(model.unigram_prob(w)).mean():.4f}")
    print(f"bigram val_loss: {-np.log(model.bigram_prob(v, w, args.discount)).mean():.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
