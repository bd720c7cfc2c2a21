"""Every record folder under records/<track>/ holds >= 3 logs, and its README quotes exactly what
`records.py stats <folder> --target T` prints today (so the numbers cannot drift from the logs)."""
import importlib.util
import re
import sys

import pytest
from conftest import ROOT

_spec = importlib.util.spec_from_file_location("records_cli", ROOT / "records" / "records.py")
rec = sys.modules.setdefault("records_cli", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(rec)

RECORD_DIRS = sorted(p for p in (ROOT / "records").glob("track_*/*") if p.is_dir())


def test_there_is_a_cpu_record():
    assert any(p.parent.name == "track_cpu" for p in RECORD_DIRS)


@pytest.mark.parametrize("folder", RECORD_DIRS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_record_readme_matches_stats(folder, monkeypatch):
    monkeypatch.chdir(ROOT)  # the report names logs by the path given, relative to the repo
    logs = sorted(folder.glob("*.txt"))
    assert len(logs) >= 3, f"{folder}: a record needs at least 3 logs"
    readme = (folder / "README.md").read_text(encoding="utf-8")
    command = re.search(r"python records/records\.py stats (\S+) --target ([\d.]+)", readme)
    assert command, f"{folder}/README.md must show the stats command it quotes"
    assert (ROOT / command.group(1)).resolve() == folder.resolve()
    report = rec.stats_report([str(folder.relative_to(ROOT))], target=float(command.group(2)))
    for line in report.splitlines():
        assert line in readme, f"{folder}/README.md does not quote this stats line: {line!r}"
