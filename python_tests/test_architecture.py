"""The import rules of docs/architecture.md: each package, imported alone in a fresh interpreter,
pulls in nothing it must not depend on."""

import json
import subprocess
import sys

import pytest

# package -> prefixes that must not be in sys.modules after importing it
RULES = {
    "flashreinforce.ops": ["transformers", "flashreinforce.trainer", "flashreinforce.engines", "flashreinforce.envs",
                           "flashreinforce.config", "flashreinforce.models", "flashreinforce.distributed"],
    "flashreinforce.config": ["torch", "transformers", "flashreinforce.trainer", "flashreinforce.ops",
                              "flashreinforce.envs", "flashreinforce.models", "flashreinforce.engines"],
    "flashreinforce.envs.registry": ["torch", "flashreinforce.trainer", "flashreinforce.engines",
                                     "flashreinforce.models"],
    "flashreinforce.models.loading": ["transformers", "flashreinforce.trainer", "flashreinforce.engines",
                                      "flashreinforce.envs"],
    "flashreinforce.engines": ["transformers", "vllm", "flashreinforce.trainer", "flashreinforce.envs"],
    "flashreinforce.trainer": ["transformers", "ray", "vllm", "flashreinforce.distributed", "flashreinforce.cli"],
    "flashreinforce.experiments": ["torch", "flashreinforce.trainer"],
    "flashreinforce.cli": ["torch", "transformers", "flashreinforce.trainer"],
    "flashreinforce.analysis": ["torch", "matplotlib", "flashreinforce.trainer", "flashreinforce.config"],
}


@pytest.mark.parametrize("package", sorted(RULES))
def test_package_imports_only_what_it_may(package):
    code = (f"import json, sys, {package}\n"
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    bad = sorted({p for p in RULES[package] for m in loaded if m == p or m.startswith(p + ".")})
    assert bad == [], f"importing {package} loads {bad}"
