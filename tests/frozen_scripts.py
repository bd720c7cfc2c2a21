"""Import the trainer snapshot a record log holds (its script part), as a module of its own.

A record's log starts with the exact script that produced it (records/records.py's log contract),
so tests of a retired recipe can test that frozen script instead of the live train_gpt.py.
"""
import atexit
import hashlib
import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RECORDS_PY = REPO / "records" / "records.py"
OP_NAMESPACE = "speedrun"  # the namespace of the torch custom ops the trainer registers at import

_loaded: dict[str, tuple[Path, object]] = {}  # module name -> (log, module): one load per process
_folder: list[Path] = []  # the per-process folder the rewritten scripts are written to


def records_module():
    """records/records.py as a module (the one tests/test_records.py loaded, if it did)."""
    if "records_cli" in sys.modules:
        return sys.modules["records_cli"]
    spec = importlib.util.spec_from_file_location("records_cli", RECORDS_PY)
    module = importlib.util.module_from_spec(spec)
    sys.modules["records_cli"] = module  # its dataclasses need the module registered
    spec.loader.exec_module(module)
    return module


def verified_script(log_path) -> str:
    """The log's script as text, checked against its script_sha256 line like `records.py extract`."""
    rec = records_module()
    try:
        parts = rec.read_log(log_path)
        verified = rec.verify_script(log_path, parts, quiet=True)
    except rec.RecordError as e:
        pytest.fail(f"cannot use the script of {log_path}: {e}", pytrace=False)
    if not verified:
        pytest.fail(f"{log_path} has no script_sha256 line: its script cannot be verified", pytrace=False)
    return parts.script.decode("utf-8")


def rename_op_namespace(source: str, namespace: str) -> str:
    """The source with its custom ops registered under `namespace` instead of `speedrun`."""
    # torch.library.custom_op registers "speedrun::mm_fp8" and "speedrun::mm_fp8_backward" for the
    # whole process, and registering one name twice fails. The live train_gpt.py registers the same
    # names, and pytest-xdist runs several test files in one worker process, so the frozen script's
    # ops get a namespace of their own (its Python code calls the ops through their Python objects;
    # torch.ops.speedrun.* is rewritten too, should a script use it).
    renamed = source.replace(f'"{OP_NAMESPACE}::', f'"{namespace}::').replace(f"'{OP_NAMESPACE}::", f"'{namespace}::")
    renamed = renamed.replace(f"torch.ops.{OP_NAMESPACE}.", f"torch.ops.{namespace}.")
    assert f"{OP_NAMESPACE}::" not in renamed.replace(f"{namespace}::", ""), "an op name was not rewritten"
    return renamed


def scratch_folder() -> Path:
    """A folder for this process's rewritten scripts, removed when the process exits."""
    if not _folder:
        _folder.append(Path(tempfile.mkdtemp(prefix="frozen_scripts_")))
        atexit.register(shutil.rmtree, _folder[0], True)
    return _folder[0]


def import_source(source: str, module_name: str):
    """Import source as module `module_name` from a file (triton.jit and inspect read the source)."""
    # the module's __file__ is this rewritten copy, so its run_source() is not the logged script
    path = scratch_folder() / f"{module_name}.py"
    path.write_text(source, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def load_record_script(log_path, module_name: str):
    """The verified script of a record log, imported once per process as `module_name`."""
    log_path = Path(log_path).resolve()
    if module_name in _loaded:
        loaded_from, module = _loaded[module_name]
        assert loaded_from == log_path, f"{module_name} was loaded from {loaded_from}, not {log_path}"
        return module
    assert module_name != "train_gpt" and module_name not in sys.modules, f"module name {module_name} is taken"
    source = verified_script(log_path)
    digest = hashlib.sha256(f"{module_name}:{source}".encode("utf-8")).hexdigest()[:12]
    module = import_source(rename_op_namespace(source, f"{OP_NAMESPACE}_frozen_{digest}"), module_name)
    _loaded[module_name] = (log_path, module)
    return module
