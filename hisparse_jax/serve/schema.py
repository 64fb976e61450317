"""The OpenAI request bodies the server accepts, checked before anything reaches the engine.

`completion_request` and `chat_request` turn a decoded JSON body into a `GenerationRequest`
(token ids and sampling parameters) or raise `RequestError`, which names the offending field
(`param`, also in the message) and the HTTP status (400; 404 for an unknown `model`). The
rules: the body is a JSON object; every field is one of the endpoint's known ones (an
unknown field is refused, not ignored); each field has its JSON type (a bool is never an
int); a prompt is non-empty text (the model's tokenizer encodes it) or non-empty token ids
in [0, vocab); a prompt leaves room under max_model_len, and so do prompt + max_tokens;
n is 1; a seed is an int in [0, 2**32); stop strings need the tokenizer (they are matched
on the decoded text). Chat messages are rendered by the tokenizer's chat template
(`text.ChatTemplate`) before the same checks.

Nothing here imports the server's optional packages: the rules are plain Python.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

MAX_SEED = 2**32 - 1  # the engine's per-request sampling seeds are 32-bit


class RequestError(Exception):
    """A request refused before the engine: `message`, the field `param` it names (None: the
    body as a whole) and the HTTP `status`."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind

    def body(self) -> dict[str, Any]:
        """OpenAI's error object: {"error": {message, type, param, code}}."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.status}}


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the served model and engine allow: `max_model_len` tokens per request (prompt +
    generated), token ids in [0, `vocab_size`), and the `model_name` a request may give."""

    max_model_len: int
    vocab_size: int
    model_name: str


@dataclasses.dataclass
class GenerationRequest:
    """One checked request: `prompt` token ids (non-empty, in the vocab), `max_tokens` (None:
    until max_model_len), `temperature` (>= 0, 0 greedy), `seed` (None: the engine's
    default, the request's arrival order), `stop` strings (matched on decoded text),
    `stop_token_ids` (the request's own; the tokenizer's end-of-sequence ids are added unless
    `ignore_eos`), `stream` and `include_usage` (a usage chunk before `[DONE]`)."""

    prompt: list[int]
    max_tokens: int | None = None
    temperature: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False


# field -> (JSON type description, check); the check returns the value to keep.
_Check = Callable[[str, Any], Any]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_at_least(minimum: int, maximum: int | None = None, *, nullable: bool = True
                  ) -> _Check:
    def check(name: str, value: Any) -> Any:
        if value is None and nullable:
            return None
        upper = "" if maximum is None else f" and <= {maximum}"
        if not _is_int(value) or value < minimum or (maximum is not None and value > maximum):
            raise RequestError(f"'{name}' must be an integer >= {minimum}{upper}"
                               f"{' or null' if nullable else ''}, got {value!r:.60}", name)
        return value
    return check


def _temperature(name: str, value: Any) -> float:
    if value is None:
        return 1.0
    if (not isinstance(value, (int, float)) or isinstance(value, bool)
            or not math.isfinite(value) or value < 0):
        raise RequestError(f"'{name}' must be a finite number >= 0 (0: greedy), got "
                           f"{value!r:.60}", name)
    return float(value)


def _bool(name: str, value: Any) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"'{name}' must be a boolean, got {value!r:.60}", name)
    return value


def _n(name: str, value: Any) -> int:
    if value is None:
        return 1
    if not _is_int(value):
        raise RequestError(f"'{name}' must be an integer, got {value!r:.60}", name)
    if value != 1:
        raise RequestError(f"'{name}' must be 1: one choice per request, got {value}", name)
    return 1


