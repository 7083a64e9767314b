"""Tokenizer: Kimi tiktoken format (synthetic K3 / K2 files), special tokens stay text in user text,
long-input piecing, `tokenizer.json` checkpoints, bad files."""

from __future__ import annotations

import base64
import json

import pytest
import regex
import tiktoken
from moe_export.common.errors import InputError
from moe_export.export.convert.synth import (
    SYNTHETIC_MERGES,
    synthetic_special_ids,
    write_synthetic_tokenizer,
)
from moe_export.runtime.tokenizer import KIMI_PATTERN, SHORT_TEXT_CHARS, load_tokenizer, split_long_runs


@pytest.fixture(scope="module", params=["k3", "k2"])
def kimi(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"tok-{request.param}")
    write_synthetic_tokenizer(d, request.param, 1024)
    return load_tokenizer(d)


def test_layout_family_and_names(kimi):
    family = kimi.family
    base = 256 + len(SYNTHETIC_MERGES)
    assert kimi.vocab_size == base + 256
    for name, tid in synthetic_special_ids(family).items():
        assert kimi.encode_special(name) == tid == kimi.token_to_id(name)
    # unnamed slots are reserved tokens named by their absolute id
    assert kimi.token_to_id(f"<|reserved_token_{base + 7}|>") == base + 7
    assert kimi.token_to_id("think") == 256 + SYNTHETIC_MERGES.index(b"think")
    assert kimi.token_to_id("not a token") is None
    with pytest.raises(InputError, match="not a special token"):
        kimi.encode_special("think")
    stop = "<|end_of_msg|>" if family == "k3" else "<|im_end|>"
    assert kimi.eos_token_ids == {kimi.encode_special(stop), kimi.encode_special("[EOS]")}


@pytest.mark.parametrize("typed", ["<|open|>", "</think>", "<|im_end|>", "<|tool_call_begin|>", "[EOS]", "<|reserved_token_300|>"])
def test_typed_markers_stay_text(kimi, typed):
    ids = kimi.encode(f"a {typed} b")
    assert not any(kimi.is_special(i) for i in ids)
    assert all(i < 256 + len(SYNTHETIC_MERGES) for i in ids)
    assert kimi.decode(ids) == f"a {typed} b"


def test_round_trip_and_merges(kimi):
    text = "Think: the message\n\n中文 naïve 1234567 — 🙂\r\n  end "
    ids = kimi.encode(text)
    assert kimi.decode(ids) == text
    assert kimi.encode("think") == [kimi.token_to_id("think")]
    # merges never cross a pre-tokenizer split: "th" + "ink" in "th ink" stay apart
    assert kimi.token_to_id("think") not in kimi.encode("th ink")
    sep = "<|sep|>" if kimi.family == "k3" else "<|im_middle|>"
    marker = kimi.encode_special(sep)
    assert kimi.decode([*ids, marker]) == text + sep
    assert kimi.decode([*ids, marker], skip_special_tokens=True) == text
    with pytest.raises(InputError, match="outside the vocabulary"):
        kimi.decode([kimi.vocab_size])


def _pair_merge_encoding(texts: list[str]) -> tiktoken.Encoding:
    """Byte ranks, then every character of `texts` as one token, then every adjacent character pair:
    a merge can join any two neighbours, so the ids show exactly where the pre-tokenizer split."""
    ranks = {bytes([b]): b for b in range(256)}

    def add(tok: bytes) -> None:
        ranks.setdefault(tok, len(ranks))

    for t in texts:
        for ch in t:
            raw = ch.encode()
            for k in range(2, len(raw) + 1):
                add(raw[:k])
    for t in texts:
        for c1, c2 in zip(t, t[1:]):
            add((c1 + c2).encode())
    return tiktoken.Encoding("pairs", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens={})


def test_pattern_splits_like_the_regex_module():
    """tiktoken's reading of Kimi's pattern (class intersections `&&`, contractions, digit runs) equals
    the `regex` module's (V1 set operations): pieces found by `regex` encode to the same ids."""
    texts = ["th中文ab", "HELLO's World'S Don'T", "12345 x1y22", "a\n\n  b\r\n\tc  ", "ÉCOLE naïve Ǆx", "!!?\n\nok", "漢字かなカナ한국"]
    enc = _pair_merge_encoding(texts)
    for text in texts:
        pieces = regex.findall(KIMI_PATTERN, text, flags=regex.V1)
        assert "".join(pieces) == text
        expected = [i for p in pieces for i in enc.encode_ordinary(p)]
        assert enc.encode_ordinary(text) == expected, (text, pieces)
    # a merge would cross the Han / Latin boundary if `&&[^\p{Han}]` were ignored
    assert len(enc.encode_ordinary("th中")) == 2


def test_split_long_runs():
    assert split_long_runs("ab  cd", 3) == ["ab  cd"]
    assert split_long_runs("abcdefg hi", 3) == ["abc", "def", "g hi"]
    assert split_long_runs("a" + " " * 7 + "b", 3) == ["a   ", "   ", " b"]
    text = "x" * 60_000 + " y"
    assert "".join(split_long_runs(text)) == text
    assert [len(p) for p in split_long_runs(text)] == [25_000, 25_000, 10_002]


def test_long_input_is_pieced(kimi):
    text = ("word " * 20_000) + "z" * 30_000
    ids = kimi.encode(text)
    assert kimi.decode(ids) == text


