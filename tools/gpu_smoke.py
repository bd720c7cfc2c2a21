"""One-GPU smoke test of the record path, in one go: the plan, then one line per check as it ends
(PASS / FAIL / SKIP, INFO for a measurement) with its seconds and its time budget, and a last line counting them.

    python3 tools/gpu_smoke.py                    # on a CUDA machine (budget: see the plan line)
    python3 tools/gpu_smoke.py --dry-run          # the same checks at toy sizes on the CPU (the test suite runs this)
    python3 tools/gpu_smoke.py --only memory,fp8_head   # those checks alone (and the record run's phases they need)
    python3 tools/gpu_smoke.py --pytest           # also tests/test_gpu.py and tests/test_kernels.py (heavy: minutes more)

The checks are tools/smoke_checks.py's, in order of value. First the record model on a synthetic corpus, at one
batch size throughout (one training graph): three steps from initialization (every parameter moves; its first
step compiles the training graph, the optimizers' graphs and the Triton kernels), the Trainer's warm-up, a timed
loop (graphs compiled in it must be 0), host syncs in a training step (must be 0 on CUDA), peak memory (must fit
an 80 GB H100, and the memory plan), tokens/s per GPU against the record's pace, and the compiled against an eager
loss. Then the FP8 head against bf16, Polar Express through Triton against torch, the attention against a naive
one, every Triton tile configuration, and the speed measurements. Before each check, one whose budget would end
past --deadline is skipped (SKIP ... (deadline)); the last lines say how to rerun those with --only. Exit status
1 if any check fails, 2 for bad flags; a measurement (INFO) and a SKIP never fail.
"""
import time

STARTED = time.monotonic()  # --deadline counts from here, before the heavy imports

import argparse  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

import torch  # noqa: E402

if "--dry-run" in sys.argv[1:] or not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when train_gpt's kernels are decorated, at import

import compile_caches  # noqa: E402
import smoke_checks as sc  # noqa: E402

DEFAULT_DEADLINE_S = 480  # one borrowed-GPU command may run 600 s: this leaves room for start-up and a rerun


def check_line(status, name, seconds, budget, detail):
    over = ", over" if seconds > budget else ""
    return f"{status} {name} [{seconds:.1f} s, budget {budget:.0f} s{over}]: {detail}"


def check_list(text):
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected check names separated by commas")
    return names


def positive_seconds(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text}")
    return value


def summary_lines(counts, failures, seconds, budget):
    """The verdict with its details, then the counts alone (the last line)."""
    skipped = sum(counts["skipped"].values())
    why = ", ".join(f"{n} {reason}" for reason, n in counts["skipped"].items() if n)
    verdict = (f"{'FAIL' if failures else 'PASS'} overall in {seconds:.0f} s (budget {budget:.0f} s): "
               f"{counts['info']} of the passed are measurements; failed: {', '.join(failures) or 'none'}; "
               f"skipped: {why or 'none'}")
    return verdict, f"smoke: {counts['passed']} passed, {len(failures)} failed, {skipped} skipped"


def main(argv=None):
    parser = argparse.ArgumentParser(prog="gpu_smoke.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU (what the test suite runs)")
    parser.add_argument("--pytest", action="store_true", help="also run tests/test_gpu.py and tests/test_kernels.py")
    parser.add_argument("--deadline", type=positive_seconds, default=DEFAULT_DEADLINE_S, metavar="S",
                        help="seconds from the process start: a check whose budget would end later is skipped "
                             f"(default {DEFAULT_DEADLINE_S})")
    parser.add_argument("--only", type=check_list, metavar="NAME,...",
                        help="run these checks alone (with the record run's phases they need), e.g. to pick up "
                             "where a run stopped at its deadline")
    parser.add_argument("--load-caches", type=Path, metavar="DIR",
                        help="load the compile caches a run saved with --save-caches first (skips the cold compile)")
    parser.add_argument("--save-caches", type=Path, metavar="DIR",
                        help=f"save this run's compile caches into DIR at the end (at most "
                             f"{compile_caches.MAX_FILES} files of {compile_caches.MAX_FILE_BYTES >> 20} MiB)")
    args = parser.parse_args(argv)
    if args.load_caches and not args.load_caches.is_dir():
        parser.error(f"--load-caches {args.load_caches}: no such folder; give the DIR of a --save-caches run")
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device; pass --dry-run to check the script on the CPU")
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", 0)
    os.chdir(ROOT)
    folder = Path(tempfile.mkdtemp(prefix="speedrun_smoke_"))
    try:
        plan = sc.SmokePlan(device, folder, with_pytest=args.pytest, only=args.only)
    except ValueError as e:
        shutil.rmtree(folder, ignore_errors=True)
        parser.error(f"--only: {e}")
    if args.load_caches:
        print(f"compile caches: {compile_caches.load(args.load_caches):,} bytes loaded from {args.load_caches}")
    print(plan.plan_line(), flush=True)
    counts = {"passed": 0, "info": 0, "skipped": {"need CUDA": 0, "past the deadline": 0}}
    failures, late, start = [], [], time.perf_counter()
    try:
        for check in plan.checks:
            budget, elapsed = plan.budget_s(check), time.monotonic() - STARTED
            if elapsed + budget > args.deadline and not plan.skips_here(check):
                print(f"SKIP {check.name} (deadline): {elapsed:.0f} s elapsed + budget {budget:.0f} s > "
                      f"{args.deadline:.0f} s", flush=True)
                counts["skipped"]["past the deadline"] += 1
                late.append(check.name)
                continue
            status, detail, seconds = plan.run(check)
            print(check_line(status, check.name, seconds, budget, detail), flush=True)
            if status == "FAIL":
                failures.append(check.name)
            elif status == "SKIP":
                counts["skipped"]["need CUDA"] += 1
            else:
                counts["passed"] += 1
                counts["info"] += status == "INFO"
    finally:
        plan.close()
        shutil.rmtree(folder, ignore_errors=True)
    if device.type == "cuda":
        print(f"graphs compiled: {sc.compiled_graphs()} (dynamo's count; planned "
              f"{sum(kind not in ('triton', 'autotune') for kind, _ in plan.graphs())})", flush=True)
    if late:
        print(f"rerun the checks skipped at the deadline: tools/gpu_smoke.sh{' --dry-run' if args.dry_run else ''} "
              f"--only {','.join(late)}", flush=True)
    if args.save_caches:
        parts, size = compile_caches.save(args.save_caches)
        print(f"compile caches: {size:,} bytes saved in {parts} file(s) to {args.save_caches}", flush=True)
    for line in summary_lines(counts, failures, time.perf_counter() - start, plan.budget_s()):
        print(line, flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
