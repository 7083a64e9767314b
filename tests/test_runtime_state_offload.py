"""The offload store of prefix state (`runtime.core.state_offload`): a conversation resumed by a new engine (a
restart) loads its kept session's state, cache blocks and recurrent state, from disk and gives the same greedy tokens
and logits (up to float32 reordering) as a full prefill on an engine with no cache of any kind (the oracle); a
tampered, truncated or foreign file is never loaded (the request is answered as without it); the disk cap evicts
least recently used files. Under mpiexec (tp 2) each rank resumes from its own files, and a rank without a valid
copy makes every rank prefill."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_runtime_prefix_cache import oracle, run_turn, tail
from test_runtime_sessions import Recorder, assert_same, run

from moe_export.runtime.core.contracts import Request
from moe_export.runtime.core.engine_core import EngineCore
from moe_export.runtime.core.state_offload import OffloadStore, StateOffload, open_state_offload
from moe_export.runtime.engine import open_engine
from moe_export.runtime.engine.ort import Engine
from moe_export.runtime.sampling import SamplingParams

TURN1 = tail(70, 21)  # 4 full blocks of 16 and a tail of 6: a checkpoint at 64, the session ends mid-block
TOOL = tail(30, 22)


def open_core(engine_dir, directory, *, overlap: bool = False, **caps) -> tuple[EngineCore, StateOffload]:
    """A new engine (as after a restart) whose scheduler offloads to `directory`."""
    eng = open_engine(engine_dir, threads=1)
    offload = open_state_offload(eng, engine_dir, directory, host_bytes=caps.get("host", 1 << 30),
                                 disk_bytes=caps.get("disk", 1 << 30))
    return EngineCore(eng, offload=offload, overlap=overlap), offload


def first_turn(engine_dir, directory, overlap: bool = False) -> list[int]:
    """Turn 1 on an engine that then shuts down (its queued rows read, its files written)."""
    core, offload = open_core(engine_dir, directory, overlap=overlap)
    out1, _, cached = run(core, "t1", TURN1, 6)
    assert cached == 0
    core.shutdown()
    assert offload.store.written > 0
    return out1


@pytest.mark.parametrize("preset, overlap, backend", [
    ("tiny-k3", False, "onnxruntime"), ("tiny-k3-dsa", True, "onnxruntime"), ("tiny-kimi-linear", False, "onnxruntime"),
    ("tiny-k3", True, "torch"),
])
def test_restart_resumes_from_offloaded_state(runtime_engine, tmp_path, preset, overlap, backend):
    """After a restart the follow-up turn (turn 1 + its output + a tool result) resumes at the end of turn 1's kept
    session, its mid-block tail included, and answers as a full prefill does (ONNX Runtime and torch runners)."""
    engine_dir = runtime_engine(preset, 1, 1, 1, backend=backend)
    out1 = first_turn(engine_dir, tmp_path / "state", overlap)
    core, offload = open_core(engine_dir, tmp_path / "state", overlap=overlap)  # the restart: empty device pools
    prompt2 = TURN1 + out1 + TOOL
    got, rec, cached = run(core, "t2", prompt2, 5)
    assert cached == len(TURN1) + len(out1) - 1  # the kept session: every token but the last sampled one was fed
    assert offload.store.warmed > 0 and offload.store.rejected == 0  # read into host memory at start
    stats = core.stats()
    assert stats["offload_loaded_tokens"] == cached and stats["offload_files_rejected"] == 0
    fresh = open_engine(engine_dir, num_slots=1, threads=1)
    want, frec = oracle(fresh, prompt2, 5)
    assert got == want
    assert_same(rec, frec, fresh)
    core.shutdown()


def test_loaded_blocks_are_written_from_the_store_without_a_copy(runtime_engine, tmp_path):
    """After a restart the loaded blocks' rows reach the runner as the store's own arrays (no stacked copy of them
    all: at K3 scale hundreds of MB), and the ONNX Runtime runner writes each into its place."""
    engine_dir = runtime_engine("tiny-k3", 1, 1, 1)
    out1 = first_turn(engine_dir, tmp_path / "state")
    core, offload = open_core(engine_dir, tmp_path / "state")
    eng = core.engine
    written = []
    write_blocks = eng.write_blocks
    eng.write_blocks = lambda blocks, rows: written.append((list(blocks), rows)) or write_blocks(blocks, rows)
    got, _, cached = run(core, "t2", TURN1 + out1 + TOOL, 5)
    assert cached == len(TURN1) + len(out1) - 1
    ((blocks, rows),) = written
    held = {id(a) for entry in offload.store._host.values() for a in entry.values()}
    assert rows and all(len(v) == len(blocks) and all(id(row) in held for row in v) for v in rows.values())
    full = eng.read_blocks(blocks[:-1])  # (the last one is turn 1's tail block: the next tokens are written in it)
    assert all(np.array_equal(full[k], np.stack(v[:-1])) for k, v in rows.items())
    fresh = open_engine(engine_dir, num_slots=1, threads=1)
    assert got == oracle(fresh, TURN1 + out1 + TOOL, 5)[0]
    core.shutdown()


def damage(path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "tampered":  # one byte of the rows (the end of the file is tensor data)
        data[-3] ^= 0x5A
    else:
        data = data[: len(data) // 2]
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["tampered", "truncated", "foreign"])
def test_bad_or_foreign_files_are_never_loaded(runtime_engine, tmp_path, how):
    """Every state file damaged (or the store opened as another engine): nothing is loaded, the request is prefilled
    in full and answers as the oracle does; our damaged files are rejected, another engine's are left alone."""
    engine_dir = runtime_engine("tiny-k3", 1, 1, 1)
    out1 = first_turn(engine_dir, tmp_path / "state")
    states = sorted((tmp_path / "state").glob("s-*.safetensors"))
    assert states
    if how != "foreign":
        for path in states:
            damage(path, how)
    eng = Engine(engine_dir, threads=1)
    if how == "foreign":  # the same files seen by another engine identity (other model, dtype, layout or build)
        store = OffloadStore(tmp_path / "state", b"another engine!!", eng.state_layout(), host_bytes=1 << 30,
                             disk_bytes=1 << 30)
        offload = StateOffload(store, eng.block_size)
    else:
        offload = open_state_offload(eng, engine_dir, tmp_path / "state", host_bytes=1 << 30, disk_bytes=1 << 30)
    core = EngineCore(eng, offload=offload)
    prompt2 = TURN1 + out1 + TOOL
    got, rec, cached = run(core, "t2", prompt2, 5)
    assert cached == 0 and offload.loaded_tokens == 0  # (the undamaged block files alone resume nothing)
    fresh = Engine(engine_dir, num_slots=1, threads=1)
    want, frec = oracle(fresh, prompt2, 5)
    assert got == want
    assert_same(rec, frec, fresh)
    if how == "foreign":
        assert all(p.exists() for p in states) and offload.store.rejected == 0
    else:
        assert offload.store.rejected == len(states)  # each tried once, deleted (then written again by this run)
    core.shutdown()


