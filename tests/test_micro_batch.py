"""--micro_batch_tokens: a micro-step runs as near-equal pieces whose gradients add up. The pieces cover the
micro-step exactly and the loader's walk does not depend on the cap; a cut at a document start gives the
uncut gradients once the three channels that cross it are closed (smear gate, key shift, rotary tables),
each of which, and a cut through a document, moves them measurably; the warm-up visits every piece length;
runs with cuts stay within a measured distance of the uncut run and resume across caps."""
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
from test_model import _small_model
from test_training import corpus, restore_threads, run_main, short  # noqa: F401 (fixtures)

CPU = torch.device("cpu")
FP32_UNIT_ROUNDOFF = 2.0 ** -24
NEXT_TOKEN_ONLY = [1, 0, 0] * 3  # --mtp_weights_* of every stage: the next-token loss alone


@pytest.mark.parametrize("tokens,cap", [(4096, 4096), (4096, 2048), (4096, 1000), (49152, 16384), (32768, 12000), (7, 2)])
def test_piece_bounds_are_near_equal_and_cover_the_micro_step(tokens, cap):
    bounds = tg.piece_bounds(tokens, cap)
    assert len(bounds) == math.ceil(tokens / cap)
    assert bounds[0][0] == 0 and bounds[-1][1] == tokens
    assert all(stop == start for (_, stop), (start, _) in zip(bounds, bounds[1:]))
    lengths = [stop - start for start, stop in bounds]
    assert max(lengths) <= cap and max(lengths) - min(lengths) <= 1


def test_cut_lengths():
    lengths = np.array([3, 5, 2, 6])  # documents at 0, 3, 8, 10
    assert tg.cut_lengths(lengths, 0, 16).tolist() == [3, 5, 2, 6]
    assert tg.cut_lengths(lengths, 0, 8).tolist() == [3, 5]  # a cut at a document start
    assert tg.cut_lengths(lengths, 4, 12).tolist() == [4, 2, 2]  # through documents at both ends
    assert tg.cut_lengths(lengths, 10, 16).tolist() == [6]


def test_pieces_are_the_micro_step_and_the_walk_ignores_the_cap(tmp_path):
    """Concatenated, the pieces are the uncut micro-step (tokens, targets, document boundaries, the last
    piece's last target included, the bigram ids hashed over the whole micro-step), on 2 ranks; the
    loaders' positions afterwards are the same."""
    pattern, _ = write_shards(tmp_path, np.random.default_rng(7), [6000, 5000])
    rank_tokens, max_seq_len, world, rows = 300, 128, 2, 1000
    for rank in range(world):
        whole, cut = (tg.TrainLoader(pattern, rank, world, CPU, bigram_rows=rows) for _ in range(2))
        for cap in (300, 150, 100, 97, 64):
            batch = whole.next_batch(rank_tokens, max_seq_len)
            pieces = cut.next_pieces(rank_tokens, max_seq_len, cap)
            assert [len(p.inputs) for p in pieces] == [b - a for a, b in tg.piece_bounds(rank_tokens, cap)]
            assert torch.equal(torch.cat([p.inputs for p in pieces]), batch.inputs)
            assert torch.equal(torch.cat([p.targets for p in pieces]), batch.targets)
            assert torch.equal(torch.cat([p.bigram_ids for p in pieces]), batch.bigram_ids)
            assert torch.equal(batch.bigram_ids, torch.from_numpy(tg.bigram_hash(batch.inputs.numpy(), rows)))
            offsets = np.cumsum([0] + [len(p.inputs) for p in pieces])
            starts = sorted({int(b) + int(o) for p, o in zip(pieces, offsets) for b in p.cu_seqlens.numpy()})
            assert starts == sorted(set(batch.cu_seqlens.numpy().tolist()) | set(offsets.tolist()))
            for piece in pieces:
                assert piece.cu_seqlens.shape == (len(piece.inputs) + 1,)
                assert piece.cu_seqlens[0] == 0 and piece.cu_seqlens[-1] == len(piece.inputs)
            assert whole.state_dict() == cut.state_dict()
        whole.close()
        cut.close()


