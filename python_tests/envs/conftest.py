"""Environment tests: the sandbox attack suite's numbers in the terminal summary."""

from __future__ import annotations

import sys


def pytest_terminal_summary(terminalreporter):
    module = sys.modules.get("python_tests.envs.test_sandbox_attacks")
    if module is None or not getattr(module, "OUTCOMES", None):
        return
    terminalreporter.section("sandbox attack suite")
    for line in module.summary():
        terminalreporter.write_line(line)
