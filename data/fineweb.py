"""Tokenize text into GPT-2 token shards (the FineWeb ``.bin`` format, see shards.py).

Sources:

* default: the Hugging Face dataset ``HuggingFaceFW/fineweb``, config ``sample-10BT``,
  streamed with the ``datasets`` package (``pip install datasets``);
* ``--files A.txt B.jsonl DIR ...``: local files. A ``.txt`` file is one document, or is
  split into several with ``--separator STR``; a ``.jsonl`` file holds one document per
  line in its ``"text"`` field. A directory contributes its ``.txt``/``.jsonl`` files
  (recursively, in sorted order).

Encoding: tiktoken GPT-2 (``tiktoken.get_encoding("gpt2")``, which downloads its ranks on
first use), or offline with ``--bpe PATH`` pointing to the ``r50k_base.tiktoken`` ranks file
(its sha256 is verified). Every document becomes ``[50256] + enc.encode_ordinary(text)``.

Tokens go into fixed-size shards (``--shard_size``, default 10**8 tokens); documents may
straddle shard ends. The first shard written is the validation shard
``{prefix}_val_000000.bin``, then ``{prefix}_train_000001.bin``, ``..._000002.bin``, ...;
the final partial shard is written too. An input of no more than ``--shard_size`` tokens
(which would give a validation shard and no training shard) is an error: nothing is written.

Errors (bad flags, unreadable or malformed input, offline failures, an unwritable ``--out``)
print one line ``fineweb.py: error: ...`` on stderr and exit with status 2.

Examples::

    python data/fineweb.py                                   # FineWeb sample-10BT
    python data/fineweb.py --files corpus/ --bpe r50k_base.tiktoken --out data/mine \\
        --prefix mine --shard_size 1000000 --workers 2

Library use (e.g. from data/novels.py): ``load_encoding``, ``tokenize_documents``,
``ShardWriter``, ``iter_local_documents``.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from shards import (BOS_ID, GPT2_VOCAB_SIZE, CliParser, DataError, describe_os_error, exit_with_error,
                    write_shard)

_HERE = Path(__file__).resolve().parent

PROG = "fineweb.py"
R50K_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
# The GPT-2 / r50k_base pre-tokenization pattern, as in tiktoken's openai_public registry.
GPT2_PAT_STR = (
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
)
ENDOFTEXT = "<|endoftext|>"
DEFAULT_SHARD_SIZE = 10**8
DEFAULT_OUT = _HERE / "fineweb10B"


# --------------------------------------------------------------------------- encoding

def load_bpe_ranks(bpe_path: str | os.PathLike, expected_sha256: str = R50K_SHA256) -> dict:
    """Parse a ``.tiktoken`` ranks file (lines ``<base64 token> <rank>``), verifying sha256."""
    bpe_path = Path(bpe_path)
    try:
        data = bpe_path.read_bytes()
    except OSError as e:
        raise DataError(f"--bpe {bpe_path}: cannot read ({e.strerror or e}); "
                        f"pass the path of r50k_base.tiktoken") from None
    digest = hashlib.sha256(data).hexdigest()
    if expected_sha256 is not None and digest != expected_sha256:
        raise DataError(f"--bpe {bpe_path}: sha256 {digest} does not match the r50k_base "
                        f"ranks file ({expected_sha256}); pass the genuine r50k_base.tiktoken")
    ranks = {}
    for lineno, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
        except ValueError:
            raise DataError(f"--bpe {bpe_path}: line {lineno} is not '<base64> <rank>'; "
                            f"pass a tiktoken ranks file") from None
    return ranks


def load_encoding(bpe_path: str | os.PathLike | None = None):
    """The GPT-2 tiktoken encoding: from ``bpe_path`` (offline) or ``get_encoding("gpt2")``."""
    try:
        import tiktoken
    except ImportError:
        raise DataError("tokenizing needs the 'tiktoken' package: pip install tiktoken") from None

    if bpe_path is not None:
        ranks = load_bpe_ranks(bpe_path)
        return tiktoken.Encoding(name="gpt2", pat_str=GPT2_PAT_STR, mergeable_ranks=ranks,
                                 special_tokens={ENDOFTEXT: BOS_ID})
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # network / cache problems
        reason = str(e).splitlines()[0][:150] if str(e) else type(e).__name__
        raise DataError(f"could not load tiktoken's gpt2 encoding ({reason}); "
                        f"offline, pass --bpe PATH/TO/r50k_base.tiktoken") from None


# --------------------------------------------------------------------------- tokenizing

_worker_enc = None


def _init_worker(enc) -> None:
    global _worker_enc
    _worker_enc = enc


def encode_document(text: str, enc=None) -> np.ndarray:
    """``[BOS] + enc.encode_ordinary(text)`` as a ``np.uint16`` array."""
    enc = _worker_enc if enc is None else enc
    ids = enc.encode_ordinary(text)
    out = np.empty(len(ids) + 1, dtype=np.int64)
    out[0] = BOS_ID
    out[1:] = ids
    if out.size > 1 and (out[1:].max() >= GPT2_VOCAB_SIZE or out[1:].min() < 0):
        raise DataError(f"encoding produced a token id outside [0, {GPT2_VOCAB_SIZE}); "
                        f"use the GPT-2 encoding")
    return out.astype(np.uint16)


def tokenize_documents(docs: Iterable[str], enc, workers: int = 1,
                       chunksize: int = 16) -> Iterator[np.ndarray]:
    """Yield one ``np.uint16`` array per document, in input order.

    ``workers <= 1`` tokenizes in this process; otherwise a multiprocessing pool
    (``imap``, order preserved) whose workers receive ``enc`` once at start-up.
    """
    if workers is None or workers <= 1:
        for text in docs:
            yield encode_document(text, enc)
        return
    import multiprocessing as mp

    with mp.Pool(workers, initializer=_init_worker, initargs=(enc,)) as pool:
        yield from pool.imap(encode_document, docs, chunksize=chunksize)


# --------------------------------------------------------------------------- sharding

class ShardWriter:
    """Accumulate token arrays and write fixed-size shards.

    ``split=None`` (FineWeb layout): the first shard is ``{prefix}_val_{start_index:06d}.bin``
    and the following ones ``{prefix}_train_{i:06d}.bin``. ``split="train"`` or ``"val"``
    names every shard with that split. Shards hold exactly ``shard_size`` tokens, except
    the last one (written by :meth:`close`), which may be shorter. Documents straddle
    shard boundaries.

    In the FineWeb layout the validation shard is written only once more than ``shard_size``
    tokens have arrived, so that a training shard follows it: if the whole input has no more
    than ``shard_size`` tokens, :meth:`close` raises :class:`DataError` and nothing is written.
    """

    def __init__(self, out_dir, prefix: str = "fineweb", shard_size: int = DEFAULT_SHARD_SIZE,
                 split: str | None = None, start_index: int = 0):
        if shard_size <= 0:
            raise DataError(f"--shard_size {shard_size}: must be a positive number of tokens")
        if split not in (None, "train", "val"):
            raise ValueError(f"split must be None, 'train' or 'val', not {split!r}")
        self.out_dir = Path(out_dir)
        self.prefix = prefix
        self.shard_size = int(shard_size)
        self.split = split
        self.index = int(start_index)
        self.paths: list[Path] = []
        self.total_tokens = 0
        self._parts: list[np.ndarray] = []
        self._buffered = 0
        self._closed = False

    def _name(self, index: int) -> str:
        split = self.split or ("val" if not self.paths else "train")
        return f"{self.prefix}_{split}_{index:06d}.bin"

    def _write(self, tokens: np.ndarray) -> None:
        path = self.out_dir / self._name(self.index)
        write_shard(path, tokens)
        self.paths.append(path)
        self.index += 1

    def _needed(self) -> int:
        """Tokens to buffer before the next full shard is written: one more than a shard for
        the FineWeb layout's validation shard, so that a training shard is sure to follow."""
        return self.shard_size + (1 if self.split is None and not self.paths else 0)

    def add(self, tokens) -> list[Path]:
        """Append tokens; write every shard that became full. Returns the new paths."""
        if self._closed:
            raise RuntimeError("ShardWriter is closed")
        tokens = np.asarray(tokens, dtype=np.uint16)
        self.total_tokens += int(tokens.size)
        self._parts.append(tokens)
        self._buffered += int(tokens.size)
        written = []
        if self._buffered >= self._needed():
            buf = np.concatenate(self._parts)
            start = 0
            while buf.size - start >= self._needed():
                self._write(buf[start:start + self.shard_size])
                written.append(self.paths[-1])
                start += self.shard_size
            rest = buf[start:]
            self._parts = [rest.copy()] if rest.size else []
            self._buffered = int(rest.size)
        return written

    def close(self) -> list[Path]:
        """Write the final partial shard (if any tokens are left); return all paths."""
        if not self._closed:
            if self._buffered and self.split is None and not self.paths:
                n = self.total_tokens
                raise DataError(f"the input has only {n:,} tokens, which would all go into the validation "
                                f"shard (--shard_size {self.shard_size:,}) and leave no training shard; "
                                f"nothing written; pass a --shard_size below {n:,} or more input")
            if self._buffered:
                self._write(np.concatenate(self._parts))
            self._parts, self._buffered, self._closed = [], 0, True
        return list(self.paths)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            self.close()
        return False