def _documents(vocab, lengths, seed=0):
    """A window of BOS-started random documents (one token more than positions) and their lengths."""
    lengths = np.array(lengths)
    window = np.random.default_rng(seed).integers(1, vocab, size=lengths.sum())
    window[np.cumsum(lengths) - lengths] = 0  # token 0 stands for the document token in this vocabulary
    return window, lengths


def _model(open_channels):
    """A small CPU-path model with every path carrying gradient, with the channels that cross a cut at a
    document start closed except `open_channels`: the smear gate (its lambda set to 0), the key shift (no
    long-window layer) and the absolute position of the bf16 rotary tables (frequencies set to 0)."""
    model = _small_model(vocab=1024, block_tokens=64)
    with torch.no_grad():
        if "smear" not in open_channels:
            model.scalars[4 * model.num_layers] = 0.0
        if "rotary" not in open_channels:
            model.rotary.freqs.zero_()
    if "key_shift" not in open_channels:
        model.roles = dataclasses.replace(model.roles, long_window=())
    return model.train()


def _gradients(model, pieces):
    model.zero_grad()
    for piece in pieces:
        model(piece.inputs, piece.targets, piece.cu_seqlens, (2, 4)).backward()
    # at smear lambda 0 a cut still drops the smear term of the lambda's own gradient; leave that entry out
    model.scalars.grad[4 * model.num_layers] = 0
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("cut,open_channels,moves", [
    (256, (), False),  # at a document start, every crossing channel closed: the uncut gradients
    (256, ("smear",), True), (256, ("key_shift",), True), (256, ("rotary",), True),
    (300, (), True),  # through a document: attention across the cut is lost
])
def test_cut_at_document_start_gives_the_uncut_gradients(cut, open_channels, moves):
    """Error model: each gradient entry is a sum over the 512 positions whose grouping the cut changes;
    fp32 rounding of such sums grows like sqrt(n) x 2^-24 = 1.3e-6 in relative norm (measured: 1.3e-7). The
    open channels move the gradients by 1.2e-2 (smear at lambda 0.5), 7.5e-4 (key shift), 1.7e-5 (rotary
    tables), a cut through a document by 7.1e-3: all more than 10x the tolerance."""
    window, lengths = _documents(1024, [100, 156, 60, 197])
    total = len(window) - 1
    model = _model(open_channels)
    uncut = _gradients(model, [tg.model_inputs(window, lengths, CPU)])
    pieces = [tg.model_inputs(window[a: b + 1], tg.cut_lengths(lengths, a, b), CPU) for a, b in ((0, cut), (cut, total))]
    distance = ((_gradients(model, pieces) - uncut).norm() / uncut.norm()).item()
    tolerance = math.sqrt(total) * FP32_UNIT_ROUNDOFF
    print(f"cut at {cut}, open {open_channels}: relative gradient distance {distance:.2e} (tolerance {tolerance:.1e})")
    assert (distance > 10 * tolerance) if moves else (distance < tolerance)


@pytest.mark.slow
def test_warm_up_runs_every_piece_length(corpus, tmp_path, restore_threads):  # noqa: F811
    """The warm-up's steps give the forward every piece length the run will use (one compiled graph each)."""
    argv = short(corpus, "--batch_sizes", 256, 384, 512, "--micro_batch_tokens", 200, "--warmup_steps", 1,
                 "--val_tokens", 512, "--log_dir", tmp_path, "--run_id", "warm")
    trainer = tg.Trainer(tg.parse_args(list(map(str, argv))))
    seen = set()
    forward = trainer.forward
    trainer.forward = lambda inputs, *rest: seen.add(len(inputs)) or forward(inputs, *rest)
    trainer.warm_up()
    expected = {n for lengths in tg.micro_step_pieces(trainer.hp, 1, 1).values() for n in lengths}
    assert expected == {128, 192, 170, 171}  # 256 = 2 x 128, 384 = 2 x 192, 512 = 170 + 171 + 171
    assert expected <= seen
    trainer.loader.close()


