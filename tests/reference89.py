"""A float64 port of modded-nanogpt record #89 (2026-07-17, "FP8DownProjection"), written from its
log (notes/log89.txt: the training script is lines 1-2243, its triton_kernels.py lines 2250-3492;
"L123" below cites a line of that log). Independent of train_gpt.py; imported by tests.

What is here:
- RefConfig, parameter shapes, ref_initial_weights (the reference's init, RNG call for RNG call) and
  ref_random_weights (every weight random and non-zero);
- ref_bigram_hash, RefYarn (rotary tables, YaRN, attention scale), ref_forward (GPT.forward with
  naive FlashAttention-varlen attention, the multi-token-prediction loss in training, the mean
  cross-entropy in eval);
- the schedules (ref_schedule and its pieces);
- the optimizer formulas (REF_PARAM_TABLE, ref_adam_step, ref_normuon_step and its pieces);
- the FP8 MLP numerics (RefFP8MLP, ref_fp8_mlp_sequence) and the FP8 head (ref_fp8_head_logits).

Precision policy: activations in float64; every explicit cast the reference applies to parameters,
scalars and tables is reproduced (the lambdas' .bfloat16() in the forward, the bf16 rotary tables,
fp32 0-D optimizer scalars, fp32 MTP weights). The reference's bf16 activations are not.
"""
import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

F64, F32, BF16 = torch.float64, torch.float32, torch.bfloat16
E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def round_bf16(t):
    """Round to bfloat16 (nearest even) and return float64."""
    return t.to(BF16).to(F64)


def f32(x):
    """A Python float rounded to float32, as a 0-D fp32 tensor of the reference would hold it."""
    return float(np.float32(x))


# ----------------------------------------------------------------------------------------------
# Configuration and fixed layout

NUM_LAYERS = 11  # the forward hardcodes its layer roles (L1387, L1410-1414, L1437)
PAIRED_LAYERS = (0, 2, 5, 9)  # L1185
XSA_LAYERS = (1, 3, 4, 7, 8, 10)  # L1414: non-paired attention layers only
SKIP_LAYER = 6  # no attention: the skip gate adds cache[3] instead (L1469-1470)
CACHE_LAYERS = (3, 7)  # L1182
MUDD_LAYER = 10  # the last layer's attention is rebuilt by MUDD block 0 (L1476-1485)
VE_TABLE_OF_LAYER = {1: 0, 2: 1, 8: 2, 9: 3, 10: 4}  # L1437: tables 0, 1, then 11 - 6 = 5 fillers, then 2, 3, 4
VE_GATE_OF_LAYER = {1: 0, 2: 1, 8: 2, 9: 3}  # L1411; row 4 of ve_gate_bank is never read
GATE_IN = 12  # attention-gate, smear-gate and skip-gate inputs: the first 12 channels
VE_GATE_HALF = 6  # ve gate input: 6 channels of the attention input, 6 of the value embedding
MUDD_DIM, MUDD_COEFS, MUDD_SCALE = 64, 14, 0.1  # L1315-1317
SOFTCAP_A, SOFTCAP_B, SOFTCAP_C = 23.0, 5.0, 7.5  # 23 * sigmoid((z + 5) / 7.5), L1563, L3417
HEAD_X_SCALE, HEAD_W_SCALE = 100 / 448, 1.6 / 448  # the FP8 head's static scales (L1163)


