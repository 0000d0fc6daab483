"""The import rules of docs/architecture.md: each package, imported alone in a fresh interpreter,
pulls in nothing it must not depend on; the trainer's subpackages import each other only in
data-flow order, and the trainer never imports the scale-out layer, not even inside functions; no
modules import each other in a circle; no module is over 600 lines and no package folder holds more
than 12 modules. The vocabulary rules: the typed configuration is read by attribute past the boundary
that reads flat flag names; no module names a loss mode but the registry and the modes' own module.
Registries live in the package that owns their extension point and hold registered objects, not
"module:Class" strings."""

import ast
import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

# package -> prefixes that must not be in sys.modules after importing it
RULES = {
    # The objective's options and names: the standard library only, so that every layer may import it.
    "flashreinforce.objective": ["torch", "numpy", "transformers", "flashreinforce.ops", "flashreinforce.config",
                                 "flashreinforce.trainer", "flashreinforce.envs", "flashreinforce.models",
                                 "flashreinforce.engines"],
    "flashreinforce.ops": ["transformers", "flashreinforce.trainer", "flashreinforce.engines", "flashreinforce.envs",
                           "flashreinforce.config", "flashreinforce.models", "flashreinforce.distributed"],
    "flashreinforce.config": ["torch", "transformers", "flashreinforce.trainer", "flashreinforce.ops",
                              "flashreinforce.envs", "flashreinforce.models", "flashreinforce.engines"],
    "flashreinforce.envs.registry": ["torch", "flashreinforce.trainer", "flashreinforce.engines",
                                     "flashreinforce.models"],
    "flashreinforce.models.loading": ["transformers", "flashreinforce.trainer", "flashreinforce.engines",
                                      "flashreinforce.envs"],
    # Engines: importing the package or its registry loads no torch and no engine (the configuration
    # lists the engines' names through the registry); an engine's own package loads torch.
    "flashreinforce.engines": ["torch", "transformers", "vllm", "flashreinforce.trainer", "flashreinforce.envs",
                               "flashreinforce.config", "flashreinforce.engines.hf", "flashreinforce.engines.vllm"],
    "flashreinforce.engines.hf": ["transformers", "vllm", "flashreinforce.trainer", "flashreinforce.envs",
                                  "flashreinforce.config", "flashreinforce.engines.vllm"],
    "flashreinforce.engines.vllm": ["vllm", "flashreinforce.trainer", "flashreinforce.envs", "flashreinforce.config",
                                    "flashreinforce.engines.hf"],
    "flashreinforce.trainer": ["transformers", "ray", "vllm", "flashreinforce.distributed", "flashreinforce.cli"],
    "flashreinforce.experiments": ["torch", "flashreinforce.trainer"],
    # The agent endpoint, the wire format and the chat rendering: no torch, and FastAPI, uvicorn and
    # openai only once a server starts.
    "flashreinforce.agents.server": ["torch", "transformers", "fastapi", "uvicorn", "openai", "flashreinforce.trainer",
                                     "flashreinforce.engines"],
    "flashreinforce.agents.chat": ["torch", "transformers", "flashreinforce.trainer", "flashreinforce.engines"],
    # The agent environment (``--env agent``): what the environment registry imports, without the endpoint.
    "flashreinforce.agents.environment": ["torch", "openai", "fastapi", "flashreinforce.trainer",
                                          "flashreinforce.agents.server", "flashreinforce.agents.worker"],
    "flashreinforce.cli": ["torch", "transformers", "flashreinforce.trainer"],
    "flashreinforce.analysis": ["torch", "matplotlib", "flashreinforce.trainer", "flashreinforce.config"],
}


