"""tools/plan_memory.py: its trace of the CPU path keeps exactly the bytes the CPU path saves for the backward; the
optimizer state shards over ranks; the largest fitting --micro_batch_tokens is the boundary of the fit; the
command prints its figures and the last line without training or reading data. Slow: a fake-tensor trace of
one training step takes a few seconds on 2 cores."""
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import plan_memory as pm
import ngram_prior
import train_gpt as tg
from test_training import tiny

pytestmark = pytest.mark.slow
CPU = torch.device("cpu")


def saved_for_backward(model, batch, windows, mtp, block_bytes):
    """Bytes of the distinct storages a real forward saves for the backward (parameters left out) or takes
    as its batch, each rounded up to block_bytes as the plan rounds them."""
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved = {t.untyped_storage().data_ptr(): -(-t.untyped_storage().nbytes() // block_bytes) * block_bytes
             for t in batch if t is not None}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            saved[storage.data_ptr()] = -(-storage.nbytes() // block_bytes) * block_bytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.train()(batch.inputs, batch.targets, batch.cu_seqlens, windows, batch.bigram_ids, mtp, batch.positions,
                      batch.loss_mask)
    return sum(saved.values())


@pytest.mark.parametrize("tokens", [2050, 4096])
def test_plan_keeps_what_the_cpu_path_saves(tokens):
    """The cpu preset's model, on a padded piece of --micro_batch_tokens 1024 (2,050 positions) and an uncut
    micro-step of 4,096. Error model: what the plan counts as kept by a forward is what the CPU path
    saves for the backward, plus the batch and the loss (one 512-byte block), which a forward leaves alive
    without saving. Measured: exactly that, to the byte."""
    hp = tg.parse_args(["--preset", "cpu"])
    plan = pm.MemoryPlan(hp, 1, gpu_path=False)
    figures = plan.piece_figures(tokens)
    torch.manual_seed(0)
    model = tg.build_model(hp, CPU)
    batch = pm.plan_batch(hp, tokens, piece=tokens == tg.padded_piece_length(4096, 1024, hp.max_seq_len))
    actual = saved_for_backward(model, batch, plan.windows, plan.mtp_weights, pm.CUDA_BLOCK_BYTES)
    print(f"{tokens} tokens: plan {figures['trunk'] + figures['head']:,} bytes, CPU path saves {actual:,} "
          f"with its batch")
    assert figures["trunk"] + figures["head"] == actual + pm.CUDA_BLOCK_BYTES


def test_optimizer_state_shards_over_ranks():
    hp = tg.parse_args(tiny(Path(".")) + ["--grad_accum_base", "4"])
    one, four = pm.MemoryPlan(hp, 1), pm.MemoryPlan(hp, 4)
    assert one.static["parameters"] == four.static["parameters"] and one.static["gradients"] == four.static["gradients"]
    for name in ("optimizer state NorMuon", "optimizer state DistAdam"):
        ratio = four.static[name] / one.static[name]
        print(name, one.static[name], four.static[name], ratio)
        assert 0.25 <= ratio < 0.35, (name, ratio)  # a quarter, plus the padding to equal shards and 512-byte blocks
    assert one.accum == 4 and four.accum == 1


def test_largest_fitting_cap_is_the_boundary():
    """The cap the plan picks fits both peaks (training: its padded pieces; validation: its pieces, which run the
    receptive field's context before their tokens) and the next larger one does not; validation's pieces shrink
    its peak."""
    hp = tg.parse_args(tiny(Path(".")) + ["--batch_sizes", "4096", "4096", "4096", "--val_tokens", "16384",
                                          "--val_batch_size", "16384"])
    plan = pm.MemoryPlan(hp, 1)
    _, val_uncut = plan.validation_figures(0)
    uncut = plan.peak(0)
    smallest = plan.peak(pm.PLAN_PIECE_STEP)
    budget = (3 * smallest + uncut) // 4  # somewhere among the cuts
    cap = plan.largest_fitting_cap(budget)
    assert 0 < cap < 16384 and cap % pm.PLAN_PIECE_STEP == 0
    assert plan.largest_piece(cap) in (cap + 448 + 2, 4096)
    context = tg.receptive_field(plan.model.plan, tg.Schedule(hp).window_pairs(), hp.window_block_tokens)
    val_length, val_peak = plan.validation_figures(cap)
    assert val_length == cap + min(context, 16384 - cap) and val_peak < val_uncut
    assert plan.piece_figures(plan.largest_piece(cap))["peak"] <= budget and val_peak <= budget
    assert plan.peak(cap + pm.PLAN_PIECE_STEP) > budget  # the next larger pieces do not fit
    assert plan.largest_fitting_cap(uncut) == 0 and plan.largest_fitting_cap(smallest - 1) is None


def test_plan_memory_prints_and_exits_without_training(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = tiny(tmp_path / "no_data_here") + ["--gpu_memory_gb", "80", "--device", "auto"]
    assert pm.main(argv) is None
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("memory plan (predicted: eager accounting, fake tensors) for rank 0 of 2 process(es), GPU paths")
    for name in ("parameters", "gradients", "optimizer state NorMuon", "optimizer state DistAdam", "activations saved",
                 "head logits saved", "training peak", "validation peak"):
        assert any(line.strip().startswith(name) and line.endswith(" GiB") for line in lines), name
    assert re.fullmatch(r"largest --micro_batch_tokens that fits --gpu_memory_gb 80 "
                        r"\(72\.0 GiB usable\): .+", lines[-2])
    assert re.fullmatch(r"predicted peak per process: \d+\.\d\d GiB", lines[-1])
    assert not (tmp_path / "logs").exists()


def test_a_plan_where_nothing_fits_exits_with_status_1(tmp_path, capsys, monkeypatch):
    """"Nothing fits" exited 0, as a plan that fits does: a script could not tell. The plan is still
    printed."""
    monkeypatch.chdir(tmp_path)
    argv = tiny(tmp_path / "no_data_here") + ["--gpu_memory_gb", "0.0001", "--device", "auto"]
    with pytest.raises(SystemExit) as exit_info:
        pm.main(argv)
    assert exit_info.value.code == pm.NOTHING_FITS_EXIT == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2].endswith(": " + pm.NOTHING_FITS), lines
    assert lines[-1].startswith("predicted peak per process: "), lines


def test_the_cpu_plan_counts_the_ngram_priors_bytes(tmp_path, monkeypatch):
    """The prior's bound (one context and one n-gram per training token and order above the first) is a row of
    the CPU plan and part of its peak (shards said to hold 10^8 tokens: 9.6 GB, far above the 2-decimal
    rounding of the printed GiB); it holds the prior of a real count (a tiny random shard's)."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 300, 5_000).astype(np.uint16)
    tg.write_shard(tmp_path / "t_train_000001.bin", tokens)
    hp = tg.parse_args(["--preset", "cpu", "--ngram_prior_order", "4", "--train_files", str(tmp_path / "t_*.bin")])
    monkeypatch.setattr(pm, "shard_tokens", lambda path: 10 ** 8)
    lines = pm.plan_report(hp, 1, 80.0)
    bound = ngram_prior.NgramPrior.bytes_bound(4, 10 ** 8, tg.padded_vocab(hp))
    row = [line for line in lines if "n-gram prior, at most (100,000,000 tokens)" in line]
    assert len(row) == 1 and float(row[0].split()[-2]) == pytest.approx(bound / pm.GiB, abs=0.006), row
    without = pm.plan_report(tg.dataclasses.replace(hp, ngram_prior=0.0), 1, 80.0)
    peak = lambda ls: float(ls[-1].split()[-2])  # noqa: E731
    assert peak(lines) == pytest.approx(peak(without) + bound / pm.GiB, abs=0.011)
    prior = ngram_prior.NgramPrior(ngram_prior.kneser_ney(*ngram_prior.count_ngrams([tokens], hp.vocab_size, 4)), 1.0, tg.padded_vocab(hp))
    assert 0 < prior.nbytes() <= ngram_prior.NgramPrior.bytes_bound(4, tokens.size, tg.padded_vocab(hp))