def test_disk_cap_evicts_least_recently_used(tmp_path):
    """Files beyond the disk cap are deleted least recently used first; one read since is kept; nothing is left in
    host memory with a 0-byte host tier."""
    layout = {"0/mla_cache.0": ["cache", 4096, "float32", [16, 64]]}
    store = OffloadStore(tmp_path, b"i" * 16, layout, host_bytes=0, disk_bytes=3 * 4096 + 2000)
    rows = {"0/mla_cache.0": np.full(4096, 7, np.uint8)}
    names = [bytes([n]) * 16 for n in range(3)]
    for h in names:
        store.put_block(h, rows)
    store._writer.submit(lambda: None).result()
    assert all(store.has_block(h) for h in names)
    assert store.get_block(names[0]) is not None  # names[0] is now the most recently used
    store.put_block(b"\x09" * 16, rows)
    store.close()
    assert store.evicted == 1 and not store.has_block(names[1])
    assert store.has_block(names[0]) and store.has_block(names[2]) and store.has_block(b"\x09" * 16)
    assert len(list(tmp_path.glob("*.safetensors"))) == 3 and store.disk_used <= store.disk_bytes
    # a restart indexes what is on disk, in the same order
    again = OffloadStore(tmp_path, b"i" * 16, layout, host_bytes=0, disk_bytes=1 << 20)
    np.testing.assert_array_equal(again.get_block(names[0])["0/mla_cache.0"], rows["0/mla_cache.0"])
    again.close()


