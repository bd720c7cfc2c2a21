"""The README's configuration table and --help are the Hyperparameters dataclass and its presets."""
import re
import sys
from dataclasses import fields
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # also run as a script, to print the table
import train_gpt as tg  # noqa: E402


def _fmt(value):
    return " ".join(map(str, value)) if isinstance(value, tuple) else str(value)


def config_table():
    """The README's configuration table, made from Hyperparameters, HP_SECTIONS and the cpu preset (print it
    with `python tests/test_docs.py` after changing a field)."""
    lines = ["| flag | default (the record) | `--preset cpu` | meaning |", "|---|---|---|---|"]
    cpu = tg.PRESETS["cpu"]
    for f in fields(tg.Hyperparameters):
        if f.name in tg.HP_SECTIONS:
            lines.append(f"| **{tg.HP_SECTIONS[f.name]}** | | | |")
        preset = f"`{_fmt(cpu[f.name])}`" if f.name in cpu else ""
        lines.append(f"| `--{f.name}` | `{_fmt(f.default)}` | {preset} | {f.metadata['help']} |")
    return "\n".join(lines) + "\n"


def test_readme_config_table_is_the_dataclass():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = config_table()
    assert table in readme, "README's configuration table is stale: paste the output of `python tests/test_docs.py`"
    assert len(re.findall(r"^\| `--\w+` \|", readme, re.M)) == len(fields(tg.Hyperparameters))  # one table only
    assert tg.PRESETS["record"] == {}


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


if __name__ == "__main__":
    print(config_table(), end="")
