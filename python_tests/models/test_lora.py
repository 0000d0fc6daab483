"""LoRA adapters (PEFT): the learner's gradient is the full model's projected onto the adapters,
engines serve the adapters the learner trains, checkpoints and exports hold them, bad settings are
one line naming the flag."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft", reason="LoRA needs PEFT: pip install 'flashreinforce[lora]'")

from flashreinforce.config import ConfigError  # noqa: E402
from flashreinforce.engines import (GenerationRequest, LocalWeightStore, SamplingParams, create_engine,  # noqa: E402
                                    sampling_log_probs)
from flashreinforce.loss import flashreinforce_loss_packed  # noqa: E402
from flashreinforce.models.lora import (LoraSettings, adapter_state, apply_lora, copy_sharing_frozen,  # noqa: E402
                                        frozen_state_names, has_lora, merged_model, save_adapter)
from flashreinforce.trainer.learning.packing import pack  # noqa: E402
from flashreinforce.trainer.learning.scoring import token_log_probs  # noqa: E402
from python_tests.builders import random_trajectory, tiny_causal_lm  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 40


def lora_model(seed: int = 0, rank: int = 3, alpha: float = 6.0, dtype=torch.float64):
    """A tiny model with adapters on every projection and B drawn too (PEFT starts B at 0)."""
    model = tiny_causal_lm(VOCAB, seed=seed).to(dtype)
    apply_lora(model, LoraSettings(rank=rank, alpha=alpha, base_dtype=str(dtype).removeprefix("torch.")))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in adapter_state(model).values():
            p.copy_(0.2 * torch.randn(p.shape, generator=g, dtype=dtype))
    return model


def objective(model, trajectories, *, learner_path: bool) -> torch.Tensor:
    """The FlashREINFORCE loss of ``trajectories``: through the learner's packed forward (its float32
    log-probabilities, per-document attention, shared prefixes), or, in float64 throughout, from the
    model's plain forward one trajectory at a time."""
    batch = pack(trajectories)
    if learner_path:
        logp, _ = token_log_probs(model, batch, packed_forward=True, share_prefixes=True)
    else:
        parts = []
        for t in trajectories:
            ids = torch.tensor([t.token_ids])
            lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), -1)
            parts.append(torch.cat([torch.zeros(1, dtype=torch.float64), lp.gather(1, ids[0, 1:, None])[:, 0]]))
        logp = torch.cat(parts)
    loss, _ = flashreinforce_loss_packed(logp, batch.behavior_log_probs.to(logp.dtype), batch.rewards.to(logp.dtype),
                                         batch.cu_seqlens, batch.action_mask, delta=float("inf"))
    return loss


@pytest.mark.parametrize("learner_path", [False, True], ids=["float64", "learner_packed_forward"])
def test_the_adapter_gradient_is_the_full_gradient_projected_onto_the_adapters(learner_path):
    """W' = W + s B A: dL/dB = s (dL/dW') A^T and dL/dA = s B^T (dL/dW'). Exact in float64; through the
    learner's packed forward (float32 log-probabilities) to float32 rounding."""
    rng = random.Random(0)
    trajectories = [random_trajectory(rng, VOCAB) for _ in range(5)]
    shared = list(trajectories[0].token_ids[:4])  # a shared prefix, so the packed forward computes it once
    for t in trajectories[1:3]:
        t.token_ids[:4] = shared
    model = lora_model()
    objective(model, trajectories, learner_path=learner_path).backward()
    merged = merged_model(model).double()
    objective(merged, trajectories, learner_path=learner_path).backward()
    tol = dict(rtol=1e-9, atol=1e-12) if not learner_path else dict(rtol=1e-4, atol=1e-7)
    scale = 6.0 / 3
    checked = 0
    for name, module in model.named_modules():
        lora_a = getattr(module, "lora_A", None)
        if not isinstance(lora_a, torch.nn.ModuleDict):
            continue
        a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
        full = merged.get_submodule(name).weight.grad
        assert full.abs().max() > 0
        torch.testing.assert_close(b.grad, scale * full @ a.detach().T, **tol)
        torch.testing.assert_close(a.grad, scale * b.detach().T @ full, **tol)
        assert module.base_layer.weight.grad is None  # the base is frozen
        checked += 1
    assert checked == 2 * 7  # two layers, seven projections each


def test_only_adapters_train_and_the_merge_is_the_same_function():
    model = lora_model(dtype=torch.float32)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    x = torch.randint(0, VOCAB, (2, 9))
    merged = merged_model(model)
    assert not has_lora(merged)
    torch.testing.assert_close(merged(x).logits, model(x).logits, rtol=1e-5, atol=1e-5)