@pytest.mark.parametrize("package", sorted(RULES))
def test_package_imports_only_what_it_may(package):
    code = (f"import json, sys, {package}\n"
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    bad = sorted({p for p in RULES[package] for m in loaded if m == p or m.startswith(p + ".")})
    assert bad == [], f"importing {package} loads {bad}"


# ------------------------------------------------------------------ import cycles and module size
PACKAGE_DIR = Path(__file__).resolve().parents[1] / "flashreinforce"
MAX_MODULE_LINES = 600
# Import cycles not broken yet, each as the exact set of modules of its strongly connected component
# (a component that grows or changes is reported). Remove an entry when its cycle is gone.
KNOWN_CYCLES: set[frozenset[str]] = set()

# Modules built from csrc/ (CMakeLists.txt), not in the source tree: ``from flashreinforce import _C``
# imports the extension, not the package's ``__init__``.
COMPILED_MODULES = ("flashreinforce._C",)


def _module_files() -> dict[str, Path]:
    """``{dotted module name: file}`` of every module of the package (a package is its ``__init__``)."""
    files = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(parts)] = path
    return files


def _imported_modules(name: str, path: Path, modules: set[str]) -> set[str]:
    """The package's modules that module ``name`` imports anywhere in its file: at module level, in
    functions and methods, under ``try`` or ``if``. ``from pkg import x`` counts as importing
    ``pkg.x`` when that is a module, else ``pkg``. Importing ``a.b.c`` counts as importing ``a.b.c``
    alone (not its parent packages, whose ``__init__`` Python runs first without it being a cycle);
    names given to ``importlib`` as strings are not seen."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules)
    return found


def import_graph() -> dict[str, set[str]]:
    """``{module: the package's modules it imports}`` over the whole package."""
    files = _module_files()
    modules = set(files) | set(COMPILED_MODULES)
    graph = {name: _imported_modules(name, path, modules) for name, path in files.items()}
    return {**graph, **{name: set() for name in COMPILED_MODULES}}  # the extension imports no Python module


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module, and the modules that
    import themselves (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    cycles.append(sorted(component))
    return sorted(cycles)


def test_cycle_finder_sees_lazy_relative_and_from_imports(tmp_path):
    files = {
        "pkg/__init__.py": "from pkg.a import f\n",
        "pkg/a.py": "def f():\n    from . import b\n",
        "pkg/b.py": "try:\n    from pkg.sub import c\nexcept ImportError:\n    pass\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "class C:\n    def m(self):\n        import pkg.a\n",
        "pkg/d.py": "import pkg.d\n",
        "pkg/e.py": "from .sub import c\nfrom pkg import d\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    modules = {"pkg", "pkg.a", "pkg.b", "pkg.sub", "pkg.sub.c", "pkg.d", "pkg.e"}
    graph = {}
    for m in modules:
        rel = m.replace(".", "/")
        path = tmp_path / (rel + "/__init__.py" if m in ("pkg", "pkg.sub") else rel + ".py")
        graph[m] = _imported_modules(m, path, modules)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.sub.c"] == {"pkg.a"}
    assert graph["pkg.e"] == {"pkg.sub.c", "pkg.d"} and graph["pkg"] == {"pkg.a"}
    assert import_cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c"], ["pkg.d"]]


def test_compiled_modules_are_the_ones_the_build_makes():
    root = PACKAGE_DIR.parent  # the top-level CMakeLists.txt adds csrc/ (the module's targets live there)
    cmake = "\n".join((root / p).read_text(encoding="utf-8") for p in ("CMakeLists.txt", "csrc/CMakeLists.txt"))
    for name in COMPILED_MODULES:
        package, _, module = name.rpartition(".")
        assert f"pybind11_add_module({module} " in cmake and f"DESTINATION {package.replace('.', '/')})" in cmake, name


def test_no_import_cycles_counting_lazy_imports():
    cycles = [c for c in import_cycles(import_graph()) if frozenset(c) not in KNOWN_CYCLES]
    assert cycles == [], "import cycles (lazy imports included):\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_module_is_over_the_line_limit():
    long = {name: n for name, path in _module_files().items()
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES}
    assert long == {}, f"modules over {MAX_MODULE_LINES} lines: {long}"


# ------------------------------------------------------------------ layers inside the package, counting lazy imports
# package -> (prefixes its modules must not import, even inside functions; the exceptions to them).
# The trainer's subpackages in data-flow order: rollout (workers, the buffer, the trajectory record)
# -> learning (packing, scoring, the optimizer step) -> reporting and persistence beside the loop ->
# run (the loop and the parts it builds), the only one that imports the others. ``errors`` is below
# them all. The scale-out layer (``distributed``) sits above the trainer: a run receives it as a
# ``ScaleOut`` from its caller.
TRAINER = "flashreinforce.trainer"
AGENTS = "flashreinforce.agents"
# The agents' modules below the trainer: the endpoint, the wire format, the chat rendering, the tool
# parsers and templates, and the agent environment.
AGENT_LOWER_MODULES = ("chat", "protocol", "server", "serving", "templates", "toolcalls", "environment")
LAYER_RULES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    f"{TRAINER}.errors": ((f"{TRAINER}.rollout", f"{TRAINER}.learning", f"{TRAINER}.reporting",
                           f"{TRAINER}.persistence", f"{TRAINER}.run"), ()),
    # Rollout knows nothing downstream of the buffer (nor the agents: below).
    # The learner reads the trajectory record, not the workers or the buffer; it reports nothing itself.
    f"{TRAINER}.learning": ((f"{TRAINER}.rollout", f"{TRAINER}.reporting", f"{TRAINER}.persistence",
                             f"{TRAINER}.run"), (f"{TRAINER}.rollout.trajectory",)),
    # Reporting reads records and plays evaluation episodes with rollout workers; the learner hands it
    # plain statistics.
    f"{TRAINER}.reporting": ((f"{TRAINER}.learning", f"{TRAINER}.persistence", f"{TRAINER}.run"), ()),
    # Checkpoints and the output directory know only the model and the run's errors.
    f"{TRAINER}.persistence": ((f"{TRAINER}.rollout", f"{TRAINER}.learning", f"{TRAINER}.reporting",
                                f"{TRAINER}.run"), ()),
    # Engines receive their typed options, never the run's configuration (see also
    # test_engines_do_not_read_the_run_configuration); one engine does not import another.
    "flashreinforce.engines": (("flashreinforce.config", TRAINER, "flashreinforce.envs", "flashreinforce.distributed"),
                               ()),
    "flashreinforce.engines.hf": (("flashreinforce.engines.vllm",), ()),
    "flashreinforce.engines.vllm": (("flashreinforce.engines.hf",), ()),
    # The agents package sits on the rollout side: its worker is a rollout worker; it imports nothing of the
    # trainer downstream of the buffer, nor the layers above the trainer.
    AGENTS: ((f"{TRAINER}.learning", f"{TRAINER}.reporting", f"{TRAINER}.persistence", f"{TRAINER}.run",
              "flashreinforce.distributed", "flashreinforce.cli", "flashreinforce.api"), ()),
    # Its endpoint and its environment are below the trainer and the engines (the trainer, the export and
    # ``flashreinforce serve`` use them): only the worker and its episodes are built on the rollout side.
    **{f"{AGENTS}.{m}": ((TRAINER, "flashreinforce.engines", f"{AGENTS}.worker", f"{AGENTS}.episode"), ())
       for m in AGENT_LOWER_MODULES},
    # The trainer reaches the agent worker through the worker registry (trainer/rollout/worker_kinds.py),
    # never by import; the rollout side imports nothing of the agents at all.
    f"{TRAINER}.rollout": ((f"{TRAINER}.learning", f"{TRAINER}.reporting", f"{TRAINER}.persistence",
                            f"{TRAINER}.run", AGENTS), ()),
    TRAINER: (("flashreinforce.distributed", "flashreinforce.cli", "flashreinforce.api", AGENTS),
              tuple(f"{AGENTS}.{m}" for m in AGENT_LOWER_MODULES)),
    # An environment may subclass the agent environment (verifiers' tasksets do), nothing else of the agents.
    "flashreinforce.envs": ((AGENTS,), (f"{AGENTS}.environment",)),
}

MAX_FOLDER_MODULES = 12
# Folders over the limit before it was set, with their module count then: they may shrink, not grow.
KNOWN_LARGE_FOLDERS = {"flashreinforce.envs": 13, "flashreinforce.envs.sandbox": 13}


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_violations(graph: dict[str, set[str]], rules=LAYER_RULES) -> list[str]:
    """``"importer -> imported"`` for every import in ``graph`` that a rule of ``rules`` forbids."""
    bad = []
    for package, (forbidden, allowed) in rules.items():
        for module in sorted(m for m in graph if _under(m, package)):
            bad += [f"{module} -> {target}" for target in sorted(graph[module])
                    if any(_under(target, f) for f in forbidden) and not any(_under(target, a) for a in allowed)]
    return sorted(set(bad))


def folder_sizes(files: dict[str, Path]) -> dict[str, int]:
    """``{package: the module files directly in its folder}`` (``{name: file}`` as
    :func:`_module_files` gives them); a package's ``__init__`` and its subpackages are not counted."""
    sizes: dict[str, int] = {}
    for name, path in files.items():
        if path.name != "__init__.py":
            parent = name.rpartition(".")[0]
            sizes[parent] = sizes.get(parent, 0) + 1
    return sizes


def oversized_folders(sizes: dict[str, int], known=KNOWN_LARGE_FOLDERS) -> dict[str, int]:
    return {p: n for p, n in sizes.items() if n > max(MAX_FOLDER_MODULES, known.get(p, 0))}


def test_layer_rules_name_packages_that_exist():
    modules = set(_module_files())
    for package, (forbidden, allowed) in LAYER_RULES.items():
        for name in (package, *forbidden, *allowed):
            assert name in modules, f"{name} (a layer rule of {package}) is not a module of the package"


def test_layers_hold_counting_lazy_imports():
    bad = layer_violations(import_graph())
    assert bad == [], "imports across the layers of docs/architecture.md:\n" + "\n".join(bad)


def test_layer_rules_catch_a_planted_import():
    graph = {f"{TRAINER}.rollout.worker": {f"{TRAINER}.learning.learner", f"{TRAINER}.rollout.buffer"},
             f"{TRAINER}.learning.packing": {f"{TRAINER}.rollout.trajectory"},
             f"{TRAINER}.learning.learner": {f"{TRAINER}.rollout.buffer", f"{TRAINER}.reporting.metrics"},
             f"{TRAINER}.reporting.metrics": {f"{TRAINER}.persistence.checkpoints"},
             f"{TRAINER}.persistence.checkpoints": {f"{TRAINER}.errors", f"{TRAINER}.run.loop"},
             f"{TRAINER}.errors": {f"{TRAINER}.rollout.trajectory"},
             f"{TRAINER}.run.loop": {"flashreinforce.distributed.data_parallel", f"{TRAINER}.learning.learner"}}
    assert layer_violations(graph) == [
        f"{TRAINER}.errors -> {TRAINER}.rollout.trajectory",
        f"{TRAINER}.learning.learner -> {TRAINER}.reporting.metrics",
        f"{TRAINER}.learning.learner -> {TRAINER}.rollout.buffer",
        f"{TRAINER}.persistence.checkpoints -> {TRAINER}.run.loop",
        f"{TRAINER}.reporting.metrics -> {TRAINER}.persistence.checkpoints",
        f"{TRAINER}.rollout.worker -> {TRAINER}.learning.learner",
        f"{TRAINER}.run.loop -> flashreinforce.distributed.data_parallel",
    ]


def test_no_package_folder_holds_more_than_the_limit():
    sizes = folder_sizes(_module_files())
    assert oversized_folders(sizes) == {}, f"package folders over {MAX_FOLDER_MODULES} modules"
    shrunk = {p: sizes.get(p, 0) for p, n in KNOWN_LARGE_FOLDERS.items() if sizes.get(p, 0) < n}
    assert shrunk == {}, f"lower these counts in KNOWN_LARGE_FOLDERS (or drop them at {MAX_FOLDER_MODULES} or less)"


def test_the_folder_limit_catches_a_planted_module():
    files = {"pkg": Path("pkg/__init__.py"), "pkg.sub": Path("pkg/sub/__init__.py"),
             **{f"pkg.sub.m{i}": Path(f"pkg/sub/m{i}.py") for i in range(MAX_FOLDER_MODULES)}}
    assert folder_sizes(files) == {"pkg.sub": MAX_FOLDER_MODULES}
    assert oversized_folders(folder_sizes(files), known={}) == {}
    planted = {**files, "pkg.sub.extra": Path("pkg/sub/extra.py")}
    assert oversized_folders(folder_sizes(planted), known={}) == {"pkg.sub": MAX_FOLDER_MODULES + 1}
    assert oversized_folders(folder_sizes(planted), known={"pkg.sub": MAX_FOLDER_MODULES + 1}) == {}



# ------------------------------------------------------------------ one vocabulary
# The modules that read settings by their flat flag names (``flags["actor.loss_mode"]``): the
# boundary between the published launchers' flat flags and the typed configuration.
FLAT_FLAG_BOUNDARY = {
    "flashreinforce.config.trainer_config": "resolves the layers of flat flags into the typed configuration",
    "flashreinforce.objective": "each loss mode's rules, over the same flat flags",
    "flashreinforce.experiments.resolve": "the published settings themselves",
    "flashreinforce.models.loading": "a run directory's record on disk (config.json's flags), not a configuration",
    "flashreinforce.envs.registry": "make_environment's public mapping form, read once into the typed EnvConfig",
}
# Modules that still read a flat mapping past the boundary; remove an entry when it reads a typed view.
KNOWN_FLAT_READERS: dict[str, str] = {}
# The modules that may name a loss mode: the registry and the modes' own module.
LOSS_MODE_MODULES = {"flashreinforce.objective", "flashreinforce.ops.loss_modes"}


def flat_flag_reads(path: Path, flag_names: set[str]) -> list[tuple[int, str]]:
    """``(line, flag)`` of each read of a flag by its flat name in ``path``: ``x["section.name"]`` (not as
    an assignment target) and ``x.get("section.name")`` / ``.pop`` / ``.setdefault``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        key = None
        if isinstance(node, ast.Subscript) and not isinstance(node.ctx, ast.Store):
            if isinstance(node.slice, ast.Constant):
                key = node.slice.value
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("get", "pop", "setdefault") and node.args and isinstance(node.args[0], ast.Constant)):
            key = node.args[0].value
        if isinstance(key, str) and key in flag_names:
            found.append((node.lineno, key))
    return sorted(found)


def loss_mode_names_in(path: Path, names: set[str]) -> list[tuple[int, str]]:
    """``(line, name)`` of each string constant in ``path`` that is exactly a loss mode's name (or the
    name of its advantage estimator or implementation)."""
    return sorted((node.lineno, node.value) for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                  if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names)


def _loss_mode_vocabulary() -> set[str]:
    from flashreinforce.objective import LOSS_MODE_REGISTRY, advantage_estimators
    from flashreinforce.ops.loss_modes import LOSS_MODES, LossImplementation, get_loss_mode

    shipped = [name for name, mode in LOSS_MODES.items()  # not modes a test registered for itself
               if type(mode).__module__.startswith("flashreinforce.")]
    names = set(shipped) | {LOSS_MODE_REGISTRY[name].estimator for name in shipped} - {None}
    assert set(advantage_estimators()) >= names - set(shipped)
    for name in shipped:
        impl = get_loss_mode(name).implementation()
        if isinstance(impl, LossImplementation):
            names.add(impl.name)
    return names


def test_the_vocabulary_finders_see_a_planted_violation(tmp_path):
    plant = tmp_path / "plant.py"
    plant.write_text("def f(cfg, v):\n"
                     "    v['other'] = cfg.flags['actor.loss_mode']\n"
                     "    cfg.inactive['rollout.batch_size'] = 'written, not read'\n"
                     "    if v.get('rollout.batch_size') == 'ppo':\n"
                     "        return 'a ppo run'\n")
    assert flat_flag_reads(plant, {"actor.loss_mode", "rollout.batch_size"}) == [(2, "actor.loss_mode"),
                                                                                 (4, "rollout.batch_size")]
    assert loss_mode_names_in(plant, {"ppo", "flash_reinforce"}) == [(4, "ppo")]


def test_the_typed_config_is_read_by_attribute_past_the_flat_flag_boundary():
    from flashreinforce.config.trainer_config import FLAG_BY_NAME

    readers = {name: reads for name, path in _module_files().items()
               if name not in FLAT_FLAG_BOUNDARY and (reads := flat_flag_reads(path, set(FLAG_BY_NAME)))}
    unexpected = {name: reads for name, reads in readers.items() if name not in KNOWN_FLAT_READERS}
    assert unexpected == {}, f"settings read by flag name past the boundary (read the typed attribute): {unexpected}"
    assert set(readers) == set(KNOWN_FLAT_READERS), f"remove from KNOWN_FLAT_READERS: {set(KNOWN_FLAT_READERS) - set(readers)}"


def test_no_module_names_a_loss_mode_but_the_registry_and_the_modes_module():
    names = _loss_mode_vocabulary()
    assert {"flash_reinforce", "ppo", "grpo", "fused"} <= names
    named = {name: found for name, path in _module_files().items()
             if name not in LOSS_MODE_MODULES and (found := loss_mode_names_in(path, names))}
    assert named == {}, f"modules that name a loss mode (ask the selected mode instead): {named}"


# ------------------------------------------------------------------ registries in their packages, engines' typed views
def config_section_reads(path: Path, sections: dict[str, set[str]]) -> list[tuple[int, str]]:
    """``(line, "section.field")`` of each read of a configuration section's field by attribute,
    ``x.section.field`` (``sections``: ``{section name: its field names}``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                and node.attr in sections.get(node.value.attr, ())):
            found.append((node.lineno, f"{node.value.attr}.{node.attr}"))
    return sorted(found)


def _section_fields() -> dict[str, set[str]]:
    import dataclasses

    from flashreinforce.config.sections import SECTIONS

    return {name: {f.name for f in dataclasses.fields(cls)} for name, cls in SECTIONS}


def test_the_section_read_finder_sees_a_planted_read(tmp_path):
    plant = tmp_path / "plant.py"
    plant.write_text("def options(self, cfg, w):\n"
                     "    n = cfg.vllm.num_engines\n"
                     "    w.data.copy_(w)\n"
                     "    return cfg.rollout.episodes_per_call + n\n")
    assert config_section_reads(plant, _section_fields()) == [(2, "vllm.num_engines"), (4, "rollout.episodes_per_call")]


def test_engines_do_not_read_the_run_configuration():
    sections = _section_fields()
    reads = {name: found for name, path in _module_files().items()
             if _under(name, "flashreinforce.engines") and (found := config_section_reads(path, sections))}
    assert reads == {}, f"engines reading the run configuration (give the engine a field of its options): {reads}"


def test_the_engine_registry_lives_in_the_engines_package():
    import flashreinforce.config.sections as sections
    from flashreinforce.engines.registry import ENGINE_REGISTRY, SHIPPED_ENGINES, engine_kind

    assert not hasattr(sections, "ENGINE_REGISTRY")
    for name, package in SHIPPED_ENGINES.items():
        assert type(engine_kind(name)).__module__.startswith(package + "."), name
        assert ENGINE_REGISTRY[name] is engine_kind(name)


#: Where each registry lives: its name -> the modules or package folders (relative to flashreinforce/) that own
#: its extension point. A module-level name ending in REGISTRY that is not here is a registry without a home.
REGISTRY_HOMES = {
    "ENGINE_REGISTRY": ("engines/",),
    "LOSS_MODE_REGISTRY": ("objective.py", "ops/"),
    "LOSS_MODES": ("objective.py", "ops/"),
    "ENV_REGISTRY": ("envs/",),
    "WORKER_REGISTRY": ("trainer/rollout/",),
}
#: A ``"module:Attr"`` string (a dotted module, a colon, a name): a registry holds the registered object, or
#: at most the module whose import registers it.
_MODULE_ATTR = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+:[A-Za-z_]\w*$")


def registry_violations(package: Path) -> list[str]:
    """One message per registry (a module-level assignment to a name of :data:`REGISTRY_HOMES` or ending in
    ``REGISTRY``) outside its home, and per ``"module:Attr"`` string in a module that defines a registry or
    is a ``registry.py`` (its shipped tables included), in the package folder ``package``."""
    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        holds_registry = path.name == "registry.py"
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) else []
            for target in targets:
                name = target.id if isinstance(target, ast.Name) else None
                if name is None or not (name in REGISTRY_HOMES or name.endswith("REGISTRY")):
                    continue
                holds_registry = True
                homes = REGISTRY_HOMES.get(name)
                if homes is None:
                    found.append(f"{rel}:{node.lineno}: {name} is a registry without a home in REGISTRY_HOMES")
                elif not any(rel == home or rel.startswith(home) for home in homes):
                    found.append(f"{rel}:{node.lineno}: {name} belongs in {' or '.join(homes)}")
        if holds_registry:
            strings = sorted((node.lineno, node.value) for node in ast.walk(tree) if isinstance(node, ast.Constant)
                             and isinstance(node.value, str) and _MODULE_ATTR.match(node.value))
            found += [f"{rel}:{line}: registry module holds the 'module:Attr' string {value!r} (register the object "
                      "where it is implemented)" for line, value in strings]
    return found


