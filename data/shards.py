"""Token shard file IO (numpy only).

A shard (``.bin``) is the format used by the FineWeb GPT-2 shards:

* header: 256 little-endian int32 (1024 bytes); ``header[0] = MAGIC`` (20240520),
  ``header[1] = VERSION`` (1), ``header[2] = N`` (number of tokens), the rest zero;
* body: N little-endian uint16 GPT-2 token ids, all ``< VOCAB_SIZE`` (50257).

The file size must be exactly ``1024 + 2 * N``. Anything else is a corrupt shard and
raises :class:`ShardError` (a ``ValueError``) with a one-line message that names the file
and the problem.

Library use::

    from shards import write_shard, read_shard, validate_shard
    write_shard("x.bin", tokens)          # atomic: temp file + os.replace
    toks = read_shard("x.bin")            # np.ndarray[np.uint16], fully checked
    n = validate_shard("x.bin", check_tokens=False)   # header + size only (fast)

As a script, ``python data/shards.py FILE...`` validates shards and prints their sizes.
"""

from __future__ import annotations

import argparse
import os
import sys
import secrets
from pathlib import Path

import numpy as np

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4  # 1024
BOS = 50256  # <|endoftext|>, used as the beginning-of-document token
VOCAB_SIZE = 50257  # token ids must be < VOCAB_SIZE
TOKEN_DTYPE = np.dtype("<u2")


class ShardError(ValueError):
    """A shard file is malformed (bad magic/version, wrong size, bad token id)."""


def make_header(num_tokens: int) -> np.ndarray:
    """The 256-int32 little-endian header for a shard of ``num_tokens`` tokens."""
    if not 0 <= num_tokens < 2**31:
        raise ValueError(f"token count {num_tokens} does not fit the int32 shard header")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0] = MAGIC
    header[1] = VERSION
    header[2] = num_tokens
    return header


def _check_tokens(tokens: np.ndarray, where: str) -> None:
    if tokens.size == 0:
        return
    hi = int(tokens.max())
    if hi >= VOCAB_SIZE:
        pos = int(np.argmax(tokens >= VOCAB_SIZE))
        raise ShardError(
            f"{where}: token id {int(tokens[pos])} >= {VOCAB_SIZE} at position {pos} "
            f"(not a GPT-2 token id)"
        )


def read_header(path: str | os.PathLike) -> int:
    """Check the header and the file size of a shard; return its token count N.

    Reads only the first 1024 bytes (plus a stat), so it is cheap for 200 MB shards.
    """
    path = Path(path)
    size = path.stat().st_size  # FileNotFoundError propagates as is
    if size < HEADER_BYTES:
        raise ShardError(
            f"{path}: file shorter than the {HEADER_BYTES}-byte header ({size} bytes); "
            f"truncated or not a shard"
        )
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(HEADER_BYTES), dtype="<i4")
    if int(header[0]) != MAGIC:
        raise ShardError(
            f"{path}: bad magic {int(header[0])} (expected {MAGIC}); not a GPT-2 token shard"
        )
    if int(header[1]) != VERSION:
        raise ShardError(
            f"{path}: bad version {int(header[1])} (expected {VERSION}); unsupported shard format"
        )
    n = int(header[2])
    if n < 0:
        raise ShardError(f"{path}: bad token count {n} in header (negative)")
    expected = HEADER_BYTES + 2 * n
    if size < expected:
        raise ShardError(
            f"{path}: truncated: {size} bytes but the header says {n} tokens "
            f"({expected} bytes); re-download or regenerate it"
        )
    if size > expected:
        raise ShardError(
            f"{path}: oversized: {size} bytes but the header says {n} tokens "
            f"({expected} bytes); re-download or regenerate it"
        )
    return n


def validate_shard(path: str | os.PathLike, check_tokens: bool = True) -> int:
    """Validate a shard and return its token count.

    With ``check_tokens=False`` only the header and the file size are checked (fast);
    otherwise the body is read too and every token id must be ``< VOCAB_SIZE``.
    """
    if check_tokens:
        return int(read_shard(path).size)
    return read_header(path)


def read_shard(path: str | os.PathLike) -> np.ndarray:
    """Read a whole shard into a ``np.uint16`` array (header, size and ids checked)."""
    path = Path(path)
    n = read_header(path)
    with open(path, "rb") as f:
        f.seek(HEADER_BYTES)
        body = f.read(2 * n)
    if len(body) != 2 * n:  # file changed under us
        raise ShardError(f"{path}: truncated: read {len(body)} of {2 * n} body bytes")
    tokens = np.frombuffer(body, dtype=TOKEN_DTYPE).astype(np.uint16)  # native, writable
    _check_tokens(tokens, str(path))
    return tokens


def write_shard(path: str | os.PathLike, tokens) -> Path:
    """Write ``tokens`` (1-D integer array-like, all in [0, 50257)) as a shard.

    The file is written to a temporary file in the same directory and moved into place
    with ``os.replace``, so readers never see a half-written shard.
    """
    path = Path(path)
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"{path}: tokens must be a 1-D array, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{path}: tokens must be integers, got dtype {arr.dtype}")
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= VOCAB_SIZE:
            bad = lo if lo < 0 else hi
            raise ShardError(
                f"{path}: refusing to write token id {bad}: ids must be in [0, {VOCAB_SIZE})"
            )
    body = arr.astype(TOKEN_DTYPE, copy=False)
    header = make_header(int(body.size))
    return atomic_write(path, [header.tobytes(), body.tobytes()])


def atomic_write(path: str | os.PathLike, chunks) -> Path:
    """Write the byte strings ``chunks`` to ``path`` via a temp file in the same directory
    and ``os.replace`` (normal permissions, i.e. 0666 minus the umask)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Validate token shards (.bin): header, size and (unless --header-only) token ids."
    )
    parser.add_argument("files", nargs="+", help="shard files to check")
    parser.add_argument("--header-only", action="store_true",
                        help="check only header and file size (fast)")
    args = parser.parse_args(argv)
    bad = 0
    for f in args.files:
        try:
            n = validate_shard(f, check_tokens=not args.header_only)
            print(f"{f}: ok, {n:,} tokens")
        except (ShardError, OSError) as e:
            print(f"shards.py: {e}", file=sys.stderr)
            bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
