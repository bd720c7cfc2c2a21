"""No host-device synchronization inside a training step (besides the designed, one-step-late
non-finite check, which is outside train_step). Counted on CPU with tools/smoke_checks.py's SyncCounter,
which records the operations that would make the host wait on CUDA; tools/gpu_smoke.sh measures the
same on a GPU with CUDA's sync debug mode.

Documented count for one train_step: 0 on the GPU path. On the CPU path, 2 per micro-step: the tiled
SDPA attention (a CPU fallback) reads its short and long window on the host to size its tiles; the
GPU path's forward is traced with fullgraph=True (tests/test_compile_trace.py), where any such read
would be a graph break."""
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

import smoke_checks
import synthetic
import train_gpt as tg
from conftest import ROOT
from smoke_checks import SyncCounter


def test_counter_sees_each_kind_of_sync():
    """Positive control: every kind the counter claims to catch is caught, plain math is not."""
    x = torch.arange(6.0)
    with SyncCounter() as counter:
        x * 2 + 1  # noqa: B018 - plain device work: nothing
    assert counter.events == []
    with SyncCounter() as counter:
        x.sum().item()
        float(x[0])
        torch.tensor(0.5)
        x[[0, 2]]
        x[x > 2]
        x.nonzero()
    kinds = counter.summary()
    assert counter.events.count("host read (.item/.tolist/float)") == 2, kinds
    assert "tensor from Python data" in kinds and "boolean-mask indexing" in kinds, kinds
    assert "data-dependent size (aten.nonzero.default)" in kinds, kinds


def test_on_cuda_only_the_sync_debug_warnings_count():
    """CUDA's sync debug mode reports through warnings; any other warning in the step is no sync."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn("called a synchronizing CUDA operation (Triggered internally at CUDAFunctions.cpp)")
        warnings.warn("flex_attention called without torch.compile()")
        warnings.warn("called a synchronizing CUDA operation")
        warnings.warn("torch.cuda.amp.autocast is deprecated", FutureWarning)
    assert [str(w.message)[:40] for w in smoke_checks.sync_debug_warnings(caught)] == \
        ["called a synchronizing CUDA operation (T", "called a synchronizing CUDA operation"]


@pytest.fixture
def trainer(tmp_path):
    folder = tmp_path / "corpus"
    synthetic.markov_corpus(folder, train_tokens=60_000, val_tokens=8_192)
    threads = torch.get_num_threads()
    argv = ["--preset", "cpu", "--device", "cpu", "--batch_sizes", "512", "512", "512", "--grad_accum_base", "2",
            "--val_tokens", "1024", "--val_batch_size", "512", "--max_seq_len", "256", "--window_blocks", "2", "2", "2",
            "--extension_window_blocks", "2", "--final_val_window_blocks", "3", "--num_layers", "9",
            "--model_dim", "64", "--num_heads", "2", "--head_dim", "32", "--window_block_tokens", "64",
            "--cpu_threads", "1", "--warmup_steps", "0", "--num_scheduled_iterations", "6",
            "--num_extension_iterations", "0", "--log_dir", str(tmp_path / "logs"), "--ngram_prior", "0",
            "--train_files", str(folder / "synthetic_train_*.bin"), "--val_files", str(folder / "synthetic_val_*.bin")]
    trainer = tg.Trainer(tg.parse_args(argv), argv)
    yield trainer
    trainer.loader.close()
    torch.set_num_threads(threads)


def cpu_host_reads_per_micro_step(trainer):
    """The CPU path's host reads: the tiled attention reads the window of each kind of mask."""
    return len(trainer.model.attention_kinds())


@pytest.mark.parametrize("step", [0, 1], ids=["normuon-only step", "adam step"])
def test_train_step_has_no_host_syncs_besides_the_cpu_attention(trainer, step):
    trainer.train_step(trainer.begin_step(0))  # the first step allocates optimizer state; count a steady-state step
    with SyncCounter() as counter:
        trainer.train_step(trainer.begin_step(step + 2))
    assert trainer.accum == 2  # two micro-steps
    host_reads = counter.events.count("host read (.item/.tolist/float)")
    assert host_reads == cpu_host_reads_per_micro_step(trainer) * trainer.accum, counter.summary()
    assert len(counter.syncs()) == host_reads, counter.summary()  # and nothing else
    # inputs, targets, cu_seqlens and bigram ids per micro-step
    assert len(counter.events) - host_reads == 4 * trainer.accum, counter.summary()


def test_the_count_would_catch_a_sync_in_the_optimizer(trainer, monkeypatch):
    """The same step with one .item() slipped into DistAdam is counted (the test has power)."""
    real = tg.DistAdam._adam_update

    def with_item(self, group, grad, weight, p):
        grad.abs().max().item()
        return real(self, group, grad, weight, p)

    monkeypatch.setattr(tg.DistAdam, "_adam_update", with_item)
    trainer.train_step(trainer.begin_step(0))
    with SyncCounter() as counter:
        trainer.train_step(trainer.begin_step(1))  # an Adam step: one read per updated DistAdam parameter
    updated = len(trainer.adam.param_groups) - 1  # the embedding is still tied to the head
    expected = cpu_host_reads_per_micro_step(trainer) * trainer.accum + updated
    assert counter.events.count("host read (.item/.tolist/float)") == expected, counter.summary()
    assert len(counter.syncs()) == expected


