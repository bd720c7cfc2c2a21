"""Token shard file IO (numpy only), and the command-line conventions of the data/ scripts.

A shard (``.bin``) is the format used by the FineWeb GPT-2 shards:

* header: 256 little-endian int32 (1024 bytes); ``header[0] = MAGIC`` (20240520),
  ``header[1] = VERSION`` (1), ``header[2] = N`` (number of tokens), the rest zero;
* body: N little-endian uint16 GPT-2 token ids, all ``< GPT2_VOCAB_SIZE`` (50257).

The file size must be exactly ``1024 + 2 * N``. Anything else is a corrupt shard and raises
:class:`DataError` (a ``ValueError``) with a one-line message that names the file and the
problem; so does a file that cannot be read at all (missing, a directory, no permission).
The messages are word for word those of ``read_shard`` in ``train_gpt.py``, which has its own
copy of this reader (the trainer is a single self-contained file);
``tests/test_shard_format.py`` checks that the two agree.

Library use::

    from shards import write_shard, read_shard, validate_shard
    write_shard("x.bin", tokens)          # atomic: unique temp file + fsync + os.replace
    toks = read_shard("x.bin")            # np.ndarray[np.uint16], fully checked
    n = validate_shard("x.bin", check_tokens=False)   # header + size only (fast)

As a script, ``python data/shards.py FILE...`` validates shards and prints one line per file
(``ok, N tokens`` or ``FAILED: reason``) on stdout; if any file is bad it ends with one line
``shards.py: error: ...`` on stderr and exit status 2.

Every data/ script reports errors the same way (:class:`CliParser`, :func:`exit_with_error`):
exactly one line ``<script>.py: error: <message>`` on stderr and exit status 2, for usage
errors and for data/IO errors alike.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from pathlib import Path
from typing import NoReturn

import numpy as np

PROG = "shards.py"
MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4  # 1024
BOS_ID = 50256  # <|endoftext|>, used as the beginning-of-document token
GPT2_VOCAB_SIZE = 50257  # token ids must be < GPT2_VOCAB_SIZE
TOKEN_DTYPE = np.dtype("<u2")


class DataError(ValueError):
    """Missing, unreadable or malformed data (a shard, an input file, a flag's value); the
    message is one line naming the file or flag and the problem."""


# --------------------------------------------------------------------------- command line

def exit_with_error(prog: str, message) -> NoReturn:
    """Print ``<prog>: error: <message>`` as exactly one line on stderr and exit with status 2."""
    text = " ".join(str(message).split())
    print(f"{prog}: error: {text}", file=sys.stderr)
    sys.exit(2)


class CliParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line (no usage dump), exit status 2."""

    def error(self, message):
        exit_with_error(self.prog, message)


def describe_os_error(e: OSError) -> str:
    """``PATH: reason`` of an OSError, on one line (``str(e)`` when it names no file)."""
    if e.filename is not None and e.strerror:
        return f"{e.filename}: {e.strerror}"
    return str(e) or type(e).__name__


# --------------------------------------------------------------------------- reading

def make_header(num_tokens: int) -> np.ndarray:
    """The 256-int32 little-endian header for a shard of ``num_tokens`` tokens."""
    if not 0 <= num_tokens < 2**31:
        raise ValueError(f"token count {num_tokens} does not fit the int32 shard header")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0] = MAGIC
    header[1] = VERSION
    header[2] = num_tokens
    return header


def _cannot_read(path: Path, e: OSError) -> DataError:
    return DataError(f"{path}: cannot read shard ({e.strerror or e})")


def _parse_header(path: Path, head: bytes, size: int) -> int:
    """Check the first bytes ``head`` of a file of ``size`` bytes; return the token count."""
    for n_bytes in (size, len(head)):  # len(head) < size only if the file shrank after the stat
        if n_bytes < HEADER_BYTES:
            raise DataError(f"{path}: corrupt shard: {n_bytes} bytes is shorter than the {HEADER_BYTES}-byte header")
    header = np.frombuffer(head, dtype="<i4")
    if int(header[0]) != MAGIC:
        raise DataError(f"{path}: bad magic {int(header[0])} (expected {MAGIC}); not a GPT-2 token shard")
    if int(header[1]) != VERSION:
        raise DataError(f"{path}: unsupported shard version {int(header[1])} (expected {VERSION})")
    n = int(header[2])
    if n < 0:
        raise DataError(f"{path}: corrupt shard: negative token count {n} in the header")
    expected = HEADER_BYTES + 2 * n
    if size != expected:
        what = "truncated" if size < expected else "oversized"
        raise DataError(f"{path}: {what} shard: header says {n} tokens ({expected} bytes) but the file has "
                        f"{size} bytes; re-download or re-tokenize it")
    return n


