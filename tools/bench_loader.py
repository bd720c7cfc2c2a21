"""Throughput of the BOS-aligned training loader (train_gpt.TrainLoader.next_batch) on CPU.

    python tools/bench_loader.py [--tokens 20000000] [--shards 2] [--seconds 5]

Writes synthetic shards with realistic document lengths (log-normal, mean ~1000 tokens, some far
longer than max_seq_len) into a temporary folder and measures, for the record shape
(393,216 tokens per step, max_seq_len 2048):
  - rank 0 of 8 ranks: 49,152 tokens per call (what one process of an 8-GPU run asks for),
  - 1 rank: 393,216 tokens per call (one process doing the whole step),
in tokens per second of this process (the tokens it receives), shard crossings included.
Requirement: >= 5 million tokens/s per process; exit status 0 if it is met, 1 if not.
Bad flags, a corpus too small for a batch, or a failure to write the temporary shards print
one line ``bench_loader.py: error: ...`` on stderr and exit with status 2 (the data/ scripts'
convention, from data/shards.py).

The loader and the shard writer are the trainer's own: ``train_gpt.py`` one folder up.
"""

import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "data")]  # train_gpt.py, and data/shards.py for the CLI helpers

import torch  # noqa: E402

import train_gpt as tg  # noqa: E402
from shards import BOS_ID, CliParser, describe_os_error, exit_with_error  # noqa: E402

PROG = "bench_loader.py"
REQUIRED = 5e6


def write_corpus(folder, total_tokens, n_shards, seed=0):
    """BOS-started documents, log-normal lengths (median ~600, mean ~1000), random GPT-2 ids."""
    rng = np.random.default_rng(seed)
    lengths = []
    while sum(lengths) < total_tokens:
        lengths.extend(np.maximum(2, rng.lognormal(6.4, 1.0, size=100_000).astype(np.int64)).tolist())
    lengths = np.array(lengths)
    lengths = lengths[: np.searchsorted(np.cumsum(lengths), total_tokens) + 1]
    tokens = rng.integers(0, BOS_ID, size=int(lengths.sum()), dtype=np.uint16)
    tokens[np.cumsum(lengths) - lengths] = BOS_ID
    tokens = tokens[:total_tokens]
    paths = []
    for i, part in enumerate(np.array_split(tokens, n_shards)):
        path = Path(folder) / f"bench_train_{i:06d}.bin"
        tg.write_shard(path, part)
        paths.append(path)
    return lengths.mean(), paths


def measure(pattern, rank, world, rank_tokens, max_seq_len, seconds):
    start = time.perf_counter()
    loader = tg.TrainLoader(pattern, rank, world, torch.device("cpu"), cycle=True)
    setup = time.perf_counter() - start
    try:
        loader.next_batch(rank_tokens, max_seq_len)  # first call
        calls, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            loader.next_batch(rank_tokens, max_seq_len)
            calls += 1
        elapsed = time.perf_counter() - start
    finally:
        loader.close()
    return setup, calls, calls * rank_tokens / elapsed, loader.epoch


def main(argv=None):
    parser = CliParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=20_000_000, help="corpus size (default 20M)")
    parser.add_argument("--shards", type=int, default=2, help="number of shards (default 2, so batches cross shards)")
    parser.add_argument("--seconds", type=float, default=5.0, help="measuring time per configuration")
    parser.add_argument("--max_seq_len", type=int, default=2048)
    args = parser.parse_args(argv)
    for flag, value in (("--tokens", args.tokens), ("--shards", args.shards), ("--seconds", args.seconds),
                        ("--max_seq_len", args.max_seq_len)):
        if not value > 0:
            parser.error(f"{flag} {value}: must be positive")
    if args.shards > args.tokens:
        parser.error(f"--shards {args.shards}: more shards than --tokens {args.tokens}")
    try:
        return run(args)
    except tg.DataError as e:
        exit_with_error(PROG, f"{e}; pass a larger --tokens or fewer --shards")
    except OSError as e:
        exit_with_error(PROG, describe_os_error(e))


def run(args):
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        mean_len, paths = write_corpus(folder, args.tokens, args.shards)
        print(f"wrote {args.tokens:,} tokens in {len(paths)} shards (mean document {mean_len:.0f} tokens) "
              f"in {time.perf_counter() - start:.1f}s")
        pattern = str(Path(folder) / "bench_train_*.bin")
        ok = True
        for label, rank, world, rank_tokens in (("rank 0 of 8", 0, 8, 49_152), ("1 rank", 0, 1, 393_216)):
            setup, calls, rate, epochs = measure(pattern, rank, world, rank_tokens, args.max_seq_len, args.seconds)
            ok &= rate >= REQUIRED
            print(f"{label:12s} {rank_tokens:>7,} tokens/call, max_seq_len {args.max_seq_len}: "
                  f"{rate / 1e6:7.1f} M tokens/s ({calls} calls, {epochs} passes over the corpus; "
                  f"loader setup {setup * 1000:.0f} ms)")
        print(f"requirement >= {REQUIRED / 1e6:.0f} M tokens/s per process: {'met' if ok else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
