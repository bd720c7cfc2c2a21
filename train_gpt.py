"""speedrun: train a GPT-2-small-class model on FineWeb to val loss <= 3.28, fast.

One file on purpose: records copy it verbatim. The sections follow one batch: configuration ->
data (shards, the BOS-aligned loader) -> model -> head (FP8 matmul, softcapped loss) -> CPU fallbacks
(attention and loss chosen once in build_model, Polar Express's fp32 path in make_optimizers) ->
optimizers (Polar Express, NorMuon, DistAdam; make_optimizers) -> track-3 optimizers (Shampoo, SOAP,
AdamW, registered in TRACK3_OPTIMIZERS) -> schedules -> training loop (Trainer) -> memory plan
(--plan_memory, traced with fake tensors) -> main().
Run with `./run.sh` (torchrun over all GPUs) or `python train_gpt.py --preset cpu`.
Importing this module registers two torch ops (speedrun::mm_fp8 and speedrun::mm_fp8_backward) and
does nothing else; main() runs only under __main__.
"""

import argparse
import concurrent.futures
import contextlib
import dataclasses
import datetime
import functools
import glob
import hashlib
import heapq
import io
import json
import math
import os
import platform
import re
import resource
import subprocess
import sys
import time
import uuid
import warnings
import weakref
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

# ----------------------------------------------------------------------------------------------
# Configuration: one dataclass; CLI flags and presets are generated from it


def hp_field(default, help):
    return field(default=default, metadata={"help": help})


@dataclass
class Hyperparameters:
    # data
    train_files: str = hp_field("data/fineweb10B/fineweb_train_*.bin", "glob of training shards (prefixed by $DATA_PATH)")
    val_files: str = hp_field("data/fineweb10B/fineweb_val_*.bin", "glob of validation shards (prefixed by $DATA_PATH)")
    synthetic_fallback: bool = hp_field(False, "if no shards match, generate and use the synthetic corpus in data/synthetic/")
    cycle_data: bool = hp_field(False, "restart from the first training shard when all are used instead of stopping")
    val_tokens: int = hp_field(10_485_760, "validation tokens (a prefix of the validation shards)")
    val_batch_size: int = hp_field(2_097_152, "validation tokens per validation step, all ranks together")
    # model
    vocab_size: int = hp_field(50257, "tokenizer vocabulary; the embedding is padded to a multiple of 128")
    num_layers: int = hp_field(11, "transformer blocks")
    num_heads: int = hp_field(6, "attention heads")
    head_dim: int = hp_field(128, "dimension per head")
    model_dim: int = hp_field(768, "residual stream width")
    # batches and schedules
    num_scheduled_iterations: int = hp_field(1995, "steps of the scheduled run (thirds set batch size, lr, window)")
    num_extension_iterations: int = hp_field(40, "extra steps at the final batch size, window and lr 0.1x")
    batch_sizes: tuple = hp_field((131072, 262144, 393216), "tokens per optimizer step in each third of the run")
    max_seq_len: int = hp_field(2048, "longest document piece in a training batch")
    grad_accum_base: int = hp_field(8, "world size with one micro-step per step; fewer ranks accumulate base/world")
    micro_batch_tokens: int = hp_field(0, "most tokens per forward/backward per rank: longer micro-steps run as "
                                          "ceil(tokens / N) near-equal pieces whose gradients add up (0: no cap)")
    lr_multipliers: tuple = hp_field((1.0, 1.51, 1.93), "lr multiplier in each third (batch-size ratio ^ 0.6)")
    cooldown_frac: float = hp_field(0.55, "fraction of scheduled steps over which lr cools down linearly")
    final_lr_multiplier: float = hp_field(0.1, "lr multiplier at the end of cooldown and during extension")
    window_block_tokens: int = hp_field(128, "tokens per attention-window block")
    window_blocks: tuple = hp_field((3, 7, 11), "long attention window (blocks) in each third; short = long // 2")
    extension_window_blocks: int = hp_field(13, "long window during the extension steps")
    final_val_window_blocks: int = hp_field(20, "long window for the final validation (no YaRN)")
    # optimizers
    muon_lr: float = hp_field(0.023, "NorMuon learning rate")
    muon_wd: float = hp_field(1.2, "NorMuon cautious weight decay (applied as wd*lr, so it follows lr^2)")
    muon_momentum: tuple = hp_field((0.85, 0.95), "NorMuon momentum: start/end value of the warm-up")
    muon_momentum_warmup_steps: int = hp_field(300, "steps of the momentum warm-up")
    muon_momentum_cooldown_steps: int = hp_field(50, "final steps over which momentum returns to its start value")
    muon_beta2: float = hp_field(0.95, "NorMuon second-moment decay")
    adam_lr: float = hp_field(0.008, "DistAdam learning rate")
    adam_betas: tuple = hp_field((0.65, 0.95), "DistAdam betas")
    adam_eps: float = hp_field(1e-8, "DistAdam epsilon")
    adam_wd: float = hp_field(0.005, "DistAdam cautious weight decay")
    # the optimizer of the hidden matrices and gates (track 3: the optimizer race); DistAdam keeps the rest
    matrix_optimizer: str = hp_field("normuon", "optimizer of the hidden matrices and gates: normuon, shampoo, soap, adamw")
    shampoo_lr: float = hp_field(0.0015, "Shampoo learning rate")
    shampoo_betas: tuple = hp_field((0.9, 0.95), "Shampoo momentum and factor decay")
    shampoo_wd: float = hp_field(0.2, "Shampoo decoupled weight decay")
    shampoo_eps: float = hp_field(1e-12, "Shampoo epsilon added to the factors' eigenvalues")
    shampoo_precondition_frequency: int = hp_field(5, "Shampoo: steps between inverse-root refreshes")
    shampoo_graft_beta2: float = hp_field(0.95, "Shampoo: second-moment decay of the Adam grafting")
    shampoo_graft_eps: float = hp_field(1e-10, "Shampoo: epsilon of the Adam grafting")
    # the factored optimizers' blocks (Shampoo and SOAP; AdamW takes whole matrices)
    factor_max_dim: int = hp_field(8192, "Shampoo and SOAP: largest factor dimension (blocks are cut to it)")
    factor_dtype: str = hp_field("fp32", "Shampoo and SOAP: dtype of the stored factors and roots/bases: fp32, bf16")
    factor_block_cost: str = hp_field("bytes", "Shampoo and SOAP: block cost for the rank assignment: bytes, poly")
    soap_lr: float = hp_field(0.003, "SOAP learning rate")
    soap_betas: tuple = hp_field((0.95, 0.95), "SOAP momentum and second-moment/factor decay")
    soap_wd: float = hp_field(0.01, "SOAP decoupled weight decay")
    soap_eps: float = hp_field(1e-8, "SOAP epsilon")
    soap_precondition_frequency: int = hp_field(10, "SOAP: steps between eigenbasis refreshes")
    adamw_lr: float = hp_field(0.0015, "AdamW learning rate (as the matrix optimizer)")
    adamw_betas: tuple = hp_field((0.9, 0.95), "AdamW betas")
    adamw_wd: float = hp_field(0.1, "AdamW decoupled weight decay")
    adamw_eps: float = hp_field(1e-8, "AdamW epsilon")
    # run
    seed: int = hp_field(0, "random seed for initialization")
    val_loss_every: int = hp_field(250, "validate every N steps and at the end (0: only at the end)")
    warmup_steps: int = hp_field(3, "untimed compile warm-up steps per stage, undone afterwards (0: none)")
    device: str = hp_field("auto", "auto (CUDA when present, else CPU), cuda or cpu")
    compile: bool = hp_field(True, "torch.compile the model (CUDA only; CPU always runs eager)")
    fp8: str = hp_field("auto", "FP8 head matmul in training: auto (CUDA, capability >= 8.9), on, off")
    run_id: str = hp_field("", "name of the log file logs/<run_id>.txt (default: a new uuid)")
    log_dir: str = hp_field("logs", "folder for logs, profiler traces and checkpoints")
    save_every: int = hp_field(0, "write a resumable checkpoint every N steps (even N; 0: never)")
    save_checkpoint: bool = hp_field(False, "write a checkpoint at the end of the run")
    resume: str = hp_field("", "checkpoint to resume from")
    force: bool = hp_field(False, "resume even if the checkpoint was written by a different script or with other training settings")
    profile: str = hp_field("", "START:END steps to record with the PyTorch profiler (Chrome trace next to the log)")
    cpu_threads: int = hp_field(0, "torch threads per process on CPU (0: cores / local processes)")
    plan_memory: bool = hp_field(False, "print the predicted memory per GPU of this run (traced with fake tensors, "
                                        "world size from $WORLD_SIZE) and exit without training")
    gpu_memory_gb: float = hp_field(80.0, "memory of one GPU in GiB: --plan_memory names the largest "
                                          "--micro_batch_tokens whose predicted peak fits it")


PRESETS = {
    "record": {},
    "cpu": dict(  # 2 CPU cores, ~190 s of training (the track's budget is 500 s); tuned on the novels corpus (records/track_cpu)
        device="cpu",  # also where CUDA exists (add --device cuda to run it on a GPU)
        synthetic_fallback=True,
        val_tokens=65_536,
        val_batch_size=8_192,
        num_layers=9,
        num_heads=2,
        head_dim=64,
        model_dim=128,
        num_scheduled_iterations=108,
        num_extension_iterations=4,
        batch_sizes=(2048, 3072, 4096),
        max_seq_len=1024,
        grad_accum_base=1,
        lr_multipliers=(1.0, 1.28, 1.52),
        window_blocks=(2, 4, 6),
        extension_window_blocks=7,
        final_val_window_blocks=8,
        muon_momentum_warmup_steps=20,
        muon_momentum_cooldown_steps=5,
        adam_lr=0.02,
        val_loss_every=36,
        warmup_steps=0,
    ),
}


class ConfigError(ValueError):
    """A bad flag or combination of flags; main() prints it as one line."""


def parse_bool(text):
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def build_arg_parser():
    parser = argparse.ArgumentParser(
        prog="train_gpt.py", allow_abbrev=False,  # --num_layer must not silently mean --num_layers
        description="Train the speedrun GPT. Every field of Hyperparameters is a flag; --preset is applied first.",
    )
    # one-line errors instead of the ~25-line usage that buries the message
    parser.error = lambda message: parser.exit(2, f"{parser.prog}: error: {message} (see --help)\n")
    # argparse reads only plain decimals like -1.5 as negative numbers; -1e-3 and -1:2 would count as
    # flags ("expected one argument") instead of reaching the range checks with their messages
    parser._negative_number_matcher = re.compile(r"^-\.?\d")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="record", help="named configuration (default: record)")
    for f in fields(Hyperparameters):
        default = f.default
        kwargs = dict(default=None, help=f"{f.metadata['help']} (default: {default})")
        if isinstance(default, bool):
            kwargs.update(type=parse_bool, metavar="BOOL", nargs="?", const=True)  # a bare --force means true
        elif isinstance(default, tuple):
            kwargs.update(type=type(default[0]), nargs=len(default), metavar=type(default[0]).__name__.upper())
        else:
            kwargs.update(type=type(default), metavar=type(default).__name__.upper())
        parser.add_argument(f"--{f.name}", **kwargs)
    return parser


def parse_args(argv=None):
    """Preset first, then explicit flags. Returns a validated-shape Hyperparameters."""
    args = build_arg_parser().parse_args(argv)
    values = dataclasses.asdict(Hyperparameters())
    values.update(PRESETS[args.preset])
    for name, value in vars(args).items():
        if name != "preset" and value is not None:
            values[name] = tuple(value) if isinstance(value, list) else value
    hp = Hyperparameters(**values)
    check_hyperparameters(hp)
    return hp


# (flags, test, what the test means): applied to every value of a tuple flag
VALUE_RULES = [
    (("val_tokens", "val_batch_size", "vocab_size", "num_layers", "num_heads", "head_dim", "model_dim",
      "num_scheduled_iterations", "batch_sizes", "max_seq_len", "grad_accum_base", "window_block_tokens",
      "final_val_window_blocks", "muon_lr", "adam_lr", "adam_eps", "shampoo_lr", "shampoo_graft_eps",
      "shampoo_precondition_frequency", "factor_max_dim", "soap_lr", "soap_eps", "soap_precondition_frequency",
      "adamw_lr", "adamw_eps", "gpu_memory_gb"), lambda v: v > 0, "must be positive"),
    (("num_extension_iterations", "val_loss_every", "warmup_steps", "save_every", "cpu_threads", "micro_batch_tokens",
      "muon_momentum_warmup_steps", "muon_momentum_cooldown_steps", "muon_wd", "adam_wd", "lr_multipliers",
      "final_lr_multiplier", "shampoo_wd", "shampoo_eps", "soap_wd", "adamw_wd"), lambda v: v >= 0, "must be >= 0"),
    (("window_blocks", "extension_window_blocks"), lambda v: v >= 2, "must be at least 2 (short window = long // 2 blocks)"),
    (("muon_momentum", "muon_beta2", "adam_betas", "shampoo_betas", "shampoo_graft_beta2", "soap_betas", "adamw_betas"),
     lambda v: 0 <= v < 1, "must be in [0, 1)"),
    (("cooldown_frac",), lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    (("seed",), lambda v: 0 <= v < 2 ** 63, "must be in [0, 2^63)"),
]


def check_hyperparameters(hp):
    """Reject impossible values and combinations before any work, naming the flag."""
    for f in fields(hp):
        value = getattr(hp, f.name)
        if any(isinstance(v, float) and not math.isfinite(v) for v in (value if isinstance(value, tuple) else [value])):
            raise ConfigError(f"--{f.name} must be finite, got {value}")
    for names, ok, meaning in VALUE_RULES:
        for name in names:
            value = getattr(hp, name)
            if not all(ok(v) for v in (value if isinstance(value, tuple) else [value])):
                raise ConfigError(f"--{name} {meaning}, got {_flag_text(value)}")
    for name in ["batch_sizes", "lr_multipliers", "window_blocks"]:
        if len(getattr(hp, name)) != 3:
            raise ConfigError(f"--{name} needs exactly 3 values (one per third of the run), got {getattr(hp, name)}")
    if hp.val_tokens % hp.val_batch_size:
        raise ConfigError(f"--val_tokens {hp.val_tokens} must be a multiple of --val_batch_size {hp.val_batch_size}")
    if hp.vocab_size <= BOS_ID:
        raise ConfigError(f"--vocab_size {hp.vocab_size} must exceed {BOS_ID}, the shards' document-start token (GPT-2 ids)")
    if hp.num_heads * hp.head_dim != hp.model_dim:
        raise ConfigError(f"--num_heads x --head_dim must equal --model_dim (the merged QKVO weight applies O as a "
                          f"{hp.model_dim} x {hp.model_dim} map); got {hp.num_heads} x {hp.head_dim} vs {hp.model_dim}")
    if hp.model_dim < GATE_INPUTS:
        raise ConfigError(f"--model_dim {hp.model_dim} is below {GATE_INPUTS}: the smear and attention gates read the "
                          f"first {GATE_INPUTS} channels")
    if hp.head_dim % 4:
        raise ConfigError(f"--head_dim must be a multiple of 4 (half-truncated RoPE splits it in quarters), got {hp.head_dim}")
    longest_window = max(*hp.window_blocks, hp.extension_window_blocks) * hp.window_block_tokens
    if longest_window > hp.max_seq_len:
        raise ConfigError(f"the longest training window ({longest_window} tokens = --window_blocks/--extension_window_blocks "
                          f"x --window_block_tokens) exceeds --max_seq_len {hp.max_seq_len}; shrink the window")
    if hp.save_every % 2:
        raise ConfigError(f"--save_every must be even (Adam steps on odd steps; checkpoints fall between them), got {hp.save_every}")
    for name, choices in (("device", ("auto", "cuda", "cpu")), ("matrix_optimizer", MATRIX_OPTIMIZERS),
                          ("factor_dtype", ("fp32", "bf16")), ("factor_block_cost", ("bytes", "poly"))):
        if getattr(hp, name) not in choices:
            raise ConfigError(f"--{name} must be one of {', '.join(choices)}, got {getattr(hp, name)!r}")
    if hp.fp8 not in ("auto", "on", "off"):
        raise ConfigError(f"--fp8 must be auto, on or off, got {hp.fp8!r}")
    if hp.profile and not _parse_profile_range(hp.profile):
        raise ConfigError(f"--profile must look like START:END with 0 <= START < END, got {hp.profile!r}")
    if hp.run_id and not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}", hp.run_id):
        raise ConfigError(f"--run_id may hold letters, digits, '.', '_' and '-', not first (it names a file), got {hp.run_id!r}")
    layer_roles(hp.num_layers)  # raises ConfigError for depths without a valid layout


def _flag_text(value):
    return " ".join(map(str, value)) if isinstance(value, tuple) else str(value)


def _parse_profile_range(text):
    try:
        start, end = (int(v) for v in text.split(":"))
    except ValueError:
        return None
    return (start, end) if 0 <= start < end else None


def grad_accum_steps(hp, world_size):
    """Same tokens per step at any world size: ranks below the base accumulate, above it split."""
    return hp.grad_accum_base // world_size if hp.grad_accum_base % world_size == 0 else 1


def tokens_per_rank(batch_tokens, world_size, accum, what="--batch_sizes"):
    if batch_tokens % (world_size * accum):
        raise ConfigError(
            f"{what} value {batch_tokens} does not split over {world_size} ranks x {accum} accumulation steps; "
            f"use a multiple of {world_size * accum}")
    return batch_tokens // (world_size * accum)

# ----------------------------------------------------------------------------------------------
# Data: .bin shards, BOS-aligned distributed batches, validation batches, a synthetic corpus

BOS_ID = 50256  # <|endoftext|>: every document starts with it
SHARD_MAGIC, SHARD_VERSION, SHARD_HEADER_INTS = 20240520, 1, 256
GPT2_VOCAB_SIZE = 50257  # shard token ids are GPT-2 ids
BOS_SYNC_TOKENS = 4_000_000  # index this many tokens before returning; the rest in the background


class DataError(ValueError):
    """Missing or corrupt data; main() prints it as one line."""