def test_evicted_device_state_is_loaded_back(runtime_engine, tmp_path):
    """Without a restart: turn 1's kept session and cached blocks are evicted from a small pool by another prompt;
    the follow-up turn loads them back from the store (host memory) and answers as a full prefill does."""
    engine_dir = runtime_engine("tiny-k3", 1, 1, 1)
    eng = Engine(engine_dir, num_slots=2, num_blocks=12, threads=1)
    offload = open_state_offload(eng, engine_dir, tmp_path / "state", host_bytes=1 << 30, disk_bytes=1 << 30)
    core = EngineCore(eng, offload=offload)
    out1, _, _ = run(core, "t1", TURN1, 6)
    run(core, "other", tail(170, 23), 6)  # 11 of the 12 blocks: turn 1's session and blocks are evicted
    assert core.stats()["kept_sessions"] == 1 and core.stats()["prefix_cached_blocks"] <= 11
    prompt2 = TURN1 + out1 + TOOL
    got, rec, cached = run(core, "t2", prompt2, 5)
    assert cached == len(TURN1) + len(out1) - 1 and offload.loaded_tokens == cached
    fresh = Engine(engine_dir, num_slots=1, threads=1)
    want, frec = oracle(fresh, prompt2, 5)
    assert got == want
    assert_same(rec, frec, fresh)
    core.shutdown()


def test_restart_after_a_stop_token_with_overlap(runtime_engine, tmp_path):
    """With overlap a turn ended by a stop token has its last token fed by the step after (the kept session covers
    it): the offloaded state is read after that step, so the restart resumes after the stop token, exactly."""
    engine_dir = runtime_engine("tiny-k3", 1, 1, 1)
    probe, _, _ = run(EngineCore(Engine(engine_dir, threads=1), keep_sessions=False, prefix_caching=False), "p", TURN1, 6)
    core, _ = open_core(engine_dir, tmp_path / "state", overlap=True)
    core.add(Request("t1", TURN1, SamplingParams(max_tokens=6, ignore_eos=True, stop_token_ids=[probe[2]])))
    out1 = []
    while core.has_work:
        out1 += [t for u in core.step() for t in u.token_ids]
    assert out1 == probe[:3]
    core.shutdown()
    core, offload = open_core(engine_dir, tmp_path / "state", overlap=True)
    prompt2 = TURN1 + out1 + TOOL
    got, rec, cached = run(core, "t2", prompt2, 5)
    assert cached == len(TURN1) + len(out1) and offload.store.loaded > 0  # the stop token's state included
    fresh = Engine(engine_dir, num_slots=1, threads=1)
    want, frec = oracle(fresh, prompt2, 5)
    assert got == want
    assert_same(rec, frec, fresh)
    core.shutdown()


def test_an_idle_engine_has_its_last_turn_on_disk(runtime_engine, tmp_path):
    """Once the engine core is idle after a turn, the turn's state is read and written without a next step or a
    shutdown: a crash then (no shutdown here) still leaves it for the next engine."""
    engine_dir = runtime_engine("tiny-k3", 1, 1, 1)
    core, offload = open_core(engine_dir, tmp_path / "state", overlap=True)
    out1, _, _ = run(core, "t1", TURN1, 6)
    offload.store._writer.submit(lambda: None).result()  # the files queued so far are written
    again, _ = open_core(engine_dir, tmp_path / "state")
    _, _, cached = run(again, "t2", TURN1 + out1 + TOOL, 2)
    assert cached == len(TURN1) + len(out1) - 1
    again.shutdown()
    core.shutdown()


def test_turn_after_a_restart_round_resumes_at_its_turn_point(runtime_engine, tmp_path):
    """K3's `required` loop across a restart: each prompt is the conversation + an instruction after it, with the
    conversation's end as a turn point. The restart round resumes from the stored state at the previous round's turn
    point, and checkpoints its own turn point as any round does, so the round after it resumes there exactly
    (cached = the common prefix, mid-block), with the tokens and logits of a full prefill."""
    engine_dir = runtime_engine("tiny-k3", 1, 1, 1)
    instruction = tail(7, 40)
    conv = TURN1[:37]  # mid-block (block size 16)
    core, _ = open_core(engine_dir, tmp_path / "state")
    out, _, _ = run_turn(core, "r1", conv + instruction, 6, (len(conv), len(conv) + len(instruction)))
    core.shutdown()
    fresh = open_engine(engine_dir, num_slots=1, threads=1)
    core, offload = open_core(engine_dir, tmp_path / "state")  # the restart
    for turn in (2, 3):
        common = len(conv)
        conv = conv + out + tail(20 + turn, 60 + turn)  # the output, then the tool's answer
        prompt = conv + instruction
        out, rec, cached = run_turn(core, f"r{turn}", prompt, 6, (len(conv), len(prompt)))
        assert cached == common and cached % 16, turn
        want, frec = oracle(fresh, prompt, 6)
        assert out == want, turn
        assert_same(rec, frec, fresh)
    assert offload.loaded_tokens == 37  # turn 2 from the store; turn 3 from the device's checkpoint
    core.shutdown()


