"""Look at what a checkpoint of train_gpt.py learned: continue a prompt, or score the checkpoint on any shards.

    python tools/sample.py CHECKPOINT --prompt "It was a dark night" --max_new_tokens 200 --temperature 0.8 \\
        --top_k 50 --seed 0 --bpe path/to/r50k_base.tiktoken
    python tools/sample.py CHECKPOINT --eval 'data/novels/novels_val_*.bin'

Any checkpoint of this trainer loads, whatever number of processes wrote it (a checkpoint holds the full
model; only its model state is read, see load_model_state). The model runs its own forward (through
GPT.logits) with the attention windows and YaRN state of the checkpoint's step, on the
CPU path's attention (tiled SDPA, any device); generation is incremental (IncrementalModel: each position
runs once, earlier keys and values cached), on --cpu_threads threads (default 1).
Sampling is deterministic for a --seed on a given device; the text goes to stdout, tokens/s to stderr.
Generation stops at the end of a document (<|endoftext|>) or at the model's --max_seq_len.

--eval GLOB prints the mean loss per token over the first --eval_tokens tokens of the shards (default: the
checkpoint's --val_tokens, fewer if the shards hold fewer) with the final validation's windows, in
forwards of the trainer's size on one process: on the checkpoint's own validation shards it is the last
val_loss of its log.

Prompts are encoded with the GPT-2 BPE: --bpe PATH names the offline r50k_base.tiktoken ranks file (as
data/fineweb.py takes it); without it tiktoken's cached or downloaded gpt2 encoding is used. Bad input (a
missing, corrupt or foreign checkpoint, an empty prompt or one longer than the model takes, no encoding)
is one line `sample.py: error: ...` on stderr and exit status 2.
"""
import argparse
import glob
import hashlib
import io
import math
import pickle
import sys
import time
import warnings
import zipfile
from pathlib import Path
from typing import NamedTuple

STARTED = time.perf_counter()  # before the imports: the start-up figure counts them
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "data")]

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import train_gpt as tg  # noqa: E402
from shards import CliParser, describe_os_error, exit_with_error, validate_shard  # noqa: E402

PROG = "sample.py"


def build_parser():
    parser = CliParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint written by train_gpt.py (--save_every, --save_checkpoint)")
    parser.add_argument("--prompt", help="text to continue (the model sees it as the start of a document)")
    parser.add_argument("--max_new_tokens", type=int, default=200, help="tokens to generate (default: 200)")
    parser.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0: greedy (default: 0.8)")
    parser.add_argument("--top_k", type=int, default=50, help="sample among the k likeliest tokens; 0: all (default: 50)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling (default: 0)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: CUDA when present, else CPU (default: auto)")
    parser.add_argument("--cpu_threads", type=int, default=1,
                        help="torch threads on CPU (default: 1; the model's operations are too small to share, and a "
                             "second thread on a busy machine waits for its turn at every one of them)")
    parser.add_argument("--bpe", metavar="PATH", help="r50k_base.tiktoken ranks file for offline use (sha256 checked)")
    parser.add_argument("--eval", metavar="GLOB", help="print the mean loss on these shards instead of sampling")
    parser.add_argument("--eval_tokens", type=int, default=0,
                        help="tokens to score with --eval (default 0: the checkpoint's --val_tokens)")
    return parser


