"""The one request parser: a request's options (JSON values) -> its `SamplingParams` over the engine's defaults plus
the chat path's keyword arguments. The server (`entrypoints/server/service.py`, after its pydantic bodies), the
Triton model (`sampling_parameters`), eval and batch's document tasks all build their requests' sampling here.

The sampling options are the fields of `SamplingParams`, by name, with the JSON types their annotations admit
(`SAMPLING_OPTIONS`): a field added to SamplingParams is an option of every front end without a change here.
The session a request names (`SESSION_KEYS`) becomes `RequestOptions.session` (`Request.session`: the prefix
cache keeps its state checkpoints as an agent session's)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from moe_export.common.errors import InputError
from moe_export.runtime.sampling import SamplingParams, SamplingValueError, with_defaults

# SamplingParams annotation -> the JSON types its option accepts
JSON_TYPES: dict[str, tuple[type, ...]] = {
    "float": (int, float),
    "int": (int,),
    "int | None": (int,),
    "bool": (bool,),
    "tuple[str, ...]": (str, list),
    "tuple[int, ...]": (list,),
    "tuple[tuple[int, float], ...]": (dict,),
}
SAMPLING_OPTIONS: dict[str, tuple[type, ...]] = {f.name: JSON_TYPES[f.type] for f in fields(SamplingParams)}
"""Every SamplingParams field -> the JSON types its option accepts."""
CHAT_KEYS = ("reasoning_effort", "tools", "tool_choice", "response_format")
# the session a request names, the first one given: OpenAI's `prompt_cache_key` (chat completions, Responses), else
# its `user` (the end user's id, which `prompt_cache_key` replaces for caching; legacy completions have only `user`;
# Anthropic's `metadata.user_id` is passed as `user`)
SESSION_KEYS = ("prompt_cache_key", "user")
MAX_SESSION_CHARS = 256  # Anthropic's bound on metadata.user_id


def options_of_type(annotation: str) -> tuple[str, ...]:
    """The sampling options whose SamplingParams field is annotated `annotation` ("float", "int", "bool")."""
    return tuple(f.name for f in fields(SamplingParams) if f.type.split(" |")[0] == annotation)


@dataclass
class RequestOptions:
    """What one request asks for: sampling (a SamplingParams), the chat path's keyword arguments and the session it
    names (None: anonymous)."""

    sampling: SamplingParams
    chat_kwargs: dict[str, Any] = field(default_factory=dict)
    session: str | None = None


def _option(key: str, value, types: tuple[type, ...]):
    """One option's value checked against its JSON types and put in SamplingParams' form (SamplingValueError
    naming the option otherwise)."""
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise SamplingValueError(key, f"must be {' or '.join(t.__name__ for t in types)}, got {value!r}")
    if key == "stop":
        value = (value,) if isinstance(value, str) else value
        if not all(isinstance(s, str) and s for s in value):
            raise SamplingValueError(key, f"must be a non-empty string or a list of them, got {value!r}")
        return tuple(value)
    if key == "stop_token_ids":
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
            raise SamplingValueError(key, f"must be a list of token ids, got {value!r}")
        return tuple(value)
    if key == "top_k" and value == -1:  # vLLM's and OpenAI-compatible servers' "no top-k"
        return 0
    if key == "max_tokens" and value < 1:
        raise SamplingValueError(key, f"must be >= 1, got {value}")
    return float(value) if float in types else value


def parse_request_options(options: dict[str, Any], defaults: SamplingParams, *, where: str | None = None,
                          ignored: tuple[str, ...] = (), excluded: tuple[str, ...] = ()) -> RequestOptions:
    """`options`: a JSON object of sampling options (`SAMPLING_OPTIONS` but `excluded`: what this front end does
    not serve), CHAT_KEYS and SESSION_KEYS (a non-empty string of at most MAX_SESSION_CHARS characters); a None
    value leaves the engine's default (`defaults`: `LLM.default_sampling`). Keys in `ignored` are dropped; any
    other key, or a bad value, raises InputError naming it, after `where` when given (e.g. 'sampling_parameters');
    without `where` a bad value raises `SamplingValueError` (its `field` names the option)."""
    prefix = f"{where}: " if where else ""
    if not isinstance(options, dict):
        raise InputError(f"{prefix}expected a JSON object, got {type(options).__name__}")
    served = {k: t for k, t in SAMPLING_OPTIONS.items() if k not in excluded and k not in ignored}
    known = (*CHAT_KEYS, *SESSION_KEYS)
    unknown = sorted(k for k in options if k not in served and k not in known and k not in ignored)
    if unknown:
        raise InputError(f"{prefix}unsupported field(s) {', '.join(unknown)}; supported: "
                         f"{', '.join(sorted([*served, *known]))}")
    chat = {k: options[k] for k in CHAT_KEYS if options.get(k) is not None}
    if "reasoning_effort" in chat and not isinstance(chat["reasoning_effort"], (str, int)):
        raise InputError(f"{prefix}reasoning_effort must be low, high, max, none or a token count")
    if "tools" in chat and not isinstance(chat["tools"], list):
        raise InputError(f"{prefix}tools must be a list of tool declarations")
    try:
        given = {k: _option(k, options[k], types) for k, types in served.items() if options.get(k) is not None}
        sampling = with_defaults(defaults, **given)
        sessions = [_session(k, options[k]) for k in SESSION_KEYS if options.get(k) is not None]
    except InputError as exc:  # (a SamplingValueError names its option: `field`)
        if not where:
            raise
        raise InputError(f"{prefix}{exc}") from None
    return RequestOptions(sampling, chat, sessions[0] if sessions else None)


def _session(key: str, value) -> str:
    """A session key checked (SamplingValueError naming the option otherwise)."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_SESSION_CHARS:
        raise SamplingValueError(key, f"must be a string of 1 to {MAX_SESSION_CHARS} characters, got {value!r:.80}")
    return value
