"""Torch stand-ins for record #89's kernels, for tools/gpu_race.py where they cannot run: its CUDA
loss kernel (ce_fwd_bwd, compiled with NVRTC) on a CPU, and its Triton launchers under a Triton
whose interpreter does not run FP8 (any but 3.6). Each computes what the kernel computes, from the
kernel's own order of rounding where it rounds (fp32 accumulation; bf16 results; e4m3 / e5m2 casts
saturating as the kernels' clamps and cvt.satfinite do), written from the log's triton_kernels.py.
"""

import math

import torch

E4M3_MAX = 448.0
E5M2_MAX = float(torch.finfo(torch.float8_e5m2).max)


def XXT(A, out):
    """out = A @ A.mT, fp32 accumulation."""
    out.copy_(A.float() @ A.float().mT)
    return out


def XTX(A, out):
    """out = A.mT @ A, fp32 accumulation."""
    out.copy_(A.float().mT @ A.float())
    return out


def ba_plus_cAA(A, alpha, beta, out):
    """out = alpha A @ A.mT + beta A (the kernel adds beta A to the fp32 accumulator, then rounds
    once)."""
    a = A.float()
    out.copy_(alpha * (a @ a.mT) + beta * a)
    return out


def linear_relu_square(
    a,
    b,
    aux=None,
    a_f8=None,
    b_f8=None,
    dequant_scale_ptr=None,
    activation_scale=None,
    partial_amax=None,
):
    """The fused up projection: pre = a @ b.T (FP8 operands dequantized by the scale), post =
    relu(pre)^2 in the input's dtype, and with activation_scale the e4m3 post / scale with the
    largest post in partial_amax (the programs' maxima, all but one 0: what
    reduce_mlp_activation_scales reads); with aux, the backward 2 (a @ b.T) relu(aux)."""
    if b_f8 is not None:
        acc = (a_f8.float() @ b_f8.float().T) * dequant_scale_ptr.float()
    else:
        acc = a.float() @ b.float().T
    c = acc.to(a.dtype)
    if aux is not None:
        return 2 * c * torch.where(aux > 0, aux, 0)
    post = c.clamp_min(0)
    post = post * post
    if activation_scale is None:
        return c, post
    post_f8 = (
        (post.float() * (1.0 / activation_scale.float()))
        .clamp_max(E4M3_MAX)
        .to(torch.float8_e4m3fn)
    )
    partial_amax.zero_()
    partial_amax.view(-1)[0] = post.float().max()
    return c, post, post_f8


def reduce_mlp_activation_scales(partial_amax, scales, headroom=1.25):
    """scales[layer] = max(the layer's partial amaxes, 1e-12) headroom / 448."""
    amax = partial_amax.float().amax(dim=1)
    scales[: partial_amax.shape[0]] = amax.clamp_min(1e-12) * (headroom / E4M3_MAX)


def quantize_transpose_mlp_down_weights(
    weights, output_storage, next_scales, used_scales, partial_amax, headroom=1.12
):
    """The down projections in e4m3 at next_scales, transposed into output_storage; used_scales =
    next_scales; each 64 x 64 tile's amax, then the next scales from them."""
    layers, hidden, dim = weights.shape
    values = weights.float()
    quantized = (values / next_scales[:layers].view(-1, 1, 1)).clamp(-E4M3_MAX, E4M3_MAX)
    output_storage.copy_(quantized.transpose(1, 2).to(torch.float8_e4m3fn))
    tiles_h, tiles_d = math.ceil(hidden / 64), math.ceil(dim / 64)
    padded = torch.nn.functional.pad(
        values.abs(), (0, tiles_d * 64 - dim, 0, tiles_h * 64 - hidden)
    )
    partial_amax.copy_(
        padded.view(layers, tiles_h, 64, tiles_d, 64).amax(dim=(2, 4)).view(layers, -1)
    )
    used_scales[:layers] = next_scales[:layers]
    reduce_mlp_activation_scales(partial_amax, next_scales, headroom)


def transpose_copy(src, dst):
    dst.copy_(src.T)


def transpose_add(src, dst):
    dst.add_(src.T)


TRITON_LAUNCHERS = {
    f.__name__: f
    for f in (
        XXT,
        XTX,
        ba_plus_cAA,
        linear_relu_square,
        reduce_mlp_activation_scales,
        quantize_transpose_mlp_down_weights,
        transpose_copy,
        transpose_add,
    )
}


def ce_fwd_bwd_kernel(grid, block, args, shared_mem=0):
    """ce_fwd_bwd_kernel's launch, as the custom op ce_fwd_bwd makes it: per row of bf16 logits, the
    sigmoid s = sigmoid(logit / C + B / C) stored in bf16, z = A s, lse over the row; the row's loss
    sum_k w_k (lse - z[target_{row+k}]) over the horizons inside the batch; the e5m2 gradient
    grad_scale (A / C) / grad_s (S_w p - sum_k w_k [target_{row+k}]) s (1 - s), S_w the sum of all
    weights.
    """
    logits, targets, weights, losses, grad_input, n_rows, n_predict, A, B, C, grad_s, grad_scale = (
        args
    )
    s = torch.sigmoid(logits.float() * (1 / C) + B / C).bfloat16().float()
    z = A * s
    lse = torch.logsumexp(z, dim=-1)
    total = torch.zeros(n_rows, dtype=torch.float32, device=logits.device)
    hits = torch.zeros_like(z)
    weights = weights.float()
    for k in range(n_predict):
        rows = torch.arange(n_rows - k, device=logits.device)
        target = targets[k:n_rows]
        valid = (target >= 0) & (target < logits.shape[1])
        t = target.clamp(0, logits.shape[1] - 1)
        total[rows] += torch.where(valid, weights[k] * (lse[rows] - z[rows, t]), 0.0)
        hits[rows[valid], t[valid]] += weights[k]
    losses.copy_(total)
    grad = weights.sum() * torch.exp(z - lse[:, None]) - hits
    grad = grad_scale * (A / C) * (1 / grad_s) * grad * s * (1 - s)
    grad_input.copy_(grad.clamp(-E5M2_MAX, E5M2_MAX).to(torch.float8_e5m2))


def cautious_update_in_int32(p, mantissa, grad, wd_tensor, lr_tensor):
    """NorMuonAndAdam._cautious_wd_and_update_inplace where uint32 shifts do not exist (a CPU): the
    fp32 weight is p's bf16 bits above the 16 bits of `mantissa`, assembled and split again in
    int32, the update the same: w - w [grad w >= 0] wd lr - grad lr."""
    grad, wd, lr = grad.float(), wd_tensor.float(), lr_tensor.float()
    bits = (p.view(torch.int16).to(torch.int32) << 16) | (
        mantissa.view(torch.int16).to(torch.int32) & 0xFFFF
    )
    weight = bits.view(torch.float32)
    mask = (grad * weight) >= 0
    bits = (weight - weight * mask * wd * lr - grad * lr).view(torch.int32)
    p.view(torch.int16).copy_((bits >> 16).to(torch.int16))
    mantissa.view(torch.int16).copy_(bits.to(torch.int16))
