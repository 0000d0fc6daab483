"""Builds the C++ core tests (CPU only) with CMake and runs them through CTest, and checks that a seed
replays the C++ test's random cases.

The build directory (build/cpp-tests under the repository) is reused between runs, so only the
first run compiles. The same build also produces a CPU-only flashreinforce._C, used to check the
error a CPU-only build gives for CUDA tensors and the structural checks of the raw binding.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build" / "cpp-tests"


def _tool(name: str) -> str | None:
    """A command of this interpreter's environment (the test extra's cmake), else from PATH: a suite run
    as `venv/bin/python -m pytest` without an activated environment has the former not on its PATH."""
    return shutil.which(name, path=os.pathsep.join([sysconfig.get_path("scripts"), os.environ.get("PATH", "")]))


def _cmake_build() -> Path:
    cmake = _tool("cmake")
    if cmake is None:
        pytest.fail("cmake is required to build the C++ tests (pip install cmake)")
    import pybind11

    args = [cmake, "-S", str(ROOT), "-B", str(BUILD), "-DFLASHREINFORCE_CUDA=OFF", "-DFLASHREINFORCE_BUILD_TESTS=ON",
            "-DFLASHREINFORCE_BUILD_PYTHON=ON", f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DPython_EXECUTABLE={sys.executable}", "-DCMAKE_BUILD_TYPE=Release"]
    if _tool("ninja") and not (BUILD / "CMakeCache.txt").exists():
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
    ctest = _tool("ctest")
    assert ctest, "ctest not found (it comes with cmake)"
    done = subprocess.run([ctest, "--output-on-failure"], cwd=build_dir, capture_output=True, text=True, timeout=600)
    print(done.stdout[-3000:])
    assert done.returncode == 0, f"ctest failed:\n{done.stdout[-6000:]}\n{done.stderr[-2000:]}"
    assert "100% tests passed" in done.stdout


def _run_core(build_dir: Path, *args: str, seed_env: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "FR_TEST_SEED"}
    if seed_env is not None:
        env["FR_TEST_SEED"] = seed_env
    return subprocess.run([str(build_dir / "test_core"), *args], capture_output=True, text=True, timeout=600, env=env)


def test_core_replays_a_seed(build_dir):
    """``test_core --seed S`` draws the cases of seed S: two runs print the seed, the command that
    replays it and the same draws, and pass; another seed draws other cases. FR_TEST_SEED is read
    when no seed is given (an invalid one is refused, naming it), and a malformed seed is refused."""
    seed = 20240511
    first, again = _run_core(build_dir, "--seed", str(seed)), _run_core(build_dir, "--seed", str(seed))
    for done in (first, again):
        assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        assert done.stdout.startswith(f"seed {seed} (replay: ") and f" --seed {seed})" in done.stdout.splitlines()[0]
        assert "all core checks passed" in done.stdout
    assert first.stdout == again.stdout
    draw = [line for line in first.stdout.splitlines() if line.startswith(f"seed {seed}: next draw")]
    assert len(draw) == 1, first.stdout
    other = _run_core(build_dir, str(seed + 1))  # the positional form scripts/check_cpu_isas.sh uses
    assert other.returncode == 0 and other.stdout.startswith(f"seed {seed + 1} ")
    assert f"seed {seed + 1}: next draw" in other.stdout and draw[0].split()[-1] not in other.stdout
    refused = _run_core(build_dir, seed_env="12x")
    assert refused.returncode == 2 and "FR_TEST_SEED" in refused.stderr and "'12x'" in refused.stderr
    for args in (["--seed", "-3"], ["--seed"], ["--sead", "3"]):
        done = _run_core(build_dir, *args)
        assert done.returncode == 2 and "usage:" in done.stderr, (args, done.stderr)


def _load_module(build_dir: Path) -> str:
    modules = list(build_dir.glob("_C*.so")) + list(build_dir.glob("_C*.pyd"))
    assert modules, "the CPU-only _C module was not built"
    return textwrap.dedent(f"""
        import importlib.util
        spec = importlib.util.spec_from_file_location("_C", {str(modules[0])!r})
        C = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(C)
    """)


# The raw binding's three dicts (flashreinforce/ops/fused.py builds them from tensors): views by
# name (data_ptr, numel, dtype), the options, and the launch. Here with fake device pointers.
_RAW_CALL = textwrap.dedent("""
    views = dict(log_probs=(4096, 4, "float32"), behavior_log_probs=(4096, 4, "float32"),
                 rewards=(4096, 1, "float32"), cu_seqlens=(4096, 2, "int64"), action_mask=None, entropies=None,
                 failures=None, loss=(4096, 1, "float32"), grad=(4096, 4, "float32"),
                 advantages=(4096, 1, "float32"), sequence_kl=(4096, 1, "float32"), admitted=(4096, 1, "bool"),
                 acceptance_rate=(4096, 1, "float32"), policy_tokens=(4096, 1, "int64"),
                 retained_tokens=(4096, 1, "int64"), workspace=(4096, 64, "uint8"), error_record=(4096, 2, "int64"))
    options = dict(delta=1e-3, negative_token_fraction=1.0, reward_baseline=None, num_trajectories=None,
                   loss_agg="seq-mean-token-mean", loss_scale_factor=None, num_policy_tokens=None, no_is=False,
                   gate_metric="binary_kl", is_truncation=float("inf"))
    launch = dict(device="cuda", padded_row_length=0, num_threads=1, stream=0, synchronize=True)
