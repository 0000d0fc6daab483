"""Builds the C++ core tests (CPU only) with CMake and runs them through CTest.

The build directory (build/cpp-tests under the repository) is reused between runs, so only the
first run compiles. The same build also produces a CPU-only flashreinforce._C, used to check the
error a CPU-only build gives for CUDA tensors.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build" / "cpp-tests"


def _cmake_build() -> Path:
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.fail("cmake is required to build the C++ tests (pip install cmake)")
    import pybind11

    args = [cmake, "-S", str(ROOT), "-B", str(BUILD), "-DFLASHREINFORCE_CUDA=OFF", "-DFLASHREINFORCE_BUILD_TESTS=ON",
            "-DFLASHREINFORCE_BUILD_PYTHON=ON", f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DPython_EXECUTABLE={sys.executable}", "-DCMAKE_BUILD_TYPE=Release"]
    if shutil.which("ninja") and not (BUILD / "CMakeCache.txt").exists():
        args += ["-G", "Ninja"]
    subprocess.run(args, check=True, capture_output=True, text=True)
    jobs = str(max(1, min(2, os.cpu_count() or 1)))
    done = subprocess.run([cmake, "--build", str(BUILD), "-j", jobs], capture_output=True, text=True)
    assert done.returncode == 0, f"C++ build failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return BUILD


@pytest.fixture(scope="module")
def build_dir() -> Path:
    return _cmake_build()


def test_ctest_core(build_dir):
    ctest = shutil.which("ctest")
    assert ctest, "ctest not found next to cmake"
    done = subprocess.run([ctest, "--output-on-failure"], cwd=build_dir, capture_output=True, text=True, timeout=600)
    print(done.stdout[-3000:])
    assert done.returncode == 0, f"ctest failed:\n{done.stdout[-6000:]}\n{done.stderr[-2000:]}"
    assert "100% tests passed" in done.stdout


def test_cpu_only_build_rejects_cuda_tensors(build_dir):
    modules = list(build_dir.glob("_C*.so")) + list(build_dir.glob("_C*.pyd"))
    assert modules, "the CPU-only _C module was not built"
    script = textwrap.dedent(f"""
        import importlib.util
        spec = importlib.util.spec_from_file_location("_C", {str(modules[0])!r})
        C = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(C)
        assert C.has_cuda() is False
        def d(shape, dtype, dev="cuda"):
            strides, acc = [], 1
            for s in reversed(shape):
                strides.insert(0, acc); acc *= s
            return (4096, tuple(shape), tuple(strides), dtype, dev, 0)
        outs = [d((), "float32"), d((4,), "float32"), d((1,), "float32"), d((1,), "float32"), d((1,), "bool"),
                d((), "float32"), d((1,), "int64"), d((1,), "int64")]
        try:
            C.loss_forward(False, d((4,), "float32"), d((4,), "float32"), d((1,), "float32"), d((2,), "int64"),
                           None, None, None, 1e-3, 1.0, None, None, "seq-mean-token-mean", None, None, False,
                           outs, d((64,), "uint8"), d((2,), "int64"), 1, 0, True)
        except RuntimeError as e:
            assert "built without CUDA" in str(e), e
            print("ok")
        else:
            raise SystemExit("no error for CUDA tensors on a CPU-only build")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr
