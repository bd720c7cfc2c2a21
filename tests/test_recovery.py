"""Recovery without a person, on CPU with gloo: a stop signal ends a run at a step every rank agrees
on, with a checkpoint and exit code 75; --resume auto continues the newest checkpoint of a run id
that verifies, in the run's own log; torchrun --max-restarts recovers from a rank killed with SIGKILL.
Recovered runs end with the same val losses (to the printed digits) as uninterrupted ones: resume is
bit-exact on CPU at the same world size, so the bar is equality. Also the checks around it: ranks
started with different settings, a run id reused by another run, log and checkpoint folders that
cannot be written, a DATA_PATH that does not exist.

Faults are injected by tests/fault_runner.py at exact steps (signals sent by the process to itself),
so no test races a timer."""
import os
import platform
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import synthetic
import train_gpt as tg
from test_bad_input import one_line_error
from test_multinode import free_port, single_log, torchrun
from test_training import corpus, env, restore_threads, run_main, short, tiny, val_losses  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("restore_threads")  # in-process runs set torch's thread count

RUNNER = Path(__file__).resolve().parent / "fault_runner.py"
# A signal noted after step 3 (FAULT_AFTER_STEP=R:3:...) rides step 3's all-reduce, is read one step
# late (after step 4), and step 5 is completed so that DistAdam's two-step gradient is applied: the
# run stops with 6 steps done.
SIGNALLED_AFTER, STOPS_AT = 3, 6


def run_ranks(args, cwd, world_size=1, faults=(), timeout=300, rank_args=()):
    """`world_size` plain processes of fault_runner.py forming one gloo group (no launcher, so each exit
    code is seen), rank r with rank_args[r] appended if given; [(exit code, stdout, stderr)] by rank."""
    port, procs, outputs = free_port(), [], []
    for rank in range(world_size):
        group = dict(RANK=rank, WORLD_SIZE=world_size, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=world_size,
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=port) if world_size > 1 else {}
        out, err = (open(cwd / f"rank{rank}.{kind}", "w+") for kind in ("out", "err"))  # no pipe can fill up
        outputs.append((out, err))
        own = rank_args[rank] if rank_args else []
        procs.append(subprocess.Popen([sys.executable, str(RUNNER), *map(str, [*args, *own])], cwd=cwd, stdout=out,
                                      stderr=err, env={**env(), **{k: str(v) for k, v in group.items()}, **dict(faults)}))
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    results = []
    for code, (out, err) in zip(codes, outputs):
        out.seek(0)
        err.seek(0)
        results.append((code, out.read(), err.read()))
        out.close()
        err.close()
    return results


@pytest.fixture(scope="module")
def uninterrupted(corpus, tmp_path_factory):
    """Val losses of the uninterrupted 8-step run, by world size (each computed once)."""
    cache = {}

    def losses(world_size):
        if world_size not in cache:
            cwd = tmp_path_factory.mktemp(f"uninterrupted{world_size}")
            results = run_ranks(short(corpus, "--run_id", "whole"), cwd, world_size)
            assert all(code == 0 for code, _, _ in results), results[0][2][-3000:]
            cache[world_size] = val_losses(single_log(cwd))
        return cache[world_size]
    return losses


def sound_checkpoint_at(folder, step):
    path = folder / f"step_{step:06d}.pt"
    assert tg.load_checkpoint(path)["step"] == step  # verifies: checksum, format, keys
    assert not list(folder.glob(".*.tmp"))  # no write was left half done
    return path


# ---------------------------------------------------------------------------------------------- stop signals


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_sigterm_stops_every_rank_at_one_checkpoint_and_resume_auto_ends_the_same(corpus, tmp_path, uninterrupted,
                                                                                 world_size):
    """SIGTERM reaches the last rank only; every rank stops after the same step, rank 0 writes the
    checkpoint, all exit with 75. Alone, the process gets a second SIGTERM in the middle of each later
    checkpoint write, which must not cut it short. --resume auto then finishes with the uninterrupted
    run's val losses, in the same log."""
    args = short(corpus, "--run_id", "job", "--save_every", 2, "--resume", "auto")
    faults = {"FAULT_AFTER_STEP": f"{world_size - 1}:{SIGNALLED_AFTER}:TERM", "FAULT_IN_FSYNC": "TERM"}
    stopped = run_ranks(args, tmp_path, world_size, faults)
    assert [code for code, _, _ in stopped] == [tg.PREEMPTED_EXIT_CODE] * world_size, stopped[0][2][-3000:]
    log = single_log(tmp_path)
    checkpoint = sound_checkpoint_at(tmp_path / "logs" / "checkpoints" / "job", STOPS_AT)
    who = "SIGTERM" if world_size == 1 else "a signal to another process"  # rank 0 itself got none
    line = f"preempted at step {STOPS_AT} by {who}, checkpoint {checkpoint.relative_to(tmp_path)}"
    assert line in log and line in stopped[0][2], stopped[0][2]
    assert f"step:{STOPS_AT + 1}/" not in log  # no rank went on

    resumed = run_ranks(args, tmp_path, world_size)
    assert [code for code, _, _ in resumed] == [0] * world_size, resumed[0][2][-3000:]
    log = single_log(tmp_path)
    assert f"resumed from {checkpoint.relative_to(tmp_path)} at step {STOPS_AT}" in log
    assert val_losses(log) == uninterrupted(world_size)  # (the resumed run's lines come last for each step)