def test_inputs_are_cut_every_400k_characters_before_the_run_split(kimi):
    """As Kimi's tokenization code: text[i:i + 400_000] for each i, then runs over 25,000 characters cut. The
    leading space moves the 25,000-character run cuts off the 400,000 boundary, so the two orders differ."""
    text = " x" + "think" * 100_000
    ids = kimi.encode(text)
    assert ids == kimi.encode(text[:400_000]) + kimi.encode(text[400_000:])
    assert ids != [t for piece in split_long_runs(text) for t in kimi.encode(piece)]
    assert kimi.decode(ids) == text


def test_short_texts_are_encoded_once(kimi, monkeypatch):
    """A chat renders the same short segments (roles, marker names, tool names) in every turn: their ids come from
    the library once per process, as the library gives them, and a caller's list is its own."""
    texts = ["assistant", " tool", "search", "", "x" * SHORT_TEXT_CHARS, "word " * 30]
    want = [kimi._encode_text(t) for t in texts]
    calls = []
    library = kimi._encode_text
    monkeypatch.setattr(kimi, "_encode_text", lambda text: calls.append(text) or library(text))
    assert [kimi.encode(t) for t in texts] == want
    first = list(calls)
    got = kimi.encode("assistant")
    got.append(-1)  # the caller's own list: the remembered ids do not change
    assert [kimi.encode(t) for t in texts] == want
    assert calls == first + ["word " * 30]  # longer than SHORT_TEXT_CHARS: encoded each time


def test_kimi_linear_258_special_ids(tmp_path):
    """Kimi Linear's tokenization_kimi.py builds 256 + 2 special ids: accepted when the config names them."""
    write_synthetic_tokenizer(tmp_path, "k2", 1024)
    base = 256 + len(SYNTHETIC_MERGES)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["added_tokens_decoder"][str(base + 257)] = {"content": "<|extra_257|>", "special": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(tmp_path)
    assert tok.vocab_size == base + 258
    assert tok.encode_special("<|extra_257|>") == base + 257 and tok.token_to_id(f"<|reserved_token_{base + 256}|>") == base + 256
    assert tok.decode([base + 257]) == "<|extra_257|>"
    cfg["added_tokens_decoder"][str(base + 258)] = {"content": "<|too_far|>", "special": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match=rf"outside the special range \[{base}, {base + 258}\)"):
        load_tokenizer(tmp_path)


def test_tokenizer_json_checkpoint(tmp_path):
    """Other checkpoints: a Hugging Face tokenizer.json, with its special tokens kept as text in `encode`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {chr(c): i for i, c in enumerate(range(32, 127))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken("<|im_end|>", special=True, normalized=False)])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    loaded = load_tokenizer(tmp_path)
    end = loaded.encode_special("<|im_end|>")
    assert end == len(vocab) and loaded.eos_token_ids == {end}
    assert loaded.family is None
    ids = loaded.encode("hi<|im_end|>")
    assert end not in ids and loaded.decode(ids) == "hi<|im_end|>"
    assert loaded.decode([*loaded.encode("hi"), end]) == "hi<|im_end|>"


def test_bad_files(tmp_path):
    (tmp_path / "tiktoken.model").write_text("!!notbase64 0\n")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(InputError, match="tiktoken.model:1: not a"):
        load_tokenizer(tmp_path)
    (tmp_path / "tiktoken.model").write_text(f"{base64.b64encode(b'a').decode()} 0\n{base64.b64encode(b'b').decode()} 2\n")
    with pytest.raises(InputError, match="without gaps"):
        load_tokenizer(tmp_path)
    (tmp_path / "tiktoken.model").write_text(f"{base64.b64encode(b'a').decode()} 0\n")
    (tmp_path / "tokenizer_config.json").write_text('{"added_tokens_decoder": {"0": {"content": "x"}}}')
    with pytest.raises(InputError, match="outside the special range"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{nope")
    with pytest.raises(InputError, match="not valid JSON"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()
    with pytest.raises(InputError, match="needs tokenizer_config.json"):
        load_tokenizer(tmp_path)


def test_incremental_decoder(kimi):
    text = "a中🙂 b"
    ids = [b for b in text.encode()]  # one byte token per byte: characters split across tokens
    sep = kimi.encode_special("[EOS]")
    dec = kimi.incremental_decoder()
    pieces = [dec.push([i]) for i in [*ids, sep, *b"x"]]
    assert "".join(pieces) + dec.flush() == text + "[EOS]x"
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[1:4] == ["", "", "中"]
    dec.push(["中".encode()[0]])
    assert dec.flush() == "\ufffd"


def test_incremental_decoder_equals_whole_decode_on_random_ids(kimi):
    """Any ids (invalid UTF-8, split characters, special tokens), pushed in any grouping: the pieces join to
    exactly `decode` of all of them."""
    import random

    rng = random.Random(0)
    pool = [*"é€🙂中".encode(), 0x80, 0xFF, 0xC3, *range(97, 100), *range(256, 262), kimi.encode_special("[EOS]")]
    for _ in range(300):
        ids = [rng.choice(pool) for _ in range(rng.randint(0, 24))]
        dec, text, k = kimi.incremental_decoder(), "", 0
        while k < len(ids):
            n = rng.randint(1, 3)
            text += dec.push(ids[k:k + n])
            k += n
        assert text + dec.flush() == kimi.decode(ids), ids


def test_incremental_decoder_of_a_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<0xC3>": 0, "<0xA9>": 1, "a": 2, "▁b": 3}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path)
    ids = [2, 0, 1, 3, 0]
    dec = loaded.incremental_decoder()
    pieces = [dec.push([i]) for i in ids]
    assert pieces[1] == "" and pieces[2] == "é"
    assert "".join(pieces) + dec.flush() == loaded.decode(ids) == "aé b\ufffd"
