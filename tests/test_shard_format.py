"""One shard format, two implementations: train_gpt.py's read_shard/write_shard (the trainer is
self-contained) and data/shards.py's. Each reads what the other writes, both write the same bytes,
both reject every kind of corrupt or unreadable file with the same one-line DataError message, and
both writers refuse bad ids and leave neither a temp file nor a damaged shard behind on failure."""
import os
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

import train_gpt as tg
from conftest import ROOT

if str(ROOT / "data") not in sys.path:
    sys.path.insert(0, str(ROOT / "data"))
import shards  # noqa: E402

WRITERS = {"train_gpt": tg.write_shard, "shards": shards.write_shard}
ERRORS = {"train_gpt": tg.DataError, "shards": shards.DataError}


def spec_bytes(tokens):
    """A shard as the format defines it, built independently of both implementations."""
    tokens = [int(t) for t in tokens]
    return struct.pack("<256i", 20240520, 1, len(tokens), *([0] * 253)) + struct.pack(f"<{len(tokens)}H", *tokens)


def test_constants_and_error_classes_agree():
    assert tg.BOS_ID == shards.BOS_ID == 50256
    assert tg.GPT2_VOCAB_SIZE == shards.GPT2_VOCAB_SIZE == 50257
    for cls in ERRORS.values():
        assert issubclass(cls, ValueError) and cls.__name__ == "DataError"


def token_cases():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50257, size=3000, dtype=np.int64)
    tokens[[0, 1, 2, -2, -1]] = [50256, 0, 50256, 50256, 0]  # BOS first, the extreme ids, BOS twice in a row
    return {"random": tokens, "empty": np.array([], dtype=np.int64), "one_bos": np.array([50256])}


@pytest.mark.parametrize("case", list(token_cases()))
@pytest.mark.parametrize("writer", list(WRITERS))
def test_each_reads_the_others_shards(tmp_path, writer, case):
    tokens = token_cases()[case]
    path = tmp_path / f"{case}.bin"
    WRITERS[writer](path, tokens)
    assert path.read_bytes() == spec_bytes(tokens)
    for read in (tg.read_shard, lambda p: tg.read_shard(p, vocab_size=tg.GPT2_VOCAB_SIZE), shards.read_shard):
        got = read(path)
        assert got.dtype == np.uint16 and got.shape == tokens.shape
        np.testing.assert_array_equal(got, tokens)
    assert shards.validate_shard(path) == shards.validate_shard(path, check_tokens=False) == tokens.size
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temp file left


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
    "train_gpt": (lambda p: tg.read_shard(p, vocab_size=tg.GPT2_VOCAB_SIZE), tg.DataError),
    "shards": (shards.read_shard, shards.DataError),
    "shards_header_only": (lambda p: shards.validate_shard(p, check_tokens=False), shards.DataError),
}
def corrupt_params():
    for case in CORRUPT:
        for reader in READERS:
            yield pytest.param(case, reader, id=f"{case}-{reader}")


@pytest.mark.parametrize("case,reader", corrupt_params())
def test_corrupt_or_unreadable_shard_gives_the_same_one_line_message(tmp_path, monkeypatch, case, reader):
    make, expected = CORRUPT[case]
    read, error = READERS[reader]
    path = make(tmp_path, monkeypatch) if make is unreadable else make(tmp_path)
    if case == "id_too_large" and reader == "shards_header_only":
        assert read(path) == 10  # the body is not read
        return
    with pytest.raises(error) as ei:
        read(path)
    message = str(ei.value)
    assert message.startswith(f"{path}: ")
    assert message[len(f"{path}: "):] == expected


def test_trainer_reader_checks_ids_only_when_asked(tmp_path):
    path = bad_ids(tmp_path)
    assert tg.read_shard(path).size == 10  # vocab_size=None: the trainer's default
    with pytest.raises(tg.DataError, match="token id 50257 at position 3"):
        tg.read_shard(path, vocab_size=50257)
    with pytest.raises(shards.DataError, match="token id 50257 at position 3"):
        shards.read_shard(path)  # the data/ reader checks by default


# --------------------------------------------------------------------------- writers

@pytest.mark.parametrize("bad", [50257, 65535, -1])
@pytest.mark.parametrize("writer", list(WRITERS))
def test_writers_refuse_ids_outside_the_vocabulary(tmp_path, writer, bad):
    path = tmp_path / "w.bin"
    with pytest.raises(ERRORS[writer]) as ei:
        WRITERS[writer](path, np.array([1, bad, 3], dtype=np.int64))
    assert str(ei.value) == f"{path}: refusing to write token id {bad}: ids must be in [0, 50257)"
    assert list(tmp_path.iterdir()) == []  # neither the shard nor a temp file


@pytest.mark.parametrize("failing", ["replace", "fsync"])
@pytest.mark.parametrize("writer", list(WRITERS))
def test_failed_write_keeps_the_old_shard_and_no_temp_file(tmp_path, monkeypatch, writer, failing):
    path = tmp_path / "s.bin"
    WRITERS[writer](path, [1, 2, 3])
    before = path.read_bytes()
    temp_files = []

    def boom(*args):
        if failing == "replace":
            temp_files.append(Path(args[0]))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, failing, boom)
    with pytest.raises(OSError, match="No space left"):
        WRITERS[writer](path, [4, 5])
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["s.bin"]
    for tmp in temp_files:  # the temp file was next to the shard, named .s.bin<unique part>.tmp
        assert tmp.parent == tmp_path and tmp.name.startswith(".s.bin") and tmp.name.endswith(".tmp")
    assert len(temp_files) == (failing == "replace")
    WRITERS[writer](path, [4, 5])  # and a later write works
    np.testing.assert_array_equal(shards.read_shard(path), [4, 5])
