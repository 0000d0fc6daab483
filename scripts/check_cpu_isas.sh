#!/usr/bin/env bash
# The CPU path on CPUs this machine is not, through Debian's qemu-user and aarch64 cross compiler
# (apt-get install qemu-user g++-aarch64-linux-gnu; plus cmake and a C++ compiler). 10-20 minutes on
# 2 cores (emulation is slow); run it after changing csrc/cpu or csrc/flashreinforce/token_math.h.
#
#   x86       the C++ core tests (cpp_tests/test_core.cpp) built for this machine, run on emulated
#             x86-64 CPUs without AVX-512 (Haswell: AVX2 + FMA, the AVX2 kernels) and without AVX
#             (Nehalem: the generic ones): no instruction the CPU lacks, and the results hold;
#   aarch64   the core cross-compiled for AArch64 (CMake, aarch64-linux-gnu-g++: the generic kernels,
#             vectorized with NEON by the compiler); every `#pragma omp simd` loop of the main pass and
#             the filter must be reported vectorized (-fopt-info-vec), and test_core, linked
#             statically, must pass under qemu-aarch64.
#
#   bash scripts/check_cpu_isas.sh              # both
#   CHECK_CPU_ISAS=aarch64 bash scripts/check_cpu_isas.sh
#
# python_tests/ops/test_cpu_isa.py runs the Python entry points on the emulated x86 CPUs within the
# test suite when qemu-x86_64 is installed; this script is the longer check. The exit status is that
# of the first failure; every stage runs.
set -uo pipefail
cd "$(dirname "$0")/.."
STAGES="${CHECK_CPU_ISAS:-x86 aarch64}"
JOBS="$(( $(nproc) < 4 ? $(nproc) : 4 ))"
status=0
fail() { echo "FAILED: $*"; [ "$status" -ne 0 ] || status=1; }
need() { command -v "$1" > /dev/null || { echo "missing $1 ($2)"; exit 2; }; }
need cmake "pip install cmake"

if [[ " $STAGES " == *" x86 "* ]]; then
  need qemu-x86_64 "apt-get install qemu-user"
  echo "== x86: test_core on emulated CPUs"
  cmake -S . -B build/isa-x86 -DFLASHREINFORCE_CUDA=OFF -DFLASHREINFORCE_BUILD_PYTHON=OFF \
    -DFLASHREINFORCE_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Release > /dev/null &&
    cmake --build build/isa-x86 -j "$JOBS" --target test_core > /dev/null || fail "x86 build"
  seed="${FR_TEST_SEED:-$RANDOM$RANDOM}"
  for cpu in Haswell Nehalem; do
    echo "-- qemu-x86_64 -cpu $cpu build/isa-x86/test_core $seed"
    # qemu warns about CPU features its emulation lacks (e.g. pcid); those do not matter here.
    qemu-x86_64 -cpu "$cpu" build/isa-x86/test_core "$seed" 2>&1 | grep -v "TCG doesn't support"
    [ "${PIPESTATUS[0]}" -eq 0 ] || fail "test_core on an emulated $cpu"
  done
fi

if [[ " $STAGES " == *" aarch64 "* ]]; then
  need aarch64-linux-gnu-g++ "apt-get install g++-aarch64-linux-gnu"
  need qemu-aarch64 "apt-get install qemu-user"
  echo "== aarch64: cross build, vectorization report, test_core under qemu-aarch64"
  cmake -S . -B build/isa-aarch64 -DCMAKE_SYSTEM_NAME=Linux -DCMAKE_SYSTEM_PROCESSOR=aarch64 \
    -DCMAKE_CXX_COMPILER=aarch64-linux-gnu-g++ -DCMAKE_EXE_LINKER_FLAGS=-static -DCMAKE_EXPORT_COMPILE_COMMANDS=ON \
    -DFLASHREINFORCE_CUDA=OFF \
    -DFLASHREINFORCE_BUILD_PYTHON=OFF -DFLASHREINFORCE_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Release > /dev/null &&
    cmake --build build/isa-aarch64 -j "$JOBS" --target test_core > /dev/null || fail "aarch64 build"
  # The compiler's report on the generic kernels: their file compiled again with the build's own
  # command line (compile_commands.json) and -fopt-info-vec-optimized.
  report="$PWD/build/isa-aarch64/vectorized.txt"
  rm -f "$report"
  python3 - build/isa-aarch64 "$report" <<'PY' || fail "vectorization report"
import json, shlex, subprocess, sys
build, report = sys.argv[1], sys.argv[2]
entries = json.load(open(f"{build}/compile_commands.json"))
entry = next(e for e in entries if e["file"].endswith("csrc/cpu/main_pass_generic.cpp"))
args = shlex.split(entry["command"])
args[args.index("-o") + 1] = "/dev/null"
subprocess.run(args + [f"-fopt-info-vec-optimized={report}"], cwd=entry["directory"], check=True)
PY
  # Each `#pragma omp simd` loop must have a "loop vectorized" report inside it (GCC reports a line
  # of the loop's body, or of the lambda it calls).
  [ -f "$report" ] && python3 - "$report" <<'PY' || fail "loops of the main pass or the filter not vectorized for aarch64"
import re, sys
reported = {}
for line in open(sys.argv[1]):
    m = re.search(r"csrc/cpu/(\w+\.h):(\d+):\d+: optimized: loop vectorized", line)
    if m:
        reported.setdefault(m.group(1), set()).add(int(m.group(2)))
missing = []
for name in ("main_pass_impl.h", "filter_impl.h"):
    src = open(f"csrc/cpu/{name}").read().splitlines()
    def span(start):  # lines [start, end] of the statement opening at `start` (braces or one line)
        depth, seen = 0, False
        for i in range(start, len(src)):
            depth += src[i].count("{") - src[i].count("}")
            seen = seen or "{" in src[i]
            if (seen and depth <= 0) or (not seen and src[i].rstrip().endswith(";")):
                return start + 1, i + 1
        return start + 1, len(src)
    lambdas = {m.group(1): span(i) for i, l in enumerate(src) if (m := re.search(r"auto (\w+) = \[", l))}
    for i, l in enumerate(src):
        if "#pragma omp simd" not in l:
            continue
        lo, hi = span(i + 1)
        ranges = [(i + 1, hi)] + [lambdas[f] for f in lambdas if re.search(rf"\b{f}\(", "\n".join(src[lo - 1:hi]))]
        hits = [n for n in reported.get(name, ()) if any(a <= n <= b for a, b in ranges)]
        print(f"   {name}:{i + 1} {'vectorized' if hits else 'NOT vectorized'}: {src[i + 1].strip()[:70]}")
        if not hits:
            missing.append(f"{name}:{i + 1}")
sys.exit(1 if missing else 0)
PY
  echo "-- qemu-aarch64 build/isa-aarch64/test_core"
  qemu-aarch64 build/isa-aarch64/test_core ${FR_TEST_SEED:+"$FR_TEST_SEED"} || fail "test_core under qemu-aarch64"
fi

[ "$status" -eq 0 ] && echo "check_cpu_isas: all passed" || echo "check_cpu_isas: FAILED"
exit "$status"
