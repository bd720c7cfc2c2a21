"""Optimizers and schedules, on CPU.

- NorMuon and DistAdam against straightforward references written here from the recipe.
- The same training loop on 2 gloo processes against 1 process fed the averaged gradients
  (uneven matrix counts and an odd-length scalar vector, so NorMuon's zero-padded chunks and
  DistAdam's padded shards are exercised); backward passes issue no collective, each optimizer's
  step reduces its own gradients.
- Save -> load round trips on 1 and 2 processes, continuing bit-for-bit.
- Parameter coverage of the two optimizers; the record schedule at the stage boundaries.
"""
import contextlib
import datetime
import io
import math
import os
import socket
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import train_gpt as tg

# Hyperparameters chosen so that every term moves the parameters visibly: decay factor wd*lr = 0.25
# (NorMuon) / 0.1 (Adam), so a missing or unmasked decay is far outside the tolerances below.
MUON_HP = dict(lr=0.05, weight_decay=5.0, momentum=0.9, beta2=0.95, polar=tg.CPU_POLAR_EXPRESS)
ADAM_HP = dict(lr=0.02, betas=(0.65, 0.95), eps=1e-8, weight_decay=5.0)
D = 16  # model dim of the toy parameter set; attention (4h, d) with h = d
STEPS = 6  # training steps: NorMuon steps 6 times, DistAdam 3 times (odd steps)
RESUME_AT = 4  # state saved after steps 0..3 (Adam has just stepped, no gradients pending)

# Polar Express coefficients of the recipe, written out here (not taken from train_gpt.py).
RECIPE_COEFFS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


# ----------------------------------------------------------------------------------------------
# Toy parameter sets and deterministic per-(rank, step) gradients

SPECS = {}  # parameter -> its ParamSpec (the model's param_table; here the toy parameters')


def _tagged(p, label, lr_mul=1.0, wd_mul=1.0, pieces=1):
    optimizer = "matrix" if label in ("attn", "attn_qk", "attn_vo", "mlp", "gate") else "adam"
    SPECS[p] = tg.ParamSpec(label, optimizer, lr_mul, wd_mul, pieces)
    return p


def spec(p):
    return SPECS[p]


def table(params):
    """The optimizers' input: (parameter, ParamSpec) pairs."""
    return [(p, SPECS[p]) for p in params]


def _param(gen, shape, label, lr_mul=1.0, wd_mul=1.0, scale=0.3):
    """A parameter with its spec; "attn" is the retie recipe's merged Q, K, V, O weight: 4 pieces."""
    return _tagged(nn.Parameter(torch.randn(shape, generator=gen) * scale), label, lr_mul, wd_mul,
                   pieces=4 if label == "attn" else 1)


def muon_params():
    """3 matrices of shape (4D, D) (two attention, one MLP with lr_mul 2) -> padded to 4 on 2 ranks,
    one gate of another shape, one tall and one wide matrix (groups of 1: rank 1 owns only padding)."""
    g = torch.Generator().manual_seed(1)
    return [
        _param(g, (4 * D, D), "attn"),
        _param(g, (4 * D, D), "mlp", lr_mul=2.0),
        _param(g, (4 * D, D), "attn"),
        _param(g, (3, 12), "gate"),
        _param(g, (24, 8), "mlp"),  # tall: step size x sqrt(3)
        _param(g, (8, 24), "mlp"),  # wide: normalized per column
    ]


def adam_params():
    """Order as in the model: head, value embedding, scalars; the 11 scalars do not divide by 2 ranks
    (DistAdam pads its shards)."""
    g = torch.Generator().manual_seed(2)
    return [
        _param(g, (32, 8), "lm_head"),
        _param(g, (32, 8), "value_embed", lr_mul=3.0, wd_mul=0.5),
        _param(g, (11,), "scalars", lr_mul=5.0, wd_mul=0.0),
    ]


def rank_grad(rank, step, index, shape):
    gen = torch.Generator().manual_seed(100_000 * step + 1_000 * index + rank)
    grad = torch.randn(shape, generator=gen)
    if index == 100:  # lm_head: two rows of tiny gradients, where eps = 1e-8 matters (u ~ 0.5 instead of ~1)
        grad[:2] *= 1e-8
    return grad


def avg_grad(step, index, shape):
    return (rank_grad(0, step, index, shape) + rank_grad(1, step, index, shape)) / 2


def set_schedules(muon, adam, step):
    """Like Trainer.train_step: lr and momentum change every step (values are arbitrary)."""
    scale = 1.0 - 0.1 * step
    for group in muon.param_groups:
        group["lr"], group["momentum"] = MUON_HP["lr"] * scale, 0.85 + 0.02 * step
    for group in adam.param_groups:
        group["lr"] = ADAM_HP["lr"] * scale


