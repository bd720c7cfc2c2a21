"""The checks of the one-GPU smoke test as plain functions of a device and a size, shared by
tools/gpu_smoke.py (the script) and tests/test_gpu.py (the suite): at the record's shapes on CUDA, at
toy shapes on the CPU, so that a deterministic failure shows on the CPU first.

A check returns its detail line or raises CheckFailed. Only what needs CUDA is CUDA-only (Check.cuda_only
says why; the CPU reports SKIP): CUDA memory statistics, FP8 hardware speed and compiled Triton kernels'
speed. The sync count runs on both (CUDA's sync debug mode, or SyncCounter on the CPU), so do the
kernels' results (the Triton interpreter on the CPU).

The record-model checks share one RecordRun with one batch size for the whole run, so the training step
is one compiled graph. Model-specific choices live in RECORD and TOY (the sizes) and in RecordRun.
"""
import functools
import gc
import math
import os
import subprocess
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import plan_memory
import train_gpt as tg

ROOT = Path(__file__).resolve().parents[1]
# The record's pace, #89's measured figure on 8xH100: stage 3 at 82.7 ms per step for 49,152 tokens per GPU, that
# is 594k tokens/s per GPU. One GPU has to reach this before any communication is added.
RECORD_STAGE3_MS, RECORD_STAGE3_TOKENS_PER_GPU = 82.7, 49_152
RECORD_PACE_TOKENS_PER_GPU = round(RECORD_STAGE3_TOKENS_PER_GPU / (RECORD_STAGE3_MS / 1000))
RECORD_PACE_LABEL = (f"{RECORD_PACE_TOKENS_PER_GPU / 1000:.0f}k tokens/s per GPU on 8xH100 (#89's stage 3: "
                     f"{RECORD_STAGE3_MS} ms per step at {RECORD_STAGE3_TOKENS_PER_GPU:,} tokens per GPU)")
H100_BYTES = 80 * 2**30
# Cold compile seconds per unit on one H200 (16 CPU cores compile), by kind: the plan's estimates, not
# measurements. On CUDA each compile prints its measured seconds next to its estimate (report_compile).
COMPILE_BUDGET_S = {
    "training": 100,  # the record model's forward+backward at one micro-batch length (with FlexAttention's templates)
    "validation": 45,  # its validation forward
    "fp8": 5,  # one FP8 head helper: its forward or backward at one shape, with or without gradients
    "flex": 30,  # FlexAttention's forward and backward kernels on their own (the attention check)
    "adam": 3,  # DistAdam's fused update at one parameter shape
    "normuon": 3,  # NorMuon's variance normalization or cautious update at one stack shape
    "triton": 1.5,  # one Polar Express kernel binary: a tile configuration at one specialization of its arguments
    "autotune": 1,  # timing every tile configuration at one matrix size (its new binaries count as "triton")
}
COMPILE_NAMES = {"training": "training", "validation": "validation", "fp8": "FP8 head", "flex": "FlexAttention",
                 "adam": "DistAdam", "normuon": "NorMuon", "triton": "Triton kernels"}  # autotune: no compile
# The kernels' dtype and tolerance (max |Triton - torch| / max |torch|): bf16 compiled on CUDA, fp32 under
# the Triton interpreter on the CPU (it has no bf16 tl.dot)
KERNEL_PRECISION = {"cuda": (torch.bfloat16, 1e-2), "cpu": (torch.float32, 1e-5)}


class CheckFailed(AssertionError):
    pass


