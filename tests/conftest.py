"""Shared test setup: the repo root and tools/ on sys.path, Triton's CPU interpreter when there is no GPU."""
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools"), str(ROOT / "data")]  # train_gpt; smoke_checks; synthetic

# triton.jit reads this when kernels are decorated, i.e. when train_gpt is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest-xdist's workers share the cores: torch's default of a thread per core in each of them
# oversubscribes the machine, and OpenMP's waiting threads then slow every worker down.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // WORKERS))
