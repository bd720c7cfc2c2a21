"""The optimizers' pointwise math (NorMuon's variance normalization and cautious update, DistAdam's
update), which the GPU path compiles, gives the eager results when compiled, without graph breaks
and without recompiling as the per-step factors (lr, decay) change, and DistAdam's with one graph per
parameter shape whatever the groups' betas. Compiled here with the aot_eager backend (the CPU has no GPU
kernels to generate); the inductor kernels themselves run only on a GPU."""
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import train_gpt as tg

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]
STEPS = 4  # two DistAdam steps (odd steps)


def cloned(values):
    return [v.clone() if isinstance(v, torch.Tensor) else v for v in values]


def tensors_of(result, args):
    """The output and every tensor argument (the functions update some in place)."""
    outputs = list(result) if isinstance(result, tuple) else [result]
    return outputs + [a for a in args if isinstance(a, torch.Tensor)]


def checked(fn, compiled, report, counter=None, compiling_calls=None):
    """fn itself (the optimizer goes on eagerly), and the compiled fn on a copy of the same arguments; with a
    compile counter (its backend), each call that compiled notes its first argument's shape."""
    def call(*args):
        copies = cloned(args)
        result = fn(*args)
        before = counter.frame_count if counter else 0
        ours = compiled(*copies)
        if counter and counter.frame_count > before:
            compiling_calls.append(tuple(args[0].shape))
        for a, b in zip(tensors_of(result, args), tensors_of(ours, copies)):
            scale = a.float().abs().max().clamp_min(1e-30)
            report.append((fn.__name__, ((b.float() - a.float()).abs().max() / scale).item()))
        return result
    return call


def test_compiled_optimizer_math_gives_the_eager_updates_without_recompiles(monkeypatch):
    monkeypatch.setattr(torch._dynamo.config, "cache_size_limit", 64)  # as start_model sets it on CUDA
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    hp = tg.parse_args(["--preset", "cpu", "--num_layers", "9", "--model_dim", "32", "--num_heads", "2", "--head_dim", "16",
                        "--bigram_dim", "8", "--bigram_vocab_size", "1024", "--num_scheduled_iterations", "6",
                        "--adam_group_betas", "true"])  # groups of one shape with different betas
    torch.manual_seed(0)
    model = tg.build_model(hp, torch.device("cpu"))
    backend = tg.backend_for(hp, torch.device("cpu"))._replace(compile_math=True)  # the compiled path's arguments
    matrix_opt, adam = tg.make_optimizers(model, hp, backend)
    report = []
    adam_graphs = CompileCounterWithBackend("aot_eager")
    compile_ = lambda fn, backend="aot_eager": torch.compile(fn, backend=backend, dynamic=False, fullgraph=True)  # noqa: E731
    matrix_opt.normalize = checked(tg.normalize_variance, compile_(tg.normalize_variance), report)
    matrix_opt.apply_update = checked(tg.cautious_update, compile_(tg.cautious_update), report)
    adam_compiles = []  # the shape of each call that compiled (a first compile may call the backend twice)
    adam.math = checked(tg.adam_update_, compile_(tg.adam_update_, adam_graphs), report, adam_graphs, adam_compiles)
    g = torch.Generator().manual_seed(1)
    graphs, schedule = [], tg.Schedule(hp)
    for step in range(STEPS):
        inputs = torch.randint(0, hp.vocab_size, (256,), generator=g, dtype=torch.int32)
        cu = torch.tensor([0, 100] + [256] * 7, dtype=torch.int32)
        bigram = torch.from_numpy(tg.bigram_hash(inputs.numpy(), hp.bigram_vocab_size))
        plan = schedule.at(step)
        tg.start_step(plan, model, matrix_opt, adam)  # the lr changes every step
        model(inputs, torch.roll(inputs, -1).long(), cu, (1, 2), bigram).backward()
        tg.step_optimizers(plan, matrix_opt, adam)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert not torch._dynamo.utils.counters["graph_break"]
    # compiled once per distinct shape in the first two steps (NorMuon's groups, DistAdam's parameters);
    # the later steps, with other lr and decay values, add none
    assert graphs[-1] == graphs[1] > 0, graphs
    # DistAdam's betas are 0-dim tensors there: a graph per parameter shape, not per (shape, betas)
    stepped = [group for group in adam.param_groups if group["step"]]
    shapes = {tuple(group["params"][0].shape) for group in stepped}
    assert len({(tuple(g["params"][0].shape), g["betas"]) for g in stepped}) > len(shapes)  # the test can tell
    assert sorted(adam_compiles) == sorted(shapes), (adam_compiles, shapes)
    assert {name for name, _ in report} == {"normalize_variance", "cautious_update", "adam_update_"}
    # aot_eager runs decomposed ops in the same dtypes: the same arithmetic up to reassociation, a few
    # fp32 ulps of each tensor's scale (measured: NorMuon's exact, Adam's 2 ulps)
    worst = {name: max(e for n, e in report if n == name) for name, _ in report}
    print(f"compiled vs eager, worst difference / scale over {len(report)} tensors in {STEPS} steps: {worst}; "
          f"graphs {graphs}")
    assert max(worst.values()) <= 8 * torch.finfo(torch.float32).eps, worst
