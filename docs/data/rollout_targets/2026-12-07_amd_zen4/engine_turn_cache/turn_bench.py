"""Second-turn calls of 32 arith_tool-like conversations: turn cache on vs off (SmolLM2, bf16, 2 threads).
Turn 1: 32 prompts of 125 tokens (104 shared), 15 new tokens each; turn 2: prompt + turn + 16-token answer,
8 new tokens. Alternated, 5 rounds; seconds of the second call."""
import sys, time, torch, statistics
from flashreinforce.engines import GenerationRequest, HFEngine, SamplingParams
from flashreinforce.models.loading import build_model
torch.set_num_threads(2)
model = build_model(sys.argv[1], device=torch.device("cpu"))[0]
g = torch.Generator().manual_seed(0)
V = 4000
shared = torch.randint(100, V, (104,), generator=g).tolist()
first = [GenerationRequest(shared + torch.randint(100, V, (21,), generator=g).tolist(), 15, i) for i in range(32)]
params = SamplingParams(1.0)
engines = {name: HFEngine(model if name == "on" else __import__("copy").deepcopy(model), pad_token_id=0, dtype="bfloat16",
                          turn_cache_mb=512 if name == "on" else 0) for name in ("on", "off")}
times = {"on": [], "off": []}
first_times = {"on": [], "off": []}
for rnd in range(5):
    for name, e in engines.items():
        t = time.perf_counter(); gens = e.generate(first, params); first_times[name].append(time.perf_counter() - t)
        second = [GenerationRequest(list(r.token_ids) + list(x.token_ids) + torch.randint(100, V, (16,), generator=torch.Generator().manual_seed(rnd * 100 + i)).tolist(), 8, 1000 + i)
                  for i, (r, x) in enumerate(zip(first, gens))]
        t = time.perf_counter(); e.generate(second, params); times[name].append(time.perf_counter() - t)
for name, ts in times.items():
    print(name, "second call s: median", round(statistics.median(ts), 3), [round(x, 3) for x in ts])
for name, ts in first_times.items():
    print(name, "first call s: median", round(statistics.median(ts), 3), [round(x, 3) for x in ts])
print("reused", engines["on"]._turns.tokens_reused)
