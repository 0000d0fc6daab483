"""Prompt datasets, prompt rendering, DatasetEnvironment and the make_environment factory."""

from __future__ import annotations

import json
import random
import sys
import types

import pytest

from flashreinforce.envs import Environment, StepResult
from flashreinforce.envs.tasks import (
    DatasetEnvironment,
    Task,
    TaskEnvironment,
    chat_template_from_tokenizer,
    load_tasks,
    render_prompt,
)
from flashreinforce.envs.registry import make_environment


def _write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return path


def _math_rows(n, rng):
    rows = []
    for i in range(n):
        a, b = rng.randrange(100), rng.randrange(100)
        rows.append({"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
                     "reward_model": {"ground_truth": str(a + b), "style": "rule"},
                     "datasource": f"bench{i % 2}"})
    return rows


def test_load_jsonl_with_chat_prompts_labels_and_max_samples(tmp_path):
    rng = random.Random()
    rows = _math_rows(7, rng)
    path = _write_jsonl(tmp_path / "train.jsonl", rows)
    tasks = load_tasks(path, max_samples=5)
    assert len(tasks) == 5
    for i, task in enumerate(tasks):
        assert task.index == i and task.datasource == rows[i]["datasource"]
        assert task.prompt == tuple(rows[i]["prompt"])
        assert task.ground_truth == rows[i]["reward_model"]["ground_truth"]
        assert task.extra == {"datasource": rows[i]["datasource"]}
    assert len(load_tasks(path)) == 7


def test_load_json_list_with_plain_labels(tmp_path):
    rows = [{"question": "1+1?", "answer": 2}, {"question": "pick", "answer": ["a", "b"]},
            {"question": "str", "answer": "x"}]
    path = tmp_path / "data.json"
    path.write_text(json.dumps(rows))
    tasks = load_tasks(path, input_key="question", label_key="answer")
    assert [t.ground_truth for t in tasks] == ["2", ("a", "b"), "x"]
    assert [t.prompt for t in tasks] == ["1+1?", "pick", "str"]
    assert load_tasks(path, input_key="question", label_key=None)[0].ground_truth is None
    assert load_tasks(path, input_key=None, label_key="answer")[0].prompt == ""


@pytest.mark.parametrize("rows,kwargs,message", [
    ([{"text": "q", "reward_model": "1"}], {}, "row 0: no data.input_key 'prompt'"),
    ([{"prompt": "q"}], {}, "row 0: no data.label_key 'reward_model'"),
    ([{"prompt": "q", "reward_model": {"style": "rule"}}], {}, "no 'ground_truth'"),
    ([{"prompt": "q", "reward_model": None}], {}, "ground truth must be"),
    ([{"prompt": [{"role": "user"}], "reward_model": "1"}], {}, "chat message 0"),
    ([{"prompt": "q", "reward_model": "1"}], {"max_samples": 0}, "data.max_samples"),
    ([], {}, "empty"),
])
def test_load_errors_name_the_problem(tmp_path, rows, kwargs, message):
    path = _write_jsonl(tmp_path / "bad.jsonl", rows) if rows else tmp_path / "empty.jsonl"
    if not rows:
        path.write_text("")
    with pytest.raises(ValueError, match=message):
        load_tasks(path, **kwargs)


