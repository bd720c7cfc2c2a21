"""The README's configuration table is the Hyperparameters dataclass and its presets."""
import re
from dataclasses import fields

import train_gpt as tg
from conftest import ROOT


def _fmt(value):
    return " ".join(map(str, value)) if isinstance(value, tuple) else str(value)


def test_readme_config_table_matches_dataclass():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    rows = {m.group(1): m for m in re.finditer(r"^\| `--(\w+)` \| `([^`]*)` \| (?:`([^`]*)`)? \|", readme, re.M)}
    names = [f.name for f in fields(tg.Hyperparameters)]
    assert sorted(rows) == sorted(names), "README table and Hyperparameters list different flags"
    for f in fields(tg.Hyperparameters):
        row = rows[f.name]
        assert row.group(2) == _fmt(f.default), f"README default of --{f.name} is stale"
        cpu = tg.PRESETS["cpu"].get(f.name)
        assert row.group(3) == (None if cpu is None else _fmt(cpu)), f"README cpu preset value of --{f.name} is stale"


def test_help_lists_every_field_with_default():
    text = tg.build_arg_parser().format_help()
    for f in fields(tg.Hyperparameters):
        assert f"--{f.name}" in text
        assert f"(default: {f.default})" in " ".join(text.split()), f"--help lacks the default of --{f.name}"
