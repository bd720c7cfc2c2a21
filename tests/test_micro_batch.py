"""--micro_batch_tokens: a micro-step runs as pieces of whole documents (only a document longer than a piece is
cut), each padded to a fixed length and carrying the context the uncut micro-step reads outside it (the
document before it, the next two targets, the rotary positions). The pieces hold the micro-step exactly and
the loader's walk does not depend on the cap; the pieces' gradients are the uncut ones to fp32 rounding with
the key shift closed, and within KEY_SHIFT_RESIDUAL_BOUND (1.7e-5) with it open (it reaches past the previous
document); each carried piece of context, left out, moves them measurably; validation in pieces has the uncut
loss; the warm-up visits every piece length; runs with pieces stay within a measured distance of the uncut run
and resume across caps."""
import dataclasses
import math
import re
import sys

import numpy as np
import pytest
import torch

import train_gpt as tg
from conftest import ROOT
from test_loader import write_shards
from test_training import corpus, restore_threads, run_main, short  # noqa: F401 (fixtures)

CPU = torch.device("cpu")
FP32_UNIT_ROUNDOFF = 2.0 ** -24
BF16_UNIT_ROUNDOFF = 2.0 ** -8
# Parameters used through a bf16 copy (the reference rounds them before use): autograd rounds the gradient of
# that copy to bf16 in every forward, so a micro-step in k pieces rounds k partial sums instead of one.
BF16_ROUNDED = ("resid_lambdas", "post_lambdas", "x0_lambdas", "bigram_lambdas")


def test_pack_documents_keeps_documents_whole_and_in_order():
    assert tg.pack_documents([3, 5, 2, 6], 16) == ([(0, 16)], 0)
    assert tg.pack_documents([3, 5, 2, 6], 10) == ([(0, 10), (10, 16)], 0)
    assert tg.pack_documents([3, 5, 2, 6], 8) == ([(0, 8), (8, 16)], 0)
    assert tg.pack_documents([3, 5, 2, 6], 7) == ([(0, 3), (3, 10), (10, 16)], 0)
    # only a document longer than a piece is cut, into pieces of its own; the next documents join its last
    assert tg.pack_documents([3, 17, 2, 6], 8) == ([(0, 3), (3, 11), (11, 19), (19, 22), (22, 28)], 1)
    assert tg.pack_documents([9, 9], 8) == ([(0, 8), (8, 9), (9, 17), (17, 18)], 2)


def test_cut_lengths():
    lengths = np.array([3, 5, 2, 6])  # documents at 0, 3, 8, 10
    assert tg.cut_lengths(lengths, 0, 16).tolist() == [3, 5, 2, 6]
    assert tg.cut_lengths(lengths, 0, 8).tolist() == [3, 5]  # a cut at a document start
    assert tg.cut_lengths(lengths, 4, 12).tolist() == [4, 2, 2]  # through documents at both ends
    assert tg.cut_lengths(lengths, 10, 16).tolist() == [6]


def _real(piece):
    """The positions of a piece that belong to its micro-step's tokens."""
    return piece.loss_mask.nonzero()[:, 0]


