"""Build the CPU-track "novels" corpus: 98 public-domain English novels as GPT-2 token shards.

Source: the public repository ``computationalstylistics/100_english_novels`` at commit
143e601875d70e195f2cc5ebd8b034609271194d, folder ``corpus/``. Its two novels first published
after 1930 (``Galsworthy_River_1933``, ``Woolf_Years_1937``) are always left out.

    python data/novels.py --bpe PATH/TO/r50k_base.tiktoken            # download the texts
    python data/novels.py --src DIR_WITH_TXT --bpe r50k_base.tiktoken  # offline, local texts

Steps (deterministic, byte for byte):

1. every novel is normalized (UTF-8, BOM dropped, CRLF -> LF, trailing whitespace of each
   line removed, leading/trailing blank lines removed) and cut into ~4,000-character
   documents at line boundaries: lines are collected until they (counting one newline
   each) reach ``--chunk_chars``; each document is stripped and empty ones are dropped; a
   last document shorter than half of ``--chunk_chars`` is appended to the previous one;
2. the validation novels (``--val``; default: Cbronte_Villette_1853, Doyle_Hound_1902,
   Hardy_Tess_1891, Kipling_Kim_1901, Woolf_Lighthouse_1927) are held out whole: all their
   documents go to the validation split, every other novel's to the training split. Each
   split's documents are listed novel by novel (novels in sorted name order, each novel's
   documents in text order) and that list is then shuffled, which is all ``--seed`` does:
   the training documents are put in the order ``numpy.random.default_rng(seed).permutation``
   and the validation documents in the order ``default_rng(seed + 1).permutation``. The seed
   changes neither the documents nor which novels are held out, only the order of the
   documents in the shards. (Shuffling the validation documents makes any prefix of the
   validation shard sample all held-out novels.)
3. the documents are tokenized with fineweb.py's functions (``[50256] + encode_ordinary``)
   into ``novels_val_000000.bin`` and ``novels_train_000001.bin`` in ``--out`` (default:
   data/novels/ next to this script); a split of more than ``--shard_size`` tokens continues
   in ``novels_val_000001.bin`` / ``novels_train_000002.bin`` and so on. Shards of an earlier
   build with the same prefix that this build did not write are deleted, and
   ``manifest.json`` records the source, the files per split, document and token counts and
   the sha256 of every shard.

With ``--src DIR`` every ``*.txt`` file in DIR (except the two excluded novels) is used; the
download uses exactly the 98 novels listed in ``NOVELS``. Errors (bad flags, missing or
unreadable texts, a download that fails offline, an unwritable ``--out``) print one line
``novels.py: error: ...`` on stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

from fineweb import ShardWriter, load_encoding, tokenize_documents, write_documents
from shards import BOS_ID, CliParser, DataError, describe_os_error, exit_with_error, write_atomically

_HERE = Path(__file__).resolve().parent

PROG = "novels.py"
REPO = "computationalstylistics/100_english_novels"
COMMIT = "143e601875d70e195f2cc5ebd8b034609271194d"
FOLDER = "corpus/"
RAW_URL = "https://raw.githubusercontent.com/{repo}/{commit}/{folder}{name}.txt"
EXCLUDED = ("Galsworthy_River_1933", "Woolf_Years_1937")
VAL_NOVELS = ("Cbronte_Villette_1853", "Doyle_Hound_1902", "Hardy_Tess_1891",
              "Kipling_Kim_1901", "Woolf_Lighthouse_1927")
# The 98 texts of corpus/ at COMMIT that are used (the 100 files minus EXCLUDED).
NOVELS = (
    "Anon_Clara_1864", "Barclay_Ladies_1917", "Barclay_Postern_1911", "Barclay_Rosary_1909",
    "Bennet_Babylon_1902", "Bennet_Helen_1910", "Bennet_Imperial_1930", "Blackmore_Erema_1877",
    "Blackmore_Lorna_1869", "Blackmore_Springhaven_1887", "Braddon_Audley_1862",
    "Braddon_Phantom_1883", "Braddon_Quest_1871", "Burnett_Garden_1911", "Burnett_Lord_1886",
    "Burnett_Princess_1905", "Cbronte_Jane_1847", "Cbronte_Shirley_1849", "Cbronte_Villette_1853",
    "Chesterton_Innocence_1911", "Chesterton_Napoleon_1904", "Chesterton_Thursday_1908",
    "Conrad_Almayer_1895", "Conrad_Nostromo_1904", "Conrad_Rover_1923", "Corelli_Innocent_1914",
    "Corelli_Romance_1886", "Corelli_Satan_1895", "Dickens_Bleak_1853", "Dickens_Expectations_1861",
    "Dickens_Oliver_1839", "Doyle_Hound_1902", "Doyle_Lost_1912", "Doyle_Micah_1889",
    "Eliot_Adam_1859", "Eliot_Daniel_1876", "Eliot_Felix_1866", "Ford_Girl_1907", "Ford_Post_1926",
    "Ford_Soldier_1915", "Forster_Angels_1905", "Forster_Howards_1910", "Forster_View_1908",
    "Galsworthy_Man_1906", "Galsworthy_Saints_1919", "Gaskell_Lovers_1863", "Gaskell_Ruth_1855",
    "Gaskell_Wives_1865", "Gissing_Unclassed_1884", "Gissing_Warburton_1903", "Gissing_Women_1893",
    "Haggard_Mines_1885", "Haggard_She_1887", "Haggard_Sheallan_1921", "Hardy_Jude_1895",
    "Hardy_Madding_1874", "Hardy_Tess_1891", "James_Ambassadors_1903", "James_Roderick_1875",
    "James_Tragic_1890", "Kipling_Captains_1896", "Kipling_Kim_1901", "Kipling_Light_1891",
    "Lawrence_Peacock_1911", "Lawrence_Serpent_1926", "Lawrence_Women_1920", "Lee_Albany_1884",
    "Lee_Brown_1884", "Lee_Penelope_1903", "Lytton_Kenelm_1873", "Lytton_Novel_1853",
    "Lytton_What_1858", "Meredith_Feverel_1859", "Meredith_Marriage_1895", "Meredith_Richmond_1871",
    "Morris_Roots_1890", "Morris_Water_1897", "Morris_Wood_1894", "Schreiner_Farm_1883",
    "Schreiner_Trooper_1897", "Schreiner_Undine_1929", "Stevenson_Arrow_1888",
    "Stevenson_Catriona_1893", "Stevenson_Treasure_1883", "Thackeray_Esmond_1852",
    "Thackeray_Pendennis_1850", "Thackeray_Virginians_1859", "Trollope_Angel_1881",
    "Trollope_Phineas_1869", "Trollope_Warden_1855", "Ward_Ashe_1905", "Ward_Harvest_1920",
    "Ward_Milly_1881", "Wcollins_Basil_1852", "Wcollins_Legacy_1889", "Wcollins_Woman_1860",
    "Woolf_Lighthouse_1927", "Woolf_Night_1919",
)
DEFAULT_CHUNK_CHARS = 4000
DEFAULT_SEED = 1337
DEFAULT_SHARD_SIZE = 10**8
DEFAULT_OUT = _HERE / "novels"
_SHARD_RE = re.compile(r"_(train|val)_\d{6}\.bin$")


# --------------------------------------------------------------------------- text -> documents

def normalize_text(text: str) -> str:
    """Drop a BOM, CRLF/CR -> LF, strip trailing whitespace of every line and of the text."""
    text = text.removeprefix("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
    return "\n".join(line.rstrip() for line in text.split("\n")).strip()


def split_documents(text: str, chunk_chars: int = DEFAULT_CHUNK_CHARS) -> list[str]:
    """Cut a normalized text into documents of about ``chunk_chars`` characters.

    Lines are collected until their length, counting one newline per line, reaches
    ``chunk_chars``; the collected lines form a document (so a very long line ends the
    document it falls in). Documents are stripped and empty ones dropped. A final
    document shorter than ``chunk_chars // 2`` is appended to the previous one.
    """
    if chunk_chars <= 0:
        raise DataError(f"--chunk_chars {chunk_chars}: must be positive")
    pieces, cur, count = [], [], 0
    for line in text.split("\n"):
        cur.append(line)
        count += len(line) + 1
        if count >= chunk_chars:
            pieces.append("\n".join(cur))
            cur, count = [], 0
    if cur:
        pieces.append("\n".join(cur))
    docs = [p.strip() for p in pieces]
    docs = [d for d in docs if d]
    if len(docs) > 1 and len(docs[-1]) < chunk_chars // 2:
        last = docs.pop()
        docs[-1] = docs[-1] + "\n" + last
    return docs


# --------------------------------------------------------------------------- sources

def read_novel(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid UTF-8 (byte {e.start}); use the original text files") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None


def load_local(src: str | os.PathLike) -> dict[str, str]:
    """``{name: raw text}`` for every ``*.txt`` in ``src`` except the excluded novels."""
    src = Path(src)
    if not src.is_dir():
        raise DataError(f"--src {src}: not a directory; pass the folder holding the novels' .txt files")
    texts = {p.stem: read_novel(p) for p in sorted(src.glob("*.txt")) if p.stem not in EXCLUDED}
    if not texts:
        raise DataError(f"--src {src}: no .txt files found; pass the folder holding the novels")
    return texts


def fetch_url(url: str, timeout: float = 60.0) -> bytes:
    """GET ``url`` (replaceable in tests)."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def download_novels(cache_dir: str | os.PathLike, names=NOVELS, progress: bool = True) -> dict[str, str]:
    """Download the novels' raw texts into ``cache_dir`` (skipping ones already there)."""
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    from tqdm import tqdm

    for name in tqdm(names, desc="downloading novels", unit="file", disable=not progress):
        path = cache_dir / f"{name}.txt"
        if path.is_file() and path.stat().st_size > 0:
            continue
        url = RAW_URL.format(repo=REPO, commit=COMMIT, folder=FOLDER, name=name)
        try:
            data = fetch_url(url)
        except (urllib.error.URLError, OSError, ValueError) as e:
            reason = " ".join(str(getattr(e, "reason", e)).split())[:150]
            raise DataError(f"could not download {url} ({reason}); check your internet "
                            f"connection, or pass --src DIR with the .txt files") from None
        write_atomically(path, data)
    return {name: read_novel(cache_dir / f"{name}.txt") for name in names}