def train(muon, adam, mparams, aparams, steps, grad_fn, phase=contextlib.nullcontext):
    """The step logic of Trainer.train_step with one micro-step: NorMuon every step, DistAdam on
    odd steps; Adam gradients come from a real backward. phase(name) wraps the backward and each
    optimizer step (to count their collectives)."""
    for step in steps:
        set_schedules(muon, adam, step)
        for i, p in enumerate(mparams):
            p.grad = grad_fn(step, i, p.shape)
        loss = sum((p * grad_fn(step, 100 + i, p.shape)).sum() for i, p in enumerate(aparams))
        with phase("backward"):
            loss.backward()
        with phase("normuon"):
            muon.step()
        muon.zero_grad()
        if step % 2 == 1:  # DistAdam's steps (test_distadam_matches_reference_adam_and_steps_on_odd_steps_only)
            with phase("adam"):
                adam.step()
            adam.zero_grad()


def make_optimizers(mparams, aparams):
    return tg.NorMuon(table(mparams), **MUON_HP), tg.DistAdam(table(aparams), **ADAM_HP)


def clone_all(params):
    return [p.detach().clone() for p in params]


def fresh_from(values, factory):
    params = factory()
    with torch.no_grad():
        for p, v in zip(params, values):
            p.copy_(v)
    return params


def roundtrip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf)


# ----------------------------------------------------------------------------------------------
# References written from the recipe

def ref_polar_express(G):
    """Polar Express on one matrix, in float64: transpose if tall, Frobenius-normalize, 5 steps."""
    X = G.double()
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    X = X / (X.norm() * 1.02 + 1e-6)
    for a, b, c in RECIPE_COEFFS:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