@pytest.mark.slow
def test_a_run_with_cuts_through_documents_stays_close_and_resumes_across_caps(corpus, tmp_path, capsys,
                                                                               restore_threads):  # noqa: F811
    """The tiny configuration (512 tokens per step, documents of 32-1024 tokens cut to 256) uncut and in
    pieces of at most 200 (3 per micro-step: 2 cuts, nearly always through documents). Measured: the val
    losses at steps 0/2/4/6/8 differ by 0/0.0006/0.0013/0.0002/0.0001 (they fall from 10.83 to 9.25). Bound:
    0.01, under half the 1-vs-2-process difference at the same steps (0.023-0.069, test_training), which
    moves document cuts too. Resuming the cut run's step-4 checkpoint with the same cap continues it exactly;
    with no cap, the log says so and the losses stay within the bound."""
    log_dir = tmp_path / "logs"
    uncut, code, err = run_main(short(corpus, "--log_dir", log_dir, "--run_id", "uncut"), capsys)
    assert code == 0, err
    cut, code, err = run_main(short(corpus, "--log_dir", log_dir, "--run_id", "cut", "--micro_batch_tokens", 200,
                                    "--save_every", 4), capsys)
    assert code == 0, err
    assert "micro_batch_tokens 200: micro-steps of 512 as 3 x 171/170 tokens" in (log_dir / "cut.txt").read_text()
    differences = [abs(a - b) for (_, a), (_, b) in zip(uncut, cut)]
    with capsys.disabled():
        print(f"\nuncut {uncut}\ncut {cut}\ndifferences {differences}")
    assert differences[0] == 0 and 0 < max(differences) < 0.01
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
    """train_step's loss (summed over pieces) is the uncut step's at step 0 with a zero attention output
    projection and the next-token loss alone, where nothing crosses a cut (the attention outputs, the smear
    and the bigram embedding start at zero; the bigram ids are hashed over the whole micro-step): to the
    rounding of a sum over 512 tokens grouped otherwise, sqrt(512) x 2^-24 relative (measured: equal). A
    wrong scale of the pieces would move it by a third. Measured, for the README: the multi-token loss moves
    it by 2.2e-3 (a piece's last two positions lack their later targets), recipe 89's nonzero output
    projection by 2.2e-6 more (attention across the cuts)."""
    losses = []
    for cap in (0, 200):
        argv = short(corpus, "--micro_batch_tokens", cap, "--zero_init_attn_out", "true", "--mtp_weights_start",
                     *NEXT_TOKEN_ONLY, "--mtp_weights_end", *NEXT_TOKEN_ONLY, "--log_dir", tmp_path,
                     "--run_id", f"step{cap}")
        trainer = tg.Trainer(tg.parse_args(list(map(str, argv))))
        losses.append(trainer.train_step(0, *trainer.schedule(0))[0].item())
        trainer.loader.close()
    print("step loss uncut, in pieces:", losses)
    assert abs(losses[1] - losses[0]) <= math.sqrt(512) * FP32_UNIT_ROUNDOFF * losses[0]


@pytest.mark.slow
def test_micro_batch_distance_tool_reports_every_cap(corpus, tmp_path, capsys):  # noqa: F811
    """tools/micro_batch_distance.py on a checkpoint of the tiny configuration (recipe 89: bigram ids and
    the multi-token loss): every cap's two rows and the batch-noise row, with nonzero distances for cuts."""
    sys.path.insert(0, str(ROOT / "tools"))
    import micro_batch_distance
    from test_sample import tiny_checkpoint
    checkpoint = tiny_checkpoint(tmp_path / "tiny.pt")
    micro_batch_distance.main([str(checkpoint), "--train_files", str(corpus / "synthetic_train_*.bin"),
                               "--micro_batch_tokens", "256", "100", "--micro_steps", "2"])
    out = capsys.readouterr().out
    rows = dict(re.findall(r"^  (.+?)\s+mean (\S+)  max \S+$", out, re.M))
    assert set(rows) == {"consecutive micro-steps (batch noise)"} | {
        f"cap {cap}: {kind}{loss}" for cap in (256, 100) for kind in ("the trainer's cuts", "cuts moved to document starts")
        for loss in ("", " (loss)")}, out
    assert float(rows["cap 100: the trainer's cuts"]) > 0 and float(rows["consecutive micro-steps (batch noise)"]) > 0
