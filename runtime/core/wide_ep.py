"""Data-parallel attention groups at run time (the `dp` layout of `graphs/sharding.py`) under mpiexec.

Roles. World rank 0 holds the API (`LLM`, `AsyncLLM`, `moe-export serve`) and is the first rank of group 0.
The first rank of every attention group (its leader) runs a lockstep `EngineCore` over the group's requests
and broadcasts each step's plan inside the group; the group's other ranks follow those plans
(`execution.follow`: in the dp layout the engine's broadcast reaches the group only).

One world step:
  1. rank 0 sends every leader its new requests and aborts (a broadcast over the leaders);
  2. every leader runs one step of its scheduler, an idle one when its group has nothing to run: every rank
     runs exactly one engine step per world step, so every MoE all-to-all has every rank in it (an idle group
     sends no tokens and computes what the others send its experts), and a group that finishes early holds
     nobody up: it keeps joining with zero tokens;
  3. the leaders' updates (sampled tokens, finishes), scheduler stats and their groups' per-expert token counts of
     the step come back to rank 0 (a gather over the leaders); rank 0's `stats()` sums them over the groups.

Placement (rank 0). A request whose prompt continues the prompt of a request that finished in group g
(a conversation's follow-up turn) goes to g, which keeps that turn's state; otherwise it goes to the group
with the fewest requests waiting or running. A warm turn (`add_warm`: the start of a finished chat's next prompt,
prefilled between turns) goes to the group whose finished prompt shares the longest prefix with it (the group that
ran the turn, which holds the conversation's state), and is remembered as that group's finished prompt, so the next
turn, which continues it, is placed there too and resumes at its end.

What a group's leader rebuilds. A request's thinking budget travels as its spec (`BudgetSpec`), rebuilt by the leader
with its own tokenizer; rank 0 replays the group's tokens into its own copy, so usage counts reasoning tokens. Its
grammar (`core.structured.GrammarLogitsProcessor`: a forced or required tool call, a JSON response format) travels as
its lowered structural tag (`GrammarSpec`): the leader builds its own processor from it with its own grammar
vocabulary (compiled once per distinct tag, in the world step that adds the request) and masks the group's sampling
with it, while rank 0 advances the caller's processor over the group's tokens, over the output before each new token
(the output the leader's processor had seen when it masked that token), so what the server reads from it at the end
(`completed`) is what it reads when the request runs in group 0; constrained requests and their conversations' warm
turns are placed as any other. Penalties, bias and bans are sampling parameters: they travel with the request. Any other
logits processor (a caller's own callable, which cannot be rebuilt elsewhere) keeps its request in group 0, where rank
0 runs it itself; such a turn of a conversation that ran in another group prefills it again in group 0.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import cast

import numpy as np
from moe_export.common.errors import InputError
from moe_export.runtime.core.contracts import (
    BudgetSpec,
    GrammarSpec,
    GroupControl,
    GroupReport,
    RemoteRequest,
    Request,
    SequenceUpdate,
)
from moe_export.runtime.core.engine_core import EngineCore
from moe_export.runtime.core.execution import follow, stop_the_world
from moe_export.runtime.engine.runner import GroupedRunner, ModelRunner

PLACEMENT_HISTORY = 4096  # finished requests' prompts remembered for placing follow-up turns


def budget_spec(budget) -> BudgetSpec | None:
    """What a leader needs to rebuild a request's fresh `ReasoningBudget`."""
    return None if budget is None else BudgetSpec(budget.family, budget.cap, budget.in_reasoning)


def grammar_specs(processors: list) -> list[GrammarSpec] | None:
    """What a leader needs to rebuild a request's logits processors: each one's `GrammarSpec` (grammars:
    `core.structured`), in order; None when one has none (a caller's own processor: it runs in group 0)."""
    specs = [getattr(proc, "spec", None) for proc in processors]
    return specs if all(isinstance(spec, GrammarSpec) for spec in specs) else None


class Placed:
    """Rank 0's record of a request it placed: its group and prompt (remembered for follow-up turns when it
    finishes) and, placed in another group, the budget and grammars rank 0 keeps in step with the group's tokens."""

    def __init__(self, group: int, request: Request) -> None:
        self.group, self.prompt = group, tuple(request.prompt_ids)
        self.budget, self.grammars = request.budget, request.logits_processors
        self.output: list[int] = []

    def observe(self, token_ids: list[int]) -> None:
        """The group's new tokens: the budget sees each, and each grammar the output before each (the leader's copy
        had seen that output when it masked the token: `GrammarLogitsProcessor.fill_bitmask`)."""
        for token in token_ids:
            for grammar in self.grammars:
                grammar.advance(self.output)
            self.output.append(token)
            if self.budget is not None:
                self.budget.observe(token)


