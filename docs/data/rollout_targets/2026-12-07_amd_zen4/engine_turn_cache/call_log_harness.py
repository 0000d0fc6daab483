import json, sys, time
from flashreinforce.engines.hf import engine as E
orig_generate = E.HFEngine.generate
orig_shared = E.HFEngine._shared_prefix
log = open('/work/perf/s17/calls.jsonl', 'w')
def generate(self, requests, params, **kw):
    prompts = [list(r.token_ids) for r in requests]
    shared = orig_shared(self, prompts)
    lengths = [len(p) - shared for p in prompts]
    t = time.perf_counter()
    out = orig_generate(self, requests, params, **kw)
    log.write(json.dumps({"b": len(prompts), "shared": shared, "width": max(lengths), "suffix": sum(lengths),
                          "prompt_tokens": sum(len(p) for p in prompts), "new": sum(len(g.token_ids) for g in out),
                          "steps": max(len(g.token_ids) for g in out), "s": time.perf_counter() - t, "turn_reused": self._turns.tokens_reused if self._turns else -1, "prefix_reused": self.prefix_tokens_reused}) + "\n")
    log.flush()
    return out
E.HFEngine.generate = generate
from flashreinforce.cli import main
sys.exit(main(sys.argv[1:]))
