"""Loading a benchmark script (``benchmarks/NAME.py``, not a package) as a module for its tests."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Iterator

__all__ = ["BENCHMARKS", "loaded_benchmark"]

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@contextlib.contextmanager
def loaded_benchmark(file_name: str) -> Iterator[ModuleType]:
    """``benchmarks/<file_name>`` executed as a module named ``<stem>_under_test``, registered in
    ``sys.modules`` while the context lasts (its dataclasses look their module up there)."""
    path = BENCHMARKS / file_name
    spec = importlib.util.spec_from_file_location(f"{path.stem}_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)
