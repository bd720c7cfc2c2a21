"""The record model traces for torch.compile with fullgraph=True (any graph break is an error) in
training and in validation, at every stage's sequence length and windows, into a documented number
of graphs: one per distinct per-rank training length (16,384 / 32,768 / 49,152 tokens: 3) plus one
for validation (262,144 tokens). The windows are data (an int tensor), so none of the 4 + 1 window
pairs adds a graph. Traced on CPU with a backend that records the graphs and never runs them (eager
FlexAttention at these lengths would need the full score matrix)."""
import pytest
import torch

import train_gpt as tg

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]


def recording_backend(graphs):
    def backend(gm, example_inputs):
        graphs.append(gm)
        outputs = next(node for node in gm.graph.nodes if node.op == "output").args[0]
        metas = [node.meta["example_value"] if isinstance(node, torch.fx.Node) else node for node in outputs]

        def run(*args):  # shapes only: the test is about tracing, not values
            return [torch.zeros(m.shape, dtype=m.dtype) if isinstance(m, torch.Tensor) else m for m in metas]
        return run
    return backend


def batch(tokens, vocab, docs=7):
    g = torch.Generator().manual_seed(tokens)
    inputs = torch.randint(0, vocab, (tokens,), generator=g, dtype=torch.int32)
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    bounds = torch.sort(torch.randint(1, tokens, (docs,), generator=g)).values
    cu = torch.full((tokens + 1,), tokens, dtype=torch.int32)
    cu[0], cu[1: docs + 1] = 0, bounds
    return inputs, targets, cu


def test_record_model_traces_without_breaks_into_four_graphs():
    hp = tg.parse_args([])
    torch._dynamo.reset()
    with torch.device("cpu"):
        model = tg.GPT(hp.vocab_size, hp.num_layers, hp.num_heads, hp.head_dim, hp.model_dim, hp.window_block_tokens)
    model.use_fp8 = True  # the record's training head
    assert isinstance(model.attention, tg.FlexWindowAttention) and model.head_loss is tg.softcap_cross_entropy
    graphs = []
    compiled = torch.compile(model, backend=recording_backend(graphs), dynamic=False, fullgraph=True)
    accum, world = tg.grad_accum_steps(hp, 8), 8
    windows = lambda pair: torch.tensor(pair, dtype=torch.int32)  # noqa: E731
    seen_lengths = set()
    for step in tg.stage_first_steps(hp):
        tokens = tg.tokens_per_rank(tg.batch_size_at(step, hp), world, accum)
        seen_lengths.add(tokens)
        model.train()
        with torch.no_grad():  # FlexAttention refuses to trace a CPU backward; the forward graph is the same
            compiled(*batch(tokens, hp.vocab_size), windows(tg.window_blocks_at(step, hp)))
    val_tokens = tg.tokens_per_rank(hp.val_batch_size, world, accum)
    model.eval()
    with torch.no_grad():
        for step in tg.stage_first_steps(hp):
            compiled(*batch(val_tokens, hp.vocab_size), windows(tg.window_blocks_at(step, hp)))
        compiled(*batch(val_tokens, hp.vocab_size), windows(tg.final_window_blocks(hp)))
    assert sorted(seen_lengths) == [16384, 32768, 49152] and val_tokens == 262144
    assert len(graphs) == len(seen_lengths) + 1, f"{len(graphs)} graphs"
