"""The repository's folders, and its benchmark tables module for tests that read or write it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def benchmark_tables() -> ModuleType:
    """benchmarks/tables.py, loaded by path: benchmarks/ is a folder of programs, not a package."""
    name = "benchmark_tables"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "tables.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[name]
