"""The record preset computes modded-nanogpt record #89's function (2026-07-17, FP8DownProjection),
checked against tests/reference89.py, a float64 port of its forward pass, schedules and optimizer
formulas written from the record's log, independently of train_gpt.py:

- the forward pass with every weight random, at every stage's windows (YaRN advanced as in a run)
  and at the final validation, in train (the multi-token loss) and eval mode: loss within 1e-6
  relative, logits within 1e-5 of their largest magnitude;
- positive controls: switching off each idea of the recipe moves the logits by at least 100x that;
- every schedule value for steps 0..1389 exactly; the untie step;
- one NorMuon step (a head-pair piece of Q/K, V/O, MLP) and one Adam step of each DistAdam group
  against the reference's formulas; the FP8 MLP's scales and outputs against the port's emulation;
- the parameter count equal to the reference model's, less its padding and its unused row.

Our model computes with a half-split rotary layout ((i, i + d/2) pairs) where the reference pairs
neighbouring dimensions ((2i, 2i + 1)): the same function up to a permutation of each head's Q and
K rows, which the weight mapping below applies (the stationary dimensions, which the key shift
moves, map onto each other).
"""
import dataclasses
import math

import pytest
import torch

import reference89 as ref
import train_gpt as tg

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

F64 = torch.float64
VOCAB, DIM, HEADS, HEAD_DIM, BLOCK = 512, 64, 4, 16, 16
CFG = ref.RefConfig(vocab_size=VOCAB, model_dim=DIM, num_heads=HEADS, head_dim=HEAD_DIM, bigram_vocab_size=2048,
                    bigram_dim=16, bigram_sign_table_rows=64, block_size=BLOCK, world_size=1)
TOY_FLAGS = ["--device", "cpu", "--model_dim", str(DIM), "--num_heads", str(HEADS),
             "--head_dim", str(HEAD_DIM), "--bigram_vocab_size", "2048", "--bigram_dim", "16", "--bigram_sign_rows",
             "64", "--window_block_tokens", str(BLOCK)]
T = 512
CU = torch.tensor([0, 37, 220, 231, T, T, T], dtype=torch.int32)  # documents of 37, 183, 11, 281 tokens

# fp32 (ours) against float64 (the port): an fp32 forward of this depth is good to ~1e-6 relative in
# the loss and ~1e-5 of the largest logit (as for the retie recipe's port)
LOSS_TOL, LOGIT_TOL = 1e-6, 1e-5


def toy_hp(*extra):
    """The record's hyperparameters at toy sizes (a 512-token vocabulary: below the shards' BOS id,
    which parse_args refuses, so it is set afterwards)."""
    return dataclasses.replace(tg.parse_args([*TOY_FLAGS, *map(str, extra)]), vocab_size=VOCAB)


def rotary_permutation(head_dim):
    """Row d of our Q/K head comes from row perm[d] of the reference's head."""
    q = head_dim // 4
    half = head_dim // 2
    perm = [0] * head_dim
    for i in range(q):
        perm[i], perm[half + i] = 2 * i, 2 * i + 1  # the rotating pairs
        perm[q + i], perm[half + q + i] = half + i, half + q + i  # the stationary dimensions
    return torch.tensor(perm)