def read_shard(path, vocab_size=None, max_tokens=None):
    """Tokens of a .bin shard as uint16, after checking the header against the file size; with
    vocab_size, every id read must be below it; with max_tokens, only that prefix is read."""
    path = Path(path)
    header_bytes = SHARD_HEADER_INTS * 4
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            if size < header_bytes:
                raise DataError(f"{path}: corrupt shard: {size} bytes is shorter than the {header_bytes}-byte header")
            header = np.frombuffer(f.read(header_bytes), dtype="<i4")
            if header[0] != SHARD_MAGIC:
                raise DataError(f"{path}: bad magic {header[0]} (expected {SHARD_MAGIC}); not a GPT-2 token shard")
            if header[1] != SHARD_VERSION:
                raise DataError(f"{path}: unsupported shard version {header[1]} (expected {SHARD_VERSION})")
            n = int(header[2])
            if n < 0:
                raise DataError(f"{path}: corrupt shard: negative token count {n} in the header")
            expected = header_bytes + 2 * n
            if size != expected:
                what = "truncated" if size < expected else "oversized"
                raise DataError(f"{path}: {what} shard: header says {n} tokens ({expected} bytes) but the file has "
                                f"{size} bytes; re-download or re-tokenize it")
            count = n if max_tokens is None else min(n, max_tokens)
            data = f.read(2 * count)
            if len(data) != 2 * count:
                raise DataError(f"{path}: the shard shrank while it was read ({len(data)} of {2 * count} bytes); is "
                                f"another process writing it?")
            tokens = np.frombuffer(data, dtype="<u2")
    except OSError as e:
        raise DataError(f"{path}: cannot read shard ({e.strerror or e})") from None
    if vocab_size is not None and tokens.size and tokens.max() >= vocab_size:
        position = int(np.argmax(tokens >= vocab_size))
        raise DataError(f"{path}: token id {tokens[position]} at position {position} is not below the vocabulary "
                        f"size {vocab_size}")
    return tokens


