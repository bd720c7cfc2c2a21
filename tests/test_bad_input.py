"""Bad input and faults end in one clear line and lose nothing, by class: flags, data, checkpoints,
logs. Each case runs train_gpt.main in this process with a tiny configuration and checks the exit
code, that stderr is exactly one line naming the flag or file, and (for data) that it happens before
the first training step."""
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import ngram_prior
import plan_memory as pm
import synthetic
import train_gpt as tg
from test_training import run_main

BOS = tg.BOS_ID
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    synthetic.markov_corpus(folder, train_tokens=60_000, val_tokens=8_192)
    return folder


@pytest.fixture(autouse=True)
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def tiny(corpus, log_dir, *extra, train=None, val=None):
    return ["--preset", "cpu", "--batch_sizes", "512", "512", "512", "--val_tokens", "1024", "--val_batch_size", "512",
            "--max_seq_len", "256", "--window_blocks", "2", "2", "2", "--extension_window_blocks", "2",
            "--final_val_window_blocks", "3", "--num_layers", "9", "--model_dim", "64", "--num_heads", "2",
            "--head_dim", "32", "--cpu_threads", "1", "--window_block_tokens", "64", "--warmup_steps", "0",
            "--num_scheduled_iterations", "4", "--num_extension_iterations", "0", "--val_loss_every", "0",
            "--muon_momentum_warmup_steps", "2", "--muon_momentum_cooldown_steps", "0", "--log_dir", str(log_dir),
            "--train_files", str(train or corpus / "synthetic_train_*.bin"),
            "--val_files", str(val or corpus / "synthetic_val_*.bin"), *map(str, extra)]


def one_line_error(code, err, *needles, prog="train_gpt.py"):
    lines = err.strip().splitlines()
    assert code == 2, (code, err)
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error:"), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def no_training_happened(log_dir):
    """Refused before the log was created: no step trained, and the run id stays free for a rerun."""
    assert not list(log_dir.glob("*.txt"))


# ---------------------------------------------------------------------------------------------- flags

BAD_FLAGS = [
    (["--seed", "99999999999999999999999"], "--seed"),
    (["--seed", "-1"], "--seed"),
    (["--muon_lr", "-0.5"], "--muon_lr"),
    (["--adam_lr", "-0.5"], "--adam_lr"),
    (["--adam_lr", "nan"], "--adam_lr"),
    (["--muon_lr", "inf"], "--muon_lr"),
    (["--adam_lr", "0"], "--adam_lr"),
    (["--adam_betas", "1.0", "1.0"], "--adam_betas"),
    (["--adam_betas", "-0.1", "0.9"], "--adam_betas"),
    (["--muon_momentum", "0.85", "1.0"], "--muon_momentum"),
    (["--muon_beta2", "1.5"], "--muon_beta2"),
    (["--muon_wd", "-1"], "--muon_wd"),
    (["--adam_wd", "-0.1"], "--adam_wd"),
    (["--adam_eps", "0"], "--adam_eps"),
    (["--cooldown_frac", "1.5"], "--cooldown_frac"),
    (["--cooldown_frac", "-0.1"], "--cooldown_frac"),
    (["--lr_multipliers", "1", "nan", "1"], "--lr_multipliers"),
    (["--final_lr_multiplier", "-1"], "--final_lr_multiplier"),
    (["--model_dim", "8", "--num_heads", "1", "--head_dim", "8"], "--model_dim 8"),
    (["--num_heads", "4", "--head_dim", "33", "--model_dim", "132"], "--head_dim"),
    (["--num_heads", "3", "--head_dim", "32"], "--model_dim"),
    (["--vocab_size", "1000"], "--vocab_size 1000"),
    (["--num_layer", "10"], "--num_layer"),  # no prefix matching of flags
    (["--run_id", "../elsewhere"], "--run_id"),
    (["--extension_window_blocks", "1"], "--extension_window_blocks"),
    (["--window_blocks", "2", "1", "2"], "--window_blocks"),
    (["--fp8", "on", "--device", "cpu"], "--fp8 on"),
    (["--device", "tpu"], "--device"),
    (["--bogus_flag", "3"], "--bogus_flag"),
    (["--num_layers", "0"], "--num_layers"),
    (["--batch_sizes", "0", "1", "1"], "--batch_sizes"),
    (["--val_batch_size", "-512"], "--val_batch_size"),
    (["--batch_sizes", "1000", "1000", "1001", "--grad_accum_base", "8"], "--batch_sizes value 1001"),
    (["--window_blocks", "2", "3", "5"], "--max_seq_len"),
    (["--val_tokens", "1000"], "--val_batch_size"),
    (["--save_every", "3"], "--save_every"),
    (["--fp8", "maybe"], "--fp8"),
    (["--num_layers", "4"], "--num_layers 4"),
    (["--num_layers", "abc"], "--num_layers"),
    (["--cycle_data", "perhaps"], "--cycle_data"),
    (["--profile", "5:2"], "--profile"),
    # negative values in scientific or START:END notation reach the range checks (not "expected one argument")
    (["--matrix_optimizer", "shampoo", "--shampoo_lr", "-1e-3"], "--shampoo_lr must be positive, got -0.001"),
    (["--profile", "-1:2"], "--profile must look like START:END"),
    (["--muon_momentum", "-1e-2", "0.9"], "--muon_momentum must be in [0, 1)"),
    (["--run_id=-rf"], "--run_id may hold"),
    (["--matrix_optimizer", "soap", "--factor_dtype", "fp16"], "--factor_dtype must be one of fp32, bf16"),
    # track 3's flags come with its optimizers (track3.py)
    (["--shampoo_lr", "0.1"], "unrecognized arguments: --shampoo_lr 0.1; track 3's flags need --matrix_optimizer"),
    (["--matrix_optimizer", "lion"], "--matrix_optimizer must be normuon or one of track3.py's shampoo, soap, adamw"),
    # a cap of 1 ran thousands of forwards per step (no step in 12 minutes); 128 is one attention tile
    (["--micro_batch_tokens", "1"], "--micro_batch_tokens 1 is below 128, the smallest cap"),
    (["--micro_batch_tokens", "127"], "--micro_batch_tokens 127 is below 128"),
    # the loss was -inf or nan at step 0, and the message blamed the learning rates
    (["--ngram_prior", "1e30"], "--ngram_prior 1e+30 is above 8.037"),
    (["--ngram_prior", "8.04"], "--ngram_prior 8.04 is above 8.037"),
    (["--ngram_prior_order", "1"], "--ngram_prior_order must be in 2 ... 5"),
    (["--ngram_prior_order", "6"], "--ngram_prior_order must be in 2 ... 5"),
    (["--flex_backend", "flsh"], "--flex_backend must be triton or flash"),
]


