"""The shard format, its one implementation (train_gpt.py's read_shard/write_shard, which the data/
scripts use through data/shards.py), shards.py's validate_shard and validating CLI, and the
conventions shared by all data/ scripts: one BOS constant, one DataError, and one-line CLI errors
(``<script>: error: <message>``, exit status 2).

Shards are checked against bytes built from the format spec with ``struct``, independently of
the implementation."""

import ast
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import train_gpt as tg
from conftest import ROOT

DATA_DIR = ROOT / "data"
if str(DATA_DIR) not in sys.path:
    sys.path.insert(0, str(DATA_DIR))

import shards  # noqa: E402
from shards import BOS_ID, DataError, read_shard, validate_shard, write_shard  # noqa: E402

SCRIPTS = ["data/cached_fineweb10B.py", "data/fineweb.py", "data/novels.py", "data/shards.py",
           "tools/bench_loader.py"]


def spec_bytes(tokens):
    """A shard as the format defines it, built independently of the implementation."""
    tokens = [int(t) for t in tokens]
    return struct.pack("<256i", 20240520, 1, len(tokens), *([0] * 253)) + struct.pack(f"<{len(tokens)}H", *tokens)


def test_shards_py_has_no_copy_of_the_trainers_shard_io():
    assert (BOS_ID, shards.GPT2_VOCAB_SIZE) == (50256, 50257)
    assert DataError is tg.DataError and issubclass(DataError, ValueError)
    for name in ("BOS_ID", "GPT2_VOCAB_SIZE", "SHARD_MAGIC", "SHARD_VERSION", "SHARD_HEADER_INTS",
                 "read_shard", "write_shard", "write_atomically"):
        assert getattr(shards, name) is getattr(tg, name), name


def token_cases():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50257, size=3000, dtype=np.int64)
    tokens[[0, 1, 2, -2, -1]] = [50256, 0, 50256, 50256, 0]  # BOS first, the extreme ids, BOS twice in a row
    return {"random": tokens, "random_uint16": tokens.astype(np.uint16), "empty": np.array([], dtype=np.int64),
            "one_bos": np.array([50256])}


@pytest.mark.parametrize("case", list(token_cases()))
def test_written_bytes_follow_the_spec_and_read_back(tmp_path, case):
    tokens = token_cases()[case]
    path = tmp_path / f"{case}.bin"
    write_shard(path, tokens)
    assert path.read_bytes() == spec_bytes(tokens)
    for got in (read_shard(path), read_shard(path, vocab_size=50257)):
        assert got.dtype == np.uint16 and got.shape == tokens.shape
        np.testing.assert_array_equal(got, tokens)
    assert validate_shard(path) == validate_shard(path, check_tokens=False) == tokens.size
    write_shard(tmp_path / "again.bin", read_shard(path))  # writing what was read gives the same bytes
    assert (tmp_path / "again.bin").read_bytes() == path.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, "again.bin"])  # no temp file left


def test_written_files_follow_the_umask(tmp_path):
    """Unlike tempfile.mkstemp's 0600, dataset files get the usual 0666 minus the umask."""
    path = tmp_path / "m.bin"
    umask = os.umask(0o022)
    try:
        write_shard(path, [1, 2])
    finally:
        os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o644


# --------------------------------------------------------------------------- corrupt or unreadable files

def good_shard(folder, n=10):
    path = folder / "s.bin"
    path.write_bytes(spec_bytes(range(n)))
    return path


def patched(folder, offset, fmt, value):
    path = good_shard(folder)
    data = bytearray(path.read_bytes())
    struct.pack_into(fmt, data, offset, value)
    path.write_bytes(bytes(data))
    return path


def resized(folder, delta):
    path = good_shard(folder)
    data = path.read_bytes()
    path.write_bytes(data[:delta] if delta < 0 else data + b"\0" * delta)
    return path


def cut(folder, size):
    path = good_shard(folder)
    path.write_bytes(path.read_bytes()[:size])
    return path