def test_pieces_are_the_micro_step_and_the_walk_ignores_the_cap(tmp_path):
    """The pieces' tokens (loss_mask) are the uncut micro-step in order (inputs, targets, rotary positions,
    bigram ids hashed over the whole micro-step), each piece of one fixed length, whole documents only, led
    by the document before it (its rotary positions too), the two targets after its last token on the next
    positions (none past the micro-step's end), the padding a document of its own; on 2 ranks; the loaders'
    positions afterwards are the same."""
    pattern, _ = write_shards(tmp_path, np.random.default_rng(7), [6000, 5000])
    rank_tokens, max_seq_len, world, rows = 300, 64, 2, 1000
    for rank in range(world):
        whole, cut = (tg.TrainLoader(pattern, rank, world, CPU, bigram_rows=rows) for _ in range(2))
        for cap in (300, 150, 100, 97, 64):
            batch = whole.next_batch(rank_tokens, max_seq_len)
            pieces = cut.next_pieces(rank_tokens, max_seq_len, cap)
            if cap == rank_tokens:
                assert len(pieces) == 1 and all(torch.equal(a, b) for a, b in zip(pieces[0][:4], batch[:4]))
                assert pieces[0].positions is None and pieces[0].loss_mask is None
                continue
            assert {len(p.inputs) for p in pieces} == {tg.padded_piece_length(rank_tokens, cap, max_seq_len)} == \
                {cap + max_seq_len + 2}
            real = [_real(p) for p in pieces]
            assert all(len(r) <= cap for r in real)
            assert torch.equal(torch.cat([p.inputs[r] for p, r in zip(pieces, real)]), batch.inputs)
            assert torch.equal(torch.cat([p.targets[r] for p, r in zip(pieces, real)]), batch.targets)
            assert torch.equal(torch.cat([p.bigram_ids[r] for p, r in zip(pieces, real)]), batch.bigram_ids)
            assert torch.equal(torch.cat([p.positions[r] for p, r in zip(pieces, real)]), torch.arange(rank_tokens))
            uncut_starts = set(batch.cu_seqlens.tolist())
            for i, (p, r) in enumerate(zip(pieces, real)):
                first, last = int(p.positions[r[0]]), int(p.positions[r[-1]])
                bounds = p.cu_seqlens.tolist()
                assert first in uncut_starts and last + 1 in uncut_starts  # whole documents
                assert {b - int(r[0]) + first for b in bounds if r[0] <= b <= r[-1] + 1} == \
                    {b for b in uncut_starts if first <= b <= last + 1}
                context = int(r[0])  # the whole document before the piece, its own document here too
                assert (context > 0) == (i > 0) and first - context == max([0] + [b for b in uncut_starts if b < first])
                assert torch.equal(p.inputs[:context], batch.inputs[first - context: first]) and context in bounds
                assert torch.equal(p.positions[:context], torch.arange(first - context, first))
                assert int(r[-1]) + 1 in bounds  # the padding is a document of its own
                after = p.targets[r[-1] + 1: r[-1] + 3]
                assert torch.equal(after[after >= 0], batch.targets[last + 1: last + 3])
                assert (p.targets[r[-1] + 3:] == tg.NO_TARGET).all() and (i == 0 or p.targets[0] == tg.NO_TARGET)
            assert whole.state_dict() == cut.state_dict()
        whole.close()
        cut.close()


def _cpu_model(vocab=None, seed=0):
    """The cpu preset's model (recipe 89: smear gate, key shift, bigram embedding, paired heads, XSA, MUDD)
    on the CPU path, in training mode, its zero-initialized parameters filled and the smear lambda at 0.5 so
    that every path carries gradient; with a smaller vocabulary (and bigram table) if `vocab`."""
    hp = tg.parse_args(["--preset", "cpu"])
    if vocab:
        hp = dataclasses.replace(hp, vocab_size=vocab, bigram_vocab_size=15 * vocab)
    torch.manual_seed(seed)
    model = tg.build_model(hp, CPU).train()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.abs().max() == 0 or p.numel() < 64:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        model.scalars[2 * model.num_layers] = 0.5  # smear
    return hp, model


def _micro_step(hp, tokens, longest, seed=0):
    """(window, document lengths, bigram ids) of a micro-step of BOS-started random documents of 20 ...
    longest tokens; the last document runs one token past it (the last target), as the loader's do."""
    rng = np.random.default_rng(seed)
    lengths = []
    while sum(lengths) < tokens + 1:
        lengths.append(int(rng.integers(20, longest + 1)))
    lengths[-1] -= sum(lengths) - (tokens + 1)
    lengths = np.array(lengths)
    window = rng.integers(1, hp.vocab_size - 1, size=tokens + 1)
    window[np.cumsum(lengths) - lengths] = 0  # token 0 stands for the document token in any vocabulary
    return window, lengths, tg.bigram_hash(window[:-1], hp.bigram_vocab_size)