def run_smoke(*flags):
    return subprocess.run(["bash", str(ROOT / "tools" / "gpu_smoke.sh"), "--dry-run", *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHON": sys.executable})


CHECK_LINE = re.compile(r"(PASS|FAIL|SKIP|INFO) (\w+) \[[\d.]+ s, budget \d+ s(, over)?\]: ")
DEADLINE_LINE = re.compile(r"SKIP (\w+) \(deadline\): (\d+) s elapsed \+ budget (\d+) s > (\d+) s")
PLAN_LINE = re.compile(r"plan: (\d+) checks, (\d+) compiles \((.*)\) and (\d+) sizes autotuned on CUDA, budget (\d+) s "
                       r"\(CPU dry run; on CUDA: (\d+) s\)")
COUNTS_LINE = re.compile(r"smoke: (\d+) passed, (\d+) failed, (\d+) skipped")


def statuses(lines):
    """{check: status} from the check lines and the deadline's SKIP lines, in order."""
    found = {}
    for line in lines:
        m = CHECK_LINE.match(line)
        if m:
            found[m[2]] = m[1]
        elif DEADLINE_LINE.match(line):
            found[DEADLINE_LINE.match(line)[1]] = "deadline"
    return found


def assert_counts(lines, found):
    counts = COUNTS_LINE.fullmatch(lines[-1])
    assert counts, lines[-1]
    values = list(found.values())
    assert [int(n) for n in counts.groups()] == [values.count("PASS") + values.count("INFO"), values.count("FAIL"),
                                                  values.count("SKIP") + values.count("deadline")], (lines[-1], found)


@pytest.mark.slow
def test_gpu_smoke_script_dry_run():
    """tools/gpu_smoke.sh --dry-run, with this interpreter: the plan first (every compile CUDA would make,
    and the budget of its table: at most 420 s, leaving a rerun in a 600 s command), then every check at toy
    sizes on CPU, each with its seconds and budget; none fails, and the only SKIPs are the
    CUDA-only checks and those this CPU cannot run."""
    result = run_smoke("--deadline", "100000")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    lines = result.stdout.splitlines()
    plan = PLAN_LINE.fullmatch(lines[0])
    assert plan, lines[0]
    names = smoke_checks.check_names()
    found = statuses(lines)
    assert list(found) == names and int(plan[1]) == len(names), (list(found), lines)
    cuda_plan = smoke_checks.SmokePlan(torch.device("cuda"), None)
    kinds = [kind for kind, _ in cuda_plan.graphs()]
    assert int(plan[2]) == len(kinds) - kinds.count("autotune") and int(plan[4]) == kinds.count("autotune")
    for kind in ("training", "DistAdam", "NorMuon", "Triton kernels", "FP8 head"):
        assert re.search(rf"\b\d+ {kind}\b", plan[3]), plan[3]
    assert int(plan[6]) == round(cuda_plan.budget_s())
    # the checks that pass or fail fit a 7-minute call; the speed measurements (INFO, the plan's last)
    # are what a lend's --deadline may cut
    assert sum(c.own_budget_s(torch.device("cuda")) for c in cuda_plan._planned() if not c.info) <= 420
    assert f"`{cuda_plan.plan_line()}`" in (ROOT / "docs" / "gpu-smoke.md").read_text(encoding="utf-8")  # its example
    cpu = torch.device("cpu")
    assert ({n for n, status in found.items() if status == "SKIP"}
            == {c.name for c in smoke_checks.SmokePlan(cpu, None).checks if c.skip_reason(cpu)})
    assert "FAIL" not in found.values() and found["train_steps_move_every_parameter"] == "PASS"
    assert lines[-2].startswith("PASS overall") and "failed: none" in lines[-2]
    assert_counts(lines, found)


@pytest.mark.slow
def test_gpu_smoke_deadline_skips_what_would_end_past_it():
    """--deadline 8: a check whose budget (with the record run's phases it needs that have not run) would
    end past 8 s from the process start is skipped with a SKIP ... (deadline) line, the rest run; exit 0,
    and the last lines say how to rerun the skipped ones and count every check. (At 20 s the outcome
    depended on the machine: on idle cores the phases ran in time and the timed loop's checks fit.)"""
    deadline = 8
    result = run_smoke("--deadline", str(deadline))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    lines = result.stdout.splitlines()
    found = statuses(lines)
    assert list(found) == smoke_checks.check_names(), lines
    plan = smoke_checks.SmokePlan(torch.device("cpu"), None)
    late = [n for n, status in found.items() if status == "deadline"]
    for line in lines:
        m = DEADLINE_LINE.match(line)
        if m:
            # (each figure is printed rounded to a whole second: the sum may be 1 s off)
            assert int(m[2]) + int(m[3]) + 1 > int(m[4]) == deadline, line
    # the record run's first phase alone has a CPU budget of 8 s, so it is late from any start, and so
    # is every check that needs it (the timed loop's: 8 + 8 + 6 s)
    assert {"compiles_in_timed_loop", "host_syncs_per_step", "compiled_vs_eager"} <= set(late), found
    assert plan.budget_s(plan.check("train_steps_move_every_parameter")) >= deadline
    assert not [n for n, status in found.items()
                if status == "SKIP" and not plan.check(n).skip_reason(torch.device("cpu"))]
    assert f"--only {','.join(late)}" in lines[-3]
    assert_counts(lines, found)


@pytest.mark.slow
def test_gpu_smoke_only_runs_the_named_checks():
    """--only reruns chosen checks (in the plan's order), and names an unknown one in a one-line error."""
    result = run_smoke("--only", "polar_express_triton,fp8_head")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("plan: 2 checks, ")
    found = statuses(lines)
    assert found == {"fp8_head": "PASS", "polar_express_triton": "PASS"}, lines
    assert lines[-1] == "smoke: 2 passed, 0 failed, 0 skipped"
    bad = run_smoke("--only", "fp8_head,no_such_check")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().splitlines()[-1].startswith("gpu_smoke.py: error: --only: unknown check(s) no_such_check;")