def load_reference_weights(model, W):
    """Our model holding the port's weights W (reference names and layouts)."""
    L, H, hd, D = 11, HEADS, HEAD_DIM, DIM
    perm = rotary_permutation(hd)
    head_rows = torch.cat([h * hd + perm for h in range(2 * H)])  # Q heads, then K heads
    qk = W["qk_bank"][: CFG.num_qk_groups].reshape(L - 1, 2 * D, D)
    vo = W["vo_bank"][: CFG.num_vo].reshape(L - 1, 2 * D, D)
    ve_gates = dict(ref.VE_GATE_OF_LAYER)
    with torch.no_grad():
        model.lm_head.weight.copy_(W["lm_head.weight"].T)
        model.embed.copy_(W["embed.weight"])
        for i, table in enumerate(W["value_embeds"].view(5, CFG.vocab, D)):
            model.value_embeds[i].copy_(table)
        model.bigram_embed.copy_(W["bigram_embed.weight"])
        model.bigram_signs.copy_(W["bigram_sign_table"])
        model.smear_gate_w.copy_(W["smear_gate.weight"])
        model.skip_gate_w.copy_(W["skip_gate.weight"])
        for name in ("post_lambdas", "x0_lambdas", "bigram_lambdas", "resid_lambdas", "xsa_alphas", "mudd_w1",
                     "mudd_w2", "mudd_b2"):
            getattr(model, name).copy_(W[name])
        model.scalars.copy_(W["scalars"][: model.scalars.numel()])
        for i, layer in enumerate(model.layers):
            layer.fc_w.copy_(W["mlp_bank"][i, 0])
            layer.proj_w.copy_(W["mlp_bank"][i, 1])
            if i == 6:
                continue
            j = i - (i > 6)
            layer.qk_w.copy_(qk[j][head_rows])
            layer.vo_w.copy_(vo[j])
            layer.gate_w.copy_(W["attn_gate_bank"][j])
            if layer.ve_gate_w is not None:
                layer.ve_gate_w.copy_(W["ve_gate_bank"][ve_gates[i]])
    return model


def our_model(*flags):
    torch.manual_seed(0)
    return tg.build_model(toy_hp(*flags), torch.device("cpu"))


def packed_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, VOCAB, (T,), generator=g, dtype=torch.int32)
    targets = torch.randint(0, VOCAB, (T,), generator=g)
    return inputs, targets


def stage_windows():
    """[(label, (short, long) blocks, YaRN transition before it in blocks, mtp weights)] of the record."""
    schedule = tg.Schedule(tg.parse_args([]))
    stages, previous = [], None
    for step in schedule.stage_first_steps():
        blocks = schedule.at(step).windows
        stages.append((f"stage@{step}", blocks, None if previous is None else (previous[1], blocks[1]),
                       schedule.mtp_weights(step)))
        previous = blocks
    stages.append(("final validation", schedule.final_windows, None, (1.0, 0.0, 0.0)))
    return stages


def our_logits(model, monkeypatch, inputs, targets, windows, bigram, mtp, training):
    """(our loss, per-position logits before the softcap) of one forward pass."""
    captured, real = [], tg.head_matmul

    def spy(x, w, fp8_scales):
        captured.append(real(x, w, fp8_scales))
        return captured[-1]

    monkeypatch.setattr(tg, "head_matmul", spy)
    model.head_loss = tg.softcap_cross_entropy  # the chunked CPU loss never forms whole logits
    model.train(training)
    with torch.no_grad():
        loss = model(inputs, targets, CU, windows, bigram, None if mtp is None else torch.tensor(mtp))
    model.head_loss = tg.chunked_softcap_cross_entropy
    monkeypatch.setattr(tg, "head_matmul", real)
    return loss.item(), captured[-1]


def compare_all_stages(model, monkeypatch, W, training, stages=None):
    """[(label, our loss, reference loss, logits difference relative to their largest magnitude)] at
    the record's stages (or the first `stages` of them)."""
    inputs, targets = packed_batch()
    bigram = torch.from_numpy(tg.bigram_hash(inputs.numpy(), CFG.bigram_vocab_size))
    yarn, yarn_paired = ref.ref_yarns(CFG, 2 * T)
    model.rotary.reset()
    results = []
    for label, (short, long), transition, mtp in stage_windows()[:stages]:
        if transition is not None:
            yarn.apply(transition[0] * BLOCK, transition[1] * BLOCK)
            yarn_paired.apply(transition[0] * BLOCK, transition[1] * BLOCK)
            model.rotary.extend_window(transition[0] * BLOCK, transition[1] * BLOCK)
        ours, logits = our_logits(model, monkeypatch, inputs, targets, (short, long), bigram, mtp if training else None,
                                  training)
        weights = [w for w in mtp] if training else (1.0,)
        theirs, ref_logits, _ = ref.ref_forward(W, CFG, inputs, targets, CU, short * BLOCK, long * BLOCK, yarn,
                                                yarn_paired, weights, training)
        err = ((logits.double() - ref_logits).abs().max() / ref_logits.abs().max()).item()
        results.append((label, ours, theirs.item(), err))
    return results


