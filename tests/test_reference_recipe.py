"""The 2025-12-19 RetieLMHead recipe (modded-nanogpt record 2025-12-19_RetieLMHead) as frozen in the
snapshot of records/track_cpu/2026-11-29_ReferenceFidelity/ (the script its logs start with; the live
train_gpt.py holds only the current recipe): its record preset computes the reference recipe's
function, checked against plain re-implementations written here from the reference script,
independently of the trainer:

- the schedules (lr multiplier, batch size, windows, momentum) at every step 0..2034, compared
  exactly (the reference's float expressions give bit-identical values);
- the attention windows in tokens per stage and at the final validation;
- one and two DistAdam steps against the reference's update formula (head and value-embedding
  groups, record multipliers);
- the whole forward pass against a float64 port of the reference's forward (naive attention with
  FlashAttention's inclusive windows, the smear gate and key shift across document starts, the U-net
  skip added before the residual scaling, bf16 rotary tables, YaRN), with every weight random, at
  every stage's windows; variants of the port with the old behaviours show the test can tell them apart.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from frozen_scripts import REPO, load_record_script

RECORD_LOG = REPO / "records/track_cpu/2026-11-29_ReferenceFidelity/02b30626-776f-47d3-a45a-3c3ca3310156.txt"
tg = load_record_script(RECORD_LOG, "frozen_reference_fidelity")  # the script the record ran

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

# ----------------------------------------------------------------------------------------------
# Schedules: the reference's functions, re-implemented with its constants

N_SCHEDULED, N_EXTENSION, COOLDOWN = 1995, 40, 0.55
N_TOTAL = N_SCHEDULED + N_EXTENSION
BS_SCHEDULE, BS_EXTENSION = (8 * 2048 * 8, 16 * 2048 * 8, 24 * 2048 * 8), 24 * 2048 * 8
WS_SCHEDULE, WS_FINAL, WS_VALIDATE_POST_YARN = (3, 7, 11), 13, 20


def ref_get_lr(step):
    if step > N_SCHEDULED:
        return 0.1
    lr_max = 1.0
    x = step / N_SCHEDULED
    if x > 1 / 3:
        lr_max = 1.51
    if x > 2 / 3:
        lr_max = 1.93
    if x >= 1 - COOLDOWN:
        w = (1 - x) / COOLDOWN
        return lr_max * w + (1 - w) * 0.1
    return lr_max


def ref_get_ws(step):
    if step >= N_SCHEDULED:
        return WS_FINAL // 2, WS_FINAL
    x = step / N_SCHEDULED
    idx = int(len(WS_SCHEDULE) * x)
    return WS_SCHEDULE[idx] // 2, WS_SCHEDULE[idx]


def ref_get_bs(step):
    if step >= N_SCHEDULED:
        return BS_EXTENSION
    x = step / N_SCHEDULED
    return BS_SCHEDULE[int(len(BS_SCHEDULE) * x)]


def ref_get_momentum(step, warmup=300, cooldown=50, low=0.85, high=0.95):
    cd_start = N_TOTAL - cooldown
    if step < warmup:
        frac = step / warmup
        return low + frac * (high - low)
    if step > cd_start:
        frac = (step - cd_start) / cooldown
        return high - frac * (high - low)
    return high


def test_record_schedules_match_the_reference_at_every_step():
    hp = tg.parse_args([])
    assert hp.num_scheduled_iterations + hp.num_extension_iterations == N_TOTAL
    mismatches = []
    for step in range(N_TOTAL):
        ours = (tg.lr_multiplier_at(step, hp), tg.batch_size_at(step, hp), tg.window_blocks_at(step, hp),
                tg.muon_momentum_at(step, hp))
        ref = (ref_get_lr(step), ref_get_bs(step), ref_get_ws(step), ref_get_momentum(step))
        if ours != ref:  # exact: the same float expressions in the same order
            mismatches.append((step, ours, ref))
    assert not mismatches, mismatches[:5]
    # the lr multiplier switches one step after the batch size (progress strictly past 1/3, 2/3)
    assert tg.batch_size_at(665, hp) == 262144 and tg.lr_multiplier_at(665, hp) == 1.0
    assert tg.lr_multiplier_at(666, hp) == 1.51
    assert tg.batch_size_at(1330, hp) == 393216 and tg.lr_multiplier_at(1330, hp) == pytest.approx(0.1 + 1.41 * 20 / 33)


def test_the_reference_schedules_tell_the_old_rules_apart():
    """Positive control for the comparison above: the rules this project used before differ."""
    old_lr_665 = 1.51  # stage multiplier from the batch-size stage
    old_short_tokens_stage0 = 3 * 128 // 2  # half the long window in tokens: 192
    assert ref_get_lr(665) != old_lr_665
    assert ref_get_ws(0)[0] * 128 != old_short_tokens_stage0


WINDOW_TOKENS = [  # (stage first step, short tokens, long tokens): 1, 3, 5, 6 blocks short
    (0, 128, 384), (665, 384, 896), (1330, 640, 1408), (1995, 768, 1664)]


@pytest.mark.parametrize("step,short,long", WINDOW_TOKENS)
def test_window_tokens_per_stage(step, short, long):
    hp = tg.parse_args([])
    blocks = tg.window_blocks_at(step, hp)
    assert (blocks[0] * hp.window_block_tokens, blocks[1] * hp.window_block_tokens) == (short, long)
    assert blocks == ref_get_ws(step)


def test_final_validation_windows():
    """Only the long window widens (20 blocks); the short one stays at the extension's 6 blocks."""
    hp = tg.parse_args([])
    short, long = tg.final_window_blocks(hp)
    assert (short * 128, long * 128) == (768, 2560)
    assert (short, long) == (ref_get_ws(N_TOTAL)[0], WS_VALIDATE_POST_YARN)


