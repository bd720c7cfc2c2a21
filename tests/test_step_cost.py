"""tools/step_cost.py, the step-cost ledger: its matmul FLOPs are the analytic count of the record step, its
FLOPs are FlopCounterMode's, it sees fp32 GEMMs where there are some (a positive control) and none in the
shipped FP8 MLP, and the bytes a traced forward keeps are the memory plan's (slow: a fake-tensor trace of a
tiny model's step takes ~20 s on 2 cores). The FP8 MLP's bf16 weight gradients meet their error model."""
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

import step_cost as sc
import plan_memory as pm
import train_gpt as tg
from test_training import tiny

H100 = sc.GPU_PEAKS["h100"]


def tiny_hp(*extra):
    return tg.parse_args(tiny(Path("."), *extra))


def traced_piece(hp, tokens, step, flop_counter=None):
    """A fresh Ledger holding the forward and backward of one piece (world size 1) at `step`'s StepPlan."""
    ledger, plan = sc.Ledger(1), tg.Schedule(hp).at(step)
    fake = FakeTensorMode()
    with fake:
        model, _, _ = sc.trace_setup(hp, 1, ledger)
        if flop_counter is None:
            sc.trace_piece(hp, model, fake, ledger, tokens, plan)
        else:
            with flop_counter:
                sc.trace_piece(hp, model, fake, ledger, tokens, plan)
    return ledger


def matmul_flops(ledger, kind=None):
    return sum(op.flops for op in ledger.ops if op.kind.startswith("matmul") and (kind is None or op.kind == kind))


def fp32_weight_gradients(ctx, grad_out, _):
    """FP8ReluSquareMLP.backward as it was before the ledger: both weight gradients as fp32 GEMMs."""
    x, w1, w2, pre, post = ctx.saved_tensors
    grad_out = grad_out.to(x.dtype)
    grad_pre = 2 * (grad_out @ w2.T.type_as(x)) * torch.relu(pre)
    return (grad_pre @ w1.type_as(x), grad_pre.T.float() @ x.float(), post.T.float() @ grad_out.float(),
            None, None, None, None, None)


@pytest.mark.slow
def test_flops_are_flop_counter_modes():
    """Error model: none; the ledger uses FlopCounterMode's formulas op by op, so the totals are equal."""
    hp = tiny_hp()
    counter = FlopCounterMode(display=False)
    ledger = traced_piece(hp, 512, 5, counter)
    assert sum(op.flops for op in ledger.ops) == counter.get_total_flops() > 0


@pytest.mark.slow
def test_fp32_matmuls_are_the_mlp_weight_gradients(monkeypatch):
    """Positive control: with the MLP's weight gradients as fp32 GEMMs, the ledger's fp32 matmuls are exactly
    those (two (hidden, dim) products per layer, 2 T hidden dim FLOPs each); the shipped backward has none."""
    hp = tiny_hp()
    tokens, hidden = 512, 4 * hp.model_dim
    monkeypatch.setattr(tg.FP8ReluSquareMLP, "backward", staticmethod(fp32_weight_gradients))
    ledger = traced_piece(hp, tokens, 5)
    fp32 = [op for op in ledger.ops if op.kind == "matmul fp32"]
    assert {(op.phase, op.shape) for op in fp32} == {("backward", f"float32[{hidden}, {hp.model_dim}]")}
    assert len(fp32) == 2 * hp.num_layers
    assert matmul_flops(ledger, "matmul fp32") == 2 * hp.num_layers * 2 * tokens * hidden * hp.model_dim
    monkeypatch.undo()
    shipped = traced_piece(hp, tokens, 5)
    assert matmul_flops(shipped, "matmul fp32") < 0.01 * matmul_flops(shipped)


