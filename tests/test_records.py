"""Tests for the records CLI (records/records.py): synthetic logs, in-process calls."""

import hashlib
import importlib.util
import json
import os
import shlex
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
             final_val=True, separator=True, args=("--preset", "cpu"), world_size=1, sha=True):
    """Write a log in the trainer's format; returns the path.

    args: a list -> `args: <JSON>` (current format); a str -> `args: <str>` (older logs);
    None -> no args line. sha: True -> `script_sha256 <sha256 of script>` as the last line of
    the environment block; a str -> that value; None -> no such line (older logs).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    out = [script]
    if separator:
        out.append(SEP + "\n")
    out.append("Running Python 3.11.7\nRunning PyTorch 2.10.0\n"
               "+-------------------+\n|=========+=========|\n")
    if sha is True:
        sha = hashlib.sha256(script.encode("utf-8")).hexdigest()
    if sha is not None:
        out.append(f"script_sha256 {sha}\n")
    if separator:
        out.append(SEP + "\n")
    if args is not None:
        out.append(f"args: {args if isinstance(args, str) else json.dumps(list(args))}\n")
    out.append("hyperparameters: {'seed': 0}\n")
    if world_size is not None:
        out.append(f"world_size {world_size}  grad_accum 1  device cpu\n")
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
    path.write_text("".join(out), encoding="utf-8")
    return path


OLD_ARGS = "--preset cpu --seed 0 --train_files /data/example/novels/novels_train_*.bin"


def old_log(path, **kw):
    """A log as written before the script_sha256 line and JSON args (e.g. track_cpu Baseline)."""
    return make_log(path, args=OLD_ARGS, sha=None, **kw)


def one_error_line(err, *fragments):
    """stderr is exactly one `records.py: error: ...` line holding every fragment."""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("records.py: error: "), err
    for f in fragments:
        assert f in lines[0], (f, err)
    return lines[0]


def record_folder(tmp_path, losses=LOSSES, name="2025-11-29_Test", track="track_1_short"):
    d = tmp_path / track / name
    for i, loss in enumerate(losses):
        make_log(d / f"run{i}.txt", final_loss=loss, step_ms=61.0 + 0.1 * i)
    (d / "README.md").write_text("# test record\n")
    return d


# --------------------------------------------------------------------------- extract

def test_extract_exact_bytes(tmp_path, capsysbinary):
    log = make_log(tmp_path / "a.txt")
    assert rec.extract_script_bytes(log) == SCRIPT.encode()
    assert rec.main(["extract", str(log)]) == 0
    cap = capsysbinary.readouterr()
    assert cap.out == SCRIPT.encode() and cap.err == b""  # verified: no warning


def test_extract_to_file_and_folder(tmp_path):
    d = record_folder(tmp_path)
    out = tmp_path / "x.py"
    assert rec.main(["extract", str(d), "-o", str(out)]) == 0
    assert out.read_bytes() == SCRIPT.encode()


def test_extract_no_separator(tmp_path, capsys):
    log = make_log(tmp_path / "bad.txt", separator=False)
    assert rec.main(["extract", str(log)]) == 2
    one_error_line(capsys.readouterr().err, str(log), "separator")


# --------------------------------------------------------------------------- script_sha256

def edit_script_part(log, old, new):
    """Edit the script part of a log in place, leaving its script_sha256 line as it was."""
    data = log.read_bytes()
    cut = data.index((SEP + "\n").encode())
    script = data[:cut]
    assert script.count(old.encode()) == 1
    log.write_bytes(script.replace(old.encode(), new.encode()) + data[cut:])


def test_verify_script_good_log(tmp_path):
    log = make_log(tmp_path / "good.txt")
    assert rec.verify_script(log) is True
    parts = rec.read_log(log)
    assert parts.script == SCRIPT.encode()
    assert rec.recorded_sha256(parts, log) == hashlib.sha256(SCRIPT.encode()).hexdigest()


@pytest.mark.parametrize("cmd", ["extract", "replay"])
def test_one_edited_character_fails(tmp_path, capsys, cmd):
    marker = tmp_path / "ran.txt"
    script = f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\nx = 1\n"
    log = make_log(tmp_path / "logs" / "edited.txt", script=script)
    edit_script_part(log, "x = 1", "x = 2")
    recorded = hashlib.sha256(script.encode()).hexdigest()
    actual = hashlib.sha256(script.replace("x = 1", "x = 2").encode()).hexdigest()
    argv = [cmd, str(log)] if cmd == "extract" else [cmd, "--nproc", "0", "--dir", str(tmp_path), str(log)]
    assert rec.main(argv) == 2
    cap = capsys.readouterr()
    one_error_line(cap.err, str(log), "script_sha256", "cut short or edited", recorded[:12], actual[:12])
    assert cap.out == "" and not marker.exists() and not list(tmp_path.glob(".replay_*"))
    with pytest.raises(rec.RecordError):
        rec.verify_script(log)


def test_cut_short_script_never_replays(tmp_path, capsys):
    """The script part lost its last lines (the call of main): it would run nothing and exit 0."""
    marker = tmp_path / "ran.txt"
    script = (f"import pathlib\n\ndef main():\n    pathlib.Path({str(marker)!r}).write_text('ran')\n\n"
              f"if __name__ == '__main__':\n    main()\n")
    log = make_log(tmp_path / "cut.txt", script=script)
    edit_script_part(log, "if __name__ == '__main__':\n    main()\n", "")
    assert rec.main(["replay", "--nproc", "0", "--dir", str(tmp_path), str(log)]) == 2
    one_error_line(capsys.readouterr().err, str(log), "cut short or edited")
    assert not marker.exists() and not list(tmp_path.glob(".replay_*"))
    assert rec.main(["extract", str(log)]) == 2


def test_script_cut_inside_a_line_never_replays(tmp_path, capsys):
    """The log lost the middle of its file, so the script now ends inside a line and the first
    separator is no longer a line of its own: the sha line must not go unnoticed."""
    marker = tmp_path / "ran.txt"
    script = f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\nx = 'a long line'\n"
    log = make_log(tmp_path / "cut.txt", script=script)
    data = log.read_bytes()
    log.write_bytes(data[: len(script) - 5] + data[len(script):])  # "...a long l" + "=====..."
    assert rec.main(["replay", "--nproc", "0", "--dir", str(tmp_path), str(log)]) == 2
    one_error_line(capsys.readouterr().err, str(log), "cut short inside a line")
    assert not marker.exists() and not list(tmp_path.glob(".replay_*"))
    assert rec.main(["extract", str(log)]) == 2


def test_old_log_without_sha_warns_and_extracts(tmp_path, capsys):
    log = old_log(tmp_path / "old.txt")
    assert rec.verify_script(log, quiet=True) is False
    assert rec.main(["extract", str(log)]) == 0
    cap = capsys.readouterr()
    assert cap.out == SCRIPT
    assert cap.err == f"records.py: warning: {log} has no script_sha256 line; cannot verify the script\n"


def test_old_log_without_sha_replays_only_with_force(tmp_path, capsys):
    """A log without a script_sha256 line (from before that line, or edited to lose it) ran its script after a
    warning: now replay refuses it in one line unless --force."""
    marker = tmp_path / "ran.txt"
    log = old_log(tmp_path / "old.txt", script=f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n")
    argv = ["replay", "--no-args", "--nproc", "0", "--dir", str(tmp_path), str(log)]
    assert rec.main(argv) == 2
    one_error_line(capsys.readouterr().err, f"{log} has no script_sha256 line", "pass --force to run it anyway")
    assert not marker.exists() and not list(tmp_path.glob(".replay_*"))
    assert rec.main(["replay", "--force", *argv[1:]]) == 0 and marker.read_text() == "ran"
    assert capsys.readouterr().err.startswith(f"records.py: warning: {log} has no script_sha256 line; --force runs "
                                              f"its script unverified\n")


def test_malformed_sha_line_is_an_error(tmp_path, capsys):
    log = make_log(tmp_path / "bad.txt", sha="12345")
    assert rec.main(["extract", str(log)]) == 2
    one_error_line(capsys.readouterr().err, str(log), "script_sha256")


# --------------------------------------------------------------------------- truncated or not a log

def _cut_after_script(data, script):
    return data[: len(script) + len(SEP) + 1]  # the script and its separator line, nothing else


def _cut_inside_environment(data, script):
    return data[: data.index(b"script_sha256")]  # the environment's first lines only


def _cut_before_second_separator(data, script):
    return data[: data.index((SEP + "\n").encode(), len(script) + 1)]  # sha line kept, no 2nd separator


NOT_LOGS = {
    "cut_after_script": _cut_after_script,
    "cut_inside_environment": _cut_inside_environment,
    "cut_before_second_separator": _cut_before_second_separator,
    "binary_garbage": lambda data, script: bytes(range(256)) * 16 + b"\x00\xff" * 512,
    "empty": lambda data, script: b"",
}


@pytest.mark.parametrize("case", sorted(NOT_LOGS))
@pytest.mark.parametrize("cmd", ["extract", "replay", "diff", "stats"])
def test_truncated_or_foreign_file_is_refused(tmp_path, capsys, cmd, case):
    """Every command refuses, in one line, a file that is not a whole log: replay never runs a
    script that it cannot check, with no arguments; diff does not compare half a log."""
    marker = tmp_path / "ran.txt"
    script = f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
    good = make_log(tmp_path / "good.txt", script=script, n=4, val_every=2)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(NOT_LOGS[case](good.read_bytes(), script))
    argv = {"extract": ["extract", str(bad)],
            "replay": ["replay", "--nproc", "0", "--dir", str(tmp_path), str(bad)],
            "diff": ["diff", str(good), str(bad)],
            "stats": ["stats", str(bad)]}[cmd]
    assert rec.main(argv) == 2
    cap = capsys.readouterr()
    one_error_line(cap.err, str(bad), "truncated or not a log of this trainer", "complete log")
    assert cap.out == "" and not marker.exists() and not list(tmp_path.glob(".replay_*"))


def test_diff_plain_script_must_be_python_text(tmp_path, capsys):
    """Without a separator line only a .py file of UTF-8 text is a script: not a log cut inside
    its script, not binary data with a .py name; an empty .py is an (empty) script."""
    log = make_log(tmp_path / "a.txt", n=4, val_every=2)
    cut = tmp_path / "cut.txt"
    cut.write_bytes(log.read_bytes()[: len(SCRIPT) // 2])
    assert rec.main(["diff", str(log), str(cut)]) == 2
    one_error_line(capsys.readouterr().err, str(cut), "truncated or not a log", ".py file")
    garbage = tmp_path / "garbage.py"
    garbage.write_bytes(b"\xff\xfe\x00binary" * 100)
    assert rec.main(["diff", str(garbage), str(log)]) == 2
    one_error_line(capsys.readouterr().err, str(garbage), "not UTF-8 text")
    empty = tmp_path / "empty.py"
    empty.write_bytes(b"")
    assert rec.main(["diff", str(empty), str(log)]) == 0
    added = [l for l in capsys.readouterr().out.splitlines()[2:] if l.startswith("+")]
    assert added == ["+" + l for l in SCRIPT.splitlines()]


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


def test_stats_takes_the_target_from_the_tracks_rules(tmp_path, capsys):
    """A track_cpu record without --target got `verdict: FAIL (mean loss below 3.28 ...)`:
    track_1_short's target applied to a CPU record. track_cpu (lower wins) and track_3_cpu (the
    NorMuon record's mean, passed as --target) set no fixed target: no verdict unless --target is
    given; track_1_short keeps 3.28."""
    cpu = record_folder(tmp_path, losses=[4.96, 4.97, 4.955], track="track_cpu")
    assert rec.main(["stats", str(cpu)]) == 0
    out = capsys.readouterr().out
    assert "3.28" not in out and "FAIL" not in out and "PASS" not in out, out
    assert "p=n/a (no target: track_cpu's rules set none; pass --target LOSS)" in out, out
    assert out.splitlines()[-1] == ("verdict: none (track_cpu's rules set no target loss: lower "
                                    "wins; pass --target LOSS to test the mean against one)"), out
    assert rec.main(["stats", str(cpu), "--target", "5.0"]) == 0
    out = capsys.readouterr().out
    assert "(target 5," in out and out.splitlines()[-1].startswith("verdict: PASS"), out
    assert rec.main(["stats", str(record_folder(tmp_path))]) == 0  # track_1_short: 3.28
    assert "(target 3.28, one-sided t-test)" in capsys.readouterr().out


def test_stats_names_file_without_final_val(tmp_path, capsys):
    d = record_folder(tmp_path)
    bad = make_log(d / "run9.txt", final_val=False)
    assert rec.main(["stats", str(d)]) == 2
    one_error_line(capsys.readouterr().err, str(bad), "val")


def test_stats_empty_folder_and_missing(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "README.md").write_text("nothing\n")
    assert rec.main(["stats", str(empty)]) == 2
    one_error_line(capsys.readouterr().err, str(empty), "no logs")
    assert rec.main(["stats", str(tmp_path / "nope.txt")]) == 2
    one_error_line(capsys.readouterr().err, "nope.txt")


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


def test_stats_columns_ms_per_step_and_first_step_at_target(tmp_path, capsys):
    log = make_log(tmp_path / "a.txt", n=2035, val_every=250, step_ms=61.0)
    r = rec.parse_log(log)
    assert r.ms_per_step == pytest.approx(61.0, abs=0.01)
    # intermediate losses are 10.8 - 7 s / 2035: <= 5.0 from s = 1686, validated every 250
    assert r.first_step_at_or_below(5.0) == 1750
    assert r.first_step_at_or_below(3.0) is None
    assert rec.main(["stats", str(log), "--target", "5.0"]) == 0
    row = capsys.readouterr().out.splitlines()[2]
    assert row.split()[-2:] == ["61.0", "1750"]
    assert rec.main(["stats", str(log), "--target", "3.0"]) == 0
    assert capsys.readouterr().out.splitlines()[2].split()[-1] == "-"


def test_stats_against_baseline_is_welch_one_sided(tmp_path, capsys):
    from scipy import stats as st
    import numpy as np

    new, base = [3.270, 3.272, 3.275], [3.280, 3.284, 3.279, 3.290]
    a = record_folder(tmp_path, losses=new, name="A")
    b = record_folder(tmp_path, losses=base, name="B")
    va, vb = np.var(new, ddof=1) / 3, np.var(base, ddof=1) / 4
    t = (np.mean(new) - np.mean(base)) / np.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / 2 + vb ** 2 / 3)
    expected = st.t.cdf(t, df)
    c = rec.compare([rec.parse_log(p) for p in rec.expand([a])],
                    [rec.parse_log(p) for p in rec.expand([b])])
    assert c["n"] == 4 and c["diff"] == pytest.approx(np.mean(new) - np.mean(base), abs=1e-9)
    assert c["p"] == pytest.approx(expected, rel=1e-6)
    assert rec.main(["stats", str(a), "--against", str(b), "--alpha", "0.05"]) == 0
    out = capsys.readouterr().out
    assert f"against n=4 mean_loss={np.mean(base):.4f}" in out
    assert "PASS (mean loss below the baseline's mean" in out
    # the other way round the difference is positive and the test fails
    assert rec.main(["stats", str(b), "--against", str(a), "--alpha", "0.05"]) == 0
    assert "FAIL (mean loss below the baseline's mean" in capsys.readouterr().out


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


def test_diff_against_a_plain_script(tmp_path, capsys):
    """A file without a separator line is a script, e.g. the working train_gpt.py."""
    d = record_folder(tmp_path, losses=LOSSES[:3])
    work = tmp_path / "train_gpt.py"
    work.write_text(SCRIPT.replace("x = 1", "x = 2"))
    assert rec.main(["diff", str(d), str(work)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"--- {d / 'run0.txt'}" and out[1] == f"+++ {work}"
    assert [l for l in out[2:] if l[:1] in "+-"] == ["-    x = 1", "+    x = 2"]
    assert rec.main(["diff", str(work), str(d / "run1.txt")]) == 0  # either side
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"--- {work}"
    assert [l for l in out[2:] if l[:1] in "+-"] == ["-    x = 2", "+    x = 1"]
    (tmp_path / "same.py").write_text(SCRIPT)
    assert rec.main(["diff", str(tmp_path / "same.py"), str(d)]) == 0
    cap = capsys.readouterr()
    assert cap.out == "" and "identical" in cap.err


def test_diff_the_real_script_with_itself_as_a_log(tmp_path, capsys):
    """train_gpt.py names the separator but has no separator line: it reads as a script."""
    source = (REPO / "train_gpt.py").read_text(encoding="utf-8")
    log = make_log(tmp_path / "real.txt", script=source, n=4, val_every=2)
    assert rec.main(["diff", str(REPO / "train_gpt.py"), str(log)]) == 0
    assert capsys.readouterr().out == ""


COMPANION = "import torch\n\n\ndef step():\n    return 1\n"


def with_companions(script=SCRIPT, **files):
    """A run's code as its log carries it: the script, then each companion file under its header."""
    return script + "".join(f"\n\n{'-' * 40}\n# {name}\n{'-' * 40}\n\n{text}" for name, text in files.items())


