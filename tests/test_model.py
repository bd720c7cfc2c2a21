"""Model invariants: initial loss, causality, document isolation, sliding windows,
attention backends vs a naive reference, tying, the parameter split, layer roles and plans, the plain
residual against a hand-written model, the FP8 head op, the chunked CPU loss, YaRN and the key shift.
CPU only, small shapes (~1 min on 2 cores). Per-position logits come from GPT.logits.
"""
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

import train_gpt as tg

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

PADDED_VOCAB = 50304  # 50257 rounded up to a multiple of 128
HEAD_FP8_SCALES = tg.head_fp8_scales(tg.Hyperparameters().head_fp8_amax)  # the record's static head scales


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _cu(bounds, total, pad_to=8):
    """Padded cumulative boundaries [0, b1, ..., total, total, ...] (int32)."""
    values = [0, *bounds, total]
    values += [total] * (pad_to - len(values))
    return torch.tensor(values, dtype=torch.int32)


def _small_hp(vocab=1024, layers=9, block_tokens=16, **changes):
    """The cpu preset's recipe at width 64 (2 heads of 32), a small vocabulary and bigram table."""
    small = dict(vocab_size=vocab, num_layers=layers, num_heads=2, head_dim=32, model_dim=64,
                 window_block_tokens=block_tokens, bigram_vocab_size=4099, bigram_dim=16)
    return dataclasses.replace(tg.parse_args(["--preset", "cpu"]), **{**small, **changes})


def _small_model(vocab=1024, layers=9, seed=0, block_tokens=16, randomize=True, attention=None, head_loss=None,
                 fp8_scales=None, **changes):
    """A 9-layer dim-64 model of the recipe, built with the CPU's backend or with the given attention, head loss
    (e.g. the GPU path's) and FP8 head scales. randomize=True also fills the weights that start at zero or
    nearly (MLP proj, value embeddings, gates, bigram table, MUDD's second layer, smear/x0 lambdas): at init
    they make many paths carry nothing, which would make the causality/isolation tests vacuous."""
    torch.manual_seed(seed)
    hp = _small_hp(vocab, layers, block_tokens, **changes)
    backend = tg.backend_for(hp, torch.device("cpu"))
    backend = backend._replace(attention=attention or backend.attention, head_loss=head_loss or backend.head_loss,
                               fp8_scales=fp8_scales)
    model = tg.GPT(hp, backend)
    if randomize:
        g = _gen(seed + 1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                label = model.specs[name].label
                if label in ("mlp", "gate", "smear_gate", "skip_gate") and p.abs().max() == 0:
                    p.uniform_(-0.05, 0.05, generator=g) if label == "mlp" else p.normal_(0, 0.5, generator=g)
                elif label in ("value_embed", "bigram"):
                    p.normal_(0, 0.5, generator=g)
                elif name == "mudd_w2":
                    p.normal_(0, 0.05, generator=g)
            model.x0_lambdas.uniform_(0.1, 0.5, generator=g)
            model.scalar_views().smear.fill_(0.5)
    return model


def _bigram_ids(model, inputs):
    if model.bigram_embed is None:
        return None
    return torch.from_numpy(tg.bigram_hash(inputs.numpy(), model.bigram_embed.size(0)))


def _forward(model, inputs, targets, cu_seqlens, windows, mtp=None):
    return model(inputs, targets, cu_seqlens, windows, _bigram_ids(model, inputs), mtp)


def _logits(model, inputs, cu_seqlens, windows):
    """Per-position softcapped logits of an eval-mode forward pass."""
    model.eval()
    with torch.no_grad():
        return model.logits(inputs, cu_seqlens, windows, _bigram_ids(model, inputs))


# ------------------------------------------------------------------------------ initial loss

def test_initial_loss_is_log_vocab():
    torch.manual_seed(0)
    model = tg.build_model(_small_hp(vocab=50257), torch.device("cpu")).eval()
    T = 512
    g = _gen(1)
    inputs = torch.randint(0, 50257, (T,), generator=g, dtype=torch.int32)
    targets = torch.randint(0, 50257, (T,), generator=g)
    with torch.no_grad():
        loss = _forward(model, inputs, targets, _cu([200], T), (1, 2))
    # at init the softcapped logits are all near 23 sigmoid(5 / 7.5): uniform over the padded vocab
    assert loss.dtype == torch.float32 and loss.ndim == 0
    assert abs(loss.item() - math.log(PADDED_VOCAB)) < 0.05, loss.item()


# ------------------------------------------------------------------------------ causality, documents

# The CPU fallback and the GPU path (eager FlexAttention: forward only on CPU)
BACKENDS = [tg.TiledWindowAttention(), tg.FlexWindowAttention()]
BACKEND_IDS = ["tiled", "flex"]


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
def test_causality(backend):
    model = _small_model(attention=backend)
    T = 300
    g = _gen(2)
    inputs = torch.randint(0, 1024, (T,), generator=g, dtype=torch.int32)
    cu = _cu([120], T)  # two documents; windows 1 and 2 blocks x 16 tokens
    base = _logits(model, inputs, cu, (1, 2))
    scale = base.abs().max().item()
    # eager FlexAttention is slow on CPU (~0.3 s per call): fewer cut points for it
    for t in (0, 60, 130, 200) if isinstance(backend, tg.TiledWindowAttention) else (130,):
        changed = inputs.clone()
        changed[t + 1:] = torch.randint(0, 1024, (T - t - 1,), generator=g, dtype=torch.int32)
        out = _logits(model, changed, cu, (1, 2))
        # past and present: unchanged (measured bit-identical; tolerance for kernel blocking)
        assert (out[: t + 1] - base[: t + 1]).abs().max().item() <= 1e-6 * scale, t
        # the future does change (the test has power)
        assert (out[t + 1:] - base[t + 1:]).abs().max().item() > 1e-2 * scale, t


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
def test_documents_meet_only_at_the_boundary(backend):
    """Attention never crosses a document boundary; the only carry-over is the reference's: the smear
    gate and the key shift at a document's first position read the previous position. So changing
    the first document everywhere except near its end (out of reach of the windows of every layer
    that feeds its last key) leaves the second document bit-identical, and changing the last
    token of the first document changes the second document."""
    model = _small_model(attention=backend)
    g = _gen(3)
    a_len, b_len = 250, 170
    doc_a = torch.randint(0, 1024, (a_len,), generator=g, dtype=torch.int32)
    doc_b = torch.randint(0, 1024, (b_len,), generator=g, dtype=torch.int32)
    T = a_len + b_len
    packed = torch.cat([doc_a, doc_b])
    cu = _cu([a_len], T)
    base = _logits(model, packed, cu, (1, 2))
    scale = base.abs().max().item()

    # The first document's last key (shifted into the second document at the long-window layers 2 and
    # 8) depends on at most 6 short (16) + 1 long (32) windows of attention before it: 128 tokens.
    # The first 40 tokens are out of that reach.
    far = packed.clone()
    far[:40] = torch.randint(0, 1024, (40,), generator=g, dtype=torch.int32)
    out = _logits(model, far, cu, (1, 2))
    assert torch.equal(out[a_len:], base[a_len:])
    assert (out[:40] - base[:40]).abs().max().item() > 1e-2 * scale  # the change itself is visible

    # the boundary: the last token of the first document reaches the second document's first position
    near = packed.clone()
    near[a_len - 1] = (near[a_len - 1] + 1) % 1024
    out = _logits(model, near, cu, (1, 2))
    assert (out[a_len] - base[a_len]).abs().max().item() > 1e-5 * scale  # measured 8e-4 x scale

    # positive control: declared as one document, the second part depends on the far change
    if isinstance(backend, tg.FlexWindowAttention):
        return  # (the model's information flow does not depend on the backend; saves two slow passes)
    merged = _cu([], T)
    one = _logits(model, packed, merged, (8, 16))
    two = _logits(model, far, merged, (8, 16))
    assert (one[a_len:] - two[a_len:]).abs().max().item() > 1e-5 * scale  # measured 8e-4 x scale


# ------------------------------------------------------------------------------ attention masks

SCALE = 0.37  # a softmax scale that is not 1, so a scale applied twice or not at all shows


def _naive_attention(q, k, v, docs, window, scale=SCALE):
    """Masked softmax in float64: attend iff same document and 0 <= q - kv <= window (inclusive, as
    FlashAttention's window_size=(window, 0))."""
    T = q.size(0)
    pos = torch.arange(T)
    delta = pos[:, None] - pos[None, :]
    allowed = (docs[:, None] == docs[None, :]) & (delta >= 0) & (delta <= window)
    scores = torch.einsum("thd,shd->hts", q.double(), k.double()) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v.double())