class RefNorMuon:
    """One matrix, float64."""

    def __init__(self, p):
        self.p = p.detach().double().clone()
        self.label, self.lr_mul, self.wd_mul = spec(p).label, spec(p).lr_mul, spec(p).wd_mul
        self.M = torch.zeros_like(self.p)
        self.v = None

    def step(self, grad, lr, wd, mu, beta2):
        G = grad.double()
        self.M = self.M + (1 - mu) * (G - self.M)  # M <- lerp(M, G, 1 - mu)
        U = G + mu * (self.M - G)  # Nesterov: lerp(G, M, mu)
        rows, cols = U.shape
        pieces = 4 if self.label == "attn" else 1  # Q, K, V, O orthogonalized and rescaled separately
        O = torch.cat([ref_polar_express(block) for block in U.split(rows // pieces)])
        # per row (mean over columns) for tall/square matrices and gates, per column for wide ones
        axis = 1 if rows >= cols or self.label == "gate" else 0
        sq = O.square().mean(dim=axis, keepdim=True)
        self.v = (1 - beta2) * sq if self.v is None else beta2 * self.v + (1 - beta2) * sq
        S = O / self.v.sqrt()
        # keep the Frobenius norm of each orthogonalized piece
        S = torch.cat([s * (o.norm() / s.norm()) for s, o in zip(S.split(rows // pieces), O.split(rows // pieces))])
        eta = lr * math.sqrt(max(1.0, rows / pieces / cols)) * self.lr_mul  # the shape of each piece
        mask = (S * self.p) >= 0
        self.p = self.p - eta * (wd * self.wd_mul * lr) * mask * self.p - eta * S


class RefAdam:
    """One parameter, the reference's formula: eps on the uncorrected sqrt(v), bias corrections in
    the step size, decay factor eff_lr^2 * wd * wd_mul where update x weight > 0; fp32 moments."""

    def __init__(self, p):
        self.p = p.detach().float().clone()
        self.lr_mul, self.wd_mul = spec(p).lr_mul, spec(p).wd_mul
        self.m = torch.zeros_like(self.p)
        self.v = torch.zeros_like(self.p)
        self.t = 0

    def step(self, grad, lr, betas, eps, wd):
        b1, b2 = betas
        self.t += 1
        m = b1 * self.m + (1 - b1) * grad
        v = b2 * self.v + (1 - b2) * grad.square()
        self.m, self.v = m, v
        eta = lr * self.lr_mul
        u = m / (v.sqrt() + eps) * (math.sqrt(1 - b2 ** self.t) / (1 - b1 ** self.t))
        mask = (u * self.p) > 0
        self.p = self.p - eta * (wd * self.wd_mul * eta) * mask * self.p - eta * u


# ----------------------------------------------------------------------------------------------
# 1 process against the references

def test_normuon_matches_single_matrix_reference():
    g = torch.Generator().manual_seed(3)
    params = [_param(g, (24, 8), "mlp", lr_mul=2.0),  # tall, shape multiplier sqrt(3)
              _param(g, (4 * D, D), "attn"),  # 4 blocks of (D, D), each of multiplier 1
              _param(g, (3, 12), "gate"),  # gate: per-row statistics although wide
              _param(g, (8, 24), "mlp")]  # wide: per-column statistics
    muon = tg.NorMuon(table(params), **MUON_HP)
    refs = [RefNorMuon(p) for p in params]
    for step in range(3):
        lr, mu = MUON_HP["lr"] * (1 - 0.1 * step), 0.85 + 0.05 * step
        for group in muon.param_groups:
            group["lr"], group["momentum"] = lr, mu
        for i, p in enumerate(params):
            p.grad = rank_grad(0, step, i, p.shape)
            refs[i].step(p.grad, lr, MUON_HP["weight_decay"], mu, MUON_HP["beta2"])
        muon.step()
        muon.zero_grad()
        for p, ref in zip(params, refs):
            eta = lr * math.sqrt(max(1.0, p.shape[0] / spec(p).pieces / p.shape[1])) * spec(p).lr_mul
            err = (p.double() - ref.p).abs().max().item()
            # fp32 implementation vs float64 reference: measured max error 6.2e-6 * eta (3 steps);
            # a wrong axis/coefficient/step size is O(0.1 * eta) or more.
            assert err <= 1e-4 * eta, (step, spec(p).label, tuple(p.shape), err / eta)


def test_normuon_keeps_a_gate_and_a_wide_matrix_of_one_shape_apart():
    """A gate is normalized per row, a wide matrix per column: of the same shape, they land in groups of
    their own, each normalized its way."""
    g = torch.Generator().manual_seed(4)
    gate, wide = _param(g, (3, 12), "gate"), _param(g, (3, 12), "mlp")
    muon = tg.NorMuon(table([gate, wide]), **MUON_HP)
    assert sorted(len(group["params"]) for group in muon.param_groups) == [1, 1]
    assert {spec(group["params"][0]).label: group["reduce_dim"] for group in muon.param_groups} == {"gate": -1, "mlp": -2}


def test_distadam_matches_reference_adam_and_steps_on_odd_steps_only():
    params = adam_params()
    adam = tg.DistAdam(table(params), **ADAM_HP)
    refs = [RefAdam(p) for p in params]
    schedule = tg.Schedule(tg.parse_args([]))
    assert [schedule.at(s).adam_step for s in range(4)] == [False, True, False, True]
    pending = [None] * len(params)
    for step in range(STEPS):
        lr = ADAM_HP["lr"] * (1 - 0.1 * step)
        for group in adam.param_groups:
            group["lr"] = lr
        before = clone_all(params)
        grads = [rank_grad(0, step, 100 + i, p.shape) for i, p in enumerate(params)]
        sum((p * g).sum() for p, g in zip(params, grads)).backward()  # accumulates into .grad
        pending = [g if acc is None else acc + g for acc, g in zip(pending, grads)]
        if schedule.at(step).adam_step:
            adam.step()
            adam.zero_grad()
            for ref, grad in zip(refs, pending):
                ref.step(grad, lr, **{k: ADAM_HP[k] for k in ("betas", "eps")}, wd=ADAM_HP["weight_decay"])
            pending = [None] * len(params)
            for p, b, ref in zip(params, before, refs):
                assert not torch.equal(p, b), f"Adam did not update {spec(p).label} on odd step {step}"
                eta = lr * spec(p).lr_mul
                err = (p - ref.p).abs().max().item()
                # same arithmetic up to the order of fp32 operations: measured max error one ulp of
                # |p| (1.2e-7 at |p| < 2); tolerance 4 ulps of the largest |p| plus 1e-6 * eta per
                # step. Missing bias correction (~0.56 eta), eps in the wrong place (~0.5 eta on the
                # tiny rows) or unmasked decay (0.1 * eta * |p|) are far outside it.
                tolerance = 4 * 2 ** -24 * ref.p.abs().max().item() + 1e-6 * eta * ref.t
                assert err <= tolerance, (step, spec(p).label, err / eta)
        else:
            for p, b in zip(params, before):
                assert torch.equal(p, b), f"Adam changed {spec(p).label} on even step {step}"
            assert all(p.grad is not None for p in params)  # gradients kept for the odd step
    for group in adam.param_groups:
        assert group["exp_avg"].dtype == torch.float32 and group["exp_avg_sq"].dtype == torch.float32
        assert group["step"] == STEPS // 2


def test_adam_update_with_tensor_betas_matches_float_betas():
    """The compiled path's betas, 0-dim float64 tensors (one graph for every group), give the float path's
    update up to one rounding: (1 - beta) * grad is rounded before the add, which the float path fuses."""
    g = torch.Generator().manual_seed(7)
    exp_avg, exp_avg_sq, grad, weight = (torch.randn(64, 32, generator=g) for _ in range(4))
    exp_avg_sq = exp_avg_sq.square()
    betas = (0.9, 0.99)
    results = []
    for b1, b2 in (betas, [torch.tensor(beta, dtype=torch.float64) for beta in betas]):
        state = [t.clone() for t in (exp_avg, exp_avg_sq, grad, weight)]
        new_weight = tg.adam_update_(*state, b1, b2, 1e-8, torch.tensor(0.01), torch.tensor(1e-4))
        results.append((state[0], state[1], new_weight))
    eps = torch.finfo(torch.float32).eps
    (m, v, w), (m_t, v_t, w_t) = results
    assert not torch.equal(m, exp_avg) and not torch.equal(w, weight)
    # each moment: at most three roundings of half an ulp apart, each of a term no larger than
    # |beta x old| + |(1 - beta) x new| (measured: up to 1.04 ulps of that sum)
    assert torch.all((m_t - m).abs() <= 1.5 * eps * (0.9 * exp_avg.abs() + 0.1 * grad.abs()))
    assert torch.all((v_t - v).abs() <= 1.5 * eps * (0.99 * exp_avg_sq + 0.01 * grad.square()))
    # the weight's step m / (sqrt(v) + eps) x step size inherits a few ulps of relative difference from the
    # moments; the new weight's own rounding adds an ulp of |weight|
    step = (w - weight).abs()
    assert torch.all((w_t - w).abs() <= 8 * eps * (step + weight.abs()))


def test_distadam_one_process_owns_every_row():
    g = torch.Generator().manual_seed(5)
    p = _param(g, (3, 4), "lm_head")  # 3 rows: only world size 1 divides them
    before = p.detach().clone()
    adam = tg.DistAdam(table([p]), **ADAM_HP)
    p.grad = torch.ones_like(p)
    adam.step()
    assert adam.param_groups[0]["exp_avg"].shape == (3, 4)  # one process owns every row
    assert (p - before).abs().min() > 0  # and updates every one of them


def test_save_load_roundtrip_one_process_continues_identically():
    mparams, aparams = muon_params(), adam_params()
    muon, adam = make_optimizers(mparams, aparams)
    grad_fn = lambda step, index, shape: rank_grad(0, step, index, shape)  # noqa: E731
    train(muon, adam, mparams, aparams, range(RESUME_AT), grad_fn)
    saved_m, saved_a = clone_all(mparams), clone_all(aparams)
    state_m, state_a = roundtrip(muon.state_dict()), roundtrip(adam.state_dict())
    train(muon, adam, mparams, aparams, range(RESUME_AT, STEPS), grad_fn)

    mparams2, aparams2 = fresh_from(saved_m, muon_params), fresh_from(saved_a, adam_params)
    muon2, adam2 = make_optimizers(mparams2, aparams2)
    muon2.load_state_dict(state_m)
    adam2.load_state_dict(state_a)
    train(muon2, adam2, mparams2, aparams2, range(RESUME_AT, STEPS), grad_fn)
    for p, q in zip(mparams + aparams, mparams2 + aparams2):
        assert torch.equal(p, q), spec(p).label

    # without the loaded state the continuation differs (so the comparison above can fail)
    mparams3, aparams3 = fresh_from(saved_m, muon_params), fresh_from(saved_a, adam_params)
    muon3, adam3 = make_optimizers(mparams3, aparams3)
    train(muon3, adam3, mparams3, aparams3, range(RESUME_AT, STEPS), grad_fn)
    assert not torch.equal(mparams3[0], mparams[0]) and not torch.equal(aparams3[0], aparams[0])


# ----------------------------------------------------------------------------------------------
# 2 processes (gloo) against 1 process on the averaged gradients

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dist_worker(rank, world_size, port, out_dir):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120))
    try:
        result = {}
        # count the collectives issued in each phase of a step (the backward must issue none)
        calls = []
        for name in ("reduce_scatter_tensor", "all_reduce", "all_gather_into_tensor", "broadcast"):
            original = getattr(dist, name)

            def counting(*args, _original=original, _name=name, **kwargs):
                calls.append(_name)
                return _original(*args, **kwargs)
            setattr(dist, name, counting)
        comm_log = []

        @contextlib.contextmanager
        def phase(name):
            before = len(calls)
            yield
            comm_log.append((name, calls[before:]))

        grad_fn = lambda step, index, shape: rank_grad(rank, step, index, shape)  # noqa: E731
        mparams, aparams = muon_params(), adam_params()
        muon, adam = make_optimizers(mparams, aparams)
        train(muon, adam, mparams, aparams, range(RESUME_AT), grad_fn, phase)
        result["at_resume"] = clone_all(mparams + aparams)
        result["state_muon"], result["state_adam"] = muon.state_dict(), adam.state_dict()
        train(muon, adam, mparams, aparams, range(RESUME_AT, STEPS), grad_fn, phase)
        result["final"] = clone_all(mparams + aparams)
        result["comm_log"] = comm_log

        saved = result["at_resume"]
        mparams2 = fresh_from(saved[:len(mparams)], muon_params)
        aparams2 = fresh_from(saved[len(mparams):], adam_params)
        muon2, adam2 = make_optimizers(mparams2, aparams2)
        muon2.load_state_dict(roundtrip(result["state_muon"]))
        adam2.load_state_dict(roundtrip(result["state_adam"]))
        train(muon2, adam2, mparams2, aparams2, range(RESUME_AT, STEPS), grad_fn)
        result["resumed"] = clone_all(mparams2 + aparams2)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_process_results():  # the tests using it are marked slow (two spawned processes)
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_dist_worker, args=(2, _free_port(), out_dir), nprocs=2, join=True)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(2)]


@pytest.fixture(scope="module")
def one_process_reference():
    mparams, aparams = muon_params(), adam_params()
    muon, adam = make_optimizers(mparams, aparams)
    train(muon, adam, mparams, aparams, range(RESUME_AT), avg_grad)
    ref = {"at_resume": clone_all(mparams + aparams), "state_muon": muon.state_dict(),
           "state_adam": adam.state_dict()}
    train(muon, adam, mparams, aparams, range(RESUME_AT, STEPS), avg_grad)
    ref["final"] = clone_all(mparams + aparams)
    return ref


def _labels():
    return [(spec(p).label, tuple(p.shape)) for p in muon_params() + adam_params()]


N_MUON = len(muon_params())


@pytest.mark.slow
def test_two_processes_agree_with_each_other(two_process_results):
    r0, r1 = two_process_results
    for key in ("at_resume", "final", "resumed"):
        for a, b, label in zip(r0[key], r1[key], _labels()):
            assert torch.equal(a, b), (key, label)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["normuon", "distadam"])
def test_two_processes_match_one_process_on_averaged_grads(two_process_results, one_process_reference, which):
    sl = slice(0, N_MUON) if which == "normuon" else slice(N_MUON, None)
    dist_final = two_process_results[0]["final"][sl]
    ref_final = one_process_reference["final"][sl]
    start = (muon_params() + adam_params())[sl]
    for d, r, p0, label in zip(dist_final, ref_final, start, _labels()[sl]):
        assert not torch.equal(d, p0.detach()), f"{label} never updated"
        # bf16-level tolerance (the averaging order differs, DistAdam rounds its moments to bf16, so one
        # flipped bf16 rounding moves a weight by ~0.004 * eta = 2.4e-4 for the lr_mul-3 table).
        # Measured: NorMuon max |diff| 0 (bit-identical), DistAdam 6e-8.
        torch.testing.assert_close(d, r, atol=1e-3, rtol=1e-3, msg=lambda m: f"{label}: {m}")


@pytest.mark.slow
def test_two_process_state_dict_is_the_full_state(two_process_results, one_process_reference):
    """The gathered state of 2 ranks equals the 1-process state (padding dropped, chunks in order)."""
    dist_state, ref_state = two_process_results[0], one_process_reference
    for key in ("momentum_buffer", "second_moment"):  # per parameter, whatever the grouping
        assert len(dist_state["state_muon"][key]) == len(ref_state["state_muon"][key]) == N_MUON
        for d, r in zip(dist_state["state_muon"][key], ref_state["state_muon"][key]):
            assert d.shape == r.shape, key
            torch.testing.assert_close(d, r, atol=1e-4, rtol=1e-3)
    for dg, rg in zip(dist_state["state_adam"]["groups"], ref_state["state_adam"]["groups"]):
        assert dg["step"] == rg["step"] == RESUME_AT // 2
        for key in ("exp_avg", "exp_avg_sq"):
            assert dg[key].dtype == torch.float32 and dg[key].shape == rg[key].shape
            torch.testing.assert_close(dg[key].float(), rg[key].float(), atol=1e-3, rtol=2e-2)


@pytest.mark.slow
def test_two_process_save_load_continues_identically(two_process_results):
    for rank, result in enumerate(two_process_results):
        for a, b, label in zip(result["final"], result["resumed"], _labels()):
            assert torch.equal(a, b), (rank, label)


@pytest.mark.slow
def test_two_process_state_loads_into_one_process(two_process_results, one_process_reference):
    """A checkpoint written by 2 ranks resumes on 1 (full, un-sharded state)."""
    res = two_process_results[0]
    saved = res["at_resume"]
    mparams, aparams = fresh_from(saved[:N_MUON], muon_params), fresh_from(saved[N_MUON:], adam_params)
    muon, adam = make_optimizers(mparams, aparams)
    muon.load_state_dict(res["state_muon"])
    adam.load_state_dict(res["state_adam"])
    train(muon, adam, mparams, aparams, range(RESUME_AT, STEPS), avg_grad)
    for p, d, label in zip(mparams + aparams, res["final"], _labels()):
        torch.testing.assert_close(p.detach(), d, atol=1e-3, rtol=1e-3, msg=lambda m: f"{label}: {m}")


@pytest.mark.slow
def test_backward_issues_no_collective_and_each_step_reduces_its_own_grads(two_process_results):
    log = two_process_results[0]["comm_log"]
    expected_phases = []
    for step in range(STEPS):
        expected_phases += ["backward", "normuon"] + (["adam"] if step % 2 == 1 else [])
    assert [name for name, _ in log] == expected_phases
    n_groups = len(tg.stacked_groups(table(muon_params()), 2))
    n_buckets = 1  # DistAdam's parameters, all of ADAM_BUCKET_NUMEL elements or fewer and fp32, in one bucket
    assert all(p.numel() <= tg.ADAM_BUCKET_NUMEL and p.dtype == torch.float32 for p in adam_params())
    for name, calls in log:
        if name == "backward":
            assert calls == [], log
        else:  # every reduce-scatter first, then one all-gather per group/bucket
            n = n_groups if name == "normuon" else n_buckets
            assert calls == ["reduce_scatter_tensor"] * n + ["all_gather_into_tensor"] * n, (name, calls)


def bucket_params():
    """adam_params() (two tables of 256 elements, 11 scalars that do not divide by 2 ranks), a tied embedding,
    and two small bf16 gates (5 rows: padded too)."""
    g = torch.Generator().manual_seed(3)
    gates = [_tagged(nn.Parameter((torch.randn(shape, generator=g) * 0.3).bfloat16()), "gate")
             for shape in ((5, 3), (4,))]
    return adam_params() + [_param(g, (32, 8), "embed")] + gates


def _bucket_worker(rank, world_size, port, out_dir):
    """DistAdam's steps with its small parameters in buckets (ADAM_BUCKET_NUMEL 100: the tables travel alone)
    and with every parameter alone (0): the parameters after each, and the reduce-scatters each issued."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120))
    try:
        original, calls, result = dist.reduce_scatter_tensor, [], {}

        def counting(*args, **kwargs):
            calls.append(args[0].shape)
            return original(*args, **kwargs)
        dist.reduce_scatter_tensor = counting
        for bucket_numel in (0, 100):
            tg.ADAM_BUCKET_NUMEL = bucket_numel
            params = bucket_params()
            adam = tg.DistAdam(table(params), **ADAM_HP, tie=(params[0], params[3]))
            calls.clear()
            for step in range(4):
                for i, p in enumerate(params):
                    p.grad = rank_grad(rank, step, i, p.shape).to(p.dtype)
                adam.step()
                adam.zero_grad()
                if step == 1:
                    adam.untie()
            result[bucket_numel] = (clone_all(params), len(calls), adam.state_dict())
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_bucketed_distadam_equals_one_collective_per_parameter():
    """On 2 gloo processes (reduce_scatter_tensor with AVG, all_gather_into_tensor), DistAdam with its small
    parameters bucketed by dtype gives bit-identical parameters to one collective per parameter (each element
    is averaged over the same ranks, alone or in a bucket), tied and untied, with padded shards and bf16
    parameters, and issues fewer reduce-scatters."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_bucket_worker, args=(2, _free_port(), out_dir), nprocs=2, join=True)
        results = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(2)]
    start = bucket_params()
    for result in results:
        (alone, alone_calls, alone_state), (bucketed, bucketed_calls, bucketed_state) = result[0], result[100]
        for a, b, p0 in zip(alone, bucketed, start):
            assert not torch.equal(a, p0.detach()), spec(p0).label
            assert a.dtype == b.dtype == p0.dtype and torch.equal(a, b), spec(p0).label
        # the moments too: Adam's direction is blind to a gradient's scale (a sum in place of the average)
        for a, b in zip(alone_state["groups"], bucketed_state["groups"]):
            assert a["step"] == b["step"] and all(torch.equal(a[k], b[k]) for k in ("exp_avg", "exp_avg_sq"))
        # tied: head and value embedding alone, scalars, the gates' bucket; untied the embedding too; 4 steps
        assert (alone_calls, bucketed_calls) == (2 * 5 + 2 * 6, 2 * 4 + 2 * 5), (alone_calls, bucketed_calls)
    assert all(torch.equal(a, b) for a, b in zip(results[0][100][0], results[1][100][0]))


def _wire_worker(rank, world_size, port, out_dir):
    """NorMuon with its gradients and new weights sent in bf16 (the GPU path) beside the same steps sent in
    fp32: on gradients the same on both ranks and bf16-exact (their average is exact in either dtype), and
    on gradients that differ by rank. Records the parameters after each step, then after exact_weights(),
    and the dtypes of the tensors each collective sent."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120))
    try:
        sent, result = [], {}
        for name in ("reduce_scatter_tensor", "all_gather_into_tensor"):
            def recording(out, tensor, *args, _original=getattr(dist, name), **kwargs):
                sent.append(tensor.dtype)
                return _original(out, tensor, *args, **kwargs)
            setattr(dist, name, recording)
        grads = {"same": lambda step, i, shape: rank_grad(0, step, i, shape).bfloat16().float(),
                 "by_rank": lambda step, i, shape: rank_grad(rank, step, i, shape)}
        for kind, grad_fn in grads.items():
            for wire in (None, torch.bfloat16):
                params = muon_params()
                muon = tg.NorMuon(table(params), **MUON_HP, wire_dtype=wire)
                sent.clear()
                steps = []
                for step in range(3):
                    for i, p in enumerate(params):
                        p.grad = grad_fn(step, i, p.shape)
                    muon.step()
                    muon.zero_grad()
                    steps.append(clone_all(params))
                stepped = set(sent)
                muon.exact_weights()
                owned = set()
                for group in muon.param_groups:
                    start, _, n_real = muon._owned(group)
                    owned |= {id(p) for p in group["params"][start: start + n_real]}
                result[kind, wire] = dict(steps=steps, exact=clone_all(params), sent=stepped,
                                          owned=[id(p) in owned for p in params])
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_normuon_sends_bf16_and_keeps_the_exact_weights_where_they_are_owned():
    """On 2 gloo processes: with wire_dtype bf16 both collectives send bf16; a rank holds the exact weights of
    the parameters it owns and the others rounded to bf16 (so every rank's forward, which casts the weights to
    bf16, sees the same weights), and exact_weights() makes every rank's parameters exact. On bf16-exact
    gradients equal across ranks the average is exact, so the exact weights are bit-identical to fp32's."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_wire_worker, args=(2, _free_port(), out_dir), nprocs=2, join=True)
        results = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(2)]
    start = muon_params()
    for rank, result in enumerate(results):
        assert result["same", None]["sent"] == {torch.float32}
        assert result["same", torch.bfloat16]["sent"] == {torch.bfloat16}
        owned = result["same", torch.bfloat16]["owned"]
        assert any(owned) and not all(owned), owned  # each rank owns some parameters, not all
        fp32, bf16 = result["same", None], result["same", torch.bfloat16]
        for step in range(3):
            for exact, got, is_owned, p0 in zip(fp32["steps"][step], bf16["steps"][step], owned, start):
                assert not torch.equal(exact, p0.detach()), spec(p0).label
                expected = exact if is_owned else exact.bfloat16().float()
                assert torch.equal(got, expected), (rank, step, spec(p0).label, is_owned)
        assert all(torch.equal(a, b) for a, b in zip(fp32["exact"], bf16["exact"])), rank
    for kind in ("same", "by_rank"):  # the ranks agree on the weights the forward sees, and after exact_weights()
        r0, r1 = results[0][kind, torch.bfloat16], results[1][kind, torch.bfloat16]
        for a, b in zip(r0["steps"][-1], r1["steps"][-1]):
            assert torch.equal(a.bfloat16(), b.bfloat16())
        assert all(torch.equal(a, b) for a, b in zip(r0["exact"], r1["exact"]))
    # rank-dependent gradients averaged in bf16: 3 steps of at most lr x lr_mul x sqrt(3) = 0.17 each, in a
    # direction the gradient's bf16 rounding (2^-8) moves by well under 4 % (Polar Express may amplify it along
    # the smallest singular directions): within 3 x 0.17 x 0.04 = 0.02
    for a, b in zip(results[0]["by_rank", None]["exact"], results[0]["by_rank", torch.bfloat16]["exact"]):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


