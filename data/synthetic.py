"""The synthetic corpus: documents with structure that a count model cannot see but attention can.

    python data/synthetic.py --out DIR [--seed 0] [--train_tokens 8000000] [--val_tokens 262144]

writes ``synthetic_val_000000.bin`` and ``synthetic_train_000001.bin`` into DIR (the .bin shard
format of data/shards.py) and prints one line per shard. train_gpt.py's --synthetic_fallback writes
the same corpus into data/synthetic/ when no shards match the default globs.

A document is BOS (50256) followed by 64 ... 512 tokens. Its words are 8 ... 16 distinct ids drawn
from a vocabulary of 128 (a fixed draw of ids in 1,000 ... 49,999: the trainer's sizes stay valid).
Of the vocabularies tried for the README's 34-step quickstart (64, 128, 512), 128 learned the most
(docs/cpu-development.md).
The document is a run of segments of 4 ... 32 tokens, each one of:

- fresh: ids drawn uniformly from the document's words;
- a copy: an earlier span of the same document, repeated token for token.

The words are long-range agreement: every token of a document comes from a set that is fixed at its
start, so a model that looks back over the document needs about ln(words) nats per fresh token.
The copies are exact: a model that finds where the span started predicts the rest of it for free.
A count model of order 5 sees only the last 4 tokens, which in a document of random words almost
never occurred in training; it learns little more than that a recent token may recur, and pays
nearly ln(128) = 4.85 nats on most tokens (tools/ngram_baseline.py --order 5 measures it).

Generation is deterministic from --seed (numpy's default_rng) and takes a few seconds for 8M tokens.
After the shards, ``corpus.txt`` records what wrote them (this file's sha256 and the arguments), so
that a folder an older version of this file wrote is known as stale (``is_current``) and rewritten.
Bad flags or an unwritable --out print one line ``synthetic.py: error: ...`` and exit with status 2.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import numpy as np

BOS_ID = 50256
VOCAB = 128  # ids a document's words are drawn from
FIRST_ID, LAST_ID = 1_000, 50_000  # the range the VOCAB ids are drawn from
DOC_TOKENS = (64, 512)  # tokens after BOS, inclusive
WORDS = (8, 16)  # distinct ids per document, inclusive
SEGMENT_TOKENS = (4, 32)  # inclusive
COPY_PROBABILITY = 0.5  # of a segment, once the document has a span to copy
TRAIN_TOKENS, VAL_TOKENS = 8_000_000, 262_144
PROG = "synthetic.py"
SHARD_NAMES = ("synthetic_val_000000.bin", "synthetic_train_000001.bin")
STAMP = "corpus.txt"


def vocabulary(rng):
    """The VOCAB token ids every document draws its words from."""
    return rng.choice(np.arange(FIRST_ID, LAST_ID), size=VOCAB, replace=False)


def document(rng, token_ids):
    """One document's tokens after BOS: fresh segments of its words, copies of its earlier spans."""
    words = rng.choice(token_ids, size=rng.integers(WORDS[0], WORDS[1] + 1), replace=False)
    length = int(rng.integers(DOC_TOKENS[0], DOC_TOKENS[1] + 1))
    tokens = words[rng.integers(0, words.size, size=length)]  # fresh everywhere; copies overwrite
    segments = length // SEGMENT_TOKENS[0] + 1
    sizes = rng.integers(SEGMENT_TOKENS[0], SEGMENT_TOKENS[1] + 1, size=segments).tolist()
    copies = (rng.random(segments) < COPY_PROBABILITY).tolist()
    starts = rng.random(segments).tolist()
    filled = 0
    for size, copy, start in zip(sizes, copies, starts):  # length // 4 + 1 segments of >= 4 fill it
        size = min(size, length - filled)
        if copy and filled >= SEGMENT_TOKENS[0]:
            size = min(size, filled)
            begin = int(start * (filled - size + 1))
            tokens[filled: filled + size] = tokens[begin: begin + size]
        filled += size
        if filled == length:
            return tokens


def split_tokens(rng, token_ids, n_tokens):
    """Whole documents, each BOS-started, until n_tokens; the last one is cut to fit."""
    parts, total = [], 0
    while total < n_tokens:
        part = np.concatenate(([BOS_ID], document(rng, token_ids)))
        parts.append(part)
        total += part.size
    return np.concatenate(parts)[:n_tokens]


def default_write_shard(path, tokens):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from shards import write_shard
    write_shard(path, tokens)


def stamp(seed, train_tokens, val_tokens):
    """The line corpus.txt holds: this file's sha256 and synthetic_corpus's arguments."""
    digest = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    return (f"data/synthetic.py sha256 {digest} seed {seed} train_tokens {train_tokens} "
            f"val_tokens {val_tokens}\n")


