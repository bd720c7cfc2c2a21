"""Step-cost ledger: where the time of one training step goes on a GPU, predicted without one.

    python tools/step_cost.py [train_gpt flags] [--world_size N] [--gpu h100|h200] [--reference LOG]
                              [--kernels INVENTORY] [--reference_kernels RACE_INVENTORY]

For each stage of the run it traces one training step of rank 0 of N ranks (the forward and backward of
every micro-step piece, then the optimizer step) on fake tensors, the way train_gpt.py's memory plan does:
shapes and dtypes only, no GPU and no data. Every op of the GPU path is counted: the FP8 head and its loss
(the FP8 custom op's eager body, casts and transposes included), the FP8 MLP (its fused Triton ops as
GEMMs), a fused-attention stand-in with FlexAttention's block mask and footprint, the optimizers with
their collectives (a fake process group).
With --reference LOG it traces a modded-nanogpt record's own step the same way (tools/reference_step.py) and
prints the two side by side.

FLOPs come from torch.utils.flop_counter (FlopCounterMode's formulas, one for the attention stand-in per
visible 128 x 128 block); bytes from the storages the ops read and write (the memory plan's live-storage
tracer). Ideal fusion: a tensor made by a pointwise/reduction op, read only by such ops and dead within the
same phase (forward, backward, optimizer) never reaches memory; the ops joined by such tensors are one kernel.
With --kernels (the CUDA compile check's kernel inventory) ours' forward and backward are priced
by the kernels Inductor really generated instead: their calls for the launch floor, their bytes
read and written (our own kernels' custom ops, which Inductor only calls, stay as traced); with
--reference_kernels (the compile check's --race inventory) the reference's too (its own Triton and
NVRTC kernels' stand-ins stay as traced).
Each op costs its roofline time, max(FLOPs / peak of its class, bytes / HBM bandwidth), with what a
roofline misses (attention at its backend's efficiency, GEMM waves over the SMs, a looped reduction's
second pass, special functions, a hand-written kernel's occupancy), and each kernel at least the
launch floor; each collective costs NCCL's latency plus its ring traffic over NVLink, and the
collectives overlap the optimizer step's compute (both codes start them after the backward). It is a model:
see docs/where-the-time-goes.md for what it leaves out.
"""
import argparse
import collections
import contextlib
import csv
import dataclasses
import functools
import io
import json
import math
import os
import re
import warnings
import sys
import weakref

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_gpt as tg  # noqa: E402
from plan_memory import PLAN_PIECE_STEP, LiveMemory, fake_world, plan_batch, planned_model  # noqa: E402
import reference_step  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.utils.flop_counter import (FlopCounterMode, register_flop_formula, sdpa_backward_flop_count,  # noqa: E402
                                      sdpa_flop_count)

# Peak rates, dense (no sparsity); sources: NVIDIA H100 Tensor Core GPU datasheet (SXM5 column) and NVIDIA
# H200 Tensor Core GPU datasheet (SXM column); NVLink 4: 900 GB/s per GPU in both directions together.
# launch: the least time a kernel takes after the one before it, however little it does (a few us: NVIDIA
# Technical Blog, "Getting Started with CUDA Graphs", 2019, short kernels launched back to back).
# nccl_base, nccl_hop: NCCL's latency model for a ring over NVLink, LL protocol (its small-message latency):
# base + steps x hop, steps = 2 (n - 1) for an all-reduce, n - 1 for the others (NCCL src/graph/tuning.cc,
# baseLat and hwLat).
# sms: streaming multiprocessors (both: 132); sfu: special-function results per second (exp2,
# log2, rcp, tanh: 16 per clock per SM on compute capability 9.0, CUDA C++ Programming Guide,
# "Arithmetic Instructions", at the 1.98 GHz boost clock the datasheets' fp32 peak implies:
# 132 SMs x 128 lanes x 2 x 1.98 GHz = 67 TFLOP/s).
SMS, SFU_PER_CLOCK, CLOCK = 132, 16, 1.98e9
GPU_PEAKS = {
    "h100": dict(name="H100 SXM", fp8=1979e12, bf16=989e12, tf32=494.5e12, fp32=67e12, hbm=3.35e12,
                 nvlink=450e9, memory_gb=80, launch=3e-6, nccl_base=3.6e-6, nccl_hop=0.47e-6,
                 sms=SMS, sfu=SMS * SFU_PER_CLOCK * CLOCK),
    "h200": dict(name="H200 SXM", fp8=1979e12, bf16=989e12, tf32=494.5e12, fp32=67e12, hbm=4.8e12,
                 nvlink=450e9, memory_gb=141, launch=3e-6, nccl_base=3.6e-6, nccl_hop=0.47e-6,
                 sms=SMS, sfu=SMS * SFU_PER_CLOCK * CLOCK),
}
# Attention by backend: the share of the bf16 peak its kernels reach on an H100, forward and
# backward.
# FA2_H100: FlashAttention-2 on an H100, 35 % (FlashAttention-3 paper, Shah et al. 2024, abstract).
# fa3 (record #89): forward 75 % (the same abstract: up to 740 TFLOP/s in FP16); backward 1.5 x
#   FA2's, the low end of the abstract's 1.5-2.0 x (it quotes no backward utilization of its own).
# flex_triton (ours, FlexAttention's default Triton backend): 90 % of FlashAttention-2's forward
#   speed and 85 % of its backward (PyTorch blog "FlexAttention: The Flexibility of PyTorch with the
#   Performance of FlashAttention", 2024, measured on an A100), applied to FA2's 35 % on an H100.
# flex_flash (kernel_options={"BACKEND": "FLASH"}: flash-attn-4's CuTe-DSL kernels): 1.2 x the
#   Triton backend, the low end of the 1.2-3.2 x on compute-bound workloads in PyTorch's blog
#   "FlexAttention + FlashAttention-4: Fast and Flexible" (its high end is Blackwell's).
FA2_H100 = 0.35
ATTENTION_BACKENDS = {
    "fa3": dict(forward=0.75, backward=1.5 * FA2_H100),
    "flex_triton": dict(forward=0.90 * FA2_H100, backward=0.85 * FA2_H100),
    "flex_flash": dict(forward=1.2 * 0.90 * FA2_H100, backward=1.2 * 0.85 * FA2_H100),
}
# A GEMM's output tile (128 x 256, the long side along the longer output side): cuBLAS's Hopper
# kernels for large GEMMs and #89's persistent linear_relu_square use it; t tiles run
# ceil(t / SMs) waves.
GEMM_TILE = (128, 256)
# Inductor keeps a reduction's row in registers (a persistent reduction) up to this many elements; a
# longer row is reduced in a loop, and what is computed from the result over the row is a second
# loop that reads the row again (torch/_inductor/choices.py, should_use_persistent_reduction: 1024
# for inner reductions)
PERSISTENT_REDUCTION_LIMIT = 1024
# special-function results per output element of an op (Triton's sigmoid is 1 / (1 + exp(-x)): an
# exp and a rcp; an fp32 division is a rcp refined by FMAs)
SFU_OPS = {"exp": 1, "exp2": 1, "log": 1, "log2": 1, "sigmoid": 2, "tanh": 1, "rsqrt": 1, "sin": 1,
           "cos": 1, "reciprocal": 1, "div": 1}
# special-function results per input element of a reduction (an exp of each)
SFU_PER_INPUT = {"logsumexp": 1, "_softmax": 1, "_log_softmax": 1}
REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "logsumexp", "prod", "norm",
              "linalg_vector_norm"}
# modded-nanogpt record #89 (2026-07-17, FP8 down projection), its log on 8 x H100: ms/step per stage and the
# mean train time of its 13 runs
REFERENCE_MS_PER_STAGE = (31.4, 56.8, 82.7)
REFERENCE_TRAIN_SECONDS = 79.7
CLASSES = ("matmul fp8", "matmul bf16", "matmul tf32", "matmul fp32", "attention", "pointwise/reduction", "collectives")
PHASES = ("forward", "backward", "optimizer")
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")  # their ops return the buffers they fill
MATMULS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm"}
# ops that write memory at data-dependent places or sort: their outputs are real buffers under any fusion
UNFUSABLE = {"scatter", "scatter_add", "scatter_add_", "scatter_", "scatter_reduce", "index_put", "index_put_",
             "index_add", "index_add_", "embedding_dense_backward", "sort", "argsort", "topk", "_unsafe_index_put"}