@pytest.fixture(scope="module")
def weights():
    return ref.ref_random_weights(CFG, seed=3)


def test_forward_matches_the_reference_port_at_the_first_stage(monkeypatch, weights):
    """The everyday tier's share of the comparison below: eval mode, the first stage's windows."""
    model = load_reference_weights(our_model(), weights)
    [(label, ours, theirs, err)] = compare_all_stages(model, monkeypatch, weights, training=False, stages=1)
    assert abs(ours - theirs) <= LOSS_TOL * abs(theirs) and err <= LOGIT_TOL, (ours, theirs, err)


@pytest.mark.slow
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_forward_matches_the_reference_port_at_every_stage(monkeypatch, weights, training):
    model = load_reference_weights(our_model(), weights)
    results = compare_all_stages(model, monkeypatch, weights, training)
    assert [label for label, *_ in results] == ["stage@0", "stage@460", "stage@920", "stage@1380", "final validation"]
    for label, ours, theirs, err in results:
        print(f"{label}: loss {ours:.8f} vs {theirs:.8f}, logits {err:.1e}")
        assert abs(ours - theirs) <= LOSS_TOL * abs(theirs), (label, ours, theirs)
        assert err <= LOGIT_TOL, (label, err)


# Each idea switched off, and what of the port's weights the smaller model still takes. The port
# keeps every idea on, so the logits must move far outside the tolerance.
IDEAS_OFF = {
    "bigram embedding": ["--bigram_vocab_size", 0],
    "bigram sign trick": ["--bigram_sign_rows", 0],
    "value embeddings": ["--value_embed_layers", "--value_embed_tables"],
    "value-embedding gates": ["--value_embed_gates", "false"],
    "paired heads": ["--paired_head_layers"],
    "XSA": ["--xsa_layers"],
    "skip gate": ["--skip_gate", "false"],
    "shared attention input": ["--shared_attention_input", "false"],
    "MUDD": ["--mudd_dim", 0],
    "sublayer scalars": ["--sublayer_scalars", "false"],
    "softcap offset": ["--softcap_offset", 0],
}


def load_what_fits(model, W):
    """The port's weights, into a model without some idea: the parameters it still has, by shape."""
    full = load_reference_weights(our_model(), W)
    mine = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in full.named_parameters():
            if name in mine and mine[name].shape == p.shape:
                mine[name].copy_(p)
        for name, b in full.named_buffers():
            target = dict(model.named_buffers()).get(name)
            if target is not None and target.shape == b.shape:
                target.copy_(b)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("idea", list(IDEAS_OFF))
def test_switching_off_each_idea_moves_the_logits(monkeypatch, weights, idea):
    """At the first stage's windows: the logits before the softcap (the softcap's offset: the loss)."""
    model = load_what_fits(our_model(*IDEAS_OFF[idea]), weights)
    [(_, ours, theirs, err)] = compare_all_stages(model, monkeypatch, weights, training=False, stages=1)
    assert err > 100 * LOGIT_TOL or abs(ours - theirs) > 100 * LOSS_TOL * abs(theirs), (idea, err, ours, theirs)


