"""Environments: the :class:`Environment` interface and the ones the project ships."""

from flashreinforce.envs.base import Environment, StepResult

__all__ = ["Environment", "StepResult"]

# The shipped environments load on first use, so importing this package starts nothing and
# imports neither math-verify nor subprocess machinery.
_LAZY_EXPORTS = {
    "MathEnv": "flashreinforce.envs.math_env",
    "MathGrader": "flashreinforce.envs.math_env",
    "PythonToolEnv": "flashreinforce.envs.python_tool",
    "Sandbox": "flashreinforce.envs.sandbox",
    "SandboxResult": "flashreinforce.envs.sandbox",
    "Task": "flashreinforce.envs.tasks",
    "TaskEnvironment": "flashreinforce.envs.tasks",
    "DatasetEnvironment": "flashreinforce.envs.tasks",
    "load_tasks": "flashreinforce.envs.tasks",
    "make_environment": "flashreinforce.envs.registry",
    "EnvSpec": "flashreinforce.envs.registry",
    "EnvConfig": "flashreinforce.envs.registry",
    "ALFWorldEnv": "flashreinforce.envs.alfworld",
}
__all__ += list(_LAZY_EXPORTS)


def __getattr__(name: str):
    module = _LAZY_EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
