#!/usr/bin/env python3
"""records: extract, replay, diff, summarize and plot speedrun run logs.

This tool reads run logs only; it never imports the trainer.

Log-format contract (what ``train_gpt.py`` writes on rank 0 to ``logs/<run_id>.txt``)
--------------------------------------------------------------------------------------
1. The trainer's source exactly as read from disk (UTF-8 text; it ends with a newline;
   if it does not, the trainer writes one newline so that the separator starts a line).
2. A separator line: exactly 100 ``=`` characters followed by ``\\n``.
   The source itself must not contain a line that is exactly 100 ``=`` characters.
3. The environment block (Python, torch, CUDA, Triton versions, ``nvidia-smi`` ...).
4. The same separator line again.
5. The run output. Step lines are exactly::

       step:{s}/{N} val_loss:{loss:.4f} train_time:{ms:.0f}ms step_avg:{ms/s:.2f}ms
       step:{s}/{N} train_time:{ms:.0f}ms step_avg:{avg:.2f}ms

   and the run ends with a peak-memory line and a throughput line (ignored here).

In code (the trainer side)::

    f.write(source if source.endswith("\\n") else source + "\\n")
    f.write("=" * 100 + "\\n")
    f.write(environment_block)        # ends with "\\n"
    f.write("=" * 100 + "\\n")
    ...                                # run output, one line per print

``extract`` returns every byte before the first separator line, so for a source that ends
with a newline the extracted script is byte-for-byte the trainer's source. Step lines are
parsed from everything after the first separator. The final validation loss of a run is
the last ``val_loss`` step line; the run's train time is that line's ``train_time``.

Usage: ``python records/records.py {extract,replay,diff,stats,plot} --help``.
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import re
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

SEPARATOR = "=" * 100
DEFAULT_TARGET = 3.28
DEFAULT_ALPHA = 0.01
REPO_ROOT = Path(__file__).resolve().parent.parent

_NUM = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_VAL_RE = re.compile(
    rf"^step:(\d+)/(\d+) val_loss:(\S+) train_time:({_NUM})ms step_avg:(\S+)ms[ \t\r]*$",
    re.M,
)


class RecordError(Exception):
    """A user-facing error; the CLI prints it as one line and exits non-zero."""


# ---------------------------------------------------------------------------------------
# reading logs


def _read_bytes(path: Path) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise RecordError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise RecordError(f"{path}: is a directory, expected a log file") from None
    except OSError as e:
        raise RecordError(f"{path}: cannot read ({e.strerror or e})") from None


def _split(data: bytes, path) -> tuple[bytes, bytes]:
    """Split a log into (script bytes, bytes after the first separator line)."""
    sep = SEPARATOR.encode()
    pos = 0
    for line in data.splitlines(keepends=True):
        if line.rstrip(b"\r\n") == sep:
            return data[:pos], data[pos + len(line):]
        pos += len(line)
    raise RecordError(f"{path}: no separator line of 100 '=' (not a speedrun log?)")


def extract_script_bytes(path) -> bytes:
    """The script part of a log, byte for byte."""
    return _split(_read_bytes(Path(path)), path)[0]


def extract_script(path) -> str:
    """The script part of a log as text."""
    return extract_script_bytes(path).decode("utf-8", errors="replace")


@dataclass
class Run:
    """The parsed contents of one log."""

    path: Path
    val_steps: list[int] = field(default_factory=list)
    val_losses: list[float] = field(default_factory=list)
    val_times_ms: list[float] = field(default_factory=list)
    num_steps: int = 0  # N of the last validation line

    @property
    def name(self) -> str:
        return self.path.stem

    @property
    def final_step(self) -> int:
        return self.val_steps[-1]

    @property
    def final_loss(self) -> float:
        return self.val_losses[-1]

    @property
    def final_time_ms(self) -> float:
        return self.val_times_ms[-1]

    @property
    def complete(self) -> bool:
        return self.final_step == self.num_steps


def parse_log(path) -> Run:
    """Parse a log; errors if it has no separator or no validation line."""
    path = Path(path)
    _, run_part = _split(_read_bytes(path), path)
    text = run_part.decode("utf-8", errors="replace")
    run = Run(path=path)
    for m in _VAL_RE.finditer(text):
        try:
            loss = float(m.group(3))
        except ValueError:
            raise RecordError(
                f"{path}: unreadable val_loss {m.group(3)!r} in line {m.group(0).strip()!r}"
            ) from None
        run.val_steps.append(int(m.group(1)))
        run.num_steps = int(m.group(2))
        run.val_losses.append(loss)
        run.val_times_ms.append(float(m.group(4)))
    if not run.val_losses:
        raise RecordError(f"{path}: no final val line ('step:S/N val_loss:...') in the run output")
    return run


def logs_in(path) -> list[Path]:
    """The logs a PATH argument names: a file, or every *.txt in a folder (sorted)."""
    path = Path(path)
    if path.is_dir():
        logs = sorted(p for p in path.iterdir() if p.suffix == ".txt" and p.is_file())
        if not logs:
            raise RecordError(f"{path}: folder contains no logs (*.txt)")
        return logs
    if not path.exists():
        raise RecordError(f"{path}: no such file or folder")
    return [path]


def expand(paths) -> list[Path]:
    out: list[Path] = []
    for p in paths:
        out.extend(logs_in(p))
    return out


def first_log(path) -> Path:
    """A log file, or the first log (sorted by name) of a record folder."""
    return logs_in(path)[0]


# ---------------------------------------------------------------------------------------
# commands


def script_diff(a, b, context: int = 3) -> str:
    """Unified diff of the scripts of two logs (or record folders: their first log)."""
    la, lb = first_log(a), first_log(b)
    sa = extract_script(la).splitlines(keepends=True)
    sb = extract_script(lb).splitlines(keepends=True)
    lines = []
    for line in difflib.unified_diff(sa, sb, fromfile=str(la), tofile=str(lb), n=context):
        lines.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(lines)


def _fmt_p(p: float) -> str:
    if p is None or not math.isfinite(p):
        return "n/a"
    return f"{p:.4f}" if p >= 1e-4 else f"{p:.2e}"


def _fmt(x: float, spec: str) -> str:
    return "n/a" if x is None or not math.isfinite(x) else format(x, spec)


def summarize(runs: list[Run], target: float = DEFAULT_TARGET) -> dict:
    """Mean/std (ddof=1) of final losses and train times, one-sided t-test p-value."""
    import numpy as np

    losses = np.array([r.final_loss for r in runs], dtype=np.float64)
    times = np.array([r.final_time_ms for r in runs], dtype=np.float64) / 1000.0
    n = len(runs)
    out = {
        "n": n,
        "losses": losses.tolist(),
        "times_s": times.tolist(),
        "mean_loss": float(losses.mean()),
        "std_loss": float(losses.std(ddof=1)) if n > 1 else float("nan"),
        "mean_time_s": float(times.mean()),
        "std_time_s": float(times.std(ddof=1)) if n > 1 else float("nan"),
        "target": target,
        "p": float("nan"),
    }
    if n > 1:
        from scipy import stats

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. zero variance
            res = stats.ttest_1samp(losses, target, alternative="less")
        out["p"] = float(res.pvalue)
    return out


def stats_report(paths, target: float = DEFAULT_TARGET, alpha: float = DEFAULT_ALPHA) -> str:
    runs = [parse_log(p) for p in expand(paths)]
    s = summarize(runs, target)
    names = [str(r.path) for r in runs]
    steps = [f"{r.final_step}/{r.num_steps}" for r in runs]
    w_name = max(len("log"), *(len(x) for x in names))
    w_step = max(len("step"), *(len(x) for x in steps))
    head = f"{'log':<{w_name}}  {'step':>{w_step}}  {'val_loss':>8}  {'train_time':>12}"
    lines = [head, "-" * len(head)]
    for r, name, st in zip(runs, names, steps):
        mark = "" if r.complete else "  (incomplete: last val before final step)"
        lines.append(
            f"{name:<{w_name}}  {st:>{w_step}}  {r.final_loss:>8.4f}  "
            f"{r.final_time_ms / 1000:>11.3f}s{mark}"
        )
    lines.append(
        f"n={s['n']} mean_loss={s['mean_loss']:.4f} std_loss={_fmt(s['std_loss'], '.4f')} "
        f"p={_fmt_p(s['p'])} (target {target:g}, one-sided t-test) "
        f"mean_time={s['mean_time_s']:.3f}s std_time={_fmt(s['std_time_s'], '.3f')}{'s' if s['n'] > 1 else ''}"
    )
    if s["n"] < 2:
        lines.append("verdict: need at least 2 runs for the t-test")
    else:
        ok = math.isfinite(s["p"]) and s["p"] < alpha
        rel = "<" if ok else "not <"
        lines.append(
            f"verdict: {'PASS' if ok else 'FAIL'} (mean loss below {target:g} at p {rel} {alpha:g})"
        )
    return "\n".join(lines) + "\n"


def plot_runs(paths, target: float | None = DEFAULT_TARGET, ylim=None):
    """Figure with val loss vs train time and vs step, one labelled line per run."""
    from matplotlib.figure import Figure

    runs = [parse_log(p) for p in expand(paths)]
    fig = Figure(figsize=(12, 4.5), layout="constrained")
    ax_t, ax_s = fig.subplots(1, 2)
    for r in runs:
        t = [ms / 1000 for ms in r.val_times_ms]
        ax_t.plot(t, r.val_losses, marker=".", label=r.name)
        ax_s.plot(r.val_steps, r.val_losses, marker=".", label=r.name)
    for ax, xlabel in ((ax_t, "train time (s)"), (ax_s, "step")):
        if target is not None:
            ax.axhline(target, color="gray", linestyle="--", linewidth=0.8, label="_target")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("val loss")
        ax.grid(True, alpha=0.3)
        if ylim is not None:
            ax.set_ylim(*ylim)
    ax_t.set_title("val loss vs train time")
    ax_s.set_title("val loss vs step")
    ax_s.legend(fontsize="small")
    return fig


def count_gpus() -> int:
    """Number of CUDA GPUs per `nvidia-smi -L` (0 if none or no nvidia-smi)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return 0
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return 0
    if out.returncode != 0:
        return 0
    n = sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [v for v in visible.split(",") if v.strip()]
        if not ids or ids[0].strip() == "-1":
            return 0
        n = min(n, len(ids))
    return n