def check_args(args):
    if args.eval is None and args.prompt is None:
        raise tg.ConfigError("pass --prompt TEXT to sample, or --eval GLOB to score shards")
    if args.prompt is not None and not args.prompt.strip():
        raise tg.ConfigError("--prompt is empty; give the model some text to continue")
    for name, ok, meaning in (("max_new_tokens", args.max_new_tokens > 0, "must be positive"),
                              ("temperature", math.isfinite(args.temperature) and args.temperature >= 0,
                               "must be a finite number >= 0 (0: the likeliest token each time)"),
                              ("top_k", args.top_k >= 0, "must be >= 0"),
                              ("eval_tokens", args.eval_tokens >= 0, "must be >= 0"),
                              ("cpu_threads", args.cpu_threads > 0, "must be positive")):
        if not ok:
            raise tg.ConfigError(f"--{name} {meaning}, got {getattr(args, name)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise tg.ConfigError("--device cuda, but no CUDA device is visible; use --device cpu or auto")


class LazyTensor(NamedTuple):
    """A tensor of the checkpoint's pickle, not read yet: its storage (record key, dtype) and view."""
    storage: tuple
    offset: int
    size: tuple
    stride: tuple


class LazyUnpickler(pickle.Unpickler):
    """Unpickles a torch.save archive's data.pkl with every tensor left as a LazyTensor."""

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *_: LazyTensor(storage, offset, tuple(size), tuple(stride))
        return super().find_class(module, name)

    def persistent_load(self, saved_id):
        _, storage_type, key, _, _ = saved_id
        with warnings.catch_warnings():  # (torch's own loader reads the dtype of the legacy storage class too)
            warnings.simplefilter("ignore", UserWarning)
            return key, torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype


def load_model_state(path):
    """The checkpoint, checked as train_gpt.load_checkpoint checks it (header, checksum, keys), with only the
    model's tensors read: the optimizer state, most of the file, stays on disk (its tensors LazyTensor)."""
    header_len = len(tg.CHECKPOINT_MAGIC) + 65
    try:
        with open(path, "rb") as f:
            header, digest = f.read(header_len), hashlib.sha256()
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    except OSError as e:
        raise tg.DataError(f"{path}: cannot read checkpoint ({e.strerror})")
    if not header.startswith(tg.CHECKPOINT_MAGIC) or len(header) < header_len:
        raise tg.DataError(f"{path}: not a speedrun checkpoint (bad header); pass a checkpoint train_gpt.py wrote "
                           f"(--save_every, --save_checkpoint or a stop signal: step_NNNNNN.pt, final.pt)")
    if digest.hexdigest() != header[len(tg.CHECKPOINT_MAGIC): header_len - 1].decode():
        raise tg.DataError(f"{path}: checkpoint is corrupt or truncated (checksum mismatch); use an earlier checkpoint")
    try:
        archive = zipfile.ZipFile(path)  # (a zip reader skips the header in front of torch.save's archive)
        pickled = next(name for name in archive.namelist() if name.endswith("data.pkl"))
        snap = LazyUnpickler(io.BytesIO(archive.read(pickled))).load()
        storages = {}

        def read(t):
            key, dtype = t.storage
            if key not in storages:
                storages[key] = torch.frombuffer(bytearray(archive.read(f"{pickled[:-len('data.pkl')]}data/{key}")),
                                                 dtype=dtype)
            return storages[key].as_strided(t.size, t.stride, t.offset)

        if isinstance(snap, dict) and isinstance(snap.get("model"), dict):
            snap["model"] = {k: read(v) if isinstance(v, LazyTensor) else v for k, v in snap["model"].items()}
    except Exception as e:  # a sound file whose contents this torch cannot read
        raise tg.DataError(f"{path}: cannot load the checkpoint ({type(e).__name__}); it may come from another torch "
                           f"version") from None
    missing = tg.CHECKPOINT_KEYS - set(snap) if isinstance(snap, dict) else tg.CHECKPOINT_KEYS
    if missing:
        raise tg.DataError(f"{path}: not a checkpoint of this trainer (missing {', '.join(sorted(missing))})")
    return snap


def checkpoint_hyperparameters(path, snap):
    """The checkpoint's Hyperparameters; fields an older script did not have keep their defaults. A checkpoint
    of the previous recipe (RetieLMHead: saved with recipe "retie", or by a script from before recipe 89, which
    had no MUDD) is refused."""
    saved = snap["hyperparameters"]
    if saved.get("recipe") == "retie" or "mudd_dim" not in saved:
        raise tg.DataError(f"{path}: written by the RetieLMHead recipe, which this train_gpt.py no longer has; "
                           f"sample it with the script of its run (python records/records.py extract LOG)")
    values = tg.dataclasses.asdict(tg.Hyperparameters())
    known = set(values)
    values.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved.items() if k in known})
    return tg.Hyperparameters(**values)


