"""Step-cost ledger: where the time of one training step goes on a GPU, predicted without one.

    python tools/step_cost.py [train_gpt flags] [--world_size N] [--gpu h100|h200]

For each stage of the run it traces one training step of rank 0 of N ranks (the forward and backward of
every micro-step piece, then the optimizer step) on fake tensors, the way train_gpt.py's memory plan does:
shapes and dtypes only, no GPU and no data. Every op of the GPU path is counted: the FP8 head and its loss
(the FP8 custom op's eager body, casts and transposes included), the FP8 MLP, a fused-attention stand-in with
FlexAttention's block mask and footprint, the optimizers with their collectives (a fake process group).

FLOPs come from torch.utils.flop_counter (FlopCounterMode's formulas, one for the attention stand-in per
visible 128 x 128 block); bytes from the storages the ops read and write (the memory plan's live-storage
tracer). Ideal fusion: a tensor made by a pointwise/reduction op, read only by such ops and dead within the
same phase (forward, backward, optimizer) never reaches memory. Each op then costs its roofline time,
max(FLOPs / peak of its class, bytes / HBM bandwidth); collectives cost their ring traffic over NVLink and
overlap the optimizer step's compute (this code starts them after the backward). The prediction is a
bound: fusion and overlap are ideal, no launch overheads. The reference's measured ms/step stands beside it.
"""
import argparse
import collections
import contextlib
import dataclasses
import functools
import os
import sys
import weakref

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_gpt as tg  # noqa: E402
from plan_memory import PLAN_PIECE_STEP, LiveMemory, fake_world, plan_batch, planned_model  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.utils.flop_counter import (FlopCounterMode, register_flop_formula, sdpa_backward_flop_count,  # noqa: E402
                                      sdpa_flop_count)

# Peak rates, dense (no sparsity); sources: NVIDIA H100 Tensor Core GPU datasheet (SXM5 column) and NVIDIA
# H200 Tensor Core GPU datasheet (SXM column); NVLink 4: 900 GB/s per GPU in both directions together.
GPU_PEAKS = {
    "h100": dict(name="H100 SXM", fp8=1979e12, bf16=989e12, tf32=494.5e12, fp32=67e12, hbm=3.35e12, nvlink=450e9,
                 memory_gb=80),
    "h200": dict(name="H200 SXM", fp8=1979e12, bf16=989e12, tf32=494.5e12, fp32=67e12, hbm=4.8e12, nvlink=450e9,
                 memory_gb=141),
}
# modded-nanogpt record #89 (2026-07-17, FP8 down projection), its log on 8 x H100: ms/step per stage
REFERENCE_MS_PER_STAGE = (31.4, 56.8, 82.7)
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
ALLOCATION_ONLY = {"new_empty", "new_empty_strided", "empty_like", "empty", "empty_strided"}
METADATA = {"size", "sym_size", "stride", "sym_stride", "numel", "sym_numel", "dim", "is_contiguous",
            "storage_offset", "sym_storage_offset", "is_strides_like_format", "is_non_overlapping_and_dense",
            "_local_scalar_dense", "detach", "alias", "lift_fresh"}


# ---- the fused attention stand-in: FlexAttention's visible blocks, FusedAttentionFootprint's bytes

@torch.library.custom_op("step_cost::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, float32 log-sum-exp per query and head) of a fused kernel over `blocks` visible tiles."""
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)


