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
