"""The project's one tokenizer loader: Kimi `tiktoken.model` tokenizers, and `tokenizer.json` for others.

Kimi checkpoints (K2, Kimi Linear, K3) ship `tiktoken.model` (one `base64(token bytes) rank` per line)
and `tokenizer_config.json` (`added_tokens_decoder`: id -> {content, special}). We build a
`tiktoken.Encoding` from them with Kimi's pre-tokenizer pattern; the 256 special ids follow the last BPE
rank (258 when the config names either of the two more that Kimi Linear's tokenizer code adds), named from
`added_tokens_decoder`, unnamed ones `<|reserved_token_{id}|>`. The checkpoint's `tokenization_kimi.py` is
never executed. A checkpoint chat template beside the tokenizer is loaded with it (`chat_template`, see
`runtime/formats/template.py`).

`encode(text)` treats every special-token string as ordinary text, so user, tool and document text can
never inject a control token; structural markers are encoded one by one with `encode_special(name)`.
The file names, the special range and the special-token strings come from `moe_export.graphs.tokens`; the
synthetic presets' tokenizer is written by `moe_export.export.convert.synth`.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from functools import cached_property, lru_cache
from pathlib import Path

from moe_export.common.errors import InputError
from moe_export.common.model_config import read_json_object
from moe_export.graphs.tokens import (
    END_OF_MESSAGE,
    FAMILY_MARKERS,
    MAX_RESERVED_SPECIAL,
    NUM_RESERVED_SPECIAL,
    TIKTOKEN_FILE,
    TOKENIZER_CONFIG,
    TOKENIZER_JSON,
)
from moe_export.runtime.formats.template import ChatTemplate, load_chat_template

# Kimi's pre-tokenizer (the same in K2, Kimi Linear and K3); `&&` is a class intersection.
KIMI_PATTERN = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
# Long inputs are encoded in pieces so the regex never sees a huge run (as Kimi's tokenizer does): cut every
# MAX_ENCODE_CHARS characters, then each piece wherever a whitespace or non-whitespace run passes MAX_RUN_CHARS.
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000
# `Tokenizer.encode` remembers the ids of texts up to SHORT_TEXT_CHARS characters, the SHORT_TEXT_CACHE most recent
SHORT_TEXT_CHARS = 64
SHORT_TEXT_CACHE = 8192


def split_long_runs(text: str, max_run: int = MAX_RUN_CHARS) -> list[str]:
    """Cut `text` so no piece holds more than `max_run` consecutive whitespace or non-whitespace chars.

    A run longer than `max_run` is cut every `max_run` characters from its start; other text is untouched."""
    cuts = [
        m.start() + k
        for m in re.finditer(rf"\s{{{max_run + 1},}}|\S{{{max_run + 1},}}", text)
        for k in range(max_run, len(m.group()), max_run)
    ]
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


class Tokenizer(ABC):
    """Text <-> token ids; `vocab_size` counts every id (specials included). Subclasses set `path`,
    `_specials` (name -> id) and `eos_token_ids`, and encode / decode with their library."""

    path: Path
    _specials: dict[str, int]
    eos_token_ids: set[int]
    chat_template: ChatTemplate | None = None  # the checkpoint's own chat template, if it ships one

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @abstractmethod
    def _token_to_id(self, token: str) -> int | None: ...

    @abstractmethod
    def _encode_text(self, text: str) -> list[int]: ...

    @abstractmethod
    def _decode(self, ids: list[int]) -> str: ...

    @abstractmethod
    def incremental_decoder(self) -> IncrementalDecoder:
        """A fresh streaming decoder (see `IncrementalDecoder`)."""

    @property
    def family(self) -> str | None:
        """"k3" or "k2" from the structural special tokens present, else None."""
        for name, markers in FAMILY_MARKERS.items():
            if all(m in self._specials for m in markers):
                return name
        return None

    @property
    def special_tokens(self) -> dict[str, int]:
        """Special-token name -> id."""
        return dict(self._specials)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def token_to_id(self, token: str) -> int | None:
        """Id of a special token or of a single ordinary token; None if `token` is neither."""
        if token in self._specials:
            return self._specials[token]
        return self._token_to_id(token)

    def encode_special(self, token: str) -> int:
        """Id of the special token named `token` (a structural marker); InputError if it is not one."""
        if token not in self._specials:
            raise InputError(f"{self.path}: {token!r} is not a special token of this tokenizer")
        return self._specials[token]

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` as ordinary text: special-token strings in it are encoded as text. Cut every
        MAX_ENCODE_CHARS characters first, then at long runs, as Kimi's tokenizer code does (a text of at most
        MAX_RUN_CHARS characters has nothing to cut). Texts of at most SHORT_TEXT_CHARS characters (a chat's markers'
        names, roles, tool names: most of a rendered conversation's segments) are encoded once per process."""
        if len(text) <= SHORT_TEXT_CHARS:
            return list(self._encode_short(text))
        if len(text) <= MAX_RUN_CHARS:
            return self._encode_text(text)
        return [
            t
            for start in range(0, len(text), MAX_ENCODE_CHARS)
            for piece in split_long_runs(text[start:start + MAX_ENCODE_CHARS])
            for t in self._encode_text(piece)
        ]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids` (invalid UTF-8 replaced); special tokens by name unless skipped."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise InputError(f"token ids {bad[:8]} are outside the vocabulary [0, {self.vocab_size})")
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_ids]
        return self._decode(ids)

    def visible_text(self, text: str) -> str:
        """Output `text` (decoded with special tokens by name, as the scheduler decodes it) as every entry point
        shows it: without the special-token names (vLLM's skip_special_tokens default), so a sampled reserved,
        padding or media token is not text."""
        if not text or self._special_name_pattern is None:
            return text
        return self._special_name_pattern.sub("", text)

    @cached_property
    def _special_name_pattern(self) -> re.Pattern | None:
        names = sorted(self._specials, key=len, reverse=True)
        return re.compile("|".join(map(re.escape, names))) if names else None

    @cached_property
    def _special_ids(self) -> frozenset[int]:
        return frozenset(self._specials.values())

    @cached_property
    def _encode_short(self) -> Callable[[str], tuple[int, ...]]:
        """`_encode_text` of short texts, remembered (the SHORT_TEXT_CACHE most recently used)."""
        return lru_cache(maxsize=SHORT_TEXT_CACHE)(lambda text: tuple(self._encode_text(text)))


class KimiTokenizer(Tokenizer):
    """A Kimi `tiktoken.model` tokenizer (tiktoken BPE with Kimi's pattern and special-token layout)."""

    def __init__(self, directory: Path) -> None:
        import tiktoken

        self.path = directory
        ranks = read_tiktoken_ranks(directory / TIKTOKEN_FILE)
        if sorted(ranks.values()) != list(range(len(ranks))):
            raise InputError(f"{directory / TIKTOKEN_FILE}: ranks must be 0..{len(ranks) - 1} without gaps")
        config = _read_config(directory)
        base = len(ranks)
        named: dict[int, str] = {}
        for key, entry in config.get("added_tokens_decoder", {}).items():
            tid = int(key)
            if not base <= tid < base + MAX_RESERVED_SPECIAL:
                raise InputError(
                    f"{directory / TOKENIZER_CONFIG}: added token {entry.get('content')!r} has id {tid}, outside the "
                    f"special range [{base}, {base + MAX_RESERVED_SPECIAL}) after the {base} BPE ranks"
                )
            named[tid] = entry["content"]
        self._num_special = MAX_RESERVED_SPECIAL if any(t >= base + NUM_RESERVED_SPECIAL for t in named) else NUM_RESERVED_SPECIAL
        self._specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(base, base + self._num_special)}
        self._num_base = base
        self._ranks = ranks
        self._enc = tiktoken.Encoding(
            name=f"kimi:{directory}", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=self._specials
        )
        self.eos_token_ids = _eos_ids(config, self._specials, self.family)
        self.chat_template = load_chat_template(directory, config, sort_tools=True)

    @property
    def vocab_size(self) -> int:
        return self._num_base + self._num_special

    def _token_to_id(self, token: str) -> int | None:
        return self._ranks.get(token.encode())

    def _encode_text(self, text: str) -> list[int]:
        return self._enc.encode(text, allowed_special=set(), disallowed_special=())

    def _decode(self, ids: list[int]) -> str:
        return self._enc.decode(ids, errors="replace")

    def incremental_decoder(self) -> IncrementalDecoder:
        return _Utf8Decoder(self._enc.decode_bytes)


class JsonTokenizer(Tokenizer):
    """A Hugging Face `tokenizer.json` tokenizer (checkpoints that are not Kimi's tiktoken format)."""

    def __init__(self, directory: Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self.path = directory
        try:
            self._tok = HFTokenizer.from_file(str(directory / TOKENIZER_JSON))
        except Exception as exc:  # the Rust parser raises a bare Exception with the JSON error
            raise InputError(f"{directory / TOKENIZER_JSON}: not a valid tokenizers file ({exc})") from None
        self._tok.encode_special_tokens = True  # special-token strings in text stay text
        self._specials = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        config = _read_config(directory) if (directory / TOKENIZER_CONFIG).is_file() else {}
        self.eos_token_ids = _eos_ids(config, self._specials, self.family)
        self.chat_template = load_chat_template(directory, config, sort_tools=False)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def _token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def _encode_text(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def incremental_decoder(self) -> IncrementalDecoder:
        return _StreamDecoder(self._tok)


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """`base64(token bytes) rank` per line -> {token bytes: rank}; InputError naming the bad line.
    (Parsed here rather than with `tiktoken.load`, which caches files by path in a shared folder.)"""
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise InputError(f"{path}:{n}: not a `base64(token) rank` line: {line[:60]!r}") from None
    return ranks


class IncrementalDecoder(ABC):
    """Streaming detokenizer over one tokenizer: the pieces `push` returns, then `flush()`, join to exactly
    `decode` of every id pushed (special tokens by name), at a cost per call that does not grow with the
    output. Bytes of an unfinished UTF-8 character are held until it completes."""

    @abstractmethod
    def push(self, ids: list[int]) -> str:
        """The text that `ids` complete."""

    @abstractmethod
    def flush(self) -> str:
        """The held rest (an unfinished character decodes as U+FFFD); the decoder then starts afresh."""

    @property
    @abstractmethod
    def holding(self) -> bool:
        """Whether ids of an unfinished character are held (the text pushed so far ends inside one)."""


class _Utf8Decoder(IncrementalDecoder):
    """Byte-level tokenizers: token bytes through Python's incremental UTF-8 decoder (errors replaced), which
    gives the same text as decoding all bytes at once."""

    def __init__(self, token_bytes) -> None:
        self._bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: list[int]) -> str:
        return self._utf8.decode(self._bytes(ids)) if ids else ""

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)

    @property
    def holding(self) -> bool:
        return bool(self._utf8.getstate()[0])


class _StreamDecoder(IncrementalDecoder):
    """`tokenizer.json` tokenizers: the tokenizers library's own `DecodeStream`."""

    def __init__(self, tok) -> None:
        self._tok = tok
        self._restart()

    def _restart(self) -> None:
        from tokenizers.decoders import DecodeStream

        self._stream = DecodeStream(skip_special_tokens=False)
        self._held: list[int] = []  # ids pushed since the stream last returned text

    def push(self, ids: list[int]) -> str:
        pieces = []
        for i in ids:
            self._held.append(i)
            piece = self._stream.step(self._tok, i)
            if piece is not None:
                pieces.append(piece)
                self._held = []
        return "".join(pieces)

    def flush(self) -> str:
        text = self._tok.decode(self._held, skip_special_tokens=False) if self._held else ""
        self._restart()
        return text

    @property
    def holding(self) -> bool:
        return bool(self._held)


def _read_config(directory: Path) -> dict:
    path = directory / TOKENIZER_CONFIG
    if not path.is_file():
        raise InputError(f"{directory}: {TIKTOKEN_FILE} needs {TOKENIZER_CONFIG} beside it (the special tokens)")
    config = read_json_object(path)
    if not isinstance(config.get("added_tokens_decoder", {}), dict):
        raise InputError(f"{path}: expected an object with an `added_tokens_decoder` object")
    return config


def _eos_ids(config: dict, specials: dict[str, int], family: str | None) -> set[int]:
    """The config's `eos_token` plus the family's end-of-message token (generation stops at either)."""
    eos = config.get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    names = {eos, END_OF_MESSAGE.get(family or "")}
    return {specials[n] for n in names if n in specials}


def has_tokenizer(directory: str | Path) -> bool:
    """Whether `directory` holds tokenizer files `load_tokenizer` reads."""
    d = Path(directory)
    return (d / TIKTOKEN_FILE).is_file() or (d / TOKENIZER_JSON).is_file()


def load_tokenizer(directory: str | Path) -> Tokenizer:
    """Load `tiktoken.model` + `tokenizer_config.json` (Kimi), else `tokenizer.json`; InputError if neither."""
    d = Path(directory)
    if (d / TIKTOKEN_FILE).is_file():
        return KimiTokenizer(d)
    if (d / TOKENIZER_JSON).is_file():
        return JsonTokenizer(d)
    raise InputError(f"{d}: no tokenizer ({TIKTOKEN_FILE} + {TOKENIZER_CONFIG}, or {TOKENIZER_JSON})")