def test_bad_settings_are_one_line_naming_the_flag():
    with pytest.raises(ConfigError, match=r"--lora.target_modules nope: .*this model's linear layers: .*q_proj"):
        apply_lora(tiny_causal_lm(VOCAB), LoraSettings(rank=2, target_modules=("nope",)))
    # A valid name beside an unknown one: the unknown one is named (PEFT ignored it), the model untouched.
    model = tiny_causal_lm(VOCAB)
    with pytest.raises(ConfigError, match=r"--lora.target_modules q_proj,no_such: 'no_such' matches no layer") as err:
        apply_lora(model, LoraSettings(rank=2, target_modules=("q_proj", "no_such")))
    assert "lm_head" not in str(err.value) and not has_lora(model)
    # The output projection: refused by name (it gave an autograd error at the first update), and not
    # offered in the list of layers that can carry adapters.
    for targets in (("lm_head",), ("q_proj", "lm_head")):
        with pytest.raises(ConfigError, match=r"lm_head is the output projection, which cannot carry LoRA") as err:
            apply_lora(tiny_causal_lm(VOCAB, tied=False), LoraSettings(rank=2, target_modules=targets))
        assert "\n" not in str(err.value) and "lm_head" not in str(err.value).split("that can: ")[1]
    model = lora_model(dtype=torch.float32)
    with pytest.raises(ConfigError, match="already holds LoRA layers"):
        apply_lora(model, LoraSettings(rank=2))


def test_the_hf_engine_serves_the_adapters_it_is_sent():
    """The engine's copy gets the adapters only (the base once) and samples from the adapted policy."""
    model = lora_model(dtype=torch.float32)
    engine = create_engine("hf", tiny_causal_lm(VOCAB), pad_token_id=0, version=-1,
                           options={"lora": {"rank": 3, "alpha": 6.0}})
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    engine.load_weights(state, 0)
    full = engine.last_load[1]
    adapters_only = {k: (v.clone() if ".lora_" in k else state[k]) for k, v in state.items()}
    engine.load_weights(adapters_only, 1)
    assert 0 < engine.last_load[1] == sum(v.numel() * 4 for k, v in state.items() if ".lora_" in k) < full / 5
    params = SamplingParams(temperature=1.0)
    reference = merged_model(model).double()
    req = GenerationRequest([5, 9, 11, 3], 6, seed=3)
    g = engine.generate([req], params)[0]
    with torch.no_grad():
        for k, tok in enumerate(g.token_ids):
            logits = reference(input_ids=torch.tensor([list(req.token_ids) + g.token_ids[:k]])).logits[0, -1:]
            assert g.log_probs[k] == pytest.approx(float(sampling_log_probs(logits, params)[0, tok]), abs=1e-4)


def test_an_adapters_only_load_walks_the_parameters_once_not_once_per_absent_name(monkeypatch):
    """Under LoRA most names are absent from a load (the frozen base); checking each against the tied
    names used to walk every parameter once per absent name, about a second per sync at SmolLM2's size."""
    model = lora_model(dtype=torch.float32)
    engine = create_engine("hf", tiny_causal_lm(VOCAB), pad_token_id=0, version=-1,
                           options={"lora": {"rank": 3, "alpha": 6.0}})
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    engine.load_weights(state, 0)
    walks = []
    original = type(engine)._tied_keys
    monkeypatch.setattr(type(engine), "_tied_keys", lambda self: walks.append(1) or original(self))
    adapters_only = {k: v.clone() for k, v in state.items() if ".lora_" in k}
    assert len(state) - len(adapters_only) > 10  # many absent names
    engine.load_weights(adapters_only, 1)
    assert len(walks) == 1 and engine.version == 1  # the absent names were checked, with one walk
    fresh = create_engine("hf", tiny_causal_lm(VOCAB), pad_token_id=0, version=-1,
                          options={"lora": {"rank": 3, "alpha": 6.0}})
    with pytest.raises(ValueError, match=r"load_weights: missing \['model\."):
        fresh.load_weights(adapters_only, 0)  # nothing loaded before: the frozen base is missing, not skipped


def test_frozen_names_cover_a_tied_output_projection_so_only_adapters_travel_after_the_first_load():
    model = lora_model(dtype=torch.float32)
    assert model.config.tie_word_embeddings and "lm_head.weight" in model.state_dict()
    frozen = frozen_state_names(model)
    # Every state-dict entry is either an adapter or frozen: the tied lm_head.weight is frozen too.
    assert "lm_head.weight" in frozen and "model.embed_tokens.weight" in frozen
    assert set(model.state_dict()) - frozen == set(adapter_state(model))
    store = LocalWeightStore()
    store.publish(model.state_dict(), 0, frozen)
    first = dict(store.fetch(-1)[1])
    store.publish(model.state_dict(), 1, frozen)
    second = store.fetch(0)[1]
    kept = {k for k in second if second[k] is first[k]}
    assert kept == frozen