# ----------------------------------------------------------------------------------------------
# Parameter coverage

def _check_coverage(model, hp):
    muon, adam = tg.make_optimizers(model, hp, tg.backend_for(hp, torch.device("cpu")))
    SPECS.update(model.param_table())
    owned = [p for g in muon.param_groups for p in g["params"]] + [p for g in adam.param_groups for p in g["params"]]
    model_ids = [id(p) for p in model.parameters()]
    assert sorted(id(p) for p in owned) == sorted(model_ids)  # every parameter exactly once
    assert len(set(map(id, owned))) == len(owned) == len(model_ids)
    for g in muon.param_groups:  # sqrt(max(1, rows / cols)) of each orthogonalized piece, x the lr multiplier
        expected = [math.sqrt(max(1.0, p.shape[0] / spec(p).pieces / p.shape[1])) * spec(p).lr_mul for p in g["params"]]
        if not g["lr_scale"].is_meta:
            assert g["lr_scale"][: len(expected)].tolist() == pytest.approx(expected)
    return muon, adam


def test_optimizers_cover_record_model_exactly_once():
    hp = tg.parse_args([])
    with torch.device("meta"):
        model = tg.build_model(hp, torch.device("meta"))
    muon, adam = _check_coverage(model, hp)
    assert {spec(p).label for g in muon.param_groups for p in g["params"]} == {"attn_qk", "attn_vo", "mlp"}  # gates: Adam
    assert {spec(p).label for g in adam.param_groups for p in g["params"]} == set(tg.ADAM_GROUPS)
    mlp = [p for g in muon.param_groups for p in g["params"] if spec(p).label == "mlp"]
    # 11 MLP fc + 11 MLP proj (lr_mul 2); 10 attention layers (one layer is attention-free) of [Q; K] and [V; O]
    assert sorted(spec(p).lr_mul for p in mlp) == [1.0] * 11 + [2.0] * 11
    assert [spec(p).pieces for g in muon.param_groups for p in g["params"] if spec(p).label == "attn_qk"] == [6] * 10  # head pairs
    assert [spec(p).pieces for g in muon.param_groups for p in g["params"] if spec(p).label == "attn_vo"] == [2] * 10
    scalars = [p for g in adam.param_groups for p in g["params"] if spec(p).label == "scalars"]
    assert len(scalars) == 1 and (spec(scalars[0]).lr_mul, spec(scalars[0]).wd_mul) == (5.0, 0.0)


