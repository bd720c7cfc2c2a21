"""The race: our record step against record #89's own, timed on one GPU in one process.

    python3 tools/gpu_race.py --out race                 # one CUDA GPU (docs/gpu-smoke.md's plan)
    python3 tools/gpu_race.py --dry-run --out race-out  # tiny, eager, on the CPU (slow tier)

Both sides run one training step at stage 3's per-GPU shape (49,152 tokens in one micro-step, stage
3's windows and multi-token weights): forward, backward and the optimizer step at world size 1,
compiled as each training run compiles it. Ours is train_gpt.py's Trainer.train_step; #89's is its
log's train_gpt.py and triton_kernels.py loaded as tools/reference_step.py loads them for the
ledger, but with its kernels real (Triton compiled on a GPU; on a CPU Triton 3.6's interpreter, or
tools/reference_kernels.py's torch stand-ins under other Tritons, and always for its NVRTC loss
kernel), its torch.compile decorators kept on a GPU, FlashAttention 3 (a hub download) replaced by
our attention (FlexAttention on a GPU, the tiled attention on a CPU) and its NorMuonAndAdam at world
size 1. Each side is timed over --steps pairs of steps (an even step and an odd one, whose Adam
steps) after --warmup pairs: CUDA events, ms per step = a pair's time / 2, median and spread
(min-max). One pair of each is profiled with torch.profiler; its kernels' time per step, by the
ledger's classes, is printed beside tools/step_cost.py's prediction for one GPU at that shape (one
micro-step and the optimizer step).

Output: `race: ours X ms/step, #89 (attention: Z) Y ms/step, ratio X/Y; ledger predicted X' / Y'`,
the losses of the first steps, the per-class table; in --out: race.txt (the output), kernels.csv and
classes.csv, times.csv. --load-caches DIR loads the compile caches a smoke saved with --save-caches
DIR (tools/compile_caches.py) first.
"""

import argparse
import contextlib
import csv
import dataclasses
import gc
import os
import re
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]
DEFAULT_LOG = (
    ROOT.parent
    / "shared"
    / "reference"
    / "modded-nanogpt_2026-07-17_FP8DownProjection_11cb620c.txt"
)
STAGE = 2  # stage 3 (0-based), the record's last third


def wants_interpreter(argv):
    """Before torch and Triton load: the dry run runs #89's Triton kernels in Triton's interpreter,
    whose switch is read when a kernel is decorated."""
    return "--dry-run" in argv


if wants_interpreter(sys.argv[1:]):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import compile_caches  # noqa: E402
import reference_kernels  # noqa: E402
import reference_step  # noqa: E402
import step_cost  # noqa: E402
import train_gpt as tg  # noqa: E402


@dataclasses.dataclass(frozen=True)
class RaceShape:
    """What the race runs: tokens of the one micro-step, document length, our flags (on the
    record's), #89's sizes (Reference's; {} for the log's own) and whether the steps are
    compiled."""

    name: str
    tokens: int
    document: int
    our_flags: tuple
    reference_sizes: dict
    compiled: bool


# The record's per-GPU micro-step at stage 3. Our flags are the record's at world size 1 (8
# accumulation steps of 49,152 tokens: the smoke's training graph, whose compile cache the race can
# load); the race runs one of those micro-steps, then the optimizer step.
RECORD_SHAPE = RaceShape("record", 49_152, 768, (), {}, True)
# Tiny on the CPU: the full vocabulary (the loss kernel's), a 64-wide model, 256 tokens in
# documents of 64.
TINY_SIZES = dict(model_dim=64, num_heads=4, head_dim=16)
TINY_BIGRAM = dict(bigram_vocab_size=2048, bigram_dim=16, bigram_sign_table_rows=64)
# The dry run's torch threads, whatever the machine: the CPU's sums split by thread, and #89's first
# optimizer step moves its tiny model's loss by less than that changes it (1 thread vs 2: 3.5e-4).
DRY_RUN_THREADS = 2
DRY_RUN_SHAPE = RaceShape(
    "dry-run", 256, 64,
    tuple("--model_dim 64 --num_heads 4 --head_dim 16 --bigram_vocab_size 2048 --bigram_dim 16 "
          "--bigram_sign_rows 64 --batch_sizes 1024 2048 2048 --val_batch_size 2048 "
          f"--cpu_threads {DRY_RUN_THREADS}".split()),
    dict(TINY_SIZES, max_seq_len=2048, **TINY_BIGRAM), False)