def write_documents(token_arrays: Iterable[np.ndarray], writer: ShardWriter,
                    progress=None, max_tokens: int | None = None) -> list[Path]:
    """Feed token arrays into ``writer`` (stopping after ``max_tokens``) and close it."""
    for toks in token_arrays:
        if max_tokens is not None and writer.total_tokens + toks.size > max_tokens:
            toks = toks[: max(0, max_tokens - writer.total_tokens)]
        if toks.size:
            writer.add(toks)
        if progress is not None:
            progress.update(int(toks.size))
        if max_tokens is not None and writer.total_tokens >= max_tokens:
            break
    return writer.close()


# --------------------------------------------------------------------------- sources

def decode_separator(s: str | None) -> str | None:
    """Turn the escapes ``\\n``, ``\\t``, ``\\r``, ``\\\\`` of a command-line separator into characters."""
    if s is None:
        return None
    out, i = [], 0
    table = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}
    while i < len(s):
        if s[i] == "\\" and i + 1 < len(s) and s[i + 1] in table:
            out.append(table[s[i + 1]])
            i += 2
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


def expand_paths(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """Files as given; directories replaced by their ``.txt``/``.jsonl`` files, sorted."""
    out = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            found = sorted(q for q in p.rglob("*") if q.is_file() and q.suffix in (".txt", ".jsonl"))
            if not found:
                raise DataError(f"--files {p}: directory has no .txt or .jsonl files")
            out.extend(found)
        elif p.is_file():
            if p.suffix not in (".txt", ".jsonl"):
                raise DataError(f"--files {p}: unsupported file type {p.suffix or '(none)'!r}; "
                                f"use .txt or .jsonl")
            out.append(p)
        else:
            raise DataError(f"--files {p}: no such file or directory")
    return out


def _read_text(path: Path) -> str:
    """The file's text exactly (no newline translation); a leading UTF-8 BOM is dropped."""
    try:
        return path.read_bytes().decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid UTF-8 (byte {e.start}); convert it to UTF-8") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None


def iter_local_documents(paths: Iterable[str | os.PathLike],
                         separator: str | None = None) -> Iterator[str]:
    """Documents from local ``.txt``/``.jsonl`` files (directories expanded); empty ones skipped."""
    for path in expand_paths(paths):
        if path.suffix == ".jsonl":
            with open(path, encoding="utf-8") as f:
                try:
                    for lineno, line in enumerate(f, 1):
                        if not line.strip():
                            continue
                        try:
                            obj = json.loads(line)
                        except json.JSONDecodeError as e:
                            raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg}); "
                                            f"each line must be an object with a 'text' field") from None
                        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                            raise DataError(f"{path}:{lineno}: no string 'text' field; "
                                            f"each line must be an object with a 'text' field")
                        if obj["text"]:
                            yield obj["text"]
                except UnicodeDecodeError as e:
                    raise DataError(f"{path}: not valid UTF-8 (byte {e.start}); "
                                    f"convert it to UTF-8") from None
        else:
            text = _read_text(path)
            parts = text.split(separator) if separator else [text]
            for part in parts:
                if part:
                    yield part


