"""The layout of benchmarks/: each script is a benchmark of its own, and what they share lives in one
module, benchmarks/common.py. No script imports another script (only ``common``), anywhere in its file
(at module level or inside a function), and every name a script takes from ``common`` is defined there.
A script that needs another benchmark's run starts it as a command (bench_tool_race.py runs
trl_tool_side.py)."""

from __future__ import annotations

import ast
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SHARED = "common"


def imported_modules(path: Path) -> dict[str, set[str]]:
    """``{top-level module: names taken from it}`` of every absolute import in ``path``, anywhere in the
    file (``import m`` takes no name; ``from m import a, b`` takes ``a`` and ``b``)."""
    found: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.setdefault(alias.name.split(".")[0], set())
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.setdefault(node.module.split(".")[0], set()).update(alias.name for alias in node.names)
    return found


def layout_problems(directory: Path) -> list[str]:
    """What breaks the rule in ``directory``: a script importing another script, ``common`` importing a
    script, or a name taken from ``common`` that it does not define."""
    scripts = {path.stem: path for path in sorted(directory.glob("*.py"))}
    shared = scripts.get(SHARED)
    defined: set[str] = set()
    if shared is not None:
        for node in ast.parse(shared.read_text(encoding="utf-8")).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, ast.Assign):
                defined.update(t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                defined.add(node.target.id)
    problems = []
    for stem, path in scripts.items():
        for module, names in sorted(imported_modules(path).items()):
            if module == SHARED and stem != SHARED:
                problems += [f"{path.name}: takes {name!r} from common.py, which does not define it"
                             for name in sorted(names - defined)]
            elif module in scripts and module != stem:
                problems.append(f"{path.name} imports the benchmark script {module}.py (only common.py may be "
                                "imported; run a script as a command)")
    return problems


def test_no_benchmark_imports_another():
    assert (BENCHMARKS / f"{SHARED}.py").is_file()
    assert layout_problems(BENCHMARKS) == []


def test_layout_check_finds_planted_imports(tmp_path):
    files = {
        "common.py": "import torch\nSHAPES = {}\ndef print_table():\n    pass\n",
        "bench_a.py": "import sys\nfrom common import SHAPES, print_table\n",
        "bench_b.py": "def main():\n    from bench_a import main as other\n",
        "bench_c.py": "import bench_b\nfrom common import missing\n",
        "bench_d.py": "from flashreinforce.ops import reference\nimport trl\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert layout_problems(tmp_path) == [
        "bench_b.py imports the benchmark script bench_a.py (only common.py may be imported; run a script as a "
        "command)",
        "bench_c.py imports the benchmark script bench_b.py (only common.py may be imported; run a script as a "
        "command)",
        "bench_c.py: takes 'missing' from common.py, which does not define it",
    ]