def _qkv(T, H=2, D=16, seed=0, requires_grad=False):
    g = _gen(seed)
    return [(torch.randn(T, H, D, generator=g) * s).requires_grad_(requires_grad) for s in (0.5, 0.5, 1.0)]


def _docs(bounds, T):
    return tg.document_ids(_cu(bounds, T, pad_to=len(bounds) + 5), T)


MASK_CASES = [  # (T, inner document boundaries, window tokens)
    (256, [], 64),
    (300, [100, 101, 250], 1),
    (300, [100, 101, 250], 128),
    (513, [7, 200, 450], 200),  # T not a multiple of 128
    (513, [7, 200, 450], 1000),  # window longer than everything
    (130, [129], 130),  # a one-token last document in a partial tile
]


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
@pytest.mark.parametrize("T,bounds,window", MASK_CASES)
def test_attend_matches_naive(backend, T, bounds, window):
    q, k, v = _qkv(T, seed=T + window)
    docs = _docs(bounds, T)
    y = backend(q, k, v, backend.mask(docs, window), torch.tensor(SCALE))
    ref = _naive_attention(q, k, v, docs, window)
    assert y.shape == q.shape
    err = (y.double() - ref).abs().max().item()
    assert err < 2e-5, err  # measured <= 5.5e-7 (fp32 vs float64 reference), both backends


@pytest.mark.parametrize("T,bounds,window", MASK_CASES)
def test_local_attention_gradients_match_naive(T, bounds, window):
    q, k, v = _qkv(T, seed=T + window + 1, requires_grad=True)
    docs = _docs(bounds, T)
    gy = torch.randn(T, *q.shape[1:], generator=_gen(9))
    tiled = tg.TiledWindowAttention()
    y = tiled(q, k, v, tiled.mask(docs, window), torch.tensor(SCALE))
    grads = torch.autograd.grad(y, (q, k, v), gy)
    ref = _naive_attention(q, k, v, docs, window)
    ref_grads = torch.autograd.grad(ref, (q, k, v), gy.double())
    for name, got, want in zip("qkv", grads, ref_grads):
        err = (got.double() - want).abs().max().item()
        assert err < 1e-4 * max(1.0, want.abs().max().item()), (name, err)  # measured <= 2.6e-6, |grad| ~3-7


