#!/usr/bin/env python3
"""records: extract, replay, diff, summarize and plot speedrun run logs.

This tool reads run logs only; it never imports the trainer.

Log-format contract (what ``train_gpt.py`` writes on rank 0 to ``logs/<run_id>.txt``)
--------------------------------------------------------------------------------------
1. The trainer's source exactly as read from disk (UTF-8 text; it ends with a newline;
   if it does not, the trainer writes one newline so that the separator starts a line).
   A run that loads files of its own beside the script (track3.py, ngram_prior.py) carries
   each after it under a header, as modded-nanogpt's logs carry triton_kernels.py:
   ``"\\n\\n" + "-" * 40 + "\\n# NAME\\n" + "-" * 40 + "\\n\\n"`` and the file's text
   (``split_files``); older logs hold the script alone.
2. A separator line: exactly 100 ``=`` characters followed by ``\\n``.
   The source itself must not contain a line that is exactly 100 ``=`` characters.
3. The environment block (Python, torch, CUDA, Triton versions, ``nvidia-smi`` ...). Its
   last line is ``script_sha256 <64 hex>``: the sha256 of the UTF-8 bytes of part 1
   exactly. Logs written before this line existed are read too (without verification).
4. The same separator line again.
5. The run output. Its first line is ``args: <JSON list of the command-line arguments>``
   (older logs: ``args: <the arguments joined by spaces>``), then ``hyperparameters: {...}``,
   then ``world_size N  grad_accum A  device D``. Step lines are exactly::

       step:{s}/{N} val_loss:{loss:.4f} train_time:{ms:.0f}ms step_avg:{ms/s:.2f}ms
       step:{s}/{N} train_time:{ms:.0f}ms step_avg:{avg:.2f}ms

   and the run ends with a peak-memory line and a throughput line (ignored here).

In code (the trainer side)::

    source = source if source.endswith("\\n") else source + "\\n"
    f.write(source)
    f.write("=" * 100 + "\\n")
    f.write(environment_block)        # ends with "\\n"
    f.write(f"script_sha256 {sha256(source.encode()).hexdigest()}\\n")
    f.write("=" * 100 + "\\n")
    ...                                # run output, one line per print

Every command first checks that a log has both separator lines (``split_log``); a file cut
before its second one (it records neither ``script_sha256`` nor the arguments) is refused as
truncated or not a log of this trainer. ``extract`` returns every byte before the first
separator line, so for a source that ends with a newline the extracted script is
byte-for-byte the trainer's source; ``extract`` and ``replay`` check it against
``script_sha256``; ``extract`` prints the script alone (``--file NAME`` a companion file,
``--all DIR`` every file), ``replay`` writes every file to a folder of its own and runs the
script there, and ``diff`` compares the files one by one. Step lines are parsed from the run output. The final validation loss of a
run is the last ``val_loss`` step line; the run's train time is that line's ``train_time``.

Usage: ``python records/records.py {extract,replay,diff,stats,plot} --help``.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import glob
import hashlib
import io
import json
import math
import os
import re
import secrets
import shlex
import shutil
import stat
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

SEPARATOR = "=" * 100
DEFAULT_TARGET = 3.28  # track_1_short's (records/README.md), also for logs outside a track folder
# the target val loss of each track's rules; None: no fixed one (lower wins, or a record's mean)
TRACK_TARGETS = {"track_1_short": DEFAULT_TARGET, "track_cpu": None, "track_3_cpu": None,
                 "track_3": None}
DEFAULT_ALPHA = 0.01
REPO_ROOT = Path(__file__).resolve().parent.parent

_NUM = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_VAL_RE = re.compile(
    rf"^step:(\d+)/(\d+) val_loss:(\S+) train_time:({_NUM})ms step_avg:(\S+)ms[ \t\r]*$",
    re.M,
)
_SHA_RE = re.compile(r"[0-9a-f]{64}")
_EMBEDDED_SHA_RE = re.compile(rb"^script_sha256 [0-9a-f]{64}\r?$", re.M)
_WORLD_RE = re.compile(r"^world_size (\d+)(?:\s|$)", re.M)
# the header before each companion file in a log's code part (train_gpt.COMPANION_HEADER)
_COMPANION_RE = re.compile(rb"\n\n-{40}\n# ([A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)*\.py)\n-{40}\n\n")
SCRIPT_NAME = "train_gpt.py"  # the script's name in a replay folder and in split_files
# A replay is a new run: these recorded flags (each takes one value) are not passed on.
DROPPED_FLAGS = ("--run_id", "--resume")


class RecordError(Exception):
    """A user-facing error; the CLI prints it as one line and exits with code 2."""


class UsageError(RecordError):
    """A command-line usage error (argparse's, reported the same way)."""


def warn(message: str) -> None:
    print(f"records.py: warning: {message}", file=sys.stderr, flush=True)


def write_output(path, data: bytes) -> None:
    """Write data to the file at path, all of it or nothing.

    A regular file (or a new one) is written to a unique temporary file in the same folder,
    fsynced and renamed over it (a link is followed; an existing file keeps its mode), so a
    failure leaves no partial or empty file and the old file untouched. Anything else (a
    device such as /dev/stdout or /dev/full, a pipe) is written directly. Any OSError is a
    RecordError `cannot write PATH: REASON`.
    """
    try:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISREG(st.st_mode):
            with open(path, "wb") as f:
                f.write(data)
            return
        folder, name = os.path.split(os.path.realpath(path))
        tmp = os.path.join(folder, f".{name}.{secrets.token_hex(6)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            with open(fd, "wb") as f:
                if st is not None:
                    os.fchmod(f.fileno(), stat.S_IMODE(st.st_mode))
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(folder, name))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as e:
        raise RecordError(f"cannot write {path}: {e.strerror or e}") from None


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


def _separators(data: bytes, limit: int = 2) -> list[tuple[int, int]]:
    """(start, end) byte offsets of the first `limit` separator lines in data."""
    sep = SEPARATOR.encode()
    out, pos = [], 0
    for line in data.splitlines(keepends=True):
        if line.rstrip(b"\r\n") == sep:
            out.append((pos, pos + len(line)))
            if len(out) == limit:
                break
        pos += len(line)
    return out


def is_log(data: bytes) -> bool:
    """Whether a file's contents are a log (it has a separator line) rather than a script."""
    return bool(_separators(data, limit=1))


def _not_a_log(path, why: str) -> RecordError:
    return RecordError(f"{path}: truncated or not a log of this trainer ({why}); use a complete log "
                       f"as train_gpt.py wrote it (logs/<run_id>.txt, or a record folder)")


@dataclass
class LogParts:
    """A log split at its separator lines (see the module docstring)."""

    script: bytes
    environment: str  # part 3
    output: str  # part 5


def split_log(data: bytes, path) -> LogParts:
    """Split a log at its two separator lines: the one check of a log's structure that every
    command makes. A file with fewer than two is refused (one line, naming the file)."""
    seps = _separators(data, limit=2)
    if not seps:
        raise _not_a_log(path, "no separator line of 100 '='")
    if len(seps) == 1:
        if _EMBEDDED_SHA_RE.search(data[:seps[0][0]]):
            # the environment's sha line sits inside the "script": the first separator line was cut
            raise RecordError(f"{path}: the script is cut short inside a line (its separator line is "
                              f"damaged, so it cannot be verified); the log is cut short or edited")
        raise _not_a_log(path, "it ends before the second line of 100 '=' that closes the "
                               "environment block, so it records no script_sha256 and no arguments")
    (s1, e1), (s2, e2) = seps
    return LogParts(data[:s1], data[e1:s2].decode("utf-8", errors="replace"),
                    data[e2:].decode("utf-8", errors="replace"))


def read_log(path) -> LogParts:
    return split_log(_read_bytes(Path(path)), path)


def recorded_sha256(parts: LogParts, path) -> str | None:
    """The hex digest on the log's `script_sha256` line, or None for logs without one."""
    lines = [l.strip() for l in parts.environment.splitlines() if l.startswith("script_sha256")]
    if not lines:
        return None
    value = lines[-1][len("script_sha256"):].strip()
    if not _SHA_RE.fullmatch(value):
        raise RecordError(f"{path}: malformed line {lines[-1][:90]!r} "
                          f"(expected 'script_sha256 <64 hex digits>')")
    return value


def verify_script(path, parts: LogParts | None = None, quiet: bool = False) -> bool:
    """Check the extracted script against the log's script_sha256 line.

    True: it matches. False: the log has no such line (older logs; a warning is printed
    unless quiet). A mismatch (the log was cut short or edited) raises RecordError.
    """
    parts = read_log(path) if parts is None else parts
    expected = recorded_sha256(parts, path)
    if expected is None:
        if not quiet:
            warn(f"{path} has no script_sha256 line; cannot verify the script")
        return False
    actual = hashlib.sha256(parts.script).hexdigest()
    if actual != expected:
        raise RecordError(f"{path}: the script does not match the log's script_sha256 "
                          f"(recorded {expected[:12]}..., extracted {actual[:12]}...); "
                          f"the log is cut short or edited")
    return True


def recorded_args(parts: LogParts, path) -> list[str] | None:
    """The command-line arguments on the run output's `args:` line (None if it has none).

    Current logs hold a JSON list; older ones the arguments joined by spaces, split here
    like a shell would (an argument that contained a space cannot be recovered).
    """
    line = next((l for l in parts.output.splitlines() if l.startswith("args:")), None)
    if line is None:
        return None
    text = line[len("args:"):].strip()
    if text.startswith("["):
        try:
            args = json.loads(text)
        except ValueError:
            args = None
        if not (isinstance(args, list) and all(isinstance(a, str) for a in args)):
            raise RecordError(f"{path}: unreadable args line {line[:90]!r} "
                              f"(expected a JSON list of strings)")
        return args
    try:
        return shlex.split(text)
    except ValueError as e:
        raise RecordError(f"{path}: unreadable args line {line[:90]!r} ({e})") from None


def recorded_world_size(parts: LogParts) -> int | None:
    """N of the run output's first `world_size N ...` line, or None."""
    m = _WORLD_RE.search(parts.output)
    return int(m.group(1)) if m else None


def _dropped(arg: str) -> bool:
    """Whether arg names one of DROPPED_FLAGS (argparse also accepts unique prefixes)."""
    name = arg.split("=", 1)[0]
    return len(name) > 3 and any(flag.startswith(name) for flag in DROPPED_FLAGS)


def replay_args(recorded, extra=()) -> list[str]:
    """The recorded arguments without --run_id/--resume and their values, then `extra`
    (the trainer's argparse keeps the last occurrence of a flag, so these override)."""
    out, args, i = [], list(recorded), 0
    while i < len(args):
        arg = args[i]
        if _dropped(arg):
            i += 1 if "=" in arg else 2
            continue
        out.append(arg)
        i += 1
    return out + list(extra)


def split_files(code: bytes) -> dict[str, bytes]:
    """{file name: bytes} of a log's code part: the script (as SCRIPT_NAME), then each companion
    file under its header; an older log's code is the script alone."""
    parts = _COMPANION_RE.split(code)
    files = {SCRIPT_NAME: parts[0]}
    for name, body in zip(parts[1::2], parts[2::2]):
        files[name.decode()] = body
    return files


def extract_script_bytes(path) -> bytes:
    """The script part of a log, byte for byte (not verified; see verify_script)."""
    return read_log(path).script


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

    @property
    def ms_per_step(self) -> float:
        return self.final_time_ms / self.final_step if self.final_step else float("nan")

    def first_step_at_or_below(self, target: float) -> int | None:
        """The first validation step whose loss is <= target (None if no step reaches it)."""
        return next((s for s, loss in zip(self.val_steps, self.val_losses) if loss <= target), None)


def parse_log(path) -> Run:
    """Parse a log; errors if it fails split_log's check or has no validation line."""
    path = Path(path)
    text = read_log(path).output
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


def files_of(path) -> tuple[Path, dict[str, bytes], bool]:
    """(path, {file name: bytes}, whether it is a log) of a log's code (split_files), a record
    folder's (its first log) or a plain script's (the script alone, as SCRIPT_NAME).

    A file with a separator line of 100 '=' is a log (checked like any log); a file without
    one is a script only if its name ends in .py and it is UTF-8 text.
    """
    path = Path(path)
    if path.is_dir():
        path = first_log(path)
    data = _read_bytes(path)
    if is_log(data):
        return path, split_files(split_log(data, path).script), True
    if path.suffix != ".py":
        raise _not_a_log(path, "no separator line of 100 '='; a plain script must be a .py file")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        raise RecordError(f"{path}: not UTF-8 text, so not a script; give a .py script, a log "
                          f"or a record folder") from None
    return path, {SCRIPT_NAME: data}, False


def beside(script, names) -> dict[str, bytes]:
    """The files of `names` (companion files) that lie beside a plain script."""
    return {name: _read_bytes(script.parent / name) for name in names
            if name != SCRIPT_NAME and (script.parent / name).is_file()}


def script_diff(a, b, context: int = 3) -> str:
    """Unified diff of two runs' code, file by file (the script, then each companion file of
    either): each a log, a record folder (its first log) or a script (with the companion files
    of the other side that lie beside it)."""
    la, fa, a_log = files_of(a)
    lb, fb, b_log = files_of(b)
    if not b_log:
        fb.update(beside(lb, fa))
    if not a_log:
        fa.update(beside(la, fb))
    lines = []
    for name in [*fa, *(n for n in fb if n not in fa)]:
        ta = fa.get(name, b"").decode("utf-8", errors="replace").splitlines(keepends=True)
        tb = fb.get(name, b"").decode("utf-8", errors="replace").splitlines(keepends=True)
        names = (str(la), str(lb)) if name == SCRIPT_NAME else (f"{la}:{name}", f"{lb}:{name}")
        for line in difflib.unified_diff(ta, tb, fromfile=names[0], tofile=names[1], n=context):
            lines.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(lines)


def _fmt_p(p: float) -> str:
    if p is None or not math.isfinite(p):
        return "n/a"
    return f"{p:.4f}" if p >= 1e-4 else f"{p:.2e}"


def _fmt(x: float, spec: str) -> str:
    return "n/a" if x is None or not math.isfinite(x) else format(x, spec)


def track_of(path) -> str | None:
    """The track folder (records/README.md's) a log or record lies in, if any."""
    parts = reversed(Path(path).resolve().parts)
    return next((part for part in parts if part in TRACK_TARGETS), None)


def default_target(paths) -> tuple[float | None, str | None]:
    """(target, the track that sets none): the target of the tracks' rules for logs given no
    --target; None where one of them lies in a track whose rules set no fixed target."""
    tracks = {track_of(p) for p in paths}
    untargeted = sorted(t for t in tracks if t is not None and TRACK_TARGETS[t] is None)
    return (None, untargeted[0]) if untargeted else (DEFAULT_TARGET, None)


def summarize(runs: list[Run], target: float | None = DEFAULT_TARGET) -> dict:
    """Mean/std (ddof=1) of final losses and train times, one-sided t-test p-value (none without a
    target)."""
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
    if n > 1 and target is not None:
        from scipy import stats

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. zero variance
            res = stats.ttest_1samp(losses, target, alternative="less")
        out["p"] = float(res.pvalue)
    return out


def compare(runs: list[Run], baseline: list[Run]) -> dict:
    """Whether the runs' mean final loss is below the baseline runs' mean: the difference of
    the means and the one-sided two-sample Welch t-test p-value (unequal variances)."""
    import numpy as np

    a = np.array([r.final_loss for r in runs], dtype=np.float64)
    b = np.array([r.final_loss for r in baseline], dtype=np.float64)
    out = {"n": len(b), "mean_loss": float(b.mean()), "diff": float(a.mean() - b.mean()),
           "p": float("nan")}
    if len(a) > 1 and len(b) > 1:
        from scipy import stats

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = stats.ttest_ind(a, b, equal_var=False, alternative="less")
        out["p"] = float(res.pvalue)
    return out


def stats_report(paths, target: float | None = None, alpha: float = DEFAULT_ALPHA,
                 against=None) -> str:
    """The stats table and summary; with `against` (baseline logs or folders) the verdict is
    the Welch test against those runs instead of the one-sample test against the target (by
    default the target of the logs' track: none for a track whose rules set none)."""
    untargeted = None
    if target is None:
        target, untargeted = default_target(paths)
    runs = [parse_log(p) for p in expand(paths)]
    s = summarize(runs, target)
    names = [str(r.path) for r in runs]
    steps = [f"{r.final_step}/{r.num_steps}" for r in runs]
    reached = [str(r.first_step_at_or_below(target) or "-") if target is not None else "-"
               for r in runs]
    w_name = max(len("log"), *(len(x) for x in names))
    w_step = max(len("step"), *(len(x) for x in steps))
    head = (f"{'log':<{w_name}}  {'step':>{w_step}}  {'val_loss':>8}  {'train_time':>12}  "
            f"{'ms/step':>9}  {'first<=target':>13}")
    lines = [head, "-" * len(head)]
    for r, name, st, first in zip(runs, names, steps, reached):
        mark = "" if r.complete else "  (incomplete: last val before final step)"
        lines.append(
            f"{name:<{w_name}}  {st:>{w_step}}  {r.final_loss:>8.4f}  "
            f"{r.final_time_ms / 1000:>11.3f}s  {_fmt(r.ms_per_step, '9.1f')}  {first:>13}{mark}"
        )
    lines.append(
        f"n={s['n']} mean_loss={s['mean_loss']:.4f} std_loss={_fmt(s['std_loss'], '.4f')} "
        f"p={_fmt_p(s['p'])} " +
        (f"(target {target:g}, one-sided t-test) " if target is not None else
         f"(no target: {untargeted}'s rules set none; pass --target LOSS) ") +
        f"mean_time={s['mean_time_s']:.3f}s std_time={_fmt(s['std_time_s'], '.3f')}{'s' if s['n'] > 1 else ''}"
    )
    if against:
        c = compare(runs, [parse_log(p) for p in expand(against)])
        lines.append(
            f"against n={c['n']} mean_loss={c['mean_loss']:.4f}: difference {c['diff']:+.4f} "
            f"p={_fmt_p(c['p'])} (one-sided Welch t-test)"
        )
        s, what = c, "below the baseline's mean"
    elif target is None:
        lines.append(f"verdict: none ({untargeted}'s rules set no target loss: lower wins; pass "
                     "--target LOSS to test the mean against one)")
        return "\n".join(lines) + "\n"
    else:
        what = f"below {target:g}"
    if s["n"] < 2 or len(runs) < 2:
        lines.append("verdict: need at least 2 runs for the t-test")
    else:
        ok = math.isfinite(s["p"]) and s["p"] < alpha
        rel = "<" if ok else "not <"
        lines.append(f"verdict: {'PASS' if ok else 'FAIL'} (mean loss {what} at p {rel} {alpha:g})")
    return "\n".join(lines) + "\n"


def plot_runs(paths, target: float | None = DEFAULT_TARGET, ylim=None, labels=None):
    """Figure with val loss vs train time and vs step, one labelled line per run (labels: the
    logs' names, or one given label per run)."""
    from matplotlib.figure import Figure

    runs = [parse_log(p) for p in expand(paths)]
    if labels is not None and len(labels) != len(runs):
        raise RecordError(f"--labels gives {len(labels)} labels for {len(runs)} runs; give one per run")
    fig = Figure(figsize=(12, 4.5), layout="constrained")
    ax_t, ax_s = fig.subplots(1, 2)
    for r, label in zip(runs, labels or [r.name for r in runs]):
        t = [ms / 1000 for ms in r.val_times_ms]
        ax_t.plot(t, r.val_losses, marker=".", label=label)
        ax_s.plot(r.val_steps, r.val_losses, marker=".", label=label)
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
    """CUDA devices torch sees (so CUDA_VISIBLE_DEVICES counts), asked in a subprocess
    so this tool never imports torch; 0 if torch is missing or fails."""
    code = "import torch; print(torch.cuda.device_count())"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=300)
    except (OSError, subprocess.SubprocessError):
        return 0
    try:
        return max(0, int(out.stdout.split()[-1])) if out.returncode == 0 else 0
    except (ValueError, IndexError):
        return 0


