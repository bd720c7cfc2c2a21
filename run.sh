#!/usr/bin/env bash
# Launch train_gpt.py on every visible GPU (torchrun), or the `cpu` preset on one process without a GPU.
# Extra arguments pass through, e.g. ./run.sh --val_loss_every 125
# $PYTHON picks the interpreter (default python3: many CUDA images have no `python`).
set -euo pipefail
cd "$(dirname "$0")"
python=${PYTHON:-python3}
# torch's count honours CUDA_VISIBLE_DEVICES (nvidia-smi -L lists every GPU of the machine)
gpus=$("$python" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "${gpus:-0}" -gt 0 ]; then
  # torchrun through the same interpreter (the torchrun on PATH may belong to another one)
  exec "$python" -m torch.distributed.run --standalone --nproc_per_node="$gpus" train_gpt.py "$@"
fi
echo "run.sh: no GPU found; running the cpu preset on one process" >&2
exec "$python" train_gpt.py --preset cpu "$@"