def load_model(path, snap, hp, device):
    """The checkpoint's model in eval mode, fp32, with the CPU path's attention (any device), the rotary state
    (YaRN) of the checkpoint's step and, under --bigram_prior, the prior of its training shards."""
    model = tg.use_cpu_fallbacks(tg.new_model(hp))
    try:
        model.load_state_dict(snap["model"])
    except (RuntimeError, KeyError, TypeError) as e:
        raise tg.DataError(f"{path}: its model state does not fit the model its settings describe "
                           f"({str(e).splitlines()[0][:120]}); was it written by another version of train_gpt.py?")
    model.rotary.follow_window(tg.window_blocks_at(snap["step"], hp)[1] * hp.window_block_tokens)
    if hp.bigram_prior:  # not model state: counted again from the run's training shards, as the trainer did
        files = (snap.get("loader") or {}).get("files") or []
        if not files:
            raise tg.DataError(f"{path}: its model adds --bigram_prior {hp.bigram_prior:g}, but the checkpoint names no "
                               f"training shards to count it from; was it written by train_gpt.py?")
        gone = [name for name in files if not Path(name).is_file()]
        if gone:
            raise tg.DataError(f"{path}: its model adds --bigram_prior {hp.bigram_prior:g}, counted from its training "
                               f"shards, and {gone[0]} is not there; run from the folder the training ran in")
        model.bigram_prior = tg.count_bigram_prior(hp, files, model.lm_head.weight.size(0))
    return model.to(device).eval()


def prompt_ids(enc, prompt, max_seq_len):
    ids = [tg.BOS_ID] + enc.encode_ordinary(prompt)
    if len(ids) >= max_seq_len:
        raise tg.ConfigError(f"the prompt is {len(ids)} tokens with the document token, but the model takes documents "
                             f"of at most {max_seq_len} (its --max_seq_len) and needs room for one new token")
    return ids


def next_token(logits, temperature, top_k, generator):
    """A token id drawn from softmax(logits / temperature) over the top_k likeliest (argmax at temperature 0)."""
    if temperature == 0:
        return int(logits.argmax())
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))


class CachedAttention:
    """Stands in for the model's attention while the model runs on new positions only: keeps each attention
    layer's keys and values (in its rows: two per token in a paired layer) and attends the new rows' queries
    over them, causal and within the window, as the model's own attention does inside one document. The
    rows of the one already-seen position that leads each step's input get zeros (they are not used)."""

    def __init__(self):
        self.keys, self.values, self.layer, self.share = [], [], 0, (1, 1)

    @staticmethod
    def mask(docs, window_tokens):
        return int(window_tokens)  # one document: the window is all the mask says

    def __call__(self, q, k, v, window, scale):
        rows = q.size(0)
        new = rows * self.share[0] // self.share[1]  # the rows of the new positions (the last ones)
        if self.layer == len(self.keys):
            self.keys.append(k[rows - new:])
            self.values.append(v[rows - new:])
        else:
            self.keys[self.layer] = torch.cat([self.keys[self.layer], k[rows - new:]])
            self.values[self.layer] = torch.cat([self.values[self.layer], v[rows - new:]])
        keys, values = self.keys[self.layer], self.values[self.layer]
        self.layer += 1
        first = keys.size(0) - new  # the first new row's index
        start = max(0, first - window)
        q_pos = torch.arange(first, keys.size(0), device=q.device)[:, None]
        k_pos = torch.arange(start, keys.size(0), device=q.device)[None, :]
        allowed = (k_pos <= q_pos) & (q_pos - k_pos <= window)
        y = F.scaled_dot_product_attention((q[rows - new:] * scale.to(q.dtype)).transpose(0, 1),
                                           keys[start:].transpose(0, 1), values[start:].transpose(0, 1),
                                           attn_mask=allowed, scale=1.0).transpose(0, 1)
        return torch.cat([y.new_zeros(rows - new, *y.shape[1:]), y])


