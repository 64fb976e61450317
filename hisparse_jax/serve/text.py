"""Text around the token ids: incremental decoding, stop strings and chat templates.

`TextStream` turns a request's generated ids, a few at a time, into text deltas: the ids are
decoded incrementally (a delta is released once it no longer ends in an incomplete UTF-8
sequence, U+FFFD), and with stop strings the last `max(len(stop)) - 1` characters are held
back until they cannot begin a stop string. When a stop string appears, the text is cut
before it and the stream reports it; the ids keep every token up to the one that completed
it. `ChatTemplate` renders OpenAI chat messages with a checkpoint's `chat_template`
(tokenizer_config.json), the way Hugging Face tokenizers do: a sandboxed jinja2 environment
with `messages`, `add_generation_prompt`, `bos_token`, `eos_token` and `raise_exception`.
jinja2 is imported only when a template is used.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

REPLACEMENT = "\ufffd"  # what a decoder yields for an incomplete UTF-8 sequence


class TextStream:
    """Incremental text of one request's generated ids (`decode(ids) -> str`, special tokens
    skipped) with stop strings (`stop`: non-empty strings).

    `add(ids)` returns the text that is final so far; `finish()` the rest (the held-back
    characters, and any incomplete sequence) once the request ended. After a stop string
    matched, `stopped` is the string and every later call returns ""."""

    def __init__(self, decode: Any, stop: Sequence[str] = ()) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0   # ids[_prefix:_read] decode to text already released (context)
        self._read = 0
        self._stop = tuple(stop)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._pending = ""  # decoded, not released: it may begin a stop string
        self.stopped: str | None = None

    def _decoded(self, final: bool) -> str:
        """Text of the ids not decoded yet (empty while they end mid-character)."""
        before = self._decode(self._ids[self._prefix:self._read])
        now = self._decode(self._ids[self._prefix:])
        if len(now) <= len(before) or (now.endswith(REPLACEMENT) and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return now[len(before):]

    def add(self, ids: Sequence[int]) -> str:
        if self.stopped is not None:
            return ""
        self._ids.extend(int(t) for t in ids)
        return self._release(self._decoded(final=False), final=False)

    def finish(self) -> str:
        if self.stopped is not None:
            return ""
        return self._release(self._decoded(final=True), final=True)

    def _release(self, text: str, final: bool) -> str:
        text = self._pending + text
        self._pending = ""
        if self._stop:
            hits = [(text.find(s), s) for s in self._stop if s in text]
            if hits:
                at, self.stopped = min(hits)
                return text[:at]
        if final or not self._hold:
            return text
        # Hold back what could still become the beginning of a stop string.
        cut = max(len(text) - self._hold, 0)
        self._pending = text[cut:]
        return text[:cut]


def chat_template_of(folder: str | os.PathLike) -> str | None:
    """The `chat_template` of a checkpoint folder's tokenizer_config.json (a string, or the
    "default" entry of a list of {name, template}; the first when none is named so), None when
    there is none. ValueError naming the file when it is malformed."""
    path = os.path.join(os.fspath(folder), "tokenizer_config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{path}: chat_template must be a string or a list of "
                         f"{{name, template}} objects")
    return template or None


def _special(config: dict[str, Any], key: str) -> str:
    value = config.get(key)
    if isinstance(value, dict):  # {"content": "<s>", ...}
        value = value.get("content")
    return value if isinstance(value, str) else ""


class ChatTemplate:
    """A checkpoint's chat template, compiled once (jinja2's sandboxed environment)."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        try:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise ImportError('chat templates need the `jinja2` package: pip install -e '
                              '".[serve]"') from None

        def raise_exception(message: str) -> None:
            raise ValueError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        self._template = env.from_string(source)
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def from_folder(cls, folder: str | os.PathLike) -> ChatTemplate | None:
        """The template of a checkpoint folder (None: it has none)."""
        source = chat_template_of(folder)
        if source is None:
            return None
        with open(os.path.join(os.fspath(folder), "tokenizer_config.json"),
                  encoding="utf-8") as f:
            config = json.load(f)
        return cls(source, bos_token=_special(config, "bos_token"),
                   eos_token=_special(config, "eos_token"))

    def render(self, messages: list[dict[str, str]]) -> str:
        """The prompt text of `messages`, ending with the assistant's turn opened. A
        template's own refusal (`raise_exception`) is a ValueError."""
        return self._template.render(messages=messages, add_generation_prompt=True,
                                     bos_token=self.bos_token, eos_token=self.eos_token)
