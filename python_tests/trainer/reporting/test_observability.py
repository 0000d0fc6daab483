"""What a run reports about itself: failure kinds, samples, the zero-signal warning, trackers, summary.json."""

from __future__ import annotations

import json
import math
import random
import sys
import types

import pytest

from flashreinforce.objective import LossOptions
from flashreinforce.config import resolve
from flashreinforce.models.tokenizers import CharTokenizer
from flashreinforce.trainer.reporting.diagnostics import (ToolUseWatch, TrustGateWatch, ZeroSignalWatch,
                                                          has_reward_signal, tool_use_warnings, trust_gate_warnings)
from flashreinforce.trainer.learning.learner import Learner, LearnerSettings
from flashreinforce.trainer.reporting.loggers import TensorBoardSink, WandbSink, flat_scalars, open_sinks
from flashreinforce.trainer.reporting.metrics import (MetricsLog, UpdateTimings, failure_kinds, no_answer_fraction,
                                                      update_metrics)
from flashreinforce.trainer.reporting.samples import (SampleLog, clip_text, decode_turns, pick_rows, read_samples,
                                                      short_sample)
from flashreinforce.trainer.reporting.summary import config_hash, write_run_summary
from flashreinforce.trainer.rollout.trajectory import Trajectory
from python_tests.builders import random_trajectory, tiny_causal_lm

TOK = CharTokenizer()


def episode(prompt: str, turns: list[tuple[str, str]], *, reward: float = 0.0, failed: bool | None = None,
            prompt_id: int = 0, info: dict | None = None, truncated: bool = False) -> Trajectory:
    """A trajectory whose text is ``prompt`` then each (action, observation) pair, in character tokens."""
    ids, mask = TOK.encode(prompt), [False] * len(prompt)
    for action, observation in turns:
        ids += TOK.encode(action)
        mask += [True] * len(action)
        ids += TOK.encode(observation)
        mask += [False] * len(observation)
    logp = [-0.5 if m else 0.0 for m in mask]
    return Trajectory(ids, mask, logp, reward=reward, failed=reward <= 0 if failed is None else failed,
                      truncated=truncated, prompt_id=prompt_id, info=dict(info or {}), policy_version_min=3,
                      policy_version_max=4)


LEARNER = {"acceptance_rate": 0.5, "sequence_kl_mean": 0.01, "policy_tokens": 4, "loss": 0.1, "grad_norm": 1.0,
           "lr": 1e-3, "learner_compute_s": 0.01}


def record_of(trajs, step=1):
    return update_metrics(step=step, policy_version=step, version_before=step - 1, learner=LEARNER, trajectories=trajs,
                          buffer_stats={"in_flight": 0}, worker_stats=[{"idle_s": 1.0, "busy_s": 1.0, "errors": 0}],
                          timings=UpdateTimings(idle=0.0, step=1.0, wall=1.0), wall_time_before=0.0)


def test_update_record_gives_the_cpu_time_and_its_share_of_the_usable_cores(monkeypatch):
    from flashreinforce.trainer.reporting import metrics as metrics_module

    monkeypatch.setattr(metrics_module, "usable_cores", lambda: 4)
    rec = update_metrics(step=1, policy_version=1, version_before=0, learner=LEARNER,
                         trajectories=[episode("q", [("a", "")])], buffer_stats={"in_flight": 0}, worker_stats=[{"idle_s": 1.0, "busy_s": 1.0, "errors": 0}],
                         timings=UpdateTimings(idle=0.0, step=2.0, wall=2.0, cpu=3.0), wall_time_before=0.0)
    assert rec["cpu_time_s"] == 3.0 and rec["cpu_busy_share"] == pytest.approx(3.0 / (2.0 * 4))
    assert math.isnan(record_of([episode("q", [("a", "")])])["cpu_time_s"])  # not measured


def test_process_cpu_seconds_counts_this_process_and_its_waited_children():
    import subprocess
    import time

    from flashreinforce.trainer.reporting.metrics import process_cpu_seconds, usable_cores

    before = process_cpu_seconds()
    t0 = time.process_time()
    while time.process_time() - t0 < 0.2:  # this process's own work
        pass
    subprocess.run([sys.executable, "-c", "import time\nt=time.process_time()\nwhile time.process_time()-t<0.3: pass"],
                   check=True)
    assert process_cpu_seconds() - before >= 0.45  # 0.2 s here + 0.3 s in the child, less the clocks' ticks
    assert usable_cores() >= 1


# ---------------------------------------------------------------------------------------- failure kinds


