"""Automatic prefix caching across requests (`runtime.core.prefix_cache`): a request resuming from cached blocks
and a recurrent-state checkpoint gives the same greedy tokens and logits (up to float32 reordering) as a full re-prefill of the same
prompt on an engine of its own (the oracle), for K3 (with and without the DSA indexer) and Kimi Linear: prefixes
ending mid-block, exactly at a block boundary, sharing only part of a block, repeated prompts, the divergence
checkpoint, requests sharing a prefix in the same step, eviction then re-use, and under mpiexec (tp 2); exact-position
checkpoints where an agent's next prompt departs (`Request.turn_points`): resumed by copy-on-write of their partial
block (several requests at once, the block's writer still running; under mpiexec too), prefill steps ending only at
the checkpoint targets, and their eviction by session."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from fp32_reorder import num_layers, reorder_atol
from test_runtime_scheduler import MPI_SCRIPT, mpiexec
from test_runtime_sessions import Recorder, assert_same, run

from moe_export.export.convert.checkpoint import load_model
from moe_export.runtime.core.blocks import BlockAllocator
from moe_export.runtime.core.prefix_cache import PartialCheckpoint, PrefixCache, block_hashes, partial_name
from moe_export.runtime.core.engine_core import EngineCore
from moe_export.runtime.core.scheduler import Request
from moe_export.runtime.engine import open_engine
from moe_export.runtime.engine.ort import Engine
from moe_export.runtime.engine.reference import ReferenceEngine
from moe_export.runtime.sampling import SamplingParams

BS = 16  # the runtime_engine fixture's block size; its max_num_tokens 64 makes the checkpoint interval 64
rng = np.random.default_rng(7)
BASE = rng.integers(10, 500, 100).tolist()


def tail(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, 500, n).tolist()


def oracle(eng: Engine, prompt: list[int], n: int) -> tuple[list[int], Recorder]:
    """Greedy tokens and logits of a full prefill (no cache of any kind)."""
    tokens, rec, cached = run(EngineCore(eng, keep_sessions=False, prefix_caching=False), "oracle", prompt, n)
    assert cached == 0
    return tokens, rec


def check(sched: EngineCore, fresh: Engine, rid: str, prompt: list[int], want_cached: int, n: int = 5) -> None:
    got, rec, cached = run(sched, rid, prompt, n)
    assert cached == want_cached, rid
    want, frec = oracle(fresh, prompt, n)
    assert got == want, rid
    assert_same(rec, frec, fresh)


@pytest.mark.parametrize("preset", ["tiny-k3", "tiny-k3-dsa", "tiny-kimi-linear"])
def test_cached_prefixes_equal_full_prefill(runtime_engine, preset):
    engine_dir = runtime_engine(preset, 2, 2, 4)
    eng, fresh = Engine(engine_dir, threads=1), Engine(engine_dir, num_slots=1, threads=1)
    assert eng.checkpoint_interval == 64
    sched = EngineCore(eng, keep_sessions=False)
    a = BASE[:70] + tail(20, 1)  # 90 tokens: checkpoints at 64 (interval) and 80 (its last block boundary)
    check(sched, fresh, "a", a, 0)
    check(sched, fresh, "mid-block", BASE[:70] + tail(25, 2), 64)  # shares 70 tokens: resumes at 64
    check(sched, fresh, "boundary", BASE[:64] + tail(30, 3), 64)  # shares exactly 4 blocks
    check(sched, fresh, "part-of-a-block", BASE[:10] + tail(40, 4), 0)  # a partial block is never shared
    check(sched, fresh, "repeat", a, 80)  # the same prompt: from its last block boundary, its last token fed
    # 40 shared tokens: blocks [0, 32) are cached without a checkpoint at 32, so a full prefill that checkpoints
    # its divergence point; the next prompt sharing them resumes there
    check(sched, fresh, "diverge", BASE[:40] + tail(30, 5), 0)
    check(sched, fresh, "after-diverge", BASE[:40] + tail(30, 6), 32)
    s = sched.stats()
    assert s["prefix_hit_tokens"] == 64 + 64 + 80 + 32 and s["prefix_queried_tokens"] > s["prefix_hit_tokens"]


@pytest.mark.parametrize("preset", ["tiny-k3", "tiny-kimi-linear"])
def test_requests_sharing_a_prefix_in_the_same_step(runtime_engine, preset):
    """Two misses sharing a prefix admitted together (both prefill it, the second's blocks stay private), then
    two hits restoring the same checkpoint in one step."""
    engine_dir = runtime_engine(preset, 2, 2, 4)
    eng, fresh = Engine(engine_dir, threads=1), Engine(engine_dir, num_slots=1, threads=1)
    sched = EngineCore(eng, keep_sessions=False)
    for wave, (shared, want_cached) in enumerate([(BASE[:50], 0), (BASE[:50], 48)]):
        prompts = {f"w{wave}-{i}": shared + tail(12 + i, 10 * wave + i) for i in range(2)}
        recs = {rid: Recorder() for rid in prompts}
        for rid, p in prompts.items():
            sched.add(Request(rid, p, SamplingParams(max_tokens=4, ignore_eos=True), [recs[rid]]))
        got = {rid: [] for rid in prompts}
        cached = dict.fromkeys(prompts, 0)
        first = True
        while sched.has_work:
            updates = sched.step()
            if first:
                assert len(sched.scheduler.running) == 2  # both in the first step
                first = False
            for u in updates:
                got[u.request_id] += u.token_ids
                cached[u.request_id] = max(cached[u.request_id], u.cached_tokens)
        for rid, p in prompts.items():
            assert cached[rid] == want_cached, rid
            want, frec = oracle(fresh, p, 4)
            assert got[rid] == want, rid
            assert_same(recs[rid], frec, fresh)


def test_eviction_then_reuse(runtime_engine):
    """A small pool: admitting a long prompt evicts the cached blocks nobody holds; a one-entry checkpoint pool
    keeps the most recent checkpoint only. Results stay equal to a full prefill."""
    engine_dir = runtime_engine("tiny-k3", 2, 2, 4)
    eng = Engine(engine_dir, num_slots=2, num_blocks=12, num_checkpoints=1, threads=1)
    fresh = Engine(engine_dir, num_slots=1, threads=1)
    sched = EngineCore(eng, keep_sessions=False)
    a = BASE[:70] + tail(4, 20)  # 74 tokens + 4: 5 blocks; checkpoint 64 only (the last boundary)
    check(sched, fresh, "a", a, 0, n=4)
    assert sched.stats()["prefix_cached_blocks"] == 4 and sched.stats()["prefix_checkpoints"] == 1
    check(sched, fresh, "a-hit", BASE[:70] + tail(6, 21), 64, n=4)
    # 12 blocks: this prompt needs 11, so a's cached blocks (nobody else holds them) are evicted
    long = tail(170, 22)
    check(sched, fresh, "long", long, 0, n=4)
    assert sched.stats()["prefix_checkpoints"] == 1  # the one entry now holds long's last checkpoint
    check(sched, fresh, "a-again", a, 0, n=4)  # evicted: a full prefill, checkpointing again
    check(sched, fresh, "a-reused", BASE[:70] + tail(6, 23), 64, n=4)


def run_turn(sched: EngineCore, rid: str, prompt: list[int], n: int, points: tuple[int, ...]) -> tuple[list[int], Recorder, int]:
    """`run` (this request's tokens only) with the prompt's `Request.turn_points`."""
    rec = Recorder()
    sched.add(Request(rid, prompt, SamplingParams(max_tokens=n, ignore_eos=True), [rec], turn_points=points))
    tokens, cached = [], 0
    while sched.has_work:
        for u in sched.step():
            if u.request_id == rid:
                tokens += u.token_ids
                cached = max(cached, u.cached_tokens)
    return tokens, rec, cached


@pytest.mark.parametrize("preset", ["tiny-k3", "tiny-kimi-linear"])
def test_required_turns_resume_at_the_exact_divergence(runtime_engine, preset):
    """An agent loop whose prompts end with an instruction after the conversation (K3's `required` tool-choice
    message): each next prompt is the conversation + the previous output + new tokens, so it departs from the
    previous prompt + output at the conversation's end, mid-block. It resumes exactly there (cached tokens = the
    common prefix), from the checkpoint taken at that turn point, writing into that checkpoint's partial block, with
    the tokens and logits of a full prefill; with sessions kept and without."""
    engine_dir = runtime_engine(preset, 2, 2, 4)
    eng, fresh = Engine(engine_dir, threads=1), Engine(engine_dir, num_slots=1, threads=1)
    instruction = tail(7, 40)
    for keep in (True, False):
        sched = EngineCore(eng, keep_sessions=keep)
        conv, common = BASE[:37], 0  # mid-block (BS 16)
        for turn in range(3):
            prompt = conv + instruction
            got, rec, cached = run_turn(sched, f"{keep}-{turn}", prompt, 6, (len(conv), len(prompt)))
            assert cached == common and (cached % BS or not turn), (keep, turn)
            want, frec = oracle(fresh, prompt, 6)
            assert got == want, (keep, turn)
            assert_same(rec, frec, fresh)
            common = len(conv)
            conv = conv + got + tail(11 + 5 * turn, 50 + turn)  # the output, then the tool's answer


@pytest.mark.parametrize("runner", ["onnxruntime", "torch", "reference"])
def test_requests_continuing_one_exact_checkpoint_at_once_copy_its_block(runtime_engine, synthetic_checkpoint, runner):
    """Copy-on-write of an exact-position checkpoint's partial block: while the request that wrote the block still
    runs (it decodes into it), the same follow-up sent twice at once and another departing at the same point all
    resume at the exact checkpoint (not at the block boundary before it), each from a copy of the block, and every
    one of the four, the writer included, has the tokens and logits of a full prefill (ONNX Runtime and torch
    runners; the reference, whose checkpoints hold a slot's whole cache, has no block rows to copy)."""
    if runner == "reference":
        model = load_model(synthetic_checkpoint("tiny-k3"))
        eng, fresh = (ReferenceEngine(model, num_slots=n, max_seq_len=128, max_num_tokens=64, block_size=BS) for n in (4, 1))
        layers = model.cfg.num_layers
    else:
        engine_dir = runtime_engine("tiny-k3", *((2, 2, 4) if runner == "onnxruntime" else (1, 1, 1)), backend=runner)
        eng, fresh = open_engine(engine_dir, threads=1), open_engine(engine_dir, num_slots=1, threads=1)
        layers = num_layers(fresh.model_config)
    assert eng.num_slots >= 4
    sched = EngineCore(eng, keep_sessions=False)
    conv, instruction = BASE[:45], tail(7, 40)  # the divergence at 45: mid-block (BS 16)
    prompts = {"first": conv + instruction, "again-a": conv + tail(9, 61), "again-b": conv + tail(9, 61),
               "other": conv + tail(12, 62)}
    recs = {rid: Recorder() for rid in prompts}
    got = {rid: [] for rid in prompts}
    cached = dict.fromkeys(prompts, 0)

    def step():
        for u in sched.step():
            got[u.request_id] += u.token_ids
            cached[u.request_id] = max(cached[u.request_id], u.cached_tokens)

    sched.add(Request("first", prompts["first"], SamplingParams(max_tokens=30, ignore_eos=True), [recs["first"]],
                      turn_points=(len(conv),)))
    while len(got["first"]) < 2:  # its prompt's chunks end at 45 (the exact checkpoint), 48 and 52; it decodes
        step()
    for rid in ("again-a", "again-b", "other"):
        sched.add(Request(rid, prompts[rid], SamplingParams(max_tokens=4, ignore_eos=True), [recs[rid]]))
    while sched.has_work:
        step()
    assert cached == {"first": 0, "again-a": len(conv), "again-b": len(conv), "other": len(conv)}
    for rid, prompt in prompts.items():
        want, frec = oracle(fresh, prompt, len(got[rid]))
        assert got[rid] == want, rid
        assert len(recs[rid].logits) == len(frec.logits), rid
        for x, y in zip(recs[rid].logits, frec.logits):
            atol = reorder_atol(y.numpy(), layers, fresh.max_seq_len)  # float32 sums in other orders
            np.testing.assert_allclose(x.numpy(), y.numpy(), atol=atol, rtol=0, err_msg=rid)


def test_a_chat_prefill_steps_end_only_at_its_targets(runtime_engine):
    """An agent loop (`required`: conversation + instruction, turn points at the conversation's end and the prompt's
    end): each next prompt resumes at the previous conversation's exact end and its prefill steps end exactly at its
    checkpoint targets: the interval boundary (64) it crosses and its two turn points, never at the block boundary
    before a turn point (the partial block is copied, not replayed), with a full prefill's tokens and logits."""
    engine_dir = runtime_engine("tiny-k3", 2, 2, 4)
    eng, fresh = Engine(engine_dir, threads=1), Engine(engine_dir, num_slots=1, threads=1)
    ends: list[list[int]] = []  # per step: where each of its chunks ends (position after its last token)
    sample = eng.sample

    def counting(batch, sampling):
        ends.append([int(batch.positions[hi - 1]) + 1 for hi in batch.cu_seqlens[1:]])
        return sample(batch, sampling)

    eng.sample = counting
    sched = EngineCore(eng)
    instruction = tail(7, 40)
    conv, resume = BASE[:37], 0
    # the turns' prompts end at 44, 61, 83; their conversations at 37, 54, 76 (mid-block, BS 16)
    for turn, want_ends in enumerate([[37, 44], [54, 61], [64, 76, 83]]):
        prompt = conv + instruction
        ends.clear()
        got, rec, cached = run_turn(sched, str(turn), prompt, 6, (len(conv), len(prompt)))
        assert cached == resume, turn
        assert [e for (e,) in ends if e <= len(prompt)] == want_ends, (turn, ends)
        want, frec = oracle(fresh, prompt, 6)
        assert got == want, turn
        assert_same(rec, frec, fresh)
        resume = len(conv)
        conv = conv + got + tail(11 + 5 * turn, 50 + turn)


def test_a_request_waiting_for_a_slot_keeps_the_exact_checkpoint_it_will_resume_from(runtime_engine):
    """One slot, busy: the next turn of a `required` loop waits (its admission fails at each step) while another
    request decodes. Its exact-position checkpoint at the conversation's end outlives the failed admissions: once
    admitted it resumes there (not at the block boundary before it), with the tokens and logits of a full prefill."""
    engine_dir = runtime_engine("tiny-k3", 2, 2, 4)
    eng, fresh = Engine(engine_dir, num_slots=1, threads=1), Engine(engine_dir, num_slots=1, threads=1)
    sched = EngineCore(eng)
    conv, instruction = BASE[:37], tail(7, 40)  # mid-block (BS 16)
    got, _, _ = run_turn(sched, "t0", conv + instruction, 6, (len(conv), len(conv) + len(instruction)))
    sched.add(Request("other", tail(40, 80), SamplingParams(max_tokens=5, ignore_eos=True)))
    sched.step()  # "other" takes the slot (t0's kept session evicted) and decodes for 4 more steps
    nxt = conv + got + tail(11, 50) + instruction
    got, rec, cached = run_turn(sched, "t1", nxt, 4, (len(nxt) - len(instruction), len(nxt)))
    assert cached == len(conv)
    want, frec = oracle(fresh, nxt, 4)
    assert got == want
    assert_same(rec, frec, fresh)


def test_a_turn_sent_back_otherwise_resumes_at_its_prompt_end(runtime_engine):
    """A client that sends a turn back without its reasoning: the next prompt holds the previous prompt, then other
    tokens than the output. It resumes at exactly the previous prompt's end (mid-block: the checkpoint at that
    turn point), not at the block boundary before it, with the tokens and logits of a full prefill."""
    engine_dir = runtime_engine("tiny-k3", 2, 2, 4)
    eng, fresh = Engine(engine_dir, threads=1), Engine(engine_dir, num_slots=1, threads=1)
    sched = EngineCore(eng)
    first = BASE[:53]
    run_turn(sched, "first", first, 6, (len(first),))
    nxt = first + tail(20, 70)
    got, rec, cached = run_turn(sched, "next", nxt, 4, (len(nxt),))
    assert cached == len(first)
    want, frec = oracle(fresh, nxt, 4)
    assert got == want
    assert_same(rec, frec, fresh)


def test_prefix_cache_lru_and_references():
    alloc = BlockAllocator(6, 4)
    cache = PrefixCache(alloc, num_checkpoints=1, interval=8)
    key = tuple(range(20))
    hashes = block_hashes(key, 4)
    assert len(hashes) == 5 and hashes[:2] == block_hashes(key[:9], 4)  # chained: a prefix's names are the same
    assert block_hashes((9,) + key[1:], 4)[1] != hashes[1]  # ... and depend on every earlier token
    blocks = alloc.allocate(5)
    cache.add_blocks(hashes, blocks)
    assert [alloc.refcount(b) for b in blocks] == [2] * 5
    alloc.decref(blocks)  # the sequence is done: the cache alone holds them
    assert cache.match(hashes, 20)[:3] == (0, [], None)  # no checkpoint: nothing resumable
    c = cache.take_checkpoint()
    cache.add_checkpoint(hashes[1], c)
    resume, shared, checkpoint, matched = cache.match(hashes, 20)
    assert (resume, shared, checkpoint, matched) == (8, blocks[:2], c, 5) and alloc.refcount(blocks[0]) == 2
    assert cache.evict_blocks(5) == 3  # the matched (held) blocks stay; the tail goes first
    assert cache.cached_blocks == 2
    alloc.decref(shared)
    assert cache.evict_blocks(5) == 2 and alloc.free_blocks == 6
    assert cache.take_checkpoint() == c and cache.cached_checkpoints == 0  # the one checkpoint, recycled (LRU)
    # every 8 tokens, the divergence point (9 cached blocks: 36), the last block boundary before token 99 (96)
    assert cache.checkpoint_targets(100, 16, 9) == [24, 32, 36, 40, 48, 56, 64, 72, 80, 88, 96]


def test_checkpoints_are_evicted_by_session_agents_last():
    """A full pool gives up the least recently used checkpoint of a one-turn lineage first, even when agent sessions'
    are older; among agent sessions only, the least recently used session's oldest; never the writer's own while
    others' remain. An exact-position checkpoint holds a reference on its partial block until it goes."""
    alloc = BlockAllocator(4, 4)
    cache = PrefixCache(alloc, num_checkpoints=3, interval=4)
    ids = {}
    for name, lineage, agent in ((b"a1", "a", True), (b"b1", "b", False), (b"a2", "a", True)):
        ids[name] = cache.take_checkpoint()
        cache.add_checkpoint(name, ids[name], lineage, agent=agent)
    assert cache.take_checkpoint() == ids[b"b1"] and not cache.has_checkpoint(b"b1")
    (block,) = alloc.allocate(1)
    tail = np.array([5, 6], dtype=np.int64)
    part = PartialCheckpoint(b"", tail, block)
    alloc.incref([block])  # the checkpoint's reference
    cache.add_checkpoint(partial_name(b"", tail), ids[b"b1"], "c", part, agent=True)
    alloc.decref([block])  # its sequence is done: the checkpoint alone holds the block
    assert alloc.refcount(block) == 1
    cache.touch_session("a")  # a resumed: c is now the least recently used session
    assert cache.take_checkpoint() == ids[b"b1"] and alloc.free_blocks == 4  # c's checkpoint and its block went
    cache.add_checkpoint(b"d1", ids[b"b1"], "d", agent=True)
    assert cache.take_checkpoint("a") == ids[b"b1"]  # a writes: d1 (this id) goes, though a is older
    cache.add_checkpoint(b"d2", ids[b"b1"], "d", agent=True)
    assert cache.take_checkpoint() == ids[b"a1"]  # a is now the least recently used session: its oldest goes
    assert cache.has_checkpoint(b"a2") and cache.has_checkpoint(b"d2")


def test_prefix_caching_under_mpiexec(runtime_engine):
    """mpiexec -n 2 (tp 2): rank 0 plans checkpoint saves / restores, both ranks apply them; requests sharing a
    prefix resume from it and give the tokens of full prefills in one process."""
    engine_dir = runtime_engine("tiny-k3", 2, 2, 2)
    prompts = [BASE[:70] + tail(20, 30), BASE[:70] + tail(9, 31), BASE[:70] + tail(20, 30)]
    spec = [{"prompt": p, "max_tokens": 5} for p in prompts]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PREFIX_CACHING": "1"}
    r = subprocess.run([mpiexec(), "-n", "2", sys.executable, str(MPI_SCRIPT), str(engine_dir), json.dumps(spec)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads([line for line in r.stdout.splitlines() if line.strip()][-1])
    assert got["cached"] == [0, 64, 80]
    fresh = Engine(engine_dir, num_slots=1, threads=1)
    assert got["tokens"] == [oracle(fresh, p, 5)[0] for p in prompts]


def test_exact_checkpoint_copy_on_write_under_mpiexec(runtime_engine):
    """mpiexec -n 2 (tp 2): a turn checkpoints the conversation's exact end (mid-block); the same follow-up sent twice
    at once and another departing there all resume at it, each rank copying the partial block's rows of its own
    shards (`StepPlan.copies`), with the tokens of full prefills in one process."""
    engine_dir = runtime_engine("tiny-k3", 2, 2, 2)
    conv, instruction = BASE[:45], tail(7, 40)
    follow_up = conv + tail(9, 61)
    spec = [{"prompt": conv + instruction, "max_tokens": 5, "turn_points": [len(conv), len(conv) + len(instruction)]},
            {"prompt": follow_up, "max_tokens": 5, "with_next": True},
            {"prompt": follow_up, "max_tokens": 5, "with_next": True},
            {"prompt": conv + tail(12, 62), "max_tokens": 5}]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PREFIX_CACHING": "1"}
    r = subprocess.run([mpiexec(), "-n", "2", sys.executable, str(MPI_SCRIPT), str(engine_dir), json.dumps(spec)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads([line for line in r.stdout.splitlines() if line.strip()][-1])
    assert got["cached"] == [0, len(conv), len(conv), len(conv)]
    fresh = Engine(engine_dir, num_slots=1, threads=1)
    assert got["tokens"] == [oracle(fresh, s["prompt"], 5)[0] for s in spec]


def test_plan_counts_the_checkpoint_pool_the_runner_allocates(runtime_engine):
    """`moe-export plan`'s host memory for prefix-cache checkpoints is what each rank's runner allocates."""
    from moe_export.export.plan.planner import make_plan

    eng = Engine(runtime_engine("tiny-k3", 2, 2, 4), threads=1)
    plan = make_plan(eng.config.recipe, eng.config.model)
    for runner, rank in zip(eng.ranks, plan.per_rank):
        allocated = sum(a.nbytes for a in runner.checkpoints.values())
        assert allocated > 0 and rank.to_dict()["checkpoint_host_bytes"] == allocated * plan.recipe.limits.max_batch // eng.num_slots