@pytest.mark.slow
def test_multi_token_weights_change_the_training_loss(monkeypatch, weights):
    """Positive control for the training comparison: the next-token loss alone differs from the
    multi-token loss of stage 0 by far more than the tolerance."""
    inputs, targets = packed_batch()
    yarn, yarn_paired = ref.ref_yarns(CFG, 2 * T)
    one, *_ = ref.ref_forward(weights, CFG, inputs, targets, CU, BLOCK, 3 * BLOCK, yarn, yarn_paired, (1.0,), True)
    three, *_ = ref.ref_forward(weights, CFG, inputs, targets, CU, BLOCK, 3 * BLOCK, yarn, yarn_paired,
                                (1.0, 0.5, 0.25), True)
    assert abs(three.item() - one.item()) > 100 * LOSS_TOL * abs(one.item())


# ----------------------------------------------------------------------------------------------
# Schedules, the untie step, the parameter count


def test_schedule_matches_the_reference_at_every_step():
    hp = tg.parse_args([])
    schedule = tg.Schedule(hp, torch.device("cpu"))
    assert hp.num_scheduled_iterations + hp.num_extension_iterations == ref.REF_TOTAL == 1390
    mismatches = []
    for step in range(ref.REF_TOTAL + 1):
        theirs = ref.ref_schedule(step)
        mtp = list(theirs["mtp_weights"]) + [0.0] * (tg.MTP_HORIZON - len(theirs["mtp_weights"]))
        plan = schedule.at(step)
        ours = (plan.lr_multiplier, plan.momentum, plan.batch_tokens, plan.max_seq_len, plan.windows, plan.adam_step,
                plan.mtp_weights.tolist())
        expected = (theirs["lr"], theirs["muon_momentum"], theirs["batch_size"], theirs["train_max_seq_len"],
                    (theirs["ws_short"], theirs["ws_long"]), theirs["adam_step"],
                    torch.tensor(mtp, dtype=torch.float32).tolist())
        if ours != expected:  # exact: the same float expressions in the same order
            mismatches.append((step, ours, expected))
    assert not mismatches, mismatches[:3]
    assert schedule.untie_step == ref.REF_SPLIT_STEP == 921
    assert [s for s in range(ref.REF_TOTAL) if schedule.at(s).unties_after] == [921]
    assert schedule.final_windows == ref.REF_FINAL_VAL_WS
    assert schedule.at(ref.REF_TOTAL).val_window_tensor.tolist() == list(ref.REF_FINAL_VAL_WS)
    assert [s for s in range(1, ref.REF_TOTAL) if schedule.stage_index(s) != schedule.stage_index(s - 1)] == \
        [460, 920, 1380]


def test_a_multiplier_one_step_late_differs_from_the_reference():
    """Positive control: the earlier record's rule (the stage multiplier switching one step after the batch
    size) gives other values on the same step counts."""
    schedule = tg.Schedule(tg.parse_args([]))
    late = [schedule.lr_multiplier(s - 1 if s in (460, 920) else s) for s in range(ref.REF_TOTAL)]
    assert [s for s in range(ref.REF_TOTAL) if late[s] != ref.ref_schedule(s)["lr"]] == [460, 920]


def test_parameter_count_equals_the_reference_models():
    """Less the reference's padding (its 12th MLP layer, which the forward never reads, and bank rows
    for an even split over 8 GPUs) and its unused fifth value-embedding gate."""
    hp = tg.parse_args([])
    with torch.device("meta"):
        model = tg.GPT(hp, tg.backend_for(hp, torch.device("cpu")))
    ours = sum(p.numel() for p in model.parameters())
    record = ref.RefConfig(world_size=1)
    unread = 2 * record.mlp_dim * record.model_dim + record.num_heads * 12
    assert ours == ref.ref_param_count(record) - unread, (ours, ref.ref_param_count(record))
    assert ref.ref_param_count(ref.RefConfig()) == 498_773_000  # on 8 GPUs, as the record's model


# ----------------------------------------------------------------------------------------------
# One optimizer step of each kind against the reference's formulas


