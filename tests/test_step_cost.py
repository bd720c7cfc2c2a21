"""tools/step_cost.py, the step-cost ledger: its matmul FLOPs are the analytic count of the record step, its
FLOPs are FlopCounterMode's, it sees fp32 GEMMs where there are some (a positive control) and none in the
shipped FP8 MLP, and the bytes a traced forward keeps are the memory plan's (slow: a fake-tensor trace of a
tiny model's step takes ~20 s on 2 cores). The FP8 MLP's bf16 weight gradients meet their error model.
The reference's side (tools/reference_step.py): each stand-in's FLOPs and bytes are the analytic count of its
kernel, and the reference's own step at reduced size has its analytic FLOPs (slow, skipped without the log in
../shared/reference/); the launch floor and NCCL's latency move the totals they should; the flags' errors are
one line."""
import collections
import dataclasses
import math
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
            None, None, None, None, None, None)


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
        saved_tensors, fused = (x, w1, w2, pre, post), False

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


# ---- the reference's stand-ins, the cost model's launch floor and collective latency, the flags

import reference_step as rs  # noqa: E402

REFERENCE_LOG = Path(__file__).resolve().parents[2] / "shared" / "reference" / \
    "modded-nanogpt_2026-07-17_FP8DownProjection_11cb620c.txt"


def traced_ops(fn, *shapes_and_dtypes):
    """The ops a Ledger records (and the Ledger) while fn runs on fake tensors made from (shape, dtype) pairs; its
    result stays alive (in the ledger), as a step's outputs do."""
    ledger, fake = sc.Ledger(1), FakeTensorMode()
    with fake:
        tensors = [torch.empty(shape, dtype=dtype) for shape, dtype in shapes_and_dtypes]
        with ledger:
            ledger.result = fn(*tensors)
    return ledger.ops, ledger


def only_op(ops, name):
    (op,) = [op for op in ops if op.name == name]
    return op