def test_load_reports_bad_json_with_its_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "a", "reward_model": "1"}\n{not json}\n')
    with pytest.raises(ValueError, match=r"broken.jsonl:2"):
        load_tasks(path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tasks(tmp_path / "missing.jsonl")


def test_render_prompt_plain_and_with_a_template():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    assert render_prompt(messages) == "System: Be brief.\n\nUser: Hi?\n\nAssistant:"
    assert render_prompt("just text") == "just text"
    template = lambda msgs: "".join(f"<{m['role']}>{m['content']}" for m in msgs) + "<assistant>"  # noqa: E731
    assert render_prompt(messages, template) == "<system>Be brief.<user>Hi?<assistant>"
    assert render_prompt("text", template) == "<user>text<assistant>"
    with pytest.raises(TypeError, match="must return str"):
        render_prompt(messages, lambda msgs: 42)


def test_chat_template_from_a_tokenizer_like_object():
    class FakeTokenizer:
        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            assert tokenize is False and add_generation_prompt is True
            return "T:" + messages[-1]["content"]

    assert render_prompt("q", chat_template_from_tokenizer(FakeTokenizer())) == "T:q"
    with pytest.raises(TypeError, match="apply_chat_template"):
        chat_template_from_tokenizer(object())


class _EchoTaskEnv(TaskEnvironment):
    """A task environment whose reward says whether the action equals the ground truth."""

    closed = False

    def step(self, action):
        correct = action == self.task.ground_truth
        return StepResult(reward=float(correct), done=True, failed=not correct, info={"index": self.task.index})

    def close(self):
        self.closed = True


def test_dataset_environment_plays_row_seed_mod_len(tmp_path):
    rng = random.Random()
    rows = _math_rows(5, rng)
    tasks = load_tasks(_write_jsonl(tmp_path / "d.jsonl", rows))
    env = DatasetEnvironment(_EchoTaskEnv(), tasks)
    for seed in [0, 3, 5, 12, 10 ** 9 + 7]:
        i = seed % 5
        assert env.reset(seed=seed) == f"User: {rows[i]['prompt'][0]['content']}\n\nAssistant:"
        assert env.current_task.index == i
        assert env.step(rows[i]["reward_model"]["ground_truth"]).reward == 1.0
    env.close()
    assert env.env.closed
    with pytest.raises(TypeError, match="set_task"):
        DatasetEnvironment(object(), tasks)


def _install_module(monkeypatch, name, **attrs):
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    monkeypatch.setitem(sys.modules, name, module)


def test_make_environment_builtin_math_with_flat_and_nested_config(tmp_path):
    rows = _math_rows(4, random.Random())
    path = _write_jsonl(tmp_path / "m.jsonl", rows)
    for config in ({"data.prompt_dataset": str(path), "data.max_samples": 3, "rollout.batch_size": 128},
                   {"data": {"prompt_dataset": str(path), "max_samples": 3}, "actor": {"adam": {"lr": 1e-6}}}):
        env = make_environment("math", config, timeout_s=3.0)
        try:
            assert isinstance(env, DatasetEnvironment) and len(env.tasks) == 3
            env.reset(seed=4)  # row 4 % 3 == 1
            truth = rows[1]["reward_model"]["ground_truth"]
            result = env.step(f"\\boxed{{{truth}}}")
            assert result.reward == 1.0 and result.info["correct"] is True
        finally:
            env.close()


def test_make_environment_passes_max_turns_and_template(tmp_path):
    path = _write_jsonl(tmp_path / "m.jsonl", _math_rows(2, random.Random()))
    env = make_environment("python_tool", {"data.prompt_dataset": str(path), "max_turns": 4},
                           apply_chat_template=lambda msgs: "T" + str(len(msgs)))
    try:
        assert env.env.max_turns == 4
        assert env.reset(seed=0) == "T2"  # system prompt + the user message
    finally:
        env.close()


def test_make_environment_module_class_spec(tmp_path, monkeypatch):
    class Plain(Environment):
        def __init__(self, greeting="hi"):
            self.greeting = greeting

        def reset(self, *, seed):
            return f"{self.greeting} {seed}"

        def step(self, action):
            return StepResult(reward=1.0)

    _install_module(monkeypatch, "fr_test_envs", Plain=Plain, EchoEnv=_EchoTaskEnv, NotEnv=dict)
    env = make_environment("fr_test_envs:Plain", greeting="hello")
    assert env.reset(seed=3) == "hello 3"
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "reward_model": "x"}])
    env = make_environment("fr_test_envs:EchoEnv", {"data.prompt_dataset": str(path)})
    assert env.reset(seed=0) == "p" and env.step("x").reward == 1.0
    with pytest.raises(TypeError, match="set_task"):
        make_environment("fr_test_envs:Plain", {"data.prompt_dataset": str(path)})
    with pytest.raises(TypeError, match="not a flashreinforce.envs.Environment"):
        make_environment("fr_test_envs:NotEnv")
    with pytest.raises(ValueError, match="has no Missing"):
        make_environment("fr_test_envs:Missing")
    with pytest.raises(ValueError, match="module:Class"):
        make_environment("nonsense")
    with pytest.raises(ValueError, match="needs data.prompt_dataset"):
        make_environment("math", {})