@pytest.mark.slow
def test_sighup_with_the_terminal_gone_checkpoints_and_resume_auto_ends_the_same(corpus, tmp_path, uninterrupted):
    """A closed terminal or ssh session: SIGHUP, and every write to the terminal fails (here pipes whose reader is
    gone). It used to end the run with no checkpoint and no log line; now it stops as at SIGTERM."""
    args = short(corpus, "--run_id", "hup", "--save_every", 2, "--resume", "auto")
    proc = subprocess.Popen([sys.executable, str(RUNNER), *map(str, args)], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**env(), "FAULT_AFTER_STEP": f"0:{SIGNALLED_AFTER}:HUP"})
    proc.stdout.close()
    proc.stderr.close()
    assert proc.wait(timeout=300) == tg.PREEMPTED_EXIT_CODE
    log = single_log(tmp_path)
    checkpoint = sound_checkpoint_at(tmp_path / "logs" / "checkpoints" / "hup", STOPS_AT)
    assert f"preempted at step {STOPS_AT} by SIGHUP, checkpoint {checkpoint.relative_to(tmp_path)}" in log
    [(code, _, err)] = run_ranks(args, tmp_path)
    assert code == 0, err[-3000:]
    assert val_losses(single_log(tmp_path)) == uninterrupted(1)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path of run.sh")
def test_sigterm_to_run_sh_under_restarts_checkpoints_and_ends_in_one_line(corpus, tmp_path):
    """run.sh with RESTARTS on a CPU runs torchrun; SIGTERM to it reaches the worker, which checkpoints and stops.
    torchrun then ended with its 30-line traceback and exit status 1 (and, after its default 30 s, killed a CPU
    worker still on its way to the checkpoint: run.sh gives it TORCH_ELASTIC_SHUTDOWN_TIMEOUT=300); now it ends
    with one line and 128 + 15. The signal is sent once the log shows step 3 (the run has 300 steps)."""
    logs = tmp_path / "logs"
    args = [*tiny(corpus, "--num_scheduled_iterations", 300, "--num_extension_iterations", 0, "--val_loss_every", 0),
            "--save_every", "2", "--cycle_data", "true", "--log_dir", str(logs), "--run_id", "sh"]
    with open(tmp_path / "out", "w+") as out, open(tmp_path / "err", "w+") as err:
        proc = subprocess.Popen(["bash", str(Path(tg.__file__).with_name("run.sh")), *args], stdout=out, stderr=err,
                                env={**env(), "RESTARTS": "1", "PYTHON": sys.executable})
        try:
            deadline = time.monotonic() + 240
            while not re.search(r"^step:3/300 ", (logs / "sh.txt").read_text() if (logs / "sh.txt").exists() else "",
                                re.M):
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "err").read_text()[-3000:]
                time.sleep(0.2)
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=240)
        finally:
            if proc.poll() is None:
                proc.kill()
        err.seek(0)
        stderr = err.read()
    assert code == 128 + signal.SIGTERM and "Traceback" not in stderr, stderr[-3000:]
    assert stderr.endswith("run.sh: torchrun stopped by SIGTERM and passed it on to its workers\n"), stderr[-3000:]
    stopped = re.search(r"^preempted at step (\d+) by SIGTERM, checkpoint (\S+);", (logs / "sh.txt").read_text(), re.M)
    assert stopped and tg.load_checkpoint(stopped[2])["step"] == int(stopped[1]), stderr[-3000:]


