"""Tests for the records CLI (records/records.py): synthetic logs, in-process calls."""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RECORDS_PY = REPO / "records" / "records.py"
SEP = "=" * 100

_spec = importlib.util.spec_from_file_location("records_cli", RECORDS_PY)
rec = importlib.util.module_from_spec(_spec)
sys.modules["records_cli"] = rec  # dataclasses need the module registered
_spec.loader.exec_module(rec)

LOSSES = [3.2772, 3.2796, 3.2781, 3.2783, 3.2769]

SCRIPT = '''import os
import sys

def main():
    print("=" * 100)  # not a separator line: the literal is not 100 '='
    print("step:{step}/{n} val_loss:{loss:.4f} train_time:{ms:.0f}ms step_avg:{avg:.2f}ms")
    x = 1
    return x

if __name__ == "__main__":
    main()
'''


def make_log(path, final_loss=3.28, script=SCRIPT, n=2035, val_every=250, step_ms=61.0,
             final_val=True, separator=True):
    """Write a log in the trainer's format; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    out = [script]
    if separator:
        out.append(SEP + "\n")
    out.append("Running Python 3.11.7\nRunning PyTorch 2.10.0\n"
               "+-------------------+\n|=========+=========|\n")
    if separator:
        out.append(SEP + "\n")
    for s in range(n + 1):
        ms = s * step_ms
        if s > 0:
            out.append(f"step:{s}/{n} train_time:{ms:.0f}ms step_avg:{ms / s:.2f}ms\n")
        if final_val and (s % val_every == 0 or s == n):
            loss = final_loss if s == n else 10.8 - 7.0 * s / n
            out.append(f"step:{s}/{n} val_loss:{loss:.4f} train_time:{ms:.0f}ms "
                       f"step_avg:{ms / max(s, 1):.2f}ms\n")
    out.append("peak memory allocated: 30000 MiB reserved: 32000 MiB\n")
    out.append("throughput: 1.0M tokens/s\n")
    path.write_text("".join(out))
    return path


def record_folder(tmp_path, losses=LOSSES, name="2025-11-29_Test"):
    d = tmp_path / "track_1_short" / name
    for i, loss in enumerate(losses):
        make_log(d / f"run{i}.txt", final_loss=loss, step_ms=61.0 + 0.1 * i)
    (d / "README.md").write_text("# test record\n")
    return d


# --------------------------------------------------------------------------- extract

def test_extract_exact_bytes(tmp_path, capsysbinary):
    log = make_log(tmp_path / "a.txt")
    assert rec.extract_script_bytes(log) == SCRIPT.encode()
    assert rec.main(["extract", str(log)]) == 0
    assert capsysbinary.readouterr().out == SCRIPT.encode()


def test_extract_to_file_and_folder(tmp_path):
    d = record_folder(tmp_path)
    out = tmp_path / "x.py"
    assert rec.main(["extract", str(d), "-o", str(out)]) == 0
    assert out.read_bytes() == SCRIPT.encode()


def test_extract_no_separator(tmp_path, capsys):
    log = make_log(tmp_path / "bad.txt", separator=False)
    assert rec.main(["extract", str(log)]) != 0
    err = capsys.readouterr().err
    assert str(log) in err and "separator" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


# --------------------------------------------------------------------------- stats

def test_stats_reference_numbers(tmp_path, capsys):
    d = record_folder(tmp_path)
    s = rec.summarize([rec.parse_log(p) for p in rec.expand([d])])
    assert s["n"] == 5
    assert s["mean_loss"] == pytest.approx(3.2780, abs=5e-5)
    assert s["std_loss"] == pytest.approx(0.0011, abs=5e-5)
    assert s["p"] == pytest.approx(0.0070, abs=5e-5)
    assert s["mean_time_s"] == pytest.approx(2035 * 61.2 / 1000, abs=1e-3)

    assert rec.main(["stats", str(d)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    summary = [l for l in lines if l.startswith("n=")]
    assert len(summary) == 1
    assert summary[0].startswith(
        "n=5 mean_loss=3.2780 std_loss=0.0011 p=0.0070 (target 3.28, one-sided t-test) mean_time=")
    assert "PASS" in out
    for i, loss in enumerate(LOSSES):
        row = [l for l in lines if f"run{i}.txt" in l]
        assert len(row) == 1 and f"{loss:.4f}" in row[0] and "2035/2035" in row[0]
    # aligned table: every data row has the same length as the header
    rows = lines[: 2 + len(LOSSES)]
    assert len({len(r) for r in rows}) == 1


def test_stats_files_and_target(tmp_path, capsys):
    d = record_folder(tmp_path)
    files = [str(p) for p in sorted(d.glob("*.txt"))]
    assert rec.main(["stats", *files, "--target", "3.279"]) == 0
    out = capsys.readouterr().out
    assert "n=5 " in out and "(target 3.279," in out and "FAIL" in out


def test_stats_names_file_without_final_val(tmp_path, capsys):
    d = record_folder(tmp_path)
    bad = make_log(d / "run9.txt", final_val=False)
    assert rec.main(["stats", str(d)]) != 0
    cap = capsys.readouterr()
    assert str(bad) in cap.err and "val" in cap.err
    assert len(cap.err.strip().splitlines()) == 1 and "Traceback" not in cap.err


def test_stats_empty_folder_and_missing(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "README.md").write_text("nothing\n")
    assert rec.main(["stats", str(empty)]) != 0
    err = capsys.readouterr().err
    assert str(empty) in err and "no logs" in err and len(err.strip().splitlines()) == 1
    assert rec.main(["stats", str(tmp_path / "nope.txt")]) != 0
    assert "nope.txt" in capsys.readouterr().err


def test_stats_single_run(tmp_path, capsys):
    log = make_log(tmp_path / "one.txt", final_loss=3.2700)
    assert rec.main(["stats", str(log)]) == 0
    out = capsys.readouterr().out
    assert "n=1 mean_loss=3.2700 std_loss=n/a p=n/a" in out


def test_stats_incomplete_run_flagged(tmp_path, capsys):
    log = make_log(tmp_path / "cut.txt", n=2035)
    text = log.read_text()
    log.write_text(text[: text.index("step:1001/2035")])  # killed mid-run
    r = rec.parse_log(log)
    assert r.final_step == 1000 and not r.complete
    assert rec.main(["stats", str(log)]) == 0
    assert "incomplete" in capsys.readouterr().out


# --------------------------------------------------------------------------- diff

def test_diff_shows_exactly_the_changed_line(tmp_path, capsys):
    a = make_log(tmp_path / "A" / "a.txt")
    b = make_log(tmp_path / "B" / "b.txt", script=SCRIPT.replace("x = 1", "x = 2"))
    assert rec.main(["diff", str(a), str(b)]) == 0
    out = capsys.readouterr().out.splitlines()
    minus = [l for l in out if l.startswith("-") and not l.startswith("---")]
    plus = [l for l in out if l.startswith("+") and not l.startswith("+++")]
    assert minus == ["-    x = 1"] and plus == ["+    x = 2"]
    assert any(l.startswith("--- ") and "a.txt" in l for l in out)
    # folders mean their first log by name
    assert rec.main(["diff", str(tmp_path / "A"), str(tmp_path / "B")]) == 0
    assert capsys.readouterr().out.splitlines() == out


def test_diff_identical_is_empty(tmp_path, capsys):
    a = make_log(tmp_path / "a.txt")
    b = make_log(tmp_path / "b.txt", final_loss=3.1)
    assert rec.main(["diff", str(a), str(b)]) == 0
    assert capsys.readouterr().out == ""


# --------------------------------------------------------------------------- plot

def test_plot_one_curve_per_run(tmp_path):
    pytest.importorskip("matplotlib")
    d = record_folder(tmp_path, losses=LOSSES[:3])
    extra = make_log(tmp_path / "other.txt", final_loss=3.30)
    fig = rec.plot_runs([d, extra])
    ax_t, ax_s = fig.axes[:2]
    for ax in (ax_t, ax_s):
        runs = [l for l in ax.get_lines() if not l.get_label().startswith("_")]
        assert len(runs) == 4
    legend = ax_s.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["run0", "run1", "run2", "other"]
    png = tmp_path / "p.png"
    assert rec.main(["plot", str(d), str(extra), "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- replay

def test_replay_runs_script_and_passes_args(tmp_path):
    script = ("import sys, pathlib\n"
              "pathlib.Path('replayed.txt').write_text(' '.join(sys.argv[1:]))\n"
              "sys.exit(3)\n")
    log = make_log(tmp_path / "logs" / "abc.txt", script=script)
    rc = rec.main(["replay", "--nproc", "0", "--dir", str(tmp_path), str(log),
                   "--", "--preset", "cpu", "-x"])
    assert rc == 3
    assert (tmp_path / "replayed.txt").read_text() == "--preset cpu -x"
    assert not (tmp_path / ".replay_abc.py").exists()


FAKE_TRAINER = """import sys, time, uuid
from pathlib import Path

