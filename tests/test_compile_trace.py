"""The record model traces for torch.compile with fullgraph=True (any graph break is an error) at every
stage's sequence length and windows, on 8 GPUs' shapes: one graph per distinct per-rank training length
(16,384 / 32,768 / 49,152 tokens: 3) plus one for validation (262,144 tokens). The windows and the
multi-token weights are data (tensors), so the stages' 4 + 1 window pairs and weights add no graph.

Traced on the CPU with backends that record the graphs and never run them: the real sizes would need
the full score matrix (eager FlexAttention) or minutes of CPU compute. The forward test traces the
record's own GPU path (FlexAttention, FP8 head and MLP); the backward one traces forward and backward
through AOTAutograd with causal SDPA standing in for FlexAttention (which refuses a CPU backward; the
tiled CPU attention reads its window on the host): every other op of the compiled training step, FP8
included, is in its joint graph. FlexAttention's own backward is traced only on a GPU."""
import pytest
import torch
import torch.nn.functional as F
from torch._functorch.aot_autograd import aot_module_simplified

import train_gpt as tg

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]
WORLD = 8


def shapes_only(gm):
    """A runner for a traced graph that returns zeros of its outputs' shapes (one element each, expanded:
    the activations a training forward saves would not fit a CPU's memory)."""
    outputs = next(node for node in gm.graph.nodes if node.op == "output").args[0]
    metas = [node.meta.get("val", node.meta.get("example_value")) if isinstance(node, torch.fx.Node) else node
             for node in outputs]

    def run(*args):
        return [torch.zeros((), dtype=m.dtype).expand(m.shape) if isinstance(m, torch.Tensor) else m for m in metas]
    return run


def recording_backend(graphs):
    """A backend (or AOTAutograd compiler) that keeps each graph and never runs it."""
    def backend(gm, example_inputs):
        graphs.append(gm)
        return shapes_only(gm)
    return backend


def joint_recording_backend(forward_graphs, backward_graphs):
    """Dynamo's graph through AOTAutograd (which traces the joint forward + backward on fake tensors)."""
    def backend(gm, example_inputs):
        return aot_module_simplified(gm, example_inputs, fw_compiler=recording_backend(forward_graphs),
                                     bw_compiler=recording_backend(backward_graphs))
    return backend


def batch(tokens, hp, window_pair, docs=7):
    """The model's arguments up to the multi-token weights: a packed batch of `docs` documents."""
    g = torch.Generator().manual_seed(tokens)
    inputs = torch.randint(0, hp.vocab_size, (tokens,), generator=g, dtype=torch.int32)
    targets = torch.randint(0, hp.vocab_size, (tokens,), generator=g)
    bounds = torch.sort(torch.randint(1, tokens, (docs,), generator=g)).values
    cu = torch.full((tokens + 1,), tokens, dtype=torch.int32)
    cu[0], cu[1: docs + 1] = 0, bounds
    bigram_ids = torch.from_numpy(tg.bigram_hash(inputs.numpy(), hp.bigram_vocab_size))
    return inputs, targets, cu, torch.tensor(window_pair, dtype=torch.int32), bigram_ids


def training_shapes(hp):
    """(step, per-rank tokens) at each stage's first step."""
    accum = tg.grad_accum_steps(hp, WORLD)
    schedule = tg.Schedule(hp)
    return [(step, tg.tokens_per_rank(schedule.at(step).batch_tokens, WORLD, accum))
            for step in schedule.stage_first_steps()]


class CausalStandIn:
    """Attention of FlexWindowAttention's shapes that traces a backward on the CPU (no document mask)."""

    @staticmethod
    def mask(docs, window_tokens):
        return None

    def __call__(self, q, k, v, mask, scale):
        y = F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (q, k, v)), is_causal=True, scale=scale)
        return y.transpose(0, 1)


def record_model(hp, attention):
    """The record's model with the backend of an FP8 GPU (modelled), `attention` standing in for FlexAttention's kernel."""
    backend = tg.backend_for(hp, torch.device("cuda"), tg.grad_accum_steps(hp, WORLD), fp8_hardware=True,
                             attention=attention)
    with torch.device("cpu"):
        model = tg.GPT(hp, backend)
    # the fused loss is told the gradient it will get: 1 / the accumulation steps
    assert model.head_loss.func is tg.softcap_cross_entropy and model.mlp_in_fp8
    assert model.head_loss.keywords == {"grad_scale": 1 / tg.grad_accum_steps(hp, WORLD),
                                        "fused": tg.HAS_TRITON}  # fp8_kernels.py's loss op
    return model


def test_record_model_traces_without_breaks_into_four_graphs():
    hp = tg.parse_args([])
    torch._dynamo.reset()
    model = record_model(hp, tg.FlexWindowAttention())
    graphs = []
    compiled = torch.compile(model, backend=recording_backend(graphs), dynamic=False, fullgraph=True)
    schedule = tg.Schedule(hp, torch.device("cpu"))
    model.train()
    for step, tokens in training_shapes(hp):
        with torch.no_grad():  # FlexAttention refuses to trace a CPU backward; the forward graph is the same
            compiled(*batch(tokens, hp, schedule.at(step).windows), schedule.at(step).mtp_weights)
    val_tokens = tg.tokens_per_rank(hp.val_batch_size, WORLD, tg.grad_accum_steps(hp, WORLD))
    model.eval()
    with torch.no_grad():
        for pair in [schedule.at(step).windows for step in schedule.stage_first_steps()] + [schedule.final_windows]:
            compiled(*batch(val_tokens, hp, pair))
    lengths = {tokens for _, tokens in training_shapes(hp)}
    assert sorted(lengths) == [16384, 32768, 49152] and val_tokens == 262144
    assert len(graphs) == len(lengths) + 1, f"{len(graphs)} graphs"


def test_record_model_backward_traces_without_graph_breaks_at_every_stage():
    hp = tg.parse_args([])
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = record_model(hp, CausalStandIn())
    forward_graphs, backward_graphs = [], []
    compiled = torch.compile(model, backend=joint_recording_backend(forward_graphs, backward_graphs),
                             dynamic=False, fullgraph=True)
    schedule = tg.Schedule(hp, torch.device("cpu"))
    model.train()
    for step, tokens in training_shapes(hp):
        loss = compiled(*batch(tokens, hp, schedule.at(step).windows), schedule.at(step).mtp_weights)
        loss.backward()
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert len(forward_graphs) == len(backward_graphs) == 3, (len(forward_graphs), len(backward_graphs))
    # the backward reaches every parameter the optimizers step (a detached path would leave it out)
    assert all(p.grad is not None for p in model.parameters()), \
        [n for n, p in model.named_parameters() if p.grad is None]
