"""The optimizer step's collectives on 2 processes (gloo): every rank issues the same sequence of
reduce-scatters, all-gathers and waits, and every reduce-scatter (DistAdam's, then NorMuon's groups)
is issued before the first wait, so that the first group's update can start while the later
groups' gradients are still in flight."""
import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import train_gpt as tg

pytestmark = pytest.mark.slow
WORLD = 2


class RecordedWork:
    def __init__(self, work, events, name):
        self.work, self.events, self.name = work, events, name

    def wait(self):
        self.events.append(f"wait {self.name}")
        return self.work.wait()


def recording(events, kind, collective):
    def call(out, inp=None, *args, async_op=False, **kwargs):
        name = f"{kind} {tuple(out.shape)}#{sum(e.startswith(kind) for e in events)}"
        events.append(name)
        work = collective(out, inp, *args, async_op=async_op, **kwargs) if inp is not None else \
            collective(out, *args, async_op=async_op, **kwargs)
        return RecordedWork(work, events, name) if async_op else work
    return call


def one_step(rank, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        hp = tg.parse_args(["--preset", "cpu", "--num_layers", "9", "--model_dim", "32", "--num_heads", "2", "--head_dim", "16",
                        "--bigram_dim", "8", "--bigram_vocab_size", "1024"])
        torch.manual_seed(0)
        model = tg.build_model(hp, torch.device("cpu"))
        matrix_opt, adam = tg.make_optimizers(model, hp, tg.backend_for(hp, torch.device("cpu")))
        events = []
        originals = {name: getattr(dist, name) for name in ("reduce_scatter_tensor", "all_gather_into_tensor")}
        g = torch.Generator().manual_seed(rank)
        inputs = torch.randint(0, hp.vocab_size, (256,), generator=g, dtype=torch.int32)
        cu = torch.tensor([0] + [256] * 8, dtype=torch.int32)
        bigram = torch.from_numpy(tg.bigram_hash(inputs.numpy(), hp.bigram_vocab_size))
        model(inputs, torch.roll(inputs, -1).long(), cu, (1, 2), bigram).backward()
        try:
            dist.reduce_scatter_tensor = recording(events, "reduce_scatter", originals["reduce_scatter_tensor"])
            dist.all_gather_into_tensor = recording(events, "all_gather", originals["all_gather_into_tensor"])
            tg.step_optimizers(tg.Schedule(hp).at(1), matrix_opt, adam)  # an odd step: DistAdam steps too
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(events, f)
    finally:
        dist.destroy_process_group()


def test_collective_order_every_rank_the_same_and_every_reduce_scatter_before_the_first_wait(tmp_path):
    mp.start_processes(one_step, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, start_method="spawn")
    sequences = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert sequences[0] == sequences[1], sequences
    events = sequences[0]
    first_wait = next(i for i, e in enumerate(events) if e.startswith("wait"))
    scatters = [i for i, e in enumerate(events) if e.startswith("reduce_scatter")]
    gathers = [i for i, e in enumerate(events) if e.startswith("all_gather")]
    print(f"{len(scatters)} reduce-scatters, {len(gathers)} all-gathers, {len(events)} events: {events[:first_wait + 2]}")
    assert len(scatters) > 3 and gathers, events  # DistAdam's parameters and NorMuon's groups, both gathered
    assert max(scatters) < first_wait, events
    # every started collective is waited for within the step
    assert sorted(e[len("wait "):] for e in events if e.startswith("wait")) == sorted(
        e for e in events if not e.startswith("wait")), events