def bad_ids(folder):
    path = good_shard(folder)
    data = bytearray(path.read_bytes())
    struct.pack_into("<H", data, 1024 + 2 * 3, 50257)
    struct.pack_into("<H", data, 1024 + 2 * 7, 65535)
    path.write_bytes(bytes(data))
    return path


def directory(folder):
    path = folder / "d.bin"
    path.mkdir()
    return path


def unreadable(folder, monkeypatch):
    """chmod 0; as root, which reads any file, opening it for reading fails as the OS would."""
    path = good_shard(folder)
    path.chmod(0)
    if os.geteuid() == 0:
        real_open = Path.open

        def open_or_deny(self, mode="r", *args, **kwargs):
            if self == path and "r" in mode:
                raise PermissionError(13, "Permission denied", str(self))
            return real_open(self, mode, *args, **kwargs)

        monkeypatch.setattr(Path, "open", open_or_deny)
    return path


# case -> (make the file, the message after "<path>: ")
CORRUPT = {
    "empty_file": (lambda d: cut(d, 0), "corrupt shard: 0 bytes is shorter than the 1024-byte header"),
    "short_100": (lambda d: cut(d, 100), "corrupt shard: 100 bytes is shorter than the 1024-byte header"),
    "short_1023": (lambda d: cut(d, 1023), "corrupt shard: 1023 bytes is shorter than the 1024-byte header"),
    "bad_magic": (lambda d: patched(d, 0, "<i", 12345),
                  "bad magic 12345 (expected 20240520); not a GPT-2 token shard"),
    "bad_version": (lambda d: patched(d, 4, "<i", 7), "unsupported shard version 7 (expected 1)"),
    "negative_count": (lambda d: patched(d, 8, "<i", -5), "corrupt shard: negative token count -5 in the header"),
    "truncated": (lambda d: resized(d, -2), "truncated shard: header says 10 tokens (1044 bytes) but the file has "
                                            "1042 bytes; re-download or re-tokenize it"),
    "oversized": (lambda d: resized(d, 2), "oversized shard: header says 10 tokens (1044 bytes) but the file has "
                                           "1046 bytes; re-download or re-tokenize it"),
    "id_too_large": (bad_ids, "token id 50257 at position 3 is not below the vocabulary size 50257"),
    "missing": (lambda d: d / "nope.bin", "cannot read shard (No such file or directory)"),
    "directory": (directory, "cannot read shard (Is a directory)"),
    "unreadable": (unreadable, "cannot read shard (Permission denied)"),
}
READERS = {
    "read_shard": lambda p: read_shard(p, vocab_size=50257),
    "validate_shard": validate_shard,
    "header_only": lambda p: validate_shard(p, check_tokens=False),  # read_shard(max_tokens=0), as the loader
}


@pytest.mark.parametrize("reader", list(READERS))
@pytest.mark.parametrize("case", list(CORRUPT))
def test_corrupt_or_unreadable_shard_gives_a_one_line_message(tmp_path, monkeypatch, case, reader):
    make, expected = CORRUPT[case]
    path = make(tmp_path, monkeypatch) if make is unreadable else make(tmp_path)
    if case == "id_too_large" and reader == "header_only":
        assert READERS[reader](path) == 10  # the body is not read
        return
    with pytest.raises(DataError) as ei:
        READERS[reader](path)
    assert str(ei.value) == f"{path}: {expected}"


def test_reader_checks_ids_only_when_asked(tmp_path):
    path = bad_ids(tmp_path)
    assert read_shard(path)[3] == 50257  # vocab_size=None: the default
    with pytest.raises(DataError, match="token id 50257 at position 3"):
        read_shard(path, vocab_size=50257)
    np.testing.assert_array_equal(read_shard(path, max_tokens=4), [0, 1, 2, 50257])


# --------------------------------------------------------------------------- the writer

