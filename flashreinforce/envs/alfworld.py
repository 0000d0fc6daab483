"""ALFWorld (text household tasks) as a multi-turn environment, over the ``alfworld`` package.

Each task is one ALFWorld game: the dataset's label (``data.label_key game_file`` in the
published setting) is the path of a ``game.tw-pddl`` file, or of the trial directory holding
it; relative paths are taken under ``$ALFWORLD_DATA``. The game is played with TextWorld
(``textworld.start``) wrapped by alfworld's own ``AlfredDemangler`` (readable object names
such as ``apple 1``) and ``AlfredInfos``, exactly the text engine alfworld trains on.

Protocol: the prompt is the instruction (the dataset row's prompt when it has one, else
``DEFAULT_INSTRUCTION``) followed by the game's opening text and its admissible actions. Each
turn the policy writes one action inside ``<action>...</action>`` (the last such tag counts;
the action is lower-cased and its spaces collapsed). The observation is the game's answer plus
the new admissible actions. A turn without the tag gets a format reminder and no game step.
The episode ends when the task is done (reward 1.0), when the game ends, or at ``max_turns``
(default ``MAX_AGENT_TURNS`` if set, else 50), with reward 0.0; ``failed = not won``. The final
``info`` holds ``won``, ``game_steps``, ``inadmissible_actions``, ``format_errors``, ``turns``
and ``turn_limit``.

Needs ``pip install alfworld`` (the text engine; no THOR simulator) and
``export ALFWORLD_DATA=<game data directory>`` (``alfworld-download`` fetches the games).
Neither is installed in this project's CI; the test suite plays a tiny game it builds from
the package's own PDDL domain and grammar when ``alfworld`` is importable and skips otherwise.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Sequence

from flashreinforce.envs.base import StepResult, resolve_max_turns
from flashreinforce.envs.tasks import ChatTemplate, Task, TaskEnvironment, render_prompt
from flashreinforce.envs.registry import register_environment

__all__ = ["ALFWorldEnv", "DEFAULT_INSTRUCTION", "extract_action", "resolve_game_file"]

DEFAULT_INSTRUCTION = (
    "You are an agent in a household. Complete the task by interacting with the environment. "
    "Each turn, think briefly, then give exactly one of the admissible actions inside "
    "<action>...</action>."
)

def extract_action(text: str) -> str | None:
    """The last ``<action>...</action>`` of ``text``, lower-cased with spaces collapsed, or None."""
    lowered = text.lower()  # tags match in any case; found from the end to stay linear
    close = lowered.rfind("</action>")
    open_ = lowered.rfind("<action>", 0, close) if close >= 0 else -1
    if open_ < 0:
        return None
    action = " ".join(lowered[open_ + len("<action>"):close].split())
    return action or None


def resolve_game_file(label: str, data_dir: str | None) -> str:
    """Path of the ``game.tw-pddl`` named by a dataset label (see the module docstring)."""
    path = os.path.expanduser(os.path.expandvars(label))
    if not os.path.isabs(path):
        if not data_dir:
            raise ValueError(f"game file {label!r} is relative but ALFWORLD_DATA is not set")
        path = os.path.join(data_dir, path)
    if os.path.isdir(path):
        path = os.path.join(path, "game.tw-pddl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"ALFWorld game file {path!r} (from label {label!r}) does not exist")
    return path


def _format_admissible(commands: Sequence[str]) -> str:
    return "Admissible actions: " + ", ".join(commands) if commands else "Admissible actions: (none)"


@register_environment("alfworld")
class ALFWorldEnv(TaskEnvironment):
    """ALFWorld text games (see the module docstring for the protocol and requirements).

    Args:
        tasks: optional list of :class:`Task` whose ``ground_truth`` is the game file.
        max_turns: policy turns per episode; default ``MAX_AGENT_TURNS`` if set, else 50.
        instruction: used when a task's prompt is empty.
        observation_template: wraps each observation; ``{observation}`` is replaced by it.
        apply_chat_template: renders chat-message prompts (see ``render_prompt``).
        data_dir: the game data directory; default ``$ALFWORLD_DATA`` (required).
    """

    #: TextWorld's game interpreters are not known to be thread-safe: a worker calls its instances one
    #: after another.
    parallel_calls = False

    default_max_turns = 50  # the published ALFWorld setting

    def __init__(self, tasks: Sequence[Task] | None = None, *, max_turns: int | None = None,
                 instruction: str = DEFAULT_INSTRUCTION,
                 observation_template: str = "\n<observation>\n{observation}\n</observation>\n",
                 apply_chat_template: ChatTemplate | None = None, data_dir: str | None = None) -> None:
        super().__init__(tasks, apply_chat_template=apply_chat_template)
        for module in ("alfworld", "textworld"):
            if importlib.util.find_spec(module) is None:
                raise ImportError(f"ALFWorldEnv needs the {module!r} package: pip install alfworld "
                                  "(then alfworld-download for the game data)")
        data_dir = data_dir if data_dir is not None else os.environ.get("ALFWORLD_DATA")
        if not data_dir:
            raise ValueError("ALFWorldEnv needs the game data directory: export ALFWORLD_DATA=<dir> "
                             "(alfworld-download fills it) or pass data_dir=")
        if not os.path.isdir(data_dir):
            raise ValueError(f"ALFWORLD_DATA {data_dir!r} is not a directory")
        max_turns = resolve_max_turns(self.default_max_turns, max_turns)
        if "{observation}" not in observation_template:
            raise ValueError("observation_template must contain '{observation}'")
        self.data_dir = data_dir
        self.max_turns = max_turns
        self.instruction = instruction
        self.observation_template = observation_template
        self._game: Any = None
        self._game_file: str | None = None
        self._admissible: list[str] = []

    def _load(self, game_file: str) -> None:
        if game_file == self._game_file and self._game is not None:
            return
        import textworld
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos

        self._close_game()
        infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile"])
        self._game = textworld.start(game_file, request_infos=infos,
                                     wrappers=[AlfredDemangler(shuffle=False), AlfredInfos])
        self._game_file = game_file

    def start(self, task: Task) -> str:
        if not isinstance(task.ground_truth, str):
            raise ValueError(f"ALFWorldEnv task {task.index} needs a game file as its label "
                             f"(data.label_key game_file), got {task.ground_truth!r}")
        self._load(resolve_game_file(task.ground_truth, self.data_dir))
        state = self._game.reset()
        self._admissible = list(state["admissible_commands"] or [])
        self._turn = 0
        self._counts = {"game_steps": 0, "inadmissible_actions": 0, "format_errors": 0}
        opening = f"{state.feedback.strip()}\n\n{_format_admissible(self._admissible)}"
        prompt = task.prompt if task.prompt else self.instruction
        if isinstance(prompt, str):
            prompt = f"{prompt}\n\n{opening}"
        else:
            prompt = (*prompt, {"role": "user", "content": opening})
        return render_prompt(prompt, self.apply_chat_template)

    def _finish(self, won: bool, turn_limit: bool) -> StepResult:
        info = {**self._counts, "won": won, "turns": self._turn, "turn_limit": turn_limit}
        return StepResult(reward=1.0 if won else 0.0, done=True, failed=not won, info=info)

    def _observe(self, text: str) -> StepResult:
        return StepResult(observation=self.observation_template.replace("{observation}", text),
                          reward=0.0, done=False)

    def step(self, action: str) -> StepResult:
        self._begin_step(action)
        if self._game is None:
            raise RuntimeError("step() before reset()")
        self._turn += 1
        command = extract_action(action)
        if command is None:
            self._counts["format_errors"] += 1
            if self._turn >= self.max_turns:
                return self._finish(False, turn_limit=True)
            return self._observe("Invalid format: give exactly one admissible action inside "
                                 "<action>...</action>.\n" + _format_admissible(self._admissible))
        if command not in self._admissible:
            self._counts["inadmissible_actions"] += 1
        state, _score, game_done = self._game.step(command)
        self._counts["game_steps"] += 1
        self._admissible = list(state["admissible_commands"] or [])
        if state["won"]:
            return self._finish(True, turn_limit=False)
        if game_done or self._turn >= self.max_turns:
            return self._finish(False, turn_limit=not game_done)
        return self._observe(f"{state.feedback.strip()}\n{_format_admissible(self._admissible)}")

    def _close_game(self) -> None:
        if self._game is not None:
            self._game.close()
        self._game = None
        self._game_file = None

    def close(self) -> None:
        self._close_game()
