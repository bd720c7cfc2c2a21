"""Shared test setup: the repo root on sys.path, Triton's CPU interpreter when there is no GPU."""
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# triton.jit reads this when kernels are decorated, i.e. when train_gpt is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
