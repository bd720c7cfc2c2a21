"""Every CUDA compile of the record run, done on a machine with no GPU: behind a faked H100,
Inductor generates the record run's graphs and Triton compiles each kernel for sm_90 with the ptxas
of its wheel. No kernel is loaded or run.

    python tools/cuda_compile_check.py [--only NAME ...] [--list] [--inventory FILE.json|FILE.csv]
                                       [--train-gpt FILE] [--reference LOG]

Run it with the GPU image's versions (torch 2.11.0, Triton 3.6.0: the venv of .ci/run's second leg);
it leans on their private APIs and says so in one line when the running versions differ. The graphs
are the smoke's plan of compiles (tools/smoke_checks.py) at the record's shapes: the training step
(forward and backward, stage 3), the validation forward, the FP8 head's helpers, DistAdam's and
NorMuon's compiled math at 1 and 8 ranks, and Polar Express's Triton kernels at every tile
configuration and specialization. Each graph prints one line (kernels, seconds), each kernel its
shared memory against the H100's limit and ptxas's registers and spills; the last line counts
graphs, kernels and failures. Exit 1 when a compile fails. See docs/cuda-compile-check.md."""

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
import sys
import tempfile
import time
import types
import warnings
from unittest import mock
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
EXPECTED_VERSIONS = {"torch": "2.11.0", "triton": "3.6.0"}
RACE_LOG = (
    ROOT.parent / "shared" / "reference" / "modded-nanogpt_2026-07-17_FP8DownProjection_11cb620c.txt"
)  # tools/gpu_race.py's default
H100_SMEM = 232_448  # shared memory per block (opt-in), bytes
H100_SMS = 132


class DeviceProperties(types.SimpleNamespace):
    """torch.cuda.get_device_properties' answer for the fake device (a type of its own, which
    dynamo is told is a constant as the real one is)."""


H100 = DeviceProperties(
    name="NVIDIA H100 80GB HBM3 (faked)",
    major=9,
    minor=0,
    multi_processor_count=H100_SMS,
    total_memory=80 << 30,
    regs_per_multiprocessor=65536,
    max_threads_per_multi_processor=2048,
    max_threads_per_block=1024,
    warp_size=32,
    shared_memory_per_block_optin=H100_SMEM,
    shared_memory_per_multiprocessor=233_472,
    shared_memory_per_block=49_152,
    L2_cache_size=50 << 20,
    gcnArchName="",
)
# What differs from a compile on a real H100; printed with every run, as each can hide a bug.
FAKE_SETTINGS = (
    "sm_90 target, 132 SMs, 232,448 B shared memory per block",
    "compile only: no cubin loaded, so no autotuning and no rblock rescaling by register count",
    "joint-graph constant folding off (it evaluates aten.full on the device)",
    "1 compile thread, Triton's launcher (no static CUDA launcher), caches off (all compiled cold)",
    "every graph traced on fake CPU tensors, then moved to cuda and lowered",
)


def running_versions():
    import triton

    return {"torch": torch.__version__.split("+")[0], "triton": triton.__version__}


def version_mismatch():
    """One line when torch/Triton are not the GPU image's versions, else None."""
    try:
        running = running_versions()
    except ImportError:
        running = {"torch": torch.__version__.split("+")[0], "triton": "none"}
    if running == EXPECTED_VERSIONS and torch.version.cuda:
        return None
    return (
        f"cuda compile: needs torch {EXPECTED_VERSIONS['torch']} (a CUDA build) and Triton "
        f"{EXPECTED_VERSIONS['triton']}, running torch {torch.__version__} and Triton "
        f"{running['triton']}: "
        f"use CI's venv ~/.cache/speedrun/venv-torch-2.11"
    )


# ---------------------------------------------------------------------- kernels


@dataclasses.dataclass
class Binary:
    """One cubin: a kernel at one configuration."""

    config: str
    shared: int
    registers: int
    spills: int  # bytes of spill stores


@dataclasses.dataclass
class Kernel:
    graph: str
    name: str
    binaries: list
    reads: int = 0  # bytes it reads at these shapes (kernel_traffic; 0 if unknown)
    writes: int = 0
    numels: dict = dataclasses.field(
        default_factory=dict
    )  # its iteration ranges, as Inductor names them
    grid: tuple = ()  # of its first configuration
    launches: int = 1  # calls in its graph's generated code (one kernel serves identical sources)

    def over_limit(self):
        return all(b.shared > H100_SMEM for b in self.binaries)

    def line(self):
        shared = max(b.shared for b in self.binaries)
        regs = max(b.registers for b in self.binaries)
        spills = max(b.spills for b in self.binaries)
        flag = "  OVER THE H100'S LIMIT" if self.over_limit() else ""
        return (
            f"  {self.name}: {len(self.binaries)} config(s), shared memory {shared:,} / "
            f"{H100_SMEM:,} B, "
            f"{regs} registers, {spills} B spilled{flag}"
        )


class KernelLog:
    """What Triton compiled for sm_90, kernel by kernel, with ptxas's report of each cubin and
    Inductor's view of each kernel's arguments."""

    def __init__(self):
        self.graph = None
        self.kernels = []
        self.ptxas = []  # (registers, spill bytes) of each cubin, in compile order
        self.inductor = {}  # kernel name -> (reads, writes, numels) of the graph being lowered
        self.wrapper, self.launches = None, collections.Counter()  # Inductor graph: calls per name
        self.compiling = None  # the kernel being compiled now (named in a failure)

    def add(self, name, binaries, grid=()):
        reads, writes, numels = self.inductor.get(name, (0, 0, {}))
        launches = self.launches.get(name, 1)
        self.kernels.append(
            Kernel(self.graph, name, binaries, reads, writes, numels, grid, launches)
        )

    def count_launch(self, name):
        """One call of kernel `name` in the generated code of the Inductor graph being lowered
        (Inductor defines a kernel once and calls it wherever its source recurs, e.g. per layer);
        a graph's kernels are compiled after all of its code is generated."""
        from torch._inductor.virtualized import V

        if self.wrapper is not V.graph.wrapper_code:
            self.wrapper, self.launches = V.graph.wrapper_code, collections.Counter()
        self.launches[name] += 1

    def of(self, graph):
        return [k for k in self.kernels if k.graph == graph]


LOG = KernelLog()
PTXAS_REGISTERS = re.compile(r"Used (\d+) registers")
PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores")


def ptxas_report(text):
    """(registers, spill store bytes) of ptxas -v's output for one kernel."""
    regs = PTXAS_REGISTERS.search(text)
    spills = PTXAS_SPILLS.search(text)
    return int(regs.group(1)) if regs else 0, int(spills.group(1)) if spills else 0


# ---------------------------------------------------------------------- the fake H100