def _str(name: str, value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise RequestError(f"'{name}' must be a string, got {value!r:.60}", name)
    return value


def _stop(name: str, value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(s, str) and s for s in values):
        raise RequestError(f"'{name}' must be a non-empty string or a list of them, got "
                           f"{value!r:.60}", name)
    return tuple(values)


def _token_list(name: str, value: Any) -> list[int]:
    """A JSON array of ints (never bools); the vocabulary is checked by the caller."""
    if not isinstance(value, list) or not all(_is_int(t) for t in value):
        raise RequestError(f"'{name}' must be a list of integer token ids, got "
                           f"{value!r:.60}", name)
    return value


def _stream_options(name: str, value: Any) -> bool:
    if value is None:
        return False
    if not isinstance(value, dict):
        raise RequestError(f"'{name}' must be an object, got {value!r:.60}", name)
    for key, item in value.items():
        if key != "include_usage":
            raise RequestError(f"unknown field '{name}.{key}' (known: include_usage)",
                               f"{name}.{key}")
        _bool(f"{name}.include_usage", item)
    return bool(value.get("include_usage"))


def _neutral(shown: str, *allowed: Any, why: str) -> _Check:
    """A standard OpenAI field this server does not implement: accepted only as null or one
    of `allowed` (values that change nothing; `shown` as JSON), so that clients sending
    their defaults work."""
    def check(name: str, value: Any) -> None:
        if value is None or any(type(value) is type(a) and value == a for a in allowed):
            return None
        raise RequestError(f"'{name}' must be {shown} or null: {why}, got {value!r:.60}",
                           name)
    return check


# The fields both endpoints take, with their checks.
_COMMON: dict[str, _Check] = {
    "top_p": _neutral("1", 1, 1.0, why="tokens are sampled from the whole distribution"),
    "frequency_penalty": _neutral("0", 0, 0.0, why="no penalties are applied"),
    "presence_penalty": _neutral("0", 0, 0.0, why="no penalties are applied"),
    "logprobs": _neutral("false", False, why="log-probabilities are not returned"),
    "echo": _neutral("false", False, why="the prompt is not echoed (see prompt_token_ids)"),
    "best_of": _neutral("1", 1, why="one choice per request"),
    "model": _str,
    "max_tokens": _int_at_least(1),
    "temperature": _temperature,
    "seed": _int_at_least(0, MAX_SEED),
    "stop": _stop,
    "stop_token_ids": lambda n, v: () if v is None else tuple(_token_list(n, v)),
    "n": _n,
    "stream": _bool,
    "stream_options": _stream_options,
    "ignore_eos": _bool,
    "user": _str,
    "return_token_ids": _bool,  # always on: every choice and chunk carries token_ids
}
COMPLETION_FIELDS = ("prompt", *_COMMON)
CHAT_FIELDS = ("messages", "max_completion_tokens", *_COMMON)


def _fields(body: Any, known: tuple[str, ...]) -> dict[str, Any]:
    """The checked common fields of `body` (absent ones as their check's default)."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got "
                           f"{type(body).__name__}")
    for key in body:
        if key not in known:
            raise RequestError(f"unknown field '{key}' (this endpoint takes: "
                               f"{', '.join(known)})", key)
    return {name: check(name, body.get(name)) for name, check in _COMMON.items()}


def _check_model(fields: dict[str, Any], limits: Limits) -> None:
    model = fields["model"]
    if model is not None and model != limits.model_name:
        raise RequestError(f"'model' {model!r} is not served here (this server serves "
                           f"{limits.model_name!r}; GET /v1/models)", "model", status=404,
                           kind="not_found_error")


def _ids_in_vocab(name: str, ids: list[int] | tuple[int, ...], limits: Limits) -> None:
    bad = [t for t in ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise RequestError(f"'{name}' token ids must be in [0, {limits.vocab_size}) (the "
                           f"model's vocab), got {bad[0]}", name)


def _prompt_ids(value: Any, limits: Limits, encode: Callable[[str], list[int]] | None
                ) -> list[int]:
    """`prompt`: text, token ids, or a list holding one of those (one prompt per request)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    elif isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
        raise RequestError(f"'prompt' must be one prompt (text or token ids); got a batch of "
                           f"{len(value)}", "prompt")
    if isinstance(value, str):
        if not value:
            raise RequestError("'prompt' must not be empty", "prompt")
        if encode is None:
            raise RequestError("'prompt' is text, but this model has no tokenizer: give the "
                               "prompt as a list of token ids", "prompt")
        ids = encode(value)
        if not ids:
            raise RequestError("'prompt' encodes to no tokens", "prompt")
        return ids
    if value is None:
        raise RequestError("'prompt' is required (text or a list of token ids)", "prompt")
    ids = _token_list("prompt", value)
    if not ids:
        raise RequestError("'prompt' must not be empty", "prompt")
    _ids_in_vocab("prompt", ids, limits)
    return list(ids)


def _request(prompt: list[int], fields: dict[str, Any], limits: Limits, *,
             has_tokenizer: bool, max_tokens_field: str = "max_tokens") -> GenerationRequest:
    """The checks on lengths, stop strings and streaming shared by both endpoints."""
    L = limits.max_model_len
    if len(prompt) >= L:
        raise RequestError(f"'prompt' has {len(prompt)} tokens; max_model_len is {L}, which "
                           f"leaves no room for a generated token", "prompt")
    max_tokens = fields["max_tokens"]
    if max_tokens is not None and len(prompt) + max_tokens > L:
        raise RequestError(f"'{max_tokens_field}' {max_tokens} + the prompt's {len(prompt)} "
                           f"tokens = {len(prompt) + max_tokens} exceeds max_model_len {L}",
                           max_tokens_field)
    if fields["stop"] and not has_tokenizer:
        raise RequestError("'stop' strings are matched on decoded text, but this model has no "
                           "tokenizer (use 'stop_token_ids')", "stop")
    _ids_in_vocab("stop_token_ids", fields["stop_token_ids"], limits)
    if fields["stream_options"] and not fields["stream"]:
        raise RequestError("'stream_options' needs 'stream': true", "stream_options")
    return GenerationRequest(
        prompt=prompt, max_tokens=max_tokens, temperature=fields["temperature"],
        seed=fields["seed"], stop=fields["stop"], stop_token_ids=fields["stop_token_ids"],
        ignore_eos=fields["ignore_eos"], stream=fields["stream"],
        include_usage=fields["stream_options"])


def completion_request(body: Any, limits: Limits,
                       encode: Callable[[str], list[int]] | None) -> GenerationRequest:
    """POST /v1/completions: the checked request (`encode`: the tokenizer's text -> ids,
    None when the model has none); RequestError naming the field otherwise."""
    fields = _fields(body, COMPLETION_FIELDS)
    _check_model(fields, limits)
    prompt = _prompt_ids(body.get("prompt"), limits, encode)
    return _request(prompt, fields, limits, has_tokenizer=encode is not None)


def chat_messages(value: Any) -> list[dict[str, str]]:
    """`messages`: a non-empty list of {"role": str, "content": str or text parts, "name"?};
    returned with each content as one string."""
    if not isinstance(value, list) or not value:
        raise RequestError("'messages' must be a non-empty list of {role, content} objects",
                           "messages")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError(f"'{where}' must be an object", where)
        for key in message:
            if key not in ("role", "content", "name"):
                raise RequestError(f"unknown field '{where}.{key}' (known: role, content, "
                                   f"name)", f"{where}.{key}")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise RequestError(f"'{where}.role' must be a non-empty string", f"{where}.role")
        if isinstance(content, list):
            parts = content
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in parts):
                raise RequestError(f"'{where}.content' parts must be "
                                   f"{{\"type\": \"text\", \"text\": str}} objects",
                                   f"{where}.content")
            content = "".join(p["text"] for p in parts)
        if not isinstance(content, str):
            raise RequestError(f"'{where}.content' must be a string or a list of text parts",
                               f"{where}.content")
        entry = {"role": role, "content": content}
        if "name" in message:
            entry["name"] = _str(f"{where}.name", message["name"]) or ""
        out.append(entry)
    return out


def chat_request(body: Any, limits: Limits, render: Callable[[list[dict[str, str]]], str],
                 encode: Callable[[str], list[int]]) -> GenerationRequest:
    """POST /v1/chat/completions: `messages` rendered by `render` (the chat template) and
    encoded by `encode` (no special tokens added: the template writes its own), then the
    completion rules; `max_completion_tokens` is OpenAI's newer name of max_tokens."""
    fields = _fields(body, CHAT_FIELDS)
    _check_model(fields, limits)
    newer = _int_at_least(1)("max_completion_tokens", body.get("max_completion_tokens"))
    name = "max_tokens"
    if newer is not None:
        if fields["max_tokens"] is not None:
            raise RequestError("give one of 'max_tokens' and 'max_completion_tokens'",
                               "max_completion_tokens")
        fields["max_tokens"], name = newer, "max_completion_tokens"
    text = render(chat_messages(body.get("messages")))
    prompt = encode(text)
    if not prompt:
        raise RequestError("'messages' render to an empty prompt", "messages")
    return _request(prompt, fields, limits, has_tokenizer=True, max_tokens_field=name)