def choose_nproc(nproc: int | None = None, world_size: int | None = None, gpus=count_gpus) -> int:
    """Processes to launch, 0 meaning plain python (no torchrun).

    --nproc if given, else the log's recorded world_size, else the number of GPUs (gpus()
    is called at most once, only when needed). One process without a GPU: plain python.
    """
    if nproc is not None and nproc < 0:
        raise UsageError(f"--nproc must be >= 0, got {nproc}")
    cache: list[int] = []

    def n_gpus() -> int:
        if not cache:
            cache.append(gpus())
        return cache[0]

    k = nproc if nproc is not None else world_size if world_size is not None else n_gpus()
    return 0 if k == 0 or (k == 1 and n_gpus() == 0) else k


def replay_command(log, extra_args=(), nproc: int | None = None, use_recorded_args: bool = True,
                   script_name: str | None = None, gpus=count_gpus, parts: LogParts | None = None
                   ) -> list[str]:
    """The command `replay` runs for LOG (a log file): launcher, script, arguments.

    Arguments: the log's recorded ones (without --run_id/--resume) then extra_args; with
    use_recorded_args=False only extra_args. The process count is choose_nproc's.
    """
    log = Path(log)
    parts = read_log(log) if parts is None else parts
    args = list(extra_args)
    if use_recorded_args:
        recorded = recorded_args(parts, log)
        if recorded is None:
            warn(f"{log} has no args: line; passing only the arguments after --")
        else:
            args = replay_args(recorded, extra_args)
    k = choose_nproc(nproc, recorded_world_size(parts), gpus)
    script_name = script_name or f".replay_{log.stem}.py"
    if k == 0:
        return [sys.executable, script_name, *args]
    launcher = shutil.which("torchrun")
    launcher = [launcher] if launcher else [sys.executable, "-m", "torch.distributed.run"]
    return [*launcher, "--standalone", f"--nproc_per_node={k}", script_name, *args]


