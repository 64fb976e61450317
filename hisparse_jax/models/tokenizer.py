"""A checkpoint folder's tokenizer: `tokenizer.json` through the `tokenizers` package.

`tokenizers` is an optional dependency (`pip install -e ".[hf]"`), imported only when a folder
has a tokenizer.json. The end-of-sequence ids come from generation_config.json's
`eos_token_id` when it has one (what Hugging Face generation stops on), else config.json's,
else tokenizer_config.json's `eos_token` looked up in the vocabulary.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

TOKENIZER_FILE = "tokenizer.json"
INSTALL_HINT = 'pip install -e ".[hf]"'


def _json(path: str) -> dict[str, Any]:
    """The JSON object in `path`, {} when the file does not exist."""
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return value


def _ids(value: Any, where: str) -> tuple[int, ...] | None:
    """An `eos_token_id` value (int, list of ints, or null) as a tuple; None when absent."""
    if value is None:
        return None
    values = value if isinstance(value, list) else [value]
    if not all(type(v) is int and v >= 0 for v in values):
        raise ValueError(f"{where}: eos_token_id must be an int >= 0 or a list of them, got "
                         f"{value!r}")
    return tuple(values)


class Tokenizer:
    """Text <-> token ids of one checkpoint folder (a `tokenizers.Tokenizer` inside).

    Attributes:
      path: the folder.
      eos_token_ids: the ids that end a generated sequence (possibly empty).
    """

    def __init__(self, path: str, backend: Any, eos_token_ids: tuple[int, ...]):
        self.path = path
        self.backend = backend
        self.eos_token_ids = eos_token_ids

    @property
    def vocab_size(self) -> int:
        """Ids in the vocabulary, added tokens included."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The token ids of `text` (with the tokenizer's own special tokens, e.g. a BOS, as
        Hugging Face tokenizers add them by default)."""
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return f"Tokenizer({self.path!r}, vocab {self.vocab_size}, eos {self.eos_token_ids})"


def _eos_token_ids(folder: str, backend: Any) -> tuple[int, ...]:
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(folder, name)
        ids = _ids(_json(path).get("eos_token_id"), path)
        if ids is not None:
            return ids
    token = _json(os.path.join(folder, "tokenizer_config.json")).get("eos_token")
    if isinstance(token, dict):                    # {"content": "</s>", ...}
        token = token.get("content")
    tid = backend.token_to_id(token) if isinstance(token, str) else None
    return () if tid is None else (int(tid),)


def load_tokenizer(path: str | os.PathLike) -> Tokenizer | None:
    """The tokenizer of the checkpoint folder `path`, or None when it has no tokenizer.json.

    Raises ImportError (saying how to install it) when the folder has a tokenizer.json but the
    `tokenizers` package is missing, and ValueError naming the file when it cannot be read.
    """
    folder = os.fspath(path)
    file = os.path.join(folder, TOKENIZER_FILE)
    if not os.path.isfile(file):
        return None
    try:
        import tokenizers
    except ImportError:
        raise ImportError(f"{file} needs the `tokenizers` package: {INSTALL_HINT}") from None
    try:
        backend = tokenizers.Tokenizer.from_file(file)
    except Exception as e:  # the Rust side raises a bare Exception on a malformed file
        raise ValueError(f"{file} could not be read by tokenizers: {e}") from None
    return Tokenizer(folder, backend, _eos_token_ids(folder, backend))