class IncrementalModel:
    """Next-token logits of a growing token sequence, each position run through the model once: the model's
    own forward on the new positions, led by the last position already run (the smear gate and the bigram
    signs read the previous token), with the attention keys and values of earlier positions cached
    (CachedAttention), each key-shift layer's previous key kept, and the rotary tables of the positions'
    own offsets. Equal to the full forward's logits to fp32 rounding (tests/test_sample.py)."""

    def __init__(self, model, hp, windows, device):
        self.model, self.hp, self.windows, self.device = model, hp, windows, device
        self.attention, self.seen, self.start, self.previous_keys, self.shift_layer = CachedAttention(), 0, 0, [], 0
        self.tables = model.rotary.cos_sin(4 * hp.max_seq_len)  # positions of both streams (paired: 2 per token)

    def cos_sin(self, n, positions=None):
        """Rotary tables for n rows from this step's first position (paired layers ask for 2 rows a token);
        `positions` is a micro-step piece's (training only), never given here."""
        assert positions is None
        offset = self.start * n // self.share[1]
        return tuple(t[offset: offset + n] for t in self.tables)

    def shift_keys(self, k):
        """Key shift with the previous position's key of this layer from the last step."""
        layer, lead = self.shift_layer, self.share[1] - self.share[0]
        self.shift_layer += 1
        if layer == len(self.previous_keys):
            self.previous_keys.append(None)
        previous, self.previous_keys[layer] = self.previous_keys[layer], k[-1]
        if previous is None:
            return self.real_shift_keys(k)
        return torch.cat([k[:lead], self.real_shift_keys(torch.cat([previous[None], k[lead:]]))[1:]])

    @torch.no_grad()
    def logits(self, ids):
        """Softcapped fp32 logits (padded vocabulary) of the token after `ids`, whose first self.seen
        positions were run before."""
        self.start = max(self.seen - 1, 0)
        self.share = self.attention.share = (len(ids) - self.seen, len(ids) - self.start)
        window = np.array(ids[self.start:] + [tg.BOS_ID])  # the last entry: only the unused last target
        bigram_ids = tg.bigram_hash(np.array(ids), self.hp.bigram_vocab_size)[self.start:] \
            if self.hp.bigram_vocab_size else None
        batch = tg.model_inputs(window, [len(window) - 1], self.device, bigram_ids)
        model, self.real_shift_keys = self.model, tg.shift_keys
        own = model.attention, model.rotary.cos_sin
        model.attention, model.rotary.cos_sin, tg.shift_keys = self.attention, self.cos_sin, self.shift_keys
        self.attention.layer = self.shift_layer = 0
        try:
            logits = model.logits(batch.inputs, batch.cu_seqlens, self.windows, batch.bigram_ids, last_only=True)[0]
        finally:
            (model.attention, _), tg.shift_keys = own, self.real_shift_keys
            del model.rotary.cos_sin  # (the instance attribute: the class's method again)
        self.seen = len(ids)
        return logits


@torch.no_grad()
def generate(model, ids, hp, windows, args, device):
    """(new token ids, why generation stopped, seconds to the first new token): until --max_new_tokens, a
    document end or --max_seq_len."""
    generator = torch.Generator(device).manual_seed(args.seed)
    ids, new, first = list(ids), [], None
    incremental = IncrementalModel(model, hp, windows, device)
    start = time.perf_counter()
    while len(new) < args.max_new_tokens:
        if len(ids) == hp.max_seq_len:
            return new, f"stopped at the model's {hp.max_seq_len}-token document limit (--max_seq_len)", first
        logits = incremental.logits(ids)[: hp.vocab_size]
        token = next_token(logits, args.temperature, args.top_k, generator)
        first = time.perf_counter() - start if first is None else first
        if token == tg.BOS_ID:
            return new, "stopped at the end of the document (<|endoftext|>)", first
        ids.append(token)
        new.append(token)
    return new, None, first


