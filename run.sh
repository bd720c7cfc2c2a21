#!/usr/bin/env bash
# Launch train_gpt.py on every local GPU (torchrun), or the `cpu` preset on one process without a GPU.
# Extra arguments pass through, e.g. ./run.sh --val_loss_every 125
set -euo pipefail
cd "$(dirname "$0")"
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [ "${gpus:-0}" -gt 0 ]; then
  exec torchrun --standalone --nproc_per_node="$gpus" train_gpt.py "$@"
fi
echo "run.sh: no GPU found; running the cpu preset on one process" >&2
exec python train_gpt.py --preset cpu "$@"
