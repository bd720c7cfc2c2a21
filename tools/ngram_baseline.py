"""Count models as reference lines for a corpus: a unigram and an absolute-discount bigram model, fitted on
the training shards and scored on exactly the tokens train_gpt.py's validation scores.

    python tools/ngram_baseline.py --train 'data/novels/novels_train_*.bin' \\
        --val 'data/novels/novels_val_*.bin' --val_tokens 65536

The validation pairs are the trainer's: the first --val_tokens + 1 tokens of the validation shards (in name
order), each token predicting the next, across document boundaries as the trainer's stream does. The
models are fitted on every consecutive pair of the training shards (each shard read as one stream).

- unigram: P(w) = (c(w) + 1) / (N + V), add-one smoothed over the --vocab_size ids;
- bigram: P(w | v) = max(c(v, w) - d, 0) / c(v) + d n(v) / c(v) P(w), with d = --discount and n(v) the
  number of distinct successors of v (absolute discounting, interpolated with the unigram); a context never
  seen in training falls back to P(w).

Prints one line per model, `unigram val_loss: X` and `bigram val_loss: Y` (mean nats per token), after a
line naming how many tokens were counted and in how many seconds. Bad input (no shard matches, a corrupt
shard, too few validation tokens, a discount outside (0, 1)) is one line `ngram_baseline.py: error: ...` on
stderr and exit status 2.
"""
import argparse
import glob
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "data")]

import numpy as np  # noqa: E402

from shards import CliParser, exit_with_error  # noqa: E402
from train_gpt import (BIGRAM_PRIOR_DISCOUNT, GPT2_VOCAB_SIZE, DataError, count_bigrams, read_shard,  # noqa: E402
                       read_validation_tokens)

PROG = "ngram_baseline.py"


def build_parser():
    parser = CliParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", required=True, metavar="GLOB", help="training shards to count")
    parser.add_argument("--val", required=True, metavar="GLOB", help="validation shards (as train_gpt's --val_files)")
    parser.add_argument("--val_tokens", type=int, default=65536,
                        help="validation tokens scored, as train_gpt's --val_tokens (default: 65536)")
    parser.add_argument("--discount", type=float, default=BIGRAM_PRIOR_DISCOUNT,
                        help=f"the bigram model's discount d (default: {BIGRAM_PRIOR_DISCOUNT}, as in train_gpt's "
                             f"--bigram_prior)")
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


class CountModel:
    """Unigram and bigram probabilities from train_gpt.count_bigrams (pairs keyed v * vocab + w)."""

    def __init__(self, streams, vocab_size):
        self.vocab_size = vocab_size
        self.unigrams, self.pairs, self.pair_counts = count_bigrams(streams, vocab_size)
        contexts = self.pairs // vocab_size
        self.context_counts = np.bincount(contexts, weights=self.pair_counts, minlength=vocab_size)
        self.successors = np.bincount(contexts, minlength=vocab_size)
        self.tokens = int(self.unigrams.sum())

    def unigram_prob(self, w):
        return (self.unigrams[w] + 1) / (self.tokens + self.vocab_size)

    def pair_count(self, v, w):
        keys = v * self.vocab_size + w
        at = np.searchsorted(self.pairs, keys).clip(max=len(self.pairs) - 1)
        return np.where(self.pairs[at] == keys, self.pair_counts[at], 0)

    def bigram_prob(self, v, w, discount):
        seen = self.context_counts[v]
        safe = np.maximum(seen, 1)
        backoff = np.where(seen > 0, discount * self.successors[v] / safe, 1.0)
        direct = np.maximum(self.pair_count(v, w) - discount, 0) / safe
        return direct + backoff * self.unigram_prob(w)


def read_training_streams(pattern, vocab_size):
    files = sorted(glob.glob(pattern))
    if not files:
        raise DataError(f"no training shards match {pattern!r}; check --train")
    return [read_shard(path, vocab_size) for path in files]


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
        start = time.perf_counter()
        model = CountModel(read_training_streams(args.train, args.vocab_size), args.vocab_size)
        seconds = time.perf_counter() - start
        val = read_validation_tokens(args.val, args.val_tokens + 1, args.vocab_size).astype(np.int64)
    except DataError as e:
        exit_with_error(PROG, e)
    v, w = val[:-1], val[1:]
    print(f"counted {model.tokens:,} training tokens ({len(model.pairs):,} distinct bigrams) in {seconds:.1f} s; "
          f"scoring {v.size:,} validation tokens")
    print(f"unigram val_loss: {-np.log(model.unigram_prob(w)).mean():.4f}")
    print(f"bigram val_loss: {-np.log(model.bigram_prob(v, w, args.discount)).mean():.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
