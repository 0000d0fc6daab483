"""Shared pytest fixtures (generic: any test module may use or extend them)."""

from __future__ import annotations

import atexit
import os
import random
import shutil
import tempfile

import pytest
import torch


@pytest.fixture
def seed(request) -> int:
    """A fresh random seed per test (set FR_TEST_SEED to replay one); printed on failure.

    Tests draw their inputs from ``torch.Generator().manual_seed(seed)`` so that every run checks
    new random inputs while a failing run can be reproduced exactly.
    """
    value = int(os.environ.get("FR_TEST_SEED", random.SystemRandom().randrange(2**31)))
    request.node.user_properties.append(("seed", value))
    print(f"[seed] {request.node.nodeid}: FR_TEST_SEED={value}")
    return value


@pytest.fixture
def generator(seed) -> torch.Generator:
    """A CPU torch.Generator seeded with :func:`seed`."""
    return torch.Generator().manual_seed(seed)


cuda_available = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not cuda_available, reason="needs a CUDA device (none found)")


def _private_gguf_cache() -> None:
    """The tests' dequantized GGUF files go to a cache of their own (flashreinforce.models.gguf_cache), not
    the user's, removed at exit; set before anything starts, so subprocesses and Ray workers inherit it."""
    if "FLASHREINFORCE_CACHE_DIR" in os.environ:
        return
    folder = tempfile.mkdtemp(prefix="flashreinforce-test-cache-")
    os.environ["FLASHREINFORCE_CACHE_DIR"] = folder
    atexit.register(shutil.rmtree, folder, ignore_errors=True)


_private_gguf_cache()
