"""(Kept as the record of docs/performance.md's probe of 2026-12-07; run in the vLLM environment.)
How long vLLM's CPU oneDNN handler takes to build (its weight packing) for SmolLM2-135M's linear
shapes, float32: one thread, two threads, and two Python threads building different layers at once."""
import time, threading, statistics
import torch
from vllm import _custom_ops as ops
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]  # qkv, o, gate_up, down per layer; tied lm_head
ws = [torch.randn(n, k) for n, k in shapes]

def build(items):
    return [ops.create_onednn_mm(w.t(), 32) for w in items]

for threads in (1, 2):
    torch.set_num_threads(threads)
    ts = []
    for _ in range(3):
        t0 = time.perf_counter(); hs = build(ws); ts.append(time.perf_counter() - t0); del hs
    print(f"torch threads {threads}: all {len(ws)} handlers {statistics.median(ts):.3f} s (runs {[round(t, 3) for t in ts]})")
torch.set_num_threads(1)
ts = []
for _ in range(3):
    out = [None, None]
    def work(i):
        out[i] = build(ws[i::2])
    th = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    t0 = time.perf_counter(); [t.start() for t in th]; [t.join() for t in th]; ts.append(time.perf_counter() - t0)
print(f"two python threads, 1 torch thread each: {statistics.median(ts):.3f} s (runs {[round(t, 3) for t in ts]})")
x = torch.randn(32, 576)
h = ops.create_onednn_mm(ws[0].t(), 32)
print("check:", torch.allclose(ops.onednn_mm(h, x, None), x @ ws[0].t(), atol=1e-4))