def main():
    source = Path(__file__).read_text(encoding="utf-8")
    Path("logs").mkdir(exist_ok=True)
    with open(f"logs/{uuid.uuid4()}.txt", "w", encoding="utf-8") as f:
        f.write(source if source.endswith("\\n") else source + "\\n")
        f.write("=" * 100 + "\\n")
        f.write(f"Running Python {sys.version}\\n")
        f.write("=" * 100 + "\\n")
        n = 4
        for s in range(n + 1):
            ms = 10.0 * s
            if s:
                f.write(f"step:{s}/{n} train_time:{ms:.0f}ms step_avg:{ms / s:.2f}ms\\n")
            if s % 2 == 0:
                f.write(f"step:{s}/{n} val_loss:{5.0 - s / 10:.4f} train_time:{ms:.0f}ms "
                        f"step_avg:{ms / max(s, 1):.2f}ms\\n")
        f.write("peak memory: n/a on CPU\\n")

if __name__ == "__main__":
    main()
"""


def test_contract_roundtrip_with_fake_trainer(tmp_path):
    """A minimal trainer that follows the documented log contract: extract gives its
    exact source back and replay writes a new log with the same script part."""
    (tmp_path / "train_gpt.py").write_text(FAKE_TRAINER)
    subprocess.run([sys.executable, "train_gpt.py"], cwd=tmp_path, check=True, timeout=60)
    (log,) = (tmp_path / "logs").glob("*.txt")
    assert rec.extract_script_bytes(log) == FAKE_TRAINER.encode()
    run = rec.parse_log(log)
    assert run.val_steps == [0, 2, 4] and run.final_loss == pytest.approx(4.6)
    assert run.final_time_ms == 40 and run.complete
    assert rec.main(["replay", "--nproc", "0", "--dir", str(tmp_path), str(log)]) == 0
    new = [p for p in (tmp_path / "logs").glob("*.txt") if p != log]
    assert len(new) == 1
    assert rec.extract_script_bytes(new[0]) == FAKE_TRAINER.encode()


# --------------------------------------------------------------------------- CLI as a script

def test_cli_runs_as_script(tmp_path):
    d = record_folder(tmp_path)
    r = subprocess.run([sys.executable, str(RECORDS_PY), "stats", str(d)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "p=0.0070" in r.stdout
    for cmd in ("extract", "replay", "diff", "stats", "plot"):
        r = subprocess.run([sys.executable, str(RECORDS_PY), cmd, "--help"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "usage" in r.stdout.lower()


# --------------------------------------------------------------------------- with the real trainer

# The cpu preset shrunk to seconds: a narrow model, 512-token steps, 1,024 validation tokens.
TRAIN_ARGS = ["--preset", "cpu", "--num_scheduled_iterations", "4", "--num_extension_iterations", "0",
              "--val_loss_every", "2", "--model_dim", "64", "--head_dim", "32", "--batch_sizes", "512", "512", "512",
              "--max_seq_len", "256", "--window_blocks", "2", "2", "2", "--extension_window_blocks", "2",
              "--final_val_window_blocks", "2", "--val_tokens", "1024", "--val_batch_size", "512"]


def test_extract_and_replay_real_trainer_log(tmp_path):
    """A real trainer log (synthetic data generated under tmp_path) round-trips through extract and replay."""
    trainer = REPO / "train_gpt.py"
    shutil.copy2(trainer, tmp_path / "train_gpt.py")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    r = subprocess.run([sys.executable, "train_gpt.py", *TRAIN_ARGS], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    logs = sorted((tmp_path / "logs").glob("*.txt"))
    assert len(logs) == 1
    log = logs[0]
    assert rec.extract_script_bytes(log) == trainer.read_bytes()
    run = rec.parse_log(log)
    assert run.complete and run.final_step == 4 and run.val_steps[-1] == 4

    rc = rec.main(["replay", "--nproc", "0", "--dir", str(tmp_path), str(log),
                   "--", *TRAIN_ARGS])
    assert rc == 0
    new = [p for p in (tmp_path / "logs").glob("*.txt") if p != log]
    assert len(new) == 1
    assert rec.extract_script_bytes(new[0]) == rec.extract_script_bytes(log)
    assert not list(tmp_path.glob(".replay_*.py"))
