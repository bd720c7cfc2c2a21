"""fp8_mlp_kernels.py's fused FP8 MLP against the unfused torch path (FP8ReluSquareMLP), on the CPU
under Triton's interpreter (TRITON_INTERPRET=1, conftest.py).

The operands are built so that every sum of the GEMMs is exact in fp32 (e4m3 values that are
multiples of 8 up to 448, bf16 values that are multiples of 1/16 and 1/64): any accumulation
order then gives the same sums, so the fused and unfused paths must agree bit for bit, through every
rounding point (pre and post to bf16, post_f8 to e4m3, the amax, the gradient of pre). On a GPU
the sums of real data differ by accumulation order: tools/smoke_checks.py's fused_mlp check bounds
that."""

import pytest
import torch

import train_gpt as tg


pytestmark = pytest.mark.skipif(
    not (tg.HAS_TRITON and tg.load_companion("fp8_mlp_kernels.py").interpreter_computes_fp8()),
    reason=f"needs Triton's interpreter with FP8 dots (CI's torch 2.11 / Triton 3.6 venv); here "
           f"torch {torch.__version__}, "
           f"Triton {__import__('triton').__version__ if tg.HAS_TRITON else 'absent'}")

D, H = 64, 320  # model and hidden widths: 2.5 column tiles of the up projection, 1.25 of grad


def _exact_operands(rows, seed):
    """x, fc_w, proj_w, grad_out whose GEMM sums are exact in fp32 (see the module's note)."""
    g = torch.Generator().manual_seed(seed)

    def ints(*shape):
        return torch.randint(-8, 9, shape, generator=g).float()

    # amaxes pinned at 1.75 and 0.875: x_f8 = 256 x and W1's copy 512 W1 are multiples of 32, and
    # the dequantization scale is 2^-17 (a power of two: the CPU's _scaled_mm may scale before
    # its sums, cuBLAS and the kernel after)
    x, fc_w, proj_w = ints(rows, D) / 8, ints(H, D) / 16, ints(H, D) / 64
    x[0, 0], fc_w[0, 0] = 1.75, 0.875
    return x.bfloat16(), fc_w, proj_w, (ints(rows, D) / 16).bfloat16()


def _run(fused, x, fc_w, proj_w, grad_out, act_scale):
    weights = tg.FP8MLPWeights(1, H, D, fused)
    layer = torch.nn.Module()
    layer.fc_w, layer.proj_w = fc_w, proj_w
    weights.quantize([layer], bootstrap=True)
    x, fc_w, proj_w = (t.clone().requires_grad_() for t in (x, fc_w, proj_w))
    out, post_amax = tg.FP8ReluSquareMLP.apply(
        x, fc_w, proj_w, weights.w1_f8[0], weights.w1_scales[0], weights.w2_f8[0],
        weights.w2_scales[0], act_scale, fused)
    out.backward(grad_out)
    return out, post_amax, x.grad, fc_w.grad, proj_w.grad


@pytest.mark.parametrize("rows, act_scale", [(80, 0.0137), (128, 0.31)])
def test_fused_mlp_matches_the_torch_path_bit_for_bit(rows, act_scale):
    operands = _exact_operands(rows, seed=rows)
    scale = torch.tensor(act_scale)
    fused, unfused = (_run(f, *operands, scale) for f in (True, False))
    for name, a, b in zip(("out", "post_amax", "grad x", "grad W1", "grad W2"), fused, unfused):
        assert a.dtype == b.dtype and torch.equal(a, b), name


def _up_torch(x_f8, w_f8, dequant, act_scale):
    """The unfused path's up projection, relu^2 and e4m3 copy (FP8ReluSquareMLP.forward)."""
    pre = torch._scaled_mm(x_f8, w_f8.T, scale_a=dequant, scale_b=torch.ones(()),
                           out_dtype=torch.bfloat16)
    post = torch.relu(pre).square()
    return pre, post, (post.float() * (1 / act_scale)).clamp(max=448).to(torch.float8_e4m3fn)


def test_up_kernel_tiles_rounding_and_saturation():
    """Several row, column and K tiles (one partial each way), e4m3 ties, carries into the next
    binade, subnormals and values clamped at 448; the per-tile maxima give post's amax."""
    kernels = tg.load_companion("fp8_mlp_kernels.py")
    g = torch.Generator().manual_seed(3)
    x_f8, w_f8 = (torch.randint(-8, 9, shape, generator=g).mul(8.0).to(torch.float8_e4m3fn)
                  for shape in ((70, 96), (90, 96)))
    dequant, act_scale = torch.tensor(2.0 ** -12), torch.tensor(1.0 / 3)
    pre, post, post_f8, pre_max = kernels.launch_up_relu_square(
        x_f8, w_f8, dequant, 1 / act_scale, tile=(32, 32, 64, 4, 1))
    ref = _up_torch(x_f8, w_f8, dequant, act_scale)
    f8 = ref[2].float()
    assert (f8 == 448).any() and ((f8 > 0) & (f8 < 2 ** -6)).any()  # both ends exercised
    for name, a, b in zip(("pre", "post", "post_f8"), (pre, post, post_f8), ref):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    assert pre_max.numel() == kernels.tile_count(70, 90, (32, 32))
    assert pre_max.amax() == pre.float().amax().clamp(min=0)


def test_grad_kernel_masks_and_relu():
    kernels = tg.load_companion("fp8_mlp_kernels.py")
    g = torch.Generator().manual_seed(4)
    grad_out = (torch.randint(-8, 9, (70, 96), generator=g) / 16).bfloat16()
    w2 = (torch.randint(-8, 9, (90, 96), generator=g) / 64).bfloat16()
    pre = torch.randn(70, 90, generator=g).bfloat16()
    out = kernels.launch_relu_square_grad(grad_out, w2, pre, tile=(32, 32, 64, 4, 1))
    assert torch.equal(out, 2 * (grad_out @ w2.T) * torch.relu(pre))


def test_the_ops_fake_implementations_match():
    kernels = tg.load_companion("fp8_mlp_kernels.py")
    x_f8 = torch.zeros(20, D, dtype=torch.float8_e4m3fn)
    w_f8 = torch.zeros(H, D, dtype=torch.float8_e4m3fn)
    one = torch.ones(())
    torch.library.opcheck(kernels.up_relu_square, (x_f8, w_f8, one, one),
                          test_utils="test_faketensor")
    g, w2, pre = torch.zeros(20, D).bfloat16(), torch.zeros(H, D).bfloat16(), \
        torch.zeros(20, H).bfloat16()
    torch.library.opcheck(kernels.relu_square_grad, (g, w2, pre),
                          test_utils="test_faketensor")
