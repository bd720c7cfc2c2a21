"""One-GPU smoke test of the record path, in one go: the plan, then one line per check as it ends
(PASS / FAIL / SKIP, INFO for a measurement) with its seconds and its time budget.

    python3 tools/gpu_smoke.py            # on a CUDA machine (budget: see the plan line, about 5 minutes cold)
    python3 tools/gpu_smoke.py --dry-run  # the same checks at toy sizes on the CPU (the test suite runs this)
    python3 tools/gpu_smoke.py --pytest   # also tests/test_gpu.py and tests/test_kernels.py (heavy: minutes more)

The checks are tools/smoke_checks.py's. First the record model on a synthetic corpus, at one batch size
throughout (one training graph): three steps from initialization (every parameter moves), the
Trainer's warm-up, a timed loop (graphs compiled in it must be 0; tokens/s per GPU against the record's
pace; peak memory must fit an 80 GB H100), host syncs in a training step (must be 0 on CUDA) and the
compiled against an eager loss. Then the FP8 head against bf16, Polar Express through Triton against
torch, every Triton tile configuration, and the attention against a naive one. Exit status 1 if any
check fails; a measurement (INFO) never fails.
"""
import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

import torch  # noqa: E402

if "--dry-run" in sys.argv[1:] or not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when train_gpt's kernels are decorated, at import

import smoke_checks as sc  # noqa: E402


def check_line(status, name, seconds, budget, detail):
    over = ", over" if seconds > budget else ""
    return f"{status} {name} [{seconds:.1f} s, budget {budget:.0f} s{over}]: {detail}"


def main(argv=None):
    parser = argparse.ArgumentParser(prog="gpu_smoke.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU (what the test suite runs)")
    parser.add_argument("--pytest", action="store_true", help="also run tests/test_gpu.py and tests/test_kernels.py")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_smoke.py: error: no CUDA device; pass --dry-run to check the script on the CPU", file=sys.stderr)
        return 2
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", 0)
    os.chdir(ROOT)
    folder = Path(tempfile.mkdtemp(prefix="speedrun_smoke_"))
    plan = sc.SmokePlan(device, folder, with_pytest=args.pytest)
    print(plan.plan_line(), flush=True)
    failures, start = [], time.perf_counter()
    try:
        for check in plan.checks:
            status, detail, seconds = plan.run(check)
            print(check_line(status, check.name, seconds, check.budget_s(device), detail), flush=True)
            if status == "FAIL":
                failures.append(check.name)
    finally:
        plan.close()
        shutil.rmtree(folder, ignore_errors=True)
    if device.type == "cuda":
        print(f"graphs compiled: {sc.compiled_graphs()} (dynamo's count; planned {len(plan.graphs())})", flush=True)
    total = time.perf_counter() - start
    print(f"{'FAIL' if failures else 'PASS'} overall: {len(failures)} failed check(s) {failures or ''}in {total:.0f} s "
          f"(budget {plan.budget_s():.0f} s)", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
