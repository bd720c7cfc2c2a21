"""Look at what a checkpoint of train_gpt.py learned: continue a prompt, or score the checkpoint on any shards.

    python tools/sample.py CHECKPOINT --prompt "It was a dark night" --max_new_tokens 200 --temperature 0.8 \\
        --top_k 50 --seed 0 --bpe path/to/r50k_base.tiktoken
    python tools/sample.py CHECKPOINT --eval 'data/novels/novels_val_*.bin'

Any checkpoint of this trainer loads, whatever number of processes wrote it (a checkpoint holds the full
model; only its model state is read, see read_model_state). The model runs with the attention windows and
YaRN state of the checkpoint's step. Generation is incremental (Decoder: the model's own layer functions,
each position run once, earlier keys and values cached), on --cpu_threads threads (default 1): on 2 CPU
cores the cpu preset's model writes about 140 tokens/s, its first token about 3 s after the start.
Sampling is deterministic for a --seed on a given device; the text goes to stdout, tokens/s to stderr.
Generation stops at the end of a document (<|endoftext|>) or at the model's --max_seq_len.

--eval GLOB prints the mean loss per token over the first --eval_tokens tokens of the shards (default: the
checkpoint's --val_tokens; fewer if the shards hold fewer, and rounded down to whole forwards, as stderr then
says; fewer than one forward: one shorter forward) with the final validation's windows, in forwards
of the trainer's size on one process: on the checkpoint's own validation shards it is the last
val_loss of its log (shards of their names that changed since, by the size and sampled checksum it
records, are said on stderr).

A model trained with --ngram_prior adds a prior counted from its training shards, which are read again (the
prior is not in checkpoints): from where the training read them, or --train_files GLOB where they are now
(matched by file name). The checkpoint records each shard's size and a sampled checksum; a shard that differs
is one line naming it, unless --force (the prior, and with it every figure, would not be the model's).

Prompts are encoded with the GPT-2 BPE: --bpe PATH names the offline r50k_base.tiktoken ranks file (as
data/fineweb.py takes it); without it tiktoken's cached or downloaded gpt2 encoding is used. --prompt ''
starts from the document token alone. Only ids the encoding has are drawn (a model whose --vocab_size pads
the GPT-2 vocabulary never writes its padding ids). Bad input (a missing, corrupt or foreign checkpoint, a
prompt of only spaces, not UTF-8 or longer than the model takes, no encoding) is one line
`sample.py: error: ...` on stderr and exit status 2.
"""
import concurrent.futures
import functools
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
    parser.add_argument("--prompt", help="text to continue (the model sees it as the start of a document); '': "
                                          "start from the document token alone")
    parser.add_argument("--max_new_tokens", type=int, default=200, help="tokens to generate (default: 200)")
    parser.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0: greedy (default: 0.8)")
    parser.add_argument("--top_k", type=int, default=50, help="sample among the k likeliest tokens; 0: all (default: 50)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling, in [0, 2^63) (default: 0)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: CUDA when present, else CPU; a model with --ngram_prior runs on the CPU "
                             "(default: auto)")
    parser.add_argument("--cpu_threads", type=int, default=1,
                        help="torch threads on CPU (default: 1; the model's operations are too small to share, and a "
                             "second thread on a busy machine waits for its turn at every one of them)")
    parser.add_argument("--bpe", metavar="PATH", help="r50k_base.tiktoken ranks file for offline use (sha256 checked)")
    parser.add_argument("--eval", metavar="GLOB", help="print the mean loss on these shards instead of sampling")
    parser.add_argument("--eval_tokens", type=int, default=0,
                        help="tokens to score with --eval, rounded down to whole forwards of the "
                             "trainer's size; fewer than one forward: one shorter forward "
                             "(default 0: the checkpoint's --val_tokens)")
    parser.add_argument("--train_files", metavar="GLOB",
                        help="where the training shards of a --ngram_prior model are now, if they moved (matched by "
                             "file name; default: where the training read them)")
    parser.add_argument("--force", action="store_true",
                        help="count the prior from training shards whose size or checksum differ from those the "
                             "checkpoint recorded")
    return parser


