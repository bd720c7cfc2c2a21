"""The reference's training step for the step-cost ledger: a modded-nanogpt record log's own train_gpt.py and
triton_kernels.py, loaded without running their training, with stand-ins for what cannot run on fake tensors.

    reference = Reference(log_path, world_size, attention_op)   (the definitions, in modules of their own)
    model, manager = reference.build()                          (under the trace's FakeTensorMode and process group)
    reference.step(model, manager, step, tokens, ledger)        (one training step into a step_cost.Ledger)

Loading. Such a log starts with the record's train_gpt.py, then a line of 40 '-', '# triton_kernels.py', another
line of 40 '-', that file, and a line of 100 '=' before the run's output. Both files go to a temporary folder
(never the repository) and are parsed with `ast`; only definitions run:
- imports, functions and classes, and the top-level constants their bodies read (names in CAPITALS, and
  KEPT_NAMES: the schedule, the hyperparameters, the FP8 MLP's autograd function, the Polar Express
  coefficients). The rest (process-group set-up, logging, data, the training loop) is dropped;
- `torch.compile` decorators are dropped (the ledger's ideal fusion stands for the compiler), the custom ops'
  namespace is renamed per log (one process may load two logs), and `.cuda()` is the identity;
- `from kernels import get_kernel` (the hub download of FlashAttention 3) gets a stand-in whose
  flash_attn_varlen_func is the ledger's visible-tile attention; `world_size`, `rank`, `grad_accum_steps`,
  `grad_scale`, `device` and `master_process` are given, the process group is the ledger's fake one;
- of triton_kernels.py the autograd functions stay (their torch ops are traced as they are); every kernel
  launcher they or the script call is replaced by STAND_INS: a custom op each, reading and writing the tensors
  the kernel reads and writes, with its FLOPs (tensor-core tiles it computes; pointwise kernels count none,
  as FlopCounterMode counts none for pointwise ops). A launcher without a stand-in stops the trace with its
  name. Their backwards may return fewer gradients than they have inputs (dynamo, which runs them in the
  record, pads with None; eager autograd does not): the loader pads them.
The model is built from the script's own `model = GPT(...)` statement and the casts after it. All fake tensors
live on the CPU device; the optimizer's 0-d tensors, which the reference keeps on the CPU, are marked as host
tensors: ops on them alone are host work that launches no kernel.

The training step follows the script's loop: forward, `.sum() * grad_scale`, backward, then its
TrainingManager's step_optimizers and quantize_mlp_fp8. The bigram table's sparse exchange (world size 8) needs
the rows a rank touched since the last Adam step, which depend on the data: SPARSE_ROWS counts them as for
uniformly spread bigram hashes (an upper bound: real bigrams repeat).
"""
import ast
import contextlib
import math
import os
import sys
import tempfile
import types

import torch
from torch.utils.flop_counter import register_flop_formula

NAMESPACE = "step_cost_ref"
NUM_SMS = 132  # streaming multiprocessors of an H100 SXM: the persistent kernels' grid (NVIDIA H100 datasheet)
SCRIPT_END = "\n\n" + "-" * 40 + "\n# triton_kernels.py\n" + "-" * 40 + "\n\n"
KERNELS_END = "\n" + "=" * 100 + "\n"
KEPT_NAMES = {"ReLUSqrdMLP", "polar_express_coeffs", "args", "training_schedule", "flash_attn_interface"}
STUBBED_MODULES = {"triton", "kernels", "triton_kernels"}


class LogError(ValueError):
    """The log is not a modded-nanogpt record log this tool can trace; the message says why."""


# ---- stand-ins for the Triton and CUDA kernels: custom ops with the kernel's reads, writes and FLOPs