@attention_op.register_fake
def _(q, k, v, blocks):
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.custom_op("step_cost::attention_backward", mutates_args=())
def attention_backward_op(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          lse: torch.Tensor, blocks: int
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(lse)


@attention_backward_op.register_fake
def _(grad, q, k, v, out, lse, blocks):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(lse)


def _tile(shape):
    """(T, H, D) -> the (1, H, tile, D) shape of one visible block's query or key tile."""
    return (1, shape[1], tg.ATTN_BLOCK, shape[2])


@register_flop_formula(torch.ops.step_cost.attention)
def _attention_flop(q, k, v, blocks, out_shape=None, **kwargs):
    return blocks * sdpa_flop_count(_tile(q), _tile(k), _tile(v))


@register_flop_formula(torch.ops.step_cost.attention_backward)
def _attention_backward_flop(grad, q, k, v, out, lse, blocks, out_shape=None, **kwargs):
    return blocks * sdpa_backward_flop_count(_tile(grad), _tile(q), _tile(k), _tile(v))


def _attention_setup(ctx, inputs, output):
    q, k, v, blocks = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.blocks = blocks


def _attention_autograd(ctx, grad, _):
    grad_q, grad_k, grad_v, _term = attention_backward_op(grad, *ctx.saved_tensors, ctx.blocks)
    return grad_q, grad_k, grad_v, None


attention_op.register_autograd(_attention_autograd, setup_context=_attention_setup)


@functools.lru_cache(maxsize=None)
def visible_blocks(seq_len, window_tokens):
    """Tiles FlexAttention computes under the GPU path's own block mask (sliding_document_mask) for one
    document of seq_len positions: partial and full blocks."""
    with torch.utils._python_dispatch._disable_current_modes():
        mask = tg.sliding_document_mask(torch.zeros(seq_len, dtype=torch.int64), int(window_tokens))
        return int(mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum())


class LedgerAttention:
    """FlexWindowAttention's cost for the ledger: its block mask's visible tiles (one document per piece, as
    the memory plan's batch; real batches have more documents, so fewer tiles), a fused kernel's memory."""

    @staticmethod
    def mask(docs, window_tokens):
        return visible_blocks(docs.numel(), window_tokens)

    def __call__(self, q, k, v, blocks, scale):
        return attention_op(q, k, v, blocks)[0]


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


def _view_bytes(t):
    return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())