class FakeDriver:
    """What Inductor and Triton ask Triton's active driver, answered for an H100."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", 90, 32)
        self.utils = types.SimpleNamespace(
            get_device_properties=lambda device: {
                "max_shared_mem": H100_SMEM,
                "multiprocessor_count": H100_SMS,
                "max_num_regs": 65536,
                "warpSize": 32,
                "sm_clock_rate": 1_980_000,
                "mem_clock_rate": 2_619_000,
                "mem_bus_width": 5120,
            }
        )

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def set_current_device(self, device):
        pass

    def get_device_capability(self, device=0):
        return 9, 0

    def get_current_stream(self, device=0):
        return 0

    def get_active_torch_device(self):
        return torch.device("cuda", 0)

    def get_device_interface(self):
        return torch.cuda

    def is_active(self):
        return True


def compile_only(self, *args, **kwargs):
    """CachingAutotuner.precompile without a device: Triton to cubin for every configuration,
    nothing loaded; each cubin's shared memory and ptxas's registers and spills go to LOG."""
    LOG.compiling = self.fn.__name__
    start = len(LOG.ptxas)
    self._precompile_worker()
    reports = LOG.ptxas[start:]
    binaries = [
        Binary(str(r.config.kwargs), r.kernel.metadata.shared, *report)
        for r, report in zip(self.compile_results, reports)
    ]
    if len(binaries) < len(self.compile_results):  # compiled before in this process: no ptxas run
        binaries = [
            Binary(str(r.config.kwargs), r.kernel.metadata.shared, 0, 0)
            for r in self.compile_results
        ]
    LOG.add(self.fn.__name__, binaries, inductor_grid(self, self.compile_results[0].config))
    LOG.compiling = None


def inductor_grid(autotuner, config):
    """The launch grid of an Inductor kernel at one configuration, from its metadata and sizes."""
    from torch._inductor.runtime.triton_heuristics import GridExpr

    _, _, numels = LOG.inductor.get(autotuner.fn.__name__, (0, 0, {}))
    try:
        expr = GridExpr.from_meta(autotuner.inductor_meta, config)
        sizes = {f"{prefix}numel": n for prefix, n in numels.items()}
        return tuple(
            (
                int(eval(str(e), {"triton_helpers": None}, {**sizes, **_grid_helpers()}))
                if not isinstance(e, int)
                else e
            )
            for e in (expr.x_grid, expr.y_grid, expr.z_grid)
        )
    except Exception:  # a template's or a combo kernel's grid: not derived here
        return ()


def _grid_helpers():
    return {"cdiv": lambda a, b: -(-a // b), "min": min, "max": max}


def record_kernel_arguments(define_kernel):
    """TritonScheduling.define_kernel, also noting the bytes the kernel reads and writes
    (kernel_traffic), its iteration ranges and one more call of it (called once per kernel the
    generated code calls, an identical source returning the name defined first)."""

    def define(self, src_code, node_schedule, kernel):
        name = define_kernel(self, src_code, node_schedule, kernel)
        LOG.count_launch(name)
        with contextlib.suppress(Exception):  # an argument Inductor cannot size: counted as 0
            LOG.inductor[name] = kernel_traffic(kernel, node_schedule)
        return name

    return define


def kernel_traffic(kernel, node_schedule=()):
    """(bytes read, bytes written, iteration ranges) of a kernel, from Inductor's dependencies of its
    nodes (accesses_by_buffer): of each buffer among its arguments, the elements its distinct
    accesses touch, each access at most the kernel's iteration space and the buffer at most whole,
    so that a kernel on one chunk of a larger buffer counts the chunk. A buffer without a dependency
    Inductor can size counts whole."""
    from torch._inductor.virtualized import V

    def hint(expr):
        return int(V.graph.sizevars.optimization_hint(expr))

    numels = {prefix: hint(n) for prefix, n in getattr(kernel, "numels", {}).items()}
    iterations = math.prod(numels.values()) if numels else math.inf  # a template: not capped
    args = kernel.args
    removed = {  # fused away: never stored (in place ones too), read from registers
        name
        for owner in (kernel, V.graph)
        for field in ("removed_buffers", "inplaced_to_remove")
        for name in getattr(owner, field, ())
    }
    names = {
        n
        for n, inner in (*args.input_buffers.items(), *args.output_buffers.items())
        if not str(inner).startswith("REMOVED")
    } | {n for n in args.inplace_buffers if not n.startswith("REMOVED")}
    names -= removed
    features = getattr(kernel, "features", None)
    looped = features is not None and features.is_reduction() and not kernel.persistent_reduction
    reads, writes = accesses_by_buffer(node_schedule, names, looped)

    def elements(dep, numel):
        if dep is None:  # no index: the whole buffer
            return numel
        if dep.is_indirect():  # a gather: an element per point of its node's ranges
            return min(math.prod(hint(n) for n in dep.size), numel)
        return min(hint(dep.get_numel()), iterations)

    def touched(accesses):
        total = 0
        for name, loops in accesses.items():
            numel = hint(V.graph.get_numel(name))
            total += V.graph.get_dtype(name).itemsize * sum(
                min(numel, sum(elements(dep, numel) for dep in loop)) for loop in loops
            )
        return total

    untouched = {n: [[None]] for n in names if n not in reads and n not in writes}
    return touched({**reads, **untouched}), touched(writes), numels


def accesses_by_buffer(node_schedule, names, looped):
    """({buffer: [[distinct access of one loop, ...] per loop]} read, the same written) of the
    kernel's buffers `names` by its nodes: a read of what a node of the same loop wrote before is
    from registers, not memory. One loop unless `looped` (a reduction that is not persistent: it
    loads its rows again in each loop over them, and a reduction's result is used in a loop of its
    own), where a marker between a reduction and its users starts the next loop. An access without
    an index (a StarDep) is None, the whole buffer."""
    from torch._inductor.dependencies import MemoryDep

    reads, writes = collections.defaultdict(dict), collections.defaultdict(dict)
    loop, written = 0, set()
    for node in node_schedule:
        if not hasattr(node, "read_writes"):  # a marker
            if looped:
                loop, written = loop + 1, set()
            continue
        for kind, accesses in (("reads", reads), ("writes", writes)):
            for dep in getattr(node.read_writes, kind):
                if dep.name not in names or kind == "reads" and dep.name in written:
                    continue
                key = dep.index if isinstance(dep, MemoryDep) else id(dep)
                value = dep if isinstance(dep, MemoryDep) else None
                accesses[dep.name].setdefault(loop, {})[key] = value
        written |= {dep.name for dep in node.read_writes.writes}

    def listed(accesses):
        return {name: [list(d.values()) for d in by_loop.values()] for name, by_loop in accesses.items()}

    return listed(reads), listed(writes)


def capture_ptxas(make_cubin):
    """Triton's make_cubin with ptxas -v's report kept (Triton prints it when asked, then deletes
    it)."""
    from triton import knobs

    def make(self, src, metadata, opt, capability):
        out = io.StringIO()
        with knobs.nvidia.scope(), contextlib.redirect_stdout(out):
            knobs.nvidia.dump_ptxas_log = True
            cubin = make_cubin(self, src, metadata, opt, capability)
        LOG.ptxas.append(ptxas_report(out.getvalue()))
        return cubin

    return make


def h100_properties(device=None):
    return H100


@contextlib.contextmanager
def fake_h100():
    """Inductor and Triton see one H100 (sm_90) and compile for it; every patch is undone on
    exit."""
    import torch._inductor.config as inductor_config
    import torch._inductor.runtime.triton_helpers as triton_helpers
    import torch._inductor.scheduler as scheduler
    import torch._dynamo.utils as dynamo_utils
    import torch._dynamo.variables.torch as torch_variables
    import torch.utils._triton as torch_triton_utils
    from torch._dynamo.device_interface import CudaInterface
    from torch._inductor.codegen.triton import TritonScheduling
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    from triton import knobs
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime import driver

    interface = dict(
        is_available=lambda: True,
        device_count=lambda: 1,
        current_device=lambda: 0,
        get_device_properties=lambda device=None: H100,
        get_compute_capability=lambda device=None: 90,
        is_bf16_supported=lambda including_emulation=False: True,
    )
    with contextlib.ExitStack() as stack:
        patch = stack.enter_context(_Patches())
        for name, fn in interface.items():
            patch(CudaInterface, name, staticmethod(fn))
        patch(CudaInterface.Worker, "get_device_properties", staticmethod(lambda device=None: H100))
        patch(torch.cuda, "get_device_properties", h100_properties)
        # dynamo folds the real one to a constant inside a graph (#89's launchers read the SM
        # count there): the same for the fake
        folded = torch_variables.constant_fold_functions
        patch(torch_variables, "constant_fold_functions", {**folded, h100_properties: None})
        dynamo_utils.common_constant_types.add(DeviceProperties)
        stack.callback(dynamo_utils.common_constant_types.discard, DeviceProperties)
        patch(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
        # dynamo traces TensorDescriptor.from_tensor (#89's TMA kernels) as a descriptor only where
        # the device has TMA; torch asks torch.cuda.is_available() and caches the answer
        patch(torch_triton_utils, "_device_supports_tma", lambda: True)
        for cached in (torch_triton_utils.has_triton_tensor_descriptor_host_tma,
                       torch_triton_utils.has_triton_experimental_host_tma):
            cached.cache_clear()
            stack.callback(cached.cache_clear)
        patch(triton_helpers, "set_driver_to_gpu", lambda: None)
        patch(scheduler, "has_triton", lambda: True)
        patch(CachingAutotuner, "precompile", compile_only)
        patch(
            TritonScheduling,
            "define_kernel",
            record_kernel_arguments(TritonScheduling.define_kernel),
        )
        patch(CUDABackend, "make_cubin", capture_ptxas(CUDABackend.make_cubin))
        # in this process, one thread; Triton's launcher; no cache hit (it would skip ptxas and its
        # report)
        stack.enter_context(
            inductor_config.patch(
                joint_graph_constant_folding=False,
                compile_threads=1,
                use_static_cuda_launcher=False,
                force_disable_caches=True,
            )
        )
        stack.enter_context(knobs.cache.scope())
        knobs.cache.dir = stack.enter_context(
            tempfile.TemporaryDirectory(prefix="cuda-compile-check-")
        )
        stack.callback(driver.set_active, driver._active)  # None: chosen again at the next use
        driver.set_active(FakeDriver())
        yield


class _Patches:
    """setattr that is undone on exit, last first."""

    def __enter__(self):
        self.undo = []
        return self

    def __call__(self, owner, name, value):
        self.undo.append(
            (owner, name, owner.__dict__[name] if name in vars(owner) else getattr(owner, name))
        )
        setattr(owner, name, value)

    def __exit__(self, *exc):
        for owner, name, value in reversed(self.undo):
            setattr(owner, name, value)


# ---------------------------------------------------------------------- lowering


def on_device(t, mode, device):
    """A fake tensor on `device` with t's shape, strides and dtype (t: a real or fake tensor of any
    device)."""
    if not isinstance(t, torch.Tensor):
        return t
    meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    return mode.from_tensor(meta).to(device)


def lower_function(fn, args):
    """fn compiled by Inductor for the faked H100 at args (any device: only their shapes, strides
    and dtypes count), as torch.compile(fn, dynamic=False) compiles it on a GPU under no_grad;
    traced as lower_module traces. Nothing runs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        cpu_args = [on_device(a, mode, "cpu") for a in args]
    lower_module(fn, cpu_args, mode, training=False)