def test_normuon_sends_bf16_on_the_gpu_path_only():
    """make_optimizers picks NorMuon's wire dtype from the backend the model was built with: bf16 for the GPU
    path (bf16 head), the parameters' own dtype on the CPU path (whose losses stay bit-identical)."""
    hp = tg.parse_args([])
    gpu_backend = tg.backend_for(hp, torch.device("cuda"), fp8_hardware=True, attention=tg.TiledWindowAttention())
    gpu_backend = gpu_backend._replace(compile_math=False)
    cpu_backend = tg.backend_for(hp, torch.device("cpu"))
    with torch.device("meta"):
        gpu, cpu = tg.GPT(hp, gpu_backend), tg.GPT(hp, cpu_backend)
    assert tg.make_optimizers(gpu, hp, gpu_backend)[0].wire_dtype == torch.bfloat16
    assert tg.make_optimizers(cpu, hp, cpu_backend)[0].wire_dtype is None


# ----------------------------------------------------------------------------------------------
# Schedules of the record, expected values by hand (every step is compared with re-implementations of the
# reference's functions in test_reference_recipe_89.py)
#
# 1380 scheduled steps in thirds ending at round(1380/3) = 460 and round(2 x 1380/3) = 920: stage 0 = steps
# 0..459, 1 = 460..919, 2 = 920..1379; extension = 1380..1389 (10 steps). The lr multiplier (1, 1.52, 1.73)
# switches with the batch size and window. Cooldown over the last 60 %: from int(1380 x 0.4) = 552 over
# 828 steps to 0.15, m (1 - t) + 0.15 t with t = (s - 552) / 828:
#   551, 552: 1.52 (t = 0)
#   553:  1.52 x 827/828 + 0.15 / 828 = 1.5183454
#   919:  1.52 x 461/828 + 0.15 x 367/828 = 0.9127657
#   920:  1.73 x 460/828 + 0.15 x 368/828 = 1.0277778
#   1379: 1.73 / 828 + 0.15 x 827/828 = 0.1519082
#   1380+: 0.15 (extension)
# Windows (short, long) in blocks: short = long // 2 blocks.
# Momentum: 0.85 -> 0.95 over steps 0..300 (0.85 + 0.1 s / 300); back towards 0.85 over the last 50
# steps, from 1390 - 50 = 1340: 0.95 - 0.1 (s - 1340) / 50:
#   1379: 0.95 - 0.1 x 39/50 = 0.872; 1380: 0.87; 1389: 0.95 - 0.1 x 49/50 = 0.852.
# Adam steps on odd steps.
SCHEDULE_TABLE = [
    # step, stage, batch, windows, lr multiplier, momentum, adam steps
    (0, 0, 131072, (1, 3), 1.0, 0.85, False),
    (150, 0, 131072, (1, 3), 1.0, 0.90, False),
    (300, 0, 131072, (1, 3), 1.0, 0.95, False),
    (459, 0, 131072, (1, 3), 1.0, 0.95, True),
    (460, 1, 262144, (3, 7), 1.52, 0.95, False),
    (552, 1, 262144, (3, 7), 1.52, 0.95, False),
    (553, 1, 262144, (3, 7), 1.52 * 827 / 828 + 0.15 / 828, 0.95, True),
    (919, 1, 262144, (3, 7), 1.52 * 461 / 828 + 0.15 * 367 / 828, 0.95, True),
    (920, 2, 393216, (5, 11), 1.73 * 460 / 828 + 0.15 * 368 / 828, 0.95, False),
    (1340, 2, 393216, (5, 11), 1.73 * 40 / 828 + 0.15 * 788 / 828, 0.95, False),
    (1379, 2, 393216, (5, 11), 1.73 / 828 + 0.15 * 827 / 828, 0.872, True),
    (1380, 3, 393216, (6, 13), 0.15, 0.87, False),
    (1389, 3, 393216, (6, 13), 0.15, 0.852, True),
]