def _split_before(lengths, start):
    """The document lengths with the token before `start` made a document of its own (a shorter context)."""
    ends = np.cumsum(lengths)
    i = int(np.searchsorted(ends, start - 1, side="right"))
    head = start - 1 - (ends[i] - lengths[i])
    return np.concatenate([lengths[:i], [head, 1, lengths[i] - head - 1], lengths[i + 1:]]).astype(int)


def _pieces(window, lengths, bigram_ids, cap, previous_token_only=False):
    """The micro-step's pieces (as the loader makes them); with previous_token_only, each piece's context is
    the token before it alone (a document of its own) instead of the whole document before it."""
    tokens = len(window) - 1
    bounds, cut = tg.pack_documents(tg.cut_lengths(lengths, 0, tokens), cap)
    length = tg.padded_piece_length(tokens, cap, max(lengths))
    own = [_split_before(lengths, a) if previous_token_only and a else lengths for a, _ in bounds]
    return [tg.piece_inputs(window, doc_lengths, a, b, length, CPU, bigram_ids)
            for (a, b), doc_lengths in zip(bounds, own)], cut


def _gradients(model, hp, pieces):
    """{parameter name: gradient} of the micro-step run as `pieces` at step 0 (windows, multi-token weights)."""
    model.zero_grad()
    plan = tg.Schedule(hp).at(0)
    for piece in pieces:
        model(piece.inputs, piece.targets, piece.cu_seqlens, plan.windows, piece.bigram_ids, plan.mtp_weights,
              piece.positions, piece.loss_mask).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _distance(a, b, bf16_rounded=False):
    """|a - b| / |b| over the parameters (those used through a bf16 copy, or all the others)."""
    names = [n for n in b if (n in BF16_ROUNDED) == bf16_rounded]
    diff = torch.cat([(a[n] - b[n]).flatten() for n in names])
    return (diff.norm() / torch.cat([b[n].flatten() for n in names]).norm()).item()


def _without(piece, what):
    """A piece with one carried piece of context taken away (the positive controls)."""
    context = int(_real(piece)[0])
    if what == "previous token":  # the smear gate and the bigram sign of its first token see another token
        inputs = piece.inputs.clone()
        inputs[max(context - 1, 0)] = 7
        return piece._replace(inputs=inputs)
    if what == "next targets":  # its last positions lose their multi-token targets
        targets = piece.targets.clone()
        real = _real(piece)
        targets[real[-1] + 1:] = tg.NO_TARGET
        return piece._replace(targets=targets)
    return piece._replace(positions=torch.arange(len(piece.inputs)))  # "positions": the rotary tables restart


def _check_exactness(vocab, tokens, fractions, longest):
    """Error model: each gradient entry is a sum over the micro-step's positions, which the pieces group
    otherwise; fp32 rounding of such sums grows like sqrt(n) x 2^-24 in relative norm (2.7e-6 at n = 2048),
    and the measured distances lie well under 1e-6, the bound. The four bf16-used lambda vectors are rounded
    to bf16 once per piece: within 2^-8 x sqrt(pieces). The key shift is closed here: its channel reaches
    past the previous document (see the last test).
    Each positive control moves the gradients by more than 10x the bound."""
    hp, model = _cpu_model(vocab)
    assert any(layer.key_shift for layer in model.plan)  # the cpu preset's long-window layers shift keys
    model.plan = [layer._replace(key_shift=False) for layer in model.plan]
    window, lengths, ids = _micro_step(hp, tokens, longest)
    uncut = _gradients(model, hp, [tg.model_inputs(window, lengths, CPU, ids)])
    for fraction in fractions:
        pieces, cut = _pieces(window, lengths, ids, int(tokens * fraction))
        assert cut == 0 and len(pieces) >= 1 / fraction
        got = _gradients(model, hp, pieces)
        distance, rounded = _distance(got, uncut), _distance(got, uncut, bf16_rounded=True)
        print(f"{tokens} tokens in {len(pieces)} pieces of <= {int(tokens * fraction)}: relative gradient distance "
              f"{distance:.2e}, bf16-used lambdas {rounded:.2e}")
        assert distance < 1e-6 and rounded < BF16_UNIT_ROUNDOFF * math.sqrt(len(pieces))
    pieces, _ = _pieces(window, lengths, ids, int(tokens * fractions[0]))
    for what in ("previous token", "next targets", "positions"):
        moved = _distance(_gradients(model, hp, [_without(p, what) for p in pieces]), uncut)
        print(f"without its {what}: {moved:.2e}")
        assert moved > 10 * 1e-6, what


