"""The first weight sync of a worker sends only what the first update changed: under LoRA the adapters,
not the frozen base again (an engine built from the policy is told which published tensors it holds;
an engine built without weights loads the newest version at its start, apart from the syncs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashreinforce.engines import HFEngine, LocalWeightStore, SamplingParams
from flashreinforce.models.tokenizers import CharTokenizer
from flashreinforce.trainer.rollout.buffer import RolloutBuffer
from flashreinforce.trainer.rollout.settings import RolloutSettings
from flashreinforce.trainer.rollout.worker import RolloutWorker
from python_tests.builders import tiny_causal_lm

pytest.importorskip("peft")
from flashreinforce.models.lora import LoraSettings, adapter_state, apply_lora, frozen_state_names  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
TOK = CharTokenizer()
LORA = {"rank": 3, "alpha": 6.0}


def _policy():
    model = apply_lora(tiny_causal_lm(TOK.vocab_size), LoraSettings(**LORA))
    return model


def _worker(engine, store) -> RolloutWorker:
    settings = RolloutSettings(max_new_tokens=4, max_len=64, sampling=SamplingParams(), episodes_per_call=2, seed=0)
    buf = RolloutBuffer(batch_groups=2, async_queue_size=1, vocab_size=TOK.vocab_size)
    return RolloutWorker(0, engine, None, TOK, buf, store, settings)


def _next_version(policy, store, version: int) -> int:
    """An optimizer step's worth of change in the adapters, published as the learner publishes it."""
    with torch.no_grad():
        for p in adapter_state(policy).values():
            p.add_(0.01)
    store.publish(policy.state_dict(), version, frozen=frozen_state_names(policy))
    return sum(p.numel() * p.element_size() for p in adapter_state(policy).values())


def test_an_engine_built_from_the_policy_sends_only_the_adapters_at_its_first_sync():
    policy = _policy()
    store = LocalWeightStore()
    store.publish(policy.state_dict(), 0, frozen=frozen_state_names(policy))
    # As the trainer builds it: a copy of the policy, at the published version, with the same LoRA layers.
    engine = HFEngine(_copy(policy), pad_token_id=0, version=0, lora=LORA)
    worker = _worker(engine, store)
    worker._start_weights()
    assert worker.start_weight_load == (0.0, 0)  # nothing to load: it holds version 0
    adapters = _next_version(policy, store, 1)
    worker._sync_weights()
    assert engine.version == 1
    full = sum(v.numel() * v.element_size() for v in policy.state_dict().values())
    # Before, the first sync sent every tensor (the engine knew none of the published objects).
    assert worker.last_weight_sync[1] == adapters < full / 5
    with torch.no_grad():  # and the engine holds the new adapters
        for name, p in adapter_state(policy).items():
            assert torch.equal(dict(engine.model.named_parameters())[name], p)


def test_an_engine_without_weights_loads_the_newest_version_at_its_start_then_syncs_only_changes():
    policy = _policy()
    store = LocalWeightStore()
    store.publish(policy.state_dict(), 0, frozen=frozen_state_names(policy))
    # Built from the config with no weights of the policy's (as the vLLM engine is): version -1.
    engine = HFEngine(apply_lora(tiny_causal_lm(TOK.vocab_size, seed=9), LoraSettings(**LORA)), pad_token_id=0,
                      version=-1, lora=LORA)
    worker = _worker(engine, store)
    worker._start_weights()
    full = sum(v.numel() * v.element_size() for v in policy.state_dict().values())
    assert engine.version == 0 and worker.start_weight_load[1] == full
    assert worker.last_weight_sync == (0.0, 0) and worker.weight_loads == 0  # not a sync of an update
    adapters = _next_version(policy, store, 1)
    worker._sync_weights()
    assert worker.last_weight_sync[1] == adapters and worker.weight_loads == 1


def _copy(model):
    import copy

    return copy.deepcopy(model)


@pytest.mark.slow
def test_a_lora_run_syncs_the_adapters_only_from_its_first_update(tmp_path):
    """In a real run (the toy preset, one worker): every sync, the first included, is the adapters'
    bytes (the frozen base used to travel at the first sync)."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "flashreinforce.cli", "train", "--preset", "toy", "--output", str(out), "--no_progress",
           "--eval.steps", "0", "--eval.eval_at_start", "false", "--lora.rank", "4", "--rollout.num_workers", "1",
           "--train.max_steps", "4", "--ckpt.save_steps", "4"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    from safetensors.torch import load_file

    adapters = sum(t.numel() * t.element_size() for t in
                   load_file(str(out / "checkpoints" / "step_00000004" / "model.safetensors")).values())
    synced = [r["weight_sync_bytes"] for r in rows if r["weight_sync_bytes"]]
    assert synced and all(b == adapters for b in synced), (synced, adapters)
