"""train_gpt.main with faults injected at exact points, for tests/test_recovery.py (a plain script, not
a test module). The arguments are train_gpt.py's; the faults come from the environment:

- FAULT_AFTER_STEP="RANK:STEP:SIGNAL" sends SIGNAL (TERM, USR1, KILL, ...) to this process once STEP
  is done on global rank RANK, in the first attempt only (a torchrun restart runs clean);
- FAULT_IN_FSYNC="SIGNAL", once that signal is sent, sends SIGNAL again inside every fsync, i.e. in the
  middle of each later checkpoint write, before its rename.
The log and checkpoints record train_gpt.py itself: this file only wraps two of its functions.
"""
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import train_gpt as tg  # noqa: E402


SENT = []  # the signal of FAULT_AFTER_STEP, once sent


def signal_after_step(rank, step, sig):
    real = tg.Trainer.log_step

    def log_step(self, s, val_loss=None):
        real(self, s, val_loss)
        if val_loss is None and s == step and self.rank == rank:
            SENT.append(sig)
            os.kill(os.getpid(), sig)

    tg.Trainer.log_step = log_step


def signal_in_fsync(sig):
    real = os.fsync

    def fsync(fd):
        if SENT:
            os.kill(os.getpid(), sig)
        real(fd)

    tg.os.fsync = fsync


if __name__ == "__main__":
    if os.environ.get("FAULT_AFTER_STEP") and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        rank, step, name = os.environ["FAULT_AFTER_STEP"].split(":")
        signal_after_step(int(rank), int(step), signal.Signals[f"SIG{name}"])
    if os.environ.get("FAULT_IN_FSYNC"):
        signal_in_fsync(signal.Signals[f"SIG{os.environ['FAULT_IN_FSYNC']}"])
    tg.main(sys.argv[1:])
