#!/usr/bin/env bash
# One-GPU smoke test of the record path: one line per check (PASS / FAIL / SKIP), exit 1 on a FAIL.
# $PYTHON picks the interpreter (default python3: many CUDA images have no `python`).
#   tools/gpu_smoke.sh            on a machine with a CUDA GPU (5-8 minutes on one H200)
#   tools/gpu_smoke.sh --dry-run  the same checks at toy sizes on CPU (CI runs this)
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" tools/gpu_smoke.py "$@"
