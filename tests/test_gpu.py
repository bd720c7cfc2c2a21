"""The GPU smoke test's checks (tools/smoke_checks.py) as tests, each in two twins that run the same
function: at the record's shapes on CUDA (marked gpu, skipped without CUDA) and at toy shapes on the
CPU (slow tier), where a deterministic failure shows before any GPU is rented. On real hardware, with
the numbers:

    python3 -m pytest -q -s -m "not slow" tests/test_gpu.py   # or: tools/gpu_smoke.sh --pytest

The record-model checks share one run per device (module scope): three steps from initialization
(every parameter moves), the warm-up, a timed loop, then host syncs and compiled against eager. Its
compilations dominate on CUDA (minutes on a fresh machine). CUDA-only checks (memory statistics, FP8
and Triton speed) skip on the CPU, as does the fused FP8 MLP's where Triton's interpreter cannot
run it; tools/gpu_smoke.sh --dry-run runs the CPU twins too.
"""
import pytest
import torch

import smoke_checks as sc

DEVICES = [pytest.param("cpu", marks=pytest.mark.slow, id="cpu-toy"),
           pytest.param("cuda", id="cuda-record", marks=[pytest.mark.gpu, pytest.mark.skipif(
               not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.fixture(scope="module", params=DEVICES)
def smoke(request, tmp_path_factory):
    plan = sc.SmokePlan(torch.device(request.param), tmp_path_factory.mktemp(f"smoke_{request.param}"))
    yield plan
    plan.close()


@pytest.mark.parametrize("name", sc.check_names())
def test_smoke_check(smoke, name):
    check = smoke.check(name)
    reason = check.skip_reason(smoke.device)
    if reason:
        pytest.skip(reason)
    print(f"\n[{smoke.device.type}] {name}: {check.run()}")