def test_update_record_counts_failure_kinds_and_unanswered_trajectories():
    trajs = [episode("q", [("a", "")], reward=1.0, info={"answer_extraction": "boxed"}),
             episode("q", [("b", "")], info={"answer_extraction": "boxed", "failure_kind": "wrong_answer"}),
             episode("q", [("c", "")], info={"answer_extraction": "none", "failure_kind": "no_answer"}),
             episode("q", [("d", "")], info={"answer_extraction": "none", "failure_kind": "no_answer"}),
             episode("q", [("e", "")], truncated=True),   # cut by the trainer before the final step
             episode("q", [("f", "")], failed=True)]      # failed, and the environment said nothing
    rec = record_of(trajs)
    assert rec["failure_kinds"] == {"no_answer": 2, "wrong_answer": 1, "truncated": 1, "unspecified": 1}
    assert list(rec["failure_kinds"])[0] == "no_answer"  # most common first
    # the two trajectories without the key have no gradable answer either
    assert rec["no_answer_fraction"] == pytest.approx(4 / 6)
    assert rec["success_rate"] == pytest.approx(1 / 6)
    assert rec["reward_std"] == pytest.approx((5 / 36) ** 0.5)
    json.dumps(rec)  # the record stays one JSON line


def test_no_answer_fraction_only_when_an_environment_reports_extraction():
    plain = [episode("q", [("a", "")], reward=1.0), episode("q", [("b", "")])]
    assert no_answer_fraction(plain) is None
    rec = record_of(plain)
    assert "no_answer_fraction" not in rec and rec["failure_kinds"] == {"unspecified": 1}
    assert failure_kinds([episode("q", [("a", "")], reward=1.0)]) == {}


# ---------------------------------------------------------------------------------------- samples


def test_decode_turns_splits_prompt_actions_and_observations():
    t = episode("say a:", [("a", " ok. say b:"), ("c", " no. say d:"), ("d", "")])
    prompt, turns = decode_turns(t, TOK)
    assert prompt == "say a:"
    assert turns == [{"action": "a", "observation": " ok. say b:"}, {"action": "c", "observation": " no. say d:"},
                     {"action": "d", "observation": ""}]


def test_clip_text_keeps_head_and_tail():
    text = "Q" * 50 + "x" * 1000 + "ANSWER"
    cut = clip_text(text, 100)
    assert cut.startswith("Q" * 50) and cut.endswith("ANSWER") and "[... 956 chars cut ...]" in cut
    assert len(cut) < 140 and clip_text("short", 100) == "short"


