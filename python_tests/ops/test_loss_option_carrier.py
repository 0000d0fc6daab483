"""LossOptions is the one carrier of the loss options, from the typed configuration to the core's struct.

A new option is its field in ``flashreinforce.objective.LossOptions`` (with its metadata), its row in the
core's field table (csrc/flashreinforce/core.h), the kernels that read it, its reference line and its test.
These tests plant an option in a copy of the definition and show every derived piece picking it up (the
trainer's flag and configuration field, the public loss functions' keywords, the op's options argument,
the resume table, its loss mode's flags), check that the core's table and the Python definition agree, and
count the files that name each existing option outside the kernels and the reference.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from flashreinforce import objective

ROOT = Path(__file__).resolve().parents[2]


def test_a_planted_option_reaches_every_derived_place():
    """In a fresh process whose LossOptions has one more kernel option, ``planted_cap`` (the one edit an
    author makes in Python), the flag, the configuration field, the loss mode's flags, the resume table,
    the public keywords and their documentation, and the op's argument all have it."""
    script = Path(__file__).with_name("planted_option.py")
    done = subprocess.run([sys.executable, str(script), str(ROOT)], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert done.returncode == 0 and "planted option: ok" in done.stdout, done.stderr[-3000:]


def test_a_bad_value_of_an_option_names_its_flag():
    from flashreinforce.config import TrainerConfig
    from flashreinforce.config.schema import ConfigError

    cfg = TrainerConfig()
    cfg.set("actor.is_truncation", 0.5)
    with pytest.raises(ConfigError, match=r"^actor\.is_truncation must be a number >= 1"):
        cfg.loss_options()
    assert objective.flag_message(ValueError("delta must be x")) == "actor.flash_gate_delta must be x"


def test_the_cores_table_and_the_definition_list_the_same_options():
    from flashreinforce import _C
    from flashreinforce.ops import contract

    rows = _C.loss_option_fields()
    assert sorted(name for name, _, _ in rows) == sorted(contract.OP_OPTION_NAMES)
    for f in objective.OPTION_FIELDS:
        if f.metadata["choices"]:
            assert dict((n, c) for n, _, c in rows)[f.name] == f.metadata["choices"], f.name


@pytest.mark.parametrize("change, message", [("extra", "unknown option 'planted_cap'"),
                                             ("missing", "options: missing 'is_truncation'")])
def test_the_bindings_fill_the_struct_from_the_table_only(monkeypatch, change, message):
    """The bindings read exactly the table's fields: an option the table lacks, or a field the caller left
    out, is refused by name."""
    import torch

    from flashreinforce.ops import contract, fused

    def mapping(packed):
        out = dict(contract.options_mapping(packed))
        if change == "extra":
            out["planted_cap"] = 2.0
        else:
            del out["is_truncation"]
        return out

    monkeypatch.setattr(fused, "_options_mapping", mapping)
    lp = torch.full((4,), -0.5)
    with pytest.raises(RuntimeError, match=message):
        fused.flashreinforce_loss_packed(lp, lp, torch.tensor([1.0, 0.0]), torch.tensor([0, 2, 4]))


def test_the_bindings_name_no_option():
    text = (ROOT / "csrc" / "bindings.cpp").read_text()
    named = [n for n in objective.KERNEL_OPTIONS + ("reward_baseline", "num_trajectories", "num_policy_tokens")
             if re.search(rf"\b{n}\b", text)]
    assert named == []


#: What implements an option's math, and so changes with a new option by nature: the CPU and CUDA kernels,
#: the per-token and per-trajectory math they share, the core's structure check, and the reference.
KERNEL_FILES = ("csrc/cpu/", "csrc/cuda/", "csrc/flashreinforce/token_math.h", "csrc/flashreinforce/trajectory.h",
                "csrc/core_common.cpp", "flashreinforce/ops/reference.py")
#: The definition and the core's struct and table: the two places an option is declared.
DECLARING_FILES = {"flashreinforce/objective.py", "csrc/flashreinforce/core.h"}
#: Files that use an option's name for something else (the OpenAI streaming format's "delta").
UNRELATED = {("delta", "flashreinforce/agents/protocol.py")}


def files_naming(name: str, root: Path = ROOT) -> set[str]:
    out = set()
    for path in list((root / "flashreinforce").rglob("*.py")) + list((root / "csrc").rglob("*")):
        rel = path.relative_to(root).as_posix()
        if not path.is_file() or rel.startswith(KERNEL_FILES):
            continue
        if re.search(rf"(?<![\w\-]){re.escape(name)}\b", path.read_text(errors="replace")):
            out.add(rel)
    return out


@pytest.mark.parametrize("field", [f.name for f in objective.OPTION_FIELDS if f.metadata["kernel"]])
def test_a_kernel_option_is_named_only_where_it_is_declared(field):
    """Besides the kernels and the reference (which implement it) and the tests and docs, a kernel option is
    named only by its definition and the core's struct: adding one is then at most 5 files (definition,
    core.h, the kernel, the reference, its test), none of them the plumbing between (the op, the bindings,
    the configuration, the resume rules). The loss modes may read an option they act on (the token-mean
    denominator), and the contract states the entropy filter's needs."""
    allowed = DECLARING_FILES | {"flashreinforce/ops/loss_modes.py", "flashreinforce/ops/contract.py"}
    allowed |= {path for name, path in UNRELATED if name == field}
    assert files_naming(field) <= allowed, files_naming(field) - allowed


def test_the_count_catches_a_file_that_names_an_option(tmp_path):
    """The count above is able to fail: a module that spells out an option is found (and a kernel is not)."""
    (tmp_path / "flashreinforce" / "ops").mkdir(parents=True)
    (tmp_path / "csrc" / "cpu").mkdir(parents=True)
    (tmp_path / "flashreinforce" / "ops" / "user.py").write_text("def f(options):\n    return options.gate_metric\n")
    (tmp_path / "csrc" / "cpu" / "kernel.cpp").write_text("double g(const LossOptions& o) { return o.gate_metric; }\n")
    assert files_naming("gate_metric", tmp_path) == {"flashreinforce/ops/user.py"}
