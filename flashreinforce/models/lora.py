"""LoRA adapters on the policy, with PEFT: inject, name, save, merge.

:func:`apply_lora` injects PEFT's LoRA layers into a ``transformers`` causal LM *in place*: the model
object stays the one the learner holds (its packed forward, per-document attention, shared prefixes
and fused loss see the same module tree, with each targeted ``nn.Linear`` now a PEFT ``lora.Linear``),
every base weight is frozen (``requires_grad`` False, optionally cast to bf16) and only the adapters
train. The effective weight of a targeted projection is ``W + (alpha / rank) * B @ A``.

Names: the model's state dict then holds each targeted projection's base weight as
``...q_proj.base_layer.weight`` and its adapters as ``...q_proj.lora_A.default.weight`` /
``lora_B``; :func:`base_name` gives a base weight's Hugging Face name and :func:`is_adapter_name`
tells adapters apart. :func:`save_adapter` writes PEFT's own adapter format
(``adapter_config.json`` + ``adapter_model.safetensors``), which ``peft.PeftModel.from_pretrained``
and vLLM load; :func:`merged_model` gives a plain model with the adapters folded in.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from flashreinforce.config.schema import ConfigError

__all__ = ["DEFAULT_TARGETS", "LoraSettings", "adapter_state", "apply_lora", "base_model_copy", "base_name",
           "copy_sharing_frozen", "frozen_state_names", "has_lora", "is_adapter_name", "load_adapter_dir", "merged_model",
           "peft_adapter_state", "save_adapter", "write_adapter"]

#: ``lora.target_modules default``: the attention and MLP projections of the Llama / Qwen / Mistral
#: families (the names ``transformers`` gives them).
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

#: What LoRA needs, as one install line.
PEFT_INSTALL = "pip install 'flashreinforce[lora]'  (peft)"


@dataclass(frozen=True)
class LoraSettings:
    """rank (0: no LoRA), alpha (scale ``alpha / rank``), dropout (on the adapters' input while
    training), target_modules (``"default"``: :data:`DEFAULT_TARGETS`; ``"all-linear"``: every linear
    layer but the output projection; else module names), base_dtype (the frozen base weights' dtype:
    ``float32`` or ``bfloat16``)."""

    rank: int = 0
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = field(default=("default",))
    base_dtype: str = "float32"

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def peft_targets(self) -> Any:
        targets = tuple(self.target_modules)
        if targets == ("default",):
            return list(DEFAULT_TARGETS)
        if targets == ("all-linear",):
            return "all-linear"
        return list(targets)


def _import_peft():
    try:
        import peft
    except ImportError:
        raise ConfigError(f"--lora.rank: LoRA needs PEFT: {PEFT_INSTALL}") from None
    return peft


def has_lora(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds PEFT LoRA layers."""
    return any(is_adapter_name(n) for n, _ in model.named_parameters())


def is_adapter_name(name: str) -> bool:
    """Whether a parameter name (the model's or PEFT's saved form) is a LoRA adapter's."""
    return ".lora_A." in name or ".lora_B." in name or name.endswith((".lora_A", ".lora_B"))


def base_name(name: str) -> str:
    """The Hugging Face name of a weight of a LoRA-injected model (``.base_layer`` removed)."""
    return name.replace(".base_layer.", ".")


def apply_lora(model: torch.nn.Module, settings: LoraSettings) -> torch.nn.Module:
    """Inject LoRA layers into ``model`` in place (see the module docstring) and return it.

    Raises :class:`ConfigError` naming the flag when PEFT is missing, when the model class cannot be
    wrapped, or when ``lora.target_modules`` matches no module of the model.
    """
    peft = _import_peft()
    if has_lora(model):
        raise ConfigError("--lora.rank: the model already holds LoRA layers (a PEFT adapter was loaded as the "
                          "model): give the base model with --model, or merge the adapter first")
    _check_targets(model, settings)
    config = peft.LoraConfig(r=int(settings.rank), lora_alpha=float(settings.alpha),
                             lora_dropout=float(settings.dropout), target_modules=settings.peft_targets(),
                             bias="none", task_type="CAUSAL_LM")
    try:
        peft.get_peft_model(model, config)  # changes ``model``'s modules in place; the wrapper is not kept
    except ValueError as err:
        first = (str(err).splitlines() or [""])[0][:300]
        raise ConfigError(f"--lora.target_modules {','.join(settings.target_modules)}: {first} (this model's "
                          f"linear layers: {', '.join(_adaptable_names(model))})") from None
    except (TypeError, NotImplementedError, AttributeError) as err:
        raise ConfigError(f"--lora.rank: PEFT cannot add LoRA to {type(model).__name__}: {type(err).__name__}: "
                          f"{(str(err).splitlines() or [''])[0][:300]}") from None
    if not has_lora(model):
        raise ConfigError(f"--lora.target_modules {','.join(settings.target_modules)} matches no layer of "
                          f"{type(model).__name__}")
    base = getattr(torch, settings.base_dtype)
    for name, p in model.named_parameters():
        if is_adapter_name(name):
            p.requires_grad_(True)
            continue
        p.requires_grad_(False)
        if base != p.dtype and p.is_floating_point():
            p.data = p.data.to(base)
    model._flashreinforce_lora = settings  # read back by save_adapter / the checkpoints
    return model


