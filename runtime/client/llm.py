"""The Python API's blocking client: `LLM` (offline, the vLLM shape) over a built engine directory
(`client.async_llm.AsyncLLM` is the asyncio one).

Both render chats with the engine's tokenizer family, apply the thinking budget of the request's effort
(`ReasoningBudget`: forced close markers, `reasoning_tokens` in usage), parse the output into reasoning,
content and tool calls, and keep finished turns' state for reuse by the next turn (exact token prefix).
Under mpiexec, rank 0 holds the API and other ranks call `run_follower()`; with a dp-layout engine rank 0 spreads
the requests over the attention groups (`runtime.core.wide_ep`) and returns the outputs in prompt order as usual.
Requests are prepared by `runtime.processor.InputProcessor` and run through `client.request_core.RequestCore`
(the engine core and each request's output stage).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator
from pathlib import Path

from moe_export.common.errors import InputError, RequestFailed
from moe_export.common.model_config import read_generation_config
from moe_export.runtime.client.request_core import ChatOutput, RequestCore, StreamDelta, Tracked
from moe_export.runtime.core.budget import ReasoningBudget
from moe_export.runtime.core.contracts import BudgetSpec
from moe_export.runtime.core.sessions import TurnMemory
from moe_export.runtime.core.state_offload import open_state_offload
from moe_export.runtime.core.wide_ep import is_grouped, run_rank
from moe_export.runtime.engine import engine_eos_ids
from moe_export.runtime.image_urls import fetch_image_url, private_allowed, public_address
from moe_export.runtime.processor import InputProcessor
from moe_export.runtime.sampling import LogitsProcessor, SamplingParams, model_defaults
from moe_export.runtime.tokenizer import load_tokenizer

# `LLM.warm_up`'s request: WARM_UP_CHUNKS full prefill steps (max_num_tokens each: the second one attends to the first
# through the cache pools, as every prefill of a resumed conversation does), then WARM_UP_TAIL tokens (two full blocks
# of 16 and a partial one) and WARM_UP_OUTPUT decode steps under a forced call of WARM_UP_TOOL
WARM_UP_CHUNKS = 2
WARM_UP_TAIL = 40
WARM_UP_OUTPUT = 4
WARM_UP_TOOL = {"type": "function", "function": {"name": "warm_up", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}

OFFLOAD_HOST_BYTES = 1 << 30  # the offload store's host-memory tier
OFFLOAD_DISK_BYTES = 8 << 30  # and its directory on disk (`moe-export serve --offload-gib`)


GenerationOutput = ChatOutput


class LLM:
    """A built engine with its tokenizer and chat family; offline batch API (the vLLM shape).

    default_effort: thinking tier when a chat request gives none (low | high | max | none).
    reuse_sessions: keep finished turns' state for reuse by a continuing prompt, and their tokens, so that a
    turn sent back as text is rendered as generated and the prompt continues the kept state (default on).
    prefix_caching: share cached prompt prefixes across requests (`runtime.core.prefix_cache`; default on).
    warm_turns: when a chat whose next prompt departs from its own finishes (K3's tool-choice message after the
    conversation, e.g. tool_choice "required"), prefill the start of that next prompt (the conversation and this turn)
    in the background, so the next turn prefills only its new messages (`Scheduler.add_warm`; default on; with
    prefix caching and reuse_sessions only).
    overlap: run each model step in a worker thread while the host plans the next step and processes the
    previous step's outputs (`EngineCore(overlap=True)`, see `runtime.core.scheduler`; default on, also under
    mpiexec; not in the dp layout; greedy outputs are the same either way).
    skip_tokenizer_init: open no tokenizer (vLLM's name; for an engine built without tokenizer files): prompts are
    token id lists, outputs carry ids and no text, the stop ids are the engine's; chats and stop strings need one.
    offload_dir: keep the prefix cache's state (blocks, checkpoints, kept sessions) in host memory (at most
    offload_host_bytes) and in this directory (at most offload_disk_bytes) too, so a restarted LLM resumes
    conversations from it (`runtime.core.state_offload`; one process or the tp layout under mpiexec, not
    the dp layout's groups; with prefix caching).
    allow_image_urls: image parts may be http(s) URLs, fetched with a size and time limit from public addresses
    (`runtime.image_urls`; default: data URLs only); allow_private_image_urls: from any address but cloud metadata.

    Failures: a request the engine fails raises `RequestFailed` (the others go on); once the engine core is dead
    (`healthy` False, `fatal_error` the `EngineDead`) every call raises that EngineDead."""

    def __init__(self, engine_dir: str | Path, *, default_effort: str = "max", num_slots: int | None = None,
                 num_blocks: int | None = None, threads: int | None = None, reuse_sessions: bool = True,
                 prefix_caching: bool = True, warm_turns: bool = True, allow_image_urls: bool = False,
                 allow_private_image_urls: bool = False, overlap: bool = True, runner=None, skip_tokenizer_init: bool = False,
                 offload_dir: str | Path | None = None, offload_host_bytes: int = OFFLOAD_HOST_BYTES,
                 offload_disk_bytes: int = OFFLOAD_DISK_BYTES) -> None:
        from moe_export.runtime.engine import open_engine

        # runner: a ModelRunner to drive instead of the engine directory's own (which then provides the tokenizer)
        self.engine = runner or open_engine(engine_dir, num_slots=num_slots, num_blocks=num_blocks, threads=threads)
        self.tokenizer = None if skip_tokenizer_init else load_tokenizer(engine_dir)
        self.family = self.tokenizer.family if self.tokenizer is not None else None
        self.thinking_caps: dict[str, int] = self.engine.config.thinking if self.engine.config is not None else {}
        self.default_effort = default_effort
        tokenizer_eos = self.tokenizer.eos_token_ids if self.tokenizer is not None else ()
        self.eos_token_ids = sorted(set(tokenizer_eos) | set(engine_eos_ids(self.engine)))
        self.reuse_sessions = reuse_sessions
        self.prefix_caching = prefix_caching
        self.warm_turns = warm_turns and prefix_caching and reuse_sessions
        self.overlap = overlap
        # prefix state offloaded to host memory and `offload_dir` (`core.state_offload`; prefix caching on; under
        # mpiexec every rank's own, in the tp layout)
        self.offload = (open_state_offload(self.engine, engine_dir, offload_dir, host_bytes=offload_host_bytes,
                                           disk_bytes=offload_disk_bytes)
                        if offload_dir is not None and prefix_caching and not is_grouped(self.engine) else None)
        # how http(s) image parts are fetched (`runtime.image_urls`: the addresses allowed); None: URLs refused
        self.fetch_image_url = None if not allow_image_urls else functools.partial(
            fetch_image_url, allowed=private_allowed if allow_private_image_urls else public_address)
        # finished turns' tokens, as many as the cache pools hold, so turns sent back as text render as generated
        self.turns = TurnMemory(self.engine.num_blocks * self.engine.block_size) if reuse_sessions else None
        model = self.engine.model_config
        self.vocab_size = int(model.get("vocab_size") or (model.get("text_config") or {}).get("vocab_size") or self.tokenizer.vocab_size)
        # the one set of sampling defaults (requests without their own parameters use it)
        self.default_sampling = model_defaults(read_generation_config(engine_dir))
        self.processor = InputProcessor(self.tokenizer, vision=self.engine.vision, thinking_caps=self.thinking_caps,
                                        default_effort=default_effort, turns=self.turns,
                                        fetch_image_url=self.fetch_image_url, vocab_size=self.vocab_size,
                                        default_sampling=self.default_sampling, engine_dir=engine_dir)
        self._core = (RequestCore(self.engine, self.tokenizer, self.turns, warm_turns=self.warm_turns,
                                  **self.scheduler_kwargs())
                      if self.engine.is_root else None)

    # ---- request preparation (rank 0): the input processor's --------------------------------------

    def prepare_generate(self, prompt: str | list[int], sampling: SamplingParams | None = None,
                         request_id: str | None = None) -> Tracked:
        return self.processor.generate(prompt, sampling, request_id)

    def render_chat(self, messages: list[dict], *, tools=None, reasoning_effort=None, tool_choice=None,
                    response_format=None, add_generation_prompt: bool = True) -> list[int]:
        """The prompt ids of a conversation as a chat request renders it (`InputProcessor.render`)."""
        return self.processor.render(messages, tools=tools, reasoning_effort=reasoning_effort, tool_choice=tool_choice,
                                     response_format=response_format,
                                     add_generation_prompt=add_generation_prompt).prompt_ids

    def prepare_chat(self, messages: list[dict], sampling: SamplingParams | None = None, **kwargs) -> Tracked:
        """A conversation's engine request (`InputProcessor.chat`)."""
        return self.processor.chat(messages, sampling, **kwargs)

    # ---- blocking API ---------------------------------------------------------------------------

    @property
    def fatal_error(self) -> BaseException | None:
        """What killed the engine core (an `EngineDead`), or None while it serves (always None on follower ranks)."""
        return self._core.fatal_error if self._core is not None else None

    @property
    def healthy(self) -> bool:
        """Whether the engine core can serve requests (False once it is dead)."""
        return self.fatal_error is None

    def _root(self) -> RequestCore:
        if self._core is None:
            raise InputError("this is a follower rank under mpiexec: call run_follower(); rank 0 serves requests")
        return self._core

    def _run(self, tracked: list[Tracked], processors: list[LogitsProcessor] | None = None) -> Iterator[StreamDelta]:
        core = self._root()
        pending: set[str] = set()
        try:
            for tr in tracked:
                core.submit(tr, processors)
                pending.add(tr.request_id)
            while pending:
                for delta in core.step():
                    if delta.request_id in pending:
                        if delta.error:
                            pending.discard(delta.request_id)
                            raise RequestFailed(delta.error)
                        if delta.finished:
                            pending.discard(delta.request_id)
                        yield delta
        finally:  # an error, or a consumer that stopped iterating: the rest must not hold slots and blocks
            if core.fatal_error is None:
                for rid in pending:
                    core.abort(rid)
                    core.forget(rid)
                while pending and core.has_work:  # drain the abort notices and any step still in flight
                    core.step()

    def _collect(self, tracked: list[Tracked], processors=None) -> list[ChatOutput]:
        done = {d.request_id: d.output for d in self._run(tracked, processors) if d.finished}
        return [done[tr.request_id] for tr in tracked]

    def generate(self, prompts: list[str | list[int]], sampling: SamplingParams | None = None, *,
                 logits_processors: list[LogitsProcessor] | None = None) -> list[GenerationOutput]:
        """Continue each prompt (text or token ids), all batched together; outputs in prompt order."""
        return self._collect([self.prepare_generate(p, sampling) for p in prompts], logits_processors)

    def chat(self, conversations: list[list[dict]], sampling: SamplingParams | None = None, *, tools=None,
             reasoning_effort=None, tool_choice=None, response_format=None, parallel_tool_calls: bool = True,
             logits_processors: list[LogitsProcessor] | None = None) -> list[ChatOutput]:
        """Answer each conversation (OpenAI message dicts), all batched together."""
        tracked = [self.prepare_chat(c, sampling, tools=tools, reasoning_effort=reasoning_effort, tool_choice=tool_choice,
                                     response_format=response_format, parallel_tool_calls=parallel_tool_calls)
                   for c in conversations]
        return self._collect(tracked, logits_processors)

    def chat_stream(self, messages: list[dict], sampling: SamplingParams | None = None, **kwargs) -> Iterator[StreamDelta]:
        """One conversation's deltas as they are generated (blocking iterator; the terminal uses it)."""
        processors = kwargs.pop("logits_processors", None)
        return self._run([self.prepare_chat(messages, sampling, **kwargs)], processors)

    def stats(self) -> dict:
        return self._root().stats()

    def scheduler_kwargs(self) -> dict:
        """How this LLM's schedulers are set up (rank 0's, and in the dp layout every group leader's)."""
        tok = self.tokenizer
        return {"eos_token_ids": self.eos_token_ids, "text_decoder": tok.incremental_decoder if tok is not None else None,
                "keep_sessions": self.reuse_sessions, "prefix_caching": self.prefix_caching,
                "sample_vocab": tok.vocab_size if tok is not None else None, "overlap": self.overlap,
                "offload": self.offload}

    def _budget(self, spec: BudgetSpec) -> ReasoningBudget:
        return ReasoningBudget(self.tokenizer, spec.family, spec.cap, starts_in_reasoning=spec.starts_in_reasoning)

    def run_follower(self) -> None:
        """Non-root ranks under mpiexec: execute rank 0's steps until it shuts down (dp layout: a group's first
        rank schedules the requests rank 0 sends its group, the others follow it; `runtime.core.wide_ep`)."""
        if self.engine.is_root:
            raise InputError("run_follower() is for non-root ranks; rank 0 serves requests")
        run_rank(self.engine, budget_factory=self._budget, grammar_factory=self.processor.grammar,
                 **self.scheduler_kwargs())

    def warm_up(self) -> int:
        """Run one greedy request through this engine before the first real one (`serve` calls it before /health
        answers), so that no request after a start pays a first-use cost the others do not: WARM_UP_CHUNKS full
        prefill steps and a partial one (the largest step temporaries, grown once in the step thread's heap; ONNX
        Runtime's first run of each session; torch's first sampler and cache-write ops), then WARM_UP_OUTPUT tokens
        constrained by a forced tool call (`_warm_up_grammar`). Returns the engine steps it ran (0 in the dp layout).

        It runs on an engine core of its own (no prefix cache, kept session or offload store: nothing of it is
        remembered) whose steps go through this LLM's own step executor: its worker thread, and under mpiexec its
        broadcast, so every rank runs the same steps as for any request (the followers are in `run_follower`).
        No request may be open meanwhile; the slot and blocks it used are free again and are written before they
        are read by any request (a new sequence resets or loads its slot's state and writes its own positions).
        Not in the dp layout (`runtime.core.wide_ep`): there group leaders schedule their own groups' steps, and a
        core of rank 0's would drive group 0 alone."""
        from moe_export.runtime.core.contracts import Request
        from moe_export.runtime.core.engine_core import EngineCore

        serving = self._root().engine_core
        if not isinstance(serving, EngineCore):
            return 0
        core = EngineCore(self.engine, executor=serving.executor, keep_sessions=False, prefix_caching=False,
                          overlap=False)
        length = min(WARM_UP_CHUNKS * self.engine.max_num_tokens + WARM_UP_TAIL, self.engine.max_seq_len - WARM_UP_OUTPUT)
        tok, pad = self.tokenizer, self.engine.media_pad_id if self.engine.vision is not None else None
        ids = range(1, min(self.vocab_size, tok.vocab_size) if tok is not None else self.vocab_size)
        ordinary = (t for t in itertools.cycle(ids) if t != pad and (tok is None or not tok.is_special(t)))  # text
        prompt = list(itertools.islice(ordinary, length))
        grammar = self._warm_up_grammar()
        core.add(Request("warm-up", prompt, SamplingParams(max_tokens=WARM_UP_OUTPUT, temperature=0.0, ignore_eos=True),
                         [grammar] if grammar is not None else []))
        started = serving.executor.steps
        while core.has_work:
            core.step()
        return serving.executor.steps - started

    def _warm_up_grammar(self) -> LogitsProcessor | None:
        """The grammar of a chat forcing a call of WARM_UP_TOOL (None without a chat family): preparing it renders a
        chat with tools, builds the tokenizer's grammar vocabulary (every token's text, once per process) and runs
        xgrammar's first compile, none of which a request then pays."""
        if self.family is None:
            return None
        forced = {"type": "function", "function": {"name": WARM_UP_TOOL["function"]["name"]}}
        return self.processor.chat([{"role": "user", "content": "warm-up"}], tools=[WARM_UP_TOOL],
                                   tool_choice=forced).grammar

    def shutdown(self) -> None:
        """Rank 0: release the follower ranks (multi-rank); the LLM takes no requests afterwards."""
        if self._core is not None:
            self._core.shutdown()
            self._core = None
