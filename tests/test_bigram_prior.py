"""--bigram_prior: the prior's rows are the count model's log P(. | v), the chunked CPU loss with the prior
equals autograd through the dense biased logits, weight 0 is the plain loss exactly, the prior stays out
of the model's state, and the GPU path refuses the flag in one line."""
import numpy as np
import pytest
import torch

import ngram_baseline as nb
import train_gpt as tg

VOCAB, COLUMNS = 7, 9  # two padding columns, as the head pads the vocabulary


def random_prior(weight, vocab=VOCAB, columns=COLUMNS, seed=0):
    rng = np.random.default_rng(seed)
    counts = tg.count_bigrams([rng.integers(0, vocab - 1, 300), rng.integers(0, 3, 40)], vocab)
    return tg.BigramPrior(counts, weight, columns)


def rows(prior, prev_tokens):
    """The prior's (len(prev_tokens), columns) rows: add_to on zeros."""
    return prior.add_to(torch.zeros(prev_tokens.numel(), prior.log_unigram.numel()), prev_tokens)


def test_rows_are_the_count_models_log_probabilities():
    streams = [np.array([1, 2, 1, 2, 3]), np.array([0, 5, 5, 1, 2])]  # 4 and 6 never occur; 3 ends a stream
    prior = tg.BigramPrior(tg.count_bigrams(streams, VOCAB), 1.0, COLUMNS)
    model = nb.CountModel(streams, VOCAB)
    table = rows(prior, torch.arange(VOCAB))
    for v in range(VOCAB):
        expected = torch.from_numpy(model.bigram_prob(np.full(VOCAB, v), np.arange(VOCAB), tg.BIGRAM_PRIOR_DISCOUNT))
        p = torch.softmax(table[v].double(), 0)
        torch.testing.assert_close(p[:VOCAB], expected, rtol=0, atol=1e-6)
        assert p[VOCAB:].max() == 0  # the head's padding ids
        torch.testing.assert_close(table[v, :VOCAB].double(), expected.log(), rtol=0, atol=1e-5)  # no row constant


def test_weight_scales_the_rows():
    prev = torch.tensor([0, 3, 3, 1, 6])
    torch.testing.assert_close(rows(random_prior(0.5), prev), 0.5 * rows(random_prior(1.0), prev))


def loss_inputs(n=37, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(COLUMNS, dim, generator=g)
    inputs = torch.randint(0, VOCAB, (n,), generator=g)
    targets = torch.randint(0, VOCAB, (n,), generator=g)
    targets[-2:] = tg.NO_TARGET
    mask = torch.rand(n, generator=g) > 0.2
    return x, w, inputs, targets, mask


@pytest.mark.parametrize("masked", [False, True])
def test_chunked_loss_with_prior_matches_dense_autograd(monkeypatch, masked):
    monkeypatch.setattr(tg, "SOFTCAP_CHUNK", 8)  # several chunks and a partial one
    x, w, inputs, targets, mask = loss_inputs()
    if not masked:
        targets, mask = targets.clamp_min(0), None
    prior, softcap, weights = random_prior(0.8), tg.Softcap(23.0, 5.0), torch.tensor([1.0, 0.5, 0.25])
    x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = tg.chunked_softcap_cross_entropy(x1, w1, targets, True, None, softcap, weights, mask, prior, inputs)
    loss.backward()
    x2, w2 = x.clone().requires_grad_(), w.clone().requires_grad_()
    logits = tg.softcapped(x2 @ w2.T, softcap) + rows(prior, inputs)
    reference = tg.multi_token_loss(logits, targets, weights, mask)
    reference.backward()
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-4, atol=1e-5)


def test_validation_loss_with_prior_matches_dense(monkeypatch):
    monkeypatch.setattr(tg, "SOFTCAP_CHUNK", 8)
    x, w, inputs, targets, _ = loss_inputs()
    targets, prior, softcap = targets.clamp_min(0), random_prior(1.3), tg.Softcap(23.0, 5.0)
    loss = tg.chunked_softcap_cross_entropy(x, w, targets, False, None, softcap, prior=prior, prev_tokens=inputs)
    logits = tg.softcapped(x @ w.T, softcap) + rows(prior, inputs)
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(logits, targets), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("training", [True, False])
def test_weight_zero_is_the_plain_loss_exactly(training):
    x, w, inputs, targets, mask = loss_inputs()
    softcap, weights = tg.Softcap(23.0, 5.0), torch.tensor([1.0, 0.5, 0.25])
    args = (weights, mask) if training else (None, None)
    results = []
    for extra in ({}, dict(prior=random_prior(0.0), prev_tokens=inputs)):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = tg.chunked_softcap_cross_entropy(xi, wi, targets.clamp_min(0) if not training else targets, training,
                                                None, softcap, *args, **extra)
        if training:
            loss.backward()
        results.append((loss, xi.grad, wi.grad))
    (a, *grads_a), (b, *grads_b) = results
    assert torch.equal(a, b)
    assert all(ga is gb is None or torch.equal(ga, gb) for ga, gb in zip(grads_a, grads_b))


def tiny_hp(**changes):
    hp = tg.parse_args(["--preset", "cpu", "--model_dim", "64", "--num_heads", "2", "--head_dim", "32",
                        "--bigram_vocab_size", "0"])
    return tg.dataclasses.replace(hp, **changes)


def test_the_prior_is_not_model_state():
    model = tg.build_model(tiny_hp(), torch.device("cpu"))
    keys = set(model.state_dict())
    model.bigram_prior = random_prior(1.0, columns=model.lm_head.weight.size(0))
    assert set(model.state_dict()) == keys


def test_the_cpu_preset_has_the_prior_and_the_record_not():
    assert tg.parse_args(["--preset", "cpu"]).bigram_prior > 0
    assert tg.parse_args([]).bigram_prior == 0


def test_gpu_path_refuses_the_prior_in_one_line():
    with pytest.raises(tg.ConfigError) as error:
        tg.build_model(tiny_hp(bigram_prior=1.0), torch.device("cuda"))
    assert str(error.value).startswith("--bigram_prior needs the CPU loss path") and "\n" not in str(error.value)
    with pytest.raises(tg.ConfigError, match="--bigram_prior must be >= 0"):
        tg.parse_args(["--bigram_prior", "-1"])
