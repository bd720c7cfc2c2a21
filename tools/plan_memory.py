"""Memory plan: the predicted memory per GPU of a train_gpt.py run, without a GPU and without data.

    python tools/plan_memory.py [train_gpt flags] [--gpu_memory_gb G]
    WORLD_SIZE=8 python tools/plan_memory.py --micro_batch_tokens 17664 --gpu_memory_gb 24

It traces one training step and one validation forward of rank 0 of $WORLD_SIZE processes (the environment
variable, as torchrun sets it, default 1; there is no --world_size flag) with fake tensors (shapes and dtypes,
no data: no GPU is touched), counting every tensor storage while it lives: parameters, gradients, each
optimizer's state, the activations a piece saves for the backward, the head's logits, the training and
validation peaks; on the CPU path with --ngram_prior, a bound on the prior's bytes from the training
shards' token counts (their headers; the counting's own transient peak, about 3.4 GB for order 5 on 18 M
tokens, comes before training and is not in it). On GPU paths it also names the largest --micro_batch_tokens
under which both peaks fit --gpu_memory_gb (the validation runs in pieces of the same cap). The last line is
always `predicted peak per process: X GiB` (one GPU's, on GPUs); under torchrun only rank 0 prints it,
outside torchrun the plan is printed whatever $RANK says.
Bad flags or environment variables are one line `plan_memory.py: error: ...` on stderr and exit
status 2; a plan under which nothing fits --gpu_memory_gb (not even the smallest pieces) is printed
and exits with status 1.
"""
import contextlib
import dataclasses
import functools
import glob
import math
import os
import sys
import warnings
import weakref

import numpy as np
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ngram_prior import NgramPrior  # noqa: E402
from train_gpt import (ATTN_BLOCK, BOS_ID, GPT, GPU_POLAR_EXPRESS, PIECE_CONTEXT_AFTER,  # noqa: E402
                       SHARD_HEADER_INTS, Batch, ConfigError, DataError, Schedule, backend_for, bigram_hash,
                       check_batch_splits, context_piece, describe_pieces, grad_accum_steps,
                       hyperparameters_from, make_optimizers, micro_step_pieces, model_inputs, padded_vocab,
                       parser_for, piece_inputs, process_place, read_shard, receptive_field,
                       tokens_per_rank, validation_piece_length)

PROG = "plan_memory.py"


CUDA_BLOCK_BYTES = 512  # the CUDA caching allocator rounds every allocation up to a multiple of this
# The share of --gpu_memory_gb a plan may fill: the rest is for the CUDA context, library workspaces,
# communication buffers and the allocator's fragmentation, none of which the trace sees.
PLAN_USABLE_FRACTION = 0.9
PLAN_PIECE_STEP = ATTN_BLOCK  # --micro_batch_tokens values the plan searches: multiples of the attention tile
NOTHING_FITS = (f"none (not even {PLAN_PIECE_STEP}: the static memory alone does not fit; use more "
                "GPUs)")
NOTHING_FITS_EXIT = 1  # the plan is printed, and a script can tell no cap fits (2 is bad input)
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


def plan_batch(hp, tokens, piece=False):
    """A Batch of one document of `tokens` positions, with bigram ids if the model has a bigram embedding; as a
    padded micro-step piece of that many positions (with its context, positions and loss mask) if `piece`."""
    window = np.full(tokens + 1, BOS_ID)
    bigram_ids = bigram_hash(window[:-1], hp.bigram_vocab_size) if hp.bigram_vocab_size else None
    if piece:  # one position of context (its length does not change the memory), two targets after
        return piece_inputs(window, [1, tokens], 1, tokens - PIECE_CONTEXT_AFTER, tokens, torch.device("cpu"),
                            bigram_ids)
    return model_inputs(window, [tokens], torch.device("cpu"), bigram_ids)


def plan_validation_batch(hp, tokens, length):
    """A Batch of a validation forward of `length` positions: uncut (one document) if it holds all `tokens`, else
    a validation piece of that length (its context, then its loss-bearing tokens)."""
    if length == tokens:
        return plan_batch(hp, tokens)
    window = np.full(tokens + 1, BOS_ID)
    bigram_ids = bigram_hash(window[:-1], hp.bigram_vocab_size) if hp.bigram_vocab_size else None
    context = length - hp.micro_batch_tokens
    return context_piece(window, [tokens], 0, context, length, 0, length, torch.device("cpu"), bigram_ids)