def test_pick_rows_shows_a_dropped_a_failed_and_a_successful_trajectory():
    trajs = [episode("q", [("a", "")], failed=True) for _ in range(6)]
    trajs[4] = episode("q", [("a", "")], reward=1.0)
    admitted = [1.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    assert pick_rows(trajs, {"admitted": admitted}, 3) == [5, 0, 4]
    assert pick_rows(trajs, {}, 2) == [0, 4]
    assert pick_rows(trajs, {}, 10) == [0, 4, 1, 2, 3, 5]


def test_sample_log_writes_bounded_records_on_its_steps_only(tmp_path):
    log = SampleLog(tmp_path, TOK, every=5, per_update=3, max_chars=60, max_bytes=1500)
    assert [s for s in range(1, 16) if log.due(s)] == [5, 10, 15]
    long_turns = [("x" * 400, "y" * 400)] * 3
    trajs = [episode("say a:" * 30, long_turns, reward=float(i % 2), info={"failure_kind": "wrong_answer"})
             for i in range(4)]
    stats = {"sequence_kl": [0.1, 0.2, 0.3, 0.4], "admitted": [1.0, 0.0, 1.0, 1.0], "retained": [1, 2, 3, 4]}
    written = log.write(5, trajs, stats, learner_version=4)
    lines = (tmp_path / "samples.jsonl").read_text().splitlines()
    assert len(lines) == len(written) >= 1 and sum(len(x.encode()) + 1 for x in lines) <= 1500
    first = json.loads(lines[0])
    assert first["step"] == 5 and first["policy_lag"] == 1 and isinstance(first["admitted"], bool)
    assert all(len(turn["action"]) <= 100 for turn in first["turns"])
    # the trajectory the gate dropped comes first
    assert first["row"] == 1 and first["admitted"] is False and first["sequence_kl"] == pytest.approx(0.2)
    assert "dropped by the trust gate" in short_sample({**first, "admitted": False})


def test_sample_log_resume_drops_lines_after_the_checkpoint(tmp_path):
    log = SampleLog(tmp_path, TOK, every=1, per_update=1)
    for step in (1, 2, 3, 4):
        log.write(step, [episode("q", [("a", "")], reward=1.0)], {}, learner_version=step - 1)
    SampleLog(tmp_path, TOK, every=1, per_update=1, initial_step=2)
    assert [r["step"] for r in read_samples(tmp_path)] == [1, 2]
    assert read_samples(tmp_path, step=2)[0]["prompt"] == "q" and read_samples(tmp_path, failed=True) == []


def test_metrics_log_decodes_nothing_when_samples_are_off(tmp_path):
    class Counting:
        vocab_size = TOK.vocab_size

        def __init__(self):
            self.calls = 0

        def decode(self, ids):
            self.calls += 1
            return TOK.decode(ids)

    tok = Counting()
    trajs = [episode("q", [("a", "")], reward=1.0), episode("q", [("b", "")])]
    on = MetricsLog(tmp_path / "on", total=4, initial=0, progress=False, logging_steps=100,
                    samples=SampleLog(tmp_path, tok, every=2), watch=ZeroSignalWatch(0, tok))
    (tmp_path / "on").mkdir()
    for step in (1, 2, 3):
        on.write(record_of(trajs, step), trajectories=trajs, learner={"per_trajectory": {}})
    assert tok.calls > 0 and [r["step"] for r in read_samples(tmp_path)] == [2, 2]
    tok.calls = 0
    (tmp_path / "off").mkdir()
    off = MetricsLog(tmp_path / "off", total=4, initial=0, progress=False, logging_steps=100,
                     samples=SampleLog(tmp_path / "off", tok, every=0), watch=ZeroSignalWatch(0, tok))
    for step in (1, 2, 3):
        off.write(record_of(trajs, step), trajectories=trajs, learner={"per_trajectory": {}})
    assert tok.calls == 0 and not (tmp_path / "off" / "samples.jsonl").exists()


def test_learner_step_returns_per_trajectory_gate_statistics():
    rng = random.Random(0)
    trajs = [random_trajectory(rng, 40) for _ in range(5)]
    learner = Learner(tiny_causal_lm(40, seed=1), LearnerSettings(loss=LossOptions(delta=3e-3), lr=1e-3), pad_token_id=0)
    metrics = learner.step(trajs)
    per = metrics["per_trajectory"]
    assert set(per) == {"sequence_kl", "admitted", "retained", "drift_binary_kl", "drift_kpop", "drift_k3",
                        "drift_log_ratio"}
    assert per["drift_binary_kl"] == pytest.approx(per["sequence_kl"], rel=1e-5, abs=1e-12)  # the gate's metric
    assert all(len(v) == 5 for v in per.values())
    assert metrics["acceptance_rate"] == pytest.approx(sum(a > 0.5 for a in per["admitted"]) / 5)
    assert metrics["sequence_kl_mean"] == pytest.approx(sum(per["sequence_kl"]) / 5)


# ---------------------------------------------------------------------------------------- zero-signal warning


def test_zero_signal_watch_warns_once_with_the_common_failure_kind_and_a_sample():
    batch = [episode("what is 2+2?", [("I think so", "")], info={"failure_kind": "no_answer"}, prompt_id=i)
             for i in range(4)]
    batch[0].info["failure_kind"] = "wrong_answer"
    watch = ZeroSignalWatch(3, TOK)
    assert watch.observe(1, batch) is None and watch.observe(2, batch) is None
    text = watch.observe(3, batch)
    assert "first 3 updates" in text and "every reward was 0" in text
    assert "no_answer (9 of 12 failed trajectories)" in text
    assert "what is 2+2?" in text and "I think so" in text
    assert watch.observe(4, batch) is None  # once


def test_zero_signal_watch_is_silent_when_any_early_update_has_signal_or_on_resume():
    zero = [episode("q", [("a", "")], prompt_id=i) for i in range(3)]
    mixed = zero[:2] + [episode("q", [("a", "")], reward=1.0, prompt_id=2)]
    watch = ZeroSignalWatch(3, TOK)
    assert watch.observe(1, zero) is None and watch.observe(2, mixed) is None and watch.observe(3, zero) is None
    assert not watch.fired
    resumed = ZeroSignalWatch(2, TOK, initial_step=40)
    assert resumed.observe(41, zero) is None and resumed.observe(42, zero) is None


def test_reward_signal_is_taken_within_prompt_groups_when_there_are_groups():
    # GRPO: two prompts, four samples each; rewards differ between the prompts but not within them.
    groups = [episode("q", [("a", "")], reward=float(p), prompt_id=p) for p in (0, 1) for _ in range(4)]
    assert not has_reward_signal(groups)
    groups[0].reward = 0.5
    assert has_reward_signal(groups)
    singles = [episode("q", [("a", "")], reward=float(i), prompt_id=i) for i in range(3)]
    assert has_reward_signal(singles) and not has_reward_signal(singles[:1])


# ---------------------------------------------------------------------------------------- trackers


def test_a_failing_tracker_is_dropped_and_never_stops_the_run(tmp_path, capsys):
    class Broken:
        def __init__(self):
            self.logged = 0

        def log(self, step, record):
            self.logged += 1
            raise OSError("No space left on device")

        def close(self, status="completed"):
            raise RuntimeError("cannot close")

    broken = Broken()
    log = MetricsLog(tmp_path, total=3, initial=0, progress=False, logging_steps=100, sinks=[broken])
    trajs = [episode("q", [("a", "")], reward=1.0)]
    for step in (1, 2):
        log.write(record_of(trajs, step))
    log.close()
    assert broken.logged == 1 and len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
    err = capsys.readouterr().err
    assert "Broken failed at update 1" in err and "No space left" in err and "cannot close" in err


def test_flat_scalars_flattens_dicts_and_drops_text():
    assert flat_scalars({"a": 1, "ok": True, "name": "x", "kinds": {"no_answer": 3}, "none": None}) == \
        {"a": 1.0, "ok": 1.0, "kinds/no_answer": 3.0}


def test_trackers_are_off_by_default_and_on_other_ranks(tmp_path):
    logger = resolve({}).logger
    assert open_sinks(logger, tmp_path) == []
    logger.tensorboard.dir = str(tmp_path / "tb")
    assert open_sinks(logger, tmp_path, rank=1) == [] and not (tmp_path / "tb").exists()


def test_a_missing_tracker_package_is_a_config_error_naming_the_install_line(monkeypatch):
    import importlib.util

    from flashreinforce.config import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("tensorboard", "wandb")
                        else real(name, *a))
    with pytest.raises(ConfigError, match=r"--logger.tensorboard.dir needs the tensorboard package.*"
                                          r"pip install 'flashreinforce\[tensorboard\]'"):
        resolve({"logger.tensorboard.dir": "tb"})
    with pytest.raises(ConfigError, match=r"--logger.wandb.project needs the wandb package.*flashreinforce\[wandb\]"):
        resolve({"logger.wandb.project": "p"})
    with pytest.raises(ImportError, match="flashreinforce\\[tensorboard\\]"):
        TensorBoardSink("tb")


