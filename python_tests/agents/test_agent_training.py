"""An agent function trains end to end (``flashreinforce.train(agent=...)`` and ``--agent``), and the
configuration's checks of ``--agent``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flashreinforce.config import ConfigError, TrainerConfig

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")
pytest.importorskip("gguf")


def agent_fn(client, row):
    """Two calls, the second continuing the first: reward 1 when the answer holds the letter 'a'."""
    messages = [{"role": "user", "content": row["prompt"]}]
    first = client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "ok"}]
    second = client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    return float("a" in (second.choices[0].message.content or ""))


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    from python_tests.models.gguf_tiny import write_tiny_gguf

    path = Path(tmp_path_factory.mktemp("gguf")) / "tiny.gguf"
    write_tiny_gguf(path, seed=2)
    return str(path)


def _config(steps=2):
    import flashreinforce as fr

    cfg = fr.load_config(None)
    cfg.train.max_steps = steps
    cfg.rollout.batch_groups = cfg.train.batch_size = 4
    cfg.rollout.max_new_tokens = 4
    cfg.data.max_len = 256
    cfg.eval.steps = 0
    cfg.ckpt.save_steps = 0
    return cfg


def test_train_with_an_agent_function(tmp_path, gguf_path):
    import flashreinforce as fr

    rows = [{"prompt": f"letter {c}"} for c in "abcdefgh"]
    summary = fr.train(_config(), model=gguf_path, agent=agent_fn, dataset=rows, output=str(tmp_path / "run"),
                       device="cpu", progress=False)
    assert summary["status"] == "completed" and summary["step"] == 2
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["env/agent_calls"] == 2.0 and r["env/history_rewrites"] == 0.0 for r in records)
    assert all(r["sequence_kl_mean"] < 1e-6 for r in records)  # behavior log-probs are the policy's own
    config = (tmp_path / "run" / "config.yaml").read_text()
    assert "python_tests.agents.test_agent_training:agent_fn" in config


def test_agent_flag_resolves_to_the_agent_environment():
    cfg = TrainerConfig.from_layers({"agent": "my_agent.py:play", "env.kwargs": {"tool_parser": "hermes"}})
    assert cfg.train.agent_path == "agent"
    assert cfg.env_kwargs == {"tool_parser": "hermes", "agent": "my_agent.py:play"}
    with pytest.raises(ConfigError, match="--agent and --env math both say what the task is"):
        TrainerConfig.from_layers({"agent": "my_agent.py:play", "env": "math"})
    with pytest.raises(ConfigError, match="--agent and --reward both"):
        TrainerConfig.from_layers({"agent": "my_agent.py:play", "reward": ["r.py:f"]})


def test_a_bad_agent_spec_is_one_line_naming_the_flag(tmp_path, gguf_path):
    out = subprocess.run([sys.executable, "-m", "flashreinforce.cli", "train", "--model", gguf_path, "--agent",
                          str(tmp_path / "missing.py") + ":play", "--output", str(tmp_path / "r"), "--device", "cpu"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1].endswith(f"--agent {tmp_path / 'missing.py'}:play: "
                                                        f"{tmp_path / 'missing.py'} does not exist")


def test_a_missing_agent_package_is_named_before_the_model_loads(monkeypatch):
    from flashreinforce.trainer.run.prechecks import check_before_model

    cfg = TrainerConfig.from_layers({"agent": "flashreinforce.agents.arith_tool:agent", "model": "tiny-qwen2"})
    check_before_model(cfg)  # everything there
    monkeypatch.setitem(sys.modules, "openai", None)  # import openai raises ImportError
    with pytest.raises(ConfigError, match=r"^--agent: the agent endpoint needs openai: pip install -e '\.\[agents\]'"):
        check_before_model(cfg)


def test_an_env_or_reward_replaces_a_preset_s_agent():
    from flashreinforce.config.presets import PRESETS

    preset = PRESETS["arith_tool_agent"]
    assert TrainerConfig.from_layers({}, preset).train.agent_path == "agent"
    cfg = TrainerConfig.from_layers({"env": "math"}, preset)
    assert cfg.train.agent_path == "math" and "agent" not in cfg.env_kwargs
    cfg = TrainerConfig.from_layers({"reward": ["r.py:f"]}, preset)
    assert cfg.train.agent_path == "reward_functions" and "agent" not in cfg.env_kwargs
    with pytest.raises(ConfigError, match="--agent and --env math both"):  # both given: still refused
        TrainerConfig.from_layers({"env": "math", "agent": "a.py:f"}, preset)
