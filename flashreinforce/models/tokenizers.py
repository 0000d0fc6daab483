"""Tokenizers the trainer talks to: a character-level one for tiny models, and an adapter for
Hugging Face tokenizers.

The trainer only needs five things from a tokenizer (the :class:`TextTokenizer` protocol):
turning the prompt and the environment's observations into token ids, turning sampled ids back
into text, the stop token(s), a padding id and the vocabulary size. Both classes here provide them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol, Sequence

__all__ = ["CharTokenizer", "HFTokenizer", "TextTokenizer", "load_tokenizer"]

CHAR_TOKENIZER_FILE = "char_tokenizer.json"


class TextTokenizer(Protocol):
    """What the rollout workers and the learner need from a tokenizer."""

    vocab_size: int
    pad_token_id: int
    eos_token_ids: tuple[int, ...]

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of the first prompt of an episode (with BOS or chat template as configured)."""

    def encode_observation(self, text: str) -> list[int]:
        """Token ids of an environment observation appended after a policy turn."""

    def decode(self, ids: Sequence[int]) -> str:
        """Text of sampled ids, special tokens left out."""


class CharTokenizer:
    """One token per character: ``<pad>``, ``<bos>``, ``<eos>``, tab, newline and printable ASCII.

    Ids: 0 ``<pad>``, 1 ``<bos>``, 2 ``<eos>``, then ``\\t``, ``\\n`` and the 95 characters
    ``' '..'~'`` in code-point order (vocabulary size 100). A character outside that set raises
    ``ValueError`` naming it (nothing is replaced silently).
    """

    PAD, BOS, EOS = 0, 1, 2
    SPECIALS = ("<pad>", "<bos>", "<eos>")
    CHARS = "\t\n" + "".join(chr(c) for c in range(32, 127))

    def __init__(self) -> None:
        self._stoi = {c: i + len(self.SPECIALS) for i, c in enumerate(self.CHARS)}
        self.vocab_size = len(self.SPECIALS) + len(self.CHARS)
        self.pad_token_id = self.PAD
        self.bos_token_id = self.BOS
        self.eos_token_ids = (self.EOS,)

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``, one per character, no special tokens."""
        try:
            return [self._stoi[c] for c in text]
        except KeyError as err:
            raise ValueError(f"CharTokenizer: character {err.args[0]!r} in text {text[:60]!r} is not "
                             "printable ASCII, tab or newline") from None

    def encode_prompt(self, text: str) -> list[int]:
        return [self.BOS] + self.encode(text)

    def encode_observation(self, text: str) -> list[int]:
        return self.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        n = len(self.SPECIALS)
        out = []
        for i in ids:
            i = int(i)
            if i < 0 or i >= self.vocab_size:
                raise ValueError(f"CharTokenizer.decode: id {i} outside the vocabulary [0, {self.vocab_size})")
            if i >= n:
                out.append(self.CHARS[i - n])
        return "".join(out)

    def save_pretrained(self, directory: str | Path) -> None:
        """Write ``char_tokenizer.json`` so a checkpoint directory names its tokenizer."""
        path = Path(directory) / CHAR_TOKENIZER_FILE
        path.write_text(json.dumps({"type": "char", "specials": list(self.SPECIALS), "chars": self.CHARS}))


class HFTokenizer:
    """Adapter around a Hugging Face tokenizer (``AutoTokenizer``) loaded from a local directory.

    ``chat_prompt``: the prompt text is rendered as one user message with the generation prompt
    (leave it off when the environment renders the template itself). ``chat_observations``: each
    observation is wrapped as a user message followed by the generation prompt, using the
    template's text between an assistant turn and the next one (found once by rendering a probe
    conversation); a template that does not render conversations as growing prefixes is refused
    with ``ValueError``.
    """

    def __init__(self, tokenizer, *, chat_prompt: bool = False, chat_observations: bool = False) -> None:
        self.tok = tokenizer
        self.vocab_size = len(tokenizer)
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ValueError("HFTokenizer: the tokenizer has no eos_token_id; generation could never stop")
        self.eos_token_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
        pad = tokenizer.pad_token_id
        self.pad_token_id = int(pad) if pad is not None else self.eos_token_ids[0]
        self.chat_prompt = bool(chat_prompt)
        self.chat_observations = bool(chat_observations)
        if (self.chat_prompt or self.chat_observations) and not getattr(tokenizer, "chat_template", None):
            raise ValueError("data.apply_chat_template is set but the tokenizer has no chat template")
        if self.chat_observations:
            self._obs_prefix, self._obs_suffix = self._observation_wrapping()

    def _render(self, messages, generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _observation_wrapping(self) -> tuple[str, str]:
        marker = "\x00OBSERVATION\x00"
        base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
        before = self._render(base, False)
        after = self._render(base + [{"role": "user", "content": marker}], True)
        if not after.startswith(before) or marker not in after:
            raise ValueError("HFTokenizer: the chat template does not render a conversation as a growing "
                             "prefix; multi-turn observations cannot be appended to a trajectory")
        # The assistant turn in `before` ends with the end-of-turn text; the sampled action carries the
        # eos token itself, so the wrapping starts right after the assistant's content and eos: with
        # whatever the template writes after the eos (ChatML's newline) before the next turn.
        wrapped = after[len(before):]
        prefix, suffix = wrapped.split(marker)
        eos_text = self.tok.eos_token if isinstance(self.tok.eos_token, str) else None
        cut = before.rfind(eos_text) if eos_text else -1
        if cut >= 0:
            prefix = before[cut + len(eos_text):] + prefix
        return prefix, suffix

    def encode_prompt(self, text: str) -> list[int]:
        if self.chat_prompt:
            rendered = self._render([{"role": "user", "content": text}], True)
            return list(self.tok(rendered, add_special_tokens=False)["input_ids"])
        ids = list(self.tok(text, add_special_tokens=False)["input_ids"])
        bos = self.tok.bos_token_id
        # A prompt the environment rendered with the chat template may already begin with the bos token
        # (ChatML's <|im_start|>): not twice.
        return ([bos] if bos is not None and ids[:1] != [bos] else []) + ids

    def encode_observation(self, text: str) -> list[int]:
        if self.chat_observations:
            text = self._obs_prefix + text + self._obs_suffix
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def save_pretrained(self, directory: str | Path) -> None:
        self.tok.save_pretrained(str(directory))


def load_tokenizer(spec: str, *, chat_prompt: bool = False, chat_observations: bool = False):
    """``"char"`` gives :class:`CharTokenizer`; a directory gives its char tokenizer (if it holds
    ``char_tokenizer.json``) or its Hugging Face tokenizer (local files only, never a download); a
    ``.gguf`` file or a model alias (``smollm2-135m-instruct``) gives the tokenizer and chat template
    stored in the GGUF file; a run directory gives its newest checkpoint's tokenizer."""
    if spec == "char":
        return CharTokenizer()
    from flashreinforce.models.loading import gguf_tokenizer, require_gguf, resolve_model_spec

    path = Path(resolve_model_spec(spec))
    if (path / CHAR_TOKENIZER_FILE).is_file():
        return CharTokenizer()
    from transformers import AutoTokenizer

    if path.is_file() and path.suffix == ".gguf":
        require_gguf(f"tokenizer {spec}")
        tok = gguf_tokenizer(path)
    elif path.is_dir():
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    else:
        raise ValueError(f"tokenizer {spec!r}: expected 'char', a local directory holding a tokenizer, a .gguf "
                         "file or a model alias")
    return HFTokenizer(tok, chat_prompt=chat_prompt, chat_observations=chat_observations)