@pytest.mark.slow
def test_forward_keeps_the_memory_plans_bytes():
    """The GPU path's forward of one piece: the storages the ledger records as made by the forward's ops and
    alive after it, with the piece's batch, are the bytes the memory plan counts as kept (its trunk and
    head), to the byte."""
    hp = tiny_hp()
    plan = pm.MemoryPlan(hp, 1, gpu_path=True)
    figures = plan.piece_figures(512)
    last_step = hp.num_scheduled_iterations + hp.num_extension_iterations
    ledger = traced_piece(hp, 512, last_step)
    block = pm.CUDA_BLOCK_BYTES
    batch = sum(-(-t.untyped_storage().nbytes() // block) * block for t in pm.plan_batch(hp, 512) if t is not None)
    print("plan", figures["trunk"] + figures["head"], "ledger", ledger.kept_bytes("forward"), "batch", batch)
    assert ledger.kept_bytes("forward") + batch == figures["trunk"] + figures["head"]


def analytic_visible_tiles(tokens, window_blocks):
    """Query tile i of one document sees key tiles i - window_blocks ... i (128-token tiles = window blocks)."""
    return sum(min(i + 1, window_blocks + 1) for i in range(-(-tokens // tg.ATTN_BLOCK)))


@pytest.mark.slow
def test_record_step_matmul_flops_are_the_analytic_count():
    """Stage 3 of the record at 8 ranks (49,152 tokens per rank): forward and backward matmuls are
    6 T (per-token weights of the projections and the head) within 1 % (the gates and MUDD's small
    networks are left out of the count); attention is 4 x 128^2 x head_dim x heads per visible tile
    forward and 2.5 times that backward, the tiles counted here (one document, sliding window)."""
    hp = tg.parse_args([])
    assert hp.window_block_tokens == tg.ATTN_BLOCK
    (cost,), _ = sc.stage_costs(hp, 8, H100, stages=[2])
    tokens = cost.tokens // 8
    D, L, hdim, V = hp.model_dim, hp.num_layers, hp.num_heads * hp.head_dim, hp.vocab_size
    attn_layers = L - 1  # one layer has no attention
    per_token = attn_layers * 4 * hdim * D + L * 2 * 4 * D * D + V * D
    traced = sum(op.flops * w for op, w in cost.ops if op.kind.startswith("matmul") and op.phase != "optimizer")
    expected = 6 * tokens * per_token
    print(f"matmul FLOPs: traced {traced:.4e}, analytic {expected:.4e}, ratio {traced / expected:.4f}")
    assert abs(traced / expected - 1) < 0.01
    schedule = tg.Schedule(hp)
    short, long = schedule.at(schedule.stages[2].first_step).windows
    model = tg.build_model(hp, torch.device("cpu"))
    tile_flops = 4 * tg.ATTN_BLOCK ** 2 * hp.head_dim * hp.num_heads  # a paired layer: twice the tiles, half the heads
    attention = 0
    for i, plan in enumerate(model.plan):
        if i == model.roles.attn_free:
            continue
        blocks = long if i in model.roles.long_window else short
        stream = 2 * tokens if plan.paired else tokens
        attention += analytic_visible_tiles(stream, blocks) * tile_flops // (2 if plan.paired else 1)
    traced_attention = sum(op.flops * w for op, w in cost.ops if op.kind == "attention")
    print(f"attention FLOPs: traced {traced_attention:.4e}, analytic {3.5 * attention:.4e}")
    assert traced_attention == 3.5 * attention


def test_fp8_mlp_weight_gradients_within_the_bf16_error_model():
    """FP8ReluSquareMLP.backward's weight gradients (bf16 GEMMs, fp32 accumulation, returned in fp32) against
    float64 from the same bf16 saved tensors. Error model per entry, with S = sum_t |a_t| |b_t| of the
    product's operands: dW2 = post^T g has one rounding of the output to bf16 (2^-9 relative) and fp32
    accumulation (T 2^-24 S); dW1 = grad_pre^T x also carries grad_pre's three bf16 roundings (2^-9 each)."""
    torch.manual_seed(0)
    T, D, Hd = 1024, 64, 256
    x = torch.randn(T, D).bfloat16()
    w1, w2 = torch.randn(Hd, D) / D ** 0.5, torch.randn(Hd, D) / Hd ** 0.5
    pre = (x.float() @ w1.T).bfloat16()
    post = torch.relu(pre).square()
    grad_out = torch.randn(T, D).bfloat16()

    class Ctx:
        saved_tensors = (x, w1, w2, pre, post)

    _, grad_w1, grad_w2, *_ = tg.FP8ReluSquareMLP.backward(Ctx, grad_out, None)
    assert grad_w1.dtype == grad_w2.dtype == torch.float32
    f64 = {name: t.double() for name, t in dict(x=x, w2=w2.bfloat16(), pre=pre, post=post, g=grad_out).items()}
    grad_pre = 2 * (f64["g"] @ f64["w2"].T) * torch.relu(f64["pre"])
    for grad, a, b, roundings in ((grad_w2, f64["post"], f64["g"], 1), (grad_w1, grad_pre, f64["x"], 4)):
        exact, scale = a.T @ b, a.abs().T @ b.abs()
        error = (grad.double() - exact).abs()
        bound = (roundings * 2.0 ** -9 + T * 2.0 ** -24) * scale
        print(f"max error / bound: {(error / bound).max():.3f}")
        assert (error <= bound).all()
        assert (error > 0).any()  # bf16 outputs: not the fp64 values