def test_pieces_give_the_uncut_gradients():
    """The cpu preset's model with a 1,024-token vocabulary, a micro-step of 512 tokens (documents of 20-70
    tokens) in pieces of at most 1/2, 1/3, 1/7 of it; and the positive controls. Measured: 2.3e-7, 2.5e-7,
    3.1e-7 (3, 4, 10 pieces; bf16-used lambdas 1.7e-3 to 1.9e-3); without the previous token 7.2e-2, without
    the next targets 3.2e-2, without the rotary positions 6.1e-5."""
    _check_exactness(1024, 512, (1 / 2, 1 / 3, 1 / 7), longest=70)


@pytest.mark.slow
def test_pieces_give_the_uncut_gradients_of_the_cpu_preset():
    """As above with the cpu preset itself (50,304-token vocabulary) and its first micro-step size, 2,048 tokens
    (documents of 20-290 tokens, so that pieces of 1/7 hold them whole). Measured: 2.4e-7, 2.8e-7, 2.9e-7 (3, 4,
    9 pieces); without the previous token 3.2e-2, the next targets 1.6e-2, the rotary positions 3.6e-5."""
    _check_exactness(None, 2048, (1 / 2, 1 / 3, 1 / 7), longest=290)


# The open key-shift channel. A piece carries the whole document before it, but the key shift goes one document
# further: that document's own first key takes, on its position-free dims, the last key of the document before it,
# whose key takes the one before that, a chain back to the micro-step's start. The uncut micro-step computes that
# chain's keys once; a piece recomputes its context document's first key without the document before it (the
# chain cut there), and fp32 rounds the chain's sums in another order. The residual is that key's difference,
# propagated through attention into the piece's first document, plus the gradient sums grouped otherwise (the
# closed channel's 1e-6). It grows with the number of cuts. Measured worst relative gradient distance over pieces
# of 1/2, 1/3 and 1/7 of a 512-token micro-step (3, 4 and 10 pieces: 2.7e-6, 4.1e-6, 5.7e-6); the bound is 3x the
# worst, far below what a piece without its previous document gives (4.7e-4, the positive control).
KEY_SHIFT_RESIDUAL_BOUND = 1.7e-5


def test_the_open_key_shift_stays_within_its_bound():
    """With the key shift open (as the trainer runs): pieces of at most 1/2, 1/3, 1/7 of a micro-step of 512
    tokens give the uncut gradients within KEY_SHIFT_RESIDUAL_BOUND (its error model above); the positive
    control: with the token before each piece alone as its context (not its document), the first key of the
    piece's first document sees another key at every key-shift layer and the gradients move by more than 10x
    the bound."""
    hp, model = _cpu_model(1024)
    window, lengths, ids = _micro_step(hp, 512, 70)
    uncut = _gradients(model, hp, [tg.model_inputs(window, lengths, CPU, ids)])
    for fraction in (1 / 2, 1 / 3, 1 / 7):
        pieces, _ = _pieces(window, lengths, ids, int(512 * fraction))
        distance = _distance(_gradients(model, hp, pieces), uncut)
        print(f"key shift open, {len(pieces)} pieces of <= {int(512 * fraction)}: relative gradient distance "
              f"{distance:.2e}")
        assert distance < KEY_SHIFT_RESIDUAL_BOUND
    token_only, _ = _pieces(window, lengths, ids, 256, previous_token_only=True)
    token_distance = _distance(_gradients(model, hp, token_only), uncut)
    print(f"with the previous token alone as the context: {token_distance:.2e}")
    assert token_distance > 10 * KEY_SHIFT_RESIDUAL_BOUND