@pytest.mark.parametrize("T,bounds,window", MASK_CASES)
def test_flex_block_mask_structure(T, bounds, window):
    """Eager FlexAttention evaluates mask_mod densely, so the tile lists (which the compiled GPU
    kernel uses to skip work) are checked here: every tile holding an allowed pair is visited, a
    'full' tile (mask_mod skipped) has every pair allowed, and no tile is visited needlessly."""
    docs = _docs(bounds, T)
    bm = tg.sliding_document_mask(docs, window)
    B = tg.ATTN_BLOCK
    n = -(-T // B)

    def dense(num, idx):
        out = torch.zeros(n, n, dtype=torch.bool)
        for row in range(n):
            out[row, idx[0, 0, row, : num[0, 0, row]].long()] = True
        return out

    partial, full = dense(bm.kv_num_blocks, bm.kv_indices), dense(bm.full_kv_num_blocks, bm.full_kv_indices)
    pos = torch.arange(T)
    delta = pos[:, None] - pos[None, :]
    allowed = (docs[:, None] == docs[None, :]) & (delta >= 0) & (delta <= window)
    for qb in range(n):
        for kb in range(n):
            tile = allowed[qb * B: (qb + 1) * B, kb * B: (kb + 1) * B]
            assert not (partial[qb, kb] and full[qb, kb])
            assert bool(partial[qb, kb] or full[qb, kb]) == bool(tile.any()), (qb, kb)
            if full[qb, kb]:
                assert tile.all() and tile.shape == (B, B), (qb, kb)
    # the backward pass walks the transposed lists; they must describe the same tiles
    q_partial = dense(bm.q_num_blocks, bm.q_indices).T
    q_full = dense(bm.full_q_num_blocks, bm.full_q_indices).T
    assert torch.equal(q_partial, partial) and torch.equal(q_full, full)


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
def test_sliding_window_influence(backend):
    """One attention layer: a key/value more than `window` tokens behind t has no influence on t;
    one exactly `window` behind (the inclusive edge) and closer ones do."""
    T, window, t = 400, 50, 300
    q, k, v = _qkv(T, seed=5)
    docs = _docs([], T)
    mask = backend.mask(docs, window)
    base = backend(q, k, v, mask, torch.tensor(SCALE))
    assert (base.double() - _naive_attention(q, k, v, docs, window)).abs().max() < 2e-5
    for s, inside in ((t - window - 1, False), (t - window - 70, False), (t - window, True), (t - 1, True)):
        k2, v2 = k.clone(), v.clone()
        k2[s] += 3.0
        v2[s] += 3.0
        out = backend(q, k2, v2, mask, torch.tensor(SCALE))
        effect = (out[t] - base[t]).abs().max().item()
        if inside:
            assert effect > 1e-3, (s, effect)
        else:
            assert effect == 0.0, (s, effect)  # exactly: the key is masked out


# ------------------------------------------------------------------------------ tied embedding

def test_tied_embedding_and_head(monkeypatch):
    """--untie_stage -1: the input embedding is the head's weight itself (no separate table)."""
    # the plain path, so head_matmul is where the head reads its weight
    model = _small_model(randomize=False, head_loss=tg.softcap_cross_entropy, untie_stage=-1)
    model.train()
    T = 128
    g = _gen(4)
    inputs = torch.randint(0, 300, (T,), generator=g, dtype=torch.int32)  # rows >= 300 never looked up
    targets = torch.randint(0, 1024, (T,), generator=g)
    cu = _cu([100], T)
    W = model.lm_head.weight

    # no separate embedding parameter: lm_head.weight is the only "lm_head" parameter, and the other
    # vocab-sized tables are exactly the 5 value embeddings
    params = dict(model.named_parameters())
    heads = [n for n in params if model.specs[n].label in ("lm_head", "embed")]
    assert model.embed is None and heads == ["lm_head.weight"]
    vocab_sized = {n for n, p in params.items() if p.size(0) == W.size(0)}
    assert vocab_sized == {"lm_head.weight", *(f"value_embeds.{i}" for i in range(5))}

    # the embedding lookup reads lm_head.weight: split the gradient into head and embedding parts by
    # giving the head a detached copy
    model.zero_grad()
    _forward(model, inputs, targets, cu, (1, 2)).backward()
    full_grad = W.grad.clone()

    head_copies = []
    real = tg.head_matmul

    def head_on_copy(x, w, use_fp8):
        assert w is W  # the head reads lm_head.weight
        copy = w.detach().clone().requires_grad_()
        head_copies.append(copy)
        return real(x, copy, use_fp8)

    monkeypatch.setattr(tg, "head_matmul", head_on_copy)
    model.zero_grad()
    _forward(model, inputs, targets, cu, (1, 2)).backward()
    monkeypatch.setattr(tg, "head_matmul", real)
    embed_grad, head_grad = W.grad.clone(), head_copies[0].grad
    looked_up = torch.zeros(W.size(0), dtype=torch.bool)
    looked_up[inputs.long()] = True
    assert embed_grad[looked_up].abs().sum(-1).min() > 0  # every input token's row gets an embedding gradient
    assert torch.equal(embed_grad[~looked_up], torch.zeros_like(embed_grad[~looked_up]))
    assert head_grad.abs().sum(-1).min() > 0  # every row is a head row
    torch.testing.assert_close(full_grad, embed_grad + head_grad, rtol=1e-4, atol=1e-9)


# ------------------------------------------------------------------------------ parameter split

def test_cpu_preset_split_covers_every_parameter_once():
    hp = tg.parse_args(["--preset", "cpu"])
    model = tg.build_model(hp, torch.device("cpu"))
    muon, adam = tg.split_params_for_optimizers(model)
    ids = [id(p) for p, _ in muon + adam]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    assert sorted(ids) == sorted(id(p) for p in model.parameters())
    assert {s.label for _, s in muon} == {"attn_qk", "attn_vo", "mlp"}
    assert {s.label for _, s in adam} == set(tg.ADAM_GROUPS)
    for _, s in adam:
        assert (s.lr_mul, s.wd_mul, s.betas) == (*tg.ADAM_GROUPS[s.label][1:], tg.ADAM_GROUPS[s.label][0])
    # the optimizers take the CPU path of Polar Express on a CPU
    muon, _ = tg.make_optimizers(model, hp, tg.backend_for(hp, torch.device("cpu")))
    assert muon.polar == tg.CPU_POLAR_EXPRESS
    # a parameter the table does not know has no optimizer: refused
    model.extra = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(KeyError, match="extra"):
        tg.split_params_for_optimizers(model)


def test_scalars_layout():
    L = 11
    for mudd_dim, backout in ((64, None), (0, 0.5)):
        hp = dataclasses.replace(_small_hp(layers=L), mudd_dim=mudd_dim)
        model = tg.build_model(hp, torch.device("cpu"))
        views = model.scalar_views()
        assert torch.equal(views.attn, torch.tensor([[0.5, 1.0]] * L))
        assert (views.smear.item(), views.skip.item()) == (0.0, -1.5)
        assert (None if views.backout is None else views.backout.item()) == backout
        assert model.scalars.numel() == 2 * L + 2 + (backout is not None)
    assert abs(torch.sigmoid(views.skip).item() - 0.1824) < 1e-3


def test_mudd_coefficients_are_named_in_the_networks_order():
    bias = tg.mudd_bias_init() * tg.MUDD_SCALE
    layer = dict(zip(tg.MuddLayerCoefs._fields, bias[0].tolist()))
    output = dict(zip(tg.MuddOutputCoefs._fields, bias[1].tolist()))
    bf16 = lambda v: torch.tensor(v / tg.MUDD_SCALE).bfloat16().item() * tg.MUDD_SCALE  # noqa: E731
    assert len(layer) == 14 and len(output) == 5
    assert layer == pytest.approx(dict(dict.fromkeys(layer, 0.0), ve_gate_low=bf16(2.0), ve_gate_high=bf16(2.0),
                                       attn_resid=bf16(1.1 ** 0.5), attn_out=1.0, bigram=bf16(0.05),
                                       mlp_resid=bf16(1.1 ** 0.5), mlp_out=1.0))
    assert output == pytest.approx(dict(dict.fromkeys(output, 0.0), backout=-0.5))


# ------------------------------------------------------------------------------ layer roles and plans

def test_layer_roles_record():
    r = tg.layer_roles_of(tg.parse_args([]))
    assert (r.skip_source, r.attn_free, r.backout) == (3, 6, 7)
    assert tuple(r.long_window) == (3, 10)
    assert r.value_embed == {1: 0, 2: 1, 8: 2, 9: 3, 10: 4}
    assert (r.paired, r.xsa) == ((0, 2, 5, 9), (1, 3, 4, 7, 8, 10))


def test_layer_plan_record():
    plan = tg.layer_plan(tg.parse_args([]), tg.layer_roles_of(tg.parse_args([])))
    assert [i for i, p in enumerate(plan) if not p.attention] == [6]
    assert [i for i, p in enumerate(plan) if p.key_shift] == [3, 10]  # the long-window layers, none paired
    assert [p.residual for p in plan] == ["sublayer"] * 10 + ["mudd"]
    assert [i for i, p in enumerate(plan) if p.value_gate] == [1, 2, 8, 9]  # layer 10's gates come from MUDD
    assert [i for i, p in enumerate(plan) if p.attends_backout] == [8, 9, 10]
    assert [(p.skip_in, p.skip_out, p.backout_out) for p in plan].index((False, True, False)) == 3
    assert not any(p.scale_before for p in plan) and [p.adds_bigram for p in plan] == [False] + [True] * 10


@pytest.mark.parametrize("layers", range(-1, 9))
def test_layer_roles_too_shallow(layers):
    """Below 9 layers the layout has no room: the skip or backout falls off, or (5-8 layers) the last three
    layers' value embeddings meet the attention-free layer."""
    with pytest.raises(tg.ConfigError):
        tg.layer_roles(layers, ((0, 1, -3, -2, -1), (1, 2, 0, 1, 2)))


def test_too_shallow_rejected_by_parse_args():
    with pytest.raises(tg.ConfigError):
        tg.parse_args(["--preset", "cpu", "--num_layers", "8"])


@pytest.mark.parametrize("layers", [9, 10, 12, 13, 16, 24, 48])
def test_layer_roles_other_depths(layers):
    r = tg.layer_roles(layers, ((0, 1, -3, -2, -1), (1, 2, 0, 1, 2)))
    assert 0 <= r.skip_source < r.attn_free < r.backout < layers
    assert r.attn_free not in r.value_embed and r.attn_free not in r.long_window
    assert r.skip_source in r.long_window and layers - 1 in r.long_window and len(set(r.long_window)) == 2
    assert sorted(r.value_embed) == [0, 1, layers - 3, layers - 2, layers - 1]
    assert [r.value_embed[i] for i in sorted(r.value_embed)] == [1, 2, 0, 1, 2]
    with torch.device("meta"):
        model = tg.GPT(_small_hp(layers=layers), tg.backend_for(_small_hp(layers=layers), torch.device("cpu")))
    assert [i for i, p in enumerate(model.plan) if not p.attention] == [model.roles.attn_free]
    assert not hasattr(model.layers[model.roles.attn_free], "qk_w")


def test_nine_layer_model_trains_one_step():
    model = _small_model(vocab=512, randomize=False)
    model.train()
    T = 128
    g = _gen(6)
    inputs = torch.randint(0, 512, (T,), generator=g, dtype=torch.int32)
    loss = _forward(model, inputs, torch.randint(0, 512, (T,), generator=g), _cu([50], T), (1, 2),
                    torch.tensor([1.0, 0.5, 0.25]))
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters())