class GroupedScheduler:
    """Rank 0's engine core over every attention group (the `EngineCore` interface the LLM front ends use):
    group 0 runs here, the others on their leaders; each `step()` is one world step."""

    def __init__(self, engine: GroupedRunner, **scheduler_kwargs) -> None:
        self.engine = engine
        self.local = EngineCore(engine, lockstep=True, **scheduler_kwargs)
        self.leaders = engine.comm.leaders
        self.groups = engine.dp
        self.loads = [0] * self.groups
        self.group_stats: list[dict] = [{} for _ in range(self.groups)]  # the leaders' latest scheduler stats
        self.remote_work = [False] * self.groups
        self.outbox = [GroupControl() for _ in range(self.groups)]
        self.placed: dict[str, Placed] = {}
        self.history: OrderedDict[tuple[int, ...], int] = OrderedDict()  # finished prompts -> their group
        # tokens routed to each expert per MoE layer over the world: the last world step's and the running total
        self.step_expert_tokens = np.zeros_like(engine.expert_tokens)
        self.expert_tokens = np.zeros_like(engine.expert_tokens)

    def place(self, request: Request) -> int:
        """The group for a request: group 0 when a logits processor of it cannot be rebuilt elsewhere (`grammar_specs`),
        else the one holding its conversation's state, else the least loaded."""
        if grammar_specs(request.logits_processors) is None:
            return 0
        prompt = tuple(request.prompt_ids)
        held = [(len(p), g) for p, g in self.history.items() if len(p) <= len(prompt) and prompt[: len(p)] == p]
        if held:
            return max(held)[1]
        return min(range(self.groups), key=lambda g: (self.loads[g], g))

    def add(self, request: Request) -> None:
        self.local.check(request)
        if request.request_id in self.placed:
            raise InputError(f"request id {request.request_id!r} is already in use")
        group = self.place(request)
        if group == 0:
            self.local.add(request)
        else:
            self.outbox[group].add.append(remote_request(request))
        self.loads[group] += 1
        self.placed[request.request_id] = Placed(group, request)

    def add_warm(self, request: Request) -> None:
        """A warm turn (`Scheduler.add_warm`: prefill-only, low priority, reports nothing), in the group that ran the
        turn it continues: the one whose finished prompt shares the longest prefix with it (its conversation's state
        is there). Its prompt is remembered as that group's, so the next turn is placed there (`place`). A prompt
        that can never run is ignored."""
        try:
            self.local.check(request)
        except InputError:
            return
        group = self.warm_group(request.prompt_ids)
        if group is None:
            return
        if group == 0:
            self.local.add_warm(request)
        else:
            self.outbox[group].add.append(remote_request(request, warm=True))
        self.remember(tuple(request.prompt_ids), group)

    def warm_group(self, prompt_ids: list[int]) -> int | None:
        """The group whose finished prompt shares the longest prefix with `prompt_ids` (the latest on a tie); None
        when no finished prompt shares a token with it."""
        prompt = np.asarray(prompt_ids)
        best, group = 0, None
        for held, g in reversed(self.history.items()):
            n = min(len(held), len(prompt))
            differ = np.flatnonzero(np.asarray(held[:n]) != prompt[:n])
            shared = int(differ[0]) if differ.size else n
            if shared > best:
                best, group = shared, g
        return group

    def remember(self, prompt: tuple[int, ...], group: int) -> None:
        """`prompt` finished in (or was prefilled ahead in) `group`: follow-up turns continuing it go there."""
        self.history[prompt] = group
        self.history.move_to_end(prompt)
        while len(self.history) > PLACEMENT_HISTORY:
            self.history.popitem(last=False)

    def abort(self, request_id: str) -> bool:
        if request_id not in self.placed:
            return False
        group = self.placed[request_id].group
        if group == 0:
            return self.local.abort(request_id)
        self.outbox[group].abort.append(request_id)
        return True

    @property
    def has_work(self) -> bool:
        return (self.local.has_work or any(self.remote_work)
                or any(box.add or box.abort for box in self.outbox))

    def group_of(self, request_id: str) -> int | None:
        entry = self.placed.get(request_id)
        return None if entry is None else entry.group

    def step(self) -> list[SequenceUpdate]:
        """One world step: requests out to the leaders, one engine step everywhere, updates back."""
        control, self.outbox = self.outbox, [GroupControl() for _ in range(self.groups)]
        try:
            self.leaders.bcast(control, root=0)
            updates = self.local.step()
            reports: list[GroupReport] = self.leaders.gather(None, root=0)
        except BaseException as exc:
            stop_the_world(self.engine, exc)
            raise
        self.loads[0] = self.local.load
        self.step_expert_tokens = self.engine.group_step_expert_tokens.copy()
        for group, report in enumerate(reports[1:], start=1):
            self.remote_work[group], self.group_stats[group] = report.has_work, report.stats
            self.loads[group] = report.stats["waiting"] + report.stats["running"]
            self.step_expert_tokens += report.expert_tokens
            for u in report.updates:
                if u.request_id in self.placed:
                    self.placed[u.request_id].observe(u.token_ids)
            updates.extend(report.updates)
        self.expert_tokens += self.step_expert_tokens
        for u in updates:
            if u.finished and u.request_id in self.placed:
                entry = self.placed.pop(u.request_id)
                if u.finish_reason != "abort":
                    self.remember(entry.prompt, entry.group)
        return updates

    def stats(self) -> dict:
        out = self.local.stats()
        for stats in self.group_stats[1:]:  # every group's queue, slots, blocks and reuse, summed
            for key, value in stats.items():
                out[key] = out.get(key, 0) + value
        out["group_loads"] = list(self.loads)
        out["groups"] = self.groups
        out["expert_load"] = expert_load_summary(self.expert_tokens)
        return out

    def shutdown(self) -> None:
        """Release every rank: the leaders (and through them their groups), then group 0's followers."""
        release_ranks(self.engine)


