"""The GPU path's own Triton kernels (train_gpt.py loads this file on CUDA when the head runs in
FP8; docs/fp8-kernels.md):

- speedrun::fp8_up_relu_square: pre = bf16(dequant * x_f8 @ w1_f8^T), post = bf16(relu(pre)^2),
  post_f8 = e4m3(min(post * inv_act_scale, 448)) and each tile's max(pre, 0) for the next forward's
  activation amax, in one pass over the output (record #89's `linear_relu_square` does the same);
- speedrun::relu_square_grad: bf16(2 * bf16(grad_out @ w2^T) * relu(pre)), the gradient of pre;
- speedrun::softcap_loss: the FP8 head's softcapped (multi-token) loss sums and the logits' e5m2
  gradient from one read of each row of logits (and a second from L2), in the rounding order of
  train_gpt.softcap_loss_grad (record #89's `ce_fwd_bwd` does the same).

They are torch.library custom ops, opaque to torch.compile, whose implementation launches Triton
kernels: on CUDA, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1, the tests)."""
import functools
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

E4M3_MAX = tl.constexpr(448.0)
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages). The bf16 gradient GEMM has record #89's tile. The FP8
# up projection has half its columns: record #89's 128 x 256 tile keeps 128 fp32 accumulator
# registers a thread, and promoting the FP8 accumulator (below) needs a second one as large, past
# sm_90's 255 registers (ptxas spills 1,056 B; 444 B with the epilogue in halves)
UP_TILE = (128, 128, 128, 8, 3)
GRAD_TILE = (128, 256, 64, 8, 3)
GROUP_M = 8  # row tiles per group: neighbouring programs share a band of W's columns in L2
# The FP8 dot's accumulator is promoted to fp32 registers every K tile (128 elements), as cuBLAS
# accumulates the unfused path's _scaled_mm (use_fast_accum=False), rather than Triton's default on
# Hopper, which keeps the tensor core's narrower accumulator for the whole K loop
UP_IMPRECISE_ACC = UP_TILE[2]


@triton.jit
def _tile_origin(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
    """This program's output tile's first row and column, in groups of GROUP row tiles."""
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP * tiles_n)
    first_m = group * GROUP
    group_rows = min(tiles_m - first_m, GROUP)
    pid_m = first_m + (pid % (GROUP * tiles_n)) % group_rows
    pid_n = (pid % (GROUP * tiles_n)) // group_rows
    return pid_m * BLOCK_M, pid_n * BLOCK_N