# ------------------------------------------------------------------------------ every idea off

EVERY_IDEA_OFF = dict(bigram_vocab_size=0, value_embed_layers=(), value_embed_tables=(), value_embed_gates=False,
                      paired_head_layers=(), xsa_layers=(), skip_gate=False, shared_attention_input=False, mudd_dim=0,
                      sublayer_scalars=False, untie_stage=-1)


def _plain_reference(model, inputs, cu, windows, x0_term=True):
    """The model with every recipe-89 idea off, written out by hand in float64 from its weights: smeared, normed
    tied embedding x0; before each layer x <- resid x + x0_lambda x0 (lambdas rounded to bf16, as the reference
    uses them); the U-net skip (sigmoid(skip lambda) x the skip source's output) lands before the attention-free
    layer; attention with QKV scaled by lambda 0, O by lambda 1, rotary q and k, keys shifted on the long-window
    layers, causal within documents and the window, a sigmoid gate per head; the ReLU^2 MLP; the backout layer's
    output times its lambda subtracted before the final norm; the softcapped tied head."""
    def norm64(t):
        return t * torch.rsqrt(t.square().mean(-1, keepdim=True) + torch.finfo(torch.float32).eps)

    d = lambda t: t.detach().double()  # noqa: E731
    T, L, H, hd, roles = inputs.numel(), model.num_layers, model.num_heads, model.head_dim, model.roles
    s, W = d(model.scalars), d(model.lm_head.weight)
    resid, x0_lambda = d(model.resid_lambdas.bfloat16()), d(model.x0_lambdas.bfloat16())
    docs = tg.document_ids(cu, T)
    cos_sin = tuple(t.double() for t in model.rotary.cos_sin(T))
    x = W[inputs.long()]
    smear = s[2 * L] * torch.sigmoid(x[1:, :tg.GATE_INPUTS] @ d(model.smear_gate_w).T)
    x = x0 = norm64(torch.cat([x[:1], x[1:] + smear * x[:-1]]))
    skip = backout = None
    for i, layer in enumerate(model.layers):
        if i == roles.attn_free:
            x = x + torch.sigmoid(s[2 * L + 1]) * skip
        x = resid[i] * x + (x0_lambda[i] * x0 if x0_term else 0)
        if i != roles.attn_free:
            h = norm64(x)
            qkv = h @ (s[2 * i] * torch.cat([d(layer.qk_w), d(layer.vo_w)[:H * hd]])).T
            q, k, v = qkv.view(T, 3, H, hd).unbind(1)
            q, k = tg.apply_rotary(norm64(q), cos_sin), tg.apply_rotary(norm64(k), cos_sin)
            long = i in roles.long_window
            if long:
                k = tg.shift_keys(k)
            y = _naive_attention(q, k, v, docs, windows[long] * model.window_block_tokens, d(model.rotary.attn_scale))
            y = y * torch.sigmoid(h[:, :tg.GATE_INPUTS] @ d(layer.gate_w).T)[..., None]
            x = x + y.reshape(T, H * hd) @ (s[2 * i + 1] * d(layer.vo_w)[H * hd:]).T
        x = x + torch.relu(norm64(x) @ d(layer.fc_w).T).square() @ d(layer.proj_w)
        skip = x if i == roles.skip_source else skip
        backout = x if i == roles.backout else backout
    z = norm64(x - s[2 * L + 2] * backout) @ W.T
    return model.softcap.scale * torch.sigmoid((z + model.softcap.offset) / tg.SOFTCAP_WIDTH)