def test_adam_step_of_every_group_matches_the_reference():
    """Betas, lr and decay multipliers of each group, eps 1e-10, fp32 moments, decay where
    update x weight > 0 (one element has a zero gradient: no decay), fp32 step size and decay."""
    hp = tg.parse_args(["--device", "cpu"])
    lr_step = tg.Schedule(hp).lr_multiplier(1)
    groups = {"lm_head": "lm_head", "embed": "embed", "value_embed": "value_embeds", "bigram": "bigram_embed",
              "scalars": "scalars", "smear_gate": "smear_gate", "skip_gate": "skip_gate", "gate": "attn_gate_bank",
              "resid_lambdas": "resid_lambdas", "lambdas": "post_lambdas", "mudd": "mudd_w1", "mudd_bias": "mudd_b2"}
    assert set(groups) == set(tg.ADAM_GROUPS)
    g = torch.Generator().manual_seed(5)
    for ours, theirs in groups.items():
        p = torch.nn.Parameter(torch.randn(32, 8, generator=g))
        grad = torch.randn(32, 8, generator=g) * 0.01
        grad[0, 0] = 0.0
        initial = p.detach().clone()
        adam = tg.DistAdam([(p, tg.adam_spec(ours, hp))], hp.adam_lr, hp.adam_betas, hp.adam_eps, hp.adam_wd)
        adam.set_schedule(lr_step, 0.0)
        p.grad = grad.clone()
        adam.step()
        expected = ref.ref_adam_step(initial.double(), grad, {}, theirs, lr_step)
        err = (p.detach().double() - expected).abs().max().item()
        # fp32 arithmetic against float64 with fp32-rounded step size and decay: a few roundings of |p| <= 4
        assert err <= 8 * 2 ** -24 * 4, (ours, err)
        assert adam.param_groups[0]["exp_avg"].dtype == torch.float32


@pytest.mark.parametrize("kind", ["qk", "vo", "mlp_fc", "mlp_proj"])
def test_normuon_step_matches_the_reference(kind):
    """A layer's [Q; K] (pieces: head pairs, normalized per column), [V; O] (per row) or an MLP matrix
    (step size x2, and x2 again for the projection) against the reference's NorMuon on its banks."""
    hp = tg.parse_args([*TOY_FLAGS])
    D, H, hd = DIM, HEADS, HEAD_DIM
    g = torch.Generator().manual_seed(7)
    shape = {"qk": (2 * D, D), "vo": (2 * D, D), "mlp_fc": (4 * D, D), "mlp_proj": (4 * D, D)}[kind]
    label, pieces, lr_mul = {"qk": ("attn_qk", H, 1.0), "vo": ("attn_vo", 2, 1.0), "mlp_fc": ("mlp", 1, 1.0),
                             "mlp_proj": ("mlp", 1, 2.0)}[kind]
    p = torch.nn.Parameter(torch.rand(shape, generator=g) - 0.5)
    spec = tg.ParamSpec(label, "matrix", lr_mul=lr_mul, pieces=pieces)
    grad = torch.randn(shape, generator=g)
    initial = p.detach().clone()
    muon = tg.NorMuon([(p, spec)], hp.muon_lr, hp.muon_wd, 0.9, hp.muon_beta2, polar=tg.CPU_POLAR_EXPRESS)
    lr_step = tg.Schedule(hp).lr_multiplier(100)
    muon.set_schedule(lr_step, 0.9)
    p.grad = grad.clone()
    muon.step()
    # the reference's bank of this kind: (pieces, rows, cols), with the MLP's c_fc / c_proj alternating
    if kind.startswith("mlp"):
        bank, index = ("mlp_bank", 1 if kind == "mlp_proj" else 0)
        param = torch.stack([initial, initial]) if index else torch.stack([initial, initial])
        grads = torch.stack([grad, grad])
        expected = ref.ref_normuon_step(param.view(1, 2, *shape), grads.view(1, 2, *shape), {}, bank, lr_step, 0.9)
        expected = expected.view(2, *shape)[index]
    else:
        bank = "qk_bank" if kind == "qk" else "vo_bank"
        expected = ref.ref_normuon_step(initial.view(pieces, -1, D), grad.view(pieces, -1, D), {}, bank, lr_step, 0.9)
        expected = expected.reshape(shape)
    err = (p.detach().double() - expected).abs().max().item()
    step = hp.muon_lr * lr_step * (2 if kind.startswith("mlp") else 1) * lr_mul
    # fp32 Polar Express against float64: ~1e-6 of the update per element, measured; 1e-4 of the step size
    assert err <= 1e-4 * step, (kind, err / step)
    # positive control: the per-row/column rule or the piece count wrong moves it by a sizeable share of a step
    assert (initial.double() - expected).abs().max() > 0.1 * step


