"""The README's configuration table and --help are the Hyperparameters dataclass and its presets."""
import re
from dataclasses import fields

import pytest

import train_gpt as tg
from conftest import ROOT


def _fmt(value):
    return " ".join(map(str, value)) if isinstance(value, tuple) else str(value)


def test_readme_config_table_matches_dataclass():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    rows = {m.group(1): m for m in re.finditer(r"^\| `--(\w+)` \| `([^`]*)` \| (?:`([^`]*)`)? \| (?:`([^`]*)`)? \|",
                                              readme, re.M)}
    names = [f.name for f in fields(tg.Hyperparameters)]
    assert sorted(rows) == sorted(names), "README table and Hyperparameters list different flags"
    for f in fields(tg.Hyperparameters):
        row = rows[f.name]
        assert row.group(2) == _fmt(f.default), f"README default of --{f.name} is stale"
        cpu, retie = tg.PRESETS["cpu"]["89"].get(f.name), tg.RECIPES["retie"].get(f.name)
        assert row.group(3) == (None if cpu is None else _fmt(cpu)), f"README cpu preset value of --{f.name} is stale"
        assert row.group(4) == (None if retie is None else _fmt(retie)), f"README retie value of --{f.name} is stale"
    # what the README says of --preset cpu --recipe retie
    assert tg.PRESETS["cpu"]["retie"] == dict(tg.CPU_COMMON, lr_multipliers=(1.0, 1.28, 1.52))
    assert "`--preset cpu --recipe retie` is the previous `cpu` preset" in readme


def test_help_lists_every_field_with_default(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "10000")  # one line per option
    with pytest.raises(SystemExit) as info:
        tg.parse_args(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    lines = {}  # option -> its entry (name line + help continuation lines), whitespace normalized
    for line in out.split("options:")[1].splitlines():
        if line.startswith("  -"):
            current = line.split()[0].rstrip(",")
            lines[current] = line
        elif line.startswith("    ") and lines:
            lines[current] = " ".join([lines[current], line.strip()])
    for f in fields(tg.Hyperparameters):
        assert f"--{f.name}" in lines, f.name
        assert f"(default: {f.default})" in lines[f"--{f.name}"], lines[f"--{f.name}"]
    assert "--preset" in lines and "cpu" in lines["--preset"]


def test_dockerfile_uses_the_ci_torch_and_a_lean_context():
    ci = (ROOT / ".ci" / "run").read_text()
    docker = (ROOT / "Dockerfile").read_text()
    pinned = re.search(r'"torch==([\d.]+)"', ci)[1]
    assert f"torch=={pinned}" in docker, "the Dockerfile must install the torch version CI tests"
    assert "TORCHINDUCTOR_CACHE_DIR=/speedrun/logs/" in docker  # the compile cache lives on the logs volume
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", "data/fineweb10B", "data/synthetic", "data/novels", "logs"} <= set(ignored)