def test_every_idea_off_is_the_plain_model_written_by_hand():
    """The off value of every idea together leaves the plain residual model: GPT.logits against _plain_reference.
    Error model: the softcapped logits lie near 15 (the head starts small), where one fp32 ulp is 2^-23 x 15 =
    1.8e-6; the fp32 forward's own roundings reach them scaled down by the softcap's slope (< 1). Bound: 8 ulps
    of the largest logit (measured: 2.2e-6, about 1.2 ulps). Positive control: the same reference without the
    x0 term (one idea's worth of difference) lies more than 100 times the bound away (measured 0.026)."""
    model = _small_model(**EVERY_IDEA_OFF)
    assert [p.residual for p in model.plan] == ["plain"] * 9 and all(p.scale_before for p in model.plan)
    T = 200
    g = _gen(12)
    inputs = torch.randint(0, 1024, (T,), generator=g, dtype=torch.int32)
    cu = _cu([70, 150], T)
    ours = _logits(model, inputs, cu, (1, 2)).double()
    reference = _plain_reference(model, inputs, cu, (1, 2))[:, : ours.size(1)]
    bound = 8 * 2 ** -23 * reference.abs().max().item()
    assert (ours - reference).abs().max().item() <= bound
    no_x0 = _plain_reference(model, inputs, cu, (1, 2), x0_term=False)[:, : ours.size(1)]
    assert (ours - no_x0).abs().max().item() > 100 * bound


