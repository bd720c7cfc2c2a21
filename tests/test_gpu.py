"""GPU checks (skipped without CUDA). Run once on real hardware with `-s` to see the numbers:

    python -m pytest -q -s tests/test_gpu.py

- the record model, bf16 (embeddings in bf16, build_model), compiled (dynamic=False, fullgraph=True) with
  FlexAttention, forward+backward at 16,384 tokens: runs, prints ms per fwd+bwd (median after warm-up);
- FP8 head (model.use_fp8=True) vs bf16 head: per-token losses agree within 1e-2 at init;
- Polar Express on a (16, 3072, 768) stack: Triton kernels vs the torch path agree; TFLOP/s of each;
  the Triton path is faster;
- compiled FlexAttention (block-sparse kernel, which the CPU tests cannot run) matches a naive
  masked softmax, forward and backward, for packed documents and a length not a multiple of 128;
- the FP8 head's gradients against the bf16 head's at the stage-3 shape (cosine > 0.99);
- one full Trainer.train_step on CUDA (NorMuon with its gradient hooks, DistAdam, the schedule);
- the peak memory of a stage-3 forward+backward of the record model (49,152 tokens) fits 80 GB.
Budget: the compilations of the record model dominate (minutes on a fresh machine).
"""
import math
import statistics
import time

import numpy as np
import pytest
import torch

import train_gpt as tg

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
TOKENS = 16_384


def _sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def _median_ms(fn, warmup=2, iters=5):
    """Median wall time of fn() in ms after `warmup` untimed calls (synchronized around each call)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        _sync()
        start = time.perf_counter()
        fn()
        _sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _packed_batch(tokens, vocab, seed=0, max_doc=2048):
    """Random tokens in random documents (lengths 1..max_doc), cu_seqlens padded like the loader's."""
    rng = np.random.default_rng(seed)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(int(rng.integers(1, max_doc + 1)))
    inputs = torch.from_numpy(rng.integers(0, vocab, tokens).astype(np.int32))
    targets = torch.from_numpy(rng.integers(0, vocab, tokens).astype(np.int64))
    cu = torch.from_numpy(tg.padded_cu_seqlens(np.array(lengths), tokens))
    return inputs.to(DEVICE), targets.to(DEVICE), cu.to(DEVICE)


@pytest.fixture(scope="module")
def record_model():
    hp = tg.parse_args([])
    torch.manual_seed(hp.seed)
    model = tg.build_model(hp, DEVICE)
    assert isinstance(model.attention, tg.FlexWindowAttention) and model.lm_head.weight.dtype == torch.bfloat16
    assert model.head_loss is tg.softcap_cross_entropy  # the head (and use_fp8) in the compiled graph
    model.train()
    return hp, model, torch.compile(model, dynamic=False, fullgraph=True)


def _fwd_bwd(model, compiled, batch, window_blocks):
    def step():
        model.zero_grad(set_to_none=True)
        loss = compiled(*batch, window_blocks)
        loss.backward()
        return loss
    return step


def test_record_compiled_fwd_bwd_and_fp8_vs_bf16(record_model):
    hp, model, compiled = record_model
    batch = _packed_batch(TOKENS, hp.vocab_size)
    window = tg.window_blocks_at(0, hp)
    results = {}
    for fp8 in (False, True):
        model.use_fp8 = fp8
        step = _fwd_bwd(model, compiled, batch, window)
        _sync()
        start = time.perf_counter()
        loss = step()  # compiles (a recompile for the second variant: use_fp8 is guarded)
        _sync()
        compile_s = time.perf_counter() - start
        ms = _median_ms(step, warmup=2, iters=5)
        loss = step()
        grads_finite = all(torch.isfinite(p.grad).all().item() for p in model.parameters() if p.grad is not None)
        missing = [n for n, p in model.named_parameters() if p.grad is None]
        per_token = loss.item() / TOKENS
        results[fp8] = per_token
        print(f"\n[gpu] record model {'fp8' if fp8 else 'bf16'} head, {TOKENS} tokens, window {window} blocks: "
              f"first call (compile) {compile_s:.1f} s, fwd+bwd median {ms:.2f} ms, loss/token {per_token:.5f}")
        assert math.isfinite(per_token) and grads_finite and not missing, missing
        assert abs(per_token - math.log(50304)) < 0.1  # at init: uniform over the padded vocabulary
    model.use_fp8 = tg.fp8_supported(DEVICE)
    print(f"[gpu] |loss fp8 - loss bf16| per token = {abs(results[True] - results[False]):.2e}")
    assert abs(results[True] - results[False]) < 1e-2


