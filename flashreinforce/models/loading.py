"""Building the policy model from what ``--model`` names (never a download).

``--model`` is a built-in tiny configuration name (random weights), a model config JSON file
(random weights), or a local Hugging Face checkpoint directory. The model comes back in float32
(the learner's master weights) with the tokenizer spec that goes with it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from flashreinforce.config.flags import ConfigError

__all__ = ["TINY_MODELS", "build_model"]

#: Tiny Qwen2-architecture configurations (``transformers.Qwen2Config`` keyword arguments), built
#: with random weights. Sized for the character tokenizer (vocabulary 100).
TINY_MODELS: dict[str, dict[str, Any]] = {
    "tiny-qwen2": dict(vocab_size=100, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       tie_word_embeddings=True, rope_theta=10000.0),
}


def build_model(spec: str, *, device: torch.device, attn_implementation: str | None = None,
                seed: int = 0) -> tuple[torch.nn.Module, str]:
    """The policy model and its default tokenizer spec.

    ``spec``: a :data:`TINY_MODELS` name (random init from ``seed``), a
    model config JSON file (random init), or a local Hugging Face checkpoint directory (never a
    download). The model is float32 (master weights) on ``device``.
    """
    import transformers

    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    path = Path(spec)
    torch.manual_seed(seed)
    if spec in TINY_MODELS:
        config = transformers.Qwen2Config(**TINY_MODELS[spec])
        model, tok = transformers.Qwen2ForCausalLM._from_config(config, **kwargs), "char"
    elif path.is_file() and path.suffix == ".json":
        data = json.loads(path.read_text())
        model_type = data.pop("model_type", None)
        if model_type is None:
            raise ConfigError(f"model config {spec}: no model_type")
        config = transformers.AutoConfig.for_model(model_type, **data)
        model, tok = transformers.AutoModelForCausalLM.from_config(config, **kwargs), "char"
    elif path.is_dir() and (path / "config.json").is_file():
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True,
                                                                  torch_dtype=torch.float32, **kwargs)
        tok = str(path)
    else:
        raise ConfigError(f"--model {spec!r}: expected one of {sorted(TINY_MODELS)}, a model config .json, or a "
                          "local checkpoint directory with config.json (models are never downloaded)")
    return model.to(device=device, dtype=torch.float32), tok