def iter_hf_documents(dataset: str = "HuggingFaceFW/fineweb", name: str | None = "sample-10BT",
                      split: str = "train") -> Iterator[str]:
    """Stream the ``text`` field of a Hugging Face dataset (needs the ``datasets`` package).

    The import happens here, eagerly, so a missing package is reported before anything else.
    """
    try:
        from datasets import load_dataset
    except ImportError:
        raise DataError("the default source (Hugging Face FineWeb) needs the 'datasets' package: "
                        "pip install datasets, or tokenize local files with --files") from None

    def gen():
        try:
            ds = load_dataset(dataset, name=name, split=split, streaming=True)
            for row in ds:
                yield row["text"]
        except Exception as e:
            reason = (str(e).splitlines() or [type(e).__name__])[0][:150]
            raise DataError(f"could not stream {dataset} ({name}): {type(e).__name__}: {reason}; "
                            f"check your internet connection or use --files") from None

    return gen()


# --------------------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    p = CliParser(
        prog=PROG,
        description="Tokenize text (FineWeb sample-10BT by default, or local .txt/.jsonl files) "
                    "into GPT-2 token shards; the first shard is validation.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--files", nargs="+", metavar="PATH",
                   help="local .txt/.jsonl files or directories instead of the HF dataset")
    p.add_argument("--separator", metavar="STR", default=None,
                   help="split .txt files into documents at STR (escapes \\n \\t \\r \\\\ allowed); "
                        "default: one document per file")
    p.add_argument("--dataset", default="HuggingFaceFW/fineweb", help="HF dataset repo")
    p.add_argument("--name", default="sample-10BT", help="HF dataset config name")
    p.add_argument("--split", default="train", help="HF dataset split")
    p.add_argument("--bpe", metavar="PATH", default=None,
                   help="r50k_base.tiktoken ranks file for offline use (sha256 checked)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="output directory")
    p.add_argument("--prefix", default="fineweb", help="shard file name prefix")
    p.add_argument("--shard_size", type=int, default=DEFAULT_SHARD_SIZE, help="tokens per shard")
    p.add_argument("--max_tokens", type=int, default=None,
                   help="stop after this many tokens (default: the whole source)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="tokenizer processes (1 = in this process)")
    p.add_argument("--quiet", action="store_true", help="no progress bar (it is shown only on a terminal)")
    return p


def main(argv=None, enc=None) -> list[Path]:
    """Run the CLI; ``enc`` may be injected (tests). On bad flags or input it prints one line
    ``fineweb.py: error: ...`` on stderr and exits with status 2."""
    args = build_parser().parse_args(argv)
    try:
        if args.shard_size <= 0:
            raise DataError(f"--shard_size {args.shard_size}: must be a positive number of tokens")
        if args.max_tokens is not None and args.max_tokens <= 0:
            raise DataError(f"--max_tokens {args.max_tokens}: must be positive")
        if args.max_tokens is not None and args.max_tokens <= args.shard_size:
            raise DataError(f"--max_tokens {args.max_tokens:,} is not more than --shard_size {args.shard_size:,}: "
                            f"every token would go into the validation shard and no training shard would be "
                            f"written; raise --max_tokens or lower --shard_size")
        if Path(args.out).exists() and not Path(args.out).is_dir():
            raise DataError(f"--out {args.out}: not a directory")
        if args.workers < 1:
            raise DataError(f"--workers {args.workers}: must be >= 1")
        separator = decode_separator(args.separator)
        if args.files:
            expand_paths(args.files)  # fail early on bad paths
            docs = iter_local_documents(args.files, separator)
        else:
            docs = iter_hf_documents(args.dataset, args.name, args.split)
        if enc is None:
            enc = load_encoding(args.bpe)
        from tqdm import tqdm

        writer = ShardWriter(args.out, args.prefix, args.shard_size)
        with tqdm(total=args.max_tokens, unit="tok", unit_scale=True, desc="tokenizing",
                  disable=True if args.quiet else None) as bar:  # None: only on a terminal
            paths = write_documents(tokenize_documents(docs, enc, args.workers), writer,
                                    progress=bar, max_tokens=args.max_tokens)
    except DataError as e:
        exit_with_error(PROG, e)
    except OSError as e:
        exit_with_error(PROG, describe_os_error(e))
    if not paths:
        exit_with_error(PROG, "no documents found; nothing written")
    if not args.quiet:
        print(f"wrote {writer.total_tokens:,} tokens in {len(paths)} shard(s) to {args.out}")
    return paths


if __name__ == "__main__":
    main()