@pytest.mark.parametrize("bad", [50257, 65535, -1])
def test_writer_refuses_ids_outside_the_vocabulary(tmp_path, bad):
    path = tmp_path / "w.bin"
    with pytest.raises(DataError) as ei:
        write_shard(path, np.array([1, bad, 3], dtype=np.int64))
    assert str(ei.value) == f"{path}: refusing to write token id {bad}: ids must be in [0, 50257)"
    assert list(tmp_path.iterdir()) == []  # neither the shard nor a temp file


@pytest.mark.parametrize("bad", [np.zeros((2, 3), dtype=np.int64), np.array([1.5, 2.0])], ids=["2-D", "float"])
def test_writer_refuses_arrays_that_are_not_1d_integer_ids(tmp_path, bad):
    path = tmp_path / "bad.bin"
    with pytest.raises(DataError, match="tokens must be a 1-D array of integer ids"):
        write_shard(path, bad)
    assert list(tmp_path.iterdir()) == []


def test_reader_names_a_shard_that_shrinks_while_it_is_read(tmp_path, monkeypatch):
    path = tmp_path / "s.bin"
    write_shard(path, np.arange(100))
    real_open = Path.open

    def open_then_truncate(self, *args, **kwargs):  # another process cuts the file after the size check
        f = real_open(self, *args, **kwargs)
        os.truncate(self, 1024 + 50)
        return f
    monkeypatch.setattr(Path, "open", open_then_truncate)
    with pytest.raises(DataError, match=r"s\.bin: the shard shrank while it was read \(50 of 200 bytes\)"):
        read_shard(path)


@pytest.mark.parametrize("failing", ["replace", "fsync"])
def test_failed_write_keeps_the_old_shard_and_no_temp_file(tmp_path, monkeypatch, failing):
    path = tmp_path / "s.bin"
    write_shard(path, [1, 2, 3])
    before = path.read_bytes()
    temp_files = []

    def boom(*args):
        if failing == "replace":
            temp_files.append(Path(args[0]))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, failing, boom)
    with pytest.raises(OSError, match="No space left"):
        write_shard(path, [4, 5])
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["s.bin"]
    for tmp in temp_files:  # the temp file was next to the shard, named .s.bin<unique part>.tmp
        assert tmp.parent == tmp_path and tmp.name.startswith(".s.bin") and tmp.name.endswith(".tmp")
    assert len(temp_files) == (failing == "replace")
    write_shard(path, [4, 5])  # and a later write replaces the shard
    np.testing.assert_array_equal(read_shard(path), [4, 5])


# --------------------------------------------------------------------------- the validating CLI

def test_cli_reports_every_file_and_fails_with_one_line(tmp_path, capsys):
    good, bad = tmp_path / "good.bin", tmp_path / "bad.bin"
    write_shard(good, np.arange(10))
    bad.write_bytes(spec_bytes([1, 2])[:-1])
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


# --------------------------------------------------------------------------- conventions of the data scripts

def test_one_bos_constant_one_error_class():
    """BOS_ID and DataError come from train_gpt.py through shards.py; only shards.py (which finds
    train_gpt.py) and tools/bench_loader.py (outside data/) edit sys.path."""
    for name in SCRIPTS:
        source = (ROOT / name).read_text(encoding="utf-8")
        tree = ast.parse(source)
        assigned = {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
                    for t in node.targets if isinstance(t, ast.Name)}
        constants = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)}
        classes = {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
        assert not {n for n in assigned if "BOS" in n}, f"{name} defines its own BOS constant"
        assert 50256 not in constants, f"{name} spells out 50256 instead of importing BOS_ID"
        assert not classes & {"DataError", "ShardError"} and "ShardError" not in source, name
        if name not in ("data/shards.py", "tools/bench_loader.py"):
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

    assert fineweb.DataError is novels.DataError is cached_fineweb10B.DataError is tg.DataError
    assert fineweb.BOS_ID is novels.BOS_ID is bench_loader.BOS_ID is tg.BOS_ID
    assert bench_loader.tg is tg


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