@pytest.mark.parametrize("extra,needle", BAD_FLAGS, ids=[" ".join(e) for e, _ in BAD_FLAGS])
def test_bad_flag_is_one_line_before_any_work(corpus, tmp_path, capsys, extra, needle):
    result, code, err = run_main([*tiny(corpus, tmp_path), *extra], capsys)
    assert result is None
    one_line_error(code, err, needle)
    assert not list(tmp_path.glob("*.txt"))  # rejected before a log was even created


def test_flex_backend_flash_without_flash_attn_4_is_one_line(monkeypatch):
    """--flex_backend flash where flash-attn-4 does not import (the GPU image today): one line
    naming the flag, the package and the way back, when the GPU backend is built."""
    flex_flash = tg.load_companion("flex_flash.py")
    monkeypatch.setattr(flex_flash, "flash_available", lambda: False)
    hp = tg.parse_args(["--flex_backend", "flash"])
    with pytest.raises(tg.ConfigError) as info:
        tg.backend_for(hp, torch.device("cuda"), fp8_hardware=True)
    assert str(info.value).startswith("--flex_backend flash needs flash-attn-4")
    assert "--flex_backend triton" in str(info.value) and "\n" not in str(info.value)


BAD_ENVIRONMENTS = [
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be >= 1"),
    ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' is not an integer"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is not below WORLD_SIZE=2"),
    ({"LOCAL_RANK": "-1"}, "LOCAL_RANK=-1 must be >= 0"),
    ({"LOCAL_WORLD_SIZE": "x1"}, "LOCAL_WORLD_SIZE='x1' is not an integer"),
    ({"LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "2", "RANK": "1"}, "LOCAL_WORLD_SIZE=4 is more than WORLD_SIZE=2"),
    ({"TORCHELASTIC_MAX_RESTARTS": "many"}, "TORCHELASTIC_MAX_RESTARTS='many' is not an integer"),
]


ENVIRONMENT_CASES = [(variables, needle, plan) for variables, needle in BAD_ENVIRONMENTS for plan in (False, True)
                     if not (plan and "TORCHELASTIC_MAX_RESTARTS" in variables)]  # (no plan reads restart settings)


def run_plan(argv, capsys):
    """tools/plan_memory.py's main in this process: (exit code, stderr)."""
    capsys.readouterr()
    try:
        pm.main(list(map(str, argv)))
        code = 0
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("variables,needle,plan", ENVIRONMENT_CASES,
                         ids=[" ".join(f"{k}={v}" for k, v in e.items()) + (" plan_memory.py" if plan else "")
                              for e, _, plan in ENVIRONMENT_CASES])
def test_a_bad_environment_variable_is_one_line_like_a_flag(corpus, tmp_path, capsys, monkeypatch, variables, needle,
                                                            plan):
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    if plan:
        code, err = run_plan(tiny(corpus, tmp_path), capsys)
        one_line_error(code, err, f"the environment variable {needle}", prog="plan_memory.py")
    else:
        result, code, err = run_main(tiny(corpus, tmp_path), capsys)
        assert result is None
        one_line_error(code, err, f"the environment variable {needle}")
    assert not list(tmp_path.glob("*.txt"))


@pytest.mark.parametrize("extra,needle", [(["--gpu_memory_gb", "0"], "--gpu_memory_gb must be positive, got 0.0"),
                                          (["--gpu_memory_gb", "nan"], "--gpu_memory_gb must be positive, got nan"),
                                          (["--gpu_memory_gb", "inf"],
                                           "--gpu_memory_gb must be finite, got inf"),
                                          (["--num_layers", "4"], "--num_layers 4")])
def test_plan_memory_refuses_bad_flags_in_one_line(corpus, tmp_path, capsys, extra, needle):
    code, err = run_plan([*tiny(corpus, tmp_path), *extra], capsys)
    one_line_error(code, err, needle, prog="plan_memory.py")


@pytest.mark.parametrize("flag", [["--world_size", "8"], ["--world_size=8"]])
def test_plan_memory_points_a_world_size_flag_at_the_environment(corpus, tmp_path, capsys, flag):
    code, err = run_plan([*tiny(corpus, tmp_path), *flag], capsys)
    one_line_error(code, err, "--world_size is not a flag of this tool", "WORLD_SIZE=N python tools/plan_memory.py",
                   prog="plan_memory.py")


def test_plan_memory_prints_the_plan_outside_torchrun_whatever_rank_says(corpus, tmp_path, capsys, monkeypatch):
    """RANK=1 WORLD_SIZE=2 outside torchrun printed nothing, with exit status 0: the plan is rank 0's of 2."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setattr(pm, "plan_report", lambda hp, world_size, gb: [f"the plan of rank 0 of {world_size}"])
    capsys.readouterr()
    pm.main(tiny(corpus, tmp_path))
    assert capsys.readouterr().out == "the plan of rank 0 of 2\n"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "under-torchrun")  # there only rank 0 prints
    pm.main(tiny(corpus, tmp_path))
    assert capsys.readouterr().out == ""


@pytest.mark.slow
@pytest.mark.parametrize("restarts", ["abc", "-1", "1.5", " ", "12345678901234567890"])
def test_run_sh_refuses_a_restarts_that_is_not_a_count(tmp_path, restarts):
    """It used to print `integer expression expected` twice and train without restarts (or train silently
    without them for -1; a 20-digit count overflowed bash's integers the same way). PYTHON names a program that
    fails if run: the refusal comes before any launch."""
    done = subprocess.run(["bash", str(REPO / "run.sh")], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "RESTARTS": restarts, "PYTHON": "false"})
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr == f"run.sh: error: RESTARTS={restarts} is not a number of restarts; set it to 0 to " \
                          f"999999999 (or unset it)\n", done.stderr


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path of run.sh")
def test_run_sh_refuses_a_bad_flag_under_restarts_once_before_torchrun(tmp_path):
    """torchrun started the worker with the bad flag, and restarted it: the error printed once per attempt."""
    done = subprocess.run(["bash", str(REPO / "run.sh"), "--adam_lr", "-1", "--run_id", "x", "--log_dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "RESTARTS": "2", "PYTHON": sys.executable})
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr == ("run.sh: no GPU found; running the cpu preset on one process\n"
                           "train_gpt.py: error: --adam_lr must be positive, got -1.0\n"), done.stderr
    assert not list(tmp_path.iterdir())


def test_cpu_preset_stays_on_the_cpu_where_cuda_exists(monkeypatch):
    """The tests' configurations use the cpu preset: on a GPU machine they must run as they do here (a
    second local rank on one GPU would otherwise ask for cuda:1)."""
    monkeypatch.setattr(tg.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tg.torch, "set_num_threads", lambda n: None)
    monkeypatch.setattr(tg.dist, "init_process_group", lambda *args, **kwargs: None)  # (no second process)
    for name, value in (("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1"), ("LOCAL_WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)
    assert tg.setup_distributed(tg.parse_args(["--preset", "cpu"]))[2].type == "cpu"
    assert tg.parse_args(["--preset", "cpu", "--device", "cuda"]).device == "cuda"  # an explicit flag wins
    monkeypatch.setattr(tg.torch.cuda, "device_count", lambda: 1)
    with pytest.raises(tg.ConfigError, match="local rank 1 needs 2 GPUs"):
        tg.setup_distributed(tg.parse_args([]))  # the record preset does go to CUDA (control)


def test_a_bare_boolean_flag_means_true():
    parse = tg.build_arg_parser().parse_args
    assert parse(["--force"]).force is True and parse(["--force", "false"]).force is False
    assert parse(["--compile", "--seed", "3"]).compile is True  # the next flag is not taken as its value
    with pytest.raises(SystemExit):
        parse(["--force", "maybe"])


def test_abbreviated_flag_is_not_taken_for_the_full_one():
    with pytest.raises(SystemExit):
        tg.build_arg_parser().parse_args(["--num_layer", "10"])
    assert tg.build_arg_parser().parse_args(["--num_layers", "10"]).num_layers == 10


# ---------------------------------------------------------------------------------------------- data


def write(path, tokens):
    tg.write_shard(path, np.asarray(tokens))
    return path


def corrupt_copy(corpus, tmp_path, which, change):
    """A copy of the synthetic `which` shard changed by `change(tokens) -> tokens`; returns its glob."""
    folder = tmp_path / f"{which}_data"
    folder.mkdir()
    tokens = tg.read_shard(next(corpus.glob(f"synthetic_{which}_*.bin"))).astype(np.int64)
    raw = change(tokens.copy())
    if isinstance(raw, bytes):
        (folder / f"{which}_000000.bin").write_bytes(raw)
    else:
        header = np.zeros(256, dtype="<i4")
        header[:3] = 20240520, 1, len(raw)
        (folder / f"{which}_000000.bin").write_bytes(header.tobytes() + np.asarray(raw, dtype="<u2").tobytes())
    return folder / f"{which}_*.bin", folder / f"{which}_000000.bin"


def with_big_id(tokens):
    tokens[500] = 60000  # inside the validation prefix too (only the prefix is read and used)
    return tokens


def header_only(tokens):
    return tokens[:0]


def no_bos(tokens):
    tokens[tokens == BOS] = 7
    return tokens


def only_bos(tokens):
    return np.full_like(tokens, BOS)


@pytest.mark.parametrize("which,change,needle", [
    ("train", with_big_id, "token id 60000 at position 500 is not below the vocabulary size 50257"),
    ("val", with_big_id, "token id 60000 at position 500 is not below the vocabulary size 50257"),
    ("train", header_only, "holds no tokens"),
    ("val", header_only, "hold 0 tokens, but --val_tokens 1024 needs 1025"),
    ("train", no_bos, "no document start (token 50256)"),
    ("train", only_bos, "its 60,000 tokens are all the document token 50256, documents with no text"),
])
def test_bad_shard_is_named_before_training(corpus, tmp_path, capsys, which, change, needle):
    pattern, path = corrupt_copy(corpus, tmp_path, which, change)
    kwargs = {which: pattern}
    log_dir = tmp_path / "logs"
    result, code, err = run_main(tiny(corpus, log_dir, **kwargs), capsys)
    line = one_line_error(code, err, needle)
    assert str(path) in line or str(pattern) in line
    no_training_happened(log_dir)


def test_the_smallest_micro_batch_cap_is_accepted():
    assert tg.parse_args(["--micro_batch_tokens", "128"]).micro_batch_tokens == 128
    assert tg.parse_args(["--micro_batch_tokens", "0"]).micro_batch_tokens == 0  # (no cap)


@pytest.mark.parametrize("tokens,needle", [
    (1_500, "the 1 training shard(s) hold 1,500 tokens, but the run's 4 steps take at least 2,052"),
    (5_000, "the 1 training shard(s) (5,000 tokens) run out at step "),
])
def test_training_shards_that_run_out_are_refused_before_the_first_step(corpus, tmp_path, capsys, tokens, needle):
    """A 5,000-token shard was reported used up only once step 1 asked for more. The run's 4 steps of 512 tokens
    take at least 4 x 513 (each micro-step one more target); the walk over the documents (up to 448 or 256 tokens
    of each, by stage; the rest is skipped) finds the step the shard runs out at, and the loader itself runs out
    there."""
    pattern, _ = corrupt_copy(corpus, tmp_path, "train", lambda t: t[:tokens])
    log_dir = tmp_path / "logs"
    argv = tiny(corpus, log_dir, train=pattern)
    result, code, err = run_main(argv, capsys)
    line = one_line_error(code, err, needle, "--cycle_data true")
    no_training_happened(log_dir)
    if "run out at step" in line:
        step, schedule = int(re.search(r"run out at step (\d+) of 4", line)[1]), tg.Schedule(tg.parse_args(argv))
        loader = tg.TrainLoader(str(pattern), 0, 1, torch.device("cpu"))
        for s in range(step):
            loader.next_pieces(512, schedule.at(s).max_seq_len, 512)
        with pytest.raises(tg.DataError, match="used up"):
            loader.next_pieces(512, schedule.at(step).max_seq_len, 512)
        loader.close()


@pytest.mark.parametrize("pattern,script", [
    ("data/novels/novels_train_*.bin", "python data/novels.py --out data/novels"),
    ("data/fineweb10B/fineweb_val_*.bin", "python data/cached_fineweb10B.py")])
def test_a_glob_that_matches_nothing_names_the_script_that_builds_its_data(tmp_path, monkeypatch,
                                                                           pattern, script):
    """A novels glob that matched nothing was told to download FineWeb (`cached_fineweb10B.py`)."""
    monkeypatch.setenv("DATA_PATH", str(tmp_path))
    flag = "--train_files" if "train" in pattern else "--val_files"
    hint = f"matches no file; build the shards with `{script}`"
    with pytest.raises(tg.DataError, match=re.escape(hint)):
        tg.resolve_data(tg.parse_args([flag, pattern]), 0)


def one_document(tokens):
    tokens[tokens == BOS] = 7
    tokens[0] = BOS
    return tokens


def test_cycled_shards_too_small_for_a_micro_step_are_refused_before_the_log(corpus, tmp_path,
                                                                            capsys):
    """With --cycle_data true and a shard of one long document every check passed: the log was
    written, step 0 validated, and then came `the training shards ... are too small` (exit 2), the
    run id taken. A micro-step comes from one shard, of whole documents of at most the stage's
    sequence length (the rest skipped): one document gives 448 of the 513 tokens the first stage's
    micro-step takes."""
    pattern, path = corrupt_copy(corpus, tmp_path, "train", one_document)
    log_dir = tmp_path / "logs"
    argv = tiny(corpus, log_dir, "--cycle_data", "true", train=pattern)
    result, code, err = run_main(argv, capsys)
    one_line_error(code, err, f"no training shard of {pattern} holds one micro-step of 512 tokens",
                   "documents of at most 448 tokens", "even with --cycle_data")
    no_training_happened(log_dir)


def test_half_of_the_default_data_is_never_swapped_for_the_synthetic_corpus(tmp_path, capsys, monkeypatch):
    """The cpu preset (--synthetic_fallback) with FineWeb training shards and no validation shard used the
    synthetic corpus for both, saying only that no shards match."""
    monkeypatch.setattr(synthetic, "synthetic_corpus",
                        lambda folder, **_: pytest.fail(f"would write a corpus into {folder}"))
    monkeypatch.setenv("DATA_PATH", str(tmp_path))
    write(tmp_path / "data" / "fineweb10B" / "fineweb_train_000001.bin", [BOS, 1, 2, 3])
    with pytest.raises(tg.DataError, match=re.escape(f"--val_files '{tmp_path}/data/fineweb10B/fineweb_val_*.bin' "
                                                     f"matches no file (--synthetic_fallback replaces the data only "
                                                     f"when neither glob matches)")):
        tg.resolve_data(tg.parse_args(["--preset", "cpu"]), 0)


def test_a_shard_fingerprint_tells_another_shard_under_the_same_name(tmp_path):
    """What a checkpoint records of each training shard: its size and a sha256 of its header and 64 blocks of
    4 KiB spread over it. A shard up to 257 KiB is hashed whole, so one changed token shows."""
    path = write(tmp_path / "a.bin", np.arange(100_000) % 50_000)
    other = write(tmp_path / "b" / "a.bin", np.arange(100_000) % 50_000)
    state = dict(files=[str(path)], fingerprints=[tg.shard_fingerprint(path)])
    assert tg.shard_difference(state, [other], [tg.shard_fingerprint(other)]) is None  # the same shard, moved
    changed = np.arange(100_000) % 50_000
    changed[77_777] += 1
    write(other, changed)
    assert "the same 201,024 bytes, other contents" in tg.shard_difference(state, [other], [tg.shard_fingerprint(other)])
    write(other, changed[:-1])
    assert "201,022 bytes where that run read 201,024" in tg.shard_difference(state, [other], [tg.shard_fingerprint(other)])
    unrecorded = write(tmp_path / "c.bin", changed)
    assert tg.shard_difference(state, [unrecorded], [tg.shard_fingerprint(unrecorded)]) is None  # (names are matched
    assert tg.shard_difference({"files": [str(path)]}, [other], [tg.shard_fingerprint(other)]) is None  # elsewhere)
    big = np.arange(2_000_000) % 50_000  # 4 MB: a block every 62 KiB
    path = write(tmp_path / "big.bin", big)
    before = tg.shard_fingerprint(path)
    span = 2 * big.size - tg.SHARD_SAMPLE_BYTES
    inside = span * 32 // (tg.SHARD_SAMPLES - 1) // 2 + 1  # a token inside the 33rd block
    between = inside + tg.SHARD_SAMPLE_BYTES // 2  # 2 bytes past that block's end
    for token, seen in ((inside, True), (between, False)):  # (an edit between the blocks is the cheap check's blind spot)
        edited = big.copy()
        edited[token] += 1
        assert (tg.shard_fingerprint(write(path, edited)) != before) == seen, token


def test_glob_matching_a_directory(corpus, tmp_path, capsys):
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "train_000000.bin").mkdir()
    log_dir = tmp_path / "logs"
    result, code, err = run_main(tiny(corpus, log_dir, train=tmp_path / "shards" / "train_*.bin"), capsys)
    one_line_error(code, err, "train_000000.bin", "Is a directory")
    no_training_happened(log_dir)


def deny_access(monkeypatch, path, folder=False):
    """Take away read (a file) or write (a folder) permission: chmod where it binds; as root, which
    ignores permissions, make Path.open fail as the OS would."""
    path.chmod(0o555 if folder else 0)
    if os.geteuid() != 0:
        return
    real_open = tg.Path.open

    def open_or_deny(self, mode="r", *args, **kwargs):
        if (self.parent if folder else self) == path and (("r" in mode) != folder):
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, mode, *args, **kwargs)

    monkeypatch.setattr(tg.Path, "open", open_or_deny)


def test_unreadable_shard(corpus, tmp_path, capsys, monkeypatch):
    pattern, path = corrupt_copy(corpus, tmp_path, "train", lambda t: t)
    deny_access(monkeypatch, path)
    result, code, err = run_main(tiny(corpus, tmp_path / "logs", train=pattern), capsys)
    one_line_error(code, err, str(path), "Permission denied")
    no_training_happened(tmp_path / "logs")


def test_val_shard_shorter_than_val_tokens_is_reported_first(corpus, tmp_path, capsys):
    log_dir = tmp_path / "logs"
    result, code, err = run_main([*tiny(corpus, log_dir), "--val_tokens", "16384", "--val_batch_size", "512"], capsys)
    one_line_error(code, err, "--val_tokens 16384 needs 16385")
    no_training_happened(log_dir)


def test_explicit_glob_matching_nothing_is_an_error_even_with_the_fallback(corpus, tmp_path, capsys):
    """The synthetic corpus replaces only the default globs, never one the user gave."""
    missing = str(tmp_path / "nothere_*.bin")
    result, code, err = run_main([*tiny(corpus, tmp_path), "--train_files", missing, "--synthetic_fallback", "true"],
                                 capsys)
    one_line_error(code, err, "--train_files", missing)


# ---------------------------------------------------------------------------------------------- logs


@pytest.mark.slow
def test_run_id_is_exclusive(corpus, tmp_path, capsys):
    argv = tiny(corpus, tmp_path, "--run_id", "taken")
    result, code, err = run_main(argv, capsys)
    assert code == 0, err
    first = (tmp_path / "taken.txt").read_text()
    result, code, err = run_main(argv, capsys)
    one_line_error(code, err, "taken.txt exists", "--run_id")
    assert (tmp_path / "taken.txt").read_text() == first  # the earlier log is untouched


def test_log_dir_that_is_a_file(corpus, tmp_path, capsys):
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("x")
    result, code, err = run_main(tiny(corpus, blocker / "logs"), capsys)
    one_line_error(code, err, "not_a_folder")


def test_read_only_log_dir(corpus, tmp_path, capsys, monkeypatch):
    folder = tmp_path / "ro"
    folder.mkdir()
    deny_access(monkeypatch, folder, folder=True)
    result, code, err = run_main(tiny(corpus, folder), capsys)
    one_line_error(code, err, str(folder), "Permission denied")
    assert not list(folder.iterdir())


def test_a_non_finite_loss_at_step_0_does_not_blame_the_learning_rates():
    """Step 0's loss comes before any update: the learning rates cannot have made it."""
    check = tg.LateLossCheck(torch.device("cpu"))
    check.push(0, torch.tensor([float("nan"), 0.0]))
    with pytest.raises(FloatingPointError, match=r"^training loss is nan at step 0; before any update, so not from the "
                                                 r"learning rates: check the data and the model's flags, then rerun$"):
        check.finish()
    check.push(3, torch.tensor([float("inf"), 0.0]))
    with pytest.raises(FloatingPointError, match=r"at step 3; lower the learning rates \(--muon_lr/--adam_lr\)"):
        check.finish()


@pytest.mark.slow
def test_non_finite_validation_loss_fails_the_run(corpus, tmp_path, capsys, monkeypatch):
    real = tg.chunked_softcap_cross_entropy

    def nan_in_eval(x, weight, targets, training, *args, **kwargs):
        loss = real(x, weight, targets, training, *args, **kwargs)
        return loss if training else loss * float("nan")

    monkeypatch.setattr(tg, "chunked_softcap_cross_entropy", nan_in_eval)
    result, code, err = run_main(tiny(corpus, tmp_path), capsys)
    one_line_error(code, err, "validation loss is nan")


# ------------------------------------------------------------------------------ the n-gram prior


def test_a_prior_that_cannot_fit_in_memory_is_refused_before_the_log(corpus, tmp_path, capsys,
                                                                     monkeypatch):
    """Counting the prior past the memory gave a numpy _ArrayMemoryError traceback (exit 1), and the
    log ended at its `data:` line. The counting's least peak, from the token count and the order, is
    checked at setup."""
    floor = ngram_prior.ngram_count_bytes_floor(5, 60_000)
    assert floor >= 60_000 * 4 * 35  # (measured at order 5: 146-224 bytes a token while counting)
    monkeypatch.setattr(tg, "available_memory_bytes", lambda: floor - 1)
    log_dir = tmp_path / "logs"
    result, code, err = run_main(tiny(corpus, log_dir), capsys)
    one_line_error(code, err, "counting the --ngram_prior of 60,000 training tokens at "
                   "--ngram_prior_order 5 needs at least",
                   "lower --ngram_prior_order, or pass --ngram_prior 0")
    no_training_happened(log_dir)
    hp = tg.parse_args(["--preset", "cpu"])
    assert ngram_prior.check_counting_fits(hp, 60_000, floor) is None  # (just fits)
    assert ngram_prior.check_counting_fits(hp, 60_000, None) is None  # (unknown: not refused)


def test_out_of_memory_while_counting_the_prior_is_one_line_before_the_log(corpus, tmp_path,
                                                                            capsys, monkeypatch):
    """A MemoryError while counting was a traceback. The prior is counted at setup, before the
    log is written: one line, and the run id stays free."""
    def out_of_memory(*args):
        raise MemoryError("Unable to allocate 3.66 MiB for an array with shape (60000, 8) and data "
                          "type int64")

    monkeypatch.setattr(ngram_prior, "count_ngrams", out_of_memory)
    result, code, err = run_main(tiny(corpus, tmp_path, "--run_id", "oom"), capsys)
    one_line_error(code, err, "ran out of memory counting the --ngram_prior of 60,000 training "
                   "tokens", "lower --ngram_prior_order, or pass --ngram_prior 0")
    no_training_happened(tmp_path)


@pytest.mark.parametrize("stop", ["SIGTERM", "Ctrl-C"])
def test_a_stop_while_the_prior_is_counted_ends_before_the_first_step(corpus, tmp_path, capsys,
                                                                      monkeypatch, stop):
    """SIGTERM during the counting was only noted: the run counted on, validated step 0, trained two
    steps, checkpointed and exited 75. It is before the first step: nothing to save, exit 75 and one
    line. Ctrl-C there said to continue from the last checkpoint, with none written."""
    real = ngram_prior.count_ngram_prior

    def interrupted(*args):
        if stop == "Ctrl-C":
            raise KeyboardInterrupt
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*args)

    monkeypatch.setattr(ngram_prior, "count_ngram_prior", interrupted)
    argv = tiny(corpus, tmp_path, "--run_id", "stop", "--save_every", "2")
    result, code, err = run_main(argv, capsys)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and code == (tg.PREEMPTED_EXIT_CODE if stop == "SIGTERM" else 130), err
    if stop == "SIGTERM":
        assert lines[0] == ("train_gpt.py: stopped by SIGTERM before the first training step; "
                            "nothing new to save"), lines
    else:
        assert "last checkpoint" not in lines[0] and "no checkpoint" in lines[0], lines
    no_training_happened(tmp_path)  # (the prior is counted at setup: before the log)
    assert not (tmp_path / "checkpoints").exists()


def test_ctrl_c_says_to_continue_only_where_a_checkpoint_of_the_run_exists(tmp_path):
    hp = tg.parse_args(["--preset", "cpu", "--log_dir", str(tmp_path), "--run_id", "r"])
    assert "no checkpoint" in tg.interrupted_message(hp, None)
    assert "no checkpoint" in tg.interrupted_message(None, None)
    (tmp_path / "checkpoints" / "r").mkdir(parents=True)
    (tmp_path / "checkpoints" / "r" / "step_000002.pt").write_bytes(b"")
    assert "continue from the last checkpoint" in tg.interrupted_message(hp, None)


# ---------------------------------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def checkpoint(corpus, tmp_path_factory):
    """A checkpoint at step 2 of the tiny 4-step run."""
    log_dir = tmp_path_factory.mktemp("ckpt")
    argv = tiny(corpus, log_dir, "--save_every", "2", "--run_id", "src")
    assert tg.main(argv)
    return log_dir / "checkpoints" / "src" / "step_000002.pt"


@pytest.mark.slow
@pytest.mark.parametrize("extra,needles", [
    (["--num_layers", "10"], ["--num_layers 9", "--num_layers 10"]),
    (["--model_dim", "128", "--num_heads", "2", "--head_dim", "64"], ["--model_dim 64", "--model_dim 128"]),
    (["--batch_sizes", "1024", "1024", "1024"], ["--batch_sizes 512 512 512", "--batch_sizes 1024 1024 1024", "--force"]),
    (["--muon_lr", "0.05"], ["--muon_lr 0.00575", "--muon_lr 0.05", "--force"]),
    (["--num_scheduled_iterations", "1"], ["at step 2, past this run's last step 1"]),
])
def test_resume_refuses_what_it_cannot_continue(corpus, tmp_path, capsys, checkpoint, extra, needles):
    result, code, err = run_main([*tiny(corpus, tmp_path), "--resume", checkpoint, *extra], capsys)
    one_line_error(code, err, str(checkpoint), *needles)


def test_force_names_every_setting_and_the_script_it_overrides():
    """--force resumed a checkpoint of other settings, or of an edited script, without a word
    (check_resumable returned before it looked): the loss then differed from the checkpoint's run's
    with no warning. Now one warning line names each setting, old -> new, and the script change;
    without --force the same is refused."""
    old = tg.parse_args(["--preset", "cpu", "--ngram_prior_order", "3"])
    snap = dict(hyperparameters=tg.dataclasses.asdict(old), step=2, script_sha256="0" * 64)
    argv = ["--preset", "cpu", "--ngram_prior_order", "4", "--adam_lr", "0.01", "--seed", "5"]
    lines, script = [], tg.script_sha256(tg.parse_args(argv))
    tg.check_resumable("ck.pt", snap, tg.parse_args([*argv, "--force"]), 100, lines.append)
    [line] = lines
    # (--seed may differ on resume: not named)
    assert line == (f"warning: --force resumes ck.pt with --ngram_prior_order 3 -> 4, --adam_lr "
                    f"{old.adam_lr} -> 0.01 and another train_gpt.py (sha256 000000000000 -> "
                    f"{script[:12]}): the losses will not be those of the checkpoint's "
                    f"run"), line
    with pytest.raises(tg.ConfigError, match="written by a different train_gpt.py; pass --force"):
        tg.check_resumable("ck.pt", snap, tg.parse_args(argv), 100, lines.append)
    snap["script_sha256"] = script
    refused = (r"with --ngram_prior_order 3, --adam_lr .* but this run has --ngram_prior_order 4, "
               r"--adam_lr 0.01; pass the same settings, or --force")
    with pytest.raises(tg.ConfigError, match=refused):
        tg.check_resumable("ck.pt", snap, tg.parse_args(argv), 100, lines.append)
    snap["hyperparameters"] = tg.dataclasses.asdict(tg.parse_args(argv))
    tg.check_resumable("ck.pt", snap, tg.parse_args([*argv, "--force"]), 100, lines.append)
    assert len(lines) == 1  # nothing overridden: no warning


@pytest.mark.slow
def test_resume_with_changed_schedule_and_force(corpus, tmp_path, capsys, checkpoint):
    argv = [*tiny(corpus, tmp_path, "--run_id", "forced"), "--resume", checkpoint, "--muon_lr",
            "0.05", "--force", "true"]
    result, code, err = run_main(argv, capsys)
    assert code == 0 and [s for s, _ in result] == [4], err
    warning = f"warning: --force resumes {checkpoint} with --muon_lr 0.00575 -> 0.05: the losses"
    assert warning in (tmp_path / "forced.txt").read_text()


@pytest.mark.slow
def test_resume_at_the_last_step_still_validates(corpus, tmp_path, capsys, checkpoint):
    """A checkpoint at the run's last step resumes into the final validation only."""
    result, code, err = run_main([*tiny(corpus, tmp_path), "--resume", checkpoint, "--num_scheduled_iterations", "2",
                                  "--force", "true"], capsys)
    assert code == 0 and [s for s, _ in result] == [2], err


@pytest.mark.slow
def test_resume_cleans_temp_files_of_killed_writes(corpus, tmp_path, capsys, checkpoint):
    folder = tmp_path / "ckpts"
    shutil.copytree(checkpoint.parent, folder)
    host = tg.platform.node()
    dead = folder / f".step_000004.pt~{host}~999999999~dead.tmp"  # no such process
    live = folder / f".step_000004.pt~{host}~{os.getpid()}~live.tmp"  # a write still running
    other = folder / f".step_000004.pt~another-host~1~far.tmp"  # cannot tell: left alone
    for p in (dead, live, other):
        p.write_bytes(b"partial")
    result, code, err = run_main([*tiny(corpus, tmp_path), "--resume", folder / checkpoint.name], capsys)
    assert code == 0, err
    assert not dead.exists() and live.exists() and other.exists()


@pytest.mark.slow
def test_failed_periodic_checkpoint_warns_and_training_goes_on(corpus, tmp_path, capsys, monkeypatch):
    real = tg.write_atomically

    def full_disk(path, data):
        if path.name != "step_000002.pt":
            return real(path, data)
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(tg, "write_atomically", full_disk)
    result, code, err = run_main([*tiny(corpus, tmp_path, "--save_every", "2", "--save_checkpoint", "true",
                                       "--run_id", "disk")], capsys)
    assert code == 0 and [s for s, _ in result] == [4], err
    log = (tmp_path / "disk.txt").read_text()
    assert "warning: could not write checkpoint" in log and "No space left on device" in log
    folder = tmp_path / "checkpoints" / "disk"
    assert sorted(p.name for p in folder.iterdir()) == ["final.pt"]  # no partial file, no temp file


@pytest.mark.slow
def test_failed_final_checkpoint_fails_the_run(corpus, tmp_path, capsys, monkeypatch):
    def full_disk(path, data):
        raise OSError(28, "No space left on device")  # as a write to a full disk: no file name

    monkeypatch.setattr(tg, "write_atomically", full_disk)
    result, code, err = run_main([*tiny(corpus, tmp_path, "--save_checkpoint", "true", "--run_id", "full")], capsys)
    line = one_line_error(code, err, "final.pt", "No space left on device")
    assert (tmp_path / "full.txt").read_text().endswith(line + "\n")  # the log records why the run failed


def test_batch_larger_than_any_shard_is_reported_before_training(corpus, tmp_path, capsys):
    log_dir = tmp_path / "logs"
    result, code, err = run_main([*tiny(corpus, log_dir), "--batch_sizes", "512", "512", "100000"], capsys)
    one_line_error(code, err, "--batch_sizes 100000", "largest training shard holds 60000")
    no_training_happened(log_dir)


@pytest.mark.parametrize("content,needle", [
    (b"not a checkpoint at all", "not a speedrun checkpoint"),
    ("sound-but-garbage", "cannot load the checkpoint"),
    ("sound-but-foreign", "not a checkpoint of this trainer (missing"),
])
def test_resume_refuses_files_that_are_not_our_checkpoints(corpus, tmp_path, capsys, content, needle):
    path = tmp_path / "x.pt"
    if content == "sound-but-garbage":  # right header and checksum around bytes torch cannot read
        data = b"garbage"
        path.write_bytes(tg.CHECKPOINT_MAGIC + tg.hashlib.sha256(data).hexdigest().encode() + b"\n" + data)
    elif content == "sound-but-foreign":  # a valid checkpoint file of something else
        tg.save_checkpoint(path, {"weights": torch.zeros(3)})
    else:
        path.write_bytes(content)
    result, code, err = run_main([*tiny(corpus, tmp_path / "logs"), "--resume", path], capsys)
    one_line_error(code, err, str(path), needle)


def test_resume_of_a_directory_or_missing_file(corpus, tmp_path, capsys):
    for target in (tmp_path, tmp_path / "missing.pt"):
        result, code, err = run_main([*tiny(corpus, tmp_path / "logs"), "--resume", target], capsys)
        one_line_error(code, err, str(target), "cannot read checkpoint")
