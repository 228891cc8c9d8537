"""The repository's folders, the test folders on ``sys.path``, and the benchmark and example
modules tests read, write or count with."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"


def module_folders() -> list[Path]:
    """Every folder under tests/ that holds a module. Tests, workers and helpers import one
    another by bare name (``from dist_harness import ...``), from any folder: file names are
    unique across tests/ (tests/tooling/test_test_layout.py checks)."""
    return sorted({path.parent for path in TESTS.rglob("*.py")})


def add_module_folders_to_path() -> None:
    """Put :func:`module_folders` on ``sys.path``: tests/conftest.py does, before any worker
    pool starts (spawned ranks start with this process's ``sys.path`` and import each worker
    by module name), and so do the tools that run test workers."""
    for folder in reversed(module_folders()):
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))


def benchmark_tables() -> ModuleType:
    """benchmarks/tables.py, loaded by path: benchmarks/ is a folder of programs, not a package."""
    return _benchmark_module("benchmark_tables", "tables.py")


def comm_bytes() -> ModuleType:
    """benchmarks/comm_bytes.py: the bytes a rank sends in a step."""
    return _benchmark_module("benchmark_comm_bytes", "comm_bytes.py")


def example_module(name: str) -> ModuleType:
    """examples/NAME.py, loaded by path as ``example_NAME``: examples/ is a folder of programs,
    not a package, and ``data`` or ``corpus`` are too generic to put on ``sys.path``."""
    return _load(f"example_{name}", ROOT / "examples" / f"{name}.py")


def _benchmark_module(name: str, file: str) -> ModuleType:
    return _load(name, ROOT / "benchmarks" / file)


def _load(name: str, path: Path) -> ModuleType:
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[name]