def test_server_warm_up_leaves_nothing_behind(runtime_engine, tmp_path):
    """`serve`'s warm-up (`LLM.warm_up`: one request on an engine core of its own, before /health answers) remembers
    nothing: no kept session, cached block or offload file; a restarted LLM warmed that way still resumes turn 1
    from the store, with the greedy tokens and logits of a full prefill."""
    from moe_export.runtime.client.llm import LLM

    engine_dir = runtime_engine("tiny-k3", 1, 1, 1)
    out1 = first_turn(engine_dir, tmp_path / "state")
    llm = LLM(engine_dir, offload_dir=tmp_path / "state", threads=1)
    llm.warm_up()
    stats = llm.stats()
    assert stats["kept_sessions"] == stats["prefix_cached_blocks"] == stats["prefix_checkpoints"] == 0
    assert stats["blocks_used"] == 0 and stats["offload_files_written"] == 0
    prompt2 = TURN1 + out1 + TOOL
    rec = Recorder()
    (out,) = llm.generate([prompt2], SamplingParams(max_tokens=5, ignore_eos=True), logits_processors=[rec])
    assert out.usage["cached_tokens"] == len(TURN1) + len(out1) - 1
    llm.shutdown()
    fresh = Engine(engine_dir, num_slots=1, threads=1)
    want, frec = oracle(fresh, prompt2, 5)
    assert out.output_ids == want
    width = rec.logits[0].shape[0]  # the LLM samples over the tokenizer's ids, fewer than the engine's logits
    frec.logits = [x[:width] for x in frec.logits]
    assert_same(rec, frec, fresh)


MPI_SCRIPT = Path(__file__).with_name("mpi_offload_run.py")