def sample(args, enc, snap, hp, device, started):
    model = load_model(args.checkpoint, snap, hp, device)
    ids = prompt_ids(enc, args.prompt, hp.max_seq_len)
    windows = tg.window_blocks_at(snap["step"], hp)
    start = time.perf_counter()
    new, stopped, first = generate(model, ids, hp, windows, args, device)
    seconds = time.perf_counter() - start
    print(enc.decode(ids[1:] + new))
    print(f"{len(new)} tokens in {seconds:.2f} s ({len(new) / seconds:.1f} tokens/s) on {device}; first token "
          f"{start - started + (first or 0):.1f} s after start; checkpoint step {snap['step']}, windows "
          f"{windows[0]}/{windows[1]} blocks of {hp.window_block_tokens}" + (f"; {stopped}" if stopped else ""),
          file=sys.stderr)


def shard_tokens(pattern):
    """Tokens in the shards matching `pattern` (headers and sizes checked)."""
    files = sorted(glob.glob(pattern))
    if not files:
        raise tg.DataError(f"--eval {pattern!r} matches no file")
    return sum(validate_shard(path, check_tokens=False) for path in files)


@torch.no_grad()
def evaluate(args, snap, hp, device):
    """Mean loss per token over the first eval tokens of the shards, in forwards of the trainer's size."""
    model = load_model(args.checkpoint, snap, hp, device)
    available = shard_tokens(args.eval) - 1  # the last target needs one more token
    wanted = min(args.eval_tokens or hp.val_tokens, available)
    chunk = min(tg.tokens_per_rank(hp.val_batch_size, 1, tg.grad_accum_steps(hp, 1), what="--val_batch_size"), wanted)
    count = wanted // chunk * chunk
    if count <= 0:
        raise tg.DataError(f"--eval {args.eval!r} holds {available + 1} tokens; scoring needs at least 2")
    tokens = tg.read_validation_tokens(args.eval, count + 1, hp.vocab_size)
    windows = tg.final_window_blocks(hp)
    losses = [model(b.inputs, b.targets, b.cu_seqlens, windows, b.bigram_ids)
              for b in tg.validation_batches(tokens, count, chunk, 0, 1, 1, device, hp.bigram_vocab_size)]
    loss = torch.stack(losses).mean().item()
    print(f"val_loss:{loss:.4f} over {count:,} tokens of {args.eval} ({chunk:,} per forward, windows "
          f"{windows[0]}/{windows[1]} blocks of {hp.window_block_tokens}; checkpoint step {snap['step']})")
    return loss


def main(argv=None, enc=None):
    """Sample or evaluate; `enc` (a tiktoken Encoding) replaces the GPT-2 BPE (tests)."""
    started = STARTED if __name__ == "__main__" else time.perf_counter()  # (in-process calls: from here)
    args = build_parser().parse_args(argv)
    threads = torch.get_num_threads()
    try:
        check_args(args)
        device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                              else "cpu")
        if args.eval is None and enc is None:
            import fineweb  # data/fineweb.py: the GPT-2 BPE, offline from --bpe
            enc = fineweb.load_encoding(args.bpe)
        torch.set_num_threads(args.cpu_threads)
        snap = load_model_state(args.checkpoint)
        hp = checkpoint_hyperparameters(args.checkpoint, snap)
        if args.eval is not None:
            return evaluate(args, snap, hp, device)
        return sample(args, enc, snap, hp, device, started)
    except (tg.ConfigError, tg.DataError) as e:
        exit_with_error(PROG, e)
    except OSError as e:
        exit_with_error(PROG, describe_os_error(e))
    finally:
        torch.set_num_threads(threads)  # (main runs in the tests' process too)


if __name__ == "__main__":
    main()