def _validation_loss(model, pieces, windows, tokens):
    """The mean loss of one validation forward run as `pieces`, as Trainer.validation_loss forms it."""
    with torch.no_grad():
        if pieces[0].loss_mask is None:
            p = pieces[0]
            return model(p.inputs, p.targets, p.cu_seqlens, windows, p.bigram_ids).item()
        return (sum(model(p.inputs, p.targets, p.cu_seqlens, windows, p.bigram_ids, positions=p.positions,
                          loss_mask=p.loss_mask) for p in pieces) / tokens).item()


def test_validation_in_pieces_has_the_uncut_loss(monkeypatch):
    """--micro_batch_tokens cuts a validation forward into pieces of consecutive tokens, each led by the
    receptive field's tokens before it. The cpu preset's model (1,024-token vocabulary) in evaluation, a
    validation window of 3,072 tokens that starts inside a document and holds documents of 64-1,500 tokens
    (longer than the pieces and than the context), windows of (1, 2) blocks (a receptive field of 1,930 tokens, shorter
    than the window), pieces of 1/3, 1/5 and 1/11 of it. Error model: every loss term is the uncut one but for
    the fp32 rounding of attention and norms in another tile layout, and the mean sums the same 3,072 terms
    grouped otherwise: sqrt(6144) x 2^-24 = 4.7e-6 relative (the bound); measured: 6.3e-8. Control
    (the head's weights scaled up, so that the loss feels its context): pieces without their context move the
    loss by more than 10x the bound (measured: 7.2e-5 at worst)."""
    hp, model = _cpu_model(1024)
    monkeypatch.setattr(tg, "BOS_ID", 0)  # token 0 stands for the document token in this vocabulary
    with torch.no_grad():
        model.lm_head.weight.mul_(400)  # logits that vary: a loss that feels its context
    model.eval()
    rng = np.random.default_rng(3)
    tokens = 6144
    window = rng.integers(1, hp.vocab_size - 1, size=2 * tokens)
    starts = np.cumsum(rng.integers(64, 3000, size=64))
    window[starts[starts < len(window)]] = tg.BOS_ID
    windows = torch.tensor((1, 2), dtype=torch.int32)
    context = tg.receptive_field(model.plan, {(1, 2)}, hp.window_block_tokens)
    assert context < tokens // 3 and any(np.diff([0, *starts[starts < tokens]]) > tokens // 5 + context)

    def losses(cap, context):
        return [_validation_loss(model, pieces, windows, tokens) for pieces in
                tg.validation_pieces(window, tokens, tokens, 0, 1, 1, CPU, cap, context, hp.bigram_vocab_size)]

    uncut = losses(tokens, context)
    bound = math.sqrt(tokens) * FP32_UNIT_ROUNDOFF
    for cap in (tokens // 3, tokens // 5, tokens // 11):
        cut = losses(cap, context)
        worst = max(abs(a - b) / b for a, b in zip(cut, uncut))
        print(f"validation in pieces of {cap}: losses {cut} against {uncut}, worst relative difference {worst:.1e}")
        assert worst < bound
    moved = max(abs(a - b) / b for cap in (tokens // 3, tokens // 5) for a, b in zip(losses(cap, 0), uncut))
    print(f"pieces of 1/3 or 1/5 without their context: {moved:.1e}")
    assert moved > 10 * bound


def test_validation_is_not_cut_into_pieces_as_long_as_the_uncut_forward():
    """--micro_batch_tokens 129 on 1,024-token validation forwards with a longer receptive field cut
    each into 8 pieces of 1,024 positions (129 tokens after up to 895 of context): 8 times the work
    for no memory. Such a forward now runs uncut, and pieces that are shorter still cut it."""
    window = np.arange(1, 2050) % 1000
    window[::300] = tg.BOS_ID

    def forwards(cap, context):
        return [[len(b.inputs) for b in pieces] for pieces in
                tg.validation_pieces(window, 2048, 1024, 0, 1, 1, CPU, cap, context)]
    assert forwards(129, 2000) == [[1024], [1024]]  # (the context reaches across the whole forward)
    assert tg.validation_piece_length(1024, 129, 2000) == 1024
    assert forwards(129, 200) == [[329] * 8, [329] * 8]  # 129 tokens after 200 of context: shorter


@pytest.mark.slow
def test_warm_up_runs_every_piece_length(corpus, tmp_path, restore_threads):  # noqa: F811
    """The warm-up's steps give the forward every piece length the run will use (one compiled graph each)."""
    argv = short(corpus, "--batch_sizes", 256, 384, 512, "--micro_batch_tokens", 200, "--warmup_steps", 1,
                 "--val_tokens", 512, "--log_dir", tmp_path, "--run_id", "warm")
    trainer = tg.Trainer(tg.parse_args(list(map(str, argv))))
    seen = set()
    forward = trainer.forward
    trainer.forward = lambda inputs, *rest, **kw: seen.add(len(inputs)) or forward(inputs, *rest, **kw)
    trainer.warm_up()
    expected = {length for _, length in tg.micro_step_pieces(trainer.hp, trainer.schedule.stages, 1, 1)}
    assert expected == {650, 458}  # 200 tokens, the previous document (448 / 256 at most) and 2 targets
    assert expected <= seen
    trainer.loader.close()


@pytest.mark.slow
def test_a_run_with_cuts_through_documents_stays_close_and_resumes_across_caps(corpus, tmp_path, capsys,
                                                                               restore_threads):  # noqa: F811
    """The tiny configuration (512 tokens per step, documents of 32-1024 tokens cut to 448 in the first stage,
    256 later) uncut and in pieces of at most 200 tokens (documents longer than that are cut, each later part
    with the earlier one as its context). The val losses at steps 0/2/4/6/8 are printed. Bound:
    0.01, under half the 1-vs-2-process difference at the same steps (0.023-0.069, test_training), which
    moves document cuts too. Resuming the cut run's step-4 checkpoint with the same cap continues it exactly;
    with no cap, the log says so and the losses stay within the bound. The validations run in pieces too (of
    512 positions: 200 tokens after their context), step 0's to fp32 rounding of the uncut one."""
    log_dir = tmp_path / "logs"
    uncut, code, err = run_main(short(corpus, "--log_dir", log_dir, "--run_id", "uncut"), capsys)
    assert code == 0, err
    cut, code, err = run_main(short(corpus, "--log_dir", log_dir, "--run_id", "cut", "--micro_batch_tokens", 200,
                                    "--save_every", 4), capsys)
    assert code == 0, err
    log = (log_dir / "cut.txt").read_text()
    assert "micro_batch_tokens 200: micro-steps of 512 in pieces of 650 positions, 512 in pieces of 458 positions" in log
    assert re.search(r"^stage 0 pieces: [\d,]+ tokens in [\d,]+ positions \(\d+\.\d% padding and context\); documents "
                     r"longer than --micro_batch_tokens 200, cut: [1-9]\d*$", log, re.M)
    differences = [abs(a - b) for (_, a), (_, b) in zip(uncut, cut)]
    with capsys.disabled():
        print(f"\nuncut {uncut}\ncut {cut}\ndifferences {differences}")
    # step 0: the same model, its validation in pieces: the same 1,024 terms summed in another order
    assert differences[0] <= math.sqrt(1024) * FP32_UNIT_ROUNDOFF * uncut[0][1] and max(differences) < 0.01
    checkpoint = log_dir / "checkpoints" / "cut" / "step_000004.pt"
    same, code, err = run_main(short(corpus, "--log_dir", log_dir, "--run_id", "same", "--micro_batch_tokens", 200,
                                     "--resume", checkpoint), capsys)
    assert code == 0, err
    assert same == [(s, v) for s, v in cut if s >= 4]
    other, code, err = run_main(short(corpus, "--log_dir", log_dir, "--run_id", "other", "--resume", checkpoint), capsys)
    assert code == 0, err
    assert "--micro_batch_tokens changes from 200 (the checkpoint's run) to 0" in (log_dir / "other.txt").read_text()
    assert other[0] == same[0]  # step 4's validation comes before any step with the new cap
    assert all(abs(a - b) < 0.01 for (_, a), (_, b) in zip(other, same))


@pytest.mark.slow
def test_a_step_in_pieces_has_the_uncut_step_loss(corpus, tmp_path, restore_threads):  # noqa: F811
    """train_step's loss (summed over pieces) is the uncut step's at step 0, the multi-token loss on, in pieces
    of at most 448 tokens (the first stage's longest document: none is cut), with a zero attention output
    projection (so that the key shift, carried but for the previous document's own first key, changes nothing
    yet): to the rounding of a sum over 512 tokens grouped otherwise, sqrt(512) x 2^-24 relative (measured:
    equal). A wrong scale of the pieces would move it by a third, a piece's last positions without their next
    targets by ~2e-3."""
    losses = []
    for cap in (0, 448):
        argv = short(corpus, "--micro_batch_tokens", cap, "--log_dir", tmp_path, "--run_id", f"step{cap}")
        trainer = tg.Trainer(tg.parse_args(list(map(str, argv))))
        with torch.no_grad():
            for layer in trainer.model.layers:
                if hasattr(layer, "vo_w"):
                    layer.vo_w[layer.vo_w.size(0) // 2:].zero_()  # [V; O]: the output projection
        losses.append(trainer.train_step(trainer.begin_step(0))[0][0].item())
        trainer.loader.close()
    print("step loss uncut, in pieces:", losses)
    assert abs(losses[1] - losses[0]) <= math.sqrt(512) * FP32_UNIT_ROUNDOFF * losses[0]


@pytest.mark.slow
def test_micro_batch_distance_tool_reports_every_cap(corpus, tmp_path, capsys):  # noqa: F811
    """tools/micro_batch_distance.py on a checkpoint of the tiny configuration (recipe 89: bigram ids and
    the multi-token loss): every cap's four rows and the batch-noise row, with nonzero distances for pieces."""
    sys.path.insert(0, str(ROOT / "tools"))
    import micro_batch_distance
    from test_sample import tiny_checkpoint
    checkpoint = tiny_checkpoint(tmp_path / "tiny.pt")
    micro_batch_distance.main([str(checkpoint), "--train_files", str(corpus / "synthetic_train_*.bin"),
                               "--micro_batch_tokens", "256", "100", "--micro_steps", "2"])
    out = capsys.readouterr().out
    rows = dict(re.findall(r"^  (.+?)\s+mean (\S+)  max \S+$", out, re.M))
    assert set(rows) == {"consecutive micro-steps (batch noise)"} | {
        f"cap {cap}: {kind}{loss}" for cap in (256, 100) for kind in ("the trainer's pieces", "key shift closed")
        for loss in ("", " (loss)")}, out
    assert float(rows["cap 100: the trainer's pieces"]) > 0 and float(rows["consecutive micro-steps (batch noise)"]) > 0