# ops that only take their input's shape and dtype: they read nothing (the empty ones write nothing either)
SHAPE_ONLY = {"new_zeros", "new_ones", "new_full", "new_empty", "new_empty_strided", "zeros_like", "ones_like",
              "full_like", "empty_like", "zero_", "fill_"}
# ops that read rows of their first argument at indices: they read the rows they gather, not the table
GATHERS = {"embedding", "index", "index_select", "gather"}
# ops that add or put rows (the argument at the index given) into self at indices: self's rows touched (the
# functional index_put of an index's backward, into a fresh zero tensor, as a compiler does it in place)
ROW_SCATTERS = {"index_put_": 2, "index_add_": 3, "_unsafe_index_put_": 2, "scatter_add_": 3, "index_put": 2,
                "_unsafe_index_put": 2}
# in-place ops that overwrite self without reading it
OVERWRITES = {"copy_"}
ALLOCATION_ONLY = {"new_empty", "new_empty_strided", "empty_like", "empty", "empty_strided"}
METADATA = {"size", "sym_size", "stride", "sym_stride", "numel", "sym_numel", "dim", "is_contiguous",
            "storage_offset", "sym_storage_offset", "is_strides_like_format", "is_non_overlapping_and_dense",
            "_local_scalar_dense", "detach", "alias", "lift_fresh"}


# ---- the fused FP8 MLP's Triton ops (fp8_kernels.py, the GPU path with Triton): a GEMM of (M, K)
# against (N, K) with its epilogue, 2 M N K FLOPs at the FP8 (up projection) or bf16 (the relu^2
# gradient) matmul rate; their bytes are the ledger's, the operands they read and every output they
# store (pre, post and post_f8 of the up projection, its tile maxima)
FUSED_MLP_KINDS = {"fp8_up_relu_square": "matmul fp8", "relu_square_grad": "matmul bf16"}


def fused_kernels():
    """fp8_kernels.py, its ops registered (None without Triton: the GPU path runs unfused)."""
    return tg.load_companion("fp8_kernels.py") if tg.HAS_TRITON else None


def fused_mlp_gemm_flops(a_shape, b_shape, *args, **kwargs):
    (m, k), n = a_shape, b_shape[0]
    return 2 * m * n * k


def fused_mlp_tiles(name, args):
    """The programs (output tiles) a fused MLP op launches, at its kernel's tile."""
    kernels = fused_kernels()
    tile = kernels.UP_TILE if name == "fp8_up_relu_square" else kernels.GRAD_TILE
    return kernels.tile_count(args[0].shape[0], args[1].shape[0], tile)


if fused_kernels():
    for _op in (torch.ops.speedrun.fp8_up_relu_square, torch.ops.speedrun.relu_square_grad):
        register_flop_formula(_op)(fused_mlp_gemm_flops)

# fp8_kernels.py's loss kernel (speedrun::softcap_loss), a kernel of its own: it reads the bf16
# logits, the targets, weights and the announced gradient and writes the e5m2 gradient and the loss
# sums (its (K, n) per-row terms and their sum, 12 bytes a row against 3 V, are left out). Its
# second pass over a row reads L2, not HBM. Special functions per logit: each pass's sigmoid (one
# tanh.approx, as record #89's; its argument multiplied by 1 / width, not divided), the first's exp
# of the sum, the second's exp of p
FUSED_LOSS_SFU_PER_LOGIT = 4


# ---- the fused attention stand-in: FlexAttention's visible blocks, FusedAttentionFootprint's bytes

@torch.library.custom_op("step_cost::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: int, backend: str
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, float32 log-sum-exp per query and head) of a fused kernel over `blocks` visible tiles,
    run by `backend` (a key of ATTENTION_BACKENDS)."""
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)


@attention_op.register_fake
def _(q, k, v, blocks, backend):
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.custom_op("step_cost::attention_backward", mutates_args=())
def attention_backward_op(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          out: torch.Tensor, lse: torch.Tensor, blocks: int, backend: str
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(lse)


@attention_backward_op.register_fake
def _(grad, q, k, v, out, lse, blocks, backend):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(lse)


def _tile(shape):
    """(T, H, D) -> the (1, H, tile, D) shape of one visible block's query or key tile."""
    return (1, shape[1], tg.ATTN_BLOCK, shape[2])


@register_flop_formula(torch.ops.step_cost.attention)
def _attention_flop(q, k, v, blocks, backend, out_shape=None, **kwargs):
    return blocks * sdpa_flop_count(_tile(q), _tile(k), _tile(v))


@register_flop_formula(torch.ops.step_cost.attention_backward)
def _attention_backward_flop(grad, q, k, v, out, lse, blocks, backend, out_shape=None, **kwargs):
    return blocks * sdpa_backward_flop_count(_tile(grad), _tile(q), _tile(k), _tile(v))


def _attention_setup(ctx, inputs, output):
    q, k, v, blocks, backend = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.blocks, ctx.backend = blocks, backend


def _attention_autograd(ctx, grad, _):
    grad_q, grad_k, grad_v, _term = attention_backward_op(grad, *ctx.saved_tensors, ctx.blocks,
                                                          ctx.backend)
    return grad_q, grad_k, grad_v, None, None


attention_op.register_autograd(_attention_autograd, setup_context=_attention_setup)


@functools.lru_cache(maxsize=None)
def visible_blocks(seq_len, window_tokens):
    """Tiles FlexAttention computes under the GPU path's own block mask (sliding_document_mask) for one
    document of seq_len positions: partial and full blocks."""
    with torch.utils._python_dispatch._disable_current_modes():
        mask = tg.sliding_document_mask(torch.zeros(seq_len, dtype=torch.int64), int(window_tokens))
        return int(mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum())


class LedgerAttention:
    """FlexWindowAttention's cost for the ledger: its block mask's visible tiles (one document per
    piece, as the memory plan's batch; real batches have more documents, so fewer tiles), a fused
    kernel's memory, at the efficiency of FlexAttention's backend (`backend`: a key of
    ATTENTION_BACKENDS)."""

    def __init__(self, backend="flex_triton"):
        self.backend = backend

    @staticmethod
    def mask(docs, window_tokens):
        return visible_blocks(docs.numel(), window_tokens)

    def __call__(self, q, k, v, blocks, scale):
        return attention_op(q, k, v, blocks, self.backend)[0]


# ---- the ledger: every op's class, FLOPs and the storages it reads and writes

@dataclasses.dataclass
class Op:
    name: str
    kind: str  # one of CLASSES
    phase: str
    flops: int
    reads: list  # [(storage serial, bytes)]
    writes: list  # [(storage serial, bytes written, fresh storage?, storage bytes)]
    sent: float = 0.0  # bytes this rank sends (collectives)
    shape: str = ""  # dtype and shape of its largest output, to tell ops of one name apart
    fusable: bool = False  # a pointwise/reduction op a compiler may fuse with its neighbours
    # a kernel of its own: a custom op of ours (speedrun::) or a stand-in of one of #89's kernels;
    # not Inductor's (--kernels, --reference_kernels), so priced as traced there too
    own_kernel: bool = False
    tiles: int = 0  # a GEMM's output tiles (GEMM_TILE), for its waves over the SMs
    efficiency: float = 1.0  # the share of its class's peak it reaches (attention: by backend)
    sfu: int = 0  # special-function results it computes
    blocks_per_sm: int = 0  # a hand-written kernel's occupancy (0: its memory and compute overlap)
    row: int = 0  # a reduction's elements per result
    numel: int = 0  # elements of its largest output
    index: int = -1  # its place in Ledger.ops


def _view_bytes(t):
    return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())


