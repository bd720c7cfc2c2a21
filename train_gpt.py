"""speedrun: train a GPT-2-small-class model on FineWeb to val loss <= 3.28, fast.

One file on purpose: records copy it verbatim. The recipe reads straight through: configuration
(Hyperparameters, presets) -> data (shards, BOS-aligned loader, validation batches) -> model (recipe
89's GPT, a LayerPlan per layer, built with a Backend) -> head and losses (FP8 head, softcapped
multi-token loss, FP8 MLP; backend_for) -> optimizers (Polar Express, NorMuon, DistAdam) -> schedule
(Schedule.at(step): a StepPlan) -> training (Trainer). The fence (a line of '=') ends the recipe;
after it: bookkeeping (CLI, log, checkpoints, resume, signals, main()), micro-steps in pieces, CPU
fallbacks. Other tracks live beside this file, loaded only when a flag asks and carried by the log:
track3.py (--matrix_optimizer), ngram_prior.py (--ngram_prior).
Run `./run.sh` (torchrun over all GPUs) or `python train_gpt.py --preset cpu`. Importing registers
two torch ops (speedrun::mm_fp8, speedrun::mm_fp8_backward) and nothing else.
"""

import os
import signal
import sys

if __name__ == "__main__":  # a signal during the slow imports below ends as before the first step
    def _stopped_while_importing(signum, frame):
        if os.environ.get("RANK", "0").strip() in ("", "0"):
            try:
                print(f"train_gpt.py: stopped by {signal.Signals(signum).name} before the first "
                      f"training step; nothing new to save", file=sys.stderr)
            except OSError:  # (no terminal any more: SIGHUP)
                pass
        # 130 as main's Ctrl-C, else PREEMPTED_EXIT_CODE (main's handlers take over later)
        sys.exit(130 if signum == signal.SIGINT else 75)

    for _signal in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP, signal.SIGINT):
        signal.signal(_signal, _stopped_while_importing)

import argparse
import ast
import concurrent.futures
import contextlib
import dataclasses
import datetime
import fcntl
import functools
import glob
import hashlib
import importlib.util
import io
import json
import math
import platform
import re
import resource
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False


# ----------------------------------------------------------------------------------------------
# Configuration: the Hyperparameters dataclass and its presets (the CLI made of it: after the fence)


def hp_field(default, help):
    return field(default=default, metadata={"help": help})


def layers_field(default, help):
    """Layer indices, any number (negative: from the last layer); empty: none."""
    return field(default=default, metadata={"help": help, "layers": True})


@dataclass
class Hyperparameters:
    # data
    train_files: str = hp_field("data/fineweb10B/fineweb_train_*.bin",
                                "glob of training shards (prefixed by $DATA_PATH)")
    val_files: str = hp_field("data/fineweb10B/fineweb_val_*.bin",
                              "glob of validation shards (prefixed by $DATA_PATH)")
    synthetic_fallback: bool = hp_field(False, "if no shards match, generate and use the "
                                               "synthetic corpus in data/synthetic/")
    cycle_data: bool = hp_field(False, "when the training shards run out, start over (else: stop)")
    val_tokens: int = hp_field(10_485_760, "validation tokens (a prefix of the validation shards)")
    val_batch_size: int = hp_field(2_097_152, "validation tokens per step, all ranks together")
    # model shape
    vocab_size: int = hp_field(50257, "vocabulary size; the embedding pads it to a multiple of 128")
    num_layers: int = hp_field(11, "transformer blocks")
    num_heads: int = hp_field(6, "attention heads")
    head_dim: int = hp_field(128, "dimension per head")
    model_dim: int = hp_field(768, "residual stream width")
    # recipe ideas, each switched off by the value after "off:"
    bigram_vocab_size: int = hp_field(754_560, "hashed bigram embedding rows (50304 x 15; off: 0)")
    bigram_dim: int = hp_field(192, "bigram embedding width (added to the stream's first channels)")
    bigram_sign_rows: int = hp_field(8192, "random sign rows multiplying the bigram rows (off: 0)")
    value_embed_layers: tuple = layers_field((1, 2, 8, 9, 10), "layers whose values get a value "
                                                               "embedding (off: none)")
    value_embed_tables: tuple = layers_field((0, 1, 2, 3, 4), "the table each of --value_embed_"
                                                              "layers reads (tables may be shared)")
    value_embed_std: float = hp_field(0.01, "init std of the value embeddings (off: 0, zero init)")
    value_embed_gates: bool = hp_field(True, "per-head gates 2 sigmoid(w . [x, ve][:12]) on the "
                                             "value embeddings")
    paired_head_layers: tuple = layers_field((0, 2, 5, 9), "layers where two heads share one "
                                                           "interleaved stream (off: none)")
    xsa_layers: tuple = layers_field((1, 3, 4, 7, 8, 10), "layers that subtract a gated share of y "
                                                          "along v (off: none)")
    skip_gate: bool = hp_field(True, "the U-net skip's gate reads x0 (off: a learned constant "
                                     "sigmoid(lambda))")
    shared_attention_input: bool = hp_field(True, "layers after the backout layer attend over its "
                                                  "output (off: over their own input)")
    mudd_dim: int = hp_field(64, "hidden width of the MUDD coefficient networks of the last layer "
                                 "and the output (off: 0, a backout lambda instead)")
    sublayer_scalars: bool = hp_field(True, "residual and output lambdas per sublayer, x0 added "
                                            "after attention (off: residual and x0 lambdas before)")
    fp8_mlp: bool = hp_field(True, "MLP matmuls in FP8 (delayed scales) where --fp8 puts the head")
    untie_stage: int = hp_field(2, "stage at whose first odd step the embedding leaves the head "
                                   "(off: -1, tied)")
    softcap_scale: float = hp_field(23.0, "logits -> scale * sigmoid((logits + offset) / 7.5)")
    softcap_offset: float = hp_field(5.0, "the softcap's offset (off: 0)")
    mtp_weights_start: tuple = hp_field((1.0, 0.5, 0.25, 1.0, 0.5, 0.0, 1.0, 0.0, 0.0),
                                        "loss weights of the next 3 tokens at each stage's start, "
                                        "stage after stage (off: 1 0 0 1 0 0 1 0 0)")
    mtp_weights_end: tuple = hp_field((1.0, 0.5, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0),
                                      "the same at each stage's end (linear in between; the "
                                      "extension keeps stage 3's end)")
    head_fp8_amax: tuple = hp_field((100.0, 1.6, 0.75), "largest values the FP8 head casts: "
                                                        "activations, weights, gradients")
    gates_in_adam: bool = hp_field(True, "gates train with DistAdam (off: the matrix optimizer)")
    ngram_prior: float = hp_field(0.0, "weight of a fixed prior added to the softcapped logits: "
                                       "log P(next token) of ngram_prior.py's count model (off: 0)")
    ngram_prior_order: int = hp_field(2, "the prior's order (2 ... 5): contexts of order-1 tokens")
    # batches and schedule
    num_scheduled_iterations: int = hp_field(1380, "steps of the scheduled run (thirds set batch "
                                                   "size, lr, window)")
    num_extension_iterations: int = hp_field(10, "extra steps at the final batch size, window, lr")
    batch_sizes: tuple = hp_field((131072, 262144, 393216), "tokens per step in each third")
    max_seq_len: int = hp_field(2048, "longest document piece in a training batch")
    first_stage_max_seq_len: int = hp_field(896, "longest document piece in the first third (off: "
                                                 "0, --max_seq_len)")
    grad_accum_base: int = hp_field(8, "world size with one micro-step per step; fewer ranks "
                                       "accumulate base/world")
    micro_batch_tokens: int = hp_field(0, "most tokens per forward/backward per rank; longer "
                                          "micro-steps run in pieces (0: no cap)")
    lr_multipliers: tuple = hp_field((1.0, 1.52, 1.73), "lr multiplier in each third")
    cooldown_frac: float = hp_field(0.6, "share of scheduled steps over which lr decays linearly")
    final_lr_multiplier: float = hp_field(0.15, "lr multiplier after cooldown and in the extension")
    window_block_tokens: int = hp_field(128, "tokens per attention-window block")
    window_blocks: tuple = hp_field((3, 7, 11), "long window (blocks) per third; short = long // 2")
    extension_window_blocks: int = hp_field(13, "long window during the extension steps")
    final_val_window_blocks: int = hp_field(20, "long window for the final validation (no YaRN)")
    # record optimizers: NorMuon (hidden matrices and gates), DistAdam (the rest)
    muon_lr: float = hp_field(0.023, "NorMuon learning rate")
    muon_wd: float = hp_field(1.2, "NorMuon cautious weight decay (applied as wd*lr, so it follows "
                                   "lr^2)")
    muon_momentum: tuple = hp_field((0.85, 0.95), "NorMuon momentum: start/end of the warm-up")
    muon_momentum_warmup_steps: int = hp_field(300, "steps of the momentum warm-up")
    muon_momentum_cooldown_steps: int = hp_field(50, "final steps over which momentum returns to "
                                                     "its start value")
    muon_beta2: float = hp_field(0.9, "NorMuon second-moment decay")
    muon_qk_head_pairs: bool = hp_field(True, "NorMuon orthogonalizes Q and K per head pair (off: "
                                              "Q and K whole)")
    adam_lr: float = hp_field(0.008, "DistAdam learning rate")
    adam_betas: tuple = hp_field((0.65, 0.95), "DistAdam betas (of every parameter without "
                                               "--adam_group_betas)")
    adam_group_betas: bool = hp_field(True, "each kind of parameter has its own DistAdam betas "
                                            "(the recipe's table)")
    adam_eps: float = hp_field(1e-10, "DistAdam epsilon")
    adam_wd: float = hp_field(0.005, "DistAdam cautious weight decay")
    # track 3, the optimizer race: the optimizer of hidden matrices and gates (DistAdam: the rest)
    matrix_optimizer: str = hp_field("normuon", "optimizer of the hidden matrices and gates: "
                                                "normuon, or one of track3.py's (docs/track3.md)")
    # run
    seed: int = hp_field(0, "random seed for initialization")
    val_loss_every: int = hp_field(250, "validate every N steps and at the end (0: only the end)")
    warmup_steps: int = hp_field(3, "untimed compile warm-up steps per stage, undone afterwards "
                                    "(0: none)")
    device: str = hp_field("auto", "auto (CUDA when present, else CPU), cuda or cpu")
    compile: bool = hp_field(True, "torch.compile the model (CUDA only; CPU always runs eager)")
    fp8: str = hp_field("auto", "FP8 head (and --fp8_mlp) matmuls in training: auto (CUDA, "
                                "capability >= 8.9), on, off")
    flex_backend: str = hp_field("triton", "FlexAttention's CUDA kernels: triton or flash")
    run_id: str = hp_field("", "name of the log file logs/<run_id>.txt (default: a new uuid)")
    log_dir: str = hp_field("logs", "folder for logs, profiler traces and checkpoints")
    save_every: int = hp_field(0, "write a resumable checkpoint every N steps (even N; 0: never)")
    save_checkpoint: bool = hp_field(False, "write a checkpoint at the end of the run")
    resume: str = hp_field("", "checkpoint to resume from, or auto: the newest sound one of "
                               "--run_id (none: start fresh)")
    force: bool = hp_field(False, "resume even if the checkpoint was written by a different script "
                                  "or with other training settings")
    profile: str = hp_field("", "START:END steps to record with the PyTorch profiler (Chrome trace "
                                "next to the log)")
    cpu_threads: int = hp_field(0, "torch threads per process on CPU (0: cores / local processes)")


# Hyperparameters' sections by their first field: --help and docs/configuration.md group by them.
HP_SECTIONS = {"train_files": "data", "vocab_size": "model shape",
               "bigram_vocab_size": "recipe ideas, each switched off by the value after \"off:\"",
               "num_scheduled_iterations": "batches and schedule",
               "muon_lr": "record optimizers: NorMuon (hidden matrices and gates), "
                          "DistAdam (the rest)", "matrix_optimizer": "track 3, the optimizer race",
               "seed": "run"}

# --preset NAME: values applied before the flags
PRESETS = {
    "record": {},
    "cpu": dict(  # 2 CPU cores: ~440 s with the prior (budget 500 s); tuned on novels
        device="cpu",  # also where CUDA exists (add --device cuda to run it on a GPU)
        synthetic_fallback=True, val_tokens=65_536, val_batch_size=8_192, num_layers=9, num_heads=2,
        head_dim=64, model_dim=128, num_scheduled_iterations=132, num_extension_iterations=4,
        batch_sizes=(2048, 3072, 4096), max_seq_len=1024, grad_accum_base=1,
        window_blocks=(2, 4, 6), extension_window_blocks=7, final_val_window_blocks=8,
        muon_momentum_warmup_steps=20, muon_momentum_cooldown_steps=5, adam_lr=0.005,
        muon_lr=0.00575, val_loss_every=44, warmup_steps=0, bigram_dim=32,
        # layer lists count from the end after the attention-free layer: other depths keep them
        paired_head_layers=(0, 4, -2), xsa_layers=(1, 2, 3, -3, -1),
        value_embed_layers=(1, 2, -3, -2, -1), first_stage_max_seq_len=448,
        lr_multipliers=(1.0, 1.28, 1.41), ngram_prior=1.0, ngram_prior_order=5),
}


class ConfigError(ValueError):
    """A bad flag or combination of flags; main() prints it as one line."""


MTP_HORIZON = 3  # the multi-token-prediction loss weighs the next 1, 2 and 3 tokens
# The smallest --micro_batch_tokens cap: one attention tile. A piece runs its tokens, up to
# --max_seq_len tokens of context and 2 targets, so 128-token pieces already spend ~17 positions per
# token trained at --max_seq_len 2048; smaller caps only multiply the forwards.
MIN_MICRO_BATCH_TOKENS = 128
# The CPU loss sums exp(logits) unshifted in fp32 (the prior's log-probabilities are <= 0). A
# context's likeliest next token may have P = 1 / vocab, so every row's sum stays above 0 while
# --ngram_prior x ln(vocab) <= 87 (exp(-87) ~ fp32's smallest normal): a weight <= 8.04.
PRIOR_EXP_FLOOR = 87.0
MAX_NGRAM_ORDER = 5  # --ngram_prior_order: <= 4 context tokens pack into a uint64 (ngram_prior.py)


def grad_accum_steps(hp, world_size):
    """Same tokens per step at any world size: ranks below the base accumulate, above it split."""
    return hp.grad_accum_base // world_size if hp.grad_accum_base % world_size == 0 else 1


def tokens_per_rank(batch_tokens, world_size, accum, what="--batch_sizes"):
    if batch_tokens % (world_size * accum):
        raise ConfigError(f"{what} value {batch_tokens} does not split over {world_size} ranks x "
                          f"{accum} accumulation steps; use a multiple of {world_size * accum}")
    return batch_tokens // (world_size * accum)


# ----------------------------------------------------------------------------------------------
# Data: .bin shards, BOS-aligned batches (in pieces under --micro_batch_tokens), validation batches


BOS_ID = 50256  # <|endoftext|>: every document starts with it
SHARD_MAGIC, SHARD_VERSION, SHARD_HEADER_INTS = 20240520, 1, 256
GPT2_VOCAB_SIZE = 50257  # shard token ids are GPT-2 ids
BOS_SYNC_TOKENS = 4_000_000  # index this many tokens before returning; the rest in the background


class DataError(ValueError):
    """Missing or corrupt data; main() prints it as one line."""


def read_shard(path, vocab_size=None, max_tokens=None):
    """A .bin shard's tokens (uint16), its header checked against the file size; with vocab_size,
    every id read must be below it; with max_tokens, only that prefix is read."""
    path = Path(path)
    header_bytes = SHARD_HEADER_INTS * 4
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            if size < header_bytes:
                raise DataError(f"{path}: corrupt shard: {size} bytes is shorter than the "
                                f"{header_bytes}-byte header")
            header = np.frombuffer(f.read(header_bytes), dtype="<i4")
            if header[0] != SHARD_MAGIC:
                raise DataError(f"{path}: bad magic {header[0]} (expected {SHARD_MAGIC}); not a "
                                f"GPT-2 token shard")
            if header[1] != SHARD_VERSION:
                raise DataError(f"{path}: unsupported shard version {header[1]} "
                                f"(expected {SHARD_VERSION})")
            n = int(header[2])
            if n < 0:
                raise DataError(f"{path}: corrupt shard: negative token count {n} in the header")
            expected = header_bytes + 2 * n
            if size != expected:
                what = "truncated" if size < expected else "oversized"
                raise DataError(f"{path}: {what} shard: header says {n} tokens ({expected} bytes) "
                                f"but the file has {size} bytes; re-download or re-tokenize it")
            count = n if max_tokens is None else min(n, max_tokens)
            data = f.read(2 * count)
            if len(data) != 2 * count:
                raise DataError(f"{path}: the shard shrank while it was read ({len(data)} of "
                                f"{2 * count} bytes); is another process writing it?")
            tokens = np.frombuffer(data, dtype="<u2")
    except OSError as e:
        raise DataError(f"{path}: cannot read shard ({e.strerror or e})") from None
    if vocab_size is not None and tokens.size and tokens.max() >= vocab_size:
        position = int(np.argmax(tokens >= vocab_size))
        raise DataError(f"{path}: token id {tokens[position]} at position {position} is not below "
                        f"the vocabulary size {vocab_size}")
    return tokens


SHARD_SAMPLES, SHARD_SAMPLE_BYTES = 64, 4096  # shard_fingerprint reads these (256 KiB), the header


class BosIndex:
    """A shard's BOS positions: the first BOS_SYNC_TOKENS at once, the rest on `pool` (a background
    thread), so a new shard is usable at once."""

    def __init__(self, tokens, pool):
        head = np.flatnonzero(tokens[:BOS_SYNC_TOKENS] == BOS_ID)
        self._parts = [head]
        self._rest = None
        if tokens.size > BOS_SYNC_TOKENS:
            self._rest = pool.submit(lambda: np.flatnonzero(tokens[BOS_SYNC_TOKENS:] == BOS_ID)
                                     + BOS_SYNC_TOKENS)

    def available(self, need_all=False):
        """The positions indexed so far (all of them, waiting, with need_all)."""
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
    """Walk BOS positions from `cursor`: rank 0 takes pieces until it has rank_tokens, then rank
    1... A piece runs from a BOS to the next BOS, max_seq_len or the rank's quota. Returns
    ([(starts, lengths)] per rank, next cursor), or None when the BOS list runs out (an incomplete
    index's last BOS, whose end is unknown, is not used)."""
    ends = np.append(bos[cursor + 1:], shard_len) if index_complete else bos[cursor + 1:]
    if len(ends) == 0:
        return None
    lengths = np.minimum(ends - bos[cursor: cursor + len(ends)], max_seq_len)
    cumulative = np.cumsum(lengths)
    plan, taken, first = [], 0, 0
    for _ in range(world_size):
        last = int(np.searchsorted(cumulative, taken + rank_tokens))  # first to reach the quota
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


def bigram_hash(inputs, rows):
    """Record #89's hashed bigram ids of a packed sequence, in its int32 arithmetic (products wrap).
    Row rows - 1 is position 0's; position 1 pairs its token with that id (the reference overwrites
    position 0 before reading it), position t >= 2 with token t - 1, across documents too."""
    mod = rows - 1
    x = inputs.astype(np.int32)
    previous = np.concatenate([[mod], x[1:-1]]).astype(np.int32)
    with np.errstate(over="ignore"):
        hashed = np.bitwise_xor(np.int32(36313) * x[1:], np.int32(27191) * previous) % np.int32(mod)
    return np.concatenate([[mod], hashed]).astype(np.int32)


class Batch(NamedTuple):
    inputs: Tensor  # int32
    targets: Tensor  # int64 (NO_TARGET where a piece has none)
    cu_seqlens: Tensor  # int32, padded to a static length
    bigram_ids: Tensor | None  # int32 hashed bigrams (recipe 89's bigram embedding), or None
    positions: Tensor | None = None  # a micro-step piece's rotary positions (int64), or None
    loss_mask: Tensor | None = None  # a piece's positions whose loss terms count (bool), or None


