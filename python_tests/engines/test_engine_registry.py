"""Engines by name: kinds registered in their own packages, each engine built from its own typed
options (never from the run's configuration), and the trainer's boundary that builds those options."""

import dataclasses
import inspect
import json
import subprocess
import sys

import pytest

from flashreinforce.engines import EngineKind, EngineRun, create_engine, engine_kind, engine_names, register_engine
from flashreinforce.engines.hf import HFEngine, HFOptions
from flashreinforce.engines.registry import ENGINE_REGISTRY, SHIPPED_ENGINES
from flashreinforce.engines.vllm import VLLMEngine, VLLMOptions


def _constructor_defaults(cls) -> dict:
    return {name: p.default for name, p in inspect.signature(cls.__init__).parameters.items()
            if p.default is not inspect.Parameter.empty}


@pytest.mark.parametrize("options_type, engine_class, not_arguments", [(HFOptions, HFEngine, set()),
                                                                       (VLLMOptions, VLLMEngine, {"num_engines"})])
def test_each_option_defaults_to_the_engines_own_default(options_type, engine_class, not_arguments):
    defaults = _constructor_defaults(engine_class)
    fields = {f.name: f.default for f in dataclasses.fields(options_type) if f.name not in not_arguments}
    assert fields == {name: defaults[name] for name in fields}, "an option's default differs from the engine's"


def test_the_shipped_engines_register_themselves_in_their_packages():
    assert engine_names()[:2] == ("hf", "vllm")
    for name, package in SHIPPED_ENGINES.items():
        kind = engine_kind(name)
        assert kind.name == name and type(kind).__module__.startswith(package + ".")
        assert dataclasses.is_dataclass(kind.options_type) and kind.options_type.__dataclass_params__.frozen


def test_listing_the_engines_imports_no_engine_and_no_torch():
    code = ("import json, sys\nfrom flashreinforce.config.sections import engine_names\n"
            "names = engine_names()\nprint(json.dumps([list(names), sorted(sys.modules)]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    names, loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert names[:2] == ["hf", "vllm"]
    engines = ("flashreinforce.engines.hf", "flashreinforce.engines.vllm")
    assert not [m for m in loaded if m == "torch" or m.startswith(engines)]


@dataclasses.dataclass(frozen=True)
class EchoOptions:
    greeting: str = "hello"
    seed: int = 0


class EchoEngine:
    def __init__(self, options):
        self.options = options


def test_a_new_engine_is_a_registered_class_with_its_options():
    @register_engine
    class EchoKind(EngineKind):
        name = "echo_for_a_test"
        options_type = EchoOptions

        def options(self, run: EngineRun) -> EchoOptions:
            return EchoOptions(greeting=run.section["greeting"], seed=run.seed)

        def create(self, model, *, pad_token_id, version, options):
            return EchoEngine(options)

    try:
        assert "echo_for_a_test" in engine_names()
        kind = engine_kind("echo_for_a_test")
        options = kind.options(EngineRun(seed=5, section={"greeting": "hi"}))
        assert options == EchoOptions("hi", 5)
        assert create_engine("echo_for_a_test", None, pad_token_id=0, options=options).options is options
        from_mapping = create_engine("echo_for_a_test", None, pad_token_id=0, options={"seed": 2})
        assert from_mapping.options == EchoOptions(seed=2)
        with pytest.raises(ValueError, match=r"takes the options \['greeting', 'seed'\], got \['colour'\]"):
            create_engine("echo_for_a_test", None, pad_token_id=0, options={"colour": "red"})
    finally:
        ENGINE_REGISTRY.pop("echo_for_a_test", None)


def test_a_kind_whose_options_are_not_a_frozen_dataclass_is_refused():
    class Loose(EngineKind):
        name = "loose_for_a_test"
        options_type = dict

        def create(self, model, *, pad_token_id, version, options):
            raise AssertionError

    with pytest.raises(TypeError, match="options_type must be a frozen dataclass"):
        register_engine(Loose)
    assert "loose_for_a_test" not in ENGINE_REGISTRY


def test_the_trainer_hands_the_vllm_engine_its_own_options_from_the_configuration():
    from flashreinforce.config import TrainerConfig
    from flashreinforce.trainer.run import components

    cfg = TrainerConfig.from_preset("arith")
    cfg.rollout.engine = "vllm"
    cfg.rollout.engine_dtype = "bf16"
    cfg.vllm.num_engines, cfg.vllm.gpu_memory_utilization, cfg.vllm.kv_cache_gib = 3, 0.4, 0.5
    cfg.rollout.episodes_per_call, cfg.rollout.inflight_check_tokens = 7, 9
    options = components.engine_options(cfg, 11, "cpu")
    assert isinstance(options, VLLMOptions)
    assert (options.num_engines, options.gpu_memory_utilization, options.kv_cache_bytes) == (3, 0.4, 2**29)
    assert (options.seed, options.dtype, options.max_num_seqs, options.pause_check_tokens) == (11, "bfloat16", 7, 9)
    assert options.max_model_len == cfg.data.max_len
    kind = engine_kind("vllm")
    assert kind.num_workers(components.engine_run(cfg, 11, "cpu"), options) == 3
    cfg.rollout.engine = "hf"
    assert components.engine_options(cfg, 11, "cpu") == HFOptions(dtype="bfloat16")
