"""OpenAI response bodies and streamed chunks of one request (`Output`), from its updates.

Completions: `text_completion` objects, each choice with `text`, `token_ids` (the generated
ids, as vLLM's `return_token_ids`), `finish_reason` and `stop_reason`; chat completions:
`chat.completion` with the `message`, streamed as `chat.completion.chunk` deltas (the first
one opens the assistant's turn). Every streamed chunk carries the `token_ids` it adds; the
first one also `prompt_token_ids`.

finish_reason: "stop" (a stop token: the tokenizer's end of sequence or one of
`stop_token_ids`, kept in token_ids; or a stop string: the text is cut before it and
`stop_reason` names it), "length" (max_tokens, or max_model_len), "abort" (the request was
cancelled: its client disconnected, or the server's shutdown grace period ran out), "error"
(the engine failed the request: `error` says why). stop_reason: the stop string, or the
stop token id from `stop_token_ids`, else null.
"""

from __future__ import annotations

import time
from typing import Any

from hisparse_jax.serve.engine_loop import Update
from hisparse_jax.serve.schema import GenerationRequest
from hisparse_jax.serve.text import TextStream

FINISH_REASON = {"stop": "stop", "length": "length", "max_model_len": "length",
                 "cancelled": "abort", "error": "error"}


class Output:
    """The client-facing state of one request. `kind`: "completion" or "chat"; `stream`: a
    `TextStream` over the tokenizer (None: no tokenizer, text stays empty)."""

    def __init__(self, kind: str, request_id: str, model: str, gen: GenerationRequest,
                 stream: TextStream | None) -> None:
        self.kind, self.request_id, self.model, self.gen = kind, request_id, model, gen
        self.created = int(time.time())
        self._text = stream
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.error: str | None = None
        self._chunks_sent = 0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def stopped_by_text(self) -> bool:
        """A stop string ended it (the engine still runs it: the caller cancels it)."""
        return isinstance(self.stop_reason, str)

    def apply(self, update: Update) -> tuple[list[int], str]:
        """Takes one update (not an accepted / rejected one); returns the token ids and text
        it adds to the output."""
        ids, text = list(update.tokens), ""
        if self._text is not None:
            text = self._text.add(ids)
            if self._text.stopped is not None:
                self.finish_reason, self.stop_reason = "stop", self._text.stopped
            elif update.finish_reason is not None:
                text += self._text.finish()
        self.token_ids += ids
        self.text += text
        if update.finish_reason is not None and not self.done:
            self.finish_reason = FINISH_REASON.get(update.finish_reason, update.finish_reason)
            self.error = update.error
            if (update.finish_reason == "stop" and self.token_ids
                    and self.token_ids[-1] in self.gen.stop_token_ids):
                self.stop_reason = self.token_ids[-1]
        return ids, text

    def usage(self) -> dict[str, int]:
        n, m = len(self.gen.prompt), len(self.token_ids)
        return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}

    def _head(self, chunk: bool) -> dict[str, Any]:
        obj = {"completion": "text_completion", "chat": "chat.completion"}[self.kind]
        return {"id": self.request_id, "object": obj + (".chunk" if chunk and self.kind == "chat"
                                                         else ""),
                "created": self.created, "model": self.model}

    def body(self) -> dict[str, Any]:
        """The whole response (stream: false)."""
        choice: dict[str, Any] = {"index": 0}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": self.text}
        else:
            choice["text"] = self.text
        choice.update(token_ids=self.token_ids, prompt_token_ids=self.gen.prompt,
                      logprobs=None, finish_reason=self.finish_reason,
                      stop_reason=self.stop_reason)
        return {**self._head(False), "choices": [choice], "usage": self.usage()}

    def chunk(self, ids: list[int], text: str) -> dict[str, Any] | None:
        """The streamed chunk of one update's additions (None: nothing to send)."""
        first = self._chunks_sent == 0
        if not ids and not text and not self.done and not (first and self.kind == "chat"):
            return None
        choice: dict[str, Any] = {"index": 0}
        if self.kind == "chat":
            choice["delta"] = ({"role": "assistant", "content": text} if first
                               else {"content": text})
        else:
            choice["text"] = text
        choice.update(token_ids=ids, logprobs=None, finish_reason=self.finish_reason)
        if self.done:
            choice["stop_reason"] = self.stop_reason
        if first:
            choice["prompt_token_ids"] = self.gen.prompt
        self._chunks_sent += 1
        return {**self._head(True), "choices": [choice]}

    def usage_chunk(self) -> dict[str, Any]:
        """The last chunk with stream_options.include_usage: no choice, the usage."""
        return {**self._head(True), "choices": [], "usage": self.usage()}