def _tiles(n, block):
    return -(-n // block)


def symmetric_tiles(m, block_m, block_n):
    """Output tiles a symmetric-product kernel computes: those of the cdiv(m, bm) x cdiv(m, bn) grid that are not
    wholly above the diagonal (the kernels skip a tile when its row start + BLOCK_M <= its column start)."""
    return sum(1 for i in range(_tiles(m, block_m)) for j in range(_tiles(m, block_n))
               if not i * block_m + block_m <= j * block_n)


def gram_blocks(k):
    """XXT's and XTX's (BLOCK_M, BLOCK_N, BLOCK_K) by the contraction width, as the launchers choose them."""
    return (128, 128, 64) if k == 768 else (64, 128, 128)


def xxt_flops(shape):
    """A @ A.T of A (..., M, K): the computed tiles' multiply-adds over K padded to BLOCK_K."""
    *batch, m, k = shape
    bm, bn, bk = gram_blocks(k)
    return math.prod(batch) * symmetric_tiles(m, bm, bn) * 2 * bm * bn * _tiles(k, bk) * bk


def xtx_flops(shape):
    """A.T @ A of A (..., M, K): tiles of the K x K output, contraction over M padded to BLOCK_K."""
    *batch, m, k = shape
    bm, bn, bk = gram_blocks(k)
    return math.prod(batch) * symmetric_tiles(k, bm, bn) * 2 * bm * bn * _tiles(m, bk) * bk


def ba_plus_caa_flops(shape):
    """alpha A @ A.T + beta A of a square A (..., M, M): 128 x 128 tiles, contraction over M padded to 64."""
    *batch, m, _ = shape
    return math.prod(batch) * symmetric_tiles(m, 128, 128) * 2 * 128 * 128 * _tiles(m, 64) * 64


def linear_relu_square_flops(m, n, k):
    """The persistent GEMM of linear_relu_square: 128 x 256 tiles over M x N, K in full (tiles divide the
    record's shapes; ragged edges are masked stores of full tiles)."""
    return _tiles(m, 128) * 128 * _tiles(n, 256) * 256 * 2 * k


def _op(name, mutates=()):
    return torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=mutates)


@_op("xxt", ("out",))
def xxt_op(a: torch.Tensor, out: torch.Tensor) -> None:
    """XXT: out = a @ a.mT (reads a, writes out)."""


@_op("xtx", ("out",))
def xtx_op(a: torch.Tensor, out: torch.Tensor) -> None:
    """XTX: out = a.mT @ a."""


@_op("ba_plus_caa", ("out",))
def ba_plus_caa_op(a: torch.Tensor, alpha: float, beta: float, out: torch.Tensor) -> None:
    """ba_plus_cAA: out = alpha a @ a.mT + beta a."""