# --------------------------------------------------------------------------- build

def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_json(path: Path, obj) -> None:
    text = json.dumps(obj, indent=1, ensure_ascii=False) + "\n"
    write_atomically(path, text.encode("utf-8"))


def build(texts: dict[str, str], out_dir: str | os.PathLike, enc, *,
          val_names=VAL_NOVELS, seed: int = DEFAULT_SEED, chunk_chars: int = DEFAULT_CHUNK_CHARS,
          shard_size: int = DEFAULT_SHARD_SIZE, workers: int = 1, prefix: str = "novels",
          progress: bool = False) -> dict:
    """Build the shards and manifest from ``{name: raw text}``; return the manifest dict."""
    out_dir = Path(out_dir)
    texts = {k: v for k, v in texts.items() if k not in EXCLUDED}
    missing = [v for v in val_names if v not in texts]
    if missing:
        raise DataError(f"validation novel(s) {', '.join(missing)} not found among the sources; "
                        f"add their .txt files or choose others with --val")
    val_set = set(val_names)
    files, split_docs = [], {"train": [], "val": []}
    split_files = {"train": [], "val": []}
    split_chars = {"train": 0, "val": 0}
    for name in sorted(texts):
        split = "val" if name in val_set else "train"
        text = normalize_text(texts[name])
        docs = split_documents(text, chunk_chars)
        files.append({"path": f"{FOLDER}{name}.txt", "split": split,
                      "chars": len(text), "pieces": len(docs)})
        split_docs[split].extend(docs)
        split_files[split].append(name)
        split_chars[split] += sum(len(d) for d in docs)
    if not split_docs["train"]:
        raise DataError("no training documents: every source novel is held out; check --src and --val")

    # Both splits are shuffled, so any prefix of the validation shard samples all held-out novels.
    train_perm = np.random.default_rng(seed).permutation(len(split_docs["train"]))
    val_perm = np.random.default_rng(seed + 1).permutation(len(split_docs["val"]))
    ordered = {"val": [split_docs["val"][i] for i in val_perm], "train": [split_docs["train"][i] for i in train_perm]}

    out_dir.mkdir(parents=True, exist_ok=True)
    from tqdm import tqdm

    splits = {}
    written = set()
    for split, start in (("val", 0), ("train", 1)):
        docs = ordered[split]
        writer = ShardWriter(out_dir, prefix, shard_size, split=split, start_index=start)
        with tqdm(unit="tok", unit_scale=True, desc=f"tokenizing {split}", disable=not progress) as bar:
            paths = write_documents(tokenize_documents(docs, enc, workers), writer, progress=bar)
        written.update(p.name for p in paths)
        shard_info = []
        for p in paths:
            shard_info.append({"file": p.name, "tokens": (p.stat().st_size - 1024) // 2,
                               "sha256": _sha256(p)})
        splits[split] = {
            "files": split_files[split],
            "source_files": len(split_files[split]),
            "documents": len(docs),
            "tokens": writer.total_tokens,
            "chars": split_chars[split],
            "order": f"numpy default_rng({seed if split == 'train' else seed + 1}).permutation",
            "shards": shard_info,
        }
    # remove stale shards of an earlier build with the same prefix
    for p in out_dir.glob(f"{prefix}_*.bin"):
        if _SHARD_RE.search(p.name) and p.name not in written:
            p.unlink()

    manifest = {
        "name": prefix,
        "source": {"repo": REPO, "commit": COMMIT, "folder": FOLDER,
                   "excluded": [f"{n}.txt" for n in EXCLUDED]},
        "tokenizer": {"name": getattr(enc, "name", type(enc).__name__),
                      "n_vocab": getattr(enc, "n_vocab", None), "bos": BOS_ID},
        "params": {"chunk_chars": chunk_chars, "seed": seed, "shard_tokens": shard_size,
                   "val_novels": list(val_names)},
        "splits": {"train": splits["train"], "val": splits["val"]},
        "files": files,
    }
    _write_json(out_dir / "manifest.json", manifest)
    return manifest