def data_script(pattern: str) -> str:
    """The command that builds the shards a glob names (as train_gpt.py's hint)."""
    if "novels" in pattern:
        return "python data/novels.py --out data/novels"
    return "python data/cached_fineweb10B.py"


def last_flag_value(args, flag: str) -> str | None:
    """The value of the last `flag VALUE` or `flag=VALUE` in args (the trainer keeps the last)."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1:]
    return value


def check_data(cmd, workdir: Path) -> None:
    """Refuse, before anything runs, a command whose --train_files or --val_files glob matches
    nothing in the working folder (under $DATA_PATH when set, as the trainer reads it), naming the
    script that builds them: the replayed script's own hint may predate the data it names."""
    root = workdir / os.environ.get("DATA_PATH", "")
    for flag in ("--train_files", "--val_files"):
        pattern = last_flag_value(cmd, flag)
        if pattern is not None and not glob.glob(str(root / pattern)):
            raise RecordError(f"the replayed run's {flag} {pattern!r} matches no file in {root}; "
                              f"build the data with `{data_script(pattern)}` there, or pass one "
                              f"that matches: -- {flag} GLOB")


def replay(log, extra_args=(), nproc: int | None = None, workdir=None,
           use_recorded_args: bool = True, gpus=count_gpus, force: bool = False) -> int:
    """Verify the log's code, write its files to `<workdir>/.replay_<stem>/` (the script as
    SCRIPT_NAME, each companion file beside it), run the script there, remove the folder.

    A log without a script_sha256 line is refused unless force (its script cannot be told
    from an edited one). workdir defaults to the repository root (so relative paths like
    data/fineweb10B resolve). The command is replay_command's; it is printed to stderr
    first. Returns the run's exit code.
    """
    log = first_log(log)
    parts = read_log(log)
    if not verify_script(log, parts, quiet=True):
        if not force:
            raise RecordError(f"{log} has no script_sha256 line, so its script cannot be checked against the one "
                              f"its run used (a log from before that line, or an edited one); pass --force to run "
                              f"it anyway")
        warn(f"{log} has no script_sha256 line; --force runs its script unverified")
    workdir = Path(workdir) if workdir is not None else REPO_ROOT
    if not workdir.is_dir():
        raise RecordError(f"{workdir}: working folder does not exist")
    tmp = workdir / f".replay_{log.stem}"
    cmd = replay_command(log, extra_args, nproc=nproc, use_recorded_args=use_recorded_args,
                         script_name=f"{tmp.name}/{SCRIPT_NAME}", gpus=gpus, parts=parts)
    check_data(cmd, workdir)
    try:
        tmp.mkdir(exist_ok=True)
        for name, data in split_files(parts.script).items():
            if ".." in Path(name).parts:
                raise RecordError(f"{log}: a file named {name!r} would land outside {tmp}")
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / name).write_bytes(data)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RecordError(f"{tmp}: cannot write ({e.strerror or e})") from None
    try:
        print(f"records.py: replay: cd {shlex.quote(str(workdir))} && {shlex.join(cmd)}",
              file=sys.stderr, flush=True)
        try:
            return subprocess.call(cmd, cwd=workdir)
        except OSError as e:
            raise RecordError(f"{cmd[0]}: cannot run ({e.strerror or e})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------------------
# CLI


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `records.py: error: <message>`, exit code 2."""

    def error(self, message):
        raise UsageError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="records.py",
        description="Extract, replay, diff, summarize and plot speedrun run logs.",
    )
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", required=True)

    q = sub.add_parser("extract", help="print the script stored in a log",
                       description="Print the script stored in a log, byte for byte, after "
                                   "checking the log's code (everything before the first line "
                                   "of 100 '=') against its script_sha256 line (a mismatch is "
                                   "an error; a log without that line gets a warning). A run's "
                                   "companion files (track3.py, ngram_prior.py) follow the script "
                                   "in its log: --file NAME prints one, --all DIR writes every "
                                   "file.")
    q.add_argument("log", metavar="LOG", help="log file or record folder (its first log)")
    q.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout")
    q.add_argument("--file", default=SCRIPT_NAME, metavar="NAME",
                   help=f"the file to print (default: the script, {SCRIPT_NAME})")
    q.add_argument("--all", metavar="DIR", help="write every file of the log's code into DIR")

    q = sub.add_parser(
        "replay", help="run the script stored in a log, with its recorded arguments",
        description="Check the code of LOG against its script_sha256 line, write its files "
                    "to .replay_<stem>/ in the working folder (default: the repository root, "
                    "so relative data paths resolve), run the script, remove them, and exit with the "
                    "run's exit code. Arguments: the log's recorded `args:` without --run_id "
                    "and --resume, then the arguments after `--` (the last occurrence of a "
                    "flag wins, so these override). Processes: --nproc, else the log's "
                    "world_size, else the number of GPUs torch sees; more than one, or one "
                    "with a GPU, runs `torchrun --standalone --nproc_per_node=K`, otherwise "
                    "plain python. The command is printed to stderr before it runs. A log without "
                    "a script_sha256 line is refused unless --force.",
        usage="records.py replay [-h] [--nproc K] [--dir DIR] [--no-args] [--force] LOG [-- ARGS...]",
    )
    q.add_argument("log", metavar="LOG", help="log file or record folder (its first log)")
    q.add_argument("--nproc", type=int, default=None, metavar="K",
                   help="processes (0 = plain python; default: the log's world_size, else "
                        "the number of GPUs)")
    q.add_argument("--dir", default=None, metavar="DIR",
                   help="folder to write the script to and run it in (default: repo root)")
    q.add_argument("--no-args", dest="no_args", action="store_true",
                   help="ignore the log's recorded arguments; pass only those after --")
    q.add_argument("--force", action="store_true",
                   help="run the script of a log that has no script_sha256 line (unverified)")

    q = sub.add_parser("diff", help="unified diff of two scripts",
                       description="Unified diff of the scripts of A and B. Each is a log, a "
                                   "record folder (its first log by name) or a plain script "
                                   "such as train_gpt.py (a .py file with no line of 100 '=').")
    q.add_argument("a", metavar="A")
    q.add_argument("b", metavar="B")
    q.add_argument("-U", "--context", type=int, default=3, metavar="N",
                   help="lines of context (default 3)")

    q = sub.add_parser("stats", help="final val loss / train time table and t-test",
                       description="Per-run final val loss, train time, ms/step and the first "
                                   "validation step at or below the target; their mean and "
                                   "sample std, and the one-sided one-sample t-test p-value "
                                   "that the mean loss is below the target (with --against: "
                                   "the one-sided Welch t-test p-value that it is below the "
                                   "baseline runs' mean).")
    q.add_argument("paths", nargs="+", metavar="PATH", help="log files or folders of logs")
    q.add_argument("--against", nargs="+", default=None, metavar="BASELINE",
                   help="baseline logs or folders: test the mean loss against theirs")
    q.add_argument("--target", type=float, default=None,
                   help=f"target val loss (default: the track's, {DEFAULT_TARGET} for "
                        "track_1_short and logs outside a track folder; none for track_cpu, "
                        "track_3_cpu and track_3)")
    q.add_argument("--alpha", type=float, default=DEFAULT_ALPHA,
                   help=f"significance level for the verdict line (default {DEFAULT_ALPHA})")

    q = sub.add_parser("plot", help="plot val loss against train time and step",
                       description="Plot val loss against train time and against step "
                                   "(two subplots), one labelled line per run.")
    q.add_argument("paths", nargs="+", metavar="PATH", help="log files or folders of logs")
    q.add_argument("-o", "--output", required=True, metavar="FILE.png",
                   help="image to write (its format from the name's ending, png if none)")
    q.add_argument("--target", type=float, default=None,
                   help="draw a dashed line at this loss (default: the track's target, as stats; "
                        "none: no line)")
    q.add_argument("--ylim", type=float, nargs=2, default=None, metavar=("LO", "HI"),
                   help="val loss axis limits")
    q.add_argument("--labels", nargs="+", default=None, metavar="LABEL",
                   help="one legend label per run, in the order of the runs (default: the log names)")
    return p


def write_stdout(data) -> None:
    """Write text or bytes to stdout, flushed: a failed write (`> FILE` on a full disk, `> /dev/full`) is one
    RecordError line (a closed pipe stays a BrokenPipeError: `| head` is no error)."""
    try:
        sys.stdout.flush()
        if isinstance(data, bytes):
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()
        else:
            sys.stdout.write(data)
            sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as e:
        discard_stdout()
        raise RecordError(f"cannot write to stdout: {e.strerror or e}") from None


def discard_stdout() -> None:
    """Point stdout's file descriptor at the null device, so that the interpreter's last flush of what
    stdout still holds cannot fail again (a second message after ours)."""
    with contextlib.suppress(OSError, ValueError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)


def _run(args, extra) -> int:
    if args.cmd == "extract":
        log = first_log(args.log)
        parts = read_log(log)
        verify_script(log, parts)
        files = split_files(parts.script)
        if args.all:
            Path(args.all).mkdir(parents=True, exist_ok=True)
            for name, data in files.items():
                if ".." in Path(name).parts:
                    raise RecordError(f"{log}: a file named {name!r} would land outside {args.all}")
                (Path(args.all) / name).parent.mkdir(parents=True, exist_ok=True)
                write_output(Path(args.all) / name, data)
            print(f"wrote {', '.join(files)} into {args.all}", file=sys.stderr)
            return 0
        if args.file not in files:
            raise UsageError(f"--file {args.file}: {log} holds {', '.join(files)}")
        if args.output:
            write_output(args.output, files[args.file])
        else:
            write_stdout(files[args.file])
        return 0
    if args.cmd == "replay":
        return replay(args.log, extra, nproc=args.nproc, workdir=args.dir,
                      use_recorded_args=not args.no_args, force=args.force)
    if args.cmd == "diff":
        if args.context < 0:
            raise UsageError(f"-U/--context must be >= 0, got {args.context}")
        out = script_diff(args.a, args.b, context=args.context)
        write_stdout(out)
        if not out:
            print("scripts are identical", file=sys.stderr)
        return 0
    if args.cmd in ("stats", "plot") and args.target is not None and not math.isfinite(args.target):
        raise UsageError(f"--target must be a finite val loss, got {args.target:g}")
    if args.cmd == "stats" and not 0 < args.alpha < 1:
        raise UsageError(f"--alpha must be a significance level in (0, 1), got {args.alpha:g}")
    if args.cmd == "stats":
        write_stdout(stats_report(args.paths, target=args.target, alpha=args.alpha, against=args.against))
        return 0
    if args.cmd == "plot":
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise RecordError("plot needs matplotlib: pip install matplotlib") from None
        if args.ylim is not None and not all(math.isfinite(v) for v in args.ylim):
            raise UsageError(f"--ylim needs two finite numbers, got {args.ylim[0]:g} {args.ylim[1]:g}")
        target = default_target(args.paths)[0] if args.target is None else args.target
        fig = plot_runs(args.paths, target=target, ylim=args.ylim, labels=args.labels)
        fmt = Path(args.output).suffix[1:].lower() or "png"  # e.g. /dev/full: png
        supported = fig.canvas.get_supported_filetypes()
        if fmt not in supported:
            raise UsageError(f"-o {args.output}: unknown image format '.{fmt}'; "
                             f"use a name ending in one of .{', .'.join(sorted(supported))}")
        image = io.BytesIO()  # drawn in memory first: a failure leaves no file behind
        try:
            fig.savefig(image, format=fmt, dpi=120)
        except ValueError as e:
            raise RecordError(f"cannot draw {args.output} ({e})") from None
        write_output(args.output, image.getvalue())
        print(f"wrote {args.output}", file=sys.stderr)
        return 0
    raise UsageError(f"unknown command {args.cmd}")


def main(argv=None) -> int:
    """Run the CLI; returns the exit code (2 and one stderr line for any error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # `replay LOG -- args`: split at the first `--` after `replay` ourselves, so
    # script arguments that look like options never reach argparse.
    extra: list[str] = []
    if argv and argv[0] == "replay" and "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    try:
        args = _parser().parse_args(argv)
        return _run(args, extra)
    except RecordError as e:
        print(f"records.py: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `records.py extract LOG | head`
        discard_stdout()
        return 0


if __name__ == "__main__":
    sys.exit(main())
