"""--ngram_prior: the prior's rows are the Kneser-Ney model's log P(. | context), the chunked CPU loss with the prior
equals autograd through the dense biased logits, weight 0 is the plain loss exactly, the prior stays out
of the model's state, and the GPU path refuses the flag in one line."""
import glob

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ngram_baseline as nb
import ngram_prior
import train_gpt as tg
from test_training import corpus, tiny  # noqa: F401 (corpus: a fixture)

VOCAB, COLUMNS = 7, 9  # two padding columns, as the head pads the vocabulary


def random_prior(weight, vocab=VOCAB, columns=COLUMNS, seed=0, order=3):
    rng = np.random.default_rng(seed)
    streams = [rng.integers(0, vocab - 1, 300), rng.integers(0, 3, 40)]
    return ngram_prior.NgramPrior(ngram_prior.kneser_ney(*ngram_prior.count_ngrams(streams, vocab, order)), weight, columns)


def rows(prior, tokens):
    """The prior's (len(tokens), columns) rows of the token after each of tokens: add_to on zeros."""
    return prior.add_to(torch.zeros(tokens.numel(), prior.log_unigram.numel()), prior.context_rows(tokens))


@pytest.mark.parametrize("order", [2, 3, 5])
def test_rows_are_the_tools_kneser_ney_log_probabilities(order):
    """Each row is log P(. | context) of tools/ngram_baseline.py's --order model, which looks each probability
    up entry by entry: the rows are those log-probabilities themselves (no row constant; fp32 sums of <= 9 terms
    of size <= 10: 1e-5), they exponentiate to distributions, and the padding columns get nothing."""
    rng = np.random.default_rng(order)
    streams = [rng.integers(0, VOCAB - 1, 300), rng.integers(0, 3, 40)]
    model = ngram_prior.kneser_ney(*ngram_prior.count_ngrams(streams, VOCAB, order))
    prior = ngram_prior.NgramPrior(model, 1.0, COLUMNS)
    tokens = np.concatenate([rng.integers(0, VOCAB, 60), [2, 2, 2, 2, 6, 6, 0]])  # 6: never counted
    table = rows(prior, torch.from_numpy(tokens)).double()
    for w in range(VOCAB):
        expected = nb.kneser_ney_log_probs(model, tokens, np.full(tokens.size, w))
        torch.testing.assert_close(table[:, w], torch.from_numpy(expected), rtol=0, atol=1e-5)
    torch.testing.assert_close(table.exp().sum(1), torch.ones(tokens.size, dtype=torch.float64), rtol=0, atol=1e-5)
    assert table[:, VOCAB:].exp().max() == 0  # the head's padding ids


def test_contexts_stop_at_the_sequence_start_and_at_a_document_token():
    """Order 4: a context is up to 3 tokens, never reaching before the sequence or past a document token back
    (it may start with one), so a micro-step piece, which starts at a document, sees what the whole sees."""
    bos = tg.BOS_ID
    whole = np.array([5, 6, 7, bos, 8, 9, 10, 11])
    streams = [np.array([5, 6, 7, bos, 8, 9, 10, 11] * 3)]
    model = ngram_prior.kneser_ney(*ngram_prior.count_ngrams(streams, bos + 1, 4))
    contexts = [level.contexts for level in model.levels]
    found = ngram_prior.ngram_context_rows(contexts, whole) >= 0
    # orders 2, 3, 4 (rows) at each position: the first has one token of context, the document token stops
    # the contexts of the tokens after it
    assert found.tolist() == [[1, 1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 0, 1, 1, 1, 1], [0, 0, 1, 0, 0, 1, 1, 1]]
    piece = ngram_prior.ngram_context_rows(contexts, whole[3:])
    np.testing.assert_array_equal(piece, ngram_prior.ngram_context_rows(contexts, whole)[:, 3:])


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
    loss = tg.chunked_softcap_cross_entropy(x1, w1, targets, True, None, softcap, weights, mask, inputs=inputs,
                                            prior=prior)
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
    loss = tg.chunked_softcap_cross_entropy(x, w, targets, False, None, softcap, inputs=inputs, prior=prior)
    logits = tg.softcapped(x @ w.T, softcap) + rows(prior, inputs)
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(logits, targets), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("training", [True, False])
def test_weight_zero_is_the_plain_loss_exactly(training):
    x, w, inputs, targets, mask = loss_inputs()
    softcap, weights = tg.Softcap(23.0, 5.0), torch.tensor([1.0, 0.5, 0.25])
    args = (weights, mask) if training else (None, None)
    results = []
    for extra in ({}, dict(prior=random_prior(0.0), inputs=inputs)):
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


