"""The cache of dequantized GGUF files (flashreinforce.models.gguf_cache): a second load reads it, the same
model and tokenizer come back, it can be turned off, and nothing another user could have written is read."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")

from flashreinforce.models import gguf_cache, loading  # noqa: E402
from flashreinforce.models.loading import build_model  # noqa: E402
from flashreinforce.models.tokenizers import load_tokenizer  # noqa: E402
from python_tests.models.gguf_tiny import write_tiny_gguf  # noqa: E402


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "home" / "cache"
    monkeypatch.setenv(gguf_cache.CACHE_ENV, str(root))
    monkeypatch.delenv(gguf_cache.CACHE_OFF_ENV, raising=False)
    gguf_cache._warned.clear()
    return root / "gguf"


@pytest.fixture
def gguf_file(tmp_path):
    path = tmp_path / "files" / "tiny.gguf"
    path.parent.mkdir()
    write_tiny_gguf(path, seed=4)
    return path


def _count_dequantizing(monkeypatch) -> list[Path]:
    calls: list[Path] = []
    real = loading._dequantize_gguf

    def counting(path, kwargs):
        calls.append(path)
        return real(path, kwargs)

    monkeypatch.setattr(loading, "_dequantize_gguf", counting)
    return calls


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([[5, 40, 77, 12, 3]])).logits


def test_a_second_load_reads_the_cache_and_gives_the_same_model_and_tokenizer(cache, gguf_file, monkeypatch):
    calls = _count_dequantizing(monkeypatch)
    first, tok_spec = build_model(str(gguf_file), device=torch.device("cpu"))
    first_tok = load_tokenizer(tok_spec, chat_prompt=True)
    assert calls == [gguf_file]
    entries = [p for p in cache.iterdir() if not p.name.startswith(".")]
    assert len(entries) == 1 and (entries[0] / "model.safetensors").is_file() and (entries[0] / "tokenizer.json").is_file()
    # private: the folders 0700, the files 0600, all this user's
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700 and stat.S_IMODE(os.stat(entries[0]).st_mode) == 0o700
    assert {stat.S_IMODE(os.stat(f).st_mode) for f in entries[0].iterdir()} == {0o600}
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no temporary folder left behind

    second, _ = build_model(str(gguf_file), device=torch.device("cpu"))
    second_tok = load_tokenizer(str(gguf_file), chat_prompt=True)
    assert calls == [gguf_file]  # not dequantized again
    assert torch.equal(_logits(first), _logits(second))
    assert second_tok.encode_prompt("hello world") == first_tok.encode_prompt("hello world")
    assert second_tok.tok.chat_template == first_tok.tok.chat_template and second_tok.eos_token_ids == first_tok.eos_token_ids
    assert loading.checkpoint_directory(str(gguf_file)) == entries[0]  # the folder vLLM reads is the same entry


def test_the_cache_is_keyed_by_content_not_by_name_size_or_time(cache, gguf_file, monkeypatch):
    calls = _count_dequantizing(monkeypatch)
    build_model(str(gguf_file), device=torch.device("cpu"))
    st = os.stat(gguf_file)
    write_tiny_gguf(gguf_file, seed=5)  # other weights, same size
    os.utime(gguf_file, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(gguf_file).st_size == st.st_size
    other, _ = build_model(str(gguf_file), device=torch.device("cpu"))
    assert len(calls) == 2
    reference, _ = loading._dequantize_gguf(gguf_file, {}), None
    assert torch.equal(_logits(other), _logits(reference))


def test_the_cache_can_be_turned_off(cache, gguf_file, monkeypatch):
    monkeypatch.setenv(gguf_cache.CACHE_OFF_ENV, "0")
    calls = _count_dequantizing(monkeypatch)
    build_model(str(gguf_file), device=torch.device("cpu"))
    build_model(str(gguf_file), device=torch.device("cpu"))
    assert len(calls) == 2 and not cache.exists()


@pytest.mark.parametrize("tamper", ["group-writable file", "world-writable entry", "symbolic link",
                                    "group-writable cache"])
def test_an_entry_another_user_could_have_written_is_not_read(cache, gguf_file, monkeypatch, caplog, tamper):
    calls = _count_dequantizing(monkeypatch)
    build_model(str(gguf_file), device=torch.device("cpu"))
    entry = gguf_cache.entry_for(gguf_file)
    assert gguf_cache.cached_entry(gguf_file) == entry
    if tamper == "group-writable file":
        os.chmod(entry / "config.json", 0o620)
    elif tamper == "world-writable entry":
        os.chmod(entry, 0o777)
    elif tamper == "symbolic link":
        target = entry.parent.parent / "elsewhere.json"
        (entry / "config.json").rename(target)
        (entry / "config.json").symlink_to(target)
    else:
        os.chmod(cache, 0o770)
    with caplog.at_level(logging.WARNING, logger="flashreinforce.models.gguf_cache"):
        assert gguf_cache.cached_entry(gguf_file) is None
        model, _ = build_model(str(gguf_file), device=torch.device("cpu"))
    assert len(calls) == 2  # dequantized from the file again
    assert "is not used" in caplog.text
    assert torch.equal(_logits(model), _logits(loading._dequantize_gguf(gguf_file, {})))


def test_a_cache_below_a_folder_others_can_write_is_neither_read_nor_written(tmp_path, gguf_file, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # anyone may rename what is inside: nothing below it can be trusted
    monkeypatch.setenv(gguf_cache.CACHE_ENV, str(shared / "cache"))
    gguf_cache._warned.clear()
    calls = _count_dequantizing(monkeypatch)
    build_model(str(gguf_file), device=torch.device("cpu"))
    build_model(str(gguf_file), device=torch.device("cpu"))
    assert len(calls) == 2 and not list((shared / "cache" / "gguf").glob("tiny-*"))
    os.chmod(shared, 0o1777)  # sticky, like /tmp: others cannot rename this user's folders
    build_model(str(gguf_file), device=torch.device("cpu"))
    build_model(str(gguf_file), device=torch.device("cpu"))
    assert len(calls) == 3