def test_tensorboard_events_read_back_with_tensorboards_reader(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install 'flashreinforce[tensorboard]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = resolve({}).logger
    logger.tensorboard.dir = str(tmp_path / "tb")
    trajs = [episode("q", [("a", "")], reward=1.0), episode("q", [("b", "")], info={"failure_kind": "wrong_answer"})]
    records = [record_of(trajs, step) for step in (1, 2, 3)]
    records[1].update(eval_reward_mean=0.25)
    (sink,) = open_sinks(logger, tmp_path)
    for r in records:
        sink.log(r["step"], r)
    sink.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    expected = {k for k, v in records[0].items() if isinstance(v, (int, float)) and k != "step"}
    assert expected | {"failure_kinds/wrong_answer", "eval_reward_mean"} <= tags
    assert [(e.step, e.value) for e in acc.Scalars("reward_mean")] == [(1, 0.5), (2, 0.5), (3, 0.5)]
    assert [(e.step, e.value) for e in acc.Scalars("eval_reward_mean")] == [(2, 0.25)]
    # a resumed run from step 2 drops the earlier session's step 3 and logs it again
    (sink,) = open_sinks(logger, tmp_path, initial_step=2, resume=True)
    sink.log(3, dict(records[2], reward_mean=0.75))
    sink.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward_mean")] == [(1, 0.5), (2, 0.5), (3, 0.75)]


class _FakeRun:
    def __init__(self, **kwargs):
        self.init, self.logged, self.metrics, self.finished = kwargs, [], [], None

    def define_metric(self, name, step_metric=None):
        self.metrics.append((name, step_metric))

    def log(self, data):
        self.logged.append(data)

    def finish(self, exit_code=0):
        self.finished = exit_code


def test_wandb_sink_logs_the_record_keys_against_the_step_and_resumes_the_same_run(tmp_path, monkeypatch):
    runs = []
    fake = types.SimpleNamespace(init=lambda **kw: runs.append(_FakeRun(**kw)) or runs[-1])
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr("flashreinforce.trainer.reporting.loggers._require", lambda *a: None)
    sink = WandbSink("proj", out=tmp_path, run_name=None, config={"seed": 3})
    rec = record_of([episode("q", [("a", "")], reward=1.0), episode("q", [("b", "")])], step=7)
    sink.log(7, rec)
    sink.close("interrupted")
    run = runs[0]
    assert run.init["project"] == "proj" and run.init["name"] == tmp_path.name and run.init["dir"] == str(tmp_path)
    assert run.init["config"] == {"seed": 3} and ("*", "step") in run.metrics
    assert run.logged[0]["step"] == 7.0 and run.logged[0]["reward_mean"] == 0.5
    assert run.logged[0]["failure_kinds/unspecified"] == 1.0 and run.finished == 1
    WandbSink("proj", out=tmp_path, resume=True)
    assert runs[1].init["id"] == run.init["id"] == (tmp_path / "wandb_run_id").read_text().strip()
    WandbSink("proj", out=tmp_path, resume=False)
    assert runs[2].init["id"] != run.init["id"]


def test_wandb_offline_run_is_written_without_network(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install 'flashreinforce[wandb]')")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = WandbSink("flashreinforce-test", out=tmp_path, run_name="offline")
    sink.log(1, record_of([episode("q", [("a", "")], reward=1.0), episode("q", [("b", "")])]))
    sink.close()
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))