def remote_request(request: Request, warm: bool = False) -> RemoteRequest:
    """What a group's leader needs to add `request` (`warm`: as a warm turn; placed there, every logits processor of
    it has a grammar spec)."""
    return RemoteRequest(request.request_id, list(request.prompt_ids), request.sampling, budget_spec(request.budget),
                         list(request.images), request.turn_points, request.session, warm,
                         grammar_specs(request.logits_processors) or [])


def expert_load_summary(tokens: np.ndarray) -> dict:
    """Routed tokens (top-k choices) so far and, per MoE layer, the busiest expert's count over the mean: the
    imbalance a redundant-expert placement (EPLB) would even out."""
    mean = tokens.mean(axis=1) if tokens.size else np.zeros(0)
    ratio = np.divide(tokens.max(axis=1, initial=0), mean, out=np.zeros_like(mean, dtype=float), where=mean > 0)
    return {"routed": int(tokens.sum()), "max_over_mean": [round(float(v), 4) for v in ratio]}


def lead_group(engine: GroupedRunner, budget_factory=None, grammar_factory=None, **scheduler_kwargs) -> int:
    """A group leader other than world rank 0: run its group's requests in world steps until rank 0 shuts
    down; returns the number of steps run. `budget_factory(spec)` rebuilds a request's thinking budget,
    `grammar_factory(spec)` its grammar processors (given wherever rank 0 may send grammars: `LLM.run_follower`)."""
    sched = EngineCore(engine, lockstep=True, **scheduler_kwargs)
    leaders, steps = engine.comm.leaders, 0
    while True:
        try:
            control: list[GroupControl] | None = leaders.bcast(None, root=0)
            if control is None:
                sched.shutdown()
                return steps
            mine = control[engine.group]
            rejected = []
            for r in mine.add:
                budget = budget_factory(r.budget) if r.budget is not None and budget_factory is not None else None
                if r.warm:  # reports nothing, rejected or not
                    sched.add_warm(Request(r.request_id, r.prompt_ids, r.sampling, [], budget, r.images, r.turn_points,
                                           r.session))
                    continue
                try:
                    processors = [grammar_factory(spec) for spec in r.grammars]
                    sched.add(Request(r.request_id, r.prompt_ids, r.sampling, processors, budget, r.images,
                                      r.turn_points, r.session))
                except InputError as exc:  # rank 0 checked and compiled it with the same limits; kept as a safety net
                    rejected.append(SequenceUpdate(r.request_id, [], None, True, "abort", error=str(exc)))
            for rid in mine.abort:
                sched.abort(rid)
            updates = rejected + sched.step()
            leaders.gather(GroupReport(updates, sched.has_work, sched.stats(), engine.group_step_expert_tokens), root=0)
        except BaseException as exc:
            stop_the_world(engine, exc)
            raise
        steps += 1


def is_grouped(engine: ModelRunner) -> bool:
    """A dp-layout engine under mpiexec (a `GroupedRunner`): its attention groups run their own requests."""
    return engine.dp_layout and engine.comm is not None


def open_engine_core(engine: ModelRunner, **core_kwargs) -> EngineCore | GroupedScheduler:
    """Rank 0's engine core: `GroupedScheduler` for a dp-layout engine under mpiexec, else an `EngineCore`."""
    if is_grouped(engine):
        return GroupedScheduler(cast(GroupedRunner, engine), **core_kwargs)
    return EngineCore(engine, **core_kwargs)


def release_ranks(engine: ModelRunner) -> None:
    """World rank 0: let every other rank leave `run_rank` (the leaders, which release their groups, then
    group 0's followers; without groups, the followers)."""
    if is_grouped(engine):
        engine.comm.leaders.bcast(None, root=0)
    engine.comm.broadcast(None)


def run_rank(engine: ModelRunner, budget_factory=None, grammar_factory=None, **scheduler_kwargs) -> int:
    """A rank other than world rank 0: lead its group (dp layout, first rank of a group) or follow its
    leader's plans, until rank 0 shuts down; returns the number of steps run."""
    if is_grouped(engine) and engine.comm.leaders is not None:
        return lead_group(cast(GroupedRunner, engine), budget_factory, grammar_factory, **scheduler_kwargs)
    return follow(engine, scheduler_kwargs.get("offload"))