@triton.jit
def _round_bf16(x):
    """fp32 rounded to the nearest bf16 (ties to even), kept in fp32, by its bits: Triton's
    interpreter truncates in its own cast, so the kernels round here, and the casts that store the
    values are exact on a GPU and in the tests alike."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


@triton.jit
def _round_e4m3(x):
    """x in [0, 448] (or NaN) rounded to the nearest e4m3 value (ties to even), kept in fp32, for
    the same reason: the interpreter's cast rounds ties away and drops a carry into the exponent.
    Normal values by their bits (3 mantissa bits kept); below 2^-6 to multiples of 2^-9 by fp32's
    own rounding of x + 2^14."""
    bits = x.to(tl.uint32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    subnormal = (x + 16384.0) - 16384.0
    return tl.where(x < 0.015625, subnormal, tl.where(x != x, x, normal))


@triton.jit
def _a_times_b_t(a_ptr, b_ptr, rm, rn, M, N, K, s_am, s_bn, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IMPRECISE_ACC: tl.constexpr,
                 UPCAST: tl.constexpr):
    """The (BLOCK_M, BLOCK_N) tile of A @ B^T in fp32, A (M, K) and B (N, K) row-major; UPCAST:
    the operands as fp32 (Triton 3.6's interpreter multiplies bf16 operands' raw bits)."""
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(a_ptr + rm[:, None] * s_am + kk[None, :],
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(b_ptr + rn[:, None] * s_bn + kk[None, :],
                    mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=IMPRECISE_ACC,
                     input_precision="ieee" if UPCAST else None)
    return acc


@triton.jit
def _up_epilogue(acc, rm, rn, M, N, pre_ptr, post_ptr, post_f8_ptr, inv_act):
    """Stores pre, post and post_f8 of a block of the scaled fp32 sums; returns its max(pre, 0)."""
    # the rounding points of the unfused path: _scaled_mm's scaled fp32 result to bf16, relu and
    # square in fp32 (exact for a bf16 value) to bf16, its fp32 product with 1 / act_scale to e4m3
    pre = _round_bf16(acc)
    relu = tl.maximum(pre, 0.0, propagate_nan=tl.PropagateNan.ALL)
    post = _round_bf16(relu * relu)
    post_f8 = _round_e4m3(tl.minimum(post * inv_act, E4M3_MAX, propagate_nan=tl.PropagateNan.ALL))
    at = rm[:, None] * N + rn[None, :]
    inside = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(pre_ptr + at, pre.to(tl.bfloat16), mask=inside)
    tl.store(post_ptr + at, post.to(tl.bfloat16), mask=inside)
    tl.store(post_f8_ptr + at, post_f8.to(tl.float8e4nv), mask=inside)
    # rows and columns outside the output are 0 here (masked loads), as relu leaves them
    return tl.max(tl.max(relu, axis=1), axis=0)


@triton.jit
def _up_relu_square_kernel(x_ptr, w_ptr, pre_ptr, post_ptr, post_f8_ptr, pre_max_ptr,
                           dequant_ptr, inv_act_ptr, M, N, K, s_xm, s_wn,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           GROUP: tl.constexpr, IMPRECISE_ACC: tl.constexpr):
    row0, col0 = _tile_origin(M, N, BLOCK_M, BLOCK_N, GROUP)
    rm, rn = row0 + tl.arange(0, BLOCK_M), col0 + tl.arange(0, BLOCK_N)
    acc = _a_times_b_t(x_ptr, w_ptr, rm, rn, M, N, K, s_xm, s_wn, BLOCK_M, BLOCK_N, BLOCK_K,
                       IMPRECISE_ACC, False)
    acc = acc * tl.load(dequant_ptr)
    # the epilogue a half tile at a time (its left and right BLOCK_N / 2 columns), as record #89's
    # kernel, fewer values and pointers live at once: 183 registers on sm_90 rather than 254
    left, right = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
    half = tl.arange(0, BLOCK_N // 2)
    inv_act = tl.load(inv_act_ptr)
    left_max = _up_epilogue(left, rm, col0 + half, M, N, pre_ptr, post_ptr, post_f8_ptr, inv_act)
    right_max = _up_epilogue(right, rm, col0 + BLOCK_N // 2 + half, M, N, pre_ptr, post_ptr,
                             post_f8_ptr, inv_act)
    tl.store(pre_max_ptr + tl.program_id(0), tl.maximum(left_max, right_max))


@triton.jit
def _relu_square_grad_kernel(g_ptr, w_ptr, pre_ptr, out_ptr, M, N, K, s_gm, s_wn,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, GROUP: tl.constexpr, UPCAST: tl.constexpr):
    row0, col0 = _tile_origin(M, N, BLOCK_M, BLOCK_N, GROUP)
    rm, rn = row0 + tl.arange(0, BLOCK_M), col0 + tl.arange(0, BLOCK_N)
    acc = _a_times_b_t(g_ptr, w_ptr, rm, rn, M, N, K, s_gm, s_wn, BLOCK_M, BLOCK_N, BLOCK_K, 0,
                       UPCAST)
    at = rm[:, None] * N + rn[None, :]
    inside = (rm[:, None] < M) & (rn[None, :] < N)
    pre = tl.load(pre_ptr + at, mask=inside, other=0.0).to(tl.float32)
    relu = tl.maximum(pre, 0.0, propagate_nan=tl.PropagateNan.ALL)
    # the unfused path rounds the bf16 GEMM's result, then 2 * it * relu(pre) once (the product
    # of two bf16 values is exact in fp32)
    grad_pre = 2 * _round_bf16(acc) * relu
    tl.store(out_ptr + at, _round_bf16(grad_pre).to(tl.bfloat16), mask=inside)


def _interpreting():
    """Whether Triton's interpreter runs the kernels (TRITON_INTERPRET=1: the CPU tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def tile_count(m, n, tile):
    return triton.cdiv(m, tile[0]) * triton.cdiv(n, tile[1])