# ---------------------------------------------------------------------------------------- summary.json


def test_config_hash_depends_on_what_the_run_computes_only():
    base = resolve({"seed": 1, "rollout.batch_size": 8, "train.batch_size": 8}).to_json()
    moved = resolve({"seed": 1, "rollout.batch_size": 8, "train.batch_size": 8, "output": "/elsewhere",
                     "logger.log_samples_steps": 0, "ckpt.save_steps": 3}).to_json()
    other = resolve({"seed": 2, "rollout.batch_size": 8, "train.batch_size": 8}).to_json()
    assert config_hash(base) == config_hash(moved) != config_hash(other)
    # options that only say how a session runs, present or future, leave the hash alone
    assert config_hash({**base, "overwrite": True, "device": "cuda:1"}) == config_hash(base)
    assert len(config_hash(base)) == 16


def test_run_summary_has_final_and_best_eval_and_keeps_sessions_on_resume(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward_mean": s / 10}) + "\n"
                                                    for s in range(1, 9)))
    evals = [{"step": 0, "eval_reward_mean": 0.1}, {"step": 4, "eval_reward_mean": 0.7},
             {"step": 8, "eval_reward_mean": 0.5, "eval_success_rate": 0.5}]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    cfg = resolve({"seed": 1}).to_json()
    common = dict(config=cfg, max_steps=10, training_wall_s=12.5, checkpoints_dir=tmp_path / "checkpoints")
    write_run_summary(tmp_path, status="interrupted", step=8, policy_version=8, session_started=0.0, resumed=False,
                      checkpoint=tmp_path / "checkpoints" / "step_00000008", export_dir=None, **common)
    first = json.loads((tmp_path / "summary.json").read_text())
    assert first["status"] == "interrupted" and first["exported_model"] is None
    assert first["best_eval"]["step"] == 4 and first["final_eval"] == {"step": 8, "eval_reward_mean": 0.5,
                                                                       "eval_success_rate": 0.5,
                                                                       "eval_trajectories": None}
    assert first["reward_first"] == pytest.approx(0.15) and first["reward_last"] == pytest.approx(0.75)
    assert first["versions"]["torch"] and first["config_hash"] == config_hash(cfg)
    assert first["latest_checkpoint"].endswith("step_00000008") and len(first["sessions"]) == 1
    write_run_summary(tmp_path, status="completed", step=10, policy_version=10, session_started=1.0, resumed=True,
                      checkpoint=tmp_path / "checkpoints" / "step_00000010", export_dir=tmp_path / "hf", **common)
    second = json.loads((tmp_path / "summary.json").read_text())
    assert second["status"] == "completed" and second["exported_model"] == str(tmp_path / "hf")
    assert [s["status"] for s in second["sessions"]] == ["interrupted", "completed"]
    assert not second["config_changed_on_resume"]
    write_run_summary(tmp_path, status="completed", step=10, policy_version=10, session_started=2.0, resumed=False,
                      checkpoint=None, export_dir=None, **common)
    assert len(json.loads((tmp_path / "summary.json").read_text())["sessions"]) == 1  # a new run starts over