""")


def test_cpu_only_build_rejects_cuda_tensors(build_dir):
    script = _load_module(build_dir) + _RAW_CALL + textwrap.dedent("""
        assert C.has_cuda() is False and C.cuda_workspace_bytes(4, 1, False) == 0
        try:
            C.loss_forward(views, options, launch)
        except RuntimeError as e:
            assert "built without CUDA" in str(e), e
            print("ok")
        else:
            raise SystemExit("no error for CUDA tensors on a CPU-only build")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr


def test_raw_binding_checks_the_structure_it_relies_on(build_dir):
    """Malformed views never reach the core: a RuntimeError naming the field (the public entry
    points validate everything before, so only direct calls of the private binding meet these)."""
    script = _load_module(build_dir) + _RAW_CALL + textwrap.dedent("""
        import copy
        def fails(change, fragment):
            v, o, l = copy.deepcopy(views), dict(options), dict(launch)
            change(v, o, l)
            try:
                C.loss_forward(v, o, l)
            except RuntimeError as e:
                assert fragment in str(e), (fragment, str(e))
            else:
                raise SystemExit(f"no error for {fragment}")
        fails(lambda v, o, l: v.update(grad=(4096, 3, "float32")), "grad")
        fails(lambda v, o, l: v.update(behavior_log_probs=None), "behavior_log_probs")
        fails(lambda v, o, l: v.update(cu_seqlens=(4096, 3, "int64")), "cu_seqlens")
        fails(lambda v, o, l: v.update(rewards=(4096, 1, "bool")), "rewards")
        fails(lambda v, o, l: v.update(bogus=(4096, 1, "bool")), "unknown view 'bogus'")
        fails(lambda v, o, l: v.update(log_probs=(4096, 4, "complex64")), "unsupported dtype 'complex64'")
        fails(lambda v, o, l: o.update(negative_token_fraction=0.5), "entropies")
        fails(lambda v, o, l: o.update(loss_agg="sum"), "loss_agg")
        fails(lambda v, o, l: l.update(device="meta"), "device")
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr


def test_binding_names_match_the_contract():
    """The binding's views and error codes are the contract's outputs and ErrorCode, in order."""
    from flashreinforce import _C
    from flashreinforce.ops import contract

    views = _C.view_names()
    assert views[-len(contract.OUTPUT_NAMES):] == contract.OUTPUT_NAMES
    assert [c.name.lower() for c in contract.ErrorCode] == list(_C.error_code_names())


# The instruction-set files of the CPU path (csrc/cpu/main_pass_*.cpp) and their namespaces.
_ISA_OBJECTS = {"generic": "isa_generic", "avx2": "isa_avx2", "avx512": "isa_avx512"}


def _isa_objects(build_dir: Path) -> dict:
    # the core library is built in the binary subdirectory core/ (csrc/CMakeLists.txt)
    objects = build_dir / "core" / "CMakeFiles" / "fr_core.dir" / "cpu"
    found = {name: objects / f"main_pass_{name}.cpp.o" for name in _ISA_OBJECTS}
    found = {name: path for name, path in found.items() if path.exists()}
    assert "generic" in found, f"no object files of the CPU path under {objects}"
    return found


def _avx512_bf16_objects(build_dir: Path) -> dict:
    """The objects built where the compiler takes -mavx512bf16: the skinny products' AVX-512 files
    (csrc/cpu/skinny_gemm_avx512*.cpp) and the bfloat16 decode attention's AVX-512 BF16 file
    (csrc/cpu/decode_attention_avx512_bf16.cpp), with what each may define externally."""
    objects = build_dir / "core" / "CMakeFiles" / "fr_core.dir" / "cpu"
    entries = {"skinny_gemm_avx512.cpp.o": "flashreinforce::cpu::skinny_panels_avx512_f32(",
               "skinny_gemm_avx512_bf16.cpp.o": "flashreinforce::cpu::skinny_panels_avx512_bf16(",
               "decode_attention_avx512_bf16.cpp.o": "flashreinforce::cpu::isa_avx512_bf16::"}
    return {objects / name: entry for name, entry in entries.items() if (objects / name).exists()}


def test_instruction_set_files_share_no_code(build_dir):
    """An instruction-set file defines nothing outside its own namespace (or entry point) that is global
    or weak: an inline function or template instance that several files emit is kept once by the
    linker, maybe from the AVX-512 file, and then runs in the generic code on any CPU. Nor does it run
    anything at load time (a static initializer would run before the CPU check)."""
    nm, objdump = shutil.which("nm"), shutil.which("objdump")
    if nm is None or objdump is None:
        pytest.skip("nm / objdump (binutils) not found")
    objects = _isa_objects(build_dir)
    if platform.machine() in ("x86_64", "AMD64"):
        assert set(objects) == set(_ISA_OBJECTS), f"x86-64 builds compile every instruction set: {objects}"
    # What each file may define externally: its namespace (the main pass, the bfloat16 attention's
    # AVX-512 BF16 file) or its one entry point (the skinny products' kernels, skinny_gemm_isa.h).
    allowed = {path: f"flashreinforce::cpu::{_ISA_OBJECTS[name]}::" for name, path in objects.items()}
    bf16_files = _avx512_bf16_objects(build_dir)
    if platform.machine() in ("x86_64", "AMD64") and len(bf16_files) != 3:
        pytest.fail("x86-64 builds with GCC or Clang compile the skinny products' AVX-512 files and the bfloat16 "
                    f"attention's AVX-512 BF16 file; found {[p.name for p in bf16_files]}")
    allowed.update(bf16_files)
    problems = []
    for path, prefix in allowed.items():
        listing = subprocess.run([nm, "--defined-only", "-C", str(path)], capture_output=True, text=True, check=True)
        for line in listing.stdout.splitlines():
            _, kind, symbol = line.split(" ", 2)
            external = kind.isupper() or kind in "uvw"  # global, weak or unique
            # The personality pointer of C++ exception handling: data, the same in every object.
            if external and prefix not in symbol and symbol != "DW.ref.__gxx_personality_v0":
                problems.append(f"{path.name}: {kind} {symbol}")
        sections = subprocess.run([objdump, "-h", str(path)], capture_output=True, text=True, check=True).stdout
        problems += [f"{path.name}: static initializers ({s})" for s in (".init_array", ".ctors") if s in sections]
    assert not problems, "\n".join(problems)
