"""Tests of tests/reference89.py, the float64 port of modded-nanogpt record #89, on its own.

The port was checked against the reference script itself (run on CPU with stubs, outside the
repository); the literal values below are ones that check confirmed. These tests keep the port
honest when it is edited: hand-computed values, internal consistency, and every idea of the model
visibly changing the logits at the toy sizes the comparison tests use.
"""
import dataclasses
import math

import pytest
import torch

import reference89 as ref

F64 = torch.float64
CFG = ref.RefConfig(vocab_size=500, model_dim=64, num_heads=4, head_dim=16, bigram_vocab_size=2048,
                    bigram_dim=16, bigram_sign_table_rows=64, block_size=16, world_size=8)
T = 64
CU = torch.tensor([0, 9, 50, 55, T, T], dtype=torch.int32)  # documents of 9, 41, 5, 9 tokens


def batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, CFG.vocab_size, (T,), generator=g, dtype=torch.int32),
            torch.randint(0, CFG.vocab_size, (T,), generator=g))


def forward(W, training=False, mtp=(1.0,), windows=(16, 32), yarn_transitions=((16, 32),), **kw):
    inputs, targets = batch()
    y, yp = ref.ref_yarns(CFG, T, yarn_transitions)
    return ref.ref_forward(W, CFG, inputs, targets, CU, *windows, y, yp, mtp, training, **kw)


# ----------------------------------------------------------------------------------------------
# Bigram hash and sign index


def test_bigram_hash_hand_values():
    ids = torch.tensor([5, 7, 11, 50256, 3], dtype=torch.int32)
    m = 2047  # bigram vocab 2048: no int32 overflow
    by_hand = [m, (36313 * 7 ^ 27191 * m) % m, (36313 * 11 ^ 27191 * 7) % m,
               (36313 * 50256 ^ 27191 * 11) % m, (36313 * 3 ^ 27191 * 50256) % m]
    assert ref.ref_bigram_hash(ids, 2048).tolist() == by_hand == [2047, 1928, 114, 413, 1117]
    # record size: position 1 multiplies the reserved index 754559 by 27191, which wraps in int32
    wrapped = 27191 * 754559 - 5 * 2 ** 32
    assert wrapped == -957622711
    assert ref.ref_bigram_hash(ids, 754560).tolist() == [
        754559, (36313 * 7 ^ wrapped) % 754559, 327634, 188927, 732365]
    assert ref.ref_bigram_hash(ids, 754560)[1] == 429744
    # position 1 pairs with the reserved index, not with token 0
    assert ref.ref_bigram_hash(torch.tensor([1, 7], dtype=torch.int32), 2048)[1] == \
        ref.ref_bigram_hash(torch.tensor([9, 7], dtype=torch.int32), 2048)[1]


def test_sign_index():
    ids = torch.tensor([3, 5, 70, 70], dtype=torch.int32)
    assert ref.ref_sign_index(ids, 64).tolist() == [0, 3 ^ 5, (5 ^ 70) % 64, 0]


# ----------------------------------------------------------------------------------------------
# Rotary tables and YaRN