def _check_tokens(tokens: np.ndarray, path: Path, vocab_size: int) -> None:
    if tokens.size and int(tokens.max()) >= vocab_size:
        pos = int(np.argmax(tokens >= vocab_size))
        raise DataError(f"{path}: token id {int(tokens[pos])} at position {pos} is not below the vocabulary "
                        f"size {vocab_size}")


def read_header(path: str | os.PathLike) -> int:
    """Check the header and the file size of a shard; return its token count N.

    Reads only the first 1024 bytes (plus a stat), so it is cheap for 200 MB shards.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(HEADER_BYTES)
    except OSError as e:
        raise _cannot_read(path, e) from None
    return _parse_header(path, head, size)


def read_shard(path: str | os.PathLike, vocab_size: int | None = GPT2_VOCAB_SIZE) -> np.ndarray:
    """Read a whole shard into a ``np.uint16`` array: header and size checked, and every id
    checked to be below ``vocab_size`` (GPT-2's 50257 by default; ``None`` skips that check)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            n = _parse_header(path, f.read(HEADER_BYTES), size)
            body = f.read(2 * n)
    except OSError as e:
        raise _cannot_read(path, e) from None
    if len(body) != 2 * n:  # the file shrank after the stat
        raise DataError(f"{path}: truncated shard: header says {n} tokens but only {len(body) // 2} could be read; "
                        f"re-download or re-tokenize it")
    tokens = np.frombuffer(body, dtype=TOKEN_DTYPE).astype(np.uint16)  # native, writable
    if vocab_size is not None:
        _check_tokens(tokens, path, vocab_size)
    return tokens


def validate_shard(path: str | os.PathLike, check_tokens: bool = True) -> int:
    """Validate a shard and return its token count.

    With ``check_tokens=False`` only the header and the file size are checked (fast);
    otherwise the body is read too and every token id must be ``< GPT2_VOCAB_SIZE``.
    """
    if check_tokens:
        return int(read_shard(path).size)
    return read_header(path)


# --------------------------------------------------------------------------- writing

def write_shard(path: str | os.PathLike, tokens) -> Path:
    """Write ``tokens`` (1-D integer array-like, all in [0, 50257)) as a shard; return the path.

    Written atomically (see :func:`atomic_write`): readers see the old file or the new one.
    """
    path = Path(path)
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"{path}: tokens must be a 1-D array, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{path}: tokens must be integers, got dtype {arr.dtype}")
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= GPT2_VOCAB_SIZE:
            bad = lo if lo < 0 else hi
            raise DataError(f"{path}: refusing to write token id {bad}: ids must be in [0, {GPT2_VOCAB_SIZE})")
    body = arr.astype(TOKEN_DTYPE, copy=False)
    header = make_header(int(body.size))
    return atomic_write(path, [header.tobytes(), body.tobytes()])


def atomic_write(path: str | os.PathLike, chunks) -> Path:
    """Write the byte strings ``chunks`` to ``path``: a new, uniquely named temp file
    ``.{name}.XXXX.tmp`` in the same folder, fsync, ``os.replace``; the temp file is removed
    if anything fails, so the previous file (if any) stays intact and no temp file is left.

    The scheme of ``train_gpt.write_atomically``, except that the temp file is created with
    ``O_CREAT | O_EXCL`` and mode 0666 (minus the umask) rather than by ``tempfile.mkstemp``,
    whose 0600 would make every dataset file private to its owner.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


# --------------------------------------------------------------------------- CLI

def main(argv=None) -> int:
    """Validate shard files. Prints a line per file; exits 2 with one stderr line if any is bad."""
    parser = CliParser(
        prog=PROG,
        description="Validate token shards (.bin): header, size and (unless --header-only) token ids.")
    parser.add_argument("files", nargs="+", help="shard files to check")
    parser.add_argument("--header-only", action="store_true",
                        help="check only header and file size (fast)")
    args = parser.parse_args(argv)
    failures = []
    for f in args.files:
        try:
            n = validate_shard(f, check_tokens=not args.header_only)
            print(f"{f}: ok, {n:,} tokens")
        except DataError as e:
            print(f"{f}: FAILED: {str(e).removeprefix(f'{Path(f)}: ')}")
            failures.append(str(e))
    if len(failures) == 1:
        exit_with_error(PROG, failures[0])
    if failures:
        exit_with_error(PROG, f"{len(failures)} of {len(args.files)} files are not valid shards; "
                              f"the first: {failures[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
