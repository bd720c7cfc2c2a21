"""Tests for data/shards.py beyond the cross-implementation checks of test_shard_format.py (exact
bytes, header-only validation, file mode, the validating CLI), and for the conventions shared by
all data/ scripts (and tools/bench_loader.py): one BOS constant, one DataError, no sys.path edits
in data/, and one-line CLI errors
(``<script>: error: <message>``, exit status 2)."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = ROOT / "data"
if str(DATA_DIR) not in sys.path:
    sys.path.insert(0, str(DATA_DIR))

import shards  # noqa: E402
from shards import BOS_ID, DataError, read_shard, validate_shard, write_shard  # noqa: E402

SCRIPTS = ["data/cached_fineweb10B.py", "data/fineweb.py", "data/novels.py", "data/shards.py",
           "tools/bench_loader.py"]


def test_round_trip_bit_identical(tmp_path):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50257, size=1000).astype(np.uint16)
    tokens[0], tokens[1], tokens[-1] = BOS_ID, 0, 50256
    path = write_shard(tmp_path / "a.bin", tokens)
    # writing what was read gives the same bytes; int64 input works too
    write_shard(tmp_path / "b.bin", read_shard(path).astype(np.int64))
    assert (tmp_path / "b.bin").read_bytes() == path.read_bytes()
    assert path.stat().st_size == 1024 + 2 * 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "b.bin"]


def test_overwrite_replaces(tmp_path):
    p = tmp_path / "x.bin"
    write_shard(p, [1, 2, 3])
    write_shard(p, [4, 5])
    np.testing.assert_array_equal(read_shard(p), [4, 5])


def test_written_files_follow_the_umask(tmp_path):
    """Unlike tempfile.mkstemp's 0600, dataset files get the usual 0666 minus the umask."""
    umask = os.umask(0o022)
    try:
        path = write_shard(tmp_path / "m.bin", [1, 2])
    finally:
        os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o644


def test_write_rejects_2d_and_floats(tmp_path):
    with pytest.raises(ValueError, match="1-D"):
        write_shard(tmp_path / "w.bin", np.zeros((2, 2), dtype=np.uint16))
    with pytest.raises(ValueError, match="integers"):
        write_shard(tmp_path / "w.bin", np.array([1.5]))
    assert list(tmp_path.iterdir()) == []


def test_header_only_validation_skips_the_body(tmp_path):
    path = write_shard(tmp_path / "s.bin", np.arange(10))
    data = bytearray(path.read_bytes())
    data[1024 + 6:1024 + 8] = (50257).to_bytes(2, "little")
    path.write_bytes(bytes(data))
    assert validate_shard(path, check_tokens=False) == shards.read_header(path) == 10
    assert read_shard(path, vocab_size=None)[3] == 50257
    with pytest.raises(DataError, match="token id 50257 at position 3"):
        validate_shard(path)


def test_cli_reports_every_file_and_fails_with_one_line(tmp_path, capsys):
    good = write_shard(tmp_path / "good.bin", np.arange(10))
    bad = write_shard(tmp_path / "bad.bin", [1, 2])
    bad.write_bytes(bad.read_bytes()[:-1])
    assert shards.main([str(good), "--header-only"]) == 0
    assert capsys.readouterr().out == f"{good}: ok, 10 tokens\n"
    with pytest.raises(SystemExit) as ei:
        shards.main([str(good), str(bad)])
    assert ei.value.code == 2
    out, err = capsys.readouterr()
    assert out.splitlines() == [f"{good}: ok, 10 tokens",
                                f"{bad}: FAILED: truncated shard: header says 2 tokens (1028 bytes) but the "
                                f"file has 1027 bytes; re-download or re-tokenize it"]
    assert err == (f"shards.py: error: {bad}: truncated shard: header says 2 tokens (1028 bytes) but the file "
                   f"has 1027 bytes; re-download or re-tokenize it\n")
    with pytest.raises(SystemExit) as ei:
        shards.main([str(bad), str(tmp_path / "missing.bin"), str(good)])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"shards.py: error: 2 of 3 files are not valid shards; the first: {bad}: truncated")
    assert err.count("\n") == 1