def write_shard(path, tokens):
    """Write GPT-2 token ids as a .bin shard atomically: a unique temp file in the same folder,
    removed on failure, renamed into place on success."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or (tokens.size and not np.issubdtype(tokens.dtype, np.integer)):
        raise DataError(f"{path}: refusing to write a {tokens.ndim}-D array of {tokens.dtype}: tokens must be a 1-D "
                        f"array of integer ids")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= GPT2_VOCAB_SIZE):
        bad = tokens.min() if tokens.min() < 0 else tokens.max()
        raise DataError(f"{path}: refusing to write token id {bad}: ids must be in [0, {GPT2_VOCAB_SIZE})")
    header = np.zeros(SHARD_HEADER_INTS, dtype="<i4")
    header[:3] = SHARD_MAGIC, SHARD_VERSION, tokens.size
    write_atomically(Path(path), header.tobytes() + tokens.astype("<u2").tobytes())


def write_atomically(path, data):
    """Write bytes via a unique temp file next to `path`, fsync, rename: readers see the old file or
    the new one, never a part; the temp file is removed if anything fails. The temp name records the
    host and process, so remove_stale_temp_files can tell a killed write from a running one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}~{platform.node()}~{os.getpid()}~{uuid.uuid4().hex[:8]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # usual permissions, unlike mkstemp's 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def remove_stale_temp_files(folder):
    """Delete the temp files of writes that were killed (this host's, whose process is gone)."""
    removed = []
    for tmp in Path(folder).glob(".*~*~*~*.tmp"):
        _, host, pid, _ = tmp.name.rsplit("~", 3)
        if host != platform.node() or not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                tmp.unlink()
                removed.append(tmp)
        except OSError:
            pass  # alive, another user's
    return removed


class BosIndex:
    """Positions of BOS tokens in a shard: the first BOS_SYNC_TOKENS synchronously, the rest as a job
    on `pool` (a background thread), so a new shard is usable at once."""

    def __init__(self, tokens, pool):
        head = np.flatnonzero(tokens[:BOS_SYNC_TOKENS] == BOS_ID)
        self._parts = [head]
        self._rest = None
        if tokens.size > BOS_SYNC_TOKENS:
            self._rest = pool.submit(lambda: np.flatnonzero(tokens[BOS_SYNC_TOKENS:] == BOS_ID) + BOS_SYNC_TOKENS)

    def available(self, need_all=False):
        """All positions indexed so far (waits for the background part if need_all or nothing is left)."""
        if self._rest is not None and (need_all or self._rest.done()):
            self._parts = [np.concatenate([self._parts[0], self._rest.result()])]
            self._rest = None
        return self._parts[0]

    @property
    def complete(self):
        return self._rest is None


def load_shard_with_index(path, pool, vocab_size=None):
    tokens = read_shard(path, vocab_size)
    return tokens, BosIndex(tokens, pool)


def plan_pieces(bos, shard_len, cursor, world_size, rank_tokens, max_seq_len, index_complete=True):
    """Walk BOS positions from `cursor`: rank 0 takes pieces until it has rank_tokens, then rank 1...
    A piece starts at a BOS and ends at the next BOS, max_seq_len, or the rank's quota.
    Returns ([(starts, lengths)] per rank, next cursor), or None if the BOS list runs out.
    With an incomplete index the last known BOS has no known end, so it is not used."""
    ends = np.append(bos[cursor + 1:], shard_len) if index_complete else bos[cursor + 1:]
    if len(ends) == 0:
        return None
    lengths = np.minimum(ends - bos[cursor: cursor + len(ends)], max_seq_len)
    cumulative = np.cumsum(lengths)
    plan, taken, first = [], 0, 0
    for _ in range(world_size):
        last = int(np.searchsorted(cumulative, taken + rank_tokens))  # first piece reaching the quota
        if last >= len(cumulative):
            return None
        piece_lengths = lengths[first: last + 1].copy()
        piece_lengths[-1] -= cumulative[last] - (taken + rank_tokens)
        plan.append((bos[cursor + first: cursor + last + 1], piece_lengths))
        taken, first = int(cumulative[last]), last + 1
    return plan, cursor + first


def gather_pieces(tokens, starts, lengths):
    index = np.repeat(starts - np.cumsum(lengths) + lengths, lengths) + np.arange(lengths.sum())
    return tokens[index]


def padded_cu_seqlens(lengths, total):
    """[0, l1, l1+l2, ..., total] padded with `total` to length total + 1 (static shape)."""
    cu = np.full(total + 1, total, dtype=np.int32)
    cu[0] = 0
    bounds = np.cumsum(lengths)
    bounds = bounds[bounds < total]
    cu[1: 1 + len(bounds)] = bounds
    return cu


def to_device(inputs, targets, cu_seqlens, device):
    """int32 inputs, int64 targets, int32 cu_seqlens; pinned + non_blocking on CUDA."""
    tensors = [torch.from_numpy(inputs.astype(np.int32)), torch.from_numpy(targets.astype(np.int64)),
               torch.from_numpy(cu_seqlens)]
    if device.type == "cuda":
        return [t.pin_memory().to(device, non_blocking=True) for t in tensors]
    return [t.to(device) for t in tensors]


def model_inputs(window, doc_lengths, device):
    """What GPT.forward takes for a window of tokens (inputs window[:-1], targets window[1:]) whose
    inputs are documents of `doc_lengths` (a longer last length is cut): (inputs, targets, cu_seqlens)
    on `device`. Training pieces, validation batches and tools/sample.py all go through here."""
    positions = len(window) - 1
    return to_device(window[:-1], window[1:], padded_cu_seqlens(doc_lengths, positions), device)


def piece_bounds(tokens, max_piece_tokens):
    """[(start, stop)] of the ceil(tokens / max_piece_tokens) pieces a micro-step runs as: consecutive and
    near-equal (lengths differ by at most one), so a stage compiles at most two piece lengths. The cuts sit
    at fixed positions: with static shapes, moving one to a document start would take padding."""
    count = -(-tokens // max_piece_tokens)
    edges = [i * tokens // count for i in range(count + 1)]
    return list(zip(edges[:-1], edges[1:]))


def cut_lengths(doc_lengths, start, stop):
    """Lengths of the documents of a sequence inside [start, stop): a document the edges cut through keeps
    its part inside (the piece treats that part as a document of its own)."""
    ends = np.cumsum(doc_lengths)
    inside = np.minimum(ends, stop) - np.maximum(ends - doc_lengths, start)
    return inside[inside > 0]


class TrainLoader:
    """BOS-aligned batches for one rank. The walk over documents is the same on every rank (each
    computes the global plan and keeps its own part), so ranks never need to talk about data."""

    def __init__(self, pattern, rank, world_size, device, cycle=False, vocab_size=None, pool=None):
        self.files = sorted(glob.glob(pattern))
        if not self.files:
            raise DataError(f"no training shards match {pattern!r}; download them with "
                            f"`python data/cached_fineweb10B.py` or pass --train_files")
        self.shard_tokens = []
        for path in self.files:  # every file readable, with a sound header and some tokens, before the first step
            read_shard(path, max_tokens=0)
            self.shard_tokens.append((os.path.getsize(path) - SHARD_HEADER_INTS * 4) // 2)
            if self.shard_tokens[-1] == 0:
                raise DataError(f"{path}: the shard holds no tokens (a header only); remove it or re-tokenize")
        self.rank, self.world_size, self.device, self.cycle = rank, world_size, device, cycle
        self.vocab_size = vocab_size  # token ids are checked against it as each shard is read
        # one background thread reads the next shard, one indexes BOS positions
        self._pool = pool or concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="loader")
        self.reset()

    def _load(self, index):
        return load_shard_with_index(self.files[index], self._pool, self.vocab_size)

    def reset(self, shard=0, cursor=0, epoch=0):
        self.shard, self.cursor, self.epoch = shard, cursor, epoch
        self.tokens, self.bos = self._load(shard)
        if self.bos.complete:
            self._check_has_documents()
        self._prefetch = self._pool.submit(self._load, self._following_shard())

    def _check_has_documents(self):
        if self.bos.available(need_all=True).size == 0:
            raise DataError(f"{self.files[self.shard]}: no document start (token {BOS_ID}) in its {self.tokens.size} "
                            f"tokens; every document must begin with it (re-tokenize the shard)")

    def close(self):
        """Stop the background threads (a pending prefetch is dropped)."""
        if isinstance(self._pool, concurrent.futures.Executor):
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _following_shard(self):
        return (self.shard + 1) % len(self.files)

    def state_dict(self):
        return dict(shard=self.shard, cursor=self.cursor, epoch=self.epoch, files=self.files)

    def load_state_dict(self, state):
        """Continue where the state was taken. The position (shard, BOS cursor) is that of the global
        walk over documents, which every rank computes, so it holds at any world size: the next batch
        starts at the first document no rank has trained on. Shards are matched by file name, so the
        data may live elsewhere (another node, another DATA_PATH)."""
        if [Path(f).name for f in state["files"]] != [Path(f).name for f in self.files]:
            raise DataError("the training shards differ from those of the checkpoint; pass the same --train_files")
        self.reset(state["shard"], state["cursor"], state["epoch"])

    def _advance_shard(self):
        if self.shard + 1 == len(self.files):
            if not self.cycle:
                raise DataError(f"all {len(self.files)} training shards are used up; download more shards "
                                f"(python data/cached_fineweb10B.py N) or pass --cycle_data true")
            self.epoch += 1
        self.shard = self._following_shard()
        self.cursor = 0
        self.tokens, self.bos = self._prefetch.result()
        self._prefetch = self._pool.submit(self._load, self._following_shard())

    def next_batch(self, rank_tokens, max_seq_len):
        """(inputs, targets, cu_seqlens) of rank_tokens tokens each for this rank."""
        return self.next_pieces(rank_tokens, max_seq_len, rank_tokens)[0]

    def next_pieces(self, rank_tokens, max_seq_len, max_piece_tokens):
        """This rank's next micro-step of rank_tokens tokens as the model inputs of its piece_bounds pieces
        of at most max_piece_tokens each. The walk over documents does not depend on max_piece_tokens."""
        for _ in range(2 * len(self.files) + 1):
            plan = None
            if not self.bos.complete:
                plan = plan_pieces(self.bos.available(), len(self.tokens), self.cursor, self.world_size, rank_tokens + 1,
                                   max_seq_len, index_complete=self.bos.complete)
            if plan is None:
                self._check_has_documents()
                plan = plan_pieces(self.bos.available(need_all=True), len(self.tokens), self.cursor, self.world_size,
                                   rank_tokens + 1, max_seq_len)
            if plan is not None:
                break
            self._advance_shard()
        else:
            raise DataError(f"the training shards {self.files[0]}... are too small for {rank_tokens} tokens per rank")
        pieces, self.cursor = plan
        starts, lengths = pieces[self.rank]
        buf = gather_pieces(self.tokens, starts, lengths)
        return [model_inputs(buf[start: stop + 1], cut_lengths(lengths, start, stop), self.device)
                for start, stop in piece_bounds(rank_tokens, max_piece_tokens)]


def read_validation_tokens(pattern, count, vocab_size=None):
    """The first `count` tokens of the validation shards (in name order), reading no more than that."""
    files = sorted(glob.glob(pattern))
    if not files:
        raise DataError(f"no validation shards match {pattern!r}; download them with "
                        f"`python data/cached_fineweb10B.py` or pass --val_files")
    parts, have = [], 0
    for path in files:
        if have == count:
            break
        parts.append(read_shard(path, vocab_size, max_tokens=count - have))
        have += parts[-1].size
    if have < count:
        raise DataError(f"validation shards {pattern!r} hold {have} tokens, but --val_tokens {count - 1} needs {count} "
                        f"(one more than the inputs: the last target); lower --val_tokens or add validation shards")
    return np.concatenate(parts)


def validation_batches(tokens, val_tokens, val_batch_size, rank, world_size, accum, device):
    """The first val_tokens of `tokens` (read_validation_tokens), in val_batch_size steps; rank r takes
    its contiguous slice of each step (split into `accum` forward passes). Not BOS-aligned; documents
    still never mix in attention."""
    chunk = tokens_per_rank(val_batch_size, world_size, accum, what="--val_batch_size")
    for start in range(0, val_tokens, chunk * world_size):
        begin = start + rank * chunk
        buf = tokens[begin: begin + chunk + 1]
        starts = np.flatnonzero(buf[:-1] == BOS_ID)
        yield model_inputs(buf, np.diff(np.concatenate([[0], starts[starts > 0], [chunk]])), device)


def synthetic_corpus(out_dir, seed=0, train_tokens=8_000_000, val_tokens=262_144, vocab=512, topics=8):
    """Write a deterministic corpus with learnable structure: BOS-started documents, each with a topic,
    generated by a topic-dependent sparse Markov chain (4 successors per token, probs .6/.25/.1/.05).
    A model must use context (the topic) and the previous token to reach ~1.1 nats/token;
    the unigram entropy is ~ln(vocab). Returns the (train, val) paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    token_ids = rng.choice(np.arange(1000, 50000), size=vocab, replace=False)
    successors = rng.integers(0, vocab, size=(topics, vocab, 4))
    probs = np.array([0.6, 0.25, 0.1, 0.05])
    paths = []
    for name, n_tokens in (("synthetic_val_000000.bin", val_tokens), ("synthetic_train_000001.bin", train_tokens)):
        docs = []
        total = 0
        while total < n_tokens:
            n_docs, doc_len = 512, 1024
            topic = rng.integers(0, topics, size=n_docs)
            state = rng.integers(0, vocab, size=n_docs)
            choices = rng.choice(4, size=(doc_len, n_docs), p=probs)
            seq = np.empty((n_docs, doc_len), dtype=np.int64)
            for t in range(doc_len):
                seq[:, t] = state
                state = successors[topic, state, choices[t]]
            lengths = rng.integers(32, doc_len, size=n_docs)
            for row, length in zip(seq, lengths):
                docs.append(np.concatenate([[BOS_ID], token_ids[row[:length]]]))
                total += length + 1
        path = out_dir / name
        write_shard(path, np.concatenate(docs)[:n_tokens])
        paths.append(path)
    return paths

# ----------------------------------------------------------------------------------------------
# Model: tied embedding, smear gate, value embeddings, sliding-window attention, ReLU^2 MLP, U-net
# skip and backout (the head and its loss follow in the next section)

GATE_INPUTS = 12  # the smear and attention gates read the first 12 channels of their input
ATTN_BLOCK = 128  # FlexAttention tile size (tokens)


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


def tag(p, label, lr_mul=1.0, wd_mul=1.0):
    """Attach what the optimizers need to know about a parameter."""
    p.label, p.lr_mul, p.wd_mul = label, lr_mul, wd_mul
    return p


@dataclass(frozen=True)
class LayerRoles:
    attn_free: int  # layer without attention; also where the U-net skip lands
    skip_source: int  # its output is added back before attn_free
    backout: int  # its output is partly subtracted before the final norm
    long_window: tuple  # layers with the long window (and the key shift)
    value_embed: dict  # layer -> value-embedding table


def layer_roles(num_layers):
    """The 11-layer layout (skip 3->6, no attention in 6, backout 7, long windows 3 and 10,
    value embeddings `. 1 2 ... 0 1 2`) expressed relative to the depth."""
    attn_free = num_layers // 2 + 1
    skip_source = attn_free - 3
    backout = attn_free + 1
    value_embed = {0: 1, 1: 2, num_layers - 3: 0, num_layers - 2: 1, num_layers - 1: 2}
    if skip_source < 0 or backout > num_layers - 1 or len(value_embed) != 5 or attn_free in value_embed:
        raise ConfigError(f"--num_layers {num_layers}: the layer roles (skip, backout, value embeddings, attention-free "
                          f"layer) need at least 9 layers")
    return LayerRoles(attn_free, skip_source, backout, (skip_source, num_layers - 1), value_embed)


class Rotary(nn.Module):
    """Half-truncated RoPE: head_dim/4 frequencies rotate, the other head_dim/4 pairs are position-free.
    Also owns the softmax scale, since YaRN changes both together. The scale is kept in float64
    (the reference keeps it as a Python float) and applied to the fp32 attention scores."""

    INITIAL_ATTN_SCALE = 0.1

    def __init__(self, head_dim):
        super().__init__()
        quarter = head_dim // 4
        freqs = torch.cat([(1 / 1024) ** torch.linspace(0, 1, quarter), torch.zeros(quarter)])
        self.register_buffer("initial_freqs", freqs, persistent=False)
        self.register_buffer("freqs", freqs.clone())
        self.register_buffer("attn_scale", torch.tensor(self.INITIAL_ATTN_SCALE, dtype=torch.float64))
        self.window = None  # the long window (tokens) the frequencies are tuned for; None: not yet set

    @torch.no_grad()
    def reset(self):
        self.freqs.copy_(self.initial_freqs)
        self.attn_scale.fill_(self.INITIAL_ATTN_SCALE)
        self.window = None

    def follow_window(self, tokens):
        """Apply YaRN when the long window changes; the first window after a reset is the base."""
        if self.window is not None and tokens != self.window:
            self.extend_window(self.window, tokens)
        self.window = tokens

    def get_extra_state(self):  # the window travels with freqs/attn_scale in state_dict()
        return {"window": self.window}

    def set_extra_state(self, state):
        self.window = state["window"]

    @torch.no_grad()
    def extend_window(self, old_tokens, new_tokens):
        """YaRN: slow frequencies (fewer than 1 turn over the old window) scale by old/new, fast ones
        (32+ turns) stay, linear in between; the softmax scale grows by 0.2*ln(new/old) + 1."""
        s = old_tokens / new_tokens
        rotations = old_tokens * self.freqs / (2 * math.pi)
        interp = ((rotations - 1) / (32 - 1)).clamp(0, 1)
        self.freqs.mul_(s + interp * (1 - s))
        self.attn_scale.mul_(0.2 * math.log(new_tokens / old_tokens) + 1)

    def cos_sin(self, seq_len):
        """(seq_len, 1, head_dim/2) tables, rounded to bf16 like the reference's cached tables."""
        theta = torch.outer(torch.arange(seq_len, device=self.freqs.device, dtype=torch.float32), self.freqs)
        return theta.cos().bfloat16()[:, None, :], theta.sin().bfloat16()[:, None, :]


def apply_rotary(x, cos_sin):
    cos, sin = cos_sin
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1).type_as(x)


def shift_keys(k):
    """On the position-free dims, key t takes key t-1 (position 0 keeps its own): one layer can then
    match 'the token after X', i.e. an induction head. Like the reference, this does not stop at
    document starts (the first key of a document carries the previous document's last key)."""
    head_dim = k.size(-1)
    prev = torch.cat([k[:1], k[:-1]])
    free = torch.arange(head_dim, device=k.device) % (head_dim // 2) >= head_dim // 4  # the 2nd quarter of each half
    return torch.where(free, prev, k)


def document_ids(cu_seqlens, seq_len):
    """Document index of every position from padded cumulative boundaries [0, b1, ..., T, T, ...]."""
    positions = torch.arange(seq_len, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens, positions, right=True) - 1


def sliding_document_mask(docs, window_tokens):
    """BlockMask for causal attention inside documents: query t sees keys t - window_tokens ... t
    (inclusive, like FlashAttention's window_size=(w, 0)). Built from per-tile document ranges, so
    nothing of size T x T is materialized."""
    seq_len = docs.numel()
    n_blocks = -(-seq_len // ATTN_BLOCK)
    padded = torch.cat([docs, (docs[-1:] + 1).expand(n_blocks * ATTN_BLOCK - seq_len)])
    tiles = padded.view(n_blocks, ATTN_BLOCK)
    first, last = tiles[:, 0], tiles[:, -1]
    q = torch.arange(n_blocks, device=docs.device)[:, None]
    k = torch.arange(n_blocks, device=docs.device)[None, :]
    gap = (q - k) * ATTN_BLOCK
    any_allowed = (k <= q) & (gap - (ATTN_BLOCK - 1) <= window_tokens) & (last[k] >= first[q])
    all_allowed = (k < q) & (gap + (ATTN_BLOCK - 1) <= window_tokens) & (first[q] == last[k]) & (first[k] == last[q])
    partial = any_allowed & ~all_allowed

    def as_indices(m):
        counts = m.sum(dim=-1, dtype=torch.int32)
        order = torch.argsort(m.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return counts[None, None].contiguous(), order[None, None].contiguous()

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= window_tokens) & (padded[q_idx] == padded[kv_idx])

    return BlockMask.from_kv_blocks(*as_indices(partial), *as_indices(all_allowed), BLOCK_SIZE=ATTN_BLOCK,
                                    mask_mod=mask_mod, seq_lengths=(seq_len, seq_len))


class FlexWindowAttention:
    """The GPU attention: FlexAttention over a block mask (documents, causal, inclusive window).
    An attention implementation builds a mask once per forward pass and applies it per layer.
    Eager FlexAttention materializes the whole score matrix, so a model that is not compiled as a
    whole gets a compiled FlexAttention kernel of its own (compile_kernel=True)."""

    mask = staticmethod(sliding_document_mask)

    def __init__(self, compile_kernel=False):
        self.flex = torch.compile(flex_attention, dynamic=False) if compile_kernel else flex_attention

    def __call__(self, q, k, v, mask, scale):
        """(T, H, D) tensors -> (T, H, D). `scale` (a 0-dim tensor) multiplies the fp32 scores, as a
        softmax scale; as a tensor, YaRN's changes never recompile."""
        scale = scale.float()
        out = self.flex(*(t.transpose(0, 1)[None] for t in (q, k, v)), block_mask=mask, scale=1.0,
                        score_mod=lambda score, b, h, q_idx, kv_idx: score * scale)
        return out[0].transpose(0, 1)


class Attention(nn.Module):
    def __init__(self, dim, num_heads, head_dim):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        hdim = num_heads * head_dim
        bound = math.sqrt(3) * 0.5 / math.sqrt(dim)
        # Q, K, V and O in one (4*hdim, dim) matrix so it stacks with the MLP weights in NorMuon;
        # O is applied as F.linear(y, W_o) (rows are output channels), which needs hdim == dim.
        qkvo = torch.empty(4 * hdim, dim).uniform_(-bound, bound)
        qkvo[3 * hdim:].zero_()
        self.qkvo_w = tag(nn.Parameter(qkvo), "attn")
        self.gate_w = tag(nn.Parameter(torch.zeros(num_heads, GATE_INPUTS)), "gate")

    def forward(self, x, lambdas, ve, attention, mask, cos_sin, attn_scale, key_shift):
        seq_len, hdim = x.size(0), self.num_heads * self.head_dim
        w = self.qkvo_w.type_as(x)
        # the attention lambdas scale the weights (QKV by λ0, O by λ1), as in the reference
        q, k, v = F.linear(x, lambdas[0] * w[: 3 * hdim]).view(seq_len, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = apply_rotary(norm(q), cos_sin), apply_rotary(norm(k), cos_sin)
        if key_shift:
            k = shift_keys(k)
        if ve is not None:
            v = v + ve.view_as(v)
        y = attention(q, k, v, mask, attn_scale)
        y = y * torch.sigmoid(F.linear(x[:, :GATE_INPUTS], self.gate_w.type_as(x)))[..., None]
        return F.linear(y.reshape(seq_len, hdim), lambdas[1] * w[3 * hdim:])


class MLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        bound = math.sqrt(3) * 0.5 / math.sqrt(dim)
        self.fc_w = tag(nn.Parameter(torch.empty(hidden, dim).uniform_(-bound, bound)), "mlp")
        # Stored (hidden, dim) like fc_w so both stack with the attention weights.
        self.proj_w = tag(nn.Parameter(torch.zeros(hidden, dim)), "mlp", lr_mul=2.0)

    def forward(self, x):
        return F.relu(F.linear(x, self.fc_w.type_as(x))).square() @ self.proj_w.type_as(x)


class Block(nn.Module):
    def __init__(self, dim, num_heads, head_dim, has_attn):
        super().__init__()
        self.attn = Attention(dim, num_heads, head_dim) if has_attn else None
        self.mlp = MLP(dim, 4 * dim)

    def forward(self, x, attn_args):
        if self.attn is not None:
            x = x + self.attn(norm(x), **attn_args)
        return x + self.mlp(norm(x))


class GPT(nn.Module):
    def __init__(self, vocab_size, num_layers, num_heads, head_dim, model_dim, window_block_tokens=128):
        super().__init__()
        self.roles = layer_roles(num_layers)
        self.num_layers = num_layers
        self.window_block_tokens = window_block_tokens
        # the GPU paths; build_model swaps in the CPU fallbacks on a CPU
        self.attention = FlexWindowAttention()
        self.head_loss = softcap_cross_entropy
        self.use_fp8 = False  # FP8 head matmul in training (build_model turns it on where supported)
        padded_vocab = -(-vocab_size // 128) * 128
        hdim = num_heads * head_dim
        self.lm_head = nn.Linear(model_dim, padded_vocab, bias=False)
        nn.init.normal_(self.lm_head.weight, std=0.005)
        tag(self.lm_head.weight, "lm_head")  # also the input embedding table (tied)
        self.value_embeds = nn.ParameterList(
            [tag(nn.Parameter(torch.zeros(padded_vocab, hdim)), "value_embed", lr_mul=75.0) for _ in range(3)])
        self.smear_gate_w = tag(nn.Parameter(torch.zeros(1, GATE_INPUTS)), "gate")
        self.blocks = nn.ModuleList(
            [Block(model_dim, num_heads, head_dim, has_attn=i != self.roles.attn_free) for i in range(num_layers)])
        self.rotary = Rotary(head_dim)
        self.scalars = tag(nn.Parameter(initial_scalars(num_layers)), "scalars", lr_mul=5.0, wd_mul=0.0)

    def scalar_views(self):
        """Named views into the flat `scalars` parameter (layout of initial_scalars)."""
        n, s = self.num_layers, self.scalars
        return dict(resid=s[:n], x0=s[n: 2 * n], attn=s[2 * n: 4 * n].view(n, 2),
                    smear=s[4 * n], backout=s[4 * n + 1], skip=s[4 * n + 2])

    def forward(self, input_seq, target_seq, cu_seqlens, window_blocks):
        """Loss of one packed sequence; window_blocks = (short, long) attention windows in blocks."""
        seq_len = input_seq.numel()
        roles, lam = self.roles, self.scalar_views()
        docs = document_ids(cu_seqlens, seq_len)
        short_blocks, long_blocks = window_blocks
        masks = {long: self.attention.mask(docs, blocks * self.window_block_tokens)
                 for long, blocks in ((True, long_blocks), (False, short_blocks))}
        cos_sin = self.rotary.cos_sin(seq_len)

        x = F.embedding(input_seq, self.lm_head.weight)
        # smear: each token's embedding takes a gated share of the previous one (across documents too)
        gate = lam["smear"] * torch.sigmoid(F.linear(x[1:, :GATE_INPUTS], self.smear_gate_w.type_as(x)))
        x = torch.cat([x[:1], x[1:] + gate * x[:-1]])
        x = x0 = norm(x)
        ve = [F.embedding(input_seq, table) for table in self.value_embeds]
        skip = backout = None
        for i, block in enumerate(self.blocks):
            if i == roles.attn_free:  # the U-net skip lands before this layer's residual scaling
                x = x + torch.sigmoid(lam["skip"]) * skip
            x = (lam["resid"][0] + lam["x0"][0]) * x if i == 0 else lam["resid"][i] * x + lam["x0"][i] * x0
            long = i in roles.long_window
            table = roles.value_embed.get(i)
            attn_args = dict(lambdas=lam["attn"][i], ve=None if table is None else ve[table], attention=self.attention,
                             mask=masks[long], cos_sin=cos_sin, attn_scale=self.rotary.attn_scale, key_shift=long)
            x = block(x, attn_args)
            if i == roles.skip_source:
                skip = x
            if i == roles.backout:
                backout = x
        x = norm(x - lam["backout"] * backout)
        return self.head_loss(x, self.lm_head.weight, target_seq.long(), self.training, self.use_fp8)

    def next_token_logits(self, input_seq, cu_seqlens, window_blocks):
        """Softcapped float32 logits (padded vocabulary) of the token after input_seq: forward itself, its
        head's loss swapped for the last position's logits (tools/sample.py)."""
        head_loss = self.head_loss
        self.head_loss = lambda x, weight, *_: softcapped(head_matmul(x[-1:], weight, False))[0]
        try:
            return self(input_seq, input_seq, cu_seqlens, window_blocks)
        finally:
            self.head_loss = head_loss


def initial_scalars(num_layers):
    """resid λ (1.1) x L, x0 λ (0) x L, attention λ pairs (0.5, 1.0) x L, smear λ 0, backout λ 0.5,
    skip λ -1.5 (the reference pads them for its sharded Adam; DistAdam pads its own shards)."""
    n = num_layers
    return torch.tensor([1.1] * n + [0.0] * n + [0.5, 1.0] * n + [0.0, 0.5, -1.5])

# ----------------------------------------------------------------------------------------------
# Head: the tied x @ W.T in FP8 (a custom op: e4m3 forward, e5m2 gradients, static scales) and the
# softcapped cross-entropy

# Static scales of the record's head: activations up to ~100, weights ~1.5, gradients ~0.75,
# each divided by 448 (the largest finite float8_e4m3fn value) so they use the full e4m3 range.
HEAD_FP8_SCALES = (100 / 448, 1.5 / 448, 0.75 / 448)


def fp8_forward(x, w, x_s, w_s):
    x_f8 = x.div(x_s).to(torch.float8_e4m3fn)
    w_f8 = w.div(w_s).to(torch.float8_e4m3fn)
    out = torch._scaled_mm(x_f8, w_f8.T, out_dtype=torch.bfloat16, scale_a=x.new_tensor(x_s, dtype=torch.float32),
                           scale_b=x.new_tensor(w_s, dtype=torch.float32), use_fast_accum=True)
    return out, x_f8, w_f8


def fp8_backward(g, x_f8, w_f8, x_s, w_s, grad_s):
    g_f8 = g.div(grad_s).to(torch.float8_e5m2)
    # _scaled_mm wants its first operand row-major and its second column-major
    grad_x = torch._scaled_mm(g_f8, w_f8.T.contiguous().T, out_dtype=torch.bfloat16,
                              scale_a=g.new_tensor(grad_s, dtype=torch.float32),
                              scale_b=g.new_tensor(w_s, dtype=torch.float32), use_fast_accum=False)
    # computed as (x_f8.T @ g_f8).T: for the head's (50304, 768) weight that orientation is the faster one
    grad_w = torch._scaled_mm(x_f8.T.contiguous(), g_f8.T.contiguous().T, out_dtype=torch.float32,
                              scale_a=g.new_tensor(x_s, dtype=torch.float32),
                              scale_b=g.new_tensor(grad_s, dtype=torch.float32), use_fast_accum=False).T
    return grad_x, grad_w


# On CUDA the casts and scalings run compiled (fused, the scale tensors folded into constants); the
# eager bodies serve the CPU.
fp8_forward_compiled = torch.compile(fp8_forward, dynamic=False)
fp8_backward_compiled = torch.compile(fp8_backward, dynamic=False)


@torch.library.custom_op("speedrun::mm_fp8", mutates_args=())
def mm_fp8(x: Tensor, w: Tensor, x_s: float, w_s: float, grad_s: float) -> tuple[Tensor, Tensor, Tensor]:
    """x (M, K) @ w (N, K).T -> bf16 (M, N); also returns the float8 casts saved for backward."""
    return fp8_forward(x, w, x_s, w_s)


@mm_fp8.register_kernel("cuda")
def _(x, w, x_s, w_s, grad_s):
    return fp8_forward_compiled(x, w, x_s, w_s)


@mm_fp8.register_fake
def _(x, w, x_s, w_s, grad_s):
    return x.new_empty(x.shape[0], w.shape[0], dtype=torch.bfloat16), torch.empty_like(x, dtype=torch.float8_e4m3fn), \
        torch.empty_like(w, dtype=torch.float8_e4m3fn)


@torch.library.custom_op("speedrun::mm_fp8_backward", mutates_args=())
def mm_fp8_backward(g: Tensor, x_f8: Tensor, w_f8: Tensor, x_s: float, w_s: float, grad_s: float) -> tuple[Tensor, Tensor]:
    """grad_x = g @ w (bf16), grad_w = g.T @ x (fp32, column-major), with g cast to float8_e5m2."""
    return fp8_backward(g, x_f8, w_f8, x_s, w_s, grad_s)


@mm_fp8_backward.register_kernel("cuda")
def _(g, x_f8, w_f8, x_s, w_s, grad_s):
    return fp8_backward_compiled(g, x_f8, w_f8, x_s, w_s, grad_s)


@mm_fp8_backward.register_fake
def _(g, x_f8, w_f8, x_s, w_s, grad_s):
    grad_w = torch.empty_strided(w_f8.shape, (1, w_f8.shape[0]), dtype=torch.float32, device=w_f8.device)
    return x_f8.new_empty(x_f8.shape, dtype=torch.bfloat16), grad_w


def _mm_fp8_setup_context(ctx, inputs, output):
    x, w, x_s, w_s, grad_s = inputs
    ctx.save_for_backward(output[1], output[2])
    ctx.scales = (x_s, w_s, grad_s)
    ctx.w_dtype = w.dtype


def _mm_fp8_backward(ctx, grad_out, *_):
    x_f8, w_f8 = ctx.saved_tensors
    grad_x, grad_w = mm_fp8_backward(grad_out.contiguous(), x_f8, w_f8, *ctx.scales)
    return grad_x, grad_w.to(ctx.w_dtype), None, None, None


mm_fp8.register_autograd(_mm_fp8_backward, setup_context=_mm_fp8_setup_context)


def fp8_supported(device):
    """FP8 tensor cores exist from compute capability 8.9 (Ada, Hopper) on."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def head_matmul(x, w, use_fp8):
    """Logits x @ w.T of the tied head; FP8 in training where enabled, plain matmul otherwise."""
    if use_fp8:
        flat = x.reshape(-1, x.shape[-1])
        return mm_fp8(flat.to(torch.bfloat16), w, *HEAD_FP8_SCALES)[0].view(*x.shape[:-1], w.shape[0])
    return F.linear(x, w.type_as(x))


# logits -> SOFTCAP * sigmoid(logits / SOFTCAP_WIDTH): a smooth cap in (0, 30) (a shifted 15*tanh)
SOFTCAP, SOFTCAP_WIDTH = 30.0, 7.5


# Validation computes the head over at most this many tokens at once, so its memory does not grow with
# the validation batch: 16,384 x 50,304 logits x (2 + 4 + 4) bytes (bf16 out, fp32 softcap and
# log-softmax) is ~8 GB, where the record's 262,144-token slice at once would be ~130 GB.
EVAL_HEAD_ROWS = 16384


def softcapped(logits):
    return SOFTCAP * torch.sigmoid(logits.float() / SOFTCAP_WIDTH)


def softcap_cross_entropy(x, weight, targets, training, use_fp8):
    """The head and its loss on the GPU path: summed over tokens in training (the caller divides by
    the accumulation steps), mean in fp32 for validation. The compiled graph fuses the softcap."""
    if training:
        return F.cross_entropy(softcapped(head_matmul(x, weight, use_fp8)), targets, reduction="sum")
    total = sum(F.cross_entropy(softcapped(head_matmul(xc, weight, False)), tc, reduction="sum")
                for xc, tc in zip(x.split(EVAL_HEAD_ROWS), targets.split(EVAL_HEAD_ROWS)))
    return total / x.size(0)

# ----------------------------------------------------------------------------------------------
# CPU fallbacks: FlexAttention has no CPU backward, so attention runs as tiled SDPA with the same mask;
# the softcapped loss runs in chunks with gradients formed on the way (both chosen once in build_model);
# Polar Express runs in fp32, as bf16 matmuls without native support are ~20x slower (make_optimizers)

def local_window_mask(docs, window_tokens):
    """Queries in tiles of ATTN_BLOCK; each tile sees the window_tokens keys before it plus itself.
    Returns (tile mask, keys looked back)."""
    seq_len = docs.numel()
    n_tiles = -(-seq_len // ATTN_BLOCK)
    lookback = min(int(window_tokens), seq_len)  # a shape: the CPU path reads the window on the host
    # Padding positions get one extra document id, so every query row has at least itself unmasked.
    padded = torch.cat([docs, (docs[-1:] + 1).expand(n_tiles * ATTN_BLOCK - seq_len)])
    q_pos = torch.arange(n_tiles * ATTN_BLOCK, device=docs.device).view(n_tiles, ATTN_BLOCK, 1)
    k_pos = (torch.arange(n_tiles, device=docs.device)[:, None] * ATTN_BLOCK - lookback
             + torch.arange(lookback + ATTN_BLOCK, device=docs.device)[None, :])[:, None, :]
    k_doc = padded[k_pos.clamp_min(0)]
    allowed = (k_pos >= 0) & (k_pos <= q_pos) & (q_pos - k_pos <= window_tokens) & (padded[q_pos] == k_doc)
    return allowed[:, None], lookback


def local_window_attention(q, k, v, mask, scale):
    """q, k, v (T, H, D) -> (T, H, D) with the tiles of local_window_mask, via one batched SDPA."""
    allowed, lookback = mask
    seq_len, n_tiles = q.size(0), allowed.size(0)
    tail = n_tiles * ATTN_BLOCK - seq_len

    def windows(t):  # (T, H, D) -> (tiles, H, lookback + ATTN_BLOCK, D)
        t = F.pad(t, (0, 0, 0, 0, lookback, tail))
        return t.unfold(0, lookback + ATTN_BLOCK, ATTN_BLOCK).permute(0, 1, 3, 2)

    q = q * scale.to(q.dtype)  # the softmax scale, applied without reading it on the host
    q_tiles = F.pad(q, (0, 0, 0, 0, 0, tail)).view(n_tiles, ATTN_BLOCK, *q.shape[1:]).transpose(1, 2)
    y = F.scaled_dot_product_attention(q_tiles, windows(k), windows(v), attn_mask=allowed, scale=1.0)
    return y.transpose(1, 2).reshape(n_tiles * ATTN_BLOCK, *q.shape[1:])[:seq_len]


class TiledWindowAttention:
    """The CPU attention: same mask semantics as FlexWindowAttention, via one batched SDPA over tiles."""

    mask = staticmethod(local_window_mask)

    def __call__(self, q, k, v, mask, scale):
        return local_window_attention(q, k, v, mask, scale)


SOFTCAP_CHUNK = 512  # rows of logits alive at once in the CPU loss


def chunked_softcap_loss(x, w, targets, with_grads):
    """Summed cross-entropy of the softcapped logits of x @ w.T, SOFTCAP_CHUNK rows at a time;
    with_grads also forms d loss / d x and d loss / d w on the way. On CPU, eager elementwise passes
    over full (tokens, vocab) logits dominate; on GPU the compiled graph fuses them instead."""
    grad_x = torch.empty_like(x) if with_grads else None
    grad_w = torch.zeros_like(w) if with_grads else None
    total = x.new_zeros((), dtype=torch.float32)
    for start in range(0, x.size(0), SOFTCAP_CHUNK):
        xc, tc = x[start: start + SOFTCAP_CHUNK], targets[start: start + SOFTCAP_CHUNK]
        rows = torch.arange(tc.numel(), device=x.device)
        logits = (xc @ w.T).float().div_(SOFTCAP_WIDTH).sigmoid_().mul_(SOFTCAP)
        # d logits / d z = SOFTCAP * s (1 - s) / SOFTCAP_WIDTH with s = logits / SOFTCAP,
        # i.e. logits * (SOFTCAP - logits) / (SOFTCAP * SOFTCAP_WIDTH) = logits * (30 - logits) / 225
        slope = torch.rsub(logits, SOFTCAP).mul_(logits) if with_grads else None
        target_logits = logits[rows, tc]
        probs = logits.exp_()  # logits lie in (0, SOFTCAP): exp cannot overflow, no max-subtraction needed
        sum_exp = probs.sum(dim=1)
        total += (sum_exp.log() - target_logits).sum()
        if with_grads:
            probs.mul_(sum_exp.reciprocal_()[:, None])
            probs[rows, tc] -= 1
            grad_logits = probs.mul_(slope)
            grad_x[start: start + SOFTCAP_CHUNK] = (grad_logits @ w.float()).div_(SOFTCAP * SOFTCAP_WIDTH).to(x.dtype)
            grad_w += (grad_logits.T @ xc.float()).div_(SOFTCAP * SOFTCAP_WIDTH).to(w.dtype)
    return total, grad_x, grad_w


class ChunkedSoftcapLoss(torch.autograd.Function):
    """chunked_softcap_loss as an autograd op: gradients come from the forward pass, so no
    (tokens, vocab) tensor outlives one chunk."""

    @staticmethod
    def forward(ctx, x, w, targets):
        total, grad_x, grad_w = chunked_softcap_loss(x, w, targets, with_grads=True)
        ctx.save_for_backward(grad_x, grad_w)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_x, grad_w = ctx.saved_tensors
        return grad_x * grad_total, grad_w * grad_total, None


def chunked_softcap_cross_entropy(x, weight, targets, training, use_fp8):
    """softcap_cross_entropy for the CPU: same values, chunked (use_fp8 is ignored: no FP8 on CPU)."""
    if training:
        return ChunkedSoftcapLoss.apply(x, weight, targets)
    return chunked_softcap_loss(x, weight, targets, with_grads=False)[0] / x.size(0)


CPU_POLAR_EXPRESS = dict(use_triton=False, dtype=torch.float32)


def use_cpu_fallbacks(model):
    model.attention = TiledWindowAttention()
    model.head_loss = chunked_softcap_cross_entropy
    model.use_fp8 = False
    return model


def check_fp8_device(hp, device):
    if hp.fp8 == "on" and device.type != "cuda":
        raise ConfigError("--fp8 on needs a CUDA device (the CPU path has no FP8 head); use --fp8 auto or off")


def build_model(hp, device):
    """The model on `device`: the GPU paths (bf16 embeddings and gates as in the reference, FP8 head
    where supported or forced) on CUDA, the CPU fallbacks (fp32) on a CPU."""
    check_fp8_device(hp, device)
    model = GPT(hp.vocab_size, hp.num_layers, hp.num_heads, hp.head_dim, hp.model_dim, hp.window_block_tokens).to(device)
    if device.type != "cuda":
        return use_cpu_fallbacks(model)
    return use_gpu_paths(model, use_fp8=hp.fp8 == "on" or (hp.fp8 == "auto" and fp8_supported(device)),
                         attention=FlexWindowAttention(compile_kernel=not hp.compile))


def use_gpu_paths(model, use_fp8, attention):
    """The GPU paths: bf16 embeddings and gates (as in the reference), the FP8 head if use_fp8, `attention`."""
    for p in [model.lm_head.weight, *model.value_embeds, model.smear_gate_w,
              *(block.attn.gate_w for block in model.blocks if block.attn is not None)]:
        p.data = p.data.to(torch.bfloat16)
    model.use_fp8 = use_fp8
    model.attention = attention
    return model

# ----------------------------------------------------------------------------------------------
# Optimizers: Polar Express orthogonalization (symmetric-product Triton kernels on GPU), NorMuon for
# the hidden matrices and gates, sharded DistAdam for the embedding/head, value embeddings and scalars,
# and the record's wiring of them (make_optimizers, step_optimizers)

def xxt_torch(X, out=None):
    """X @ X.mT for (m, n) or (batch, m, n)."""
    return torch.matmul(X, X.mT, out=out)


def ba_plus_caa_torch(A, b, c, out=None):
    """b*A + c*(A @ A) for symmetric (m, m) or (batch, m, m)."""
    addmm = torch.baddbmm if A.ndim == 3 else torch.addmm
    # A.mT == A; the transposed view takes oneDNN's fast bf16 path on CPUs without
    # native bf16 (the plain A @ A layout is ~10x slower there); free on GPU
    return addmm(A, A.mT, A, beta=b, alpha=c, out=out)


# Both outputs are symmetric ((XXᵀ)ᵀ = XXᵀ; A = Aᵀ ⇒ (A·A)ᵀ = A·A), so each kernel
# computes only the output blocks (i, j) with i >= j and stores every off-diagonal
# block a second time, transposed, at (j, i): ~half the FLOPs of a full matmul.
# Tile configurations (BLOCK_M, BLOCK_K, warps, stages). On GPU the autotuner picks one per matrix size
# (a 768x768 Gram matrix is only 21 tiles of 128 for 132 SMs: smaller tiles fill the GPU); under the
# Triton interpreter (CPU tests) the first one runs, and tests can pick any.
SYM_CONFIGS = [(64, 64, 4, 3), (64, 32, 4, 4), (128, 64, 8, 3), (128, 32, 8, 4), (64, 64, 8, 4)]

if HAS_TRITON:

    @triton.jit
    def _lower_tri_block(pid):
        # linear pid -> (i, j), i >= j, row by row over the lower triangle of blocks;
        # the float sqrt guess is corrected by one step either way
        i = ((tl.sqrt((8 * pid + 1).to(tl.float32)) - 1.0) * 0.5).to(tl.int32)
        i = tl.where(i * (i + 1) // 2 > pid, i - 1, i)
        i = tl.where((i + 1) * (i + 2) // 2 <= pid, i + 1, i)
        return i, pid - i * (i + 1) // 2

    @triton.jit
    def _store_symmetric(C, acc, rm, rn, pid_m, pid_n, M, s_cm, s_cn):
        acc = acc.to(C.dtype.element_ty)
        mask = (rm[:, None] < M) & (rn[None, :] < M)
        tl.store(C + rm[:, None] * s_cm + rn[None, :] * s_cn, acc, mask=mask)
        if pid_m != pid_n:  # mirror; the diagonal block is written once (deterministic)
            mask_t = (rn[:, None] < M) & (rm[None, :] < M)
            tl.store(C + rn[:, None] * s_cm + rm[None, :] * s_cn, tl.trans(acc), mask=mask_t)

    @triton.jit
    def _xxt_kernel(X, C, M, K, s_xb, s_xm, s_xk, s_cb, s_cm, s_cn,
                    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_m, pid_n = _lower_tri_block(tl.program_id(0))
        batch = tl.program_id(1).to(tl.int64)
        X += batch * s_xb
        C += batch * s_cb
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_M + tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            x_m = tl.load(X + rm[:, None] * s_xm + kk[None, :] * s_xk,
                          mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
            x_n = tl.load(X + rn[:, None] * s_xm + kk[None, :] * s_xk,
                          mask=(rn[:, None] < M) & (kk[None, :] < K), other=0.0)
            acc = tl.dot(x_m, tl.trans(x_n), acc)
        _store_symmetric(C, acc, rm, rn, pid_m, pid_n, M, s_cm, s_cn)

    @triton.jit
    def _ba_plus_caa_kernel(A, C, M, b, c, s_ab, s_am, s_an, s_cb, s_cm, s_cn,
                            BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_m, pid_n = _lower_tri_block(tl.program_id(0))
        batch = tl.program_id(1).to(tl.int64)
        A += batch * s_ab
        C += batch * s_cb
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_M + tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, M, BLOCK_K):
            kk = k0 + rk
            a_mk = tl.load(A + rm[:, None] * s_am + kk[None, :] * s_an,
                           mask=(rm[:, None] < M) & (kk[None, :] < M), other=0.0)
            a_kn = tl.load(A + kk[:, None] * s_am + rn[None, :] * s_an,
                           mask=(kk[:, None] < M) & (rn[None, :] < M), other=0.0)
            acc = tl.dot(a_mk, a_kn, acc)
        a_mn = tl.load(A + rm[:, None] * s_am + rn[None, :] * s_an,
                       mask=(rm[:, None] < M) & (rn[None, :] < M), other=0.0)
        acc = b * a_mn.to(tl.float32) + c * acc
        _store_symmetric(C, acc, rm, rn, pid_m, pid_n, M, s_cm, s_cn)


if HAS_TRITON:
    _AUTOTUNED = {
        kernel: triton.autotune([triton.Config({"BLOCK_M": bm, "BLOCK_K": bk}, num_warps=w, num_stages=st)
                                 for bm, bk, w, st in SYM_CONFIGS], key=key)(kernel)
        for kernel, key in ((_xxt_kernel, ["M", "K"]), (_ba_plus_caa_kernel, ["M"]))}


def _sym_launch(kernel, inp, out, *args, config=None):
    """Launch a lower-triangle kernel on (m, k) / (batch, m, k) input, output (.., m, m); autotuned on
    GPU unless `config` (one of SYM_CONFIGS) is given."""
    assert inp.ndim in (2, 3), f"expected a 2D or 3D tensor, got shape {tuple(inp.shape)}"
    M = inp.size(-2)
    if out is None:
        out = inp.new_empty(*inp.shape[:-1], M)
    x3, o3 = (inp, out) if inp.ndim == 3 else (inp.unsqueeze(0), out.unsqueeze(0))

    def grid(meta):
        nb = triton.cdiv(M, meta["BLOCK_M"])
        return nb * (nb + 1) // 2, x3.size(0)

    if config is None and os.environ.get("TRITON_INTERPRET") == "1":
        config = SYM_CONFIGS[0]
    if config is None:
        _AUTOTUNED[kernel][grid](x3, o3, M, *args, *x3.stride(), *o3.stride())
    else:
        block_m, block_k, warps, stages = config
        kernel[grid](x3, o3, M, *args, *x3.stride(), *o3.stride(), BLOCK_M=block_m, BLOCK_K=block_k,
                     num_warps=warps, num_stages=stages)
    return out


def xxt_triton(X, out=None, config=None):
    """X @ X.mT via Triton (one triangle computed, mirrored); fp32 accumulation."""
    return _sym_launch(_xxt_kernel, X, out, X.size(-1), config=config)


def ba_plus_caa_triton(A, b, c, out=None, config=None):
    """b*A + c*(A @ A) for symmetric A via Triton (one triangle computed, mirrored)."""
    assert A.size(-1) == A.size(-2), f"A must be square, got shape {tuple(A.shape)}"
    return _sym_launch(_ba_plus_caa_kernel, A, out, float(b), float(c), config=config)


# Polar Express per-step (a, b, c): X <- a X + (b A + c A²) X with A = X Xᵀ
POLAR_EXPRESS_COEFFS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


GPU_POLAR_EXPRESS = dict(use_triton=HAS_TRITON, dtype=torch.bfloat16)


def polar_express(G, use_triton=HAS_TRITON, dtype=torch.bfloat16):
    """Approximate orthogonalization (polar factor) of G (..., m, n) in `dtype`; the symmetric
    products run as Triton kernels (GPU) or torch matmuls. Defaults: the GPU path."""
    xxt, ba_plus_caa = (xxt_triton, ba_plus_caa_triton) if use_triton else (xxt_torch, ba_plus_caa_torch)
    tall = G.size(-2) > G.size(-1)
    if tall:  # work on the wide side so the Gram matrix A is the smaller one
        G = G.mT
    lead, (m, n) = G.shape[:-2], G.shape[-2:]
    X = G.reshape(-1, m, n).to(dtype, memory_format=torch.contiguous_format)
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * 1.02 + 1e-6)
    A, B, Y = X.new_empty(X.size(0), m, m), X.new_empty(X.size(0), m, m), torch.empty_like(X)
    for a, b, c in POLAR_EXPRESS_COEFFS:
        xxt(X, out=A)
        ba_plus_caa(A, b, c, out=B)
        torch.baddbmm(X, B.mT, X, beta=a, out=Y)  # a·X + B·X in one call (B.mT == B, see above)
        X, Y = Y, X
    X = X.reshape(*lead, m, n)
    return X.mT if tall else X


def dist_ready():
    return dist.is_available() and dist.is_initialized()


def world_info():
    return (dist.get_rank(), dist.get_world_size()) if dist_ready() else (0, 1)


class ScheduledOptimizer:
    """What the training loop asks of every optimizer: param_groups (dicts holding "params", "lr" and
    "initial_lr"), set_schedule() before each step, step() after the step's last backward (it reduces
    the gradients over the ranks itself), zero_grad(), and a state_dict() that does not depend on the
    world size (collective when distributed) with its load_state_dict()."""

    param_groups: list

    def set_schedule(self, lr_multiplier, momentum):
        """This step's lr: each group's initial lr x the multiplier (`momentum` is NorMuon's)."""
        for group in self.param_groups:
            group["lr"] = group["initial_lr"] * lr_multiplier

    def zero_grad(self):
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    def step(self):
        raise NotImplementedError

    def state_dict(self):
        raise NotImplementedError

    def load_state_dict(self, state):
        raise NotImplementedError


class NorMuon(ScheduledOptimizer):
    """Momentum -> Polar Express -> per-row/column variance normalization -> cautious decoupled decay.

    Parameters of one shape are stacked (sorted by label, so a rank's chunk holds contiguous runs of
    one kind); each rank owns a contiguous chunk of the stack (zero-padded so the chunks are equal),
    receives its gradients by reduce-scatter, updates them, and all-gathers the new weights. A stack
    of at least two matrices per rank is split in two groups. step() starts every group's
    reduce-scatter, then updates the groups smallest first, so each group's Polar Express overlaps the
    later groups' communication. Gradients, momentum and second moments keep the parameter's dtype
    (fp32 matrices; bf16 gates on GPU), as in the reference. `polar` holds polar_express's options:
    GPU_POLAR_EXPRESS, or CPU_POLAR_EXPRESS on a CPU.
    """

    def __init__(self, params, lr, weight_decay, momentum, beta2=0.95, polar=GPU_POLAR_EXPRESS):
        self.rank, self.world_size = world_info()
        self.polar = polar
        params = list(params)
        self.param_groups = [self._group(stack, lr, weight_decay, momentum, beta2)
                             for stack in stacked_groups(params, self.world_size)]
        self._order = {p: index for index, p in enumerate(params)}  # the state_dict's layout

    def set_schedule(self, lr_multiplier, momentum):
        super().set_schedule(lr_multiplier, momentum)
        for group in self.param_groups:
            group["momentum"] = momentum

    def _group(self, params, lr, weight_decay, momentum, beta2):
        rows, cols = params[0].shape
        chunk = -(-len(params) // self.world_size)
        padding = [0.0] * (chunk * self.world_size - len(params))

        def per_param(values):
            return torch.tensor(values + padding, dtype=torch.float32, device=params[0].device)

        return dict(
            params=params, lr=lr, initial_lr=lr, weight_decay=weight_decay, momentum=momentum, beta2=beta2, chunk=chunk,
            # NorMuon normalizes per row for tall/square matrices and gates, per column for wide matrices.
            reduce_dim=-1 if rows >= cols or params[0].label == "gate" else -2,
            # step size multiplier sqrt(max(1, rows/cols)) x the parameter's lr_mul (stored shape)
            lr_scale=per_param([max(1.0, rows / cols) ** 0.5 * q.lr_mul for q in params]),
            wd_scale=per_param([q.wd_mul for q in params]),
            momentum_buffer=None, second_moment=None)

    def _owned(self, group):
        """Global indices [start, stop) of this rank's chunk and how many of them are real parameters."""
        start = self.rank * group["chunk"]
        return start, start + group["chunk"], max(0, min(len(group["params"]), start + group["chunk"]) - start)

    def _stack(self, tensors, group):
        shape = group["params"][0].shape
        out = torch.zeros(group["chunk"] * self.world_size, *shape, dtype=tensors[0].dtype, device=tensors[0].device)
        torch.stack(tensors, out=out[: len(tensors)])
        return out

    def _reduce(self, group):
        """Start the reduce-scatter (AVG) of a group's stacked gradients: (this rank's chunk, handle)."""
        grads = self._stack([p.grad for p in group["params"]], group)
        if self.world_size == 1:
            return grads, None
        local = grads.new_empty(group["chunk"], *grads.shape[1:])
        return local, dist.reduce_scatter_tensor(local, grads, op=dist.ReduceOp.AVG, async_op=True)

    @torch.no_grad()
    def step(self):
        pending = [self._reduce(group) for group in self.param_groups]
        gathers = []
        for group, (local, handle) in zip(self.param_groups, pending):
            if handle is not None:
                handle.wait()
            new_weights = self._update_chunk(group, local)
            if self.world_size > 1:
                full = new_weights.new_empty(group["chunk"] * self.world_size, *new_weights.shape[1:])
                gathers.append((group, full, dist.all_gather_into_tensor(full, new_weights, async_op=True)))
            else:
                gathers.append((group, new_weights, None))
        for group, full, handle in gathers:
            if handle is not None:
                handle.wait()
            for p, new in zip(group["params"], full):
                p.copy_(new)

    def _update_chunk(self, group, grad):
        """Steps 1-5 of NorMuon on this rank's chunk (consumed in place); returns the chunk's new weights."""
        start, stop, n_real = self._owned(group)
        params = group["params"][start: start + n_real]
        if group["momentum_buffer"] is None:
            group["momentum_buffer"] = torch.zeros_like(grad)
            moment_shape = list(grad.shape)
            moment_shape[group["reduce_dim"]] = 1
            group["second_moment"] = grad.new_zeros(moment_shape)
        mu = group["momentum"]
        buf = group["momentum_buffer"]
        buf.lerp_(grad, 1 - mu)
        nesterov = grad.lerp_(buf, mu)
        update = torch.zeros_like(grad, dtype=self.polar["dtype"])
        for label, lo, hi in label_runs([p.label for p in params]):
            # the merged attention weight is four matrices (Q, K, V, O) for both steps
            update[lo:hi] = normuon_direction(nesterov[lo:hi], group["second_moment"][lo:hi], 4 if label == "attn" else 1,
                                              group["reduce_dim"], group["beta2"], self.polar)
        weights = torch.zeros_like(grad, dtype=torch.float32)
        if n_real:
            torch.stack([p.float() for p in params], out=weights[:n_real])
        lr = group["lr"]
        lr_factor = (group["lr_scale"][start:stop] * lr).view(-1, 1, 1)
        wd_factor = (group["wd_scale"][start:stop] * group["weight_decay"] * lr).view(-1, 1, 1)
        mask = (update * weights) >= 0  # cautious: decay only where the update agrees with the weight's sign
        weights = weights - weights * mask * wd_factor * lr_factor - update * lr_factor
        return weights.to(group["params"][0].dtype)

    def state_dict(self):
        """Each parameter's momentum and second moment, in the order the parameters were given: the
        same at any world size or grouping. Identical on every rank; collective when distributed."""
        state = {key: [None] * len(self._order) for key in ("momentum_buffer", "second_moment")}
        for group in self.param_groups:
            for key in ("momentum_buffer", "second_moment"):
                if group[key] is not None:
                    full = gather_chunks(group[key], self.world_size)
                    for p, value in zip(group["params"], full):  # zip stops before the padding
                        state[key][self._order[p]] = value.cpu().clone()
        return {"name": "normuon", **state}

    def load_state_dict(self, state):
        if state.get("name") != "normuon" or any(len(state[key]) != len(self._order)
                                                 for key in ("momentum_buffer", "second_moment")):
            raise ValueError("NorMuon state does not match the parameters of this model")
        for group in self.param_groups:
            start, stop, n_real = self._owned(group)
            for key in ("momentum_buffer", "second_moment"):
                values = [state[key][self._order[p]] for p in group["params"]]
                if values[0] is None:
                    group[key] = None
                    continue
                local = values[0].new_zeros(group["chunk"], *values[0].shape, device=group["params"][0].device)
                for i, value in enumerate(values[start: start + n_real]):
                    local[i] = value
                group[key] = local


def stacked_groups(params, world_size):
    """NorMuon's communication groups: parameters of one shape (sorted by label), split in two when
    each rank can still own one of each half; smallest groups first. Each group is stacked, padded to
    a multiple of the world size and cut into equal per-rank chunks."""
    by_shape = {}
    for p in params:
        by_shape.setdefault(tuple(p.shape), []).append(p)
    groups = []
    for shape, same_shape in sorted(by_shape.items(), key=lambda kv: math.prod(kv[0]) * len(kv[1])):
        same_shape = sorted(same_shape, key=lambda q: q.label)  # stable: keeps model order per label
        if any((q.label == "gate") != (same_shape[0].label == "gate") for q in same_shape):
            raise ValueError(f"NorMuon: gates and matrices share the shape {shape}; give them different shapes")
        parts = 2 if len(same_shape) >= 2 * world_size else 1
        chunk = -(-len(same_shape) // (parts * world_size))
        groups += [same_shape[start: start + chunk * world_size] for start in range(0, len(same_shape), chunk * world_size)]
    return groups


def gather_chunks(local, world_size):
    if world_size == 1:
        return local
    full = local.new_empty(local.shape[0] * world_size, *local.shape[1:])
    dist.all_gather_into_tensor(full, local.contiguous())
    return full


def label_runs(labels):
    """[(label, start, stop)] for the maximal runs of equal consecutive labels."""
    runs = []
    for i, label in enumerate(labels):
        if runs and runs[-1][0] == label:
            runs[-1][2] = i + 1
        else:
            runs.append([label, i, i + 1])
    return [tuple(run) for run in runs]


def normuon_direction(stack, second_moment, pieces, reduce_dim, beta2, polar):
    """Polar Express, then variance normalization, of a (n, rows, cols) stack of one kind of matrix,
    each matrix treated as `pieces` row blocks of its own (second_moment is updated in place)."""
    n, rows, cols = stack.shape
    if pieces > 1 and reduce_dim != -1:
        raise ValueError("NorMuon: split matrices must be normalized per row")
    update = polar_express(stack.reshape(n * pieces, rows // pieces, cols), **polar)
    moment = second_moment.view(n * pieces, -1, second_moment.size(-1))
    return normalize_variance(update, moment, reduce_dim, beta2).view(n, rows, cols)


def normalize_variance(update, second_moment, reduce_dim, beta2):
    """NorMuon: divide by a running RMS along one axis, then restore each matrix's Frobenius norm.
    Norms come from the per-axis means of squares (as the reference computes them); the result keeps
    the dtype of `update`."""
    mean_square = update.float().square().mean(dim=reduce_dim, keepdim=True)
    axis_len = update.size(reduce_dim)
    norm_before = mean_square.sum(dim=(-2, -1), keepdim=True).mul_(axis_len).sqrt_()
    second_moment.lerp_(mean_square.to(second_moment.dtype), 1 - beta2)
    step = second_moment.clamp_min(1e-10).rsqrt()
    norm_after = ((mean_square * axis_len) * step.float().square()).sum(dim=(-2, -1), keepdim=True).sqrt_()
    return update * (step * (norm_before / norm_after.clamp_min(1e-10))).type_as(update)


def ema_(average, value, beta):
    """average <- beta * average + (1 - beta) * value, in place (an Adam moment, a Shampoo factor)."""
    return average.mul_(beta).add_(value, alpha=1 - beta)


def ema_square_(average, value, beta):
    """average <- beta * average + (1 - beta) * value^2, in place (Adam's second moment)."""
    return average.mul_(beta).addcmul_(value, value, value=1 - beta)


def adam_direction(m, v, t, beta1, beta2, eps):
    """Adam's bias-corrected direction m_hat / (sqrt(v_hat) + eps) at step t (>= 1); DistAdam's
    reference formula differs on purpose (eps on the uncorrected sqrt(v))."""
    return (m / (1 - beta1 ** t)) / ((v / (1 - beta2 ** t)).sqrt() + eps)


FLOAT32_MAX = torch.finfo(torch.float32).max


class DistAdam(ScheduledOptimizer):
    """ZeRO-1 Adam: each rank keeps bf16 moments for its slice of dim 0 of every parameter. A first
    dimension that does not divide by the world size is padded with zero rows in the communication
    buffers and the moments (the parameter keeps its shape). step() starts every parameter's
    reduce-scatter (AVG), then per parameter waits, updates its slice and all-gathers it.
    """

    def __init__(self, params, lr, betas, eps, weight_decay):
        self.rank, self.world_size = world_info()
        self.param_groups = [dict(params=[p], lr=lr, initial_lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                  step=0, exp_avg=None, exp_avg_sq=None) for p in params]

    def _padded(self, t):
        """t with zero rows appended up to a multiple of the world size (t itself if none are needed)."""
        missing = -t.shape[0] % self.world_size
        return t if missing == 0 else torch.cat([t, t.new_zeros(missing, *t.shape[1:])])

    def _slice(self, t):
        """This rank's rows of a padded tensor."""
        rows = t.shape[0] // self.world_size
        return t[self.rank * rows: (self.rank + 1) * rows]

    def _reduce(self, p):
        """Start the reduce-scatter (AVG) of p's gradient: (this rank's rows, handle); alone: (p.grad, None)."""
        if self.world_size == 1:
            return p.grad, None
        grad = self._padded(p.grad.contiguous())
        local = grad.new_empty(grad.shape[0] // self.world_size, *grad.shape[1:])
        return local, dist.reduce_scatter_tensor(local, grad, op=dist.ReduceOp.AVG, async_op=True)

    @torch.no_grad()
    def step(self):
        pending = [self._reduce(group["params"][0]) for group in self.param_groups]
        gathers = []
        for group, (grad, handle) in zip(self.param_groups, pending):
            p = group["params"][0]
            if handle is not None:
                handle.wait()
            weights = self._padded(p)
            shard = self._slice(weights)
            new_shard = self._adam_update(group, grad.float(), shard.to(torch.float32, copy=True), p)
            if self.world_size == 1:
                shard.copy_(new_shard)
                continue
            full = p if weights is p else torch.empty_like(weights)
            gathers.append((p, full, dist.all_gather_into_tensor(full, new_shard.to(p.dtype), async_op=True)))
        for p, full, handle in gathers:
            handle.wait()
            if full is not p:
                p.copy_(full[: p.shape[0]])

    def _adam_update(self, group, grad, weight, p):
        """The reference's Adam step with cautious decay, in fp32 (moments stored in bf16); `weight` is
        an fp32 copy of this rank's slice and is updated in place."""
        beta1, beta2 = group["betas"]
        if group["exp_avg"] is None:
            group["exp_avg"] = torch.zeros_like(weight, dtype=torch.bfloat16)
            group["exp_avg_sq"] = torch.zeros_like(weight, dtype=torch.bfloat16)
        group["step"] += 1
        t = group["step"]
        lr = group["lr"] * p.lr_mul  # the parameter's own learning rate
        exp_avg = ema_(group["exp_avg"].float(), grad, beta1)
        exp_avg_sq = ema_square_(group["exp_avg_sq"].float(), grad, beta2)
        group["exp_avg"].copy_(exp_avg)
        group["exp_avg_sq"].copy_(exp_avg_sq)
        # unlike adam_direction, eps is added to the uncorrected sqrt(v) and both bias corrections live in
        # the step size, as in the reference
        step_size = lr * ((1 - beta2 ** t) ** 0.5 / (1 - beta1 ** t))
        update = exp_avg.div_(exp_avg_sq.sqrt_().add_(group["eps"])).mul_(step_size)
        mask = (update * weight) >= 0  # cautious: decay only where the update agrees with the weight's sign
        # decay factor lr * (lr * wd * wd_mul): it follows the square of the parameter's own lr (an
        # absurd lr saturates the factor instead of raising, so the run stops with the non-finite-loss hint)
        update.addcmul_(weight, mask, value=min(lr * group["weight_decay"] * p.wd_mul * lr, FLOAT32_MAX))
        return weight.sub_(update)

    def state_dict(self):
        """Full moments (all ranks' slices gathered, the padding cut off); collective when distributed."""
        groups = []
        for group in self.param_groups:
            rows = group["params"][0].shape[0]
            entry = {"step": group["step"]}
            for key in ("exp_avg", "exp_avg_sq"):
                entry[key] = None if group[key] is None else \
                    gather_chunks(group[key], self.world_size)[:rows].cpu().clone()
            groups.append(entry)
        return {"groups": groups}

    def load_state_dict(self, state):
        if len(state["groups"]) != len(self.param_groups) or any(
                entry[key] is not None and entry[key].shape != group["params"][0].shape
                for group, entry in zip(self.param_groups, state["groups"]) for key in ("exp_avg", "exp_avg_sq")):
            raise ValueError("DistAdam state does not match the parameters of this model")
        for group, entry in zip(self.param_groups, state["groups"]):
            group["step"] = entry["step"]
            p = group["params"][0]
            for key in ("exp_avg", "exp_avg_sq"):
                group[key] = None if entry[key] is None else self._slice(self._padded(entry[key].to(p.device))).clone()


def split_params_for_optimizers(model):
    """NorMuon: hidden matrices and gates. DistAdam, in order: head/embedding, value embeddings, scalars."""
    muon = [p for p in model.parameters() if p.label in ("attn", "mlp", "gate")]
    adam = [model.lm_head.weight, *model.value_embeds, model.scalars]
    covered = [id(p) for p in muon + adam]
    if sorted(covered) != sorted(id(p) for p in model.parameters()) or len(set(covered)) != len(covered):
        raise AssertionError("optimizer parameter sets must cover every model parameter exactly once")
    return muon, adam


def make_optimizers(model, hp):
    """(matrix optimizer, DistAdam) for the model's parameters. The matrix optimizer is NorMuon (the
    record; its Polar Express takes the fp32 torch path on a CPU) or a track-3 optimizer."""
    matrix_params, adam_params = split_params_for_optimizers(model)
    adam = DistAdam(adam_params, hp.adam_lr, hp.adam_betas, hp.adam_eps, hp.adam_wd)
    if hp.matrix_optimizer != "normuon":
        return make_track3_optimizer(hp.matrix_optimizer, matrix_params, hp), adam
    on_cpu = model.lm_head.weight.device.type == "cpu"
    return NorMuon(matrix_params, hp.muon_lr, hp.muon_wd, hp.muon_momentum[0], hp.muon_beta2,
                   polar=CPU_POLAR_EXPRESS if on_cpu else GPU_POLAR_EXPRESS), adam


def step_optimizers(step, matrix_opt, adam):
    """The matrix optimizer every step; DistAdam on odd steps (its gradients accumulate over two steps)."""
    matrix_opt.step()
    matrix_opt.zero_grad()
    if adam_steps_at(step):
        adam.step()
        adam.zero_grad()


# ----------------------------------------------------------------------------------------------
# Track-3 optimizers for --matrix_optimizer (Shampoo, SOAP, AdamW), registered in TRACK3_OPTIMIZERS

# Each parameter is cut into blocks (the merged attention weight into Q, K, V and O first); blocks go
# to ranks by a greedy heaviest-first assignment over a cost model; one reduce-scatter brings each
# rank the gradients of its blocks, one all-gather brings everyone the updated blocks.


def merge_dims(shape, max_dim, target=1):
    """Drop size-1 dimensions, then merge neighbours from the right while the product stays within
    max_dim and at least `target` dimensions remain: (1, 2, 5, 1) -> (10,); (32, 3, 64, 64) with
    max_dim 8192 and target 2 -> (96, 4096)."""
    dims = [d for d in shape if d > 1] or [1]
    merged = [dims[-1]]
    for i in range(len(dims) - 2, -1, -1):  # i dimensions are still to the left of this one
        if dims[i] * merged[0] <= max_dim and i + len(merged) >= target:
            merged[0] *= dims[i]
        else:
            merged.insert(0, dims[i])
    return tuple(merged)


def split_dims(shape, max_dim):
    """Blocks of at most max_dim along every dimension: a list of per-dimension slices per block
    (5 x 3 split by 2 -> 3 x 2 = 6 blocks)."""
    per_dim = [[slice(start, min(start + max_dim, size)) for start in range(0, size, max_dim)] for size in shape]
    blocks = [[]]
    for options in per_dim:
        blocks = [block + [s] for block in blocks for s in options]
    return [tuple(block) for block in blocks]


def block_cost(shape, model):
    """Relative work and memory of a block's preconditioner. 'bytes': its factor matrices in fp32, each
    side aligned to 8; 'poly': eigendecompositions (d^3 per side) plus applying them (numel x sum d)."""
    if model == "bytes":
        return sum(4 * (-(-d // 8) * 8) ** 2 for d in shape)
    return sum(d ** 3 for d in shape) + math.prod(shape) * sum(shape)


def assign_blocks(costs, numels, world_size, capacity=None):
    """Greedy, heaviest block first, to the rank with the least cost so far whose gradient elements
    stay within `capacity` (else to the rank with the fewest elements). Returns each block's rank."""
    owner = [0] * len(costs)
    heap = [(0.0, rank) for rank in range(world_size)]
    elements = [0] * world_size
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        skipped = []
        while heap:
            load, rank = heapq.heappop(heap)
            if capacity is None or elements[rank] + numels[i] <= capacity:
                break
            skipped.append((load, rank))
        else:  # nobody has room: the least-filled rank takes it (more padding)
            rank = min(range(world_size), key=lambda r: elements[r])
            load = next(l for l, r in skipped if r == rank)
            skipped.remove((load, rank))
        owner[i] = rank
        elements[rank] += numels[i]
        for item in skipped + [(load + costs[i], rank)]:
            heapq.heappush(heap, item)
    return owner


def symmetric_eigh(matrix):
    """(eigenvalues, eigenvectors) of a symmetric matrix in fp32, retried in fp64 when fp32 fails to converge."""
    try:
        return torch.linalg.eigh(matrix.float())
    except torch.linalg.LinAlgError:
        return tuple(t.float() for t in torch.linalg.eigh(matrix.double()))


def inverse_root(matrix, root, eps):
    """(matrix + eps I)^(-1/root) of a symmetric PSD matrix via its eigendecomposition."""
    values, vectors = symmetric_eigh(matrix)
    scale = (values.clamp_min(0) + eps).pow(-1 / root)
    return (vectors * scale) @ vectors.T


def gram(grad, side):
    """G Gᵀ (side 0) or Gᵀ G (side 1) of a 2-D block; g gᵀ of a 1-D one."""
    if grad.ndim == 1:
        return torch.outer(grad, grad)
    return grad @ grad.T if side == 0 else grad.T @ grad


@dataclass(frozen=True)
class ParamBlock:
    param: int  # index into the optimizer's parameters
    rows: slice  # the piece of the parameter (a Q/K/V/O quarter of the attention weight, or all of it)
    shape: tuple  # the piece viewed with merged dimensions
    index: tuple  # the block within that view
    numel: int

    def of(self, tensor):
        """The block as a view of `tensor` (the parameter or its gradient)."""
        return tensor[self.rows].view(self.shape)[self.index]


class BlockOptimizer(ScheduledOptimizer):
    """Blocks, their assignment to ranks and the communication of the track-3 optimizers; subclasses
    define the per-block update (`direction`). Each rank keeps state only for its own blocks. One lr
    for every matrix: NorMuon's per-parameter lr_mul and shape factor are part of NorMuon."""

    name = "block optimizer"

    def __init__(self, params, lr, betas, weight_decay, max_dim, cost):
        self.rank, self.world_size = world_info()
        self.params = list(params)
        self.param_groups = [dict(params=self.params, lr=lr, initial_lr=lr, betas=betas, weight_decay=weight_decay)]
        self.blocks = []
        for index, p in enumerate(self.params):
            pieces = 4 if p.label == "attn" else 1
            height = p.shape[0] // pieces
            for piece in range(pieces):
                rows = slice(piece * height, (piece + 1) * height)
                shape = merge_dims((height, *p.shape[1:]), max_dim, target=2)
                for sub in split_dims(shape, max_dim):
                    numel = math.prod(s.stop - s.start for s in sub)
                    self.blocks.append(ParamBlock(index, rows, shape, sub, numel))
        # no rank receives more gradient elements than NorMuon sends it for the same parameters
        capacity = sum(-(-len(g) // self.world_size) * g[0].numel() for g in stacked_groups(self.params, self.world_size)) \
            if self.world_size > 1 else None
        costs = [block_cost(tuple(s.stop - s.start for s in b.index), cost) for b in self.blocks]
        owner = assign_blocks(costs, [b.numel for b in self.blocks], self.world_size, capacity)
        self.rank_blocks = [[i for i, r in enumerate(owner) if r == rank] for rank in range(self.world_size)]
        self.segment = max(sum(self.blocks[i].numel for i in mine) for mine in self.rank_blocks)
        self.step_count = 0
        self.state = {}  # block index -> its tensors (own blocks only)

    def _pack(self, get, rank_blocks, dtype):
        """The blocks' values (get(block) -> tensor) laid out rank after rank, padded to equal segments."""
        flat = torch.zeros(len(rank_blocks) * self.segment, dtype=dtype, device=self.params[0].device)
        for rank, mine in enumerate(rank_blocks):
            offset = rank * self.segment
            for i in mine:
                block = self.blocks[i]
                flat[offset: offset + block.numel] = get(block).reshape(-1)
                offset += block.numel
        return flat

    @torch.no_grad()
    def step(self):
        self.step_count += 1
        group = self.param_groups[0]
        grads = self._pack(lambda b: b.of(self.params[b.param].grad), self.rank_blocks, torch.float32)
        if self.world_size > 1:
            local = grads.new_empty(self.segment)
            dist.reduce_scatter_tensor(local, grads, op=dist.ReduceOp.AVG)
        else:
            local = grads
        mine = self.rank_blocks[self.rank]
        updated, offset = torch.zeros_like(local), 0
        for i in mine:
            block = self.blocks[i]
            p = self.params[block.param]
            g = local[offset: offset + block.numel].view(block.of(p).shape)
            weight = block.of(p).float()
            direction = self.direction(i, g)
            new = weight if direction is None else \
                weight * (1 - group["lr"] * group["weight_decay"]) - group["lr"] * direction
            updated[offset: offset + block.numel] = new.reshape(-1)
            offset += block.numel
        full = updated
        if self.world_size > 1:
            full = updated.new_empty(self.world_size * self.segment)
            dist.all_gather_into_tensor(full, updated)
        for rank, blocks in enumerate(self.rank_blocks):
            offset = rank * self.segment
            for i in blocks:
                block = self.blocks[i]
                target = block.of(self.params[block.param])
                target.copy_(full[offset: offset + block.numel].view(target.shape))
                offset += block.numel

    def direction(self, i, grad):
        """The block's update direction from its averaged gradient (None: leave the block as it is)."""
        raise NotImplementedError

    def _new_state(self, grad):
        raise NotImplementedError

    def _block_state(self, i, grad):
        """Block i's state tensors, made (zeros) at its first step."""
        if i not in self.state:
            self.state[i] = self._new_state(grad)
        return self.state[i]

    def state_dict(self):
        """Every block's state (all ranks' gathered, keyed by block index: the same at any world size)."""
        state = {i: {k: v.cpu().clone() if torch.is_tensor(v) else v for k, v in s.items()}
                 for i, s in self.state.items()}
        if self.world_size > 1:
            parts = [None] * self.world_size
            dist.all_gather_object(parts, state)
            state = {i: s for part in parts for i, s in part.items()}
        return {"name": self.name, "step": self.step_count, "blocks": state}

    def load_state_dict(self, state):
        if state.get("name") != self.name or any(i >= len(self.blocks) or not self._fits(i, s)
                                                 for i, s in state["blocks"].items()):
            raise ValueError(f"{self.name} state does not match this optimizer and model")
        self.step_count = state["step"]
        device = self.params[0].device
        self.state = {i: {k: v.to(device) if torch.is_tensor(v) else v for k, v in state["blocks"][i].items()}
                      for i in self.rank_blocks[self.rank] if i in state["blocks"]}

    def _fits(self, i, block_state):
        """Whether a saved block state has the entries and shapes this optimizer makes for block i
        (a checkpoint of another version of the script may not)."""
        block = self.blocks[i]
        expected = self._new_state(torch.empty(block.of(self.params[block.param]).shape, device="meta"))
        return block_state.keys() == expected.keys() and \
            all(getattr(block_state[k], "shape", None) == getattr(expected[k], "shape", None) for k in expected)


class FactoredOptimizer(BlockOptimizer):
    """Shampoo's and SOAP's common part: per block, the factors L = EMA(G Gᵀ) and R = EMA(Gᵀ G) (one
    factor for a 1-D block), each with a matrix derived from it (`derived`: inverse root or eigenbasis),
    stored in `state_dtype` ("fp32" or "bf16"), plus momentum and an Adam-style second moment (`second`);
    subclasses name the last two state entries."""

    def __init__(self, params, lr, betas, weight_decay, eps, max_dim, precondition_frequency,
                 state_dtype="fp32", cost="bytes"):
        super().__init__(params, lr, betas, weight_decay, max_dim, cost)
        self.eps, self.frequency = eps, precondition_frequency
        self.state_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[state_dtype]

    def _new_state(self, grad):
        state = {"momentum": torch.zeros_like(grad), self.second: torch.zeros_like(grad)}
        for d, size in enumerate(grad.shape):
            state[f"factor{d}"] = grad.new_zeros(size, size, dtype=self.state_dtype)
            state[f"{self.derived}{d}"] = grad.new_zeros(size, size, dtype=self.state_dtype)
        return state

    def _accumulate_factor(self, state, grad, d, beta2):
        """factor_d <- beta2 factor_d + (1 - beta2) (G Gᵀ or Gᵀ G), computed in fp32; returns the fp32 factor."""
        factor = ema_(state[f"factor{d}"].float(), gram(grad, d), beta2)
        state[f"factor{d}"].copy_(factor)
        return factor


class Shampoo(FactoredOptimizer):
    """Shampoo with Adam grafting: factors L = EMA(G Gᵀ), R = EMA(Gᵀ G) (bias-corrected), inverse roots
    L^(-1/4), R^(-1/4) refreshed every `precondition_frequency` steps f, momentum on the gradient, the
    preconditioned direction rescaled per block to the norm of Adam's direction, then decoupled weight
    decay. A 1-D block has one factor and exponent -1/2. The refreshes fall on steps 1, 1 + f, 1 + 2f, ...,
    so there is a root from the first step; Meta's Distributed Shampoo computes its roots on the
    multiples of f (f, 2f, ...) after its start_preconditioning_step: the same interval, another phase."""

    name, derived, second = "shampoo", "root", "graft"

    def __init__(self, params, lr, betas, weight_decay, eps, max_dim, precondition_frequency, graft_beta2, graft_eps,
                 state_dtype="fp32", cost="bytes"):
        super().__init__(params, lr, betas, weight_decay, eps, max_dim, precondition_frequency, state_dtype, cost)
        self.graft_beta2, self.graft_eps = graft_beta2, graft_eps

    def direction(self, i, grad):
        beta1, beta2 = self.param_groups[0]["betas"]
        t = self.step_count
        state = self._block_state(i, grad)
        for d in range(grad.ndim):
            factor = self._accumulate_factor(state, grad, d, beta2)
            if (t - 1) % self.frequency == 0:
                state[f"root{d}"].copy_(inverse_root(factor / (1 - beta2 ** t), 2 * grad.ndim, self.eps))
        momentum = ema_(state["momentum"], grad, beta1)
        adam = adam_direction(momentum, ema_square_(state["graft"], grad, self.graft_beta2), t, beta1,
                              self.graft_beta2, self.graft_eps)
        filtered = momentum / (1 - beta1 ** t)
        roots = [state[f"root{d}"].float() for d in range(grad.ndim)]
        shampoo = roots[0] @ filtered @ roots[1] if grad.ndim == 2 else roots[0] @ filtered
        return shampoo * (adam.norm() / shampoo.norm().clamp_min(1e-30))


class SOAP(FactoredOptimizer):
    """SOAP: Adam run in the eigenbasis of Shampoo's factors, with decoupled weight decay. As in the
    published SOAP, a gradient enters the factors only after it has been used, so the basis never holds
    the gradient it rotates: a block's first step only builds its basis (an eigendecomposition, no
    update). After every `precondition_frequency` Adam steps the basis takes one power-iteration step
    and a QR decomposition from where it was, its directions (and the second moment's entries with
    them) ordered by their estimated eigenvalues: a slowly turning basis whose second moment still fits
    it. Momentum lives in the parameter's basis, the second moment in the rotated one."""

    name, derived, second = "soap", "basis", "second"

    def _new_state(self, grad):
        # adam_steps: a Python int (reading it never waits for a GPU); -1 while the block has no basis.
        # A block behind a zero-initialized weight (Q, K, V behind O, the MLP's input behind its output)
        # has an exactly zero first gradient; a basis built from a zero factor would be arbitrary, and
        # power iterations every few steps would take most of the run to repair it.
        return dict(super()._new_state(grad), adam_steps=-1)

    def direction(self, i, grad):
        beta1, beta2 = self.param_groups[0]["betas"]
        state = self._block_state(i, grad)
        steps = state["adam_steps"]
        t = steps + 1 if steps >= 0 else 0  # this step's Adam step number (0: building the basis)
        if t == 0 and not grad.any():
            return None  # still no basis (a zero gradient leaves the zero factors as they are)
        update = self._adam_in_basis(state, grad, t, beta1, beta2) if t > 0 else None
        for d in range(grad.ndim):
            factor = self._accumulate_factor(state, grad, d, beta2)
            if t == 0:
                state[f"basis{d}"].copy_(symmetric_eigh(factor)[1])
            elif t % self.frequency == 0:
                self._turn_basis(state, factor, d)
        state["adam_steps"] = t
        return update

    def _turn_basis(self, state, factor, d):
        """basis_d <- QR(factor_d @ basis_d) with the directions sorted by estimated eigenvalue, largest first."""
        basis = state[f"basis{d}"].float()
        order = torch.argsort((basis * (factor @ basis)).sum(0), descending=True)  # diag(Bᵀ F B)
        state["second"].copy_(state["second"].index_select(d, order))
        state[f"basis{d}"].copy_(torch.linalg.qr(factor @ basis[:, order]).Q)

    def _adam_in_basis(self, state, grad, t, beta1, beta2):
        bases = [state[f"basis{d}"].float() for d in range(grad.ndim)]

        def rotate(x):
            return bases[0].T @ x @ bases[1] if x.ndim == 2 else bases[0].T @ x

        def unrotate(x):
            return bases[0] @ x @ bases[1].T if x.ndim == 2 else bases[0] @ x

        momentum = ema_(state["momentum"], grad, beta1)
        second = ema_square_(state["second"], rotate(grad), beta2)
        return unrotate(adam_direction(rotate(momentum), second, t, beta1, beta2, self.eps))


class AdamW(BlockOptimizer):
    """AdamW (bias-corrected, decoupled weight decay), the track's baseline; blocks are whole pieces."""

    name = "adamw"

    def __init__(self, params, lr, betas, weight_decay, eps):
        super().__init__(params, lr, betas, weight_decay, max_dim=2 ** 62, cost="poly")
        self.eps = eps

    def direction(self, i, grad):
        beta1, beta2 = self.param_groups[0]["betas"]
        t = self.step_count
        state = self._block_state(i, grad)
        return adam_direction(ema_(state["m"], grad, beta1), ema_square_(state["v"], grad, beta2), t, beta1, beta2,
                              self.eps)

    def _new_state(self, grad):
        return dict(m=torch.zeros_like(grad), v=torch.zeros_like(grad))


# --matrix_optimizer NAME -> (class, {constructor argument: Hyperparameters field}): a new track-3
# optimizer is its class, its fields in Hyperparameters and one entry here.
FACTOR_FLAGS = dict(max_dim="factor_max_dim", state_dtype="factor_dtype", cost="factor_block_cost")
TRACK3_OPTIMIZERS = {
    "shampoo": (Shampoo, dict(lr="shampoo_lr", betas="shampoo_betas", weight_decay="shampoo_wd", eps="shampoo_eps",
                              precondition_frequency="shampoo_precondition_frequency",
                              graft_beta2="shampoo_graft_beta2", graft_eps="shampoo_graft_eps", **FACTOR_FLAGS)),
    "soap": (SOAP, dict(lr="soap_lr", betas="soap_betas", weight_decay="soap_wd", eps="soap_eps",
                        precondition_frequency="soap_precondition_frequency", **FACTOR_FLAGS)),
    "adamw": (AdamW, dict(lr="adamw_lr", betas="adamw_betas", weight_decay="adamw_wd", eps="adamw_eps")),
}
MATRIX_OPTIMIZERS = ("normuon", *TRACK3_OPTIMIZERS)


def make_track3_optimizer(name, params, hp):
    cls, flags = TRACK3_OPTIMIZERS[name]
    return cls(params, **{argument: getattr(hp, flag) for argument, flag in flags.items()})

# ----------------------------------------------------------------------------------------------
# Schedules: everything that changes with the step (record: 1995 scheduled steps in thirds + 40 extension)


# The float expressions below follow the reference recipe's schedule functions operation for
# operation, so every step gets bit-identical values (e.g. int(3 * (step / n)), not 3 * step // n).


def stage_at(step, hp):
    """0, 1, 2 for the thirds of the scheduled steps, 3 for the extension."""
    n = hp.num_scheduled_iterations
    return 3 if step >= n else int(3 * (step / n))


def batch_size_at(step, hp):
    return (*hp.batch_sizes, hp.batch_sizes[-1])[stage_at(step, hp)]


def window_blocks_at(step, hp):
    """(short, long) attention windows in blocks: short = long // 2 blocks, as in the reference."""
    long = (*hp.window_blocks, hp.extension_window_blocks)[stage_at(step, hp)]
    return long // 2, long


def final_window_blocks(hp):
    """The final validation widens only the long window (no YaRN); the short one stays at the extension's."""
    return hp.extension_window_blocks // 2, hp.final_val_window_blocks


def lr_multiplier_at(step, hp):
    """Stage multiplier (it switches only once progress is strictly past 1/3 and 2/3, one step after
    the batch size does), then a linear cooldown over the last cooldown_frac of the scheduled steps
    to final_lr_multiplier, which also holds during the extension."""
    n = hp.num_scheduled_iterations
    if step > n:
        return hp.final_lr_multiplier
    progress = step / n
    multiplier = hp.lr_multipliers[0]
    if progress > 1 / 3:
        multiplier = hp.lr_multipliers[1]
    if progress > 2 / 3:
        multiplier = hp.lr_multipliers[2]
    if hp.cooldown_frac > 0 and progress >= 1 - hp.cooldown_frac:
        weight = (1 - progress) / hp.cooldown_frac
        return multiplier * weight + (1 - weight) * hp.final_lr_multiplier
    return multiplier


def muon_momentum_at(step, hp):
    """Linear warm-up from start to end value; back to the start value over the final steps."""
    low, high = hp.muon_momentum
    cooldown_start = hp.num_scheduled_iterations + hp.num_extension_iterations - hp.muon_momentum_cooldown_steps
    if step < hp.muon_momentum_warmup_steps:
        return low + step / hp.muon_momentum_warmup_steps * (high - low)
    if step > cooldown_start:
        return high - (step - cooldown_start) / hp.muon_momentum_cooldown_steps * (high - low)
    return high


def adam_steps_at(step):
    """DistAdam updates on odd steps only; its gradients accumulate over the two steps."""
    return step % 2 == 1


def stage_first_steps(hp):
    """The first step of every stage (what the compile warm-up visits)."""
    total = hp.num_scheduled_iterations + hp.num_extension_iterations
    return [s for s in range(total) if s == 0 or stage_at(s, hp) != stage_at(s - 1, hp)]


def apply_schedule(step, hp, model, *optimizers):
    """Set what changes with the step: each optimizer's lr multiplier and momentum (set_schedule) and YaRN
    on the model's rotary embedding. Returns (batch size, windows)."""
    lr_multiplier, momentum = lr_multiplier_at(step, hp), muon_momentum_at(step, hp)
    for optimizer in optimizers:
        optimizer.set_schedule(lr_multiplier, momentum)
    windows = window_blocks_at(step, hp)
    model.rotary.follow_window(windows[1] * hp.window_block_tokens)
    return batch_size_at(step, hp), windows

# ----------------------------------------------------------------------------------------------
# Training loop: setup, warm-up, timed steps, validation, checkpoints, logs

SEPARATOR = "=" * 100
CHECKPOINT_MAGIC = b"SPEEDRUN-CKPT-1\n"
CHECKPOINT_KEYS = {"step", "training_time_ms", "tokens_seen", "model", "matrix", "adam", "loader", "rng", "script_sha256",
                   "world_size", "hyperparameters"}
# Dense bf16 peak FLOP/s assumed for MFU (vendor figures, no sparsity), by device-name substring.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "L40S": 362e12, "4090": 165e12}


class RunLog:
    """Rank 0 writes lines to stdout and logs/<run_id>.txt; other ranks stay quiet. The log starts
    with the script, a separator, the environment (with the script's sha256, so a log whose script
    was cut short or edited is detected) and another separator."""

    def __init__(self, path, enabled):
        self.path, self.enabled = path, enabled
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                f = path.open("x", encoding="utf-8")  # exclusive: two runs never share (or overwrite) a log
            except FileExistsError:
                raise ConfigError(f"{path} exists: the run id {path.stem!r} is taken; pass another --run_id "
                                  f"(or none for a fresh one)") from None
            with f:
                f.write(script_source())
                f.write(f"{SEPARATOR}\n{environment_report()}script_sha256 {script_sha256()}\n{SEPARATOR}\n")

    def __call__(self, line, console=True):
        if not self.enabled:
            return
        if console:
            print(line, flush=True)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(line + "\n")


def environment_report():
    lines = [f"python {platform.python_version()}  torch {torch.__version__}  cuda {torch.version.cuda}  "
             f"triton {triton.__version__ if HAS_TRITON else 'not installed'}  host {platform.node()}"]
    try:
        lines.append(subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20).stdout.rstrip())
    except (OSError, subprocess.SubprocessError):
        cpu = next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                    if l.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
        lines.append(f"no nvidia-smi; CPU: {cpu}, {os.cpu_count()} cores")
    return "\n".join(lines) + "\n"


def script_source():
    """This script's text as logged (always ending with a newline)."""
    source = Path(__file__).read_text(encoding="utf-8")
    return source if source.endswith("\n") else source + "\n"


def script_sha256():
    """The sha256 of the logged script: written into logs and checkpoints, checked on replay and resume."""
    return hashlib.sha256(script_source().encode("utf-8")).hexdigest()


def save_checkpoint(path, payload):
    """Serialize, checksum, write atomically: a crash leaves the previous file intact."""
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    data = buffer.getvalue()
    write_atomically(Path(path), CHECKPOINT_MAGIC + hashlib.sha256(data).hexdigest().encode() + b"\n" + data)


def load_checkpoint(path):
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read checkpoint ({e.strerror})")
    header_len = len(CHECKPOINT_MAGIC) + 65
    if not raw.startswith(CHECKPOINT_MAGIC) or len(raw) < header_len:
        raise DataError(f"{path}: not a speedrun checkpoint (bad header); pass a file written by --save_every")
    digest, data = raw[len(CHECKPOINT_MAGIC): header_len - 1].decode(), raw[header_len:]
    if hashlib.sha256(data).hexdigest() != digest:
        raise DataError(f"{path}: checkpoint is corrupt or truncated (checksum mismatch); resume from an earlier one")
    try:
        snap = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    except Exception as e:  # a sound file whose contents this torch cannot read
        raise DataError(f"{path}: cannot load the checkpoint ({type(e).__name__}); it may come from another torch version")
    missing = CHECKPOINT_KEYS - set(snap) if isinstance(snap, dict) else CHECKPOINT_KEYS
    if missing:
        raise DataError(f"{path}: not a checkpoint of this trainer (missing {', '.join(sorted(missing))})")
    return snap


# Settings that may differ when resuming: they do not change the training trajectory, except
# micro_batch_tokens, which only moves the cuts of micro-steps into pieces (resuming logs the change).
RESUME_FREE_FLAGS = {"run_id", "log_dir", "save_every", "save_checkpoint", "resume", "force", "profile", "cpu_threads",
                     "val_loss_every", "warmup_steps", "device", "compile", "fp8", "seed", "train_files", "val_files",
                     "synthetic_fallback", "cycle_data", "val_tokens", "val_batch_size", "micro_batch_tokens",
                     "plan_memory", "gpu_memory_gb"}
MODEL_SHAPE_FLAGS = ("vocab_size", "num_layers", "num_heads", "head_dim", "model_dim", "matrix_optimizer")


def _flags(values, names):
    return ", ".join(f"--{name} {_flag_text(tuple(values[name]) if isinstance(values[name], list) else values[name])}"
                     for name in names)


def check_resumable(path, snap, hp, total_steps):
    """Refuse, in one line, a checkpoint that a run with `hp` cannot continue faithfully."""
    ours, theirs = dataclasses.asdict(hp), snap["hyperparameters"]
    theirs = {"matrix_optimizer": "normuon", **theirs}
    shape = [name for name in MODEL_SHAPE_FLAGS if ours[name] != theirs.get(name)]
    if shape:
        raise ConfigError(f"{path} holds a model and optimizer state with {_flags(theirs, shape)} but this run has "
                          f"{_flags(ours, shape)}; pass the checkpoint's settings to resume it")
    if snap["step"] > total_steps:
        raise ConfigError(f"{path} is at step {snap['step']}, past this run's last step {total_steps}; "
                          f"resume an earlier checkpoint or lengthen the run")
    if hp.force:
        return
    if snap["script_sha256"] != script_sha256():
        raise ConfigError(f"{path} was written by a different train_gpt.py; pass --force to resume anyway")
    changed = [name for name in ours if name not in RESUME_FREE_FLAGS and ours[name] != theirs.get(name)]
    if changed:
        raise ConfigError(f"{path} was written with {_flags(theirs, changed)} but this run has {_flags(ours, changed)}; "
                          f"pass the same settings, or --force to continue with the new ones")


def setup_distributed(hp):
    """torchrun (RANK/WORLD_SIZE set) or a single plain process; NCCL on CUDA, gloo on CPU. The device
    follows the node-local rank; data and logs follow the global rank."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if hp.device == "cuda" or (hp.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda, but no CUDA device is visible; use --device cpu or auto")
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(f"local rank {local_rank} needs {local_rank + 1} GPUs but {torch.cuda.device_count()} "
                              f"are visible; start fewer processes per node (torchrun --nproc_per_node)")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(hp.cpu_threads or max(1, (os.cpu_count() or 1) // local_world))
    check_fp8_device(hp, device)  # before any log or work: also with --device auto on a machine without CUDA
    if world_size > 1:
        # the first compile on 8 ranks can keep a rank from the next collective for many minutes
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(minutes=30),
                                device_id=device if device.type == "cuda" else None)
    return rank, world_size, device


def resolve_data(hp, rank):
    """(train glob, val glob, description), prefixed by $DATA_PATH. The synthetic corpus replaces the
    data only with --synthetic_fallback, when both globs are left at their defaults and match nothing;
    a glob the user gave that matches nothing is an error."""
    root = Path(os.environ.get("DATA_PATH", "."))
    train, val = str(root / hp.train_files), str(root / hp.val_files)
    defaults = Hyperparameters()
    untouched = (hp.train_files, hp.val_files) == (defaults.train_files, defaults.val_files)
    if hp.synthetic_fallback and untouched and not (glob.glob(train) and glob.glob(val)):
        folder = root / "data" / "synthetic"
        train, val = str(folder / "synthetic_train_*.bin"), str(folder / "synthetic_val_*.bin")
        if rank == 0 and not (glob.glob(train) and glob.glob(val)):
            synthetic_corpus(folder)
        if dist_ready():
            dist.barrier()
        return train, val, f"the synthetic corpus in {folder} (no shards match the default --train_files/--val_files)"
    for flag, pattern in (("--train_files", train), ("--val_files", val)):
        if not glob.glob(pattern):
            raise DataError(f"{flag} {pattern!r} matches no file; download shards with `python data/cached_fineweb10B.py` "
                            f"or pass a glob that matches")
    return train, val, f"train {train}, val {val}"


@contextlib.contextmanager
def failing_together(device):
    """Run a block on every rank; if it fails on any rank, fail on all (one rank stopping alone would
    leave the others waiting in their next collective)."""
    error = None
    try:
        yield
    except (ConfigError, DataError, OSError) as e:
        error = e
    if dist_ready():
        failed = torch.tensor([float(error is not None)], device=device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failed.item() and error is None:
            raise ConfigError("another process stopped during setup (its message is above)")
    if error is not None:
        raise error


def micro_step_pieces(hp, world_size, accum):
    """{tokens of a micro-step per rank: its pieces' lengths} for each batch size of the run."""
    pieces = {}
    for batch in hp.batch_sizes:
        tokens = tokens_per_rank(batch, world_size, accum)
        pieces[tokens] = [stop - start for start, stop in piece_bounds(tokens, hp.micro_batch_tokens or tokens)]
    return pieces


def describe_pieces(pieces):
    return ", ".join(f"{tokens:,} as {len(lengths)} x {'/'.join(f'{n:,}' for n in sorted(set(lengths), reverse=True))}"
                     for tokens, lengths in pieces.items())


def check_batch_splits(hp, world_size, accum):
    """Every training and the validation batch splits evenly over ranks and micro-steps (else one line)."""
    for b in hp.batch_sizes:
        tokens_per_rank(b, world_size, accum)
    tokens_per_rank(hp.val_batch_size, world_size, accum, what="--val_batch_size")


def window_tensors(hp, device):
    """Every (short, long) window pair of the run as a device tensor, made once: the compiled model
    takes the windows as data, so no window change recompiles and no step copies them."""
    pairs = {window_blocks_at(step, hp) for step in stage_first_steps(hp)} | {final_window_blocks(hp)}
    return {pair: torch.tensor(pair, dtype=torch.int32, device=device) for pair in pairs}


def rng_state(device):
    return dict(torch=torch.get_rng_state(), cuda=torch.cuda.get_rng_state_all() if device.type == "cuda" else None)


def set_rng_state(state, device):
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and device.type == "cuda":
        # the writing machine may have had more GPUs than this one (resume on fewer processes)
        for index, cuda_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, index)


class RunStats:
    """Memory high-water marks (training and validation apart) and the throughput/MFU summary."""

    def __init__(self, device):
        self.device = device
        self.peak_bytes = self.eval_peak_bytes = 0  # CUDA peaks before the allocator's last reset

    def reset_peaks(self):
        """Forget the memory peaks so far (warm-up and checks before the timed loop)."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        self.peak_bytes = self.eval_peak_bytes = 0

    @contextlib.contextmanager
    def eval_memory(self):
        """Measure the validation's own CUDA memory peak (the run's overall peak keeps counting)."""
        if self.device.type != "cuda":
            yield
            return
        self.peak_bytes = max(self.peak_bytes, torch.cuda.max_memory_allocated())
        torch.cuda.reset_peak_memory_stats()
        yield
        self.eval_peak_bytes = max(self.eval_peak_bytes, torch.cuda.max_memory_allocated())

    def train_peak_bytes(self):
        return max(self.peak_bytes, torch.cuda.max_memory_allocated()) if self.device.type == "cuda" else 0

    def summary(self, model, hp, tokens_seen, training_time_ms, world_size):
        """The log's closing lines: memory peaks, then tokens/s and MFU."""
        if self.device.type == "cuda":
            lines = [f"peak memory allocated: {self.train_peak_bytes() // 2**20} MiB "
                     f"reserved: {torch.cuda.max_memory_reserved() // 2**20} MiB",
                     f"validation peak memory allocated: {self.eval_peak_bytes // 2**20} MiB"]
        else:
            lines = [f"peak memory (CPU max RSS of rank 0): {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MiB"]
        seconds = training_time_ms / 1000
        tokens_per_s = tokens_seen / seconds if seconds else 0.0
        flops_per_token = model_flops_per_token(model, hp)
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else ""
        peak = next((v for k, v in PEAK_FLOPS.items() if k in name), None) if name else None
        mfu = f"{100 * tokens_per_s * flops_per_token / (peak * world_size):.1f}%" if peak else "n/a (unknown peak FLOP/s)"
        return lines + [f"throughput: {tokens_per_s:,.0f} tokens/s over {tokens_seen:,} tokens; "
                        f"{flops_per_token / 1e9:.2f} GFLOP/token; MFU {mfu}"]


def model_flops_per_token(model, hp):
    """6 x (matmul weights: blocks + head) for forward+backward, plus attention's 12 x layers x hdim x
    mean keys per query (half the average long/short window of the last stage). Embedding lookups are free."""
    matmul = sum(p.numel() for p in model.parameters() if p.label in ("attn", "mlp")) + model.lm_head.weight.numel()
    attn_layers = sum(block.attn is not None for block in model.blocks)
    keys = 0.75 * hp.window_blocks[-1] * hp.window_block_tokens / 2
    return 6 * matmul + 12 * attn_layers * hp.num_heads * hp.head_dim * keys


class StepProfiler:
    """The PyTorch profiler around the --profile START:END steps; a Chrome trace next to the log."""

    def __init__(self, hp, run_id, total_steps, log):
        self.range = _parse_profile_range(hp.profile) if hp.profile else None
        self.trace = Path(hp.log_dir) / f"{run_id}_trace.json"
        self.profiler, self.log, self.text = None, log, hp.profile
        if self.range and self.range[1] >= total_steps:
            log(f"warning: --profile {hp.profile} ends at or after the run's last step ({total_steps}); no trace "
                f"will be written (END must be below it)")

    def at(self, step, rank):
        if self.range is None:
            return
        if step == self.range[0]:
            self.profiler = torch.profiler.profile(record_shapes=True)
            self.profiler.__enter__()
        elif step == self.range[1] and self.profiler is not None:
            self.profiler.__exit__(None, None, None)
            if rank == 0:
                self.profiler.export_chrome_trace(str(self.trace))
                self.log(f"profiler trace of steps {self.text} written to {self.trace}")
            self.profiler = None


class LateLossCheck:
    """Each step's loss is checked for a non-finite value one step late, so the host never waits for the
    GPU: push() starts copying this step's loss and checks the previous one; finish() checks the last."""

    def __init__(self, device):
        self.device, self.pending = device, None

    def push(self, step, loss):
        self.finish()
        if self.device.type != "cuda":
            self.pending = (step, loss, None)
            return
        host = torch.empty((), dtype=loss.dtype, pin_memory=True)
        host.copy_(loss, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self.pending = (step, host, done)

    def finish(self):
        if self.pending is None:
            return
        step, loss, done = self.pending
        self.pending = None
        if done is not None:
            done.synchronize()  # waits for that step only, not for the work queued since
        value = loss.item()
        if not math.isfinite(value):
            raise FloatingPointError(f"training loss is {value} at step {step}; lower the learning rates "
                                     f"(--muon_lr/--adam_lr) or check the data, then rerun")


class Trainer:
    """Holds the run's moving parts: setup in __init__, warm_up(), then run(), the timed loop."""

    def __init__(self, hp, argv=()):
        self.hp = hp
        self.rank, self.world_size, self.device = setup_distributed(hp)
        self.total_steps = hp.num_scheduled_iterations + hp.num_extension_iterations
        with failing_together(self.device):  # everything that can be wrong with the input, before any work
            self.accum = grad_accum_steps(hp, self.world_size)
            check_batch_splits(hp, self.world_size, self.accum)
            self.run_id = hp.run_id or str(uuid.uuid4())
            self.log = RunLog(Path(hp.log_dir) / f"{self.run_id}.txt", self.rank == 0)
            self.log(f"args: {json.dumps(list(argv))}", console=False)
            self.log(f"hyperparameters: {dataclasses.asdict(hp)}", console=False)
            self.log(f"world_size {self.world_size}  grad_accum {self.accum}  device {self.device}")
            if hp.micro_batch_tokens:
                self.log(f"micro_batch_tokens {hp.micro_batch_tokens}: micro-steps of "
                         f"{describe_pieces(micro_step_pieces(hp, self.world_size, self.accum))} tokens")
            train_pattern, val_pattern, data_description = resolve_data(hp, self.rank)
            self.log(f"data: {data_description}")
            self.val_tokens = read_validation_tokens(val_pattern, hp.val_tokens + 1, hp.vocab_size)  # read once
            self.loader = TrainLoader(train_pattern, self.rank, self.world_size, self.device, hp.cycle_data,
                                      vocab_size=hp.vocab_size)
            per_micro_step = max(hp.batch_sizes) // self.accum + self.world_size  # one micro-step comes from one shard
            if per_micro_step > max(self.loader.shard_tokens):
                raise DataError(f"--batch_sizes {max(hp.batch_sizes)} takes {per_micro_step} tokens per micro-step from one "
                                f"shard, but the largest training shard holds {max(self.loader.shard_tokens)}; use "
                                f"smaller batches or larger shards")
            self.resume_from = load_checkpoint(hp.resume) if hp.resume else None
            if self.resume_from is not None:
                check_resumable(hp.resume, self.resume_from, hp, self.total_steps)
        torch.manual_seed(hp.seed)
        self.model = build_model(hp, self.device)
        if self.world_size > 1:
            for p in self.model.parameters():
                dist.broadcast(p.data, 0)
        self.matrix_opt, self.adam = make_optimizers(self.model, hp)
        self.forward = self.model
        if self.device.type == "cuda" and hp.compile:
            torch._dynamo.config.cache_size_limit = 64
            self.forward = torch.compile(self.model, dynamic=False, fullgraph=True)
        self.windows = window_tensors(hp, self.device)
        self.stats = RunStats(self.device)
        self.profiler = StepProfiler(hp, self.run_id, self.total_steps, self.log)
        self.step, self.training_time_ms, self.tokens_seen = 0, 0.0, 0

    # --- one step -------------------------------------------------------------------------
    def schedule(self, step):
        """Set step's lr, momentum and YaRN state; returns its (batch size, windows)."""
        return apply_schedule(step, self.hp, self.model, self.matrix_opt, self.adam)

    def train_step(self, step, batch_size, windows):
        """One optimizer step of `batch_size` tokens (as scheduled for `step`): `accum` micro-batches
        forward and backward (each in pieces of at most --micro_batch_tokens), the optimizers. Returns the
        step's loss summed over ranks, as a device tensor (reading it waits for the GPU); no host-device
        synchronization happens inside."""
        rank_tokens = tokens_per_rank(batch_size, self.world_size, self.accum)
        self.model.train()
        total = torch.zeros((), device=self.device)
        for _ in range(self.accum):
            # the training loss is a sum over tokens, so the pieces' losses add up to the micro-step's
            for inputs, targets, cu_seqlens in self.loader.next_pieces(rank_tokens, self.hp.max_seq_len,
                                                                       self.hp.micro_batch_tokens or rank_tokens):
                loss = self.forward(inputs, targets, cu_seqlens, self.windows[windows]) / self.accum
                loss.backward()
                total += loss.detach()
        if self.world_size > 1:
            dist.all_reduce(total)  # a non-finite loss on any rank stops every rank at the same step
        step_optimizers(step, self.matrix_opt, self.adam)
        self.tokens_seen += rank_tokens * self.accum * self.world_size
        return total

    @torch.no_grad()
    def validate(self, windows):
        """Mean loss over the validation tokens, all ranks together, with the given (short, long) windows."""
        hp = self.hp
        self.model.eval()
        with self.stats.eval_memory():
            losses = [self.forward(*batch, self.windows[windows]) for batch in validation_batches(
                self.val_tokens, hp.val_tokens, hp.val_batch_size, self.rank, self.world_size, self.accum, self.device)]
            loss = torch.stack(losses).mean()
        if self.world_size > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        value = loss.item()
        if not math.isfinite(value):
            raise FloatingPointError(f"validation loss is {value}; lower the learning rates (--muon_lr/--adam_lr) "
                                     f"or check the data, then rerun")
        return value

    # --- state -------------------------------------------------------------------------------
    def snapshot(self):
        """Everything a bit-exact continuation needs (collective when distributed)."""
        return dict(
            step=self.step, training_time_ms=self.training_time_ms, tokens_seen=self.tokens_seen,
            model={k: v.detach().cpu().clone() if torch.is_tensor(v) else v for k, v in self.model.state_dict().items()},
            matrix=self.matrix_opt.state_dict(), adam=self.adam.state_dict(), loader=self.loader.state_dict(),
            rng=rng_state(self.device),
            script_sha256=script_sha256(), world_size=self.world_size, hyperparameters=dataclasses.asdict(self.hp))

    def restore(self, snap):
        self.model.load_state_dict(snap["model"])
        self.matrix_opt.load_state_dict(snap["matrix"])
        self.adam.load_state_dict(snap["adam"])
        self.loader.load_state_dict(snap["loader"])
        set_rng_state(snap["rng"], self.device)
        self.step, self.training_time_ms, self.tokens_seen = snap["step"], snap["training_time_ms"], snap["tokens_seen"]
        self.matrix_opt.zero_grad()
        self.adam.zero_grad()

    def resume(self, path, snap):
        stale = remove_stale_temp_files(Path(path).parent) if self.rank == 0 else []
        if stale:
            self.log(f"removed {len(stale)} temp file(s) of interrupted checkpoint writes in {Path(path).parent}")
        try:
            self.restore(snap)
        except (ValueError, RuntimeError) as e:  # a model or optimizer state of another shape (possible with --force)
            raise ConfigError(f"{path}: {str(e).splitlines()[0]}; resume it with the script that wrote it") from None
        moved = f" (written by {snap['world_size']} processes, continued on {self.world_size})" \
            if snap["world_size"] != self.world_size else ""
        self.log(f"resumed from {path} at step {self.step}{moved}")
        written_with = snap["hyperparameters"].get("micro_batch_tokens", 0)
        if written_with != self.hp.micro_batch_tokens:
            self.log(f"--micro_batch_tokens changes from {written_with} (the checkpoint's run) to "
                     f"{self.hp.micro_batch_tokens}: the same data from here on, cut into other pieces")

    def checkpoint(self, tag):
        """Write a checkpoint (rank 0). A failed periodic write only warns: training goes on and the
        earlier checkpoints stay; a failed final write ends the run."""
        snap = self.snapshot()
        if self.rank != 0:
            return
        path = Path(self.hp.log_dir) / "checkpoints" / self.run_id / f"{tag}.pt"
        try:
            save_checkpoint(path, snap)
        except OSError as e:
            if tag == "final":
                raise
            self.log(f"warning: could not write checkpoint {path} ({e.strerror or e}); training goes on and the "
                     f"earlier checkpoints are kept")
            return
        self.log(f"saved checkpoint {path}")

    def warm_up(self):
        """Compile every batch-size/window variant and the validation pass, then undo it all."""
        initial = self.snapshot()
        for first in stage_first_steps(self.hp):
            for step in range(first, first + self.hp.warmup_steps):
                self.train_step(step, *self.schedule(step))
        self.validate(window_blocks_at(self.total_steps, self.hp))
        self.validate(final_window_blocks(self.hp))
        self.restore(initial)
        self.model.rotary.reset()
        self.synchronize()

    def synchronize(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    # --- the run -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def clock_paused(self):
        """Validation and checkpoints do not count as training time."""
        self.synchronize()
        self.training_time_ms += 1000 * (time.perf_counter() - self.clock_start)
        yield
        self.synchronize()
        self.clock_start = time.perf_counter()

    def log_step(self, step, val_loss=None):
        ms = self.training_time_ms if val_loss is not None else \
            self.training_time_ms + 1000 * (time.perf_counter() - self.clock_start)
        val = f" val_loss:{val_loss:.4f}" if val_loss is not None else ""
        self.log(f"step:{step}/{self.total_steps}{val} train_time:{ms:.0f}ms step_avg:{ms / max(step, 1):.2f}ms")

    def run(self):
        hp = self.hp
        if hp.warmup_steps:
            self.warm_up()
        if self.resume_from is not None:
            self.resume(hp.resume, self.resume_from)
        loss_check = LateLossCheck(self.device)
        val_losses = []
        self.synchronize()
        self.clock_start = time.perf_counter()
        for step in range(self.step, self.total_steps + 1):
            last = step == self.total_steps
            batch_size, windows = self.schedule(step)  # validation sees step s's windows
            if last or (hp.val_loss_every and step % hp.val_loss_every == 0):
                with self.clock_paused():
                    val_losses.append((step, self.validate(final_window_blocks(hp) if last else windows)))
                    self.log_step(step, val_losses[-1][1])
            if last:
                break
            self.profiler.at(step, self.rank)
            loss_check.push(step, self.train_step(step, batch_size, windows))
            self.step = step + 1
            self.log_step(self.step)
            if hp.save_every and self.step % hp.save_every == 0 and self.step < self.total_steps:
                with self.clock_paused():
                    self.checkpoint(f"step_{self.step:06d}")
        loss_check.finish()
        if hp.save_checkpoint:
            self.checkpoint("final")
        for line in self.stats.summary(self.model, hp, self.tokens_seen, self.training_time_ms, self.world_size):
            self.log(line)
        self.loader.close()
        return val_losses

# ----------------------------------------------------------------------------------------------
# Memory plan (--plan_memory): one training step and one validation forward of the run, traced with
# fake tensors (shapes and dtypes, no data: no GPU is touched), counting every tensor storage while it lives

CUDA_BLOCK_BYTES = 512  # the CUDA caching allocator rounds every allocation up to a multiple of this
# The share of --gpu_memory_gb a plan may fill: the rest is for the CUDA context, library workspaces,
# communication buffers and the allocator's fragmentation, none of which the trace sees.
PLAN_USABLE_FRACTION = 0.9
PLAN_PIECE_STEP = ATTN_BLOCK  # --micro_batch_tokens values the plan searches: multiples of the attention tile
GiB = 2 ** 30


class LiveMemory(TorchDispatchMode):
    """The bytes of the tensor storages alive and their peak, as an allocator's 'allocated' counter sees an
    eager run: every storage an op creates while the mode is on (an output sharing no input's storage), and
    every one passed to track(), counts until it dies (a storage keeps one Python object for its whole
    life, so a weak reference to that object says when)."""

    def __init__(self, block_bytes=CUDA_BLOCK_BYTES):
        super().__init__()
        self.block_bytes, self.live, self.peak, self._alive = block_bytes, 0, 0, {}

    def track(self, tensor):
        storage = tensor.untyped_storage()
        ref = self._alive.get(id(storage))
        if ref is not None and ref() is storage:
            return
        size = -(-storage.nbytes() // self.block_bytes) * self.block_bytes
        self._alive[id(storage)] = weakref.ref(storage, functools.partial(self._free, id(storage), size))
        self.live += size
        self.peak = max(self.peak, self.live)

    def _free(self, key, size, ref):
        if self._alive.get(key) is ref:
            del self._alive[key]
            self.live -= size

    def reset_peak(self):
        self.peak = self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in inputs:  # views and in-place ops
                self.track(t)                                                          # make no storage
        return out


class FusedAttentionFootprint(torch.autograd.Function):
    """The memory of a fused attention kernel (compiled FlexAttention, FlashAttention), which a trace cannot
    see into: the forward keeps q, k, v, its output and a float32 log-sum-exp per query and head; the
    backward makes the three gradients and a float32 term per query and head. No score matrix."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:2], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        torch.empty_like(lse)  # the kernel's per-query term, freed when the backward returns
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class PlannedAttention:
    """FlexWindowAttention's memory for the plan; its block mask (a few n_tiles^2 int32) is left out."""

    @staticmethod
    def mask(docs, window_tokens):
        return None

    def __call__(self, q, k, v, mask, scale):
        return FusedAttentionFootprint.apply(q, k, v)


def planned_model(hp, gpu_path):
    """The run's model (made under a FakeTensorMode: no memory): the GPU paths (fused attention's footprint;
    the FP8 head unless --fp8 off) or, for --device cpu, the CPU path."""
    model = GPT(hp.vocab_size, hp.num_layers, hp.num_heads, hp.head_dim, hp.model_dim, hp.window_block_tokens)
    if not gpu_path:
        return use_cpu_fallbacks(model)
    return use_gpu_paths(model, use_fp8=hp.fp8 != "off", attention=PlannedAttention())


@contextlib.contextmanager
def fake_world(world_size):
    """This process as rank 0 of `world_size` ranks whose collectives do nothing (torch's fake process
    group), so the optimizers shard their state as in the real run."""
    if world_size == 1:
        yield
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


class MemoryPlan:
    """Rank 0's memory in one training step and one validation forward of a run of `world_size` processes:
    `static` (parameters, gradients, each optimizer's state) from a traced first step, then each piece length
    traced on demand (piece_figures). Everything runs on fake CPU tensors, so the CPU's kernels are chosen
    where torch picks one by device (e.g. its fused attention for the CPU path's SDPA; the meta device would
    take the unfused one); the GPU path's attention is FusedAttentionFootprint."""

    def __init__(self, hp, world_size, gpu_path=True):
        self.hp, self.world_size, self.gpu_path = hp, world_size, gpu_path
        self.accum = grad_accum_steps(hp, world_size)
        check_batch_splits(hp, world_size, self.accum)
        self.windows = window_blocks_at(hp.num_scheduled_iterations + hp.num_extension_iterations, hp)
        self.fake, self.live = FakeTensorMode(), LiveMemory()
        self._pieces = {}
        with warnings.catch_warnings(), fake_world(world_size), self.fake, self.live:
            self.model = planned_model(hp, gpu_path)
            warnings.simplefilter("ignore")  # deprecation notices of collectives that do nothing here
            for t in [*self.model.parameters(), *self.model.buffers()]:
                self.live.track(t)
            self.static = {"parameters": self.live.live}
            self.optimizers = make_optimizers(self.model, hp)
            if isinstance(self.optimizers[0], NorMuon):  # Triton cannot run on fake tensors; same buffers
                self.optimizers[0].polar = dict(GPU_POLAR_EXPRESS, use_triton=False) if gpu_path else CPU_POLAR_EXPRESS
            self._run_piece(PLAN_PIECE_STEP)
            self.static["gradients"] = sum(self._storage_bytes(p.grad) for p in self.model.parameters())
            self.live.reset_peak()
            for optimizer in self.optimizers:  # an odd step: both optimizers make their state
                before = self.live.live
                optimizer.step()
                self.static[f"optimizer state {type(optimizer).__name__}"] = self.live.live - before
            self.step_peak = self.live.peak
            # the gradients stay: every piece after this one runs with all of them, as a micro-step after
            # the first does (and DistAdam's gradients accumulate over two steps)

    def _storage_bytes(self, tensor):
        return -(-tensor.untyped_storage().nbytes() // self.live.block_bytes) * self.live.block_bytes

    def _run_piece(self, tokens, training=True):
        """One forward of `tokens` positions (and its backward in training) under the tracker: the bytes the
        forward leaves alive, before and after the head ({"trunk": ..., "head": ...})."""
        before, marks = self.live.live, {}
        inputs = [self.fake.from_tensor(t) for t in model_inputs(np.full(tokens + 1, BOS_ID), [tokens], torch.device("cpu"))]
        for t in inputs:  # the batch is made for the piece
            self.live.track(t)
        head_loss = self.model.head_loss

        def head_loss_marked(*args):
            marks["head"] = self.live.live
            return head_loss(*args)

        self.model.head_loss = head_loss_marked
        self.model.train(training)
        try:
            with torch.set_grad_enabled(training):
                loss = self.model(*inputs, self.windows)
            kept = {"trunk": marks["head"] - before, "head": self.live.live - marks["head"]}
            if training:
                loss.backward()
        finally:
            self.model.head_loss = head_loss
        return kept

    def piece_figures(self, tokens):
        """{"trunk", "head": bytes saved for the backward, "peak": the training step's peak} of a piece."""
        if tokens not in self._pieces:
            with self.fake, self.live:
                self.live.reset_peak()
                kept = self._run_piece(tokens)
                self._pieces[tokens] = dict(kept, peak=max(self.live.peak, self.step_peak))
        return self._pieces[tokens]

    def validation_figures(self):
        """(tokens per forward, the peak of a validation forward after an even step: the matrix optimizer's
        gradients are gone (traced with them, then taken off), DistAdam's still accumulate)."""
        tokens = tokens_per_rank(self.hp.val_batch_size, self.world_size, self.accum, what="--val_batch_size")
        with self.fake, self.live:
            self.live.reset_peak()
            self._run_piece(tokens, training=False)
        matrix_grads = sum(self._storage_bytes(p.grad) for group in self.optimizers[0].param_groups
                           for p in group["params"])
        return tokens, self.live.peak - matrix_grads

    def largest_piece(self, micro_batch_tokens):
        hp = dataclasses.replace(self.hp, micro_batch_tokens=micro_batch_tokens)
        return max(max(lengths) for lengths in micro_step_pieces(hp, self.world_size, self.accum).values())

    def largest_fitting_cap(self, budget_bytes, val_peak):
        """The largest --micro_batch_tokens (written as its largest piece, which gives the same pieces) whose
        training peak and val_peak stay within budget_bytes; 0 if the run fits uncut, None if none fits."""
        longest = self.largest_piece(0)
        if val_peak > budget_bytes or self.piece_figures(PLAN_PIECE_STEP)["peak"] > budget_bytes:
            return None
        if self.piece_figures(longest)["peak"] <= budget_bytes:
            return 0
        low, high = 1, longest // PLAN_PIECE_STEP  # multiples of PLAN_PIECE_STEP: low fits, high does not
        while high - low > 1:
            middle = (low + high) // 2
            fits = self.piece_figures(self.largest_piece(middle * PLAN_PIECE_STEP))["peak"] <= budget_bytes
            low, high = (middle, high) if fits else (low, middle)
        return self.largest_piece(low * PLAN_PIECE_STEP)


def plan_report(hp, world_size):
    """The lines --plan_memory prints; the last reads 'predicted peak per GPU: X GiB' (per process on CPU)."""
    gpu_path = hp.device != "cpu"
    plan = MemoryPlan(hp, world_size, gpu_path)
    pieces = micro_step_pieces(hp, world_size, plan.accum)
    piece = plan.largest_piece(hp.micro_batch_tokens)
    figures = plan.piece_figures(piece)
    val_tokens, val_peak = plan.validation_figures()
    paths = f"GPU paths ({'FP8' if hp.fp8 != 'off' else 'bf16'} head, fused attention)" if gpu_path else "CPU path"
    lines = [f"memory plan (predicted: eager accounting, fake tensors) for rank 0 of {world_size} process(es), "
             f"{paths}, {plan.accum} micro-step(s) per step of {describe_pieces(pieces)} tokens"]
    rows = [*plan.static.items(), (f"activations saved, {piece:,}-token piece", figures["trunk"]),
            (f"head logits saved, {piece:,}-token piece", figures["head"]), ("training peak", figures["peak"]),
            (f"validation peak, {val_tokens:,}-token forward", val_peak)]
    lines += [f"  {name:<44} {size / GiB:8.2f} GiB" for name, size in rows]
    peak = max(figures["peak"], val_peak)
    if gpu_path:
        budget = hp.gpu_memory_gb * PLAN_USABLE_FRACTION * GiB
        cap = plan.largest_fitting_cap(budget, val_peak)
        fit = f"largest --micro_batch_tokens that fits --gpu_memory_gb {hp.gpu_memory_gb:g} ({budget / GiB:.1f} GiB usable): "
        if cap is None:
            fit += "none (the validation forward or the static memory alone does not fit; lower --val_batch_size or use more GPUs)"
        elif cap == 0:
            fit += "any: the run fits uncut (0)"
        else:
            cut = micro_step_pieces(dataclasses.replace(hp, micro_batch_tokens=cap), world_size, plan.accum)
            fit += f"{cap} (training peak {plan.piece_figures(cap)['peak'] / GiB:.2f} GiB; micro-steps of {describe_pieces(cut)} tokens)"
        lines.append(fit)
    lines.append(f"predicted peak per {'GPU' if gpu_path else 'process'}: {peak / GiB:.2f} GiB")
    return lines

# ----------------------------------------------------------------------------------------------
# main(): parse, train, and turn bad input into one line


def portable_argv(argv):
    """The command-line arguments with data paths under the working folder made relative to it, so
    a log (and a replay of it) does not name this machine's folders."""
    out, here = [], Path.cwd()
    for i, arg in enumerate(argv):
        if i and argv[i - 1] in ("--train_files", "--val_files", "--resume") and os.path.isabs(arg):
            with contextlib.suppress(ValueError):
                arg = str(Path(arg).relative_to(here))
        out.append(arg)
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    try:
        hp = parse_args(argv)
        if hp.plan_memory:  # before anything touches a GPU; under torchrun, rank 0 prints
            lines = plan_report(hp, int(os.environ.get("WORLD_SIZE", 1)))
            if int(os.environ.get("RANK", 0)) == 0:
                print("\n".join(lines))
            return None
        trainer = Trainer(hp, portable_argv(argv))
        return trainer.run()
    except (ConfigError, DataError, FloatingPointError) as e:
        print(f"train_gpt.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:  # a log or checkpoint folder that cannot be written, a full disk, ...
        where = f"{e.filename}: " if e.filename else ""
        print(f"train_gpt.py: error: {where}{e.strerror or e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("train_gpt.py: error: interrupted; resume from the last checkpoint with --resume", file=sys.stderr)
        sys.exit(130)
    finally:
        if dist_ready():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