def planned_backend(hp, gpu_path, accum, attention=None):
    """The trainer's Backend for a traced run: on a GPU with FP8 tensor cores (the FP8 head unless --fp8 off),
    `attention` standing in for the fused kernel (default: its footprint, PlannedAttention), or, for --device cpu,
    the CPU path; the optimizers' math uncompiled and Polar Express in torch (fake tensors run no kernels)."""
    if not gpu_path:
        return backend_for(hp, torch.device("cpu"))
    backend = backend_for(hp, torch.device("cuda"), accum, fp8_hardware=True, attention=attention or PlannedAttention())
    return backend._replace(polar=dict(GPU_POLAR_EXPRESS, use_triton=False), compile_math=False)


def planned_model(hp, gpu_path, accum, attention=None):
    """(the run's model, made under a FakeTensorMode: no memory, with planned_backend's Backend, that Backend)."""
    backend = planned_backend(hp, gpu_path, accum, attention)
    return GPT(hp, backend), backend


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
        schedule = Schedule(hp)
        self.stages = schedule.stages
        last = schedule.at(schedule.total_steps)
        self.windows, self.mtp_weights = last.windows, last.mtp_weights
        self.window_pairs = schedule.window_pairs()
        self.fake, self.live = FakeTensorMode(), LiveMemory()
        self._pieces, self._validations = {}, {}
        with warnings.catch_warnings(), fake_world(world_size), self.fake, self.live:
            self.model, backend = planned_model(hp, gpu_path, self.accum)
            warnings.simplefilter("ignore")  # deprecation notices of collectives that do nothing here
            for t in [*self.model.parameters(), *self.model.buffers()]:
                self.live.track(t)
            self.static = {"parameters": self.live.live}
            self.optimizers = make_optimizers(self.model, hp, backend)
            for optimizer in self.optimizers:  # no counts travel in the fake world, no rows are noted
                if getattr(optimizer, "sparse", None) is not None:  # (the received rows not planned)
                    optimizer.sparse.exchange_counts = lambda sent: sent
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

    def _run_piece(self, tokens, training=True, batch=None):
        """One forward of `tokens` positions (and its backward in training) under the tracker, of `batch` (default:
        a training piece or micro-step of that length): the bytes the forward leaves alive, before and after the
        head ({"trunk": ..., "head": ...})."""
        before = self.live.live
        if batch is None:
            uncut = micro_step_pieces(dataclasses.replace(self.hp, micro_batch_tokens=0), self.stages, self.world_size,
                                      self.accum)
            batch = plan_batch(self.hp, tokens, piece=training and tokens not in dict(uncut))
        batch = Batch(*(None if t is None else self.fake.from_tensor(t) for t in batch))
        for t in batch:  # the batch is made for the piece
            if t is not None:
                self.live.track(t)
        self.model.train(training)
        with torch.set_grad_enabled(training):
            mtp = None if self.mtp_weights is None or not training else self.fake.from_tensor(self.mtp_weights)
            x = self.model.trunk(batch.inputs, batch.cu_seqlens, self.windows, batch.bigram_ids, batch.positions)
            at_head = self.live.live
            loss = self.model.loss(x, batch.inputs, batch.targets, mtp, batch.loss_mask)
            del x  # what the head saves of it counts; in the trainer's forward it is a temporary
        kept = {"trunk": at_head - before, "head": self.live.live - at_head}
        if training:
            loss.backward()
        return kept

    def piece_figures(self, tokens):
        """{"trunk", "head": bytes saved for the backward, "peak": the training step's peak} of a piece."""
        if tokens not in self._pieces:
            with self.fake, self.live:
                self.live.reset_peak()
                kept = self._run_piece(tokens)
                self._pieces[tokens] = dict(kept, peak=max(self.live.peak, self.step_peak))
        return self._pieces[tokens]

    def validation_length(self, micro_batch_tokens):
        """The positions of a validation forward at that cap: all of a rank's tokens per forward, or a piece."""
        tokens = tokens_per_rank(self.hp.val_batch_size, self.world_size, self.accum, what="--val_batch_size")
        if not micro_batch_tokens:
            return tokens
        context = receptive_field(self.model.plan, self.window_pairs, self.hp.window_block_tokens)
        return validation_piece_length(tokens, micro_batch_tokens, context)

    def validation_figures(self, micro_batch_tokens):
        """(positions per forward, the peak of a validation forward at that cap after an even step: the matrix
        optimizer's gradients are gone (traced with them, then taken off), DistAdam's still accumulate)."""
        length = self.validation_length(micro_batch_tokens)
        if length not in self._validations:
            tokens = self.validation_length(0)
            batch = plan_validation_batch(dataclasses.replace(self.hp, micro_batch_tokens=micro_batch_tokens), tokens,
                                          length)
            with self.fake, self.live:
                self.live.reset_peak()
                self._run_piece(length, training=False, batch=batch)
            matrix_grads = sum(self._storage_bytes(p.grad) for group in self.optimizers[0].param_groups
                               for p in group["params"])
            self._validations[length] = self.live.peak - matrix_grads
        return length, self._validations[length]

    def peak(self, micro_batch_tokens):
        """The larger of the training and the validation peak at that cap."""
        return max(self.piece_figures(self.largest_piece(micro_batch_tokens))["peak"],
                   self.validation_figures(micro_batch_tokens)[1])

    def largest_piece(self, micro_batch_tokens):
        """The positions of the longest forward (a padded piece, or an uncut micro-step) of the run at that cap."""
        hp = dataclasses.replace(self.hp, micro_batch_tokens=micro_batch_tokens)
        return max(length for _, length in micro_step_pieces(hp, self.stages, self.world_size, self.accum))

    def largest_fitting_cap(self, budget_bytes):
        """The largest --micro_batch_tokens (a multiple of PLAN_PIECE_STEP) whose training peak (its padded
        pieces) and validation peak (its validation pieces) stay within budget_bytes; 0 if the run fits uncut,
        None if none fits."""
        if self.peak(PLAN_PIECE_STEP) > budget_bytes:
            return None
        if self.peak(0) <= budget_bytes:
            return 0
        longest = max(self.largest_piece(0), self.validation_length(0))
        low, high = 1, -(-longest // PLAN_PIECE_STEP)  # multiples of PLAN_PIECE_STEP: low fits, high does not
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if self.peak(middle * PLAN_PIECE_STEP) <= budget_bytes else (low, middle)
        return low * PLAN_PIECE_STEP


def shard_tokens(path):
    """Tokens of a training shard, from its checked header and size (the body is not read)."""
    read_shard(path, max_tokens=0)
    return (os.path.getsize(path) - SHARD_HEADER_INTS * 4) // 2


def plan_report(hp, world_size, gpu_memory_gb):
    """The lines this tool prints; the last reads 'predicted peak per process: X GiB' (one GPU's, on GPUs)."""
    gpu_path = hp.device != "cpu"
    plan = MemoryPlan(hp, world_size, gpu_path)
    pieces = micro_step_pieces(hp, plan.stages, world_size, plan.accum)
    piece = plan.largest_piece(hp.micro_batch_tokens)
    figures = plan.piece_figures(piece)
    val_length, val_peak = plan.validation_figures(hp.micro_batch_tokens)
    val_tokens = plan.validation_length(0)
    val_forward = f"{val_tokens:,}-token forward" if val_length == val_tokens else \
        f"{val_tokens:,} tokens in pieces of {val_length:,}"
    paths = f"GPU paths ({'FP8' if hp.fp8 != 'off' else 'bf16'} head, fused attention)" if gpu_path else "CPU path"
    lines = [f"memory plan (predicted: eager accounting, fake tensors) for rank 0 of {world_size} process(es), "
             f"{paths}, {plan.accum} micro-step(s) per step of {describe_pieces(pieces)} tokens"]
    rows = [*plan.static.items(), (f"activations saved, {piece:,}-token piece", figures["trunk"]),
            (f"head logits saved, {piece:,}-token piece", figures["head"]), ("training peak", figures["peak"]),
            (f"validation peak, {val_forward}", val_peak)]
    lines += [f"  {name:<44} {size / GiB:8.2f} GiB" for name, size in rows]
    peak = max(figures["peak"], val_peak)
    if hp.ngram_prior and not gpu_path:
        files = sorted(glob.glob(hp.train_files))
        if files:  # the prior lives beside everything else from the first step on
            tokens = sum(shard_tokens(f) for f in files)
            prior = NgramPrior.bytes_bound(hp.ngram_prior_order, tokens, padded_vocab(hp))
            lines.append(f"  {f'n-gram prior, at most ({tokens:,} tokens)':<44} {prior / GiB:8.2f} GiB")
            peak += prior
        else:
            lines.append(f"  n-gram prior: not counted (no training shard matches {hp.train_files!r})")
    if gpu_path:
        budget = gpu_memory_gb * PLAN_USABLE_FRACTION * GiB
        cap = plan.largest_fitting_cap(budget)
        fit = f"largest --micro_batch_tokens that fits --gpu_memory_gb {gpu_memory_gb:g} ({budget / GiB:.1f} GiB usable): "
        if cap is None:
            fit += NOTHING_FITS
        elif cap == 0:
            fit += "any: the run fits uncut (0)"
        else:
            cut = micro_step_pieces(dataclasses.replace(hp, micro_batch_tokens=cap), plan.stages, world_size,
                                    plan.accum)
            cap_peak = plan.piece_figures(plan.largest_piece(cap))["peak"]
            cap_val_length, cap_val_peak = plan.validation_figures(cap)
            fit += (f"{cap} (training peak {cap_peak / GiB:.2f} GiB, validation peak {cap_val_peak / GiB:.2f} GiB; "
                    f"micro-steps of {describe_pieces(cut)}; validation in pieces of {cap_val_length:,})")
        lines.append(fit)
    lines.append(f"predicted peak per process: {peak / GiB:.2f} GiB")
    return lines


def parse(argv):
    """train_gpt.py's flags and --gpu_memory_gb -> (Hyperparameters, GiB per GPU)."""
    flag = next((a.split("=", 1)[0] for a in argv if a.split("=", 1)[0] in ("--world_size", "--world-size")), None)
    if flag:
        raise ConfigError(f"{flag} is not a flag of this tool: the number of processes comes from the environment, as "
                          f"torchrun sets it; run WORLD_SIZE=N python tools/plan_memory.py ...")
    parser = parser_for(argv, prog=PROG)
    parser.description = __doc__.split("\n\n")[0]
    parser.add_argument("--gpu_memory_gb", type=float, default=80.0, metavar="FLOAT",
                        help="memory of one GPU in GiB: the plan names the largest --micro_batch_tokens whose "
                             "predicted peak fits it (default: 80.0)")
    args = parser.parse_args(argv)
    if not args.gpu_memory_gb > 0:  # (also NaN)
        raise ConfigError(f"--gpu_memory_gb must be positive, got {args.gpu_memory_gb}")
    if math.isinf(args.gpu_memory_gb):
        raise ConfigError(f"--gpu_memory_gb must be finite, got {args.gpu_memory_gb}: the GiB of "
                          f"one GPU")
    return hyperparameters_from(args), args.gpu_memory_gb


def main(argv=None):
    """Print the plan (rank 0's of $WORLD_SIZE; under torchrun only rank 0 prints it)."""
    try:
        hp, gpu_memory_gb = parse(sys.argv[1:] if argv is None else argv)
        place = process_place()
        lines = plan_report(hp, place.world_size, gpu_memory_gb)
    except (ConfigError, DataError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        sys.exit(2)
    if place.rank == 0 or "TORCHELASTIC_RUN_ID" not in os.environ:  # (a RANK of the user's own changes no plan)
        print("\n".join(lines))
    if len(lines) > 1 and lines[-2].endswith(NOTHING_FITS):
        sys.exit(NOTHING_FITS_EXIT)


if __name__ == "__main__":
    main()