def test_the_registry_rule_sees_a_planted_violation(tmp_path):
    (tmp_path / "config").mkdir()
    (tmp_path / "envs").mkdir()
    (tmp_path / "config" / "sections.py").write_text("ENGINE_REGISTRY: dict = {}\n")
    (tmp_path / "envs" / "registry.py").write_text("ENV_REGISTRY = {}\nSHIPPED = {'math': 'pkg.math_env:MathEnv'}\n")
    (tmp_path / "widgets.py").write_text("WIDGET_REGISTRY = {'a': 1}\n")
    (tmp_path / "engines").mkdir()
    (tmp_path / "engines" / "registry.py").write_text("ENGINE_REGISTRY = {}\nSHIPPED = {'hf': 'pkg.engines.hf'}\n")
    assert registry_violations(tmp_path) == [
        "config/sections.py:1: ENGINE_REGISTRY belongs in engines/",
        "envs/registry.py:2: registry module holds the 'module:Attr' string 'pkg.math_env:MathEnv' (register the "
        "object where it is implemented)",
        "widgets.py:1: WIDGET_REGISTRY is a registry without a home in REGISTRY_HOMES"]


def test_registries_live_in_their_packages_and_hold_no_module_class_strings():
    violations = registry_violations(PACKAGE_DIR)
    assert violations == [], "\n".join(violations)


def test_shipped_environments_register_themselves_where_they_are_implemented():
    from flashreinforce.envs.registry import ENV_REGISTRY, LIBRARY_ENVIRONMENTS, SHIPPED_ENVIRONMENTS, environment_class

    for name, module in [*SHIPPED_ENVIRONMENTS.items(), *((p, m) for p, (m, _) in LIBRARY_ENVIRONMENTS.items())]:
        cls = environment_class(name if name in SHIPPED_ENVIRONMENTS else name + "x")
        assert ENV_REGISTRY[name] is cls and getattr(importlib.import_module(module), cls.__name__) is cls, name