def _output_projection(model: torch.nn.Module) -> str | None:
    """The module name of ``model``'s output projection (``lm_head``), or ``None``."""
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    return next((n for n, m in model.named_modules() if head is not None and m is head), None)


def _adaptable_names(model: torch.nn.Module) -> list[str]:
    """The names (last part) of ``model``'s linear layers that can carry adapters: all but the output
    projection."""
    head = _output_projection(model)
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and n != head})


def _check_targets(model: torch.nn.Module, settings: LoraSettings) -> None:
    """:class:`ConfigError` for a ``lora.target_modules`` name that is the output projection (the learner
    computes log-probabilities from its weight directly, so an adapter there would get no gradient:
    a raw autograd error at the first update) or that matches no module (PEFT ignores it when
    another name matches)."""
    targets = tuple(settings.target_modules)
    if targets in (("default",), ("all-linear",)):
        return
    flag = f"--lora.target_modules {','.join(targets)}"
    head = _output_projection(model)
    names = [n for n, _ in model.named_modules() if n]
    for t in targets:
        matched = [n for n in names if n == t or n.endswith("." + t)]
        if head is not None and head in matched:
            raise ConfigError(f"{flag}: {t} is the output projection, which cannot carry LoRA adapters here (the "
                              "learner computes log-probabilities from its weight directly); this model's linear "
                              f"layers that can: {', '.join(_adaptable_names(model))}")
        if not matched:
            raise ConfigError(f"{flag}: {t!r} matches no layer of {type(model).__name__} (this model's linear "
                              f"layers: {', '.join(_adaptable_names(model))})")


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors under the model's own names (``...lora_A.default.weight``)."""
    return {n: p for n, p in model.named_parameters() if is_adapter_name(n)}


def frozen_state_names(model: torch.nn.Module) -> set[str]:
    """Names in ``model.state_dict()`` of the parameters that do not train (the base weights under
    LoRA), each tied alias included: a tied output projection (``lm_head.weight``) is the input
    embedding under a second name, and a weight store that missed it would send it after every update."""
    return {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def peft_adapter_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Adapter tensors renamed to PEFT's saved form: ``base_model.model.`` in front, ``.default`` out."""
    out = {}
    for name, t in state.items():
        if is_adapter_name(name):
            out["base_model.model." + name.replace(".default.", ".")] = t
    return out


def _adapter_config(settings: LoraSettings, base_model: str, names) -> dict[str, Any]:
    targets = sorted({n.split(".lora_A.")[0].rsplit(".", 1)[-1] for n in names if ".lora_A." in n})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": int(settings.rank), "lora_alpha": float(settings.alpha), "lora_dropout": float(settings.dropout),
            "target_modules": targets, "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
            "modules_to_save": None, "init_lora_weights": True, "use_rslora": False, "use_dora": False}


