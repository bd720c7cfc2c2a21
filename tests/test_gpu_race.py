"""tools/gpu_race.py's dry run (slow tier): both steps run at tiny shapes on the CPU, the race line,
the losses, the per-class table and the files come out; the race's losses are those of the eager CPU
steps built apart.

Error model of the losses. Each side runs the same eager CPU code on the same inputs in the race
and here (#89's kernels are the torch stand-ins in both, as the dry run's default), on the same
number of threads (gpu_race.DRY_RUN_THREADS: the CPU's sums split by thread, and #89's first
optimizer step moves the loss less than a change of thread count does). The same values, so the
difference is the printed rounding (6 decimals).
"""

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import gpu_race  # noqa: E402
import reference_step  # noqa: E402

pytestmark = pytest.mark.slow
PRINTED = 1e-6  # the losses' printed rounding (6 decimals), with room for the float
NUMBER = r"(\d+\.\d+)"


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("race")
    result = subprocess.run(
        [sys.executable, "tools/gpu_race.py", "--dry-run", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout, out


def eager_losses(step):
    return [step.run(i).item() / step.tokens for i in range(2)]


@pytest.fixture
def dry_run_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(gpu_race.DRY_RUN_THREADS)
    yield
    torch.set_num_threads(threads)


def test_race_line_table_and_files(dry_run):
    stdout, out = dry_run
    lines = stdout.splitlines()
    assert re.fullmatch(
        rf"race: ours {NUMBER} ms/step, #89 \(attention: TiledWindowAttention for FlashAttention "
        rf"3\) {NUMBER} ms/step, ratio {NUMBER}; ledger predicted {NUMBER} / {NUMBER}",
        lines[-1],
    )
    table = lines.index(next(line for line in lines if line.startswith("class ")))
    for i, kind in enumerate(gpu_race.step_cost.CLASSES):
        values = lines[table + 1 + i][len(kind) :].split()
        assert lines[table + 1 + i].startswith(kind) and len(values) == 4, lines[table + 1 + i]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["classes.csv", "kernels.csv", "race.txt", "times.csv"]
    assert all(p.stat().st_size <= gpu_race.compile_caches.MAX_FILE_BYTES for p in out.iterdir())
    assert (out / "race.txt").read_text().splitlines()[-1] == lines[-1]
    kernels = (out / "kernels.csv").read_text().splitlines()
    sides = {row.split(",")[0] for row in kernels[1:]}
    assert sides == {"ours", "#89"}, "a side has no profiled op"


def test_losses_are_the_eager_cpu_steps(dry_run, dry_run_threads):
    stdout, _ = dry_run
    match = re.search(rf"ours {NUMBER} {NUMBER}, #89 {NUMBER} {NUMBER}", stdout)
    ours_race, theirs_race = [float(v) for v in match.groups()[:2]], [
        float(v) for v in match.groups()[2:]
    ]
    assert all(math.isfinite(v) and v > 0 for v in ours_race + theirs_race)
    cpu = torch.device("cpu")
    ours = eager_losses(gpu_race.build_our_step(gpu_race.DRY_RUN_SHAPE, cpu))
    with reference_step._cuda_properties(), gpu_race.world_of_one(cpu):
        theirs = eager_losses(
            gpu_race.build_reference_step(gpu_race.DRY_RUN_SHAPE, cpu, kernels="torch")
        )
    assert ours_race == pytest.approx(ours, abs=PRINTED, rel=0)
    assert theirs_race == pytest.approx(theirs, abs=PRINTED, rel=0)
    assert (
        abs(theirs[1] - theirs[0]) > 10 * PRINTED
    ), "the first optimizer step must move the loss for the second check to mean anything"