# ---------------------------------------------------------------------------------------- what the console shows


def test_the_progress_bar_shows_the_numbers_of_the_update_it_counts(tmp_path, monkeypatch):
    import io

    screen = io.StringIO()
    monkeypatch.setattr(sys, "stderr", screen)
    bar = MetricsLog(tmp_path, total=3, initial=0, progress=True, logging_steps=100)
    bar.bar.mininterval = 0  # redraw on every update
    rewarded = [episode("q", [("a", "")], reward=1.0)] * 2
    for step, trajs in ((1, [episode("q", [("b", "")])] * 2), (2, rewarded), (3, rewarded)):
        bar.write(record_of(trajs, step))
    bar.close()
    frames = screen.getvalue().replace("\r", "\n").splitlines()
    at_two = [f for f in frames if " 2/3 " in f]
    assert at_two and all("reward=1.000" in f for f in at_two)  # update 2's reward, not update 1's 0.000
    assert not any("reward=0.000" in f for f in frames if " 2/3 " in f or " 3/3 " in f)


def test_the_console_sample_keeps_the_question_of_a_chat_templated_prompt():
    prompt = ("system You are a helpful AI assistant named SmolLM, trained by Hugging Face user What is 37 + 45? "
              "Answer with just the number. assistant")
    line = short_sample({"prompt": prompt, "turns": [{"action": "The answer is 82. " * 10, "observation": ""}],
                         "reward": 0.0, "failure_kind": "correct <= 0", "admitted": True})
    assert "What is 37 + 45? Answer with just the number. assistant" in line
    assert "chars cut]" in line and line.endswith("(reward 0, correct <= 0, admitted)") and len(line) <= 170
    assert short_sample({"prompt": "say c:", "turns": [{"action": "4", "observation": ""}], "reward": 0,
                         "failure_kind": "invalid_answer", "admitted": True}) == \
        "'say c:' -> '4' (reward 0, invalid_answer, admitted)"


def test_reward_functions_name_the_failure_kind():
    trajs = [episode("q", [("a", "")], info={"reward/correct": 0.0, "reward/format": 1.0}),
             episode("q", [("a", "")], info={"reward/correct": 0.0, "reward/format": 0.0}),
             episode("q", [("a", "")], reward=-0.5, info={"reward/correct": 1.0, "reward/length": 0.5}),
             episode("q", [("a", "")], reward=1.0, info={"reward/correct": 1.0})]
    assert failure_kinds(trajs) == {"correct <= 0": 1, "correct <= 0, format <= 0": 1, "weighted reward <= 0": 1}


def test_sample_log_writes_a_lone_surrogate_as_its_json_escape(tmp_path):
    # An environment's info (or a tokenizer's text) may hold a lone surrogate, which no UTF-8
    # encoder takes: the line is written with the character's JSON escape, not an error.
    log = SampleLog(tmp_path, TOK, every=1, per_update=1)
    log.write(1, [episode("q", [("a", "")], reward=1.0, info={"failure_kind": "bad \ud800 text"})], {},
              learner_version=0)
    (record,) = read_samples(tmp_path)
    assert record["info"]["failure_kind"] == "bad \ud800 text"
    assert "\\ud800" in (tmp_path / "samples.jsonl").read_text(encoding="utf-8")


# ---------------------------------------------------------------------------------------- tools never called


def _agent_record(step: int, calls: float, offered: float = 2.0, malformed: float = 0.0) -> dict:
    return {"step": step, "trajectories": 4, "env/tool_calls": calls, "env/calls_with_tools": offered,
            "env/malformed_tool_calls": malformed}


def test_tools_offered_and_never_called_for_n_updates_in_a_row_warn_once():
    watch = ToolUseWatch(3)
    assert watch.observe(_agent_record(1, 0.0)) is None and watch.observe(_agent_record(2, 0.0)) is None
    assert watch.observe(_agent_record(3, 0.5)) is None  # a call: the count starts over
    assert [watch.observe(_agent_record(s, 0.0, malformed=0.25)) for s in (4, 5)] == [None, None]
    text = watch.observe(_agent_record(6, 0.0, malformed=0.25))
    assert text.startswith("warning: the agent offered tools in 24 model calls of updates 4-6 and the policy called "
                           "none")
    assert "3 replies held tool-call markup the parser could not read" in text
    assert "worked episodes" in text and "docs/environments.md" in text
    assert watch.fired == {"kind": "no_tool_calls", "step": 6, "updates": 3, "message": text}
    assert watch.observe(_agent_record(7, 0.0)) is None  # once


