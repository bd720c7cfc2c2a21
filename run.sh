#!/usr/bin/env bash
# Launch train_gpt.py on every visible GPU (torchrun), or the `cpu` preset on one process without a GPU.
# Extra arguments pass through, e.g. ./run.sh --val_loss_every 125
# $PYTHON picks the interpreter (default python3: many CUDA images have no `python`).
# RESTARTS=K: torchrun restarts the workers up to K times after a crash, and they continue from the newest
# checkpoint (--resume auto with a run id made here unless you pass --run_id; add --save_every N).
# A stop signal (SIGTERM, SIGUSR1, SIGHUP, Ctrl-C) to torchrun reaches its workers, which checkpoint and stop;
# torchrun waits $TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds for them (here 300 unless set) before it kills them.
set -euo pipefail
cd "$(dirname "$0")"
python=${PYTHON:-python3}
args=("$@")
launch=(--standalone)
restarts=${RESTARTS:-0}
if ! [[ "$restarts" =~ ^[0-9]{1,9}$ ]]; then
  echo "run.sh: error: RESTARTS=$restarts is not a number of restarts; set it to 0 to 999999999 (or unset it)" >&2
  exit 2
fi
restarts=$((10#$restarts))
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
# torchrun's default, 30 s, can end a worker on a CPU (two steps and a validation) before its stop checkpoint
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-300}

# torchrun through the same interpreter (the torchrun on PATH may belong to another one); stopped by a signal,
# it ends with one line (its workers' own lines say where they stopped) instead of its traceback
torchrun='import sys
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main
sys.argv[0] = "torchrun"
try:
    main()
except SignalException as e:
    print(f"run.sh: torchrun stopped by {e.sigval.name} and passed it on to its workers", file=sys.stderr)
    sys.exit(128 + e.sigval)'

# bad flags are one line here, before torchrun starts (its workers would each print it, again at every restart)
check_flags() {
  "$python" - "$@" <<'EOF' || exit 2
import sys
import train_gpt
try:
    train_gpt.parse_args(sys.argv[1:])
except train_gpt.ConfigError as e:
    print(f"train_gpt.py: error: {e}", file=sys.stderr)
    sys.exit(2)
EOF
}

# torch's count honours CUDA_VISIBLE_DEVICES (nvidia-smi -L lists every GPU of the machine)
gpus=$("$python" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "${gpus:-0}" -gt 0 ]; then
  check_flags "${args[@]}"
  exec "$python" -c "$torchrun" "${launch[@]}" --nproc_per_node="$gpus" train_gpt.py "${args[@]}"
fi
echo "run.sh: no GPU found; running the cpu preset on one process" >&2
if [ "$restarts" -gt 0 ]; then
  check_flags --preset cpu "${args[@]}"
  exec "$python" -c "$torchrun" "${launch[@]}" --nproc_per_node=1 train_gpt.py --preset cpu "${args[@]}"
fi
exec "$python" train_gpt.py --preset cpu "${args[@]}"