# ------------------------------------------------------------------------------ FP8 head op

def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _fp8_inputs(M=64, K=128, N=256, seed=0, w_dtype=torch.float32):
    """Realistic magnitudes for the scales (100/448, 1.5/448, 0.75/448): activations of a few units
    (RMS-normed, so |x| up to ~4-5), head weights ~0.005 std (init), logit gradients ~0.01."""
    g = _gen(seed)
    x = (torch.randn(M, K, generator=g) * 1.5).to(torch.bfloat16)
    w = (torch.randn(N, K, generator=g) * 0.005).to(w_dtype)
    gy = (torch.randn(M, N, generator=g) * 0.01).to(torch.bfloat16)
    return x, w, gy


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_mm_fp8_matches_fp32(w_dtype):
    x, w, gy = _fp8_inputs(w_dtype=w_dtype)
    xr, wr = x.float().clone().requires_grad_(), w.float().clone().requires_grad_()  # .float() may alias w
    (xr @ wr.T).backward(gy.float())
    ref = xr.detach() @ wr.detach().T
    x8, w8 = x.clone().requires_grad_(), w.clone().requires_grad_()
    out, x_f8, w_f8 = tg.mm_fp8(x8, w8, *HEAD_FP8_SCALES)
    out.backward(gy)
    assert out.dtype == torch.bfloat16 and x_f8.dtype == w_f8.dtype == torch.float8_e4m3fn
    assert x8.grad.dtype == torch.bfloat16 and w8.grad.dtype == w_dtype
    # relative Frobenius errors, measured (fp32 and bf16 w alike): forward 0.037 (e4m3 x e4m3),
    # grad_x 0.058, grad_w 0.059 (e5m2 gradient: 2 mantissa bits)
    assert 0.01 < _rel(out, ref) < 0.05  # lower bound: it really is float8, not a bf16 matmul (~0.003)
    assert _rel(x8.grad, xr.grad) < 0.08
    assert _rel(w8.grad, wr.grad) < 0.08


def test_head_matmul_fp8_path():
    x, w, _ = _fp8_inputs()
    x3 = x.view(4, 16, 128)
    out = tg.head_matmul(x3, w, HEAD_FP8_SCALES)
    assert out.shape == (4, 16, 256)
    assert _rel(out, x3.float() @ w.T) < 0.05
    torch.testing.assert_close(tg.head_matmul(x.float(), w, None), x.float() @ w.T)


def test_mm_fp8_opcheck():
    x, w, gy = _fp8_inputs(M=32, K=64, N=48)
    args = (x.clone().requires_grad_(), w.clone().requires_grad_(), *HEAD_FP8_SCALES)
    # test_schema and test_aot_dispatch_dynamic cannot run here: their checkers call allclose/sum on the
    # float8 outputs, which CPU torch does not implement for float8 ("mul_cpu_reduced_float" /
    # "sum_cpu" not implemented for 'Float8_e4m3fn'). The compile path is checked below instead.
    result = torch.library.opcheck(torch.ops.speedrun.mm_fp8.default, args,
                                   test_utils=("test_autograd_registration", "test_faketensor"))
    assert set(result.values()) == {"SUCCESS"}
    bargs = (gy, x.div(HEAD_FP8_SCALES[0]).to(torch.float8_e4m3fn),
             w.div(HEAD_FP8_SCALES[1]).to(torch.float8_e4m3fn), *HEAD_FP8_SCALES)
    result = torch.library.opcheck(torch.ops.speedrun.mm_fp8_backward.default, bargs, test_utils=("test_faketensor",))
    assert set(result.values()) == {"SUCCESS"}


def test_mm_fp8_under_compile_matches_eager():
    """Fake-tensor tracing + AOT autograd (what torch.compile does with the op), forward and backward."""
    x, w, gy = _fp8_inputs(M=32, K=64, N=48)

    def f(x, w):
        return tg.mm_fp8(x, w, *HEAD_FP8_SCALES)[0].float().sum(0)

    results = []
    for fn in (f, torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=False)):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(xg, wg)
        out.backward(gy[0].float())
        results.append((out, xg.grad, wg.grad))
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)