@pytest.mark.parametrize("row", SCHEDULE_TABLE, ids=[f"step{r[0]}" for r in SCHEDULE_TABLE])
def test_record_schedule_table(row):
    step, stage, batch, windows, lr_mul, momentum, adam = row
    plan = tg.Schedule(tg.parse_args([])).at(step)
    assert plan.stage == stage
    assert plan.batch_tokens == batch
    assert plan.windows == windows
    assert plan.lr_multiplier == pytest.approx(lr_mul, abs=1e-9)
    assert plan.momentum == pytest.approx(momentum, abs=1e-9)
    assert plan.adam_step is adam


def test_record_schedule_spot_values():
    schedule = tg.Schedule(tg.parse_args([]))
    # the hand-derived cooldown values above, as decimals
    assert schedule.lr_multiplier(553) == pytest.approx(1.5183454, abs=1e-7)
    assert schedule.lr_multiplier(919) == pytest.approx(0.9127657, abs=1e-7)
    assert schedule.lr_multiplier(920) == pytest.approx(1.0277778, abs=1e-7)
    assert schedule.lr_multiplier(1379) == pytest.approx(0.1519082, abs=1e-7)
    assert schedule.stage_first_steps() == [0, 460, 920, 1380]
    assert [(s.first_step, s.end_step) for s in schedule.stages] == [(0, 460), (460, 920), (920, 1380), (1380, 1390)]