def test_a_class_registered_by_name_is_an_env_name_and_the_shipped_ones_load_on_first_use(tmp_path):
    import subprocess

    from flashreinforce.envs.registry import ENV_REGISTRY, environment_names, register_environment

    with pytest.raises(TypeError, match="not a flashreinforce.envs.Environment subclass"):
        register_environment("fr_test_dict")(dict)
    register_environment("fr_test_echo")(_EchoTaskEnv)
    try:
        assert environment_names()[:2] == ("math", "python_tool") and "fr_test_echo" in environment_names()
        path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "reward_model": "x"}])
        env = make_environment("fr_test_echo", {"data.prompt_dataset": str(path)})
        assert env.reset(seed=0) == "p" and env.step("x").reward == 1.0
    finally:
        del ENV_REGISTRY["fr_test_echo"]
    # naming the shipped environments imports none of them; building one registers its class only
    code = ("import sys; from flashreinforce.envs import registry as r; names = r.environment_names(); "
            "print(sorted(m for m in sys.modules if m.startswith('flashreinforce.envs.') and m.endswith('_env'))); "
            "cls = r.environment_class('math'); print(cls.__module__, sorted(r.ENV_REGISTRY))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["[]", "flashreinforce.envs.math_env ['math']"]


def test_task_environment_without_tasks_explains():
    with pytest.raises(RuntimeError, match="DatasetEnvironment"):
        _EchoTaskEnv().reset(seed=0)
    with pytest.raises(ValueError, match="non-empty"):
        _EchoTaskEnv(tasks=[])
    env = _EchoTaskEnv(tasks=[Task("a", "1"), Task("b", "2")])
    assert [env.reset(seed=s) for s in range(3)] == ["a", "b", "a"]
    env.set_task(Task("override", "3"))
    assert env.reset(seed=0) == "override" and env.reset(seed=0) == "a"


def test_importing_the_package_is_light():
    import subprocess

    code = ("import sys, flashreinforce.envs as e; "
            "print(sorted(m for m in ('math_verify', 'flashreinforce.envs.math_env', 'flashreinforce.envs.sandbox') "
            "if m in sys.modules)); print(e.make_environment.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["[]", "flashreinforce.envs.registry"]


# ------------------------------------------------------------------ an --env whose import fails: one line
def test_an_environment_file_with_a_syntax_error_is_one_line_with_file_and_line(tmp_path):
    from flashreinforce.envs.registry import EnvironmentSpecError, environment_class

    bad = tmp_path / "bad_env.py"
    bad.write_text("import os\n\nclass Broken(:\n    pass\n")
    for spec in (str(bad), f"{bad}:Broken"):
        with pytest.raises(EnvironmentSpecError) as info:
            environment_class(spec)
        message = str(info.value)
        assert "\n" not in message
        assert f"{bad}:3: SyntaxError: " in message and "class Broken(:" in message, message


def test_an_exception_while_importing_names_module_type_message_and_place(tmp_path, monkeypatch):
    from flashreinforce.envs.registry import EnvironmentSpecError, environment_class

    code = ("def configure():\n"
            "    raise RuntimeError('no API key\\nset MY_KEY')\n"
            "\n"
            "configure()\n")
    (tmp_path / "fr_raising_env.py").write_text(code)
    (tmp_path / "fr_dependent_env.py").write_text("import json\nimport fr_not_installed_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for spec, module in ((str(tmp_path / "fr_raising_env.py"), str(tmp_path / "fr_raising_env.py")),
                         ("fr_raising_env:Env", "fr_raising_env")):
        with pytest.raises(EnvironmentSpecError) as info:
            environment_class(spec)
        message = str(info.value)
        assert message == (f"importing {module} raised RuntimeError: no API key set MY_KEY "
                           f"(at {tmp_path / 'fr_raising_env.py'}:2 in configure)"), message
    with pytest.raises(EnvironmentSpecError) as info:  # a module it imports is missing: which one, and where
        environment_class("fr_dependent_env:Env")
    assert str(info.value) == ("importing fr_dependent_env raised ModuleNotFoundError: No module named "
                               f"'fr_not_installed_anywhere' (at {tmp_path / 'fr_dependent_env.py'}:2 in <module>)")
    with pytest.raises(ModuleNotFoundError, match="fr_absent_module"):  # the module itself: left to the caller
        environment_class("fr_absent_module:Env")


def test_the_cli_prints_one_line_for_an_environment_file_with_a_syntax_error(tmp_path):
    import subprocess

    bad = tmp_path / "bad_env.py"
    bad.write_text("class Broken(:\n    pass\n")
    proc = subprocess.run([sys.executable, "-m", "flashreinforce.cli", "train", "--preset", "toy", "--env", str(bad),
                           "--output", str(tmp_path / "run")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("flashreinforce train: error: --env "), proc.stderr[-3000:]
    assert f"{bad}:1: SyntaxError: invalid syntax" in lines[0]


# ------------------------------------------------------------------ dataset problems: one line naming flag and file
def _run_train(tmp_path, *flags):
    import subprocess

    return subprocess.run([sys.executable, "-m", "flashreinforce.cli", "train", "--preset", "toy", "--env", "math",
                           "--output", str(tmp_path / "run"), *flags], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("problem", ["missing key", "missing file"])
def test_the_cli_prints_one_line_with_exit_status_2_for_a_dataset_problem(tmp_path, problem):
    if problem == "missing key":
        path = _write_jsonl(tmp_path / "nolabel.jsonl", [{"prompt": "1+1?"}])
        want = f"--data.prompt_dataset {path} row 0: no data.label_key 'reward_model' (keys: ['prompt'])"
    else:
        path = tmp_path / "missing.jsonl"
        want = f"--data.prompt_dataset {path}: does not exist"
    proc = _run_train(tmp_path, "--data.prompt_dataset", str(path))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert [ln for ln in proc.stderr.splitlines() if ln.strip()] == [f"flashreinforce train: error: {want}"]


def test_dataset_errors_name_the_flag_that_gave_the_file(tmp_path):
    from flashreinforce.envs.tasks import DatasetError

    good = _write_jsonl(tmp_path / "train.jsonl", _math_rows(2, random.Random()))
    bad = _write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "q"}])
    # The evaluation factory's config carries eval.dataset as data.prompt_dataset.
    with pytest.raises(DatasetError, match=rf"^--eval.dataset {bad} row 0: no data.label_key"):
        make_environment("math", {"data.prompt_dataset": str(bad), "eval.dataset": str(bad)})
    with pytest.raises(DatasetError, match=rf"^--data.prompt_dataset {bad} row 0: no data.label_key"):
        make_environment("math", {"data.prompt_dataset": str(bad), "eval.dataset": str(good)})
    with pytest.raises(DatasetError, match=rf"^--data.prompt_dataset {tmp_path}: is a folder, but not one written"):
        load_tasks(tmp_path)


def test_parquet_without_pyarrow_says_what_to_install(tmp_path, monkeypatch):
    from flashreinforce.envs.tasks import DatasetError

    path = tmp_path / "train.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if it were not installed
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DatasetError) as info:
        load_tasks(path, flag="eval.dataset")
    assert str(info.value) == (f"--eval.dataset {path}: reading Parquet needs pyarrow (pip install pyarrow), "
                               "or convert it to JSONL")


def _fake_save_to_disk_folder(path):
    path.mkdir()
    (path / "state.json").write_text('{"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}')
    (path / "dataset_info.json").write_text("{}")
    return path


def test_a_datasets_folder_without_the_datasets_package_says_so(tmp_path, monkeypatch):
    from flashreinforce.envs.tasks import DatasetError

    folder = _fake_save_to_disk_folder(tmp_path / "saved")
    monkeypatch.setitem(sys.modules, "datasets", None)  # hidden: importing it raises ImportError
    with pytest.raises(DatasetError) as info:
        load_tasks(folder)
    assert str(info.value) == (f"--data.prompt_dataset {folder}: a Hugging Face datasets folder (save_to_disk); "
                               "reading it needs the datasets package: pip install datasets")
    splits = tmp_path / "splits"
    splits.mkdir()
    (splits / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    for name in ("train", "test"):
        _fake_save_to_disk_folder(splits / name)
    with pytest.raises(DatasetError, match=r"several splits \(test, train\); give one split's folder, e\.g\. "):
        load_tasks(splits)


def test_a_list_of_dicts_is_a_dataset_too(tmp_path):
    from flashreinforce.envs.tasks import DatasetError

    rows = _math_rows(3, random.Random())
    tasks = load_tasks(rows, max_samples=2)
    assert [t.ground_truth for t in tasks] == [r["reward_model"]["ground_truth"] for r in rows[:2]]
    env = make_environment("math", {"data.prompt_dataset": rows})
    try:
        assert len(env.tasks) == 3 and env.reset(seed=4).endswith(rows[1]["prompt"][0]["content"] + "\n\nAssistant:")
        again = make_environment("math", {"data.prompt_dataset": rows})
        assert all(a is b for a, b in zip(again.tasks, env.tasks))  # read once per process
        again.close()
    finally:
        env.close()
    with pytest.raises(DatasetError, match=r"^data.prompt_dataset \(a list of 1 rows\) row 0: no data.label_key"):
        load_tasks([{"prompt": "q"}])
    with pytest.raises(DatasetError, match="expected a path, a list of dicts or a datasets.Dataset, got int"):
        load_tasks(7)


def test_a_datasets_dataset_and_its_save_to_disk_folder(tmp_path):
    datasets = pytest.importorskip("datasets", reason="the datasets route needs the datasets package "
                                                      "(pip install datasets); its not-installed message is tested")
    rows = _math_rows(4, random.Random())
    dataset = datasets.Dataset.from_list(rows)
    dataset.save_to_disk(str(tmp_path / "saved"))
    want = load_tasks(rows)
    assert load_tasks(dataset) == want
    assert load_tasks(tmp_path / "saved") == want
    env = make_environment("math", {"data.prompt_dataset": str(tmp_path / "saved")})
    try:
        truth = rows[2]["reward_model"]["ground_truth"]
        env.reset(seed=2)
        assert env.step(f"\\boxed{{{truth}}}").reward == 1.0
    finally:
        env.close()
    datasets.DatasetDict({"train": dataset, "test": dataset}).save_to_disk(str(tmp_path / "dict"))
    from flashreinforce.envs.tasks import DatasetError

    with pytest.raises(DatasetError, match="several splits"):
        load_tasks(tmp_path / "dict")


def test_deep_or_huge_rows_are_one_short_line(tmp_path):
    from flashreinforce.envs.tasks import DatasetError

    deep = "[" * 100_000 + "]" * 100_000
    cases = [("deep.jsonl", '{"prompt": "a"}\n{"prompt": "b", "x": ' + deep + "}\n",
              "deep.jsonl:2: nested too deeply to read"),
             ("deep.json", '[{"prompt": "b", "x": ' + deep + "}]", "deep.json: nested too deeply to read"),
             ("deep40.jsonl", '{"prompt": "b", "x": ' + "[" * 40 + "]" * 40 + "}\n",
              "deep40.jsonl row 0: values nested deeper than 32 levels"),
             ("label.jsonl", json.dumps({"prompt": "b", "reward_model": {"ground_truth": [["x" * 100] * 10_000]}}) + "\n",
              "ground truth must be a string, a number or a list of them, got [[")]
    for name, text, needle in cases:
        (tmp_path / name).write_text(text)
        with pytest.raises(DatasetError) as err:
            load_tasks(str(tmp_path / name))
        assert needle in str(err.value) and "\n" not in str(err.value) and len(str(err.value)) < 500, \
            str(err.value)[:1000]