# --------------------------------------------------------------------------- conventions of data/*.py

def test_one_bos_constant_one_error_class_no_sys_path_edits():
    for name in SCRIPTS:
        source = (ROOT / name).read_text(encoding="utf-8")
        tree = ast.parse(source)
        assigned = {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
                    for t in node.targets if isinstance(t, ast.Name)}
        constants = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)}
        classes = {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
        if name == "data/shards.py":
            assert "BOS_ID" in assigned and "DataError" in classes
        else:
            assert not {n for n in assigned if "BOS" in n}, f"{name} defines its own BOS constant"
            assert 50256 not in constants, f"{name} spells out 50256 instead of importing shards.BOS_ID"
            assert "DataError" not in classes and "ShardError" not in classes, name
        assert "ShardError" not in source, name
        if name.startswith("data/"):  # tools/ scripts put the repository root on sys.path
            assert not re.search(r"sys\.path\.(insert|append)|sys\.path\s*[+]?=|sys\.path\[", source), \
                f"{name} edits sys.path"
        uses_bos = any(isinstance(node, ast.Attribute) and "BOS" in node.attr for node in ast.walk(tree))
        assert not uses_bos, f"{name} takes a BOS constant from another module than shards"
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import bench_loader
    finally:
        sys.path.remove(str(ROOT / "tools"))
    import cached_fineweb10B
    import fineweb
    import novels

    assert fineweb.DataError is novels.DataError is cached_fineweb10B.DataError is shards.DataError
    assert fineweb.BOS_ID is novels.BOS_ID is bench_loader.BOS_ID is shards.BOS_ID


def test_exit_with_error_prints_one_line(capsys):
    parser = shards.CliParser(prog="x.py")
    parser.add_argument("--n", type=int)
    with pytest.raises(SystemExit) as ei:
        parser.parse_args(["--n", "two"])
    assert ei.value.code == 2
    assert capsys.readouterr().err == "x.py: error: argument --n: invalid int value: 'two'\n"
    with pytest.raises(SystemExit) as ei:
        shards.exit_with_error("x.py", OSError("first line\n  second line"))
    assert ei.value.code == 2
    assert capsys.readouterr().err == "x.py: error: first line second line\n"


def bad_input(name, tmp_path):
    """(arguments, a part of the expected message) for an invalid input of each script."""
    a_file = tmp_path / "a_file.bin"
    a_file.write_bytes(b"not a shard")
    return {
        "cached_fineweb10B.py": (["0", "--dir", str(a_file), "--quiet"], f"--dir {a_file}: not a directory"),
        "fineweb.py": (["--files", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "o"), "--quiet"],
                       "missing.txt: no such file or directory"),
        "novels.py": (["--src", str(tmp_path / "missing"), "--out", str(tmp_path / "o"), "--quiet"],
                      "--src"),
        "shards.py": ([str(a_file)], f"{a_file}: corrupt shard: 11 bytes is shorter than the 1024-byte header"),
        "bench_loader.py": (["--shards", "0"], "--shards 0: must be positive"),
    }[name]


@pytest.mark.slow
@pytest.mark.parametrize("problem", ["bad_flag", "bad_input"])
@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_fail_with_one_line_and_status_2(tmp_path, script, problem):
    name = Path(script).name
    if problem == "bad_flag":
        args = ["--no-such-flag"] + ([str(tmp_path / "x.bin")] if name == "shards.py" else [])
        needle = "unrecognized arguments: --no-such-flag"
    else:
        args, needle = bad_input(name, tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(ROOT / script), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.endswith("\n"), proc.stderr
    assert proc.stderr.startswith(f"{name}: error: "), proc.stderr
    assert needle in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == (["a_file.bin"] if problem == "bad_input" else [])
