"""The CPU path chooses its instruction set at run time and never runs code compiled for one the CPU
lacks (docs/kernel.md, "Instruction sets").

* Every public function of ``flashreinforce._C`` (python_tests/ops/cpu_entry_points.py), in
  subprocesses with ``FLASHREINFORCE_CPU_ISA`` forced down to ``generic``, ``avx2`` and ``avx512``
  (AVX-512 without its BF16 extension).
* The same on emulated CPUs without AVX-512 (Haswell: AVX2 + FMA) and without AVX (Nehalem), through
  ``qemu-x86_64`` from Debian's qemu-user when it is installed (skipped, with the reason, otherwise):
  a run must choose the best instruction set of the emulated CPU, and give bit for bit the
  float32-compute results of the native run of that instruction set.

The symbols of the instruction-set object files are checked in test_cpp_core.py.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flashreinforce import _C

SCRIPT = Path(__file__).with_name("cpu_entry_points.py")


def _entry_points(isa: str | None = None, emulate: str | None = None) -> dict:
    env = dict(os.environ)
    env.pop("FLASHREINFORCE_CPU_ISA", None)
    if isa is not None:
        env["FLASHREINFORCE_CPU_ISA"] = isa
    command = [sys.executable, str(SCRIPT), _C.__file__]
    if emulate is not None:
        command = [shutil.which("qemu-x86_64"), "-cpu", emulate] + command
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{command} (FLASHREINFORCE_CPU_ISA={isa}) exited with {done.returncode}:\n" \
                                 f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def native() -> dict:
    """The native runs: default (the best instruction set of this CPU), and each forced one."""
    runs = {"best": _entry_points()}
    for isa in ("generic", "avx2", "avx512"):
        runs[isa] = _entry_points(isa)
    return runs


def test_every_entry_point_with_the_instruction_set_forced_down(native):
    best = native["best"]["isa"]
    print("this CPU's instruction set:", best, "with AVX-512 BF16" if native["best"]["avx512_bf16"] else "")
    assert best in ("generic", "avx2", "avx512")
    assert native["generic"]["isa"] == "generic"
    assert native["avx2"]["isa"] == ("generic" if best == "generic" else "avx2")
    assert native["avx512"]["isa"] == best  # avx512 lowers nothing but the BF16 extension
    assert native["best"]["avx512_bf16"] == bool(_C.cpu_avx512_bf16())
    assert not (native["generic"]["avx512_bf16"] or native["avx2"]["avx512_bf16"] or native["avx512"]["avx512_bf16"])
    if native["best"]["avx512_bf16"]:
        assert best == "avx512"
    calls = {run["calls"] for run in native.values()}
    assert len(calls) == 1 and calls.pop() > 60


@pytest.mark.parametrize("cpu,isa,expected", [("Haswell", None, "avx2"), ("Haswell", "generic", "generic"),
                                              ("Nehalem", None, "generic")])
def test_emulated_cpu_without_avx512(native, cpu, isa, expected):
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"emulates x86-64 CPU models; this machine is {platform.machine()}")
    if shutil.which("qemu-x86_64") is None:
        pytest.skip("qemu-x86_64 is not installed (Debian / Ubuntu: apt-get install qemu-user)")
    emulated = _entry_points(isa, emulate=cpu)
    assert emulated["isa"] == expected, emulated
    if native[expected]["isa"] != expected:
        pytest.skip(f"this CPU cannot run {expected} natively to compare the results with (it ran {emulated})")
    assert emulated["float32"] == native[expected]["float32"], (emulated, native[expected])