# ----------------------------------------------------------------------------------------------
# FP8 MLP numerics


def test_fp8_mlp_scales_and_outputs_match_the_reference_emulation():
    """Bootstrap (current) scales for the first 16 refreshes, then W2's delayed scale with 1.12
    headroom (exact: they come from the weights); the activation scale 1.8 x the previous forward's
    amax and the FP8 products' outputs (the port computes activations in float64, ours in bf16 as the
    reference: within bf16 of the scale, and a few e4m3 steps of the output)."""
    L, hidden, D = 2, 64, 16
    g = torch.Generator().manual_seed(11)

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            bound = 3 ** 0.5 * 0.5 / D ** 0.5
            self.fc_w = torch.nn.Parameter(((torch.rand(hidden, D, generator=g) * 2 - 1) * bound).bfloat16().float())
            self.proj_w = torch.nn.Parameter((torch.randn(hidden, D, generator=g) * 0.02).bfloat16().float())

    layers = torch.nn.ModuleList([Layer() for _ in range(L)])
    ours, theirs = tg.FP8MLPWeights(L, hidden, D), ref.RefFP8MLP()
    plain_gap, errors = [], []
    for step in range(tg.FP8MLPWeights.BOOTSTRAP_STEPS + 2):  # through the switch to delayed scaling
        bank = torch.stack([torch.stack([lay.fc_w, lay.proj_w]) for lay in layers]).detach().bfloat16()
        ours.quantize(layers, bootstrap=step < tg.FP8MLPWeights.BOOTSTRAP_STEPS)
        theirs.quantize(bank, bootstrap_down=step < 16)
        assert torch.equal(ours.w1_scales, theirs.up_scales[:L]) and torch.equal(ours.w2_scales, theirs.down_used[:L])
        assert torch.equal(ours.w1_f8.double(), theirs.up_f8[:L]) and torch.equal(ours.w2_f8.double(), theirs.down_f8[:L])
        x = (torch.randn(32, D, generator=g) * (1 + 0.05 * step)).bfloat16()  # within the 1.8 headroom of post
        for i, layer in enumerate(layers):
            used_act = ours.act_scales[i].item()
            # amax(post) of bf16 activations against float64 ones: within a few % (the max squares the error)
            torch.testing.assert_close(used_act, theirs.act_scales[i].item(), rtol=0.05, atol=0)
            out = ours(i, x, layer.fc_w, layer.proj_w).double()
            expected = theirs.mlp(i, x.double())
            # our activations are bf16 before each e4m3 cast (as the reference's), the port's float64, so some
            # casts land one e4m3 step (2^-3) apart: measured 2-5 % of the output's RMS, 9 % of its largest
            rms = expected.square().mean().sqrt().item()
            errors.append(((out - expected).square().mean().sqrt().item() / rms,
                           (out - expected).abs().max().item() / expected.abs().max().item()))
            plain = F_relu_square(x.double(), layer.fc_w.double(), layer.proj_w.double())
            plain_gap.append((plain - expected).square().mean().sqrt().item() / rms)
        theirs.end_forward()
        with torch.no_grad():  # W2 grows between refreshes (its delayed scale then clips by the headroom)
            for layer in layers:
                layer.proj_w.copy_((layer.proj_w * 1.05).bfloat16().float())
    print(f"FP8 MLP against the port: RMS {max(e for e, _ in errors):.3f}, max {max(m for _, m in errors):.3f}; "
          f"plain MLP against the port: RMS {min(plain_gap):.3f}")
    assert max(e for e, _ in errors) <= 0.08 and max(m for _, m in errors) <= 0.15
    # positive control: ours is closer to the port's FP8 products than the plain bf16 MLP is
    assert sum(e for e, _ in errors) < 0.85 * sum(plain_gap)


