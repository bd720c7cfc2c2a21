#!/usr/bin/env bash
# Launch train_gpt.py on every visible GPU (torchrun), or the `cpu` preset on one process without a GPU.
# Extra arguments pass through, e.g. ./run.sh --val_loss_every 125
# $PYTHON picks the interpreter (default python3: many CUDA images have no `python`).
# RESTARTS=K: torchrun restarts the workers up to K times after a crash, and they continue from the newest
# checkpoint (--resume auto with a run id made here unless you pass --run_id; add --save_every N).
set -euo pipefail
cd "$(dirname "$0")"
python=${PYTHON:-python3}
args=("$@")
launch=(--standalone)
restarts=${RESTARTS:-0}
if ! [[ "$restarts" =~ ^[0-9]+$ ]]; then
  echo "run.sh: error: RESTARTS=$restarts is not a number of restarts; set it to 0 or more (or unset it)" >&2
  exit 2
fi
if [ "$restarts" -gt 0 ]; then
  case " $* " in
    *" --run_id "* | *" --run_id="*) ;;
    *)
      run_id="run-$(date +%Y%m%d-%H%M%S)-$$"
      args=(--run_id "$run_id" "${args[@]}")
      echo "run.sh: RESTARTS=$restarts: run id $run_id" >&2 ;;
  esac
  args=(--resume auto "${args[@]}")  # (a --resume of yours comes later and wins)
  launch+=(--max-restarts "$restarts")
  # restarted workers must not find the previous attempt's addresses in torchrun's store (pytorch#135712)
  export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
fi
# the agent passes SIGUSR1 (SLURM's --signal) on to the workers, which checkpoint and stop, as for SIGTERM
export TORCHELASTIC_SIGNALS_TO_HANDLE="SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
# torch's count honours CUDA_VISIBLE_DEVICES (nvidia-smi -L lists every GPU of the machine)
gpus=$("$python" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
# torchrun through the same interpreter (the torchrun on PATH may belong to another one)
if [ "${gpus:-0}" -gt 0 ]; then
  exec "$python" -m torch.distributed.run "${launch[@]}" --nproc_per_node="$gpus" train_gpt.py "${args[@]}"
fi
echo "run.sh: no GPU found; running the cpu preset on one process" >&2
if [ "$restarts" -gt 0 ]; then
  exec "$python" -m torch.distributed.run "${launch[@]}" --nproc_per_node=1 train_gpt.py --preset cpu "${args[@]}"
fi
exec "$python" train_gpt.py --preset cpu "${args[@]}"