def check_args(args):
    if args.eval is None and args.prompt is None:
        raise tg.ConfigError("pass --prompt TEXT to sample, or --eval GLOB to score shards")
    if args.prompt and not args.prompt.strip():
        raise tg.ConfigError("--prompt is only spaces; give the model some text to continue, or pass --prompt '' to "
                             "start from the document token alone")
    if args.prompt:
        check_utf8(args.prompt)
    for name, ok, meaning in (("max_new_tokens", args.max_new_tokens > 0, "must be positive"),
                              ("temperature", math.isfinite(args.temperature) and args.temperature >= 0,
                               "must be a finite number >= 0 (0: the likeliest token each time)"),
                              ("top_k", args.top_k >= 0, "must be >= 0"),
                              ("eval_tokens", args.eval_tokens >= 0, "must be >= 0"),
                              ("cpu_threads", args.cpu_threads > 0, "must be positive"),
                              ("seed", 0 <= args.seed < 2 ** 63, "must be in [0, 2^63)")):
        if not ok:
            raise tg.ConfigError(f"--{name} {meaning}, got {getattr(args, name)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise tg.ConfigError("--device cuda, but no CUDA device is visible; use --device cpu or auto")


def check_utf8(prompt):
    """Refuse a prompt that is not UTF-8 text: Python keeps the bytes of an invalid command-line argument as lone
    surrogates, which the encoder would turn into U+FFFD."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(prompt[e.start])
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X} (a lone surrogate)"
        raise tg.ConfigError(f"--prompt is not valid UTF-8: {what} at character {e.start}; pass the prompt as UTF-8 "
                             f"text") from None


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


def file_checksum(path):
    """(the checkpoint's header, sha256 of the rest of the file)."""
    try:
        with open(path, "rb") as f:
            header, digest = f.read(len(tg.CHECKPOINT_MAGIC) + 65), hashlib.sha256()
            while chunk := f.read(1 << 24):
                digest.update(chunk)  # (hashlib lets other threads run meanwhile)
    except OSError as e:
        raise tg.DataError(f"{path}: cannot read checkpoint ({e.strerror})")
    return header, digest.hexdigest()


def check_checksum(path, header, checksum):
    """The header and checksum checks of train_gpt.load_checkpoint."""
    if not header.startswith(tg.CHECKPOINT_MAGIC) or len(header) < len(tg.CHECKPOINT_MAGIC) + 65:
        raise tg.DataError(f"{path}: not a speedrun checkpoint (bad header); pass a checkpoint train_gpt.py wrote "
                           f"(--save_every, --save_checkpoint or a stop signal: step_NNNNNN.pt, final.pt)")
    if checksum != header[len(tg.CHECKPOINT_MAGIC): -1].decode():
        raise tg.DataError(f"{path}: checkpoint is corrupt or truncated (checksum mismatch); use an earlier checkpoint")


def read_model_state(path):
    """The checkpoint's contents with only the model's tensors read: the optimizer state, most of the file,
    stays on disk (its tensors LazyTensor). Not checked against the checksum (check_checksum)."""
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
    had no MUDD) is refused, and so is one of a --bigram_prior model (its prior is gone)."""
    saved = snap["hyperparameters"]
    if saved.get("recipe") == "retie" or "mudd_dim" not in saved:
        raise tg.DataError(f"{path}: written by the RetieLMHead recipe, which this train_gpt.py no longer has; "
                           f"sample it with the script of its run (python records/records.py extract LOG)")
    if saved.get("bigram_prior"):
        raise tg.DataError(f"{path}: its model adds --bigram_prior {saved['bigram_prior']:g}, the absolute-discount "
                           f"bigram prior this train_gpt.py no longer has (--ngram_prior replaced it); sample it with "
                           f"the script of its run (python records/records.py extract LOG)")
    values = tg.dataclasses.asdict(tg.Hyperparameters())
    known = set(values)
    values.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved.items() if k in known})
    return tg.Hyperparameters(**values)


def warn(message):
    print(f"{PROG}: warning: {message}", file=sys.stderr, flush=True)


def training_shards(path, loader_state, hp, train_files):
    """The files of the checkpoint's training shards: where the training read them, or those of the same names
    that the glob train_files matches (--train_files: the shards moved)."""
    recorded = loader_state.get("files") or []
    prior = f"its model adds --ngram_prior {hp.ngram_prior:g}, counted from its training shards"
    if not recorded:
        raise tg.DataError(f"{path}: {prior}, but the checkpoint names none; was it written by train_gpt.py?")
    if train_files is not None:
        found = {Path(f).name: f for f in glob.glob(train_files)}
        missing = [Path(f).name for f in recorded if Path(f).name not in found]
        if missing:
            raise tg.DataError(f"{path}: {prior}, and --train_files {train_files!r} matches no {missing[0]} (one of the "
                               f"{len(recorded)}); pass a glob that matches every one of them by name")
        return [found[Path(f).name] for f in recorded]
    gone = next((f for f in recorded if not Path(f).is_file()), None)
    if gone is not None:
        moved = "pass --train_files GLOB of where they are now"
        raise tg.DataError(f"{path}: {prior}, and {gone} is not there; {moved}" if Path(gone).is_absolute() else
                           f"{path}: {prior}, and {gone} is not there (a path relative to the folder the training ran "
                           f"in); run from that folder, or {moved}")
    return recorded


def count_prior(path, snap, hp, train_files=None, force=False):
    """--ngram_prior's NgramPrior: not model state, counted again from the run's training shards, as the
    trainer did; shards that are not those the run read (shard_fingerprint) are refused unless force."""
    state = snap.get("loader") or {}
    files = training_shards(path, state, hp, train_files)
    difference = tg.shard_difference(state, files, [tg.shard_fingerprint(f) for f in files])
    if difference and not force:
        raise tg.DataError(f"{difference}, so the --ngram_prior counted from it is not {path}'s; put that shard "
                           f"back, or pass --force to count it anyway")
    if difference:
        warn(f"{difference}; --force counts the prior from it")
    if not state.get("fingerprints"):
        warn(f"{path} records no checksums of its training shards (its script predates them): the prior is counted "
             f"from the shards as they are now, unchecked")
    return tg.load_companion("ngram_prior.py").count_ngram_prior(hp, files)


def sampling_device(choice, hp):
    """--device's choice for this checkpoint: auto is CUDA when present, except for a model that adds
    --ngram_prior (its prior is added on the CPU only, as in training)."""
    if hp.ngram_prior and choice == "cuda":
        raise tg.ConfigError(f"--device cuda: the checkpoint's model adds --ngram_prior {hp.ngram_prior:g}, which runs "
                             f"on the CPU only; use --device cpu or auto")
    cuda = choice == "cuda" or (choice == "auto" and not hp.ngram_prior and torch.cuda.is_available())
    return torch.device("cuda" if cuda else "cpu")


def open_checkpoint(path, device_choice, train_files=None, force=False):
    """(contents, Hyperparameters, model, its --ngram_prior's NgramPrior or None): the checkpoint checked as
    train_gpt.load_checkpoint checks it (header, checksum, keys) and its model in eval mode, fp32, on the device
    of the --device choice (sampling_device),
    with the CPU path's attention (any device), the rotary state (YaRN) of its step and, under --ngram_prior,
    the prior of its training shards (count_prior, with train_files and force), which its CPU loss adds. The
    checksum of the whole file runs in a thread meanwhile; nothing read is used before it holds."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        checksum = pool.submit(file_checksum, path)
        try:
            snap = read_model_state(path)
            hp = checkpoint_hyperparameters(path, snap)
            device = sampling_device(device_choice, hp)
            prior = count_prior(path, snap, hp, train_files, force) if hp.ngram_prior else None
            model = tg.GPT(hp, tg.backend_for(hp, torch.device("cpu"), prior=prior))  # the loss adds the prior
        except Exception:
            check_checksum(path, *checksum.result())  # a damaged file is named as one, whatever broke its reading
            raise
        check_checksum(path, *checksum.result())
        try:
            model.load_state_dict(snap["model"])
        except (RuntimeError, KeyError, TypeError) as e:
            raise tg.DataError(f"{path}: its model state does not fit the model its settings describe "
                               f"({str(e).splitlines()[0][:120]}); was it written by another version of train_gpt.py?")
        model.follow_window(tg.Schedule(hp).at(snap["step"]).windows)
    return snap, hp, model.to(device).eval(), prior


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
    if top_k and top_k < logits.numel():  # a draw among k, not the whole vocabulary (a draw costs per candidate)
        values, ids = torch.topk(logits, top_k)
        return int(ids[torch.multinomial(probabilities(values, temperature), 1, generator=generator)])
    return int(torch.multinomial(probabilities(logits, temperature), 1, generator=generator))


def probabilities(logits, temperature):
    """softmax(logits / temperature) in fp32, formed in fp64 from the logits less their largest: every temperature
    above 0 gives its distribution, the tiniest the greedy limit (logits / 1e-40 overflowed fp32, and the softmax
    of infinities is NaN). Rounded to fp32 for the draw, which then takes the same random numbers as before."""
    return torch.softmax((logits.double() - logits.max()) / temperature, dim=-1).float()


def rows_after_the_first(stream):
    """The Stream without its first position (the lead position: its values were kept from the last call)."""
    rest = lambda t: None if t is None else t[1:]  # noqa: E731
    return stream._replace(x0=rest(stream.x0), bigram=rest(stream.bigram), values=[v[1:] for v in stream.values],
                           skip_scale=rest(stream.skip_scale) if stream.skip_scale.dim() else stream.skip_scale)


class Decoder:
    """GPT.trunk and GPT.logits for a sequence that grows by appended positions, each run once: append() runs
    the new positions through the model's own layers (GPT.through_layers, as GPT.trunk does, with the
    attention over cached keys), and keeps what later positions read of earlier ones: every attention layer's
    keys and values, each key-shift layer's last key, the last token (the smear gate, bigram hash and signs
    read it). The head multiplies by a (dim, vocabulary) copy of its weight, which CPU BLAS multiplies by one
    row several times faster than the (vocabulary, dim) original. Equal to the full forward's logits to fp32
    rounding (tests/test_sample.py)."""

    @torch.no_grad()
    def __init__(self, model, hp, windows, prior=None):
        self.model, self.prior, self.ids, self.device = model, prior, [], model.lm_head.weight.device
        self.bigram_rows = hp.bigram_vocab_size
        self.window = {long: windows[long] * hp.window_block_tokens for long in (0, 1)}  # (in rows, as the mask's)
        self.tables = model.rotary.cos_sin(hp.max_seq_len)  # the positions' rotary tables, made once
        self.paired_tables = model.rotary.paired_cos_sin(hp.max_seq_len, model.num_heads)
        self.attn_scale = model.rotary.attn_scale.float()
        self.head = model.lm_head.weight.t().contiguous()
        # the lambdas of embed_input, rounded to bf16 as the forward uses them, kept in fp32: no cast per use
        self.lambdas = tg.Lambdas(*(t if t is None else t.float() for t in model.rounded_lambdas()))
        self.keys, self.values, self.last_keys, self.weights = {}, {}, {}, {}
        scalars, fp32 = model.scalar_views(), self.head
        for i, plan in enumerate(model.plan):
            if plan.attention:  # [Q; K; V] and O times their lambdas, made once; the cached keys and values
                layer = model.layers[i]
                self.weights[i] = layer.qkv_weight(scalars.attn[i, 0], fp32), layer.o_weight(scalars.attn[i, 1], fp32)
                share = 2 if plan.paired else 1  # a paired layer's stream: two rows per token, half the heads
                shape = (share * hp.max_seq_len, model.num_heads // share, model.head_dim)
                self.keys[i], self.values[i] = (torch.zeros(shape, device=self.device) for _ in range(2))

    @torch.no_grad()
    def append(self, new_ids):
        """Softcapped fp32 logits (padded vocabulary, with the n-gram prior) of the token after new_ids."""
        model, start, lead = self.model, len(self.ids), int(bool(self.ids))
        self.ids = self.ids + list(new_ids)
        inputs = torch.tensor(self.ids[start - lead:], device=self.device)
        first = max(0, start - lead - 2)  # (bigram_hash takes a span's first two positions for a sequence start)
        bigram_ids = torch.from_numpy(tg.bigram_hash(np.array(self.ids[first:]), self.bigram_rows)[start - lead - first:]
                                      ).to(self.device) if self.bigram_rows else None
        stream = model.embed_input(inputs, bigram_ids)._replace(lambdas=self.lambdas)
        stream = rows_after_the_first(stream) if lead else stream
        x = model.through_layers(stream, functools.partial(self.attend, start=start))[-1:]
        logits = tg.softcapped(x @ self.head, model.softcap)
        if self.prior is None:
            return logits[0]
        last = torch.tensor(self.ids[-len(self.prior.contexts):])  # an order-N prior's context: N - 1 tokens
        return self.prior.add_to(logits, self.prior.context_rows(last)[:, -1:])[0]

    def attend(self, i, plan, x, added_v, xsa_alpha, start):
        """Layer.attend for positions start ... of the normed input x, over this layer's cached keys."""
        layer, (w_qkv, w_o) = self.model.layers[i], self.weights[i]
        tables = self.paired_tables if plan.paired else self.tables
        q, k, v = layer.qkv(x, w_qkv, tuple(t[start: start + x.size(0)] for t in tables))
        if plan.key_shift:  # the first new key takes the last cached one's (position 0: its own)
            previous, self.last_keys[i] = self.last_keys.get(i, k[:1]), k[-1:]
            k = tg.shift_keys(torch.cat([previous, k]))[1:]
        if added_v is not None:
            v = v + added_v.view_as(v)
        y = self.cached_attention(i, plan, q, k, v, start)
        return layer.output(x, y, v, xsa_alpha, w_o)

    def cached_attention(self, i, plan, q, k, v, start):
        """The new rows' attention over the cached keys and values (causal, within the layer's window)."""
        n, H, hd = q.shape
        share = 2 if plan.paired else 1  # row 2t + r, slot s holds head r H/2 + s of token t (as Layer.attend)
        q, k, v = (t.reshape(share * n, H // share, hd) for t in (q, k, v))
        first, end = share * start, share * (start + n)
        self.keys[i][first:end], self.values[i][first:end] = k, v
        window = self.window[plan.long_window]
        begin = max(0, first - window)
        mask = None
        if end - first > 1:  # one row sees every cached key from `begin` on; several need causality
            q_pos = torch.arange(first, end, device=q.device)[:, None]
            k_pos = torch.arange(begin, end, device=q.device)[None, :]
            mask = (k_pos <= q_pos) & (q_pos - k_pos <= window)
        y = F.scaled_dot_product_attention((q * self.attn_scale).transpose(0, 1),
                                           self.keys[i][begin:end].transpose(0, 1),
                                           self.values[i][begin:end].transpose(0, 1), attn_mask=mask, scale=1.0)
        return y.transpose(0, 1).reshape(n, H, hd)


def generate(model, ids, hp, windows, args, device, drawable, prior=None):
    """(new token ids, why generation stopped, seconds to the first new token): until --max_new_tokens, a
    document end or --max_seq_len; only ids below `drawable` (those the encoding has) are drawn."""
    generator = torch.Generator(device).manual_seed(args.seed)
    decoder, new, first = Decoder(model, hp, windows, prior), [], None
    start = time.perf_counter()
    logits = decoder.append(ids)
    while True:
        token = next_token(logits[:drawable], args.temperature, args.top_k, generator)
        first = time.perf_counter() - start if first is None else first
        if token == tg.BOS_ID:
            return new, "stopped at the end of the document (<|endoftext|>)", first
        new.append(token)
        if len(new) == args.max_new_tokens:
            return new, None, first
        if len(ids) + len(new) == hp.max_seq_len:
            return new, f"stopped at the model's {hp.max_seq_len}-token document limit (--max_seq_len)", first
        logits = decoder.append([token])


def sample(args, enc, snap, hp, model, prior, device, started):
    ids = prompt_ids(enc, args.prompt, hp.max_seq_len)
    windows = tg.Schedule(hp).at(snap["step"]).windows
    drawable = min(hp.vocab_size, enc.n_vocab)
    if hp.vocab_size > drawable:
        print(f"{PROG}: note: the model's --vocab_size {hp.vocab_size} pads the encoding's {enc.n_vocab:,} ids; only "
              f"those are drawn", file=sys.stderr)
    start = time.perf_counter()
    new, stopped, first = generate(model, ids, hp, windows, args, device, drawable, prior)
    seconds = time.perf_counter() - start
    print(enc.decode(ids[1:] + new), flush=True)  # (before the figures on stderr)
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


def warn_of_changed_validation(snap, pattern):
    """--eval scores any shards; those named as the run's own validation shards but changed since
    are said."""
    if snap.get("validation"):
        files = sorted(glob.glob(pattern))
        fingerprints = [tg.shard_fingerprint(f) for f in files]
        difference = tg.shard_difference(snap["validation"], files, fingerprints, "validation")
        if difference:
            warn(f"{difference}: this loss does not compare with its log's")


@torch.no_grad()
def evaluate(args, snap, hp, model, prior, device):
    """Mean loss per token over the first eval tokens of the shards, in forwards of the trainer's size."""
    available = shard_tokens(args.eval) - 1  # the last target needs one more token
    asked = args.eval_tokens or hp.val_tokens
    wanted = min(asked, available)
    if wanted <= 0:
        raise tg.DataError(f"--eval {args.eval!r} holds {available + 1} token(s); scoring needs at least 2")
    forward = tg.tokens_per_rank(hp.val_batch_size, 1, tg.grad_accum_steps(hp, 1),
                                 what="--val_batch_size")
    chunk = min(forward, wanted)
    count = wanted // chunk * chunk
    if chunk < forward:
        print(f"{PROG}: note: scoring {count:,} token(s) in one forward, shorter than the "
              f"trainer's {forward:,} (the log's losses are of whole forwards)", file=sys.stderr)
    if count < asked:
        why = [f"the shards hold {available + 1:,} tokens"] if wanted < asked else []
        why += [f"whole forwards of {chunk:,} tokens"] if count < wanted else []
        print(f"{PROG}: note: scoring {count:,} of the {asked:,} tokens asked for (" +
              ("--eval_tokens" if args.eval_tokens else "the checkpoint's --val_tokens") + f"): {' and '.join(why)}",
              file=sys.stderr)
    warn_of_changed_validation(snap, args.eval)
    tokens = tg.read_validation_tokens(args.eval, count + 1, hp.vocab_size)
    windows = tg.Schedule(hp).final_windows
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
        if args.eval is None and enc is None:
            import fineweb  # data/fineweb.py: the GPT-2 BPE, offline from --bpe
            enc = fineweb.load_encoding(args.bpe)
        torch.set_num_threads(args.cpu_threads)
        snap, hp, model, prior = open_checkpoint(args.checkpoint, args.device, args.train_files, args.force)
        device = model.lm_head.weight.device
        if args.eval is not None:
            return evaluate(args, snap, hp, model, prior, device)
        return sample(args, enc, snap, hp, model, prior, device, started)
    except (tg.ConfigError, tg.DataError) as e:
        exit_with_error(PROG, e)
    except OSError as e:
        exit_with_error(PROG, describe_os_error(e))
    finally:
        torch.set_num_threads(threads)  # (main runs in the tests' process too)


if __name__ == "__main__":
    main()