def nbytes(shape, dtype):
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def upper_tiles(m, block_m, block_n):
    """Tiles (i, j) of the block grid whose rows reach the diagonal: j * block_n < (i + 1) * block_m."""
    return sum(min(-(-m // block_n), -(-(i + 1) * block_m // block_n)) for i in range(-(-m // block_m)))


BF16, F32, E4M3 = torch.bfloat16, torch.float32, torch.float8_e4m3fn


@pytest.mark.parametrize("batch, m, k", [(3, 768, 768), (8, 256, 768), (2, 512, 1024)])
def test_xxt_stand_in_counts_the_kernels_tiles(batch, m, k):
    """XXT computes the output tiles on or above the diagonal block row (128 x 128 tiles for K = 768, 64 x 128
    otherwise), each a full tile times K; it reads A and writes the M x M output. Error model: none (integers)."""
    bm, bn = (128, 128) if k == 768 else (64, 128)
    ops, ledger = traced_ops(lambda a, out: rs.XXT(a, out), ((batch, m, k), BF16), ((batch, m, m), BF16))
    op = only_op(ops, "xxt")
    assert op.kind == "matmul bf16"
    assert op.flops == batch * upper_tiles(m, bm, bn) * 2 * bm * bn * k
    assert ledger.op_bytes(op) == (nbytes((batch, m, k), BF16), nbytes((batch, m, m), BF16))


def test_xtx_and_ba_plus_caa_stand_ins():
    """XTX of the MLP bank's (3, 3072, 768) chunk: 21 of the 6 x 6 tiles of the 768 x 768 output, contraction
    3072; ba_plus_cAA of (3, 768, 768): the same tiles, contraction 768, reading A once."""
    ops, ledger = traced_ops(lambda a, out: rs.XTX(a, out), ((3, 3072, 768), BF16), ((3, 768, 768), BF16))
    op = only_op(ops, "xtx")
    assert op.flops == 3 * 21 * 2 * 128 * 128 * 3072
    assert ledger.op_bytes(op) == (nbytes((3, 3072, 768), BF16), nbytes((3, 768, 768), BF16))
    ops, ledger = traced_ops(lambda a, out: rs.ba_plus_cAA(a, 2.0, -1.0, out), ((3, 768, 768), BF16),
                             ((3, 768, 768), BF16))
    op = only_op(ops, "ba_plus_caa")
    assert op.flops == 3 * 21 * 2 * 128 * 128 * 768
    assert ledger.op_bytes(op) == (nbytes((3, 768, 768), BF16),) * 2


def test_linear_relu_square_stand_ins():
    """Forward (FP8 in, FP8 out): 2 M N K FLOPs as an FP8 GEMM; reads x and W1 in e4m3 and two scales, writes
    pre and post (bf16), post in e4m3 and one amax per program (132 SMs). Backward: 2 M N K in bf16, reading
    the gradient, W2 and pre, writing the pre-activation gradient."""
    M, N, K = 512, 3072, 768
    ops, ledger = traced_ops(
        lambda x, w1, x8, w18, s, a, amax: rs.linear_relu_square(x, w1, a_f8=x8, b_f8=w18, dequant_scale_ptr=s,
                                                                  activation_scale=a, partial_amax=amax[0]),
        ((M, K), BF16), ((N, K), BF16), ((M, K), E4M3), ((N, K), E4M3), ((1,), F32), ((1,), F32),
        ((11, rs.NUM_SMS), F32))
    op = only_op(ops, "linear_relu_square")
    assert (op.kind, op.flops) == ("matmul fp8", 2 * M * N * K)
    assert ledger.op_bytes(op) == (M * K + N * K + 8, 2 * 2 * M * N + M * N + 4 * rs.NUM_SMS)
    ops, ledger = traced_ops(lambda g, w2, pre: rs.linear_relu_square(g, w2, aux=pre),
                             ((M, K), BF16), ((N, K), BF16), ((M, N), BF16))
    op = only_op(ops, "linear_relu_square_backward")
    assert (op.kind, op.flops) == ("matmul bf16", 2 * M * N * K)
    assert ledger.op_bytes(op) == (2 * (M * K + N * K + M * N), 2 * M * N)


@pytest.mark.skipif(not tg.HAS_TRITON, reason="the fused FP8 MLP's ops need Triton")
def test_fused_mlp_ops_are_priced_as_their_gemms():
    """fp8_kernels.py's ops. Up projection: 2 M N K FLOPs as an FP8 GEMM; reads x and W1 in e4m3
    and two scales, writes pre and post (bf16), post in e4m3 and one fp32 maximum per output tile.
    relu^2 gradient: 2 M N K in bf16, reading the gradient, W2 and pre, writing the gradient of pre.
    Error model: none (integers)."""
    M, N, K = 512, 3072, 768
    kernels = sc.fused_kernels()
    block_m, block_n = kernels.UP_TILE[:2]
    tiles = (M // block_m) * (N // block_n)
    ops, ledger = traced_ops(torch.ops.speedrun.fp8_up_relu_square, ((M, K), E4M3), ((N, K), E4M3),
                             ((), F32), ((), F32))
    op = only_op(ops, "fp8_up_relu_square")
    assert (op.kind, op.flops, op.tiles) == ("matmul fp8", 2 * M * N * K, tiles)
    assert ledger.op_bytes(op) == (M * K + N * K + 8, 2 * 2 * M * N + M * N + 4 * tiles)
    ops, ledger = traced_ops(torch.ops.speedrun.relu_square_grad, ((M, K), BF16), ((N, K), BF16),
                             ((M, N), BF16))
    op = only_op(ops, "relu_square_grad")
    assert (op.kind, op.flops) == ("matmul bf16", 2 * M * N * K)
    assert ledger.op_bytes(op) == (2 * (M * K + N * K + M * N), 2 * M * N)


LOSS_ROWS, LOSS_VOCAB = 256, 50304


def traced_fused_loss(after=None):
    """(ops, ledger) of speedrun::softcap_loss on LOSS_ROWS x LOSS_VOCAB bf16 logits with 3
    horizons (softcap 23, offset 5, bf16 sigmoid), then `after` of its loss sums if given."""
    sc.fused_kernels()  # registers the op

    def loss(logits, targets, weights, announced):
        out = torch.ops.speedrun.softcap_loss(logits, targets, weights, None, 23.0, 5.0, True,
                                              7.5, announced, 0.5)
        return out if after is None else after(out[0])

    return traced_ops(loss, ((LOSS_ROWS, LOSS_VOCAB), BF16), ((LOSS_ROWS,), torch.int64),
                      ((3,), F32), ((), F32))


@pytest.mark.skipif(not tg.HAS_TRITON, reason="the fused loss's op needs Triton")
def test_fused_loss_op_is_priced_as_one_read_of_the_logits():
    """fp8_kernels.py's speedrun::softcap_loss, as #89's ce_fwd_bwd: reads the bf16 logits once, the
    int64 targets, the 3 fp32 MTP weights and the announced fp32 gradient; writes the e5m2
    gradient and 3 fp32 loss sums. No FLOPs, its own kernel (not fused with its neighbours), 4
    special functions per logit (two sigmoids, one tanh each; two exps). Error model: none
    (integers)."""
    R, V = LOSS_ROWS, LOSS_VOCAB
    ops, ledger = traced_fused_loss()
    op = only_op(ops, "softcap_loss")
    assert (op.flops, op.fusable, op.sfu) == (0, False, 4 * R * V)
    assert ledger.op_bytes(op) == (2 * R * V + 8 * R + 12 + 4, R * V + 12)


@pytest.mark.skipif(not tg.HAS_TRITON, reason="the fused loss's op needs Triton")
def test_the_fused_loss_op_keeps_its_price_beside_inductors_kernels():
    """Its kernel is ours, not Inductor's: an inventory (--kernels) replaces the pointwise work
    Inductor compiles, not the op. Error model: none (the same sums in another order, rel 1e-12)."""
    ops, ledger = traced_fused_loss(after=lambda sums: sums * 2)
    loss = only_op(ops, "softcap_loss")
    alone = sc.cost_of(ledger, [loss], H100)
    real = sc.cost_of(ledger, ops, H100, real=[("triton_poi_fused_mul_0", 24, 1)])
    assert real["seconds"]["pointwise/reduction"] == pytest.approx(
        alone["seconds"]["pointwise/reduction"] + H100["launch"], rel=1e-12)


def test_loss_and_copy_stand_ins_move_their_tensors():
    """ce_fwd_bwd reads each row's bf16 logits, the int64 targets and the MTP weights and writes the fp32 losses
    and the e5m2 gradient; the quantize-transpose reads the strided down projections (12 of the bank's 24
    matrices) and writes them in e4m3 with the scales and 12 x 576 tile amaxes, then the amax reduction reads
    those; transpose_copy reads and writes once, transpose_add reads both and writes one. No FLOPs (pointwise
    kernels count none, as FlopCounterMode counts none for ours), and none of them fuses."""
    R, V = 256, 50304
    ops, ledger = traced_ops(lambda l, t, w, loss, g: rs.ce_fwd_bwd(l, t, w, loss, g, R, 3, 23.0, 5.0, 7.5, 1.0, 1.0),
                             ((R, V), BF16), ((R,), torch.int64), ((3,), F32), ((R,), F32),
                             ((R, V), torch.float8_e5m2))
    op = only_op(ops, "ce_fwd_bwd")
    assert (op.flops, op.fusable) == (0, False)
    assert ledger.op_bytes(op) == (2 * R * V + 8 * R + 12, 4 * R + R * V)
    ops, ledger = traced_ops(
        lambda bank, out, nxt, used, amax: rs.quantize_transpose_mlp_down_weights(bank[:, 1], out, nxt, used, amax),
        ((12, 2, 3072, 768), BF16), ((12, 768, 3072), E4M3), ((12,), F32), ((12,), F32), ((12, 576), F32))
    quantize, reduce = only_op(ops, "quantize_transpose"), only_op(ops, "reduce_amax")
    assert ledger.op_bytes(quantize) == (2 * 12 * 3072 * 768 + 48, 12 * 768 * 3072 + 48 + 4 * 12 * 576)
    assert ledger.op_bytes(reduce) == (4 * 12 * 576, 48)
    ops, ledger = traced_ops(lambda src, dst: (rs.transpose_copy(src, dst), rs.transpose_add(dst, src)),
                             ((768, 4096), BF16), ((4096, 768), BF16))
    assert ledger.op_bytes(only_op(ops, "transpose_copy")) == (2 * 768 * 4096,) * 2
    assert ledger.op_bytes(only_op(ops, "transpose_add")) == (4 * 768 * 4096, 2 * 768 * 4096)


@pytest.mark.parametrize("seq_len, window", [(1024, 384), (2048, 640), (1000, 100), (512, 4096)])
def test_window_tiles_are_the_visible_tile_pairs(seq_len, window):
    """FA3's causal sliding window (key k seen by query q when q - window <= k <= q): the 128 x 128 tile pairs
    holding at least one visible pair, counted by brute force over positions."""
    q = torch.arange(seq_len)[:, None]
    k = torch.arange(seq_len)[None, :]
    visible = (k <= q) & (k >= q - window)
    tiles = -(-seq_len // 128)
    pad = torch.zeros(tiles * 128, tiles * 128, dtype=torch.bool)
    pad[:seq_len, :seq_len] = visible
    expected = int(pad.view(tiles, 128, tiles, 128).any(3).any(1).sum())
    assert rs.window_tiles(seq_len, window) == expected


def test_launch_floor_joins_fused_ops_into_one_kernel():
    """A pointwise chain (its intermediate dies in the phase) is one kernel, a matmul another: with a launch
    floor of 1 s, the step costs 2 s, and the floor adds 2 s less the two kernels' roofline time."""
    peaks = dict(H100, launch=1.0)

    def chain(a, w):
        return ((a + 1) * 2) @ w

    ops, ledger = traced_ops(chain, ((256, 64), F32), ((64, 64), F32))
    totals = sc.cost_of(ledger, ops, peaks)
    assert totals["kernels"] == 2
    roofline = totals["compute"] + totals["memory"]
    assert 0 < roofline < 1e-3
    assert totals["launch"] == pytest.approx(2.0 - roofline, rel=1e-12)
    no_floor = sc.cost_of(ledger, ops, dict(H100, launch=0.0))
    assert no_floor["launch"] == 0 and no_floor["kernels"] == 2


def test_collectives_pay_nccls_latency():
    """Over 8 ranks, an all-reduce pays base + 14 hops, a reduce-scatter base + 7 hops, each plus its ring bytes
    over NVLink; with no latency only the bytes remain."""
    import torch.distributed as dist

    def collectives(x, chunk):
        dist.all_reduce(x)
        dist.reduce_scatter_tensor(chunk, x)

    ledger, fake = sc.Ledger(8), FakeTensorMode()
    with pm.fake_world(8), fake:
        x, chunk = torch.empty(8 * 1024, dtype=BF16), torch.empty(1024, dtype=BF16)
        with ledger:
            collectives(x, chunk)
    totals = sc.cost_of(ledger, ledger.ops, H100)
    base, hop, link = H100["nccl_base"], H100["nccl_hop"], H100["nvlink"]
    sent = 2 * 16384 * 7 / 8 + 16384 * 7 / 8
    assert totals["collectives"] == 2
    assert totals["latency"] == pytest.approx(2 * base + 21 * hop, rel=1e-12)
    assert totals["comm"] == pytest.approx(2 * base + 21 * hop + sent / link, rel=1e-12)
    assert sc.cost_of(ledger, ledger.ops, dict(H100, nccl_base=0.0, nccl_hop=0.0))["comm"] == \
        pytest.approx(sent / link, rel=1e-12)


def test_gathers_read_the_rows_they_gather():
    """An embedding lookup of 100 rows reads 100 rows of its 50,000-row table, not the table."""
    ops, ledger = traced_ops(lambda table, ids: torch.nn.functional.embedding(ids, table),
                             ((50000, 64), BF16), ((100,), torch.int64))
    assert ledger.op_bytes(only_op(ops, "embedding")) == (100 * 64 * 2 + 800, 100 * 64 * 2)


def one_line_error(capsys, argv, env=None, monkeypatch=None):
    with pytest.raises(SystemExit) as exit_info:
        sc.parse(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.count("\n") == 1 and err.startswith("step_cost.py: error: "), err
    return err


@pytest.mark.parametrize("argv, says", [(["--top", "-5"], "--top"), (["--bogus", "1"], "--bogus"),
                                        (["--preset", "cpu"], "--ngram_prior 0"),
                                        (["--reference", "/nonexistent/log.txt"], "no such file")])
def test_bad_flags_get_one_line_errors(capsys, argv, says):
    assert says in one_line_error(capsys, argv)


def test_world_size_follows_the_environment(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert sc.parse([])[0].world_size == 4
    assert sc.parse(["--world_size", "2"])[0].world_size == 2
    monkeypatch.setenv("WORLD_SIZE", "four")
    assert "WORLD_SIZE" in one_line_error(capsys, [])


def test_a_log_without_the_kernels_section_is_refused(tmp_path):
    with pytest.raises(rs.LogError, match="triton_kernels.py"):
        rs.split_log("import torch\nprint('a log of another era')\n", "log.txt")


def record_log(script, kernels="import torch\n", output="step:0/10 val_loss:10.8\n"):
    return script + rs.SCRIPT_END + kernels + rs.KERNELS_END + output


BAD_LOGS = [
    ("binary", lambda p: p.write_bytes(bytes(range(256)) * 40),
     "is not a text log (not UTF-8 at byte 128)"),
    ("script", lambda p: p.write_text(record_log("import torch\nmodel = GPT(\n")),
     "its train_gpt.py does not parse (line 2: "),
    ("kernels", lambda p: p.write_text(record_log("import torch\n", "def kernel(:\n    pass\n")),
     "its triton_kernels.py does not parse (line 1: "),
    ("directory", lambda p: p.mkdir(), "is a directory, not a modded-nanogpt record log"),
    ("era", lambda p: p.write_text("import torch\n"), "no '# triton_kernels.py' section"),
    ("world size", lambda p: p.write_text(record_log("import torch\n")), "not --world_size 3"),
]


@pytest.mark.parametrize("name,make,says", BAD_LOGS, ids=[b[0] for b in BAD_LOGS])
def test_a_reference_log_that_cannot_be_traced_is_refused_before_tracing(tmp_path, capsys,
                                                                          monkeypatch, name, make,
                                                                          says):
    """A binary file printed a UnicodeDecodeError traceback, and a syntax error in the log's script
    a traceback after ~58 s of tracing our own step; a directory was "no such file". The log is read
    and parsed when the flags are: parse() refuses it, and nothing is traced."""
    monkeypatch.setattr(sc, "report", lambda *a: pytest.fail("traced our step before the log"))
    log = tmp_path / "log.txt"
    make(log)
    world_size = "3" if name == "world size" else "8"
    err = one_line_error(capsys, ["--reference", str(log), "--world_size", world_size])
    assert f"--reference {log}" in err and says in err, err


@pytest.mark.slow
@pytest.mark.skipif(not REFERENCE_LOG.is_file(), reason="the reference log (../shared/reference/) is absent")
def test_reference_step_at_reduced_size():
    """The reference's own step (record #89's log) at 2,048 tokens per rank, stages 2 (tied embedding) and 3 of 8
    ranks, ~15 s. Forward and backward matmuls are 6 T per-token weights (its 10 attention layers' Q, K, V, O, its
    11 MLPs, the head) within 1 % (gates and MUDD's small networks left out); attention is 3.5 x 4 x 128^2 x
    head_dim x heads per visible tile, the tiles of each layer's window from the record's schedule ((3, 7) and
    (5, 11) blocks; layer 6 has no attention; the paired layers 0, 2, 5, 9 attend over twice the positions with
    half the heads; layers 3 and 10 take the long window); every stand-in runs; NorMuon's banks travel in bf16;
    the bigram table's exchange is an all-to-all."""
    T, D, L, V, hd = 2048, 768, 11, 50304, 128
    costs, _ = sc.reference_stage_costs(REFERENCE_LOG, 8, H100, stages=[1, 2], tokens_per_rank=T)
    per_token = (L - 1) * 4 * D * D + L * 2 * 4 * D * D + V * D
    for cost, (short, long) in zip(costs, [(3, 7), (5, 11)]):
        traced = sum(op.flops * w for op, w in cost.ops if op.kind.startswith("matmul") and op.phase != "optimizer")
        print(f"stage {cost.stage + 1}: matmul FLOPs traced/analytic {traced / (6 * T * per_token):.4f}")
        assert abs(traced / (6 * T * per_token) - 1) < 0.01
        attention = 0
        for layer in range(L):
            if layer == 6:
                continue
            paired = layer in (0, 2, 5, 9)
            blocks = long if layer in (3, 10) else short
            attention += analytic_visible_tiles(2 * T if paired else T, blocks) * 4 * 128 ** 2 * hd * (3 if paired else 6)
        traced_attention = sum(op.flops * w for op, w in cost.ops if op.kind == "attention")
        assert traced_attention == pytest.approx(3.5 * attention, rel=1e-12)
        names = {op.name for op, _ in cost.ops}
        expected = {"xxt", "xtx", "ba_plus_caa", "linear_relu_square", "linear_relu_square_backward", "ce_fwd_bwd",
                    "quantize_transpose", "reduce_amax", "transpose_copy", "alltoall_base_"}
        assert expected <= names, expected - names
        assert ("transpose_add" in names) == (cost.stage == 1)  # lm_head += embed.grad.T while tied
        banks = {op.shape for op, _ in cost.ops if op.kind == "collectives" and "3072, 768" in op.shape}
        assert banks == {"bfloat16[3, 3072, 768]", "bfloat16[24, 3072, 768]"}
        assert cost.kernels > 100 and cost.launch > 0 and cost.latency > 0


@pytest.mark.slow
@pytest.mark.skipif(not REFERENCE_LOG.is_file(), reason="the reference log (../shared/reference/) is absent")
def test_reference_stage_of_the_race_inventorys_size_is_priced_by_its_kernels():
    """--reference_kernels on the reference's step at 2,048 tokens per rank, stage 3 of 8 ranks (one
    micro-step): at another size it stays ideal fusion and says why; at its size the forward's and
    backward's pointwise work is the inventory's one kernel, 3 calls of 1 MB a micro-step; #89's
    stand-ins (its own kernels) keep their price."""
    T = 2048
    elsewhere = sc.RealKernels("inv89.json", 1, [("triton_poi_fused_0", 10**6, 3)], {}, 0)
    (ideal,), _ = sc.reference_stage_costs(REFERENCE_LOG, 8, H100, stages=[2], tokens_per_rank=T,
                                           kernels=elsewhere)
    assert ideal.pricing.startswith("ideal fusion: the inventory's training step has 1 tokens")
    (real,), _ = sc.reference_stage_costs(REFERENCE_LOG, 8, H100, stages=[2], tokens_per_rank=T,
                                          kernels=dataclasses.replace(elsewhere, tokens=T))
    assert real.pricing == "Inductor's kernels"
    compiled = sum(s for (phase, *_), s in real.top.items() if phase == "fwd+bwd")
    assert compiled == pytest.approx(3 * max(10**6 / H100["hbm"], H100["launch"]), rel=1e-9)
    own = {name for (phase, kind, name, _), s in real.top.items() if phase != "fwd+bwd"}
    assert {"ce_fwd_bwd", "transpose_copy"} <= own
    assert not any(sc.compiled_work(op) for op, _ in real.ops if op.name == "ce_fwd_bwd")


def test_copy_writes_its_destination_without_reading_it():
    """copy_ into a (strided) destination reads the source and writes the destination once; add_ reads both."""
    ops, ledger = traced_ops(lambda dst, src: (dst.T.copy_(src), dst.add_(src.T)), ((768, 4096), BF16),
                             ((4096, 768), BF16))
    size = 768 * 4096 * 2
    assert ledger.op_bytes(only_op(ops, "copy_")) == (size, size)
    assert ledger.op_bytes(only_op(ops, "add_")) == (2 * size, size)


def made_up_cost(stage, steps, ms, top):
    """A StageCost of `ms` per step, all of it memory time, with the given items."""
    zero = collections.Counter()
    return sc.StageCost(stage, steps, 1000, zero, zero, zero, compute=0.0, memory=ms / 1e3, launch=0.0, comm=0.0,
                        optimizer_compute=0.0, kernels=1, collectives=0, latency=0.0,
                        top=collections.Counter(top), ops=[])


def test_side_by_side_lines():
    """The stage lines, the items paired by phase, class and canonical output, and the last line: the train
    times' ratio times the reference's measured 79.7 s."""
    item = ("backward", "matmul bf16", "mm", "bfloat16[3072, 768]")
    same = ("backward", "matmul bf16", "bmm", "bfloat16[1, 3072, 768]")
    ours = [made_up_cost(0, 100, 30.0, {}), made_up_cost(2, 300, 66.0, {item: 0.004})]
    reference = [made_up_cost(0, 100, 20.0, {}), made_up_cost(2, 300, 60.0, {same: 0.001})]
    lines = sc.comparison(ours, reference, 8, H100, "log.txt")
    assert "stage 1: predicted ms/step ours 30.0, reference 20.0, ratio 1.50" in lines
    assert "stage 3: predicted ms/step ours 66.0, reference 60.0, ratio 1.10" in lines
    (paired,) = [line for line in lines if "bfloat16[3072, 768]" in line]
    assert paired.startswith("    +3.00 ms (ours   4.00, reference   1.00)") and "ours: mm; reference: bmm" in paired
    ratio = (100 * 30.0 + 300 * 66.0) / (100 * 20.0 + 300 * 60.0)
    assert lines[-1] == (f"predicted train time: ours 22.8 s, reference 20.0 s, ratio {ratio:.3f}; at the reference's "
                         f"measured 79.7 s: {ratio:.3f} × 79.7 = {ratio * 79.7:.1f} s")


# ---- issue 53: what the roofline alone missed, each priced the same way in both columns

def only_kernel_seconds(ops, ledger, peaks=H100):
    totals = sc.cost_of(ledger, ops, dict(peaks, launch=0.0))
    return totals["compute"] + totals["memory"], totals


@pytest.mark.parametrize("backend", sorted(sc.ATTENTION_BACKENDS))
def test_attention_runs_at_its_backends_efficiency(backend):
    """A forward and backward of 64 visible tiles cost their FLOPs at the backend's share of the bf16 peak: the
    forward 4 x 128 x 128 x 64 x 6 heads per tile, the backward 2.5 x that. Error model: float rounding only."""
    T, H, D, blocks = 1024, 6, 64, 64

    def attention(q, k, v):
        out = sc.attention_op(q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), blocks, backend)[0]
        out.sum().backward()

    ops, ledger = traced_ops(attention, *[((T, H, D), BF16)] * 3)
    forward, backward = only_op(ops, "attention"), only_op(ops, "attention_backward")
    efficiency = sc.ATTENTION_BACKENDS[backend]
    assert forward.flops == blocks * 4 * 128 * 128 * D * H
    assert backward.flops == 5 * forward.flops // 2
    for op, direction in ((forward, "forward"), (backward, "backward")):
        seconds, _ = only_kernel_seconds([op], ledger)
        assert seconds == pytest.approx(op.flops / (H100["bf16"] * efficiency[direction]), rel=1e-12)


def test_attention_backends_rank_as_their_sources():
    """FA3 ahead of FlexAttention's FLASH backend, ahead of its Triton backend; every share below the peak."""
    fa3, flash, triton = (sc.ATTENTION_BACKENDS[b] for b in ("fa3", "flex_flash", "flex_triton"))
    for direction in ("forward", "backward"):
        assert 1 > fa3[direction] > flash[direction] > triton[direction] > 0


def test_every_attention_choice_has_a_share_and_says_itself():
    """--attention's choices for ours each have an efficiency, and the line saying how ours is
    priced names the one used: fa3 as a what-if."""
    assert set(sc.ATTENTION_NAMES) <= set(sc.ATTENTION_BACKENDS)
    assert "what-if" in sc.pricing_line(None, "fa3")
    assert "Triton backend (what runs)" in sc.pricing_line(None)


@pytest.mark.parametrize("rows, tiles", [(4096, 96), (49152, 1152), (8192, 192)])
def test_gemm_waves_over_132_sms(rows, tiles):
    """The head's grad_x chunk (rows, 50304) @ (50304, 768) has (rows / 256) x (768 / 128) output tiles of
    128 x 256 (the long side along the rows); its compute time is that of ceil(tiles / 132) full waves: 96 tiles
    (one 4,096-row chunk) run one wave of 132, 1.375 x the even spread. Error model: float rounding only."""
    ops, ledger = traced_ops(lambda g, w: g @ w, ((rows, 50304), BF16), ((50304, 768), BF16))
    op = only_op(ops, "mm")
    assert op.tiles == tiles
    waves = -(-tiles // 132)
    seconds, totals = only_kernel_seconds(ops, ledger)
    assert totals["compute"] == pytest.approx(op.flops / H100["bf16"] * waves * 132 / tiles, rel=1e-12)


def test_stand_ins_count_their_kernels_tiles():
    """linear_relu_square tiles 128 x 256 (M / 128 x N / 256), XXT its upper tiles per matrix."""
    M, N, K = 4096, 3072, 768
    ops, _ = traced_ops(lambda g, w2, pre: rs.linear_relu_square(g, w2, aux=pre),
                        ((M, K), BF16), ((N, K), BF16), ((M, N), BF16))
    assert only_op(ops, "linear_relu_square_backward").tiles == 32 * 12
    ops, _ = traced_ops(lambda a, out: rs.XXT(a, out), ((3, 768, 768), BF16), ((3, 768, 768), BF16))
    assert only_op(ops, "xxt").tiles == 3 * 21


def test_loss_gradient_reads_the_logits_twice():
    """The fused loss's backward over (256, 50304) bf16 logits: a looped reduction (the lse, rows longer than a
    persistent reduction's 1,024) then the pass that writes the e5m2 gradient reads the logits again: two reads
    and one write of the rows, in one kernel; the forward's loss sums only reduce: one read."""
    R, V = 256, 50304
    softcap = tg.Softcap(23.0, 5.0, True)
    ops, ledger = traced_ops(
        lambda logits, targets, weights: tg.softcap_loss_grad(logits, targets, weights, softcap, 0, R,
                                                             torch.tensor(1.0), 0.5),
        ((R, V), BF16), ((R + 2,), torch.int64), ((3,), F32))
    _, totals = only_kernel_seconds(ops, ledger)
    small = 3 * (8 * (R + 2) + 12 + 4)  # per horizon: targets, weights, grad_total; read in each pass
    assert totals["kernels"] == 1
    assert sum(totals["bytes"].values()) == pytest.approx(2 * (2 * R * V) + R * V, abs=2 * small)
    ops, ledger = traced_ops(lambda logits, targets: tg.softcap_loss_sums(logits, targets, 3, softcap, 0, R),
                             ((R, V), BF16), ((R + 2,), torch.int64))
    _, totals = only_kernel_seconds(ops, ledger)
    assert sum(totals["bytes"].values()) == pytest.approx(2 * R * V, abs=small)


def test_the_second_pass_reads_only_what_feeds_the_reduction():
    """A row-wise max spread back over (256, 4096) rows, then added to another (256, 4096) input: the
    second pass reads the rows the max reduced again, not the input that joins after it."""
    R, V = 256, 4096

    def spread(logits, other):
        o = other.float()  # made before the reduction, yet not one of its inputs
        z = logits.float()
        return (torch.exp(z - z.amax(dim=-1, keepdim=True)) + o).bfloat16()

    ops, ledger = traced_ops(spread, ((R, V), BF16), ((R, V), BF16))
    _, totals = only_kernel_seconds(ops, ledger)
    assert totals["kernels"] == 1
    assert sum(totals["bytes"].values()) == 2 * (2 * R * V) + 2 * R * V + 2 * R * V


def test_a_saved_activations_fused_readers_take_it_from_registers():
    """The FP8 MLP's epilogue: post = relu(pre)^2 is saved (it reaches memory once); its e4m3 cast and its amax
    run in the kernel that makes it, so the kernel reads pre once and writes post and post in e4m3 (the amax's
    scalar too): one kernel, no second or third read of post."""
    M, N = 512, 3072

    def epilogue(pre, scale):
        post = torch.relu(pre).square()
        post_f8 = (post.float() * (1 / scale)).clamp(max=448.0).to(torch.float8_e4m3fn)
        return post, post_f8, post.amax().float()

    ops, ledger = traced_ops(epilogue, ((M, N), BF16), ((), F32))
    _, totals = only_kernel_seconds(ops, ledger)
    assert totals["kernels"] == 1
    assert sum(totals["bytes"].values()) == 2 * M * N + 4 + 2 * M * N + M * N + 4


def test_a_reader_after_another_kernel_reads_memory():
    """A reader that also needs a GEMM made after the activation cannot join the activation's kernel: it reads
    the activation from memory."""
    ops, ledger = traced_ops(lambda pre, w: (lambda post: (post, post * (post @ w)))(torch.relu(pre)),
                             ((256, 256), BF16), ((256, 256), BF16))
    mul = only_op(ops, "mul")
    assert ledger.op_bytes(mul)[0] == 2 * 2 * 256 * 256


@pytest.mark.parametrize("sfu_over_memory, expected", [(0.5, 1.0), (1.5, 1.5), (3.0, 3.0)])
def test_loss_kernel_occupancy(sfu_over_memory, expected):
    """#89's ce_fwd_bwd: three special functions per logit, two blocks per SM, each block loading its row, then
    computing, then storing: max(memory, sfu, (memory + sfu) / 2), in units of its memory time."""
    R, V = 256, 50304
    ops, ledger = traced_ops(lambda l, t, w, loss, g: rs.ce_fwd_bwd(l, t, w, loss, g, R, 3, 23.0, 5.0, 7.5, 1.0, 1.0),
                             ((R, V), BF16), ((R,), torch.int64), ((3,), F32), ((R,), F32),
                             ((R, V), torch.float8_e5m2))
    op = only_op(ops, "ce_fwd_bwd")
    assert (op.sfu, op.blocks_per_sm) == (3 * R * V, 2)
    memory = sum(ledger.op_bytes(op)) / H100["hbm"]
    peaks = dict(H100, sfu=op.sfu / (sfu_over_memory * memory))
    seconds, _ = only_kernel_seconds(ops, ledger, peaks)
    assert seconds == pytest.approx(max(expected, (1 + sfu_over_memory) / 2) * memory, rel=1e-9)


def inventory(tmp_path, tokens=512, training=(("triton_poi_fused_add_0", 100, 50, 11),), helpers=(),
              suffix=".json", step="training step"):
    """A kernel inventory as tools/cuda_compile_check.py writes it: the training step's kernels
    (an attention template among them) and the FP8 head helpers' ((graph, kernel, read, written,
    calls)); `step`: the training graph's name (--race: 'race #89 training step')."""
    graph = f"{step} at {tokens:,} tokens (step 5, forward+backward)"
    rows = [dict(graph=graph, kernel=name, read_bytes=read, written_bytes=written, launches=calls)
            for name, read, written, calls in training]
    rows.append(dict(graph=graph, kernel="triton_tem_fused_flex_attention_1", read_bytes=7,
                     written_bytes=7, launches=2))
    rows += [dict(graph=graph, kernel=name, read_bytes=read, written_bytes=written, launches=calls)
             for graph, name, read, written, calls in helpers]
    path = tmp_path / f"inventory{suffix}"
    if suffix == ".csv":
        import csv
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    else:
        import json
        path.write_text(json.dumps(dict(target="sm_90", graphs=[], kernels=rows)))
    return path


@pytest.mark.parametrize("count, calls", [(0, 1), (1, 1), (5, 1), (2, 11)])
def test_launch_floor_follows_the_inventorys_kernel_count(count, calls):
    """With Inductor's kernels given, the forward's pointwise chain is priced by them: a launch
    floor of 1 s per call, so the step is the matmul's kernel plus `count` real ones called `calls` times
    each, and the pointwise bytes are the inventory's (1,000 bytes a call), not the chain's."""
    peaks = dict(H100, launch=1.0)
    ops, ledger = traced_ops(lambda a, w: ((a + 1) * 2) @ w, ((256, 64), F32), ((64, 64), F32))
    real = [(f"triton_poi_fused_{i}", 1000, calls) for i in range(count)]
    totals = sc.cost_of(ledger, ops, peaks, real=real)
    assert totals["kernels"] == 1 + count * calls
    roofline = totals["compute"] + totals["memory"]
    assert totals["launch"] == pytest.approx(1 + count * calls - roofline, rel=1e-12)
    assert totals["bytes"]["pointwise/reduction"] == 1000 * count * calls
    ideal = sc.cost_of(ledger, ops, peaks)
    assert ideal["kernels"] == 2 and ideal["bytes"]["pointwise/reduction"] == 2 * 256 * 64 * 4


def test_real_kernels_cost_their_bytes():
    """A kernel of 1 GB read and written costs 1 GB at HBM bandwidth, above the launch floor."""
    ops, ledger = traced_ops(lambda a: (a + 1) * 2, ((256, 64), F32))
    totals = sc.cost_of(ledger, ops, H100, real=[("triton_red_fused_0", 10**9, 1)])
    assert totals["memory"] == pytest.approx(1e9 / H100["hbm"], rel=1e-12)
    assert totals["launch"] == 0 and totals["kernels"] == 1


@pytest.mark.parametrize("suffix", [".json", ".csv"])
def test_inventory_reads_the_training_step_and_the_fp8_helpers(tmp_path, suffix):
    """The training graph's kernels but its attention template, its tokens, and each FP8 helper's
    kernels under the custom op whose call runs them; a piece runs the helpers as often as the trace
    called them."""
    helpers = [("FP8 head forward helper at 512 tokens", "triton_poi_fused_div_0", 30, 20, 1),
               ("FP8 head backward helper at 512 tokens", "triton_poi_fused_div_1", 3, 2, 1),
               ("DistAdam's update at (8,), 1 rank(s)", "triton_poi_fused_adam_0", 9, 9, 1)]
    kernels = sc.read_inventory(inventory(tmp_path, 49152, helpers=helpers, suffix=suffix))
    assert (kernels.tokens, kernels.training, kernels.templates) == \
        (49152, [("triton_poi_fused_add_0", 150, 11)], 1)
    assert kernels.helpers == {"mm_fp8": [("triton_poi_fused_div_0", 50, 1)],
                               "mm_fp8_backward": [("triton_poi_fused_div_1", 5, 1)]}
    ops, ledger = traced_ops(lambda a: (a + 1) * 2, ((256, 64), F32))
    ledger.calls = [(0, "mm_fp8"), (1, "mm_fp8"), (len(ledger.ops), "mm_fp8_backward")]
    assert [name for name, *_ in kernels.of_piece(ledger, ops)] == \
        ["triton_poi_fused_add_0"] + 2 * ["triton_poi_fused_div_0"]


def test_the_race_inventory_gives_89s_inductor_kernels_not_its_own(tmp_path):
    """--reference_kernels reads the race's #89 training step (cuda_compile_check.py --race): its
    Inductor kernels, not its user-defined Triton kernels (traced stand-ins price those) nor its
    attention templates; our graph's name is not its."""
    training = (("triton_poi_fused_add_0", 100, 50, 11), ("linear_relu_square_kernel", 9, 9, 11))
    path = inventory(tmp_path, 49152, training=training, step="race #89 training step")
    kernels = sc.read_inventory(path, sc.RACE_GRAPH)
    assert (kernels.tokens, kernels.training, kernels.templates) == \
        (49152, [("triton_poi_fused_add_0", 150, 11)], 1)
    with pytest.raises(sc.InventoryError, match="no kernels of the training step"):
        sc.read_inventory(path)


def test_89s_stand_ins_are_kernels_of_their_own():
    """A stand-in of #89's Triton kernels keeps its traced price beside Inductor's kernels, as our
    own ops do: --reference_kernels replaces only the work Inductor compiles."""
    ops, _ = traced_ops(lambda x, y: rs.transpose_copy(x, y), ((64, 32), BF16), ((32, 64), BF16))
    (op,) = [op for op in ops if op.name == "transpose_copy"]
    assert op.own_kernel and not sc.compiled_work(op)
    ops, _ = traced_ops(lambda a: (a + 1) * 2, ((64, 32), F32))
    assert all(sc.compiled_work(op) for op in ops)


@pytest.mark.parametrize("argv, says", [
    (["--reference_kernels", "inv.json"], "give --reference LOG too"),
    (["--reference", str(REFERENCE_LOG), "--reference_kernels", "/nonexistent/inv.json"],
     "no such file; make one with"),
])
def test_reference_kernels_without_a_reference_or_a_file_is_one_line(capsys, argv, says):
    if not REFERENCE_LOG.is_file() and "--reference" in argv:
        pytest.skip("the reference log (../shared/reference/) is absent")
    err = one_line_error(capsys, argv)
    assert err.startswith("step_cost.py: error: --reference_kernels ") and says in err, err


def test_a_stage_of_another_size_says_it_is_priced_by_ideal_fusion(tmp_path):
    kernels = sc.read_inventory(inventory(tmp_path, 49152))
    assert sc.piece_pricing(kernels, 49152) == "Inductor's kernels"
    assert sc.piece_pricing(kernels, 16384) == ("ideal fusion: the inventory's training step has "
                                                "49,152 tokens, these pieces 16,384")
    assert sc.piece_pricing(None, 16384) == "ideal fusion"


@pytest.mark.parametrize("write, says", [
    (None, "no such file"),
    (lambda p: p.write_text('{"kernels": [{"graph": '), "not a JSON inventory"),
    (lambda p: p.write_text('{"graphs": []}'), "no list of 'kernels'"),
    (lambda p: p.write_text('{"kernels": [{"graph": "training step at 8 tokens", "kernel": "k"}]}'),
     "kernel row 1 has no read_bytes, written_bytes, launches"),
    (lambda p: p.write_text('{"kernels": [{"graph": "training step at 8 tokens", "kernel": "k", '
                            '"read_bytes": "many", "written_bytes": 1, "launches": 1}]}'),
     "not whole numbers"),
    (lambda p: p.write_text('{"kernels": [{"graph": "FP8 head forward helper", "kernel": "k", '
                            '"read_bytes": 1, "written_bytes": 1, "launches": 1}]}'),
     "no kernels of the training step"),
])
def test_a_missing_or_garbled_inventory_is_one_line(capsys, tmp_path, write, says):
    path = tmp_path / "inventory.json"
    if write is not None:
        write(path)
    err = one_line_error(capsys, ["--kernels", str(path)])
    assert err.startswith(f"step_cost.py: error: --kernels {path}: ") and says in err, err
    assert "cuda_compile_check.py --only training head --inventory" in err, err


@pytest.mark.slow
def test_a_stage_of_the_inventorys_size_is_priced_by_its_kernels():
    """A tiny run's first stage: with an inventory at another size it is priced by ideal fusion and
    says why; at its pieces' size the forward's and backward's pointwise work is the inventory's one
    kernel, called 3 times a piece at 1 MB a call, at every piece of the step (accumulation steps x
    pieces)."""
    hp = tiny_hp()
    elsewhere = sc.RealKernels("inventory.json", 1, [("triton_poi_fused_0", 10**6, 3)], {}, 0)
    (ideal,), _ = sc.stage_costs(hp, 1, H100, stages=[0], kernels=elsewhere)
    assert ideal.pricing.startswith("ideal fusion: the inventory's training step has 1 tokens")
    assert not any(phase == "fwd+bwd" for phase, *_ in ideal.top)
    length = int(ideal.pricing.rsplit(" ", 1)[1].replace(",", ""))
    here = dataclasses.replace(elsewhere, tokens=length)
    (real,), _ = sc.stage_costs(hp, 1, H100, stages=[0], kernels=here)
    assert real.pricing == "Inductor's kernels"
    plan = tg.Schedule(hp).at(0)
    accum = tg.grad_accum_steps(hp, 1)
    tokens = tg.tokens_per_rank(plan.batch_tokens, 1, accum)
    pieces = accum * (1 if length == tokens else -(-tokens // hp.micro_batch_tokens))
    per_call = max(10**6 / H100["hbm"], H100["launch"])
    compiled = sum(s for (phase, *_), s in real.top.items() if phase == "fwd+bwd")
    assert compiled == pytest.approx(3 * pieces * per_call, rel=1e-9)