def is_current(out_dir, seed=0, train_tokens=TRAIN_TOKENS, val_tokens=VAL_TOKENS):
    """Whether out_dir holds what synthetic_corpus(out_dir, ...) writes: both shards and the
    stamp of this file and these arguments."""
    out_dir = Path(out_dir)
    try:
        written = (out_dir / STAMP).read_text()
    except OSError:
        return False
    return written == stamp(seed, train_tokens, val_tokens) and all(
        (out_dir / name).is_file() for name in SHARD_NAMES)


def synthetic_corpus(out_dir, seed=0, train_tokens=TRAIN_TOKENS, val_tokens=VAL_TOKENS,
                     write_shard=None):
    """Write synthetic_val_000000.bin and synthetic_train_000001.bin into out_dir, then its stamp
    (corpus.txt; removed first, so an interrupted rewrite is never current); returns the shards'
    paths. write_shard(path, tokens) writes one shard (default: data/shards.py's; train_gpt.py
    passes its own, so that it need not import itself a second time)."""
    write_shard = write_shard or default_write_shard
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / STAMP).unlink(missing_ok=True)
    rng = np.random.default_rng(seed)
    token_ids = vocabulary(rng)
    paths = []
    for name, n_tokens in zip(SHARD_NAMES, (val_tokens, train_tokens)):
        path = out_dir / name
        write_shard(path, split_tokens(rng, token_ids, n_tokens))
        paths.append(path)
    temporary = out_dir / f".{STAMP}.{os.getpid()}"
    temporary.write_text(stamp(seed, train_tokens, val_tokens))
    temporary.replace(out_dir / STAMP)
    return paths


def markov_corpus(out_dir, seed=0, train_tokens=8_000_000, val_tokens=262_144, vocab=512, topics=8,
                  write_shard=None):
    """The tests' and the GPU smoke's corpus (the synthetic corpus before December 2026), into the
    same two shards: BOS-led documents of a sparse Markov chain per topic; topic and previous token
    reach ~1.1 nats/token, so a tiny model learns it in a few steps (a 5-gram sees all of it)."""
    write_shard = write_shard or default_write_shard
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / STAMP).unlink(missing_ok=True)  # (not the corpus a stamp would name)
    rng = np.random.default_rng(seed)
    token_ids = rng.choice(np.arange(1000, 50000), size=vocab, replace=False)
    successors = rng.integers(0, vocab, size=(topics, vocab, 4))
    probs = np.array([0.6, 0.25, 0.1, 0.05])
    paths = []
    for name, n_tokens in (("synthetic_val_000000.bin", val_tokens),
                           ("synthetic_train_000001.bin", train_tokens)):
        docs = []
        total = 0
        while total < n_tokens:
            n_docs, doc_len = 512, 1024
            topic = rng.integers(0, topics, size=n_docs)
            state = rng.integers(0, vocab, size=n_docs)
            choices = rng.choice(4, size=(doc_len, n_docs), p=probs)
            seq = np.empty((n_docs, doc_len), dtype=np.int64)
            for t in range(doc_len):
                seq[:, t] = state
                state = successors[topic, state, choices[t]]
            lengths = rng.integers(32, doc_len, size=n_docs)
            for row, length in zip(seq, lengths):
                docs.append(np.concatenate([[BOS_ID], token_ids[row[:length]]]))
                total += length + 1
        path = out_dir / name
        write_shard(path, np.concatenate(docs)[:n_tokens])
        paths.append(path)
    return paths


def main(argv=None):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from shards import CliParser, DataError, describe_os_error, exit_with_error
    parser = CliParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path,
                        help="folder the two shards are written into")
    parser.add_argument("--seed", type=int, default=0, help="numpy seed of the corpus (default: 0)")
    parser.add_argument("--train_tokens", type=int, default=TRAIN_TOKENS,
                        help=f"tokens in the training shard (default: {TRAIN_TOKENS})")
    parser.add_argument("--val_tokens", type=int, default=VAL_TOKENS,
                        help=f"tokens in the validation shard (default: {VAL_TOKENS})")
    args = parser.parse_args(argv)
    for flag, value in (("--train_tokens", args.train_tokens), ("--val_tokens", args.val_tokens)):
        if value <= 0:
            exit_with_error(PROG, f"{flag} must be positive, got {value}")
    if args.seed < 0:
        exit_with_error(PROG, f"--seed must be >= 0, got {args.seed}")
    try:
        paths = synthetic_corpus(args.out, args.seed, args.train_tokens, args.val_tokens)
    except OSError as e:
        exit_with_error(PROG, f"--out {args.out}: {describe_os_error(e)}")
    except DataError as e:
        exit_with_error(PROG, e)
    for path, n_tokens in zip(paths, (args.val_tokens, args.train_tokens)):
        print(f"{path}: {n_tokens} tokens")


if __name__ == "__main__":
    main()