# --------------------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    p = CliParser(
        prog=PROG,
        description="Build the novels corpus (98 public-domain English novels) as GPT-2 token shards.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--src", metavar="DIR", default=None,
                   help="read the novels' .txt files from DIR instead of downloading them")
    p.add_argument("--cache", metavar="DIR", default=str(DEFAULT_OUT / "raw"),
                   help="where downloaded texts are kept (without --src)")
    p.add_argument("--out", metavar="DIR", default=str(DEFAULT_OUT), help="output directory")
    p.add_argument("--bpe", metavar="PATH", default=None,
                   help="r50k_base.tiktoken ranks file for offline use (sha256 checked); "
                        "default: tiktoken.get_encoding('gpt2')")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED,
                   help="seed of the document order: the training documents are shuffled with numpy "
                        "default_rng(SEED).permutation, the validation documents with default_rng(SEED + 1); "
                        "it does not change which novels are held out or how they are cut into documents")
    p.add_argument("--chunk_chars", type=int, default=DEFAULT_CHUNK_CHARS, help="characters per document")
    p.add_argument("--shard_size", type=int, default=DEFAULT_SHARD_SIZE, help="max tokens per shard")
    p.add_argument("--val", nargs="+", metavar="NAME", default=list(VAL_NOVELS),
                   help="novels (file names without .txt) held out for validation")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes (1 = in this process)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def main(argv=None, enc=None) -> dict:
    """Run the CLI; ``enc`` may be injected (tests). On bad flags or input it prints one line
    ``novels.py: error: ...`` on stderr and exits with status 2."""
    args = build_parser().parse_args(argv)
    try:
        if args.workers < 1:
            raise DataError(f"--workers {args.workers}: must be >= 1")
        if args.shard_size <= 0:
            raise DataError(f"--shard_size {args.shard_size}: must be positive")
        if args.chunk_chars <= 0:
            raise DataError(f"--chunk_chars {args.chunk_chars}: must be positive")
        if Path(args.out).exists() and not Path(args.out).is_dir():
            raise DataError(f"--out {args.out}: not a directory")
        texts = load_local(args.src) if args.src is not None else None  # local input checked first
        if enc is None:
            enc = load_encoding(args.bpe)
        if texts is None:
            texts = download_novels(args.cache, progress=not args.quiet)
        manifest = build(texts, args.out, enc, val_names=args.val, seed=args.seed,
                         chunk_chars=args.chunk_chars, shard_size=args.shard_size,
                         workers=args.workers, progress=not args.quiet)
    except DataError as e:
        exit_with_error(PROG, e)
    except OSError as e:
        exit_with_error(PROG, describe_os_error(e))
    if not args.quiet:
        for split in ("train", "val"):
            s = manifest["splits"][split]
            print(f"{split}: {s['source_files']} novels, {s['documents']:,} documents, "
                  f"{s['tokens']:,} tokens -> {', '.join(x['file'] for x in s['shards'])}")
        print(f"wrote {Path(args.out) / 'manifest.json'}")
    return manifest


if __name__ == "__main__":
    main()
