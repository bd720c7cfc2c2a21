"""DistAdam's sparse exchange of the bigram table's gradient (SparseRows) against its dense
reduce-scatter, on 2 and 3 gloo processes (3: the table's rows do not divide, so the slices are
padded), over steps where some rank sends some owner no row, or touches no row at all.

Error model: both give every element of a rank's slice as (the sum of the `world` ranks' values)
divided by `world`; only the order of the sum differs. With values on a coarse dyadic grid every
partial sum is exact in fp32 and bf16, so the two agree bit for bit (tolerance 0): the updated
parameters over several Adam steps, and so also Adam's untouched rows (gradient exactly 0 either
way). With arbitrary values, two orders of a sum of n terms differ by at most 2 (n - 1) u sum |g_i|
(u: the dtype's unit roundoff), then the division adds u of the result to each.

Also the rule (sparse_bigram_exchange) at the record's world sizes.
"""
import datetime
import os
import socket
import tempfile

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import train_gpt as tg

ROWS, DIM, STEPS = 10, 4, 4
ADAM_HP = dict(lr=0.02, betas=(0.65, 0.95), eps=1e-8, weight_decay=5.0)
SPEC = tg.ParamSpec("bigram", "adam", lr_mul=2.0, wd_mul=1.0)
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8}


def touched_rows(rank, world, step, generator):
    """The rows `rank` touches at `step`: random at step 0; at step 1 rank 0 only its own slice's
    and every other rank only rank 0's (so each sends some owner nothing); at step 2 rank 0 none."""
    slice_rows = -(-ROWS // world)
    if step == 1:
        owner = rank if rank == 0 else 0
        return np.arange(owner * slice_rows, min(ROWS, (owner + 1) * slice_rows))[::2]
    if step == 2 and rank == 0:
        return np.array([], dtype=np.int64)
    return torch.randperm(ROWS, generator=generator)[:ROWS // 2].numpy()


def gradient(rows, dtype, generator, dyadic):
    """Zero but in `rows`: multiples of 1/16 up to 2 (exact sums) or standard normals."""
    g = torch.zeros(ROWS, DIM, dtype=torch.float64)
    values = torch.randint(-32, 33, (len(rows), DIM), generator=generator).double() / 16 if dyadic \
        else torch.randn(len(rows), DIM, generator=generator, dtype=torch.float64)
    g[torch.from_numpy(rows).long()] = values
    return g.to(dtype)


def reduced_slices(adam):
    """Each unit's reduced slice of this rank, once its exchange is complete."""
    slices = []
    for _, grads, handle in adam._pending:
        handle.wait()
        slices += grads
    adam._pending = None
    return slices


def _worker(rank, world, port, out_dir):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        failures = []
        for dtype in (torch.float32, torch.bfloat16):
            start = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(0)).to(dtype)
            dense, sparse = (torch.nn.Parameter(start.clone()) for _ in range(2))
            dense_adam = tg.DistAdam([(dense, SPEC)], **ADAM_HP)
            sparse_adam = tg.DistAdam([(sparse, SPEC)], **ADAM_HP, sparse=sparse)
            assert sparse_adam._is_sparse(sparse) and not dense_adam._is_sparse(dense)
            generator = torch.Generator().manual_seed(1000 + rank)
            for step in range(STEPS):
                rows = touched_rows(rank, world, step, generator)
                g = gradient(rows, dtype, generator, dyadic=True)
                dense.grad, sparse.grad = g.clone(), g.clone()
                sparse_adam.note_rows(rows)
                dense_adam.step()
                sparse_adam.step()
                if not torch.equal(dense, sparse):
                    failures.append(f"{dtype} step {step}: updated parameters differ by "
                                    f"{(dense.float() - sparse.float()).abs().max()}")
                if step == 2 and torch.equal(dense, start):
                    failures.append("the parameters did not move (the test would see nothing)")
            # arbitrary values: the reduced slices within the error model's bound
            rows = touched_rows(rank, world, 0, generator)
            g = gradient(rows, dtype, generator, dyadic=False)
            dense.grad, sparse.grad = g.clone(), g.clone()
            sparse_adam.note_rows(rows)
            dense_adam.reduce_grads()
            sparse_adam.reduce_grads()
            (want,), (got,) = reduced_slices(dense_adam), reduced_slices(sparse_adam)
            magnitude = dense_adam._slice(dense_adam._padded(g.abs().double()))
            dist.all_reduce(magnitude)
            u = UNIT_ROUNDOFF[dtype]
            bound = 2 * (world - 1) * u * magnitude / world + 2 * u * want.abs().double()
            excess = ((got.double() - want.double()).abs() - bound).max().item()
            if excess > 0:
                failures.append(f"{dtype} arbitrary values: beyond the bound by {excess}")
        with open(f"{out_dir}/rank{rank}.txt", "w") as f:
            f.write("\n".join(failures))
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_sparse_exchange_gives_the_dense_reduce_scatters_updates(world):
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(world, _free_port(), out_dir), nprocs=world, join=True)
        reports = [open(f"{out_dir}/rank{r}.txt").read() for r in range(world)]
    assert reports == [""] * world, reports