# ----------------------------------------------------------------------------------------------
# DistAdam: one and two steps against the reference update formula


def ref_adam_steps(p, grads, lr, lr_mul, wd_mul, betas=(0.65, 0.95), eps=1e-8, wd=0.005):
    """The reference's update in float64: moments kept in bf16 between steps (the reference's state
    dtype), eps added to the uncorrected sqrt(v), both bias corrections in the step size, cautious
    decay with factor eff_lr^2 * wd * wd_mul (eff_lr = lr * lr_mul)."""
    p = p.double().clone()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    b1, b2 = betas
    eff_lr = lr * lr_mul
    for t, g in enumerate(grads, start=1):
        g = g.double()
        m_new = b1 * m + (1 - b1) * g
        v_new = b2 * v + (1 - b2) * g * g
        m, v = m_new.to(torch.bfloat16).double(), v_new.to(torch.bfloat16).double()  # stored state
        update = m_new / (v_new.sqrt() + eps) * (eff_lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t))
        mask = (update * p >= 0).double()
        update = update + (eff_lr * wd * wd_mul * eff_lr) * mask * p
        p = p - update
    return p


@pytest.mark.parametrize("label,lr_mul", [("lm_head", 1.0), ("value_embed", 75.0)])
@pytest.mark.parametrize("steps", [1, 2])
def test_distadam_step_matches_reference_formula(label, lr_mul, steps):
    gen = torch.Generator().manual_seed(11)
    p = tg.tag(torch.nn.Parameter(torch.randn(64, 16, generator=gen) * 0.5), label, lr_mul=lr_mul)
    grads = [torch.randn(64, 16, generator=gen) * 0.01 for _ in range(steps)]
    grads[0][:4] *= 1e-7  # rows where eps dominates sqrt(v): its placement matters there
    lr = 0.008 * 1.51  # record lr at a stage-1 multiplier
    initial = p.detach().clone()
    expected = ref_adam_steps(initial, grads, lr, lr_mul, wd_mul=1.0)
    adam = tg.DistAdam([p], lr, (0.65, 0.95), 1e-8, 0.005)
    for g in grads:
        p.grad = g.clone()
        adam.step()
    err = (expected - p.detach().double()).abs().max().item()
    # Error model: fp32 arithmetic against float64, a few roundings of |p| (<= 2.5) and of the
    # update (<= step size) per step: 4 steps x 2^-24 relative, doubled.
    step_size = lr * lr_mul
    tolerance = steps * 8 * 2 ** -24 * (expected.abs().max().item() + step_size)
    print(f"{label} {steps} step(s): max error {err:.2e} (tolerance {tolerance:.2e})")
    assert err <= tolerance, (err, tolerance)
    # positive control: the former decay factor (one lr_mul short: lr * eff_lr * wd) is far outside it
    if label == "value_embed":
        one_lr_mul_short = ref_adam_steps(initial, grads, lr, lr_mul, wd_mul=1.0 / lr_mul)
        assert (one_lr_mul_short - expected).abs().max().item() > 100 * tolerance


# ----------------------------------------------------------------------------------------------
# The forward pass against a float64 port of the reference's forward

