"""tools/compile_caches.py: the compile caches a first process saves (as gpu_smoke.py --save-caches
does on a borrowed GPU) load into a second one with empty caches, whose compile of the same graph is
then a cache hit. On the CPU with Inductor's C++ backend: the round trip is the same code as on
CUDA."""

import pytest
import torch

import compile_caches


def graph(x):
    return torch.relu(x).square().sum(dim=-1)


def compile_once(x):
    torch._dynamo.reset()
    torch.compile(graph, dynamic=False)(x)


@pytest.fixture
def fresh_cache(monkeypatch, tmp_path):
    def use(name):
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / name))
        torch.compiler.reset()

    yield use
    torch.compiler.reset()
    torch._dynamo.reset()


@pytest.mark.slow  # two C++ compiles: about 20 s on 2 cores
def test_saved_caches_load_into_empty_ones_and_hit(fresh_cache, tmp_path):
    from torch._dynamo.utils import counters

    x = torch.randn(8, 16)
    fresh_cache("first")
    compile_once(x)
    parts, size = compile_caches.save(tmp_path / "saved")
    files = sorted((tmp_path / "saved").iterdir())
    assert parts == len(files) >= 1 and size > 0
    assert len(files) <= compile_caches.MAX_FILES
    assert all(f.stat().st_size <= compile_caches.MAX_FILE_BYTES for f in files)

    fresh_cache("second")  # a new machine: nothing cached
    counters.clear()
    assert compile_caches.load(tmp_path / "saved") == size
    compile_once(x)
    assert counters["inductor"]["fxgraph_cache_hit"] == 1, dict(counters["inductor"])


def test_nothing_saved_loads_nothing(tmp_path):
    assert compile_caches.load(tmp_path) == 0