def to_device(inputs, targets, cu_seqlens, device, bigram_ids=None, positions=None, loss_mask=None):
    """A Batch on `device` (pinned + non_blocking on CUDA)."""
    arrays = [inputs.astype(np.int32), targets.astype(np.int64), cu_seqlens, bigram_ids, positions,
              loss_mask]
    tensors = [None if a is None else torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
    if device.type == "cuda":
        tensors = [None if t is None else t.pin_memory().to(device, non_blocking=True)
                   for t in tensors]
    else:
        tensors = [None if t is None else t.to(device) for t in tensors]
    return Batch(*tensors)


def model_inputs(window, doc_lengths, device, bigram_ids=None):
    """The Batch of a window of tokens (inputs window[:-1], targets window[1:]) whose inputs are
    documents of `doc_lengths` (a longer last one is cut), with the inputs' hashed bigram ids if the
    model has a bigram embedding. Training, validation and the tools all go through here."""
    positions = len(window) - 1
    return to_device(window[:-1], window[1:], padded_cu_seqlens(doc_lengths, positions), device,
                     bigram_ids)


NO_TARGET = -1  # a piece's target where the uncut micro-step has none (padding, past its end)


class TrainLoader:
    """BOS-aligned batches for one rank. Every rank walks the same global plan and keeps its part,
    so ranks never talk about data."""

    def __init__(self, pattern, rank, world_size, device, cycle=False, vocab_size=None, pool=None,
                 bigram_rows=0):
        self.files = sorted(glob.glob(pattern))
        if not self.files:
            raise DataError(f"no training shards match {pattern!r}; download them with "
                            f"`{data_script(pattern)}` or pass --train_files")
        self.shard_tokens, self.fingerprints = [], []
        for path in self.files:  # each readable, with a sound header and tokens, before step 1
            read_shard(path, max_tokens=0)
            self.shard_tokens.append((os.path.getsize(path) - SHARD_HEADER_INTS * 4) // 2)
            if self.shard_tokens[-1] == 0:
                raise DataError(f"{path}: the shard holds no tokens (a header only); remove it or "
                                f"re-tokenize")
            self.fingerprints.append(shard_fingerprint(path))
        self.rank, self.world_size, self.device, self.cycle = rank, world_size, device, cycle
        self.vocab_size = vocab_size  # token ids are checked against it as each shard is read
        self.bigram_rows = bigram_rows  # rows of the model's bigram embedding (0: none)
        self.bigram_ids = None  # the last micro-step's, on the host (DistAdam's sparse exchange)
        self.piece_counts = np.zeros(3, dtype=np.int64)  # next_pieces': tokens, positions, cut docs
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
        self._check_has_text()
        self._prefetch = self._pool.submit(self._load, self._following_shard())

    def _check_has_documents(self):
        if self.bos.available(need_all=True).size == 0:
            raise DataError(f"{self.files[self.shard]}: no document start (token {BOS_ID}) in its "
                            f"{self.tokens.size} tokens; every document must begin with it "
                            f"(re-tokenize the shard)")

    def _check_has_text(self):
        """Refuse a shard of nothing but document tokens (as far as it is indexed)."""
        starts = self.bos.available().size
        if starts == (self.tokens.size if self.bos.complete else BOS_SYNC_TOKENS):
            raise DataError(f"{self.files[self.shard]}: its {'' if self.bos.complete else 'first '}"
                            f"{starts:,} tokens are all the document token {BOS_ID}, documents "
                            f"with no text; re-tokenize the shard")

    def close(self):
        """Stop the background threads (a pending prefetch is dropped)."""
        if isinstance(self._pool, concurrent.futures.Executor):
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _following_shard(self):
        return (self.shard + 1) % len(self.files)

    def state_dict(self):
        return dict(shard=self.shard, cursor=self.cursor, epoch=self.epoch, files=self.files,
                    fingerprints=self.fingerprints)

    def load_state_dict(self, state):
        """Continue where the state was taken. (shard, BOS cursor) is a place in the global walk, so
        it holds at any world size: the next batch starts at the first document no rank trained on.
        Shards match by file name: the data may live elsewhere (another node, DATA_PATH)."""
        if [Path(f).name for f in state["files"]] != [Path(f).name for f in self.files]:
            raise DataError("the training shards differ from those of the checkpoint; pass the "
                            "same --train_files")
        self.reset(state["shard"], state["cursor"], state["epoch"])

    def _advance_shard(self):
        if self.shard + 1 == len(self.files):
            if not self.cycle:
                raise DataError(f"all {len(self.files)} training shards are used up; download "
                                f"more shards (python data/cached_fineweb10B.py N) or pass "
                                f"--cycle_data true")
            self.epoch += 1
        self.shard = self._following_shard()
        self.cursor = 0
        self.tokens, self.bos = self._prefetch.result()
        self._check_has_text()
        self._prefetch = self._pool.submit(self._load, self._following_shard())

    def next_batch(self, rank_tokens, max_seq_len):
        """The Batch of rank_tokens tokens for this rank."""
        return self.next_pieces(rank_tokens, max_seq_len, rank_tokens)[0]

    def next_pieces(self, rank_tokens, max_seq_len, max_piece_tokens):
        """This rank's next micro-step of rank_tokens tokens as one Batch, or, if longer than
        max_piece_tokens, as its pack_documents pieces' Batches. Neither the walk nor the bigram ids
        (hashed over the whole micro-step, as the reference) depend on max_piece_tokens. Counts the
        pieces' tokens, positions and cut documents in self.piece_counts."""
        for _ in range(2 * len(self.files) + 1):
            plan = None
            if not self.bos.complete:
                plan = plan_pieces(self.bos.available(), len(self.tokens), self.cursor,
                                   self.world_size, rank_tokens + 1, max_seq_len,
                                   index_complete=self.bos.complete)
            if plan is None:
                self._check_has_documents()
                plan = plan_pieces(self.bos.available(need_all=True), len(self.tokens), self.cursor,
                                   self.world_size, rank_tokens + 1, max_seq_len)
            if plan is not None:
                break
            self._advance_shard()
        else:
            raise DataError(f"the training shards {self.files[0]}... are too small for "
                            f"{rank_tokens} tokens per rank")
        pieces, self.cursor = plan
        starts, lengths = pieces[self.rank]
        buf = gather_pieces(self.tokens, starts, lengths)
        bigram_ids = bigram_hash(buf[:-1], self.bigram_rows) if self.bigram_rows else None
        self.bigram_ids = bigram_ids
        if rank_tokens <= max_piece_tokens:
            return [model_inputs(buf, lengths, self.device, bigram_ids)]
        bounds, cut = pack_documents(cut_lengths(lengths, 0, rank_tokens), max_piece_tokens)
        length = padded_piece_length(rank_tokens, max_piece_tokens, max_seq_len)
        self.piece_counts += (rank_tokens, length * len(bounds), cut)
        return [piece_inputs(buf, lengths, start, stop, length, self.device, bigram_ids)
                for start, stop in bounds]


def read_validation_tokens(pattern, count, vocab_size=None):
    """The first `count` tokens of the validation shards (in name order), reading no more."""
    files = sorted(glob.glob(pattern))
    if not files:
        raise DataError(f"no validation shards match {pattern!r}; download them with "
                        f"`{data_script(pattern)}` or pass --val_files")
    parts, have = [], 0
    for path in files:
        if have == count:
            break
        parts.append(read_shard(path, vocab_size, max_tokens=count - have))
        have += parts[-1].size
    if have < count:
        raise DataError(f"validation shards {pattern!r} hold {have} tokens, but --val_tokens "
                        f"{count - 1} needs {count} (one more than the inputs: the last target); "
                        f"lower --val_tokens or add validation shards")
    return np.concatenate(parts)


def validation_windows(tokens, val_tokens, val_batch_size, rank, world_size, accum):
    """(window, document lengths) of each validation forward over the first val_tokens of `tokens`,
    in val_batch_size steps; rank r takes its contiguous slice of each step (`accum` forwards). Not
    BOS-aligned; documents still never mix in attention."""
    chunk = tokens_per_rank(val_batch_size, world_size, accum, what="--val_batch_size")
    for start in range(0, val_tokens, chunk * world_size):
        begin = start + rank * chunk
        buf = tokens[begin: begin + chunk + 1]
        starts = np.flatnonzero(buf[:-1] == BOS_ID)
        yield buf, np.diff(np.concatenate([[0], starts[starts > 0], [chunk]]))


def validation_batches(tokens, val_tokens, val_batch_size, rank, world_size, accum, device,
                       bigram_rows=0):
    """The Batch of each validation forward (validation_windows)."""
    for buf, lengths in validation_windows(tokens, val_tokens, val_batch_size, rank, world_size,
                                           accum):
        yield model_inputs(buf, lengths, device,
                           bigram_hash(buf[:-1], bigram_rows) if bigram_rows else None)


# ----------------------------------------------------------------------------------------------
# Model: recipe 89's GPT, each layer's work resolved once into a LayerPlan; the parameter table


GATE_INPUTS = 12  # the smear and attention gates read the first 12 channels of their input
ATTN_BLOCK = 128  # FlexAttention tile size (tokens)


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


class ParamSpec(NamedTuple):
    """What the optimizers know of a parameter (GPT.param_table): its kind, its optimizer ("matrix":
    NorMuon or track 3's; "adam": DistAdam), lr and decay multipliers, the row blocks the matrix
    optimizer cuts it into, its own DistAdam betas (None: DistAdam's)."""
    label: str
    optimizer: str
    lr_mul: float = 1.0
    wd_mul: float = 1.0
    pieces: int = 1
    betas: tuple | None = None


def matrix_spec(label, lr_mul=1.0, pieces=1):
    return ParamSpec(label, "matrix", lr_mul, 1.0, pieces)


@dataclass(frozen=True)
class LayerRoles:
    attn_free: int  # layer without attention; also where the U-net skip lands
    skip_source: int  # its output is added back before attn_free
    backout: int  # its output is partly subtracted before the final norm (recipe 89: MUDD's source)
    long_window: tuple  # layers with the long window (and the key shift)
    value_embed: dict  # layer -> value-embedding table
    paired: tuple = ()  # layers with paired-head attention
    xsa: tuple = ()  # layers with XSA


def layer_roles(num_layers, value_embeds, paired=(), xsa=()):
    """The 11-layer layout (skip 3->6, attention-free 6, backout 7, long windows 3, 10) relative to
    the depth, given the value-embedding, paired-head and XSA layers (negative: from the end)."""
    attn_free = num_layers // 2 + 1
    skip_source = attn_free - 3
    backout = attn_free + 1
    if skip_source < 0 or backout > num_layers - 1:
        raise ConfigError(f"--num_layers {num_layers}: the layer roles (skip, backout, "
                          f"attention-free layer) need at least 9 layers")
    lists = {}
    for flag, layers in (("value_embed_layers", value_embeds[0]), ("paired_head_layers", paired),
                         ("xsa_layers", xsa)):
        resolved = [layer % num_layers if -num_layers <= layer < num_layers else None
                    for layer in layers]
        if None in resolved or len(set(resolved)) != len(resolved) or attn_free in resolved:
            raise ConfigError(f"--{flag} {_flag_text(tuple(layers))}: each must be a distinct "
                              f"layer of --num_layers {num_layers} other than the attention-free "
                              f"layer {attn_free} (negative: from the end)")
        lists[flag] = tuple(resolved)
    if len(value_embeds[1]) != len(value_embeds[0]):
        raise ConfigError(f"--value_embed_tables needs one table per --value_embed_layers entry, "
                          f"got {len(value_embeds[1])} for {len(value_embeds[0])}")
    if set(lists["paired_head_layers"]) & set(lists["xsa_layers"]):
        raise ConfigError("--paired_head_layers and --xsa_layers overlap: XSA needs a layer's own "
                          "values")
    return LayerRoles(attn_free, skip_source, backout, (skip_source, num_layers - 1),
                      dict(zip(lists["value_embed_layers"], value_embeds[1])),
                      lists["paired_head_layers"], lists["xsa_layers"])


def layer_roles_of(hp):
    if hp.paired_head_layers and hp.num_heads % 2:
        raise ConfigError(f"--paired_head_layers needs an even --num_heads (heads attend in "
                          f"pairs), got {hp.num_heads}")
    return layer_roles(hp.num_layers, (hp.value_embed_layers, hp.value_embed_tables),
                       hp.paired_head_layers, hp.xsa_layers)


class Rotary(nn.Module):
    """Half-truncated RoPE: head_dim/4 frequencies rotate, the other head_dim/4 pairs are
    position-free. Also owns the softmax scale, since YaRN changes both; it is float64 (the
    reference's Python float), applied to the fp32 attention scores."""

    INITIAL_ATTN_SCALE = 0.1

    def __init__(self, head_dim):
        super().__init__()
        quarter = head_dim // 4
        freqs = torch.cat([(1 / 1024) ** torch.linspace(0, 1, quarter), torch.zeros(quarter)])
        self.register_buffer("initial_freqs", freqs, persistent=False)
        self.register_buffer("freqs", freqs.clone())
        self.register_buffer("attn_scale",
                             torch.tensor(self.INITIAL_ATTN_SCALE, dtype=torch.float64))
        self.window = None  # the long window (tokens) the frequencies are tuned for (None: unset)

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
        """YaRN: slow frequencies (< 1 turn over the old window) scale by old/new, fast ones (32+
        turns) stay, linear in between; the softmax scale grows by 0.2*ln(new/old) + 1."""
        s = old_tokens / new_tokens
        rotations = old_tokens * self.freqs / (2 * math.pi)
        interp = ((rotations - 1) / (32 - 1)).clamp(0, 1)
        self.freqs.mul_(s + interp * (1 - s))
        self.attn_scale.mul_(0.2 * math.log(new_tokens / old_tokens) + 1)

    def cos_sin(self, seq_len, positions=None):
        """(seq_len, 1, head_dim/2) tables in bf16 like the reference's cached ones; at `positions`
        (a micro-step piece's, in its micro-step) instead of 0 ... seq_len - 1 if given."""
        positions = torch.arange(seq_len, device=self.freqs.device, dtype=torch.float32) \
            if positions is None else positions.to(torch.float32)
        theta = torch.outer(positions, self.freqs)
        return theta.cos().bfloat16()[:, None, :], theta.sin().bfloat16()[:, None, :]

    def paired_cos_sin(self, seq_len, num_heads, positions=None):
        """(seq_len, num_heads, head_dim/2) tables of a paired layer: head h of token t sits at
        rotary position 2t + h % 2 (the reference rotates head pairs side by side, then halves)."""
        parity = torch.arange(num_heads, device=self.freqs.device) % 2
        doubled = None if positions is None else \
            (2 * positions[:, None] + torch.arange(2, device=positions.device)).flatten()
        return tuple(t.view(seq_len, 2, -1)[:, parity] for t in self.cos_sin(2 * seq_len, doubled))


def apply_rotary(x, cos_sin):
    cos, sin = cos_sin
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1).type_as(x)


def shift_keys(k):
    """On the position-free dims, key t takes key t-1 (position 0 keeps its own), so one layer can
    match 'the token after X' (an induction head). As the reference, it crosses document starts."""
    head_dim = k.size(-1)
    prev = torch.cat([k[:1], k[:-1]])
    free = torch.arange(head_dim, device=k.device) % (head_dim // 2) >= head_dim // 4  # 2nd, 4th
    return torch.where(free, prev, k)


def document_ids(cu_seqlens, seq_len):
    """Each position's document index, from padded cumulative boundaries [0, b1, ..., T, T, ...]."""
    positions = torch.arange(seq_len, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens, positions, right=True) - 1


def sliding_document_mask(docs, window_tokens):
    """BlockMask for causal attention inside documents: query t sees keys t - window_tokens ... t
    (inclusive, as FlashAttention's window_size=(w, 0)); built from per-tile document ranges, never
    T x T."""
    seq_len = docs.numel()
    n_blocks = -(-seq_len // ATTN_BLOCK)
    padded = torch.cat([docs, (docs[-1:] + 1).expand(n_blocks * ATTN_BLOCK - seq_len)])
    # a fixed layout for the mask mod's reads (Inductor cannot lower them in validation without it)
    padded = padded.as_strided(padded.shape, (1,))
    tiles = padded.view(n_blocks, ATTN_BLOCK)
    first, last = tiles[:, 0], tiles[:, -1]
    q = torch.arange(n_blocks, device=docs.device)[:, None]
    k = torch.arange(n_blocks, device=docs.device)[None, :]
    gap = (q - k) * ATTN_BLOCK
    any_allowed = (k <= q) & (gap - (ATTN_BLOCK - 1) <= window_tokens) & (last[k] >= first[q])
    all_allowed = (k < q) & (gap + (ATTN_BLOCK - 1) <= window_tokens) & (first[q] == last[k]) \
        & (first[k] == last[q])
    partial = any_allowed & ~all_allowed

    def as_indices(m):
        counts = m.sum(dim=-1, dtype=torch.int32)
        order = torch.argsort(m.to(torch.int8), dim=-1, descending=True,
                              stable=True).to(torch.int32)
        return counts[None, None].contiguous(), order[None, None].contiguous()

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= window_tokens) \
            & (padded[q_idx] == padded[kv_idx])

    return BlockMask.from_kv_blocks(*as_indices(partial), *as_indices(all_allowed),
                                    BLOCK_SIZE=ATTN_BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(seq_len, seq_len))


class FlexWindowAttention:
    """The GPU attention: FlexAttention over a block mask (documents, causal, inclusive window),
    built once per forward and applied per layer. Eager FlexAttention materializes all scores, so a
    model not compiled as a whole gets a compiled kernel of its own (compile_kernel=True)."""

    mask = staticmethod(sliding_document_mask)

    def __init__(self, compile_kernel=False):
        self.flex = torch.compile(flex_attention, dynamic=False) if compile_kernel else \
            flex_attention

    def __call__(self, q, k, v, mask, scale):
        """(T, H, D) tensors -> (T, H, D). `scale` (0-dim) multiplies the fp32 scores; a tensor, so
        YaRN's changes never recompile."""
        scale = scale.float()
        out = self.flex(*(t.transpose(0, 1)[None] for t in (q, k, v)), block_mask=mask, scale=1.0,
                        score_mod=lambda score, b, h, q_idx, kv_idx: score * scale)
        return out[0].transpose(0, 1)


# DistAdam's groups in recipe 89: group -> (betas, lr_mul, wd_mul), the reference's parameter table
ADAM_GROUPS = {
    "lm_head": ((0.5, 0.95), 1.0, 150.0), "embed": ((0.5, 0.95), 1.0, 150.0),
    "value_embed": ((0.75, 0.95), 75.0, 5.0), "bigram": ((0.75, 0.95), 75.0, 5.0),
    "scalars": ((0.9, 0.99), 5.0, 0.0), "smear_gate": ((0.9, 0.99), 0.01, 0.0),
    "skip_gate": ((0.9, 0.99), 0.05, 0.0),
    "gate": ((0.9, 0.99), 1.0, 1.0),  # attention and value-embedding gates
    "resid_lambdas": ((0.9, 0.95), 5.0, 0.0),
    "lambdas": ((0.9, 0.95), 1.0, 0.0),  # output, x0, bigram, XSA
    "mudd": ((0.9, 0.99), 0.25, 1.0), "mudd_bias": ((0.9, 0.99), 0.25, 0.0),
}

MUDD_SCALE = 0.1  # the coefficient networks' outputs (and so their biases) are scaled by 0.1
VE_GATE_HALF = GATE_INPUTS // 2  # a value-embedding gate reads 6 input and 6 embedding channels


class MuddLayerCoefs(NamedTuple):
    """The last layer's per-token coefficients (T, 1), MUDD network 0's outputs in this order."""
    v_x0: Tensor  # its values get v_x0 x0 + v_backout backout + v_x x added
    v_backout: Tensor
    v_x: Tensor
    x0: Tensor  # the stream before attention: (1 + x_boost) x + x0 x0 + backout backout
    backout: Tensor
    x_boost: Tensor
    ve_gate_low: Tensor  # value-embedding gates of the first and the second half of the heads
    ve_gate_high: Tensor
    attn_resid: Tensor  # after attention: attn_resid x + attn_out a + attn_x0 x0 + bigram rows
    attn_out: Tensor
    attn_x0: Tensor
    bigram: Tensor
    mlp_resid: Tensor  # after the MLP: mlp_resid x + mlp_out m
    mlp_out: Tensor


class MuddOutputCoefs(NamedTuple):
    """The output's per-token coefficients, MUDD network 1's: x + x0 x0 + backout backout +
    last_input (the last layer's input) + value_embed (the first one) + skip (the U-net source)."""
    x0: Tensor
    backout: Tensor
    last_input: Tensor
    value_embed: Tensor
    skip: Tensor


# the coefficient networks' initial biases (before the 0.1 scale); the rest start at 0
MUDD_LAYER_BIAS = dict(ve_gate_low=2.0, ve_gate_high=2.0, attn_resid=1.1 ** 0.5, attn_out=1.0,
                       bigram=0.05, mlp_resid=1.1 ** 0.5, mlp_out=1.0)
MUDD_OUTPUT_BIAS = dict(backout=-0.5)  # the former backout lambda


def mudd_bias_init():
    """The coefficient networks' initial biases (row 0: last layer, 1: output), divided by the 0.1
    scale and rounded to bf16 as the reference stores them."""
    b = torch.zeros(2, len(MuddLayerCoefs._fields))
    for row, (coefs, values) in enumerate(((MuddLayerCoefs, MUDD_LAYER_BIAS),
                                           (MuddOutputCoefs, MUDD_OUTPUT_BIAS))):
        for name, value in values.items():
            b[row, coefs._fields.index(name)] = value / MUDD_SCALE
    return b.bfloat16().float()


def adam_spec(group, hp):
    """Recipe 89's DistAdam `group`: its betas (unless --adam_group_betas false) and multipliers."""
    betas, lr_mul, wd_mul = ADAM_GROUPS[group]
    return ParamSpec(group, "adam", lr_mul, wd_mul, 1, betas if hp.adam_group_betas else None)


def gate_spec(group, hp):
    """A gate weight: DistAdam's `group` under --gates_in_adam, else the matrix optimizer's."""
    return adam_spec(group, hp) if hp.gates_in_adam else matrix_spec("gate")


# GPT.param_table's groups by parameter name (without "layers.i." or a list index)
ADAM_PARAMS = {"lm_head.weight": "lm_head", "embed": "embed", "value_embeds": "value_embed",
               "bigram_embed": "bigram", "bigram_lambdas": "lambdas", "scalars": "scalars",
               "resid_lambdas": "resid_lambdas", "post_lambdas": "lambdas", "x0_lambdas": "lambdas",
               "xsa_alphas": "lambdas", "mudd_w1": "mudd", "mudd_w2": "mudd",
               "mudd_b2": "mudd_bias"}
GATE_PARAMS = {"smear_gate_w": "smear_gate", "skip_gate_w": "skip_gate", "gate_w": "gate",
               "ve_gate_w": "gate"}


def param_spec(name, hp):
    """The ParamSpec of the GPT parameter `name` (as named_parameters names it)."""
    short = re.sub(r"^layers\.\d+\.|\.\d+$", "", name)
    if short in ADAM_PARAMS:
        return adam_spec(ADAM_PARAMS[short], hp)
    if short in GATE_PARAMS:
        return gate_spec(GATE_PARAMS[short], hp)
    qk_pieces = hp.num_heads if hp.muon_qk_head_pairs else 2  # head pairs of Q, then of K
    matrices = {"qk_w": matrix_spec("attn_qk", pieces=qk_pieces),
                "vo_w": matrix_spec("attn_vo", pieces=2), "fc_w": matrix_spec("mlp"),
                "proj_w": matrix_spec("mlp", lr_mul=2.0)}
    return matrices[short]


def padded_vocab(hp):
    """The head's rows: the vocabulary rounded up to whole 128-row tiles."""
    return -(-hp.vocab_size // 128) * 128


def uniform_init(rows, cols):
    bound = math.sqrt(3) * 0.5 / math.sqrt(cols)  # std 0.5 / sqrt(cols)
    return torch.empty(rows, cols).uniform_(-bound, bound)


class LayerPlan(NamedTuple):
    """What one layer does, resolved once from the flags (layer_plan), for a straight forward."""
    attention: bool  # False: the attention-free layer, where the U-net skip lands
    long_window: bool
    paired: bool  # two heads share one interleaved stream
    xsa: bool
    key_shift: bool
    value_table: int | None  # the value embedding added to its values, or None
    value_gate: bool  # its own gate on that value embedding (the MUDD layer's gates come from MUDD)
    attends_backout: bool  # attends over the backout layer's output instead of its own input
    residual: str  # "mudd": MUDD's coefficients; "sublayer": lambdas per sublayer; "plain": x+f(x)
    scale_before: bool  # residual, x0 lambdas (and bigram) before the layer (no --sublayer_scalars)
    adds_bigram: bool  # the bigram rows join the stream here (layer 0 has them in x0)
    skip_in: bool
    skip_out: bool  # its output is the U-net skip
    backout_out: bool  # its output is the backout (and MUDD's source)


def layer_plan(hp, roles):
    """Each layer's LayerPlan under the flags."""
    last, use_mudd = hp.num_layers - 1, hp.mudd_dim > 0
    plan = []
    for i in range(hp.num_layers):
        mudd = use_mudd and i == last
        table = roles.value_embed.get(i)
        plan.append(LayerPlan(
            attention=i != roles.attn_free, long_window=i in roles.long_window,
            paired=i in roles.paired, xsa=i in roles.xsa,
            key_shift=i in roles.long_window and i not in roles.paired, value_table=table,
            value_gate=hp.value_embed_gates and table is not None and not mudd,
            attends_backout=hp.shared_attention_input and i > roles.backout,
            residual="mudd" if mudd else "sublayer" if hp.sublayer_scalars else "plain",
            scale_before=not hp.sublayer_scalars, adds_bigram=i > 0 and hp.bigram_vocab_size > 0,
            skip_in=i == roles.attn_free, skip_out=i == roles.skip_source,
            backout_out=i == roles.backout))
    return plan


class Layer(nn.Module):
    """One layer's weights in recipe 89: [Q; K] and [V; O] (each 2 hdim x dim; NorMuon can cut Q, K
    into head pairs), the attention and value-embedding gates, and the MLP."""

    def __init__(self, hp, plan):
        super().__init__()
        D, H, hdim = hp.model_dim, hp.num_heads, hp.num_heads * hp.head_dim
        if plan.attention:
            self.qk_w = nn.Parameter(uniform_init(2 * hdim, D))
            self.vo_w = nn.Parameter(uniform_init(2 * hdim, D))
            self.gate_w = nn.Parameter(torch.zeros(H, GATE_INPUTS))
            self.ve_gate_w = nn.Parameter(torch.zeros(H, GATE_INPUTS)) if plan.value_gate else None
        self.num_heads, self.head_dim = H, hp.head_dim
        self.fc_w = nn.Parameter(uniform_init(4 * D, D))
        self.proj_w = nn.Parameter(torch.zeros(4 * D, D))  # stored (hidden, dim) like fc_w

    def attend(self, plan, x, lambdas, added_v, xsa_alpha, context, attention, attn_scale):
        """The attention on the normed input x (T, D); the lambdas scale [Q; K; V] and O."""
        mask, cos_sin = context
        q, k, v = self.qkv(x, self.qkv_weight(lambdas[0], x), cos_sin)
        if plan.key_shift:
            k = shift_keys(k)
        if added_v is not None:
            v = v + added_v.view_as(v)
        if plan.paired:  # row 2t + r, slot s of the doubled stream holds head r H/2 + s of token t
            T, H, hd = q.shape
            y = attention(*(t.reshape(2 * T, H // 2, hd) for t in (q, k, v)), mask,
                          attn_scale).reshape(T, H, hd)
        else:
            y = attention(q, k, v, mask, attn_scale)
        return self.output(x, y, v, xsa_alpha, self.o_weight(lambdas[1], x))

    def qkv_weight(self, qkv_lambda, x):
        """[Q; K; V] (3 H head_dim, D) in x's dtype, times the QKV lambda."""
        return qkv_lambda * torch.cat([self.qk_w,
                                       self.vo_w[: self.num_heads * self.head_dim]]).type_as(x)

    def o_weight(self, o_lambda, x):
        """O (D, H head_dim) in x's dtype, times the O lambda."""
        return o_lambda * self.vo_w[self.num_heads * self.head_dim:].type_as(x)

    def qkv(self, x, w_qkv, cos_sin):
        """Queries, keys (normed, rotated) and values (T, H, head_dim) of the normed input x."""
        q, k, v = F.linear(x, w_qkv).view(x.size(0), 3, self.num_heads, self.head_dim).unbind(1)
        return apply_rotary(norm(q), cos_sin), apply_rotary(norm(k), cos_sin), v

    def output(self, x, y, v, xsa_alpha, w_o):
        """The attention output y (T, H, head_dim) through XSA (values v), the head gates and O."""
        if xsa_alpha is not None:  # subtract a gated share of y along its own (unit) value
            unit_v = F.normalize(v, dim=-1, eps=1e-4)
            y = y - torch.tanh(xsa_alpha).type_as(y)[:, None] * (y * unit_v).sum(-1, keepdim=True) \
                * unit_v
        y = y * torch.sigmoid(F.linear(x[:, :GATE_INPUTS], self.gate_w.type_as(x)))[..., None]
        return F.linear(y.flatten(1), w_o)

    def mlp(self, x):
        return F.relu(F.linear(x, self.fc_w.type_as(x))).square() @ self.proj_w.type_as(x)


class Scalars(NamedTuple):
    """Views of GPT.scalars: (QKV, O) lambdas per layer, smear, skip, backout (without MUDD)."""
    attn: Tensor
    smear: Tensor
    skip: Tensor
    backout: Tensor | None


class Lambdas(NamedTuple):
    """One forward's per-layer lambdas, in bf16 as the reference uses them (None: not in model)."""
    resid: Tensor
    post: Tensor | None
    x0: Tensor
    bigram: Tensor | None


class Stream(NamedTuple):
    """What every layer may read besides x: the embedded input x0 (with the bigram rows), the bigram
    rows, the value embeddings, the U-net skip's scale, the lambdas and the scalars' views."""
    x0: Tensor
    bigram: Tensor | None
    values: list
    skip_scale: Tensor
    lambdas: Lambdas
    scalars: Scalars


def add_bigram(x, bigram, lam):
    """x with the bigram rows (T, bigram_dim) times lam added to its first bigram_dim channels."""
    if bigram is None:
        return x
    width = bigram.size(1)
    return torch.cat([x[:, :width] + bigram.type_as(x) * lam, x[:, width:]], -1)


def bigram_rows(input_seq, bigram_ids, table, signs):
    """(T, bigram_dim): the bigram rows (hashed by the loader) times signs chosen by both tokens
    (one row of signs: the same for every pair)."""
    if signs.size(0) > 1:
        signs = signs[torch.cat([input_seq[:1] * 0,
                                 (input_seq[:-1] ^ input_seq[1:]) % signs.size(0)])]
    return F.embedding(bigram_ids, table) * signs.type_as(table)


def attention_context(model, docs, window_blocks, positions=None):
    """{(long window, paired): (mask, rotary tables)} of the model's kinds of attention layer (a
    paired stream has two rows per token); `positions`: rotary positions (None: 0 ... T - 1)."""
    context, tables, seq_len = {}, {}, docs.numel()
    for long, paired in model.attention_kinds():
        tokens = window_blocks[1 if long else 0] * model.window_block_tokens
        if paired not in tables:
            tables[paired] = model.rotary.paired_cos_sin(seq_len, model.num_heads, positions) \
                if paired else model.rotary.cos_sin(seq_len, positions)
        mask = model.attention.mask(docs.repeat_interleave(2) if paired else docs, tokens)
        context[long, paired] = (mask, tables[paired])
    return context


def gate_heads(value, head_gates):
    """A value embedding (T, D) with each head's part scaled by its gate (T, H)."""
    return (head_gates[:, :, None] * value.view(*head_gates.shape, -1)).view(value.shape)


def scale_before_layer(plan, i, x, stream):
    """Without sublayer lambdas: x <- resid x + x0_lambda x0 (+ the bigram rows) before layer i."""
    lam = stream.lambdas
    x = lam.resid[i].type_as(x) * x + lam.x0[i].type_as(x) * stream.x0
    return add_bigram(x, stream.bigram, lam.bigram[i].type_as(x)) if plan.adds_bigram else x


def attention_residual(plan, i, x, a, stream, coefs):
    """x after layer i's attention output a joins it (coefs: the MUDD layer's, else None)."""
    lam, x0 = stream.lambdas, stream.x0
    if coefs is not None:
        x = coefs.attn_resid * x + coefs.attn_out * a + coefs.attn_x0 * x0
        return add_bigram(x, stream.bigram, coefs.bigram)
    if plan.residual == "plain":
        return x + a
    x = lam.resid[i, 0].type_as(x) * x + lam.post[i, 0].type_as(x) * a + x0 * lam.x0[i].type_as(x)
    return add_bigram(x, stream.bigram, lam.bigram[i].type_as(x)) if plan.adds_bigram else x


class Backend(NamedTuple):
    """How a model computes on its device, decided once (backend_for) and handed to GPT, which
    builds each module with it: nothing rewires a model afterwards."""
    attention: object  # FlexWindowAttention (GPU), TiledWindowAttention (CPU) or a tool's stand-in
    head_loss: object  # softcap_cross_entropy on a GPU, chunked_softcap_cross_entropy on a CPU
    fp8_scales: tuple | None  # the FP8 head's static (x, w, grad) scales (and FP8 MLP's); None: off
    round_sigmoid: bool  # the training softcap's sigmoid in bf16, as #89's loss kernel (GPU)
    bf16_params: bool  # embeddings, head, gates, MUDD networks in bf16, as the reference (GPU);
    # NorMuon's gradients and new weights then travel in bf16
    polar: dict  # polar_express's options: GPU_POLAR_EXPRESS (Triton, bf16) or CPU_POLAR_EXPRESS
    compile_math: bool  # the optimizers' pointwise math compiled (fused), as the reference (GPU)
    # micro-steps per optimizer step, the one place the accumulation is said: GPT.loss divides the
    # training loss by it; on the GPU the FP8 gradient scale and the loss's grad_scale follow it
    grad_accum: int
    # fp8_kernels.py's ops (GPU, FP8, Triton): the FP8 MLP's GEMMs with their epilogues and the FP8
    # head's loss with its e5m2 gradient in one kernel
    fused: bool = False


class GPT(nn.Module):
    """Record #89's model (modded-nanogpt, 2026-07-17): a hashed bigram embedding beside the tied
    token embedding (untied at --untie_stage), gated value embeddings, paired-head attention, gated
    XSA, a gated U-net skip, later layers attending over the backout layer's output, sublayer
    lambdas, MUDD coefficient networks, a shifted softcap, a multi-token loss; self.plan: layers."""

    def __init__(self, hp, backend, device=None):
        """Initialized on the CPU (the same weights anywhere), then moved to `device` (None: stays);
        `backend` (backend_for) says how it computes there."""
        super().__init__()
        L, H, hd, D = hp.num_layers, hp.num_heads, hp.head_dim, hp.model_dim
        self.roles = layer_roles_of(hp)
        self.plan = layer_plan(hp, self.roles)
        self.num_layers, self.num_heads, self.head_dim = L, H, hd
        self.window_block_tokens = hp.window_block_tokens
        self.softcap = Softcap(hp.softcap_scale, hp.softcap_offset, backend.round_sigmoid)
        self.use_mudd = hp.mudd_dim > 0
        self.attention, self.head_loss, self.fp8_head_scales = (
            backend.attention, backend.head_loss, backend.fp8_scales)
        self.grad_accum = backend.grad_accum
        # FP8 copies and scales of the MLP weights, used in training where the head is in FP8 (the
        # scales are in every checkpoint: one written on a GPU resumes on a CPU and back)
        self.fp8_mlp = FP8MLPWeights(L, 4 * D, D, backend.fused) if hp.fp8_mlp else None
        self.mlp_in_fp8 = self.fp8_mlp is not None and backend.fp8_scales is not None
        self.init_embeddings(hp)
        self.smear_gate_w = nn.Parameter(torch.zeros(1, GATE_INPUTS))
        self.skip_gate_w = nn.Parameter(torch.zeros(1, GATE_INPUTS)) if hp.skip_gate else None
        self.layers = nn.ModuleList([Layer(hp, plan) for plan in self.plan])
        self.rotary = Rotary(hd)
        self.init_lambdas(hp)
        if self.use_mudd:
            w1 = torch.empty(2, hp.mudd_dim, D).uniform_(-1 / math.sqrt(D), 1 / math.sqrt(D))
            self.mudd_w1 = nn.Parameter(w1)
            self.mudd_w2 = nn.Parameter(torch.zeros(2, len(MuddLayerCoefs._fields), hp.mudd_dim))
            self.mudd_b2 = nn.Parameter(mudd_bias_init())
        self.specs = {name: param_spec(name, hp) for name, _ in self.named_parameters()}
        for p in bf16_params(self) if backend.bf16_params else ():
            p.data = p.data.to(torch.bfloat16)
        if device is not None:
            self.to(device)
        self.refresh_fp8_mlp(step=0)

    def refresh_fp8_mlp(self, step=None):
        """The FP8 MLP's copies of the current weights, their one writer: after step `step`'s
        optimizer step (bootstrap scaling in the first steps), or (None) at the scales in the
        buffers, after a broadcast or a restore. Nothing without the FP8 MLP."""
        if not self.mlp_in_fp8:
            return
        if step is None:
            self.fp8_mlp.requantize(self.layers)
        else:
            self.fp8_mlp.quantize(self.layers, bootstrap=step < FP8MLPWeights.BOOTSTRAP_STEPS)

    def param_table(self):
        """[(parameter, ParamSpec)] of every parameter in model order: what the optimizers train."""
        unknown = [name for name, _ in self.named_parameters() if name not in self.specs]
        if unknown:
            raise KeyError(f"parameters without a ParamSpec (param_spec names them all): {unknown}")
        return [(p, self.specs[name]) for name, p in self.named_parameters()]

    def init_embeddings(self, hp):
        """The head (also the input embedding until the untie step), value embeddings, bigrams."""
        D, rows = hp.model_dim, padded_vocab(hp)
        self.lm_head = nn.Linear(D, rows, bias=False)
        nn.init.normal_(self.lm_head.weight, std=0.005)
        # the input embedding: tied to the head (kept equal to it by DistAdam) until the untie step
        self.embed = nn.Parameter(self.lm_head.weight.detach().clone()) if hp.untie_stage >= 0 \
            else None
        tables = max(self.roles.value_embed.values(), default=-1) + 1
        self.value_embeds = nn.ParameterList([nn.Parameter(torch.randn(rows, D)
                                                           * hp.value_embed_std)
                                              for _ in range(tables)])
        self.bigram_embed = self.bigram_lambdas = None
        if hp.bigram_vocab_size:
            self.bigram_embed = nn.Parameter(torch.zeros(hp.bigram_vocab_size, hp.bigram_dim))
            # each bigram row times random signs chosen by the two tokens (collisions then differ)
            signs = torch.randn(max(hp.bigram_sign_rows, 1), hp.bigram_dim).sign() \
                if hp.bigram_sign_rows else torch.ones(1, hp.bigram_dim)
            self.register_buffer("bigram_signs", signs)
            self.bigram_lambdas = nn.Parameter(torch.full((hp.num_layers,), 0.05))

    def init_lambdas(self, hp):
        """Scalars (per layer (QKV, O), smear 0, skip -1.5, backout 0.5 without MUDD), lambdas."""
        L = hp.num_layers
        backout_lambda = [] if self.use_mudd else [0.5]
        self.scalars = nn.Parameter(torch.tensor([0.5, 1.0] * L + [0.0, -1.5] + backout_lambda))
        if hp.sublayer_scalars:  # residual and output lambdas of the attention and the MLP sublayer
            self.resid_lambdas = nn.Parameter(torch.full((L, 2), 1.1 ** 0.5))
            self.post_lambdas = nn.Parameter(torch.ones(L, 2))
        else:  # one residual lambda per layer, before it
            self.resid_lambdas = nn.Parameter(torch.full((L,), 1.1))
            self.post_lambdas = None
        self.x0_lambdas = nn.Parameter(torch.zeros(L))
        self.xsa_alphas = nn.Parameter(torch.zeros(L, hp.num_heads)) if self.roles.xsa else None

    def scalar_views(self):
        L, s = self.num_layers, self.scalars
        return Scalars(s[: 2 * L].view(L, 2), s[2 * L], s[2 * L + 1],
                       None if self.use_mudd else s[2 * L + 2])

    def rounded_lambdas(self):
        """The per-layer lambdas rounded to bf16, as the reference uses them."""
        lambdas = (self.resid_lambdas, self.post_lambdas, self.x0_lambdas, self.bigram_lambdas)
        return Lambdas(*(None if t is None else t.bfloat16() for t in lambdas))

    def mudd(self, x, block, coefs):
        """MUDD network `block` (0: last layer, 1: output) on x: its coefficients as `coefs`."""
        count = len(coefs._fields)
        h = F.gelu(F.linear(x, self.mudd_w1[block].type_as(x)))
        out = (F.linear(h, self.mudd_w2[block, :count].type_as(x))
               + self.mudd_b2[block, :count].type_as(x)) * MUDD_SCALE
        return coefs(*out.split(1, dim=-1))

    def attention_kinds(self):
        """{(long window, paired)} of the attention layers: each kind needs a mask of its own."""
        return {(plan.long_window, plan.paired) for plan in self.plan if plan.attention}

    def embed_input(self, input_seq, bigram_ids):
        """One sequence's Stream: x0 (smeared, normed embeddings plus bigram rows) and the rest."""
        lambdas, scalars = self.rounded_lambdas(), self.scalar_views()
        x = F.embedding(input_seq, self.lm_head.weight if self.embed is None else self.embed)
        # smear: each token's embedding takes a gated share of the previous one (across documents)
        gate = scalars.smear * torch.sigmoid(F.linear(x[1:, :GATE_INPUTS],
                                                      self.smear_gate_w.type_as(x)))
        x = norm(torch.cat([x[:1], x[1:] + gate * x[:-1]]))
        bigram = None if self.bigram_embed is None else \
            bigram_rows(input_seq, bigram_ids, self.bigram_embed, self.bigram_signs)
        x0 = add_bigram(x, bigram, None if bigram is None else lambdas.bigram[0].type_as(x))
        values = [F.embedding(input_seq, table).type_as(x0) for table in self.value_embeds]
        skip_scale = torch.sigmoid(scalars.skip)
        if self.skip_gate_w is not None:
            skip_scale = skip_scale * 2 * torch.sigmoid(F.linear(x0[:, :GATE_INPUTS],
                                                                 self.skip_gate_w.type_as(x0)))
        return Stream(x0, bigram, values, skip_scale, lambdas, scalars)

    def attention_inputs(self, i, x, stream, backout):
        """Before layer i's attention: (x, normed input, what the values get added, MUDD coefs)."""
        layer, plan, x0 = self.layers[i], self.plan[i], stream.x0
        attn_in = norm(backout if plan.attends_backout else x)
        value = None if plan.value_table is None else stream.values[plan.value_table]
        coefs = self.mudd(x, 0, MuddLayerCoefs) if plan.residual == "mudd" else None
        if coefs is not None:
            mudd_v = coefs.v_x0 * x0 + coefs.v_backout * backout + coefs.v_x * x
            x = (1 + coefs.x_boost) * x + coefs.x0 * x0 + coefs.backout * backout
            head_gates = torch.cat([coefs.ve_gate_low, coefs.ve_gate_high],
                                   -1).repeat_interleave(self.num_heads // 2, -1)
            added_v = mudd_v if value is None else gate_heads(value, head_gates) + mudd_v
        elif value is not None and plan.value_gate:
            gate_in = torch.cat([attn_in[:, :VE_GATE_HALF], value[:, :VE_GATE_HALF]], -1)
            added_v = gate_heads(value,
                                 2 * torch.sigmoid(F.linear(gate_in, layer.ve_gate_w.type_as(x))))
        else:
            added_v = value
        return x, attn_in, added_v, coefs

    def mlp_sublayer(self, i, x, stream, coefs):
        layer = self.layers[i]
        fp8 = self.mlp_in_fp8 and self.training
        m = self.fp8_mlp(i, norm(x), layer.fc_w, layer.proj_w) if fp8 else layer.mlp(norm(x))
        if self.plan[i].residual == "mudd":
            return coefs.mlp_resid * x + coefs.mlp_out * m
        if self.plan[i].residual == "plain":
            return x + m
        return stream.lambdas.resid[i, 1].type_as(x) * x + stream.lambdas.post[i, 1].type_as(x) * m

    def trunk(self, input_seq, cu_seqlens, window_blocks, bigram_ids=None, positions=None):
        """The normed last hidden states (T, D) of one packed sequence: window_blocks = (short,
        long) in blocks, bigram_ids the loader's, positions a micro-step piece's (None: 0...T-1)."""
        T = input_seq.numel()
        context = attention_context(self, document_ids(cu_seqlens, T), window_blocks, positions)
        stream = self.embed_input(input_seq, bigram_ids)

        def attend(i, plan, attn_in, added_v, xsa_alpha):
            return self.layers[i].attend(plan, attn_in, stream.scalars.attn[i], added_v, xsa_alpha,
                                         context[plan.long_window, plan.paired], self.attention,
                                         self.rotary.attn_scale)
        return self.through_layers(stream, attend)

    def through_layers(self, stream, attend):
        """The normed last hidden states of a Stream after the layers and the output mix (MUDD or
        backout); attend(i, plan, normed input, added values, XSA alpha) is layer i's attention
        (trunk's over the sequence; tools/sample.py's over cached keys)."""
        x, skip, backout, last_input = stream.x0, None, None, None
        for i, plan in enumerate(self.plan):
            if plan.skip_in:
                x = x + stream.skip_scale * skip
            if plan.scale_before:
                x = scale_before_layer(plan, i, x, stream)
            last_input = x if plan.residual == "mudd" else last_input
            coefs = None
            if plan.attention:
                x, attn_in, added_v, coefs = self.attention_inputs(i, x, stream, backout)
                a = attend(i, plan, attn_in, added_v, self.xsa_alphas[i] if plan.xsa else None)
                x = attention_residual(plan, i, x, a, stream, coefs)
            x = self.mlp_sublayer(i, x, stream, coefs)
            skip = x if plan.skip_out else skip
            backout = x if plan.backout_out else backout
        if self.use_mudd:
            out = self.mudd(x, 1, MuddOutputCoefs)
            first_value = stream.values[0] if stream.values else 0
            x = x + out.x0 * stream.x0 + out.backout * backout + out.last_input * last_input + \
                out.value_embed * first_value + out.skip * skip
        else:
            x = x - stream.scalars.backout * backout
        return norm(x)

    def loss(self, x, input_seq, target_seq, mtp_weights=None, loss_mask=None):
        """The head's loss on the trunk's output: in training summed (the step's mtp_weights, a
        piece's loss_mask) and divided by the micro-steps per step, so that the micro-steps'
        gradients add up to the step's; else the mean next-token loss (summed over a piece's
        loss_mask)."""
        loss = self.head_loss(x, self.lm_head.weight, target_seq.long(), self.training,
                              self.fp8_head_scales, self.softcap, mtp_weights, loss_mask,
                              inputs=input_seq)
        return loss / self.grad_accum if self.training else loss

    def forward(self, input_seq, target_seq, cu_seqlens, window_blocks, bigram_ids=None,
                mtp_weights=None, positions=None, loss_mask=None):
        """Loss of one packed sequence (see trunk and loss)."""
        return self.loss(self.trunk(input_seq, cu_seqlens, window_blocks, bigram_ids, positions),
                         input_seq, target_seq, mtp_weights, loss_mask)

    def logits(self, input_seq, cu_seqlens, window_blocks, bigram_ids=None):
        """Softcapped fp32 logits (padded vocabulary) of each position."""
        x = self.trunk(input_seq, cu_seqlens, window_blocks, bigram_ids)
        return softcapped(head_matmul(x, self.lm_head.weight, None), self.softcap)

    def follow_window(self, window_blocks):
        """YaRN for the next forwards' (short, long) windows in blocks (Rotary.follow_window)."""
        self.rotary.follow_window(window_blocks[1] * self.window_block_tokens)


# ----------------------------------------------------------------------------------------------
# Head and losses: the FP8 head op, softcapped multi-token loss (fused in FP8), the FP8 MLP;
# backend_for, which picks a device's paths once


E4M3_MAX = 448.0  # the largest finite float8_e4m3fn value
E5M2_MAX = 57344.0  # the largest finite float8_e5m2 value


def head_fp8_scales(amax, grad_divisor=1):
    """Static FP8 scales of the head from the largest values it casts (--head_fp8_amax: activations,
    weights, gradients), each / 448 to use the full e4m3 range; recipe 89 also divides the
    gradients' by the accumulation steps, as its loss is."""
    x, w, g = amax
    return x / E4M3_MAX, w / E4M3_MAX, g / E4M3_MAX / grad_divisor


def fp8_forward(x, w, x_s, w_s):
    x_f8 = x.div(x_s).to(torch.float8_e4m3fn)
    w_f8 = w.div(w_s).to(torch.float8_e4m3fn)
    out = torch._scaled_mm(x_f8, w_f8.T, out_dtype=torch.bfloat16,
                           scale_a=x.new_tensor(x_s, dtype=torch.float32),
                           scale_b=x.new_tensor(w_s, dtype=torch.float32), use_fast_accum=True)
    return out, x_f8, w_f8


def fp8_backward(g, x_f8, w_f8, x_s, w_s, grad_s):
    g_f8 = g.div(grad_s).to(torch.float8_e5m2)
    # _scaled_mm wants its first operand row-major and its second column-major
    grad_x = torch._scaled_mm(g_f8, w_f8.T.contiguous().T, out_dtype=torch.bfloat16,
                              scale_a=g.new_tensor(grad_s, dtype=torch.float32),
                              scale_b=g.new_tensor(w_s, dtype=torch.float32), use_fast_accum=False)
    # as (x_f8.T @ g_f8).T: the faster orientation for the head's (50304, 768) weight
    grad_w = torch._scaled_mm(x_f8.T.contiguous(), g_f8.T.contiguous().T, out_dtype=torch.float32,
                              scale_a=g.new_tensor(x_s, dtype=torch.float32),
                              scale_b=g.new_tensor(grad_s, dtype=torch.float32),
                              use_fast_accum=False).T
    return grad_x, grad_w


@functools.cache
def compiled(fn):
    """fn under torch.compile, made at its first call: on CUDA the FP8 casts and scalings run
    compiled (fused, the scales folded into constants), the eager bodies serve the CPU; a process
    that never calls it (CPU path, tools/sample.py, tests) skips the seconds of importing it."""
    return torch.compile(fn, dynamic=False)


@torch.library.custom_op("speedrun::mm_fp8", mutates_args=())
def mm_fp8(x: Tensor, w: Tensor, x_s: float, w_s: float,
           grad_s: float) -> tuple[Tensor, Tensor, Tensor]:
    """x (M, K) @ w (N, K).T -> bf16 (M, N); also returns the float8 casts saved for backward."""
    return fp8_forward(x, w, x_s, w_s)


@mm_fp8.register_kernel("cuda")
def _(x, w, x_s, w_s, grad_s):
    return compiled(fp8_forward)(x, w, x_s, w_s)


@mm_fp8.register_fake
def _(x, w, x_s, w_s, grad_s):
    return (x.new_empty(x.shape[0], w.shape[0], dtype=torch.bfloat16),
            torch.empty_like(x, dtype=torch.float8_e4m3fn),
            torch.empty_like(w, dtype=torch.float8_e4m3fn))


@torch.library.custom_op("speedrun::mm_fp8_backward", mutates_args=())
def mm_fp8_backward(g: Tensor, x_f8: Tensor, w_f8: Tensor, x_s: float, w_s: float,
                    grad_s: float) -> tuple[Tensor, Tensor]:
    """grad_x = g @ w (bf16), grad_w = g.T @ x (fp32, column-major), with g cast to float8_e5m2."""
    return fp8_backward(g, x_f8, w_f8, x_s, w_s, grad_s)


@mm_fp8_backward.register_kernel("cuda")
def _(g, x_f8, w_f8, x_s, w_s, grad_s):
    return compiled(fp8_backward)(g, x_f8, w_f8, x_s, w_s, grad_s)


@mm_fp8_backward.register_fake
def _(g, x_f8, w_f8, x_s, w_s, grad_s):
    grad_w = torch.empty_strided(w_f8.shape, (1, w_f8.shape[0]), dtype=torch.float32,
                                 device=w_f8.device)
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


def head_matmul(x, w, fp8_scales):
    """The head's logits x @ w.T: FP8 with the given (x, w, grad) scales, or plain (None)."""
    if fp8_scales is not None:
        flat = x.reshape(-1, x.shape[-1])
        return mm_fp8(flat.to(torch.bfloat16), w, *fp8_scales)[0].view(*x.shape[:-1], w.shape[0])
    return F.linear(x, w.type_as(x))


class Softcap(NamedTuple):
    """logits -> scale * sigmoid((logits + offset) / SOFTCAP_WIDTH): a smooth cap in (0, scale)."""
    scale: float
    offset: float = 0.0
    round_sigmoid: bool = False  # GPU training: the sigmoid in bf16, as in #89's fused loss kernel


SOFTCAP_WIDTH = 7.5


# Validation runs the head over at most this many tokens at once, so its memory does not grow with
# the validation batch: 16,384 x 50,304 logits x (2 + 4 + 4) bytes (bf16 out, fp32 softcap and
# log-softmax) is ~8 GB, where the record's 262,144-token slice would be ~130 GB.
EVAL_HEAD_ROWS = 16384


def round_to_bf16(x):
    """fp32 x rounded to the nearest bf16 (ties to even), kept in fp32, for finite x; the gradient
    passes unchanged. On the bits because Inductor keeps a fused kernel's x.bfloat16().float() in
    fp32 (unless emulate_precision_casts), where #89's loss kernel stores its sigmoid in bf16 and
    reads it back. x + (rounded - x) is exact: the difference of two floats this close is exact."""
    bits = x.detach().view(torch.int32)
    rounded = ((bits + (0x7FFF + ((bits >> 16) & 1))) & -0x10000).view(torch.float32)
    return x + (rounded - x.detach())


def softcapped(logits, softcap, training=False):
    z = logits.float()
    if softcap.offset:
        z = z + softcap.offset
    s = torch.sigmoid(z / SOFTCAP_WIDTH)
    if training and softcap.round_sigmoid:
        s = round_to_bf16(s)
    return softcap.scale * s


def multi_token_loss(z, targets, weights, loss_mask=None):
    """sum_t sum_k w_k (logsumexp(z_t) - z_t[targets[t + k]]) over t with t + k in the sequence:
    token t also predicts the tokens k = 1, 2 after its target (across documents, as #89's loss).
    With a piece's loss_mask (Batch), only the positions it marks and targets that are tokens."""
    lse = torch.logsumexp(z, dim=-1)
    total = z.new_zeros(())
    for k in range(weights.numel()):
        n = z.size(0) - k
        if loss_mask is None:
            picked = z[:n].gather(1, targets[k:, None])[:, 0]
            total = total + weights[k] * (lse[:n] - picked).sum()
        else:
            picked = z[:n].gather(1, targets[k:, None].clamp_min(0))[:, 0]
            total = total + weights[k] * ((lse[:n] - picked)
                                          * (loss_mask[:n] & (targets[k:] >= 0))).sum()
    return total


FUSED_LOSS_ROWS = 4096  # rows of logits the fused FP8 loss holds in fp32 at once


def horizon_rows(n_horizons, start, stop, n):
    """[(k, rows)]: of the rows [start, stop), the first `rows` have their horizon-k target t + k
    within the n positions (horizons without such rows left out)."""
    return [(k, min(stop, n - k) - start) for k in range(n_horizons) if min(stop, n - k) > start]


def horizon_masks(targets, loss_mask, n_horizons):
    """(n_horizons, n) bool of a micro-step piece: row t's horizon-k term counts where loss_mask
    marks t and the target t + k is a token (not NO_TARGET), as in multi_token_loss."""
    n = targets.numel()
    masks = torch.zeros(n_horizons, n, dtype=torch.bool, device=targets.device)
    for k in range(n_horizons):
        masks[k, : n - k] = loss_mask[: n - k] & (targets[k:] >= 0)
    return masks


def training_sigmoid(logits, softcap, start, stop):
    """The softcap's sigmoid of rows [start, stop) of the logits as training computes it (rounded to
    bf16 with round_sigmoid): softcapped's, before its scale."""
    z = logits[start:stop].float()
    if softcap.offset:
        z = z + softcap.offset
    s = torch.sigmoid(z / SOFTCAP_WIDTH)
    return round_to_bf16(s) if softcap.round_sigmoid else s


def softcap_loss_sums(logits, targets, n_horizons, softcap, start, stop, masks=None, s=None):
    """Each horizon's summed loss over rows [start, stop) of the logits (softcapped as in
    training); with a piece's horizon_masks, over the terms they mark; s: their training_sigmoid."""
    z = softcapped(logits[start:stop], softcap, training=True) if s is None else softcap.scale * s
    lse = torch.logsumexp(z, dim=-1)
    sums = {}
    for k, rows in horizon_rows(n_horizons, start, stop, logits.size(0)):
        terms = lse[:rows] - z[:rows].gather(
            1, targets[start + k: start + k + rows, None].clamp_min(0))[:, 0]
        sums[k] = (terms if masks is None else terms * masks[k, start: start + rows]).sum()
    return sums


def softcap_loss_grad(logits, targets, weights, softcap, start, stop, grad_total, grad_s,
                      masks=None, s=None):
    """d loss / d logits of rows [start, stop), / grad_s, cast to e5m2, in the rounding order of
    #89's loss kernel: the sigmoid s (training_sigmoid, that stored value used from then on),
    z = scale s, p = exp(z - lse) with lse = max + log(sum exp(z - max)),
    dz = p sum_k w_k - sum_k w_k onehot(t + k), then (grad_total (scale / SOFTCAP_WIDTH) / grad_s)
    dz s (1 - s) in fp32, left to right, and one saturating cast to e5m2; with horizon_masks, only
    the terms they mark. (The kernel's fast-math sigmoid, exp, log differ in the last fp32 bits.)"""
    if s is None:
        s = training_sigmoid(logits, softcap, start, stop)
    capped = softcap.scale * s
    top = capped.amax(dim=-1, keepdim=True)
    lse = top + torch.exp(capped - top).sum(dim=-1, keepdim=True).log()
    probs = torch.exp(capped - lse)
    horizons = horizon_rows(weights.numel(), start, stop, logits.size(0))
    row = torch.arange(stop - start, device=logits.device)
    counted = [(k, rows, row < rows if masks is None else (row < rows) & masks[k, start:stop])
               for k, rows in horizons]
    count = sum(torch.where(counts, weights[k], 0.0) for k, _, counts in counted)
    column = torch.arange(logits.size(1), device=logits.device)
    hot = 0.0  # the targets' weights summed per column, then subtracted once
    for k, rows, counts in counted:  # one-hot as a comparison, so the whole chain fuses pointwise
        target = F.pad(targets[start + k: start + k + rows], (0, stop - start - rows), value=-1)
        target = torch.where(counts, target, -1)
        hot = hot + torch.where(column == target[:, None], weights[k], 0.0)
    dz = probs * count[:, None] - hot
    fp32 = functools.partial(logits.new_tensor, dtype=torch.float32)  # each step in fp32
    factor = (grad_total.float() * (fp32(1 / SOFTCAP_WIDTH) * softcap.scale)
              * fp32(grad_s).reciprocal())
    return (factor * dz * s * (1 - s)).clamp(-E5M2_MAX, E5M2_MAX).to(torch.float8_e5m2)


def softcap_loss_blocks(logits, targets, weights, softcap, masks, announced, grad_s):
    """FP8SoftcapLoss's torch path: (each horizon's loss sum (K,), the e5m2 gradient), block by
    block of FUSED_LOSS_ROWS rows, each block's logits read once by training_sigmoid."""
    n = logits.size(0)
    sums, blocks = [logits.new_zeros((), dtype=torch.float32)] * weights.numel(), []
    for start in range(0, n, FUSED_LOSS_ROWS):
        stop = min(n, start + FUSED_LOSS_ROWS)
        s = training_sigmoid(logits, softcap, start, stop)
        chunk = softcap_loss_sums(logits, targets, weights.numel(), softcap, start, stop, masks, s)
        for k, value in chunk.items():
            sums[k] = sums[k] + value
        blocks.append(softcap_loss_grad(logits, targets, weights, softcap, start, stop, announced,
                                        grad_s, masks, s))
    return torch.stack(sums), torch.cat(blocks)


class FP8SoftcapLoss(torch.autograd.Function):
    """The FP8 head and its softcapped (multi-token) loss in one op, summed over tokens. As #89's
    loss kernel, the forward also makes the logits' gradient, as the e5m2 tensor the FP8 backward
    multiplies: the gradient the loss will get (grad_scale, the Backend's 1 / accumulation steps) is
    known before the backward, so each block of FUSED_LOSS_ROWS rows gives its loss terms and its
    e5m2 gradient from one read of its logits, and the logits die with the forward. The backward is
    one FP8 GEMM for grad_x and one for grad_w (from the gradient's transposed copy); a gradient
    other than grad_scale scales both by its ratio (1 in training). The loss matches head_matmul,
    softcapped and multi_token_loss to fp32 rounding; the gradient rounds as #89's kernel
    (softcap_loss_grad), unlike autograd in about 2 % of the e5m2 entries. `fused`: loss sums and
    gradient by fp8_kernels.py's speedrun::softcap_loss, one kernel reading each row of logits."""

    @staticmethod
    def forward(ctx, x, w, targets, weights, fp8_scales, softcap, masks, grad_scale,
                fused=False):
        logits, x_f8, w_f8 = mm_fp8(x, w, *fp8_scales)
        announced = logits.new_tensor(grad_scale, dtype=torch.float32)
        if fused:  # fp8_kernels.py's op (Backend.fused): one read of each row of logits
            sums, grad = torch.ops.speedrun.softcap_loss(logits, targets, weights, masks, *softcap,
                                                         SOFTCAP_WIDTH, announced, fp8_scales[2])
        else:
            sums, grad = softcap_loss_blocks(logits, targets, weights, softcap, masks, announced,
                                             fp8_scales[2])
        total = logits.new_zeros((), dtype=torch.float32)
        for k in range(weights.numel()):
            total = total + weights[k] * sums[k]
        ctx.save_for_backward(grad, x_f8, w_f8)
        ctx.scales, ctx.grad_scale, ctx.w_dtype = fp8_scales, grad_scale, w.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        g_f8, x_f8, w_f8 = ctx.saved_tensors
        x_s, w_s, grad_s = ctx.scales
        # grad_s, times the gradient's ratio to the announced one (1 in training)
        g_scale = grad_total.float() / ctx.grad_scale * grad_s
        w_col = w_f8.T.contiguous().T  # _scaled_mm wants its second operand column-major
        scale = functools.partial(g_f8.new_tensor, dtype=torch.float32)
        grad_x = torch._scaled_mm(g_f8, w_col, out_dtype=torch.bfloat16, scale_a=g_scale,
                                  scale_b=scale(w_s), use_fast_accum=False)
        # as (x_f8.T @ g_f8).T: the faster orientation for the head's (50304, 768) weight; the
        # transposed copy is _scaled_mm's column-major operand
        grad_t = g_f8.T.contiguous()
        grad_w = torch._scaled_mm(x_f8.T.contiguous(), grad_t.T, out_dtype=torch.float32,
                                  scale_a=scale(x_s), scale_b=g_scale, use_fast_accum=False).T
        return grad_x, grad_w.to(ctx.w_dtype), None, None, None, None, None, None, None


def softcap_cross_entropy(x, weight, targets, training, fp8_scales, softcap, mtp_weights=None,
                          loss_mask=None, inputs=None, grad_scale=1.0, fused=False):
    """The head and its loss on the GPU path: in training summed over tokens (next-token, or
    multi-token with the step's mtp_weights; GPT.loss divides by the accumulation steps, and
    grad_scale, the gradient the loss will get, says so); in validation the mean next-token loss in
    fp32 (with a piece's loss_mask: the sum over it). In FP8, head and loss are one op
    (FP8SoftcapLoss; `fused`: by fp8_kernels.py's kernel); else the compiled graph fuses the
    softcap. (`inputs`, the sequence's tokens, are for the CPU loss's n-gram prior.)"""
    if training and fp8_scales is not None:
        weights = x.new_ones(1, dtype=torch.float32) if mtp_weights is None else mtp_weights
        flat, targets = x.reshape(-1, x.shape[-1]).to(torch.bfloat16), targets.reshape(-1)
        masks = None if loss_mask is None else horizon_masks(targets, loss_mask, weights.numel())
        return FP8SoftcapLoss.apply(flat, weight, targets, weights, fp8_scales, softcap, masks,
                                    grad_scale, fused)
    if training:
        z = softcapped(head_matmul(x, weight, fp8_scales), softcap, training=True)
        if loss_mask is not None:
            return multi_token_loss(z, targets, z.new_ones(1) if mtp_weights is None
                                    else mtp_weights, loss_mask)
        return F.cross_entropy(z, targets, reduction="sum") if mtp_weights is None else \
            multi_token_loss(z, targets, mtp_weights)
    if loss_mask is not None:  # a validation piece: summed (targets outside the mask are NO_TARGET)
        return sum(F.cross_entropy(softcapped(head_matmul(xc, weight, None), softcap), tc,
                                   reduction="sum", ignore_index=NO_TARGET)
                   for xc, tc in zip(x.split(EVAL_HEAD_ROWS), targets.split(EVAL_HEAD_ROWS)))
    total = sum(F.cross_entropy(softcapped(head_matmul(xc, weight, None), softcap), tc,
                                reduction="sum")
                for xc, tc in zip(x.split(EVAL_HEAD_ROWS), targets.split(EVAL_HEAD_ROWS)))
    return total / x.size(0)


class FP8ReluSquareMLP(torch.autograd.Function):
    """relu(x W1^T)^2 W2 with both products in FP8 as #89 computes them: x scaled by 448/amax(x)
    into e4m3 against W1 quantized per layer; the squared activation scaled by the activation scale
    (1.8 x the previous forward's amax / 448), clamped at 448, into e4m3 against W2 at its delayed
    scale. Backward runs in bf16 from the saved pre- and post-activations; the weight gradients are
    bf16 GEMMs (fp32 accumulation) returned in fp32, as the reference. Also returns amax(post), the
    next forward's activation amax. `fused`: the up projection and the gradient of pre as
    fp8_kernels.py's ops, relu^2, e4m3 copy, amax and 2 relu(pre) in their GEMMs."""

    @staticmethod
    def forward(ctx, x, w1, w2, w1_f8, w1_scale, w2_f8, w2_scale, act_scale, fused=False):
        amax = x.detach().abs().amax().clamp(min=1e-12)
        x_f8 = (x.detach() * (E4M3_MAX / amax)).to(torch.float8_e4m3fn)
        dequant = w1_scale * amax.float() / E4M3_MAX
        if fused:
            pre, post, post_f8, pre_max = torch.ops.speedrun.fp8_up_relu_square(
                x_f8, w1_f8, dequant, 1 / act_scale)
            # bf16(max(pre, 0)^2) is post.amax(), as squaring and rounding are monotone on x >= 0
            top = pre_max.amax().clamp(min=0)
            post_amax = (top * top).bfloat16().float()
        else:
            pre = torch._scaled_mm(x_f8, w1_f8.T, scale_a=dequant, scale_b=dequant.new_ones(()),
                                   out_dtype=x.dtype)
            post = F.relu(pre).square()
            post_f8 = ((post.float() * (1 / act_scale)).clamp(max=E4M3_MAX)
                       .to(torch.float8_e4m3fn))
            post_amax = post.detach().amax().float()
        # the per-layer scales are views into (layers,) buffers, from which Inductor (torch 2.11)
        # cannot lower _scaled_mm's tensorwise scale (LoweringException on the H200); clamp at 0
        # makes each a tensor of its own (no positive scale changes; a clone is elided as a no-op)
        out = torch._scaled_mm(post_f8, w2_f8, scale_a=act_scale.clamp(min=0),
                               scale_b=w2_scale.clamp(min=0), out_dtype=x.dtype,
                               use_fast_accum=True)
        ctx.save_for_backward(x, w1, w2, pre, post)
        ctx.fused = fused
        ctx.mark_non_differentiable(post_amax)  # it only scales the next forward
        return out, post_amax

    @staticmethod
    def backward(ctx, grad_out, _):
        x, w1, w2, pre, post = ctx.saved_tensors
        grad_out = grad_out.to(x.dtype)
        if ctx.fused:
            grad_pre = torch.ops.speedrun.relu_square_grad(grad_out, w2.type_as(x), pre)
        else:
            grad_pre = 2 * (grad_out @ w2.T.type_as(x)) * F.relu(pre)
        return (grad_pre @ w1.type_as(x), (grad_pre.T @ x).float(), (post.T @ grad_out).float(),
                None, None, None, None, None, None)


class FP8MLPWeights(nn.Module):
    """#89's FP8 copies of the MLP weights and their scales, refreshed after every optimizer step
    (quantize): W1 at its own amax (current scaling, in bf16); W2 at the scale of the previous
    refresh, 1.12 x amax / 448 (delayed scaling; it clips if amax grew over 12 %), or at its current
    amax / 448 while `bootstrap` (the first 16 steps). The scales are persistent buffers, so a
    checkpoint resumes with the run's copies (requantize)."""

    W2_HEADROOM, ACT_HEADROOM, BOOTSTRAP_STEPS = 1.12, 1.8, 16

    def __init__(self, layers, hidden, dim, fused=False):
        super().__init__()
        self.fused = fused  # fp8_kernels.py's ops (Backend.fused)
        self.register_buffer("act_scales", torch.ones(layers))  # 1.0 at first, as the reference
        self.register_buffer("w2_scales", torch.ones(layers))  # the scale of the current W2 copy
        self.register_buffer("w2_next_scales", torch.ones(layers))
        self.register_buffer("w1_f8", torch.zeros(layers, hidden, dim, dtype=torch.float8_e4m3fn),
                             persistent=False)
        self.register_buffer("w1_scales", torch.ones(layers), persistent=False)
        # W2's copy column-major, as _scaled_mm takes its second operand
        self.register_buffer("w2_f8", torch.zeros(layers, dim, hidden, dtype=torch.float8_e4m3fn)
                             .mT, persistent=False)

    @torch.no_grad()
    def quantize(self, layers, bootstrap):
        self._quantize_w1(layers)
        w2 = self._w2(layers)
        w2_amax = w2.bfloat16().abs().amax(dim=(1, 2)).clamp(min=1e-12)  # bf16, as the reference
        if bootstrap:
            self.w2_next_scales.copy_((w2_amax / E4M3_MAX).float())
        self.w2_scales.copy_(self.w2_next_scales)
        self._quantize_w2(w2)
        self.w2_next_scales.copy_(w2_amax.float() * (self.W2_HEADROOM / E4M3_MAX))

    @torch.no_grad()
    def requantize(self, layers):
        """Copies of the current weights (after a restore or a broadcast): W1 at its current scale,
        as quantize made it from these weights, W2 at the delayed scale in the buffers."""
        self._quantize_w1(layers)
        self._quantize_w2(self._w2(layers))

    def _quantize_w1(self, layers):
        w1 = torch.stack([layer.fc_w for layer in layers]).bfloat16()  # as the forward sees them
        w1_scales = w1.abs().amax(dim=(1, 2)).clamp(min=1e-12) / E4M3_MAX  # bf16, as the reference
        self.w1_scales.copy_(w1_scales.float())
        self.w1_f8.copy_((w1 / w1_scales[:, None, None]).to(torch.float8_e4m3fn))

    @staticmethod
    def _w2(layers):
        # as the forward sees them
        return torch.stack([layer.proj_w for layer in layers]).bfloat16().float()

    def _quantize_w2(self, w2):
        self.w2_f8.copy_((w2 / self.w2_scales[:, None, None]).clamp(-E4M3_MAX, E4M3_MAX)
                         .to(torch.float8_e4m3fn))

    def forward(self, i, x, fc_w, proj_w):
        out, post_amax = FP8ReluSquareMLP.apply(x, fc_w, proj_w, self.w1_f8[i], self.w1_scales[i],
                                                self.w2_f8[i], self.w2_scales[i],
                                                self.act_scales[i], self.fused)
        self.act_scales[i].copy_(post_amax.clamp(min=1e-12) * (self.ACT_HEADROOM / E4M3_MAX))
        return out


def uses_fp8(hp, device, fp8_hardware=None):
    """Whether training runs the head (and #89's MLP) in FP8, decided only here: --fp8, and for auto
    whether the GPU has FP8 tensor cores (fp8_supported, or fp8_hardware for a modelled GPU)."""
    if device.type != "cuda":
        if hp.fp8 == "on":
            raise ConfigError("--fp8 on needs a CUDA device (the CPU path has no FP8 head); "
                              "use --fp8 auto or off")
        return False
    return hp.fp8 == "on" or (hp.fp8 == "auto" and (fp8_supported(device) if fp8_hardware is None
                                                    else fp8_hardware))


def backend_for(hp, device, accum=1, fp8_hardware=None, attention=None, prior=None):
    """A run's Backend on `device` for `accum` micro-steps per step: on CUDA FlexAttention, the
    fused softcapped loss (told its gradient, 1 / accum), bf16 embeddings and gates, and if
    uses_fp8 the FP8 head and MLP (gradient scale / accum, as #89's loss); on a CPU the fp32
    fallbacks, with --ngram_prior's `prior` in the loss. `attention` replaces the attention (the
    tools' traces)."""
    if device.type != "cuda":
        uses_fp8(hp, device)
        loss = chunked_softcap_cross_entropy if prior is None else \
            functools.partial(chunked_softcap_cross_entropy, prior=prior)
        return Backend(attention or TiledWindowAttention(), loss, None, False, False,
                       CPU_POLAR_EXPRESS, False, accum)
    if hp.ngram_prior:
        raise ConfigError("--ngram_prior needs the CPU loss path (the GPU losses add no prior); "
                          "use --device cpu or --ngram_prior 0")
    fp8 = uses_fp8(hp, device, fp8_hardware)
    fused = fp8 and HAS_TRITON
    if fused:
        load_companion("fp8_kernels.py")  # registers its ops
    return Backend(attention or flex_attention_for(hp),
                   functools.partial(softcap_cross_entropy, grad_scale=1 / accum, fused=fused),
                   head_fp8_scales(hp.head_fp8_amax, accum) if fp8 else None,
                   True, True, GPU_POLAR_EXPRESS, hp.compile, accum, fused)


def build_model(hp, device, accum=1):
    """The recipe's model on `device`, with backend_for's paths."""
    return GPT(hp, backend_for(hp, device, accum), device)


def bf16_params(model):
    """The parameters the GPU path keeps in bf16, as the reference: embeddings, head, gates, MUDD
    networks (the hidden matrices stay fp32 masters, the lambdas fp32)."""
    fp32_groups = ("scalars", "resid_lambdas", "lambdas")
    return [p for p, spec in model.param_table()
            if (spec.optimizer == "adam" and spec.label not in fp32_groups) or spec.label == "gate"]


# ----------------------------------------------------------------------------------------------
# Optimizers: Polar Express (Triton kernels on GPU), NorMuon, sharded DistAdam, and their wiring


# NorMuon trains the hidden matrices and gates, DistAdam the embedding/head, value embeddings and
# scalars; make_optimizers and step_optimizers wire them as the record does.

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
# Tile configurations (BLOCK_M, BLOCK_K, warps, stages). On GPU the autotuner picks one per matrix
# size (a 768x768 Gram matrix is only 21 tiles of 128 for 132 SMs: smaller tiles fill the GPU);
# under the Triton interpreter (CPU tests) the first one runs, and tests can pick any.
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
        kernel: triton.autotune([triton.Config({"BLOCK_M": bm, "BLOCK_K": bk}, num_warps=w,
                                               num_stages=st) for bm, bk, w, st in SYM_CONFIGS],
                                key=key)(kernel)
        for kernel, key in ((_xxt_kernel, ["M", "K"]), (_ba_plus_caa_kernel, ["M"]))}


@functools.cache
def _squeeze_interpreter_loop_bounds():
    """Triton's interpreter holds a scalar kernel argument as a one-element numpy array; up to
    Triton 3.6 one used as a loop bound (`range(0, K, BLOCK_K)`) goes through int(array), which
    numpy >= 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars"). Triton
    3.8 squeezes the array first; do the same for older versions (interpreter only)."""
    from triton.runtime import interpreter
    if tuple(int(part) for part in re.findall(r"\d+", triton.__version__)[:2]) >= (3, 8):
        return
    patch_tensor = interpreter._patch_lang_tensor

    def patch_tensor_squeezing(tensor, scope):
        patch_tensor(tensor, scope)
        # undone last-in first-out
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patch_tensor_squeezing


def _sym_launch(kernel, inp, out, *args, config=None):
    """Launch a lower-triangle kernel on (m, k) / (batch, m, k) input, output (.., m, m); autotuned
    on GPU unless `config` (one of SYM_CONFIGS) is given."""
    assert inp.ndim in (2, 3), f"expected a 2D or 3D tensor, got shape {tuple(inp.shape)}"
    M = inp.size(-2)
    if out is None:
        out = inp.new_empty(*inp.shape[:-1], M)
    x3, o3 = (inp, out) if inp.ndim == 3 else (inp.unsqueeze(0), out.unsqueeze(0))

    def grid(meta):
        nb = triton.cdiv(M, meta["BLOCK_M"])
        return nb * (nb + 1) // 2, x3.size(0)

    if os.environ.get("TRITON_INTERPRET") == "1":
        _squeeze_interpreter_loop_bounds()
        config = config or SYM_CONFIGS[0]
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
    xxt, ba_plus_caa = ((xxt_triton, ba_plus_caa_triton) if use_triton
                        else (xxt_torch, ba_plus_caa_torch))
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
    """What the training loop asks of every optimizer: param_groups (dicts with "params", "lr",
    "initial_lr"), set_schedule() before each step; after the step's last backward reduce_grads()
    (start the gradients' reduce-scatters, async), update() (wait, update this rank's share, start
    the all-gathers) and finish() (wait for those), or step() for all three; zero_grad(), and a
    state_dict() independent of the world size (collective when distributed), load_state_dict()."""

    param_groups: list

    def set_schedule(self, lr_multiplier, momentum):
        """This step's lr: each group's initial lr x the multiplier (`momentum` is NorMuon's)."""
        for group in self.param_groups:
            group["lr"] = group["initial_lr"] * lr_multiplier

    def zero_grad(self):
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    def reduce_grads(self):
        """(An optimizer that communicates synchronously does it all in update.)"""

    def update(self):
        raise NotImplementedError

    def finish(self):
        """(Nothing left to wait for.)"""

    def exact_weights(self):
        """Make every rank's parameters the exact weights (collective; before a snapshot): an
        optimizer sending its new weights rounded keeps the exact ones on the owning rank."""

    def step(self):
        self.reduce_grads()
        self.update()
        self.finish()

    def state_dict(self):
        raise NotImplementedError

    def load_state_dict(self, state):
        raise NotImplementedError


class NorMuon(ScheduledOptimizer):
    """Momentum -> Polar Express -> per-row/column variance normalization -> cautious decay.

    Parameters of one shape are stacked (sorted by label, so a rank's chunk holds contiguous runs of
    one kind), zero-padded into equal per-rank chunks; each rank gets its chunk's gradients by
    reduce-scatter, updates them and all-gathers the new weights. A stack of at least two matrices
    per rank is split in two groups. step() starts every reduce-scatter, then updates the groups
    smallest first, so each one's Polar Express overlaps the later groups' communication. Momentum
    and second moments keep the parameter's dtype (fp32 matrices; bf16 gates on GPU), as in the
    reference. `polar`: polar_express's options (GPU_POLAR_EXPRESS, or CPU_POLAR_EXPRESS).
    `wire_dtype` (bf16 on the GPU path, as the reference's bf16 parameters travel; None: the
    parameter's dtype) is what gradients and new weights travel in: a rank owns the exact fp32
    weights of its chunk and holds the others rounded, which the forward's bf16 casts and FP8
    copies cannot tell apart; exact_weights() gathers the exact ones for a snapshot."""

    def __init__(self, table, lr, weight_decay, momentum, beta2, polar=GPU_POLAR_EXPRESS,
                 compile_math=False, wire_dtype=None):
        """table: [(parameter, ParamSpec)] (GPT.param_table's matrix part)."""
        self.rank, self.world_size = world_info()
        self.polar, self.wire_dtype = polar, wire_dtype
        # the pointwise math compiled (fused) on the GPU, as the reference's is
        self.normalize = (torch.compile(normalize_variance, dynamic=False) if compile_math
                          else normalize_variance)
        self.apply_update = (torch.compile(cautious_update, dynamic=False) if compile_math
                             else cautious_update)
        self._pending, self._gathers = None, []
        self.specs = dict(table)
        params = list(self.specs)
        self.param_groups = [self._group(stack, lr, weight_decay, momentum, beta2)
                             for stack in stacked_groups(table, self.world_size)]
        self._order = {p: index for index, p in enumerate(params)}  # the state_dict's layout

    def set_schedule(self, lr_multiplier, momentum):
        super().set_schedule(lr_multiplier, momentum)
        for group in self.param_groups:
            group["momentum"] = momentum

    def _group(self, params, lr, weight_decay, momentum, beta2):
        chunk = -(-len(params) // self.world_size)
        padding = [0.0] * (chunk * self.world_size - len(params))

        def per_param(values):
            return torch.tensor(values + padding, dtype=torch.float32, device=params[0].device)

        def shape_factor(q):  # sqrt(max(1, rows/cols)) of each piece it is orthogonalized in
            rows, cols = q.shape
            return max(1.0, rows // self.specs[q].pieces / cols) ** 0.5

        return dict(
            params=params, lr=lr, initial_lr=lr, weight_decay=weight_decay, momentum=momentum,
            beta2=beta2, chunk=chunk, reduce_dim=piece_reduce_dim(params[0], self.specs[params[0]]),
            lr_scale=per_param([shape_factor(q) * self.specs[q].lr_mul for q in params]),
            wd_scale=per_param([self.specs[q].wd_mul for q in params]),
            momentum_buffer=None, second_moment=None)

    def _owned(self, group):
        """Global indices [start, stop) of this rank's chunk, and how many are real parameters."""
        start = self.rank * group["chunk"]
        return (start, start + group["chunk"],
                max(0, min(len(group["params"]), start + group["chunk"]) - start))

    def _owned_params(self, group):
        start, _, n_real = self._owned(group)
        return group["params"][start: start + n_real]

    def _owned_weights(self, group, dtype):
        """This rank's chunk of a group's weights in `dtype` (zero-padded to the chunk)."""
        params, first = self._owned_params(group), group["params"][0]
        out = torch.zeros(group["chunk"], *first.shape, dtype=dtype, device=first.device)
        if params:
            torch.stack([p.to(dtype) for p in params], out=out[: len(params)])
        return out

    def _stack(self, tensors, group, dtype=None):
        shape = group["params"][0].shape
        out = torch.zeros(group["chunk"] * self.world_size, *shape, dtype=dtype or tensors[0].dtype,
                          device=tensors[0].device)
        torch.stack([t.to(out.dtype) for t in tensors], out=out[: len(tensors)])
        return out

    def _wire(self, group):
        """The dtype a group's gradients and new weights travel in."""
        return self.wire_dtype if self.wire_dtype is not None else group["params"][0].dtype

    def _reduce(self, group):
        """Start the reduce-scatter (AVG) of a group's stacked gradients: (local chunk, handle)."""
        grads = self._stack([p.grad for p in group["params"]], group,
                            self._wire(group) if self.world_size > 1 else None)
        if self.world_size == 1:
            return grads, None
        local = grads.new_empty(group["chunk"], *grads.shape[1:])
        return local, dist.reduce_scatter_tensor(local, grads, op=dist.ReduceOp.AVG, async_op=True)

    @torch.no_grad()
    def reduce_grads(self):
        self._pending = [self._reduce(group) for group in self.param_groups]

    @torch.no_grad()
    def update(self):
        """Groups smallest first: each one's Polar Express runs while the later groups' gradients
        are still being reduced."""
        pending, self._pending = self._pending or [self._reduce(group)
                                                   for group in self.param_groups], None
        for group, (local, handle) in zip(self.param_groups, pending):
            if handle is not None:
                handle.wait()
            new_weights = self._update_chunk(group, local.to(group["params"][0].dtype))
            if self.world_size > 1:
                sent = new_weights.to(self._wire(group))
                full = sent.new_empty(group["chunk"] * self.world_size, *sent.shape[1:])
                handle = dist.all_gather_into_tensor(full, sent, async_op=True)
                self._gathers.append((group, full, handle,
                                      new_weights if sent.dtype != new_weights.dtype else None))
            else:
                self._gathers.append((group, new_weights, None, None))

    @torch.no_grad()
    def finish(self):
        gathers, self._gathers = self._gathers, []
        for group, full, handle, exact in gathers:
            if handle is not None:
                handle.wait()
            for p, new in zip(group["params"], full):
                p.copy_(new)
            if exact is not None:  # this rank's chunk: the exact weights, not their rounding
                for p, new in zip(self._owned_params(group), exact):
                    p.copy_(new)

    @torch.no_grad()
    def exact_weights(self):
        if self.world_size == 1:
            return
        for group in self.param_groups:
            if self._wire(group) == group["params"][0].dtype:
                continue
            local = self._owned_weights(group, group["params"][0].dtype)
            for p, exact in zip(group["params"], gather_chunks(local, self.world_size)):
                p.copy_(exact)

    def _update_chunk(self, group, grad):
        """NorMuon's steps 1-5 on this rank's chunk (consumed in place); returns its new weights."""
        start, stop, _ = self._owned(group)
        params = self._owned_params(group)
        if group["momentum_buffer"] is None:
            group["momentum_buffer"] = torch.zeros_like(grad)
            first = group["params"][0]
            group["second_moment"] = grad.new_zeros(grad.shape[0],
                                                    *second_moment_shape(first, self.specs[first]))
        mu = group["momentum"]
        buf = group["momentum_buffer"]
        buf.lerp_(grad, 1 - mu)
        nesterov = grad.lerp_(buf, mu)
        update = torch.zeros_like(grad, dtype=self.polar["dtype"])
        for pieces, lo, hi in label_runs([self.specs[p].pieces for p in params]):
            # a parameter of several pieces (the merged attention weight's Q, K, V, O; Q and K
            # head pairs) is that many matrices for both steps
            update[lo:hi] = normuon_direction(nesterov[lo:hi], group["second_moment"][lo:hi],
                                              pieces, group["reduce_dim"], group["beta2"],
                                              self.polar, self.normalize)
        weights = self._owned_weights(group, torch.float32)
        lr = group["lr"]
        lr_factor = (group["lr_scale"][start:stop] * lr).view(-1, 1, 1)
        wd_factor = (group["wd_scale"][start:stop] * group["weight_decay"] * lr).view(-1, 1, 1)
        return self.apply_update(weights, update, lr_factor, wd_factor).to(group["params"][0].dtype)

    def state_dict(self):
        """Each parameter's momentum and second moment in the order the parameters were given: the
        same at any world size or grouping, on every rank; collective when distributed."""
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
                local = values[0].new_zeros(group["chunk"], *values[0].shape,
                                            device=group["params"][0].device)
                for i, value in enumerate(values[start: start + n_real]):
                    local[i] = value
                group[key] = local


def piece_reduce_dim(p, spec):
    """NorMuon normalizes a piece per row (-1) if it is at least as tall as wide, else per column
    (-2); gates always per row."""
    rows, cols = p.shape
    return -1 if rows // spec.pieces >= cols or spec.label == "gate" else -2


def second_moment_shape(p, spec):
    """NorMuon's second moment of one parameter: one value per row, or per column of each piece."""
    rows, cols = p.shape
    return (rows, 1) if piece_reduce_dim(p, spec) == -1 else (spec.pieces, cols)


def stacked_groups(table, world_size):
    """NorMuon's communication groups: parameters of one shape and second-moment layout (sorted by
    label), split in two when each rank can still own one of each half; smallest groups first.
    Each is stacked, padded to a multiple of the world size and cut into equal per-rank chunks."""
    by_shape, label = {}, {}
    for p, spec in table:
        by_shape.setdefault((tuple(p.shape), second_moment_shape(p, spec)), []).append(p)
        label[p] = spec.label
    groups = []
    for (shape, _), same_shape in sorted(by_shape.items(),
                                         key=lambda kv: math.prod(kv[0][0]) * len(kv[1])):
        same_shape = sorted(same_shape, key=label.get)  # stable: keeps model order per label
        parts = 2 if len(same_shape) >= 2 * world_size else 1
        chunk = -(-len(same_shape) // (parts * world_size))
        groups += [same_shape[start: start + chunk * world_size]
                   for start in range(0, len(same_shape), chunk * world_size)]
    return groups


def gather_chunks(local, world_size):
    if world_size == 1:
        return local
    full = local.new_empty(local.shape[0] * world_size, *local.shape[1:])
    dist.all_gather_into_tensor(full, local.contiguous())
    return full


def label_runs(labels):
    """[(label, start, stop)] for the maximal runs of equal consecutive labels (or other values)."""
    runs = []
    for i, label in enumerate(labels):
        if runs and runs[-1][0] == label:
            runs[-1][2] = i + 1
        else:
            runs.append([label, i, i + 1])
    return [tuple(run) for run in runs]


def normuon_direction(stack, second_moment, pieces, reduce_dim, beta2, polar, normalize=None):
    """Polar Express, then variance normalization (normalize_variance or its compiled version), of
    an (n, rows, cols) stack of one kind of matrix, each matrix as `pieces` row blocks of its own
    (second_moment is updated in place)."""
    n, rows, cols = stack.shape
    update = polar_express(stack.reshape(n * pieces, rows // pieces, cols), **polar)
    moment = second_moment.view(n * pieces, -1, second_moment.size(-1))
    return (normalize or normalize_variance)(update, moment, reduce_dim, beta2).view(n, rows, cols)


def cautious_update(weights, update, lr_factor, wd_factor):
    """weights - weights * wd * lr (where update and weight agree in sign) - update * lr."""
    mask = (update * weights) >= 0
    return weights - weights * mask * wd_factor * lr_factor - update * lr_factor


def normalize_variance(update, second_moment, reduce_dim, beta2):
    """NorMuon: divide by a running RMS along one axis, then restore each matrix's Frobenius norm.
    Norms come from the per-axis means of squares (as the reference computes them); the result
    keeps the dtype of `update`."""
    mean_square = update.float().square().mean(dim=reduce_dim, keepdim=True)
    axis_len = update.size(reduce_dim)
    norm_before = mean_square.sum(dim=(-2, -1), keepdim=True).mul_(axis_len).sqrt_()
    second_moment.lerp_(mean_square.to(second_moment.dtype), 1 - beta2)
    step = second_moment.clamp_min(1e-10).rsqrt()
    norm_after = ((mean_square * axis_len) * step.float().square()).sum(dim=(-2, -1),
                                                                        keepdim=True).sqrt_()
    return update * (step * (norm_before / norm_after.clamp_min(1e-10))).type_as(update)


def ema_(average, value, beta):
    """average <- beta * average + (1 - beta) * value, in place (an Adam moment, a track-3 factor);
    beta a float, or a 0-dim tensor in compiled code (a new value needs no new graph)."""
    if isinstance(beta, Tensor):
        return average.mul_(beta).add_(value * (1 - beta))
    return average.mul_(beta).add_(value, alpha=1 - beta)


def ema_square_(average, value, beta):
    """average <- beta * average + (1 - beta) * value^2, in place (Adam's second moment); beta as
    for ema_."""
    if isinstance(beta, Tensor):
        return average.mul_(beta).add_(value * value * (1 - beta))
    return average.mul_(beta).addcmul_(value, value, value=1 - beta)


def adam_direction(m, v, t, beta1, beta2, eps):
    """Adam's bias-corrected direction m_hat / (sqrt(v_hat) + eps) at step t (>= 1); DistAdam's
    reference formula differs on purpose (eps on the uncorrected sqrt(v))."""
    return (m / (1 - beta1 ** t)) / ((v / (1 - beta2 ** t)).sqrt() + eps)


FLOAT32_MAX = torch.finfo(torch.float32).max


def adam_update_(exp_avg, exp_avg_sq, grad, weight, beta1, beta2, eps, step_size, decay):
    """The reference's Adam step with cautious decay (only where update x weight > 0), in fp32: the
    moments are updated in place; `weight`, an fp32 copy of the slice, becomes the new weight."""
    m = ema_(exp_avg.clone(), grad, beta1)
    v = ema_square_(exp_avg_sq.clone(), grad, beta2)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    update = m.div_(v.sqrt_().add_(eps)).mul_(step_size)
    update.add_(weight * decay * ((update * weight) > 0))
    return weight.sub_(update)


# DistAdam's parameters up to this many elements share their collectives (a bucket per dtype): at
# 8 GPUs a collective costs a launch and NCCL's latency however small it is, and recipe 89 has 25
# such parameters of at most 98,304 elements (gates, lambdas, scalars, MUDD networks) beside 8
# tables of 38.6M elements or more, which travel alone (a bucket would copy them).
ADAM_BUCKET_NUMEL = 1 << 20


class SparseRows:
    """Record #89's sparse reduce-scatter (AVG) of a table whose gradient is nonzero only in rows
    the host knows (the loader's bigram ids since the last exchange, note()): each rank sends each
    other rank only the touched rows of that rank's slice (all-to-all of the counts host to host,
    then of the row numbers and rows on the device: no host-device sync); the owner adds them into
    its own slice of its gradient and divides by the world size. Per element the dense path's sum
    of `world` terms in another order; an untouched row is exactly 0 either way."""

    def __init__(self, table, rank, world_size):
        self.table, self.rank, self.world_size = table, rank, world_size
        self.rows = -(-table.shape[0] // world_size)  # an owner's slice, padded
        self.touched = np.zeros(table.shape[0], dtype=bool)
        cuda = table.device.type == "cuda"
        self.host_group = dist.new_group(backend="gloo") if cuda else None  # (NCCL: device only)
        # the row numbers' upload (pinned): the one before was two steps ago, and the host is never
        # more than one step ahead of the device (train_step's losses are read a step late)
        self.staging = torch.empty(2 * len(table), dtype=torch.int32, pin_memory=True) \
            if cuda else None

    def note(self, ids):
        self.touched[ids] = True

    def exchange_counts(self, sent):
        """How many rows each rank sends this one, given how many it sends each."""
        received = torch.empty(self.world_size, dtype=torch.int64)
        dist.all_to_all_single(received, torch.tensor(sent), group=self.host_group)
        return received.tolist()

    def start(self, shard):
        """Start the exchange into `shard`, this rank's slice of the table's (padded) gradient;
        wait() completes it."""
        rows = np.flatnonzero(self.touched).astype(np.int32)
        self.touched[:] = False
        bounds = np.searchsorted(rows, np.arange(self.world_size + 1) * self.rows)
        rows = np.delete(rows, np.s_[bounds[self.rank]: bounds[self.rank + 1]])  # in shard already
        sent = np.diff(bounds)
        sent[self.rank] = 0
        sent = sent.tolist()
        received = self.exchange_counts(sent)
        # each row's number in the table and in its owner's slice, in one upload
        ids = torch.from_numpy(np.concatenate([rows, rows % self.rows]))
        if self.staging is not None:  # (pinned: the copy to the device is asynchronous)
            ids = self.staging[: ids.numel()].copy_(ids)
        ids = ids.to(self.table.device, non_blocking=True).view(2, rows.size)
        n, grad = sum(received), self.table.grad
        self.shard, self.ids, self.values = shard, ids.new_empty(n), grad.new_empty(n, grad.size(1))
        self.received = received
        self.works = [dist.all_to_all_single(self.ids, ids[1], received, sent, async_op=True),
                      dist.all_to_all_single(self.values, grad[ids[0]], received, sent,
                                             async_op=True)]
        return self

    def wait(self):
        for work in self.works:
            work.wait()
        # one sender at a time: no two adds meet in an element, so the sum's order is fixed
        for ids, values in zip(self.ids.split(self.received), self.values.split(self.received)):
            self.shard.index_add_(0, ids, values)
        self.shard.div_(self.world_size)
        self.shard = self.ids = self.values = self.works = None


def sparse_bigram_exchange(hp, world_size):
    """Whether DistAdam exchanges the bigram table's gradient sparsely (SparseRows): with several
    ranks, when the tokens one rank feeds between two Adam steps (two steps at the largest batch),
    which bound the rows it touches, are at most half the table's rows, so that it sends at most
    half the dense reduce-scatter's rows. Record #89: 8 ranks of one micro-step each."""
    tokens = 2 * max(hp.batch_sizes) // world_size
    return world_size > 1 and 0 < 2 * tokens <= hp.bigram_vocab_size


class DistAdam(ScheduledOptimizer):
    """ZeRO-1 Adam: each rank keeps the fp32 moments of its slice of dim 0 of every parameter (a
    first dimension that does not divide by the world size is zero-padded in the communication
    buffers and the moments). step() starts every reduce-scatter (AVG), then per parameter waits,
    updates its slice and all-gathers it; parameters up to ADAM_BUCKET_NUMEL elements travel as one
    bucket per dtype (each element reduced as it would be alone). A parameter's own betas (its
    ParamSpec's) replace `betas`. Cautious decay where update x weight > 0. `tie` = (head,
    embedding): until untie(), the embedding's gradient joins the head's, and the embedding is a
    copy of the updated head. `sparse`: a table whose gradient travels as SparseRows (alone), the
    rows each micro-step can touch given to note_rows()."""

    def __init__(self, table, lr, betas, eps, weight_decay, tie=None, compile_math=False,
                 sparse=None):
        """table: [(parameter, ParamSpec)] (GPT.param_table's DistAdam part)."""
        self.rank, self.world_size = world_info()
        self.sparse = None if sparse is None else SparseRows(sparse, self.rank, self.world_size)
        # the pointwise math compiled (fused) on the GPU, as the reference's is; the per-step
        # factors, and there the betas (float64: 1 - beta as in Python), are 0-dim CPU tensors,
        # so one graph per shape serves every parameter group and step
        self.compiled = compile_math
        self.math = torch.compile(adam_update_, dynamic=False) if compile_math else adam_update_
        self._step_size, self._decay = torch.zeros(()), torch.zeros(())
        self._betas = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
        self._pending, self._gathers = None, []
        self.tie, self.tied = tie, tie is not None
        self.param_groups = [dict(params=[p], lr=lr, initial_lr=lr, betas=spec.betas or betas,
                                  eps=eps, weight_decay=weight_decay, lr_mul=spec.lr_mul,
                                  wd_mul=spec.wd_mul, step=0, exp_avg=None, exp_avg_sq=None)
                             for p, spec in table]

    def note_rows(self, ids):
        """The sparse table's rows (host ids) a micro-step's backward may make nonzero."""
        if self.sparse is not None and ids is not None:
            self.sparse.note(ids)

    def zero_grad(self):
        super().zero_grad()
        if self.sparse is not None:
            self.sparse.touched[:] = False

    def untie(self):
        """From now on the embedding trains on its own, from the head's weights and Adam state."""
        head, embed = (self._group_of(p) for p in self.tie)
        embed["step"] = head["step"]
        for key in ("exp_avg", "exp_avg_sq"):
            embed[key] = None if head[key] is None else head[key].clone()
        self.tied = False

    def _group_of(self, p):
        return next(group for group in self.param_groups if group["params"][0] is p)

    def _padded(self, t):
        """t zero-padded to a multiple of the world size in rows (t itself if none are needed)."""
        missing = -t.shape[0] % self.world_size
        return t if missing == 0 else torch.cat([t, t.new_zeros(missing, *t.shape[1:])])

    def _slice(self, t):
        """This rank's rows of a padded tensor."""
        rows = t.shape[0] // self.world_size
        return t[self.rank * rows: (self.rank + 1) * rows]

    def _is_sparse(self, p):
        return self.sparse is not None and p is self.sparse.table

    def _units(self):
        """The stepping groups as they communicate: a large parameter alone, and per dtype one
        bucket of the parameters up to ADAM_BUCKET_NUMEL elements, where its first member is (the
        same order on every rank)."""
        units, buckets = [], {}
        for group in self._stepping_groups():
            p = group["params"][0]
            if p.numel() > ADAM_BUCKET_NUMEL or self._is_sparse(p):
                units.append([group])
            elif p.dtype in buckets:
                buckets[p.dtype].append(group)
            else:
                buckets[p.dtype] = [group]
                units.append(buckets[p.dtype])
        return units

    def _reduce(self, unit):
        """Start the reduce-scatter (AVG) of a unit's gradients in one collective: (this rank's rows
        of each, handle); alone: (the gradients, None). Each padded gradient is (world size, its
        slice), laid side by side with the others' (a view, alone), so rank r gets every slice r."""
        params = [group["params"][0] for group in unit]
        if self.world_size == 1:
            return [p.grad for p in params], None
        if self._is_sparse(params[0]):
            shard = self._slice(self._padded(params[0].grad))
            return [shard], self.sparse.start(shard)
        views = [self._padded(p.grad.contiguous()).view(self.world_size, -1) for p in params]
        flat = views[0] if len(views) == 1 else torch.cat(views, dim=1)
        local = flat.new_empty(flat.shape[1])
        handle = dist.reduce_scatter_tensor(local, flat.view(-1), op=dist.ReduceOp.AVG,
                                            async_op=True)
        slices = local.split([v.shape[1] for v in views])
        return [s.view(-1, *p.shape[1:]) for s, p in zip(slices, params)], handle

    def _gather(self, unit, shards):
        """Start the all-gather of a unit's updated slices in one collective: (params, output,
        handle). A parameter alone whose rows divide by the world size is gathered in place."""
        params = [group["params"][0] for group in unit]
        if len(params) == 1 and params[0].shape[0] % self.world_size == 0:
            p = params[0]
            return params, p, dist.all_gather_into_tensor(p, shards[0], async_op=True)
        local = (shards[0].reshape(-1) if len(shards) == 1
                 else torch.cat([s.reshape(-1) for s in shards]))
        full = local.new_empty(self.world_size * local.numel())
        return params, full, dist.all_gather_into_tensor(full, local, async_op=True)

    def _stepping_groups(self):
        """The groups this step updates (a tied embedding follows the head instead)."""
        return [group for group in self.param_groups
                if not (self.tied and group["params"][0] is self.tie[1])]

    @torch.no_grad()
    def reduce_grads(self):
        if self.tied:
            head, embed = self.tie
            head.grad += embed.grad
        self._pending = [(unit, *self._reduce(unit)) for unit in self._units()]

    @torch.no_grad()
    def update(self):
        if self._pending is None:
            self.reduce_grads()
        pending, self._pending = self._pending, None
        for unit, grads, handle in pending:
            if handle is not None:
                handle.wait()
            shards = []
            for group, grad in zip(unit, grads):
                p = group["params"][0]
                shard = self._slice(self._padded(p))
                new_shard = self._adam_update(group, grad.float(),
                                              shard.to(torch.float32, copy=True), p)
                if self.world_size == 1:
                    shard.copy_(new_shard)
                else:
                    shards.append(new_shard.to(p.dtype))
            if shards:
                self._gathers.append(self._gather(unit, shards))

    @torch.no_grad()
    def finish(self):
        gathers, self._gathers = self._gathers, []
        for params, full, handle in gathers:
            handle.wait()
            if full is params[0]:
                continue
            parts = full.view(self.world_size, -1).split(
                [-(-p.shape[0] // self.world_size) * p[0].numel() for p in params], dim=1)
            for p, part in zip(params, parts):
                p.copy_(part.reshape(-1, *p.shape[1:])[: p.shape[0]])
        if self.tied:
            head, embed = self.tie
            embed.copy_(head)

    def _adam_update(self, group, grad, weight, p):
        """The reference's Adam step with cautious decay, in fp32; `weight`, an fp32 copy of this
        rank's slice, is updated in place."""
        beta1, beta2 = group["betas"]
        if group["exp_avg"] is None:
            group["exp_avg"] = torch.zeros_like(weight, dtype=torch.float32)
            group["exp_avg_sq"] = torch.zeros_like(weight, dtype=torch.float32)
        group["step"] += 1
        t = group["step"]
        lr = group["lr"] * group["lr_mul"]  # the parameter's own learning rate
        # unlike adam_direction, eps is added to the uncorrected sqrt(v) and both bias corrections
        # live in the step size, as in the reference
        self._step_size.fill_(lr * ((1 - beta2 ** t) ** 0.5 / (1 - beta1 ** t)))
        # decay factor lr * (lr * wd * wd_mul): it follows the square of the parameter's own lr (an
        # absurd lr saturates it instead of raising, so the run stops with the non-finite-loss hint)
        self._decay.fill_(min(lr * group["weight_decay"] * group["wd_mul"] * lr, FLOAT32_MAX))
        if self.compiled:
            beta1, beta2 = (t.fill_(beta) for t, beta in zip(self._betas, (beta1, beta2)))
        return self.math(group["exp_avg"], group["exp_avg_sq"], grad, weight, beta1, beta2,
                         group["eps"], self._step_size, self._decay)

    def state_dict(self):
        """Full moments (all ranks' slices gathered, padding cut off); collective if distributed."""
        groups = []
        for group in self.param_groups:
            rows = group["params"][0].shape[0]
            entry = {"step": group["step"]}
            for key in ("exp_avg", "exp_avg_sq"):
                entry[key] = None if group[key] is None else \
                    gather_chunks(group[key], self.world_size)[:rows].cpu().clone()
            groups.append(entry)
        return {"groups": groups, "tied": self.tied}

    def load_state_dict(self, state):
        if len(state["groups"]) != len(self.param_groups) or any(
                entry[key] is not None and entry[key].shape != group["params"][0].shape
                for group, entry in zip(self.param_groups, state["groups"])
                for key in ("exp_avg", "exp_avg_sq")):
            raise ValueError("DistAdam state does not match the parameters of this model")
        self.tied = state["tied"] and self.tie is not None
        for group, entry in zip(self.param_groups, state["groups"]):
            group["step"] = entry["step"]
            p = group["params"][0]
            for key in ("exp_avg", "exp_avg_sq"):
                group[key] = None if entry[key] is None else \
                    self._slice(self._padded(entry[key].to(p.device))).clone()


def split_params_for_optimizers(model):
    """(the matrix optimizer's table, DistAdam's): GPT.param_table's (parameter, ParamSpec) pairs,
    in model order: hidden matrices and (unless DistAdam's) gates; embeddings, head, scalars."""
    table = model.param_table()
    matrix = [(p, spec) for p, spec in table if spec.optimizer == "matrix"]
    adam = [(p, spec) for p, spec in table if spec.optimizer == "adam"]
    covered = [id(p) for p, _ in matrix + adam]
    if (sorted(covered) != sorted(id(p) for p in model.parameters())
            or len(set(covered)) != len(covered)):
        raise AssertionError("optimizer parameter sets must cover every model parameter "
                             "exactly once")
    return matrix, adam


def make_optimizers(model, hp, backend):
    """(matrix optimizer, DistAdam) on the model's Backend: NorMuon (the record) or track3.py's
    --matrix_optimizer, with the Backend's Polar Express path, wire dtype and compiled math."""
    matrix_table, adam_table = split_params_for_optimizers(model)
    embed = getattr(model, "embed", None)
    sparse = model.bigram_embed if sparse_bigram_exchange(hp, world_info()[1]) else None
    adam = DistAdam(adam_table, hp.adam_lr, hp.adam_betas, hp.adam_eps, hp.adam_wd,
                    tie=None if embed is None else (model.lm_head.weight, embed),
                    compile_math=backend.compile_math, sparse=sparse)
    if hp.matrix_optimizer != "normuon":
        return (load_companion("track3.py").make_optimizer(hp.matrix_optimizer, matrix_table, hp),
                adam)
    return NorMuon(matrix_table, hp.muon_lr, hp.muon_wd, hp.muon_momentum[0], hp.muon_beta2,
                   polar=backend.polar, compile_math=backend.compile_math,
                   wire_dtype=torch.bfloat16 if backend.bf16_params else None), adam


def step_optimizers(plan, matrix_opt, adam):
    """The matrix optimizer every step; DistAdam at the StepPlan's Adam steps (odd steps: its
    gradients accumulate over two), untying the embedding from the head after the step the plan
    says. Every reduce-scatter starts first (DistAdam's small ones, then the matrix optimizer's,
    smallest group first); then the matrix optimizer's updates, each overlapping the later groups'
    reductions; then DistAdam's, overlapping the matrix optimizer's all-gathers."""
    optimizers = ([adam] if plan.adam_step else []) + [matrix_opt]
    for optimizer in optimizers:
        optimizer.reduce_grads()
    for optimizer in reversed(optimizers):
        optimizer.update()
    for optimizer in optimizers:
        optimizer.finish()
        optimizer.zero_grad()
    if plan.unties_after:
        adam.untie()


# ----------------------------------------------------------------------------------------------
# Schedule: the Stages, and Schedule.at(step): everything that changes with the step
# (record: 1380 steps in thirds + 10)


# The float expressions below follow the reference recipes' schedule functions operation for
# operation, so every step gets bit-identical values (e.g. int(3 * (step / n)), not 3 * step // n).


class Stage(NamedTuple):
    """One stage of the run: the thirds of the scheduled steps (0-2), then the extension (3)."""
    first_step: int
    end_step: int  # the next stage's first step (== first_step: an empty stage of a very short run)
    batch_tokens: int
    max_seq_len: int  # the longest document piece
    window_blocks: tuple  # (short, long) attention windows in blocks: short = long // 2, as #89
    lr_multiplier: float  # before the cooldown
    mtp_start: tuple  # next 3 tokens' loss weights at first_step, to mtp_end (extension: flat)
    mtp_end: tuple


def stage_ends(hp):
    """Where the thirds end: round(n k / 3) with k / 3 summed in floats, as the reference does."""
    n, ends, fraction = hp.num_scheduled_iterations, [], 0.0
    for _ in range(2):
        fraction += 1 / 3
        ends.append(round(fraction * n))
    return ends + [n]


def stages(hp):
    """The run's four Stages, from the flags' per-stage values."""
    n = hp.num_scheduled_iterations
    bounds = [0, *stage_ends(hp), n + hp.num_extension_iterations]
    mtp_start = [hp.mtp_weights_start[MTP_HORIZON * k: MTP_HORIZON * (k + 1)] for k in range(3)]
    mtp_end = [hp.mtp_weights_end[MTP_HORIZON * k: MTP_HORIZON * (k + 1)] for k in range(3)]
    longs = (*hp.window_blocks, hp.extension_window_blocks)
    return [Stage(bounds[k], bounds[k + 1], (*hp.batch_sizes, hp.batch_sizes[-1])[k],
                  hp.first_stage_max_seq_len if k == 0 and hp.first_stage_max_seq_len
                  else hp.max_seq_len, (longs[k] // 2, longs[k]),
                  (*hp.lr_multipliers, hp.lr_multipliers[-1])[k], (*mtp_start, mtp_end[-1])[k],
                  (*mtp_end, mtp_end[-1])[k]) for k in range(4)]


class StepPlan(NamedTuple):
    """Everything one step needs that changes with the step (Schedule.at)."""
    step: int
    stage: int  # 0-2: the thirds of the scheduled steps, 3: the extension (also the final step's)
    batch_tokens: int
    max_seq_len: int  # the longest document piece
    windows: tuple  # (short, long) attention windows in blocks
    window_tensor: Tensor | None  # the same on the run's device (the compiled model takes data)
    val_window_tensor: Tensor | None  # a validation's windows at this step (the end: the final's)
    lr_multiplier: float
    momentum: float  # NorMuon's
    mtp_weights: Tensor | None  # loss weights of the next 3 tokens (None: the next-token loss)
    adam_step: bool  # DistAdam updates at this step (odd steps; its gradients accumulate over two)
    unties_after: bool  # the embedding leaves the head after this step's optimizer step


class Schedule:
    """The run's schedule, built once from the flags: its Stages, and at(step), a step's StepPlan.
    With a device, every window pair and every step's multi-token weights are device tensors made
    here once, so no step copies them and no window change recompiles (without one, at() has no
    window tensors and makes the multi-token weights on the CPU)."""

    def __init__(self, hp, device=None):
        self.hp, self.stages = hp, stages(hp)
        self.total_steps = hp.num_scheduled_iterations + hp.num_extension_iterations
        # the first odd step of --untie_stage: an Adam step, still updating embedding and head tied
        self.untie_step = None if hp.untie_stage < 0 else self.stages[hp.untie_stage].first_step | 1
        # the final validation widens only the long window (no YaRN); the short one stays the
        # extension's
        self.final_windows = (hp.extension_window_blocks // 2, hp.final_val_window_blocks)
        self.multi_token = any(w for k, w in enumerate(hp.mtp_weights_start + hp.mtp_weights_end)
                               if k % MTP_HORIZON)
        self._on_device, self._mtp = {}, None
        if device is not None:
            self._on_device = {pair: torch.tensor(pair, dtype=torch.int32, device=device)
                               for pair in self.window_pairs()}
            if self.multi_token:
                self._mtp = torch.tensor([self.mtp_weights(step)
                                          for step in range(self.total_steps + 1)], device=device)

    def window_pairs(self):
        """{(short, long)} of every window pair the run trains or validates with."""
        return {stage.window_blocks for stage in self.stages} | {self.final_windows}

    def stage_index(self, step):
        """0, 1, 2 for the thirds of the scheduled steps, 3 for the extension (and final step)."""
        return next((k for k, stage in enumerate(self.stages[:3]) if step < stage.end_step), 3)

    def stage_first_steps(self):
        """The first step of every stage that has steps (what the compile warm-up visits)."""
        return sorted({stage.first_step for stage in self.stages
                       if stage.first_step < stage.end_step})

    def lr_multiplier(self, step):
        """The stage's multiplier (switching with the batch size), then a linear cooldown from step
        int(n (1 - cooldown_frac)) to final_lr_multiplier at step n, held through the extension."""
        hp, n = self.hp, self.hp.num_scheduled_iterations
        multiplier = self.stages[self.stage_index(step)].lr_multiplier
        cooldown_start = int(n * (1 - hp.cooldown_frac))
        if step >= cooldown_start:
            t = (min(1.0, (step - cooldown_start) / (n - cooldown_start)) if n > cooldown_start
                 else 1.0)
            multiplier = multiplier * (1 - t) + hp.final_lr_multiplier * t
        return multiplier

    def momentum(self, step):
        """NorMuon's momentum: linear warm-up from start to end value, back over the final steps."""
        hp = self.hp
        low, high = hp.muon_momentum
        cooldown_start = self.total_steps - hp.muon_momentum_cooldown_steps
        if step < hp.muon_momentum_warmup_steps:
            return low + step / hp.muon_momentum_warmup_steps * (high - low)
        if step > cooldown_start:
            return high - (step - cooldown_start) / hp.muon_momentum_cooldown_steps * (high - low)
        return high

    def mtp_weights(self, step):
        """The next 3 tokens' loss weights at `step`: linear in each stage from its start to its end
        values; the extension (and the final step) keep the last stage's end values."""
        stage = self.stages[self.stage_index(step)]
        if stage.first_step == self.hp.num_scheduled_iterations:
            return stage.mtp_end
        t = (step - stage.first_step) / (stage.end_step - stage.first_step)
        return tuple(a + (b - a) * t for a, b in zip(stage.mtp_start, stage.mtp_end))

    def at(self, step):
        stage = self.stage_index(step)
        windows = self.stages[stage].window_blocks
        val_windows = self.final_windows if step == self.total_steps else windows
        adam_step = step % 2 == 1
        mtp = None if not self.multi_token else torch.tensor(self.mtp_weights(step)) \
            if self._mtp is None else self._mtp[step]
        return StepPlan(step, stage, self.stages[stage].batch_tokens,
                        self.stages[stage].max_seq_len, windows, self._on_device.get(windows),
                        self._on_device.get(val_windows), self.lr_multiplier(step),
                        self.momentum(step), mtp, adam_step, adam_step and step == self.untie_step)


def start_step(plan, model, *optimizers):
    """Set what changes with the step: each optimizer's lr multiplier and momentum (set_schedule),
    and YaRN on the model's rotary embedding."""
    for optimizer in optimizers:
        optimizer.set_schedule(plan.lr_multiplier, plan.momentum)
    model.follow_window(plan.windows)


# ----------------------------------------------------------------------------------------------
# Training: the run's data and model, Trainer (warm-up, timed steps, validation)


def finite_validation_loss(value):
    if not math.isfinite(value):
        raise FloatingPointError(f"validation loss is {value}; lower the learning rates "
                                 f"(--muon_lr/--adam_lr) or check the data, then rerun")
    return value


def step_line(step, total_steps, ms, val_loss=None):
    val = f" val_loss:{val_loss:.4f}" if val_loss is not None else ""
    return (f"step:{step}/{total_steps}{val} train_time:{ms:.0f}ms "
            f"step_avg:{ms / max(step, 1):.2f}ms")


def open_data(hp, schedule, rank, world_size, device, accum, log):
    """(training loader, validation tokens, validation files); all shards checked before work."""
    if hp.micro_batch_tokens:
        pieces = describe_pieces(micro_step_pieces(hp, schedule.stages, world_size, accum))
        log(f"micro_batch_tokens {hp.micro_batch_tokens}: micro-steps of {pieces} (documents in "
            f"order, at most {hp.micro_batch_tokens} tokens a piece, with the previous document "
            f"and 2 targets of context, padded)")
    train_pattern, val_pattern, data_description = resolve_data(hp, rank)
    log(f"data: {data_description}")
    val_tokens = read_validation_tokens(val_pattern, hp.val_tokens + 1, hp.vocab_size)  # read once
    loader = TrainLoader(train_pattern, rank, world_size, device, hp.cycle_data,
                         vocab_size=hp.vocab_size, bigram_rows=hp.bigram_vocab_size)
    per_micro_step = max(hp.batch_sizes) // accum + world_size  # a micro-step is from one shard
    if per_micro_step > max(loader.shard_tokens):
        raise DataError(f"--batch_sizes {max(hp.batch_sizes)} takes {per_micro_step} tokens per "
                        f"micro-step from one shard, but the largest training shard holds "
                        f"{max(loader.shard_tokens)}; use smaller batches or larger shards")
    if not hp.cycle_data:
        check_shards_last(hp, schedule, loader.files, loader.shard_tokens, world_size, accum)
    else:
        check_a_shard_fills_each_micro_step(schedule, train_pattern, loader, world_size, accum)
    return loader, val_tokens, sorted(glob.glob(val_pattern))


def start_model(hp, backend, device, world_size):
    """(model, its forward: compiled on CUDA) from --seed, the same on every rank (rank 0's weights
    and buffers, such as the bigram signs, are broadcast)."""
    torch.manual_seed(hp.seed)
    model = GPT(hp, backend, device)
    # what a checkpoint holds; the FP8 MLP copies (gloo has no float8) are made again
    if world_size > 1:
        for t in model.state_dict().values():
            if isinstance(t, Tensor):
                dist.broadcast(t, 0)
        model.refresh_fp8_mlp()
    if device.type == "cuda" and hp.compile:
        torch._dynamo.config.cache_size_limit = 64
        return model, torch.compile(model, dynamic=False, fullgraph=True)
    return model, model


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


class TrainClock:
    """Training time in ms; it runs only during training steps (synchronized before each read)."""

    def __init__(self, device):
        self.device, self.ms, self.started = device, 0.0, None

    def start(self):
        synchronize(self.device)
        self.started = time.perf_counter()

    def running_ms(self):
        """The time so far without a synchronization (the step lines' approximate figure)."""
        return self.ms + 1000 * (time.perf_counter() - self.started)

    @contextlib.contextmanager
    def paused(self):
        """Validation and checkpoints do not count as training time."""
        synchronize(self.device)
        self.ms = self.running_ms()
        yield
        self.start()


class Trainer:
    """Holds the run's moving parts: setup in __init__, warm_up(), then run(), the timed loop."""

    def __init__(self, hp, argv=(), stop=None, lifetime=None):
        """`lifetime` (an ExitStack: main's) holds the run lock until the process is done."""
        self.hp, self.stop = hp, stop or StopSignals()  # (one not entered never hears a signal)
        self.rank, self.world_size, self.device = setup_distributed(hp)
        self.schedule = Schedule(hp, self.device)  # the run's one Schedule
        self.total_steps = self.schedule.total_steps
        self.run_id = hp.run_id or str(uuid.uuid4())
        self.checkpoint_folder = Path(hp.log_dir) / "checkpoints" / self.run_id
        self.log = RunLog(Path(hp.log_dir) / f"{self.run_id}.txt", self.rank == 0, hp)
        # everything that can be wrong with the input, before any work
        with failing_together(self.device):
            self.accum = grad_accum_steps(hp, self.world_size)
            check_batch_splits(hp, self.world_size, self.accum)
            if self.rank == 0 and hp.run_id and lifetime is not None:  # (no lock for a fresh uuid)
                lifetime.enter_context(RunLock(self.log.path.parent / f"{self.run_id}.lock",
                                               hp.log_dir))
            continuing = self.rank == 0 and check_outputs(hp, self.log.path, self.checkpoint_folder,
                                                          self.total_steps)
            log_arguments(self.log, argv, hp, continuing)
            self.log(f"world_size {self.world_size}  grad_accum {self.accum}  device {self.device}")
            self.loader, self.val_tokens, val_files = open_data(hp, self.schedule, self.rank,
                                                                self.world_size, self.device,
                                                                self.accum, self.log)
            self.val_shards = shard_record(val_files)
            self.resume_path, self.resume_from = checkpoint_to_resume(hp, self.checkpoint_folder,
                                                                      self.log, continuing)
            if self.resume_from is not None:
                check_resumable(self.resume_path, self.resume_from, hp, self.total_steps,
                                self.log)
                check_same_shards(self.resume_path, self.resume_from["loader"], self.loader,
                                  hp.force, self.log)
                check_same_validation(self.resume_path, self.resume_from.get("validation"),
                                      val_files, hp.force, self.log)
            # --ngram_prior's counts, on the clock (prior_ms joins the training time), and the
            # device's paths (FP8 or not, the prior in the CPU loss), decided once
            self.prior, self.prior_ms = self.count_prior() if hp.ngram_prior else (None, 0.0)
            self.backend = backend_for(hp, self.device, self.accum, prior=self.prior)
        check_ranks_agree(rank_settings(hp, self.device, self.loader.files, val_files,
                                        self.resume_from["step"] if self.resume_from else 0))
        for warning in restart_warnings(hp):
            self.log(f"warning: {warning}")
        self.model, self.forward = start_model(hp, self.backend, self.device, self.world_size)
        self.matrix_opt, self.adam = make_optimizers(self.model, hp, self.backend)
        self.val_context = receptive_field(self.model.plan, self.schedule.window_pairs(),
                                           hp.window_block_tokens)
        val_chunk = tokens_per_rank(hp.val_batch_size, self.world_size, self.accum)
        if val_chunk > piece_cap(hp):
            self.log(describe_validation_pieces(val_chunk, hp.micro_batch_tokens,
                                                self.val_context))
        self.stats, self.clock = RunStats(self.device), TrainClock(self.device)
        self.profiler = StepProfiler(hp, self.run_id, self.total_steps, self.log)
        self.step, self.tokens_seen = 0, 0
        with failing_together(self.device):
            self.log.open(continuing)

    def count_prior(self):
        """(--ngram_prior's prior from the training shards: counted_prior; the ms it took)."""
        began = time.perf_counter()
        prior = counted_prior(self.hp, self.loader.files, sum(self.loader.shard_tokens), self.log)
        return prior, 1000 * (time.perf_counter() - began)

    def begin_step(self, step):
        """The StepPlan of `step`, with its lr, momentum and YaRN state set."""
        plan = self.schedule.at(step)
        start_step(plan, self.model, self.matrix_opt, self.adam)
        return plan

    def train_step(self, plan):
        """One optimizer step as `plan` (begin_step) says: `accum` micro-batches forward and
        backward (in pieces of at most --micro_batch_tokens), the optimizers. Returns ([the step's
        loss, the ranks that got a stop signal] as a device tensor, the async all-reduce summing it
        over the ranks, or None alone); no host-device synchronization happens inside."""
        rank_tokens = tokens_per_rank(plan.batch_tokens, self.world_size, self.accum)
        self.model.train()
        totals = torch.zeros(2, device=self.device)
        total, stop_votes = totals.unbind()
        for _ in range(self.accum):
            # the training loss is a sum over tokens (divided by the micro-steps: GPT.loss), so
            # the pieces' losses add up to the micro-step's
            pieces = self.loader.next_pieces(rank_tokens, plan.max_seq_len, piece_cap(self.hp))
            self.adam.note_rows(self.loader.bigram_ids)
            for batch in pieces:
                loss = self.forward(batch.inputs, batch.targets, batch.cu_seqlens,
                                    plan.window_tensor, batch.bigram_ids, plan.mtp_weights,
                                    batch.positions, batch.loss_mask)
                loss.backward()
                total += loss.detach()
        if self.stop.received:
            stop_votes += 1
        step_optimizers(plan, self.matrix_opt, self.adam)
        self.model.refresh_fp8_mlp(plan.step)
        self.tokens_seen += rank_tokens * self.accum * self.world_size
        # one all-reduce, after the optimizers' collectives (before, it would hold them up): a
        # non-finite loss or a stop signal on any rank stops every rank at the same step
        return totals, dist.all_reduce(totals, async_op=True) if self.world_size > 1 else None

    @torch.no_grad()
    def validate(self, windows):
        """Mean loss over the validation tokens, all ranks together, with a StepPlan's `windows`."""
        hp = self.hp
        self.model.eval()
        with self.stats.eval_memory():
            if hp.micro_batch_tokens:
                losses = [self.validation_loss(pieces, windows) for pieces in validation_pieces(
                    self.val_tokens, hp.val_tokens, hp.val_batch_size, self.rank, self.world_size,
                    self.accum, self.device, hp.micro_batch_tokens, self.val_context,
                    hp.bigram_vocab_size)]
            else:
                losses = [self.forward(batch.inputs, batch.targets, batch.cu_seqlens, windows,
                                       batch.bigram_ids)
                          for batch in validation_batches(
                              self.val_tokens, hp.val_tokens, hp.val_batch_size, self.rank,
                              self.world_size, self.accum, self.device, hp.bigram_vocab_size)]
            loss = torch.stack(losses).mean()
        if self.world_size > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        return finite_validation_loss(loss.item())

    def validation_loss(self, pieces, windows):
        """Mean loss of one validation forward run as `pieces` (validation_pieces): their summed
        losses over its tokens, or the uncut forward's own mean."""
        if len(pieces) == 1 and pieces[0].loss_mask is None:
            batch = pieces[0]
            return self.forward(batch.inputs, batch.targets, batch.cu_seqlens, windows,
                                batch.bigram_ids)
        total = sum(self.forward(p.inputs, p.targets, p.cu_seqlens, windows, p.bigram_ids,
                                 positions=p.positions, loss_mask=p.loss_mask) for p in pieces)
        return total / tokens_per_rank(self.hp.val_batch_size, self.world_size, self.accum)

    def snapshot(self):
        """Everything a bit-exact continuation needs (collective when distributed)."""
        self.matrix_opt.exact_weights()
        return dict(
            step=self.step, training_time_ms=self.clock.ms, tokens_seen=self.tokens_seen,
            model={k: v.detach().cpu().clone() if torch.is_tensor(v) else v
                   for k, v in self.model.state_dict().items()},
            matrix=self.matrix_opt.state_dict(), adam=self.adam.state_dict(),
            loader=self.loader.state_dict(), rng=rng_state(self.device),
            script_sha256=script_sha256(self.hp), world_size=self.world_size,
            hyperparameters=dataclasses.asdict(self.hp), validation=self.val_shards)

    def restore(self, snap):
        self.model.load_state_dict(snap["model"])
        self.matrix_opt.load_state_dict(snap["matrix"])
        self.adam.load_state_dict(snap["adam"])
        self.loader.load_state_dict(snap["loader"])
        set_rng_state(snap["rng"], self.device)
        self.step, self.clock.ms, self.tokens_seen = (snap["step"], snap["training_time_ms"],
                                                      snap["tokens_seen"])
        self.matrix_opt.zero_grad()
        self.adam.zero_grad()
        self.model.refresh_fp8_mlp()  # at the restored scales

    def resume(self, path, snap):
        if self.rank == 0:
            remove_stale_checkpoint_writes(Path(path).parent, self.log)
        try:
            self.restore(snap)
        except (ValueError, RuntimeError) as e:  # a state of another shape (possible with --force)
            raise ConfigError(f"{path}: {str(e).splitlines()[0]}; resume it with the script that "
                              f"wrote it") from None
        moved = f" (written by {snap['world_size']} processes, continued on {self.world_size})" \
            if snap["world_size"] != self.world_size else ""
        self.log(f"resumed from {path} at step {self.step}{moved}")
        if snap["hyperparameters"].get("micro_batch_tokens", 0) != self.hp.micro_batch_tokens:
            self.log(f"--micro_batch_tokens changes from "
                     f"{snap['hyperparameters'].get('micro_batch_tokens', 0)} (the checkpoint's "
                     f"run) to {self.hp.micro_batch_tokens}: the same data from here on, in other "
                     f"pieces")

    def checkpoint(self, tag, required=False):
        """Write a checkpoint (collective; rank 0 writes) and return its path (None elsewhere). A
        failed periodic write only warns (training goes on, earlier checkpoints stay); a failed
        required write (final, preemption) fails on every rank."""
        with failing_together(self.device, during=f"the checkpoint {tag}"):
            snap = self.snapshot()
            return write_checkpoint(self.checkpoint_folder / f"{tag}.pt", snap, required,
                                    self.log) if self.rank == 0 else None

    def warm_up(self):
        """Compile every batch-size/window variant and the validation pass, then undo it all."""
        initial = self.snapshot()
        for first in self.schedule.stage_first_steps():
            for step in range(first, first + self.hp.warmup_steps):
                self.train_step(self.begin_step(step))
        last = self.schedule.at(self.total_steps)
        self.validate(last.window_tensor)
        self.validate(last.val_window_tensor)
        self.restore(initial)
        self.model.rotary.reset()
        synchronize(self.device)

    def log_step(self, step, val_loss=None):
        ms = self.clock.ms if val_loss is not None else self.clock.running_ms()
        self.log(step_line(step, self.total_steps, ms, val_loss))

    def log_pieces(self, stage):
        """The padding of the pieces a stage's micro-steps ran as, and the documents cut (longer
        than a piece)."""
        if self.loader.piece_counts[1]:
            self.log(pieces_line(stage, *map(int, self.loader.piece_counts),
                                 self.hp.micro_batch_tokens))
        self.loader.piece_counts[:] = 0

    def stop_with_checkpoint(self):
        """End the run at a stop signal's request, at a step all ranks chose: checkpoint, raise."""
        path = self.checkpoint(f"step_{self.step:06d}", required=True)
        who = self.stop.received or "a signal to another process"
        raise Preempted(f"preempted at step {self.step} by {who}, checkpoint {path}; continue with "
                        f"--resume auto --run_id {self.run_id}")

    def run(self):
        hp = self.hp
        if hp.warmup_steps:
            self.warm_up()
        if self.resume_from is not None:
            self.resume(self.resume_path, self.resume_from)
        self.stop.note_from_now_on()
        loss_check = LateLossCheck(self.device)
        val_losses, stopping = [], False
        self.loader.piece_counts[:] = 0  # the warm-up's pieces are not the run's
        self.clock.ms += self.prior_ms  # (a resumed run counted again)
        self.clock.start()
        for step in range(self.step, self.total_steps + 1):
            last = step == self.total_steps
            plan = self.begin_step(step)
            if last or (hp.val_loss_every and step % hp.val_loss_every == 0):
                with self.clock.paused():
                    val_losses.append((step, self.validate(plan.val_window_tensor)))
                    self.log_step(step, val_losses[-1][1])
            if last:
                break
            self.profiler.at(step, self.rank)
            stopping |= loss_check.push(step, *self.train_step(plan))
            self.step = step + 1
            self.log_step(self.step)
            if self.step == self.total_steps or self.schedule.stage_index(self.step) != plan.stage:
                self.log_pieces(plan.stage)
            if stopping and checkpoint_complete_after(self.step):
                loss_check.finish()
                with self.clock.paused():
                    self.stop_with_checkpoint()
            if hp.save_every and self.step % hp.save_every == 0 and self.step < self.total_steps:
                with self.clock.paused():
                    self.checkpoint(f"step_{self.step:06d}")
        loss_check.finish()
        if hp.save_checkpoint:
            self.checkpoint("final", required=True)
        for line in self.stats.summary(self.model, hp, self.tokens_seen, self.clock.ms,
                                       self.world_size):
            self.log(line)
        self.loader.close()
        return val_losses


# ==============================================================================================
# The fence: the recipe is above; below, the run's bookkeeping, main() and the CPU fallbacks.
# ==============================================================================================


# ----------------------------------------------------------------------------------------------
# The CLI, generated from Hyperparameters, and its checks; other tracks' files


def parse_bool(text):
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def build_arg_parser(prog="train_gpt.py", hp_class=None):
    """--preset and one flag per field of `hp_class` (Hyperparameters or track 3's), in sections."""
    hp_class = hp_class or Hyperparameters
    sections = {**HP_SECTIONS, **getattr(sys.modules[hp_class.__module__], "HP_SECTIONS", {})}
    parser = argparse.ArgumentParser(
        prog=prog, allow_abbrev=False,  # --num_layer must not silently mean --num_layers
        description="Train the speedrun GPT. Every field of Hyperparameters is a flag; the "
                    "--preset's values are applied first, then the flags. Track 3's optimizers add "
                    "their flags with --matrix_optimizer NAME (see docs/track3.md).")
    hint = ("" if hp_class is not Hyperparameters
            else "; track 3's flags need --matrix_optimizer NAME")

    def one_line_error(message):  # instead of the ~25-line usage that buries the message
        more = hint if message.startswith("unrecognized arguments") else ""
        parser.exit(2, f"{parser.prog}: error: {message}{more} (see --help)\n")
    parser.error = one_line_error
    parser._negative_number_matcher = re.compile(r"^-\.?\d")  # -1e-3 and -1:2 are values, not flags
    parser.add_argument("--preset", choices=sorted(PRESETS), default="record",
                        help="named configuration (default: record)")
    parser.set_defaults(hp_class=hp_class)
    group = parser
    for f in fields(hp_class):
        if f.name in sections:
            group = parser.add_argument_group(sections[f.name])
        group.add_argument(f"--{f.name}", **flag_options(f))
    return parser


def flag_options(f):
    default = f.default
    options = dict(default=None, help=f"{f.metadata['help']} (default: {default})")
    if isinstance(default, bool):  # a bare --force: true
        options.update(type=parse_bool, metavar="BOOL", nargs="?", const=True)
    elif f.metadata.get("layers"):
        options.update(type=int, nargs="*", metavar="LAYER")  # no value: none
    elif isinstance(default, tuple):
        kind = type(default[0])
        options.update(type=kind, nargs=len(default), metavar=kind.__name__.upper())
    else:
        options.update(type=type(default), metavar=type(default).__name__.upper())
    return options


def hyperparameter_class(argv):
    """Hyperparameters, or track 3's if argv's --matrix_optimizer (or --preset's) is not normuon."""
    probe = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    probe.add_argument("--matrix_optimizer", nargs="?")
    probe.add_argument("--preset", nargs="?")
    known = probe.parse_known_args(argv)[0]
    name = (known.matrix_optimizer
            or PRESETS.get(known.preset, {}).get("matrix_optimizer", "normuon"))
    return Hyperparameters if name == "normuon" else load_companion("track3.py").Hyperparameters


def parser_for(argv, prog="train_gpt.py"):
    return build_arg_parser(prog, hyperparameter_class(argv))


def hyperparameters_from(args):
    """The preset's values, then the flags given in `args` (an argparse namespace). Validated."""
    hp_class = args.hp_class
    values = dataclasses.asdict(hp_class())
    values.update(PRESETS[args.preset])
    for f in fields(hp_class):
        value = getattr(args, f.name)
        if value is not None:
            values[f.name] = tuple(value) if isinstance(value, list) else value
    hp = hp_class(**values)
    check_hyperparameters(hp)
    return hp


def parse_args(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    return hyperparameters_from(parser_for(argv).parse_args(argv))


def companion_files(hp):  # files a run may load beside this script; logged after it
    # (--synthetic_fallback's corpus is data/synthetic.py's; by a flag every rank shares, not by the
    # data paths, which may differ between machines)
    return (["track3.py"] * (hp.matrix_optimizer != "normuon")
            + ["ngram_prior.py"] * (hp.ngram_prior > 0)
            + ["data/synthetic.py"] * hp.synthetic_fallback
            + ["flex_flash.py"] * (hp.flex_backend == "flash")
            + ["fp8_kernels.py"] * (hp.fp8 != "off" and on_cuda(hp)))


def on_cuda(hp):  # where setup_distributed puts the run (--device is a machine's own flag)
    return hp.device == "cuda" or (hp.device == "auto" and torch.cuda.is_available())


def load_companion(name):
    """Import the file `name` (a path from this script's folder) once; its train_gpt: this
    module, however run."""
    path = Path(__file__).parent / name
    module = sys.modules.get(path.stem)
    if module is None:
        sys.modules.setdefault("train_gpt", sys.modules[__name__])
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        try:
            spec.loader.exec_module(module)
        except FileNotFoundError:
            del sys.modules[path.stem]
            raise ConfigError(f"{path} is missing: this run needs it beside {Path(__file__).name} "
                              f"(records.py replay writes every file of a log)") from None
    return module

VALUE_RULES = [  # (flags, test, what the test means), applied to every value of a tuple flag
    (("val_tokens", "val_batch_size", "vocab_size", "num_layers", "num_heads", "head_dim",
      "model_dim", "num_scheduled_iterations", "batch_sizes", "max_seq_len", "grad_accum_base",
      "window_block_tokens", "final_val_window_blocks", "muon_lr", "adam_lr", "adam_eps",
      "bigram_dim", "softcap_scale", "head_fp8_amax"), lambda v: v > 0, "must be positive"),
    (("num_extension_iterations", "val_loss_every", "warmup_steps", "save_every", "cpu_threads",
      "micro_batch_tokens", "muon_momentum_warmup_steps", "muon_momentum_cooldown_steps",
      "muon_wd", "adam_wd", "lr_multipliers", "final_lr_multiplier", "bigram_vocab_size",
      "bigram_sign_rows", "value_embed_std", "mudd_dim", "first_stage_max_seq_len",
      "mtp_weights_start", "mtp_weights_end", "value_embed_tables", "ngram_prior"),
     lambda v: v >= 0, "must be >= 0"),
    (("untie_stage",), lambda v: -1 <= v <= 3,
     "must be a stage (0-2, 3: the extension) or -1 (never)"),
    (("window_blocks", "extension_window_blocks"), lambda v: v >= 2,
     "must be at least 2 (short window = long // 2 blocks)"),
    (("muon_momentum", "muon_beta2", "adam_betas"), lambda v: 0 <= v < 1, "must be in [0, 1)"),
    (("cooldown_frac",), lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    (("ngram_prior_order",), lambda v: 2 <= v <= MAX_NGRAM_ORDER,
     f"must be in 2 ... {MAX_NGRAM_ORDER}"),
    (("seed",), lambda v: 0 <= v < 2 ** 63, "must be in [0, 2^63)"),
    (("flex_backend",), lambda v: v in ("triton", "flash"), "must be triton or flash"),
]


def flex_attention_for(hp):  # the GPU attention of --flex_backend (flash: flex_flash.py's)
    return FlexWindowAttention(compile_kernel=not hp.compile) if hp.flex_backend == "triton" \
        else load_companion("flex_flash.py").flash_window_attention(hp)


def value_rules(hp):
    if hp.matrix_optimizer == "normuon":
        return VALUE_RULES
    track3 = load_companion("track3.py")
    if hp.matrix_optimizer not in track3.OPTIMIZERS or not isinstance(hp, track3.Hyperparameters):
        raise ConfigError(f"--matrix_optimizer must be normuon or one of track3.py's "
                          f"{', '.join(track3.OPTIMIZERS)}, got {hp.matrix_optimizer!r}")
    track3.check_hyperparameters(hp)
    return VALUE_RULES + track3.VALUE_RULES


def check_hyperparameters(hp):
    """Reject impossible values and combinations before any work, naming the flag."""
    for f in fields(hp):
        value = getattr(hp, f.name)
        if any(isinstance(v, float) and not math.isfinite(v)
               for v in (value if isinstance(value, tuple) else [value])):
            raise ConfigError(f"--{f.name} must be finite, got {value}")
    for names, ok, meaning in value_rules(hp):
        for name in names:
            value = getattr(hp, name)
            if not all(ok(v) for v in (value if isinstance(value, tuple) else [value])):
                raise ConfigError(f"--{name} {meaning}, got {_flag_text(value)}")
    for name, count, meaning in (("batch_sizes", 3, "one per third of the run"),
                                 ("lr_multipliers", 3, "one per third"),
                                 ("window_blocks", 3, "one per third"),
                                 ("head_fp8_amax", 3, "activations, weights, gradients"),
                                 ("mtp_weights_start", 3 * MTP_HORIZON, "3 tokens x 3 stages"),
                                 ("mtp_weights_end", 3 * MTP_HORIZON, "3 tokens x 3 stages")):
        if len(getattr(hp, name)) != count:
            raise ConfigError(f"--{name} needs exactly {count} values ({meaning}), got "
                              f"{_flag_text(getattr(hp, name))}")
    if hp.val_tokens % hp.val_batch_size:
        raise ConfigError(f"--val_tokens {hp.val_tokens} must be a multiple of --val_batch_size "
                          f"{hp.val_batch_size}")
    if hp.vocab_size <= BOS_ID:
        raise ConfigError(f"--vocab_size {hp.vocab_size} must exceed {BOS_ID}, the shards' "
                          f"document-start token (GPT-2 ids)")
    prior_bound = PRIOR_EXP_FLOOR / math.log(hp.vocab_size)
    if hp.ngram_prior > prior_bound:
        raise ConfigError(f"--ngram_prior {hp.ngram_prior:g} is above {prior_bound:.4g}: the CPU "
                          f"loss sums exp of the logits in fp32, and under the prior a token's "
                          f"likeliest successor may have P = 1/{hp.vocab_size}, so the weight x "
                          f"ln({hp.vocab_size}) must stay below {PRIOR_EXP_FLOOR:g} (else exp "
                          f"underflows to 0 and the loss is -inf); use a weight up to "
                          f"{prior_bound:.4g}")
    if hp.num_heads * hp.head_dim != hp.model_dim:
        raise ConfigError(f"--num_heads x --head_dim must equal --model_dim (the merged QKVO "
                          f"weight applies O as a {hp.model_dim} x {hp.model_dim} map); got "
                          f"{hp.num_heads} x {hp.head_dim} vs {hp.model_dim}")
    if hp.model_dim < GATE_INPUTS:
        raise ConfigError(f"--model_dim {hp.model_dim} is below {GATE_INPUTS}: the smear and "
                          f"attention gates read the first {GATE_INPUTS} channels")
    if hp.head_dim % 4:
        raise ConfigError(f"--head_dim must be a multiple of 4 (half-truncated RoPE splits it in "
                          f"quarters), got {hp.head_dim}")
    longest_window = max(*hp.window_blocks, hp.extension_window_blocks) * hp.window_block_tokens
    if longest_window > hp.max_seq_len:
        raise ConfigError(f"the longest training window ({longest_window} tokens = "
                          f"--window_blocks/--extension_window_blocks x --window_block_tokens) "
                          f"exceeds --max_seq_len {hp.max_seq_len}; shrink the window")
    if (hp.first_stage_max_seq_len
            and hp.window_blocks[0] * hp.window_block_tokens > hp.first_stage_max_seq_len):
        raise ConfigError(f"the first third's window "
                          f"({hp.window_blocks[0] * hp.window_block_tokens} tokens) exceeds "
                          f"--first_stage_max_seq_len {hp.first_stage_max_seq_len}; shrink the "
                          f"window")
    if hp.bigram_vocab_size == 1 or (hp.bigram_vocab_size and hp.bigram_dim > hp.model_dim):
        raise ConfigError(f"--bigram_vocab_size must be 0 (off) or at least 2 and --bigram_dim at "
                          f"most --model_dim, got {hp.bigram_vocab_size} and {hp.bigram_dim}")
    if 0 < hp.micro_batch_tokens < MIN_MICRO_BATCH_TOKENS:
        raise ConfigError(f"--micro_batch_tokens {hp.micro_batch_tokens} is below "
                          f"{MIN_MICRO_BATCH_TOKENS}, the smallest cap: every piece also runs up "
                          f"to --max_seq_len tokens of context, so smaller pieces cost a forward "
                          f"of mostly context each; pass 0 (no cap) or at least "
                          f"{MIN_MICRO_BATCH_TOKENS}")
    if hp.save_every % 2:
        raise ConfigError(f"--save_every must be even (Adam steps on odd steps; checkpoints fall "
                          f"between them), got {hp.save_every}")
    if hp.device not in ("auto", "cuda", "cpu"):
        raise ConfigError(f"--device must be one of auto, cuda, cpu, got {hp.device!r}")
    if hp.fp8 not in ("auto", "on", "off"):
        raise ConfigError(f"--fp8 must be auto, on or off, got {hp.fp8!r}")
    if hp.profile and not _parse_profile_range(hp.profile):
        raise ConfigError(f"--profile must look like START:END with 0 <= START < END, got "
                          f"{hp.profile!r}")
    if hp.resume == "auto" and not hp.run_id:
        raise ConfigError("--resume auto needs --run_id (it finds the run's checkpoints and log by "
                          "it); pass the same --run_id to every start of the run")
    if hp.run_id and not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}", hp.run_id):
        raise ConfigError(f"--run_id may hold letters, digits, '.', '_' and '-', not first (it "
                          f"names a file), got {hp.run_id!r}")
    layer_roles_of(hp)  # raises ConfigError for depths and layer lists without a valid layout


def _flag_text(value):
    return " ".join(map(str, value)) if isinstance(value, tuple) else str(value)


def _parse_profile_range(text):
    try:
        start, end = (int(v) for v in text.split(":"))
    except ValueError:
        return None
    return (start, end) if 0 <= start < end else None


# ----------------------------------------------------------------------------------------------
# Shards written and fingerprinted; data checks before the first step


def shard_fingerprint(path):
    """(bytes, sha256 of the header and 64 spread 4 KiB blocks): spots swaps, not small edits."""
    header_bytes = SHARD_HEADER_INTS * 4
    digest = hashlib.sha256()
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            digest.update(f.read(header_bytes))
            span = max(size - header_bytes - SHARD_SAMPLE_BYTES, 0)
            for i in range(SHARD_SAMPLES):
                f.seek(header_bytes + span * i // (SHARD_SAMPLES - 1))
                digest.update(f.read(SHARD_SAMPLE_BYTES))
    except OSError as e:
        raise DataError(f"{path}: cannot read shard ({e.strerror or e})") from None
    return size, digest.hexdigest()


def write_shard(path, tokens):
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or (tokens.size and not np.issubdtype(tokens.dtype, np.integer)):
        raise DataError(f"{path}: refusing to write a {tokens.ndim}-D array of {tokens.dtype}: "
                        f"tokens must be a 1-D array of integer ids")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= GPT2_VOCAB_SIZE):
        bad = tokens.min() if tokens.min() < 0 else tokens.max()
        raise DataError(f"{path}: refusing to write token id {bad}: ids must be in [0, "
                        f"{GPT2_VOCAB_SIZE})")
    header = np.zeros(SHARD_HEADER_INTS, dtype="<i4")
    header[:3] = SHARD_MAGIC, SHARD_VERSION, tokens.size
    write_atomically(Path(path), header.tobytes() + tokens.astype("<u2").tobytes())


def write_atomically(path, data):
    """Write via a temp file beside `path` (named by host and pid), fsync, rename: never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}~{platform.node()}~{os.getpid()}~{uuid.uuid4().hex[:8]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # not mkstemp's 0600
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


def log_arguments(log, argv, hp, continuing):
    log(f"{'continued by --resume auto with args' if continuing else 'args'}: "
        f"{json.dumps(list(argv))}", console=False)
    if not continuing:
        log(f"hyperparameters: {dataclasses.asdict(hp)}", console=False)


def pieces_line(stage, tokens, positions, cut, cap):
    return (f"stage {stage} pieces: {tokens:,} tokens in {positions:,} positions "
            f"({1 - tokens / positions:.1%} padding and context); documents longer than "
            f"--micro_batch_tokens {cap}, cut: {cut}")


def describe_pieces(pieces):
    return ", ".join(f"{tokens:,} uncut" if length == tokens
                     else f"{tokens:,} in pieces of {length:,} positions"
                     for tokens, length in pieces)


def check_batch_splits(hp, world_size, accum):
    for b in hp.batch_sizes:
        tokens_per_rank(b, world_size, accum)
    tokens_per_rank(hp.val_batch_size, world_size, accum, what="--val_batch_size")


DATA_WALK_MAX_TOKENS = 1 << 26  # shards up to this are walked before the first step (~0.2 s)


def check_shards_last(hp, schedule, files, shard_tokens, world_size, accum):
    """Refuse shards too short for the run: by token count, or when small by step_shards_run_out."""
    total_steps = schedule.total_steps
    fix = ("add training shards, shorten the run (--num_scheduled_iterations) or pass "
           "--cycle_data true")
    needed = sum((stage.end_step - stage.first_step) * (stage.batch_tokens + world_size * accum)
                 for stage in schedule.stages)
    if sum(shard_tokens) < needed:
        raise DataError(f"the {len(files)} training shard(s) hold {sum(shard_tokens):,} tokens, "
                        f"but the run's {total_steps} steps take at least {needed:,}; {fix}")
    step = (step_shards_run_out(hp, schedule.stages, files, world_size, accum)
            if sum(shard_tokens) <= DATA_WALK_MAX_TOKENS else None)
    if step is not None:
        raise DataError(f"the {len(files)} training shard(s) ({sum(shard_tokens):,} tokens) run "
                        f"out at step {step} of {total_steps}: a micro-step takes whole documents "
                        f"of at most --max_seq_len tokens from one shard and skips the rest of "
                        f"each; {fix}")


def step_shards_run_out(hp, stages, files, world_size, accum):
    """The first step the shards cannot fill (walked as TrainLoader.next_pieces does), or None."""
    shard, cursor, bos, size = -1, 0, np.zeros(0, dtype=np.int64), 0
    for stage in stages:
        rank_tokens = tokens_per_rank(stage.batch_tokens, world_size, accum)
        # plan_pieces sees only the documents a micro-step can need (>= 1 token each): cheap calls
        window = world_size * (rank_tokens + 1) + 1
        for step in range(stage.first_step, stage.end_step):
            for _ in range(accum):
                while True:
                    end = int(bos[cursor + window]) if cursor + window < bos.size else size
                    plan = plan_pieces(bos[: cursor + window], end, cursor, world_size,
                                       rank_tokens + 1, stage.max_seq_len) if bos.size else None
                    if plan is not None:
                        break
                    shard, cursor = shard + 1, 0
                    if shard == len(files):
                        return step
                    tokens = read_shard(files[shard])
                    bos, size = np.flatnonzero(tokens == BOS_ID), tokens.size
                cursor = plan[1]
    return None


def check_a_shard_fills_each_micro_step(schedule, pattern, loader, world_size, accum):
    """With --cycle_data the shards never run out, but a micro-step comes from one shard: refuse
    shards none of which holds one of some stage (plan_pieces from its start). The loader's first
    shard, already read, is checked first; the others are read only if it falls short."""
    needs = {(tokens_per_rank(stage.batch_tokens, world_size, accum), stage.max_seq_len)
             for stage in schedule.stages}
    for index, path in enumerate(loader.files):
        if index == 0:
            size, bos = len(loader.tokens), loader.bos.available(need_all=True)
        else:
            tokens = read_shard(path)
            size, bos = tokens.size, np.flatnonzero(tokens == BOS_ID)
        needs = {(rank_tokens, max_seq_len) for rank_tokens, max_seq_len in needs
                 if plan_pieces(bos, size, 0, world_size, rank_tokens + 1, max_seq_len) is None}
        if not needs:
            return
    rank_tokens, max_seq_len = max(needs)
    raise DataError(f"no training shard of {pattern} holds one micro-step of {rank_tokens:,} "
                    f"tokens per rank ({world_size} rank(s); whole documents of at most "
                    f"{max_seq_len} tokens, the stage's sequence length, the rest of each "
                    f"skipped): a micro-step comes from one shard, even with --cycle_data; use "
                    f"shards of more documents or smaller --batch_sizes")


def available_memory_bytes():
    """Memory this process may still take: the kernel's MemAvailable, or less under a cgroup (v2)
    limit; None where neither can be read."""
    found = []
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/meminfo") as f:
            line = next(line for line in f if line.startswith("MemAvailable:"))
            found.append(int(line.split()[1]) * 1024)
    with contextlib.suppress(OSError, ValueError):
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    return min(found) if found else None


def counted_prior(hp, files, tokens, log):
    """ngram_prior.py's count_ngram_prior of `files` (`tokens` tokens): refused at setup where its
    least peak exceeds the available memory, and running out of memory anyway is one line."""
    ngram = load_companion("ngram_prior.py")
    ngram.check_counting_fits(hp, tokens, available_memory_bytes())
    try:
        return ngram.count_ngram_prior(hp, files, log)
    except MemoryError:
        raise ngram.out_of_memory(hp, tokens) from None


# ----------------------------------------------------------------------------------------------
# Run bookkeeping: log, run lock, checkpoints, resume checks, ranks, stop signals, profiler


SEPARATOR = "=" * 100
CHECKPOINT_MAGIC = b"SPEEDRUN-CKPT-1\n"
CHECKPOINT_KEYS = {"step", "training_time_ms", "tokens_seen", "model", "matrix", "adam", "loader",
                   "rng", "script_sha256", "world_size", "hyperparameters"}
PREEMPTED_EXIT_CODE = 75  # after a stop signal's checkpoint: EX_TEMPFAIL, "try again later"
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "L40S": 362e12,
              "4090": 165e12}  # dense bf16 FLOP/s for MFU (vendor, no sparsity), by name substring


class RunLog:
    """Rank 0's lines, to stdout and logs/<run_id>.txt after the script, the environment and its
    sha256 (between separators). Until open() lines wait: a run refused in setup leaves no log."""

    def __init__(self, path, enabled, hp):
        self.path, self.enabled, self.hp, self.waiting = path, enabled, hp, []

    def open(self, continuing=False):
        """Create the log exclusively (or append, continuing it); then write the waiting lines."""
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not continuing:
            try:
                f = self.path.open("x", encoding="utf-8")
            except FileExistsError:
                raise ConfigError(run_id_taken(self.path)) from None
            try:
                with f:
                    f.write(run_source(self.hp))
                    f.write(f"{SEPARATOR}\n{environment_report()}script_sha256 "
                            f"{script_sha256(self.hp)}\n{SEPARATOR}\n")
            except BaseException as e:  # a signal or Ctrl-C too: a cut header would hold the id
                self.path.unlink(missing_ok=True)
                raise naming_file(e, self.path) if isinstance(e, OSError) else e
        waiting, self.waiting = self.waiting, None
        for line, console in waiting:
            self(line, console)

    def __call__(self, line, console=True):
        if not self.enabled:
            return
        if self.waiting is not None:
            self.waiting.append((line, console))
            return
        if console:
            to_console(line, sys.stdout)
        self._append(line)

    def _append(self, line):
        try:
            with self.path.open("a", encoding="utf-8") as f:
                f.write(line + "\n")
        except OSError as e:
            raise naming_file(e, self.path) from None

    def record_ending(self, line):
        """Append the line that ends a failed or stopped run, if the log is open and writable."""
        if self.enabled and self.waiting is None:
            with contextlib.suppress(OSError):
                self._append(line)


class RunLock:
    """One process per run id: rank 0 flocks <run_id>.lock (freed when it dies), naming its pid."""

    def __init__(self, path, log_dir):
        self.path, self.log_dir, self.fd, self.made = Path(path), log_dir, None, []

    def __enter__(self):
        check_writable_folder(self.path.parent, "the log folder", self.log_dir)
        self.made = [p for p in (self.path.parent, *self.path.parent.parents) if not p.exists()]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while self.fd is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
                os.close(fd)
                raise ConfigError(f"the run {self.path.name[:-5]!r} is being trained by {holder} "
                                  f"(it holds {self.path}); wait for that process to end or stop "
                                  f"it, or pass another --run_id") from None
            try:  # the holder before us may have removed it since we opened it: lock the one there
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                self.fd = fd
            else:
                os.close(fd)
        os.ftruncate(self.fd, 0)
        os.write(self.fd, f"host {platform.node()} pid {os.getpid()}\n".encode())
        return self

    def __exit__(self, *exc):
        self.path.unlink(missing_ok=True)  # before the lock goes: a waiting opener retries
        os.close(self.fd)
        for folder in self.made:  # only folders the lock itself made, and only while empty
            with contextlib.suppress(OSError):
                folder.rmdir()


def to_console(line, stream):
    """Print a line, flushed; a console that is gone (SIGHUP, closed pipe) becomes /dev/null."""
    try:
        print(line, file=stream, flush=True)
    except OSError:
        with contextlib.suppress(OSError, ValueError):
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, stream.fileno())
            os.close(null)


def run_id_taken(path):
    return (f"{path} exists: the run id {path.stem!r} is taken; pass another --run_id (or none for "
            f"a fresh one), or --resume auto to continue that run")


def naming_file(error, path):
    """`error` with `path` as its file name if it has none (a write to a full disk names none)."""
    return (error if error.filename or error.errno is None
            else OSError(error.errno, error.strerror, str(path)))


def environment_report():
    lines = [f"python {platform.python_version()}  torch {torch.__version__}  cuda "
             f"{torch.version.cuda}  triton "
             f"{triton.__version__ if HAS_TRITON else 'not installed'}  host {platform.node()}"]
    try:
        lines.append(subprocess.run(["nvidia-smi"], capture_output=True, text=True,
                                    timeout=20).stdout.rstrip())
    except (OSError, subprocess.SubprocessError):
        cpu = next((l.split(":", 1)[1].strip()
                    for l in Path("/proc/cpuinfo").read_text().splitlines()
                    if l.startswith("model name")), platform.processor()) \
            if Path("/proc/cpuinfo").exists() else platform.processor()
        lines.append(f"no nvidia-smi; CPU: {cpu}, {os.cpu_count()} cores")
    return "\n".join(lines) + "\n"


COMPANION_HEADER = "\n\n{dashes}\n# {name}\n{dashes}\n\n"  # before each companion file (#89's)


def run_source(hp):
    """The code a log carries: this script, then each companion file under COMPANION_HEADER (one
    that is not there is one the run cannot have loaded: load_companion refuses a missing file)."""
    source = Path(__file__).read_text(encoding="utf-8")
    for name in companion_files(hp):
        if not (Path(__file__).parent / name).is_file():
            continue
        source += COMPANION_HEADER.format(dashes="-" * 40, name=name)
        source += (Path(__file__).parent / name).read_text(encoding="utf-8")
    return source if source.endswith("\n") else source + "\n"


def script_sha256(hp):
    """The sha256 of the logged code, in logs and checkpoints; checked on replay and resume."""
    return hashlib.sha256(run_source(hp).encode("utf-8")).hexdigest()


def save_checkpoint(path, payload):
    """Serialize, checksum, write atomically: a crash leaves the previous file intact."""
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    data = buffer.getvalue()
    try:
        write_atomically(Path(path), CHECKPOINT_MAGIC + hashlib.sha256(data).hexdigest().encode()
                         + b"\n" + data)
    except OSError as e:
        raise naming_file(e, path) from None


def load_checkpoint(path):
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read checkpoint ({e.strerror})")
    header_len = len(CHECKPOINT_MAGIC) + 65
    if not raw.startswith(CHECKPOINT_MAGIC) or len(raw) < header_len:
        raise DataError(f"{path}: not a speedrun checkpoint (bad header); pass a checkpoint "
                        f"train_gpt.py wrote (--save_every, --save_checkpoint or a stop signal: "
                        f"step_NNNNNN.pt, final.pt)")
    digest, data = raw[len(CHECKPOINT_MAGIC): header_len - 1].decode(), raw[header_len:]
    if hashlib.sha256(data).hexdigest() != digest:
        raise DataError(f"{path}: checkpoint is corrupt or truncated (checksum mismatch); use an "
                        f"earlier checkpoint")
    try:
        snap = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    except Exception as e:  # a sound file whose contents this torch cannot read
        raise DataError(f"{path}: cannot load the checkpoint ({type(e).__name__}); it may come "
                        f"from another torch version")
    missing = CHECKPOINT_KEYS - set(snap) if isinstance(snap, dict) else CHECKPOINT_KEYS
    if missing:
        raise DataError(f"{path}: not a checkpoint of this trainer (missing "
                        f"{', '.join(sorted(missing))})")
    return snap


def saved_checkpoints(folder):
    """A run folder's checkpoints (step_NNNNNN.pt, final.pt), newest first."""
    found = [(math.inf if m[0] == "final" else int(m[1]), path)
             for path in Path(folder).glob("*.pt")
             if (m := re.fullmatch(r"step_(\d+)|final", path.stem))]
    return [path for _, path in sorted(found, reverse=True)]


def newest_sound_checkpoint(folder, warn):
    """(path, snapshot) of the newest sound checkpoint, warning of newer ones, or (None, None)."""
    paths = saved_checkpoints(folder)
    for path in paths:
        try:
            return path, load_checkpoint(path)
        except DataError as e:
            warn(f"warning: {e} (--resume auto skips it)")
    if paths:
        raise DataError(f"none of the {len(paths)} checkpoints in {folder} verifies; pass --resume "
                        f"with a sound one, or move them away to start the run afresh")
    return None, None


# Flags that may change on resume: not the trajectory (--micro_batch_tokens changes only the pieces)
RESUME_FREE_FLAGS = {"run_id", "log_dir", "save_every", "save_checkpoint", "resume", "force",
                     "profile", "cpu_threads", "val_loss_every", "warmup_steps", "device",
                     "compile", "fp8", "seed", "train_files", "val_files", "synthetic_fallback",
                     "cycle_data", "val_tokens", "val_batch_size", "micro_batch_tokens"}
MODEL_SHAPE_FLAGS = ("vocab_size", "num_layers", "num_heads", "head_dim", "model_dim",
                     "matrix_optimizer")


def _flags(values, names):
    return ", ".join(
        f"--{name} "
        f"{_flag_text(tuple(values[name]) if isinstance(values[name], list) else values[name])}"
        for name in names)


def trajectory_changes(ours, theirs, free=RESUME_FREE_FLAGS):
    return [name for name in ours if name not in free and ours[name] != theirs.get(name)]


def forced_overrides(snap, hp, ours, theirs):
    """What --force lets a resume override: each trajectory setting, old -> new; another script."""
    def text(value):
        return _flag_text(tuple(value) if isinstance(value, list) else value)
    items = [f"--{name} {text(theirs.get(name))} -> {text(ours[name])}"
             for name in trajectory_changes(ours, theirs)]
    sha256 = script_sha256(hp)  # (reads and hashes the run's files)
    if snap["script_sha256"] != sha256:
        items.append(f"another train_gpt.py (sha256 {snap['script_sha256'][:12]} -> "
                     f"{sha256[:12]})")
    return ", ".join(items[:-1]) + " and " + items[-1] if len(items) > 1 else "".join(items)


def check_resumable(path, snap, hp, total_steps, log):
    """Refuse, in one line, a checkpoint that a run with `hp` cannot continue faithfully; under
    --force, warn in one line (`log`) naming what it overrides."""
    ours, theirs = dataclasses.asdict(hp), snap["hyperparameters"]
    theirs = {"matrix_optimizer": "normuon", **theirs}
    shape = [name for name in MODEL_SHAPE_FLAGS if ours[name] != theirs.get(name)]
    if shape:
        raise ConfigError(f"{path} holds a model and optimizer state with {_flags(theirs, shape)} "
                          f"but this run has {_flags(ours, shape)}; pass the checkpoint's settings "
                          f"to resume it")
    if snap["step"] > total_steps:
        raise ConfigError(f"{path} is at step {snap['step']}, past this run's last step "
                          f"{total_steps}; resume an earlier checkpoint or lengthen the run")
    if hp.force:
        overrides = forced_overrides(snap, hp, ours, theirs)
        if overrides:
            log(f"warning: --force resumes {path} with {overrides}: the losses will not be those "
                f"of the checkpoint's run")
        return
    if snap["script_sha256"] != script_sha256(hp):
        raise ConfigError(f"{path} was written by a different train_gpt.py; pass --force to resume "
                          f"anyway")
    changed = trajectory_changes(ours, theirs)
    if changed:
        raise ConfigError(f"{path} was written with {_flags(theirs, changed)} but this run has "
                          f"{_flags(ours, changed)}; pass the same settings, or --force to "
                          f"continue with the new ones")


def shard_record(files):
    """What a checkpoint records of the validation shards (the loader's state does of the training
    ones): their paths and fingerprints."""
    return dict(files=list(files), fingerprints=[shard_fingerprint(f) for f in files])


def shard_names_difference(path, recorded, files, kind):
    """A line naming the shards missing from `files` or new in them, by file name, against those
    the checkpoint `path` recorded; None if the names are the same."""
    theirs, ours = [Path(f).name for f in recorded], [Path(f).name for f in files]
    changes = ([f"{name} is missing" for name in theirs if name not in ours]
               + [f"{name} is new" for name in ours if name not in theirs])
    if not changes:
        return None
    more = f" and {len(changes) - 4} more" if len(changes) > 4 else ""
    return f"the {kind} shards differ from the checkpoint {path}'s: {', '.join(changes[:4])}{more}"


def shard_difference(loader_state, files, fingerprints, kind="training"):
    """A line naming the first of `files` whose fingerprint is not the one the checkpoint recorded
    (the loader's state, or shard_record) under its name, or None."""
    recorded = dict(zip((Path(f).name for f in loader_state.get("files") or []),
                        loader_state.get("fingerprints") or []))
    for path, (size, digest) in zip(files, fingerprints):
        theirs = recorded.get(Path(path).name)
        if theirs is None or tuple(theirs) == (size, digest):
            continue
        why = (f"{size:,} bytes where that run read {theirs[0]:,}" if size != theirs[0] else
               f"the same {size:,} bytes, other contents: sampled sha256 {digest[:12]}, that run's "
               f"{theirs[1][:12]}")
        return f"{path} is not the {kind} shard the checkpoint's run read under that name ({why})"
    return None


def check_same_shards(path, loader_state, loader, force, log):
    """Unless --force, refuse shards other than the checkpoint's run read by those names; other
    names even with --force (the checkpoint's place in the data is a place in its own shards)."""
    renamed = shard_names_difference(path, loader_state.get("files") or [], loader.files,
                                     "training")
    if renamed:
        raise DataError(f"{renamed}; pass the --train_files it was trained on (--force cannot "
                        f"continue on other shards: the checkpoint's place in the data is a place "
                        f"in its own)")
    difference = shard_difference(loader_state, loader.files, loader.fingerprints)
    if difference and not force:
        raise DataError(f"{difference}; {path} continues only on the shards it was trained on: put "
                        f"that shard back, or pass --force to continue on this one")
    if difference:
        log(f"warning: {difference}; --force continues on it")


def check_same_validation(path, recorded, files, force, log):
    """Unless --force (then warn), refuse validation shards other than the checkpoint's run's
    (`recorded`: shard_record; None from an older script): the losses would not compare."""
    if recorded is None:
        return
    difference = (shard_names_difference(path, recorded["files"], files, "validation")
                  or shard_difference(recorded, files, [shard_fingerprint(f) for f in files],
                                      "validation"))
    if difference and not force:
        raise DataError(f"{difference}; {path}'s run logged its validation losses on those shards "
                        f"and these would not compare: put them back, or pass --force to validate "
                        f"on these")
    if difference:
        log(f"warning: {difference}; --force validates on them: the losses from here on do not "
            f"compare with those logged before")


def check_log_continues(path, hp, total_steps, checkpoint_folder):
    """Only this run's own log continues: unfinished, or lacking --save_checkpoint's final.pt."""
    text = path.read_text(encoding="utf-8", errors="replace")
    head = run_source(hp) + SEPARATOR + "\n"
    if not text.startswith(head):
        raise ConfigError(f"{path} was written by a different train_gpt.py: the run id "
                          f"{path.stem!r} is taken by another run; pass another --run_id")
    output = text[len(head):].split(SEPARATOR + "\n", 1)[-1]  # after the environment report
    recorded = next((line for line in output.splitlines()
                     if line.startswith("hyperparameters: ")), "")
    try:
        theirs = ast.literal_eval(recorded.partition(": ")[2])
    except (ValueError, SyntaxError):
        raise ConfigError(f"{path} records no readable hyperparameters line, so it cannot be told "
                          f"to be this run's: the run id {path.stem!r} is taken; pass another "
                          f"--run_id") from None
    ours = dataclasses.asdict(hp)
    changed = trajectory_changes(ours, theirs, RESUME_FREE_FLAGS - {"seed"})
    if changed:
        theirs = {name: theirs.get(name, "(not recorded)") for name in changed}
        raise ConfigError(f"{path} was written with {_flags(theirs, changed)} but this run has "
                          f"{_flags(ours, changed)}: the run id {path.stem!r} is taken by another "
                          f"run; pass another --run_id")
    finished = re.search(rf"^step:{total_steps}/{total_steps} val_loss:", output, re.M)
    if finished and not (hp.save_checkpoint
                         and not (Path(checkpoint_folder) / "final.pt").exists()):
        raise ConfigError(f"{path}: the run {path.stem!r} has finished (its log holds the final "
                          f"validation); pass another --run_id to train again")


def check_outputs(hp, log_path, checkpoint_folder, total_steps):
    """Rank 0's checks of the folders and the run id; returns whether the run continues its log."""
    check_writable_folder(log_path.parent, "the log folder", hp.log_dir)
    check_writable_folder(checkpoint_folder, "the checkpoint folder", hp.log_dir)
    if hp.resume != "auto" and hp.run_id and saved_checkpoints(checkpoint_folder):
        raise ConfigError(f"{checkpoint_folder} holds checkpoints of a run with the id "
                          f"{hp.run_id!r}; pass --resume auto to continue that run, or another "
                          f"--run_id")
    if not log_path.exists():
        return False
    if hp.resume != "auto":
        raise ConfigError(run_id_taken(log_path))
    check_log_continues(log_path, hp, total_steps, checkpoint_folder)
    return True


def logged_checkpoints(log_path):
    """The checkpoint files a run's log says it wrote, oldest first."""
    text = Path(log_path).read_text(encoding="utf-8", errors="replace")
    return re.findall(r"^(?:saved checkpoint |preempted at step \d+ by [^,]*, checkpoint )"
                      r"(.+?\.pt)(?:;|$)", text, re.M)


def checkpoint_to_resume(hp, checkpoint_folder, log, continuing=False):
    """(path, snapshot) to resume or (None, None); a continued log's lost checkpoint is refused."""
    if hp.resume != "auto":
        return (hp.resume, load_checkpoint(hp.resume)) if hp.resume else (None, None)
    path, snap = newest_sound_checkpoint(checkpoint_folder, log)
    if path is None:
        stale = (remove_stale_temp_files(checkpoint_folder)
                 if Path(checkpoint_folder).is_dir() else [])
        recorded = logged_checkpoints(log.path) if continuing else []
        if recorded:
            removed = (f" (removed {len(stale)} temp file(s) of interrupted writes there)"
                       if stale else "")
            raise ConfigError(f"--resume auto: {log.path} records the checkpoint {recorded[-1]}, "
                              f"but {checkpoint_folder} holds no checkpoint{removed}; put it back, "
                              f"or move the log away to start the run afresh")
        if stale:
            log(f"removed {len(stale)} temp file(s) of interrupted checkpoint writes in "
                f"{checkpoint_folder}")
        log(f"--resume auto: no checkpoint in {checkpoint_folder} yet; starting at step 0")
    return path, snap


def check_writable_folder(folder, what, log_dir):
    """Refuse, creating nothing, an unwritable folder (a file on the path, dead link, no access)."""
    existing = Path(folder)
    while not existing.exists():
        if existing.is_symlink():
            raise ConfigError(f"--log_dir {log_dir}: {what} {folder} cannot be made: {existing} is "
                              f"a symbolic link that resolves nowhere (a loop or a missing "
                              f"target); fix it or pass another --log_dir")
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"--log_dir {log_dir}: {what} {folder} cannot be made: {existing} is not "
                          f"a folder; pass another --log_dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--log_dir {log_dir}: cannot write {what} {folder} in {existing} "
                          f"(Permission denied); pass another --log_dir")


RANK_LOCAL_FLAGS = {  # each process's own (paths, resources); shards and resume step are compared
    "cpu_threads", "device", "log_dir", "profile", "train_files", "val_files", "resume"}


def rank_settings(hp, device, train_files, val_files, resume_step):
    """What a run's processes must agree on: flags, script, device type, shards, resume step."""
    settings = {f"--{name}": _flag_text(value) for name, value in dataclasses.asdict(hp).items()
                if name not in RANK_LOCAL_FLAGS}
    settings.update({"script sha256": script_sha256(hp), "device type": device.type,
                     "resume step": resume_step,
                     "training shards": [Path(f).name for f in train_files],
                     "validation shards": [Path(f).name for f in val_files]})
    return settings


def first_rank_difference(everyone):
    """One line naming the first setting in which a rank differs from rank 0 (None if none does)."""
    for rank, theirs in enumerate(everyone[1:], 1):
        for key, ours in everyone[0].items():
            value = theirs.get(key)
            if value == ours:
                continue
            if isinstance(ours, list) and isinstance(value, list):
                i = next((i for i, (a, b) in enumerate(zip(value, ours)) if a != b),
                         min(len(value), len(ours)))
                names = [names[i] if i < len(names) else "none" for names in (value, ours)]
                what = (f"rank {rank}'s {key} differ from rank 0's at file {i + 1}: "
                        f"{names[0]} vs {names[1]}")
            else:
                what = f"rank {rank} has {key} {value} but rank 0 has {key} {ours}"
            return (f"{what}; start every process with the same flags, shards and checkpoints "
                    f"(only --cpu_threads, --device, --log_dir, --profile and the data folders may "
                    f"differ)")
    return None


def check_ranks_agree(settings):
    """Nodes type their own command lines: every rank refuses the first difference from rank 0."""
    if not dist_ready():
        return
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, settings)
    difference = first_rank_difference(everyone)
    if difference:
        raise ConfigError(difference)


def restart_warnings(hp):
    """What would make torchrun's restarts of this run (--max-restarts) fail or start over."""
    if not env_int("TORCHELASTIC_MAX_RESTARTS", 0):
        return []
    warnings = []
    if hp.resume != "auto":
        warnings.append("torchrun may restart this run, but without --resume auto a restart starts "
                        "over or is refused")
    if not hp.save_every:
        warnings.append("torchrun may restart this run, but --save_every is 0: a restart after a "
                        "crash starts at step 0")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        warnings.append("torchrun shares its rendezvous store with the workers, so restarted "
                        "workers may read the last attempt's addresses and fail to connect "
                        "(pytorch#135712); start torchrun with "
                        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")
    return warnings


class ProcessPlace(NamedTuple):
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def env_int(name, default, minimum=0):
    """An integer environment variable (torchrun's, or the user's), checked like a flag."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"the environment variable {name}={text!r} is not an integer; set it to "
                          f"one (torchrun sets it for its workers) or unset it") from None
    if value < minimum:
        raise ConfigError(f"the environment variable {name}={text} must be >= {minimum}; set it to "
                          f"such a number (torchrun sets it for its workers) or unset it")
    return value


def process_place():
    """This process's place from RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE (unset: alone)."""
    place = ProcessPlace(env_int("RANK", 0), env_int("WORLD_SIZE", 1, 1), env_int("LOCAL_RANK", 0),
                         env_int("LOCAL_WORLD_SIZE", 1, 1))
    for name, index, size, size_name in (("RANK", place.rank, place.world_size, "WORLD_SIZE"),
                                         ("LOCAL_RANK", place.local_rank, place.local_world_size,
                                          "LOCAL_WORLD_SIZE")):
        if index >= size:
            raise ConfigError(f"the environment variable {name}={index} is not below "
                              f"{size_name}={size}; start the processes with torchrun, or set "
                              f"{name} in 0..{size - 1}")
    if place.local_world_size > place.world_size:
        raise ConfigError(f"the environment variable LOCAL_WORLD_SIZE={place.local_world_size} is "
                          f"more than WORLD_SIZE={place.world_size}; start the processes with "
                          f"torchrun, or fix them")
    return place


def setup_distributed(hp):
    """torchrun or a plain process; NCCL on CUDA, gloo on CPU; the device by the local rank."""
    # as the reference: growable segments (larger later batches do not fragment); read at CUDA init
    os.environ.setdefault("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    rank, world_size, local_rank, local_world = process_place()
    if on_cuda(hp):
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda, but no CUDA device is visible; use --device cpu or "
                              "auto")
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(f"local rank {local_rank} needs {local_rank + 1} GPUs but "
                              f"{torch.cuda.device_count()} are visible; start fewer processes per "
                              f"node (torchrun --nproc_per_node)")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(hp.cpu_threads or max(1, (os.cpu_count() or 1) // local_world))
    if world_size > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(minutes=30),  # compiles can stall a rank
                                device_id=device if device.type == "cuda" else None)
    return rank, world_size, device


def data_script(pattern):
    """The command that builds the shards a glob names: the novels corpus (track_cpu) or FineWeb."""
    return ("python data/novels.py --out data/novels" if "novels" in str(pattern)
            else "python data/cached_fineweb10B.py")


def resolve_data(hp, rank):
    """(train glob, val glob, description) under $DATA_PATH, or --synthetic_fallback's corpus."""
    data_path = os.environ.get("DATA_PATH")
    if data_path and not Path(data_path).is_dir():
        raise DataError(f"DATA_PATH {data_path} is not a folder; set it to the folder that holds "
                        f"data/ (or unset it)")
    root = Path(data_path or ".")
    train, val = str(root / hp.train_files), str(root / hp.val_files)
    defaults = Hyperparameters()
    untouched = (hp.train_files, hp.val_files) == (defaults.train_files, defaults.val_files)
    if hp.synthetic_fallback and untouched and not (glob.glob(train) or glob.glob(val)):
        folder = Path("data") / "synthetic"
        train, val = str(folder / "synthetic_train_*.bin"), str(folder / "synthetic_val_*.bin")
        corpus = load_companion("data/synthetic.py")
        if rank == 0 and not corpus.is_current(folder):  # (one an older version wrote: rewritten)
            corpus.synthetic_corpus(folder, write_shard=write_shard)
        if dist_ready():
            dist.barrier()
        return train, val, (f"the synthetic corpus in {folder} (no shards match the default "
                            f"--train_files/--val_files)")
    for flag, pattern in (("--train_files", train), ("--val_files", val)):
        if not glob.glob(pattern):
            fallback = (" (--synthetic_fallback replaces the data only when neither glob matches)"
                        if hp.synthetic_fallback and untouched else "")
            raise DataError(f"{flag} {pattern!r} matches no file{fallback}; build the shards "
                            f"with `{data_script(pattern)}` or pass a glob that matches")
    return train, val, f"train {train}, val {val}"


@contextlib.contextmanager
def failing_together(device, during="setup"):
    """If the block fails on any rank, fail on all (else the rest wait in their next collective)."""
    error = None
    try:
        yield
    except (ConfigError, DataError, OSError) as e:
        error = e
    if dist_ready():
        failed = torch.tensor([float(error is not None)], device=device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failed.item() and error is None:
            raise ConfigError(f"another process stopped during {during} (its message is above)")
    if error is not None:
        raise error


def rng_state(device):
    return dict(torch=torch.get_rng_state(),
                cuda=torch.cuda.get_rng_state_all() if device.type == "cuda" else None)


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
        return (max(self.peak_bytes, torch.cuda.max_memory_allocated())
                if self.device.type == "cuda" else 0)

    def summary(self, model, hp, tokens_seen, training_time_ms, world_size):
        """The log's closing lines: memory peaks, then tokens/s and MFU."""
        if self.device.type == "cuda":
            lines = [f"peak memory allocated: {self.train_peak_bytes() // 2**20} MiB "
                     f"reserved: {torch.cuda.max_memory_reserved() // 2**20} MiB",
                     f"validation peak memory allocated: {self.eval_peak_bytes // 2**20} MiB"]
        else:
            lines = [f"peak memory (CPU max RSS of rank 0): "
                     f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MiB"]
        seconds = training_time_ms / 1000
        tokens_per_s = tokens_seen / seconds if seconds else 0.0
        flops_per_token = model_flops_per_token(model, hp)
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else ""
        peak = next((v for k, v in PEAK_FLOPS.items() if k in name), None) if name else None
        mfu = (f"{100 * tokens_per_s * flops_per_token / (peak * world_size):.1f}%" if peak
               else "n/a (unknown peak FLOP/s)")
        return lines + [f"throughput: {tokens_per_s:,.0f} tokens/s over {tokens_seen:,} tokens; "
                        f"{flops_per_token / 1e9:.2f} GFLOP/token; MFU {mfu}"]


def model_flops_per_token(model, hp):
    """Training FLOPs per token: 6 x matmul weights + 12 x attention layers x hdim x keys/query."""
    hidden = ("attn", "attn_qk", "attn_vo", "mlp")
    matmul = (sum(p.numel() for p, spec in model.param_table() if spec.label in hidden)
              + model.lm_head.weight.numel())
    attn_layers = hp.num_layers - 1  # one has none (a paired layer's doubled stream: same cost)
    keys = 0.75 * hp.window_blocks[-1] * hp.window_block_tokens / 2
    return 6 * matmul + 12 * attn_layers * hp.num_heads * hp.head_dim * keys


class StepProfiler:
    """The PyTorch profiler around the --profile START:END steps; a Chrome trace next to the log."""

    def __init__(self, hp, run_id, total_steps, log):
        self.range = _parse_profile_range(hp.profile) if hp.profile else None
        self.trace = Path(hp.log_dir) / f"{run_id}_trace.json"
        self.profiler, self.log, self.text = None, log, hp.profile
        if self.range and self.range[1] >= total_steps:
            log(f"warning: --profile {hp.profile} ends at or after the run's last step "
                f"({total_steps}); no trace will be written (END must be below it)")
            self.range = None  # a profiler never stopped would outlive the run (and crash its exit)

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
    """Each step's [loss, stop votes], summed over ranks, read a step late: the host never waits."""

    def __init__(self, device):
        self.device, self.pending = device, None

    def push(self, step, totals, reduction=None):
        """Copy `totals` (`reduction`: their async all-reduce); return the last step's stop vote."""
        stop = self.finish()
        if reduction is not None:
            reduction.wait()  # on the GPU: the copy below waits for it, the host does not
        if self.device.type != "cuda":
            self.pending = (step, totals, None)
            return stop
        host = torch.empty(totals.shape, dtype=totals.dtype, pin_memory=True)
        host.copy_(totals, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self.pending = (step, host, done)
        return stop

    def finish(self):
        if self.pending is None:
            return False
        step, totals, done = self.pending
        self.pending = None
        if done is not None:
            done.synchronize()  # waits for that step only, not for the work queued since
        value, stop_votes = totals.tolist()
        if not math.isfinite(value):
            hint = ("before any update, so not from the learning rates: check the data and the "
                    "model's flags" if step == 0
                    else "lower the learning rates (--muon_lr/--adam_lr) or check the data")
            raise FloatingPointError(f"training loss is {value} at step {step}; {hint}, then rerun")
        return stop_votes > 0


class StopSignals:
    """SIGTERM, SIGUSR1, SIGHUP stop the run: at once before the first step (Preempted), later at
    the same step on every rank after a checkpoint; signals after the first change nothing."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)

    def __init__(self):
        self.received, self.noting, self._previous = None, False, {}

    def note_from_now_on(self):
        self.noting = True

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # (signals: main thread only)
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _note(self, signum, frame):
        name = signal.Signals(signum).name
        if not self.noting:
            raise Preempted(f"stopped by {name} before the first training step; nothing new to "
                            f"save")
        if self.received is None and os.environ.get("RANK", "0") == "0":
            # now, lest a long step seem to ignore it; os.write: a print could re-enter a write
            with contextlib.suppress(OSError):  # (a closed terminal: SIGHUP's usual company)
                os.write(2, f"{name} received: the run stops with a checkpoint within 1-3 "
                            f"steps\n".encode())
        self.received = self.received or name


class Preempted(Exception):
    """The run stopped at a stop signal, its state saved (main prints it from rank 0)."""


def checkpoint_complete_after(steps_done):
    """Checkpoints hold no gradients; DistAdam's accumulate from an even step to its odd update."""
    return steps_done % 2 == 0


def write_checkpoint(path, snap, required, log):
    """Save and return the path; a failed write raises if `required`, else warns (returns None)."""
    try:
        save_checkpoint(path, snap)
    except OSError as e:
        if required:
            raise
        log(f"warning: could not write checkpoint {path} ({e.strerror or e}); training goes on and "
            f"the earlier checkpoints are kept")
        return None
    log(f"saved checkpoint {path}")
    return path


def remove_stale_checkpoint_writes(folder, log):
    stale = remove_stale_temp_files(folder)
    if stale:
        log(f"removed {len(stale)} temp file(s) of interrupted checkpoint writes in {folder}")


# ----------------------------------------------------------------------------------------------
# main(): parse, train, and turn bad input into one line


def portable_argv(argv):
    """argv with paths under the working folder made relative: a log names no machine's folders."""
    out, here = [], Path.cwd()
    for i, arg in enumerate(argv):
        if i and argv[i - 1] in ("--train_files", "--val_files", "--resume") and os.path.isabs(arg):
            with contextlib.suppress(ValueError):
                arg = str(Path(arg).relative_to(here))
        out.append(arg)
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    hp = trainer = None
    with StopSignals() as stop, contextlib.ExitStack() as lifetime:
        try:
            hp = parse_args(argv)
            trainer = Trainer(hp, portable_argv(argv), stop, lifetime)
            return trainer.run()
        except Preempted as e:
            if os.environ.get("RANK", "0").strip() in ("", "0"):  # (also when RANK is not a number)
                to_console(f"train_gpt.py: {e}", sys.stderr)
            if trainer is not None:
                trainer.log.record_ending(str(e))
            sys.exit(PREEMPTED_EXIT_CODE)
        except (ConfigError, DataError, FloatingPointError) as e:
            fail(trainer, str(e))
        except OSError as e:  # a log or checkpoint folder that cannot be written, a full disk, ...
            fail(trainer, f"{e.filename}: {e.strerror or e}" if e.filename
                 else str(e.strerror or e))
        except KeyboardInterrupt:
            fail(trainer, interrupted_message(hp, trainer), 130)
        finally:
            if dist_ready():
                dist.destroy_process_group()


def interrupted_message(hp, trainer):
    """Ctrl-C's line: where to continue from, or that no checkpoint of the run exists."""
    folder = trainer.checkpoint_folder if trainer is not None else None
    if folder is None and hp is not None and hp.run_id:  # (stopped in the Trainer's setup)
        folder = Path(hp.log_dir) / "checkpoints" / hp.run_id
    if folder is not None and any(folder.glob("*.pt")):
        return "interrupted; continue from the last checkpoint with --resume auto and its --run_id"
    return ("interrupted with no checkpoint of this run written: nothing to continue from; start "
            "it again (under --resume auto its --run_id starts over in its log)")


def fail(trainer, message, code=2):
    """End the run with one error line on stderr, also in the run's log once that is open."""
    line = f"train_gpt.py: error: {message}"
    to_console(line, sys.stderr)
    if trainer is not None:
        trainer.log.record_ending(line)
    sys.exit(code)


# ----------------------------------------------------------------------------------------------
# Smaller GPUs (--micro_batch_tokens): micro-steps and validation in pieces with their context


# A piece carries, lossless, the context the uncut micro-step reads: before, the whole preceding
# document (<= max_seq_len; the key shift needs it) or a cut one's start; after, two more targets.
PIECE_CONTEXT_AFTER = MTP_HORIZON - 1


def pack_documents(doc_lengths, max_piece_tokens):
    """(piece bounds, documents cut): whole documents per piece up to max_piece_tokens, or cut."""
    bounds, start, used, cut = [], 0, 0, 0
    for length in map(int, doc_lengths):
        if used + length > max_piece_tokens:
            if used:
                bounds.append((start, start + used))
                start, used = start + used, 0
            cut += length > max_piece_tokens
            while length > max_piece_tokens:
                bounds.append((start, start + max_piece_tokens))
                start, length = start + max_piece_tokens, length - max_piece_tokens
        used += length
    if used:
        bounds.append((start, start + used))
    return bounds, cut


def piece_cap(hp):
    """Most tokens per forward and backward per rank: --micro_batch_tokens, whose 0 means no cap."""
    return hp.micro_batch_tokens or math.inf


def padded_piece_length(tokens, max_piece_tokens, max_seq_len):
    """Positions per forward of a micro-step of `tokens`: all uncut, else its pieces' length."""
    if tokens <= max_piece_tokens:
        return tokens
    return max_piece_tokens + max_seq_len + PIECE_CONTEXT_AFTER


def piece_inputs(window, doc_lengths, start, stop, length, device, bigram_ids=None):
    """context_piece for [start, stop), its context from the document of the token before it."""
    ends = np.cumsum(doc_lengths)
    first = (int((ends - doc_lengths)[np.searchsorted(ends, start - 1, side="right")])
             if start else 0)
    after = min(PIECE_CONTEXT_AFTER, len(window) - 1 - stop)
    return context_piece(window, doc_lengths, first, start, stop, after, length, device, bigram_ids)


def context_piece(window, doc_lengths, first, start, stop, after, length, device, bigram_ids=None):
    """The Batch [context][tokens][padding] of `window`'s [first, stop), loss on [start, stop)."""
    before, tokens = start - first, stop - start
    inputs = np.zeros(length, dtype=np.int64)  # padding: any token of every vocabulary
    inputs[: before + tokens] = window[first: stop]
    targets = np.full(length, NO_TARGET, dtype=np.int64)
    targets[before: before + tokens + after] = window[start + 1: stop + 1 + after]
    loss_mask = np.zeros(length, dtype=bool)
    loss_mask[before: before + tokens] = True
    lengths = [*cut_lengths(doc_lengths, first, stop), length - before - tokens]
    ids = None
    if bigram_ids is not None:
        ids = np.full(length, bigram_ids[0], dtype=np.int32)  # the reserved row, as at position 0
        ids[: before + tokens] = bigram_ids[first:stop]
    return to_device(inputs, targets, padded_cu_seqlens([n for n in lengths if n], length), device,
                     ids, np.arange(first, first + length), loss_mask)


def cut_lengths(doc_lengths, start, stop):
    """Lengths of the documents, or their parts the edges cut, inside [start, stop)."""
    ends = np.cumsum(doc_lengths)
    inside = np.minimum(ends, stop) - np.maximum(ends - doc_lengths, start)
    return inside[inside > 0]


def receptive_field(plan, window_pairs, window_block_tokens):
    """Tokens back a position sees in its document: windows, +1 per key shift, +1 (smear/bigram)."""
    return 1 + sum(max(pair[1 if layer.long_window else 0] for pair in window_pairs)
                   * window_block_tokens + layer.key_shift for layer in plan if layer.attention)


def validation_piece_length(tokens, max_piece_tokens, context):
    """Positions of each forward of a validation window of `tokens`: all uncut, else its pieces'
    (pieces as long as the uncut forward, the context reaching across it, run it uncut)."""
    return (tokens if tokens <= max_piece_tokens
            else max_piece_tokens + min(context, tokens - max_piece_tokens))


def describe_validation_pieces(tokens, max_piece_tokens, context):
    """The log's line on validation forwards of `tokens` under a cap below them."""
    length = validation_piece_length(tokens, max_piece_tokens, context)
    if length >= tokens:
        return (f"validation: forwards of {tokens:,} tokens uncut: pieces of {max_piece_tokens} "
                f"tokens after {context:,} of context (the receptive field) would be as long, "
                f"saving no memory")
    return (f"validation: forwards of {tokens:,} tokens in pieces of {length:,} positions (at "
            f"most {max_piece_tokens} tokens, after {context:,} of context: the receptive field)")


def validation_pieces(tokens, val_tokens, val_batch_size, rank, world_size, accum, device,
                      max_piece_tokens, context, bigram_rows=0):
    """Per validation window, its Batches: one uncut, or pieces led by `context` tokens (exact)."""
    for buf, lengths in validation_windows(tokens, val_tokens, val_batch_size, rank, world_size,
                                           accum):
        n = len(buf) - 1
        ids = bigram_hash(buf[:-1], bigram_rows) if bigram_rows else None
        length = validation_piece_length(n, max_piece_tokens, context)
        if length >= n:  # (pieces as long as the whole would save no memory)
            yield [model_inputs(buf, lengths, device, ids)]
            continue
        yield [context_piece(buf, lengths, max(0, start - context), start,
                             min(start + max_piece_tokens, n), 0, length, device, ids)
               for start in range(0, n, max_piece_tokens)]


def micro_step_pieces(hp, stages, world_size, accum):
    """[(a micro-step's tokens per rank, positions per forward)] of the stages, each pair once."""
    pairs = []
    for stage in stages[:3]:
        tokens = tokens_per_rank(stage.batch_tokens, world_size, accum)
        pair = (tokens, padded_piece_length(tokens, piece_cap(hp), stage.max_seq_len))
        if pair not in pairs:
            pairs.append(pair)
    return pairs


# ----------------------------------------------------------------------------------------------
# CPU fallbacks: tiled SDPA attention, a chunked loss, fp32 Polar Express
# (FlexAttention has no CPU backward; bf16 matmuls without native support are ~20x slower)

def local_window_mask(docs, window_tokens):
    """(tile mask, lookback): ATTN_BLOCK query tiles, each seeing itself and window_tokens back."""
    seq_len = docs.numel()
    n_tiles = -(-seq_len // ATTN_BLOCK)
    lookback = min(int(window_tokens), seq_len)  # a shape: the CPU path reads it on the host
    # Padding positions get one extra document id, so every query row has at least itself unmasked.
    padded = torch.cat([docs, (docs[-1:] + 1).expand(n_tiles * ATTN_BLOCK - seq_len)])
    q_pos = torch.arange(n_tiles * ATTN_BLOCK, device=docs.device).view(n_tiles, ATTN_BLOCK, 1)
    k_pos = (torch.arange(n_tiles, device=docs.device)[:, None] * ATTN_BLOCK - lookback
             + torch.arange(lookback + ATTN_BLOCK, device=docs.device)[None, :])[:, None, :]
    k_doc = padded[k_pos.clamp_min(0)]
    allowed = ((k_pos >= 0) & (k_pos <= q_pos) & (q_pos - k_pos <= window_tokens)
               & (padded[q_pos] == k_doc))
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
    q_tiles = F.pad(q, (0, 0, 0, 0, 0, tail)).view(n_tiles, ATTN_BLOCK,
                                                   *q.shape[1:]).transpose(1, 2)
    y = F.scaled_dot_product_attention(q_tiles, windows(k), windows(v), attn_mask=allowed,
                                       scale=1.0)
    return y.transpose(1, 2).reshape(n_tiles * ATTN_BLOCK, *q.shape[1:])[:seq_len]


class TiledWindowAttention:
    """The CPU attention: FlexWindowAttention's mask, one batched SDPA over tiles."""

    mask = staticmethod(local_window_mask)

    def __call__(self, q, k, v, mask, scale):
        return local_window_attention(q, k, v, mask, scale)


SOFTCAP_CHUNK = 512  # rows of logits alive at once in the CPU loss


def chunked_softcap_loss(x, w, targets, with_grads, softcap, mtp_weights=None, loss_mask=None,
                         prior=None, prior_rows=None):
    """Summed cross-entropy of softcap(x @ w.T) (+ prior rows; mtp_weights, loss_mask: as in
    multi_token_loss), SOFTCAP_CHUNK rows at a time; with_grads also forms d loss / d x, d w."""
    scale, n = softcap.scale, x.size(0)
    weights = [1.0] if mtp_weights is None else mtp_weights  # 0-dim tensors: no host read
    grad_x = torch.empty_like(x) if with_grads else None
    grad_w = torch.zeros_like(w) if with_grads else None
    total = x.new_zeros((), dtype=torch.float32)
    for start in range(0, n, SOFTCAP_CHUNK):
        xc = x[start: start + SOFTCAP_CHUNK]
        rows = torch.arange(xc.size(0), device=x.device)
        horizons = [(wk, targets[start + k: start + k + xc.size(0)])
                    for k, wk in enumerate(weights) if start + k < n]  # row r: target start + r + k
        if loss_mask is not None:  # each horizon's weight per row: 0 where mask or target says no
            horizons = [(wk * (loss_mask[start: start + tk.numel()] & (tk >= 0)), tk.clamp_min(0))
                        for wk, tk in horizons]
        logits = (xc @ w.T).float()
        if softcap.offset:
            logits.add_(softcap.offset)
        logits.div_(SOFTCAP_WIDTH).sigmoid_().mul_(scale)
        # d logits / d z = logits * (scale - logits) / (scale * SOFTCAP_WIDTH): the sigmoid's slope
        slope = torch.rsub(logits, scale).mul_(logits) if with_grads else None
        if prior is not None:  # a constant: d loss / d logits keeps its form (softmax of the sum)
            prior.add_to(logits, prior_rows[:, start: start + xc.size(0)])
        picked = [logits[rows[: tk.numel()], tk] for _, tk in horizons]
        probs = logits.exp_()  # logits < scale (a prior's log-probabilities <= 0): no overflow
        sum_exp = probs.sum(dim=1)
        log_sum = sum_exp.log()
        for (wk, tk), z in zip(horizons, picked):
            if loss_mask is not None:
                total += (wk * (log_sum[: tk.numel()] - z)).sum()
                continue
            term = (log_sum[: tk.numel()] - z).sum()
            total += term if mtp_weights is None else wk * term
        if with_grads:
            probs.mul_(sum_exp.reciprocal_()[:, None])
            if loss_mask is not None:
                probs.mul_(sum(F.pad(wk, (0, xc.size(0) - wk.numel()))
                               for wk, _ in horizons)[:, None])
            elif mtp_weights is not None:  # each row's probabilities once per horizon it predicts
                probs.mul_(sum(torch.where(rows < tk.numel(), wk, 0.0)
                               for wk, tk in horizons)[:, None])
            for wk, tk in horizons:  # one target per row and horizon
                probs[rows[: tk.numel()], tk] -= wk
            grad_logits = probs.mul_(slope)
            grad_x[start: start + SOFTCAP_CHUNK] = (grad_logits @ w.float()).div_(
                scale * SOFTCAP_WIDTH).to(x.dtype)
            grad_w += (grad_logits.T @ xc.float()).div_(scale * SOFTCAP_WIDTH).to(w.dtype)
    return total, grad_x, grad_w


class ChunkedSoftcapLoss(torch.autograd.Function):
    """chunked_softcap_loss as an autograd op: its forward forms the gradients (no logits kept)."""

    @staticmethod
    def forward(ctx, x, w, targets, softcap, mtp_weights, loss_mask, prior=None, prior_rows=None):
        total, grad_x, grad_w = chunked_softcap_loss(x, w, targets, True, softcap, mtp_weights,
                                                     loss_mask, prior, prior_rows)
        ctx.save_for_backward(grad_x, grad_w)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_x, grad_w = ctx.saved_tensors
        return grad_x * grad_total, grad_w * grad_total, None, None, None, None, None, None


def chunked_softcap_cross_entropy(x, weight, targets, training, fp8_scales, softcap,
                                  mtp_weights=None, loss_mask=None, inputs=None, prior=None):
    """softcap_cross_entropy for the CPU: chunked, fp32, no FP8, + the prior's rows for `inputs`."""
    prior_rows = None if prior is None else prior.context_rows(inputs)
    if training:
        return ChunkedSoftcapLoss.apply(x, weight, targets, softcap, mtp_weights, loss_mask, prior,
                                        prior_rows)
    if loss_mask is not None:  # a validation piece: its summed loss
        return chunked_softcap_loss(x, weight, targets, False, softcap, None, loss_mask, prior,
                                    prior_rows)[0]
    return chunked_softcap_loss(x, weight, targets, False, softcap, prior=prior,
                                prior_rows=prior_rows)[0] / x.size(0)


CPU_POLAR_EXPRESS = dict(use_triton=False, dtype=torch.float32)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C: KeyboardInterrupt again
    main()