def test_sparse_exchange_where_a_rank_touches_at_most_half_the_table_between_adam_steps():
    """The record (393,216-token batches, 754,560 rows): sparse at 4 and 8 ranks (8: as #89), dense
    at 2 (each rank's 393,216 tokens over two steps could touch over half the rows) and alone."""
    hp = tg.parse_args([])
    assert [w for w in (1, 2, 4, 8) if tg.sparse_bigram_exchange(hp, w)] == [4, 8]
    assert not tg.sparse_bigram_exchange(tg.parse_args(["--bigram_vocab_size", "0"]), 8)


def _trainer_worker(rank, world, ports, folder, out_dir):
    """A few training steps of the Trainer (the loader's ids noted each micro-step), sparse and then
    dense (the rule switched off); the parameters of both."""
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    argv = ["--preset", "cpu", "--device", "cpu", "--batch_sizes", "512", "512", "512",
            "--grad_accum_base", "2", "--val_tokens", "1024", "--val_batch_size", "512",
            "--max_seq_len", "256", "--window_blocks", "2", "2", "2", "--extension_window_blocks",
            "2", "--final_val_window_blocks", "3", "--num_layers", "9", "--model_dim", "64",
            "--num_heads", "2", "--head_dim", "32", "--window_block_tokens", "64",
            "--cpu_threads", "1", "--warmup_steps", "0", "--num_scheduled_iterations", "6",
            "--num_extension_iterations", "0", "--ngram_prior", "0",
            "--train_files", f"{folder}/synthetic_train_*.bin",
            "--val_files", f"{folder}/synthetic_val_*.bin"]
    params = {}
    for sparse, port in zip((True, False), ports):  # (a group of its own each: a port of its own)
        os.environ["MASTER_PORT"] = str(port)
        if not sparse:
            tg.sparse_bigram_exchange = lambda hp, world_size: False
        trainer = tg.Trainer(tg.parse_args(argv + ["--log_dir", f"{out_dir}/logs{sparse}"]), argv)
        try:
            assert (trainer.adam.sparse is not None) == sparse
            for step in range(4):  # two Adam steps
                trainer.train_step(trainer.begin_step(step))
            params[sparse] = [p.detach().clone() for p in trainer.model.parameters()]
        finally:
            trainer.loader.close()
            dist.destroy_process_group()
    torch.save(params, f"{out_dir}/params{rank}.pt")


@pytest.mark.slow
def test_training_steps_sparse_equal_dense_on_two_processes(tmp_path):
    """Through the Trainer (rows noted from the loader): at 2 ranks each sum has 2 terms, whose
    order does not matter, so every parameter after two Adam steps is the dense run's bit for bit;
    the bigram table moved."""
    import synthetic
    synthetic.markov_corpus(tmp_path / "corpus", train_tokens=60_000, val_tokens=8_192)
    ports = [_free_port()]
    while len(ports) < 2:
        ports += [port for port in [_free_port()] if port not in ports]
    mp.spawn(_trainer_worker, args=(2, ports, str(tmp_path / "corpus"), str(tmp_path)),
             nprocs=2, join=True)
    for rank in range(2):
        params = torch.load(tmp_path / f"params{rank}.pt")
        assert all(torch.equal(s, d) for s, d in zip(params[True], params[False]))
    assert any(p.abs().sum() > 0 and p.shape[0] == 754_560 for p in params[True])