def replay(log, extra_args=(), nproc: int | None = None, workdir=None) -> int:
    """Write the log's script to `<workdir>/.replay_<stem>.py`, run it, remove it.

    workdir defaults to the repository root (so relative paths like data/fineweb10B
    resolve). nproc: None = auto (torchrun on all GPUs, else plain python), 0 = plain
    python, K = torchrun with K processes. Returns the run's exit code.
    """
    log = first_log(log)
    script = extract_script_bytes(log)
    workdir = Path(workdir) if workdir is not None else REPO_ROOT
    if not workdir.is_dir():
        raise RecordError(f"{workdir}: working folder does not exist")
    tmp = workdir / f".replay_{log.stem}.py"
    if nproc is None:
        nproc = count_gpus()
    if nproc > 0:
        launcher = shutil.which("torchrun")
        launcher = [launcher] if launcher else [sys.executable, "-m", "torch.distributed.run"]
        cmd = launcher + ["--standalone", f"--nproc_per_node={nproc}", tmp.name]
    else:
        cmd = [sys.executable, tmp.name]
    cmd += list(extra_args)
    tmp.write_bytes(script)
    try:
        print(f"replay: {log} -> (cwd {workdir}) {' '.join(cmd)}", file=sys.stderr, flush=True)
        try:
            return subprocess.call(cmd, cwd=workdir)
        except OSError as e:
            raise RecordError(f"{cmd[0]}: cannot run ({e.strerror or e})") from None
    finally:
        try:
            tmp.unlink()
        except OSError:
            pass


