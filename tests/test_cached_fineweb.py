"""Tests for data/cached_fineweb10B.py with the Hugging Face Hub mocked out (no network)."""

import sys
from pathlib import Path

import numpy as np
import pytest

DATA_DIR = Path(__file__).resolve().parents[1] / "data"
if str(DATA_DIR) not in sys.path:
    sys.path.insert(0, str(DATA_DIR))

import cached_fineweb10B as cf  # noqa: E402
from shards import BOS_ID as BOS, validate_shard, write_shard  # noqa: E402


def small_shard(path, n=16):
    tokens = np.arange(n, dtype=np.uint16)
    tokens[0] = BOS
    write_shard(path, tokens)
    return path


class FakeHub:
    """Stands in for cf.download: writes a small valid shard, records calls, can fail."""

    def __init__(self, fail_on=(), exc=None):
        self.calls = []
        self.fail_on = set(fail_on)
        self.exc = exc

    def __call__(self, filename, dest_dir):
        self.calls.append(filename)
        if filename in self.fail_on:
            raise self.exc
        return small_shard(Path(dest_dir) / filename)


def test_shard_names():
    names = cf.shard_names(9)
    assert names[0] == "fineweb_val_000000.bin"
    assert names[1:] == [f"fineweb_train_{i:06d}.bin" for i in range(1, 10)]
    assert cf.shard_names(0) == ["fineweb_val_000000.bin"]
    assert cf.DEFAULT_DIR == DATA_DIR / "fineweb10B"


def test_downloads_all_then_skips(tmp_path, monkeypatch):
    hub = FakeHub()
    monkeypatch.setattr(cf, "download", hub)
    paths = cf.main(["3", "--dir", str(tmp_path), "--quiet"])
    assert hub.calls == cf.shard_names(3)
    assert [p.name for p in paths] == cf.shard_names(3)
    assert all(validate_shard(p) == 16 for p in paths)
    hub.calls.clear()
    cf.main(["3", "--dir", str(tmp_path), "--quiet"])
    assert hub.calls == []


def test_skips_valid_and_replaces_invalid(tmp_path, monkeypatch):
    small_shard(tmp_path / "fineweb_val_000000.bin", n=40)           # valid: kept
    bad = small_shard(tmp_path / "fineweb_train_000001.bin", n=40)
    bad.write_bytes(b"\x00" * 4 + bad.read_bytes()[4:])               # bad magic
    trunc = small_shard(tmp_path / "fineweb_train_000002.bin", n=40)
    trunc.write_bytes(trunc.read_bytes()[:-10])                        # truncated
    hub = FakeHub()
    monkeypatch.setattr(cf, "download", hub)
    cf.main(["2", "--dir", str(tmp_path), "--quiet"])
    assert hub.calls == ["fineweb_train_000001.bin", "fineweb_train_000002.bin"]
    assert validate_shard(tmp_path / "fineweb_val_000000.bin") == 40  # untouched
    assert validate_shard(bad) == 16 and validate_shard(trunc) == 16  # replaced


@pytest.mark.parametrize("exc", [ConnectionError("Failed to establish a new connection: [Errno 101]\n"
                                                 "Network is unreachable"),
                                 OSError("We couldn't connect to 'https://huggingface.co'"),
                                 TimeoutError()])
def test_offline_one_line_error(tmp_path, monkeypatch, capsys, exc):
    small_shard(tmp_path / "fineweb_val_000000.bin")
    hub = FakeHub(fail_on={"fineweb_train_000002.bin"}, exc=exc)
    monkeypatch.setattr(cf, "download", hub)
    with pytest.raises(SystemExit) as ei:
        cf.main(["3", "--dir", str(tmp_path), "--quiet"])
    assert ei.value.code == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1, captured.err
    err = captured.err.strip()
    assert err.startswith("cached_fineweb10B.py: error: could not download fineweb_train_000002.bin from "
                          "kjj0/fineweb10B-gpt2 (")
    assert "internet connection" in err and "Traceback" not in err
    assert type(exc).__name__ in err
    assert hub.calls == ["fineweb_train_000001.bin", "fineweb_train_000002.bin"]  # stopped there


def test_invalid_download_is_reported(tmp_path, monkeypatch, capsys):
    def broken(filename, dest_dir):
        p = Path(dest_dir) / filename
        p.write_bytes(b"<html>rate limited</html>")
        return p

    monkeypatch.setattr(cf, "download", broken)
    with pytest.raises(SystemExit) as ei:
        cf.main(["0", "--dir", str(tmp_path), "--quiet"])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("cached_fineweb10B.py: error: could not download fineweb_val_000000.bin from ")
    assert err.count("\n") == 1 and "downloaded file is invalid" in err and "25 bytes is shorter than the 1024-byte header" in err


def test_download_calls_hub_with_dataset_repo(tmp_path, monkeypatch):
    import huggingface_hub

    seen = {}

    def fake_hf_hub_download(**kwargs):
        seen.update(kwargs)
        return str(small_shard(Path(kwargs["local_dir"]) / kwargs["filename"]))

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_hf_hub_download)
    path = cf.download("fineweb_val_000000.bin", tmp_path)
    assert path == tmp_path / "fineweb_val_000000.bin"
    assert seen["repo_id"] == "kjj0/fineweb10B-gpt2"
    assert seen["repo_type"] == "dataset"
    assert seen["filename"] == "fineweb_val_000000.bin"


def test_negative_n_rejected(tmp_path, capsys):
    with pytest.raises(SystemExit) as ei:
        cf.main(["-1", "--dir", str(tmp_path), "--quiet"])
    assert ei.value.code == 2
    assert capsys.readouterr().err == "cached_fineweb10B.py: error: N must be >= 0, got -1\n"


@pytest.mark.parametrize("where", ["dir_is_a_file", "dir_below_a_file"])
def test_unusable_dir_is_one_line_error(tmp_path, monkeypatch, capsys, where):
    a_file = tmp_path / "f"
    a_file.write_text("not a folder")
    hub = FakeHub()
    monkeypatch.setattr(cf, "download", hub)
    dest = a_file if where == "dir_is_a_file" else a_file / "sub"
    with pytest.raises(SystemExit) as ei:
        cf.main(["1", "--dir", str(dest), "--quiet"])
    assert ei.value.code == 2
    expected = (f"--dir {dest}: not a directory" if where == "dir_is_a_file"
                else f"{dest}: Not a directory; check --dir")
    assert capsys.readouterr().err == f"cached_fineweb10B.py: error: {expected}\n"
    assert hub.calls == []


def test_reason_names_root_cause(tmp_path, monkeypatch, capsys):
    def offline(filename, dest_dir):
        try:
            raise OSError("[Errno -2] Name or service not known")
        except OSError as inner:
            raise RuntimeError("An error happened while trying to locate the file on the Hub.\n"
                               "Please check your connection.") from inner

    monkeypatch.setattr(cf, "download", offline)
    with pytest.raises(SystemExit) as ei:
        cf.main(["0", "--dir", str(tmp_path), "--quiet"])
    assert ei.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "RuntimeError" in err and "Name or service not known" in err