def test_no_warning_without_tools_or_when_off():
    watch = ToolUseWatch(2)
    # an agent that declares no tools, and an environment without a tool
    records = [_agent_record(1, 0.0, offered=0.0), _agent_record(2, 0.0, offered=0.0), {"step": 3}, {"step": 4}]
    assert [watch.observe(r) for r in records] == [None] * 4
    assert ToolUseWatch(0).observe(_agent_record(1, 0.0)) is None
    # an environment whose episodes report tool_calls offers a tool in every one
    env = ToolUseWatch(2)
    assert env.observe({"step": 1, "trajectories": 4, "env/tool_calls": 0.0}) is None
    assert env.observe({"step": 2, "trajectories": 4, "env/tool_calls": 0.0}).startswith(
        "warning: the environment offers a tool and no episode of updates 1-2 called it")


def test_the_log_and_the_summary_carry_the_tool_warning(tmp_path, capsys):
    log = MetricsLog(tmp_path, total=5, initial=0, progress=False, logging_steps=100, tool_watch=ToolUseWatch(2))
    for step in (1, 2, 3):
        log.write({**record_of([episode("q", [("a", "")], reward=1.0)], step),
                   **_agent_record(step, 0.0)}, trajectories=[episode("q", [("a", "")], reward=1.0)])
    log.close()
    assert capsys.readouterr().err.count("flashreinforce: warning: the agent offered tools") == 1
    cfg = resolve({"seed": 1}).to_json()
    write_run_summary(tmp_path, config=cfg, status="completed", step=3, max_steps=3, policy_version=3,
                      training_wall_s=1.0, session_started=0.0, resumed=False, checkpoints_dir=tmp_path / "c",
                      checkpoint=None, export_dir=None, warn_no_tool_calls_steps=2)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [(w["kind"], w["step"]) for w in summary["warnings"]] == [("no_tool_calls", 2)]
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert tool_use_warnings(records, 0) == [] and tool_use_warnings(records, 4) == []


# ---------------------------------------------------------------------------------------- the gate drops most


def _gate_record(step: int, acceptance: float, lag: float = 8.0) -> dict:
    return {"step": step, "acceptance_rate": acceptance, "policy_lag_mean": lag}


def test_a_gate_that_drops_most_of_each_batch_for_n_updates_in_a_row_warns_once():
    watch = TrustGateWatch(3)
    assert [watch.observe(_gate_record(s, 0.2)) for s in (1, 2)] == [None, None]
    assert watch.observe(_gate_record(3, 0.5)) is None  # half admitted: the count starts over
    assert watch.observe(_gate_record(4, 0.25)) is None and watch.observe(_gate_record(5, 0.0)) is None
    text = watch.observe(_gate_record(6, 0.125, lag=6.0))
    assert text.startswith("warning: the trust gate admitted less than 0.5 of the trajectories in each of updates 4-6 "
                           "(mean acceptance 0.12, 1 of them admitted none; policy lag 7.3 on average)")
    assert "moves the weights as far as on a full batch" in text
    assert "--actor.scale_step_by_acceptance true" in text and "--actor.loss_mode ppo" in text
    assert "train.async_queue_size" in text and "actor.adam.lr" in text
    assert watch.fired == {"kind": "trust_gate_drops_most", "step": 6, "updates": 3, "message": text}
    assert watch.observe(_gate_record(7, 0.0)) is None  # once


def test_the_gate_warning_knows_scaled_steps_and_numerical_drift_and_can_be_off():
    scaled = TrustGateWatch(2, scaled=True)
    text = [scaled.observe(_gate_record(s, 0.3)) for s in (1, 2)][-1]
    assert "each step is scaled by the acceptance" in text
    assert "--actor.scale_step_by_acceptance" not in text and "--actor.loss_mode ppo" in text
    on_policy = TrustGateWatch(2)
    text = [on_policy.observe(_gate_record(s, 0.3, lag=0.0)) for s in (1, 2)][-1]
    assert "the drift is numerics" in text and "raise actor.flash_gate_delta" in text and "remedies" not in text
    off = TrustGateWatch(0)
    assert all(off.observe(_gate_record(s, 0.0)) is None for s in range(1, 10)) and off.fired is None
    quiet = TrustGateWatch(2)  # records without an acceptance rate (no learner record) are ignored
    assert [quiet.observe({"step": s}) for s in (1, 2, 3)] == [None] * 3
    with pytest.raises(ValueError, match="n must be >= 0"):
        TrustGateWatch(-1)
    # the flag is inactive where there is no gate to watch
    from flashreinforce.config import parse_train_args
    from flashreinforce.config.presets import PRESETS
    base = ["--preset", "toy", "--output", "x"]
    assert "logger.warn_gate_drop_steps" not in parse_train_args(base, PRESETS).inactive
    assert parse_train_args(base + ["--actor.flash_gate_delta", "inf"], PRESETS).inactive[
        "logger.warn_gate_drop_steps"] == "the trust gate is off (actor.flash_gate_delta inf)"
    ppo = parse_train_args(base + ["--actor.loss_mode", "ppo", "--algo.advantage.estimator", "grpo"], PRESETS)
    assert ppo.inactive["logger.warn_gate_drop_steps"] == "actor.loss_mode ppo has no trust gate"


