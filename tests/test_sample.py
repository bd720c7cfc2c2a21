"""tools/sample.py: a model trained on a corpus with an obvious pattern continues it; the same seed gives the
same text; --eval on a checkpoint's own validation shards gives the last val_loss of its log; checkpoints of
1 and 2 processes load; bad input is one line and exit status 2. A byte-level encoding stands in for the
GPT-2 BPE (the real one is not part of a fresh clone)."""
import dataclasses
import re
import sys

import numpy as np
import pytest
import tiktoken
import torch

import ngram_prior
import train_gpt as tg
from conftest import ROOT
from test_training import VAL_LINE, run_script, tiny

sys.path.insert(0, str(ROOT / "tools"))
import sample  # noqa: E402

PATTERN = "abcdefghij"  # each byte is one token of the byte-level encoding: a cycle of 10 tokens


def byte_encoding():
    """ids 0..255 are bytes, the other ids below 50256 decode as '<id>' (an untrained model draws them),
    <|endoftext|> is the document token 50256 (as in GPT-2)."""
    ranks = {bytes([i]): i for i in range(256)} | {f"<{i}>".encode(): i for i in range(256, tg.BOS_ID)}
    return tiktoken.Encoding(name="bytes", pat_str=r"[\s\S]", mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": tg.BOS_ID})


def pattern_corpus(folder, tokens, seed):
    """Documents of the cycle PATTERN from a random offset, 40-200 tokens each, BOS first."""
    rng = np.random.default_rng(seed)
    cycle = np.frombuffer(PATTERN.encode(), dtype=np.uint8).astype(np.int64)
    docs, total = [], 0
    while total < tokens:
        length, offset = int(rng.integers(40, 200)), int(rng.integers(0, len(cycle)))
        docs.append(np.concatenate([[tg.BOS_ID], np.resize(np.roll(cycle, -offset), length)]))
        total += length + 1
    return np.concatenate(docs)[:tokens]


def tiny_checkpoint(path, loader=None, edit=None, validation=None, **changes):
    """A checkpoint of an untrained model of width 16 (small and fast), optionally with a loader state, the model
    changed by edit(model), the validation shards' record and other recorded hyperparameters."""
    hp = tg.parse_args(list(map(str, tiny(path.parent, "--model_dim", 16, "--head_dim", 8, "--bigram_dim", 8))))
    model = tg.build_model(hp, torch.device("cpu"))
    if edit is not None:
        with torch.no_grad():
            edit(model)
    payload = dict(step=0, training_time_ms=0.0, tokens_seen=0, model=model.state_dict(), matrix={}, adam={},
                   loader=loader or {}, rng={}, script_sha256="", world_size=1,
                   hyperparameters=dataclasses.asdict(dataclasses.replace(hp, **changes)))
    if validation is not None:
        payload["validation"] = validation
    tg.save_checkpoint(path, payload)
    return path


def run_sample(argv, capsys, gpt2_bpe=False):
    """sample.main in this process, with the byte-level encoding unless gpt2_bpe: (exit code, stdout, stderr)."""
    capsys.readouterr()
    try:
        sample.main(list(map(str, argv)), enc=None if gpt2_bpe else byte_encoding())
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def pattern_run(tmp_path_factory):
    """The tiny configuration trained 100 steps on the pattern corpus: (folder, final checkpoint, log text).
    With --adam_lr 0.05 (the tiny configuration's 0.008 is the record's): the embedding and head learn the
    10-token cycle in those steps. Measured, final val loss: 0.092 (0.233 with 0.02, the cpu preset's; 1.41
    with 0.008)."""
    folder = tmp_path_factory.mktemp("pattern")
    tg.write_shard(folder / "pattern_val_000000.bin", pattern_corpus(folder, 20_000, seed=0))
    tg.write_shard(folder / "pattern_train_000001.bin", pattern_corpus(folder, 150_000, seed=1))
    threads = torch.get_num_threads()
    try:
        tg.main(list(map(str, [*tiny(folder, "--adam_lr", 0.05), "--train_files", folder / "pattern_train_*.bin",
                               "--val_files", folder / "pattern_val_*.bin", "--num_scheduled_iterations", 100,
                               "--num_extension_iterations", 0, "--val_loss_every", 0, "--save_checkpoint", "true",
                               "--log_dir", folder / "logs", "--run_id", "pattern"])))
    finally:
        torch.set_num_threads(threads)
    return folder, folder / "logs" / "checkpoints" / "pattern" / "final.pt", (folder / "logs" / "pattern.txt").read_text()


def cycle_after(text):
    """The continuation of PATTERN's cycle after the last character of `text`, as long as wanted."""
    start = PATTERN.index(text[-1]) + 1
    return lambda n: (PATTERN * (n // len(PATTERN) + 2))[start % len(PATTERN):][:n]


@pytest.mark.slow
def test_trained_model_continues_the_pattern_deterministically(pattern_run, capsys):
    _, checkpoint, _ = pattern_run
    prompt = "cdefghijabcd"
    argv = [checkpoint, "--prompt", prompt, "--max_new_tokens", 60, "--temperature", 0.8, "--top_k", 50, "--seed", 3]
    code, out, err = run_sample(argv, capsys)
    assert code == 0, err
    text = out.rstrip("\n")
    assert text.startswith(prompt)
    new = text[len(prompt):]
    steps = list(zip(prompt[-1] + new, new))
    follow = sum(PATTERN[(PATTERN.index(a) + 1) % len(PATTERN)] == b for a, b in steps if a in PATTERN)
    with capsys.disabled():
        print(f"\ngenerated {new!r}: {follow}/{len(steps)} steps follow the cycle; {err.strip()}")
    # measured after 100 steps: 60/60 (an untrained model draws near-uniformly over 50,257 ids); at
    # temperature 0.8 a few draws may leave the cycle before the model counts as not having learned it
    assert len(new) == 60 and follow >= 54, new
    assert re.search(r"^60 tokens in [\d.]+ s \([\d.]+ tokens/s\) on cpu; first token [\d.]+ s after start; checkpoint step 100, windows \d+/\d+ blocks", err)
    assert run_sample(argv, capsys)[1] == out  # the same seed, the same text
    greedy = run_sample([*argv[:-2], "--temperature", 0], capsys)[1].rstrip("\n")
    assert greedy == prompt + cycle_after(prompt)(60)  # the likeliest token is always the cycle's next


@pytest.mark.slow
def test_eval_on_the_checkpoints_validation_shards_is_its_last_val_loss(pattern_run, capsys):
    folder, checkpoint, log = pattern_run
    last = [m[3] for m in map(VAL_LINE.match, log.splitlines()) if m][-1]
    code, out, err = run_sample([checkpoint, "--eval", folder / "pattern_val_*.bin"], capsys)
    assert code == 0, err
    assert out.startswith(f"val_loss:{last} over 1,024 tokens of "), (out, last)


@pytest.mark.slow
def test_a_two_process_checkpoint_loads(tmp_path, capsys):
    tg.write_shard(tmp_path / "pattern_val_000000.bin", pattern_corpus(tmp_path, 20_000, seed=0))
    tg.write_shard(tmp_path / "pattern_train_000001.bin", pattern_corpus(tmp_path, 60_000, seed=1))
    args = [*tiny(tmp_path), "--train_files", tmp_path / "pattern_train_*.bin", "--val_files", tmp_path / "pattern_val_*.bin",
            "--num_scheduled_iterations", 6, "--num_extension_iterations", 0, "--val_loss_every", 0,
            "--save_checkpoint", "true", "--run_id", "two"]
    result = run_script(args, tmp_path, procs=2)
    assert result.returncode == 0, result.stderr[-2000:]
    checkpoint = tmp_path / "logs" / "checkpoints" / "two" / "final.pt"
    assert tg.load_checkpoint(checkpoint)["world_size"] == 2
    code, out, err = run_sample([checkpoint, "--prompt", "abc", "--max_new_tokens", 5], capsys)
    assert code == 0 and out.startswith("abc"), err
    code, out, err = run_sample([checkpoint, "--eval", tmp_path / "pattern_val_*.bin"], capsys)
    assert code == 0 and out.startswith("val_loss:"), err


EVERY_IDEA_OFF = ("--bigram_vocab_size", 0, "--value_embed_layers", "--value_embed_tables", "--value_embed_gates", "false",
                  "--paired_head_layers", "--xsa_layers", "--skip_gate", "false", "--shared_attention_input", "false",
                  "--mudd_dim", 0, "--sublayer_scalars", "false", "--untie_stage", -1)


@pytest.mark.parametrize("flags, prompt_tokens, positions", [
    pytest.param((), 4, 140, id="every-idea"),
    pytest.param((), 150, 180, id="long-prompt", marks=pytest.mark.slow),  # (the everyday tier keeps the first)
    pytest.param(EVERY_IDEA_OFF, 4, 100, id="every-idea-off", marks=pytest.mark.slow)])
def test_decoder_logits_equal_the_full_forwards_at_every_position(tmp_path, flags, prompt_tokens, positions):
    """A prompt, then a generation to 140 positions (180 after the long prompt, 100 with every idea off), with
    random weights (so no idea is inert as at its zero init) and a bigram prior: every recipe-89 idea on (bigram
    hash and signs, smear gate, value embeddings and their gates, paired heads, XSA, key shift, U-net skip, backout,
    MUDD, sublayer lambdas, YaRN), or every idea off; a prompt of 4 tokens, or of 150 run at once (past the short
    and the long window: the masks of several new rows). The sequence outgrows both windows (with every idea off,
    the short one). Each of the Decoder's logits equals the full forward's (GPT.logits over the final sequence:
    attention is causal) at that position. The two compute the same fp32 operations and differ only in the order of
    their sums (one row instead of all, a window's keys instead of a padded tile's, the head's transposed copy); the
    softcap (slope < 1) does not enlarge those roundings. Bound: 16 fp32 ulps of the largest logit, 2^-19 of it
    (measured: 9.8e-8 of it, under one ulp, at 1 and 2 threads). One wrong input lies far above it (measured,
    smallest of the three cases): rotary tables one position off 4.1e-5, the first new key shifted without the
    cached one 4.1e-5, no window (every cached key seen) 7.3e-4."""
    hp = tg.parse_args(list(map(str, tiny(tmp_path, *flags))))
    torch.manual_seed(0)
    model = tg.build_model(hp, torch.device("cpu")).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.3)
    rng = np.random.default_rng(0)
    prior = ngram_prior.NgramPrior(ngram_prior.kneser_ney(*ngram_prior.count_ngrams([rng.integers(0, 3000, 50_000)], hp.vocab_size, 3)), 0.5,
                          model.lm_head.weight.size(0))
    windows = (1, 2)  # short and long window in blocks of 64: 64 and 128 keys (rows of a paired stream)
    model.rotary.follow_window(1 * hp.window_block_tokens)
    model.rotary.follow_window(windows[1] * hp.window_block_tokens)  # YaRN: scaled frequencies
    ids = [tg.BOS_ID] + rng.integers(0, 3000, prompt_tokens - 1).tolist()
    decoder = sample.Decoder(model, hp, windows, prior)
    steps, generator = [decoder.append(ids)], torch.Generator().manual_seed(0)
    while len(ids) < positions:
        ids.append(sample.next_token(steps[-1][: hp.vocab_size].index_fill(0, torch.tensor([tg.BOS_ID]), -torch.inf),
                                     1.0, 0, generator))
        steps.append(decoder.append(ids[-1:]))
    window = np.array(ids + [tg.BOS_ID])
    batch = tg.model_inputs(window, [len(ids)], torch.device("cpu"), tg.bigram_hash(window[:-1], hp.bigram_vocab_size)
                            if hp.bigram_vocab_size else None)
    with torch.no_grad():
        full = model.logits(batch.inputs, batch.cu_seqlens, windows, batch.bigram_ids)
        if prior is not None:  # the prior joins the logits (the Decoder adds it as the CPU loss does)
            full = prior.add_to(full, prior.context_rows(batch.inputs))
        full = full[prompt_tokens - 1:]
    difference = (torch.stack(steps) - full).abs().amax(dim=1) / full.abs().amax(dim=1)
    assert difference.max() <= 2 ** -19, difference.max()


# ----------------------------------------------------------------------------------------------
# bad input: one line, exit status 2


def one_line_error(code, err, *needles):
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("sample.py: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_missing_corrupt_and_foreign_checkpoints(tmp_path, capsys):
    missing = tmp_path / "missing.pt"
    one_line_error(*run_sample([missing, "--prompt", "abc"], capsys)[::2], str(missing), "cannot read")
    corrupt = tmp_path / "corrupt.pt"
    data = bytearray(tiny_checkpoint(tmp_path / "good.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    corrupt.write_bytes(bytes(data))
    one_line_error(*run_sample([corrupt, "--prompt", "abc"], capsys)[::2], "corrupt or truncated", "use an earlier checkpoint")
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(bytes(data[: len(data) // 2]))
    code, _, err = run_sample([truncated, "--prompt", "abc"], capsys)
    one_line_error(code, err, "corrupt or truncated")
    assert "resume" not in err  # the words fit sampling as well as resuming
    plain = tmp_path / "plain.pt"
    torch.save({"weights": torch.zeros(3)}, plain)  # a torch file, but not one of this trainer
    one_line_error(*run_sample([plain, "--prompt", "abc"], capsys)[::2], "not a speedrun checkpoint", "final.pt")
    foreign = tmp_path / "foreign.pt"
    tg.save_checkpoint(foreign, {"model": {}})
    one_line_error(*run_sample([foreign, "--prompt", "abc"], capsys)[::2], "not a checkpoint of this trainer")
    mismatched = tiny_checkpoint(tmp_path / "mismatched.pt", num_layers=10)  # its settings describe another model
    one_line_error(*run_sample([mismatched, "--prompt", "abc"], capsys)[::2], "does not fit")


def test_bad_prompts_and_flags(tmp_path, capsys):
    checkpoint = tiny_checkpoint(tmp_path / "tiny.pt")  # --max_seq_len 256
    one_line_error(*run_sample([checkpoint, "--prompt", "   "], capsys)[::2], "--prompt is only spaces",
                   "--prompt '' to start from the document token alone")
    # an argument that is not UTF-8 reaches Python as lone surrogates (surrogateescape): 0xff is '\udcff'
    one_line_error(*run_sample([checkpoint, "--prompt", "abc\udcff"], capsys)[::2],
                   "--prompt is not valid UTF-8: byte 0xff at character 3")
    for seed in ("99999999999999999999999", "-1", str(2 ** 63)):
        one_line_error(*run_sample([checkpoint, "--prompt", "x", "--seed", seed], capsys)[::2],
                       f"--seed must be in [0, 2^63), got {seed}")
    one_line_error(*run_sample([checkpoint], capsys)[::2], "--prompt", "--eval")
    one_line_error(*run_sample([checkpoint, "--prompt", "x" * 255], capsys)[::2], "256 tokens", "--max_seq_len")
    one_line_error(*run_sample([checkpoint, "--prompt", "x", "--top_k", -1], capsys)[::2], "--top_k must be >= 0")
    for temperature in ("nan", "inf", "-0.5"):
        one_line_error(*run_sample([checkpoint, "--prompt", "x", "--temperature", temperature], capsys)[::2],
                       "--temperature must be a finite number >= 0", f"got {float(temperature)}")
    one_line_error(*run_sample([checkpoint, "--prompt", "x", "--cpu_threads", 0], capsys)[::2], "--cpu_threads must be positive")
    one_line_error(*run_sample([checkpoint, "--prompt", "x", "--max_new_tokens", "many"], capsys)[::2], "invalid int")
    one_line_error(*run_sample([checkpoint, "--eval", tmp_path / "none_*.bin"], capsys)[::2], "matches no file")
    code, out, err = run_sample([checkpoint, "--prompt", "x" * 254, "--max_new_tokens", 5], capsys)  # room for 1
    assert code == 0 and "stopped at the model's 256-token document limit" in err, err


def test_a_model_with_the_ngram_prior_samples_on_the_cpu(tmp_path, capsys, monkeypatch):
    """The prior is added on the CPU only: --device auto picks the CPU for such a model even where CUDA is
    present, --device cuda is one line (checked where CUDA is faked: the refusal comes before any CUDA call)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with_prior = tg.parse_args(list(map(str, tiny(tmp_path, "--ngram_prior", 1.0))))
    assert sample.sampling_device("auto", with_prior).type == "cpu"
    assert sample.sampling_device("auto", dataclasses.replace(with_prior, ngram_prior=0.0)).type == "cuda"
    with pytest.raises(tg.ConfigError, match="--device cuda: the checkpoint's model adds --ngram_prior 1, which runs "
                                             "on the CPU only; use --device cpu or auto"):
        sample.sampling_device("cuda", with_prior)


def test_no_bpe_available(tmp_path, capsys, monkeypatch):
    checkpoint = tiny_checkpoint(tmp_path / "tiny.pt")
    code, _, err = run_sample([checkpoint, "--prompt", "abc", "--bpe", tmp_path / "r50k_base.tiktoken"], capsys, gpt2_bpe=True)
    one_line_error(code, err, "--bpe", "cannot read")

    def offline(name):
        raise ConnectionError("no network")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    code, _, err = run_sample([checkpoint, "--prompt", "abc"], capsys, gpt2_bpe=True)
    one_line_error(code, err, "could not load tiktoken's gpt2 encoding", "--bpe")


@pytest.fixture(scope="module")
def untrained(tmp_path_factory):
    """tiny_checkpoint's untrained model, written once for the tests that only read it."""
    return tiny_checkpoint(tmp_path_factory.mktemp("untrained") / "tiny.pt")


def test_an_empty_prompt_starts_from_the_document_token_alone(untrained, capsys, monkeypatch):
    checkpoint = untrained
    appended = []
    append = sample.Decoder.append
    monkeypatch.setattr(sample.Decoder, "append", lambda self, ids: appended.append(list(ids)) or append(self, ids))
    code, out, err = run_sample([checkpoint, "--prompt", "", "--max_new_tokens", 3], capsys)  # (an untrained model
    assert code == 0, err                                                                     # draws near-uniformly)
    assert appended[0] == [tg.BOS_ID] and len(appended) == 3 and re.search(r"^3 tokens in ", err, re.M), (appended, err)


def test_tiny_temperatures_draw_the_greedy_limit(untrained, capsys):
    """softmax(logits / T) as T -> 0 puts all the mass on the largest logit: 1e-40 (below fp32's smallest normal)
    and 1e-300 (0 in fp32) gave NaN probabilities, from logits / T overflowing. Now every positive T is its own
    distribution, the tiniest the greedy draw."""
    logits = torch.tensor([1.0, 3.0, -2.0, 2.5])
    for temperature in (1e-40, 1e-300, 5e-324):
        assert torch.equal(sample.probabilities(logits, temperature), torch.tensor([0.0, 1.0, 0.0, 0.0]))
    # an ordinary temperature: softmax(logits / T) to fp32 rounding (formed in fp64 from the logits less their max)
    assert torch.allclose(sample.probabilities(logits, 0.8), torch.softmax(logits / 0.8, dim=-1), rtol=1e-6, atol=0)
    argv = [untrained, "--prompt", "abc", "--max_new_tokens", 8]
    greedy = run_sample([*argv, "--temperature", 0], capsys)
    assert greedy[0] == 0, greedy[2]
    code, out, err = run_sample([*argv, "--temperature", "1e-40"], capsys)
    assert code == 0 and out == greedy[1], (out, greedy[1], err)


def head_favouring_padding(model):
    """The head's rows of the GPT-2 ids at zero and its padding rows ±10 times each unit vector: any final hidden
    state scores some padding id above every real one (whose logits are all softcap(0))."""
    weight = model.lm_head.weight
    weight.zero_()
    dim = weight.size(1)
    rows = torch.cat([torch.eye(dim), -torch.eye(dim)]) * 10
    weight[tg.GPT2_VOCAB_SIZE: tg.GPT2_VOCAB_SIZE + 2 * dim] = rows


def test_padding_ids_of_the_vocabulary_are_never_drawn(tmp_path, capsys):
    """A model of --vocab_size 50304 (the GPT-2 vocabulary padded) whose likeliest token is a padding id: it is
    never drawn (its KeyError in the decoding lost the generated text), and stderr says why."""
    checkpoint = tiny_checkpoint(tmp_path / "padded.pt", edit=head_favouring_padding, vocab_size=50304)
    snap, hp, model, prior = sample.open_checkpoint(checkpoint, "cpu")
    logits = sample.Decoder(model, hp, tg.Schedule(hp).at(0).windows, prior).append([tg.BOS_ID, *b"abc"])
    assert int(logits[: hp.vocab_size].argmax()) >= tg.GPT2_VOCAB_SIZE  # (without the mask: a padding id)
    code, out, err = run_sample([checkpoint, "--prompt", "abc", "--max_new_tokens", 6, "--temperature", 0], capsys)
    assert code == 0, err
    assert out.startswith("abc") and len(out.rstrip("\n")) > 3, out
    assert "note: the model's --vocab_size 50304 pads the encoding's 50,257 ids; only those are drawn" in err


def test_eval_of_too_few_tokens_is_one_line_and_rounding_is_said(untrained, tmp_path, capsys):
    checkpoint = untrained  # --val_batch_size 512
    tg.write_shard(tmp_path / "one_000000.bin", [tg.BOS_ID])
    one_line_error(*run_sample([checkpoint, "--eval", tmp_path / "one_*.bin"], capsys)[::2],
                   "holds 1 token(s); scoring needs at least 2")
    tg.write_shard(tmp_path / "val_000000.bin", pattern_corpus(tmp_path, 2_000, seed=0))
    code, out, err = run_sample([checkpoint, "--eval", tmp_path / "val_*.bin", "--eval_tokens", 700], capsys)
    assert code == 0 and out.startswith("val_loss:") and " over 512 tokens of " in out, (out, err)
    assert err == ("sample.py: note: scoring 512 of the 700 tokens asked for (--eval_tokens): whole forwards of "
                   "512 tokens\n"), err
    code, out, err = run_sample([checkpoint, "--eval", tmp_path / "val_*.bin", "--eval_tokens", 512], capsys)
    assert code == 0 and " over 512 tokens of " in out and err == "", (out, err)
    # fewer than one forward: the help said whole forwards, and one token was scored without a word
    argv = [checkpoint, "--eval", tmp_path / "val_*.bin", "--eval_tokens", 1]
    code, out, err = run_sample(argv, capsys)
    assert code == 0 and " over 1 tokens of " in out, (out, err)
    assert err == ("sample.py: note: scoring 1 token(s) in one forward, shorter than the trainer's "
                   "512 (the log's losses are of whole forwards)\n"), err


def prior_checkpoint(folder, train):
    """A checkpoint of a --ngram_prior model whose loader state names the training shard `train` (with its
    fingerprint, as the trainer records it)."""
    return tiny_checkpoint(folder / "prior.pt", ngram_prior=1.0,
                           loader=dict(shard=0, cursor=0, epoch=0, files=[str(train)],
                                       fingerprints=[tg.shard_fingerprint(train)]))


def test_a_replaced_training_shard_is_refused_unless_forced(tmp_path, capsys):
    """The prior is counted from the training shards when the checkpoint is read: another shard under the same
    name gave another --eval (the issue's 15.87 against the log's 5.53), silently. Now it is one line naming the
    shard, and --force gives the other number with a warning."""
    train = tmp_path / "data" / "train_000001.bin"
    train.parent.mkdir()
    tg.write_shard(train, pattern_corpus(tmp_path, 20_000, seed=1))
    tg.write_shard(tmp_path / "val_000000.bin", pattern_corpus(tmp_path, 2_000, seed=0))
    checkpoint = prior_checkpoint(tmp_path, train)
    argv = [checkpoint, "--eval", tmp_path / "val_*.bin", "--eval_tokens", 512]
    code, right, err = run_sample(argv, capsys)
    assert code == 0 and right.startswith("val_loss:") and err == "", err
    other = np.random.default_rng(5).integers(0, 1000, 20_000)
    other[::50] = tg.BOS_ID
    tg.write_shard(train, other)  # the same size, other tokens
    one_line_error(*run_sample(argv, capsys)[::2], f"{train} is not the training shard the checkpoint's run read",
                   "the same 41,024 bytes, other contents", "--force")
    code, wrong, err = run_sample([*argv, "--force"], capsys)
    assert code == 0 and wrong.split()[0] != right.split()[0], (right, wrong)
    assert err.startswith(f"sample.py: warning: {train} is not the training shard") and "--force counts" in err, err


def test_eval_says_when_the_runs_own_validation_shards_changed(tmp_path, capsys):
    """--eval scores any shards on purpose, but on the run's own validation files (by name) edited
    since, its number silently differed from the log's. It still scores them, with a warning naming
    the shard."""
    val = tmp_path / "data" / "val_000000.bin"
    val.parent.mkdir()
    tokens = pattern_corpus(tmp_path, 2_000, seed=0)
    tg.write_shard(val, tokens)
    checkpoint = tiny_checkpoint(tmp_path / "val.pt", validation=tg.shard_record([str(val)]))
    moved = tmp_path / "elsewhere" / "val_000000.bin"
    tg.write_shard(moved, tokens)
    for shards in (val.parent / "val_*.bin", moved.parent / "val_*.bin"):  # (also where they moved)
        code, out, err = run_sample([checkpoint, "--eval", shards, "--eval_tokens", 512], capsys)
        assert code == 0 and out.startswith("val_loss:") and err == "", err
    tokens[300:400] = 7
    tg.write_shard(val, tokens)  # the same size, other contents
    argv = [checkpoint, "--eval", val.parent / "val_*.bin", "--eval_tokens", 512]
    code, out, err = run_sample(argv, capsys)
    assert code == 0 and out.startswith("val_loss:"), err
    now, then = tg.shard_fingerprint(val)[1][:12], tg.shard_fingerprint(moved)[1][:12]
    assert err == (f"sample.py: warning: {val} is not the validation shard the checkpoint's run "
                   f"read under that name (the same 5,024 bytes, other contents: sampled sha256 "
                   f"{now}, that run's {then}): this loss does not compare with its log's\n"), err


@pytest.mark.slow
def test_moved_training_shards_are_found_with_train_files(tmp_path, capsys, monkeypatch):
    """The hint for a missing training shard said to run from the training's folder, wrong for an absolute path,
    and nothing could point at the shards' new place: --train_files GLOB does (the same --eval as before)."""
    train = tmp_path / "data" / "train_000001.bin"
    train.parent.mkdir()
    tg.write_shard(train, pattern_corpus(tmp_path, 20_000, seed=1))
    tg.write_shard(tmp_path / "val_000000.bin", pattern_corpus(tmp_path, 2_000, seed=0))
    checkpoint = prior_checkpoint(tmp_path, train)
    argv = [checkpoint, "--eval", tmp_path / "val_*.bin"]
    right = run_sample(argv, capsys)[1]
    moved = tmp_path / "elsewhere" / train.name
    moved.parent.mkdir()
    train.rename(moved)
    one_line_error(*run_sample(argv, capsys)[::2], f"{train} is not there; pass --train_files GLOB of where they are now")
    assert "run from" not in capsys.readouterr().err
    code, out, err = run_sample([*argv, "--train_files", moved.parent / "*.bin"], capsys)
    assert code == 0 and out == right and err == "", (out, right, err)
    one_line_error(*run_sample([*argv, "--train_files", tmp_path / "nothing_*.bin"], capsys)[::2],
                   f"matches no {train.name} (one of the 1)")
    relative = tiny_checkpoint(tmp_path / "relative.pt", ngram_prior=1.0,
                               loader=dict(files=["data/train_000001.bin"], fingerprints=[tg.shard_fingerprint(moved)]))
    monkeypatch.chdir(tmp_path)
    one_line_error(*run_sample([relative, "--eval", tmp_path / "val_*.bin"], capsys)[::2],
                   "data/train_000001.bin is not there (a path relative to the folder the training ran in); run from "
                   "that folder, or pass --train_files GLOB")


def test_a_checkpoint_of_the_former_bigram_prior_is_refused():
    """Its prior (the absolute-discount bigram) is gone from train_gpt.py: loading it with no prior would give
    other numbers silently, so it is one line pointing at the run's own script."""
    saved = dict(dataclasses.asdict(tg.Hyperparameters()), bigram_prior=1.0)
    with pytest.raises(tg.DataError, match=r"^old\.pt: its model adds --bigram_prior 1, the absolute-discount "):
        sample.checkpoint_hyperparameters("old.pt", {"hyperparameters": saved})
    saved["bigram_prior"] = 0.0  # off: the same model as today's --ngram_prior 0
    assert sample.checkpoint_hyperparameters("old.pt", {"hyperparameters": saved}).ngram_prior == 0
