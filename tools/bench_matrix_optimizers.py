"""Milliseconds per training step of each --matrix_optimizer on the cpu preset (or any flags), one
after another in this process: median over the timed steps, and the ratio to NorMuon's.

    python tools/bench_matrix_optimizers.py                       # synthetic corpus, 2 threads
    python tools/bench_matrix_optimizers.py --steps 24 -- --train_files 'data/novels/novels_train_*.bin' \\
        --val_files 'data/novels/novels_val_*.bin'

The first steps of each optimizer are not timed (state allocation; Shampoo's and SOAP's first
eigendecompositions happen at step 1 and every precondition-frequency steps after, so the timed
window covers whole refresh periods).
"""
import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import train_gpt as tg  # noqa: E402


def median_step_ms(argv, warmup, steps):
    trainer = tg.Trainer(tg.parse_args(argv), argv)
    for step in range(warmup):
        trainer.train_step(trainer.begin_step(step))
    times = []
    for step in range(warmup, warmup + steps):
        start = time.perf_counter()
        trainer.train_step(trainer.begin_step(step))
        times.append(1000 * (time.perf_counter() - start))
    trainer.loader.close()
    return sorted(times)[len(times) // 2]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="bench_matrix_optimizers.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per optimizer (default 20)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("extra", nargs="*", help="train_gpt.py flags after --")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.threads < 1:
        parser.error("--steps and --threads must be positive, --warmup >= 0")
    logs = tempfile.mkdtemp(prefix="bench_matrix_")
    base = ["--preset", "cpu", "--device", "cpu", "--cpu_threads", str(args.threads), "--log_dir", logs, *args.extra]
    results = {}
    for name in tg.MATRIX_OPTIMIZERS:
        results[name] = median_step_ms([*base, "--matrix_optimizer", name], args.warmup, args.steps)
        print(f"{name:8s} {results[name]:8.1f} ms/step  ({results[name] / results['normuon']:.2f}x NorMuon)", flush=True)
    shutil.rmtree(logs, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
