"""The FP8 head's fused softcapped loss (FP8SoftcapLoss) against autograd through today's composition
(head_matmul in FP8, softcapped, multi_token_loss or cross-entropy): same loss and gradients to fp32
rounding, with MTP weights, the softcap's offset and bf16 sigmoid, targets past the sequence end, a padded
vocabulary, a last row block shorter than the others, and a micro-step piece's loss mask and missing
targets (NO_TARGET)."""
import pytest
import torch
import torch.nn.functional as F

import train_gpt as tg

BF16_ULP = 2.0 ** -7  # spacing of bf16 values relative to the value (8 significant bits)


def case(seed, T=200, D=64, V=320, real_vocab=300):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, D, generator=g) * 2).bfloat16()
    w = torch.randn(V, D, generator=g) * 0.3
    targets = torch.randint(0, real_vocab, (T,), generator=g)  # the padding columns are never targets
    return x, w, targets


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("mtp", [None, (1.0, 0.5, 0.25)])
@pytest.mark.parametrize("softcap", [tg.Softcap(23.0, 5.0, True), tg.Softcap(30.0)])
def test_fused_loss_matches_autograd(monkeypatch, mtp, softcap, masked):
    """Error model: the loss sums the same terms in another order (row blocks), so it agrees to a few fp32
    ulps of the sum of |terms|; the logits' gradient is computed in fp32 from the same bf16 logits in another
    order, so after its rounding to bf16 an entry differs by at most one bf16 ulp per bf16 rounding in the
    chain, and only where an fp32 value lay within fp32 rounding of a bf16 rounding boundary (rarely);
    grad_x and grad_w then agree to the e5m2 cast of those few entries."""
    monkeypatch.setattr(tg, "FUSED_LOSS_ROWS", 48)  # 200 rows: four blocks of 48 and one of 8
    x, w, targets = case(0)
    scales = tg.head_fp8_scales((40.0, 1.5, 0.05))
    weights = None if mtp is None else torch.tensor(mtp)
    loss_mask = masks = None
    if masked:  # a piece: its context and padding rows have no loss, its last targets and padding none
        loss_mask = torch.ones(200, dtype=torch.bool)
        loss_mask[:1] = loss_mask[150:] = False
        targets[152:] = tg.NO_TARGET
        masks = tg.horizon_masks(targets, loss_mask, 1 if weights is None else weights.numel())
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    logits = tg.head_matmul(xa, wa, scales)
    logits.retain_grad()
    z = tg.softcapped(logits, softcap, training=True)
    if masked:
        expected = tg.multi_token_loss(z, targets, torch.ones(1) if weights is None else weights, loss_mask)
    else:
        expected = F.cross_entropy(z, targets, reduction="sum") if weights is None else \
            tg.multi_token_loss(z, targets, weights)
    expected.backward(torch.tensor(0.25))
    xf, wf = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = tg.softcap_cross_entropy(xf, wf, targets, True, scales, softcap, weights, loss_mask)
    loss.backward(torch.tensor(0.25))
    assert abs(loss.item() - expected.item()) <= 64 * 2.0 ** -24 * expected.item()

    g = torch.cat([tg.softcap_loss_grad(logits.detach(), targets, torch.ones(1) if weights is None else weights,
                                        softcap, start, min(200, start + 48), torch.tensor(0.25), masks)
                   for start in range(0, 200, 48)])
    want = logits.grad
    assert g.dtype == want.dtype == torch.bfloat16
    differ = g != want
    print(f"logit-gradient entries that differ: {differ.float().mean():.2e}")
    assert differ.float().mean() < 1e-3
    # with the bf16-rounded sigmoid the chain rounds to bf16 twice (the sigmoid's cast, then the logits'
    # dtype): a flip of the first rounding moves the result by one ulp before the second rounds it again
    ulps = 2 if softcap.round_sigmoid else 1
    assert ((g - want).float().abs() <= ulps * BF16_ULP * want.float().abs() + 1e-30)[differ].all()
    counted = slice(1, 150) if masked else slice(None)
    assert (want[counted, 300:] > 0).all()  # the padded columns get their softmax share
    if masked:
        assert (g[150:] == 0).all() and (g[:1] == 0).all() and (g[1:150] != 0).any()

    # a differing logit-gradient entry can land on the neighbouring e5m2 value: one e5m2 step (a quarter of
    # it, 2 mantissa bits; at least the subnormal step times the gradient scale) times the other operand
    # (the weights or activations as FP8 holds them, within an e4m3 step); plus fp32 rounding of the sums
    grad_s = scales[2]
    flip = torch.where(differ, (want.float().abs() / 4).clamp_min(2.0 ** -16 * grad_s), 0.0)
    for fused, autograd, bound in ((xf.grad, xa.grad, flip @ (w.abs() * 1.07)),
                                   (wf.grad, wa.grad, flip.T @ (x.float().abs() * 1.07))):
        error = (fused.float() - autograd.float()).abs()
        print(f"max gradient difference / max gradient: {error.max() / autograd.float().abs().max():.2e}")
        rounding = BF16_ULP * autograd.float().abs() if fused.dtype == torch.bfloat16 else 0  # grad_x is bf16
        assert (error <= bound + rounding + 1e-6 * autograd.float().abs().max()).all()  # measured 0 to 2.4e-8 of the max


def test_targets_past_the_end_are_left_out():
    """A 3-row sequence with 3 horizons: row t predicts t + k only where it exists (6 terms, not 9)."""
    x, w, targets = case(1, T=3)
    scales = tg.head_fp8_scales((40.0, 1.5, 0.05))
    weights = torch.tensor([1.0, 10.0, 100.0])
    loss = tg.softcap_cross_entropy(x, w, targets, True, scales, tg.Softcap(30.0), weights)
    logits = tg.head_matmul(x, w, scales).float()
    z = tg.softcapped(logits, tg.Softcap(30.0))
    terms = torch.logsumexp(z, -1)[:, None] - z
    want = sum(weights[k] * terms[t, targets[t + k]] for k in range(3) for t in range(3 - k))
    assert abs(loss.item() - want.item()) <= 1e-5 * want.item()