def test_fp8_mlp_copies_made_again_from_a_checkpoint_are_the_runs():
    """A resumed run (fresh buffers, the checkpoint's persistent scales, requantize) has the FP8 copies
    and scales the uninterrupted run had: W1's current scale is made again from the weights, W2's delayed
    one comes from the checkpoint."""
    L, hidden, D = 2, 64, 16
    g = torch.Generator().manual_seed(5)
    layers = torch.nn.ModuleList()
    for _ in range(L):
        layer = torch.nn.Module()
        layer.fc_w = torch.nn.Parameter(torch.randn(hidden, D, generator=g) * 0.1)
        layer.proj_w = torch.nn.Parameter(torch.randn(hidden, D, generator=g) * 0.02)
        layers.append(layer)
    run = tg.FP8MLPWeights(L, hidden, D)
    for step in range(3):  # an optimizer step changes the weights, then the step's refresh
        with torch.no_grad():
            for layer in layers:
                layer.proj_w.mul_(1.05)
                layer.fc_w.mul_(0.9)
        run.quantize(layers, bootstrap=step == 0)
    resumed = tg.FP8MLPWeights(L, hidden, D)  # a checkpoint written now, loaded by a fresh process
    resumed.load_state_dict(run.state_dict())
    resumed.requantize(layers)
    for name in ("w1_scales", "w2_scales", "w1_f8", "w2_f8"):
        assert torch.equal(getattr(resumed, name).float(), getattr(run, name).float()), name
    assert not torch.equal(resumed.w2_scales, tg.FP8MLPWeights(L, hidden, D).w2_scales)  # positive control


def F_relu_square(x, w1, w2):
    return torch.relu(x @ w1.T).square() @ w2


def test_fp8_mlp_backward_runs_every_micro_step_with_the_plain_gradients():
    """Forward and backward through two FP8 MLP layers three times (the activation scale each forward sets
    must stay out of the autograd graph, or the next backward reaches a freed graph) give the gradients of
    the plain fp32 MLP to the FP8 forward's error: e4m3 keeps 3 mantissa bits (relative steps of 6-12 %),
    measured 6-15 % of the gradients' norm (the first forward, at activation scale 1, the most). A wrong
    backward (the factor 2 of the square, a transposed product) is off by 50 % or more."""
    L, hidden, D = 2, 64, 16
    g = torch.Generator().manual_seed(5)

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc_w = torch.nn.Parameter((torch.rand(hidden, D, generator=g) * 2 - 1) * 0.2)
            self.proj_w = torch.nn.Parameter(torch.randn(hidden, D, generator=g) * 0.1)

    layers = torch.nn.ModuleList([Layer() for _ in range(L)])
    fp8 = tg.FP8MLPWeights(L, hidden, D)
    fp8.quantize(layers, bootstrap=True)

    def gradients(x, mlp):
        x = x.clone().requires_grad_()
        h = x
        for i, layer in enumerate(layers):
            h = mlp(i, h, layer.fc_w, layer.proj_w)
        layers.zero_grad()
        h.square().sum().backward()
        return [x.grad] + [p.grad.clone() for p in layers.parameters()]

    for _ in range(3):
        x = torch.randn(32, D, generator=g)
        ours = gradients(x, fp8)
        assert fp8.act_scales.grad_fn is None and not fp8.act_scales.requires_grad
        plain = gradients(x, lambda i, h, w1, w2: F_relu_square(h, w1, w2))
        errors = [((a - b).norm() / b.norm()).item() for a, b in zip(ours, plain)]
        assert max(errors) < 0.25, errors