def next_multiple(v, n):
    return -(-v // n) * n


@dataclass
class RefConfig:
    vocab_size: int = 50257  # GPT-2 tokens; the model pads it (see .vocab)
    model_dim: int = 768
    num_heads: int = 6
    head_dim: int = 128
    num_layers: int = NUM_LAYERS
    bigram_vocab_size: int = 50304 * 15  # L1775-1777
    bigram_dim: int = 192
    bigram_sign_table_rows: int = 8192
    block_size: int = 128  # window unit in tokens (TrainingManager.block_size, L1889)
    world_size: int = 8  # pads the qk/vo banks (L1211, L1217); the record ran on 8 GPUs
    # F.rms_norm without eps uses the eps of its computation dtype: fp32 for the record's bf16
    # activations (torch's _fused_rms_norm upcasts bf16 to fp32); a float64 model gets float64's.
    norm_eps: float = float(torch.finfo(torch.float32).eps)

    def __post_init__(self):
        assert self.num_layers == NUM_LAYERS, "the reference hardcodes 11 layers"
        assert self.num_heads % 2 == 0, "paired heads and the qk bank need an even head count"
        assert self.num_heads * self.head_dim == self.model_dim
        assert self.model_dim >= GATE_IN and self.bigram_dim <= self.model_dim

    @property
    def vocab(self):  # L1159
        return next_multiple(self.vocab_size, 128)

    @property
    def mlp_dim(self):
        return 4 * self.model_dim

    @property
    def num_qk_groups(self):  # one (2*head_dim, dim) matrix per head pair, for Q and for K (L1209)
        return (NUM_LAYERS - 1) * 2 * (self.num_heads // 2)

    @property
    def num_vo(self):
        return (NUM_LAYERS - 1) * 2


# Parameter names in the reference model's named_parameters() order (own parameters first, then
# the submodules lm_head, embed, smear_gate, skip_gate, bigram_embed), and their storage dtype after
# the casts at L2109-2119. The buffer bigram_sign_table is bf16 too.
REF_PARAM_NAMES = (
    "value_embeds", "attn_gate_bank", "ve_gate_bank", "qk_bank", "vo_bank", "mlp_bank", "post_lambdas",
    "x0_lambdas", "bigram_lambdas", "resid_lambdas", "xsa_alphas", "scalars", "mudd_w1", "mudd_w2",
    "mudd_b2", "lm_head.weight", "embed.weight", "smear_gate.weight", "skip_gate.weight",
    "bigram_embed.weight",
)
FP32_PARAMS = ("post_lambdas", "x0_lambdas", "bigram_lambdas", "resid_lambdas", "xsa_alphas", "scalars")


def ref_param_shapes(cfg):
    """{name: shape} of every parameter, in named_parameters() order."""
    L, D, H, hd, V = NUM_LAYERS, cfg.model_dim, cfg.num_heads, cfg.head_dim, cfg.vocab
    shapes = {
        "value_embeds": (5 * V, D),
        "attn_gate_bank": (L - 1, H, GATE_IN),
        "ve_gate_bank": (5, H, GATE_IN),
        "qk_bank": (next_multiple(cfg.num_qk_groups, cfg.world_size), 2 * hd, D),
        "vo_bank": (next_multiple(cfg.num_vo, cfg.world_size), D, D),
        "mlp_bank": (12, 2, cfg.mlp_dim, D),  # 11 layers + 1 padding layer (L1234)
        "post_lambdas": (L, 2), "x0_lambdas": (L,), "bigram_lambdas": (L,), "resid_lambdas": (L, 2),
        "xsa_alphas": (L, H),
        "scalars": (2 * L + 2 + (-2 * L - 2) % cfg.world_size,),  # the padding is 0 for 1, 2, 4, 8 GPUs
        "mudd_w1": (2, MUDD_DIM, D), "mudd_w2": (2, MUDD_COEFS, MUDD_DIM), "mudd_b2": (2, MUDD_COEFS),
        "lm_head.weight": (D, V),  # stored transposed: (in, out), L1163, L976
        "embed.weight": (V, D),
        "smear_gate.weight": (1, GATE_IN), "skip_gate.weight": (1, GATE_IN),
        "bigram_embed.weight": (cfg.bigram_vocab_size, cfg.bigram_dim),
    }
    assert tuple(shapes) == REF_PARAM_NAMES
    return shapes


def ref_param_count(cfg):
    return sum(math.prod(s) for s in ref_param_shapes(cfg).values())


def _mudd_bias_init():
    """mudd_b2's initial value (L1326-1338): biases in the pre-scaled domain (effective = 0.1 x)."""
    b = torch.zeros(2, MUDD_COEFS)
    b[0, 6] = b[0, 7] = 2.0 / MUDD_SCALE  # layer-10 ve gate lanes
    b[0, 8] = b[0, 12] = 1.1 ** 0.5 / MUDD_SCALE  # layer-10 residual lambdas (attn, mlp)
    b[0, 9] = b[0, 13] = 1.0 / MUDD_SCALE  # layer-10 post lambdas (attn, mlp)
    b[0, 11] = 0.05 / MUDD_SCALE  # layer-10 bigram lambda; b[0, 10] (x0 lambda) stays 0
    b[1, 1] = -0.5 / MUDD_SCALE  # post-loop coefficient of cache[7] (the former backout)
    return b


def ref_initial_weights(cfg, seed=0):
    """The reference's initial parameters and sign table as float64, reproducing
    `torch.manual_seed(seed); GPT(...)` on CPU RNG call for RNG call (L1152-1339; the reference
    itself never seeds), then the storage casts of L2109-2119 (bf16 except the six fp32 tensors)."""
    g = torch.Generator().manual_seed(seed)
    S = ref_param_shapes(cfg)
    D, V = cfg.model_dim, cfg.vocab
    W = {}
    head = torch.empty(S["lm_head.weight"], dtype=BF16).normal_(0, 0.005, generator=g)  # L1164
    torch.empty(V, D).normal_(generator=g)  # nn.Embedding's own init, overwritten by the tie (L1169)
    W["lm_head.weight"], W["embed.weight"] = head, head.T.clone()
    W["value_embeds"] = 0.01 * torch.randn(S["value_embeds"], dtype=BF16, generator=g)  # bf16 math
    W["attn_gate_bank"], W["ve_gate_bank"] = torch.zeros(S["attn_gate_bank"]), torch.zeros(S["ve_gate_bank"])
    bound = 3 ** 0.5 * (0.5 * D ** -0.5)  # L1222-1223
    for name, real in (("qk_bank", cfg.num_qk_groups), ("vo_bank", cfg.num_vo)):
        bank = torch.zeros(S[name])  # padding matrices stay zero
        bank[:real].uniform_(-bound, bound, generator=g)
        W[name] = bank
    mlp = torch.zeros(S["mlp_bank"])
    mlp[:, 0].uniform_(-bound, bound, generator=g)  # c_fc of all 12 (the padding layer too); c_proj 0
    W["mlp_bank"] = mlp
    for name in ("smear_gate.weight", "skip_gate.weight"):  # nn.Linear's init draws, then zeros_
        torch.nn.init.kaiming_uniform_(torch.empty(S[name]), a=math.sqrt(5), generator=g)
        W[name] = torch.zeros(S[name])
    torch.empty(S["bigram_embed.weight"]).normal_(generator=g)  # nn.Embedding's init, then zeros_
    W["bigram_embed.weight"] = torch.zeros(S["bigram_embed.weight"])
    signs = torch.randn(cfg.bigram_sign_table_rows, cfg.bigram_dim, generator=g).sign().to(BF16)
    L = NUM_LAYERS
    W["post_lambdas"] = torch.ones(L, 2)
    W["x0_lambdas"] = torch.zeros(L)
    W["bigram_lambdas"] = 0.05 * torch.ones(L)
    W["resid_lambdas"] = torch.full((L, 2), 1.1 ** 0.5)  # fp32; the forward rounds it to bf16
    W["xsa_alphas"] = torch.zeros(L, cfg.num_heads)
    pad = S["scalars"][0] - (2 * L + 2)
    W["scalars"] = torch.cat([torch.tensor([0.5, 1.0]).repeat(L), torch.zeros(1), -1.5 * torch.ones(1), torch.ones(pad)])
    w1 = torch.empty(S["mudd_w1"])
    for j in range(2):
        torch.nn.init.kaiming_uniform_(w1[j], a=math.sqrt(5), generator=g)  # U(-1/sqrt(D), 1/sqrt(D))
    W["mudd_w1"], W["mudd_w2"], W["mudd_b2"] = w1, torch.zeros(S["mudd_w2"]), _mudd_bias_init()
    out = {}
    for name in REF_PARAM_NAMES:
        t = W[name] if name in FP32_PARAMS else W[name].to(BF16)
        assert tuple(t.shape) == S[name], name
        out[name] = t.to(F64)
    out["bigram_sign_table"] = signs.to(F64)
    return out


def ref_random_weights(cfg, seed=0, storage_dtypes=True):
    """Every parameter random and non-zero, at scales where each piece of the model visibly moves
    the logits; plus a random +-1 sign table. storage_dtypes: values rounded to the reference's
    storage dtype (bf16, or fp32 for the six fp32 tensors), so an implementation that stores them
    that way holds exactly these values (the fp32 lambdas still differ from their bf16 roundings)."""
    g = torch.Generator().manual_seed(seed)
    S = ref_param_shapes(cfg)
    bound = 3 ** 0.5 * (0.5 * cfg.model_dim ** -0.5)
    mudd_bound = cfg.model_dim ** -0.5
    # name: ("normal", std, mean) or ("uniform", low, high)
    spec = {
        "value_embeds": ("normal", 0.5, 0.0), "attn_gate_bank": ("normal", 0.5, 0.0),
        "ve_gate_bank": ("normal", 0.5, 0.0), "qk_bank": ("uniform", -bound, bound),
        "vo_bank": ("uniform", -bound, bound), "mlp_bank": ("uniform", -bound, bound),
        "post_lambdas": ("uniform", 0.5, 1.5), "x0_lambdas": ("uniform", 0.1, 0.5),
        "bigram_lambdas": ("uniform", 0.1, 0.5), "resid_lambdas": ("uniform", 0.7, 1.3),
        "xsa_alphas": ("uniform", 0.3, 1.2), "scalars": ("uniform", 0.5, 1.5),
        "mudd_w1": ("uniform", -mudd_bound, mudd_bound), "mudd_w2": ("normal", 0.5, 0.0),
        "mudd_b2": ("normal", 1.0, 0.0), "lm_head.weight": ("normal", 0.3, 0.0),
        "embed.weight": ("normal", 1.0, 0.0), "smear_gate.weight": ("normal", 0.5, 0.0),
        "skip_gate.weight": ("normal", 0.5, 0.0), "bigram_embed.weight": ("normal", 0.5, 0.0),
    }
    W = {}
    for name in REF_PARAM_NAMES:
        kind, a, b = spec[name]
        if kind == "normal":
            W[name] = torch.randn(S[name], generator=g, dtype=F64) * a + b
        else:
            W[name] = torch.rand(S[name], generator=g, dtype=F64) * (b - a) + a
    W["xsa_alphas"] *= torch.randint(0, 2, S["xsa_alphas"], generator=g) * 2 - 1  # both signs
    W["mudd_b2"] += _mudd_bias_init().to(F64)  # around the init: coefficients of order 1
    L = NUM_LAYERS
    W["scalars"][2 * L] = 0.6 + 0.1 * torch.rand((), generator=g, dtype=F64)  # smear lambda
    W["scalars"][2 * L + 1] = -0.5 + 0.1 * torch.rand((), generator=g, dtype=F64)  # skip lambda
    signs = torch.randint(0, 2, (cfg.bigram_sign_table_rows, cfg.bigram_dim), generator=g)
    W["bigram_sign_table"] = (signs * 2 - 1).to(F64)
    if storage_dtypes:
        for name in REF_PARAM_NAMES:
            W[name] = W[name].to(F32 if name in FP32_PARAMS else BF16).to(F64)
    return W


# ----------------------------------------------------------------------------------------------
# Bigram hash (get_bigram_hash, L1652-1667)

BIGRAM_MUL_CUR, BIGRAM_MUL_PREV = 36313, 27191


def _wrap_int32(v):
    return (v + 2 ** 31) % 2 ** 32 - 2 ** 31


def ref_bigram_hash(input_ids, bigram_vocab_size):
    """hash[0] = bigram_vocab_size - 1 (reserved); hash[t] = (36313 x[t] XOR 27191 p[t]) mod
    (bigram_vocab_size - 1), products wrapped to int32 and a floor modulo (torch's % on int32).
    p[t] is x[t-1] except at t = 1: the reference writes the reserved index into position 0 before
    it reads the previous tokens (L1665-1666), so position 1's previous token is that index."""
    mod = bigram_vocab_size - 1
    x = np.asarray(input_ids, dtype=np.int64)
    prev = np.concatenate([[mod], x[1:-1]])  # the already-overwritten buffer, shifted by one
    cur = _wrap_int32(BIGRAM_MUL_CUR * x[1:])
    mixed = np.bitwise_xor(cur, _wrap_int32(BIGRAM_MUL_PREV * prev))
    out = np.concatenate([[mod], np.mod(mixed, mod)])  # np.mod floors like torch.remainder
    return torch.from_numpy(out.astype(np.int32))


def ref_sign_index(input_ids, rows):
    """Row of the sign table per position: (x[t-1] XOR x[t]) mod rows, 0 at position 0 (L1429-1430)."""
    x = input_ids.long()
    idx = torch.zeros_like(x)
    idx[1:] = torch.bitwise_xor(x[:-1], x[1:]) % rows
    return idx


# ----------------------------------------------------------------------------------------------
# Rotary embedding with YaRN (class Yarn, L981-1048)

class RefYarn:
    """Rotary tables of the reference: fp32 frequencies (half the pairs rotate, half are
    stationary), cos/sin of fp32 angles rounded to bf16 (the buffers are bf16), and the
    attention scale as a Python float. Paired: row t holds [angles at 2t | angles at 2t+1], so in a
    (T, H/2, 2*head_dim) view the first head of each pair rotates at 2t, the second at 2t+1."""

    def __init__(self, head_dim, max_seq_len, paired=False):
        self.head_dim, self.max_seq_len, self.paired = head_dim, max_seq_len, paired
        self.reset()

    def reset(self):
        hd = self.head_dim
        freq = (1 / 1024) ** torch.linspace(0, 1, steps=hd // 4, dtype=F32)  # fp32 pow, as L999
        self.angular_freq = torch.cat([freq.repeat_interleave(2), torch.zeros(hd // 2, dtype=F32)])
        self._tables()
        self.attn_scale = 0.1  # L1028

    def _tables(self):
        t = torch.arange(2 * self.max_seq_len, dtype=F32)
        if self.paired:
            even, odd = torch.outer(2 * t, self.angular_freq), torch.outer(2 * t + 1, self.angular_freq)
            cos, sin = torch.cat([even.cos(), odd.cos()], -1), torch.cat([even.sin(), odd.sin()], -1)
        else:
            theta = torch.outer(t, self.angular_freq)
            cos, sin = theta.cos(), theta.sin()
        self.factor1 = round_bf16(cos)
        sin = round_bf16(sin)
        sin[..., 1::2] *= -1  # L1025: the second element of each pair gets -sin
        self.factor2 = sin

    def apply(self, old_window, new_window, alpha=1, beta=32):
        """Window change in tokens (L1030-1048): frequencies with fewer than alpha rotations over
        the old window are scaled by old/new, those above beta kept, a linear ramp between."""
        rotations = old_window * self.angular_freq / (2 * torch.pi)
        ratio = old_window / new_window
        ramp = torch.clamp((rotations - alpha) / (beta - alpha), 0, 1)
        self.angular_freq = self.angular_freq * (ratio + ramp * (1 - ratio))
        self._tables()
        self.attn_scale *= 0.2 * math.log(new_window / old_window) + 1

    def rotary(self, x):
        """x: (T, heads, width) with width = head_dim, or 2 * head_dim when paired."""
        T = x.size(0)
        c, s = self.factor1[:T, None, :], self.factor2[:T, None, :]
        swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)  # (x1, x0) in every pair
        return c * x + s * swapped


def ref_yarns(cfg, max_seq_len, transitions=()):
    """The (normal, paired) rotary states after the given window transitions in tokens."""
    yarn, paired = RefYarn(cfg.head_dim, max_seq_len), RefYarn(cfg.head_dim, max_seq_len, paired=True)
    for old, new in transitions:
        yarn.apply(old, new)
        paired.apply(old, new)
    return yarn, paired


# ----------------------------------------------------------------------------------------------
# The forward pass (GPT.forward, L1380-1566)

def rms_norm(x, eps):
    return x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps)


def doc_ids(cu_seqlens, T):
    """Document index of each position from cumulative lengths (padding repeats ignored)."""
    cu = torch.as_tensor(cu_seqlens).long()
    assert cu[0] == 0 and cu.max() == T
    return torch.bucketize(torch.arange(T), cu[1:], right=True)


def varlen_attention(q, k, v, docs, window, scale):
    """FlashAttention varlen with causal=True, window_size=(window, 0): query t sees the keys
    s of its own document with t - window <= s <= t. q, k, v: (T, h, d)."""
    T = q.size(0)
    t, s = torch.arange(T)[:, None], torch.arange(T)[None, :]
    allowed = (docs[:, None] == docs[None, :]) & (s <= t) & (s >= t - window)
    scores = torch.einsum("thd,shd->hts", q, k) * scale
    probs = scores.masked_fill(~allowed, -math.inf).softmax(-1)
    return torch.einsum("hts,shd->thd", probs, v)


def _attention(cfg, x, w, sa, gate_w, aux_v, xsa_alpha, window, key_offset, paired, yarn, docs):
    """CausalSelfAttention.forward (L1075-1135) on the normed input x (T, D)."""
    T, D, H, hd = x.size(0), cfg.model_dim, cfg.num_heads, cfg.head_dim
    q, k, v = F.linear(x, sa[0] * w[: 3 * D]).view(T, 3 * H, hd).chunk(3, dim=1)
    q, k = rms_norm(q, cfg.norm_eps), rms_norm(k, cfg.norm_eps)
    if not paired:
        q, k = yarn.rotary(q), yarn.rotary(k)
        if key_offset:  # L1095: the stationary half of each key comes from the previous position
            # (across document starts too). Under torch.compile this is a shift by one; eager
            # PyTorch would propagate k[0] through the overlapping copy.
            k = torch.cat([k[:, :, : hd // 2], torch.cat([k[:1, :, hd // 2:], k[:-1, :, hd // 2:]])], -1)
        if aux_v is not None:
            v = v + aux_v.view(T, H, hd)
        y = varlen_attention(q, k, v, docs, window, yarn.attn_scale)
        if xsa_alpha is not None:  # gated XSA (L1127-1131); the record rounds tanh(alpha) to bf16
            # through .type_as(y), the activation dtype: a float64 model does not
            vn = F.normalize(v, dim=-1, eps=1e-4)
            y = y - torch.tanh(xsa_alpha)[None, :, None] * (y * vn).sum(-1, keepdim=True) * vn
    else:
        # Paired heads (L1100-1118). Memory order of q/k/v is (T, H, hd). Rotary runs on head pairs
        # (2p, 2p+1) viewed as (T, H/2, 2*hd): head h at time t gets rotary position 2t + h % 2.
        # The (2T, H/2, hd) view then puts heads 0..H/2-1 at row 2t and heads H/2..H-1 at row 2t+1:
        # slot j attends over the interleaved stream of heads j and j + H/2 (for H = 2 that is the
        # rotary pair; for H = 6 the slots hold heads (0,3), (1,4), (2,5)). Documents and window are
        # in doubled positions; the window is not doubled.
        q = yarn.rotary(q.reshape(T, H // 2, 2 * hd)).reshape(2 * T, H // 2, hd)
        k = yarn.rotary(k.reshape(T, H // 2, 2 * hd)).reshape(2 * T, H // 2, hd)
        v = v.reshape(2 * T, H // 2, hd)
        if aux_v is not None:
            v = v + aux_v.reshape(2 * T, H // 2, hd)
        y = varlen_attention(q, k, v, docs.repeat_interleave(2), window, yarn.attn_scale).reshape(T, H, hd)
    y = y * torch.sigmoid(F.linear(x[:, :GATE_IN], gate_w))[:, :, None]  # per-head output gate
    return F.linear(y.reshape(T, D), sa[1] * w[3 * D:])


def _mudd(W, x, block, n):
    """forward_mudd (L1341-1345): n per-token coefficients, each (T, 1)."""
    h = F.gelu(F.linear(x, W["mudd_w1"][block]))
    return ((F.linear(h, W["mudd_w2"][block, :n]) + W["mudd_b2"][block, :n]) * MUDD_SCALE).split(1, dim=-1)


def relu2_mlp(x, w_fc, w_proj):
    """relu(x W_fc^T)^2 W_proj with both (4D, D) matrices of the bank (L2913-2960)."""
    return F.relu(x @ w_fc.T).square() @ w_proj


def layer_attention_weights(cfg, W, layer):
    """The (4D, D) [Q; K; V; O] matrix of an attention layer (L1417-1419, L1472): Q and K rows from
    the qk bank's head-pair matrices, V and O from the vo bank; layer 6 has none."""
    assert layer != SKIP_LAYER
    j = layer - (layer > SKIP_LAYER)
    qk = W["qk_bank"][: cfg.num_qk_groups].reshape(NUM_LAYERS - 1, 2 * cfg.model_dim, cfg.model_dim)
    vo = W["vo_bank"][: cfg.num_vo].reshape(NUM_LAYERS - 1, 2 * cfg.model_dim, cfg.model_dim)
    return torch.cat([qk[j], vo[j]])


def mtp_loss(capped, targets, weights):
    """The fused kernel's training loss (L3303-3316), summed over positions: row t adds
    w_k * (lse_t - z_t[targets[t + k]]) for every k with t + k inside the batch (documents are not
    respected: the targets of the next document count)."""
    lse = torch.logsumexp(capped, -1)
    T, total = capped.size(0), capped.new_zeros(())
    for k, w in enumerate(weights):
        z = capped[: T - k].gather(1, targets[k:].long()[:, None])[:, 0]
        total = total + w * (lse[: T - k] - z).sum()
    return total


def ref_forward(W, cfg, input_ids, target_ids, cu_seqlens, ws_short_tokens, ws_long_tokens, yarn, yarn_paired,
                mtp_weights=(1.0,), training=False, mlp_fp8=None, fp8_head=False, eval_loss_dtype=F64):
    """GPT.forward in float64 -> (loss, logits before the softcap, softcapped logits), all (T, V).

    training: the summed multi-token-prediction loss (what model(...).sum() is, before grad_scale);
    else the mean cross-entropy (the reference casts the softcapped logits to fp32 first: pass
    eval_loss_dtype=torch.float32 for that). mlp_fp8: a RefFP8MLP whose state the training
    forward's MLPs use and update (the reference's FP8 path); fp8_head: the FP8 head of training."""
    L, D, H, hd, bd = NUM_LAYERS, cfg.model_dim, cfg.num_heads, cfg.head_dim, cfg.bigram_dim
    T = input_ids.numel()
    assert T % 16 == 0  # L1078
    ids = input_ids.long()
    docs = doc_ids(cu_seqlens, T)
    norm = lambda t: rms_norm(t, cfg.norm_eps)
    windows = {i: ws_long_tokens if i in (3, 10) else ws_short_tokens for i in range(L) if i != SKIP_LAYER}  # L1387
    # Parameters cast in the forward (L1399-1407): four lambda tensors rounded to bf16; the scalars
    # (attention lambdas, smear, skip) used in fp32.
    resid, post = round_bf16(W["resid_lambdas"]), round_bf16(W["post_lambdas"])
    x0_l, bigram_l = round_bf16(W["x0_lambdas"]), round_bf16(W["bigram_lambdas"])
    sa = W["scalars"][: 2 * L].view(L, 2)
    smear_l, skip_l = W["scalars"][2 * L], W["scalars"][2 * L + 1]

    bigram_idx = ref_bigram_hash(input_ids, cfg.bigram_vocab_size).long()
    signs = W["bigram_sign_table"][ref_sign_index(input_ids, cfg.bigram_sign_table_rows)]
    x0_bigram = W["bigram_embed.weight"][bigram_idx] * signs  # (T, bigram_dim), L1432
    ve_all = W["value_embeds"].view(5, cfg.vocab, D)[:, ids]
    ve = {layer: ve_all[table] for layer, table in VE_TABLE_OF_LAYER.items()}

    e = W["embed.weight"][ids]
    smear = smear_l * torch.sigmoid(F.linear(e[1:, :GATE_IN], W["smear_gate.weight"]))  # gate reads token t

    def add_bigram(x, scale):  # the in-place update of the first bigram_dim channels
        return torch.cat([x[:, :bd] + x0_bigram * scale, x[:, bd:]], -1)

    x = norm(torch.cat([e[:1], e[1:] + smear * e[:-1]]))  # adds token t-1 (across documents too)
    # L1443-1446: x and x0 are one tensor, so the bigram injection in place lands in x0 (and cache[0])
    x = x0 = add_bigram(x, bigram_l[0])
    skip_gate = torch.sigmoid(skip_l) * 2 * torch.sigmoid(F.linear(x0[:, :GATE_IN], W["skip_gate.weight"]))
    cache = {0: x}

    for i in range(L):
        mu = None
        if i == SKIP_LAYER:
            x = x + skip_gate * cache[3]
        else:
            attn_in = norm(cache[7] if 7 in cache else x)  # layers 8-10 attend over norm(cache[7])
            aux_v = None
            if i == MUDD_LAYER:  # L1476-1485
                cache[9] = x
                mu = _mudd(W, x, 0, MUDD_COEFS)
                v_mudd = mu[0] * cache[0] + mu[1] * cache[7] + mu[2] * x
                x = (1 + mu[5]) * x + mu[3] * cache[0] + mu[4] * cache[7]
                lane = torch.cat([mu[6], mu[7]], -1).repeat_interleave(H // 2, -1)  # heads: first half lane 6
                aux_v = (lane[:, :, None] * ve[i].view(T, H, hd)).reshape(T, D) + v_mudd
            elif i in VE_GATE_OF_LAYER:  # L1486-1491
                gate_in = torch.cat([attn_in[:, :VE_GATE_HALF], ve[i][:, :VE_GATE_HALF]], -1)
                lane = 2 * torch.sigmoid(F.linear(gate_in, W["ve_gate_bank"][VE_GATE_OF_LAYER[i]]))
                aux_v = (lane[:, :, None] * ve[i].view(T, H, hd)).reshape(T, D)
            gate_row = i - (i > SKIP_LAYER)  # L1410
            a = _attention(cfg, attn_in, layer_attention_weights(cfg, W, i), sa[i], W["attn_gate_bank"][gate_row],
                           aux_v, W["xsa_alphas"][i] if i in XSA_LAYERS else None, windows[i], i in (3, 10),
                           i in PAIRED_LAYERS, yarn_paired if i in PAIRED_LAYERS else yarn, docs)
            if mu is not None:  # L1508-1510
                x = add_bigram(mu[8] * x + mu[9] * a + mu[10] * cache[0], mu[11])
            else:  # L1512-1514
                x = resid[i, 0] * x + post[i, 0] * a + x0 * x0_l[i]
                if i > 0:
                    x = add_bigram(x, bigram_l[i])
        normed = norm(x)
        w_fc, w_proj = W["mlp_bank"][i, 0], W["mlp_bank"][i, 1]
        m = mlp_fp8.mlp(i, normed) if (training and mlp_fp8 is not None) else relu2_mlp(normed, w_fc, w_proj)
        x = mu[12] * x + mu[13] * m if mu is not None else resid[i, 1] * x + post[i, 1] * m
        if i in CACHE_LAYERS:
            cache[i] = x
    if training and mlp_fp8 is not None:
        mlp_fp8.end_forward()

    mu = _mudd(W, x, 1, 5)  # L1552-1554
    x = x + mu[0] * cache[0] + mu[1] * cache[7] + mu[2] * cache[9] + mu[3] * ve[1] + mu[4] * cache[3]
    x = norm(x)
    if training and fp8_head:
        logits = ref_fp8_head_logits(x, W["lm_head.weight"])
    else:
        logits = x @ W["lm_head.weight"]
    capped = SOFTCAP_A * torch.sigmoid((logits + SOFTCAP_B) / SOFTCAP_C)
    if training:
        loss = mtp_loss(capped, target_ids, [f32(w) for w in mtp_weights])
    else:
        loss = F.cross_entropy(capped.to(eval_loss_dtype), target_ids.long()).to(F64)
    return loss, logits, capped


# ----------------------------------------------------------------------------------------------
# Schedules (TrainingSchedule, TRAINING_STAGES, get_muon_momentum, TrainingManager; L1782-2030)

@dataclass(frozen=True)
class RefStage:
    lr_mul: float
    batch_size: int
    windows: tuple  # (short, long) blocks
    mtp_start: tuple
    mtp_end: tuple
    max_seq_len: int
    duration: float = None


REF_STAGES = (
    RefStage(1.0, 8 * 2048 * 8, (1, 3), (1.0, 0.5, 0.25), (1.0, 0.5, 0.0), 896, 1 / 3),
    RefStage(1.52, 16 * 2048 * 8, (3, 7), (1.0, 0.5), (1.0, 0.0), 2048, 1 / 3),
    RefStage(1.73, 24 * 2048 * 8, (5, 11), (1.0,), (1.0,), 2048, 1 / 3),
    RefStage(1.0, 24 * 2048 * 8, (6, 13), (1.0,), (1.0,), 2048),  # extension; its lr_mul is unused
)
REF_SCHEDULED, REF_EXTENSION = 1380, 10
REF_TOTAL = REF_SCHEDULED + REF_EXTENSION
REF_COOLDOWN_FRAC, REF_LR_FLOOR = 0.60, 0.15
REF_FINAL_VAL_WS = (6, 20)  # short stays at the extension's 6 blocks; long widened without YaRN
REF_VAL_EVERY = 250


def _stage_ends():
    ends, c = [0], 0.0
    for s in REF_STAGES[:-1]:  # itertools.accumulate of the durations, then round(c * 1380)
        c += s.duration
        ends.append(round(c * REF_SCHEDULED))
    assert ends[-1] == REF_SCHEDULED
    return ends + [REF_TOTAL]


REF_STAGE_ENDS = tuple(_stage_ends())  # (0, 460, 920, 1380, 1390)
REF_SPLIT_STEP = REF_STAGE_ENDS[2] | 1  # 921: untie at stage 2's start, made odd (an Adam step)
REF_WARMUP_STEPS = tuple(sorted({0, 1} | {s + o for s in REF_STAGE_ENDS[1:-1] for o in (-2, -1, 0, 1) if s + o >= 2}))


def ref_lookup(step):
    """(stage index, fraction of the stage elapsed); steps past the end: the last stage, 1.0."""
    for i in range(len(REF_STAGES)):
        start, end = REF_STAGE_ENDS[i], REF_STAGE_ENDS[i + 1]
        if step < end:
            return i, (step - start) / (end - start)
    return len(REF_STAGES) - 1, 1.0


def ref_get_lr(step):
    lr = REF_STAGES[ref_lookup(step)[0]].lr_mul
    cd_start = int(REF_SCHEDULED * (1 - REF_COOLDOWN_FRAC))  # 552
    if step >= cd_start:
        t = min(1.0, (step - cd_start) / (REF_SCHEDULED - cd_start))
        lr = lr * (1 - t) + REF_LR_FLOOR * t
    return lr


def ref_muon_momentum(step, warmup=300, cooldown=50, low=0.85, high=0.95):
    cd_start = REF_TOTAL - cooldown
    if step < warmup:
        return low + step / warmup * (high - low)
    if step > cd_start:
        return high - (step - cd_start) / cooldown * (high - low)
    return high


def ref_mtp_weights(step):
    """Per-stage linear interpolation, stored as an fp32 tensor (L1822-1826)."""
    i, t = ref_lookup(step)
    s = REF_STAGES[i]
    return tuple(f32(a + (b - a) * t) for a, b in zip(s.mtp_start, s.mtp_end))


def _schedule_table():
    rows, ws_long, batch = [], REF_STAGES[0].windows[1], (REF_STAGES[0].batch_size, REF_STAGES[0].max_seq_len)
    for step in range(REF_TOTAL + 1):
        i, t = ref_lookup(step)
        stage = REF_STAGES[i]
        short, long = stage.windows
        transition = (ws_long * 128, long * 128) if long != ws_long else None  # yarn.apply in tokens
        loader = (stage.batch_size, stage.max_seq_len)
        send = loader if loader != batch else None
        ws_long, batch = long, loader
        last = step == REF_TOTAL
        val = last or step % REF_VAL_EVERY == 0
        rows.append(dict(
            step=step, stage=i, stage_t=t, lr=ref_get_lr(step), muon_momentum=ref_muon_momentum(step),
            batch_size=stage.batch_size, train_max_seq_len=stage.max_seq_len, ws_short=short, ws_long=long,
            mtp_weights=ref_mtp_weights(step), yarn_transition=transition, loader_send=send,
            train_step=not last, adam_step=step % 2 == 1, split_step=step == REF_SPLIT_STEP,
            tied_update=step <= REF_SPLIT_STEP,  # lm_head/embed share one update up to and incl. 921
            fp8_bootstrap_after=step < 16,  # quantize_mlp_fp8(bootstrap_down=(step < 16)) after the step
            val_step=val, val_ws=(REF_FINAL_VAL_WS if last else (short, long)) if val else None,
        ))
    return rows


_SCHEDULE = None


def ref_schedule(step):
    """Every schedule value at a step 0..1390, after advance_schedule(step). Windows in blocks
    (tokens = blocks * 128); yarn_transition in tokens; 1390 only validates, with (6, 20) blocks."""
    global _SCHEDULE
    if _SCHEDULE is None:
        _SCHEDULE = _schedule_table()
    return dict(_SCHEDULE[step])


# ----------------------------------------------------------------------------------------------
# Optimizers (NorMuonAndAdam, L346-940; the table, L1894-1945)

REF_ADAM_DEFAULTS = dict(lr=0.008, eps=1e-10, weight_decay=0.005)
REF_NORMUON_DEFAULTS = dict(lr=0.023, momentum=0.95, beta2=0.9, weight_decay=1.2)


def _row(optim, comms, betas=None, lr_mul=1.0, wd_mul=1.0):
    return dict(optim=optim, comms=comms, adam_betas=betas, lr_mul=lr_mul, wd_mul=wd_mul)


REF_PARAM_TABLE = {  # dict order = the scatter order; defaults (lr_mul 1, wd_mul 1) filled in
    "qk_bank": _row("normuon", "sharded"),
    "vo_bank": _row("normuon", "sharded"),
    "mlp_bank": _row("normuon", "sharded"),
    "scalars": _row("adam", "replicated", (0.9, 0.99), 5.0, 0.0),
    "smear_gate": _row("adam", "replicated", (0.9, 0.99), 0.01, 0.0),
    "skip_gate": _row("adam", "replicated", (0.9, 0.99), 0.05, 0.0),
    "attn_gate_bank": _row("adam", "replicated", (0.9, 0.99)),
    "ve_gate_bank": _row("adam", "replicated", (0.9, 0.99)),
    "lm_head": _row("adam", "sharded", (0.5, 0.95), 1.0, 150.0),
    "bigram_embed": _row("adam", "sharded_sparse", (0.75, 0.95), 75.0, 5.0),
    "post_lambdas": _row("adam", "replicated", (0.9, 0.95), 1.0, 0.0),
    "x0_lambdas": _row("adam", "replicated", (0.9, 0.95), 1.0, 0.0),
    "bigram_lambdas": _row("adam", "replicated", (0.9, 0.95), 1.0, 0.0),
    "resid_lambdas": _row("adam", "replicated", (0.9, 0.95), 5.0, 0.0),
    "xsa_alphas": _row("adam", "replicated", (0.9, 0.95), 1.0, 0.0),
    "value_embeds": _row("adam", "sharded", (0.75, 0.95), 75.0, 5.0),
    "embed": _row("adam", "sharded", (0.5, 0.95), 1.0, 150.0),
    "mudd_w1": _row("adam", "replicated", (0.9, 0.99), 0.25),
    "mudd_w2": _row("adam", "replicated", (0.9, 0.99), 0.25),
    "mudd_b2": _row("adam", "replicated", (0.9, 0.99), 0.25, 0.0),
}
REF_WORK_ORDER = (
    "scalars", "smear_gate", "skip_gate", "attn_gate_bank", "ve_gate_bank", "mudd_b2", "xsa_alphas", "post_lambdas",
    "x0_lambdas", "bigram_lambdas", "resid_lambdas", "mudd_w2", "value_embeds", "bigram_embed", "mudd_w1", "lm_head",
    "embed", "qk_bank", "vo_bank", "mlp_bank",
)


def ref_adam_step(p, grad, state, label, lr_step, table=REF_PARAM_TABLE):
    """One Adam update (L821-858), float64. state: {} on the first call (filled with step,
    exp_avg, exp_avg_sq). lr = 0.008 * lr_step * lr_mul; the step size lr * sqrt(1 - b2^t) /
    (1 - b1^t) and the decay lr^2 * wd * wd_mul are rounded to fp32 (0-D fp32 tensors); eps is
    added to the uncorrected sqrt(v); decay only where update and parameter agree in sign (> 0).
    Returns the new parameter."""
    row = table[label]
    b1, b2 = row["adam_betas"]
    lr = REF_ADAM_DEFAULTS["lr"] * lr_step * row["lr_mul"]
    if not state:
        state.update(step=0, exp_avg=torch.zeros_like(p, dtype=F64), exp_avg_sq=torch.zeros_like(p, dtype=F64))
    state["step"] += 1
    t = state["step"]
    step_size = f32(lr * ((1 - b2 ** t) ** 0.5 / (1 - b1 ** t)))
    eff_wd = f32(lr * lr * REF_ADAM_DEFAULTS["weight_decay"] * row["wd_mul"])
    g = grad.to(F64)
    state["exp_avg"] = b1 * state["exp_avg"] + (1 - b1) * g
    state["exp_avg_sq"] = b2 * state["exp_avg_sq"] + (1 - b2) * g * g
    update = state["exp_avg"] / (state["exp_avg_sq"].sqrt() + REF_ADAM_DEFAULTS["eps"]) * step_size
    update = update + eff_wd * p * (update * p > 0)
    return p - update


POLAR_EXPRESS_COEFFS = (  # L161-167 (5 iterations, safety 2e-2, cushion 2)
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


def ref_polar_express(g, dtype=F64):
    """Orthogonalize each trailing matrix (L187-248): Frobenius-normalize with a 2% margin and
    1e-6, then X <- aX + X(bA + cA^2) with A = X^T X for tall matrices, X <- aX + (bA + cA^2)X with
    A = X X^T otherwise (square counts as wide). The reference runs this in bf16."""
    X = g.to(dtype)
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * (1 + 2e-2) + 1e-6)
    tall = X.size(-2) > X.size(-1)
    for a, b, c in POLAR_EXPRESS_COEFFS:
        A = X.mT @ X if tall else X @ X.mT
        B = b * A + c * (A @ A)
        X = a * X + (X @ B if tall else B @ X)
    return X


def normuon_red_dim(shape):
    """Dimension the second moment averages over: columns (-1) unless the matrix is wide."""
    return -1 if shape[-2] >= shape[-1] else -2


def ref_variance_reduction(v, second_moment, beta2=0.9):
    """NorMuon's normalization (L929-940): per-row (or per-column, for wide matrices) mean squares
    feed an EMA (beta2); v is rescaled by EMA^-1/2 and then back to its own Frobenius norm.
    Returns (new v, new second moment)."""
    dim = normuon_red_dim(v.shape)
    n = v.size(dim)
    mean_sq = v.square().mean(dim, keepdim=True)
    norm = (mean_sq.sum((-2, -1), keepdim=True) * n).sqrt()
    second_moment = second_moment + (1 - beta2) * (mean_sq - second_moment)
    inv = second_moment.clamp_min(1e-10).rsqrt()
    new_norm = (mean_sq * n * inv.square()).sum((-2, -1), keepdim=True).sqrt()
    return v * (inv * norm / new_norm.clamp_min(1e-10)), second_moment


def ref_normuon_shape(label, param_shape):
    """The reshape NorMuon sees: the bank itself, except mlp_bank as (24, 4D, D) (L1235)."""
    if label == "mlp_bank":
        return (param_shape[0] * param_shape[1], *param_shape[2:])
    return tuple(param_shape)


def ref_normuon_lr_muls(label, shape):
    """Per-matrix lr multipliers: sqrt(max(1, rows / cols)) of the matrix shape (L503; the chunk
    shape's last two dims equal the reshape's), times 2 on the odd matrices of mlp_bank (c_proj)."""
    shape_mult = max(1.0, shape[-2] / shape[-1]) ** 0.5
    per_matrix = [2.0 if (label == "mlp_bank" and i % 2 == 1) else 1.0 for i in range(shape[0])]
    return [shape_mult * REF_PARAM_TABLE[label]["lr_mul"] * m for m in per_matrix]


def ref_mantissa_update(p_bf16, mantissa, v, eff_wd, eff_lr):
    """The reference's parameter write (L909-925), exactly in fp32: a bf16 parameter and a uint16
    buffer (here int32 holding 0..65535) are the high and low halves of one fp32 master value w.
    w <- w - w * [v w >= 0] * eff_wd * eff_lr - v * eff_lr (fp32, this order); the parameter keeps
    w's high 16 bits (truncation toward zero, not rounding), the buffer the low 16. So the model
    sees trunc_bf16(w) of an fp32 master weight that starts equal to the bf16 weight.
    eff_wd, eff_lr: fp32-representable floats (scalars or per-matrix tensors broadcastable to p).
    Returns (new bf16 parameter, new mantissa)."""
    high = p_bf16.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    w = ((high << 16) | mantissa.to(torch.int32)).view(F32)
    v = v.to(F32)
    wd, lr = torch.as_tensor(eff_wd, dtype=F32), torch.as_tensor(eff_lr, dtype=F32)
    w = w - (w * (v * w >= 0) * wd * lr) - (v * lr)
    bits = w.view(torch.int32)
    new_p = ((bits >> 16) & 0xFFFF).to(torch.int16).view(BF16)  # arithmetic shift, then mask
    return new_p, bits & 0xFFFF


def ref_normuon_step(param, grad, state, label, lr_step, momentum, polar_dtype=F64, mantissa=False):
    """One NorMuon update of a whole bank (L862-905), float64 unless asked otherwise.

    Per matrix of the reshaped bank: Nesterov momentum (buf <- lerp(buf, g, 1 - m); g <- lerp(g,
    buf, m), m rounded to fp32), Polar Express, variance reduction, then cautious decay and step
    p <- p - p [v p >= 0] eff_wd eff_lr - v eff_lr with eff_lr = fp32(lr_mul_i * lr), eff_wd =
    fp32(1.2 * lr), lr = 0.023 * lr_step (so the decay scales with lr^2 and with the matrix's lr
    multiplier). state: {} on the first call. mantissa=True: param holds bf16 values and the
    update goes through ref_mantissa_update with state['mantissa'] (fp32 then, as the reference).
    Sharding over GPUs does not change the result. Returns the new parameter (param's shape)."""
    shape = ref_normuon_shape(label, param.shape)
    lr = REF_NORMUON_DEFAULTS["lr"] * lr_step
    if not state:
        second = (*shape[:-1], 1) if normuon_red_dim(shape) == -1 else (*shape[:-2], 1, shape[-1])
        state.update(momentum_buffer=torch.zeros(shape, dtype=F64), second_momentum_buffer=torch.zeros(second, dtype=F64),
                     mantissa=torch.zeros(shape, dtype=torch.int32))
    m = f32(momentum)
    g = grad.reshape(shape).to(F64)
    buf = state["momentum_buffer"] + (1 - m) * (g - state["momentum_buffer"])
    state["momentum_buffer"] = buf
    g = g + m * (buf - g)
    v = ref_polar_express(g, polar_dtype).to(F64)
    v, state["second_momentum_buffer"] = ref_variance_reduction(v, state["second_momentum_buffer"],
                                                                REF_NORMUON_DEFAULTS["beta2"])
    eff_lr = torch.tensor([f32(mul * lr) for mul in ref_normuon_lr_muls(label, shape)], dtype=F64).view(-1, 1, 1)
    eff_wd = f32(REF_PARAM_TABLE[label]["wd_mul"] * REF_NORMUON_DEFAULTS["weight_decay"] * lr)
    p = param.reshape(shape)
    if mantissa:
        new_p, state["mantissa"] = ref_mantissa_update(p.to(BF16), state["mantissa"], v, eff_wd, eff_lr.to(F32))
        return new_p.to(F64).reshape(param.shape)
    p = p.to(F64)
    return (p - p * (v * p >= 0) * eff_wd * eff_lr - v * eff_lr).reshape(param.shape)


# ----------------------------------------------------------------------------------------------
# FP8 numerics of the training forward (quantize_mlp_fp8 L1347-1378, the forward L1517-1548, the
# Triton kernels L2652-2823 and L2913-3019, the head L3415-3452)

def to_e4m3(t):
    return t.to(E4M3).to(F64)


def ref_fp8_head_logits(x, w):
    """The FP8 head of training (static scales, L3417-3431): fp8(x / x_s) @ fp8(w / w_s) times the
    scales as the fp32 tensors _scaled_mm receives (quantized with the exact Python floats). The
    divisions run in the inputs' dtype: pass bf16 tensors to divide in bf16 as the reference does
    (it then rounds the logits to bf16, not done here)."""
    acc = to_e4m3(x / HEAD_X_SCALE) @ to_e4m3(w / HEAD_W_SCALE)
    return acc * f32(HEAD_X_SCALE) * f32(HEAD_W_SCALE)


def _headroom_scale(amax, headroom):
    """The Triton reduction's scale: fp32(max(amax, 1e-12)) * fp32(headroom / 448), in fp32."""
    amax = torch.clamp(torch.as_tensor(amax, dtype=F32), min=1e-12)
    return amax * torch.tensor(headroom / E4M3_MAX, dtype=F32)


@dataclass
class RefFP8MLP:
    """The model's FP8 MLP state and its update rules.

    Weights: up projection (c_fc) with current per-layer scaling at every quantize
    (s = amax / 448, computed in the weights' dtype). Down projection (c_proj) with delayed
    scaling: quantize uses next_scales (clamped to +-448, fp32 division) and records them as the
    used scales, then sets next_scales = 1.12 * amax / 448 of the weights it just quantized; with
    bootstrap, next_scales is first set to the current amax / 448 (no headroom). Activations: x is
    scaled by its own amax to 448; the post-ReLU^2 activation is multiplied by fp32(1 / act_scale),
    clamped at 448 and cast, where act_scale is the one the previous training forward left:
    1.80 * amax / 448 of its activation (1.0 before any forward). Give the bank in its storage
    dtype (bf16 in the record) for the weight-side arithmetic to match. Not reproduced (activation
    precision): the record computes 448 / amax and the scaled x in bf16, and rounds the
    pre-activation, its square and the output to bf16."""
    act_scales: torch.Tensor = field(default_factory=lambda: torch.ones(12, dtype=F32))
    down_used: torch.Tensor = field(default_factory=lambda: torch.ones(12, dtype=F32))
    down_next: torch.Tensor = field(default_factory=lambda: torch.ones(12, dtype=F32))
    up_scales: torch.Tensor = None
    up_f8: torch.Tensor = None
    down_f8: torch.Tensor = None
    post_amax: dict = field(default_factory=dict)
    log: list = field(default_factory=list)  # one entry per mlp() call: the scales it used, its output

    def quantize(self, mlp_bank, bootstrap_down):
        up, down = mlp_bank[:, 0], mlp_bank[:, 1]
        n = up.size(0)
        up_scales = up.reshape(n, -1).abs().amax(1).clamp(min=1e-12) / E4M3_MAX  # in the bank's dtype
        self.up_scales = up_scales.to(F32)
        self.up_f8 = to_e4m3(up / up_scales.view(n, 1, 1))
        if bootstrap_down:
            self.down_next = (down.reshape(n, -1).abs().amax(1).clamp(min=1e-12) / E4M3_MAX).to(F32)
        values = down.to(F32)
        self.down_f8 = to_e4m3(torch.clamp(values / self.down_next.view(n, 1, 1), -E4M3_MAX, E4M3_MAX))
        self.down_used = self.down_next.clone()
        self.down_next = _headroom_scale(values.reshape(n, -1).abs().amax(1), 1.12)

    def mlp(self, layer, normed):
        amax = normed.abs().max().clamp(min=1e-12)
        x_f8 = to_e4m3(normed * (E4M3_MAX / amax))
        dequant = (self.up_scales[layer] * amax.to(F32)) / torch.tensor(E4M3_MAX, dtype=F32)  # fp32 buffer math
        post = F.relu((x_f8 @ self.up_f8[layer].T) * dequant.to(F64)).square()
        act = self.act_scales[layer]
        post_f8 = to_e4m3(torch.clamp(post * (1.0 / act).to(F64), max=E4M3_MAX))
        out = (post_f8 @ self.down_f8[layer]) * act.to(F64) * self.down_used[layer].to(F64)
        self.post_amax[layer] = post.max()
        self.log.append(dict(layer=layer, x_amax=float(amax), dequant=float(dequant), act_scale=float(act),
                             down_scale=float(self.down_used[layer]), up_scale=float(self.up_scales[layer]), out=out))
        return out

    def end_forward(self):
        """reduce_mlp_activation_scales(headroom=1.80) over the 11 layers of this forward."""
        for layer, amax in self.post_amax.items():
            self.act_scales[layer] = _headroom_scale(amax.to(F32), 1.80)
        self.post_amax = {}


def ref_fp8_mlp_sequence(banks, inputs, bootstrap_steps=16):
    """Scales and MLP outputs of the training forwards at steps 0, 1, ...

    banks[0]: the bank at the reset (quantized with bootstrap before step 0); banks[s + 1]: the
    bank after step s's optimizer update, quantized with bootstrap_down = (s < bootstrap_steps).
    inputs[s]: the 11 normed MLP inputs of step s's forward (one micro-batch per step, as on 8 GPUs).
    Returns per step {up_scales, down_scales (used), down_next_scales, act_scales (used), outputs}."""
    state = RefFP8MLP()
    state.quantize(banks[0], bootstrap_down=True)
    steps = []
    for s, xs in enumerate(inputs):
        used = dict(up_scales=state.up_scales.clone(), down_scales=state.down_used.clone(),
                    down_next_scales=state.down_next.clone(), act_scales=state.act_scales.clone())
        used["outputs"] = [state.mlp(layer, x) for layer, x in enumerate(xs)]
        state.end_forward()
        steps.append(used)
        if s + 1 < len(banks):
            state.quantize(banks[s + 1], bootstrap_down=s < bootstrap_steps)
    return steps
