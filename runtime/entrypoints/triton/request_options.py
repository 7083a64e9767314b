"""Per-request generation options from JSON (Triton's `sampling_parameters`, OpenAI batch bodies) to
the runtime's `SamplingParams` plus chat keyword arguments, with one clear error per bad field."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moe_export.common.errors import InputError

# JSON key -> (SamplingParams field, accepted JSON types)
SAMPLING_KEYS: dict[str, tuple[str, tuple[type, ...]]] = {
    "temperature": ("temperature", (int, float)),
    "top_p": ("top_p", (int, float)),
    "top_k": ("top_k", (int,)),
    "seed": ("seed", (int,)),
    "max_tokens": ("max_tokens", (int,)),
    "ignore_eos": ("ignore_eos", (bool,)),
    "stop_token_ids": ("stop_token_ids", (list,)),
    "stop": ("stop", (str, list)),
    "presence_penalty": ("presence_penalty", (int, float)),
    "frequency_penalty": ("frequency_penalty", (int, float)),
    "repetition_penalty": ("repetition_penalty", (int, float)),
    "min_p": ("min_p", (int, float)),
    "min_tokens": ("min_tokens", (int,)),
}
FLOAT_FIELDS = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")
CHAT_KEYS = ("reasoning_effort", "tools", "tool_choice", "response_format")


@dataclass
class RequestOptions:
    """What one request asks for: sampling (a SamplingParams) and the chat path's keyword arguments."""

    sampling: Any
    chat_kwargs: dict[str, Any] = field(default_factory=dict)


def parse_request_options(options: dict[str, Any], where: str, *, defaults, ignored: tuple[str, ...] = ()
                          ) -> RequestOptions:
    """`options`: a JSON object of SAMPLING_KEYS and CHAT_KEYS over `defaults` (the engine's
    `LLM.default_sampling`); keys in `ignored` are dropped, any other key raises InputError naming it and `where`
    (e.g. 'sampling_parameters', 'line 3 body')."""
    from moe_export.runtime.sampling import with_defaults

    if not isinstance(options, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(options).__name__}")
    unknown = sorted(k for k in options if k not in SAMPLING_KEYS and k not in CHAT_KEYS and k not in ignored)
    if unknown:
        raise InputError(
            f"{where}: unsupported field(s) {', '.join(unknown)}; supported: "
            f"{', '.join(sorted([*SAMPLING_KEYS, *CHAT_KEYS]))}"
        )
    kwargs: dict[str, Any] = {}
    for key, (name, types) in SAMPLING_KEYS.items():
        value = options.get(key)
        if value is None:
            continue
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise InputError(f"{where}: {key} must be {' or '.join(t.__name__ for t in types)}, got {value!r}")
        if key == "stop":
            value = (value,) if isinstance(value, str) else value
            if not all(isinstance(s, str) and s for s in value):
                raise InputError(f"{where}: stop must be a non-empty string or a list of them, got {value!r}")
            value = tuple(value)
        elif key == "stop_token_ids":
            if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
                raise InputError(f"{where}: stop_token_ids must be a list of token ids, got {value!r}")
            value = tuple(value)
        elif key == "max_tokens" and value < 1:
            raise InputError(f"{where}: max_tokens must be >= 1, got {value}")
        kwargs[name] = float(value) if name in FLOAT_FIELDS else value
    chat = {k: options[k] for k in CHAT_KEYS if options.get(k) is not None}
    if "reasoning_effort" in chat and not isinstance(chat["reasoning_effort"], (str, int)):
        raise InputError(f"{where}: reasoning_effort must be low, high, max, none or a token count")
    if "tools" in chat and not isinstance(chat["tools"], list):
        raise InputError(f"{where}: tools must be a list of tool declarations")
    try:
        sampling = with_defaults(defaults, **kwargs)
    except InputError as exc:
        raise InputError(f"{where}: {exc}") from None
    return RequestOptions(sampling, chat)