class Ledger(LiveMemory):
    """The memory plan's live-storage tracer, also recording each op (class, FLOPs by FlopCounterMode's
    formulas, storages read and written) and when each storage dies, for the fusion model."""

    def __init__(self, world_size):
        super().__init__()
        self.world_size, self.phase, self.ops = world_size, "forward", []
        self.flop_registry = FlopCounterMode(display=False).flop_registry
        self._keys, self._next_serial = {}, 0
        self.produced, self.consumers, self.died_in = {}, collections.defaultdict(list), {}

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
            with self:
                return tg.fp8_forward(*args[:4])
        if func is torch.ops.speedrun.mm_fp8_backward.default:
            with self:
                return tg.fp8_backward(*args)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if name in METADATA or func.namespace == "prim":
            return out
        tensors_in = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        tensors_out = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        in_storages = {id(t.untyped_storage()) for t in tensors_in}
        writes_input = any(r.alias_info is not None and r.alias_info.is_write for r in func._schema.returns)
        aliased = tensors_out and all(id(t.untyped_storage()) in in_storages for t in tensors_out)
        if aliased and not writes_input and func.namespace not in COLLECTIVE_NAMESPACES:
            return out  # a view (or a `to` that returned its input): no data moves
        kind = self._kind(func, name, tensors_in)
        reads, seen = [], set()
        for t in [] if name in SHAPE_ONLY else tensors_in:
            s = self.serial(t.untyped_storage())
            if s not in seen:
                seen.add(s)
                reads.append((s, _view_bytes(t)))
        writes = []
        for t in tensors_out:
            fresh = id(t.untyped_storage()) not in in_storages
            s = self.serial(t.untyped_storage())
            size = 0 if name in ALLOCATION_ONLY else t.untyped_storage().nbytes() if fresh else _view_bytes(t)
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
        op = Op(name, kind, self.phase, int(flops), reads, writes, shape=shape)
        if kind == "collectives":
            op.sent = self._sent_bytes(name, tensors_in)
        self.ops.append(op)
        return out

    @staticmethod
    def _kind(func, name, tensors):
        if func.namespace in COLLECTIVE_NAMESPACES:
            return "collectives"
        if func.namespace == "step_cost":
            return "attention"
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
        return 0.0

    def fused_away(self, serial):
        """A storage ideal fusion keeps in registers: made by a fusable op, read only by fusable ops, dead
        within the phase that made it."""
        op = self.produced.get(serial)
        if op is None or not self._fusable(self.ops[op]) or self.died_in.get(serial) != self.ops[op].phase:
            return False
        return all(self._fusable(self.ops[c]) for c in self.consumers[serial])

    def _fusable(self, op):
        return op.kind == "pointwise/reduction" and op.name not in UNFUSABLE

    def op_bytes(self, op):
        """(bytes read, bytes written) of one op under ideal fusion."""
        read = sum(b for s, b in op.reads if not self.fused_away(s))
        written = sum(b for s, b, *_ in op.writes if not self.fused_away(s))
        return read, written

    def kept_bytes(self, phase):
        """Bytes (in the allocator's blocks) of the storages `phase` made that outlive it: what a forward
        saves for the backward, as the memory plan counts it."""
        sizes = {s: size for op in self.ops if op.phase == phase for s, _, fresh, size in op.writes if fresh}
        blocks = self.block_bytes
        return sum(-(-b // blocks) * blocks for s, b in sizes.items() if self.died_in.get(s) != phase)


# ---- tracing one step of a stage

def trace_setup(hp, world_size, ledger):
    """(model, optimizers, accum) of the run on fake tensors, rank 0 of world_size, GPU paths."""
    accum = tg.grad_accum_steps(hp, world_size)
    model = planned_model(hp, True, accum, attention=LedgerAttention())
    for t in [*model.parameters(), *model.buffers()]:
        ledger.track(t)
    optimizers = tg.make_optimizers(model, hp)
    if isinstance(optimizers[0], tg.NorMuon):  # Triton cannot run on fake tensors
        optimizers[0].polar = dict(tg.GPU_POLAR_EXPRESS, use_triton=False)
    return model, optimizers, accum


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


def trace_optimizer_step(model, optimizers, plan, ledger, traced=True):
    """One optimizer step (phase 'optimizer'), every parameter with a gradient as after a backward (the
    caller unties the embedding at its stage)."""
    matrix_opt, adam = optimizers
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    with ledger if traced else contextlib.nullcontext():
        ledger.phase = "optimizer"
        tg.step_optimizers(plan._replace(unties_after=False), matrix_opt, adam)


@dataclasses.dataclass
class StageCost:
    """Roofline seconds per class and phase of one step, and the traced ops' totals per class."""
    stage: int
    steps: int
    tokens: int
    flops: dict
    bytes: dict
    seconds: dict  # class -> seconds (collectives: NVLink time)
    compute: float
    memory: float
    comm: float
    optimizer_compute: float
    top: collections.Counter  # (phase, class, op, output) -> seconds per step
    ops: list = dataclasses.field(repr=False)  # [(Op, times per step)]

    @property
    def exposed_comm(self):
        return max(0.0, self.comm - self.optimizer_compute)

    @property
    def step_seconds(self):
        return self.compute + self.memory + self.exposed_comm


def cost_of(ledger, ops, peaks, weight=1.0, into=None):
    """Accumulate ops' FLOPs, bytes and roofline seconds (times `weight`) into a dict of totals."""
    totals = into or dict(flops=collections.Counter(), bytes=collections.Counter(), seconds=collections.Counter(),
                          compute=0.0, memory=0.0, comm=0.0, optimizer_compute=0.0, top=collections.Counter(), ops=[])
    for op in ops:
        totals["ops"].append((op, weight))
        read, written = ledger.op_bytes(op)
        totals["flops"][op.kind] += weight * op.flops
        totals["bytes"][op.kind] += weight * (read + written)
        if op.kind == "collectives":
            seconds = op.sent / peaks["nvlink"]
            totals["comm"] += weight * seconds
        else:
            rate = peaks[op.kind.split()[1]] if op.kind.startswith("matmul") else peaks["bf16"]
            flop_s, byte_s = op.flops / rate, (read + written) / peaks["hbm"]
            seconds = max(flop_s, byte_s)
            totals["compute" if flop_s >= byte_s else "memory"] += weight * seconds
            if op.phase == "optimizer":
                totals["optimizer_compute"] += weight * seconds
        totals["seconds"][op.kind] += weight * seconds
        totals["top"][op.phase, op.kind, op.name, op.shape] += weight * seconds
    return totals


def stage_costs(hp, world_size, peaks, stages=range(4)):
    """StageCost of each of `stages` (0-2, 3: the extension) that has steps, and the Ledger."""
    fake, ledger, schedule = FakeTensorMode(), Ledger(world_size), tg.Schedule(hp)
    plans = [schedule.at(step) for step in range(schedule.total_steps)]
    costs = []
    with fake_world(world_size), fake:
        model, optimizers, accum = trace_setup(hp, world_size, ledger)
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
            start = len(ledger.ops)
            trace_piece(hp, model, fake, ledger, length, plans[first])
            totals = cost_of(ledger, ledger.ops[start:], peaks, accum * count, None)
            odd_steps = sum(plan.adam_step for plan in plans[first:following])
            if optimizers[1].tied and schedule.untie_step is not None and schedule.untie_step < following:
                optimizers[1].untie()
            for step, share in ((first | 1, odd_steps), ((first | 1) + 1, following - first - odd_steps)):
                start = len(ledger.ops)
                trace_optimizer_step(model, optimizers, schedule.at(step), ledger)
                totals = cost_of(ledger, ledger.ops[start:], peaks, share / (following - first), totals)
            costs.append(StageCost(stage, following - first, tokens * world_size * accum, **totals))
    return costs, ledger


def report(hp, world_size, gpu, top=12):
    peaks = GPU_PEAKS[gpu]
    costs, _ = stage_costs(hp, world_size, peaks)
    lines = [f"step-cost ledger: rank 0 of {world_size}, GPU path (FP8 head and MLP, fused attention), "
             f"{peaks['name']} peaks (fp8 {peaks['fp8'] / 1e12:g}, bf16 {peaks['bf16'] / 1e12:g}, "
             f"tf32 {peaks['tf32'] / 1e12:g}, fp32 {peaks['fp32'] / 1e12:g} TFLOP/s; HBM {peaks['hbm'] / 1e12:g} TB/s; "
             f"NVLink {peaks['nvlink'] / 1e9:g} GB/s per direction; {peaks['memory_gb']} GB)",
             "a bound: ideal fusion (pointwise chains stay in registers), ideal overlap of the collectives with the "
             "optimizer step, no launch overheads"]
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
    total = 0.0
    for c in costs:
        ms = c.step_seconds * 1e3
        ref = REFERENCE_MS_PER_STAGE[c.stage] if c.stage < len(REFERENCE_MS_PER_STAGE) else None
        vs = f"; reference measured {ref} ms/step, ratio measured/predicted {ref / ms:.2f}" if ref else ""
        lines.append(f"stage {c.stage + 1}: predicted ms/step {ms:.1f} (compute {c.compute * 1e3:.1f}, "
                     f"memory {c.memory * 1e3:.1f}, exposed comm {c.exposed_comm * 1e3:.1f}){vs}")
        total += c.steps * c.step_seconds
    steps = sum(c.steps for c in costs)
    lines.append(f"predicted train time ({steps:,} steps): {total:.1f} s")
    return lines


def parse(argv):
    parser = argparse.ArgumentParser(prog="step_cost.py", description=__doc__.split("\n")[0],
                                     epilog="Other flags are train_gpt.py's (the run whose step is traced).")
    parser.add_argument("--world_size", type=int, default=8, help="processes of the run (default 8)")
    parser.add_argument("--gpu", choices=sorted(GPU_PEAKS), default="h100", help="whose peaks (default h100)")
    parser.add_argument("--top", type=int, default=12, help="list this many of stage 3's largest items (default 12)")
    args, rest = parser.parse_known_args(argv)
    if args.world_size < 1:
        parser.error(f"--world_size must be at least 1, got {args.world_size}")
    try:
        hp = tg.parse_args(rest)
        tg.check_batch_splits(hp, args.world_size, tg.grad_accum_steps(hp, args.world_size))
    except tg.ConfigError as e:
        parser.error(str(e))
    return args, hp


def main(argv=None):
    args, hp = parse(sys.argv[1:] if argv is None else argv)
    for line in report(hp, args.world_size, args.gpu, args.top):
        print(line, flush=True)


if __name__ == "__main__":
    main()
