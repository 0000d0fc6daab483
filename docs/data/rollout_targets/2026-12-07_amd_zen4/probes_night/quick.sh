# usage: quick.sh NAME SEED STEPS [extra flags]  (env passes through)
name=$1; seed=$2; steps=$3; shift 3
out=runs/exp/$name; rm -rf $out
kw=$(python -c "import json; from flashreinforce.config.presets import PRESETS; print(json.dumps(dict(PRESETS['arith_tool']['env.kwargs'], tool_latency={'median_s':0.5,'sigma':1.0})))")
cd . && python ${RUNNER:--m flashreinforce.cli} train --preset arith_tool --model runs/arith_tool_model --output $out --overwrite --env.kwargs "$kw" --train.max_steps $steps --eval.steps 0 --eval.eval_at_start false --ckpt.save_steps 0 --no_progress --seed $seed "$@" > runs/exp/$name.log 2>&1
python - <<PY
import json
rows=[json.loads(l) for l in open("$out/metrics.jsonl")][1:]
n=len(rows); sec=sum(r["step_time_s"] for r in rows)/n; cpu=sum(r["cpu_time_s"] for r in rows)/n
busy=sum(r["cpu_busy_share"]*r["step_time_s"] for r in rows)/sum(r["step_time_s"] for r in rows)
bs=sum(r.get("backward_skipped",0) for r in rows)/n
print("$name", "s/upd %.2f cpu/upd %.2f busy %.2f noback %.2f reward %.3f" % (sec, cpu, busy, bs, sum(r["reward_mean"] for r in rows)/n))
PY
find $out -name "*.safetensors" -delete 2>/dev/null; true
