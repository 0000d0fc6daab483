"""The extension's objects survive the fresh configure an editable install gets from a new isolated
build environment: scikit-build-core then deletes CMakeCache.txt and the top-level CMakeFiles/, so the
objects live under core/CMakeFiles/ (csrc/CMakeLists.txt, added as a binary subdirectory)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OBJECT = "core/CMakeFiles/fr_core.dir/core_common.cpp.o"


def _tools() -> tuple[str, str]:
    """cmake and ninja: on PATH, or the test extra's (the cmake and ninja packages put them beside the
    interpreter, which is not on PATH when the environment is not activated)."""
    here = str(Path(sys.executable).parent)
    cmake, ninja = (shutil.which(name) or shutil.which(name, path=here) for name in ("cmake", "ninja"))
    if cmake is None or ninja is None:
        pytest.skip("needs cmake and ninja: pip install -e '.[test]'")
    return cmake, ninja


def test_an_object_compiled_before_a_fresh_configure_is_not_compiled_again(tmp_path):
    cmake, ninja = _tools()
    configure = [cmake, "-S", str(ROOT), "-B", str(tmp_path), "-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}",
                 "-DFLASHREINFORCE_CUDA=OFF", "-DFLASHREINFORCE_BUILD_PYTHON=OFF", "-DCMAKE_BUILD_TYPE=Release"]
    subprocess.run(configure, check=True, capture_output=True, text=True)
    assert (tmp_path / "core" / "CMakeFiles" / "fr_core.dir").is_dir()
    assert not (tmp_path / "CMakeFiles" / "fr_core.dir").exists()
    subprocess.run([ninja, "-C", str(tmp_path), OBJECT], check=True, capture_output=True, text=True)
    # What scikit-build-core does when pip hands it a new isolated environment:
    (tmp_path / "CMakeCache.txt").unlink()
    shutil.rmtree(tmp_path / "CMakeFiles")
    subprocess.run(configure, check=True, capture_output=True, text=True)
    dry = subprocess.run([ninja, "-C", str(tmp_path), "-n", "-d", "explain", OBJECT], check=True, capture_output=True,
                         text=True)
    assert "no work to do" in dry.stdout, dry.stdout + dry.stderr


BINDINGS = "core/CMakeFiles/_C.dir/bindings.cpp.o"


def test_bindings_are_not_compiled_again_when_pybind11_comes_from_another_folder(tmp_path):
    """pip installs pybind11 into a new temporary folder for every build; its headers keep one path."""
    cmake, ninja = _tools()
    pybind11 = pytest.importorskip("pybind11")
    source = Path(pybind11.__file__).parent
    for name in ("first", "second"):  # two copies, as two build environments would hold
        shutil.copytree(source, tmp_path / name / "pybind11")
    build = tmp_path / "build"

    def configure(name: str) -> None:
        subprocess.run([cmake, "-S", str(ROOT), "-B", str(build), "-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}",
                        "-DFLASHREINFORCE_CUDA=OFF",
                        "-DCMAKE_BUILD_TYPE=Release", f"-Dpybind11_DIR={tmp_path / name / 'pybind11/share/cmake/pybind11'}"],
                       check=True, capture_output=True, text=True)

    configure("first")
    subprocess.run([ninja, "-C", str(build), BINDINGS], check=True, capture_output=True, text=True)
    shutil.rmtree(tmp_path / "first")  # the first build environment is gone, as pip removes it
    (build / "CMakeCache.txt").unlink()
    shutil.rmtree(build / "CMakeFiles")
    configure("second")
    dry = subprocess.run([ninja, "-C", str(build), "-n", "-d", "explain", BINDINGS], check=True, capture_output=True,
                         text=True)
    assert "no work to do" in dry.stdout, dry.stdout + dry.stderr
