"""Every record folder under records/<track>/ is well formed (a README, >= 3 logs that parse, verify
and share one script, within the track's budget), and its README quotes exactly what
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
COMMITTED_LOGS = sorted((ROOT / "records").glob("track_*/**/*.txt"))  # records and their lr sweeps


TRACKS = {"track_1_short", "track_cpu", "track_3_cpu", "track_3"}  # records/README.md, "Tracks and rules"
TRAIN_TIME_BUDGET_MS = {"track_cpu": 500_000}  # every run's final train_time


@pytest.mark.parametrize("folder", RECORD_DIRS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_record_folder_is_well_formed(folder):
    track = folder.parent.name
    assert track in TRACKS, f"{folder}: unknown track {track!r} (records/README.md lists {sorted(TRACKS)})"
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}_[A-Z][A-Za-z0-9]*", folder.name), \
        f"{folder}: the name must be <YYYY-MM-DD>_<CamelCaseName>"
    assert (folder / "README.md").is_file(), f"{folder}: a record needs a README.md"
    logs = rec.logs_in(folder)
    assert len(logs) >= 3, f"{folder}: a record needs at least 3 logs"
    scripts = set()
    for log in logs:
        run = rec.parse_log(log)  # raises for a log without a separator or a val_loss line
        rec.verify_script(log, quiet=True)  # raises if its script_sha256 line does not match
        parts = rec.read_log(log)
        assert rec.recorded_args(parts, log) is not None, f"{log}: no args: line"
        budget = TRAIN_TIME_BUDGET_MS.get(track)
        assert budget is None or run.final_time_ms <= budget, \
            f"{log}: train_time {run.final_time_ms:.0f}ms is over the {track} budget of {budget}ms"
        scripts.add(parts.script)
    assert len(scripts) == 1, f"{folder}: the logs hold {len(scripts)} different scripts; a record has one"


@pytest.mark.parametrize("folder", RECORD_DIRS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_record_readme_matches_stats(folder, monkeypatch):
    monkeypatch.chdir(ROOT)  # the report names logs by the path given, relative to the repo
    logs = sorted(folder.glob("*.txt"))
    assert len(logs) >= 3, f"{folder}: a record needs at least 3 logs"
    readme = (folder / "README.md").read_text(encoding="utf-8")
    command = re.search(r"python records/records\.py stats (\S+) --target ([\d.]+)"
                        r"(?: --against (\S+))?(?: --alpha ([\d.]+))?\n", readme)
    assert command, f"{folder}/README.md must show the stats command it quotes"
    assert (ROOT / command.group(1)).resolve() == folder.resolve()
    against = [command.group(3)] if command.group(3) else None
    alpha = float(command.group(4)) if command.group(4) else rec.DEFAULT_ALPHA
    report = rec.stats_report([str(folder.relative_to(ROOT))], target=float(command.group(2)),
                              alpha=alpha, against=against)
    for line in report.splitlines():
        assert line in readme, f"{folder}/README.md does not quote this stats line: {line!r}"


@pytest.mark.parametrize("log", COMMITTED_LOGS, ids=lambda p: str(p.relative_to(ROOT / "records")))
def test_committed_logs_name_no_machine_path(log):
    """Recorded arguments and data paths are relative, so a replay works on any machine and a log does
    not reveal the folders of the one that produced it."""
    parts = rec.read_log(log)
    args = rec.recorded_args(parts, log)
    assert args is not None, f"{log}: no args: line"
    data_lines = [line for line in parts.output.splitlines() if line.startswith("data: ")]
    words = [*args, *(w for line in data_lines for w in line.split())]
    absolute = [w for w in words if w.startswith("/") or re.match(r"[A-Za-z]:[\\/]", w)]
    assert not absolute, f"{log}: names machine paths {absolute}"


MACHINE_PATH = re.compile(r"/(?:work|home|root|tmp)/")  # the build machine's folders; fixtures use /data/example/
TEXT_FILES = sorted(p for top in ("records", "tests") for p in (ROOT / top).rglob("*")
                    if p.suffix in {".py", ".md", ".json", ".sh", ".toml", ".cfg", ".yaml", ".yml"}
                    and "__pycache__" not in p.parts)


def test_text_files_name_no_machine_path():
    """Scripts, READMEs and fixtures under records/ and tests/ use invented paths (the logs, which
    must stay unedited, are checked above for their arguments and data paths)."""
    assert TEXT_FILES
    found = [f"{p.relative_to(ROOT)}:{n}" for p in TEXT_FILES
             for n, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
             if MACHINE_PATH.search(line)]
    assert not found, f"machine paths in {found}"
