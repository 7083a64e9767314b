"""Byte-level tokenizer for synthetic checkpoints, and a loader for a checkpoint's `tokenizer.json`.

The synthetic tokenizer maps every byte to the token id equal to its value (ids 0..255), so any text
round-trips, followed by the special tokens in `SPECIAL_TOKENS` (ids 256.. in that order).
"""

from __future__ import annotations

import json
from pathlib import Path

from moe_export.export.errors import InputError

BOS, EOS, IM_START, IM_END, THINK, END_THINK, MEDIA, PAD = (
    "[BOS]",
    "[EOS]",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<|kimi_image_placeholder|>",
    "[PAD]",
)
SPECIAL_TOKENS = (BOS, EOS, IM_START, IM_END, THINK, END_THINK, MEDIA, PAD)
NUM_BYTE_TOKENS = 256
# Chat turns end with <|im_end|>, which is therefore the generation stop token (as in Kimi's configs).
STOP_TOKEN = IM_END
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def special_token_ids() -> dict[str, int]:
    """Ids of the synthetic tokenizer's special tokens."""
    return {tok: NUM_BYTE_TOKENS + i for i, tok in enumerate(SPECIAL_TOKENS)}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by the ByteLevel pre-tokenizer."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    return chars


def build_byte_tokenizer():
    """A `tokenizers.Tokenizer`: byte b -> id b, then SPECIAL_TOKENS -> 256, 257, ..."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def write_byte_tokenizer(out_dir: Path, model_max_length: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `out_dir`."""
    tok = build_byte_tokenizer()
    tok.save(str(out_dir / "tokenizer.json"))
    ids = special_token_ids()
    special_map = {"bos_token": BOS, "eos_token": STOP_TOKEN, "pad_token": PAD}
    added = {
        str(ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        **special_map,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2, sort_keys=True) + "\n")


class CheckpointTokenizer:
    """A checkpoint's `tokenizers` tokenizer: text <-> token ids, no special tokens added implicitly."""

    def __init__(self, tokenizer, path: Path) -> None:
        self._tok = tokenizer
        self.path = path

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can emit (including special tokens)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token strings inside `text` map to their ids."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def load_tokenizer(checkpoint_dir: str | Path) -> CheckpointTokenizer:
    """Load `tokenizer.json` from a checkpoint directory; InputError if absent or unreadable."""
    from tokenizers import Tokenizer

    path = Path(checkpoint_dir) / "tokenizer.json"
    if not path.is_file():
        raise InputError(f"{checkpoint_dir}: no tokenizer.json (a Hugging Face `tokenizers` file is required)")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust parser raises a bare Exception with the JSON error
        raise InputError(f"{path}: not a valid tokenizers file ({exc})") from None
    return CheckpointTokenizer(tok, path)
