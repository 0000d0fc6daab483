"""The learner's step with a backward (SmolLM2-135M shape, bf16, 32 trajectories), 3 steps timed: wall and
the process's CPU seconds. From the repository root:

    TAG=alone python docs/data/rollout_targets/2026-12-07_amd_zen4/probes_night/contend.py
    python .../competitor.py 75 & TAG=contended python .../contend.py      # beside another process
    COMP=1 TAG=thread python .../contend.py                              # beside a thread of its own
"""
import sys, time, os, random, torch, transformers, resource
sys.path.insert(0, "benchmarks")
from common import SHAPES
from flashreinforce.objective import LossOptions
from flashreinforce.trainer.learning.learner import Learner, LearnerSettings
from flashreinforce.trainer.rollout.trajectory import Trajectory
torch.set_num_threads(int(os.environ.get("T", "2")))
cfg = dict(SHAPES["smollm2-135m"]); mt = cfg.pop("model_type")
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(mt, **cfg))
rng = random.Random(0); prefix = [rng.randrange(3, 49000) for _ in range(96)]
batch = []
for i in range(32):
    mid = [rng.randrange(3, 49000) for _ in range(rng.randint(20, 40))]; act = [rng.randrange(3, 49000) for _ in range(rng.randint(18, 30))]
    toks = prefix + mid + act; mask = [False] * (len(prefix) + len(mid)) + [True] * len(act)
    batch.append(Trajectory(toks, mask, [(-rng.random() if m else 0.0) for m in mask], reward=float(i % 2), failed=False))
L = Learner(model, LearnerSettings(lr=1e-6, loss=LossOptions(), param_dtype="bf16", total_steps=100))
L.step(batch)
if os.environ.get("COMP"):  # the competing load as a thread of this process (competitor.py)
    import threading
    from competitor import products
    threading.Thread(target=products, args=(lambda: True,), daemon=True).start()
    time.sleep(1)
for _ in range(3):
    c0 = time.process_time(); t0 = time.perf_counter(); m = L.step(batch)
    print(f"{os.environ.get('TAG','')} step wall {time.perf_counter()-t0:.2f} s  cpu {time.process_time()-c0:.2f} s  backward_skipped {m['backward_skipped']}", flush=True)