BLOCK = 16  # window block tokens for the test (the record uses 128): windows 48..320 tokens
VOCAB, DIM, HEADS, HEAD_DIM, LAYERS = 512, 64, 2, 32, 11  # 11 layers: the reference's fixed layout


def rms(x):
    """F.rms_norm without eps uses the input dtype's eps; the model under test runs in fp32."""
    return x / x.square().mean(-1, keepdim=True).add(torch.finfo(torch.float32).eps).sqrt()


class RefYarn:
    """The reference's rotary state: fp32 frequencies, bf16 cos/sin tables, a Python-float scale."""

    def __init__(self, head_dim):
        self.head_dim = head_dim
        self.reset()

    def reset(self):
        freq = (1 / 1024) ** torch.linspace(0, 1, steps=self.head_dim // 4, dtype=torch.float32)
        self.freq = torch.cat([freq, freq.new_zeros(self.head_dim // 4)])
        self.attn_scale = 0.1

    def apply(self, old_window, new_window):  # in blocks
        rotations = BLOCK * old_window * self.freq / (2 * torch.pi)
        scaling = old_window / new_window
        interp = torch.clamp((rotations - 1) / (32 - 1), 0, 1)
        self.freq *= scaling + interp * (1 - scaling)
        self.attn_scale *= 0.2 * math.log(new_window / old_window) + 1

    def tables(self, T):
        theta = torch.outer(torch.arange(T, dtype=torch.float32), self.freq)
        return theta.cos().to(torch.bfloat16).double(), theta.sin().to(torch.bfloat16).double()


def ref_rotary(x, cos, sin):
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos + x2 * sin, x1 * (-sin) + x2 * cos), -1)


def ref_attention(x, w, gate_w, lambdas, ve, docs, window, key_shift, yarn, variant):
    T = x.size(0)
    q, k, v = F.linear(x, lambdas[0] * w[: 3 * DIM]).view(T, 3 * HEADS, HEAD_DIM).chunk(3, dim=-2)
    q, k = rms(q), rms(k)
    cos, sin = yarn.tables(T)
    q, k = ref_rotary(q, cos, sin), ref_rotary(k, cos, sin)
    if key_shift:
        d = HEAD_DIM
        shifted = k.clone()
        shifted[1:, :, d // 4: d // 2] = k[:-1, :, d // 4: d // 2]
        shifted[1:, :, d // 4 + d // 2:] = k[:-1, :, d // 4 + d // 2:]
        if variant == "masked_boundaries":  # the old behaviour: no shift at a document start
            starts = torch.cat([torch.tensor([True]), docs[1:] != docs[:-1]])
            shifted[starts] = k[starts]
        k = shifted
    if ve is not None:
        v = v + ve.view_as(v)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    reach = (i - j < window) if variant == "exclusive_window" else (i - j <= window)  # FA3 window_size=(w, 0)
    allowed = (j <= i) & reach & (docs[:, None] == docs[None, :])
    scores = torch.einsum("thd,shd->hts", q, k) * yarn.attn_scale
    y = torch.einsum("hts,shd->thd", scores.masked_fill(~allowed, -math.inf).softmax(-1), v)
    y = y * torch.sigmoid(F.linear(x[:, :12], gate_w)).view(T, HEADS, 1)
    return F.linear(y.reshape(T, DIM), lambdas[1] * w[3 * DIM:])


def ref_forward(W, inputs, targets, cu, ws_short, ws_long, yarn, training=False, variant=None):
    """The reference's GPT.forward for 11 layers, in float64. W: float64 weights by our names."""
    T, L = inputs.numel(), LAYERS
    bounds = sorted(set(cu.tolist()))
    docs = torch.bucketize(torch.arange(T), torch.tensor(bounds[1:-1]), right=True)
    s = W["scalars"]
    resid, x0_l, sa = s[:L], s[L: 2 * L], s[2 * L: 4 * L].view(-1, 2)
    smear_l, backout_l, skip_l = s[4 * L], s[4 * L + 1], s[4 * L + 2]
    short_bm = ws_short * BLOCK if variant != "half_token_short" else ws_long * BLOCK // 2
    long_bm = ws_long * BLOCK
    bm_sizes = [short_bm, short_bm, short_bm, long_bm, short_bm, short_bm, None, short_bm, short_bm, short_bm, long_bm]
    x = F.embedding(inputs.long(), W["lm_head.weight"])
    ve_tables = [F.embedding(inputs.long(), W[f"value_embeds.{i}"]) for i in range(3)]
    ve = [ve_tables[1], ve_tables[2]] + [None] * (L - 5) + [ve_tables[0], ve_tables[1], ve_tables[2]]
    gate_out = smear_l * torch.sigmoid(F.linear(x[1:, :12], W["smear_gate_w"]))
    if variant == "masked_boundaries":
        gate_out = gate_out * (docs[1:] == docs[:-1]).double()[:, None]
    x = torch.cat([x[:1], x[1:] + gate_out * x[:-1]])
    x = x0 = rms(x)
    skips, x_backout = [], None
    for i in range(L):
        if i == 6 and variant != "skip_after_scaling":
            x = x + torch.sigmoid(skip_l) * skips.pop()
        x = (resid[0] + x0_l[0]) * x if i == 0 else resid[i] * x + x0_l[i] * x0
        if i == 6 and variant == "skip_after_scaling":  # the old order
            x = x + torch.sigmoid(skip_l) * skips.pop()
        if bm_sizes[i] is not None:
            prefix = f"blocks.{i}.attn."
            x = x + ref_attention(rms(x), W[prefix + "qkvo_w"], W[prefix + "gate_w"], sa[i], ve[i], docs,
                                  bm_sizes[i], bm_sizes[i] == long_bm, yarn, variant)
        h = F.relu(F.linear(rms(x), W[f"blocks.{i}.mlp.fc_w"])).square()
        x = x + F.linear(h, W[f"blocks.{i}.mlp.proj_w"].T)
        if i == 3:
            skips.append(x)
        if i == 7:
            x_backout = x
    x = rms(x - backout_l * x_backout)
    logits = F.linear(x, W["lm_head.weight"])
    loss = F.cross_entropy(30 * torch.sigmoid(logits / 7.5), targets.long(), reduction="sum" if training else "mean")
    return loss, logits


def randomized_model(seed=0):
    """Our model with every weight random and non-zero (zero-initialized O, MLP projections, value
    embeddings, gates and the smear/x0 lambdas would hide most of what is compared)."""
    torch.manual_seed(seed)
    model = tg.use_cpu_fallbacks(tg.GPT(VOCAB, LAYERS, HEADS, HEAD_DIM, DIM, window_block_tokens=BLOCK))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("qkvo_w") or name.endswith("fc_w") or name.endswith("proj_w"):
                p.uniform_(-0.5 / math.sqrt(DIM) * math.sqrt(3), 0.5 / math.sqrt(DIM) * math.sqrt(3), generator=g)
            elif "value_embeds" in name or name == "lm_head.weight":
                p.normal_(0, 0.5 if "value" in name else 0.3, generator=g)
            elif name.endswith("gate_w"):
                p.normal_(0, 0.5, generator=g)
        L, s = LAYERS, model.scalars
        s[:L].uniform_(0.5, 1.5, generator=g)  # resid lambdas
        s[6] = 0.3  # far from 1 where the skip lands: the order of skip and scaling changes x by 0.7 x skip
        s[L: 2 * L].uniform_(0.1, 0.5, generator=g)  # x0 lambdas
        s[2 * L: 4 * L].uniform_(0.5, 1.5, generator=g)  # attention lambdas
        s[4 * L], s[4 * L + 1], s[4 * L + 2] = 0.6, 0.3, 0.4  # smear, backout, skip
    return model


def packed_batch(seed=0, T=512):
    """Four documents, two longer than the widest stage window, so every window limit binds."""
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, VOCAB, (T,), generator=g, dtype=torch.int32)
    targets = torch.randint(0, VOCAB, (T,), generator=g)
    cu = torch.tensor([0, 37, 220, 231, T, T, T], dtype=torch.int32)  # docs of 37, 183, 11, 281 tokens
    return inputs, targets, cu


def stage_windows():
    """[(label, (short, long) blocks, YaRN transition before it)] of the record schedule, in order."""
    hp = tg.parse_args([])
    stages, previous = [], None
    for step in tg.stage_first_steps(hp):
        blocks = tg.window_blocks_at(step, hp)
        stages.append((f"stage@{step}", blocks, None if previous is None else (previous[1], blocks[1])))
        previous = blocks
    stages.append(("final validation", tg.final_window_blocks(hp), None))
    return stages


def compare_all_stages(model, monkeypatch, variant=None, training=False):
    """[(label, our loss, reference loss, relative max difference of the logits)] at every stage's
    windows, YaRN advanced as in a run."""
    inputs, targets, cu = packed_batch()
    W = {name: p.detach().double() for name, p in model.named_parameters()}
    yarn = RefYarn(HEAD_DIM)
    model.rotary.reset()
    results = []
    for label, (short, long), transition in stage_windows():
        if transition is not None:
            yarn.apply(*transition)
            model.rotary.extend_window(transition[0] * BLOCK, transition[1] * BLOCK)
        model.train(training)
        with torch.no_grad():
            ours = model(inputs, targets, cu, (short, long)).item()
        logits = head_logits(model, monkeypatch, inputs, cu, (short, long))
        ref, ref_logits = ref_forward(W, inputs, targets, cu, short, long, yarn, training, variant)
        logit_err = ((logits.double() - ref_logits).abs().max() / ref_logits.abs().max()).item()
        results.append((label, ours, ref.item(), logit_err))
    return results


# fp32 (ours) against float64 (port), measured over all stages: losses within 7e-8 relative, logits
# within 6e-7 of their largest magnitude. An fp32 forward of this depth is good to ~1e-6 relative
# (loss) and ~1e-5 (individual logits after 11 residual layers): the tolerances.
LOSS_TOL, LOGIT_TOL = 1e-6, 1e-5


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_forward_matches_reference_port_at_every_stage(monkeypatch, training):
    model = randomized_model()
    results = compare_all_stages(model, monkeypatch, training=training)
    assert [label for label, *_ in results] == ["stage@0", "stage@665", "stage@1330", "stage@1995", "final validation"]
    for label, ours, ref, logit_err in results:
        assert abs(ours - ref) <= LOSS_TOL * abs(ref), (label, ours, ref, abs(ours - ref) / abs(ref))
        assert logit_err <= LOGIT_TOL, (label, logit_err)


@pytest.mark.parametrize("variant", ["skip_after_scaling", "masked_boundaries", "exclusive_window", "half_token_short"])
def test_reference_port_detects_each_old_behaviour(monkeypatch, variant):
    """Positive controls: the port with one of this project's former behaviours differs from ours by
    far more than the tolerance, so the comparison above has power for each item."""
    model = randomized_model()
    worst = max(logit_err for *_, logit_err in compare_all_stages(model, monkeypatch, variant=variant))
    assert worst > 100 * LOGIT_TOL, (variant, worst)


def head_logits(model, monkeypatch, inputs, cu, windows):
    """Per-position logits of an eval forward pass, captured where the head computes them."""
    captured, real = [], tg.head_matmul

    def spy(x, w, use_fp8):
        captured.append(real(x, w, use_fp8))
        return captured[-1]

    monkeypatch.setattr(tg, "head_matmul", spy)
    model.eval()
    model.head_loss = tg.softcap_cross_entropy  # the chunked CPU loss never forms whole logits
    with torch.no_grad():
        model(inputs, torch.zeros(inputs.numel(), dtype=torch.int64), cu, windows)
    model.head_loss = tg.chunked_softcap_cross_entropy
    monkeypatch.setattr(tg, "head_matmul", real)
    return captured[0]


def test_document_start_sees_the_previous_document_through_smear_and_key_shift(monkeypatch):
    """At a document start the reference's smear gate reads the previous token and the key shift
    copies the previous key (attention itself stays inside documents). Visible here: changing only
    the previous document's last token changes the next document's first position (smear), and
    changing a token a few places before it changes the next document (only through the
    shifted key of the long-window layers, which carries the previous document's last key)."""
    model = randomized_model()
    inputs, targets, cu = packed_batch()
    start, previous_start = 220, 37  # documents 37..219 and 220..230
    base = head_logits(model, monkeypatch, inputs, cu, (1, 3))
    scale = base.abs().max().item()
    for position, floor in ((start - 1, 1e-2), (start - 5, 1e-5)):
        changed = inputs.clone()
        changed[position] = (changed[position] + 1) % VOCAB
        out = head_logits(model, monkeypatch, changed, cu, (1, 3))
        assert (out[start:231] - base[start:231]).abs().max().item() > floor * scale, position
        assert torch.equal(out[:previous_start], base[:previous_start])  # earlier documents: untouched
        # and the port agrees on how the boundary is crossed
        W = {name: p.detach().double() for name, p in model.named_parameters()}
        model.train(False)
        with torch.no_grad():
            ours = model(changed, targets, cu, (1, 3)).item()
        ref = ref_forward(W, changed, targets, cu, 1, 3, RefYarn(HEAD_DIM))[0].item()
        assert abs(ours - ref) <= LOSS_TOL * abs(ref)