def test_split_files_gives_the_script_and_each_companion_file_exactly():
    code = with_companions(**{"track3.py": COMPANION, "ngram_prior.py": "x = 1\n"}).encode()
    assert rec.split_files(code) == {"train_gpt.py": SCRIPT.encode(), "track3.py": COMPANION.encode(),
                                     "ngram_prior.py": b"x = 1\n"}
    assert rec.split_files(SCRIPT.encode()) == {"train_gpt.py": SCRIPT.encode()}  # an older, one-file log


def test_extract_prints_the_script_or_a_companion_and_writes_all(tmp_path, capsysbinary):
    log = make_log(tmp_path / "a.txt", script=with_companions(**{"track3.py": COMPANION}))
    assert rec.main(["extract", str(log)]) == 0
    assert capsysbinary.readouterr().out == SCRIPT.encode()
    assert rec.main(["extract", str(log), "--file", "track3.py"]) == 0
    assert capsysbinary.readouterr().out == COMPANION.encode()
    assert rec.main(["extract", str(log), "--all", str(tmp_path / "code")]) == 0
    assert "wrote train_gpt.py, track3.py into" in capsysbinary.readouterr().err.decode()
    assert sorted(p.name for p in (tmp_path / "code").iterdir()) == ["track3.py", "train_gpt.py"]
    assert (tmp_path / "code" / "track3.py").read_text() == COMPANION
    assert rec.main(["extract", str(log), "--file", "soap.py"]) == 2
    one_error_line(capsysbinary.readouterr().err.decode(), "soap.py", "train_gpt.py, track3.py")


