"""A run trained from a GGUF file checkpoints, exports and resumes as ordinary Hugging Face folders."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("gguf") is None or importlib.util.find_spec("accelerate") is None,
    reason="GGUF loading needs the gguf extra (pip install 'flashreinforce[gguf]')")


def train(*args, timeout=300):
    proc = subprocess.run([sys.executable, "-m", "flashreinforce.cli", "train", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_run_from_gguf_saves_hf_folders_and_resumes(tmp_path):
    import transformers

    from python_tests.models.gguf_tiny import write_tiny_gguf

    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path, seed=1)
    out = tmp_path / "run"
    common = ["--model", str(gguf_path), "--env", "flashreinforce.envs.arith:ArithEnv",
              "--env.kwargs", json.dumps({"digits": 1, "operations": "+", "heldout_size": 10}),
              "--data.apply_chat_template", "--rollout.batch_size", "4", "--train.batch_size", "4",
              "--rollout.max_new_tokens", "3", "--data.max_len", "64", "--rollout.num_workers", "1",
              "--rollout.vllm_generate_batch_size", "4", "--actor.adam.lr", "1e-3", "--ckpt.save_steps", "1",
              "--torch_threads", "1", "--no_progress", "--output", str(out)]
    first = train(*common, "--train.max_steps", "2")
    assert first["status"] == "completed" and first["step"] == 2
    ckpt = out / "checkpoints" / "step_00000002"
    assert (out / "checkpoints" / "latest").read_text().strip() == ckpt.name
    for folder in (ckpt, out / "hf"):
        config = json.loads((folder / "config.json").read_text())
        assert "quantization_config" not in config and config["model_type"] == "llama"
        model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True)
        tok = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        assert tok.chat_template and tok.convert_ids_to_tokens(tok.eos_token_id) == "<|im_end|>"
    exported = {k: v.clone() for k, v in model.state_dict().items()}
    # The run's prompts were rendered with the GGUF's chat template.
    config = json.loads((out / "config.json").read_text())
    assert config["tokenizer_kind"] == "HFTokenizer"

    second = train(*common, "--train.max_steps", "4", "--resume")
    assert second["status"] == "completed" and second["step"] == 4
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    resumed = transformers.AutoModelForCausalLM.from_pretrained(str(out / "hf"), local_files_only=True)
    changed = [k for k, v in resumed.state_dict().items() if not torch.equal(v, exported[k])]
    assert changed  # the two resumed updates moved the weights
    # The run directory itself is a --model: its newest checkpoint.
    from flashreinforce.models.loading import resolve_model_spec

    assert resolve_model_spec(str(out)) == str(out / "checkpoints" / "step_00000004")
