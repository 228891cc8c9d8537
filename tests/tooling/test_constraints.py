"""constraints.txt pins every test and example dependency exactly, and never torch or CUDA."""

from __future__ import annotations

import re

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from repo_paths import ROOT

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11, as the lock was resolved on


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9._-]+)==([A-Za-z0-9.+!-]+)", line.strip())
        assert match, f"constraints.txt: {line!r} is not an exact pin (name==version)"
        pins[canonicalize_name(match[1])] = match[2]
    return pins


def test_every_declared_dependency_is_pinned_exactly() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = list(project["dependencies"])
    for extra in ("dev", "examples", "models"):
        declared += project["optional-dependencies"][extra]
    names = {canonicalize_name(Requirement(r).name) for r in declared} - {"torch"}
    missing = sorted(names - set(_pins()))
    assert not missing, f"not pinned in constraints.txt: {missing}; run scripts/update_lock.sh"


def test_torch_and_cuda_wheels_are_left_to_torch_spec() -> None:
    pinned = [n for n in _pins() if n == "torch" or n.startswith(("nvidia-", "cuda-"))]
    assert not pinned, f"constraints.txt pins {pinned}: torch comes from TORCH_SPEC (env.sh)"