def _umask() -> int:
    """The process's umask, read without changing it (``os.umask`` would, for every thread, for a moment)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def _write_new(directory: Path, name: str, data: bytes, private: bool) -> None:
    """``directory/name`` holding ``data``, written to a new file of a random name (created exclusively,
    mode 0600) then renamed over ``name``: a symlink planted under ``name`` is replaced, never followed.
    ``private``: the file keeps mode 0600; else it gets the umask's mode, like any file written."""
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            if not private:
                os.fchmod(fh.fileno(), 0o666 & ~_umask())
            fh.write(data)
        os.replace(tmp, directory / name)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_adapter(directory: str | Path, state: Mapping[str, torch.Tensor], settings: LoraSettings, *,
                  base_model: str = "", private: bool = False) -> Path:
    """Write the adapter tensors of ``state`` (the model's names; other tensors are ignored) in PEFT's
    format (``adapter_config.json``, ``adapter_model.safetensors``, float32). Returns the folder.

    Each file is written under a new random name and renamed into place, so a symlink already in the
    folder is replaced rather than written through; ``private``: the files get mode 0600 (the vLLM
    engine's adapters in shared memory, in a folder of mode 0700 it made itself)."""
    from safetensors.torch import save

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    adapters = {n: t for n, t in state.items() if is_adapter_name(n)}
    if not adapters:
        raise ValueError("write_adapter: no LoRA adapter tensors given")
    tensors = peft_adapter_state(adapters)
    _write_new(directory, "adapter_model.safetensors",
               save({k: v.detach().to("cpu", torch.float32).contiguous() for k, v in tensors.items()}), private)
    config = _adapter_config(settings, base_model, adapters)
    _write_new(directory, "adapter_config.json", json.dumps(config, indent=1).encode(), private)
    return directory


def save_adapter(model: torch.nn.Module, directory: str | Path, *, base_model: str) -> Path:
    """Write ``model``'s adapters (LoRA layers of :func:`apply_lora`) in PEFT's format."""
    settings = getattr(model, "_flashreinforce_lora", None)
    if settings is None:
        raise ValueError("save_adapter: the model holds no LoRA layers of apply_lora")
    return write_adapter(directory, adapter_state(model), settings, base_model=base_model)


def merged_model(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` with its adapters folded into the base weights (a bf16 base in float32), as a
    plain model."""
    merged = copy.deepcopy(model)
    if not has_lora(merged):
        return merged
    _import_peft()
    from peft.tuners.lora import LoraLayer

    for p in merged.parameters():  # a bf16 base is merged in float32; float32 and float64 stay
        if p.dtype in (torch.bfloat16, torch.float16):
            p.data = p.data.float()
    for name, module in list(merged.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge()  # W += scale * B @ A
            parent_name, _, child = name.rpartition(".")
            parent = merged.get_submodule(parent_name) if parent_name else merged
            setattr(parent, child, module.get_base_layer())
    for p in merged.parameters():
        p.requires_grad_(True)
    if hasattr(merged, "_flashreinforce_lora"):
        del merged._flashreinforce_lora
    return merged


def copy_sharing_frozen(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose frozen parameters (``requires_grad`` False: the base weights under LoRA)
    are new ``Parameter`` objects over the same storage, so that the copy costs only the trainable
    weights. The copy's own parameter objects may be cast or replaced (``.to(dtype)`` rebinds them) without
    touching ``model``'s; writing into a shared one in place would change both, which engines never do
    (:meth:`flashreinforce.engines.hf.HFEngine.load_weights` skips a tensor whose storage it already holds).
    """
    memo = {id(p): torch.nn.Parameter(p.data, requires_grad=False)  # .data: a version counter of its own
            for p in model.parameters() if not p.requires_grad}
    return copy.deepcopy(model, memo)


def base_model_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` without its adapters: the frozen base weights the adapters were trained on (in
    their dtype, sharing ``model``'s storage), as a plain model, the base of an exported adapter."""
    base = copy_sharing_frozen(model)
    if not has_lora(base):
        return base
    _import_peft()
    from peft.tuners.lora import LoraLayer

    for name, module in list(base.named_modules()):
        if isinstance(module, LoraLayer):
            parent_name, _, child = name.rpartition(".")
            parent = base.get_submodule(parent_name) if parent_name else base
            setattr(parent, child, module.get_base_layer())
    for attr in ("_flashreinforce_lora", "peft_config", "_hf_peft_config_loaded"):
        if attr in vars(base):
            delattr(base, attr)
    return base


def load_adapter_dir(directory: str | Path, base: torch.nn.Module) -> torch.nn.Module:
    """``base`` with the PEFT adapter folder ``directory`` applied and merged (a plain model)."""
    peft = _import_peft()
    wrapped = peft.PeftModel.from_pretrained(base, str(directory))
    return wrapped.merge_and_unload()
