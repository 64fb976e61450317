"""hisparse_jax.models.tokenizer: a checkpoint folder's tokenizer.json through `tokenizers`
(skipped where the optional package is not installed), its eos ids, and the errors."""

from __future__ import annotations

import builtins
import json

import pytest

from hisparse_jax.models.tokenizer import INSTALL_HINT, load_tokenizer

VOCAB = {"[UNK]": 0, "<eos>": 1, "<bos>": 2, "hello": 3, "world": 4, "again": 5}


def _write_tokenizer(folder) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(VOCAB, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece()          # joins words with spaces
    tok.add_special_tokens(["<eos>", "<bos>"])
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", 2)])
    tok.save(str(folder / "tokenizer.json"))


def test_no_tokenizer_json_is_none(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert load_tokenizer(tmp_path) is None


def test_encode_decode_round_trip(tmp_path):
    _write_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path)
    ids = tok.encode("hello world again")
    assert ids == [2, 3, 4, 5]
    assert tok.encode("hello world", add_special_tokens=False) == [3, 4]
    assert tok.encode("hello nope") == [2, 3, 0]
    assert tok.decode(ids, skip_special_tokens=True) == "hello world again"
    assert tok.decode([3, 1]) == "hello <eos>"
    assert tok.vocab_size == len(VOCAB)
    assert tok.eos_token_ids == ()


@pytest.mark.parametrize("files, want", [
    ({"config.json": {"eos_token_id": 1}}, (1,)),
    ({"config.json": {"eos_token_id": [1, 5]}}, (1, 5)),
    ({"config.json": {"eos_token_id": 1}, "generation_config.json": {"eos_token_id": [5, 1]}},
     (5, 1)),
    ({"config.json": {"eos_token_id": 4}, "generation_config.json": {"do_sample": True}}, (4,)),
    ({"config.json": {}, "tokenizer_config.json": {"eos_token": "<eos>"}}, (1,)),
    ({"tokenizer_config.json": {"eos_token": {"content": "again"}}}, (5,)),
])
def test_eos_token_ids(tmp_path, files, want):
    _write_tokenizer(tmp_path)
    for name, content in files.items():
        (tmp_path / name).write_text(json.dumps(content))
    assert load_tokenizer(tmp_path).eos_token_ids == want


def test_bad_eos_token_id_names_the_file(tmp_path):
    _write_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ValueError, match=r"config.json: eos_token_id must be"):
        load_tokenizer(tmp_path)


def test_malformed_tokenizer_json_names_the_file(tmp_path):
    pytest.importorskip("tokenizers")
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match=r"tokenizer.json could not be read"):
        load_tokenizer(tmp_path)


def test_missing_package_says_how_to_install(tmp_path, monkeypatch):
    (tmp_path / "tokenizer.json").write_text("{}")
    real_import = builtins.__import__

    def no_tokenizers(name, *args, **kwargs):
        if name == "tokenizers":
            raise ImportError("No module named 'tokenizers'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tokenizers)
    with pytest.raises(ImportError, match=r"tokenizers.*" + r'pip install -e "\.\[hf\]"'):
        load_tokenizer(tmp_path)
    assert INSTALL_HINT == 'pip install -e ".[hf]"'