def _polar_flops(batch, rows, cols, steps=len(tg.POLAR_EXPRESS_COEFFS)):
    """Per step on the wide orientation (m <= n): X Xᵀ 2m²n (full count, though the kernel does half),
    bA + cA² 2m³, aX + BX 2m²n; five steps, per matrix."""
    m, n = min(rows, cols), max(rows, cols)
    return batch * steps * (2 * m * m * n + 2 * m ** 3 + 2 * m * m * n)


def test_polar_express_triton_vs_torch_speed():
    assert tg.HAS_TRITON
    shape = (16, 3072, 768)
    G = torch.randn(*shape, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(0))
    out_triton = tg.polar_express(G, use_triton=True)
    out_torch = tg.polar_express(G, use_triton=False)
    reference = tg.polar_express(G, use_triton=False, dtype=torch.float32)

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    flops = _polar_flops(*shape)
    ms_triton = _median_ms(lambda: tg.polar_express(G, use_triton=True), warmup=3, iters=10)
    ms_torch = _median_ms(lambda: tg.polar_express(G, use_triton=False), warmup=3, iters=10)
    print(f"\n[gpu] polar_express {shape} bf16: triton {ms_triton:.3f} ms ({flops / ms_triton / 1e9:.1f} TFLOP/s), "
          f"torch {ms_torch:.3f} ms ({flops / ms_torch / 1e9:.1f} TFLOP/s); "
          f"rel diff triton-torch {rel(out_triton, out_torch):.2e}, vs fp32 triton {rel(out_triton, reference):.2e} "
          f"torch {rel(out_torch, reference):.2e}")
    assert out_triton.shape == out_torch.shape == shape and out_triton.dtype == torch.bfloat16
    assert rel(out_triton, out_torch) < 5e-2
    assert rel(out_triton, reference) < 5e-2 and rel(out_torch, reference) < 5e-2
    assert ms_triton < ms_torch


SCALE = 0.12


def _naive_attention(q, k, v, docs, window):
    """Inclusive window: q - kv <= window (FlashAttention's window_size=(window, 0))."""
    T = q.size(0)
    pos = torch.arange(T, device=q.device)
    delta = pos[:, None] - pos[None, :]
    allowed = (docs[:, None] == docs[None, :]) & (delta >= 0) & (delta <= window)
    scores = (torch.einsum("thd,shd->hts", q.float(), k.float()) * SCALE).masked_fill(~allowed, float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v.float())