def mpi_turn(engine_dir, store, prompt: list[int], n: int, *extra: str, script: Path = MPI_SCRIPT) -> dict:
    """One request on a fresh `mpiexec -n 2` world (new processes: a restart) offloading to `store` (`script`, given
    `extra` arguments after the turn's)."""
    mpiexec = shutil.which("mpiexec") or str(Path(sys.executable).parent / "mpiexec")
    r = subprocess.run([mpiexec, "-n", "2", sys.executable, str(script), str(engine_dir), str(store),
                        json.dumps(prompt), str(n), *extra], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
def test_tp_ranks_offload_their_own_shards_and_agree_on_loads(runtime_engine, tmp_path, backend):
    """mpiexec -n 2, tp 2 (ONNX Runtime and torch runners): each rank writes its own shards' files (`rank{N}/`);
    after a restart (new processes on the same store) the follow-up turn resumes from them and answers as a
    cacheless prefill on the same runner does. With one rank's state files damaged, no rank loads (the ranks
    agree): the turn is prefilled in full, with the same tokens."""
    engine_dir = runtime_engine("tiny-k3", 2, 2, 2, backend=backend)
    first = mpi_turn(engine_dir, tmp_path / "state", TURN1, 6)
    assert first["cached"] == 0 and all(first["written"])
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == ["rank0", "rank1"]
    shutil.copytree(tmp_path / "state", tmp_path / "damaged")
    prompt2 = TURN1 + first["tokens"] + TOOL
    want, _ = oracle(open_engine(engine_dir, num_slots=1, threads=1), prompt2, 5)
    resumed = mpi_turn(engine_dir, tmp_path / "state", prompt2, 5)
    assert resumed["cached"] == resumed["loaded"] == len(TURN1) + len(first["tokens"]) - 1
    assert resumed["tokens"] == want and resumed["rejected"] == [0, 0]
    states = sorted((tmp_path / "damaged" / "rank1").glob("s-*.safetensors"))
    assert states
    for path in states:
        damage(path, "tampered")
    fallback = mpi_turn(engine_dir, tmp_path / "damaged", prompt2, 5)
    assert fallback["cached"] == fallback["loaded"] == 0 and fallback["tokens"] == want
    assert fallback["rejected"] == [0, len(states)]


def test_mpiexec_serve_store_resumes_a_chain_after_a_restart(tmp_path_factory, tmp_path):
    """`mpiexec -n 2 moe-export serve --store FILE` (tp 2): a Responses chain continued after a restart resumes
    from FILE.state/rank{0,1}/ (cached tokens > 0) and answers as a restarted server that offloads nothing (a full prefill) does."""
    import openai
    from serve_support import build_serve_engine, start_cli_server, stop_process

    engine = build_serve_engine(tmp_path_factory.mktemp("serve-engine-tp2"), tp=2, ep=2, world=2)
    store = tmp_path / "history.sqlite"
    opts = {"model": "m", "max_output_tokens": 10, "temperature": 0}

    def serving(*extra):
        proc, url = start_cli_server([str(engine), *extra, "--default-effort", "low", "--served-model-name", "m"],
                                     mpiexec_ranks=2, env={"MOE_EXPORT_API_KEY": "k"})
        return proc, openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)

    proc, client = serving("--store", str(store))
    try:
        r1 = client.responses.create(input="First turn, with enough words to fill a few cache blocks of the engine.",
                                     **opts)
    finally:
        assert stop_process(proc) == 0
    assert sorted(p.name for p in store.with_name(store.name + ".state").iterdir()) == ["rank0", "rank1"]
    plain = tmp_path / "plain.sqlite"
    shutil.copy(store, plain)  # the same chain, for a server that offloads nothing
    proc, client = serving("--store", str(store))  # the restart: new processes, empty device pools
    try:
        r2 = client.responses.create(input="Second turn.", previous_response_id=r1.id, **opts)
    finally:
        assert stop_process(proc) == 0
    assert r2.usage.input_tokens_details.cached_tokens > 0
    proc, client = serving("--store", str(plain), "--offload-gib", "0")  # nothing cached: the chain prefilled
    try:
        full = client.responses.create(input="Second turn.", previous_response_id=r1.id, **opts)
    finally:
        assert stop_process(proc) == 0
    assert full.usage.input_tokens_details.cached_tokens == 0
    assert full.usage.input_tokens == r2.usage.input_tokens
    assert [i.model_dump(exclude={"id"}) for i in r2.output] == [i.model_dump(exclude={"id"}) for i in full.output]


def test_mpiexec_serve_warms_up_every_rank(tmp_path_factory):
    """`mpiexec -n 2 moe-export serve` (tp 2) runs the warm-up before /health answers: its steps reach rank 1 through
    the serving core's broadcast (each step's collectives need both ranks, so rank 0 reports its steps only once rank 1
    has run them too), and the greedy answer to the first request equals the same request's after another one (no
    prefix caching: both prefilled in full; the warm-up's slot and blocks left nothing behind on either rank)."""
    import re

    import openai
    from serve_support import build_serve_engine, start_cli_server, stop_process

    engine = build_serve_engine(tmp_path_factory.mktemp("serve-engine-tp2"), tp=2, ep=2, world=2)
    proc, url = start_cli_server([str(engine), "--default-effort", "low", "--served-model-name", "m",
                                  "--no-prefix-caching"], mpiexec_ranks=2)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    opts = {"model": "m", "max_tokens": 8, "temperature": 0}
    ask = [{"role": "user", "content": "Name the colours of a rainbow, in order, one per line."}]
    try:
        first = client.chat.completions.create(messages=ask, **opts)
        client.chat.completions.create(messages=[{"role": "user", "content": "Another question in between."}], **opts)
        again = client.chat.completions.create(messages=ask, **opts)
    finally:
        assert stop_process(proc) == 0
    report = re.search(r"warm-up: (\d+) engine steps on (\d+) rank", proc.stderr.read())
    assert report is not None and int(report[1]) > 0 and report[2] == "2"
    assert first.choices[0].message.content == again.choices[0].message.content
    assert first.usage.completion_tokens == again.usage.completion_tokens > 0