def test_paired_rotary_tables_hold_positions_2t_and_2t_plus_1():
    hd = 16
    for transitions in ((), ((384, 896), (896, 1408))):
        plain, paired = ref.ref_yarns(CFG, 40, transitions)
        for t in (0, 1, 7, 19):
            for table in ("factor1", "factor2"):
                row = getattr(paired, table)[t]
                assert torch.equal(row[:hd], getattr(plain, table)[2 * t])
                assert torch.equal(row[hd:], getattr(plain, table)[2 * t + 1])
        assert paired.attn_scale == plain.attn_scale
    # half-truncated: the last half of every head is stationary; sin negated on odd entries
    y = ref.RefYarn(hd, 8)
    assert torch.all(y.factor1[:, hd // 2:] == 1) and torch.all(y.factor2[:, hd // 2:] == 0)
    assert torch.all(y.factor2[3, 1:hd // 2:2] <= 0) and torch.all(y.factor2[3, 0:hd // 2:2] >= 0)
    assert torch.equal(y.factor1, y.factor1.to(torch.bfloat16).to(F64))  # bf16 tables


def test_yarn_transitions():
    y = ref.RefYarn(128, 8)
    before = y.angular_freq.clone()
    for old, new in ((384, 896), (896, 1408), (1408, 1664)):  # the record's, in tokens
        y.apply(old, new)
    assert y.attn_scale == 0.1317779884389435  # matched the reference exactly
    assert int((before > 0).sum()) == 64 and torch.all(y.angular_freq[64:] == 0)  # half truncated
    scaled = y.angular_freq[:64] / before[:64]
    assert scaled[0] == 1  # fast pairs (many rotations over the window) are kept
    assert abs(scaled[62].item() - 384 / 1664) < 1e-6  # slow pairs take the full old/new ratio


# ----------------------------------------------------------------------------------------------
# Attention, loss


def test_window_is_inclusive_and_stays_in_documents():
    docs = ref.doc_ids(CU, T)
    assert docs.tolist()[:10] == [0] * 9 + [1] and docs[-1] == 3
    n = T
    q = torch.zeros(n, 1, 4, dtype=F64)
    v = torch.eye(n, dtype=F64)[:, None, :]  # value = one-hot position: output = attention weights
    w = 5
    y = ref.varlen_attention(q, q, v, docs, w, 1.0)[:, 0]
    for t in (0, 8, 9, 15, 30, 44, 63):
        start = int(CU[docs[t]])
        expected = set(range(max(start, t - w), t + 1))
        assert set(torch.nonzero(y[t]).flatten().tolist()) == expected, t


def test_mtp_loss_with_one_weight_is_summed_cross_entropy():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(T, 50, generator=g, dtype=F64) * 3
    targets = torch.randint(0, 50, (T,), generator=g)
    ce = torch.nn.functional.cross_entropy(z, targets, reduction="sum")
    assert torch.allclose(ref.mtp_loss(z, targets, [1.0, 0.0, 0.0]), ce, rtol=1e-14)
    # the second weight adds row t's loss on target t+1, for every row but the last
    lse = torch.logsumexp(z, -1)
    second = sum(lse[t] - z[t, targets[t + 1]] for t in range(T - 1))
    assert torch.allclose(ref.mtp_loss(z, targets, [1.0, 0.5]), ce + 0.5 * second, rtol=1e-14)


def test_training_loss_with_one_weight_is_T_times_the_eval_loss():
    W = ref.ref_random_weights(CFG, 0)
    train, logits_t, _ = forward(W, training=True, mtp=(1.0,))
    val, logits_v, _ = forward(W, training=False)
    assert torch.equal(logits_t, logits_v)
    assert abs(train.item() - T * val.item()) < 1e-12 * train.item()
    three = forward(W, training=True, mtp=(1.0, 0.5, 0.25))[0]
    assert three.item() > 1.5 * train.item()


def test_port_reproduces_the_reference_losses_at_this_configuration():
    """The reference script's own GPT.forward (float64, its rms_norm then using float64's eps, the
    eval cross-entropy in float64) gave these losses for these weights and this batch."""
    W = ref.ref_random_weights(CFG, 0)
    cfg64 = dataclasses.replace(CFG, norm_eps=float(torch.finfo(F64).eps))
    inputs, targets = batch()
    for training, mtp, reference in ((False, (1.0,), 7.485408269117108), (True, (1.0, 0.5, 0.25), 826.2577777194203)):
        y, yp = ref.ref_yarns(cfg64, T, ((16, 32),))
        loss = ref.ref_forward(W, cfg64, inputs, targets, CU, 16, 32, y, yp, mtp, training)[0].item()
        assert abs(loss - reference) <= 1e-12 * reference, (training, loss)


# ----------------------------------------------------------------------------------------------
# Every idea of the model matters at these sizes; the parameters the forward never reads do not


def _edit(W, name, index, value):
    W = {k: v.clone() for k, v in W.items()}
    W[name][index] = value
    return W


L = ref.NUM_LAYERS
IDEAS = {  # name -> (parameter, index, new value)
    "bigram embedding": ("bigram_embed.weight", slice(None), 0.0),
    "bigram sign trick": ("bigram_sign_table", slice(None), 1.0),
    "bigram lambda before layer 0": ("bigram_lambdas", 0, 0.0),
    "bigram lambda layer 5": ("bigram_lambdas", 5, 0.0),
    "x0 lambda layer 0": ("x0_lambdas", 0, 0.0),
    "x0 lambda layer 8": ("x0_lambdas", 8, 0.0),
    "smear lambda": ("scalars", 2 * L, 0.0),
    "smear gate": ("smear_gate.weight", slice(None), 0.0),
    "skip lambda": ("scalars", 2 * L + 1, -30.0),
    "skip gate": ("skip_gate.weight", slice(None), 0.0),
    "attention lambda q/k/v layer 4": ("scalars", 8, 0.3),
    "attention lambda o layer 9 (paired)": ("scalars", 19, 0.3),
    "residual lambda attention layer 2": ("resid_lambdas", (2, 0), 0.5),
    "post lambda mlp layer 6": ("post_lambdas", (6, 1), 0.0),
    "xsa layer 1": ("xsa_alphas", 1, 0.0),
    "xsa layer 10": ("xsa_alphas", 10, 0.0),
    "attention gate layer 7 (bank row 6)": ("attn_gate_bank", 6, 0.0),
    "attention gate layer 0": ("attn_gate_bank", 0, 0.0),
    **{f"value embedding table {k}": ("value_embeds", slice(k * CFG.vocab, (k + 1) * CFG.vocab), 0.0) for k in range(5)},
    **{f"ve gate {k}": ("ve_gate_bank", k, 0.0) for k in range(4)},
    "mudd block 0 weights": ("mudd_w2", 0, 0.0),
    "mudd block 1 weights": ("mudd_w2", (1, slice(0, 5)), 0.0),
    "mudd ve lane 6": ("mudd_b2", (0, 6), 0.0),
    "mudd v source": ("mudd_b2", (0, 0), 5.0),
    "mudd post-loop ve coefficient": ("mudd_b2", (1, 3), 5.0),
    "mudd hidden": ("mudd_w1", 1, 0.0),
    "mlp c_proj layer 3": ("mlp_bank", (3, 1), 0.0),
    "value/output layer 6 (bank matrices 12, 13 = layer 7)": ("vo_bank", slice(12, 14), 0.0),
    "qk head pair layer 5 (paired)": ("qk_bank", 5 * CFG.num_heads, 0.0),
}
UNUSED = {  # read nowhere in the forward (layer 6 has no attention, layer 10 uses MUDD coefficients)
    "ve gate row 4": ("ve_gate_bank", 4, 0.0),
    "x0 lambda layers 6, 10": ("x0_lambdas", [6, 10], 0.0),
    "bigram lambda layers 6, 10": ("bigram_lambdas", [6, 10], 0.0),
    "residual lambdas layer 10, attention layer 6": ("resid_lambdas", ([6, 10, 10], [0, 0, 1]), 0.0),
    "post lambdas layer 10, attention layer 6": ("post_lambdas", ([6, 10, 10], [0, 0, 1]), 0.0),
    "xsa rows of paired layers and layer 6": ("xsa_alphas", [0, 2, 5, 6, 9], 0.0),
    "attention lambdas layer 6": ("scalars", slice(12, 14), 0.0),
    "mudd post-loop rows 5-13": ("mudd_w2", (1, slice(5, None)), 0.0),
    "mlp padding layer 11": ("mlp_bank", 11, 0.0),
    "qk/vo padding matrices": ("qk_bank", slice(CFG.num_qk_groups, None), 0.0),
}


@pytest.fixture(scope="module")
def base():
    W = ref.ref_random_weights(CFG, 0)
    return W, forward(W)[1]


@pytest.mark.slow
def test_each_idea_changes_the_logits(base):
    W, logits = base
    scale = logits.abs().max().item()
    quiet = {}
    for idea, (name, index, value) in IDEAS.items():
        change = (forward(_edit(W, name, index, value))[1] - logits).abs().max().item() / scale
        if change < 1e-3:
            quiet[idea] = change
    assert not quiet, quiet


@pytest.mark.slow
def test_unused_parameters_do_not_change_the_logits(base):
    W, logits = base
    for idea, (name, index, value) in UNUSED.items():
        assert torch.equal(forward(_edit(W, name, index, value))[1], logits), idea


@pytest.mark.slow
def test_lambdas_are_rounded_to_bf16():
    W = ref.ref_random_weights(CFG, 0)
    logits = forward(W)[1]
    for name in ("resid_lambdas", "post_lambdas", "x0_lambdas", "bigram_lambdas"):
        nudged = {k: v.clone() for k, v in W.items()}
        nudged[name] = ref.round_bf16(W[name]) * (1 + 1e-6)  # far inside a bf16 ulp
        assert torch.equal(forward(nudged)[1], logits), name
    nudged = _edit(W, "scalars", slice(None), W["scalars"] * (1 + 1e-6))  # scalars are not rounded
    assert not torch.equal(forward(nudged)[1], logits)


@pytest.mark.slow
def test_stage_windows_and_yarn_change_the_logits():
    W = ref.ref_random_weights(CFG, 0)
    a = forward(W, windows=(16, 32))[1]
    wide = forward(W, windows=(16, 40))[1]  # the 41-token document's last query sees it all
    assert not torch.equal(a, wide)  # long window: layers 3, 10
    assert torch.equal(wide, forward(W, windows=(16, 41))[1])  # inclusive: 40 already reaches back 40
    assert not torch.equal(a, forward(W, windows=(8, 32))[1])
    assert not torch.equal(a, forward(W, windows=(40, 32))[1])  # paired layers: doubled rows
    assert not torch.equal(a, forward(W, yarn_transitions=())[1])


# ----------------------------------------------------------------------------------------------
# Schedules (values confirmed against the reference's own classes for every step)


def test_schedule_stage_boundaries_and_steps():
    assert ref.REF_STAGE_ENDS == (0, 460, 920, 1380, 1390)
    assert ref.REF_SPLIT_STEP == 921
    assert ref.REF_WARMUP_STEPS == (0, 1, 458, 459, 460, 461, 918, 919, 920, 921, 1378, 1379, 1380, 1381)
    rows = [ref.ref_schedule(s) for s in range(ref.REF_TOTAL + 1)]
    assert [r["step"] for r in rows if r["yarn_transition"]] == [460, 920, 1380]
    assert [r["yarn_transition"] for r in rows if r["yarn_transition"]] == [(384, 896), (896, 1408), (1408, 1664)]
    assert [r["step"] for r in rows if r["loader_send"]] == [460, 920]
    assert [r["step"] for r in rows if r["val_step"]] == [0, 250, 500, 750, 1000, 1250, 1390]
    assert rows[1390]["val_ws"] == (6, 20) and (rows[1390]["ws_short"], rows[1390]["ws_long"]) == (6, 13)
    assert [(r["ws_short"], r["ws_long"], r["batch_size"], r["train_max_seq_len"]) for r in (rows[459], rows[460], rows[920], rows[1380])] == [
        (1, 3, 131072, 896), (3, 7, 262144, 2048), (5, 11, 393216, 2048), (6, 13, 393216, 2048)]
    assert sum(r["adam_step"] for r in rows[:922]) == 461  # Adam steps up to the split: t = 461


def test_schedule_lr_momentum_and_mtp_spot_values():
    s = ref.ref_schedule
    assert [s(k)["lr"] for k in (0, 459, 460, 551, 552)] == [1.0, 1.0, 1.52, 1.52, 1.52]
    assert s(553)["lr"] == 1.5183454106280194
    assert s(919)["lr"] == 0.9127657004830918 and s(920)["lr"] == 1.027777777777778  # jumps up at stage 2
    assert [s(k)["lr"] for k in (1380, 1389, 1390)] == [0.15, 0.15, 0.15]
    assert s(1379)["lr"] == 0.15190821256038647
    assert [s(k)["muon_momentum"] for k in (0, 300, 1340, 1390)] == [0.85, 0.95, 0.95, 0.85]
    assert s(299)["muon_momentum"] == 0.9496666666666667 and s(1341)["muon_momentum"] == 0.948
    assert s(0)["mtp_weights"] == (1.0, 0.5, 0.25)
    assert s(299)["mtp_weights"] == (1.0, 0.5, 0.08749999850988388)  # fp32 rounded
    assert s(459)["mtp_weights"] == (1.0, 0.5, 0.0005434782360680401)
    assert s(552)["mtp_weights"] == (1.0, 0.4000000059604645)
    assert s(920)["mtp_weights"] == (1.0,) == s(1390)["mtp_weights"]


# ----------------------------------------------------------------------------------------------
# Parameters and initialization


def test_record_parameter_count_from_shapes():
    cfg = ref.RefConfig()
    assert cfg.vocab == 50304
    shapes = ref.ref_param_shapes(cfg)
    assert shapes["qk_bank"] == (64, 256, 768) and shapes["vo_bank"] == (24, 768, 768)
    assert shapes["scalars"] == (24,) and shapes["bigram_embed.weight"] == (754560, 192)
    on_meta = sum(torch.empty(s, device="meta").numel() for s in shapes.values())
    assert on_meta == ref.ref_param_count(cfg) == 498_773_000  # the reference model's count


def test_initial_weights():
    W = ref.ref_initial_weights(CFG, 0)
    assert torch.equal(W["embed.weight"], W["lm_head.weight"].T)
    assert W["lm_head.weight"].std().item() == pytest.approx(0.005, rel=0.05)
    assert torch.all(W["resid_lambdas"] == torch.tensor(1.1 ** 0.5, dtype=torch.float32).item())
    assert torch.all(W["bigram_lambdas"] == torch.tensor(0.05, dtype=torch.float32).item())
    assert W["mudd_b2"][0, 8] == 10.5 and W["mudd_b2"][0, 6] == 20.0 and W["mudd_b2"][1, 1] == -5.0  # bf16
    assert W["scalars"][:4].tolist() == [0.5, 1.0, 0.5, 1.0] and W["scalars"][22:].tolist() == [0.0, -1.5]
    assert torch.all(W["mlp_bank"][:, 1] == 0) and torch.all(W["mlp_bank"][:, 0] != 0)
    assert torch.all(W["qk_bank"][CFG.num_qk_groups:] == 0) and torch.all(W["vo_bank"][CFG.num_vo:] == 0)
    bound = 3 ** 0.5 * 0.5 / 8 * (1 + 2 ** -8)  # bf16 rounding may step past the bound
    assert W["vo_bank"][: CFG.num_vo].abs().max() <= bound
    assert W["mudd_w1"].abs().max() <= 1 / 8 and torch.all(W["mudd_w2"] == 0)
    for name in ("attn_gate_bank", "ve_gate_bank", "smear_gate.weight", "skip_gate.weight", "bigram_embed.weight",
                 "x0_lambdas", "xsa_alphas"):
        assert torch.all(W[name] == 0), name
    assert set(W["bigram_sign_table"].unique().tolist()) == {-1.0, 1.0}
    loss, _, capped = forward(W)
    # nearly uniform at init: the softcapped logits z stay close to their row means, so the loss is ln V plus
    # its second-order term in d = z - mean(z) (per row: mean(d^2) / 2 - d[target]), up to the third-order term
    d = capped.double() - capped.double().mean(-1, keepdim=True)
    _, targets = batch()
    second = (d.square().mean(-1) / 2 - d.gather(-1, targets.long().view(-1, 1)).squeeze(-1)).mean().item()
    third = (d.abs().amax(-1) ** 3).mean().item() / 6
    assert d.abs().amax(-1).mean() < 0.5
    assert abs(loss.item() - math.log(CFG.vocab) - second) <= third


# ----------------------------------------------------------------------------------------------
# Optimizers


def test_adam_first_step_by_hand():
    p = torch.tensor([0.5, -0.5, 0.5, 2.0], dtype=F64)
    g = torch.tensor([1e-3, 1e-3, -2e-3, 0.0], dtype=F64)
    lr = 0.008 * 1.52 * 75.0  # value_embeds (betas 0.75, 0.95; wd_mul 5) at a stage-1 lr
    new = ref.ref_adam_step(p, g, {}, "value_embeds", 1.52)
    # t = 1: m = 0.25 g, v = 0.05 g^2; step size lr sqrt(0.05) / 0.25 and decay lr^2 0.005 * 5, as fp32
    step_size = torch.tensor(lr * 0.05 ** 0.5 / 0.25, dtype=torch.float32).item()
    decay = torch.tensor(lr * lr * 0.005 * 5.0, dtype=torch.float32).item()
    update = 0.25 * g / (0.05 ** 0.5 * g.abs() + 1e-10) * step_size
    assert new[0].item() == pytest.approx(0.5 - update[0].item() - decay * 0.5, rel=1e-12)
    assert new[1].item() == pytest.approx(-0.5 - update[1].item(), rel=1e-12)  # signs disagree: no decay
    assert new[2].item() == pytest.approx(0.5 - update[2].item(), rel=1e-12)
    assert new[3].item() == 2.0  # zero update: no decay (strict > 0)


def test_normuon_pieces():
    g = torch.Generator().manual_seed(0)
    for shape in ((3, 64, 16), (3, 16, 64), (2, 32, 32)):
        X = ref.ref_polar_express(torch.randn(shape, generator=g, dtype=F64))
        s = torch.linalg.svdvals(X)
        assert s.min() > 0.6 and s.max() < 1.25, shape
        v, second = ref.ref_variance_reduction(X, torch.zeros(1, dtype=F64), 0.9)
        assert torch.allclose(v.norm(dim=(-2, -1)), X.norm(dim=(-2, -1)), rtol=1e-12)
        assert second.shape == ((*shape[:-1], 1) if shape[-2] >= shape[-1] else (*shape[:-2], 1, shape[-1]))
    assert ref.ref_normuon_lr_muls("mlp_bank", (24, 3072, 768))[:4] == [2.0, 4.0, 2.0, 4.0]
    assert ref.ref_normuon_lr_muls("qk_bank", (64, 256, 768)) == [1.0] * 64
    assert ref.ref_normuon_shape("mlp_bank", (12, 2, 3072, 768)) == (24, 3072, 768)


def test_mantissa_update_truncates_an_fp32_master_weight():
    w32 = torch.tensor([1.0 + 2 ** -8 + 2 ** -12, -0.75, 0.3, 0.3], dtype=torch.float32)
    bits = w32.view(torch.int32)
    p = ((bits >> 16) & 0xFFFF).to(torch.int16).view(torch.bfloat16)
    mant = bits & 0xFFFF
    assert p[0].item() == 1.0 and w32[0].to(torch.bfloat16).item() == 1.0 + 2 ** -7  # truncated, not rounded
    v = torch.tensor([0.0, 1.0, -1.0, 1.0])
    new_p, new_m = ref.ref_mantissa_update(p, mant, v, 0.5, 0.25)
    master = (((new_p.view(torch.int16).to(torch.int32) & 0xFFFF) << 16) | new_m).view(torch.float32)
    expected = w32 - w32 * (v * w32 >= 0).float() * 0.5 * 0.25 - v * 0.25  # v = 0 decays (>= 0)
    assert torch.equal(master, expected)


def test_normuon_step_mantissa_and_float64_agree():
    g = torch.Generator().manual_seed(1)
    p = (torch.rand(12, 2, 32, 8, generator=g, dtype=F64) - 0.5).to(torch.bfloat16).to(F64)
    grad = torch.randn(p.shape, generator=g, dtype=F64)
    a, b = {}, {}
    new64 = ref.ref_normuon_step(p, grad, a, "mlp_bank", 1.0, 0.9)
    new_m = ref.ref_normuon_step(p, grad, b, "mlp_bank", 1.0, 0.9, mantissa=True)
    step = (new64 - p).abs().max()
    assert (new_m - new64).abs().max() <= 2 ** -7 * p.abs().max() and step > 1e-3
    # c_proj (odd matrices) moves twice as far
    moved = (new64 - p).reshape(24, -1).abs().mean(1)
    assert moved[1::2].mean() > 1.7 * moved[0::2].mean()


# ----------------------------------------------------------------------------------------------
# FP8


def _bank(seed, zero_proj=False):
    g = torch.Generator().manual_seed(seed)
    b = (torch.rand(12, 2, 32, 16, generator=g, dtype=F64) - 0.5) * 0.4
    if zero_proj:
        b[:, 1] = 0
    return b.to(torch.bfloat16)


@pytest.mark.slow
def test_fp8_scales_bootstrap_then_delayed():
    banks = [_bank(0, zero_proj=True)] + [_bank(s + 1) for s in range(19)]
    g = torch.Generator().manual_seed(5)
    xs = [[ref.rms_norm(torch.randn(16, 16, generator=g, dtype=F64), 0.0) for _ in range(11)] for _ in range(19)]
    steps = ref.ref_fp8_mlp_sequence(banks, xs)
    amax = lambda b: b[:, 1].reshape(12, -1).abs().amax(1)
    assert torch.all(steps[0]["act_scales"] == 1.0)  # no activation scale before the first forward
    for s in (1, 5, 16):  # forwards 1..16 use the current weights' amax / 448 (bf16), no headroom
        assert torch.equal(steps[s]["down_scales"], (amax(banks[s]) / 448).float())
    for s in (17, 18):  # from 17 on: 1.12 x amax of the previous weights
        expected = amax(banks[s - 1]).float() * torch.tensor(1.12 / 448, dtype=torch.float32)
        assert torch.equal(steps[s]["down_scales"], expected)
    up = amax(torch.stack([banks[3][:, 0], banks[3][:, 0]], 1))
    assert torch.equal(steps[3]["up_scales"], (up / 448).float())
    # activation scale of step s: 1.8 x the largest post-ReLU^2 value of step s-1's forward, per layer
    post = torch.relu(xs[2][4] @ banks[2][4, 0].double().T).square().max()
    assert abs(steps[3]["act_scales"][4].item() / (1.8 * post.item() / 448) - 1) < 0.15  # fp8 inputs


def test_fp8_activation_scaling_and_clamp():
    g = torch.Generator().manual_seed(0)
    bank = ((torch.rand(12, 2, 128, 32, generator=g, dtype=F64) - 0.5) * 0.01).to(torch.bfloat16)
    x = ref.rms_norm(torch.randn(32, 32, generator=g, dtype=F64), 0.0)
    err = lambda out, b: ((out - ref.relu2_mlp(x, b[0, 0].double(), b[0, 1].double())).norm()
                          / ref.relu2_mlp(x, b[0, 0].double(), b[0, 1].double()).norm()).item()
    state = ref.RefFP8MLP()
    state.quantize(bank, bootstrap_down=True)
    first = err(state.mlp(0, x), bank)  # activation scale 1.0: tiny post-ReLU^2 values lose their bits
    state.end_forward()
    second = err(state.mlp(0, x), bank)  # scale from the first forward: fp8's usual few percent
    state.end_forward()
    assert second < 0.08 and first > 2 * second, (first, second)
    bigger = bank.clone()
    bigger[:, 0] *= 2  # activations x4: above 1.8 x the previous amax, clamped at 448
    state.quantize(bigger, bootstrap_down=True)
    clamped = err(state.mlp(0, x), bigger)
    state.end_forward()
    assert clamped > 2 * second and err(state.mlp(0, x), bigger) < 0.08


@pytest.mark.slow
def test_fp8_forward_and_head_stay_near_float64():
    W = ref.ref_random_weights(CFG, 0)
    state = ref.RefFP8MLP()
    state.quantize(W["mlp_bank"].to(torch.bfloat16), bootstrap_down=True)
    exact = forward(W, training=True)
    err = lambda out: ((out[1] - exact[1]).norm() / exact[1].norm()).item()
    forward(W, training=True, mlp_fp8=state)  # sets the activation scales
    assert 1e-3 < err(forward(W, training=True, mlp_fp8=state)) < 0.2
    assert len(state.log) == 22 and state.log[11]["act_scale"] != 1.0
    assert 1e-3 < err(forward(W, training=True, fp8_head=True)) < 0.1
