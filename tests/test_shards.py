"""Tests for data/shards.py: shard round trip and every corruption case."""

import struct
import sys
from pathlib import Path

import numpy as np
import pytest

DATA_DIR = Path(__file__).resolve().parents[1] / "data"
if str(DATA_DIR) not in sys.path:
    sys.path.insert(0, str(DATA_DIR))

import shards  # noqa: E402
from shards import BOS, HEADER_INTS, MAGIC, VERSION, ShardError, read_shard, validate_shard, write_shard  # noqa: E402


def _expected_bytes(tokens):
    header = struct.pack("<256i", MAGIC, VERSION, len(tokens), *([0] * 253))
    return header + struct.pack(f"<{len(tokens)}H", *tokens)


def test_constants():
    assert (MAGIC, VERSION, HEADER_INTS, BOS) == (20240520, 1, 256, 50256)
    assert issubclass(ShardError, ValueError)


def test_round_trip_bit_identical(tmp_path):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50257, size=1000).astype(np.uint16)
    tokens[0], tokens[1], tokens[-1] = BOS, 0, 50256
    path = write_shard(tmp_path / "a.bin", tokens)
    assert path.read_bytes() == _expected_bytes(tokens.tolist())
    back = read_shard(path)
    assert back.dtype == np.uint16
    np.testing.assert_array_equal(back, tokens)
    assert validate_shard(path) == 1000
    assert validate_shard(path, check_tokens=False) == 1000
    # writing what was read gives the same bytes; int64 input works too
    write_shard(tmp_path / "b.bin", back.astype(np.int64))
    assert (tmp_path / "b.bin").read_bytes() == path.read_bytes()
    # no temporary files left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "b.bin"]


def test_empty_shard(tmp_path):
    path = write_shard(tmp_path / "e.bin", [])
    assert path.stat().st_size == 1024
    assert read_shard(path).size == 0


def test_overwrite_is_atomic_replace(tmp_path):
    p = tmp_path / "x.bin"
    write_shard(p, [1, 2, 3])
    write_shard(p, [4, 5])
    np.testing.assert_array_equal(read_shard(p), [4, 5])


@pytest.mark.parametrize("bad", [50257, 65535, -1])
def test_write_rejects_out_of_range(tmp_path, bad):
    p = tmp_path / "w.bin"
    with pytest.raises(ValueError) as ei:
        write_shard(p, np.array([1, bad, 3], dtype=np.int64))
    assert str(p) in str(ei.value) and str(bad) in str(ei.value)
    assert not p.exists()
    assert list(tmp_path.iterdir()) == []


def test_write_rejects_2d(tmp_path):
    with pytest.raises(ValueError):
        write_shard(tmp_path / "w.bin", np.zeros((2, 2), dtype=np.uint16))


def _good(tmp_path, n=10):
    return write_shard(tmp_path / "s.bin", np.arange(n, dtype=np.uint16))


def _patch(path, offset, data):
    b = bytearray(path.read_bytes())
    b[offset:offset + len(data)] = data
    path.write_bytes(bytes(b))


CORRUPTIONS = {
    "magic": lambda p: _patch(p, 0, struct.pack("<i", 12345)),
    "version": lambda p: _patch(p, 4, struct.pack("<i", 7)),
    "truncated": lambda p: p.write_bytes(p.read_bytes()[:-2]),
    "oversized": lambda p: p.write_bytes(p.read_bytes() + b"\x00\x00"),
    "header": lambda p: p.write_bytes(p.read_bytes()[:100]),
    "50257": lambda p: _patch(p, 1024 + 2 * 3, struct.pack("<H", 50257)),
}


@pytest.mark.parametrize("problem", list(CORRUPTIONS))
def test_corruption_detected(tmp_path, problem):
    path = _good(tmp_path)
    CORRUPTIONS[problem](path)
    with pytest.raises(ShardError) as ei:
        read_shard(path)
    msg = str(ei.value)
    assert str(path) in msg
    assert problem in msg
    assert "\n" not in msg
    with pytest.raises(ShardError):
        validate_shard(path)


@pytest.mark.parametrize("problem", ["magic", "version", "truncated", "oversized", "header"])
def test_header_only_validation_catches_structure(tmp_path, problem):
    path = _good(tmp_path)
    CORRUPTIONS[problem](path)
    with pytest.raises(ShardError, match=problem):
        validate_shard(path, check_tokens=False)


def test_header_only_skips_token_check(tmp_path):
    path = _good(tmp_path)
    CORRUPTIONS["50257"](path)
    assert validate_shard(path, check_tokens=False) == 10  # body not read
    with pytest.raises(ShardError, match="50257"):
        validate_shard(path)


def test_truncated_message_mentions_sizes(tmp_path):
    path = _good(tmp_path, n=10)
    path.write_bytes(path.read_bytes()[:1030])
    with pytest.raises(ShardError) as ei:
        read_shard(path)
    assert "1030" in str(ei.value) and "10 tokens" in str(ei.value)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_shard(tmp_path / "nope.bin")


def test_cli(tmp_path, capsys):
    good = _good(tmp_path)
    bad = write_shard(tmp_path / "bad.bin", [1, 2])
    bad.write_bytes(bad.read_bytes()[:-1])
    assert shards.main([str(good)]) == 0
    assert shards.main([str(good), str(bad)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.bin" in err[0] and "truncated" in err[0]