def test_engines_share_the_learners_frozen_base_and_never_write_into_it():
    """The learner's model, the weight store and each engine's copy hold one base; an engine's first load
    copies the adapters only, writes nothing into the shared base, and samples as an engine with its own
    copy does; an engine that casts its weights gets its own, leaving the learner's alone."""
    model = lora_model(dtype=torch.float32)
    frozen = frozen_state_names(model)
    base = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    before = {n: (p.data_ptr(), p._version, p.dtype) for n, p in base.items()}
    store = LocalWeightStore()
    store.publish(model.state_dict(), 0, frozen)
    shared = create_engine("hf", copy_sharing_frozen(model), pad_token_id=0, version=-1)
    own = create_engine("hf", tiny_causal_lm(VOCAB), pad_token_id=0, version=-1,
                        options={"lora": {"rank": 3, "alpha": 6.0}})
    cast = create_engine("hf", copy_sharing_frozen(model), pad_token_id=0, version=-1, options={"dtype": "bfloat16"})
    for engine in (shared, own, cast):
        assert store.sync(engine)
    adapters = sum(v.numel() * 4 for v in adapter_state(model).values())
    assert shared.last_load[1] == adapters < own.last_load[1]
    weights = dict(shared.model.named_parameters())
    assert all(weights[n].data_ptr() == before[n][0] for n in base)  # one base in memory
    assert all(store.fetch(-1)[1][n].data_ptr() == before[n][0] for n in frozen if n in base)
    assert {n: (p.data_ptr(), p._version, p.dtype) for n, p in base.items()} == before  # never written, never cast
    assert all(p.dtype == torch.bfloat16 for p in cast.model.parameters())
    req, params = GenerationRequest([5, 9, 11, 3], 6, seed=3), SamplingParams(temperature=1.0)
    a, b = shared.generate([req], params)[0], own.generate([req], params)[0]
    assert a.token_ids == b.token_ids and a.log_probs == pytest.approx(b.log_probs, abs=1e-5)


def test_an_adapter_folder_loads_with_peft_and_as_a_model(tmp_path):
    model = lora_model(dtype=torch.float32)
    folder = save_adapter(model, tmp_path / "adapter", base_model="tiny-qwen2")
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["r"] == 3 and config["base_model_name_or_path"] == "tiny-qwen2"
    base = tiny_causal_lm(VOCAB)
    wrapped = peft.PeftModel.from_pretrained(base, str(folder))
    x = torch.randint(0, VOCAB, (1, 7))
    torch.testing.assert_close(wrapped(x).logits, model(x).logits, rtol=1e-5, atol=1e-5)


def test_writing_an_adapter_replaces_planted_symlinks_and_private_files_are_0600(tmp_path):
    import os
    import stat

    from flashreinforce.models.lora import write_adapter

    model = lora_model(dtype=torch.float32)
    folder = tmp_path / "adapter"
    folder.mkdir()
    victims = {name: tmp_path / f"victim-{name}" for name in ("adapter_config.json", "adapter_model.safetensors")}
    for name, victim in victims.items():
        victim.write_text("someone's file")
        victim.chmod(0o600)
        (folder / name).symlink_to(victim)
    write_adapter(folder, adapter_state(model), model._flashreinforce_lora, private=True)
    for name, victim in victims.items():
        assert victim.read_text() == "someone's file"  # never written through
        st = os.lstat(folder / name)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert json.loads((folder / "adapter_config.json").read_text())["r"] == 3
    assert sorted(os.listdir(folder)) == sorted(victims)  # no temporary file left
    public = save_adapter(model, tmp_path / "public", base_model="tiny-qwen2")  # an export: the umask's mode
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(public / "adapter_config.json").st_mode) == 0o666 & ~umask


def _train(out: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "flashreinforce.cli", "train", "--preset", "toy", "--output", str(out),
           "--no_progress", "--eval.steps", "0", "--eval.eval_at_start", "false", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_lora_run_syncs_adapters_checkpoints_them_resumes_and_exports_both_forms(tmp_path):
    out = tmp_path / "run"
    proc = _train(out, "--lora.rank", "4", "--train.max_steps", "6", "--ckpt.save_steps", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    synced = [r["weight_sync_bytes"] for r in rows if r["weight_sync_bytes"]]
    ckpt = out / "checkpoints" / "step_00000006"
    from safetensors.torch import load_file

    stored = load_file(str(ckpt / "model.safetensors"))
    assert stored and all(".lora_" in k for k in stored)
    # The frozen base is never copied to the engines (they share the learner's, and start from the base the
    # learner wraps): only the adapters travel, from the first load on.
    assert synced and set(synced) == {float(sum(t.numel() * t.element_size() for t in stored.values()))}
    assert (out / "hf" / "adapter" / "adapter_config.json").is_file() and (out / "hf" / "config.json").is_file()
    # Resume continues the adapters; resuming them as a full-model run is refused naming the flag.
    proc = _train(out, "--resume", "--train.max_steps", "8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = _train(out, "--resume", "--train.max_steps", "10", "--lora.rank", "0")
    assert proc.returncode != 0 and "lora.rank" in proc.stderr
    # Both exports evaluate as the same model.
    from flashreinforce.models.loading import build_model

    a, _ = build_model(str(out / "hf" / "adapter"), device=torch.device("cpu"))
    b, _ = build_model(str(out / "hf"), device=torch.device("cpu"))
    c, _ = build_model(str(out), device=torch.device("cpu"))  # the run directory: its newest (adapters-only) checkpoint
    x = torch.randint(0, 90, (1, 8))
    torch.testing.assert_close(a(x).logits, b(x).logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c(x).logits, b(x).logits, rtol=1e-5, atol=1e-5)