@_op("linear_relu_square", ("partial_amax",))
def linear_relu_square_op(a: torch.Tensor, b: torch.Tensor, dequant_scale: torch.Tensor,
                          activation_scale: torch.Tensor, partial_amax: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward of the fused MLP up projection with FP8 output: pre = a @ b.T (scaled), post = relu(pre)^2,
    post in e4m3 and each program's amax of post (NUM_SMS floats)."""
    m, n = a.shape[0], b.shape[0]
    return (a.new_empty(m, n, dtype=torch.bfloat16), a.new_empty(m, n, dtype=torch.bfloat16),
            a.new_empty(m, n, dtype=torch.float8_e4m3fn))


@linear_relu_square_op.register_fake
def _(a, b, dequant_scale, activation_scale, partial_amax):
    m, n = a.shape[0], b.shape[0]
    return (a.new_empty(m, n, dtype=torch.bfloat16), a.new_empty(m, n, dtype=torch.bfloat16),
            a.new_empty(m, n, dtype=torch.float8_e4m3fn))


@_op("linear_relu_square_backward")
def linear_relu_square_backward_op(a: torch.Tensor, b: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Its backward: 2 (a @ b.T) relu(pre), reading pre."""
    return a.new_empty(a.shape[0], b.shape[0])


@linear_relu_square_backward_op.register_fake
def _(a, b, pre):
    return a.new_empty(a.shape[0], b.shape[0])


@_op("ce_fwd_bwd", ("losses", "grad_input"))
def ce_fwd_bwd_op(logits: torch.Tensor, targets: torch.Tensor, mtp_weights: torch.Tensor, losses: torch.Tensor,
                  grad_input: torch.Tensor, n_rows: int, n_predict: int) -> None:
    """The softcapped multi-token cross-entropy: reads each row's bf16 logits and its n_predict targets, writes
    the row's loss and its e5m2 logit gradient."""


@_op("quantize_transpose", ("output", "used_scales", "partial_amax"))
def quantize_transpose_op(weights: torch.Tensor, output: torch.Tensor, next_scales: torch.Tensor,
                          used_scales: torch.Tensor, partial_amax: torch.Tensor) -> None:
    """The down projections in e4m3, transposed: reads the bf16 weights and the scales, writes the FP8 copy,
    the scales used and each 64 x 64 tile's amax."""


@_op("reduce_amax", ("scales",))
def reduce_amax_op(partial_amax: torch.Tensor, scales: torch.Tensor) -> None:
    """reduce_mlp_activation_scales: each row's max of the partial amaxes, times a headroom, into scales."""


@_op("transpose_copy", ("dst",))
def transpose_copy_op(src: torch.Tensor, dst: torch.Tensor) -> None:
    """dst = src.T (tiled)."""


@_op("transpose_add", ("acc",))
def transpose_add_op(src: torch.Tensor, acc: torch.Tensor) -> None:
    """acc += src.T: acc is read and written."""


for _fn in (xxt_op, xtx_op, ba_plus_caa_op, ce_fwd_bwd_op, quantize_transpose_op, reduce_amax_op, transpose_copy_op,
            transpose_add_op):
    _fn.register_fake(lambda *args, **kwargs: None)

# the arguments a mutating stand-in reads as well as writes (the others are written only)
READ_AND_WRITTEN = {"acc"}
STAND_IN_KIND = {"xxt": "matmul bf16", "xtx": "matmul bf16", "ba_plus_caa": "matmul bf16",
                 "linear_relu_square": "matmul fp8", "linear_relu_square_backward": "matmul bf16"}


def stand_in_kind(name):
    return STAND_IN_KIND.get(name, "pointwise/reduction")


# ce_fwd_bwd's special functions per logit: the sigmoid (a tanh), the exp of the sum and the exp of
# the gradient
CE_SFU_PER_LOGIT = 3
# ce_fwd_bwd's occupancy: __launch_bounds__(BLOCK_SIZE, 2), and each block holds its row's sigmoids
# in shared memory (50,304 x 2 bytes): two blocks per SM, each loading its row, then computing, then
# storing
CE_BLOCKS_PER_SM = 2


def _batch(shape):
    return math.prod(shape[:-2])


def stand_in_kernel(name, args):
    """The step-cost Op fields (tiles, sfu, blocks_per_sm) of a stand-in's kernel: its output tiles
    as the kernel tiles them, or the loss kernel's special functions and occupancy."""
    if name in ("linear_relu_square", "linear_relu_square_backward"):
        return dict(tiles=_tiles(args[0].shape[0], 128) * _tiles(args[1].shape[0], 256))
    if name in ("xxt", "xtx"):
        *_, m, k = args[0].shape
        side = m if name == "xxt" else k
        return dict(tiles=_batch(args[0].shape) * symmetric_tiles(side, *gram_blocks(k)[:2]))
    if name == "ba_plus_caa":
        return dict(tiles=_batch(args[0].shape) * symmetric_tiles(args[0].shape[-1], 128, 128))
    if name == "ce_fwd_bwd":
        return dict(sfu=CE_SFU_PER_LOGIT * args[0].numel(), blocks_per_sm=CE_BLOCKS_PER_SM)
    return {}


@register_flop_formula(torch.ops.step_cost_ref.xxt)
def _(a, out, **kwargs):
    return xxt_flops(a)


@register_flop_formula(torch.ops.step_cost_ref.xtx)
def _(a, out, **kwargs):
    return xtx_flops(a)


@register_flop_formula(torch.ops.step_cost_ref.ba_plus_caa)
def _(a, alpha, beta, out, **kwargs):
    return ba_plus_caa_flops(a)


@register_flop_formula(torch.ops.step_cost_ref.linear_relu_square)
def _(a, b, *args, **kwargs):
    return linear_relu_square_flops(a[0], b[0], a[1])


@register_flop_formula(torch.ops.step_cost_ref.linear_relu_square_backward)
def _(a, b, pre, **kwargs):
    return linear_relu_square_flops(a[0], b[0], a[1])


def XXT(A, out):
    xxt_op(A, out)
    return out


def XTX(A, out):
    xtx_op(A, out)
    return out


def ba_plus_cAA(A, alpha, beta, out):
    ba_plus_caa_op(A, float(alpha), float(beta), out)
    return out


def linear_relu_square(a, b, aux=None, a_f8=None, b_f8=None, dequant_scale_ptr=None, activation_scale=None,
                       partial_amax=None):
    """The launcher's three cases: backward (aux given: the pre-activation), FP8 forward with FP8 output (the
    record's), and the forwards without it (bf16, or FP8 input only), which a record's training does not run."""
    if aux is not None:
        return linear_relu_square_backward_op(a, b, aux)
    if activation_scale is None or b_f8 is None:
        raise LogError("the reference's MLP runs linear_relu_square without FP8 output, which has no stand-in")
    return linear_relu_square_op(a_f8, b_f8, dequant_scale_ptr, activation_scale, partial_amax)


def reduce_mlp_activation_scales(partial_amax, scales, headroom=1.25):
    reduce_amax_op(partial_amax, scales[:partial_amax.shape[0]])


def quantize_transpose_mlp_down_weights(weights, output_storage, next_scales, used_scales, partial_amax,
                                        headroom=1.12):
    quantize_transpose_op(weights, output_storage, next_scales, used_scales, partial_amax)
    reduce_mlp_activation_scales(partial_amax, next_scales, headroom)


def transpose_copy(src, dst):
    transpose_copy_op(src, dst)


def transpose_add(src, dst):
    transpose_add_op(src, dst)


def ce_fwd_bwd(logits, targets, mtp_weights, losses, grad_input, n_rows, n_predict, *constants):
    ce_fwd_bwd_op(logits, targets, mtp_weights, losses, grad_input, n_rows, n_predict)


STAND_INS = {f.__name__: f for f in (XXT, XTX, ba_plus_cAA, linear_relu_square, reduce_mlp_activation_scales,
                                      quantize_transpose_mlp_down_weights, transpose_copy, transpose_add, ce_fwd_bwd)}


# ---- FlashAttention 3 (the hub's kernels-community/flash-attn3) as the ledger's visible-tile attention

def window_tiles(seq_len, window_tokens, tile=128):
    """128 x 128 tiles a causal sliding-window kernel computes for one document of seq_len positions: query tile
    i meets key tiles from the one holding position 128 i - window to tile i."""
    return sum(i - max(0, (tile * i - window_tokens) // tile) + 1 for i in range(_tiles(seq_len, tile)))


class FlashAttention3:
    """`get_kernel('kernels-community/flash-attn3', ...)`'s stand-in: flash_attn_varlen_func is the ledger's
    fused attention over the tiles of one document per call (as the ledger counts ours)."""

    def __init__(self, attention_op):
        self.attention_op = attention_op
        self.flash_attn_interface = self

    def flash_attn_varlen_func(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                               softmax_scale, window_size):
        assert causal, "the stand-in counts causal tiles"
        return self.attention_op(q, k, v, window_tiles(q.shape[0], int(window_size[0])), "fa3")[0]


# ---- loading the definitions

def split_log(text, source="the log"):
    """(train_gpt.py, triton_kernels.py) of a record log's text."""
    start = text.find(SCRIPT_END)
    if start < 0:
        raise LogError(f"{source} has no '# triton_kernels.py' section between lines of 40 '-': not a "
                       "modded-nanogpt record log of the triton_kernels.py era")
    end = text.find(KERNELS_END, start + len(SCRIPT_END))
    if end < 0:
        raise LogError(f"{source}: no line of 100 '=' after triton_kernels.py: the log is cut short")
    return text[:start], text[start + len(SCRIPT_END):end]


def _parsed(code, name):
    try:
        return ast.parse(code, filename=name)
    except SyntaxError as e:
        raise LogError(f"its {name} does not parse (line {e.lineno}: {e.msg})") from None


def read_log(path):
    """(train_gpt.py, triton_kernels.py) of the record log at `path`, both checked to parse: a log
    that cannot be traced is refused in a moment, before any tracing."""
    if os.path.isdir(path):
        raise LogError("is a directory, not a modded-nanogpt record log")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise LogError("no such file (a modded-nanogpt record log)") from None
    except OSError as e:
        raise LogError(f"cannot be read ({e.strerror})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LogError(f"is not a text log (not UTF-8 at byte {e.start})") from None
    script, kernels = split_log(text, "the log")
    _parsed(script, "train_gpt.py")
    _parsed(kernels, "triton_kernels.py")
    return script, kernels


class _Rewrite(ast.NodeTransformer):
    """Drops torch.compile decorators, renames the custom-op namespace, makes `.cuda()` the identity
    (the decorators and `.cuda()` stay with keep_compile and keep_cuda: a real run on a GPU,
    tools/gpu_race.py)."""

    def __init__(self, namespace, keep_compile=False, keep_cuda=False):
        self.namespace, self.keep_compile, self.keep_cuda = namespace, keep_compile, keep_cuda

    @staticmethod
    def _is_compile(node):
        target = node.func if isinstance(node, ast.Call) else node
        return ast.unparse(target) in ("torch.compile", "compile")

    def visit_FunctionDef(self, node):
        if not self.keep_compile:
            node.decorator_list = [d for d in node.decorator_list if not self._is_compile(d)]
        return self.generic_visit(node)

    def visit_Constant(self, node):
        if isinstance(node.value, str) and node.value.startswith("nanogpt::"):
            return ast.copy_location(ast.Constant(self.namespace + node.value[len("nanogpt"):]), node)
        return node

    def visit_Attribute(self, node):
        self.generic_visit(node)
        if node.attr == "nanogpt" and ast.unparse(node.value) == "torch.ops":
            node.attr = self.namespace
        return node

    def visit_Call(self, node):
        self.generic_visit(node)
        call = node.func
        if (isinstance(call, ast.Attribute) and call.attr == "cuda" and not node.args
                and not node.keywords and not self.keep_cuda):
            return node.func.value
        return node


def _imported_modules(node):
    if isinstance(node, ast.ImportFrom):
        return {(node.module or "").split(".")[0]}
    return {alias.name.split(".")[0] for alias in node.names}


def _kept(node):
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        return True
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return not _imported_modules(node) & STUBBED_MODULES
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        names = [t.id for t in targets if isinstance(t, ast.Name)]
        return len(names) == len(targets) and all(n.isupper() or n in KEPT_NAMES for n in names)
    return False


def _model_statements(tree):
    """The script's `model = GPT(...)` statement and those after it up to torch.compile(model): the casts."""
    body = tree.body
    start = next((i for i, n in enumerate(body) if isinstance(n, (ast.Assign, ast.AnnAssign))
                  and "GPT(" in ast.unparse(n.value or ast.Constant(None))), None)
    if start is None:
        raise LogError("no `model = GPT(...)` statement in the log's train_gpt.py")
    end = next((i for i in range(start + 1, len(body)) if "torch.compile" in ast.unparse(body[i])), len(body))
    return [n for n in body[start:end] if "broadcast" not in ast.unparse(n) and "quantize_mlp_fp8" not in ast.unparse(n)]


@contextlib.contextmanager
def _cuda_properties():
    """torch.cuda's device queries (the model reads the SM count) answered for an H100 SXM."""
    saved = torch.cuda.get_device_properties, torch.cuda.current_device
    torch.cuda.get_device_properties = lambda *args: types.SimpleNamespace(multi_processor_count=NUM_SMS)
    torch.cuda.current_device = lambda: 0
    try:
        yield
    finally:
        torch.cuda.get_device_properties, torch.cuda.current_device = saved


def _padded_backward(backward):
    """A backward returning fewer gradients than its Function has inputs, padded with None (or
    more, the extra Nones dropped): the compiled run (dynamo) accepts such a tuple, eager autograd
    does not."""
    def padded(ctx, *grads):
        result = backward(ctx, *grads)
        result = result if isinstance(result, tuple) else (result,)
        inputs = len(ctx.needs_input_grad)
        assert all(g is None for g in result[inputs:]), "a backward with gradients past its inputs"
        return result[:inputs] + (None,) * (inputs - len(result))
    return padded


class Reference:
    """The record's definitions (`module`) and how to build and step its model on fake tensors. Load it under
    the FakeTensorMode and process group of the trace: its schedule makes tensors at import."""
    loads = 0
    rewrite_options = {}  # _Rewrite's keep_compile and keep_cuda

    def __init__(self, log_path, world_size, attention_op, micro_steps=None, sizes=None):
        """micro_steps: one rank's micro-steps per step (default the script's 8 // world_size);
        sizes: the model's GPT(...) keywords and `args` fields to change (smaller models:
        tools/gpu_race.py's dry run)."""
        script, kernels = read_log(log_path)
        if 8 % world_size:
            raise LogError(f"the reference runs on world sizes dividing 8 (its grad_accum_steps = 8 // world_size), "
                           f"not {world_size}")
        Reference.loads += 1  # custom ops stay registered for the process: a namespace per load
        self.namespace, self.world_size = f"reference{Reference.loads}", world_size
        self.micro_steps, self.sizes = micro_steps or 8 // world_size, dict(sizes or {})
        # the files live as long as this object: tracebacks through the reference's code show its lines
        self._folder = tempfile.TemporaryDirectory(prefix="step_cost_reference_")
        paths = {}
        for name, code in (("train_gpt.py", script), ("triton_kernels.py", kernels)):
            paths[name] = os.path.join(self._folder.name, name)
            with open(paths[name], "w", encoding="utf-8") as f:
                f.write(code)
        self.kernels = self._load_kernels(paths["triton_kernels.py"])
        self.module, self._model_code = self._load_script(paths["train_gpt.py"], attention_op)

    def _module(self, name, path):
        """An empty module for the log's file `name` at `path`, named by this load and registered
        in sys.modules: dynamo imports the module of a function it inlines by its name."""
        module = types.ModuleType(f"{self.namespace}_{name}")
        module.__file__ = path
        sys.modules[module.__name__] = module
        return module

    def _parse(self, path):
        with open(path, encoding="utf-8") as f:
            return ast.parse(f.read(), filename=path)

    def _exec(self, tree, module, path):
        rewrite = _Rewrite(self.namespace, **self.rewrite_options)
        tree = ast.fix_missing_locations(rewrite.visit(tree))
        exec(compile(tree, path, "exec"), module.__dict__)

    def _load_kernels(self, path):
        tree = self._parse(path)
        # its functions are kernels and their launchers: the classes call STAND_INS instead
        tree.body = [n for n in tree.body if _kept(n) and not isinstance(n, ast.FunctionDef)]
        module = self._module("triton_kernels", path)
        module.__dict__.update(STAND_INS)
        self._exec(tree, module, path)
        for value in list(vars(module).values()):
            if isinstance(value, type) and issubclass(value, torch.autograd.Function):
                value.backward = staticmethod(_padded_backward(value.backward))
        return module

    def _load_script(self, path, attention_op):
        tree = self._parse(path)
        module = self._module("train_gpt", path)
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module == "triton_kernels":
                for alias in node.names:
                    if not hasattr(self.kernels, alias.name):
                        raise LogError(f"the reference imports {alias.name} from triton_kernels.py, which has no "
                                       "stand-in here")
                    setattr(module, alias.asname or alias.name, getattr(self.kernels, alias.name))
        module.get_kernel = lambda *args, **kwargs: self.flash_attention(attention_op)
        module.__dict__.update(rank=0, world_size=self.world_size, master_process=True,
                               grad_accum_steps=self.micro_steps, grad_scale=1 / self.micro_steps,
                               device=self.device())
        model_code = ast.Module(body=_model_statements(tree), type_ignores=[])
        tree.body = [n for n in tree.body if _kept(n)]
        self._exec(tree, module, path)
        self._resize(module, model_code)
        return module, model_code

    def flash_attention(self, attention_op):
        """What `get_kernel('kernels-community/flash-attn3', ...)` returns: the ledger's
        stand-in."""
        return FlashAttention3(attention_op)

    def device(self):
        """The script's `device`: the CPU, which holds the trace's fake tensors."""
        return torch.device("cpu")

    def _resize(self, module, model_code):
        """self.sizes into the model statement's GPT(...) keywords and the script's `args`
        fields."""
        keywords = {k.arg: k for n in ast.walk(model_code) if isinstance(n, ast.Call)
                    and ast.unparse(n.func) == "GPT" for k in n.keywords}
        for name, value in self.sizes.items():
            if name in keywords:
                keywords[name].value = ast.Constant(value)
            elif hasattr(module.args, name):
                setattr(module.args, name, value)
            else:
                raise LogError(f"size {name!r} is neither a keyword of the log's GPT(...) nor a "
                               "field of its args")

    @staticmethod
    def _fit_weight_amax(model):
        """The down projections' per-tile amax buffer at the model's size: the log makes it
        (12, 576), the count of 64 x 64 tiles of a 3,072 x 768 matrix, which
        quantize_transpose_mlp_down_weights asserts."""
        hidden, dim = model.mlp_bank.shape[-2:]
        tiles = _tiles(hidden, 64) * _tiles(dim, 64)
        buffer = model._mlp_down_weight_partial_amax
        if buffer.shape[1] != tiles:
            model._mlp_down_weight_partial_amax = buffer.new_empty(buffer.shape[0], tiles)

    def build(self):
        """(model, training manager): the script's GPT(...) and casts, quantize_mlp_fp8(bootstrap_down=True) and
        TrainingManager(model), under the caller's fake modes and process group."""
        namespace = dict(self.module.__dict__)
        with _cuda_properties():
            code = _Rewrite(self.namespace, **self.rewrite_options).visit(self._model_code)
            exec(compile(ast.fix_missing_locations(code), self.module.__file__, "exec"), namespace)
        model = namespace["model"]
        self._fit_weight_amax(model)
        model.quantize_mlp_fp8(bootstrap_down=True)
        self.module.model = model  # TrainingManager.sparse_index_share reads the global
        return model, self.module.TrainingManager(model)


    def batch(self, tokens):
        """(inputs, targets, cumulative document lengths, bigram hashes) of one rank's `tokens`, as its loader
        makes them (one document: the ledger's assumption for both codes)."""
        m = self.module
        docs = m.TRAIN_MAX_NUM_DOCS.get(tokens, m.next_multiple_of_n(tokens // 300, n=128))
        return (torch.zeros(tokens, dtype=torch.int32), torch.zeros(tokens, dtype=torch.int64),
                torch.zeros(docs, dtype=torch.int32), torch.zeros(tokens, dtype=torch.int32))

    @staticmethod
    def host_tensors(manager):
        """The optimizer's 0-d tensors: the reference keeps them on the CPU (its learning rates and momentum, read
        by the compiled steps without recompiling)."""
        return [v for v in vars(manager.optimizer).values() if isinstance(v, torch.Tensor) and v.dim() == 0]

    def traced_steps(self, manager, first, following):
        """(even step, odd step) of the stage [first, following) to trace: Adam runs on odd steps, and the
        untie step (its one-off copy of the optimizer state) is left out."""
        even = first + first % 2
        if even + 1 == self.module.training_schedule.split_step:
            even += 2
        if even + 1 >= following:
            raise LogError(f"the reference's stage of steps {first}-{following - 1} has no even and odd step to trace")
        return even, even + 1

    def step(self, model, manager, step, tokens, ledger):
        """One training step of the script's loop into `ledger`: each micro-step's forward ('forward', with the
        sparse exchange's index share) and backward ('backward'), then the optimizer step and the FP8 refresh
        ('optimizer')."""
        m = self.module
        manager.advance_schedule(step)
        for _ in range(m.grad_accum_steps):
            batch = self.batch(tokens)
            with ledger:
                ledger.phase = "forward"
                loss = model(*batch, manager.get_forward_args()).sum() * m.grad_scale
                if manager._is_adam_step(step):
                    self._share_indexes(model, manager, tokens)
                ledger.phase = "backward"
                loss.backward()
                del loss
        with ledger:
            ledger.phase = "optimizer"
            manager.step_optimizers(step)
            model.quantize_mlp_fp8(bootstrap_down=step < 16)

    def _share_indexes(self, model, manager, tokens):
        """TrainingManager.sparse_index_update and sparse_index_share at a known count of touched rows: the index
        all-to-all, then the optimizer's records of it, as sparse_index_share leaves them."""
        optimizer, param = manager.optimizer, model.bigram_embed.weight
        if optimizer.param_cfgs[param].comms != "sharded_sparse":
            return
        world = self.world_size
        per_peer = round(SPARSE_ROWS(2 * tokens, param.shape[0]) / world)
        counts = [0 if r == 0 else per_peer for r in range(world)]  # this rank (0) keeps its own rows
        send = torch.empty(sum(counts), dtype=torch.int32, device=param.device)
        received = torch.empty(sum(counts), dtype=torch.int32, device=param.device)
        future = torch.distributed.all_to_all_single(received, send, output_split_sizes=counts,
                                                     input_split_sizes=counts, async_op=True).get_future()
        optimizer._reduce_futures[param] = [future, received]
        optimizer._sparse_async_data[param] = dict(send_idxes=send, send_counts=counts, recv_counts=counts)


def expected_unique_rows(draws, rows):
    """Distinct rows among `draws` uniform draws from `rows`."""
    return rows * -math.expm1(draws * math.log1p(-1 / rows))


# the bigram rows a rank touches between two Adam steps (two steps of its tokens)
SPARSE_ROWS = expected_unique_rows


if __name__ == "__main__":
    sys.exit("reference_step.py is a module of tools/step_cost.py: run python tools/step_cost.py --reference LOG")