# ---- the batch both sides read: one window of random tokens in documents starting with BOS


def race_tokens(shape, seed=0):
    """(window of tokens + 1 ids, document lengths of its inputs)."""
    window = np.random.default_rng(seed).integers(0, tg.GPT2_VOCAB_SIZE - 1, shape.tokens + 1)
    lengths = [shape.document] * (shape.tokens // shape.document)
    lengths[-1] += shape.tokens - sum(lengths)
    window[np.cumsum([0, *lengths[:-1]])] = tg.BOS_ID
    return window, lengths


@dataclasses.dataclass
class RaceStep:
    """One side: run(step) runs a training step at stage 3's `step` (0: its first) and returns its
    summed loss (a device tensor); attention names the attention it runs, kernels what ran #89's
    kernels."""

    name: str
    run: object
    attention: str
    kernels: str
    tokens: int


# ---- ours: train_gpt's Trainer.train_step on one batch (the coupling to train_gpt.py is here)


class OneBatch:
    """The loader of a race: the same batch every micro-step."""

    def __init__(self, batch):
        self.batch, self.bigram_ids = batch, None  # (no sparse exchange at world size 1)

    def next_pieces(self, tokens, max_seq_len, cap):
        return [self.batch]


def our_hyperparameters(shape, device):
    return tg.parse_args(
        [*shape.our_flags, "--device", device.type, "--compile", str(shape.compiled).lower()]
    )


def our_trainer(hp, device, batch):
    """A Trainer with the training run's model, forward (compiled on CUDA with --compile),
    optimizers and schedule at world size 1, whose loader gives `batch` and whose steps run one
    micro-step."""
    # Trainer.__init__ opens data and logs, which a race has none of
    trainer = object.__new__(tg.Trainer)
    trainer.hp, trainer.device, trainer.world_size, trainer.rank = hp, device, 1, 0
    # one micro-step per step, as each GPU of the 8-GPU run: the FP8 gradient scale of accum 1
    trainer.backend = tg.backend_for(hp, device, 1)
    trainer.model, trainer.forward = tg.start_model(hp, trainer.backend, device, 1)
    trainer.matrix_opt, trainer.adam = tg.make_optimizers(trainer.model, hp, trainer.backend)
    trainer.schedule = tg.Schedule(hp, device)
    trainer.loader, trainer.accum = OneBatch(batch), 1
    trainer.stop, trainer.tokens_seen = tg.StopSignals(), 0
    return trainer


def our_batch(hp, shape, device):
    window, lengths = race_tokens(shape)
    bigram_ids = tg.bigram_hash(window[:-1], hp.bigram_vocab_size) if hp.bigram_vocab_size else None
    return tg.model_inputs(window, lengths, device, bigram_ids)


def build_our_step(shape, device=None):
    """Our RaceStep at `shape` (RECORD_SHAPE on CUDA, DRY_RUN_SHAPE on the CPU)."""
    device = device or default_device()
    hp = our_hyperparameters(shape, device)
    trainer = our_trainer(hp, device, our_batch(hp, shape, device))
    first = trainer.schedule.stages[STAGE].first_step
    untie = trainer.schedule.untie_step
    if trainer.adam.tied and untie is not None and untie < first:
        trainer.adam.untie()

    def run(step):
        plan = trainer.begin_step(first + step)._replace(unties_after=False)
        return trainer.train_step(plan)[0][0]

    attention = type(trainer.backend.attention).__name__
    return RaceStep("ours", run, attention, "train_gpt.py's", shape.tokens)


# ---- #89: its log's code, its kernels real


class VarlenAttention:
    """FlashAttention 3's flash_attn_varlen_func (causal, window_size=(w, 0)) by our attention: the
    same documents and window as a mask of ours (FlexAttention's block mask on a GPU, the tiled mask
    on a CPU).
    """

    def __init__(self, attention):
        self.attention = attention
        self.flash_attn_interface = self

    def flash_attn_varlen_func(
        self,
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        causal,
        softmax_scale,
        window_size,
    ):
        assert (
            causal and window_size[1] == 0
        ), "#89 calls FlashAttention causal, with a window to the left"
        mask = self.attention.mask(tg.document_ids(cu_seqlens_q, q.shape[0]), window_size[0])
        return self.attention(q, k, v, mask, torch.tensor(softmax_scale, device=q.device))


def kernels_for(device):
    """What runs #89's Triton kernels by default: compiled Triton on CUDA, the torch stand-ins
    (tools/reference_kernels.py) on a CPU. Triton 3.6's interpreter (--kernels interpreter) runs
    them too, with its bf16 dot mended (bf16_dots_in_interpreter: unmended, it multiplied bf16
    bits as integers, the NaN of the optimizer step), about 100 s a step."""
    return "triton" if device.type == "cuda" else "torch"


def triton_interprets_fp8():
    try:
        import triton
    except ImportError:
        return False
    return triton.__version__.startswith("3.6.")


def bf16_constants_in_interpreter():
    """Triton 3.6's interpreter cannot make a bf16 scalar constant (its builder has no get_bf16),
    which #89's up projection's backward makes (2 * c, c in bf16): give it one, the value rounded to
    bf16 as a compiled kernel's constant is (the interpreter holds bf16 data as its bits in
    uint16)."""
    import triton.language as tl
    from triton.runtime import interpreter

    def get_bf16(self, value):
        bits = torch.tensor([value], dtype=torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return interpreter.TensorHandle(bits, tl.bfloat16)

    if not hasattr(interpreter.InterpreterBuilder, "get_bf16"):
        interpreter.InterpreterBuilder.get_bf16 = get_bf16


def bf16_dots_in_interpreter():
    """Triton 3.6's interpreter multiplies a tl.dot's bf16 operands as the uint16 bits it holds
    them in (its create_dot widens fp8 operands only), which makes #89's XXT, ba_plus_cAA and
    fused up projection wrong by ~1e9 at any shape: give it bf16 operands widened to fp32 (exact),
    accumulated in the dot's fp32 as a tensor core accumulates them."""
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "widens_bf16", False):
        return
    create_dot = builder.create_dot

    def widened(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        bits = handle.data.astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot_bf16(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    create_dot_bf16.widens_bf16 = True
    builder.create_dot = create_dot_bf16


def _cuda_kernel_statement(node):
    """triton_kernels.py's NVRTC compile of the loss kernel and its shared-memory setting."""
    return "ce_fwd_bwd_kernel" in reference_step.ast.unparse(node).split("(")[0] and not isinstance(
        node, (reference_step.ast.FunctionDef, reference_step.ast.ClassDef)
    )


class RacingReference(reference_step.Reference):
    """#89's definitions with its kernels real (`kernels`: kernels_for's answer), at world size 1
    and one micro-step per step, FlashAttention 3 replaced by VarlenAttention(attention)."""

    def __init__(self, log_path, device, kernels, attention, sizes=None):
        self.race_device, self.kernel_kind, self.attention = device, kernels, attention
        self.rewrite_options = dict(
            keep_compile=device.type == "cuda", keep_cuda=device.type == "cuda"
        )
        super().__init__(log_path, 1, None, micro_steps=1, sizes=sizes)

    def device(self):
        return self.race_device

    def flash_attention(self, attention_op):
        return VarlenAttention(self.attention)

    def _load_script(self, path, attention_op):
        module, model_code = super()._load_script(path, attention_op)
        if self.race_device.type != "cuda":  # uint32 shifts exist on CUDA only
            optimizer = module.NorMuonAndAdam
            optimizer._cautious_wd_and_update_inplace = staticmethod(
                reference_kernels.cautious_update_in_int32
            )
        return module, model_code

    def _load_kernels(self, path):
        tree = self._parse(path)
        if self.race_device.type != "cuda":
            tree.body = [n for n in tree.body if not _cuda_kernel_statement(n)]
        module = self._module("triton_kernels", path)
        self._exec(tree, module, path)
        if hasattr(module, "_dummy_f32"):
            # made on first use by a global store, which dynamo refuses inside the autograd.Function
            # it traces (its backward): made now, as an eager call before the compile would
            module._dummy_f32 = torch.zeros(1, device=self.race_device)
        if self.race_device.type != "cuda":
            module.ce_fwd_bwd_kernel = reference_kernels.ce_fwd_bwd_kernel
        if self.kernel_kind == "torch":
            module.__dict__.update(reference_kernels.TRITON_LAUNCHERS)
        elif self.kernel_kind == "interpreter":
            tg._squeeze_interpreter_loop_bounds()  # loop bounds under numpy >= 2.4, as for ours
            bf16_constants_in_interpreter()
            bf16_dots_in_interpreter()
        for value in list(vars(module).values()):
            if isinstance(value, type) and issubclass(value, torch.autograd.Function):
                value.backward = staticmethod(reference_step._padded_backward(value.backward))
        return module


def reference_batch(module, shape, device):
    """(inputs, targets, cumulative lengths padded as its loader pads them, bigram hashes) of
    race_tokens."""
    window, lengths = race_tokens(shape)
    docs = max(module.TRAIN_MAX_NUM_DOCS.get(shape.tokens, 0), len(lengths) + 1)
    cumulative = np.full(docs, shape.tokens, dtype=np.int32)
    cumulative[0] = 0
    cumulative[1 : len(lengths) + 1] = np.cumsum(lengths)
    bigram = tg.bigram_hash(window[:-1], module.args.bigram_vocab_size)
    arrays = (
        window[:-1].astype(np.int32),
        window[1:].astype(np.int64),
        cumulative,
        bigram.astype(np.int32),
    )
    return tuple(torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in arrays)


@contextlib.contextmanager
def world_of_one(device):
    """A process group of one rank (#89's optimizer asks it for its size and reduces through it)."""
    if torch.distributed.is_initialized():
        yield
        return
    store = torch.distributed.HashStore()
    torch.distributed.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", store=store, rank=0, world_size=1
    )
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def our_attention(device, compiled):
    """Our attention for the device, as backend_for picks it (FlexAttention inside a compiled
    model)."""
    return (
        tg.FlexWindowAttention(compile_kernel=not compiled)
        if device.type == "cuda"
        else tg.TiledWindowAttention()
    )


def build_reference_step(shape, device=None, log_path=DEFAULT_LOG, kernels=None):
    """#89's RaceStep at `shape`; needs a process group (world_of_one) and, on a CPU, the SM count
    of an H100 (reference_step._cuda_properties) while it is built and run."""
    device = device or default_device()
    kernels = kernels or kernels_for(device)
    attention = our_attention(device, shape.compiled)
    reference = RacingReference(log_path, device, kernels, attention, shape.reference_sizes)
    module = reference.module
    torch.manual_seed(0)
    model, manager = reference.build()
    # one amax per program of the up projection, from torch.empty: at the record's shape each of
    # the SM-count programs writes its own; at the dry run's fewer run, and the rest must not count
    model._mlp_down_partial_amax.zero_()
    forward = torch.compile(model, dynamic=False, fullgraph=True) if shape.compiled else model
    schedule = module.training_schedule
    first = schedule.boundaries[STAGE][0]
    if schedule.split_step < first:
        manager.optimizer.copy_lm_state_to_embed()  # the untie, done before stage 3
    batch = reference_batch(module, shape, device)

    def run(step):
        step += first
        manager.advance_schedule(step)
        loss = forward(*batch, manager.get_forward_args()).sum() * module.grad_scale
        loss.backward()
        manager.step_optimizers(step)
        model.quantize_mlp_fp8(bootstrap_down=step < 16)
        return loss.detach()

    name = {
        "triton": "Triton, compiled",
        "interpreter": "Triton 3.6's interpreter",
        "torch": "tools/reference_kernels.py's torch stand-ins",
    }[kernels]
    return RaceStep(
        "#89",
        run,
        f"{type(attention).__name__} for FlashAttention 3",
        name + ", NVRTC loss kernel" + (" (CPU: torch stand-in)" if device.type != "cuda" else ""),
        shape.tokens,
    )


def default_device():
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


# ---- timing and profiling


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_pairs(step, device, pairs, start):
    """ms per step of each of `pairs` pairs of steps (even, odd), numbered from `start`; CUDA events
    on a GPU."""
    times = []
    for i in range(pairs):
        index = start + 2 * i
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            step.run(index), step.run(index + 1)
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 2)
        else:
            begin = time.perf_counter()
            step.run(index), step.run(index + 1)
            times.append((time.perf_counter() - begin) * 1e3 / 2)
    return times


def profile_pair(step, device, start):
    """[(kernel or op name, calls, microseconds)] of one pair of steps: the GPU's kernels on CUDA,
    the CPU's ops' own time on a CPU."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with warnings.catch_warnings(), torch.profiler.profile(activities=activities) as profiler:
        warnings.filterwarnings("ignore", "Profiler clears events")
        step.run(start), step.run(start + 1)
        synchronize(device)
    rows = []
    for event in profiler.key_averages():
        if device.type == "cuda":
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            micros = event.self_device_time_total
        else:
            micros = event.self_cpu_time_total
        if micros > 0:
            rows.append((event.key, event.count, micros))
    return rows


# the ledger's classes of a kernel, by its name: first match wins
CLASS_PATTERNS = (
    (
        "collectives",
        r"nccl|c10d|gloo|all_?reduce|reduce_?scatter|all_?gather|all_?to_?all|broadcast",
    ),
    ("attention", r"flex_attention|flash|attention|sdpa|scaled_dot_product"),
    ("matmul fp8", r"_scaled_mm|e4m3|e5m2|f8f8|fp8|linear_relu_square"),
    ("matmul tf32", r"tf32"),
    ("matmul fp32", r"sgemm|f32f32|(^|::)(mm|addmm_?|bmm|baddbmm_?|matmul|linear)$"),
    ("matmul bf16", r"gemm|xmma|cutlass|nvjet|cublas|triton_tem|mm_|_mm|XXT|XTX|ba_plus_cAA|bf16"),
)


def kernel_class(name, device):
    """The ledger's class (step_cost.CLASSES) of a profiled kernel or op. By name: the fused up
    projection counts as FP8 forward and backward alike (one Triton kernel); on a CPU a plain matmul
    op is fp32.
    """
    for kind, pattern in CLASS_PATTERNS:
        if re.search(pattern, name, re.IGNORECASE):
            return kind
    return "pointwise/reduction"


def class_ms(rows, device, steps=2):
    """{class: ms per step} of profile_pair's rows."""
    totals = dict.fromkeys(step_cost.CLASSES, 0.0)
    for name, _, micros in rows:
        totals[kernel_class(name, device)] += micros / 1e3 / steps
    return totals


# ---- the ledger's prediction at the race's shape: one micro-step, then the optimizer step, one GPU


def ledger_hyperparameters(shape):
    """Our flags with one micro-step of the race's tokens per step at world size 1 (the ledger
    weighs a step's micro-steps by their count)."""
    hp = tg.parse_args(list(shape.our_flags))
    accum = tg.grad_accum_steps(hp, 1)
    return dataclasses.replace(
        hp, grad_accum_base=1, batch_sizes=tuple(b // accum for b in hp.batch_sizes)
    )


def ledger_prediction(shape, log_path, gpu):
    """(ours, #89's) step_cost.StageCost of stage 3 at the race's shape on one `gpu` ('h100' or
    'h200')."""
    peaks = step_cost.GPU_PEAKS[gpu]
    ours, _ = step_cost.stage_costs(ledger_hyperparameters(shape), 1, peaks, stages=[STAGE])
    theirs, _ = step_cost.reference_stage_costs(
        log_path,
        1,
        peaks,
        stages=[STAGE],
        tokens_per_rank=shape.tokens,
        micro_steps=1,
        sizes=shape.reference_sizes,
    )
    return ours[0], theirs[0]


def gpu_kind(device):
    return (
        "h200" if device.type == "cuda" and "H200" in torch.cuda.get_device_name(device) else "h100"
    )


# ---- output


@dataclasses.dataclass
class SideResult:
    step: RaceStep
    losses: list  # per token, the first pair of steps
    times: list  # ms per step of each timed pair
    profile: list  # profile_pair's rows
    predicted: object  # step_cost.StageCost

    @property
    def median(self):
        return statistics.median(self.times)

    @property
    def classes(self):
        return class_ms(self.profile, None)


def race_line(ours, theirs):
    return (
        f"race: ours {ours.median:.2f} ms/step, #89 (attention: {theirs.step.attention}) "
        f"{theirs.median:.2f} ms/step, ratio {ours.median / theirs.median:.3f}; ledger predicted "
        f"{ours.predicted.step_seconds * 1e3:.2f} / {theirs.predicted.step_seconds * 1e3:.2f}"
    )


def spread_line(side):
    return (
        f"{side.step.name}: median {side.median:.2f} ms/step over {len(side.times)} pairs of "
        f"steps, spread {min(side.times):.2f}-{max(side.times):.2f}; kernels: {side.step.kernels}; "
        f"attention: {side.step.attention}"
    )


def loss_line(ours, theirs):
    return (
        f"losses per token, first steps of stage 3 (even, odd): ours {ours.losses[0]:.6f} "
        f"{ours.losses[1]:.6f}, #89 {theirs.losses[0]:.6f} {theirs.losses[1]:.6f}"
    )


def table_row(label, values):
    """A row of the per-class table: every value after at least one space, however large."""
    return f"{label:<22}" + "".join(f" {v:10.3f}" for v in values)


def class_table(ours, theirs):
    """Measured (profiled kernels) and predicted ms per step by class, for both sides."""
    mine, yours = ours.classes, theirs.classes
    lines = [f"{'class':<22}{'ours':>11}{'ledger':>11}{'#89':>11}{'ledger':>11}   "
             "(ms per step: profiled kernels, step_cost's prediction)"]
    for kind in step_cost.CLASSES:
        lines.append(table_row(kind, (mine[kind], ours.predicted.seconds[kind] * 1e3, yours[kind],
                                      theirs.predicted.seconds[kind] * 1e3)))
    lines.append(table_row("kernels in all", (sum(mine.values()), ours.predicted.step_seconds * 1e3,
                                              sum(yours.values()),
                                              theirs.predicted.step_seconds * 1e3)))
    return lines


def write_csvs(folder, sides, device):
    with open(folder / "kernels.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["side", "class", "kernel", "calls per step", "us per step"])
        for side in sides:
            for name, calls, micros in sorted(side.profile, key=lambda row: -row[2]):
                writer.writerow(
                    [
                        side.step.name,
                        kernel_class(name, device),
                        name,
                        calls / 2,
                        f"{micros / 2:.2f}",
                    ]
                )
    with open(folder / "classes.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["side", "class", "profiled ms per step", "predicted ms per step"])
        for side in sides:
            for kind in step_cost.CLASSES:
                writer.writerow(
                    [
                        side.step.name,
                        kind,
                        f"{side.classes[kind]:.4f}",
                        f"{side.predicted.seconds[kind] * 1e3:.4f}",
                    ]
                )
    with open(folder / "times.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["side", "pair", "ms per step"])
        for side in sides:
            writer.writerows([side.step.name, i, f"{ms:.4f}"] for i, ms in enumerate(side.times))


# ---- the race


def run_side(step, device, warmup, pairs):
    """SideResult less its prediction: the first pair's losses, the warm-up, the timed pairs, one
    profiled pair."""
    losses = [step.run(0).item() / step.tokens, step.run(1).item() / step.tokens]
    for i in range(1, warmup):
        step.run(2 * i), step.run(2 * i + 1)
    synchronize(device)
    start = 2 * max(warmup, 1)
    times = time_pairs(step, device, pairs, start)
    return SideResult(step, losses, times, profile_pair(step, device, start + 2 * pairs), None)


def race(shape, device, log_path, warmup, pairs, kernels=None, say=print):
    """(ours, #89's) SideResult at `shape`, with the ledger's predictions."""
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if device.type != "cuda":
            stack.enter_context(reference_step._cuda_properties())
        ours = run_side(build_our_step(shape, device), device, warmup, pairs)
        ours.step.run = None  # our model and optimizers go before #89's are built
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        say(f"ours ran ({time.perf_counter() - started:.0f} s since the start)")
        stack.enter_context(world_of_one(device))
        theirs = run_side(
            build_reference_step(shape, device, log_path, kernels), device, warmup, pairs
        )
        say(f"#89 ran ({time.perf_counter() - started:.0f} s since the start)")
    ours.predicted, theirs.predicted = ledger_prediction(shape, log_path, gpu_kind(device))
    return ours, theirs


def positive(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse(argv):
    parser = step_cost.ArgumentParser(prog="gpu_race.py", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--out", required=True, type=Path, help="folder for the files (made if missing)"
    )
    parser.add_argument("--dry-run", action="store_true",
                        help=f"tiny shapes, eager, on the CPU ({DRY_RUN_THREADS} threads)")
    parser.add_argument(
        "--steps", type=positive, default=None, help="timed pairs of steps (default 10; 1 dry)"
    )
    parser.add_argument(
        "--warmup", type=positive, default=None, help="pairs before timing (default 3; 1 dry)"
    )
    parser.add_argument(
        "--log", type=Path, default=DEFAULT_LOG, help="#89's log (default ../shared/reference/...)"
    )
    parser.add_argument("--kernels", choices=("torch", "interpreter"), default=None,
                        help="dry run: #89's Triton kernels as torch stand-ins (default) or in "
                             "Triton 3.6's interpreter (slow: see kernels_for)")
    parser.add_argument("--load-caches", type=Path, default=None, metavar="DIR",
                        help="load the compile caches a smoke saved with --save-caches DIR first")
    args = parser.parse_args(argv)
    if not args.log.is_file():
        parser.error(f"--log {args.log}: no such file (modded-nanogpt record #89's log)")
    if args.load_caches is not None and not args.load_caches.is_dir():
        parser.error(f"--load-caches {args.load_caches}: no such folder; give the DIR of a smoke's "
                     f"--save-caches")
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device; pass --dry-run to run the race at tiny shapes on the CPU")
    if args.kernels == "interpreter" and not triton_interprets_fp8():
        parser.error("--kernels interpreter needs Triton 3.6 (its interpreter runs e4m3 exactly); "
                     "use --kernels torch")
    if args.kernels and not args.dry_run:
        parser.error(
            "--kernels is for the dry run: on a GPU #89's Triton kernels run compiled"
        )
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out}: not a folder")
    return args


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", 0)
    shape = DRY_RUN_SHAPE if args.dry_run else RECORD_SHAPE
    warmup = args.warmup or (1 if args.dry_run else 3)
    pairs = args.steps or (1 if args.dry_run else 10)
    if args.dry_run:
        torch.set_num_threads(DRY_RUN_THREADS)
    args.out.mkdir(parents=True, exist_ok=True)
    output = open(
        args.out / "race.txt", "w", encoding="utf-8"
    )  # as it goes: a run cut short keeps its lines

    def say(line):
        print(line, flush=True)
        output.write(line + "\n")
        output.flush()

    if args.load_caches is not None:
        say(f"compile caches: {compile_caches.load(args.load_caches):,} bytes loaded from "
            f"{args.load_caches}")
    say(
        f"race at {shape.name} shape: {shape.tokens:,} tokens in one micro-step of stage 3, then "
        f"the optimizer step, world size 1, {'compiled' if shape.compiled else 'eager'}, on "
        f"{device_name(device)}; "
        f"{warmup} warm-up and {pairs} timed pairs of steps per side"
    )
    ours, theirs = race(shape, device, args.log, warmup, pairs, args.kernels, say)
    for line in [
        spread_line(ours),
        spread_line(theirs),
        loss_line(ours, theirs),
        *class_table(ours, theirs),
    ]:
        say(line)
    write_csvs(args.out, (ours, theirs), device)
    say(race_line(ours, theirs))
    output.close()
    return 0


def device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"the CPU ({torch.get_num_threads()} threads)"


if __name__ == "__main__":
    sys.exit(main())
