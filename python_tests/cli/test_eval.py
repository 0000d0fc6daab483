"""``flashreinforce eval`` on tiny models: held-out seeds, greedy accuracy, sampled pass@1, run directories."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashreinforce.envs.arith import HELDOUT_SEED_OFFSET, ArithSpec, problem_for_seed
from flashreinforce.models.tokenizers import CharTokenizer

ROOT = Path(__file__).resolve().parents[2]
ENV = ["--env", "flashreinforce.envs.arith:ArithEnv"]


def constant_answer_model(directory: Path, char: str) -> Path:
    """A tiny Qwen2 folder (char tokenizer) whose every next token is ``char``, greedy or sampled.

    Its layers add nothing to the residual stream (zero output projections), every token embeds to
    the same vector e, and only the output row of ``char`` is e (logit = hidden size, others 0),
    so the answer does not depend on the prompt: a known accuracy on any problem set.
    """
    import transformers

    tok = CharTokenizer()
    config = transformers.Qwen2Config(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, tie_word_embeddings=False)
    model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        model.lm_head.weight[tok.encode(char)[0]] = 1.0
    model.save_pretrained(str(directory))
    tok.save_pretrained(directory)
    return directory


def run_eval(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "flashreinforce.cli", "eval", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_eval_scores_the_heldout_split_greedy_and_sampled(tmp_path):
    model = constant_answer_model(tmp_path / "m", "3")
    kwargs = {"digits": 1, "operations": "-", "negative": False, "heldout_size": 20}
    spec = ArithSpec(digits=1, operations="-", negative=False, heldout_size=20)
    expected = sum(problem_for_seed(spec, HELDOUT_SEED_OFFSET + i)[0].answer == 3 for i in range(12)) / 12
    assert 0 < expected < 1  # the problem set makes the check informative
    out = tmp_path / "res" / "eval.json"
    proc = run_eval(*ENV, "--env.kwargs", json.dumps(kwargs), "--model", str(model), "--eval.num_prompts", "12",
                    "--rollout.max_new_tokens", "1", "--data.max_len", "64", "--eval.temperature", "1.0",
                    "--eval.n_samples_per_prompt", "3", "--output", str(out), "--samples", str(tmp_path / "s.jsonl"))
    assert proc.returncode == 0, proc.stderr
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert printed == json.loads(out.read_text())
    assert printed["model"] == str(model) and printed["num_prompts"] == 12
    assert printed["accuracy"] == pytest.approx(expected)
    assert printed["pass@1"] == pytest.approx(expected)  # the answer is "3" whatever the sampling noise
    assert printed["pass@1_temperature"] == 1.0 and printed["pass@1_samples_per_prompt"] == 3
    # each pass's numbers say which pass they are, and the legend says how accuracy and reward differ
    assert printed["reward_mean"] == pytest.approx(expected) and "episode_means" not in printed
    assert printed["greedy_episode_means"].keys() == printed["sampled_episode_means"].keys()
    assert set(printed["legend"]) == {"accuracy", "reward_mean", "greedy_episode_means", "pass@1",
                                      "sampled_reward_mean", "sampled_episode_means"}
    assert "partial credit" in printed["legend"]["reward_mean"]
    assert printed["seeds"] == [HELDOUT_SEED_OFFSET, HELDOUT_SEED_OFFSET + 11]
    rows = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert [r["response"] for r in rows] == ["3"] * 12
    for i, r in enumerate(rows):
        p, _ = problem_for_seed(spec, HELDOUT_SEED_OFFSET + i)
        assert r["prompt"] == f"What is {p.a} - {p.b}? Answer with just the number."
        assert r["reward"] == float(p.answer == 3) and r["info"]["split"] == "heldout"


def test_eval_of_a_run_directory_scores_its_newest_checkpoint(tmp_path):
    run = tmp_path / "run"
    old = constant_answer_model(run / "checkpoints" / "step_00000002", "1")
    new = constant_answer_model(run / "checkpoints" / "step_00000004", "3")
    (old / "state.json").write_text(json.dumps({"step": 2}))
    (new / "state.json").write_text(json.dumps({"step": 4}))
    (run / "checkpoints" / "latest").write_text("step_00000004")
    (run / "config.json").write_text(json.dumps({"flags": {"ckpt.path": None}}))
    kwargs = {"digits": 1, "operations": "+", "heldout_size": 30}
    proc = run_eval(*ENV, "--env.kwargs", json.dumps(kwargs), "--model", str(run), "--eval.num_prompts", "30",
                    "--rollout.max_new_tokens", "1", "--data.max_len", "64", "--no_sampled")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["checkpoint_step"] == 4 and result["resolved_model"] == str(new)
    spec = ArithSpec(digits=1, operations="+", heldout_size=30)
    expected = sum(problem_for_seed(spec, HELDOUT_SEED_OFFSET + i)[0].answer == 3 for i in range(30)) / 30
    assert result["accuracy"] == pytest.approx(expected) and result["pass@1"] is None


@pytest.mark.parametrize("args, needle", [
    (["--model", "tiny-qwen2"], "no environment"),
    (ENV + [], "no model"),
    (ENV + ["--model", "smollm2-135m-instruct", "--preset", "nope"], "unknown --preset 'nope'"),
    (ENV + ["--model", "/no/such/dir"], "--model '/no/such/dir'"),
    (ENV + ["--env.kwargs", '{"heldout_size": 5}', "--model", "tiny-qwen2", "--eval.num_prompts", "6"],
     "--eval.num_prompts 6: held-out problem 5 requested, but the held-out split has 5 problems"),
])
def test_eval_configuration_errors_name_the_flag(args, needle):
    proc = run_eval(*args)
    assert proc.returncode == 2
    assert needle in proc.stderr


def test_eval_is_a_registered_command():
    proc = subprocess.run([sys.executable, "-m", "flashreinforce.cli", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert "eval" in proc.stdout and "held-out" in proc.stdout


def test_eval_ignores_a_presets_training_thread_split_unless_told(monkeypatch, capsys):
    from flashreinforce.cli import eval as eval_cli

    seen = []
    monkeypatch.setattr(eval_cli, "evaluate_model", lambda cfg, **kw: seen.append(cfg.torch_threads) or {"ok": 1})
    assert eval_cli.eval_command(["--preset", "arith", "--model", "m"]) == 0
    assert eval_cli.eval_command(["--preset", "arith", "--model", "m", "--torch_threads", "3"]) == 0
    assert seen == [None, 3]
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == {"ok": 1}


def says_the_letter(prompt, completion, target, **row):
    return float(completion[:1] == target)


def test_eval_of_a_run_plays_its_heldout_rows_says_what_it_does_and_records_the_result(tmp_path, capsys):
    import flashreinforce as fr
    from flashreinforce.analysis import load_run
    from flashreinforce.cli.eval import eval_command
    from flashreinforce.trainer.reporting.heldout import read_split

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"say {t}:", "target": t}) + "\n" for t in "abcdefgh" * 5))
    config = fr.TrainerConfig.from_preset("toy", output=str(tmp_path / "run"), progress=False)
    config.rollout.batch_size = 8
    config.train.max_steps, config.eval.num_prompts, config.eval.eval_at_start = 2, 6, False
    fr.train(config, rewards=[says_the_letter], dataset=str(rows))
    split = read_split(tmp_path / "run")
    assert split is not None and len(split.rows) == 6
    capsys.readouterr()
    args = ["--preset", "toy", "--model", str(tmp_path / "run"), "--reward", f"{__name__}:says_the_letter",
            "--data.prompt_dataset", str(rows), "--eval.num_prompts", "3", "--no_sampled"]
    assert eval_command(args) == 0
    out, err = capsys.readouterr()
    result = json.loads(out.splitlines()[-1])
    assert result["num_prompts"] == 6 and result["heldout"] == {"rows": 6, "of": 40, "recorded_by_run": True}
    assert result["checkpoint_step"] == 2 and result["run_dir"] == str(tmp_path / "run")
    assert "flashreinforce eval: loading the model" in err and "model loaded in" in err
    assert "greedy accuracy on 6 held-out rows of the prompt set" in err and "greedy: 6/6 prompts" in err
    recorded = [json.loads(x) for x in (tmp_path / "run" / "eval_command.jsonl").read_text().splitlines()]
    assert len(recorded) == 1 and recorded[0]["step"] == 2 and recorded[0]["accuracy"] == result["accuracy"]
    assert load_run(tmp_path / "run").command_evals == recorded


def test_eval_of_a_base_model_plays_the_rows_a_run_holds_out_and_a_tiny_set_whole(tmp_path, capsys):
    from flashreinforce.cli.eval import eval_command
    from flashreinforce.trainer.reporting.heldout import heldout_rows

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"say {t}:", "target": t}) + "\n" for t in "abcdefgh" * 5))
    base = ["--preset", "toy", "--reward", f"{__name__}:says_the_letter", "--no_sampled", "--eval.num_prompts", "6"]
    assert eval_command(base + ["--data.prompt_dataset", str(rows)]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    held = heldout_rows(40, 6, seed=0)
    assert result["num_prompts"] == 6 and result["seeds"] == [held[0], held[-1]]
    assert result["heldout"] == {"rows": 6, "of": 40, "recorded_by_run": False}
    tiny = tmp_path / "tiny.jsonl"
    tiny.write_text("".join(json.dumps({"prompt": f"say {t}:", "target": t}) + "\n" for t in "abcd"))
    assert eval_command(base + ["--data.prompt_dataset", str(tiny)]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result["num_prompts"] == 4 and result["heldout"] is None


def test_eval_usage_names_agent_functions(capsys):
    from flashreinforce.cli import main

    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    usage = capsys.readouterr().out
    assert "--agent FILE.py:FUNC" in usage.split("options:")[0] and "--agent" in usage