def require(ok, message):
    if not ok:
        raise CheckFailed(message)


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, device, repeats):
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(1000 * (time.perf_counter() - start))
    return sorted(times)[len(times) // 2]


def compiled_graphs():
    """Graphs dynamo has compiled in this process so far."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def compile_estimate_s(graphs):
    """The plan's seconds for a list of (kind, description) compiles."""
    return sum(COMPILE_BUDGET_S[kind] for kind, _ in graphs)


def report_compile(device, graphs, seconds):
    """The measured seconds of the compiles in `graphs` ((kind, description)) as their first call returns, next
    to the plan's estimate (CUDA only: the CPU runs eagerly)."""
    if device.type == "cuda":
        print(f"compiled {'; '.join(what for _, what in graphs)} in {seconds:.1f} s (first call, its run included; "
              f"estimate {compile_estimate_s(graphs):.0f} s)", flush=True)


def relative_error(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def cosine(a, b):
    return (a.flatten() @ b.flatten() / (a.norm() * b.norm())).item()


# ---------------------------------------------------------------------------------------------- sizes

def micro_batch_tokens(hp, world_size=1):
    """Tokens per forward pass at the largest batch size."""
    return tg.tokens_per_rank(max(hp.batch_sizes), world_size, tg.grad_accum_steps(hp, world_size))


@dataclass(frozen=True)
class Size:
    """What differs between the CUDA run (the record's shapes) and the CPU (toy shapes)."""
    name: str
    trainer_flags: tuple  # on top of the record's defaults; the run then uses their largest batch size throughout
    head: tuple  # (tokens, dim, vocab) of the FP8 head check
    polar_stack: int  # matrices of the MLP's shape in the Polar Express check
    attention_tokens: int  # sequence length of the attention check (not a multiple of 128)
    timed_steps: tuple  # (scheduled, extension) steps of the timed loop
    timing_repeats: int
    tile_shape: tuple  # input of the tile-configuration check

    def hp(self):
        return tg.parse_args(list(self.trainer_flags))


RECORD_HP = tg.parse_args([])
RECORD = Size("record", trainer_flags=(), head=(micro_batch_tokens(RECORD_HP), RECORD_HP.model_dim, tg.padded_vocab(RECORD_HP)),
              polar_stack=16, attention_tokens=3000, timed_steps=(9, 3), timing_repeats=10,
              # multiples of 16 like the record's matrices, so Triton reuses the kernels it compiled for training
              tile_shape=(208, 80))
TOY = Size("toy", trainer_flags=("--preset", "cpu", "--num_layers", "9", "--model_dim", "64", "--num_heads", "2",
                                 "--head_dim", "32", "--batch_sizes", "512", "512", "512", "--val_batch_size", "1024",
                                 "--cpu_threads", "2", "--ngram_prior", "0"),  # the record's path: no prior
           head=(512, 64, 1024), polar_stack=2, attention_tokens=2000, timed_steps=(3, 1), timing_repeats=1,
           tile_shape=(200, 72))


def size_for(device):
    return RECORD if device.type == "cuda" else TOY


# ---------------------------------------------------------------------------------------------- host syncs

class SyncCounter(TorchDispatchMode):
    """Records, on any device, the operations that make the host wait for a CUDA device: reading a
    value (.item(), .tolist(), float(t): _local_scalar_dense), ops whose output size depends on data
    (nonzero, masked_select, boolean indexing, ...), and tensors made from Python data inside the
    region (torch.tensor(...), indexing with a Python list: on CUDA a copy from the host)."""

    DATA_DEPENDENT = {"aten.nonzero.default", "aten.masked_select.default", "aten._unique2.default",
                      "aten.unique_dim.default", "aten.repeat_interleave.Tensor", "aten.unique_consecutive.default"}

    def __init__(self):
        super().__init__()
        self.events = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name == "aten._local_scalar_dense.default":
            self.events.append("host read (.item/.tolist/float)")
        elif name in self.DATA_DEPENDENT:
            self.events.append(f"data-dependent size ({name})")
        elif name == "aten.index.Tensor" and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self.events.append("boolean-mask indexing")
        elif name in ("aten.lift_fresh.default", "aten.lift_fresh_copy.default"):
            self.events.append("batch to device (by design: pinned, non-blocking on CUDA)" if self._in_to_device()
                               else "tensor from Python data")
        return func(*args, **(kwargs or {}))

    @staticmethod
    def _in_to_device():
        """Whether the loader's to_device (the batch's designed host-to-device transfer) is the caller."""
        frame = sys._getframe()
        while frame is not None:
            if frame.f_code.co_name == "to_device" and frame.f_code.co_filename.endswith("train_gpt.py"):
                return True
            frame = frame.f_back
        return False

    def syncs(self):
        """The events that make the host wait (the batch transfers do not)."""
        return [event for event in self.events if not event.startswith("batch to device")]

    def summary(self):
        return count_summary(self.events)


def count_summary(events):
    counts = {}
    for event in events:
        counts[event] = counts.get(event, 0) + 1
    return "; ".join(f"{n} x {event}" for event, n in sorted(counts.items())) or "none"


SYNC_DEBUG_WARNING = "called a synchronizing CUDA operation"  # c10's text in torch.cuda.set_sync_debug_mode("warn")


def sync_debug_warnings(caught):
    """The sync debug mode's own warnings among those caught (others, say a deprecation, are no syncs)."""
    return [w for w in caught if SYNC_DEBUG_WARNING in str(w.message)]


def count_host_syncs(trainer, step):
    """(count, summary) of the synchronizing calls inside one train_step: CUDA's own sync debug mode on a
    GPU; on the CPU the operations that would synchronize on CUDA (SyncCounter)."""
    if trainer.device.type != "cuda":
        with SyncCounter() as counter:
            trainer.train_step(trainer.begin_step(step))
        return len(counter.syncs()), counter.summary()
    synchronize(trainer.device)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train_step(trainer.begin_step(step))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = sync_debug_warnings(caught)
    return len(syncs), count_summary(f"{w.filename}:{w.lineno}" for w in syncs)


# ---------------------------------------------------------------------------------------------- compiles

def guard_key(args):
    """What a dynamic=False graph is keyed on, argument by argument: a tensor's shape, strides and dtype; any
    other value itself (a float is baked into the graph)."""
    return tuple((tuple(a.shape), a.stride(), a.dtype) if isinstance(a, torch.Tensor) else a for a in args)


def polar_kernel_ints(m, n):
    """The integer arguments of Polar Express's two Triton kernels on a (batch, m, n) input, m <= n (as
    _sym_launch passes them): XXᵀ (M, K and both tensors' strides) and bA + cA² (M and the strides)."""
    return (m, n, m * n, n, 1, m * m, m, 1), (m, m * m, m, 1, m * m, m, 1)


def triton_specialization(ints):
    """How Triton specializes integer arguments (equal to 1, a multiple of 16, other): one binary per
    distinct tuple and tile configuration."""
    return tuple(1 if v == 1 else 16 if v % 16 == 0 else 0 for v in ints)


@dataclass
class OptimizerCompiles:
    adam: set  # guard keys of DistAdam's update
    normuon: set  # (function, guard key) of NorMuon's normalization and cautious update
    polar_sizes: set  # (m, n), m <= n, of every Polar Express input

    def triton_specializations(self):
        """{kernel: specializations} of Polar Express's launches at these sizes."""
        ints = [polar_kernel_ints(m, n) for m, n in self.polar_sizes]
        return {kernel: {triton_specialization(k[i]) for k in ints} for i, kernel in enumerate(("xxt", "ba_plus_caa"))}

    def autotuned_sizes(self):
        """The autotuner's keys: XXᵀ's (M, K), bA + cA²'s M."""
        return [("xxt", size) for size in sorted(self.polar_sizes)] + \
            [("ba_plus_caa", (m,)) for m in sorted({m for m, _ in self.polar_sizes})]

    def graphs(self):
        """(kind, description) of each compile, and each autotuned size ("autotune")."""
        graphs = [("adam", f"DistAdam's update at {key[3][0]}") for key in sorted(self.adam, key=str)]
        graphs += [("normuon", f"NorMuon's {name} at {key[0][0]}") for name, key in sorted(self.normuon, key=str)]
        for kernel, specs in self.triton_specializations().items():
            graphs += [("triton", f"Polar Express's {kernel} kernel, tile configuration {config}, specialization {spec}")
                       for spec in sorted(specs) for config in tg.SYM_CONFIGS]
        return graphs + [("autotune", f"autotuning {kernel} at {size}") for kernel, size in self.autotuned_sizes()]


@functools.cache
def optimizer_compiles(argv):
    """What the optimizers of a run (argv: its flags) compile on one GPU: one step of both on fake tensors (no
    memory, no GPU; DistAdam's once more after the untie), each compiled function's calls keyed as its graphs
    are, and the shapes Polar Express gets (NorMuon's normalization receives its output)."""
    hp = tg.parse_args(list(argv))
    adam_keys, normuon_keys, sizes = set(), set(), set()

    def recording(fn, keys, name=None):
        def call(*args):
            keys.add(guard_key(args) if name is None else (name, guard_key(args)))
            if name == "normalization":
                rows, cols = args[0].shape[-2:]
                sizes.add((min(rows, cols), max(rows, cols)))
            return fn(*args)
        return call

    with warnings.catch_warnings(), FakeTensorMode():
        warnings.simplefilter("ignore")
        model, backend = plan_memory.planned_model(hp, True, tg.grad_accum_steps(hp, 1))
        # the compiled path's arguments (Polar Express in torch: Triton cannot run on fake tensors)
        matrix_opt, adam = tg.make_optimizers(model, hp, backend._replace(compile_math=True))
        adam.math = recording(tg.adam_update_, adam_keys)
        if isinstance(matrix_opt, tg.NorMuon):
            matrix_opt.normalize = recording(tg.normalize_variance, normuon_keys, "normalization")
            matrix_opt.apply_update = recording(tg.cautious_update, normuon_keys, "cautious update")
        plan = tg.Schedule(hp).at(1)
        for step in (1, 3):  # odd: both optimizers step; the second time with the embedding untied
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            tg.step_optimizers(plan._replace(step=step, unties_after=adam.tied), matrix_opt, adam)
    return OptimizerCompiles(adam_keys, normuon_keys, sizes)


class CompileClocks:
    """On CUDA, the optimizers' compiled functions and Polar Express's autotuners of one Trainer, wrapped so
    that each call that compiles (or autotunes) prints its seconds next to the plan's estimate; `seconds` sums
    them (they run inside the training step's first call). undo() puts the originals back."""

    def __init__(self, trainer):
        self.device, self.seconds, self._undo = trainer.device, 0.0, []
        self._specs = set()
        if trainer.device.type != "cuda":
            return
        self._wrap(trainer.adam, "math", "adam", "DistAdam's update")
        if isinstance(trainer.matrix_opt, tg.NorMuon):
            self._wrap(trainer.matrix_opt, "normalize", "normuon", "NorMuon's normalization")
            self._wrap(trainer.matrix_opt, "apply_update", "normuon", "NorMuon's cautious update")
        if tg.HAS_TRITON:
            for kernel, name in ((tg._xxt_kernel, "xxt"), (tg._ba_plus_caa_kernel, "ba_plus_caa")):
                tuner = tg._AUTOTUNED[kernel]
                tg._AUTOTUNED[kernel] = self.TimedTuner(self, tuner, name)
                self._undo.append(lambda kernel=kernel, tuner=tuner: tg._AUTOTUNED.__setitem__(kernel, tuner))

    def _wrap(self, owner, attribute, kind, what):
        fn = getattr(owner, attribute)

        def timed(*args):
            graphs, start = compiled_graphs(), time.perf_counter()
            result = fn(*args)
            if compiled_graphs() > graphs:
                self._report([(kind, f"{what} at {guard_key(args)[0][0]}")], start)
            return result

        setattr(owner, attribute, timed)
        self._undo.append(lambda: setattr(owner, attribute, fn))

    def _report(self, graphs, start):
        synchronize(self.device)
        seconds = time.perf_counter() - start
        self.seconds += seconds
        report_compile(self.device, graphs, seconds)

    class TimedTuner:
        """An autotuner (`tuner[grid](...)`) whose launches that tune a new size are timed."""

        def __init__(self, clocks, tuner, name):
            self.clocks, self.tuner, self.name = clocks, tuner, name

        def __getitem__(self, grid):
            def launch(x3, o3, M, *args):
                tuned, start = len(self.tuner.cache), time.perf_counter()
                self.tuner[grid](x3, o3, M, *args)
                if len(self.tuner.cache) > tuned:
                    m, n = x3.shape[-2:]
                    ints = polar_kernel_ints(m, n)[0 if self.name == "xxt" else 1]
                    spec = (self.name, triton_specialization(ints))
                    new = [] if spec in self.clocks._specs else [
                        ("triton", f"{self.name}, tile configuration {config}") for config in tg.SYM_CONFIGS]
                    self.clocks._specs.add(spec)
                    self.clocks._report([("autotune", f"autotuning {self.name} at {(m, n)}"), *new], start)
            return launch

    def undo(self):
        for undo in reversed(self._undo):
            undo()
        self._undo = []


# ---------------------------------------------------------------------------------------------- the record run

def once(phase):
    """A phase of the record run runs once; later calls return its result or raise its error again."""
    @functools.wraps(phase)
    def run(self):
        if phase.__name__ not in self._phases:
            try:
                self._phases[phase.__name__] = (True, phase(self))
            except Exception as e:  # noqa: BLE001 - kept for the checks that depend on this phase
                self._phases[phase.__name__] = (False, e)
        ok, value = self._phases[phase.__name__]
        if not ok:
            raise value
        return value
    return run


def gradient_state(grad):
    if grad is None:
        return "missing"
    if not torch.isfinite(grad).all():
        return "non-finite"
    return "nonzero" if grad.count_nonzero() else "zero"


def gradient_states(log, names):
    """Parameter name -> the set of gradient states note_gradients logged for it."""
    seen = {}
    for entry in log:
        for p, state in entry.items():
            seen.setdefault(names[p], set()).add(state)
    return seen


def note_gradients(optimizer, log):
    """Make this optimizer instance note each parameter's gradient_state as each of its steps starts (its
    reduce_grads(), the first of the three phases step_optimizers calls); returns the undo (the class's
    reduce_grads() again)."""
    reduce_grads = optimizer.reduce_grads

    def noting_reduce_grads():
        log.append({p: gradient_state(p.grad) for group in optimizer.param_groups for p in group["params"]})
        reduce_grads()

    optimizer.reduce_grads = noting_reduce_grads
    return lambda: delattr(optimizer, "reduce_grads")


@dataclass
class FirstSteps:
    loss_per_token: float  # step 0's, at initialization
    vocab: int
    names: set  # of every parameter
    unmoved: list  # names of the parameters still at their initial values after each step
    gradients: dict  # name -> the gradient states its optimizer saw (gradient_state)
    early_gradients: dict  # the same in steps 0-1
    seconds: float  # of the first step (on CUDA: the training graph's compilation)


@dataclass
class TimedLoop:
    step_seconds: list
    train_peak_bytes: int
    eval_peak_bytes: int
    reserved_bytes: int
    new_graphs: int


class RecordRun:
    """The record configuration (toy sizes on the CPU) on a synthetic corpus, at one batch size throughout:
    three steps from initialization, the Trainer's warm-up, a timed loop and a validation, then single
    steps and passes for the remaining checks. Each phase runs once, when a check first needs it."""

    MOVE_STEPS = 4  # NorMuon four times, DistAdam twice (odd steps)

    def __init__(self, device, size, folder):
        self.device, self.size, self.folder = device, size, Path(folder) if folder else None
        self.argv = self._argv()
        self.hp = tg.parse_args(self.argv)
        self._phases, self._trainer, self._threads = {}, None, torch.get_num_threads()
        self.clocks = None

    def _argv(self):
        hp = self.size.hp()
        batch = str(max(hp.batch_sizes))  # one training graph
        scheduled, extension = self.size.timed_steps
        folder = self.folder or Path("unused")
        return [*self.size.trainer_flags, "--device", self.device.type, "--batch_sizes", batch, batch, batch,
                "--val_tokens", str(hp.val_batch_size),  # one validation step, of the record's size on CUDA
                "--num_scheduled_iterations", str(scheduled), "--num_extension_iterations", str(extension),
                "--warmup_steps", "1", "--val_loss_every", "0", "--log_dir", str(folder / "logs"),
                "--train_files", str(folder / "synthetic_train_*.bin"), "--val_files", str(folder / "synthetic_val_*.bin")]

    # --- what it compiles on CUDA ------------------------------------------------------------------
    def training_graphs(self):
        """(kind, description) of everything the first training steps compile: the model's graphs, the
        optimizers' and Polar Express's kernels (with the sizes it autotunes)."""
        return self.model_training_graphs() + optimizer_compiles(tuple(self.argv)).graphs()

    def model_training_graphs(self):
        """The model's: one graph per distinct micro-batch length, with the FP8 head's compiled forward and
        backward helpers at each (counted unless --fp8 off: planning from a CPU assumes an FP8 GPU)."""
        accum = tg.grad_accum_steps(self.hp, 1)
        lengths = sorted({tg.tokens_per_rank(b, 1, accum) for b in self.hp.batch_sizes})
        graphs = [("training", f"the training step at {n:,} tokens per micro-step (forward+backward)") for n in lengths]
        if self.hp.fp8 != "off":
            graphs += [("fp8", f"the FP8 head's {part} at {n:,} tokens") for n in lengths for part in ("forward", "backward")]
        return graphs

    def validation_graphs(self):
        n = tg.tokens_per_rank(self.hp.val_batch_size, 1, tg.grad_accum_steps(self.hp, 1))
        return [("validation", f"the validation forward at {n:,} tokens")]

    # --- phases ------------------------------------------------------------------------------------
    @once
    def trainer(self):
        hp, batch = self.hp, max(self.hp.batch_sizes)
        steps = hp.num_scheduled_iterations + hp.num_extension_iterations
        # the longest stretch without a restore: the timed loop, two counted steps and one more batch, with
        # room for the loader's BOS alignment
        tg.load_companion("data/synthetic.py").markov_corpus(
            self.folder, train_tokens=max(2 * (steps + 3) * batch, 100_000), val_tokens=hp.val_tokens + 1,
            write_shard=tg.write_shard)
        self._trainer = tg.Trainer(hp, self.argv)
        self.clocks = CompileClocks(self._trainer)
        return self._trainer

    @once
    def first_steps(self):
        trainer = self.trainer()
        names = {p: n for n, p in trainer.model.named_parameters()}
        initial_state = trainer.snapshot()
        initial = {p: p.detach().clone() for p in names}
        log, ends = [], []  # {parameter: gradient state} per optimizer step; where each train_step's entries end
        undo = [note_gradients(opt, log) for opt in (trainer.matrix_opt, trainer.adam)]
        unmoved, losses = [], []
        start = time.perf_counter()
        try:
            for step in range(self.MOVE_STEPS):
                losses.append(trainer.train_step(trainer.begin_step(step))[0][0].item())
                if step == 0:
                    seconds = time.perf_counter() - start
                    report_compile(self.device, self.model_training_graphs(), seconds - self.clocks.seconds)
                unmoved.append({names[p] for p in names if torch.equal(p, initial[p])})
                ends.append(len(log))
        finally:
            for restore_step in undo:
                restore_step()
            trainer.restore(initial_state)  # as the warm-up does: the timed loop starts from initialization
            trainer.model.rotary.reset()
        rank_tokens = tg.tokens_per_rank(max(self.hp.batch_sizes), trainer.world_size, trainer.accum)
        return FirstSteps(losses[0] / rank_tokens, trainer.model.lm_head.weight.shape[0], set(names.values()),
                          unmoved, gradient_states(log, names), gradient_states(log[: ends[1]], names), seconds)

    @once
    def warm_up(self):
        self.first_steps()
        trainer = self.trainer()
        graphs = compiled_graphs()
        start = time.perf_counter()
        trainer.validate(trainer.schedule.at(0).window_tensor)  # compiles the validation graph
        synchronize(self.device)
        validation_s = time.perf_counter() - start
        report_compile(self.device, self.validation_graphs(), validation_s)
        start = time.perf_counter()
        trainer.warm_up()
        return validation_s, time.perf_counter() - start, compiled_graphs() - graphs

    @once
    def timed_loop(self):
        self.warm_up()
        trainer = self.trainer()
        graphs = compiled_graphs()
        trainer.stats.reset_peaks()  # the first steps, the warm-up and anything before them do not count
        times = []
        for step in range(trainer.total_steps):
            synchronize(self.device)
            start = time.perf_counter()
            trainer.train_step(trainer.begin_step(step))
            synchronize(self.device)
            times.append(time.perf_counter() - start)
        train_peak = trainer.stats.train_peak_bytes()  # read before the validation, whose peak RunStats adds to it
        trainer.validate(trainer.schedule.at(trainer.total_steps).val_window_tensor)
        reserved = torch.cuda.max_memory_reserved(self.device) if self.device.type == "cuda" else 0
        return TimedLoop(times, train_peak, trainer.stats.eval_peak_bytes, reserved, compiled_graphs() - graphs)

    def close(self):
        if self.clocks is not None:
            self.clocks.undo()
        if self._trainer is not None:
            self._trainer.loader.close()
            self._trainer = None
            self._phases["trainer"] = (False, RuntimeError("the record run's trainer was released"))
        torch.set_num_threads(self._threads)  # the CPU Trainer set its own
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # --- checks ------------------------------------------------------------------------------------
    def check_parameters_move(self):
        """Every parameter moves within four steps from initialization (two DistAdam steps). Not all
        within two: a parameter whose gradient is exactly zero stays (the smear gate's weights: their
        output is multiplied by the smear lambda, which starts at 0 and is first changed by DistAdam at
        step 1; so do the first MUDD matrix behind the zero second one and the bigram lambdas behind the
        zero bigram table). So after steps 0-1 (both optimizers have stepped) each parameter still in place must have
        had only zero gradients."""
        first = self.first_steps()
        require(set(first.gradients) == first.names, f"no optimizer steps {sorted(first.names - set(first.gradients))}")
        bad = {name: states for name, states in first.gradients.items() if {"missing", "non-finite"} & states}
        require(not bad, f"gradients missing or non-finite: {bad}")
        # the multi-token loss weighs each position's next tokens: ln V each at initialization
        mtp = tg.Schedule(self.hp).at(0).mtp_weights
        weight = 1.0 if mtp is None else mtp.sum().item()
        expected = weight * math.log(first.vocab)
        require(abs(first.loss_per_token - expected) < 0.1 * weight,
                f"loss/token at initialization {first.loss_per_token:.4f}, expected {weight:g} x ln {first.vocab} "
                f"= {expected:.4f}")
        zero = {name for name, states in first.early_gradients.items() if states == {"zero"}}
        unexplained = first.unmoved[1] - zero
        require(not unexplained, f"not moved by steps 0-1 though their gradient was not zero: {sorted(unexplained)}")
        require(not first.unmoved[-1], f"not moved in {self.MOVE_STEPS} steps: {sorted(first.unmoved[-1])}")
        late = ", ".join(sorted(first.unmoved[1])) or "none"
        return (f"{len(first.names)} parameters, all moved within {self.MOVE_STEPS} steps; still in place after "
                f"steps 0-1, each with only zero gradients: {late}; loss/token at initialization "
                f"{first.loss_per_token:.4f} ({weight:g} x ln {first.vocab} = {expected:.4f}); first step "
                f"{first.seconds:.1f} s")

    def check_warm_up(self):
        validation_s, warm_up_s, graphs = self.warm_up()
        return (f"first validation {validation_s:.1f} s, the Trainer's warm-up (a step per stage, two validations) "
                f"{warm_up_s:.1f} s; {graphs} graph(s) compiled (planned {len(self.validation_graphs())} on CUDA)")

    def check_no_compiles_in_timed_loop(self):
        loop = self.timed_loop()
        require(loop.new_graphs == 0, f"{loop.new_graphs} graph(s) compiled in the timed loop and its validation")
        return f"0 graphs compiled in {len(loop.step_seconds)} timed steps and the final validation"

    def report_throughput(self):
        loop, trainer = self.timed_loop(), self.trainer()
        last = [t for step, t in enumerate(loop.step_seconds) if trainer.schedule.stage_index(step) >= 2]
        median = sorted(last)[len(last) // 2]
        batch = max(self.hp.batch_sizes)
        per_gpu = batch / trainer.world_size / median
        unit = "GPU" if self.device.type == "cuda" else "process"
        line = (f"{per_gpu:,.0f} tokens/s per {unit}: {batch:,} tokens per step in {trainer.accum} micro-step(s), median "
                f"{1000 * median:.1f} ms over the last stages' {len(last)} steps")
        if self.device.type != "cuda":
            return line + " (CPU: no target)"
        name = torch.cuda.get_device_name(self.device)
        pace_ms = 1000 * batch / trainer.world_size / RECORD_PACE_TOKENS_PER_GPU
        line += (f" on {name}; the record's pace is {RECORD_PACE_LABEL}, {pace_ms:.0f} ms per "
                 f"step here: {per_gpu / RECORD_PACE_TOKENS_PER_GPU:.0%}")
        if per_gpu < RECORD_PACE_TOKENS_PER_GPU:
            line += f", short by {RECORD_PACE_TOKENS_PER_GPU - per_gpu:,.0f} tokens/s ({1000 * median - pace_ms:.0f} ms per step)"
        if "H200" in name:
            line += ("; an H200 figure: its memory bandwidth (4.8 TB/s, an H100's 3.35) flatters the memory-bound "
                     "kernels, so an H100 is slower")
        return line

    def check_memory(self):
        loop = self.timed_loop()
        require(loop.train_peak_bytes < H100_BYTES and loop.eval_peak_bytes < H100_BYTES,
                f"peak allocated: training {loop.train_peak_bytes / 2**30:.1f} GiB, validation "
                f"{loop.eval_peak_bytes / 2**30:.1f} GiB; an H100 has 80")
        return (f"peak allocated in the timed loop: training {loop.train_peak_bytes / 2**30:.1f} GiB, validation "
                f"{loop.eval_peak_bytes / 2**30:.1f} GiB (reserved {loop.reserved_bytes / 2**30:.1f} GiB); "
                f"fits an 80 GB H100")

    def check_memory_plan(self):
        """tools/plan_memory.py's prediction (eager accounting, meant as an upper bound of the compiled run) against
        the timed loop's measured peaks."""
        loop, hp = self.timed_loop(), self.hp
        plan = plan_memory.MemoryPlan(hp, 1)
        predicted = plan.piece_figures(plan.largest_piece(hp.micro_batch_tokens))["peak"]
        _, predicted_eval = plan.validation_figures(hp.micro_batch_tokens)
        line = (f"training: predicted {predicted / 2**30:.2f} GiB, measured {loop.train_peak_bytes / 2**30:.2f} GiB "
                f"({loop.train_peak_bytes / predicted:.2f}x); validation: predicted {predicted_eval / 2**30:.2f} GiB, "
                f"measured {loop.eval_peak_bytes / 2**30:.2f} GiB ({loop.eval_peak_bytes / predicted_eval:.2f}x)")
        require(loop.train_peak_bytes <= predicted and loop.eval_peak_bytes <= predicted_eval, line)
        return line

    def check_host_syncs(self):
        self.timed_loop()
        trainer = self.trainer()
        # CPU: the tiled attention reads the window of each kind of mask on the host per micro-step
        # (tests/test_step_syncs.py)
        expected = 0 if self.device.type == "cuda" else len(trainer.model.attention_kinds()) * trainer.accum
        counts = [count_host_syncs(trainer, step) for step in (trainer.total_steps - 2, trainer.total_steps - 1)]
        require(all(n == expected for n, _ in counts),
                f"host syncs per train_step {[n for n, _ in counts]}, documented {expected}: {counts}")
        return f"{expected} in each of two train_steps (with and without DistAdam; documented {expected}); {counts[0][1]}"

    def eager_reference_graphs(self):
        """The FP8 head's compiled forward helper once more: the eager reference runs without gradients, and
        its inputs' requires_grad is part of the helper's guards (counted unless --fp8 off)."""
        n = micro_batch_tokens(self.hp)
        return [("fp8", f"the FP8 head's forward at {n:,} tokens without gradients")] if self.hp.fp8 != "off" else []

    def check_compiled_vs_eager(self):
        """The training forward (compiled on CUDA) against an eager one with the other attention
        implementation: tiled SDPA on CUDA, eager FlexAttention on the CPU. After the timed loop: at
        initialization the attention and MLP outputs are zero (zero output projections), so the
        comparison would miss them."""
        self.timed_loop()
        trainer = self.trainer()
        model, hp = trainer.model, self.hp
        model.train()
        batch = trainer.loader.next_batch(tg.tokens_per_rank(max(hp.batch_sizes), trainer.world_size, trainer.accum),
                                          hp.max_seq_len)
        plan = trainer.schedule.at(trainer.total_steps - 1)  # the rotary follows its windows now
        tokens = batch.inputs.numel()
        args = (batch.inputs, batch.targets, batch.cu_seqlens, plan.window_tensor, batch.bigram_ids, plan.mtp_weights)
        compiled = trainer.forward(*args).item() / tokens  # with gradients on: the training graph itself
        other = tg.TiledWindowAttention() if self.device.type == "cuda" else tg.FlexWindowAttention()
        with torch.random.fork_rng(devices=[]):  # (its initialization is overwritten; the run's RNG stays)
            eager_model = tg.GPT(hp, trainer.backend._replace(attention=other), self.device).train()
        eager_model.load_state_dict(model.state_dict())
        if eager_model.mlp_in_fp8:  # the FP8 copies of these weights, at the loaded scales
            eager_model.refresh_fp8_mlp()
        start = time.perf_counter()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
            eager = eager_model(*args).item() / tokens
        del eager_model
        if self.eager_reference_graphs():
            report_compile(self.device, self.eager_reference_graphs(), time.perf_counter() - start)
        require(abs(compiled - eager) < 5e-3, f"loss/token compiled {compiled:.5f}, eager {eager:.5f}")
        what = "compiled, FlexAttention" if trainer.forward is not model else "eager (CPU), tiled attention"
        other = "eager, tiled attention" if self.device.type == "cuda" else "eager FlexAttention"
        return f"loss/token {what} {compiled:.5f}, {other} {eager:.5f} (|diff| {abs(compiled - eager):.1e})"


# ---------------------------------------------------------------------------------------------- independent checks

def versions(device):
    line = (f"python {sys.version.split()[0]}, torch {torch.__version__}, cuda {torch.version.cuda}, "
            f"triton {tg.triton.__version__ if tg.HAS_TRITON else 'none'}")
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        line += (f"; {props.name}, capability {props.major}.{props.minor}, {props.total_memory / 2**30:.0f} GiB, "
                 f"FP8 {tg.fp8_supported(device)}")
    return line


def head_inputs(device, size):
    tokens, dim, vocab = size.head
    g = torch.Generator(device=device).manual_seed(1)
    x = (torch.randn(tokens, dim, device=device, generator=g) * 1.5).bfloat16()
    w = (torch.randn(vocab, dim, device=device, generator=g) * 0.005).bfloat16()
    return x, w, torch.randint(0, vocab, (tokens,), device=device, generator=g)


# the record's head in training: its FP8 scales (one micro-step per step) and its softcap as the GPU runs it
HEAD_FP8_SCALES = tg.head_fp8_scales(RECORD_HP.head_fp8_amax)
HEAD_SOFTCAP = tg.Softcap(RECORD_HP.softcap_scale, RECORD_HP.softcap_offset, round_sigmoid=True)


def head_step(x, w, targets, fp8):
    """The head's forward and backward from fresh leaves, in FP8 or bf16: (loss, grad x, grad w)."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = tg.softcap_cross_entropy(x, w, targets, True, HEAD_FP8_SCALES if fp8 else None, HEAD_SOFTCAP)
    loss.backward()
    return loss, x.grad, w.grad


def check_fp8_head(device, size):
    """The FP8 head against the bf16 head at the record's micro-batch shape: loss and both gradients."""
    x, w, targets = head_inputs(device, size)
    (l16, gx16, gw16), (l8, gx8, gw8) = (head_step(x, w, targets, fp8) for fp8 in (False, True))
    tokens, dim, vocab = size.head
    l16, l8 = l16.item() / tokens, l8.item() / tokens
    cx, cw = cosine(gx8.float(), gx16.float()), cosine(gw8.float(), gw16.float())
    detail = (f"{tokens:,}x{dim} @ {vocab:,}: loss/token bf16 {l16:.5f} fp8 {l8:.5f}; gradient cosine x {cx:.4f} "
              f"w {cw:.4f}")
    require(cx > 0.99 and cw > 0.99 and abs(l8 - l16) < 1e-2, detail)
    # mm_fp8_backward forms grad_w as (x.T @ g).T, the faster orientation for the (50304, 768) head
    require(gw8.stride() == (1, vocab) or gw8.is_contiguous(), f"grad w strides {gw8.stride()}")
    return detail


@functools.cache
def compiled_head_loss(fp8):
    """The head and its loss under torch.compile, as the training step runs them inside the model's
    compiled forward (and its backward through AOTAutograd): FP8 (FP8SoftcapLoss) or bf16 (softcap
    and cross-entropy)."""
    scales = HEAD_FP8_SCALES if fp8 else None

    def loss(x, w, targets):
        return tg.softcap_cross_entropy(x, w, targets, True, scales, HEAD_SOFTCAP)
    return torch.compile(loss, dynamic=False)


def compiled_head_step(x, w, targets, fp8):
    """head_step through compiled_head_loss: (loss, grad x, grad w)."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = compiled_head_loss(fp8)(x, w, targets)
    loss.backward()
    return loss, x.grad, w.grad


def report_fp8_speed(device, size):
    """Both heads compiled, as training runs them (an eager FP8 loss runs its fp32 row blocks
    unfused, which says nothing of FP8): the first calls compile (timed apart), then the median."""
    x, w, targets = head_inputs(device, size)
    start = time.perf_counter()
    for fp8 in (False, True):
        compiled_head_step(x, w, targets, fp8)
    synchronize(device)
    report_compile(device, fp8_speed_graphs(size), time.perf_counter() - start)
    ms = {fp8: median_ms(lambda fp8=fp8: compiled_head_step(x, w, targets, fp8), device,
                         size.timing_repeats)
          for fp8 in (False, True)}
    return (f"head forward+backward at {size.head[0]:,} tokens, compiled: bf16 {ms[False]:.2f} ms, "
            f"FP8 {ms[True]:.2f} ms (FP8 / bf16 = {ms[True] / ms[False]:.2f})")


def fp8_speed_graphs(size):
    tokens = size.head[0]
    return [("fp8", f"the bf16 head and loss as training compiles them, at {tokens:,} tokens"),
            ("fp8", "their backward"),
            ("fp8", f"the FP8 head and fused loss as training compiles them, at {tokens:,} tokens"),
            ("fp8", "their backward")]


def polar_input(device, size):
    dim = size.hp().model_dim
    g = torch.Generator(device=device).manual_seed(0)
    return torch.randn(size.polar_stack, 4 * dim, dim, device=device, generator=g)  # a stack of MLP matrices


def check_polar_express_triton(device, size):
    """Polar Express through the Triton kernels against the torch path and an fp32 reference."""
    G = polar_input(device, size)
    dtype, _ = KERNEL_PRECISION[device.type]
    out_triton = tg.polar_express(G, use_triton=True, dtype=dtype)
    out_torch = tg.polar_express(G, use_triton=False, dtype=dtype)
    reference = tg.polar_express(G, use_triton=False, dtype=torch.float32)
    errors = relative_error(out_triton, out_torch), relative_error(out_triton, reference), relative_error(out_torch, reference)
    tolerance = 5e-2 if dtype == torch.bfloat16 else 1e-4
    detail = (f"{tuple(G.shape)} {str(dtype).removeprefix('torch.')}: relative difference Triton-torch {errors[0]:.2e}, "
              f"against fp32: Triton {errors[1]:.2e}, torch {errors[2]:.2e}")
    require(out_triton.shape == G.shape and out_triton.dtype == dtype, f"{out_triton.shape} {out_triton.dtype}")
    require(max(errors) < tolerance, detail)
    return detail


def polar_flops(batch, rows, cols, steps=len(tg.POLAR_EXPRESS_COEFFS)):
    """Per step on the wide orientation (m <= n): X Xᵀ 2m²n (full count, though the kernel does half),
    bA + cA² 2m³, aX + BX 2m²n."""
    m, n = min(rows, cols), max(rows, cols)
    return batch * steps * (2 * m * m * n + 2 * m ** 3 + 2 * m * m * n)


def report_triton_speed(device, size):
    """The ratio only: the half-FLOP Triton kernels against cuBLAS plus launch overhead can go either way."""
    G = polar_input(device, size)
    ms = {triton: median_ms(lambda triton=triton: tg.polar_express(G, use_triton=triton), device, size.timing_repeats)
          for triton in (True, False)}
    flops = polar_flops(*G.shape)
    return (f"polar_express {tuple(G.shape)} bf16: Triton {ms[True]:.3f} ms ({flops / ms[True] / 1e9:.0f} TFLOP/s), "
            f"torch {ms[False]:.3f} ms ({flops / ms[False] / 1e9:.0f} TFLOP/s); Triton / torch = {ms[True] / ms[False]:.2f}")


def symmetric_kernel_errors(config, shape, device):
    """Max |Triton - torch| / max |torch| of both symmetric-product kernels with one tile configuration
    (fp32 torch references), and the device's tolerance."""
    dtype, tolerance = KERNEL_PRECISION[device.type]
    X = torch.randn(*shape, generator=torch.Generator().manual_seed(2)).to(device)
    A = tg.xxt_torch(X)
    A = A / A.norm()
    pairs = ((tg.xxt_triton(X.to(dtype), config=config), tg.xxt_torch(X)),
             (tg.ba_plus_caa_triton(A.to(dtype), -2.8, 0.5, config=config), tg.ba_plus_caa_torch(A, -2.8, 0.5)))
    return [((out.float() - ref).abs().max() / ref.abs().max()).item() for out, ref in pairs], tolerance


def check_tile_configs(device, size):
    """Every tile configuration the autotuner may pick computes both products (a wrong one would be
    picked if it were the fastest)."""
    worst = {}
    for config in tg.SYM_CONFIGS:
        errors, tolerance = symmetric_kernel_errors(config, size.tile_shape, device)
        require(max(errors) <= tolerance, f"tile config {config}: errors (XXᵀ, bA+cA²) {errors}, tolerance {tolerance}")
        worst[config] = max(errors)
    return f"{len(worst)} configurations at {size.tile_shape}: worst error {max(worst.values()):.1e} (tolerance {tolerance})"


def naive_attention(q, k, v, docs, window, scale):
    """Inclusive window: q - kv <= window (FlashAttention's window_size=(window, 0))."""
    pos = torch.arange(q.size(0), device=q.device)
    delta = pos[:, None] - pos[None, :]
    allowed = (docs[:, None] == docs[None, :]) & (delta >= 0) & (delta <= window)
    scores = (torch.einsum("thd,shd->hts", q.float(), k.float()) * scale).masked_fill(~allowed, float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v.float())


def kernel_order_loss(logits, targets, weights, softcap, grad_total, grad_s, sigmoid=None):
    """Record #89's loss kernel's loss sums (one a horizon, float64) and e5m2 logit gradient, as a
    float64 formula of its order of rounding: the sigmoid rounded to bf16 (as the kernel stores it)
    and that value used for the softmax and the slope, dz = p sum_k w_k - sum_k w_k onehot(t + k)
    over the horizons inside the rows, the gradient grad_total (scale / width) / grad_s dz s (1 - s)
    formed unrounded and cast once to e5m2 (saturating). `sigmoid`: a kernel's own s of each logit
    (its float64 values) instead of the exact sigmoid."""
    s = sigmoid
    if s is None:
        s = torch.sigmoid((logits.double() + softcap.offset) / tg.SOFTCAP_WIDTH)
        if softcap.round_sigmoid:
            s = s.bfloat16().double()
    z = softcap.scale * s
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    probs = torch.exp(z - lse)
    n, weights = logits.size(0), [float(w) for w in weights]
    count = torch.tensor([sum(w for k, w in enumerate(weights) if t + k < n) for t in range(n)], dtype=torch.float64)
    dz = probs * count.to(logits.device)[:, None]
    sums = []
    for k, w in enumerate(weights):
        rows = torch.arange(n - k, device=logits.device)
        dz[rows, targets[k:]] -= w
        sums.append((lse[rows, 0] - z[rows, targets[k:]]).sum())
    g = grad_total * softcap.scale / tg.SOFTCAP_WIDTH / grad_s * dz * s * (1 - s)
    return torch.stack(sums), g.clamp(-tg.E5M2_MAX, tg.E5M2_MAX).to(torch.float8_e5m2)


def kernel_order_logit_grad(logits, targets, weights, softcap, grad_total, grad_s):
    """kernel_order_loss's e5m2 gradient of the exact sigmoid."""
    return kernel_order_loss(logits, targets, weights, softcap, grad_total, grad_s)[1]


FUSED_LOSS_CHECK_ROWS = 1024  # rows of the fused loss check: its float64 formula holds (rows, vocab) in float64


def check_fused_fp8_loss(device, size):
    """The fused FP8 loss's e5m2 logit gradient (softcap_loss_grad; compiled on CUDA, as training fuses it)
    against the float64 formula of record #89's kernel's order of rounding, on random logits at the record's
    vocabulary, softcap, MTP weights and gradient scale. Error model (tests/test_fused_loss.py): fp32 against
    float64 flips an e5m2 entry where its value lies within ~1e-6 relative of a tie (~2e-5 of the entries);
    the order of rounding before issue 39 differed in ~1.3 %."""
    rows, vocab = min(FUSED_LOSS_CHECK_ROWS, size.head[0]), size.head[2]
    g = torch.Generator(device=device).manual_seed(3)
    logits = (torch.randn(rows, vocab, device=device, generator=g) * 6).bfloat16()
    targets = torch.randint(0, vocab, (rows,), device=device, generator=g)
    weights = torch.tensor(RECORD_HP.mtp_weights_start[:tg.MTP_HORIZON], device=device)  # stage 1: 1, 0.5, 0.25
    grad_total, grad_s = torch.ones((), device=device), HEAD_FP8_SCALES[2]
    grad = tg.compiled(tg.softcap_loss_grad) if device.type == "cuda" else tg.softcap_loss_grad
    start = time.perf_counter()
    got = grad(logits, targets, weights, HEAD_SOFTCAP, 0, rows, grad_total, grad_s)
    synchronize(device)
    report_compile(device, fused_loss_graphs(size), time.perf_counter() - start)
    want = kernel_order_logit_grad(logits, targets, weights, HEAD_SOFTCAP, 1.0, grad_s)
    differ = (got != want).float().mean().item()
    zeros = (want.float() == 0).float().mean().item()
    detail = (f"{rows:,}x{vocab:,} logits: {differ:.1e} of the e5m2 logit-gradient entries differ from the kernel's "
              f"order in float64 ({zeros:.1%} underflow to 0 in both)")
    require(differ < 1e-3 and zeros < 0.5, detail)
    if not fused_loss_op_skip(device):
        detail += "; " + check_fused_loss_op(logits, targets, weights, grad_total, grad_s, device)
    return detail


# rows of the fused loss op's check under Triton's interpreter (a CPU runs each row's program in
# Python)
FUSED_LOSS_INTERPRETED_ROWS = 32


def fused_loss_op_skip(device):
    """Why fp8_kernels.py's loss op cannot run on `device` ('' when it can: Triton on CUDA, or its
    interpreter on a CPU)."""
    if not tg.HAS_TRITON:
        return "no Triton here"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "Triton's interpreter is off (TRITON_INTERPRET=1 runs it on a CPU)"
    return ""


def e5m2_steps_apart(a, b):
    """How many e5m2 values apart each pair of entries of two e5m2 tensors is (0: equal)."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e5m2).float()
    order = values[torch.isfinite(values)].unique().to(a.device)
    a, b = (torch.searchsorted(order, t.float().flatten().contiguous()) for t in (a, b))
    return (a - b).abs()


# tanh.approx.f32's largest relative error (PTX ISA), the loss kernel's tanh on CUDA
TANH_APPROX_ERROR = 2.0 ** -11


def kernel_sigmoid_bound(logits, softcap):
    """How far the loss kernel's s may be from the exact sigmoid sigma, a = (x + offset) / width:
    0.5 |2 sigma - 1| 2^-11 (its 0.5 + 0.5 tanh(a / 2), tanh.approx.f32 on CUDA) + 5u |a|
    sigma (1 - sigma) (the argument's roundings) + 8u, and half a bf16 step of s with round_sigmoid
    (at most 2^-8 s), u = 2^-24."""
    a = (logits.double() + softcap.offset) / tg.SOFTCAP_WIDTH
    sigma, u = torch.sigmoid(a), 2.0 ** -24
    bound = 0.5 * (2 * sigma - 1).abs() * TANH_APPROX_ERROR + 5 * u * a.abs() * sigma * (1 - sigma)
    return sigma, bound + 8 * u + (2.0 ** -8 * (sigma + bound) if softcap.round_sigmoid else 0.0)


def check_fused_loss_op(logits, targets, weights, grad_total, grad_s, device):
    """fp8_kernels.py's speedrun::softcap_loss (the GPU path's fused loss) against the float64
    formula of its order of rounding from its own sigmoids (its 0.5 + 0.5 tanh(a / 2) with
    tanh.approx.f32 on CUDA, record #89's, which no torch op computes; launch_softcap_sigmoid gives
    them). Error model (docs/fp8-kernels.md): its sigmoids within kernel_sigmoid_bound of the exact
    one; the gradient's entries as the float64 formula's except where fp32 (and the kernel's
    fast-math exp and log) flip an e5m2 rounding near a midpoint (< 1e-3 of the entries); each loss
    sum within (n + 2) u of itself (fp32 sums of n non-negative terms) plus per term (V + 8 (2 scale
    + log V) + 8) u (the lse's sum of V exps, its log, z's roundings), u = 2^-24. The torch path
    (exact sigmoid) is reported beside it."""
    rows = logits.size(0) if device.type == "cuda" else FUSED_LOSS_INTERPRETED_ROWS
    logits, targets, vocab = logits[:rows], targets[:rows], logits.size(1)
    kernels = tg.load_companion("fp8_kernels.py")
    sums, grad = kernels.softcap_loss(logits, targets, weights, None, *HEAD_SOFTCAP,
                                      tg.SOFTCAP_WIDTH, grad_total, grad_s)
    s = kernels.launch_softcap_sigmoid(logits, HEAD_SOFTCAP.offset, HEAD_SOFTCAP.round_sigmoid,
                                       tg.SOFTCAP_WIDTH).double()
    sigma, s_bound = kernel_sigmoid_bound(logits, HEAD_SOFTCAP)
    s_ratio = ((s - sigma).abs() / s_bound).max().item()
    want_sums, want = kernel_order_loss(logits, targets, weights, HEAD_SOFTCAP, 1.0, grad_s, s)
    _, torch_grad = tg.softcap_loss_blocks(logits, targets, weights, HEAD_SOFTCAP, None,
                                           grad_total, grad_s)
    u, scale = 2.0 ** -24, HEAD_SOFTCAP.scale
    per_term = (vocab + 8 * (2 * scale + math.log(vocab)) + 8) * u
    bound = (rows + 2) * u * want_sums + rows * per_term
    sum_ratio = ((sums.double() - want_sums).abs() / bound).max().item()
    differ = (grad != want).float().mean().item()
    steps = e5m2_steps_apart(grad, want).max().item()
    differ_torch = (grad != torch_grad).float().mean().item()
    detail = (f"the op at {rows:,} rows: its sigmoids' error / bound {s_ratio:.2f}; loss sums' "
              f"error / bound {sum_ratio:.2f}; gradient entries differing from float64 of its "
              f"sigmoids {differ:.1e} (at most {steps} e5m2 step), from the torch path (exact "
              f"sigmoid) {differ_torch:.1e}")
    require(s_ratio <= 1 and sum_ratio <= 1 and steps <= 1 and differ < 1e-3, detail)
    return detail


def report_fused_loss_speed(device, size):
    """The fused loss op against the torch path (softcap_loss_blocks) compiled as training compiles
    it, at the head check's tokens: the first calls compile (timed apart), then the medians."""
    rows, vocab = size.head[0], size.head[2]
    g = torch.Generator(device=device).manual_seed(4)
    logits = (torch.randn(rows, vocab, device=device, generator=g) * 6).bfloat16()
    targets = torch.randint(0, vocab, (rows,), device=device, generator=g)
    weights = torch.tensor(RECORD_HP.mtp_weights_start[:tg.MTP_HORIZON], device=device)
    grad_total, grad_s = torch.ones((), device=device), HEAD_FP8_SCALES[2]
    kernels = tg.load_companion("fp8_kernels.py")
    blocks = torch.compile(tg.softcap_loss_blocks)
    runs = (lambda: kernels.softcap_loss(logits, targets, weights, None, *HEAD_SOFTCAP,
                                         tg.SOFTCAP_WIDTH, grad_total, grad_s),
            lambda: blocks(logits, targets, weights, HEAD_SOFTCAP, None, grad_total, grad_s))
    start = time.perf_counter()
    for run in runs:
        run()
    synchronize(device)
    report_compile(device, fused_loss_speed_graphs(size), time.perf_counter() - start)
    fused, unfused = (median_ms(run, device, size.timing_repeats) for run in runs)
    gb = rows * vocab * 3 / 1e9  # one read of the bf16 logits, one e5m2 write
    return (f"fused FP8 loss at {rows:,} x {vocab:,} logits: op {fused:.3f} ms ({gb / fused:.0f} "
            f"TB/s of one read and one write), torch path compiled {unfused:.3f} ms (op / torch "
            f"{fused / unfused:.2f})")


def fused_loss_speed_graphs(size):
    return [("fp8", f"the fused FP8 loss's torch path (softcap_loss_blocks) at "
                    f"{size.head[0]:,} rows")]


def fused_loss_graphs(size):
    rows = min(FUSED_LOSS_CHECK_ROWS, size.head[0])
    return [("fp8", f"the fused FP8 loss's logit gradient at {rows:,} rows"),
            ("triton", "the fused loss op's kernel (fp8_kernels.py)"),
            ("triton", "the fused loss op's sigmoid on its own (fp8_kernels.py)")]


class MatmulDtypes(TorchDispatchMode):
    """The input dtypes of every matmul (mm, addmm, bmm) run inside it."""

    MATMULS = {"aten.mm.default", "aten.addmm.default", "aten.bmm.default"}

    def __init__(self):
        super().__init__()
        self.dtypes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in self.MATMULS:
            self.dtypes.append(tuple(a.dtype for a in args if isinstance(a, torch.Tensor)))
        return func(*args, **(kwargs or {}))


def check_mlp_weight_gradients(device, size):
    """Record #89's FP8 MLP backward (FP8ReluSquareMLP) at one micro-batch: every matmul of it takes bf16
    operands (issue 30: its weight gradients ran as fp32 GEMMs), and its weight gradients agree with float64
    products of the same bf16 operands. Error model per entry: the bf16 output's rounding (2^-8 of it: 8
    significant bits) plus fp32 accumulation over the K tokens, K 2^-24 |A|^T |B|, and on CUDA, where torch
    lets cuBLAS reduce split-K partial sums in bf16 (allow_bf16_reduced_precision_reduction), 2^-8 |A|^T |B|
    more. An FP8 operand (2^-4) or a bf16 accumulator over K would exceed it."""
    tokens, dim, _ = size.head
    hidden = 4 * dim
    g = torch.Generator(device=device).manual_seed(4)
    x = torch.randn(tokens, dim, device=device, generator=g).bfloat16().requires_grad_()
    w1 = (torch.randn(hidden, dim, device=device, generator=g) * dim ** -0.5).requires_grad_()
    w2 = (torch.randn(hidden, dim, device=device, generator=g) * hidden ** -0.5).requires_grad_()
    mlp = tg.FP8MLPWeights(1, hidden, dim).to(device)
    mlp.quantize([SimpleNamespace(fc_w=w1, proj_w=w2)], bootstrap=True)
    out = mlp(0, x, w1, w2)
    _, _, _, pre, post = out.grad_fn.saved_tensors
    grad_out = torch.randn(out.shape, device=device, generator=g).bfloat16()
    with MatmulDtypes() as matmuls:
        out.backward(grad_out)
    require(matmuls.dtypes and all(d == torch.bfloat16 for dtypes in matmuls.dtypes for d in dtypes),
            f"the MLP backward's matmuls take {matmuls.dtypes}, not bf16 alone")
    grad_pre = 2 * (grad_out @ w2.detach().T.bfloat16()) * torch.relu(pre)  # as the backward forms it, in bf16
    ratios = []
    for got, a, b in ((w1.grad, grad_pre, x.detach()), (w2.grad, post, grad_out)):
        want = a.double().T @ b.double()
        accumulation = tokens * 2.0 ** -24 + (2.0 ** -8 if device.type == "cuda" else 0)
        bound = 2.0 ** -8 * want.abs() + 1.01 * accumulation * (a.double().abs().T @ b.double().abs())
        ratios.append(((got.double() - want).abs() / bound).max().item())
    detail = (f"{tokens:,} tokens, {dim} -> {hidden}: {len(matmuls.dtypes)} bf16 matmuls; weight-gradient error / "
              f"bound dW1 {ratios[0]:.2f}, dW2 {ratios[1]:.2f}")
    require(max(ratios) <= 1, detail)
    return detail


# The FP8 tensor cores' accumulation within one K tile (the fused kernel and cuBLAS both promote to
# fp32 every 128 products): about 14 bits kept (DeepSeek-V3 technical report, 2024, section 3.3.2,
# on H800), taken as 2^-13 of the tile's sum of |products|
FP8_TILE_ACCUMULATION = 2.0 ** -13


def fused_mlp_cpu_skip():
    """Why the fused FP8 MLP's kernels cannot run on this CPU ('' when they can: Triton's
    interpreter with FP8 dots)."""
    if not tg.HAS_TRITON:
        return "no Triton here"
    if not tg.load_companion("fp8_kernels.py").interpreter_computes_fp8():
        return (f"Triton {sys.modules['triton'].__version__}'s interpreter (TRITON_INTERPRET=1) "
                f"does not compute FP8 dots")
    return ""


def fused_mlp_inputs(device, size):
    """The FP8 MLP's operands at the head check's tokens: x and W1 in e4m3 with their
    dequantization scale, 1 / act_scale (the model's headroom over this post's amax), the gradient
    and W2 in bf16."""
    tokens, dim, _ = size.head
    hidden = 4 * dim
    g = torch.Generator(device=device).manual_seed(5)
    x = torch.randn(tokens, dim, device=device, generator=g)
    w1 = torch.randn(hidden, dim, device=device, generator=g) * dim ** -0.5
    x_scale, w1_scale = x.abs().amax() / 448, w1.abs().amax() / 448
    x_f8, w1_f8 = ((t / s).to(torch.float8_e4m3fn) for t, s in ((x, x_scale), (w1, w1_scale)))
    dequant = x_scale * w1_scale
    post_amax = (x_f8.float() @ w1_f8.float().T * dequant).clamp(min=0).amax() ** 2
    inv_act_scale = 448 / (post_amax * tg.FP8MLPWeights.ACT_HEADROOM)
    grad_out = torch.randn(tokens, dim, device=device, generator=g).bfloat16()
    w2 = (torch.randn(hidden, dim, device=device, generator=g) * hidden ** -0.5).bfloat16()
    return x_f8, w1_f8, dequant, inv_act_scale, grad_out, w2


def unfused_up(x_f8, w1_f8, dequant):
    """FP8ReluSquareMLP.forward's unfused up projection."""
    return torch._scaled_mm(x_f8, w1_f8.T, scale_a=dequant, scale_b=dequant.new_ones(()),
                            out_dtype=torch.bfloat16)


def unfused_epilogue(pre, inv_act_scale):
    """FP8ReluSquareMLP.forward's unfused post, post_f8 and post's amax."""
    post = torch.relu(pre).square()
    return post, (post.float() * inv_act_scale).clamp(max=448).to(torch.float8_e4m3fn), post.amax()


def unfused_grad(grad_out, w2, pre):
    return 2 * (grad_out @ w2.T) * torch.relu(pre)


def fp32_sum_error(k):
    """Bound on |an fp32 sum of k products - the exact sum| / the sum of |products|."""
    return k * 2.0 ** -24


def rounded_bound(exact, delta):
    """Bound on |bf16(y) - exact| where |y - exact| <= delta: half a bf16 step (2^-8, 8 significant
    bits) of |y| <= |exact| + delta, plus delta."""
    return 2.0 ** -8 * (exact.abs() + delta) + delta


def worst_ratio(got, exact, bound):
    return ((got.double() - exact).abs() / bound.clamp(min=2.0 ** -133)).max().item()


def check_fused_mlp(device, size):
    """fp8_kernels.py's ops against the unfused path (FP8ReluSquareMLP's torch ops). The
    epilogue is exact: post, post_f8 and the tile maxima are the torch ops' of the fused pre, bit
    for bit. The GEMMs differ by accumulation order, so both paths are held to one error model
    against float64 products of the same operands: pre is a bf16 rounding of a sum within
    (fp32_sum_error(K + 1): the sums and the scale; on CUDA FP8_TILE_ACCUMULATION more) S,
    S = |x_f8| |W1_f8|^T dequant; the gradient of pre is bf16(2 t relu(pre)), t a bf16 rounding of
    a sum within fp32_sum_error(K) S_t (on CUDA 2^-8 S_t more: cuBLAS may reduce split-K sums in
    bf16), S_t = |grad_out| |W2|^T. A wrong kernel's error of a bf16 step is outside it."""
    kernels = tg.load_companion("fp8_kernels.py")
    x_f8, w1_f8, dequant, inv_act, grad_out, w2 = fused_mlp_inputs(device, size)
    k, on_cuda = x_f8.shape[1], device.type == "cuda"
    pre, post, post_f8, tile_max = kernels.up_relu_square(x_f8, w1_f8, dequant, inv_act)
    want_post, want_f8, want_amax = unfused_epilogue(pre, inv_act)
    require(torch.equal(post, want_post) and torch.equal(post_f8.view(torch.uint8),
                                                         want_f8.view(torch.uint8)),
            "the fused epilogue's post or post_f8 differs from relu(pre)^2 and its e4m3 copy")
    top = tile_max.amax().clamp(min=0)
    require((top * top).bfloat16() == want_amax,
            f"the tile maxima {top} against post's amax {want_amax}")
    ref = unfused_up(x_f8, w1_f8, dequant)
    a, b = x_f8.double(), w1_f8.double()
    exact = a @ b.T * dequant.double()
    sums = a.abs() @ b.abs().T * dequant.double()
    bound = rounded_bound(exact, (fp32_sum_error(k + 1) + FP8_TILE_ACCUMULATION * on_cuda) * sums)
    ratios = [worst_ratio(p, exact, bound) for p in (pre, ref)]
    got, want = kernels.relu_square_grad(grad_out, w2, pre), unfused_grad(grad_out, w2, pre)
    g, w = grad_out.double(), w2.double()
    t = g @ w.T
    twice_relu = 2 * torch.relu(pre.double())
    t_error = twice_relu * rounded_bound(t, (fp32_sum_error(k) + 2.0 ** -8 * on_cuda)
                                         * (g.abs() @ w.abs().T))
    bound = rounded_bound(twice_relu * t, t_error)
    ratios += [worst_ratio(p, twice_relu * t, bound) for p in (got, want)]
    differ = [(a != b).double().mean().item() for a, b in ((pre, ref), (got, want))]
    detail = (f"{x_f8.shape[0]:,} tokens, {k} -> {w1_f8.shape[0]}: epilogue exact; error / bound "
              f"against float64, fused and unfused: pre {ratios[0]:.2f}, {ratios[1]:.2f}; grad "
              f"{ratios[2]:.2f}, {ratios[3]:.2f} (entries differing {differ[0]:.1e}, "
              f"{differ[1]:.1e})")
    require(max(ratios) <= 1, detail)
    return detail


def unfused_forward(x_f8, w1_f8, dequant, inv_act_scale):
    return unfused_epilogue(unfused_up(x_f8, w1_f8, dequant), inv_act_scale)


def report_fused_mlp_speed(device, size):
    """The fused ops against the unfused path compiled as training compiles it (_scaled_mm, then one
    kernel for relu^2, the e4m3 copy and the amax; the bf16 GEMM, then 2 t relu(pre)): the first
    calls compile (timed apart), then the medians."""
    x_f8, w1_f8, dequant, inv_act, grad_out, w2 = fused_mlp_inputs(device, size)
    pre = unfused_up(x_f8, w1_f8, dequant)
    kernels = tg.load_companion("fp8_kernels.py")
    up_args = (x_f8, w1_f8, dequant, inv_act)
    runs = {"up": (lambda: kernels.up_relu_square(*up_args),
                   functools.partial(torch.compile(unfused_forward), *up_args)),
            "grad": (lambda: kernels.relu_square_grad(grad_out, w2, pre),
                     functools.partial(torch.compile(unfused_grad), grad_out, w2, pre))}
    start = time.perf_counter()
    for fused, unfused in runs.values():
        fused(), unfused()
    synchronize(device)
    report_compile(device, fused_mlp_speed_graphs(size), time.perf_counter() - start)
    ms = {(name, i): median_ms(fn, device, size.timing_repeats)
          for name, pair in runs.items() for i, fn in enumerate(pair)}
    return (f"FP8 MLP at {x_f8.shape[0]:,} tokens, {x_f8.shape[1]} -> {w1_f8.shape[0]}: up "
            f"projection with relu^2 fused {ms['up', 0]:.3f} ms, unfused {ms['up', 1]:.3f} ms; "
            f"relu^2 gradient fused {ms['grad', 0]:.3f} ms, unfused {ms['grad', 1]:.3f} ms "
            f"(fused / unfused {ms['up', 0] / ms['up', 1]:.2f}, {ms['grad', 0] / ms['grad', 1]:.2f})")


def fused_mlp_graphs(size):
    return [("triton", f"the fused FP8 MLP's up projection kernel at {size.head[0]:,} tokens"),
            ("triton", "its relu^2 gradient kernel")]


def fused_mlp_speed_graphs(size):
    return [("fp8", f"the unfused FP8 MLP up projection and epilogue at {size.head[0]:,} tokens"),
            ("fp8", "the unfused relu^2 gradient")]


def check_attention_vs_naive(device, size):
    """The device's attention (a compiled FlexAttention kernel on CUDA: the block-sparse kernel; tiled SDPA
    on the CPU) against a naive masked softmax, forward and backward, for packed documents (one of a single
    token, one longer than the window) and a length not a multiple of 128."""
    hp, T = size.hp(), size.attention_tokens
    window = hp.window_blocks[-1] * hp.window_block_tokens
    scale = 0.12
    g = torch.Generator(device).manual_seed(T)
    q, k, v = (torch.randn(T, hp.num_heads, hp.head_dim, device=device, generator=g) * s for s in (0.3, 0.3, 1.0))
    cu = torch.tensor([0, 1, T // 10, T // 10 + 1, T // 4, T, T, T], dtype=torch.int32, device=device)
    docs = tg.document_ids(cu, T)
    require(T - T // 4 > window, f"the last document ({T - T // 4} tokens) must be longer than the window ({window})")
    attention = tg.FlexWindowAttention(compile_kernel=True) if device.type == "cuda" else tg.TiledWindowAttention()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    start = time.perf_counter()
    y = attention(*leaves, attention.mask(docs, window), torch.tensor(scale, dtype=torch.float64, device=device))
    gy = torch.randn(y.shape, device=device, generator=g)
    grads = torch.autograd.grad(y, leaves, gy.to(y.dtype))
    synchronize(device)
    report_compile(device, [("flex", f"FlexAttention forward+backward at {T:,} tokens")], time.perf_counter() - start)
    ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
    ref = naive_attention(*ref_leaves, docs, window, scale)
    ref_grads = torch.autograd.grad(ref, ref_leaves, gy)
    errors = [(a.float() - b).abs().max().item() for a, b in zip([y, *grads], [ref, *ref_grads])]
    scales = [b.abs().max().item() for b in [ref, *ref_grads]]
    tolerance = 5e-2 if dtype == torch.bfloat16 else 1e-4  # bf16 in and out; a wrong tile list gives O(1) errors
    detail = (f"T={T:,}, window {window}: max abs error / scale (y, dq, dk, dv) "
              + ", ".join(f"{e:.1e}/{s:.1e}" for e, s in zip(errors, scales)))
    require(all(e <= tolerance * max(s, 1e-3) for e, s in zip(errors, scales)), detail)
    return detail


def run_pytest(device):
    """tests/test_gpu.py and tests/test_kernels.py in a subprocess (on CUDA: the CUDA cases)."""
    marks = ["-m", "not slow"] if device.type == "cuda" else []
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *marks, "tests/test_gpu.py",
                             "tests/test_kernels.py"], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    last = (result.stdout.strip().splitlines() or ["no output"])[-1]
    require(result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:])
    return last


# ---------------------------------------------------------------------------------------------- the plan

@dataclass
class Check:
    name: str
    run: Callable[[], str]
    work_s: tuple  # budget of its own work, (CUDA, CPU) seconds
    graphs: list = field(default_factory=list)  # (kind, description) it compiles on CUDA
    cuda_only: str = ""  # why it needs CUDA: the CPU reports SKIP
    info: bool = False  # a measurement: INFO, never FAIL
    then: Callable[[], None] = None  # runs after it, whatever its outcome
    needs: tuple = ()  # the checks whose work runs first when they have not (the record run's phases)
    cpu_skip: Callable[[], str] = None  # why it cannot run on this CPU ('' when it can): SKIP there

    def skip_reason(self, device):
        """Why it does not run on `device` ('' when it does)."""
        if device.type == "cuda":
            return ""
        if self.cuda_only:
            return f"needs CUDA: {self.cuda_only}"
        return self.cpu_skip() if self.cpu_skip else ""

    def own_budget_s(self, device):
        if device.type != "cuda":
            return 0 if self.skip_reason(device) else self.work_s[1]
        return self.work_s[0] + compile_estimate_s(self.graphs)


class SmokePlan:
    """The checks in order of value: the record model first (its compile counts, speed and memory must not be
    disturbed by anything before it; the one-step check, the training graph's compile, host syncs, memory),
    then the checks that need no trainer, the measurements last. `only` (names) runs those checks alone, in
    this order; a check's budget includes that of the checks it needs that have not run."""

    def __init__(self, device, folder, with_pytest=False, only=None):
        self.device, self.size = device, size_for(device)
        self.record = record = RecordRun(device, self.size, folder)
        d, s = device, self.size
        # what each check compiles on CUDA (the CPU runs eagerly: its plan needs none of it)
        compiles = (lambda make: make()) if device.type == "cuda" else (lambda make: [])
        trained = ("train_steps_move_every_parameter",)
        warm = (*trained, "warm_up")
        timed = (*warm, "compiles_in_timed_loop")
        checks = [
            Check("versions", lambda: versions(d), (10, 1)),
            Check("train_steps_move_every_parameter", record.check_parameters_move, (20, 8),
                  compiles(record.training_graphs)),
            Check("warm_up", record.check_warm_up, (12, 8), compiles(record.validation_graphs), needs=trained),
            Check("compiles_in_timed_loop", record.check_no_compiles_in_timed_loop, (15, 6), needs=warm),
            Check("host_syncs_per_step", record.check_host_syncs, (5, 3), needs=timed),
            Check("memory", record.check_memory, (1, 1), cuda_only="CUDA memory statistics", needs=timed),
            Check("memory_plan", record.check_memory_plan, (5, 1), cuda_only="CUDA memory statistics", needs=timed),
            Check("throughput", record.report_throughput, (1, 1), info=True, needs=timed),
            Check("compiled_vs_eager", record.check_compiled_vs_eager, (5, 4), compiles(record.eager_reference_graphs),
                  then=record.close, needs=timed),
            Check("fp8_head", lambda: check_fp8_head(d, s), (5, 2), compiles(lambda: fp8_head_graphs(record, s))),
            Check("fused_fp8_loss", lambda: check_fused_fp8_loss(d, s), (5, 5),
                  compiles(lambda: fused_loss_graphs(s))),
            Check("mlp_weight_gradients", lambda: check_mlp_weight_gradients(d, s), (5, 2)),
            Check("fused_mlp", lambda: check_fused_mlp(d, s), (5, 2),
                  compiles(lambda: fused_mlp_graphs(s)), cpu_skip=fused_mlp_cpu_skip),
            Check("polar_express_triton", lambda: check_polar_express_triton(d, s), (5, 3),
                  compiles(lambda: polar_check_graphs(record, s))),
            Check("attention_vs_naive", lambda: check_attention_vs_naive(d, s), (10, 3),
                  compiles(lambda: [("flex", f"FlexAttention forward+backward at {s.attention_tokens:,} tokens")])),
            Check("triton_tile_configs", lambda: check_tile_configs(d, s), (20, 5),
                  compiles(lambda: tile_check_graphs(record, s))),
            Check("fp8_speed", lambda: report_fp8_speed(d, s), (5, 1),
                  compiles(lambda: fp8_speed_graphs(s)), info=True,
                  cuda_only="FP8 hardware speed: no FP8 tensor cores on a CPU"),
            Check("triton_speed", lambda: report_triton_speed(d, s), (5, 1), info=True,
                  cuda_only="compiled Triton kernels: the CPU runs them in the interpreter"),
            Check("fused_mlp_speed", lambda: report_fused_mlp_speed(d, s), (5, 1),
                  compiles(lambda: fused_mlp_speed_graphs(s)), info=True,
                  cuda_only="FP8 hardware speed: no FP8 tensor cores on a CPU"),
            Check("fused_loss_speed", lambda: report_fused_loss_speed(d, s), (5, 1),
                  compiles(lambda: fused_loss_speed_graphs(s)), info=True,
                  cuda_only="the fused loss kernel's speed on a GPU"),
        ]
        if with_pytest:  # heavy: its own process runs these checks again, and tests/test_kernels.py
            checks.append(Check("gpu_tests", lambda: run_pytest(d), (60 + sum(c.work_s[0] for c in checks), 120),
                                [g for c in checks for g in c.graphs]))
        self.all_checks = checks
        unknown = sorted(set(only or ()) - {c.name for c in checks})
        if unknown:
            raise ValueError(f"unknown check(s) {', '.join(unknown)}; the checks: {', '.join(c.name for c in checks)}")
        self.checks = [c for c in checks if only is None or c.name in only]
        self.done = set()  # the checks whose work has run (or been tried)
        self.reported = set()  # ids of the errors whose traceback went to stderr

    def check(self, name):
        return next(c for c in self.all_checks if c.name == name)

    def _with_needs(self, check, done):
        """The check and the checks it needs that have not run, in order."""
        return [self.check(n) for n in check.needs if n not in done] + [check]

    def budget_s(self, check=None):
        """Seconds of one check from here (with the work it needs that has not run), or of the whole plan."""
        if check is not None:
            return sum(c.own_budget_s(self.device) for c in self._with_needs(check, self.done))
        return sum(c.own_budget_s(self.device) for c in self._planned())

    def _planned(self):
        """Every check the plan runs, those it needs included, once each."""
        done, planned = set(), []
        for check in self.checks:
            for c in self._with_needs(check, done):
                if c.name not in done:
                    done.add(c.name)
                    planned.append(c)
        return planned

    def graphs(self):
        return [g for c in self._planned() for g in c.graphs]

    def compile_summary(self):
        """"G compiles (T training, ...) and U sizes autotuned" of the plan on CUDA."""
        kinds = [kind for kind, _ in self.graphs()]
        parts = [f"{kinds.count(kind)} {name}" for kind, name in COMPILE_NAMES.items() if kind in kinds]
        compiles = len(kinds) - kinds.count("autotune")
        kinds_text = f" ({', '.join(parts)})" if parts else ""
        return f"{compiles} compiles{kinds_text} and {kinds.count('autotune')} sizes autotuned"

    def plan_line(self):
        on_cuda = self if self.device.type == "cuda" else SmokePlan(
            torch.device("cuda"), None, with_pytest=any(c.name == "gpu_tests" for c in self.all_checks),
            only=[c.name for c in self.checks])
        line = f"plan: {len(self.checks)} checks, {on_cuda.compile_summary()} on CUDA, budget {self.budget_s():.0f} s"
        return line if on_cuda is self else f"{line} (CPU dry run; on CUDA: {on_cuda.budget_s():.0f} s)"

    def skips_here(self, check):
        """A CUDA-only check on the CPU, or one this CPU cannot run."""
        return bool(check.skip_reason(self.device))

    def run(self, check):
        """(status, detail, seconds) of one check: PASS/FAIL, INFO for a measurement, SKIP for a CUDA-only
        check on the CPU; an error is a FAIL with its first line."""
        self.done.update(c.name for c in self._with_needs(check, self.done))
        if self.skips_here(check):
            return "SKIP", check.skip_reason(self.device), 0.0
        start = time.perf_counter()
        try:
            detail, status = check.run(), "INFO" if check.info else "PASS"
        except Exception as e:  # noqa: BLE001 - a smoke test reports every failure and goes on
            if not isinstance(e, CheckFailed) and id(e) not in self.reported:
                self.reported.add(id(e))  # a phase's error fails each check after it: its traceback once
                traceback.print_exception(e, file=sys.stderr)
            first = str(e).splitlines()[0] if str(e) else ""
            detail, status = (first if isinstance(e, CheckFailed) else f"{type(e).__name__}: {first}"), "FAIL"
        finally:
            if check.then is not None:
                check.then()
        return status, detail, time.perf_counter() - start

    def close(self):
        self.record.close()


def added_kernel_graphs(record, sizes):
    """What Polar Express launches at `sizes` ((M, K) of XXᵀ; M of bA + cA² too) compile and autotune beyond
    the training run's: a size not autotuned there is timed again; a specialization not seen there compiles
    every tile configuration."""
    trained = optimizer_compiles(tuple(record.argv))
    specs = trained.triton_specializations()
    tuned = set(trained.autotuned_sizes())
    graphs = []
    for m, n in sizes:
        for kernel, key, ints in (("xxt", (m, n), polar_kernel_ints(m, n)[0]),
                                  ("ba_plus_caa", (m,), polar_kernel_ints(m, m)[1])):
            if triton_specialization(ints) not in specs[kernel]:
                specs[kernel].add(triton_specialization(ints))
                graphs += [("triton", f"Polar Express's {kernel} kernel, tile configuration {config}, at {key}")
                           for config in tg.SYM_CONFIGS]
            if (kernel, key) not in tuned:
                tuned.add((kernel, key))
                graphs.append(("autotune", f"autotuning {kernel} at {key}"))
    return graphs


def fp8_head_graphs(record, size):
    """The FP8 head check's helpers not compiled in training already: a new shape, or the record's 8-GPU
    gradient scale (training on one GPU divides it by the accumulation steps), compiles them again."""
    hp = record.hp
    if hp.fp8 == "off":
        return []
    tokens = size.head[0]
    trained = tg.head_fp8_scales(hp.head_fp8_amax, tg.grad_accum_steps(hp, 1))
    same_shape = tokens in {tg.tokens_per_rank(b, 1, tg.grad_accum_steps(hp, 1)) for b in hp.batch_sizes}
    graphs = []
    if not same_shape or HEAD_FP8_SCALES[:2] != trained[:2]:
        graphs.append(("fp8", f"the FP8 head's forward at {tokens:,} tokens"))
    if not same_shape or HEAD_FP8_SCALES != trained:
        graphs.append(("fp8", f"the FP8 head's backward at {tokens:,} tokens, one micro-step's gradient scale"))
    return graphs


def polar_check_graphs(record, size):
    """The Polar Express check: a stack of MLP matrices, autotuned at their size."""
    dim = size.hp().model_dim
    return added_kernel_graphs(record, [(dim, 4 * dim)])


def tile_check_graphs(record, size):
    """The tile-configuration check launches every configuration with no autotuning: only new binaries."""
    return [g for g in added_kernel_graphs(record, [size.tile_shape]) if g[0] == "triton"]


def check_names():
    return [c.name for c in SmokePlan(torch.device("cpu"), None).checks]