# ---------------------------------------------------------------------------------------
# CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="records",
        description="Extract, replay, diff, summarize and plot speedrun run logs.",
    )
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", required=True)

    q = sub.add_parser("extract", help="print the script stored in a log",
                       description="Print the script part of a log (everything before the "
                                   "first line of 100 '='), byte for byte.")
    q.add_argument("log", metavar="LOG", help="log file or record folder (its first log)")
    q.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout")

    q = sub.add_parser(
        "replay", help="run the script stored in a log",
        description="Extract the script of LOG to .replay_<stem>.py in the working folder "
                    "(default: the repository root, so relative data paths resolve), run it "
                    "with `torchrun --standalone --nproc_per_node=K` (K = GPUs found by "
                    "`nvidia-smi -L`) or plain python when there is no GPU, remove it, and "
                    "exit with the run's exit code. Arguments after `--` go to the script "
                    "(e.g. `replay LOG -- --preset cpu`).",
        usage="records replay [-h] [--nproc K] [--dir DIR] LOG [-- ARGS...]",
    )
    q.add_argument("log", metavar="LOG", help="log file or record folder (its first log)")
    q.add_argument("--nproc", type=int, default=None, metavar="K",
                   help="processes for torchrun; 0 = plain python (default: number of GPUs)")
    q.add_argument("--dir", default=None, metavar="DIR",
                   help="folder to write the script to and run it in (default: repo root)")

    q = sub.add_parser("diff", help="unified diff of two records' scripts",
                       description="Unified diff of the scripts of A and B (log files, or "
                                   "record folders meaning their first log by name).")
    q.add_argument("a", metavar="A")
    q.add_argument("b", metavar="B")
    q.add_argument("-U", "--context", type=int, default=3, metavar="N",
                   help="lines of context (default 3)")

    q = sub.add_parser("stats", help="final val loss / train time table and t-test",
                       description="Per-run final val loss and train time, their mean and "
                                   "sample std, and the one-sided one-sample t-test p-value "
                                   "that the mean loss is below the target.")
    q.add_argument("paths", nargs="+", metavar="PATH", help="log files or folders of logs")
    q.add_argument("--target", type=float, default=DEFAULT_TARGET,
                   help=f"target val loss (default {DEFAULT_TARGET})")
    q.add_argument("--alpha", type=float, default=DEFAULT_ALPHA,
                   help=f"significance level for the verdict line (default {DEFAULT_ALPHA})")

    q = sub.add_parser("plot", help="plot val loss against train time and step",
                       description="Plot val loss against train time and against step "
                                   "(two subplots), one labelled line per run.")
    q.add_argument("paths", nargs="+", metavar="PATH", help="log files or folders of logs")
    q.add_argument("-o", "--output", required=True, metavar="FILE.png", help="image to write")
    q.add_argument("--target", type=float, default=DEFAULT_TARGET,
                   help=f"draw a dashed line at this loss (default {DEFAULT_TARGET})")
    q.add_argument("--ylim", type=float, nargs=2, default=None, metavar=("LO", "HI"),
                   help="val loss axis limits")
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    # `replay LOG -- args`: split at the first `--` after `replay` ourselves, so
    # script arguments that look like options never reach argparse.
    extra: list[str] = []
    if argv and argv[0] == "replay" and "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    args = parser.parse_args(argv)
    try:
        if args.cmd == "extract":
            data = extract_script_bytes(first_log(args.log))
            if args.output:
                try:
                    Path(args.output).write_bytes(data)
                except OSError as e:
                    raise RecordError(f"{args.output}: cannot write ({e.strerror or e})") from None
            else:
                sys.stdout.flush()
                sys.stdout.buffer.write(data)
                sys.stdout.buffer.flush()
            return 0
        if args.cmd == "replay":
            return replay(args.log, extra, nproc=args.nproc, workdir=args.dir)
        if args.cmd == "diff":
            out = script_diff(args.a, args.b, context=args.context)
            sys.stdout.write(out)
            if not out:
                print("scripts are identical", file=sys.stderr)
            return 0
        if args.cmd == "stats":
            sys.stdout.write(stats_report(args.paths, target=args.target, alpha=args.alpha))
            return 0
        if args.cmd == "plot":
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                raise RecordError("plot needs matplotlib: pip install matplotlib") from None
            fig = plot_runs(args.paths, target=args.target, ylim=args.ylim)
            try:
                fig.savefig(args.output, dpi=120)
            except (OSError, ValueError) as e:
                raise RecordError(f"{args.output}: cannot write image ({e})") from None
            print(f"wrote {args.output}", file=sys.stderr)
            return 0
    except RecordError as e:
        print(f"records: error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # e.g. `records extract LOG | head`
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0
    parser.error(f"unknown command {args.cmd}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
