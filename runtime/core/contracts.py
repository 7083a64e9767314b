"""The engine core's contracts: a request and what a step produced for it (`Request`, `SequenceUpdate`), a step's
plan as rank 0 broadcasts it (`StepPlan`, `VisionPlan`), what running a plan returns (`RunnerOutput`), and the
messages rank 0 and the attention-group leaders exchange under mpiexec (`GroupControl`, `GroupReport`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from moe_export.runtime.engine.batch import SequenceChunk
from moe_export.runtime.engine.sampler import SampledTokens
from moe_export.runtime.sampling import LogitsProcessor, SamplingParams


def future_token(row: int) -> int:
    """The input token of a planned-ahead decode row: row `row` of the step in flight's sampled ids (negative, so
    never a token id; filled in by the worker before the step runs)."""
    return -1 - row


@dataclass
class Request:
    """One generation request at token level. `budget`: a ReasoningBudget (observe / forced_token /
    reasoning_tokens) or None."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    logits_processors: list[LogitsProcessor] = field(default_factory=list)
    budget: object | None = None
    images: list = field(default_factory=list)  # runtime.images.PreparedImage of each `<|media_pad|>` run, in order
    # chats: prompt positions where the next turn's prompt may depart from this one, where the recurrent state is
    # checkpointed exactly (`InputProcessor.chat_request`): the end of the conversation before a message K3 renders
    # after it (tool choice, response format), and the end of the prompt (where the model's own tokens begin)
    turn_points: tuple[int, ...] = ()
    # the session the request names (OpenAI `prompt_cache_key` / `user`, Anthropic `metadata.user_id`:
    # `request_options.parse_request_options`): its state checkpoints belong to that session, an agent session
    # from its first request on, evicted last (`core.prefix_cache`); None: an anonymous request
    session: str | None = None


@dataclass
class SequenceUpdate:
    """What one step produced for one request: new token ids (with logprobs when asked), and the end."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float] | None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_text_index: int | None = None  # where a stop string starts in the decoded output text
    # why the engine ended the request (finish_reason "abort"): its sampling row, grammar, logits processor or
    # detokenization failed, or a step it was in failed; the front ends raise `RequestFailed` with it
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens whose state came from a kept session or the prefix cache
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per new token: (id, logprob) of the most likely
    # the output stage's text (the scheduler detokenizes once, for stop strings and output alike; with a
    # text_decoder): the decoded text of token_ids, a stop token left out, at the end the decoder's held rest
    text: str = ""
    text_complete: bool = True  # the output's text so far ends on a whole character (nothing held)


@dataclass
class StepPlan:
    """One engine step as every rank of a group runs it, in order: read `reads` (offloaded state,
    `core.state_offload`), reset `resets` slots, restore (checkpoint, slot) `restores`, copy the cache rows of
    (source, destination) blocks `copies` (all read, then all written: copy-on-write of an exact-position checkpoint's
    partial block, `core.prefix_cache`), write `loads` (state brought back from the offload store), run `chunks`
    (none: an idle step of a dp-layout group), then save (slot, checkpoint) `saves`. Rank 0 broadcasts it under
    mpiexec; in one process the runner gets the scheduler's own chunk objects."""

    resets: list[int] = field(default_factory=list)
    restores: list[tuple[int, int]] = field(default_factory=list)
    chunks: list[SequenceChunk] = field(default_factory=list)
    saves: list[tuple[int, int]] = field(default_factory=list)
    reads: list = field(default_factory=list)  # state_offload.StateRead
    loads: list = field(default_factory=list)  # state_offload.StateLoad
    copies: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class VisionPlan:
    """One vision-tower call: (pixel_values [patches, C*P*P], (t, h, w) grid) of each image, packed."""

    images: list[tuple[np.ndarray, list[int]]]


@dataclass
class RunnerOutput:
    """What running a plan returned on this rank: a step's sampled tokens (rank 0 of a step with sampled rows;
    None on followers and for idle steps), or a tower call's embeddings [tokens_i, hidden] per image."""

    sampled: SampledTokens | None = None
    image_embeds: list[np.ndarray] | None = None
    reads: list[dict[str, np.ndarray]] | None = None  # the rows of the plan's `reads`, in order


@dataclass
class BudgetSpec:
    """What a group leader needs to rebuild a request's fresh `ReasoningBudget`."""

    family: str
    cap: int | None
    starts_in_reasoning: bool


@dataclass
class GrammarSpec:
    """What a group leader needs to rebuild a request's fresh grammar processor (`core.structured`) with its own
    vocabulary: the structural tag as lowered for the engine's grammar vocabulary (JSON text,
    `GrammarVocab.lower`)."""

    tag_json: str


@dataclass
class RemoteRequest:
    """A request rank 0 places in another attention group (its logits processors travel as grammar specs only:
    see `wide_ep`)."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    budget: BudgetSpec | None
    images: list
    turn_points: tuple[int, ...] = ()
    session: str | None = None
    warm: bool = False  # a warm turn (`Scheduler.add_warm`), not a request
    grammars: list[GrammarSpec] = field(default_factory=list)  # its logits processors, in order


@dataclass
class GroupControl:
    """Rank 0 -> one group's leader, once per world step: requests to add and request ids to abort."""

    add: list[RemoteRequest] = field(default_factory=list)
    abort: list[str] = field(default_factory=list)


@dataclass
class GroupReport:
    """A group's leader -> rank 0 after each world step: its updates, whether it has work left, its scheduler
    stats and the group's per-expert routed token counts of the step [MoE layers, experts]."""

    updates: list[SequenceUpdate]
    has_work: bool
    stats: dict
    expert_tokens: np.ndarray