@pytest.mark.parametrize("T,bounds,window", [(3000, [1, 300, 301, 777], 1408)])  # one compile: ~tens of s
def test_compiled_flex_matches_naive(T, bounds, window):
    g = torch.Generator(DEVICE).manual_seed(T)
    H, D = 6, 128
    q, k, v = (torch.randn(T, H, D, device=DEVICE, generator=g) * s for s in (0.3, 0.3, 1.0))
    cu = torch.tensor([0, *bounds, T, T, T], dtype=torch.int32, device=DEVICE)
    docs = tg.document_ids(cu, T)
    mask = tg.sliding_document_mask(docs, window)
    attend = torch.compile(tg.FlexWindowAttention(), dynamic=False, fullgraph=True)
    leaves = [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
    y = attend(*leaves, mask, torch.tensor(SCALE, dtype=torch.float64, device=DEVICE))
    gy = torch.randn(y.shape, device=DEVICE, generator=g)
    grads = torch.autograd.grad(y, leaves, gy.to(y.dtype))
    ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
    ref = _naive_attention(*ref_leaves, docs, window)
    ref_grads = torch.autograd.grad(ref, ref_leaves, gy)
    errs = [(y.float() - ref).abs().max().item()] + [(a.float() - b).abs().max().item() for a, b in zip(grads, ref_grads)]
    scales = [ref.abs().max().item()] + [b.abs().max().item() for b in ref_grads]
    print(f"\n[gpu] compiled flex T={T} window={window}: max abs err (y, dq, dk, dv) "
          + ", ".join(f"{e:.2e}/{s:.2e}" for e, s in zip(errs, scales)))
    for e, s in zip(errs, scales):
        assert e <= 5e-2 * max(s, 1e-3)  # bf16 inputs/outputs; a wrong tile list gives O(1) errors


def test_fp8_head_gradients_match_bf16_at_stage3_shape():
    tokens, dim, vocab = 49152, 768, 50304
    g = torch.Generator(device=DEVICE).manual_seed(1)
    x = (torch.randn(tokens, dim, device=DEVICE, generator=g) * 1.5).bfloat16()
    w = (torch.randn(vocab, dim, device=DEVICE, generator=g) * 0.005).bfloat16()
    targets = torch.randint(0, vocab, (tokens,), device=DEVICE, generator=g)
    grads = {}
    for fp8 in (False, True):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        tg.softcap_cross_entropy(xr, wr, targets, True, fp8).backward()
        grads[fp8] = (xr.grad.float(), wr.grad.float())
    for name, a, b in zip(("x", "w"), grads[True], grads[False]):
        cosine = (a.flatten() @ b.flatten() / (a.norm() * b.norm())).item()
        print(f"\n[gpu] FP8 vs bf16 head gradient cosine ({name}): {cosine:.5f}")
        assert cosine > 0.99, (name, cosine)
    assert grads[True][1].stride() == (1, vocab) or grads[True][1].is_contiguous()  # computed as (x.T @ g).T


def test_one_train_step_with_both_optimizers(tmp_path):
    folder = tmp_path / "corpus"
    tg.synthetic_corpus(folder, train_tokens=300_000, val_tokens=20_000)
    argv = ["--preset", "cpu", "--device", "cuda", "--num_scheduled_iterations", "4", "--num_extension_iterations", "0",
            "--warmup_steps", "0", "--log_dir", str(tmp_path / "logs"), "--val_tokens", "8192",
            "--train_files", str(folder / "synthetic_train_*.bin"), "--val_files", str(folder / "synthetic_val_*.bin")]
    trainer = tg.Trainer(tg.parse_args(argv), argv)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    losses = [trainer.train_step(step, *trainer.schedule(step))[0].item() for step in range(2)]  # NorMuon twice, DistAdam once
    trainer.loader.close()
    assert all(math.isfinite(l) for l in losses), losses
    moved = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert moved == set(before), set(before) - moved  # every parameter was updated by its optimizer


def test_stage3_step_memory_fits_an_80gb_gpu(record_model):
    hp, model, compiled = record_model
    model.use_fp8 = tg.fp8_supported(DEVICE)
    batch = _packed_batch(49152, hp.vocab_size, seed=3)
    windows = torch.tensor(tg.window_blocks_at(hp.num_scheduled_iterations - 1, hp), dtype=torch.int32, device=DEVICE)
    step = _fwd_bwd(model, compiled, batch, windows)
    step()
    _sync()
    torch.cuda.reset_peak_memory_stats()
    step()
    _sync()
    peak = torch.cuda.max_memory_allocated()
    print(f"\n[gpu] stage-3 forward+backward (49,152 tokens/rank): peak allocated {peak / 2**30:.1f} GiB")
    assert peak < 80 * 2**30
