"""Token shards for the data/ scripts: the trainer's shard reader and writer, a validating CLI,
and the command-line conventions of the data/ scripts.

A shard (``.bin``) is the format used by the FineWeb GPT-2 shards:

* header: 256 little-endian int32 (1024 bytes); ``header[0] = SHARD_MAGIC`` (20240520),
  ``header[1] = SHARD_VERSION`` (1), ``header[2] = N`` (number of tokens), the rest zero;
* body: N little-endian uint16 GPT-2 token ids, all ``< GPT2_VOCAB_SIZE`` (50257).

The file size must be exactly ``1024 + 2 * N``. The format has one implementation,
``read_shard`` / ``write_shard`` / ``write_atomically`` in ``train_gpt.py`` (the trainer is a
single self-contained file, so the data scripts import it, never the other way round); this
module re-exports them with ``DataError`` and the constants. A corrupt shard raises
:class:`DataError` (a ``ValueError``) with a one-line message that names the file and the
problem; so does a file that cannot be read at all (missing, a directory, no permission).

Library use::

    from shards import GPT2_VOCAB_SIZE, read_shard, validate_shard, write_shard
    write_shard(Path("x.bin"), tokens)    # atomic: O_EXCL temp file next to it + fsync + os.replace
    toks = read_shard("x.bin", GPT2_VOCAB_SIZE)   # read-only np.uint16 array; ids checked
    n = validate_shard("x.bin", check_tokens=False)   # header + size only (fast)

The writer's temp file is created with ``O_CREAT | O_EXCL`` and mode 0666 minus the umask (not
by ``tempfile.mkstemp``, whose 0600 would make every dataset file private to its owner), and it
is removed if the write fails, so the previous file (if any) stays intact.

As a script, ``python data/shards.py FILE...`` validates shards and prints one line per file
(``ok, N tokens`` or ``FAILED: reason``) on stdout; if any file is bad it ends with one line
``shards.py: error: ...`` on stderr and exit status 2.

Every data/ script reports errors the same way (:class:`CliParser`, :func:`exit_with_error`):
exactly one line ``<script>.py: error: <message>`` on stderr and exit status 2, for usage
errors and for data/IO errors alike.

Importing this module imports ``train_gpt.py``, and with it torch (a few seconds).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import NoReturn

# train_gpt.py sits in the repository root, the parent of this data/ folder. Put that folder on
# sys.path so `import train_gpt` finds this repository's trainer however the script is started
# (python data/x.py puts only data/ on the path).
REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from train_gpt import (BOS_ID, GPT2_VOCAB_SIZE, SHARD_HEADER_INTS, SHARD_MAGIC, SHARD_VERSION,  # noqa: E402
                       DataError, read_shard, write_atomically, write_shard)

__all__ = ["BOS_ID", "GPT2_VOCAB_SIZE", "SHARD_HEADER_INTS", "SHARD_MAGIC", "SHARD_VERSION", "DataError",
           "read_shard", "write_atomically", "write_shard", "validate_shard", "CliParser", "exit_with_error",
           "describe_os_error", "main"]

PROG = "shards.py"


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


# --------------------------------------------------------------------------- validating

def validate_shard(path: str | os.PathLike, check_tokens: bool = True) -> int:
    """Validate a shard with the trainer's reader and return its token count.

    With ``check_tokens=False`` only the header and the file size are checked (fast: the body is
    not read); otherwise the body is read too and every token id must be ``< GPT2_VOCAB_SIZE``.
    """
    if check_tokens:
        return int(read_shard(path, GPT2_VOCAB_SIZE).size)
    read_shard(path, max_tokens=0)  # header and size only; the size is then 1024 + 2 * N
    return (os.path.getsize(path) - SHARD_HEADER_INTS * 4) // 2


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