def _check_rows(name, *tensors):
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: operands must be row-major (stride 1 along K), got strides "
                             f"{t.stride()}")


def launch_up_relu_square(x_f8, w1_f8, dequant, inv_act_scale, tile=UP_TILE):
    """(pre, post, post_f8, per-tile max(pre, 0)) of x_f8 (M, K) e4m3 against w1_f8 (N, K)."""
    _check_rows("fp8_up_relu_square", x_f8, w1_f8)
    (m, k), n = x_f8.shape, w1_f8.size(0)
    block_m, block_n, block_k, warps, stages = tile
    pre = x_f8.new_empty(m, n, dtype=torch.bfloat16)
    post = torch.empty_like(pre)
    post_f8 = x_f8.new_empty(m, n, dtype=torch.float8_e4m3fn)
    pre_max = x_f8.new_empty(tile_count(m, n, tile), dtype=torch.float32)
    _up_relu_square_kernel[(pre_max.numel(),)](
        x_f8, w1_f8, pre, post, post_f8, pre_max, dequant, inv_act_scale, m, n, k,
        x_f8.stride(0), w1_f8.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        GROUP=GROUP_M, IMPRECISE_ACC=min(UP_IMPRECISE_ACC, block_k), num_warps=warps,
        num_stages=stages)
    return pre, post, post_f8, pre_max


def launch_relu_square_grad(grad_out, w2, pre, tile=GRAD_TILE):
    """2 * (grad_out @ w2^T) * relu(pre) in bf16: grad_out (M, K), w2 (N, K), pre (M, N)."""
    _check_rows("relu_square_grad", grad_out, w2)
    (m, k), n = grad_out.shape, w2.size(0)
    block_m, block_n, block_k, warps, stages = tile
    pre = pre.contiguous()
    out = torch.empty_like(pre)
    _relu_square_grad_kernel[(tile_count(m, n, tile),)](
        grad_out, w2, pre, out, m, n, k, grad_out.stride(0), w2.stride(0), BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, GROUP=GROUP_M,
        UPCAST=_interpreting(), num_warps=warps, num_stages=stages)
    return out


@functools.cache
def interpreter_computes_fp8():
    """Whether Triton's interpreter is on (TRITON_INTERPRET=1) and computes an e4m3 dot as an fp32
    matmul of its values (Triton 3.6's and 3.9's do): the kernels' CPU runs need it."""
    if not _interpreting():
        return False
    import train_gpt

    train_gpt._squeeze_interpreter_loop_bounds()
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randint(-8, 9, (16, 32), generator=g).mul(8.0).to(torch.float8_e4m3fn)
            for _ in range(2))
    one = torch.ones(())
    pre = launch_up_relu_square(a, b, one, one, tile=(16, 16, 32, 4, 1))[0]
    return torch.equal(pre, (a.float() @ b.float().T).bfloat16())