def test_fp8_switch_changes_only_precision():
    """The FP8 head (e4m3 forward, e5m2 gradients) against the bf16/fp32 head; the FP8 MLP has tests of its own."""
    T = 256
    g = _gen(7)
    inputs = torch.randint(0, 4096, (T,), generator=g, dtype=torch.int32)
    targets = torch.randint(0, 4096, (T,), generator=g)
    cu = _cu([90, 200], T)
    runs = {}
    for fp8 in (False, True):  # K = 64, N = 4096, T = 256: multiples of 16 (a smaller head); the same weights
        model = _small_model(vocab=4096, head_loss=tg.softcap_cross_entropy, fp8_scales=HEAD_FP8_SCALES if fp8 else None,
                             fp8_mlp=False).train()
        loss = _forward(model, inputs, targets, cu, (1, 2))
        loss.backward()
        runs[fp8] = (loss.item() / T, {n: p.grad.clone() for n, p in model.named_parameters()})
    (l32, g32), (l8, g8) = runs[False], runs[True]
    # Error model: the logits' gradient is cast to e5m2 (2 mantissa bits: unit roundoff 2^-3, RMS relative
    # error 2^-3 / sqrt(3) = 0.072), so a gradient made of many such entries is off by about that, relative
    # (Frobenius); bound: twice it. A gradient summed over every token into a few entries (the lambdas) can
    # cancel and so lose more, relative to itself: those count in the whole gradient only. Measured: loss
    # 2e-5 per token; matrices up to 0.072, the whole gradient 0.070, a lambda vector 0.24.
    assert abs(l8 - l32) < 1e-3, (l8, l32)
    assert g8.keys() == g32.keys()
    bound = 2 * 2 ** -3 / math.sqrt(3)
    for name in g32:
        if g32[name].numel() >= 1024 and g32[name].norm() > 0:
            assert _rel(g8[name], g32[name]) < bound, name
    assert _rel(torch.cat([g.flatten() for g in g8.values()]), torch.cat([g.flatten() for g in g32.values()])) < bound


# ------------------------------------------------------------------------------ chunked CPU loss

@pytest.mark.parametrize("loss_kind", ["next-token", "multi-token"])
@pytest.mark.parametrize("T", [600, 100])  # 600: two chunks, the last one partial
def test_chunked_softcap_loss_matches_autograd(T, loss_kind):
    """The next-token loss (softcap 30 sigmoid(z / 7.5), no offset) and recipe 89's multi-token loss
    (23 sigmoid((z + 5) / 7.5), weights of the next 3 tokens; the chunk boundary at 512 and the sequence's
    end cut horizons short) against float64 autograd of the plain formulas."""
    V, D = 1000, 32
    g = _gen(8)
    x = torch.randn(T, D, generator=g)
    w = torch.randn(V, D, generator=g) * 0.5  # logits ~ +-3 std: the softcap is far from linear
    t = torch.randint(0, V, (T,), generator=g)
    t[5:8] = t[4]  # the same target for neighbouring horizons: their gradients add at one entry
    assert T % tg.SOFTCAP_CHUNK != 0
    softcap, mtp = (tg.Softcap(30.0), None) if loss_kind == "next-token" else \
        (tg.Softcap(23.0, 5.0), torch.tensor([1.0, 0.5, 0.25]))

    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    z = softcap.scale * torch.sigmoid((xr @ wr.T + softcap.offset) / 7.5)
    ref = F.cross_entropy(z, t, reduction="sum") if mtp is None else tg.multi_token_loss(z, t, mtp.double())
    ref.backward()

    xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = tg.ChunkedSoftcapLoss.apply(xc, wc, t, softcap, mtp, None)
    (loss * 2.5).backward()  # the incoming gradient is applied
    # Error model: fp32 sums of 32 (x) or up to 1000 (w) products, each relative error ~2^-24 * sqrt(n)
    # of the gradient's scale; elementwise near-zero entries can be relatively far off, so compare in
    # the gradient's norm. Measured (fp32 vs float64, 1 and 2 threads): value 4e-8 relative,
    # gradients 2.8e-7 relative (Frobenius), worst element 7e-7 of the norm.
    assert loss.dtype == torch.float32
    assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item())
    for got, want in ((xc.grad, xr.grad), (wc.grad, wr.grad)):
        want = 2.5 * want
        assert (got.double() - want).norm() <= 1e-5 * want.norm()
        assert (got.double() - want).abs().max() <= 1e-5 * want.norm()


def test_model_fused_cpu_loss_equals_plain_path():
    T = 300
    g = _gen(10)
    inputs = torch.randint(0, 1024, (T,), generator=g, dtype=torch.int32)
    targets = torch.randint(0, 1024, (T,), generator=g)
    cu = _cu([123], T)
    out = {}
    for fused in (True, False):
        model = _small_model(vocab=1024, head_loss=None if fused else tg.softcap_cross_entropy).train()
        loss = _forward(model, inputs, targets, cu, (1, 2), torch.tensor([1.0, 0.5, 0.25]))
        loss.backward()
        out[fused] = (loss.item(), [p.grad.clone() for p in model.parameters()])
    assert abs(out[True][0] - out[False][0]) <= 1e-5 * abs(out[False][0])
    for a, b in zip(out[True][1], out[False][1]):
        # measured: loss 1.2e-7 relative, gradients max|diff| <= 1.0e-6 x max|grad|
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5 * b.abs().max().item())