def test_the_prior_reaches_the_loss_through_the_backend_not_the_model():
    """The CPU Backend's loss adds the prior (backend_for binds it once): GPT.forward has no prior
    argument, and the model keeps nothing of it (its state is that of a model without the prior)."""
    import inspect
    assert "prior" not in inspect.signature(tg.GPT.forward).parameters
    hp = tiny_hp(vocab_size=VOCAB)
    prior = random_prior(1.0, columns=tg.padded_vocab(hp))
    models = []
    for bound in (None, prior):
        torch.manual_seed(0)
        models.append(tg.GPT(hp, tg.backend_for(hp, torch.device("cpu"), prior=bound)).eval())
    inputs = torch.randint(0, VOCAB - 1, (64,), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    cu = torch.tensor([0] + [64] * 64, dtype=torch.int32)
    with torch.no_grad():
        plain, with_prior = (m(inputs, inputs.roll(-1).long(), cu, (1, 2)) for m in models)
        logits = models[0].logits(inputs, cu, (1, 2))
    expected = F.cross_entropy(prior.add_to(logits.clone(), prior.context_rows(inputs)), inputs.roll(-1).long())
    assert with_prior != plain
    torch.testing.assert_close(with_prior, expected, rtol=1e-6, atol=1e-6)
    state, other = models[0].state_dict(), models[1].state_dict()
    assert state.keys() == other.keys()
    assert all(torch.equal(v, other[k]) if torch.is_tensor(v) else v == other[k] for k, v in state.items())


def test_the_cpu_preset_has_the_prior_and_the_record_not():
    assert tg.parse_args(["--preset", "cpu"]).ngram_prior > 0
    assert tg.parse_args([]).ngram_prior == 0


def test_gpu_path_refuses_the_prior_in_one_line():
    with pytest.raises(tg.ConfigError) as error:
        tg.build_model(tiny_hp(ngram_prior=1.0), torch.device("cuda"))
    assert str(error.value).startswith("--ngram_prior needs the CPU loss path") and "\n" not in str(error.value)
    with pytest.raises(tg.ConfigError, match="--ngram_prior must be >= 0"):
        tg.parse_args(["--ngram_prior", "-1"])


@pytest.mark.slow
def test_a_run_with_the_prior_counts_on_the_clock_resumes_exactly_and_samples_with_it(corpus, tmp_path, capsys):
    """The trainer counts the training shards at the start (one log line), starts near the count model's
    validation loss, continues exactly after a resume (the prior is counted again, not loaded), and
    tools/sample.py's --eval of the final checkpoint, which counts the prior from the checkpoint's shards, is
    the log's last validation loss."""
    import sample
    common = [*tiny(corpus, "--ngram_prior", 1, "--ngram_prior_order", 3), "--num_scheduled_iterations", 4,
              "--num_extension_iterations", 0, "--val_loss_every", 2, "--save_every", 2, "--save_checkpoint", "true", "--log_dir", tmp_path]
    whole = tg.main(list(map(str, [*common, "--run_id", "whole"])))
    resumed = tg.main(list(map(str, [*common, "--run_id", "resumed", "--resume",
                                     tmp_path / "checkpoints" / "whole" / "step_000002.pt"])))
    assert resumed == whole[1:]  # (step, val loss) pairs from step 2 on, to the last digit
    log = (tmp_path / "whole.txt").read_text()
    counted = [line for line in log.splitlines() if line.startswith("ngram prior: counted ")]
    assert len(counted) == 1 and "training tokens" in counted[0] and "distinct 3-grams) in " in counted[0], counted
    files = sorted(glob.glob(str(corpus / "synthetic_train_*.bin")))
    count_model = ngram_prior.kneser_ney(*ngram_prior.count_ngrams([tg.read_shard(f) for f in files], tg.GPT2_VOCAB_SIZE, 3))
    val = tg.read_validation_tokens(str(corpus / "synthetic_val_*.bin"), 1024 + 1).astype(np.int64)
    count_loss = -nb.kneser_ney_log_probs(count_model, val[:-1], val[1:]).mean()
    # the fresh network's softcapped logits are near-uniform, so the step-0 loss is the count model's (the
    # validation's 512-token sequences shorten a few contexts); an untrained model without the prior: ln(50304)
    assert abs(whole[0][1] - count_loss) < 0.05, (whole[0], count_loss)
    capsys.readouterr()
    sample.main(list(map(str, [tmp_path / "checkpoints" / "whole" / "final.pt", "--eval",
                               corpus / "synthetic_val_*.bin"])))
    assert capsys.readouterr().out.startswith(f"val_loss:{whole[-1][1]:.4f} over 1,024 tokens of ")
