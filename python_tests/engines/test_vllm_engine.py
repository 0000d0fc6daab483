"""The rollout-engine contract, checked on the hf engine here and on the vLLM engine on a GPU.

:func:`check_engine_contract` is what any :class:`~flashreinforce.engines.RolloutEngine` must do:
one generation per request, in order, within its token budget, ending on a stop token exactly when
it says ``stop``; per-token sampling log-probabilities of the *processed* distribution it sampled from
(temperature, top-k), equal to an independent float64 recomputation with the weights of the version
it reports; reproducible from the request seeds; new weights loaded in place by version.

The vLLM tests need CUDA and ``pip install 'flashreinforce[vllm]'``; without them they are skipped
with the reason shown (``pytest -rs``). They were written without a GPU to run them on: see
docs/distributed.md for what has and has not been run where.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from flashreinforce.engines import GenerationRequest, SamplingParams, create_engine, sampling_log_probs

ROOT = Path(__file__).resolve().parents[2]

# Head size 64 and a vocabulary multiple of 64: shapes every vLLM attention backend supports.
CONTRACT_CONFIG = dict(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       tie_word_embeddings=True, rope_theta=10000.0)

HAS_CUDA = torch.cuda.is_available()
try:
    import vllm  # noqa: F401

    HAS_VLLM = True
except ImportError:
    HAS_VLLM = False
needs_vllm_gpu = pytest.mark.skipif(not (HAS_CUDA and HAS_VLLM),
                                    reason="needs a CUDA GPU and vLLM (pip install 'flashreinforce[vllm]')")


def contract_model(seed: int) -> transformers.Qwen2ForCausalLM:
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**CONTRACT_CONFIG)).float().eval()
    with torch.no_grad():  # sharper distributions than the default init, so sampling is not uniform
        model.lm_head.weight.mul_(8.0)
    return model


def requests(n: int = 6, seed: int = 0) -> list[GenerationRequest]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 3 + i * 2
        ids = torch.randint(8, CONTRACT_CONFIG["vocab_size"], (length,), generator=g).tolist()
        out.append(GenerationRequest(ids, max_new_tokens=1 + (i * 3) % 7, seed=1000 + i))
    return out


def reference_log_probs(model64, context: list[int], generated: list[int], params: SamplingParams) -> list[float]:
    """float64 log-probability of each generated token under the processed distribution it was drawn from."""
    out = []
    with torch.no_grad():
        for k, tok in enumerate(generated):
            ids = torch.tensor([context + generated[:k]])
            logits = model64(input_ids=ids).logits[0, -1:].double()
            out.append(float(sampling_log_probs(logits, params)[0, tok]))
    return out


def check_engine_contract(make_engine, *, atol: float, batch_invariant: bool = True) -> None:
    """Run the contract on ``make_engine(model)`` (an engine whose weights may be replaced)."""
    models = [contract_model(0), contract_model(1)]
    states = [{k: v.clone() for k, v in m.state_dict().items()} for m in models]
    models64 = [m.double() for m in (contract_model(0), contract_model(1))]
    engine = make_engine(models[0])
    try:
        stop = (5, 7)
        sampled = SamplingParams(temperature=0.7, top_p=1.0, top_k=0, stop_token_ids=stop)
        for version, state in enumerate(states):
            engine.load_weights(state, version)
            assert engine.version == version
            reqs = requests(seed=version)
            gens = engine.generate(reqs, sampled)
            assert len(gens) == len(reqs)
            for r, g in zip(reqs, gens):
                assert g.policy_version == version
                assert 1 <= len(g.token_ids) <= r.max_new_tokens
                assert len(g.log_probs) == len(g.token_ids)
                assert all(0 <= t < CONTRACT_CONFIG["vocab_size"] for t in g.token_ids)
                assert all(t not in stop for t in g.token_ids[:-1])  # a turn ends at its first stop token
                assert g.finish_reason == ("stop" if g.token_ids[-1] in stop else "length")
                if g.finish_reason == "length":
                    assert len(g.token_ids) == r.max_new_tokens
                assert all(math.isfinite(x) and x <= 0.0 for x in g.log_probs)
                want = reference_log_probs(models64[version], list(r.token_ids), g.token_ids, sampled)
                for got_lp, want_lp in zip(g.log_probs, want):
                    assert got_lp == pytest.approx(want_lp, abs=atol), (version, r.seed)
            again = engine.generate(reqs, sampled)  # the request seeds fix the sampling noise
            assert [g.token_ids for g in again] == [g.token_ids for g in gens]
            if batch_invariant:
                alone = engine.generate([reqs[3]], sampled)[0]
                assert alone.token_ids == gens[3].token_ids
        # top-k 1: the processed distribution puts all its mass on one token, so a recorded
        # log-probability of the raw distribution (< 0) would be caught here.
        greedy_by_topk = SamplingParams(temperature=1.0, top_p=1.0, top_k=1, stop_token_ids=())
        for g in engine.generate(requests(seed=9), greedy_by_topk):
            assert all(abs(x) <= atol for x in g.log_probs)
        # temperature 0: greedy, recorded as 0
        for g in engine.generate(requests(seed=9), SamplingParams(temperature=0.0, stop_token_ids=())):
            assert all(x == 0.0 for x in g.log_probs)
    finally:
        engine.close()


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
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed
    with pytest.raises(ImportError, match=r"flashreinforce\[vllm\]"):
        create_engine("vllm", transformers.Qwen2Config(**CONTRACT_CONFIG), pad_token_id=0)


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_the_trainer_refuses_the_vllm_engine_without_vllm_naming_the_flag(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "flashreinforce.cli", "train", "--preset", "toy", "--rollout.engine",
                           "vllm", "--output", str(tmp_path / "x"), "--no_progress"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "--rollout.engine vllm" in proc.stderr and "flashreinforce[vllm]" in proc.stderr


# ---------------------------------------------------------------------------- GPU + vLLM only
@pytest.mark.cuda
@needs_vllm_gpu
def test_vllm_engine_meets_the_engine_contract():
    from flashreinforce.engines.vllm import VLLMEngine

    # float32 keeps the comparison with the float64 reference tight; vLLM batches requests with
    # kernels whose rounding depends on the batch, so batch invariance is not part of its contract.
    check_engine_contract(lambda model: VLLMEngine(model.config, dtype="float32", gpu_memory_utilization=0.3,
                                                   enforce_eager=True, max_model_len=256),
                          atol=2e-3, batch_invariant=False)


def write_model_config(path: Path) -> Path:
    cfg = dict(CONTRACT_CONFIG, model_type="qwen2")
    path.write_text(json.dumps(cfg))
    return path


@pytest.mark.cuda
@needs_vllm_gpu
@pytest.mark.parametrize("backend", ["local", "ray"])
def test_toy_training_with_vllm_engines(tmp_path, backend):
    if backend == "ray":
        pytest.importorskip("ray")
    out = tmp_path / backend
    cmd = [sys.executable, "-m", "flashreinforce.cli", "train", "--preset", "toy", "--model",
           str(write_model_config(tmp_path / "model.json")), "--tokenizer", "char", "--rollout.engine", "vllm",
           "--rollout.backend", backend, "--vllm.num_engines", "1", "--vllm.gpu_memory_utilization", "0.25",
           "--device", "cuda", "--train.max_steps", "30", "--eval.steps", "0", "--eval.eval_at_start", "false",
           "--output", str(out), "--no_progress"]
    if backend == "ray":
        cmd += ["--ray.num_gpus_per_worker", "0.3"]
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", VLLM_WORKER_MULTIPROC_METHOD="spawn")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 30 and metrics[-1]["policy_version"] == 30
    assert all(m["policy_lag_max"] <= 4 and m["policy_lag_min"] >= 0 for m in metrics)
    assert metrics[-1]["rejected_trajectories"] == 0
    # Behavior log-probs come from the engine's processed distribution and the learner's from the
    # training model at the same temperature: on-policy trajectories must pass the trust gate.
    assert sum(m["acceptance_rate"] for m in metrics) / len(metrics) > 0.9
