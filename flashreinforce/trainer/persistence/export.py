"""``OUTPUT/hf``: the trained policy as a Hugging Face folder that runs without this project.

:func:`export_policy` writes the final policy with its tokenizer (``model.save_pretrained``). With
LoRA it also writes the adapters alone in PEFT's format to ``hf/adapter``, whose
``base_model_name_or_path`` names a folder ``transformers`` can load offline, so that
``peft.AutoPeftModelForCausalLM.from_pretrained("OUTPUT/hf/adapter")`` works by itself:

* the base model's own folder (absolute path) when ``--model`` named a Hugging Face folder outside
  the run's checkpoints;
* otherwise ``hf/base``, written here: the frozen base weights the adapters were trained on (for a
  ``.gguf`` file or an alias, its dequantized weights, which differ from any hub release of the same
  model), with the tokenizer.

``hf/adapter/base_model.json`` records what the run was given (``--model`` as written, the file it
resolved to, its size and modification time) beside the folder used.

An agent run's export gets the chat template the endpoint rendered with
(:func:`flashreinforce.agents.templates.tool_chat_template`): ``apply_chat_template(messages,
tools=TOOLS)`` on the export gives the token ids the policy was trained on.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from flashreinforce.models.loading import resolve_model_spec
from flashreinforce.models.lora import base_model_copy, has_lora, merged_model, save_adapter

__all__ = ["BASE_RECORD", "agent_chat_template", "export_policy", "loadable_base"]

#: In ``hf/adapter``: what the run's base model was and where the adapter's base is.
BASE_RECORD = "base_model.json"


def _hf_folder(path: Path) -> bool:
    """A folder ``AutoModelForCausalLM.from_pretrained`` loads: a config and full weights, not a LoRA
    checkpoint of this trainer (adapters only)."""
    if not (path.is_dir() and (path / "config.json").is_file()):
        return False
    weights = any(path.glob("*.safetensors")) or any(path.glob("pytorch_model*.bin"))
    lora_only = (path / "state.json").is_file() and '"lora"' in (path / "state.json").read_text()
    return weights and not lora_only


def loadable_base(spec: str, checkpoints_dir: Path) -> Path | None:
    """The folder an exported adapter can name as its base when ``--model spec`` is one already (an
    absolute path), else None (the base is written to ``hf/base``). A checkpoint under the run's
    ``checkpoints_dir`` is not one: old checkpoints are deleted as training goes on."""
    try:
        path = Path(resolve_model_spec(spec)).resolve()
    except Exception:  # an object given in Python, an alias whose package went away
        return None
    if not _hf_folder(path):
        return None
    if checkpoints_dir.resolve() in path.parents:
        return None
    return path


def _base_record(spec: str, base: Path, written: bool) -> dict[str, Any]:
    record: dict[str, Any] = {"base_model_name_or_path": str(base), "written_by_the_run": written,
                              "run_model": spec}
    try:
        resolved = Path(resolve_model_spec(spec))
        record["run_model_resolved"] = str(resolved.resolve())
        if resolved.is_file():
            st = resolved.stat()
            record.update(run_model_bytes=st.st_size, run_model_mtime=int(st.st_mtime))
    except Exception:
        pass
    return record


def _save_tokenizer(tokenizer, directory: Path, template: str | None) -> None:
    """``tokenizer.save_pretrained(directory)``, with ``template`` as its chat template when given."""
    hf = getattr(tokenizer, "tok", None)
    if template is None or hf is None:
        tokenizer.save_pretrained(directory)
        return
    own = hf.chat_template
    hf.chat_template = template
    try:
        tokenizer.save_pretrained(directory)
    finally:
        hf.chat_template = own


def agent_chat_template(tokenizer) -> str | None:
    """The chat template an agent run's export gets: the model's own with the endpoint's tool rendering
    added when it has no tool syntax (None: nothing to change, or not a Hugging Face tokenizer)."""
    from flashreinforce.agents.templates import tool_chat_template

    own = getattr(getattr(tokenizer, "tok", None), "chat_template", None)
    if not isinstance(own, str) or not own:
        return None
    template = tool_chat_template(own)
    return None if template == own else template


def export_policy(hf_dir: str | Path, model: torch.nn.Module, tokenizer, *, base_spec: str,
                  checkpoints_dir: str | Path, agent: bool = False) -> Path:
    """Write ``model`` (the learner's, LoRA layers and all) and ``tokenizer`` to ``hf_dir`` as described in
    the module docstring; ``agent``: give the export the endpoint's tool rendering. Returns ``hf_dir``."""
    hf_dir = Path(hf_dir)
    hf_dir.mkdir(parents=True, exist_ok=True)
    template = agent_chat_template(tokenizer) if agent else None
    if has_lora(model):
        base = loadable_base(base_spec, Path(checkpoints_dir))
        written = base is None
        if written:
            base = (hf_dir / "base").resolve()
            plain = base_model_copy(model)
            plain.save_pretrained(str(base))
            del plain
            _save_tokenizer(tokenizer, base, template)
        adapter = hf_dir / "adapter"
        save_adapter(model, adapter, base_model=str(base))
        _save_tokenizer(tokenizer, adapter, template)
        tmp = adapter / (BASE_RECORD + f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(_base_record(base_spec, base, written), indent=1) + "\n")
        tmp.replace(adapter / BASE_RECORD)
        model = merged_model(model)
    model.save_pretrained(str(hf_dir))
    _save_tokenizer(tokenizer, hf_dir, template)
    return hf_dir
