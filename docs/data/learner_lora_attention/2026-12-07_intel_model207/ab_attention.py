"""The one-off A/B behind docs/performance.md's attention numbers of 2026-12-07, kept as the record of how
they were measured: the learner step with the per-bucket gathers of b54a3c7's attention.py against one
gather for all buckets (the checkout), steps in turn, same batch, compiled layers on. Run from the
repository root with the development environment: python <this file> full|lora STEPS."""
import copy, statistics, subprocess, sys, time, types
from pathlib import Path
ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT / "benchmarks"))
import torch, transformers
from common import SHAPES, machine_line
from bench_learner_mfu import make_batch
import flashreinforce.models.attention as attention
from flashreinforce.objective import LossOptions
from flashreinforce.trainer.learning.learner import Learner, LearnerSettings

old_src = subprocess.check_output(["git", "-C", str(ROOT), "show", "b54a3c7:flashreinforce/models/attention.py"], text=True)
old = types.ModuleType("old_attention"); exec(compile(old_src, "old_attention.py", "exec"), old.__dict__)
new_impl = (attention._attend_sdpa, attention._SdpaPlan)
old_impl = (old._attend_sdpa, old._SdpaPlan)

def use(impl):
    attention._attend_sdpa, attention._SdpaPlan = impl

policy = sys.argv[1] if len(sys.argv) > 1 else "full"
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
cfg = dict(SHAPES["smollm2-135m"]); model_type = cfg.pop("model_type")
config = transformers.AutoConfig.for_model(model_type, **cfg)
torch.manual_seed(0)
base = transformers.AutoModelForCausalLM.from_config(config).float()
if policy == "lora":
    from flashreinforce.models.lora import LoraSettings, apply_lora
    base = apply_lora(base, LoraSettings(rank=16, alpha=32.0))
batch = make_batch(16, 192, config.vocab_size)
print("machine:", machine_line(torch.device("cpu")), "policy", policy, flush=True)
learners = {}
for name in ("per-bucket gathers (before)", "one gather (after)"):
    s = LearnerSettings(lr=1e-5, loss=LossOptions(delta=float("inf")), micro_batch_tokens=4096, total_steps=100)
    learners[name] = Learner(copy.deepcopy(base), s)
impls = {"per-bucket gathers (before)": old_impl, "one gather (after)": new_impl}
times = {n: [] for n in learners}
losses = {n: [] for n in learners}
for i in range(steps + 1):
    for n, l in learners.items():
        use(impls[n])
        t0 = time.perf_counter(); m = l.step(batch); dt = time.perf_counter() - t0
        losses[n].append(m["loss"])
        if i:
            times[n].append(dt)
        print(f"step {i} {n}: {dt:.2f} s loss {m['loss']:.6f} grad_norm {m['grad_norm']:.6f}", flush=True)
for n in learners:
    print(f"{n}: median {statistics.median(times[n]):.2f} s of {times[n]}")
a, b = (statistics.median(times[n]) for n in learners)
print(f"speed-up {a / b:.3f}x")
# profile one step of each
from torch.profiler import profile, ProfilerActivity
for n, l in learners.items():
    use(impls[n])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        l.step(batch)
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    sel = [e for e in rows if e.key in ("aten::fill_", "aten::add_", "aten::index_put_", "aten::_index_put_impl_",
                                          "aten::index_add_", "aten::index_select", "aten::index", "aten::cat", "aten::copy_")]
    print(n + ": " + ", ".join(f"{e.key} {e.count} calls {e.self_cpu_time_total/1e6:.3f} s" for e in sel))