def lower_module(module, args, mode, training=True):
    """A module's (or function's) call lowered for the faked H100: forward and backward in
    training, the forward alone under no_grad otherwise (as the trainer validates). Traced on fake
    CPU tensors (the autograd engine asks the CUDA driver about device 0 when a backward is traced
    on CUDA ones; a constant made from Python data on a fake CUDA tensor needs the driver too), the
    captured graphs moved to cuda and each lowered by Inductor. Returns (kind, Inductor's compiled
    graph, its inputs) of each."""
    import torch._functorch.config as functorch_config
    import torch.nn.attention.flex_attention as flex_module
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._inductor.compile_fx import _recursive_joint_graph_passes, compile_fx_inner
    from torch._inductor.compile_fx import partition_fn as inductor_partition
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensorMode

    captured = []

    def capture(kind):
        def compiler(gm, inputs):
            captured.append((kind, gm, inputs))
            return gm

        return compiler

    def backend(gm, inputs):
        return aot_module_simplified(
            gm,
            inputs,
            fw_compiler=capture("forward"),
            bw_compiler=capture("backward"),
            inference_compiler=capture("inference"),
            decompositions=select_decomp_table(),
            partition_fn=inductor_partition,  # as compile_fx: joint-graph passes, min-cut
            keep_inference_input_mutations=True,
        )

    torch._dynamo.reset()
    with contextlib.ExitStack() as stack:
        patch = stack.enter_context(_Patches())
        # FlexAttention's CPU backward: traced only; the backward captured now
        patch(flex_module, "_validate_device", lambda *a, **k: None)
        patch(functorch_config, "force_non_lazy_backward_lowering", True)
        stack.enter_context(mode)
        if not training:
            stack.enter_context(torch.no_grad())
        out = torch.compile(module, dynamic=False, fullgraph=True, backend=backend)(*args)
        if training:
            out.sum().backward()  # a loss per token (#89's) as the training loop sums it
    lowered = []
    for kind, gm, inputs in captured:
        for node in gm.graph.nodes:
            if node.kwargs.get("device") == torch.device("cpu"):
                node.kwargs = {**node.kwargs, "device": torch.device("cuda", 0)}
        gm.recompile()
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            cuda_inputs = [on_device(t, mode, "cuda") for t in inputs]
        if kind == "inference":  # as compile_fx's inference path does before lowering
            gm = _recursive_joint_graph_passes(gm, input_device=torch.device("cuda", 0))
        compiled = compile_fx_inner(
            gm, cuda_inputs, is_backward=kind == "backward", is_inference=kind == "inference"
        )
        lowered.append((kind, compiled, inputs))
    return lowered


def lower_triton_kernel(kernel, args, constexprs, config):
    """One @triton.jit kernel compiled for sm_90 as its launch at `args` would compile it (Triton's
    own specialization of the arguments), with a (num_warps, num_stages) configuration; nothing is
    launched."""
    warps, stages = config
    LOG.compiling = kernel.__name__
    start = len(LOG.ptxas)
    compiled = kernel.warmup(*args, grid=(1,), num_warps=warps, num_stages=stages, **constexprs)
    report = LOG.ptxas[start:][-1] if len(LOG.ptxas) > start else (0, 0)
    LOG.add(
        kernel.__name__,
        [
            Binary(
                str({**constexprs, "num_warps": warps, "num_stages": stages}),
                compiled.metadata.shared,
                *report,
            )
        ],
    )
    LOG.compiling = None


# ------------------------------------------------------------ FlexAttention's FLASH backend
# Inductor renders FLASH as Python that calls flash-attn-4, whose CuTe DSL compiles each kernel at
# its first call. flash-attn-4 compiles without running under a FakeTensorMode, for the arch its
# cross-compile settings name; these run Inductor's compiled graph on fake tensors to get there.
FLASH_CROSS_COMPILE = {
    "FLASH_ATTENTION_ARCH": "90",  # flash-attn-4's kernel choice (SM90)
    "CUTE_DSL_ARCH": "sm_90a",  # the CuTe DSL's target
    "FLASH_ATTENTION_NUM_SMS": str(H100_SMS),  # its tile scheduler's SM count
}


class _NoDeviceGuard:
    def __init__(self, device):
        pass

    def __enter__(self):
        pass

    def __exit__(self, *exc):
        pass