def test_diff_shows_a_change_in_a_companion_file(tmp_path, capsys):
    a = make_log(tmp_path / "a.txt", script=with_companions(**{"track3.py": COMPANION}))
    b = make_log(tmp_path / "b.txt", script=with_companions(**{"track3.py": COMPANION.replace("1", "2")}))
    assert rec.main(["diff", str(a), str(b)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == [f"--- {a}:track3.py", f"+++ {b}:track3.py"]
    assert [l for l in out[2:] if l[:1] in "+-"] == ["-    return 1", "+    return 2"]
    # a plain script is compared with the companion files beside it
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "train_gpt.py").write_text(SCRIPT)
    (tmp_path / "work" / "track3.py").write_text(COMPANION)
    assert rec.main(["diff", str(a), str(tmp_path / "work" / "train_gpt.py")]) == 0
    assert capsys.readouterr().out == ""
    # a companion file only one side has shows whole
    c = make_log(tmp_path / "c.txt")
    assert rec.main(["diff", str(c), str(a)]) == 0
    assert "+    return 1" in capsys.readouterr().out.splitlines()


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
    # labels of one's own, one per run, in order; a count that does not match is refused
    fig = rec.plot_runs([d, extra], labels=["a", "b", "c", "d"])
    assert [t.get_text() for t in fig.axes[1].get_legend().get_texts()] == ["a", "b", "c", "d"]
    with pytest.raises(rec.RecordError, match="2 labels for 4 runs"):
        rec.plot_runs([d, extra], labels=["a", "b"])


def _only(folder, *names):
    """The folder holds exactly these files (no temporary or partial file left behind)."""
    assert sorted(p.name for p in folder.iterdir()) == sorted(names)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
@pytest.mark.parametrize("cmd", ["plot", "extract"])
def test_write_to_dev_full_is_one_error(tmp_path, capsys, cmd):
    """A device refuses the bytes (ENOSPC at write or close): exit 2, one line, no `wrote`."""
    if cmd == "plot":
        pytest.importorskip("matplotlib")
    log = make_log(tmp_path / "a.txt", n=4, val_every=2)
    assert rec.main([cmd, str(log), "-o", "/dev/full"]) == 2
    cap = capsys.readouterr()
    assert cap.err == "records.py: error: cannot write /dev/full: No space left on device\n"
    assert cap.out == ""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
@pytest.mark.parametrize("cmd", ["extract", "diff", "stats"])
def test_stdout_on_a_full_disk_is_one_error(tmp_path, cmd):
    """`records.py CMD ... > /dev/full`: the write (or its flush) fails with ENOSPC; one line, exit 2, and
    no second complaint from the interpreter's last flush."""
    log = make_log(tmp_path / "a.txt", n=4, val_every=2)
    other = make_log(tmp_path / "b.txt", script=SCRIPT.replace("x = 1", "x = 2"), n=4, val_every=2)
    args = {"extract": [log], "diff": [log, other], "stats": [log]}[cmd]
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, str(RECORDS_PY), cmd, *map(str, args)], stdout=full, stderr=subprocess.PIPE,
                              text=True, timeout=60)
    assert done.returncode == 2 and done.stderr == "records.py: error: cannot write to stdout: No space left on " \
                                                   "device\n", done.stderr


