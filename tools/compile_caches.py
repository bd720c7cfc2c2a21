"""torch.compile's caches of one process, saved to a folder and loaded into another: what a borrowed
GPU machine can send back (at most MAX_FILES files of at most MAX_FILE_BYTES each) so that a second
call skips the cold compile (over 200 s on the H200). tools/gpu_smoke.py's --save-caches and
--load-caches."""

from pathlib import Path

import torch

# a borrowed machine sends back 8 files of at most 16 MiB: the caches take 7, the smoke's output one
MAX_FILES, MAX_FILE_BYTES = 7, 16 << 20
PART = "compile-caches.part{:d}"


class CachesTooLarge(ValueError):
    pass


def save(folder):
    """This process's compile artifacts into `folder` (made if missing) as numbered parts; returns
    (parts, bytes); (0, 0) when there is nothing to save. Parts from an earlier save are replaced.
    """
    artifacts = torch.compiler.save_cache_artifacts()
    data = artifacts[0] if artifacts else b""
    if len(data) > MAX_FILES * MAX_FILE_BYTES:
        raise CachesTooLarge(
            f"{len(data):,} bytes of compile caches: more than {MAX_FILES} files of "
            f"{MAX_FILE_BYTES >> 20} MiB"
        )
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob(PART.format(0)[:-1] + "*"):
        old.unlink()
    parts = [data[i : i + MAX_FILE_BYTES] for i in range(0, len(data), MAX_FILE_BYTES)]
    for i, part in enumerate(parts):
        (folder / PART.format(i)).write_bytes(part)
    return len(parts), len(data)


def load(folder):
    """Load the parts `save` wrote into this process's compile caches; returns the bytes loaded."""
    folder = Path(folder)
    data = b"".join(
        (folder / PART.format(i)).read_bytes()
        for i in range(MAX_FILES)
        if (folder / PART.format(i)).is_file()
    )
    if data:
        torch.compiler.load_cache_artifacts(data)
    return len(data)
