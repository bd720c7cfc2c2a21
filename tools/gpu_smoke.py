"""One-GPU smoke test of the record path, in one go: one line per check, PASS / FAIL / SKIP.

    python tools/gpu_smoke.py            # on a CUDA machine (about 5-8 minutes on one H200)
    python tools/gpu_smoke.py --dry-run  # the same checks at toy sizes on CPU (CI runs this)

Checks: versions and device; the kernel and GPU test files; the FP8 head against bf16 at the
stage-3 shape (loss and both gradients); then the record model on a synthetic corpus with the
record's warm-up: graphs compiled inside the timed loop (must be 0), tokens/s per GPU at the stage-3
batch (the 8xH100 record pace needs >= 543,000 per GPU before communication), train and validation
peak memory (must fit an 80 GB H100) and --plan_memory's prediction of it (must not be below it), host syncs
inside a training step (must be 0) and the compiled against the eager loss (< 5e-3 per token). Exit status 1 if any check fails.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import train_gpt as tg  # noqa: E402

RECORD_PACE_TOKENS_PER_GPU = 543_000  # 393,216 tokens in 90.5 ms per step, 8 GPUs, before communication
H100_BYTES = 80 * 2**30
FAILURES = []


def report(status, name, detail=""):
    print(f"{status} {name}: {detail}", flush=True)
    if status == "FAIL":
        FAILURES.append(name)


def check(name, ok, detail):
    report("PASS" if ok else "FAIL", name, detail)


def guarded(fn):
    """A check that raises reports FAIL with the exception's first line instead of ending the script."""
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - a smoke test reports every failure and goes on
            report("FAIL", fn.__name__, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return run


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_ms(fn, iters):
    times = []
    for _ in range(iters):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(1000 * (time.perf_counter() - start))
    return sorted(times)[len(times) // 2]


@guarded
def versions(device):
    line = (f"python {sys.version.split()[0]}, torch {torch.__version__}, cuda {torch.version.cuda}, "
            f"triton {tg.triton.__version__ if tg.HAS_TRITON else 'none'}")
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        line += f"; {props.name}, capability {props.major}.{props.minor}, {props.total_memory / 2**30:.0f} GiB, FP8 {tg.fp8_supported(device)}"
    check("versions", True, line)


@guarded
def gpu_tests(dry_run):
    if dry_run:
        return report("SKIP", "gpu_tests", "dry run (the CPU suite runs these files already)")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_gpu.py",
                             "tests/test_kernels.py"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    last = (result.stdout.strip().splitlines() or ["no output"])[-1]
    check("gpu_tests", result.returncode == 0, last)


@guarded
def fp8_head(device, dry_run):
    tokens, dim, vocab = (512, 64, 1024) if dry_run else (49152, 768, 50304)
    g = torch.Generator(device=device).manual_seed(0)
    x = (torch.randn(tokens, dim, device=device, generator=g) * 1.5).bfloat16()
    w = (torch.randn(vocab, dim, device=device, generator=g) * 0.005).bfloat16()
    targets = torch.randint(0, vocab, (tokens,), device=device, generator=g)
    results = {}
    for fp8 in (False, True):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()

        def step():
            xr.grad = wr.grad = None
            loss = tg.softcap_cross_entropy(xr, wr, targets, True, fp8)
            loss.backward()
            return loss

        loss = step()
        ms = median_ms(step, 1 if dry_run else 10)
        results[fp8] = (loss.item() / tokens, xr.grad.float(), wr.grad.float(), ms)

    def cosine(a, b):
        return (a.flatten() @ b.flatten() / (a.norm() * b.norm())).item()

    (l16, gx16, gw16, ms16), (l8, gx8, gw8, ms8) = results[False], results[True]
    cx, cw = cosine(gx8, gx16), cosine(gw8, gw16)
    check("fp8_head", cx > 0.99 and cw > 0.99 and abs(l8 - l16) < 1e-2,
          f"{tokens}x{dim} @ {vocab}: loss/token bf16 {l16:.5f} fp8 {l8:.5f}; gradient cosine x {cx:.4f} w {cw:.4f}; "
          f"fwd+bwd {ms16:.2f} ms bf16, {ms8:.2f} ms fp8")


class SyncCounter(TorchDispatchMode):
    """Records, on any device, the operations that make the host wait for a CUDA device: reading a
    value (.item(), .tolist(), float(t): _local_scalar_dense), ops whose output size depends on data
    (nonzero, masked_select, boolean indexing, ...), and tensors made from Python data inside the
    region (torch.tensor(...), indexing with a Python list: on CUDA a copy from the host)."""

    DATA_DEPENDENT = {"aten.nonzero.default", "aten.masked_select.default", "aten._unique2.default",
                      "aten.unique_dim.default", "aten.repeat_interleave.Tensor", "aten.unique_consecutive.default"}

    def __init__(self):
        super().__init__()
        self.events = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name == "aten._local_scalar_dense.default":
            self.events.append("host read (.item/.tolist/float)")
        elif name in self.DATA_DEPENDENT:
            self.events.append(f"data-dependent size ({name})")
        elif name == "aten.index.Tensor" and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self.events.append("boolean-mask indexing")
        elif name in ("aten.lift_fresh.default", "aten.lift_fresh_copy.default"):
            self.events.append("batch to device (by design: pinned, non-blocking on CUDA)" if self._in_to_device()
                               else "tensor from Python data")
        return func(*args, **(kwargs or {}))

    @staticmethod
    def _in_to_device():
        """Whether the loader's to_device (the batch's designed host-to-device transfer) is the caller."""
        frame = sys._getframe()
        while frame is not None:
            if frame.f_code.co_name == "to_device" and frame.f_code.co_filename.endswith("train_gpt.py"):
                return True
            frame = frame.f_back
        return False

    def syncs(self):
        """The events that make the host wait (the batch transfers do not)."""
        return [event for event in self.events if not event.startswith("batch to device")]

    def summary(self):
        counts = {}
        for event in self.events:
            counts[event] = counts.get(event, 0) + 1
        return "; ".join(f"{n} x {event}" for event, n in sorted(counts.items())) or "none"


def count_host_syncs(trainer, step):
    """Synchronizing calls inside one train_step: CUDA's own sync debug mode on a GPU; on CPU the
    operations that would synchronize on CUDA (SyncCounter)."""
    if trainer.device.type != "cuda":
        with SyncCounter() as counter:
            trainer.train_step(step, *trainer.schedule(step))
        return len(counter.syncs()), counter.summary()
    sync()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train_step(step, *trainer.schedule(step))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    messages = sorted({str(w.message).splitlines()[0][:80] for w in caught})
    return len(caught), "; ".join(messages) or "none"


@guarded
def record_model(device, dry_run):
    """The record configuration (toy sizes on a dry run) on a synthetic corpus: warm-up, then timed steps."""
    folder = Path(tempfile.mkdtemp(prefix="speedrun_smoke_"))
    tg.synthetic_corpus(folder, train_tokens=400_000 if dry_run else 12_000_000,
                        val_tokens=20_000 if dry_run else 2_200_000)
    steps = 12
    argv = ["--device", device.type, "--num_scheduled_iterations", str(steps - 3), "--num_extension_iterations", "3",
            "--val_loss_every", "0", "--warmup_steps", "2", "--log_dir", str(folder / "logs"),
            "--train_files", str(folder / "synthetic_train_*.bin"), "--val_files", str(folder / "synthetic_val_*.bin")]
    if dry_run:
        argv += ["--preset", "cpu", "--val_tokens", "8192", "--batch_sizes", "1024", "2048", "3072", "--cpu_threads", "2",
                 "--num_layers", "9", "--model_dim", "64", "--num_heads", "2", "--head_dim", "32"]
    else:
        argv += ["--val_tokens", "2097152"]  # one validation step: 262,144 tokens per forward, as the record
    trainer = tg.Trainer(tg.parse_args(argv), argv)
    graphs_before_warmup = unique_graphs()
    trainer.warm_up()
    graphs_after_warmup = unique_graphs()
    stage3 = tg.stage_first_steps(trainer.hp)[2]  # from here on the batch is the last stage's
    times = []
    for step in range(steps):
        sync()
        start = time.perf_counter()
        trainer.train_step(step, *trainer.schedule(step))
        sync()
        times.append((step, time.perf_counter() - start))
    trainer.validate(tg.final_window_blocks(trainer.hp))
    new_graphs = unique_graphs() - graphs_after_warmup
    check("compiles_in_timed_loop", new_graphs == 0,
          f"{new_graphs} graphs compiled after the warm-up ({graphs_after_warmup - graphs_before_warmup} during it)")
    stage3_ms = sorted(1000 * t for s, t in times if s >= stage3)
    median = stage3_ms[len(stage3_ms) // 2]
    tokens_per_gpu = tg.batch_size_at(stage3, trainer.hp) / trainer.world_size / (median / 1000)
    pace = f"{tokens_per_gpu:,.0f} tokens/s per GPU at the stage-3 batch (median step {median:.1f} ms)"
    if device.type == "cuda":
        check("throughput", tokens_per_gpu >= RECORD_PACE_TOKENS_PER_GPU, f"{pace}; record pace {RECORD_PACE_TOKENS_PER_GPU:,}")
        train_peak, eval_peak = trainer.stats.train_peak_bytes(), trainer.stats.eval_peak_bytes
        check("memory", train_peak < H100_BYTES and eval_peak < H100_BYTES,
              f"peak allocated: training {train_peak / 2**30:.1f} GiB, validation {eval_peak / 2**30:.1f} GiB")
        memory_plan(trainer, train_peak, eval_peak)
    else:
        report("SKIP", "throughput", f"{pace} (CPU dry run: no target)")
        report("SKIP", "memory", "CPU dry run")
        report("SKIP", "memory_plan", "CPU dry run")
    syncs, kinds = count_host_syncs(trainer, stage3)
    expected = 0 if device.type == "cuda" else 2 * trainer.accum  # CPU: the tiled attention reads its 2 windows
    check("host_syncs_per_step", syncs == expected, f"{syncs} in one train_step (documented: {expected}); {kinds}")
    compiled_vs_eager(trainer, device)
    trainer.loader.close()
    shutil.rmtree(folder, ignore_errors=True)


@guarded
def memory_plan(trainer, train_peak, eval_peak):
    """--plan_memory's prediction (eager accounting, meant as an upper bound of the compiled run) against the
    measured peaks."""
    plan = tg.MemoryPlan(trainer.hp, trainer.world_size)
    predicted = plan.piece_figures(plan.largest_piece(trainer.hp.micro_batch_tokens))["peak"]
    _, predicted_eval = plan.validation_figures()
    check("memory_plan", train_peak <= predicted and eval_peak <= predicted_eval,
          f"training: predicted {predicted / 2**30:.2f} GiB, measured {train_peak / 2**30:.2f} GiB "
          f"({train_peak / predicted:.2f}x); validation: predicted {predicted_eval / 2**30:.2f} GiB, measured "
          f"{eval_peak / 2**30:.2f} GiB ({eval_peak / predicted_eval:.2f}x)")


def unique_graphs():
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def compiled_vs_eager(trainer, device):
    model, hp = trainer.model, trainer.hp
    model.train()
    batch = trainer.loader.next_batch(tg.tokens_per_rank(tg.batch_size_at(0, hp), trainer.world_size, trainer.accum),
                                      hp.max_seq_len)
    windows = trainer.windows[tg.window_blocks_at(0, hp)]
    tokens = batch[0].numel()
    with torch.no_grad():
        compiled = trainer.forward(*batch, windows).item() / tokens
        eager_attention = model.attention
        model.attention = tg.FlexWindowAttention(compile_kernel=True) if device.type == "cuda" else eager_attention
        eager = model(*batch, windows).item() / tokens
        model.attention = eager_attention
    same_object = trainer.forward is model
    check("compiled_vs_eager", abs(compiled - eager) < 5e-3,
          f"loss/token compiled {compiled:.5f} eager {eager:.5f} (|diff| {abs(compiled - eager):.1e})"
          + (" [not compiled: CPU]" if same_object else ""))


def main(argv=None):
    parser = argparse.ArgumentParser(prog="gpu_smoke.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="toy sizes on CPU (what CI runs)")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_smoke.py: error: no CUDA device; pass --dry-run to check the script on CPU", file=sys.stderr)
        return 2
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", 0)
    os.chdir(ROOT)
    versions(device)
    gpu_tests(args.dry_run)
    fp8_head(device, args.dry_run)
    record_model(device, args.dry_run)
    print(f"{'FAIL' if FAILURES else 'PASS'} overall: {len(FAILURES)} failed check(s) {FAILURES or ''}".rstrip(), flush=True)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