@torch.library.custom_op("speedrun::fp8_up_relu_square", mutates_args=())
def up_relu_square(x_f8: Tensor, w1_f8: Tensor, dequant: Tensor,
                   inv_act_scale: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return launch_up_relu_square(x_f8, w1_f8, dequant, inv_act_scale)


@up_relu_square.register_fake
def _(x_f8, w1_f8, dequant, inv_act_scale):
    m, n = x_f8.size(0), w1_f8.size(0)
    pre = x_f8.new_empty(m, n, dtype=torch.bfloat16)
    return (pre, torch.empty_like(pre), x_f8.new_empty(m, n),
            x_f8.new_empty(tile_count(m, n, UP_TILE), dtype=torch.float32))


@torch.library.custom_op("speedrun::relu_square_grad", mutates_args=())
def relu_square_grad(grad_out: Tensor, w2: Tensor, pre: Tensor) -> Tensor:
    return launch_relu_square_grad(grad_out, w2, pre)


@relu_square_grad.register_fake
def _(grad_out, w2, pre):
    return torch.empty_like(pre, memory_format=torch.contiguous_format)


# ---- the FP8 head's softcapped loss and its e5m2 logit gradient (speedrun::softcap_loss)
E5M2_MAX = tl.constexpr(57344.0)
E5M2_MIN_NORMAL = tl.constexpr(2.0 ** -14)
# (columns a tile, warps): a program walks a row of logits in tiles, twice; the second pass should
# find the row in L2 (50,304 bf16 logits are 100 KB), so a CUDA launch has LOSS_PROGRAMS_PER_SM
# programs an SM, each taking rows in turn: 2 x 132 rows in flight on an H100, 26 MB of its 50 MB
# L2 (one program a row could put ~1,000 rows in flight, past L2)
LOSS_TILE = (2048, 8)
LOSS_PROGRAMS_PER_SM = 2


@triton.jit
def _round_e5m2(x):
    """x (|x| <= 57344, or NaN) rounded to the nearest e5m2 value (ties to even), kept in fp32, by
    its bits: Triton's interpreter rounds its own e5m2 cast otherwise than torch. Normal values keep
    2 mantissa bits; below 2^-14, multiples of 2^-16 by fp32's own rounding of |x| + 128."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    magnitude = bits ^ sign
    normal = (magnitude + 0xFFFFF + ((magnitude >> 21) & 1)) & 0xFFE00000
    subnormal = ((magnitude.to(tl.float32, bitcast=True) + 128.0) - 128.0).to(tl.uint32,
                                                                            bitcast=True)
    small = magnitude.to(tl.float32, bitcast=True) < E5M2_MIN_NORMAL
    rounded = (tl.where(small, subnormal, normal) | sign).to(tl.float32, bitcast=True)
    return tl.where(x != x, x, rounded)


@triton.jit
def _e5m2_bits(x):
    """The e5m2 byte of an fp32 value that is exactly an e5m2 value: e5m2 is fp16's top byte (the
    same 5-bit exponent), and fp32 to fp16 is exact for it."""
    return (x.to(tl.float16).to(tl.uint16, bitcast=True) >> 8).to(tl.uint8)


@triton.jit
def _tanh(y, FAST: tl.constexpr):
    """tanh(y): with FAST (CUDA), sm_75's tanh.approx.f32, one special function (record #89's
    `__tanhf`; relative error at most 2^-11, PTX ISA); else (Triton's interpreter, which runs no
    PTX) 1 - 2 / (exp(2y) + 1), within a few fp32 roundings."""
    if FAST:
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [y],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return 1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0)


@triton.jit
def _softcap_sigmoid(x, offset, inv_width, ROUND: tl.constexpr, FAST: tl.constexpr):
    """train_gpt.training_sigmoid of fp32 logits, sigmoid((x + offset) / SOFTCAP_WIDTH), as record
    #89's kernel computes it: 0.5 + 0.5 tanh(a / 2), one special function where 1 / (1 + exp(-a))
    takes two; rounded to bf16 with round_sigmoid. The argument is times fp32(1 / width), not
    divided by it (a GPU's fp32 division is a reciprocal and a multiply)."""
    s = 0.5 + 0.5 * _tanh(0.5 * ((x + offset) * inv_width), FAST)
    if ROUND:
        s = _round_bf16(s)
    return s


@triton.jit
def _horizon(targets_ptr, weights_ptr, masks_ptr, row, n, k: tl.constexpr,
             HAS_MASKS: tl.constexpr):
    """Row `row`'s horizon-k target t + k: (whether its term counts, the target, its weight)."""
    inside = row + k < n
    counted = inside
    if HAS_MASKS:
        counted = counted & (tl.load(masks_ptr + k * n + row, mask=inside, other=0) != 0)
    target = tl.load(targets_ptr + row + k, mask=inside, other=-1)
    return counted, target, tl.load(weights_ptr + k)


@triton.jit
def _softcap_loss_kernel(logits_ptr, targets_ptr, weights_ptr, masks_ptr, announced_ptr,
                         terms_ptr, grad_ptr, n, V, s_row, offset, scale, inv_width, inv_grad_s,
                         K: tl.constexpr, HAS_MASKS: tl.constexpr, ROUND: tl.constexpr,
                         FAST: tl.constexpr, BLOCK: tl.constexpr):
    # (grad_total (scale / SOFTCAP_WIDTH) / grad_s) in softcap_loss_grad's order
    factor = tl.load(announced_ptr) * (inv_width * scale) * inv_grad_s
    for row in range(tl.program_id(0), n, tl.num_programs(0)):
        _softcap_loss_row(logits_ptr, targets_ptr, weights_ptr, masks_ptr, terms_ptr, grad_ptr,
                          row, n, V, s_row, offset, scale, inv_width, factor, K, HAS_MASKS, ROUND,
                          FAST, BLOCK)


@triton.jit
def _softcap_loss_row(logits_ptr, targets_ptr, weights_ptr, masks_ptr, terms_ptr, grad_ptr, row,
                      n, V, s_row, offset, scale, inv_width, factor, K: tl.constexpr,
                      HAS_MASKS: tl.constexpr, ROUND: tl.constexpr, FAST: tl.constexpr,
                      BLOCK: tl.constexpr):
    """One row's loss terms and e5m2 gradient, in two passes over its logits."""
    cols = tl.arange(0, BLOCK)
    row64 = tl.zeros((), dtype=tl.int64) + row  # (n V passes 2^31)
    base = logits_ptr + row64 * s_row
    # pass 1: the softcapped row's max and sum of exp, rescaled tile by tile
    top = tl.full((), -3.0e38, tl.float32)
    total = tl.zeros((), dtype=tl.float32)
    for c0 in range(0, V, BLOCK):
        c = c0 + cols
        x = tl.load(base + c, mask=c < V, other=0.0).to(tl.float32)
        s = _softcap_sigmoid(x, offset, inv_width, ROUND, FAST)
        z = tl.where(c < V, scale * s, float("-inf"))
        new_top = tl.maximum(top, tl.max(z, axis=0))
        total = total * tl.exp(top - new_top) + tl.sum(tl.exp(z - new_top), axis=0)
        top = new_top
    lse = top + tl.log(total)
    count = 0.0
    for k in tl.static_range(K):
        counted, target, weight = _horizon(targets_ptr, weights_ptr, masks_ptr, row, n, k,
                                           HAS_MASKS)
        picked = tl.load(base + tl.maximum(target, 0)).to(tl.float32)
        term = lse - scale * _softcap_sigmoid(picked, offset, inv_width, ROUND, FAST)
        tl.store(terms_ptr + k * n + row, tl.where(counted, term, 0.0))
        count += tl.where(counted, weight, 0.0)
    out = grad_ptr + row64 * V
    # pass 2: dz = p count - hot, then factor dz s (1 - s), saturated and rounded to e5m2
    for c0 in range(0, V, BLOCK):
        c = c0 + cols
        x = tl.load(base + c, mask=c < V, other=0.0).to(tl.float32)
        s = _softcap_sigmoid(x, offset, inv_width, ROUND, FAST)
        hot = tl.zeros((BLOCK,), dtype=tl.float32)
        for k in tl.static_range(K):
            counted, target, weight = _horizon(targets_ptr, weights_ptr, masks_ptr, row, n, k,
                                               HAS_MASKS)
            hot += tl.where((c == target) & counted, weight, 0.0)
        dz = tl.exp(scale * s - lse) * count - hot
        g = factor * dz * s * (1.0 - s)
        g = tl.minimum(tl.maximum(g, -E5M2_MAX, propagate_nan=tl.PropagateNan.ALL), E5M2_MAX,
                       propagate_nan=tl.PropagateNan.ALL)
        tl.store(out + c, _e5m2_bits(_round_e5m2(g)), mask=c < V)


@triton.jit
def _sigmoid_kernel(logits_ptr, out_ptr, numel, offset, inv_width, ROUND: tl.constexpr,
                    FAST: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + i, mask=i < numel, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, _softcap_sigmoid(x, offset, inv_width, ROUND, FAST), mask=i < numel)


def launch_softcap_sigmoid(logits, offset, round_sigmoid, width, block=1024):
    """The loss kernel's fp32 sigmoid of each logit, on its own (the checks' float64 formula takes
    it: on CUDA it is tanh.approx's, which nothing else computes)."""
    logits = logits.contiguous()
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    _sigmoid_kernel[(triton.cdiv(logits.numel(), block),)](
        logits, out, logits.numel(), offset, 1 / width, ROUND=round_sigmoid,
        FAST=not _interpreting(), BLOCK=block)
    return out


def loss_programs(logits):
    """How many programs the loss kernel launches: a few an SM on CUDA, else one a row."""
    if logits.device.type != "cuda":
        return logits.size(0)
    sms = torch.cuda.get_device_properties(logits.device).multi_processor_count
    return min(logits.size(0), sms * LOSS_PROGRAMS_PER_SM)


def launch_softcap_loss(logits, targets, weights, masks, scale, offset, round_sigmoid, width,
                        announced, grad_s, tile=LOSS_TILE, programs=None):
    """(per-horizon loss sums (K,) fp32, e5m2 gradient (n, V)) of bf16 logits (n, V), softcapped
    as scale * sigmoid((logits + offset) / width); `programs`: how many (loss_programs by
    default)."""
    _check_rows("softcap_loss", logits)
    if _interpreting():
        import train_gpt

        train_gpt._squeeze_interpreter_loop_bounds()
    (n, vocab), horizons = logits.shape, weights.numel()
    block, warps = tile
    terms = logits.new_empty(horizons, n, dtype=torch.float32)
    grad = logits.new_empty(n, vocab, dtype=torch.float8_e5m2)
    # 1 / grad_s as softcap_loss_grad's fp32 reciprocal of fp32(grad_s)
    inv_grad_s = torch.tensor(grad_s, dtype=torch.float32).reciprocal().item()
    _softcap_loss_kernel[(programs or loss_programs(logits),)](
        logits, targets, weights.float(), targets if masks is None else masks.contiguous(),
        announced, terms, grad.view(torch.uint8), n, vocab, logits.stride(0), offset, scale,
        1 / width, inv_grad_s, K=horizons,
        HAS_MASKS=masks is not None, ROUND=round_sigmoid, FAST=not _interpreting(), BLOCK=block,
        num_warps=warps)
    return terms.sum(dim=1), grad


@torch.library.custom_op("speedrun::softcap_loss", mutates_args=())
def softcap_loss(logits: Tensor, targets: Tensor, weights: Tensor, masks: Tensor | None,
                 scale: float, offset: float, round_sigmoid: bool, width: float,
                 announced: Tensor, grad_s: float) -> tuple[Tensor, Tensor]:
    return launch_softcap_loss(logits, targets, weights, masks, scale, offset, round_sigmoid,
                               width, announced, grad_s)


@softcap_loss.register_fake
def _(logits, targets, weights, masks, scale, offset, round_sigmoid, width, announced, grad_s):
    return (weights.new_empty(weights.numel(), dtype=torch.float32),
            logits.new_empty(logits.shape, dtype=torch.float8_e5m2))