def test_plot_into_an_unwritable_folder(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    log = make_log(tmp_path / "a.txt", n=4, val_every=2)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        if os.access(locked, os.W_OK):  # root writes anyway
            pytest.skip("this user can write into a read-only folder")
        out = locked / "p.png"
        assert rec.main(["plot", str(log), "-o", str(out)]) == 2
        assert capsys.readouterr().err == f"records.py: error: cannot write {out}: Permission denied\n"
        _only(locked)
    finally:
        locked.chmod(0o755)


def test_plot_into_a_file_as_folder(tmp_path, capsys):
    """A folder that cannot be written into even by root: its name is a file."""
    pytest.importorskip("matplotlib")
    log = make_log(tmp_path / "a.txt", n=4, val_every=2)
    out = log / "p.png"
    assert rec.main(["plot", str(log), "-o", str(out)]) == 2
    assert capsys.readouterr().err == f"records.py: error: cannot write {out}: Not a directory\n"
    _only(tmp_path, "a.txt")


@pytest.mark.parametrize("cmd", ["plot", "extract"])
def test_failed_write_keeps_the_old_file(tmp_path, capsys, monkeypatch, cmd):
    """The disk fills up while the new file is written: the old one is untouched, no temporary
    file stays; when the write succeeds the file is replaced and keeps its mode."""
    if cmd == "plot":
        pytest.importorskip("matplotlib")
    log = make_log(tmp_path / "a.txt", n=4, val_every=2)
    out = tmp_path / "out" / ("p.png" if cmd == "plot" else "s.py")
    out.parent.mkdir()
    out.write_bytes(b"old")
    out.chmod(0o640)

    def full(fd):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(rec.os, "fsync", full)
        assert rec.main([cmd, str(log), "-o", str(out)]) == 2
    assert capsys.readouterr().err == f"records.py: error: cannot write {out}: No space left on device\n"
    assert out.read_bytes() == b"old"
    _only(out.parent, out.name)
    assert rec.main([cmd, str(log), "-o", str(out)]) == 0
    data = out.read_bytes()
    assert data == SCRIPT.encode() if cmd == "extract" else data[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_mode & 0o777 == 0o640
    _only(out.parent, out.name)
    assert capsys.readouterr().err == (f"wrote {out}\n" if cmd == "plot" else "")


def test_plot_bad_format_or_limits(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    log = make_log(tmp_path / "a.txt", n=4, val_every=2)
    assert rec.main(["plot", str(log), "-o", str(tmp_path / "p.xyz")]) == 2
    one_error_line(capsys.readouterr().err, "-o", "p.xyz", ".png")
    assert rec.main(["plot", str(log), "-o", str(tmp_path / "p.png"), "--ylim", "nan", "8"]) == 2
    one_error_line(capsys.readouterr().err, "--ylim", "finite")
    _only(tmp_path, "a.txt")


# --------------------------------------------------------------------------- replay: the command

def no_gpu():
    return 0


def test_replay_args_drop_run_id_and_resume_then_append():
    recorded = ["--preset", "cpu", "--run_id", "old", "--seed", "1", "--resume", "ck/s100.pt",
                "--val_files", "data/v_*.bin"]
    assert rec.replay_args(recorded, ["--seed", "2", "--fp8", "off"]) == [
        "--preset", "cpu", "--seed", "1", "--val_files", "data/v_*.bin", "--seed", "2", "--fp8", "off"]
    # `--flag=value` and argparse's unique prefixes name the same flags
    assert rec.replay_args(["--run_id=a", "--seed", "3", "--resume=b.pt", "--run", "c", "--resu", "d"]) == [
        "--seed", "3"]
    # a --run_id passed after `--` is the user's choice and is kept
    assert rec.replay_args(["--run_id", "old"], ["--run_id", "new"]) == ["--run_id", "new"]
    assert rec.replay_args([], []) == []


def test_replay_command_reuses_recorded_args(tmp_path):
    log = make_log(tmp_path / "abc.txt", n=4, val_every=2,
                   args=["--preset", "cpu", "--run_id", "abc", "--seed", "1", "--resume", "x.pt",
                         "--train_files", "data/with space/t_*.bin"])
    cmd = rec.replay_command(log, ["--seed", "2"], gpus=no_gpu)
    assert cmd == [sys.executable, ".replay_abc.py", "--preset", "cpu", "--seed", "1",
                   "--train_files", "data/with space/t_*.bin", "--seed", "2"]
    assert rec.replay_command(log, ["--seed", "2"], use_recorded_args=False, gpus=no_gpu,
                              script_name="s.py") == [sys.executable, "s.py", "--seed", "2"]


def test_replay_command_old_format_args(tmp_path):
    log = old_log(tmp_path / "old.txt", n=4, val_every=2)
    assert rec.recorded_args(rec.read_log(log), log) == OLD_ARGS.split()
    assert rec.replay_command(log, ["--seed", "7"], gpus=no_gpu)[2:] == OLD_ARGS.split() + ["--seed", "7"]
    quoted = make_log(tmp_path / "q.txt", n=4, val_every=2, args="--preset cpu --run_id 'my run' --seed 1",
                      sha=None)
    assert rec.replay_command(quoted, gpus=no_gpu)[2:] == ["--preset", "cpu", "--seed", "1"]


def test_replay_command_without_args_line_warns(tmp_path, capsys):
    log = make_log(tmp_path / "noargs.txt", n=4, val_every=2, args=None)
    assert rec.replay_command(log, ["-x"], gpus=no_gpu)[2:] == ["-x"]
    assert capsys.readouterr().err == (
        f"records.py: warning: {log} has no args: line; passing only the arguments after --\n")


def test_replay_command_unreadable_args_line(tmp_path):
    log = make_log(tmp_path / "bad.txt", n=4, val_every=2, args='["--seed", 1')
    with pytest.raises(rec.RecordError, match="unreadable args line"):
        rec.replay_command(log, gpus=no_gpu)


@pytest.mark.parametrize("nproc, world_size, gpus, expected", [
    (None, None, 0, 0),   # nothing recorded, no GPU: plain python
    (None, None, 4, 4),   # nothing recorded: one process per GPU
    (None, 8, 1, 8),      # the log's world_size
    (None, 1, 0, 0),      # one process without a GPU: plain python
    (None, 1, 2, 1),      # one process on a GPU: torchrun with 1
    (0, 8, 8, 0),         # --nproc 0: always plain python
    (1, 8, 0, 0),
    (2, 1, 0, 2),         # --nproc overrides the log
])
def test_choose_nproc(nproc, world_size, gpus, expected):
    calls = []

    def count():
        calls.append(1)
        return gpus

    assert rec.choose_nproc(nproc, world_size, count) == expected
    assert len(calls) <= 1
    if nproc not in (None, 1) or (nproc is None and world_size not in (None, 1)):
        assert not calls  # the GPU count (a subprocess importing torch) only when it matters


def test_replay_command_torchrun_from_world_size(tmp_path):
    log = make_log(tmp_path / "ws.txt", n=4, val_every=2, world_size=8, args=["--seed", "1"])
    cmd = rec.replay_command(log, gpus=no_gpu)
    i = cmd.index("--standalone")
    assert cmd[i:] == ["--standalone", "--nproc_per_node=8", ".replay_ws.py", "--seed", "1"]
    assert cmd[:i] in ([shutil.which("torchrun")], [sys.executable, "-m", "torch.distributed.run"])
    assert rec.replay_command(log, nproc=2, gpus=no_gpu)[i + 1] == "--nproc_per_node=2"
    assert rec.replay_command(log, nproc=0, gpus=no_gpu)[:2] == [sys.executable, ".replay_ws.py"]


def test_usage_errors_are_one_line_exit_2(tmp_path, capsys):
    log = make_log(tmp_path / "a.txt", n=4, val_every=2)
    for argv, fragment in [([], "COMMAND"), (["bogus"], "bogus"), (["stats"], "PATH"),
                           (["replay", "--nproc", "x", str(log)], "--nproc"),
                           (["replay", "--nproc", "-1", str(log)], "--nproc"),
                           (["replay", "--dir", str(tmp_path / "nope"), "--nproc", "0", str(log)], "nope"),
                           (["diff", str(log)], "B"),
                           (["stats", str(log), "--alpha", "2"], "--alpha must be a significance level in (0, 1), got 2"),
                           (["stats", str(log), "--alpha", "0"], "--alpha must be"),
                           (["stats", str(log), "--target", "nan"], "--target must be a finite val loss, got nan"),
                           (["plot", str(log), "-o", str(tmp_path / "p.png"), "--target", "inf"], "--target must be")]:
        assert rec.main(argv) == 2, argv
        cap = capsys.readouterr()
        one_error_line(cap.err, fragment)
        assert "usage:" not in cap.err and cap.out == ""
    assert not list(tmp_path.glob(".replay_*"))


# --------------------------------------------------------------------------- replay: running it

@pytest.mark.slow
def test_replay_runs_script_with_recorded_and_extra_args(tmp_path, capfd):
    script = ("import sys, pathlib\n"
              "pathlib.Path('replayed.txt').write_text(' '.join(sys.argv[1:]))\n"
              "sys.exit(3)\n")
    log = make_log(tmp_path / "logs" / "abc.txt", script=script, n=4, val_every=2,
                   args=["--run_id", "abc", "--preset", "gpu"])
    rc = rec.main(["replay", "--nproc", "0", "--dir", str(tmp_path), str(log), "--", "--preset", "cpu", "-x"])
    assert rc == 3
    assert (tmp_path / "replayed.txt").read_text() == "--preset gpu --preset cpu -x"
    assert not (tmp_path / ".replay_abc").exists()
    cmd = [sys.executable, ".replay_abc/train_gpt.py", "--preset", "gpu", "--preset", "cpu", "-x"]
    err = capfd.readouterr().err
    assert err == f"records.py: replay: cd {shlex.quote(str(tmp_path))} && {shlex.join(cmd)}\n"

    assert rec.main(["replay", "--no-args", "--nproc", "0", "--dir", str(tmp_path), str(log), "--", "-y"]) == 3
    assert (tmp_path / "replayed.txt").read_text() == "-y"


@pytest.mark.parametrize("glob,script", [
    ("data/novels/novels_train_*.bin", "python data/novels.py --out data/novels"),
    ("data/fineweb10B/fineweb_train_*.bin", "python data/cached_fineweb10B.py")])
def test_replay_names_the_data_script_of_a_missing_glob(tmp_path, capsys, monkeypatch, glob,
                                                        script):
    """A track_cpu log replayed without its data printed the recorded script's hint,
    `cached_fineweb10B.py`, for a novels glob. replay checks the data globs of the command first:
    one line naming the script that builds them; nothing runs."""
    monkeypatch.delenv("DATA_PATH", raising=False)
    marker = tmp_path / "ran.txt"
    script_text = f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
    log = make_log(tmp_path / "logs" / "cpu.txt", script=script_text,
                   args=["--preset", "cpu", "--train_files", glob,
                         "--val_files", glob.replace("train", "val")])
    assert rec.main(["replay", "--nproc", "0", "--dir", str(tmp_path), str(log)]) == 2
    one_error_line(capsys.readouterr().err, f"--train_files {glob!r} matches no file in {tmp_path}",
                   f"build the data with `{script}`", "-- --train_files GLOB")
    assert not marker.exists() and not list(tmp_path.glob(".replay_*"))


FAKE_TRAINER = """import hashlib, json, sys, uuid
from pathlib import Path

def main():
    argv = sys.argv[1:]
    run_id = argv[argv.index("--run_id") + 1] if "--run_id" in argv else str(uuid.uuid4())
    source = Path(__file__).read_text(encoding="utf-8")
    source = source if source.endswith("\\n") else source + "\\n"
    Path("logs").mkdir(exist_ok=True)
    with open(f"logs/{run_id}.txt", "w", encoding="utf-8") as f:
        f.write(source)
        f.write("=" * 100 + "\\n")
        f.write(f"Running Python {sys.version}\\n")
        f.write(f"script_sha256 {hashlib.sha256(source.encode('utf-8')).hexdigest()}\\n")
        f.write("=" * 100 + "\\n")
        f.write(f"args: {json.dumps(argv)}\\n")
        f.write("world_size 1  grad_accum 1  device cpu\\n")
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


@pytest.mark.slow
def test_contract_roundtrip_with_fake_trainer(tmp_path, capfd):
    """A minimal trainer that follows the documented log contract: extract gives its exact
    source back (verified), and replay reruns it under a new run id with its recorded
    arguments plus the ones after `--`."""
    (tmp_path / "train_gpt.py").write_text(FAKE_TRAINER)
    subprocess.run([sys.executable, "train_gpt.py", "--run_id", "first", "--seed", "1"],
                   cwd=tmp_path, check=True, timeout=60)
    log = tmp_path / "logs" / "first.txt"
    before = log.read_bytes()
    assert rec.extract_script_bytes(log) == FAKE_TRAINER.encode() and rec.verify_script(log)
    run = rec.parse_log(log)
    assert run.val_steps == [0, 2, 4] and run.final_loss == pytest.approx(4.6)
    assert run.final_time_ms == 40 and run.complete
    assert rec.main(["replay", "--dir", str(tmp_path), str(log), "--", "--seed", "2"]) == 0
    assert log.read_bytes() == before  # --run_id was dropped: a new log, the old one untouched
    (new,) = [p for p in (tmp_path / "logs").glob("*.txt") if p != log]
    assert rec.verify_script(new) and rec.extract_script_bytes(new) == FAKE_TRAINER.encode()
    assert rec.recorded_args(rec.read_log(new), new) == ["--seed", "1", "--seed", "2"]
    # the recorded world_size 1: plain python here, torchrun with 1 process where torch sees a GPU
    (line,) = [l for l in capfd.readouterr().err.splitlines() if l.startswith("records.py:")]
    assert line.startswith("records.py: replay: cd ") and line.endswith(".replay_first/train_gpt.py --seed 1 --seed 2")


# --------------------------------------------------------------------------- CLI as a script

@pytest.mark.slow
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
    r = subprocess.run([sys.executable, str(RECORDS_PY), "stats", str(tmp_path / "nope")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == f"records.py: error: {tmp_path / 'nope'}: no such file or folder\n"


# --------------------------------------------------------------------------- with the real trainer

# The cpu preset shrunk to seconds: a narrow model, 512-token steps, 1,024 validation tokens.
TRAIN_ARGS = ["--preset", "cpu", "--num_scheduled_iterations", "4", "--num_extension_iterations", "0",
              "--val_loss_every", "2", "--model_dim", "64", "--head_dim", "32", "--batch_sizes", "512", "512", "512",
              "--max_seq_len", "256", "--window_blocks", "2", "2", "2", "--extension_window_blocks", "2",
              "--final_val_window_blocks", "2", "--val_tokens", "1024", "--val_batch_size", "512"]


@pytest.mark.slow
def test_extract_and_replay_real_trainer_log(tmp_path):
    """A real trainer log (synthetic data generated under tmp_path) verifies, and a replay
    with no arguments reruns it with the recorded ones under a new run id."""
    code = ("train_gpt.py", "track3.py", "ngram_prior.py", "data/synthetic.py")  # the cpu preset's corpus
    (tmp_path / "data").mkdir()
    for name in code:
        shutil.copy2(REPO / name, tmp_path / name)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    args = [*TRAIN_ARGS, "--matrix_optimizer", "adamw"]  # a track-3 run with the cpu preset's n-gram prior

    r = subprocess.run([sys.executable, "train_gpt.py", *args, "--run_id", "orig"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    log = tmp_path / "logs" / "orig.txt"
    assert sorted((tmp_path / "logs").glob("*.txt")) == [log]
    # the log carries every file the run imported
    assert rec.split_files(rec.extract_script_bytes(log)) == {name: (REPO / name).read_bytes() for name in code}
    assert rec.verify_script(log) is True
    parts = rec.read_log(log)
    assert rec.recorded_args(parts, log) == [*args, "--run_id", "orig"]
    assert rec.recorded_world_size(parts) == 1
    run = rec.parse_log(log)
    assert run.complete and run.final_step == 4 and run.val_steps[-1] == 4
    before = log.read_bytes()

    # the replay runs from the log's snapshot alone: a folder with the data and no code
    for name in code:
        (tmp_path / name).unlink()
    assert rec.main(["replay", "--nproc", "0", "--dir", str(tmp_path), str(log)]) == 0
    assert log.read_bytes() == before
    (new,) = [p for p in (tmp_path / "logs").glob("*.txt") if p != log]
    assert rec.verify_script(new) is True
    assert rec.extract_script_bytes(new) == rec.extract_script_bytes(log)
    assert rec.recorded_args(rec.read_log(new), new) == args
    assert rec.parse_log(new).complete and rec.parse_log(new).val_losses == run.val_losses
    assert not list(tmp_path.glob(".replay_*"))


# --------------------------------------------------------------------------- with a record's frozen script

REFERENCE_FIDELITY_LOG = (REPO / "records" / "track_cpu" / "2026-11-29_ReferenceFidelity"
                          / "02b30626-776f-47d3-a45a-3c3ca3310156.txt")
# The record's recorded arguments (cpu preset, seed 2, novels shards) shrunk to seconds: a tiny corpus
# under the working folder, 4 steps of 512 tokens, 1,024 validation tokens, one torch thread.
FROZEN_OVERRIDES = ["--train_files", "data/synthetic_train_*.bin", "--val_files", "data/synthetic_val_*.bin",
                    *TRAIN_ARGS[2:], "--cpu_threads", "1", "--log_dir", "logs_a", "--run_id", "a"]


def cpu_only_env():
    """The environment with no GPU visible, so that both runs take the same (CPU) path."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}


def tiny_corpus(folder, module):
    """Shards of the frozen script's synthetic corpus, small enough for a few steps."""
    module.synthetic_corpus(folder, seed=0, train_tokens=65_536, val_tokens=4_096)


@pytest.mark.slow
def test_replay_of_a_frozen_record_script_reproduces_its_val_losses(tmp_path):
    """The ReferenceFidelity record's script, run with its recorded arguments plus few-step overrides on
    a tiny corpus, writes log A; `records.py replay A` (a new --log_dir only) gets A's val losses exactly."""
    from frozen_scripts import load_record_script

    frozen = load_record_script(REFERENCE_FIDELITY_LOG, "frozen_reference_fidelity")
    tiny_corpus(tmp_path / "data", frozen)
    parts = rec.read_log(REFERENCE_FIDELITY_LOG)
    assert rec.verify_script(REFERENCE_FIDELITY_LOG, parts)
    (tmp_path / "train_gpt.py").write_bytes(parts.script)
    args = rec.replay_args(rec.recorded_args(parts, REFERENCE_FIDELITY_LOG), FROZEN_OVERRIDES)
    r = subprocess.run([sys.executable, "train_gpt.py", *args], cwd=tmp_path, env=cpu_only_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    log_a = tmp_path / "logs_a" / "a.txt"
    assert rec.verify_script(log_a) and rec.extract_script_bytes(log_a) == parts.script
    run_a = rec.parse_log(log_a)
    assert run_a.complete and run_a.val_steps == [0, 2, 4]

    r = subprocess.run([sys.executable, str(RECORDS_PY), "replay", "--nproc", "0", "--dir", str(tmp_path),
                        str(log_a), "--", "--log_dir", "logs_b"], cwd=tmp_path, env=cpu_only_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (log_b,) = (tmp_path / "logs_b").glob("*.txt")
    assert rec.recorded_args(rec.read_log(log_b), log_b) == [*args[:-2], "--log_dir", "logs_b"]
    run_b = rec.parse_log(log_b)
    assert (run_b.val_steps, run_b.val_losses) == (run_a.val_steps, run_a.val_losses)
    assert not list(tmp_path.glob(".replay_*"))
