"""Download pre-tokenized FineWeb-10B GPT-2 shards from the Hugging Face Hub.

    python data/cached_fineweb10B.py [N] [--dir DIR]

fetches ``fineweb_val_000000.bin`` and ``fineweb_train_000001.bin`` ...
``fineweb_train_{N:06d}.bin`` (default N=9; 100M tokens, ~200 MB each) from the dataset
repo ``kjj0/fineweb10B-gpt2`` into ``data/fineweb10B/`` (next to this script) or ``--dir``.

Files that are already present and valid (header and size checked, see shards.py) are
skipped; invalid ones are deleted and downloaded again. If the Hub cannot be reached, a
download fails or ``--dir`` cannot be written, the script prints one line
``cached_fineweb10B.py: error: ...`` to stderr and exits with status 2 (as for a bad flag).
``HF_ENDPOINT`` / ``HF_TOKEN`` and the other huggingface_hub environment variables apply.
"""

from __future__ import annotations

import os
from pathlib import Path

from shards import CliParser, DataError, describe_os_error, exit_with_error, validate_shard

_HERE = Path(__file__).resolve().parent

PROG = "cached_fineweb10B.py"
REPO_ID = "kjj0/fineweb10B-gpt2"
DEFAULT_NUM_TRAIN = 9
DEFAULT_DIR = _HERE / "fineweb10B"


class DownloadError(Exception):
    def __init__(self, filename: str, reason: str):
        super().__init__(f"could not download {filename} from {REPO_ID} ({reason}); "
                         f"check your internet connection or HF_ENDPOINT and retry")
        self.filename = filename
        self.reason = reason


def shard_names(num_train: int) -> list[str]:
    """The validation shard followed by train shards 1..num_train."""
    return ["fineweb_val_000000.bin"] + [f"fineweb_train_{i:06d}.bin"
                                         for i in range(1, num_train + 1)]


def is_valid(path: Path) -> bool:
    """True if ``path`` exists with a good header and the matching size (body not read)."""
    try:
        validate_shard(path, check_tokens=False)
        return True
    except DataError:
        return False


def download(filename: str, dest_dir: Path) -> Path:
    """Download one file of the dataset repo into ``dest_dir``; return its path."""
    from huggingface_hub import hf_hub_download

    try:  # the hub logs a warning per retry; the final error is reported in one line instead
        from huggingface_hub.utils import logging as hub_logging

        hub_logging.set_verbosity_error()
    except Exception:
        pass
    return Path(hf_hub_download(repo_id=REPO_ID, filename=filename, repo_type="dataset",
                                local_dir=str(dest_dir)))


def _one_line(text: str, limit: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _short_reason(e: BaseException) -> str:
    """``Type: message`` of the error, plus its root cause (e.g. a DNS failure) if chained."""
    root, seen = e, {id(e)}
    while (nxt := root.__cause__ or root.__context__) is not None and id(nxt) not in seen:
        seen.add(id(nxt))
        root = nxt
    if root is not e:
        return f"{type(e).__name__}, caused by {type(root).__name__}: {_one_line(root, 120)}"
    text = _one_line(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def fetch(num_train: int = DEFAULT_NUM_TRAIN, dest_dir: Path = DEFAULT_DIR,
          progress: bool = True) -> list[Path]:
    """Make sure all wanted shards are in ``dest_dir``; raise DownloadError on failure.

    Downloads go through the module-level :func:`download` (tests replace it).
    """
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    names = shard_names(num_train)
    from tqdm import tqdm

    paths = []
    for name in tqdm(names, desc="fineweb10B shards", unit="file", disable=not progress):
        path = dest_dir / name
        if is_valid(path):
            paths.append(path)
            continue
        if path.exists() or path.is_symlink():
            path.unlink()  # invalid: remove so the hub does not treat it as up to date
        try:
            got = Path(download(name, dest_dir))
        except KeyboardInterrupt:
            raise
        except ImportError as e:
            raise DownloadError(name, f"{e}; pip install huggingface_hub") from None
        except Exception as e:
            raise DownloadError(name, _short_reason(e)) from None
        if got.resolve() != path.resolve():
            os.replace(got, path)
        try:
            validate_shard(path, check_tokens=False)
        except DataError as e:
            raise DownloadError(name, f"downloaded file is invalid: {e}") from None
        paths.append(path)
    return paths


def main(argv=None) -> list[Path]:
    """Run the CLI. On a bad flag, an unusable --dir or a failed download it prints one line
    ``cached_fineweb10B.py: error: ...`` on stderr and exits with status 2."""
    parser = CliParser(
        prog=PROG,
        description=f"Download FineWeb-10B GPT-2 token shards from the HF dataset {REPO_ID}.")
    parser.add_argument("num_train", nargs="?", type=int, default=DEFAULT_NUM_TRAIN, metavar="N",
                        help=f"number of train shards (100M tokens each; default {DEFAULT_NUM_TRAIN}); "
                             f"the validation shard is always fetched")
    parser.add_argument("--dir", default=str(DEFAULT_DIR),
                        help="destination directory (default: data/fineweb10B next to this script)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.num_train < 0:
        parser.error(f"N must be >= 0, got {args.num_train}")
    if Path(args.dir).exists() and not Path(args.dir).is_dir():
        parser.error(f"--dir {args.dir}: not a directory")
    try:
        paths = fetch(args.num_train, Path(args.dir), progress=not args.quiet)
    except DownloadError as e:
        exit_with_error(PROG, e)
    except OSError as e:
        exit_with_error(PROG, f"{describe_os_error(e)}; check --dir")
    if not args.quiet:
        print(f"{len(paths)} shard(s) ready in {args.dir}")
    return paths


if __name__ == "__main__":
    main()
