"""Continuous batching: batched == unbatched (greedy and seeded), admission by blocks and slots, abort,
stop ids / strings, logprobs vs the reference model, logits processors; in process and under mpiexec."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from fp32_reorder import num_layers, reorder_atol
from moe_export.export.convert.checkpoint import load_model
from moe_export.common.errors import InputError
from moe_export.runtime.core.engine_core import EngineCore
from moe_export.runtime.core.scheduler import Request
from moe_export.runtime.engine.ort import Engine
from moe_export.runtime.entrypoints.generate import generate_tokens
from moe_export.runtime.sampling import SamplingParams
from moe_export.runtime.tokenizer import IncrementalDecoder

PROMPTS = [
    [5, 17, 99, 3, 250, 42, 7, 8, 300, 11, 12, 77, 1, 400, 9, 9, 31, 64, 65, 66, 70, 71, 72, 73, 80, 81],
    [200, 201, 3],
    [7] * 40 + [8, 9],
    [11, 12, 13, 14, 15, 16, 17],
    [300, 1, 300, 1, 300, 1, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56],
]
MAX_TOKENS = [9, 14, 6, 11, 8]


def run_all(sched: EngineCore, requests: list[Request], join_late: dict[int, list[Request]] | None = None) -> dict:
    """Drive `sched` to completion; requests in join_late[k] are added before step k. -> id -> (tokens, updates)."""
    out: dict[str, list] = {}
    for r in requests:
        sched.add(r)
    step = 0
    while sched.has_work or (join_late and any(k >= step for k in join_late)):
        for r in (join_late or {}).get(step, []):
            sched.add(r)
        for u in sched.step():
            out.setdefault(u.request_id, []).append(u)
        step += 1
    return {rid: ([t for u in us for t in u.token_ids], us) for rid, us in out.items()}


@pytest.fixture(scope="module")
def engine(runtime_engine):
    return Engine(runtime_engine("tiny-k3", 2, 2, 4), threads=1)


def alone(engine, prompt, params) -> list[int]:
    return generate_tokens(engine, prompt, params)


def test_batched_equals_unbatched_greedy_with_late_joins(engine):
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    want = [alone(engine, p, s) for p, s in zip(PROMPTS, params)]
    sched = EngineCore(engine, keep_sessions=False)
    reqs = [Request(f"r{i}", p, s) for i, (p, s) in enumerate(zip(PROMPTS, params))]
    got = run_all(sched, reqs[:3], join_late={2: [reqs[3]], 5: [reqs[4]]})
    for i, w in enumerate(want):
        tokens, updates = got[f"r{i}"]
        assert tokens == w, f"request {i}"
        assert updates[-1].finished and updates[-1].finish_reason == "length"
    # nothing leaked: the blocks still in use are the prefix cache's alone
    assert sched.scheduler.resources.allocator.used_blocks == sched.stats()["prefix_cached_blocks"] and len(sched.scheduler.resources.free_slots) == engine.num_slots


def test_seeded_sampling_is_per_request(engine):
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=s, max_tokens=7, ignore_eos=True) for s in (1, 2, 1)]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0]]
    want = [alone(engine, p, s) for p, s in zip(prompts, params)]
    got = run_all(EngineCore(engine, keep_sessions=False), [Request(f"s{i}", p, s) for i, (p, s) in enumerate(zip(prompts, params))])
    assert [got[f"s{i}"][0] for i in range(3)] == want
    assert want[0] == want[2] and want[0] != want[1]


def test_admission_is_bounded_by_blocks_and_waits(runtime_engine):
    """A pool of 5 blocks of 16 positions: requests needing 2 blocks each run at most two at a time."""
    eng = Engine(runtime_engine("tiny-k3", 2, 2, 4), num_blocks=5, threads=1)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = [PROMPTS[0][:20], PROMPTS[4][:18], PROMPTS[2][:12], PROMPTS[3] + [1, 2, 3, 4]]
    sched = EngineCore(eng, keep_sessions=False)
    for i, p in enumerate(prompts):
        sched.add(Request(f"b{i}", p, params))
    got: dict[str, list[int]] = {}
    for u in sched.step():
        got.setdefault(u.request_id, []).extend(u.token_ids)
    assert sched.stats()["running"] == 2 and sched.stats()["waiting"] == 2
    seen_blocks = []
    while sched.has_work:
        for u in sched.step():
            got.setdefault(u.request_id, []).extend(u.token_ids)
        seen_blocks.append(sched.scheduler.resources.allocator.used_blocks)
    assert max(seen_blocks) <= 5
    for i, p in enumerate(prompts):
        assert got[f"b{i}"] == alone(eng, p, params)
    with pytest.raises(InputError, match="needs 7 cache blocks; the engine has 5"):
        sched.add(Request("big", PROMPTS[2], SamplingParams(max_tokens=70)))


def test_abort_frees_state_at_once(engine):
    sched = EngineCore(engine, keep_sessions=False)
    sched.add(Request("a", PROMPTS[0], SamplingParams(max_tokens=20)))
    sched.add(Request("b", PROMPTS[1], SamplingParams(max_tokens=20, ignore_eos=True)))
    sched.step()
    used = sched.scheduler.resources.allocator.used_blocks
    assert sched.abort("a")
    assert sched.scheduler.resources.allocator.used_blocks < used and len(sched.scheduler.resources.free_slots) == engine.num_slots - 1
    updates = sched.step()
    assert any(u.request_id == "a" and u.finished and u.finish_reason == "abort" for u in updates)
    assert not sched.abort("a")
    while sched.has_work:
        sched.step()
    assert sched.scheduler.resources.allocator.used_blocks == sched.stats()["prefix_cached_blocks"]  # the prefix cache's alone


def test_stop_ids_stop_strings_and_bad_requests(engine):
    free = alone(engine, PROMPTS[3], SamplingParams(max_tokens=12, ignore_eos=True))
    i = next(i for i in range(1, 12) if free[i] not in free[:i])
    got = run_all(EngineCore(engine), [Request("s", PROMPTS[3], SamplingParams(max_tokens=12, stop_token_ids=(free[i],)))])
    assert got["s"][0] == free[: i + 1] and got["s"][1][-1].finish_reason == "stop"

    class Tags(IncrementalDecoder):  # each id as "<id>"
        def push(self, ids):
            return "".join(f"<{t}>" for t in ids)

        def flush(self):
            return ""

        holding = False

    stop = f"{free[i - 1]}><{free[i]}"
    sched = EngineCore(engine, text_decoder=Tags)
    got = run_all(sched, [Request("t", PROMPTS[3], SamplingParams(max_tokens=12, stop=("never", stop)))])
    last = got["t"][1][-1]
    assert got["t"][0] == free[: i + 1] and last.finish_reason == "stop"
    assert Tags().push(free[: i + 1]).find(stop) == last.stop_text_index

    with pytest.raises(InputError, match="max_seq_len is 1024"):
        sched.add(Request("long", [1] * 1024))
    with pytest.raises(InputError, match="outside the vocabulary"):
        sched.add(Request("oov", [1, 10**7]))
    with pytest.raises(InputError, match="need a tokenizer"):
        EngineCore(engine).add(Request("x", [1], SamplingParams(stop=("a",))))


def test_logprobs_match_the_reference_model(runtime_engine):

    engine_dir = runtime_engine("tiny-k3", 2, 2, 4)
    eng = Engine(engine_dir, threads=1)
    sched = EngineCore(eng)
    got = run_all(sched, [Request("l", PROMPTS[1], SamplingParams(max_tokens=4, logprobs=True, ignore_eos=True))])
    tokens, updates = got["l"]
    logprobs = [lp for u in updates for lp in u.logprobs]
    ref = load_model(next((Path(engine_dir) / ".cache").glob("source-*")))
    seq = PROMPTS[1] + tokens
    want = torch.log_softmax(ref(torch.tensor([seq]))[0], -1)
    # a logprob is a logit less the logsumexp of its row: within twice the logits' float32 reordering bound
    atol = 2 * reorder_atol(ref(torch.tensor([seq]))[0].numpy(), num_layers(eng.model_config), eng.max_seq_len)
    for k, t in enumerate(tokens):
        assert abs(logprobs[k] - float(want[len(PROMPTS[1]) - 1 + k, t])) <= atol


def test_logits_processors(engine):
    free = alone(engine, PROMPTS[1], SamplingParams(max_tokens=6, ignore_eos=True))
    banned = free[2]

    def ban(_ids, logits):
        logits = logits.clone()
        logits[banned] = float("-inf")
        return logits

    def broken(_ids, _logits):
        raise ValueError("grammar exploded")

    sched = EngineCore(engine)
    got = run_all(sched, [Request("ban", PROMPTS[1], SamplingParams(max_tokens=6, ignore_eos=True), [ban]),
                          Request("broken", PROMPTS[3], SamplingParams(max_tokens=6), [broken]),
                          Request("plain", PROMPTS[1], SamplingParams(max_tokens=6, ignore_eos=True))])
    assert banned not in got["ban"][0] and got["ban"][0][:2] == free[:2]
    assert got["plain"][0] == free
    last = got["broken"][1][-1]
    assert last.finish_reason == "abort" and "grammar exploded" in last.error


def test_prefill_chunked_under_a_pair_budget_equals_one_step(runtime_engine):
    """A 200-token prompt and its follow-up turn (kept state + 100 tokens) prefilled in chunks that keep (step tokens)
    x (attended positions) within 4,096 pairs, in steps shared with other requests' decode tokens, give every
    request the logits of one-step prefills run alone within float32 reordering (`reorder_atol`; 4 ranks, fp32 pools, 16-token blocks)."""
    engine_dir = runtime_engine("tiny-k3", 2, 2, 4, max_num_tokens=512)
    assert Engine(engine_dir, threads=1).max_step_pairs is None  # by default: the attention streams over key tiles
    whole = Engine(engine_dir, threads=1, max_step_pairs=2**40)
    chunked = Engine(engine_dir, threads=1, max_step_pairs=4096)
    shapes = []  # (tokens, attended positions, sequences) of each chunked step
    run_step = chunked.step

    def step(batch):
        shapes.append((batch.input_ids.shape[0], batch.block_tables.shape[1] * chunked.block_size, batch.num_sequences))
        return run_step(batch)

    chunked.step = step
    turn1 = [1 + (7 * i) % 500 for i in range(200)]
    params = {"a1": SamplingParams(max_tokens=4, ignore_eos=True), "a2": SamplingParams(max_tokens=4, ignore_eos=True),
              "bg1": SamplingParams(max_tokens=30, ignore_eos=True), "bg2": SamplingParams(max_tokens=30, ignore_eos=True)}

    def request(rid, prompt, logits):
        return Request(rid, prompt, params[rid], [lambda _ids, x: logits.setdefault(rid, []).append(x.clone()) or x])

    got: dict[str, list] = {}
    sched = EngineCore(chunked)
    out1 = run_all(sched, [request("bg1", PROMPTS[0], got)], join_late={1: [request("a1", turn1, got)]})
    turn2 = turn1 + out1["a1"][0] + [3 + (11 * i) % 500 for i in range(100)]
    out2 = run_all(sched, [request("bg2", PROMPTS[4], got)], join_late={1: [request("a2", turn2, got)]})
    assert out2["a2"][1][0].cached_tokens == len(turn1) + 3
    assert all(t * span <= 4096 for t, span, _ in shapes)
    assert sum(1 for t, _, n in shapes if n == 2 and t > 2) >= 10, shapes  # prefill chunks beside a decode token
    assert min(t for t, _, n in shapes if n == 2 and t > 2) < 16, shapes  # chunks shrink as the context grows

    want: dict[str, list] = {}
    for rid, prompt in (("a1", turn1), ("a2", turn2), ("bg1", PROMPTS[0]), ("bg2", PROMPTS[4])):
        run_all(EngineCore(whole, keep_sessions=False), [request(rid, prompt, want)])
    for rid in want:
        assert len(got[rid]) == len(want[rid]) == params[rid].max_tokens, rid
        for k, (x, y) in enumerate(zip(got[rid], want[rid])):
            # fp32 sums in other orders (chunks, vector width) over up to len(turn2) + 4 attended positions
            atol = reorder_atol(y.numpy(), num_layers(whole.model_config), len(turn2) + 4)
            np.testing.assert_allclose(x.numpy(), y.numpy(), atol=atol, rtol=0, err_msg=f"{rid} token {k}")


def mpiexec() -> str:
    return shutil.which("mpiexec") or str(Path(sys.executable).parent / "mpiexec")


MPI_SCRIPT = Path(__file__).with_name("mpi_scheduler_run.py")


@pytest.mark.parametrize("overlap", [False, True])
def test_batched_equals_unbatched_under_mpiexec(runtime_engine, engine, overlap):
    """mpiexec -n 4: rank 0 schedules all requests together; equals in-process unbatched runs. With overlap
    rank 0 plans each step while the previous one runs (its broadcasts and steps in the worker thread)."""
    engine_dir = runtime_engine("tiny-k3", 2, 2, 4)
    spec = [{"prompt": p, "max_tokens": n} for p, n in zip(PROMPTS, MAX_TOKENS)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OVERLAP": "1" if overlap else "0"}
    r = subprocess.run([mpiexec(), "-n", "4", sys.executable, str(MPI_SCRIPT), str(engine_dir), json.dumps(spec)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [line for line in r.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, r.stdout
    got = json.loads(lines[0])
    want = [alone(engine, p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in zip(PROMPTS, MAX_TOKENS)]
    assert got["tokens"] == want
    assert got["follower_steps"] == [got["root_steps"]] * 3
    assert got.get("planned_ahead", 0) >= (8 if overlap else 0)


@pytest.mark.parametrize("rank", [0, 2])
def test_a_failing_rank_stops_the_world(runtime_engine, rank):
    """A step failing on a rank (a bare Scheduler on rank 0, no API): the world is aborted, exit status 1 (rank 2
    after its grace period, rank 0 as its EngineDead ends the process)."""
    engine_dir = runtime_engine("tiny-k3", 2, 2, 4)
    spec = [{"prompt": p, "max_tokens": n} for p, n in zip(PROMPTS, MAX_TOKENS)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FAIL_RANK": str(rank), "FAIL_AT_STEP": "3"}
    r = subprocess.run([mpiexec(), "-n", "4", sys.executable, str(MPI_SCRIPT), str(engine_dir), json.dumps(spec)],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1
    assert f"rank {rank} of 4 failed: RuntimeError: injected failure at step 3; stopping all ranks" in r.stderr
    assert not r.stdout.strip()


def test_one_process_hands_the_step_plan_over_unserialized(engine, monkeypatch):
    """In one process (no communicator) a step's chunks reach the runner as the scheduler built them (the plan
    holds those objects) and nothing is pickled (under mpiexec the plan is broadcast)."""
    import pickle

    import moe_export.runtime.core.execution as execution_module

    assert engine.comm is None
    seen = []
    run_plan = execution_module.run_plan

    def spy(eng, plan, sampling=None, offload=None):
        seen.append(plan)
        return run_plan(eng, plan, sampling, offload)

    def no_pickling(*args, **kwargs):
        raise AssertionError("the step plan was serialized in one process")

    monkeypatch.setattr(execution_module, "run_plan", spy)
    monkeypatch.setattr(pickle, "dumps", no_pickling)
    monkeypatch.setattr(pickle, "Pickler", no_pickling)
    run_all(EngineCore(engine), [Request("a", PROMPTS[1], SamplingParams(max_tokens=3, ignore_eos=True))])
    assert len(seen) == 3 and all(plan.chunks for plan in seen)
    assert all(type(c).__name__ == "SequenceChunk" for plan in seen for c in plan.chunks)


def test_planning_ahead_changes_no_token(engine):
    """Overlap plans step N+1 while N runs (future tokens for its decode rows): the same tokens, finish reasons
    and stop cuts as planning after N, for greedy and seeded requests joining late, an eos-like stop id met
    mid-stream (its sequence's planned-ahead row is dropped), max_tokens, min_tokens and logit bias; a follow-up
    turn resumes from the kept state (which then also covers the last token); nothing leaks."""
    free = alone(engine, PROMPTS[3], SamplingParams(max_tokens=12, ignore_eos=True))
    stop_at = next(i for i in range(2, 12) if free[i] not in free[:i])

    def requests():
        return [Request("greedy", PROMPTS[0], SamplingParams(max_tokens=9, ignore_eos=True)),
                Request("stop", PROMPTS[3], SamplingParams(max_tokens=12, stop_token_ids=(free[stop_at],))),
                Request("seeded", PROMPTS[1], SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=14,
                                                             ignore_eos=True, min_tokens=4,
                                                             logit_bias=((free[0], -5.0),))),
                Request("late", PROMPTS[4], SamplingParams(max_tokens=8, ignore_eos=True)),
                Request("one", PROMPTS[2], SamplingParams(max_tokens=1, ignore_eos=True))]

    runs = {}
    for overlap in (False, True):
        sched = EngineCore(engine, overlap=overlap)
        reqs = requests()
        got = run_all(sched, reqs[:3], join_late={3: reqs[3:]})
        tokens = got["stop"][0]
        follow = Request("turn2", PROMPTS[3] + tokens + [44, 45], SamplingParams(max_tokens=5, ignore_eos=True))
        again = run_all(sched, [follow])
        runs[overlap] = ({rid: (t, us[-1].finish_reason) for rid, (t, us) in got.items()}, again["turn2"][0],
                         again["turn2"][1][-1].cached_tokens, sched)
        sched.shutdown()
    (plain, turn2, cached, _), (ahead, turn2_ahead, cached_ahead, sched) = runs[False], runs[True]
    assert ahead == plain
    assert plain["stop"] == (free[: stop_at + 1], "stop")
    assert turn2_ahead == turn2
    n = len(PROMPTS[3]) + stop_at + 1
    assert (cached, cached_ahead) == (n - 1, n)  # planned ahead, the stop token's row fed it into the kept state
    assert sched.planned_ahead >= 10
    assert len(sched.scheduler.resources.free_slots) + len(sched.scheduler.resources.sessions) == engine.num_slots and not sched.scheduler.running


def test_the_next_step_is_planned_while_the_runner_runs(engine, monkeypatch):
    """With overlap, the scheduler plans and packs step N+1 on the caller's thread while the runner executes step
    N in the worker; the runner never sees a future token (they are filled in from N's ids); a request whose next
    sampling row needs its token (a logits processor) makes the scheduler plan after the step instead."""
    import time

    sched = EngineCore(engine, overlap=True)
    counts = {"submitted": 0, "done": 0}
    plans_during_a_step = []
    sample, submit, plan = engine.sample, sched.executor.pool.submit, sched.scheduler.schedule

    def slow_sample(batch, sampling):
        assert batch.input_ids.min() >= 0, "a future token reached the runner"
        time.sleep(0.02)
        out = sample(batch, sampling)
        counts["done"] += 1
        return out

    def counting_submit(*args):
        counts["submitted"] += 1
        return submit(*args)

    def recording_plan():
        plans_during_a_step.append(counts["submitted"] > counts["done"])
        return plan()

    monkeypatch.setattr(engine, "sample", slow_sample)
    monkeypatch.setattr(sched.executor.pool, "submit", counting_submit)
    monkeypatch.setattr(sched.scheduler, "schedule", recording_plan)
    got = run_all(sched, [Request("a", PROMPTS[1], SamplingParams(max_tokens=6, ignore_eos=True)),
                          Request("b", PROMPTS[3], SamplingParams(max_tokens=6, ignore_eos=True))])
    monkeypatch.undo()
    sched.shutdown()
    assert plans_during_a_step[0] is False and all(plans_during_a_step[1:6])  # each later step: while one ran
    assert got["a"][0] == alone(engine, PROMPTS[1], SamplingParams(max_tokens=6, ignore_eos=True))

    sched = EngineCore(engine, overlap=True)
    run_all(sched, [Request("p", PROMPTS[1], SamplingParams(max_tokens=6, ignore_eos=True), [lambda ids, x: x])])
    sched.shutdown()
    assert sched.planned_ahead == 0


def test_the_scheduler_holds_no_runner_or_executor(engine):
    """The scheduler plans and applies; the engine core alone runs the model (`EngineCore`: the only holder of the
    executor). Neither the scheduler nor its resources keep the runner (they read its limits at construction)."""
    from moe_export.runtime.core.execution import StepExecutor

    core = EngineCore(engine)
    for owner in (core.scheduler, core.scheduler.resources):
        for name, value in vars(owner).items():
            assert value is not engine and not isinstance(value, StepExecutor), (type(owner).__name__, name)
    core.shutdown()
