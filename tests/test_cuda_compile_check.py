"""tools/cuda_compile_check.py sees the two compile failures the H200 smoke run hit, on the CPU:
Inductor's lowering of _scaled_mm with a tensorwise scale that is a view into a per-layer buffer
(fixed in 29f5d6a by a scale of its own), and Triton 3.6's float8 NaN constant, which Inductor
inlines for an uninitialized (new_empty) e5m2 buffer written in part (fixed in 2a7de79 by
new_zeros). Each small graph fails, and its fixed form compiles for sm_90. The inventory's bytes are
what a kernel touches: a chunk of a buffer, not the buffer; a looped reduction's rows once per loop;
a kernel called for each recurring source counts its calls.
Only with the GPU image's versions (CI's torch 2.11 leg): the check leans on their private APIs."""

import csv
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def gpu_image_versions():
    try:
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return False
    return (torch.__version__.split("+")[0], triton_version) == ("2.11.0", "3.6.0") and bool(
        torch.version.cuda
    )


needs_gpu_image = pytest.mark.skipif(
    not gpu_image_versions(), reason="needs torch 2.11.0 (CUDA build), Triton 3.6.0"
)
ROOT = Path(__file__).resolve().parents[1]
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
LAYERS = 4


def scaled_mm_with_buffer_scales(x, w, act_scales, w_scales, own_scale):
    """FP8 product with the tensorwise scales of layer 1, as views into (layers,) buffers, or
    (own_scale) as tensors of their own, the fix."""
    a, b = act_scales[1], w_scales[1]
    if own_scale:
        a, b = a.clamp(min=0), b.clamp(min=0)
    return torch._scaled_mm(
        x.to(E4M3), w.to(E4M3).T, scale_a=a, scale_b=b, out_dtype=torch.bfloat16
    )


def e5m2_buffer_written_in_part(z, zeros):
    """An e5m2 buffer, uninitialized or (zeros) zero-filled, of which the first half of the rows is
    written."""
    buf = z.new_zeros(z.shape, dtype=E5M2) if zeros else z.new_empty(z.shape, dtype=E5M2)
    buf[: z.shape[0] // 2] = z[: z.shape[0] // 2].to(E5M2)
    return buf


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def chunk_of_a_buffer(x, _):
    """A pointwise kernel on rows 256-511 of a (1024, 512) buffer (a chunk, as the loss's)."""
    return x[256:512] * 2


def spread_logsumexp(x, _):
    """x - logsumexp(x) over rows of 4,096: a looped reduction, its result spread back over the rows
    (the loss's lse pass, then its gradient pass)."""
    return x - torch.logsumexp(x.float(), -1, keepdim=True)


def four_layers(a, w, _):
    """Four times (sin(a) * 2) @ w: the last three pointwise kernels have one source."""
    for _ in range(4):
        a = (a.sin() * 2) @ w
    return a


CASES = {
    "view scales": (scaled_mm_with_buffer_scales, False),
    "own scales": (scaled_mm_with_buffer_scales, True),
    "new_empty": (e5m2_buffer_written_in_part, False),
    "new_zeros": (e5m2_buffer_written_in_part, True),
    "chunk": (chunk_of_a_buffer, None),
    "spread": (spread_logsumexp, None),
    "layers": (four_layers, None),
}


def case_args(fn):
    if fn is scaled_mm_with_buffer_scales:
        return (
            meta(256, 128),
            meta(512, 128),
            meta(LAYERS, dtype=torch.float32),
            meta(LAYERS, dtype=torch.float32),
        )
    if fn is four_layers:
        return (meta(256, 256), meta(256, 256))
    if fn is chunk_of_a_buffer:
        return (meta(1024, 512),)
    if fn is spread_logsumexp:
        return (meta(64, 4096),)
    return (meta(256, 512),)


def compile_cases():
    """Each case's (what, source line, error) of compiling it for sm_90 (None: compiled) and its
    kernels, as a JSON line (run in a process of its own: Triton must not be in the tests'
    interpreter mode, and the fake H100 must not reach other tests)."""
    import cuda_compile_check as check

    for name, (fn, fixed) in CASES.items():
        check.LOG.graph, check.LOG.compiling = name, None
        failure = None
        with check.fake_h100():
            try:
                check.lower_function(fn, (*case_args(fn), fixed))
            except Exception as e:
                failure = check.describe_failure(e)
        print(
            json.dumps(
                {
                    "case": name,
                    "failure": failure,
                    "kernels": len(check.LOG.of(name)),
                    "traffic": [
                        (k.name, k.reads, k.writes, k.launches) for k in check.LOG.of(name)
                    ],
                }
            ),
            flush=True,
        )


@pytest.fixture(scope="module")
def outcomes():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tools"), str(ROOT)])
    done = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300
    )
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == len(CASES), done.stdout[-2000:] + done.stderr[-3000:]
    return {line["case"]: line for line in lines}


@needs_gpu_image
def test_scaled_mm_with_scales_viewing_a_buffer_fails_to_lower(outcomes):
    failure = outcomes["view scales"]["failure"]
    assert (
        failure is not None
    ), "compiled, but Inductor 2.11 cannot lower a buffer view as _scaled_mm's scale"
    what, _, error = failure
    assert what == "lowering aten._scaled_mm.default" and error.startswith(
        "LoweringException"
    ), failure
    fixed = outcomes["own scales"]
    assert fixed["failure"] is None and fixed["kernels"] > 0, fixed


