#!/usr/bin/env bash
# One-GPU smoke test of the record path: the plan, then one line per check (PASS / FAIL / SKIP / INFO),
# exit 1 on a FAIL. $PYTHON picks the interpreter (default python3: many CUDA images have no `python`).
#   tools/gpu_smoke.sh                 on a machine with a CUDA GPU (the plan line's budget: about 7.5 minutes
#                                      cold on one H200; checks that would end past --deadline S, default 480, skip)
#   tools/gpu_smoke.sh --dry-run       the same checks at toy sizes on the CPU (the test suite runs this)
#   tools/gpu_smoke.sh --only A,B      those checks alone (a rerun of what a run skipped)
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" tools/gpu_smoke.py "$@"