def test_the_log_and_the_summary_carry_the_gate_warning(tmp_path, capsys):
    log = MetricsLog(tmp_path, total=5, initial=0, progress=False, logging_steps=100, gate_watch=TrustGateWatch(2))
    trajs = [episode("q", [("a", "")], reward=1.0)]
    for step, acceptance in ((1, 0.1), (2, 0.9), (3, 0.1), (4, 0.2), (5, 0.0)):
        log.write({**record_of(trajs, step), "acceptance_rate": acceptance}, trajectories=trajs)
    log.close()
    assert capsys.readouterr().err.count("flashreinforce: warning: the trust gate admitted less than 0.5") == 1
    cfg = resolve({"seed": 1}).to_json()
    write_run_summary(tmp_path, config=cfg, status="completed", step=5, max_steps=5, policy_version=5,
                      training_wall_s=1.0, session_started=0.0, resumed=False, checkpoints_dir=tmp_path / "c",
                      checkpoint=None, export_dir=None, warn_gate_drop_steps=2, scale_step_by_acceptance=True)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [(w["kind"], w["step"], w["updates"]) for w in summary["warnings"]] == [("trust_gate_drops_most", 4, 2)]
    assert "each step is scaled by the acceptance" in summary["warnings"][0]["message"]
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert trust_gate_warnings(records, 0) == [] and trust_gate_warnings(records, 4) == []
    assert [w["step"] for w in trust_gate_warnings(records, 3)] == [5]


def test_summary_has_the_evaluation_before_training_and_the_change_to_the_final_one(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    evals = [{"step": 0, "eval_reward_mean": 0.25, "eval_success_rate": 0.2, "eval_temperature": 0.0,
              "eval_env/tool_calls": 0.0, "eval_time_s": 3.0},
             {"step": 7, "eval_reward_mean": 0.75, "eval_success_rate": 0.9, "eval_temperature": 0.0,
              "eval_env/tool_calls": 1.0, "eval_time_s": 2.0}]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    cfg = resolve({"seed": 1}).to_json()
    write_run_summary(tmp_path, config=cfg, status="stopped", step=7, max_steps=9, policy_version=7,
                      training_wall_s=20.0, train_time_s=14.5, session_started=0.0, resumed=False,
                      checkpoints_dir=tmp_path / "c", checkpoint=None, export_dir=None)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["start_eval"]["step"] == 0 and summary["start_eval"]["eval_env/tool_calls"] == 0.0
    assert summary["final_eval"]["step"] == 7 and summary["final_eval"]["eval_temperature"] == 0.0
    assert summary["eval_change"] == {"eval_reward_mean": 0.5, "eval_success_rate": pytest.approx(0.7),
                                      "steps": [0, 7]}
    assert (summary["train_time_s"], summary["training_wall_s"], summary["eval_time_s"]) == (14.5, 20.0, 5.0)
    assert summary["warnings"] == []


def test_with_a_time_budget_the_bar_counts_training_seconds(tmp_path, monkeypatch):
    import io

    screen = io.StringIO()
    monkeypatch.setattr(sys, "stderr", screen)
    bar = MetricsLog(tmp_path, total=2000, initial=0, progress=True, logging_steps=100, budget_s=120.0)
    bar.bar.mininterval = 0
    bar.start_clock(30.0)  # 30 s in earlier sessions: the budget is this session's
    for step, train_s in ((1, 55.0), (2, 90.0), (3, 200.0)):
        bar.write({**record_of([episode("q", [("a", "")], reward=1.0)], step), "train_time_s": train_s})
        assert bar.bar.n == min(120.0, train_s - 30.0)
    bar.close()
    frames = screen.getvalue().replace("\r", "\n")
    assert "60/120 s of training" in frames and "update=2/2000" in frames
    assert "/2000 [" not in frames  # not a count of updates towards max_steps