@needs_gpu_image
def test_uninitialized_e5m2_buffer_fails_with_a_float8_nan_constant(outcomes):
    failure = outcomes["new_empty"]["failure"]
    assert failure is not None, "compiled, but Triton 3.6 cannot build a float8 NaN constant"
    what, source, error = failure
    assert what.startswith("kernel triton_"), failure
    assert "tl.float8e5" in source and "nan" in source, failure
    assert "builder' object has no attribute 'get_fp8e5'" in error, failure
    fixed = outcomes["new_zeros"]
    assert fixed["failure"] is None and fixed["kernels"] > 0, fixed


@needs_gpu_image
def test_a_kernel_counts_the_chunk_it_reads_not_the_buffer(outcomes):
    """Rows 256-511 of a (1024, 512) bf16 buffer, doubled: the kernel reads and writes 256 x 512 x 2
    bytes (the whole buffer would be 4 times that)."""
    ((_, reads, writes, _),) = outcomes["chunk"]["traffic"]
    assert (reads, writes) == (256 * 512 * 2, 256 * 512 * 2)


@needs_gpu_image
def test_a_looped_reduction_reads_its_rows_once_per_loop(outcomes):
    """x - logsumexp(x) over (64, 4096) bf16 rows (longer than a persistent reduction's): one kernel
    of three loops over the rows (the max, the sum of exponentials, the result), each loading x, as
    the generated source does; it writes the fp32 result once."""
    ((name, reads, writes, _),) = outcomes["spread"]["traffic"]
    assert name.startswith("triton_red_"), name
    assert (reads, writes) == (3 * 64 * 4096 * 2, 64 * 4096 * 4)


@needs_gpu_image
def test_a_kernel_called_for_each_recurring_source_counts_its_calls(outcomes):
    """Inductor defines a kernel once and calls it wherever its source recurs: four layers'
    pointwise kernels are 2 kernels (the first reads the input), 1 + 3 calls."""
    launches = [k[3] for k in outcomes["layers"]["traffic"]]
    assert launches == [1, 3], outcomes["layers"]["traffic"]


def test_inventory_reads_back_as_csv_and_json(tmp_path):
    import cuda_compile_check as check

    kernels = [
        check.Kernel(
            "training",
            "triton_poi_fused_add_0",
            [check.Binary("{'XBLOCK': 1024}", 0, 20, 0)],
            reads=4096,
            writes=2048,
            numels={"x": 1024},
            grid=(1, 1, 1),
            launches=11,
        ),
        check.Kernel(
            "training",
            "triton_mm_1",
            [check.Binary("a", 98304, 168, 0), check.Binary("b", 1024, 90, 8)],
            reads=100,
            writes=50,
        ),
    ]
    outcomes = [check.Outcome("training", "ok", 2, 3.25)]
    check.write_inventory(tmp_path / "k.csv", outcomes, kernels)
    with (tmp_path / "k.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["kernel"] for r in rows] == ["triton_poi_fused_add_0", "triton_mm_1"]
    assert rows[0]["grid"] == "1x1x1" and rows[1]["grid"] == ""
    assert (rows[0]["launches"], rows[1]["launches"]) == ("11", "1")
    assert (
        int(rows[1]["read_bytes"]),
        int(rows[1]["shared_bytes"]),
        int(rows[1]["spill_bytes"]),
    ) == (100, 98304, 8)
    check.write_inventory(tmp_path / "k.json", outcomes, kernels)
    inventory = json.loads((tmp_path / "k.json").read_text())
    assert inventory["graphs"][0]["kernels"] == 2 and len(inventory["kernels"]) == 2
    assert inventory["kernels"][1]["registers"] == 168


def test_a_missing_file_is_one_line_naming_the_flag(capsys, tmp_path):
    import cuda_compile_check as check

    for flag in ("--train-gpt", "--reference", "--race"):
        with pytest.raises(SystemExit) as exit_:
            check.main([flag, str(tmp_path / "missing.txt")])
        assert exit_.value.code == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith("cuda_compile_check.py: error: " + flag), last


def test_race_lowers_every_function_89_compiles():
    """--race lowers each function #89's script decorates with torch.compile: the AST scan finds
    its five (a method's name with its class), and none nested in a function body."""
    import cuda_compile_check as check

    if not check.RACE_LOG.is_file():
        pytest.skip(f"no #89 log at {check.RACE_LOG}")
    import reference_step

    script, _ = reference_step.read_log(check.RACE_LOG)
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"race_script_{os.getpid()}.py"
    path.write_text(script)
    try:
        found = check.compiled_definitions(path)
    finally:
        path.unlink()
    assert found == [
        (None, "polar_express"),
        (None, "sparse_comms_share_gradients"),
        ("NorMuonAndAdam", "_adam_update_step"),
        ("NorMuonAndAdam", "_cautious_wd_and_update_inplace"),
        ("NorMuonAndAdam", "_apply_normuon_variance_reduction"),
    ], found


if __name__ == "__main__":
    compile_cases()