@contextlib.contextmanager
def fake_graph_run():
    """Inductor's compiled graphs runnable on fake CUDA tensors: no device guard or stream, its
    buffer helpers made of fake tensors, its Triton launches skipped (compiled already), the CuTe
    DSL's cubins counted as kernels of the graph."""
    from torch._C._dynamo import guards
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    def compile_cubin(fn, *args, **kwargs):
        LOG.compiling = kernel_class_name(fn)
        compiled = compile_kernel(fn, *args, **kwargs)
        LOG.add(LOG.compiling, [Binary(kwargs.get("options", ""), 0, 0, 0)])
        LOG.compiling = None
        return compiled

    with mock.patch.dict(os.environ, FLASH_CROSS_COMPILE), _Patches() as patch:
        import cutlass.cute as cute  # after the settings: the CuTe DSL reads its arch on import

        compile_kernel = cute.compile
        patch(torch._C, "_cuda_getCurrentRawStream", lambda device: 0)
        patch(guards, "_empty_strided_cuda", _fake_empty_strided_cuda)
        patch(guards, "_reinterpret_tensor", _fake_reinterpret)
        patch(torch.cuda, "set_device", lambda device: None)
        patch(torch.cuda, "_DeviceGuard", _NoDeviceGuard)
        patch(CachingAutotuner, "run", lambda self, *args, **kwargs: None)
        patch(cute, "compile", compile_cubin)
        yield


def kernel_class_name(fn):
    """What the CuTe DSL compiles: a kernel object's class, a bound method's class, a function."""
    if hasattr(fn, "__self__"):
        return type(fn.__self__).__name__
    return getattr(fn, "__name__", type(fn).__name__)


def _fake_empty_strided_cuda(size, stride, dtype):
    return torch.empty_strided(size, stride, dtype=dtype, device="cuda")


def _fake_reinterpret(t, size, stride, offset):
    return t.as_strided(size, stride, t.storage_offset() + offset)