@pytest.mark.slow
def test_torchrun_restarts_a_rank_killed_with_sigkill_and_the_run_ends_the_same(corpus, tmp_path, uninterrupted):
    """torchrun --max-restarts 1 with a c10d rendezvous; rank 1 kills itself (SIGKILL) after step 5, past
    the checkpoint at step 4. The agent restarts both workers, they resume from step 4 and finish: the
    uninterrupted run's val losses, one log."""
    args = short(corpus, "--run_id", "elastic", "--save_every", 4, "--resume", "auto")
    [(code, out, err)] = torchrun(args, tmp_path, procs=2, restarts=1, script=RUNNER, timeout=400,
                                  extra_env={"FAULT_AFTER_STEP": "1:5:KILL", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    assert code == 0, err[-3000:]
    log = single_log(tmp_path)
    first_attempt, resumed = log.split("resumed from logs/checkpoints/elastic/step_000004.pt at step 4")
    assert "saved checkpoint logs/checkpoints/elastic/step_000004.pt" in first_attempt and "resumed" not in resumed
    assert val_losses(log) == uninterrupted(2)


# ---------------------------------------------------------------------------------------------- --resume auto


def interrupted_run(argv, capsys, monkeypatch, step):
    """Run in this process, stopped with Ctrl-C after `step` (exit 130): an unfinished log, its checkpoints."""
    real = tg.Trainer.log_step

    def log_step(self, s, val_loss=None):
        real(self, s, val_loss)
        if val_loss is None and s == step:
            raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(tg.Trainer, "log_step", log_step)
        _, code, err = run_main(argv, capsys)
    assert code == 130, err


@pytest.mark.slow
def test_resume_auto_skips_a_truncated_newest_checkpoint(corpus, tmp_path, capsys, monkeypatch):
    argv = short(corpus, "--log_dir", tmp_path, "--run_id", "cut", "--save_every", 2, "--resume", "auto")
    interrupted_run(argv, capsys, monkeypatch, 5)
    first = val_losses((tmp_path / "cut.txt").read_text())
    newest = tmp_path / "checkpoints" / "cut" / "step_000004.pt"
    newest.write_bytes(newest.read_bytes()[:100_000])
    resumed, code, err = run_main(argv, capsys)
    assert code == 0, err
    log = (tmp_path / "cut.txt").read_text()
    warnings = [line for line in log.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and str(newest) in warnings[0] and "corrupt or truncated" in warnings[0], warnings
    assert f"resumed from {newest.with_name('step_000002.pt')} at step 2" in log
    assert f"{resumed[1][1]:.4f}" == first[4]  # step 4 again, from step 2: the same value


@pytest.mark.slow
def test_resume_auto_without_a_checkpoint_starts_fresh_in_the_same_log(corpus, tmp_path, capsys, monkeypatch):
    """A new run id starts at step 0; so does a restart before the first checkpoint, continuing its log."""
    argv = short(corpus, "--log_dir", tmp_path, "--run_id", "new", "--save_every", 4, "--resume", "auto")
    interrupted_run(argv, capsys, monkeypatch, 2)
    result, code, err = run_main(argv, capsys)
    assert code == 0 and [s for s, _ in result] == [0, 2, 4, 6, 8], err
    log = (tmp_path / "new.txt").read_text()
    assert log.count(f"--resume auto: no checkpoint in {tmp_path / 'checkpoints' / 'new'} yet; starting at step 0") == 2
    assert len(re.findall(r"^script_sha256 ", log, re.M)) == 1 and "continued by --resume auto with args:" in log
    assert not re.search(r"^resumed from", log, re.M)


@pytest.mark.slow
def test_one_process_trains_a_run_id_and_a_second_is_refused_until_the_owner_dies(corpus, tmp_path, uninterrupted):
    """Two SLURM jobs that reuse a run id by mistake: the owner is paused (SIGSTOP) after step 3, past its
    checkpoint at step 2; a second --resume auto of the id is refused in one line naming the owner's host and
    pid, and writes nothing. Once the owner is killed with SIGKILL its lock is no obstacle: a new --resume
    auto takes the run over and ends with the uninterrupted run's val losses, in the one log."""
    args = short(corpus, "--run_id", "shared", "--save_every", 2, "--resume", "auto")
    owner = subprocess.Popen([sys.executable, str(RUNNER), *map(str, args)], cwd=tmp_path, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, env={**env(), "FAULT_AFTER_STEP": "0:3:STOP"})
    try:
        _, status = os.waitpid(owner.pid, os.WUNTRACED)  # returns once the owner has stopped itself
        assert os.WIFSTOPPED(status), status
        log = tmp_path / "logs" / "shared.txt"
        before = log.read_text()
        [(code, _, err)] = run_ranks(args, tmp_path)
        one_line_error(code, err, "the run 'shared' is being trained by", f"pid {owner.pid}",
                       f"host {platform.node()}", "logs/shared.lock")
        assert log.read_text() == before
    finally:
        owner.kill()
        owner.wait()
    [(code, _, err)] = run_ranks(args, tmp_path)
    assert code == 0, err[-3000:]
    text = single_log(tmp_path)
    assert "resumed from logs/checkpoints/shared/step_000002.pt at step 2" in text
    assert val_losses(text) == uninterrupted(1) and not (tmp_path / "logs" / "shared.lock").exists()


def test_resume_auto_needs_a_run_id(corpus, tmp_path, capsys):
    _, code, err = run_main(short(corpus, "--log_dir", tmp_path, "--resume", "auto"), capsys)
    one_line_error(code, err, "--resume auto needs --run_id")


@pytest.fixture
def logged_run(corpus, tmp_path):
    """The log of run 'mine' as its setup writes it (no step trained), and the run's arguments."""
    argv = short(corpus, "--log_dir", tmp_path, "--run_id", "mine", "--resume", "auto")
    tg.Trainer(tg.parse_args(argv)).loader.close()
    return tmp_path / "mine.txt", argv


@pytest.mark.parametrize("extra,edit,needles", [
    (["--muon_lr", "0.05"], "", ["mine.txt was written with --muon_lr 0.00575 but this run has --muon_lr 0.05", "is taken"]),
    (["--seed", "1"], "", ["--seed 0 but this run has --seed 1", "is taken"]),
    ([], "script", ["written by a different train_gpt.py", "is taken"]),
    ([], "finished", ["the run 'mine' has finished"]),
    (["--save_checkpoint", "true"], "finished with final.pt", ["the run 'mine' has finished"]),
    (["--resume", ""], "", ["mine.txt exists: the run id 'mine' is taken", "--resume auto"]),
])
def test_a_log_that_is_not_this_runs_is_not_continued(logged_run, capsys, extra, edit, needles):
    """A rerun with other training settings, another seed or another script is another run; a finished
    run is not continued; without --resume auto the id is taken, as before. The log stays as it was."""
    log, argv = logged_run
    if edit == "script":
        log.write_text("# edited\n" + log.read_text())
    elif edit.startswith("finished"):
        log.write_text(log.read_text() + "step:8/8 val_loss:9.2518 train_time:1ms step_avg:0.12ms\n")
    if edit == "finished with final.pt":
        (log.parent / "checkpoints" / "mine").mkdir(parents=True)
        tg.save_checkpoint(log.parent / "checkpoints" / "mine" / "final.pt", {"step": 8})
    before = log.read_text()
    _, code, err = run_main([*argv, *extra], capsys)
    one_line_error(code, err, *needles)
    assert log.read_text() == before


def test_a_finished_run_without_the_final_checkpoint_it_asked_for_is_continued(logged_run, capsys):
    """Ctrl-C during the write of final.pt left a finished log and no final.pt, and --resume auto refused the
    run as finished: final.pt could never be made under its id. With --save_checkpoint true the run continues
    (from its last checkpoint; here none: from step 0) and writes it; without, it stays finished."""
    log, argv = logged_run
    log.write_text(log.read_text() + "step:8/8 val_loss:9.2518 train_time:1ms step_avg:0.12ms\n")
    _, code, err = run_main(argv, capsys)
    one_line_error(code, err, "the run 'mine' has finished")
    with pytest.MonkeyPatch.context() as patch:  # only the start: no need to train
        patch.setattr(tg.Trainer, "run", lambda self: self.loader.close())
        _, code, err = run_main([*argv, "--save_checkpoint", "true"], capsys)
    assert code == 0, err
    assert "continued by --resume auto with args:" in log.read_text() and "starting at step 0" in log.read_text()


@pytest.mark.slow
def test_ctrl_c_during_the_final_checkpoint_write_is_made_good_by_resume_auto(corpus, tmp_path, capsys, monkeypatch):
    """Ctrl-C while final.pt is written (exit 130, as its message says: continue with --resume auto): the resumed
    run continues from the last periodic checkpoint (step 4), ends with the same val losses and writes final.pt;
    a further --resume auto is refused as finished."""
    argv = short(corpus, "--log_dir", tmp_path, "--run_id", "fin", "--save_every", 4, "--save_checkpoint", "true",
                 "--resume", "auto")
    real = tg.save_checkpoint

    def interrupted_final(path, payload):
        if Path(path).name == "final.pt":
            raise KeyboardInterrupt
        real(path, payload)

    with monkeypatch.context() as patch:
        patch.setattr(tg, "save_checkpoint", interrupted_final)
        _, code, err = run_main(argv, capsys)
    final = tmp_path / "checkpoints" / "fin" / "final.pt"
    assert code == 130 and "--resume auto" in err and not final.exists(), err
    first = val_losses((tmp_path / "fin.txt").read_text())
    resumed, code, err = run_main(argv, capsys)
    assert code == 0, err
    assert f"resumed from {final.with_name('step_000004.pt')} at step 4" in (tmp_path / "fin.txt").read_text()
    assert tg.load_checkpoint(final)["step"] == 8
    assert {s: f"{v:.4f}" for s, v in resumed} == {s: v for s, v in first.items() if s >= 4}, (resumed, first)
    _, code, err = run_main(argv, capsys)
    one_line_error(code, err, "the run 'fin' has finished")


@pytest.mark.slow
def test_resume_refuses_a_replaced_training_shard_unless_forced(corpus, tmp_path, capsys, monkeypatch):
    """Resume matched the shards by name only: a shard replaced under the same name trained on, silently."""
    data = tmp_path / "data"
    data.mkdir()
    shard = data / "synthetic_train_000001.bin"
    tokens = tg.read_shard(next(corpus.glob("synthetic_train_*.bin")))
    tg.write_shard(shard, tokens)
    argv = [*short(corpus, "--log_dir", tmp_path, "--run_id", "swap", "--save_every", 2, "--resume", "auto"),
            "--train_files", str(data / "synthetic_train_*.bin")]
    interrupted_run(argv, capsys, monkeypatch, 3)
    tg.write_shard(shard, tokens[::-1])  # the same size, other contents
    _, code, err = run_main(argv, capsys)
    one_line_error(code, err, f"{shard} is not the training shard the checkpoint's run read under that name",
                   "other contents", "put that shard back, or pass --force")
    result, code, err = run_main([*argv, "--force"], capsys)
    assert code == 0 and result[-1][0] == 8, err
    assert f"warning: {shard} is not the training shard" in (tmp_path / "swap.txt").read_text()


@pytest.mark.slow
def test_resume_refuses_a_changed_validation_shard_unless_forced(corpus, tmp_path, capsys,
                                                                 monkeypatch):
    """Validation shards were not fingerprinted: a few hundred tokens changed in the run's
    validation shard, and the same log read 1.3232 before the resume and 1.3515 after it, against
    1.3245 uninterrupted, silently."""
    data = tmp_path / "data"
    data.mkdir()
    shard = data / "synthetic_val_000000.bin"
    tokens = tg.read_shard(next(corpus.glob("synthetic_val_*.bin"))).copy()
    tg.write_shard(shard, tokens)
    argv = [*short(corpus, "--log_dir", tmp_path, "--run_id", "val", "--save_every", 2, "--resume",
                   "auto"), "--val_files", str(data / "synthetic_val_*.bin")]
    interrupted_run(argv, capsys, monkeypatch, 3)
    tokens[100:400] = tokens[100:400][::-1]
    tg.write_shard(shard, tokens)
    _, code, err = run_main(argv, capsys)
    one_line_error(code, err, f"{shard} is not the validation shard the checkpoint's run read",
                   "other contents", "put them back, or pass --force to validate on these")
    result, code, err = run_main([*argv, "--force"], capsys)
    assert code == 0 and result[-1][0] == 8, err
    assert f"warning: {shard} is not the validation shard" in (tmp_path / "val.txt").read_text()


def test_shards_that_differ_from_the_checkpoints_are_named(tmp_path):
    """A renamed, added or removed training shard was refused with no shard named (and a clause
    about the script); validation shards are compared the same way, refused or (--force) warned."""
    shards = [tmp_path / f"{kind}_{i:06d}.bin" for kind in ("train", "val") for i in range(3)]
    for i, path in enumerate(shards):
        tg.write_shard(path, [tg.BOS_ID, i + 1, 2, 3])
    train, val = [str(p) for p in shards[:3]], [str(p) for p in shards[3:]]
    fingerprints = [tg.shard_fingerprint(f) for f in train[1:]] + [(1, "x")]
    loader = type("Loader", (), dict(files=train[1:] + [str(tmp_path / "train_000009.bin")],
                                     fingerprints=fingerprints))
    refused = (r"^the training shards differ from the checkpoint ck.pt's: train_000000.bin is "
               r"missing, train_000009.bin is new; pass the --train_files it was trained on "
               r"\(--force cannot continue")
    with pytest.raises(tg.DataError, match=refused):
        tg.check_same_shards("ck.pt", tg.shard_record(train), loader, True, print)
    warnings = []
    record = tg.shard_record(val)
    tg.check_same_validation("ck.pt", record, val, False, warnings.append)  # the same: nothing said
    tg.check_same_validation("ck.pt", None, val[:1], False, warnings.append)  # (an older script's)
    assert warnings == []
    refused = (r"^the validation shards differ from the checkpoint ck.pt's: val_000002.bin is "
               r"missing; .* put them back, or pass --force")
    with pytest.raises(tg.DataError, match=refused):
        tg.check_same_validation("ck.pt", record, val[:2], False, warnings.append)
    tg.check_same_validation("ck.pt", record, val[:2], True, warnings.append)
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("warning: the validation shards differ"), warnings


def test_restarts_without_their_settings_are_warned_on_the_terminal_and_in_the_log(corpus, tmp_path, capsys,
                                                                                     monkeypatch):
    """Under torchrun --max-restarts with the agent's store shared (pytorch#135712), without --resume auto
    and without --save_every: each warning is a line on stdout (rank 0's terminal) and in the log, written
    by the first attempt, before any restart can fail in its rendezvous."""
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    capsys.readouterr()
    tg.Trainer(tg.parse_args(short(corpus, "--log_dir", tmp_path, "--run_id", "elastic"))).loader.close()
    out, log = capsys.readouterr().out, (tmp_path / "elastic.txt").read_text()
    for needle in ("without --resume auto", "--save_every is 0", "pytorch#135712"):
        [line] = [line for line in out.splitlines() if needle in line]
        assert line.startswith("warning: torchrun ") and line in log.splitlines(), line
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert tg.restart_warnings(tg.parse_args(short(corpus, "--resume", "auto", "--run_id", "x", "--save_every", 2))) == []


@pytest.mark.parametrize("logged", ["preempted", "saved", "none"])
def test_resume_auto_refuses_a_fresh_start_when_the_log_records_a_missing_checkpoint(logged_run, capsys, logged):
    """The checkpoint folder holds only the temp file of a killed write while the log says the run was
    preempted with (or saved) step_000006.pt: starting at step 0 would throw the logged work away. The
    stale temp file is removed either way; without a logged checkpoint the run starts at step 0."""
    log, argv = logged_run
    folder = log.parent / "checkpoints" / "mine"
    folder.mkdir(parents=True)
    gone = 2 ** 22 + 1  # above Linux's largest pid (PID_MAX_LIMIT): a process that is not there
    stale = folder / f".step_000008.pt~{platform.node()}~{gone}~0badc0de.tmp"
    stale.write_bytes(b"half a checkpoint")
    checkpoint = folder / "step_000006.pt"
    line = {"preempted": f"preempted at step 6 by SIGTERM, checkpoint {checkpoint}; continue with --resume auto --run_id "
                         f"mine", "saved": f"saved checkpoint {checkpoint}", "none": "step:6/8 train_time:9ms"}[logged]
    log.write_text(log.read_text() + line + "\n")
    before = log.read_text()
    if logged == "none":
        with pytest.MonkeyPatch.context() as patch:  # only the start: no need to train
            patch.setattr(tg.Trainer, "run", lambda self: self.loader.close())
            _, code, err = run_main(argv, capsys)
        assert code == 0 and "starting at step 0" in log.read_text(), err
    else:
        _, code, err = run_main(argv, capsys)
        one_line_error(code, err, f"{log} records the checkpoint {checkpoint}", f"{folder} holds no checkpoint",
                       "removed 1 temp file")
        assert log.read_text() == before
    assert not stale.exists()


def test_a_new_run_does_not_overwrite_the_checkpoints_of_its_id(corpus, tmp_path, capsys):
    folder = tmp_path / "checkpoints" / "old"
    folder.mkdir(parents=True)
    (folder / "step_000002.pt").write_bytes(b"precious")
    _, code, err = run_main(short(corpus, "--log_dir", tmp_path, "--run_id", "old"), capsys)
    one_line_error(code, err, str(folder), "--resume auto")
    assert (folder / "step_000002.pt").read_bytes() == b"precious" and not (tmp_path / "old.txt").exists()


def test_a_stop_signal_before_training_stops_at_once_and_one_during_training_is_noted(capfd, monkeypatch):
    """Before the first step (setup, the compile warm-up) there is nothing to save: stop at once. In the
    training loop the first signal is noted for the loop to act on, and said at once on stderr (a step in many
    --micro_batch_tokens pieces can take a while; issue 42's BAD 4 looked ignored); later ones change nothing."""
    monkeypatch.delenv("RANK", raising=False)
    before = signal.getsignal(signal.SIGTERM)
    with tg.StopSignals() as stop:
        assert signal.getsignal(signal.SIGUSR1) is not signal.SIG_DFL  # (else the signal would end pytest)
        with pytest.raises(tg.Preempted, match="stopped by SIGTERM before the first training step"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # (the handler runs at once; sleep only if it had not)
        with pytest.raises(tg.Preempted, match="stopped by SIGHUP before the first training step"):
            os.kill(os.getpid(), signal.SIGHUP)  # (a closed terminal or ssh session: treated as SIGTERM)
            time.sleep(5)
        stop.note_from_now_on()
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGHUP)
        assert stop.received == "SIGUSR1"
    assert signal.getsignal(signal.SIGTERM) is before
    assert capfd.readouterr().err == "SIGUSR1 received: the run stops with a checkpoint within 1-3 steps\n"


def test_a_console_that_is_gone_loses_only_its_copy_of_the_log(tmp_path, monkeypatch):
    """A closed terminal (SIGHUP) or pipe: the first failed write points the stream's descriptor at the null
    device; the log file gets every line and nothing raises (a print to it used to end the run)."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # writes to the pipe now fail (EPIPE)
    gone = os.fdopen(write_end, "w")
    monkeypatch.setattr(sys, "stdout", gone)
    log = tg.RunLog(tmp_path / "run.txt", True, tg.Hyperparameters())
    log.open()
    log("step:1/2 train_time:1ms step_avg:1.00ms")
    log("step:2/2 train_time:2ms step_avg:1.00ms")
    assert (tmp_path / "run.txt").read_text().endswith("step:1/2 train_time:1ms step_avg:1.00ms\n"
                                                         "step:2/2 train_time:2ms step_avg:1.00ms\n")
    assert os.path.samestat(os.fstat(gone.fileno()), os.stat(os.devnull))
    gone.close()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["TERM", "USR1", "HUP", "INT"])
def test_a_stop_signal_during_the_imports_exits_75_with_one_line(tmp_path, name):
    """The signal arrives exactly when the script imports numpy, its first import after the standard
    library (torch's import takes seconds more): it used to end the process with 143 and no word (SIGHUP: 129;
    Ctrl-C: a KeyboardInterrupt traceback). Ctrl-C exits 130, as it does later in the run."""
    starter = (f"import builtins, os, runpy, signal, sys\n"
               f"real = builtins.__import__\n"
               f"def once(name, *args, **kwargs):\n"
               f"    if name == 'numpy':\n"
               f"        builtins.__import__ = real\n"
               f"        os.kill(os.getpid(), signal.SIG{name})\n"
               f"    return real(name, *args, **kwargs)\n"
               f"builtins.__import__ = once\n"
               f"sys.argv = ['train_gpt.py', '--preset', 'cpu']\n"
               f"runpy.run_path({str(Path(tg.__file__))!r}, run_name='__main__')\n")
    done = subprocess.run([sys.executable, "-c", starter], cwd=tmp_path, env=env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == (130 if name == "INT" else tg.PREEMPTED_EXIT_CODE), (done.returncode, done.stderr[-2000:])
    assert done.stderr == f"train_gpt.py: stopped by SIG{name} before the first training step; nothing new to save\n"
    assert not (tmp_path / "logs").exists()


# ---------------------------------------------------------------------------------------------- ranks agree


@pytest.mark.slow
def test_ranks_started_with_other_settings_are_refused_before_any_work(corpus, tmp_path):
    """The probe's BAD case: rank 1 alone got --adam_lr 0.05 (each node types its own command line)."""
    results = run_ranks(short(corpus, "--run_id", "mixed"), tmp_path, 2, rank_args=[[], ["--adam_lr", "0.05"]])
    for code, _, err in results:  # the same line from both
        one_line_error(code, err, "rank 1 has --adam_lr 0.05 but rank 0 has --adam_lr 0.008")
    assert not (tmp_path / "logs").exists()  # refused before the log was made


def settings(**changes):
    base = tg.rank_settings(tg.parse_args(["--preset", "cpu"]), torch.device("cpu"), ["a/t1.bin", "a/t2.bin"],
                            ["a/v1.bin"], 4)
    return {**base, **changes}


@pytest.mark.parametrize("theirs,needle", [
    (settings(), None),
    (settings(**{"--batch_sizes": "2048 3072 8192"}), "rank 2 has --batch_sizes 2048 3072 8192 but rank 0 has "
                                                      "--batch_sizes 2048 3072 4096"),
    (settings(**{"training shards": ["t1.bin"]}), "rank 2's training shards differ from rank 0's at file 2: none vs t2.bin"),
    (settings(**{"validation shards": ["v9.bin"]}), "rank 2's validation shards differ from rank 0's at file 1: v9.bin vs v1.bin"),
    (settings(**{"resume step": 0}), "rank 2 has resume step 0 but rank 0 has resume step 4"),
])
def test_first_rank_difference_names_the_first_differing_setting(theirs, needle):
    difference = tg.first_rank_difference([settings(), settings(), theirs])
    assert difference == needle if needle is None else needle in difference, difference


def test_only_machine_local_flags_may_differ_between_ranks():
    local = tg.parse_args(["--preset", "cpu", "--cpu_threads", "3", "--log_dir", "x", "--profile", "1:2",
                           "--train_files", "elsewhere/t_*.bin", "--val_files", "elsewhere/v_*.bin", "--device", "auto"])
    same = tg.rank_settings(local, torch.device("cpu"), ["b/t1.bin", "b/t2.bin"], ["b/v1.bin"], 4)
    assert tg.first_rank_difference([settings(), same]) is None


# ---------------------------------------------------------------------------------------------- folders and disks


@pytest.mark.parametrize("case", ["log folder: a symlink loop", "checkpoint folder: a link to /dev/full"])
def test_log_and_checkpoint_folders_are_checked_before_any_work(corpus, tmp_path, capsys, case):
    """Both used to end in a bare 'File exists', the checkpoint folder's only after training."""
    log_dir = tmp_path / "logs"
    if case.startswith("log folder"):
        log_dir.symlink_to(log_dir)
        needle = f"{log_dir} is a symbolic link that resolves nowhere"
    else:
        log_dir.mkdir()
        (log_dir / "checkpoints").symlink_to("/dev/full")
        needle = f"{log_dir / 'checkpoints'} is not a folder"
    _, code, err = run_main(short(corpus, "--log_dir", log_dir, "--run_id", "x"), capsys)
    one_line_error(code, err, f"--log_dir {log_dir}", needle)
    assert not list(tmp_path.rglob("*.txt"))


def test_a_data_path_that_does_not_exist_is_refused_and_not_created(tmp_path, monkeypatch):
    """It used to get data/synthetic/ made under it and 16 MB written there."""
    monkeypatch.setattr(synthetic, "synthetic_corpus",
                        lambda folder, **_: pytest.fail(f"would write a corpus into {folder}"))
    monkeypatch.setenv("DATA_PATH", str(tmp_path / "nonexistent" / "xyz"))
    with pytest.raises(tg.DataError, match=f"DATA_PATH {tmp_path / 'nonexistent' / 'xyz'} is not a folder"):
        tg.resolve_data(tg.parse_args(["--preset", "cpu"]), 0)
    assert not (tmp_path / "nonexistent").exists()


def test_the_synthetic_corpus_lives_in_the_working_folder_not_under_data_path(tmp_path, monkeypatch):
    made = []
    monkeypatch.setattr(synthetic, "synthetic_corpus", lambda folder, **_: made.append(folder))
    monkeypatch.setenv("DATA_PATH", str(tmp_path / "shared"))
    (tmp_path / "shared").mkdir()
    monkeypatch.chdir(tmp_path)
    train, val, _ = tg.resolve_data(tg.parse_args(["--preset", "cpu"]), 0)
    assert made == [Path("data") / "synthetic"] and train == str(Path("data") / "synthetic" / "synthetic_train_*.bin")
    assert not list((tmp_path / "shared").iterdir())


def test_a_log_write_to_a_full_disk_names_the_log(tmp_path):
    log = tg.RunLog(tmp_path / "run.txt", True, tg.Hyperparameters())
    log.open()
    (tmp_path / "run.txt").unlink()
    (tmp_path / "run.txt").symlink_to("/dev/full")
    with pytest.raises(OSError, match="No space left on device") as info:
        log("step:1/2 train_time:1ms step_avg:1.00ms")
    assert info.value.filename == str(tmp_path / "run.txt")


def test_a_log_whose_header_cannot_be_written_is_removed(tmp_path, monkeypatch):
    def full_disk():
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tg, "environment_report", full_disk)
    with pytest.raises(OSError, match="No space left on device") as info:
        tg.RunLog(tmp_path / "run.txt", True, tg.Hyperparameters()).open()
    assert info.value.filename == str(tmp_path / "run.txt") and not (tmp_path / "run.txt").exists()