# ------------------------------------------------------------------------------ YaRN

def _expected_factor(freq, old, new):
    rotations = old * freq / (2 * math.pi)
    interp = min(max((rotations - 1) / 31, 0.0), 1.0)
    s = old / new
    return s + interp * (1 - s)


@pytest.mark.parametrize("steps", [[(384, 896)], [(384, 896), (896, 1408), (1408, 1664)], [(128, 2560)]])
def test_yarn_extend_window_and_reset(steps):
    model = _small_model(randomize=False)  # head_dim 32: 8 rotating frequencies, 8 zero
    rotary = model.rotary
    fresh = tg.Rotary(32)
    assert torch.equal(rotary.freqs, fresh.freqs)
    expected = (1 / 1024) ** torch.linspace(0, 1, 8)
    torch.testing.assert_close(rotary.freqs[:8], expected, rtol=1e-6, atol=0)
    assert torch.equal(rotary.freqs[8:], torch.zeros(8)) and rotary.attn_scale.item() == pytest.approx(0.1)

    seen = {"fast": 0, "slow": 0, "middle": 0}
    for old, new in steps:
        before, scale_before = rotary.freqs.clone(), rotary.attn_scale.item()
        rotary.extend_window(old, new)
        after = rotary.freqs
        for i in range(8):
            f = before[i].item()
            rotations = old * f / (2 * math.pi)
            if rotations >= 32:
                seen["fast"] += 1
                assert after[i] == before[i], i  # unchanged, exactly
            elif rotations <= 1:
                seen["slow"] += 1
                assert after[i] == before[i] * torch.tensor(old / new), i  # scaled by old/new (fp32), exactly
            else:
                seen["middle"] += 1
                assert after[i].item() == pytest.approx(f * _expected_factor(f, old, new), rel=1e-6), i
        assert torch.equal(after[8:], torch.zeros(8))
        assert rotary.attn_scale.item() == pytest.approx(scale_before * (0.2 * math.log(new / old) + 1), rel=1e-6)
        # cos/sin follow the new frequencies, rounded to bf16 tables as in the reference
        cos, sin = rotary.cos_sin(50)
        theta = torch.arange(50.0)[:, None] * after[None, :]
        assert cos.dtype == sin.dtype == torch.bfloat16
        assert torch.equal(cos[:, 0], theta.cos().bfloat16()) and torch.equal(sin[:, 0], theta.sin().bfloat16())
    # every kind occurs (no frequency turns 32 times over a 128-token window: max 128 / 2pi ~ 20)
    assert seen["slow"] and seen["middle"] and bool(seen["fast"]) == (steps[0][0] >= 2 * math.pi * 32), seen

    rotary.reset()
    assert torch.equal(rotary.freqs, fresh.freqs)
    assert torch.equal(rotary.attn_scale, fresh.attn_scale) and rotary.attn_scale.dtype == torch.float64


# ------------------------------------------------------------------------------ key shift

def test_shift_keys():
    """Key t takes key t-1 on the position-free dims (position 0 keeps its own). Document starts are
    not special: like the reference, the first key of a document carries the previous one's last."""
    T, H, D = 40, 2, 16
    k = torch.randn(T, H, D, generator=_gen(11))
    out = tg.shift_keys(k)
    free = list(range(D // 4, D // 2)) + list(range(3 * D // 4, D))  # zero-frequency halves of each pair
    rotating = [d for d in range(D) if d not in free]
    for t in range(T):
        assert torch.equal(out[t][:, rotating], k[t][:, rotating]), t
        assert torch.equal(out[t][:, free], k[max(t - 1, 0)][:, free]), t


def test_position_free_dims_are_not_rotated():
    """The dims that shift_keys moves are exactly those that RoPE leaves alone."""
    D = 32
    rotary = tg.Rotary(D)
    x = torch.randn(20, 2, D, generator=_gen(12))
    y = tg.apply_rotary(x, rotary.cos_sin(20))
    free = list(range(D // 4, D // 2)) + list(range(3 * D // 4, D))
    rotating = [d for d in range(D) if d not in free]
    assert torch.equal(y[:, :, free], x[:, :, free])
    assert not torch.allclose(y[1:, :, rotating], x[1:, :, rotating])


@pytest.mark.parametrize("T,bounds,window", MASK_CASES)
def test_flash_mask_is_the_sliding_document_mask(T, bounds, window):
    """--flex_backend flash's mask (flex_flash.py) reads the window another way (a (1,) buffer at
    the batch index, as the FLASH backend can): the same tiles, and its mask mod allows exactly the
    pairs sliding_document_mask's does."""
    from torch.nn.attention.flex_attention import create_mask

    flash = tg.load_companion("flex_flash.py")
    docs, window_tokens = _docs(bounds, T), torch.tensor(window)
    want, got = tg.sliding_document_mask(docs, window_tokens), flash.flash_document_mask(docs, window_tokens)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                 "q_indices"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert torch.equal(create_mask(got.mask_mod, 1, 1, T, T, device="cpu"),
                       create_mask(want.mask_mod, 1, 1, T, T, device="cpu"))