def _view_key(t):
    return id(t.untyped_storage()), t.storage_offset(), tuple(t.shape), tuple(t.stride())


class Ledger(LiveMemory):
    """The memory plan's live-storage tracer, also recording each op (class, FLOPs by FlopCounterMode's
    formulas, storages read and written) and when each storage dies, for the fusion model."""

    def __init__(self, world_size):
        super().__init__()
        self.world_size, self.phase, self.ops = world_size, "forward", []
        # storages of host (CPU) tensors in a GPU run: ops that read only these are host work (no kernel, no HBM)
        # and their outputs are host tensors too
        self.host = weakref.WeakValueDictionary()
        self.flop_registry = FlopCounterMode(display=False).flop_registry
        self._keys, self._next_serial = {}, 0
        self.produced, self.consumers, self.died_in = {}, collections.defaultdict(list), {}
        self.calls = []  # (index of the next op, custom op) of the FP8 head's compiled helpers

    def serial(self, storage):
        entry = self._keys.get(id(storage))
        if entry is not None and entry[0]() is storage:
            return entry[1]
        serial, self._next_serial = self._next_serial, self._next_serial + 1

        def died(ref, key=id(storage), serial=serial):
            if self._keys.get(key, (None,))[0] is ref:
                del self._keys[key]
            self.died_in[serial] = self.phase

        self._keys[id(storage)] = (weakref.ref(storage, died), serial)
        return serial

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__
        if func is torch.ops.speedrun.mm_fp8.default:  # the head's custom op: trace its eager body
            self.calls.append((len(self.ops), "mm_fp8"))
            with self:
                return tg.fp8_forward(*args[:4])
        if func is torch.ops.speedrun.mm_fp8_backward.default:
            self.calls.append((len(self.ops), "mm_fp8_backward"))
            with self:
                return tg.fp8_backward(*args)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if name in METADATA or func.namespace == "prim":
            return out
        tensors_in = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        tensors_out = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if tensors_in and all(id(t.untyped_storage()) in self.host for t in tensors_in):
            for t in tensors_out:
                self.host[id(t.untyped_storage())] = t.untyped_storage()
            return out
        in_storages = {id(t.untyped_storage()) for t in tensors_in}
        writes_input = any(r.alias_info is not None and r.alias_info.is_write for r in func._schema.returns)
        aliased = tensors_out and all(id(t.untyped_storage()) in in_storages for t in tensors_out)
        if aliased and not writes_input and func.namespace not in COLLECTIVE_NAMESPACES:
            return out  # a view (or a `to` that returned its input): no data moves
        kind = self._kind(func, name, tensors_in)
        mutated = self._mutated_arguments(func, args, kwargs)
        write_only = {_view_key(t) for t, read_too in mutated if not read_too}
        returned = {_view_key(t) for t in tensors_out}
        tensors_out += [t for t, _ in mutated if _view_key(t) not in returned]
        touched = self._touched_rows(name, args, tensors_out)  # {view key: bytes} of indexed ops' tables
        reads, seen = [], set()
        for t in [] if name in SHAPE_ONLY else tensors_in:
            s = self.serial(t.untyped_storage())
            if s not in seen and _view_key(t) not in write_only:
                seen.add(s)
                reads.append((s, touched.get(_view_key(t), _view_bytes(t))))
        writes = []
        for t in tensors_out:
            fresh = id(t.untyped_storage()) not in in_storages
            s = self.serial(t.untyped_storage())
            size = 0 if name in ALLOCATION_ONLY else t.untyped_storage().nbytes() if fresh else _view_bytes(t)
            size = touched.get(_view_key(t), size)
            writes.append((s, size, fresh, t.untyped_storage().nbytes()))
            if fresh:
                self.produced[s] = len(self.ops)
        for s, _ in reads:
            self.consumers[s].append(len(self.ops))
        flops = 0
        if func._overloadpacket in self.flop_registry:
            flops = self.flop_registry[func._overloadpacket](*args, **kwargs, out_val=out)
        largest = max(tensors_out, key=lambda t: t.numel(), default=None)
        shape = "" if largest is None else f"{str(largest.dtype).replace('torch.', '')}{list(largest.shape)}"
        fusable = (kind == "pointwise/reduction" and name not in UNFUSABLE
                   and func.namespace not in ("step_cost", "speedrun", reference_step.NAMESPACE))
        op = Op(name, kind, self.phase, int(flops), reads, writes, shape=shape, fusable=fusable,
                own_kernel=func.namespace in ("speedrun", reference_step.NAMESPACE),
                numel=0 if largest is None else largest.numel(), index=len(self.ops))
        if kind == "collectives":
            op.sent = self._sent_bytes(name, tensors_in)
        self._describe_kernel(op, func, args, tensors_in, largest)
        self.ops.append(op)
        return out

    @staticmethod
    def _describe_kernel(op, func, args, tensors_in, largest):
        """What the roofline alone misses: a GEMM's tiles, an attention backend's efficiency,
        special functions, a hand-written kernel's occupancy, a reduction's row length."""
        if func.namespace == "step_cost":
            direction = "backward" if op.name.endswith("backward") else "forward"
            op.efficiency = ATTENTION_BACKENDS[args[-1]][direction]
        elif func.namespace == reference_step.NAMESPACE:
            for field, value in reference_step.stand_in_kernel(op.name, args).items():
                setattr(op, field, value)
        elif func.namespace == "speedrun" and op.name in FUSED_MLP_KINDS:
            op.tiles = fused_mlp_tiles(op.name, args)
        elif func.namespace == "speedrun" and op.name == "softcap_loss":
            op.sfu = FUSED_LOSS_SFU_PER_LOGIT * args[0].numel()
        elif op.kind.startswith("matmul") and largest is not None:
            op.tiles = gemm_tiles(largest.shape)
        if op.fusable:
            op.sfu = SFU_OPS.get(op.name, 0) * op.numel
            if op.name in SFU_PER_INPUT and tensors_in:
                op.sfu = SFU_PER_INPUT[op.name] * tensors_in[0].numel()
            if op.name in REDUCTIONS and tensors_in and op.numel:
                op.row = tensors_in[0].numel() // op.numel

    @staticmethod
    def _touched_rows(name, args, tensors_out):
        """A gather reads of its table the bytes it outputs; a row scatter reads and writes of self the bytes of
        the rows it adds."""
        if name in GATHERS and isinstance(args[0], torch.Tensor) and tensors_out:
            return {_view_key(args[0]): min(_view_bytes(args[0]), _view_bytes(tensors_out[0]))}
        position = ROW_SCATTERS.get(name)
        if position is not None and len(args) > position and isinstance(args[position], torch.Tensor):
            rows = min(_view_bytes(args[0]), args[position].numel() * args[0].element_size())
            return {_view_key(t): rows for t in [args[0], *tensors_out[:1]]}
        return {}

    @staticmethod
    def _mutated_arguments(func, args, kwargs):
        """[(tensor, read too?)] of the arguments an op writes: an `out=` argument, copy_'s destination and a
        stand-in's outputs are written only; an in-place op's self is read and written."""
        name, mutated = func._overloadpacket.__name__, []
        for i, argument in enumerate(func._schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(argument.name)
            if isinstance(value, torch.Tensor):
                stand_in = func.namespace == reference_step.NAMESPACE
                written_only = (argument.name == "out" or name in OVERWRITES
                                or stand_in and argument.name not in reference_step.READ_AND_WRITTEN)
                mutated.append((value, not written_only))
        return mutated

    @staticmethod
    def _kind(func, name, tensors):
        if func.namespace in COLLECTIVE_NAMESPACES:
            return "collectives"
        if func.namespace == "step_cost":
            return "attention"
        if func.namespace == reference_step.NAMESPACE:
            return reference_step.stand_in_kind(name)
        if func.namespace == "speedrun" and name in FUSED_MLP_KINDS:
            return FUSED_MLP_KINDS[name]
        if name in MATMULS:
            if name == "_scaled_mm":
                return "matmul fp8"
            dtype = tensors[-1].dtype
            if dtype in (torch.bfloat16, torch.float16):
                return "matmul bf16"
            return "matmul tf32" if torch.backends.cuda.matmul.allow_tf32 else "matmul fp32"
        return "pointwise/reduction"

    def _sent_bytes(self, name, tensors):
        """What this rank sends in a ring collective over world_size ranks."""
        n = self.world_size
        full = max((t.numel() * t.element_size() for t in tensors), default=0)
        if "reduce_scatter" in name or "allgather" in name or "all_gather" in name:
            return full * (n - 1) / n
        if "allreduce" in name or "all_reduce" in name:
            return 2 * full * (n - 1) / n
        if "alltoall" in name or "all_to_all" in name:  # (output, input, ...): the input leaves, less this rank's share
            return tensors[1].numel() * tensors[1].element_size() * (n - 1) / n
        return 0.0

    def fused_away(self, serial):
        """A storage ideal fusion keeps in registers: made by a fusable op, read only by fusable ops, dead
        within the phase that made it."""
        op = self.produced.get(serial)
        if op is None or not self._fusable(self.ops[op]) or self.died_in.get(serial) != self.ops[op].phase:
            return False
        return all(self._fusable(self.ops[c]) for c in self.consumers[serial])

    @staticmethod
    def _fusable(op):
        return op.fusable

    def read_in_registers(self, serial, op):
        """A storage that reaches memory (saved for later) read by a fusable op that can join the
        kernel making it: its maker is fusable and of the same phase, and everything else the
        reader reads existed before the maker ran (so no other kernel stands between them). The
        reader takes the value from the maker's registers, as Inductor fuses such a reader (the FP8
        MLP's e4m3 cast and amax of post with relu(pre)^2)."""
        made_by = self.produced.get(serial)
        if not op.fusable or made_by is None or made_by >= op.index:
            return False
        maker = self.ops[made_by]
        if not maker.fusable or maker.phase != op.phase:
            return False
        return all(s == serial or self.produced.get(s, -1) <= made_by for s, _ in op.reads)

    def op_bytes(self, op):
        """(bytes read, bytes written) of one op under ideal fusion."""
        read = sum(b for s, b in op.reads
                   if not self.fused_away(s) and not self.read_in_registers(s, op))
        written = sum(b for s, b, *_ in op.writes if not self.fused_away(s))
        return read, written

    def kept_bytes(self, phase):
        """Bytes (in the allocator's blocks) of the storages `phase` made that outlive it: what a forward
        saves for the backward, as the memory plan counts it."""
        sizes = {s: size for op in self.ops if op.phase == phase for s, _, fresh, size in op.writes if fresh}
        blocks = self.block_bytes
        return sum(-(-b // blocks) * blocks for s, b in sizes.items() if self.died_in.get(s) != phase)


# ---- Inductor's real kernels: the CUDA compile check's kernel inventory (--kernels FILE)

TRAINING_GRAPH = re.compile(r"training step at ([\d,]+) tokens")
# #89's, in the compile check's --race inventory (FlexAttention in place of its FlashAttention 3)
RACE_GRAPH = re.compile(r"race #89 training step at ([\d,]+) tokens")
INDUCTOR_PREFIX = "triton_"  # Inductor's kernel names; a user-defined Triton kernel keeps its own
HELPER_GRAPHS = {"mm_fp8": "FP8 head forward helper", "mm_fp8_backward": "FP8 head backward helper"}
INVENTORY_COLUMNS = ("graph", "kernel", "read_bytes", "written_bytes", "launches")
TEMPLATE_PREFIX = "triton_tem_"  # FlexAttention's templates: the ledger prices attention by backend
COMPILED = "pointwise/reduction"  # the class whose work Inductor's Triton kernels do
MAKE_INVENTORY = ("make one with ~/.cache/speedrun/venv-torch-2.11/bin/python "
                  "tools/cuda_compile_check.py --only training head --inventory FILE.json")
MAKE_RACE_INVENTORY = ("make one with ~/.cache/speedrun/venv-torch-2.11/bin/python "
                       "tools/cuda_compile_check.py --race LOG --only 'training step' "
                       "--inventory FILE.json")


class InventoryError(ValueError):
    """A kernel inventory the ledger cannot use, said in a phrase."""


@dataclasses.dataclass
class RealKernels:
    """Inductor's kernels of our training step (the CUDA compile check's inventory): (name, bytes
    read + written per call, calls per run of its graph) of the training graph's kernels but its
    attention templates, and of each FP8 head helper's, by the custom op whose call runs it."""
    path: str
    tokens: int  # the training graph's tokens per micro-step
    training: list
    helpers: dict
    templates: int

    def of_piece(self, ledger, ops):
        """(name, bytes, calls) of the kernels one traced piece (`ops`, its slice of ledger.ops)
        runs."""
        first, end = ops[0].index, ops[-1].index + 1
        kernels = list(self.training)
        for index, op in ledger.calls:
            if first <= index < end:
                kernels += self.helpers.get(op, [])
        return kernels

    def describe(self):
        calls = sum(launches for _, _, launches in self.training)
        return (f"Inductor's kernels of the training step at {self.tokens:,} tokens from "
                f"{self.path} "
                f"({len(self.training)} kernels, {calls} calls; {self.templates} attention "
                "templates, priced by backend)")


def inventory_rows(path):
    """The rows of a kernel inventory: FILE.csv one per kernel, any other name JSON."""
    try:
        text = open(path, encoding="utf-8").read()
    except FileNotFoundError:
        raise InventoryError("no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InventoryError(f"cannot read it ({type(e).__name__})") from None
    if str(path).endswith(".csv"):
        try:
            return list(csv.DictReader(io.StringIO(text)))
        except csv.Error as e:
            raise InventoryError(f"not a CSV inventory ({e})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise InventoryError(f"not a JSON inventory (line {e.lineno}: {e.msg})") from None
    if not isinstance(data, dict) or not isinstance(data.get("kernels"), list):
        raise InventoryError("not a kernel inventory (no list of 'kernels')")
    return data["kernels"]


def read_inventory(path, graph_name=TRAINING_GRAPH):
    """RealKernels of a kernel inventory, its training step's graph named by `graph_name` (ours, or
    RACE_GRAPH: #89's); InventoryError when it has no training step's kernels or a row without a
    graph, a kernel and whole numbers of bytes read and written. A user-defined Triton kernel
    (#89's own, traced into its graph) is left out: the ledger prices it as traced, as ours."""
    training, helpers, templates, tokens = [], collections.defaultdict(list), 0, set()
    for number, row in enumerate(inventory_rows(path), 1):
        missing = [c for c in INVENTORY_COLUMNS if not isinstance(row, dict) or c not in row]
        if missing:
            raise InventoryError(f"kernel row {number} has no {', '.join(missing)}")
        graph, name = str(row["graph"]), str(row["kernel"])
        try:
            size = int(row["read_bytes"]) + int(row["written_bytes"])
            kernel = (name, size, int(row["launches"]))
        except (TypeError, ValueError):
            raise InventoryError(f"kernel row {number} ({name}): read_bytes, written_bytes and "
                                 "launches are not whole numbers") from None
        match = graph_name.match(graph)
        if match:
            tokens.add(int(match.group(1).replace(",", "")))
            if name.startswith(TEMPLATE_PREFIX):
                templates += 1
            elif name.startswith(INDUCTOR_PREFIX):
                training.append(kernel)
        for op, helper in HELPER_GRAPHS.items():
            if graph.startswith(helper):
                helpers[op].append(kernel)
    if not training:
        raise InventoryError(f"no kernels of the training step (a graph '{graph_name.pattern}')")
    if len(tokens) > 1:
        raise InventoryError(f"training steps at several sizes ({sorted(tokens)} tokens)")
    return RealKernels(str(path), tokens.pop(), training, dict(helpers), templates)


# ---- tracing one step of a stage

def trace_setup(hp, world_size, ledger, attention="flex_triton"):
    """(model, optimizers, accum) of the run on fake tensors, rank 0 of world_size, GPU paths."""
    accum = tg.grad_accum_steps(hp, world_size)
    model, backend = planned_model(hp, True, accum, attention=LedgerAttention(attention))
    for t in [*model.parameters(), *model.buffers()]:
        ledger.track(t)
    return model, tg.make_optimizers(model, hp, backend), accum


def trace_piece(hp, model, fake, ledger, tokens, plan):
    """Forward (phase 'forward') and backward ('backward') of one piece of `tokens` positions at the StepPlan."""
    windows = plan.windows
    model.follow_window(windows)
    batch = tg.Batch(*(None if t is None else fake.from_tensor(t) for t in plan_batch(hp, tokens)))
    mtp = None if plan.mtp_weights is None else fake.from_tensor(plan.mtp_weights)
    model.train()
    with ledger:
        ledger.phase = "forward"
        for t in batch:
            if t is not None:
                ledger.track(t)
        loss = model(batch.inputs, batch.targets, batch.cu_seqlens, windows, batch.bigram_ids, mtp)
        ledger.phase = "backward"
        loss.backward()
        del loss
    ledger.phase = "optimizer"


def trace_optimizer_step(model, optimizers, plan, ledger, traced=True, draws=0):
    """One optimizer step (phase 'optimizer'), every parameter with a gradient as after a backward (the
    caller unties the embedding at its stage). A sparse bigram exchange sends the rows `draws`
    bigram ids touch (touch_bigram_rows)."""
    matrix_opt, adam = optimizers
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if adam.sparse is not None:
        touch_bigram_rows(adam, draws)
    with ledger if traced else contextlib.nullcontext():
        ledger.phase = "optimizer"
        tg.step_optimizers(plan._replace(unties_after=False), matrix_opt, adam)


def touch_bigram_rows(adam, draws):
    """Note in DistAdam's sparse exchange the rows `draws` bigram ids touch, counted as the
    reference's are (reference_step.SPARSE_ROWS: uniformly spread hashes, an upper bound), spread
    evenly over the table; every rank sends this one as many as it sends each (no counts travel on
    fake tensors)."""
    rows = adam.sparse.table.shape[0]
    touched = round(reference_step.SPARSE_ROWS(draws, rows))
    adam.note_rows(np.unique(np.linspace(0, rows - 1, touched).astype(np.int64)))
    adam.sparse.exchange_counts = lambda sent: sent


@dataclasses.dataclass
class StageCost:
    """Seconds per class of one step (roofline, launch floor, collective latency), the traced ops' totals per
    class, the kernels and collectives per step."""
    stage: int
    steps: int
    tokens: int
    flops: dict
    bytes: dict
    seconds: dict  # class -> seconds (collectives: NCCL latency + NVLink time)
    compute: float
    memory: float
    launch: float  # what the launch floor adds to kernels shorter than it
    comm: float
    optimizer_compute: float
    kernels: float
    collectives: float
    latency: float  # the collectives' NCCL latency, within comm
    top: collections.Counter  # (phase, class, op, output) -> seconds per step
    ops: list = dataclasses.field(repr=False)  # [(Op, times per step)]
    pricing: str = "ideal fusion"  # how the forward's and backward's pointwise work is priced

    @property
    def exposed_comm(self):
        return max(0.0, self.comm - self.optimizer_compute)

    @property
    def step_seconds(self):
        return self.compute + self.memory + self.launch + self.exposed_comm


def nccl_latency(name, world_size, peaks):
    """NCCL's latency of a collective over a ring of world_size ranks (GPU_PEAKS' nccl_base and nccl_hop)."""
    if world_size < 2:
        return 0.0
    steps = 2 * (world_size - 1) if "allreduce" in name or "all_reduce" in name else world_size - 1
    return peaks["nccl_base"] + steps * peaks["nccl_hop"]


def kernels_of(ledger, ops):
    """The kernels `ops` (a slice of ledger.ops) run under ideal fusion: lists of ops, fusable ops joined to
    those that made or read a storage fusion keeps in registers; collectives and ops that move no bytes and do
    no FLOPs (allocations) run none."""
    index = {id(op): i for i, op in enumerate(ops)}
    position = {i: index.get(id(op)) for i, op in enumerate(ledger.ops) if id(op) in index}
    parent = list(range(len(ops)))

    def root(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, op in enumerate(ops):
        if not op.fusable:
            continue
        for s, _ in op.reads:
            made_by = position.get(ledger.produced.get(s))
            if made_by is not None and (ledger.fused_away(s) or ledger.read_in_registers(s, op)):
                parent[root(i)] = root(made_by)
    groups = collections.defaultdict(list)
    for i, op in enumerate(ops):
        if op.kind != "collectives":
            groups[root(i)].append(op)
    return [group for group in groups.values()
            if any(op.flops or sum(ledger.op_bytes(op)) for op in group)]


def gemm_tiles(shape):
    """GEMM_TILE output tiles of a (batch..., M, N) product, the tile's long side along the longer
    of M, N."""
    *batch, m, n = shape
    short, long = GEMM_TILE
    if m > n:
        short, long = long, short
    return math.prod(batch) * -(-m // short) * -(-n // long)


def wave_factor(tiles, sms):
    """Compute time of `tiles` tiles over `sms` SMs against an even spread: the last wave runs part
    full."""
    return math.ceil(tiles / sms) * sms / tiles if tiles else 1.0


def second_pass_bytes(ledger, kernel):
    """Bytes a kernel reads again because a looped reduction's result is spread back over its rows
    (Inductor's reduction loop, then the loop that writes the rows: an lse pass, then a gradient
    pass): what the reduction's inputs read from memory, once more. None when its reductions' rows
    stay in registers or only per-row results are written."""
    looped = {op.writes[0][0]: op for op in kernel
              if op.row > PERSISTENT_REDUCTION_LIMIT and op.writes}
    spread = [(op, looped[s]) for op in kernel for s, _ in op.reads
              if s in looped and op.numel > looped[s].numel]
    if not spread:
        return 0
    reader, reduction = min(spread, key=lambda pair: pair[0].numel)
    if not any(op.numel >= reader.numel and any(not ledger.fused_away(s) for s, *_ in op.writes)
               for op in kernel):
        return 0
    return upstream_read_bytes(ledger, reduction, {id(op) for op in kernel})


def upstream_read_bytes(ledger, op, kernel_ops):
    """Bytes from memory that `op` and the ops of its kernel feeding it (through registers) read."""
    total, seen, todo = 0, set(), [op]
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        for s, size in current.reads:
            made_by = ledger.produced.get(s)
            maker = None if made_by is None else ledger.ops[made_by]
            in_kernel = maker is not None and id(maker) in kernel_ops
            if in_kernel and (ledger.fused_away(s) or ledger.read_in_registers(s, current)):
                todo.append(maker)
            else:
                total += size
    return total


def kernel_extra_seconds(ledger, kernel, peaks, roofline):
    """{'memory': s, 'compute': s} a kernel costs beyond its ops' rooflines: a second pass over its
    inputs (second_pass_bytes), and its special functions where they outlast the rest (at full
    occupancy they overlap the memory traffic; a kernel of B blocks per SM whose blocks load,
    compute and store in turn overlaps them only across its blocks: max(memory, sfu,
    (memory + sfu) / B))."""
    extra = {}
    memory = second_pass_bytes(ledger, kernel) / peaks["hbm"]
    if memory:
        extra["memory"] = memory
    busy = roofline + memory
    sfu = sum(op.sfu for op in kernel) / peaks["sfu"]
    blocks = max((op.blocks_per_sm for op in kernel), default=0)
    bound = max(busy, sfu, (busy + sfu) / blocks) if blocks else max(busy, sfu)
    if bound > busy:
        extra["compute"] = bound - busy
    return extra


def cost_of(ledger, ops, peaks, weight=1.0, into=None, real=None):
    """Accumulate ops' FLOPs, bytes and seconds (times `weight`) into a dict of totals: each op its roofline
    time, each kernel (kernels_of) at least the launch floor, each collective NCCL's latency +
    NVLink time. With `real` ([(name, bytes, calls)]: Inductor's kernels of these ops' forward and
    backward), those do the forward's and backward's pointwise/reduction work instead of ideal
    fusion's: their bytes at HBM bandwidth, each call at least the launch floor; only the ideal
    kernels' special functions stay."""
    totals = into or dict(flops=collections.Counter(), bytes=collections.Counter(), seconds=collections.Counter(),
                          compute=0.0, memory=0.0, launch=0.0, comm=0.0, optimizer_compute=0.0, kernels=0.0,
                          collectives=0.0, latency=0.0, top=collections.Counter(), ops=[])
    op_seconds = {}
    for op in ops:
        totals["ops"].append((op, weight))
        read, written = ledger.op_bytes(op)
        totals["flops"][op.kind] += weight * op.flops
        if real is not None and compiled_work(op):  # priced by the real kernels below
            op_seconds[id(op)] = max(op.flops / peaks["bf16"], (read + written) / peaks["hbm"])
            continue
        totals["bytes"][op.kind] += weight * (read + written)
        if op.kind == "collectives":
            latency = nccl_latency(op.name, ledger.world_size, peaks)
            seconds = latency + op.sent / peaks["nvlink"]
            totals["comm"] += weight * seconds
            totals["latency"] += weight * latency
            totals["collectives"] += weight
        else:
            rate = peaks[op.kind.split()[1]] if op.kind.startswith("matmul") else peaks["bf16"]
            flop_s = op.flops / (rate * op.efficiency) * wave_factor(op.tiles, peaks["sms"])
            byte_s = (read + written) / peaks["hbm"]
            seconds = max(flop_s, byte_s)
            totals["compute" if flop_s >= byte_s else "memory"] += weight * seconds
            if op.phase == "optimizer":
                totals["optimizer_compute"] += weight * seconds
        op_seconds[id(op)] = seconds
        totals["seconds"][op.kind] += weight * seconds
        totals["top"][op.phase, op.kind, op.name, op.shape] += weight * seconds
    for kernel in kernels_of(ledger, ops):
        first = max(kernel, key=lambda op: op_seconds[id(op)])
        roofline = sum(op_seconds[id(op)] for op in kernel)
        extra = kernel_extra_seconds(ledger, kernel, peaks, roofline)
        if real is not None and all(compiled_work(op) for op in kernel):
            extra.pop("memory", None)  # a second pass is in the real kernels' bytes
            add_seconds(totals, weight, first, extra)
            continue
        totals["kernels"] += weight
        for part, seconds in extra.items():
            totals[part] += weight * seconds
            if part == "memory":
                totals["bytes"][first.kind] += weight * seconds * peaks["hbm"]
            totals["seconds"][first.kind] += weight * seconds
            totals["top"][first.phase, first.kind, first.name, first.shape] += weight * seconds
            if first.phase == "optimizer":
                totals["optimizer_compute"] += weight * seconds
            roofline += seconds
        short = peaks["launch"] - roofline
        if short > 0:
            first = max(kernel, key=lambda op: op_seconds[id(op)])
            totals["launch"] += weight * short
            totals["seconds"][first.kind] += weight * short
            totals["top"][first.phase, first.kind, first.name, first.shape] += weight * short
            if first.phase == "optimizer":
                totals["optimizer_compute"] += weight * short
    for name, size, calls in real or ():
        memory = size / peaks["hbm"]
        short = max(0.0, peaks["launch"] - memory)
        times = weight * calls
        totals["kernels"] += times
        totals["memory"] += times * memory
        totals["launch"] += times * short
        totals["bytes"][COMPILED] += times * size
        totals["seconds"][COMPILED] += times * (memory + short)
        item = "fwd+bwd", COMPILED, "kernel", name[:KERNEL_NAME_CHARS]
        totals["top"][item] += times * (memory + short)
    return totals


KERNEL_NAME_CHARS = 60  # an item per kernel name's start: the loss's chunk kernels are one item


def compiled_work(op):
    """Work of the forward and backward that Inductor's Triton kernels do (the real kernels')."""
    return op.kind == COMPILED and op.phase in ("forward", "backward") and not op.own_kernel


def add_seconds(totals, weight, op, extra):
    """A kernel's time beyond its ops' rooflines (kernel_extra_seconds' parts), put on `op`."""
    for part, seconds in extra.items():
        totals[part] += weight * seconds
        totals["seconds"][op.kind] += weight * seconds
        totals["top"][op.phase, op.kind, op.name, op.shape] += weight * seconds


def stage_costs(hp, world_size, peaks, stages=range(4), attention="flex_triton", kernels=None):
    """StageCost of each of `stages` (0-2, 3: the extension) that has steps, and the Ledger. With
    `kernels` (RealKernels), a stage whose pieces have the inventory's tokens is priced by them."""
    fake, ledger, schedule = FakeTensorMode(), Ledger(world_size), tg.Schedule(hp)
    plans = [schedule.at(step) for step in range(schedule.total_steps)]
    costs = []
    with fake_world(world_size), fake:
        model, optimizers, accum = trace_setup(hp, world_size, ledger, attention)
        trace_piece(hp, model, fake, ledger, PLAN_PIECE_STEP, plans[1])  # state made by an untraced first step
        trace_optimizer_step(model, optimizers, plans[1], ledger, traced=False)
        for stage in stages:
            first, following = schedule.stages[stage].first_step, schedule.stages[stage].end_step
            if following <= first:
                continue
            tokens = tg.tokens_per_rank(plans[first].batch_tokens, world_size, accum)
            length = tg.padded_piece_length(tokens, tg.piece_cap(hp), plans[first].max_seq_len)
            # pieces of whole documents: at least ceil(tokens / N) of them (how many more depends on the data)
            count = 1 if length == tokens else -(-tokens // hp.micro_batch_tokens)
            pricing = piece_pricing(kernels, length)
            if optimizers[1].tied and schedule.untie_step is not None and schedule.untie_step < following:
                optimizers[1].untie()
            # an even step (DistAdam's gradients start) and an odd one (they accumulate, DistAdam steps)
            even = first + first % 2
            odd_steps = sum(plan.adam_step for plan in plans[first:following])
            totals = None
            for step, share in ((even, following - first - odd_steps), (even + 1, odd_steps)):
                start = len(ledger.ops)
                trace_piece(hp, model, fake, ledger, length, schedule.at(step))
                piece = ledger.ops[start:]
                real = kernels.of_piece(ledger, piece) if pricing.startswith("Inductor") else None
                weight = accum * count * share / (following - first)
                totals = cost_of(ledger, piece, peaks, weight, totals, real)
                start = len(ledger.ops)
                # the bigram rows of one rank's tokens since the last Adam step (two steps)
                trace_optimizer_step(model, optimizers, schedule.at(step), ledger,
                                     draws=2 * tokens * accum)
                totals = cost_of(ledger, ledger.ops[start:], peaks, share / (following - first), totals)
            costs.append(StageCost(stage, following - first, tokens * world_size * accum, **totals,
                                   pricing=pricing))
    return costs, ledger


def piece_pricing(kernels, length):
    """How a stage whose pieces have `length` tokens is priced: by the inventory's kernels where it
    has this size, else by ideal fusion (and why)."""
    if kernels is None:
        return "ideal fusion"
    if kernels.tokens != length:
        return (f"ideal fusion: the inventory's training step has {kernels.tokens:,} tokens, these "
                f"pieces {length:,}")
    return "Inductor's kernels"


@contextlib.contextmanager
def fake_group(world_size):
    """torch's fake process group of world_size ranks, this process rank 0, at any world size (the reference
    asks the process group for its size even on one GPU)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend
    torch.distributed.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def reference_stage_costs(log_path, world_size, peaks, stages=range(4), tokens_per_rank=None,
                          micro_steps=None, sizes=None, kernels=None):
    """StageCost of each of `stages` of the reference's own step (tools/reference_step.py), traced as ours is:
    rank 0 of world_size on fake tensors, each stage's even step (no Adam) and odd step (Adam, its gradients
    summed over both steps) weighed by their counts. tokens_per_rank replaces the stages' batches
    (tests), micro_steps the micro-steps per step and sizes the model's sizes (Reference's;
    tools/gpu_race.py). With `kernels` (RealKernels of the compile check's --race inventory), a
    stage of its tokens per micro-step has its forward and backward priced by them, as ours."""
    fake, ledger = FakeTensorMode(), Ledger(world_size)
    costs = []
    with fake_group(world_size), fake, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecation notices of the reference's collectives
        reference = reference_step.Reference(log_path, world_size, attention_op, micro_steps,
                                             sizes)
        model, manager = reference.build()
        for t in [*model.parameters(), *model.buffers()]:
            ledger.track(t)
        for t in reference.host_tensors(manager):
            ledger.host[id(t.untyped_storage())] = t.untyped_storage()
        schedule, accum = reference.module.training_schedule, reference.module.grad_accum_steps
        for stage in stages:
            first, following = schedule.boundaries[stage]
            tokens = tokens_per_rank or schedule.stages[stage].batch_size // (world_size * accum)
            if schedule.split_step < following and not manager.optimizer.split_embed:
                manager.optimizer.copy_lm_state_to_embed()  # the untie, once, untraced
            even, odd = reference.traced_steps(manager, first, following)
            odd_steps = sum(step % 2 for step in range(first, following))
            pricing = piece_pricing(kernels, tokens)
            totals = None
            for step, share in ((even, following - first - odd_steps), (odd, odd_steps)):
                start = len(ledger.ops)
                try:
                    reference.step(model, manager, step, tokens, ledger)
                except NameError as e:
                    raise reference_step.LogError(f"the reference calls {e.name}, which has no stand-in") from e
                piece = ledger.ops[start:]
                real = kernels.of_piece(ledger, piece) if pricing.startswith("Inductor") else None
                if real is not None:  # one run of the forward and backward per micro-step
                    real = [(name, size, calls * accum) for name, size, calls in real]
                totals = cost_of(ledger, piece, peaks, share / (following - first), totals, real)
            costs.append(StageCost(stage, following - first, tokens * world_size * accum, **totals,
                                   pricing=pricing))
    return costs, ledger


def header(world_size, peaks):
    return [f"step-cost ledger: rank 0 of {world_size}, GPU path (FP8 head and MLP, fused attention), "
            f"{peaks['name']} peaks (fp8 {peaks['fp8'] / 1e12:g}, bf16 {peaks['bf16'] / 1e12:g}, "
            f"tf32 {peaks['tf32'] / 1e12:g}, fp32 {peaks['fp32'] / 1e12:g} TFLOP/s; HBM {peaks['hbm'] / 1e12:g} TB/s; "
            f"NVLink {peaks['nvlink'] / 1e9:g} GB/s per direction; {peaks['memory_gb']} GB)",
            f"a model: ideal fusion (pointwise chains stay in registers), each kernel at least "
            f"{peaks['launch'] * 1e6:g} us, each collective NCCL's latency ({peaks['nccl_base'] * 1e6:g} us + "
            f"{peaks['nccl_hop'] * 1e6:g} us per ring step) + its bytes over NVLink, collectives hidden behind the "
            "optimizer step's compute",
            "what rooflines miss: GEMMs in waves of 128 x 256 tiles over "
            f"{peaks['sms']} SMs, a looped reduction spread back over its rows reads them twice, special "
            f"functions at {peaks['sfu'] / 1e12:.2f} T/s; attention at its backend's share of the bf16 peak, "
            "forward / backward: " + ", ".join(
                f"{name} {e['forward']:.1%} / {e['backward']:.1%}" for name, e in ATTENTION_BACKENDS.items())]


def step_line(c):
    return (f"{c.step_seconds * 1e3:.1f} (compute {c.compute * 1e3:.1f}, memory {c.memory * 1e3:.1f}, launch floor "
            f"{c.launch * 1e3:.1f}, exposed comm {c.exposed_comm * 1e3:.1f}; {c.kernels:,.0f} kernels, "
            f"{c.collectives:,.0f} collectives; {c.pricing})")


def train_seconds(costs):
    return sum(c.steps * c.step_seconds for c in costs)


# --attention's backends for ours, as the first line of ours says them
ATTENTION_NAMES = {"flex_triton": "FlexAttention's Triton backend (what runs)",
                   "flex_flash": "FlexAttention's FLASH backend (--flex_backend flash)",
                   "fa3": "FA3's share, a what-if (no backend here has it)"}


def pricing_line(kernels, attention="flex_triton"):
    """Which kernels price ours: the inventory's, or ideal fusion when none is given; and its
    attention."""
    priced = f"attention at {ATTENTION_NAMES[attention]}"
    if kernels is None:
        return f"ours: ideal fusion (no --kernels inventory); {priced}"
    return (f"ours: forward and backward by {kernels.describe()}; the optimizer step and stages of "
            f"other sizes by ideal fusion; {priced}")


def reference_pricing_line(kernels):
    """Which kernels price the reference's forward and backward: ideal fusion, or the race's."""
    if kernels is None:
        return "reference: ideal fusion (no --reference_kernels inventory)"
    return (f"reference: forward and backward by {kernels.describe()} (the race's #89 step, "
            "FlexAttention for its FlashAttention 3: the block mask's kernels are counted, which "
            "FA3 does not run); the optimizer step and stages of other sizes by ideal fusion")


def report(hp, world_size, gpu, top=12, attention="flex_triton", kernels=None):
    peaks = GPU_PEAKS[gpu]
    costs, _ = stage_costs(hp, world_size, peaks, attention=attention, kernels=kernels)
    lines = header(world_size, peaks) + [pricing_line(kernels, attention)]
    for c in costs:
        matmul = sum(c.flops[k] for k in CLASSES if k.startswith("matmul"))
        lines.append(f"stage {c.stage + 1} ({c.steps} steps, {c.tokens:,} tokens/step):")
        lines.append(f"  {'class':<22}{'GFLOP':>12}{'GB':>10}{'ms':>9}")
        for k in CLASSES:
            lines.append(f"  {k:<22}{c.flops[k] / 1e9:12,.1f}{c.bytes[k] / 1e9:10,.2f}{c.seconds[k] * 1e3:9.2f}")
        share = c.flops["matmul fp32"] / matmul if matmul else 0.0
        lines.append(f"  fp32 matmul share of matmul FLOPs: {share:.1%}")
        if top and c.stage == 2:
            lines.append(f"  the {top} largest items (summed over ops of one kind and output shape):")
            for (phase, kind, name, shape), seconds in c.top.most_common(top):
                lines.append(f"    {seconds * 1e3:7.2f} ms  {phase:<9} {kind:<20} {name} -> {shape}")
    for c in costs:
        lines.append(f"stage {c.stage + 1}: predicted ms/step {step_line(c)}")
    steps = sum(c.steps for c in costs)
    lines.append(f"predicted train time ({steps:,} steps): {train_seconds(costs):.1f} s")
    return lines


def canonical_shape(shape):
    """'bfloat16[1, 3072, 768]' -> 'bfloat16[3072, 768]': leading 1s dropped, so that a bmm of one matrix and
    an mm, or a (1, T, D) and a (T, D) pointwise result, are one item."""
    dtype, _, dims = shape.partition("[")
    dims = dims.rstrip("]").split(", ") if dims.rstrip("]") else []
    while len(dims) > 1 and dims[0] == "1":
        dims = dims[1:]
    return f"{dtype}[{', '.join(dims)}]" if shape else shape


def items(cost):
    """{(phase, class, output): (ms/step, op names)} of a StageCost's items, outputs canonical."""
    merged = {}
    for (phase, kind, name, shape), seconds in cost.top.items():
        key = phase, kind, canonical_shape(shape)
        total, names = merged.get(key, (0.0, ()))
        merged[key] = total + seconds, tuple(sorted(set(names) | {name}))
    return merged


def differences(ours, reference, top):
    """The `top` items (phase, class, output) whose seconds/step differ most between the two steps, as
    (ours - reference, key, (ours seconds, names), (reference seconds, names))."""
    mine, theirs = items(ours), items(reference)
    rows = [(mine.get(k, (0.0, ()))[0] - theirs.get(k, (0.0, ()))[0], k, mine.get(k, (0.0, ())),
             theirs.get(k, (0.0, ()))) for k in set(mine) | set(theirs)]
    return sorted(rows, key=lambda row: -abs(row[0]))[:top]


def side_by_side(hp, world_size, gpu, log_path, top=12, attention="flex_triton", kernels=None,
                 reference_kernels=None):
    peaks = GPU_PEAKS[gpu]
    ours, _ = stage_costs(hp, world_size, peaks, attention=attention, kernels=kernels)
    reference, _ = reference_stage_costs(log_path, world_size, peaks, kernels=reference_kernels)
    lines = comparison(ours, reference, world_size, peaks, os.path.basename(log_path), top)
    return lines[:3] + [pricing_line(kernels, attention)] + lines[3:4] \
        + [reference_pricing_line(reference_kernels)] + lines[4:]


def comparison(ours, reference, world_size, peaks, log_name, top=12):
    """The side-by-side report of two lists of StageCost, stage by stage."""
    lines = header(world_size, peaks)
    lines.append(f"reference: {log_name}'s train_gpt.py and triton_kernels.py, traced the same way")
    for o, r in zip(ours, reference):
        lines.append(f"stage {o.stage + 1} (ours {o.steps} steps of {o.tokens:,} tokens, reference {r.steps} steps of "
                     f"{r.tokens:,} tokens):")
        lines.append(f"  {'class':<22}{'GFLOP ours':>12}{'GFLOP reference':>17}{'GB ours':>10}{'GB reference':>14}"
                     f"{'ms ours':>10}{'ms reference':>14}")
        for k in CLASSES:
            lines.append(f"  {k:<22}{o.flops[k] / 1e9:12,.1f}{r.flops[k] / 1e9:17,.1f}{o.bytes[k] / 1e9:10,.2f}"
                         f"{r.bytes[k] / 1e9:14,.2f}{o.seconds[k] * 1e3:10.2f}{r.seconds[k] * 1e3:14.2f}")
        lines.append(f"  ours:      {step_line(o)}")
        lines.append(f"  reference: {step_line(r)}")
        lines.append(f"stage {o.stage + 1}: predicted ms/step ours {o.step_seconds * 1e3:.1f}, reference "
                     f"{r.step_seconds * 1e3:.1f}, ratio {o.step_seconds / r.step_seconds:.2f}")
        if top and o.stage == 2:
            lines.append(f"stage 3: the {top} items (phase, class, largest output; the ops of each side) whose "
                         "ms/step differ most, ours - reference:")
            for difference, (phase, kind, shape), (mine, my_ops), (theirs, their_ops) in differences(o, r, top):
                lines.append(f"  {difference * 1e3:+7.2f} ms (ours {mine * 1e3:6.2f}, reference {theirs * 1e3:6.2f})  "
                             f"{phase:<9} {kind:<20} {shape}  ours: {' '.join(my_ops) or '-'}; reference: "
                             f"{' '.join(their_ops) or '-'}")
    ours_s, reference_s = train_seconds(ours), train_seconds(reference)
    ratio = ours_s / reference_s
    lines.append(f"predicted train time: ours {ours_s:.1f} s, reference {reference_s:.1f} s, ratio {ratio:.3f}; at the "
                 f"reference's measured {REFERENCE_TRAIN_SECONDS} s: {ratio:.3f} × {REFERENCE_TRAIN_SECONDS} = "
                 f"{ratio * REFERENCE_TRAIN_SECONDS:.1f} s")
    return lines


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block), as train_gpt.py's."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def non_negative(text):
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def default_world_size(parser):
    """$WORLD_SIZE when set (as torchrun sets it), else 8."""
    text = os.environ.get("WORLD_SIZE")
    if text is None:
        return 8
    if not text.isdigit() or int(text) < 1:
        parser.error(f"WORLD_SIZE={text!r} is not a positive integer: unset it or pass --world_size N")
    return int(text)


def parse(argv):
    parser = ArgumentParser(prog="step_cost.py", description=__doc__.split("\n")[0],
                            epilog="Other flags are train_gpt.py's (the run whose step is traced).")
    parser.add_argument("--world_size", type=int, default=None,
                        help="processes of the run (default $WORLD_SIZE, else 8)")
    parser.add_argument("--gpu", choices=sorted(GPU_PEAKS), default="h100", help="whose peaks (default h100)")
    parser.add_argument("--top", type=non_negative, default=12,
                        help="list this many of stage 3's largest items or differences (default 12)")
    parser.add_argument("--attention", choices=list(ATTENTION_NAMES), default="flex_triton",
                        help="the attention kernels ours is priced at: FlexAttention's backends (default "
                             "flex_triton, what runs), or fa3, a what-if: #89's FlashAttention-3 share, "
                             "which no backend here has")
    parser.add_argument("--reference", metavar="LOG", default=None,
                        help="a modded-nanogpt record log: trace its own step too and print both side by side")
    parser.add_argument("--kernels", metavar="FILE", default=None,
                        help="the CUDA compile check's kernel inventory "
                             "(tools/cuda_compile_check.py --inventory FILE): price ours by "
                             "Inductor's real kernels, not ideal fusion")
    parser.add_argument("--reference_kernels", metavar="FILE", default=None,
                        help="with --reference: the compile check's inventory of #89's race "
                             "(tools/cuda_compile_check.py --race LOG --inventory FILE): price the "
                             "reference by Inductor's real kernels too")
    args, rest = parser.parse_known_args(argv)
    if args.world_size is None:
        args.world_size = default_world_size(parser)
    if args.world_size < 1:
        parser.error(f"--world_size must be at least 1, got {args.world_size}")
    if args.reference is not None:
        try:
            reference_step.read_log(args.reference)
        except reference_step.LogError as e:
            parser.error(f"--reference {args.reference}: {e}")
        if 8 % args.world_size:
            parser.error(f"--reference {args.reference}: the record's step runs on world sizes "
                         f"dividing 8 (its grad_accum_steps = 8 // world_size), not --world_size "
                         f"{args.world_size}")
    if args.kernels is not None:
        try:
            args.kernels = read_inventory(args.kernels)
        except InventoryError as e:
            parser.error(f"--kernels {args.kernels}: {e}; {MAKE_INVENTORY}")
    if args.reference_kernels is not None:
        if args.reference is None:
            parser.error(f"--reference_kernels {args.reference_kernels}: it prices the reference; "
                         "give --reference LOG too")
        try:
            args.reference_kernels = read_inventory(args.reference_kernels, RACE_GRAPH)
        except InventoryError as e:
            parser.error(f"--reference_kernels {args.reference_kernels}: {e}; "
                         f"{MAKE_RACE_INVENTORY}")
    trainer = tg.parser_for(rest, prog=parser.prog)
    try:
        hp = tg.hyperparameters_from(trainer.parse_args(rest))
        tg.check_batch_splits(hp, args.world_size, tg.grad_accum_steps(hp, args.world_size))
    except tg.ConfigError as e:
        parser.error(str(e))
    if hp.ngram_prior:
        parser.error(f"--ngram_prior {hp.ngram_prior:g} (--preset cpu sets it): the prior exists on the CPU path "
                     "only and the ledger traces the GPU path (the trainer refuses it on a GPU): add --ngram_prior 0")
    return args, hp


def main(argv=None):
    args, hp = parse(sys.argv[1:] if argv is None else argv)
    try:
        if args.reference is None:
            lines = report(hp, args.world_size, args.gpu, args.top, args.attention, args.kernels)
        else:
            lines = side_by_side(hp, args.world_size, args.gpu, args.reference, args.top,
                                 args.attention, args.kernels, args.reference_kernels)
    except reference_step.LogError as e:
        print(f"step_cost.py: error: --reference {args.reference}: {e}", file=sys.stderr)
        sys.exit(2)
    for line in lines:
        print(line, flush=True)


if __name__ == "__main__":
    main()