def lower_and_run(module, args, mode):
    """lower_module's forward and backward, then each compiled graph run on fake CUDA tensors, so
    that the CuTe DSL compiles the kernels flash-attn-4 would launch."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with fake_graph_run():  # around the lowering too: the compiled module binds its helpers
        for _kind, compiled, inputs in lower_module(module, args, mode):
            with FakeTensorMode(allow_non_fake_inputs=True) as fake:
                compiled.current_callable([on_device(t, fake, "cuda") for t in inputs])


# ---------------------------------------------------------------------- the plan


@dataclasses.dataclass
class Graph:
    """One compile of the plan: prepare() makes what it compiles (an error there: not compiled, with
    why), lower(prepared) compiles it for sm_90 (an error there: failed)."""

    name: str
    prepare: object
    lower: object


def exception_chain(error):
    chain = []
    while error is not None and error not in chain:
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


def describe_failure(error):
    """(what: kernel or op, the generated Triton source line or None, the error) of a failed
    compile."""
    chain = exception_chain(error)
    lines = "\n".join(str(e) for e in chain).splitlines()
    caret = [i for i, line in enumerate(lines) if i and re.fullmatch(r"\s*\^\s*", line)]
    source = lines[caret[0] - 1].strip() if caret else None
    target = re.search(r"target: (\S+)", "\n".join(lines))
    what = (
        f"kernel {LOG.compiling}"
        if LOG.compiling
        else f"lowering {target.group(1)}" if target else "graph"
    )
    named = [e for e in chain if type(e).__name__ in ("LoweringException", "CompilationError")]
    innermost = chain[-1]
    message = next(
        (line.strip() for line in reversed(str(innermost).splitlines()) if line.strip()), ""
    )
    error_text = f"{type(innermost).__name__}" + (f": {message[:300]}" if message else "")
    if named and named[0] is not innermost:
        error_text = f"{type(named[0]).__name__}: {error_text}"
    return what, source, error_text


@dataclasses.dataclass
class Outcome:
    graph: str
    status: str  # "ok", "failed", "not compiled"
    kernels: int
    seconds: float
    detail: str = ""


def run_graph(graph, verbose=True):
    """Compile one graph of the plan; print its line (and its kernels' lines) and return its
    Outcome."""
    LOG.graph, LOG.compiling, LOG.inductor = graph.name, None, {}
    start = time.perf_counter()
    try:
        prepared = graph.prepare()
    except Exception as e:  # a path this tool cannot build without a device
        why = (
            f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
        )
        print(f"{graph.name}: NOT COMPILED ({why})", flush=True)
        return Outcome(graph.name, "not compiled", 0, 0.0, why)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            graph.lower(prepared)
    except Exception as e:  # the point of the check
        seconds = time.perf_counter() - start
        what, source, error = describe_failure(e)
        kernels = len(LOG.of(graph.name))
        line = f"{graph.name}: FAILED after {kernels} kernels, {seconds:.1f} s: {what}"
        line += f", line `{source}`" if source else ""
        print(f"{line}: {error}", flush=True)
        return Outcome(graph.name, "failed", kernels, seconds, f"{what}: {error}")
    seconds = time.perf_counter() - start
    kernels = LOG.of(graph.name)
    over = [k for k in kernels if k.over_limit()]
    print(f"{graph.name}: {len(kernels)} kernels compiled for sm_90 in {seconds:.1f} s", flush=True)
    if verbose:
        for kernel in kernels:
            print(kernel.line())
    for kernel in over:
        print(
            f"{graph.name}: FAILED: kernel {kernel.name} needs more shared memory than an H100 has "
            f"in every configuration",
            flush=True,
        )
    status = "failed" if over else "ok"
    return Outcome(
        graph.name,
        status,
        len(kernels),
        seconds,
        f"{len(over)} kernels over the shared memory limit",
    )


# ---------------------------------------------------------------------- the record run
# Everything this tool knows of train_gpt.py is in this section: the entry points it calls and
# the shapes of the record run (its defaults), so that a restructured train_gpt.py changes this
# section only.


def load_train_gpt(path):
    """train_gpt.py from `path` as the module `train_gpt` (the tools' imports then see it)."""
    import importlib.util

    sys.path[:0] = [str(ROOT / "tools")]
    spec = importlib.util.spec_from_file_location("train_gpt", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_gpt"] = module
    spec.loader.exec_module(module)
    return module


def meta_args(args):
    """Tensors as meta tensors of their shapes, strides and dtypes (kept after the fake run moves
    on)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return tuple(
            (
                torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
                if isinstance(a, torch.Tensor)
                else a
            )
            for a in args
        )


def argument_key(args):
    return tuple(
        (tuple(a.shape), a.stride(), a.dtype) if isinstance(a, torch.Tensor) else type(a).__name__
        for a in args
    )


class RecordRun:
    """The record run's compiles (train_gpt.py's defaults) as Graphs."""

    def __init__(self, tg):
        self.tg = tg
        self.hp = tg.parse_args([])
        self.accum = tg.grad_accum_steps(self.hp, 1)
        self.tokens = tg.tokens_per_rank(max(self.hp.batch_sizes), 1, self.accum)
        self.val_tokens = tg.tokens_per_rank(self.hp.val_batch_size, 1, self.accum)
        self.schedule = tg.Schedule(self.hp, torch.device("cpu"))
        self.step = tg.stage_ends(self.hp)[2] - 1  # stage 3's last scheduled step

    def model(self, mode):
        """The GPU path's model (FP8 head and MLP, FlexAttention) on fake CPU tensors."""
        tg = self.tg
        with mode:
            return tg.GPT(
                self.hp,
                tg.backend_for(self.hp, torch.device("cuda"), self.accum, fp8_hardware=True),
                None,
            )

    def batch(self, tokens, mode):
        """A fake Batch of one document of `tokens` positions (as tools/plan_memory.py plans)."""
        import numpy as np

        tg = self.tg
        window = np.full(tokens + 1, tg.BOS_ID)
        rows = self.hp.bigram_vocab_size
        bigrams = tg.bigram_hash(window[:-1], rows) if rows else None
        batch = tg.model_inputs(window, [tokens], torch.device("cpu"), bigrams)
        return tg.Batch(*(None if t is None else mode.from_tensor(t) for t in batch))

    def training_step(self):
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode(allow_non_fake_inputs=True)
        model = self.model(mode)
        plan = self.schedule.at(self.step)
        model.follow_window(plan.windows)
        with mode:
            b = self.batch(self.tokens, mode)
            args = (b.inputs, b.targets, b.cu_seqlens, plan.window_tensor, b.bigram_ids)
        return mode, model, (*args, plan.mtp_weights)

    def validation_forward(self):
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode(allow_non_fake_inputs=True)
        model = self.model(mode).eval()
        plan = self.schedule.at(self.schedule.total_steps)
        model.follow_window(plan.windows)
        with mode:
            b = self.batch(self.val_tokens, mode)
            args = (b.inputs, b.targets, b.cu_seqlens, plan.val_window_tensor, b.bigram_ids)
        return mode, model, args

    def flash_attention(self, paired):
        """One attention layer of the training step on --flex_backend flash (flex_flash.py), as
        attention_context builds its mask (the long window, from the step's window tensor) and
        the layer calls it: at (T, heads, head_dim), or paired (2T, heads / 2, head_dim)."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        tg, hp = self.tg, self.hp
        flash = tg.load_companion("flex_flash.py")
        if not flash.flash_available():
            raise ModuleNotFoundError("flash_attn.cute does not import: pip install --pre "
                                      "flash-attn-4 to check it (docs/gpu-smoke.md)")
        attention = flash.FlashWindowAttention()
        plan = self.schedule.at(self.step)

        def layer(q, k, v, cu_seqlens, window_blocks, scale):
            docs = tg.document_ids(cu_seqlens, self.tokens)
            tokens = window_blocks[1] * hp.window_block_tokens
            mask = attention.mask(docs.repeat_interleave(2) if paired else docs, tokens)
            return attention(q, k, v, mask, scale).float().sum()

        mode = FakeTensorMode(allow_non_fake_inputs=True)
        rows, heads = (self.tokens, hp.num_heads)
        if paired:
            rows, heads = 2 * rows, heads // 2
        with mode:
            q, k, v = (
                torch.empty(rows, heads, hp.head_dim, dtype=torch.bfloat16).requires_grad_()
                for _ in range(3)
            )
            b = self.batch(self.tokens, mode)
            scale = torch.empty(())
        return mode, layer, (q, k, v, b.cu_seqlens, plan.window_tensor, scale)

    def head_shapes(self):
        """(tokens, dim), (vocab, dim) and dtype of the head's weight, its FP8 scales in
        training."""
        tg = self.tg
        return (
            (self.tokens, self.hp.model_dim),
            (tg.padded_vocab(self.hp), self.hp.model_dim),
            tg.head_fp8_scales(self.hp.head_fp8_amax, self.accum),
        )

    def fp8_forward(self):
        (tokens, dim), (vocab, _), (x_s, w_s, _) = self.head_shapes()
        x, w = (torch.empty(n, dim, dtype=torch.bfloat16, device="meta") for n in (tokens, vocab))
        return self.tg.fp8_forward, (x, w, x_s, w_s)

    def fp8_backward(self):
        (tokens, dim), (vocab, _), (x_s, w_s, grad_s) = self.head_shapes()
        g = torch.empty(tokens, vocab, dtype=torch.bfloat16, device="meta")
        x_f8, w_f8 = (
            torch.empty(n, dim, dtype=torch.float8_e4m3fn, device="meta") for n in (tokens, vocab)
        )
        return self.tg.fp8_backward, (g, x_f8, w_f8, x_s, w_s, grad_s)

    def fused_loss_grad(self, rows):
        """The fused FP8 loss's logit gradient as the smoke's check compiles it (training inlines it
        in the backward graph)."""
        tg, hp = self.tg, self.hp
        _, (vocab, _), (_, _, grad_s) = self.head_shapes()
        logits = torch.empty(rows, vocab, dtype=torch.bfloat16, device="meta")
        targets = torch.empty(rows, dtype=torch.int64, device="meta")
        weights = torch.empty(tg.MTP_HORIZON, device="meta")
        softcap = tg.Softcap(hp.softcap_scale, hp.softcap_offset, round_sigmoid=True)
        return tg.softcap_loss_grad, (
            logits,
            targets,
            weights,
            softcap,
            0,
            rows,
            torch.empty((), device="meta"),
            grad_s,
        )

    def optimizer_calls(self, world_size):
        """{(kind, argument key): (function, meta arguments)} of DistAdam's and NorMuon's compiled
        math in two steps (an Adam step before and after the untie) of rank 0 of world_size ranks,
        and the (m, n), m <= n, of every Polar Express input."""
        import plan_memory
        from torch._subclasses.fake_tensor import FakeTensorMode

        tg, hp = self.tg, self.hp
        calls, polar_sizes = {}, set()

        def recording(kind, fn):
            def call(*args):
                calls.setdefault((kind, argument_key(args)), (fn, meta_args(args)))
                if kind == "NorMuon's normalization":
                    rows, cols = args[0].shape[-2:]
                    polar_sizes.add((min(rows, cols), max(rows, cols)))
                return fn(*args)

            return call

        with plan_memory.fake_world(world_size), FakeTensorMode():
            # the compiled path's arguments (planned_backend: Polar Express in torch, as Triton
            # cannot run on fake tensors)
            model, backend = plan_memory.planned_model(hp, True, tg.grad_accum_steps(hp, world_size))
            matrix_opt, adam = tg.make_optimizers(model, hp, backend._replace(compile_math=True))
            adam.math = recording("DistAdam's update", tg.adam_update_)
            if adam.sparse is not None:  # (no counts travel on fake tensors; no rows touched)
                adam.sparse.exchange_counts = lambda sent: sent
            matrix_opt.normalize = recording("NorMuon's normalization", tg.normalize_variance)
            matrix_opt.apply_update = recording("NorMuon's cautious update", tg.cautious_update)
            plan = tg.Schedule(hp).at(1)
            for step in (1, 3):
                for p in model.parameters():
                    p.grad = torch.zeros_like(p)
                tg.step_optimizers(
                    plan._replace(step=step, unties_after=adam.tied), matrix_opt, adam
                )
        return calls, polar_sizes

    def polar_kernels(self):
        """The Polar Express kernels and their tile configurations: {name: jit function},
        SYM_CONFIGS."""
        return {
            "xxt": self.tg._xxt_kernel,
            "ba_plus_caa": self.tg._ba_plus_caa_kernel,
        }, self.tg.SYM_CONFIGS

    def fused_launches(self):
        """fp8_kernels.py's Triton launchers (the fused FP8 MLP's two, the fused loss's and its
        sigmoid's) with meta arguments at the record's shapes: {name: (launcher, arguments)}."""
        kernels = self.tg.load_companion("fp8_kernels.py")
        dim, hidden = self.hp.model_dim, 4 * self.hp.model_dim

        def meta(*shape, dtype=torch.bfloat16):
            return torch.empty(*shape, dtype=dtype, device="meta")

        f8, scale = torch.float8_e4m3fn, meta((), dtype=torch.float32)
        (tokens, _), (vocab, _), (_, _, grad_s) = self.head_shapes()
        softcap = self.tg.Softcap(self.hp.softcap_scale, self.hp.softcap_offset, True)
        return {
            "FP8 MLP up projection": (
                kernels.launch_up_relu_square,
                (meta(self.tokens, dim, dtype=f8), meta(hidden, dim, dtype=f8), scale, scale),
            ),
            "FP8 MLP relu-square gradient": (
                kernels.launch_relu_square_grad,
                (meta(self.tokens, dim), meta(hidden, dim), meta(self.tokens, hidden)),
            ),
            # the record's three horizons, no masks (a micro-step piece's masks: another
            # specialization, the same code)
            "FP8 loss": (
                kernels.launch_softcap_loss,
                (meta(tokens, vocab), meta(tokens, dtype=torch.int64),
                 meta(self.tg.MTP_HORIZON, dtype=torch.float32), None, *softcap,
                 self.tg.SOFTCAP_WIDTH, meta((), dtype=torch.float32), grad_s),
            ),
            "FP8 loss's sigmoid (the smoke's check)": (
                kernels.launch_softcap_sigmoid,
                (meta(tokens, vocab), softcap.offset, softcap.round_sigmoid,
                 self.tg.SOFTCAP_WIDTH),
            ),
        }

    def polar_sizes_of_smoke_checks(self):
        """The Polar Express check's MLP stack and the tile-configuration check's shape (m <= n)."""
        import smoke_checks

        dim = self.hp.model_dim
        rows, cols = smoke_checks.RECORD.tile_shape
        return {(dim, 4 * dim), (min(rows, cols), max(rows, cols))}


# ---------------------------------------------------------------------- graphs


def lower_triton_specialization(kernel, args, configs):
    """A Polar Express kernel at one specialization of its arguments, every tile configuration."""
    for block_m, block_k, warps, stages in configs:
        lower_triton_kernel(kernel, args, dict(BLOCK_M=block_m, BLOCK_K=block_k), (warps, stages))


def polar_launch_args(kernel_name, m, n):
    """The arguments _sym_launch passes a kernel on a (batch, m, n) bf16 input, m <= n: input,
    output, M, K or (b, c), both tensors' strides (batch 2; the batch count does not specialize)."""
    inp = torch.empty(2, m, n if kernel_name == "xxt" else m, dtype=torch.bfloat16, device="meta")
    out = torch.empty(2, m, m, dtype=torch.bfloat16, device="meta")
    scalars = (n,) if kernel_name == "xxt" else (-2.8, 0.5)
    return (inp, out, m, *scalars, *inp.stride(), *out.stride())


def triton_specialization(args):
    """Triton's key for integer arguments: 1, a multiple of 16, or other."""
    return tuple(1 if a == 1 else 16 if a % 16 == 0 else 0 for a in args if type(a) is int)


def record_graphs(run, world_sizes=(1, 8)):
    """The record run's compiles, in the smoke's order of value: the model's, the FP8 helpers', the
    optimizers' math at each world size, Polar Express's kernels, fp8_kernels.py's kernels (the
    fused FP8 MLP's and loss's)."""
    graphs = [
        Graph(
            f"training step at {run.tokens:,} tokens (step {run.step}, forward+backward)",
            run.training_step,
            lambda p: lower_module(p[1], p[2], p[0]),
        ),
        Graph(
            f"validation forward at {run.val_tokens:,} tokens",
            run.validation_forward,
            lambda p: lower_module(p[1], p[2], p[0], training=False),
        ),
        Graph(
            f"FP8 head forward helper at {run.tokens:,} tokens",
            run.fp8_forward,
            lambda p: lower_function(*p),
        ),
        Graph(
            f"FP8 head backward helper at {run.tokens:,} tokens",
            run.fp8_backward,
            lambda p: lower_function(*p),
        ),
        Graph(
            "fused FP8 loss's logit gradient at 1,024 rows (the smoke's check)",
            lambda: run.fused_loss_grad(1024),
            lambda p: lower_function(*p),
        ),
    ]
    graphs += [
        Graph(
            f"FlexAttention's FLASH backend (--flex_backend flash), "
            f"{'paired ' if paired else ''}layer at {run.tokens:,} tokens "
            f"(forward+backward)",
            lambda paired=paired: run.flash_attention(paired),
            lambda p: lower_and_run(p[1], p[2], p[0]),
        )
        for paired in (False, True)
    ]
    polar_sizes = set()
    for world_size in world_sizes:
        try:
            calls, sizes = run.optimizer_calls(world_size)
        except Exception as e:  # named as one graph not compiled
            graphs.append(Graph(f"optimizers' math at {world_size} rank(s)", _raiser(e), None))
            continue
        polar_sizes |= sizes
        for (kind, key), (fn, args) in sorted(calls.items(), key=str):
            shape = next(k[0] for k in key if isinstance(k, tuple))
            graphs.append(
                Graph(
                    f"{kind} at {tuple(shape)}, {world_size} rank(s)",
                    lambda args=args: args,
                    lambda args, fn=fn: lower_function(fn, args),
                )
            )
    return graphs + polar_graphs(run, polar_sizes) + fused_graphs(run)


def polar_graphs(run, optimizer_sizes):
    """Polar Express's two kernels at every specialization of the sizes the smoke's plan gives them
    (the optimizer's stacks, the Polar Express check's, the tile-configuration check's), every tile
    configuration."""
    try:
        kernels, configs = run.polar_kernels()
        sizes = optimizer_sizes | run.polar_sizes_of_smoke_checks()
    except Exception as e:
        return [Graph("Polar Express's Triton kernels", _raiser(e), None)]
    graphs, seen = [], set()
    for name, kernel in kernels.items():
        for m, n in sorted(sizes):
            args = polar_launch_args(name, m, n)
            spec = triton_specialization(args)
            if (name, spec) in seen:
                continue
            seen.add((name, spec))
            graphs.append(
                Graph(
                    f"Polar Express {name} kernel, specialization {spec} (as at {m}x{n}), "
                    f"{len(configs)} tile configurations",
                    lambda args=args: args,
                    lambda args, kernel=kernel: lower_triton_specialization(kernel, args, configs),
                )
            )
    return graphs


def launch_compiling_only(prepared):
    """A Triton launcher's call, its kernels compiled for sm_90 and not launched."""
    from triton.runtime.jit import JITFunction

    fn, args, kwargs = prepared
    with _Patches() as patch:
        patch(JITFunction, "run", compile_only_launches(JITFunction.run))
        fn(*args, **kwargs)


def fused_graphs(run):
    """fp8_kernels.py's Triton kernels (opaque custom ops in the training graph) through their
    launchers at the record's shapes."""
    try:
        launches = run.fused_launches()
    except Exception as e:
        return [Graph("fused FP8 Triton kernels", _raiser(e), None)]
    return [
        Graph(
            f"fused {name} kernel at {run.tokens:,} tokens",
            lambda launch=launch: (*launch, {}),
            launch_compiling_only,
        )
        for name, launch in launches.items()
    ]


def _raiser(error):
    def prepare():
        raise error

    return prepare


# ---------------------------------------------------------------------- --reference


def reference_launches(log_path, stage=2):
    """{(launcher, argument keys): (meta arguments, meta keyword arguments)} of every kernel
    launcher a record log's script calls in one training step of `stage` (its even and odd step) on
    one GPU, from tools/step_cost.py's trace of it."""
    import reference_step
    import step_cost

    launches = {}

    def recording(name, stand_in):
        def call(*args, **kwargs):
            key = (name, argument_key(args), argument_key(kwargs.values()), tuple(kwargs))
            launches.setdefault(
                key, (meta_args(args), dict(zip(kwargs, meta_args(kwargs.values()))))
            )
            return stand_in(*args, **kwargs)

        return call

    with contextlib.ExitStack() as stack:
        patch = stack.enter_context(_Patches())
        patch(
            reference_step,
            "STAND_INS",
            {name: recording(name, fn) for name, fn in reference_step.STAND_INS.items()},
        )
        warnings.simplefilter("ignore")
        step_cost.reference_stage_costs(log_path, 1, step_cost.GPU_PEAKS["h100"], stages=[stage])
    return launches


NVRTC_MARK = (
    "_compile_kernel"  # a CUDA C++ kernel built by NVRTC at import: needs a device, not Triton
)


def load_reference_kernels(log_path, folder):
    """The log's triton_kernels.py as a module (written to `folder`, never the repository), without
    its CUDA C++ kernel (built with a device at import); and the names of the launchers that need
    that kernel."""
    import ast
    import importlib.util
    import reference_step

    _, source = reference_step.split_log(Path(log_path).read_text(), str(log_path))
    tree = ast.parse(source)
    dropped = [
        n
        for n in tree.body
        if NVRTC_MARK in ast.unparse(n) or "ce_fwd_bwd_kernel." in ast.unparse(n)
    ]
    tree.body = [n for n in tree.body if n not in dropped]
    path = Path(folder) / "triton_kernels.py"
    path.write_text(ast.unparse(tree))
    spec = importlib.util.spec_from_file_location("reference_triton_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    needs_nvrtc = {
        n.name
        for n in tree.body
        if isinstance(n, ast.FunctionDef) and "ce_fwd_bwd_kernel" in ast.unparse(n)
    }
    return module, needs_nvrtc


def compile_only_launches(run):
    """JITFunction.run made to compile for the target and return without launching (Triton's
    warmup)."""

    def warmup(self, *args, grid, warmup=False, **kwargs):
        LOG.compiling = self.__name__
        start = len(LOG.ptxas)
        compiled = run(self, *args, grid=grid, warmup=True, **kwargs)
        report = LOG.ptxas[start:][-1] if len(LOG.ptxas) > start else (0, 0)
        options = {
            k: v for k, v in kwargs.items() if k.isupper() or k in ("num_warps", "num_stages")
        }
        LOG.add(
            self.__name__,
            [Binary(str(options), compiled.metadata.shared, *report)],
            grid if isinstance(grid, tuple) else (),
        )
        LOG.compiling = None
        return compiled

    return warmup


def reference_graphs(log_path):
    """#89's Triton kernels (its log's triton_kernels.py), one graph per launcher and argument key
    its script calls in a stage-3 step, compiled for sm_90 through the launchers themselves."""
    folder = tempfile.TemporaryDirectory(prefix="cuda-compile-check-reference-")
    loaded = {}

    def launcher(name):
        if not loaded:
            loaded["module"], loaded["nvrtc"] = load_reference_kernels(log_path, folder.name)
        if name in loaded["nvrtc"]:
            raise RuntimeError(
                "a CUDA C++ kernel that NVRTC builds with a device at import, not Triton"
            )
        return getattr(loaded["module"], name)

    graphs = []
    for key, (args, kwargs) in sorted(reference_launches(log_path).items(), key=str):
        name = key[0]
        shapes = ", ".join(
            "x".join(map(str, a.shape))
            for a in (*args, *kwargs.values())
            if isinstance(a, torch.Tensor)
        )
        graphs.append(
            Graph(
                f"reference {name} at {shapes}",
                lambda name=name, args=args, kwargs=kwargs: (launcher(name), args, kwargs),
                launch_compiling_only,
            )
        )
    return graphs, folder


# ---------------------------------------------------------------------- --race


def compiled_definitions(script_path):
    """[(class name or None, function name)] of the top-level functions and methods a record's
    script decorates with torch.compile (those nested in a function body are left out)."""
    import ast
    import reference_step

    tree = ast.parse(Path(script_path).read_text())
    found = []
    for node in tree.body:
        owners = [(None, node)] if isinstance(node, ast.FunctionDef) else []
        if isinstance(node, ast.ClassDef):
            owners = [(node.name, n) for n in node.body if isinstance(n, ast.FunctionDef)]
        for owner, fn in owners:
            if any(reference_step._Rewrite._is_compile(d) for d in fn.decorator_list):
                found.append((owner, fn.name))
    return found


def race_reference(log_path):
    """#89's definitions as tools/gpu_race.py races them on a GPU (its Triton kernels real,
    FlashAttention 3 replaced by FlexAttention, world size 1, one micro-step a step), loaded on the
    CPU device that holds the check's fake tensors: its torch.compile decorators dropped (each such
    function is lowered apart, as the decorator compiles it) and its NVRTC loss kernel left out
    (not Triton; the custom op around it is traced by its fake)."""
    import gpu_race
    import reference_step

    class CheckedReference(gpu_race.RacingReference):
        def _load_script(self, path, attention_op):
            # the CUDA cautious update (uint32 shifts), not the CPU race's stand-in
            return reference_step.Reference._load_script(self, path, attention_op)

    attention = gpu_race.our_attention(torch.device("cuda"), compiled=True)
    shape = gpu_race.RECORD_SHAPE
    return CheckedReference(log_path, torch.device("cpu"), "triton", attention,
                            shape.reference_sizes), shape


@contextlib.contextmanager
def race_world(reference_log):
    """#89's model and training manager on fake CPU tensors in a fake process group of one rank,
    at stage 3's first step (the untie done): (mode, reference, model, manager, step, shape)."""
    import gpu_race
    import step_cost
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with step_cost.fake_group(1), warnings.catch_warnings(), _Patches() as patch:
        warnings.simplefilter("ignore")
        with mode:
            reference, shape = race_reference(reference_log)
            torch_launchers(reference, patch)
            model, manager = reference.build()
            first = reference.module.training_schedule.boundaries[gpu_race.STAGE][0]
            if reference.module.training_schedule.split_step < first:
                manager.optimizer.copy_lm_state_to_embed()
            manager.advance_schedule(first)
        yield mode, reference, model, manager, first, shape


def torch_launchers(reference, patch):
    """#89's Triton launchers replaced by tools/reference_kernels.py's torch ones while its model
    is built and its optimizer steps on fake tensors, which Triton cannot run on (its compiled
    model's graph is traced after, with the real launchers)."""
    import reference_kernels

    for name, stand_in in reference_kernels.TRITON_LAUNCHERS.items():
        for holder in (reference.module, reference.kernels):
            if hasattr(holder, name):
                patch(holder, name, stand_in)


class RaceRun:
    """The race's graphs of #89's step (tools/gpu_race.py): its compiled model's forward and
    backward, and each function its script compiles, at the arguments its optimizer step gives
    them (an even step and an odd, Adam, one)."""

    def __init__(self, log_path):
        self.log_path = log_path

    def training_step(self):
        """(mode, loss function, arguments) of the race's forward: the model on stage 3's batch
        of 49,152 tokens in documents of 768, the loss summed as the race sums it."""
        import gpu_race

        with race_world(self.log_path) as (mode, reference, model, manager, _, shape):
            batch = gpu_race.reference_batch(reference.module, shape, torch.device("cpu"))
            with mode:
                batch = tuple(mode.from_tensor(t) for t in batch)
            forward_args = manager.get_forward_args()

        return mode, model, (*batch, forward_args)

    def compiled_calls(self):
        """{(function, argument key): (function, meta arguments)} of the script's compiled
        functions in an even and an odd step of the optimizer, recorded on fake tensors."""
        calls = {}
        with race_world(self.log_path) as (mode, reference, model, manager, first, _):
            module = reference.module
            with _Patches() as patch, mode:
                for owner, name in compiled_definitions(module.__file__):
                    holder = getattr(module, owner) if owner else module
                    fn = vars(holder)[name]
                    fn = fn.__func__ if isinstance(fn, staticmethod) else fn
                    label = f"{owner}.{name}" if owner else name
                    wrapped = recording_call(calls, label, fn)
                    patch(holder, name, staticmethod(wrapped) if owner else wrapped)
                for step in (first, first + 1):
                    for p in model.parameters():
                        p.grad = torch.zeros_like(p)
                    manager.advance_schedule(step)
                    manager.step_optimizers(step)
        return calls


def recording_call(calls, label, fn):
    """fn, its calls recorded in `calls` by argument key (keywords bound: constants of the
    graph)."""

    def call(*args, **kwargs):
        key = (label, argument_key(args), tuple(sorted(kwargs.items())))
        bound = functools.partial(fn, **kwargs) if kwargs else fn
        calls.setdefault(key, (bound, meta_args(args)))
        return fn(*args, **kwargs)

    return call


def race_graphs(log_path):
    """The race's graphs of #89's step, named `race #89 ...`."""
    run = RaceRun(log_path)
    graphs = [
        Graph(
            "race #89 training step at 49,152 tokens (stage 3, forward+backward, FlexAttention "
            "for FlashAttention 3)",
            run.training_step,
            lambda p: lower_module(p[1], p[2], p[0]),
        )
    ]
    try:
        calls = run.compiled_calls()
    except Exception as e:  # named as one graph not compiled
        return graphs + [Graph("race #89 optimizer's compiled functions", _raiser(e), None)]
    for (label, _, kwargs), (fn, args) in sorted(calls.items(), key=str):
        shapes = ", ".join("x".join(map(str, a.shape)) for a in args
                           if isinstance(a, torch.Tensor) and a.dim())
        keywords = "".join(f", {k}={v}" for k, v in kwargs)
        graphs.append(Graph(f"race #89 {label} at {shapes}{keywords}", lambda args=args: args,
                            lambda args, fn=fn: lower_function(fn, args)))
    return graphs


# ---------------------------------------------------------------------- main


def summary_line(outcomes):
    ran = [o for o in outcomes if o.status != "not compiled"]
    failed = sum(o.status == "failed" for o in outcomes)
    kernels = sum(o.kernels for o in outcomes if o.status == "ok")
    return (
        f"cuda compile: {len(ran)} graphs, {kernels} kernels compiled for sm_90, {failed} failed, "
        f"{len(outcomes) - len(ran)} not compiled"
    )


INVENTORY_COLUMNS = (
    "graph",
    "kernel",
    "read_bytes",
    "written_bytes",
    "grid",
    "launches",
    "configs",
    "shared_bytes",
    "registers",
    "spill_bytes",
)


def inventory_rows(kernels):
    """One row per compiled kernel (INVENTORY_COLUMNS): bytes it reads and writes at these shapes
    (kernel_traffic, per call), the grid of its first configuration ("" when not derived:
    templates, Polar Express), its calls in one run of its graph, and the largest shared memory,
    registers and spills over its configurations."""
    return [
        dict(
            graph=k.graph,
            kernel=k.name,
            read_bytes=k.reads,
            written_bytes=k.writes,
            grid="x".join(map(str, k.grid)),
            launches=k.launches,
            configs=len(k.binaries),
            shared_bytes=max(b.shared for b in k.binaries),
            registers=max(b.registers for b in k.binaries),
            spill_bytes=max(b.spills for b in k.binaries),
        )
        for k in kernels
    ]


def write_inventory(path, outcomes, kernels):
    """The kernel inventory: CSV (one row per kernel) for a .csv path, else JSON with the graphs
    too."""
    rows = inventory_rows(kernels)
    if path.suffix == ".csv":
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, INVENTORY_COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
        return
    graphs = [
        dict(
            graph=o.graph,
            status=o.status,
            kernels=o.kernels,
            seconds=round(o.seconds, 1),
            detail=o.detail,
        )
        for o in outcomes
    ]
    path.write_text(
        json.dumps(
            dict(target="sm_90", shared_limit_bytes=H100_SMEM, graphs=graphs, kernels=rows),
            indent=1,
        )
        + "\n"
    )


def select(graphs, only):
    """The graphs whose name contains one of `only` (case-insensitive), all without it."""
    if not only:
        return graphs
    return [g for g in graphs if any(word.lower() in g.name.lower() for word in only)]


def build_arg_parser():
    parser = argparse.ArgumentParser(
        prog="cuda_compile_check.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--only",
        nargs="+",
        metavar="WORD",
        help="compile only the graphs whose name contains one of these words (see --list)",
    )
    parser.add_argument("--list", action="store_true", help="list the graphs and exit")
    parser.add_argument(
        "--known-failure",
        nargs="+",
        default=[],
        metavar="WORD",
        help="graphs (by a word of their name) whose failure is known and reported: they fail "
        "loudly but do not set the exit status; one that compiles does (drop it from the list)",
    )
    parser.add_argument(
        "--train-gpt",
        type=Path,
        default=ROOT / "train_gpt.py",
        metavar="FILE",
        help="the train_gpt.py to compile (default: this checkout's), e.g. an old commit's",
    )
    parser.add_argument(
        "--reference",
        type=Path,
        metavar="LOG",
        help="compile instead the Triton kernels of a modded-nanogpt record log's "
        "triton_kernels.py "
        "(e.g. #89's in ../shared/reference/), at the calls of its script's stage-3 step",
    )
    parser.add_argument(
        "--race",
        type=Path,
        nargs="?",
        const=RACE_LOG,
        metavar="LOG",
        help="compile instead the graphs of #89's step in tools/gpu_race.py's race (its model's "
        "forward and backward, its compiled optimizer functions) from LOG (default: #89's log in "
        "../shared/reference/)",
    )
    parser.add_argument(
        "--kernels", action="store_true", help="print every kernel's line, not only the graphs'"
    )
    parser.add_argument(
        "--inventory",
        type=Path,
        metavar="FILE",
        help="write the kernel inventory: FILE.csv (a row per kernel) or FILE.json (with the "
        "graphs)",
    )
    return parser


def check_args(parser, args):
    if not args.train_gpt.is_file():
        parser.error(f"--train-gpt {args.train_gpt}: no such file; give the path of a train_gpt.py")
    if args.reference and not args.reference.is_file():
        parser.error(
            f"--reference {args.reference}: no such file; give a modded-nanogpt record log"
        )
    if args.race and not args.race.is_file():
        parser.error(f"--race {args.race}: no such file; give modded-nanogpt record #89's log")
    if args.race and args.reference:
        parser.error("--race and --reference: give one (each compiles its own graphs)")
    if args.inventory and not args.inventory.parent.is_dir():
        parser.error(
            f"--inventory {args.inventory}: no folder {args.inventory.parent}; make it first"
        )


def main(argv=None):
    parser = build_arg_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    mismatch = version_mismatch()
    if mismatch:
        print(mismatch)
        return 2
    tg = load_train_gpt(args.train_gpt)
    if args.reference:
        graphs, _folder = reference_graphs(args.reference)
        graphs = select(graphs, args.only)
    elif args.race:
        graphs = select(race_graphs(args.race), args.only)
    else:
        graphs = select(record_graphs(RecordRun(tg)), args.only)
    if args.list:
        print("\n".join(g.name for g in graphs))
        return 0
    if not graphs:
        parser.error(
            f"--only {' '.join(args.only)}: no graph's name contains these words; see --list"
        )
    print(
        f"torch {torch.__version__}, Triton {running_versions()['triton']}; "
        f"{args.reference or args.race or args.train_gpt}"
    )
    print("fake H100: " + "; ".join(FAKE_SETTINGS), flush=True)
    with fake_h100():
        outcomes = [run_graph(g, verbose=args.kernels) for g in graphs]
    for o in outcomes:
        if o.status == "not compiled":
            print(f"not compiled: {o.graph}: {o.detail}")
    if args.inventory:
        write_inventory(args.inventory, outcomes, LOG.kernels)
        print(f"kernel inventory: {args.inventory}")
    known = [o for o in outcomes if any(w in o.graph for w in args.known_failure)]
    for o in known:
        if o.status == "failed":
            print(f"known failure (--known-failure): {o.graph}: {o.detail}")
        elif o.status == "ok":
            print(f"{o.graph} compiles now: drop it from --known-failure")
    print(summary_line(outcomes))
    unexpected = [o for o in outcomes if o.status == "failed" and o not in known]
    return 1 if unexpected or any(o.status == "ok" for o in known) else 0


if __name__ == "__main__":
    sys.exit(main())
