"""Wide expert parallelism (the dp layout): all-to-all dispatch / combine against the all-reduce formulation,
the mapping, per-group engine steps against the PyTorch reference, and `mpiexec -n 8` runs of the LLM API
(groups scheduled by their leaders, requests spread by rank 0) against the single-rank reference's greedy tokens."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from fp32_reorder import U32, num_layers, reorder_atol
import torch
import yaml
from moe_export.export.convert.checkpoint import load_model
from moe_export.common.errors import InputError
from moe_export.common.recipe import load_recipe
from moe_export.export.build import build
from moe_export.graphs.sharding import Mapping
from moe_export.plugins.collectives import all_to_all
from moe_export.runtime.engine.batch import SequenceChunk, StepBatch
from moe_export.runtime.engine.ort import Engine
from moe_export.runtime.entrypoints.generate import ReferenceEngine, generate_tokens
from moe_export.runtime.sampling import SamplingParams
from moe_export.runtime.tokenizer import load_tokenizer

HERE = Path(__file__).parent


def dp_recipe(tmp: Path, preset: str, tp: int, world: int, attention: str = "dp") -> Path:
    """tiny-cpu with `preset`, experts over all `world` ranks, fp32 pools, 16-token blocks."""
    data = yaml.safe_load(Path(load_recipe("tiny-cpu.yaml")[1]).read_text())
    data["name"] = f"wide-{preset}-tp{tp}-w{world}-{attention}"
    data["model"] = {"source": f"synthetic:{preset}"}
    data["target"]["gpus_per_node"] = world
    data["parallel"] = {"tp": tp, "ep": world, "attention": attention}
    data["limits"].update({"max_batch": 6, "max_seq_len": 1024, "max_num_tokens": 64, "block_size": 16})
    data["quantization"]["kv_cache"] = "fp32"
    path = tmp / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def dp_engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("wide-ep")
    built: dict[tuple, Path] = {}

    def get(preset: str, tp: int, world: int, attention: str = "dp") -> Path:
        key = (preset, tp, world, attention)
        if key not in built:
            rec, _ = load_recipe(dp_recipe(root, *key))
            build(rec, root / rec.name)
            built[key] = root / rec.name
        return built[key]

    return get


def source_checkpoint(engine_dir: Path) -> Path:
    return next((engine_dir / ".cache").glob("source-*"))


# ---- all-to-all ops ---------------------------------------------------------------------------------------


def experts_of_rank(x: np.ndarray, ids: np.ndarray, w: np.ndarray, mats: np.ndarray, rank: int, per: int) -> np.ndarray:
    """A rank's weighted expert partial sums (MoEMXFP4's contract with tanh(W_e x) experts): Σ_j [e_j on rank]
    w_j tanh(W_e x)."""
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e // per == rank:
                y[t] += w[t, j] * np.tanh(mats[e] @ x[t])
    return y


def test_dispatch_expert_combine_equals_the_all_reduce_of_partial_sums():
    """Each rank's tokens (some ranks idle) through dispatch -> its experts -> combine equal, per token, the sum
    over ranks of every rank's partial sums on those tokens (the tp layout's all-reduce)."""
    rng = np.random.default_rng(0)
    ep, num_experts, k, dim = 4, 8, 3, 5
    per = num_experts // ep
    mats = rng.standard_normal((num_experts, dim, dim)).astype(np.float32)
    counts = [3, 0, 5, 1]
    xs = [rng.standard_normal((n, dim)).astype(np.float32) for n in counts]
    ids = [np.stack([rng.choice(num_experts, k, replace=False) for _ in range(n)]) if n else np.zeros((0, k), np.int64)
           for n in counts]
    ws = [rng.random((n, k)).astype(np.float32) for n in counts]
    traffic = [all_to_all.Traffic() for _ in range(ep)]
    received = all_to_all.reference_dispatch(xs, ids, ws, num_experts, traffic)
    ys = [experts_of_rank(rx, ri, rw, mats, r, per) for r, (rx, ri, rw, _) in enumerate(received)]
    out = all_to_all.reference_combine(ys, [lay for *_, lay in received], counts, traffic)
    for r in range(ep):
        want = sum(experts_of_rank(xs[r], ids[r], ws[r], mats, d, per) for d in range(ep))
        np.testing.assert_array_equal(out[r], want)  # exact: np.add.at adds the same partials in rank order too
        # each token reaches each rank of its experts once: rows sent = distinct destination ranks per token
        assert received[r][3].send_rows.shape[0] == sum(len({e // per for e in row}) for row in ids[r].tolist())
    assert sum(t.moe_tokens for t in traffic) == sum(counts)
    assert traffic[1].sent_bytes[all_to_all.KIND] > 0  # the idle rank still returns its experts' results


def test_mpi_and_torch_distributed_all_to_all_match_the_reference():
    """`mpiexec -n 4`: the MPI implementation (ONNX Runtime path) and the TensorRT MoEDispatch / MoECombine plugins'
    enqueue (QDP impls under the real `tensorrt.plugin`, static garbage-filled output buffers, the
    `nccl.Communicator` over gloo), in the counted and the block transport, give the reference's combined sums,
    rank 1 idle (a dummy token, nothing sent) and the others' padding tokens unsent; the buffers' rows past the
    received head stay untouched, per-expert counts are recorded on the device, the host bound covers the rows
    received; a combine handed copies of the count buffers gives the same sums."""
    mpiexec = shutil.which("mpiexec") or str(Path(sys.executable).parent / "mpiexec")
    r = subprocess.run([mpiexec, "-n", "4", sys.executable, str(HERE / "mpi_all_to_all_run.py")], capture_output=True,
                       text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["mpi_max_err"] == 0.0 and got["mpi_shapes_match"]  # exact: the reference's own np.add.at order
    for transport in ("counted", "blocks"):
        t = got[transport]  # the sum kernel adds each token's partial rows in its own order: the reordering bound
        assert t["plugin_max_err"] <= got["plugin_err_bound"] and t["shapes_match"] and t["rows_ok"] and t["counts_ok"], (transport, t)
    assert got["rows_received"][1] > 0  # the idle rank's experts still get the others' tokens


def expected_send_rows(ids: np.ndarray, valid: int, num_experts: int, ep: int, block_rows: int) -> np.ndarray:
    """send_rows [T * K] from `send_plan` of the live tokens: the sent row of a token's first choice on each rank
    (blocks: rank d's j-th row at d * B + j; counted: the rows in send order), -1 for the others."""
    rows, counts = all_to_all.send_plan(ids[:valid], num_experts, ep)
    dest = all_to_all.expert_rank(ids, num_experts, ep)
    start = np.concatenate([[0], np.cumsum(counts)[:-1]])
    at = {}
    for d in range(ep):
        for j, t in enumerate(rows[start[d]: start[d] + counts[d]]):
            at[int(t), d] = d * block_rows + j if block_rows else int(start[d]) + j
    want = np.full(ids.shape, -1, dtype=np.int64)
    for t in range(valid):
        for k in range(ids.shape[1]):
            if dest[t, k] not in dest[t, :k]:
                want[t, k] = at[t, int(dest[t, k])]
    return want.reshape(-1)


def test_route_and_row_kernels_in_interpreter_subprocess():
    """Run this file's `triton_inner` tests (the all-to-all's Triton kernels) with TRITON_INTERPRET=1."""
    from conftest import run_triton_inner_tests

    run_triton_inner_tests(__file__)


ROUTE_CASES = {  # T, K, E, ep, valid
    "decode": (4, 3, 8, 4, 3),
    "all_dead": (3, 2, 8, 4, 0),
    "no_tokens": (0, 3, 8, 4, 0),
    "prefill_many_blocks": (300, 3, 8, 4, 290),
    "one_rank": (6, 4, 4, 1, 6),
    "k3_like": (40, 16, 64, 16, 37),
    "uneven_sizes": (20, 4, 12, 3, 17),  # E and ep not powers of 2
}


@pytest.mark.triton_inner
@pytest.mark.parametrize("block_rows", [0, 300])
@pytest.mark.parametrize("case", list(ROUTE_CASES))
def test_inner_triton_route_matches_send_plan(case, block_rows):
    """`_route_kernel` against `send_plan` of the live tokens: counts per rank, every (token, choice)'s sent row
    (a token's repeated ranks and the tokens at or past `valid` get -1), the live tokens' choices per expert;
    every output element is written (the buffers start as garbage)."""
    from moe_export.plugins.collectives import transport_kernels

    num_tokens, k, num_experts, ep, valid = ROUTE_CASES[case]
    rng = np.random.default_rng(num_tokens + k)
    ids = rng.integers(0, num_experts, (num_tokens, k))  # repeats: experts and ranks among a token's choices
    if num_tokens > 2:
        ids[1] = [2] * k  # one expert k times
    send_counts = torch.full((ep,), 99, dtype=torch.int64)
    send_rows = torch.full((num_tokens * k,), 99, dtype=torch.int64)
    routed = torch.full((num_experts,), 99, dtype=torch.int64)
    transport_kernels.route(torch.from_numpy(ids), torch.tensor([valid]), num_experts, ep, block_rows, send_counts,
                            send_rows, routed)
    _, counts = all_to_all.send_plan(ids[:valid], num_experts, ep)
    assert send_counts.tolist() == counts.tolist()
    assert send_rows.tolist() == expected_send_rows(ids, valid, num_experts, ep, block_rows).tolist()
    assert routed.tolist() == np.bincount(ids[:valid].ravel(), minlength=num_experts).tolist()


def numpy_packed(x: torch.Tensor, ids: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The packed rows as `packed_row_bytes` lays them out: x's bytes, int32 ids, fp32 weights (little-endian)."""
    raw = x.contiguous().view(torch.uint8).numpy()
    return np.concatenate([raw, ids.astype("<i4").view(np.uint8), w.astype("<f4").view(np.uint8)], axis=1)


@pytest.mark.triton_inner
@pytest.mark.parametrize("block_rows", [0, 7])
def test_inner_triton_pack_then_unpack_moves_the_sent_rows_to_the_head(block_rows):
    """One rank sending to itself and 2 peers (ep 3), bf16 rows of 5 values (10 bytes: ids off 4-byte alignment):
    `_pack_kernel` writes each sent row byte for byte as the layout says and nothing else; the rows as a peer
    receives them from 3 sources, unpacked (blocks compacted by the counts, or counted rows), are the head of
    recv_x / recv_ids / recv_w in source order, and the rows past it stay untouched."""
    from moe_export.plugins.collectives import transport_kernels as tk

    ep, num_experts, k, dim, num_tokens, valid = 3, 6, 2, 5, 6, 5
    rng = np.random.default_rng(3)
    ids = rng.integers(0, num_experts, (num_tokens, k))
    x = torch.from_numpy(rng.standard_normal((num_tokens, dim)).astype(np.float32)).bfloat16()
    w = rng.random((num_tokens, k)).astype(np.float32)
    width = all_to_all.packed_row_bytes(dim, 2, k)
    send_counts, send_rows = torch.zeros(ep, dtype=torch.int64), torch.zeros(num_tokens * k, dtype=torch.int64)
    tk.route(torch.from_numpy(ids), torch.tensor([valid]), num_experts, ep, block_rows, send_counts, send_rows,
             torch.zeros(num_experts, dtype=torch.int64))
    sent = ep * block_rows if block_rows else int(send_counts.sum())
    send = torch.full((sent, width), 0xAB, dtype=torch.uint8)
    tk.pack(x, torch.from_numpy(ids), torch.from_numpy(w), send_rows, send)
    rows, counts = all_to_all.send_plan(ids[:valid], num_experts, ep)
    packed = numpy_packed(x, ids, w)
    start = np.concatenate([[0], np.cumsum(counts)[:-1]])
    at = [d * block_rows + j if block_rows else start[d] + j for d in range(ep) for j in range(counts[d])]
    got = send.numpy()
    np.testing.assert_array_equal(got[at, : packed.shape[1]], packed[rows])
    assert (np.delete(got, at, axis=0) == 0xAB).all() and (got[:, packed.shape[1]:] == 0xAB).all()
    # a peer receiving this rank's rows from each of 3 sources: source s sends it the rows it sends rank s
    recv_counts = torch.from_numpy(counts.copy())
    if block_rows:
        stage = torch.from_numpy(np.concatenate([got[s * block_rows: (s + 1) * block_rows] for s in range(ep)]))
    else:
        stage = send.clone()
    bound = sent + 3
    recv_x = torch.full((bound, dim), float("nan"), dtype=torch.bfloat16)
    recv_ids, recv_w = torch.full((bound, k), 12345), torch.full((bound, k), 7.0)
    tk.unpack(stage, recv_x, recv_ids, recv_w, recv_counts, block_rows)
    n = len(rows)
    assert torch.equal(recv_x[:n], x[torch.from_numpy(rows)]) and bool(recv_x[n:].isnan().all())
    assert recv_ids[:n].tolist() == ids[rows].tolist() and (recv_ids[n:] == 12345).all()
    assert recv_w[:n].tolist() == w[rows].tolist() and (recv_w[n:] == 7.0).all()


@pytest.mark.triton_inner
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inner_triton_combine_expands_the_head_and_sums_each_tokens_rows(dtype):
    """`_expand_kernel`: the head rows back into per-source blocks (only the rows with tokens written);
    `_sum_kernel`: each token's returned rows at send_rows summed in fp32, 0 for a token with none, in out's
    dtype, against `reference_combine`'s np.add.at in float64."""
    from moe_export.plugins.collectives import transport_kernels as tk

    ep, block_rows, dim = 3, 4, 300  # two column programs
    recv_counts = torch.tensor([2, 0, 3])
    partial = torch.randn(9, dim).to(dtype)
    blocks = torch.full((ep * block_rows, dim), 5.0).to(dtype)
    tk.expand(partial, recv_counts, block_rows, blocks)
    assert torch.equal(blocks[0:2], partial[0:2]) and torch.equal(blocks[8:11], partial[2:5])
    assert (blocks[2:8] == 5).all() and (blocks[11:] == 5).all()
    send_rows = torch.tensor([[3, -1, 0], [-1, -1, -1], [1, 4, 2], [-1, -1, -1]]).reshape(-1)
    back = torch.randn(5, dim).to(dtype)
    out = torch.full((4, dim), float("nan")).to(dtype)
    tk.sum_returned(back, send_rows, out)
    want = np.zeros((4, dim))
    live = send_rows.numpy() >= 0
    np.add.at(want, np.repeat(np.arange(4), 3)[live], back.double().numpy()[send_rows.numpy()[live]])
    magnitude = np.zeros((4, dim))
    np.add.at(magnitude, np.repeat(np.arange(4), 3)[live], np.abs(back.double().numpy()[send_rows.numpy()[live]]))
    # a float32 sum of 3 rows is within 2 u sum|rows| of the exact one (Higham 4.2); a bf16 out is one more cast,
    # within one bf16 ulp (2^-7 relative: Triton's interpreter casts toward zero, not to nearest's 2^-8)
    bound = 2 * U32 * magnitude + (2.0**-7 * np.abs(want) if dtype == torch.bfloat16 else 0.0)
    assert (np.abs(out.double().numpy() - want) <= bound).all()
    assert (out[1] == 0).all() and (out[3] == 0).all()


def test_route_and_row_kernels_compile_for_sm90():
    """The transport's five kernels compile to sm_90 PTX with no GPU (the interpreter runs no code generation), at
    K3's tiles on 64 ranks (896 experts, top-16, 7,168-byte bf16 rows), both transports."""
    import triton
    from triton.backends.compiler import GPUTarget

    from moe_export.plugins.collectives import transport_kernels as tk

    pointers = dict(x_ptr="*u8", send_ptr="*u8", recv_ptr="*u8", w_ptr="*fp32", partial_ptr="*bf16",
                    blocks_ptr="*bf16", back_ptr="*bf16", out_ptr="*bf16")  # fmt: skip

    def ptx(kernel, constexprs):
        signature = {a: pointers.get(a, "*i64" if a.endswith("_ptr") else "i32") for a in kernel.arg_names}
        signature.update(dict.fromkeys(constexprs, "constexpr"))
        src = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
        code = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        assert f".entry {kernel.__name__}(" in code and ".target sm_90" in code

    for blocks in (True, False):
        ptx(tk._route_kernel, dict(BLOCKS=blocks, **tk.route_tiles(16, 64, 896)))
        ptx(tk._unpack_kernel, dict(BLOCKS=blocks, BLOCK_EP=64, BLOCK_K=16, BLOCK_B=1024))
    ptx(tk._pack_kernel, dict(BLOCK_K=16, BLOCK_B=1024, BLOCK_M=128))
    ptx(tk._expand_kernel, dict(BLOCK_EP=64, BLOCK_D=1024))
    ptx(tk._sum_kernel, dict(BLOCK_D=256))


def test_send_plan_orders_rows_by_destination_then_token():
    ids = np.array([[7, 0], [2, 3], [6, 7]])  # 8 experts on 4 ranks: ranks (3, 0), (1, 1), (3, 3)
    rows, counts = all_to_all.send_plan(ids, 8, 4)
    assert rows.tolist() == [0, 1, 0, 2] and counts.tolist() == [1, 1, 0, 2]


def test_mapping_dp_layout():
    m = Mapping(8, 5, 2, 8, "dp")
    assert (m.dp, m.dp_rank, m.tp_group, m.all_to_all) == (4, 2, (4, 5), True)
    assert Mapping(8, 5, 2, 8).dp == 1
    with pytest.raises(InputError, match="ep=4 must equal world_size=8"):
        Mapping(8, 0, 2, 4, "dp")


def test_recipe_dp_needs_experts_over_every_rank(tmp_path):
    path = dp_recipe(tmp_path, "tiny-k3", 2, 4)
    data = yaml.safe_load(path.read_text())
    data["parallel"]["ep"] = 2
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(Exception, match="parallel.ep=2 must equal the world size"):
        load_recipe(path)


# ---- engine: per-group batches in one process ---------------------------------------------------------------


@pytest.mark.parametrize("preset", ["tiny-k3", "tiny-k3-dsa", "tiny-kimi-linear"])
def test_groups_step_their_own_sequences_and_idle_groups_join(dp_engine, preset):
    """tp 2 x dp 2 (world 4, experts over 4 ranks) in one process: group 0 prefills and decodes one prompt
    while group 1 idles for three steps, then prefills another prompt of a different length and both decode;
    each group's logits match the reference at every step."""
    engine_dir = dp_engine(preset, 2, 4)
    ref = load_model(source_checkpoint(engine_dir))
    eng = Engine(engine_dir, num_slots=2, num_blocks=32, threads=1)
    assert (eng.dp, eng.dp_layout) == (2, True)
    prompts = [[5, 17, 99, 3, 250, 42, 7, 8, 300, 11, 12, 77, 1, 400], [60, 61, 62, 63, 64]]
    caches = [ref.new_cache(1), ref.new_cache(1)]
    pos = [0, 0]
    pending: list[list[int] | None] = [prompts[0], None]
    tables = [list(range(8)), list(range(8, 16))]  # blocks of 16 tokens; both groups use slot 0
    eng.reset_slot(0)
    for step in range(8):
        if step == 3:
            pending[1] = prompts[1]
        batches = [None if p is None else StepBatch.from_sequences([SequenceChunk(0, pos[g], p, tables[g])])
                   for g, p in enumerate(pending)]
        out = eng.step_groups(batches)
        for g, p in enumerate(pending):
            if p is None:
                assert out[g] is None
                continue
            want = (ref.prefill(torch.tensor([p]), caches[g])[0, -1] if pos[g] == 0
                    else ref.decode(torch.tensor([p[0]]), caches[g])[0])
            atol = reorder_atol(want.numpy(), num_layers(eng.model_config), eng.max_seq_len)
            np.testing.assert_allclose(out[g][0], want.numpy(), atol=atol, rtol=0, err_msg=f"group {g} step {step}")
            pos[g] += len(p)
            pending[g] = [int(want.argmax())]
    assert eng.expert_tokens.sum() == eng.top_k * (len(prompts[0]) + 7 + len(prompts[1]) + 4) * eng.expert_tokens.shape[0]


# ---- mpiexec -n 8: the LLM API over attention groups --------------------------------------------------------

ROUNDS = [
    {"prompts": [[5, 17, 99, 3, 250, 42, 7, 8, 300, 11, 12, 77, 1, 400], [5, 17, 99], [60, 61, 62, 63, 64, 65, 66]],
     "max_tokens": 6},
    # after round 1 group 3 has been idle all along; [60..66, 1, 2] continues round 1's third prompt (group 2)
    {"prompts": [[60, 61, 62, 63, 64, 65, 66, 1, 2], [1, 2], list(range(3, 23)), [7], [100, 200]], "max_tokens": 4},
]


def mpiexec_json(script: str, world: int, *args: str, timeout: int = 300) -> dict:
    """`mpiexec -n WORLD python tests/SCRIPT ARGS` (OMP_NUM_THREADS 1): the JSON of its last output line."""
    mpiexec = shutil.which("mpiexec") or str(Path(sys.executable).parent / "mpiexec")
    r = subprocess.run([mpiexec, "-n", str(world), sys.executable, str(HERE / script), *args], capture_output=True,
                       text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def run_mpi(engine_dir: Path, world: int, *extra: str) -> dict:
    mpiexec = shutil.which("mpiexec") or str(Path(sys.executable).parent / "mpiexec")
    r = subprocess.run([mpiexec, "-n", str(world), sys.executable, str(HERE / "mpi_wide_ep_run.py"), str(engine_dir),
                        json.dumps(ROUNDS), *extra], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("preset, tp", [("tiny-k3", 2), ("tiny-k3", 1), ("tiny-kimi-linear", 2), ("tiny-kimi-linear", 1)])
def test_mpiexec_8_ranks_dp_layout_matches_single_rank_reference(dp_engine, preset, tp):
    """`mpiexec -n 8` (tp 2 x dp 4 or tp 1 x dp 8, experts over 8 ranks): rank 0's generate() spreads the requests
    over the groups (least loaded; a follow-up to its group), each request's greedy tokens equal the reference's."""
    engine_dir = dp_engine(preset, tp, 8)
    abort = (preset, tp) == ("tiny-k3", 2)  # one layout also runs the AsyncLLM abort phase
    got = run_mpi(engine_dir, 8, *(["abort"] if abort else []))
    ref = load_model(source_checkpoint(engine_dir))
    vocab = load_tokenizer(engine_dir).vocab_size  # the LLM samples among the tokenizer's ids
    for r, spec in enumerate(ROUNDS):
        for i, prompt in enumerate(spec["prompts"]):
            params = SamplingParams(max_tokens=spec["max_tokens"], ignore_eos=True)
            want = generate_tokens(ReferenceEngine(ref, max_seq_len=64), prompt, params, sample_vocab=vocab)
            assert got["rounds"][r][i] == want, f"round {r} request {i}"
    first, second = got["groups"]
    assert first == [0, 1, 2]  # least loaded, lowest group first; group 3 idles through round 1
    assert second[0] == first[2]  # the follow-up goes to the group holding the conversation
    assert len(set(second)) == min(8 // tp, len(second))  # five requests over the groups
    moe_layers = len(got["expert_tokens"])
    routed = sum(len(p) + spec["max_tokens"] - 1 for spec in ROUNDS for p in spec["prompts"])
    load = np.asarray(got["expert_tokens"])  # every rank's own dispatches, gathered at the end
    if not abort:  # (the abort phase routes a number of tokens that depends on when the abort lands)
        assert got["moe_tokens"] == routed * moe_layers  # every token routed once per MoE layer, by one rank
        assert load.sum() == routed * moe_layers * ref.cfg.num_experts_per_token
        # rank 0's stats() sums the groups' counts step by step: the same load
        np.testing.assert_allclose(got["stats_expert_load"]["max_over_mean"], load.max(1) / load.mean(1), rtol=1e-3)
    assert got["stats_expert_load"]["routed"] == routed * moe_layers * ref.cfg.num_experts_per_token
    stats = got["stats"]  # every group's scheduler, summed
    assert stats["groups"] == 8 // tp and stats["blocks_total"] == stats["groups"] * got["blocks_per_rank"]
    assert stats["running"] == stats["waiting"] == 0
    if abort:  # streams in groups 0, 1, 2; group 1's dropped after one token, its slot freed, the others whole
        aborted = got["aborted"]
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        for key, prompt in (("a", [11, 12, 13]), ("c", [31, 32, 33])):
            assert aborted[key] == generate_tokens(ReferenceEngine(ref, max_seq_len=64), prompt, params, sample_vocab=vocab)
        assert len(aborted["b"]) == 1 and aborted["groups"] == [0, 2] and aborted["after"] == 0
    assert "moe_all_reduce" not in got["sent_bytes"] and got["sent_bytes"]["moe_all_to_all"] > 0


# ---- plan: per-layout bytes and attention work --------------------------------------------------------------


def test_expected_destinations_matches_enumeration():
    from itertools import combinations

    from moe_export.export.plan.traffic import expected_destinations

    for experts, k, ep in ((8, 3, 4), (12, 2, 6), (6, 6, 3)):
        per = experts // ep
        choices = list(combinations(range(experts), k))
        exact = sum(len({e // per for e in c}) for c in choices) / len(choices)
        assert expected_destinations(experts, k, ep) == pytest.approx(exact, rel=1e-12)


@pytest.mark.parametrize("recipe, world", [("h100x64.yaml", 64), ("h200x32.yaml", 32)])
def test_plan_shows_both_layouts_and_the_recipes_choose_dp(recipe, world):
    from moe_export.export.plan.planner import make_plan

    rec, _ = load_recipe(recipe)
    assert rec.parallel.attention == "dp" and rec.parallel.ep == world
    layouts = make_plan(rec).to_dict()["layouts"]
    tp, dp = layouts["tp"], layouts["dp"]
    batch, d = rec.limits.max_batch, 3584  # K3's latent MoE width, bf16 on GPU
    assert tp["moe_bytes"]["all_reduce"] == pytest.approx(2 * (world - 1) / world * batch * d * 2)
    assert dp["groups"] == world // 8 and dp["tokens_per_gpu"] == pytest.approx(batch / 8)
    assert dp["attention_token_heads"] == tp["attention_token_heads"] == batch * 96 // 8
    # the dp layout serves world/tp times the tokens with the same attention work per GPU, and sends fewer MoE
    # bytes per served token: the reason the recipes choose it
    assert dp["tokens_per_gpu"] == pytest.approx(tp["tokens_per_gpu"] * world / 8)
    assert dp["moe_bytes_per_token"] < 0.6 * tp["moe_bytes_per_token"]  # 0.28x (h100x64), 0.52x (h200x32)


@pytest.mark.slow
def test_mpiexec_8_ranks_serve_spreads_chats_over_groups(dp_engine):
    """`mpiexec -n 8 moe-export serve` on a tp 2 x dp 4 engine: concurrent chat completions (spread over the groups)
    answer as the same engine in one process does (group 0, the others idle), and the server drains on SIGTERM."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from moe_export.runtime import LLM
    from serve_support import start_cli_server, stop_process

    engine_dir = dp_engine("tiny-k3", 2, 8)
    questions = ["Tell me about Paris.", "Hi!", "What is two plus two, in words?", "Name a colour."]
    proc, url = start_cli_server([str(engine_dir), "--default-effort", "low", "--served-model-name", "m"],
                                 mpiexec_ranks=8)
    try:
        def ask(q: str) -> dict:
            body = {"model": "m", "messages": [{"role": "user", "content": q}], "max_tokens": 10, "temperature": 0}
            return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300).json()

        with ThreadPoolExecutor(len(questions)) as pool:
            served = list(pool.map(ask, questions))
    finally:
        code = stop_process(proc)
    llm = LLM(engine_dir, default_effort="low", threads=1)
    local = llm.chat([[{"role": "user", "content": q}] for q in questions], SamplingParams(max_tokens=10))
    for s, want in zip(served, local):
        assert s["usage"]["completion_tokens"] == len(want.output_ids)
        message = s["choices"][0]["message"]
        assert (message["content"] or "", message.get("reasoning_content") or "") == \
            (want.content or "", want.reasoning_content or "")
    assert code == 0


def test_placement_follow_ups_least_loaded_grammars_follow_and_other_processors_in_group_0(tmp_path):
    from collections import OrderedDict

    from moe_export.export.convert.synth import write_synthetic_tokenizer
    from moe_export.runtime.core.scheduler import Request
    from moe_export.runtime.core.structured import GrammarVocab, structural_tag_for
    from moe_export.runtime.core.wide_ep import GroupedScheduler

    write_synthetic_tokenizer(tmp_path, "k3", 512)
    tag = structural_tag_for("k3", tools=None, tool_choice=None, response_format={"type": "json_object"},
                             thinking=False, starts_in_reasoning=False)
    tokenizer = load_tokenizer(tmp_path)
    grammar = GrammarVocab(tokenizer, "k3", tokenizer.vocab_size).grammar(tag)  # a JSON response format

    def own(ids, logits):  # a caller's own processor
        return logits

    sched = GroupedScheduler.__new__(GroupedScheduler)  # placement reads only loads and history
    sched.groups, sched.loads = 4, [2, 0, 1, 0]
    sched.history = OrderedDict({(1, 2, 3): 2, (1, 2): 3})
    assert sched.place(Request("a", [9, 9])) == 1  # least loaded, lowest group first
    assert sched.place(Request("b", [1, 2, 3, 4])) == 2  # the longest finished prompt it continues
    assert sched.place(Request("c", [1, 2, 7])) == 3
    assert sched.place(Request("d", [1, 2, 3, 4], logits_processors=[own])) == 0
    assert sched.place(Request("d", [1, 2, 3, 4], logits_processors=[grammar, own])) == 0
    assert sched.place(Request("d", [1, 2, 3, 4], logits_processors=[grammar])) == 2  # rebuilt there from its spec
    assert sched.place(Request("d", [9, 9], logits_processors=[grammar])) == 1
    # warm turns: the group whose finished prompt shares the longest prefix (the latest on a tie), then remembered
    assert sched.warm_group([1, 2, 3, 9]) == 2 and sched.warm_group([1, 2, 8]) == 3 and sched.warm_group([5]) is None
    sched.remember((1, 2, 8), 1)
    assert sched.place(Request("e", [1, 2, 8, 4])) == 1
    # a constrained chat that ran in group 3: its warm turn goes to group 3, and so does its next turn, constrained or
    # not (the warm prompt, remembered as group 3's, is the longest it continues); a caller's processor: group 0
    sched.remember((4, 5, 6), 3)
    assert sched.warm_group([4, 5, 6, 7]) == 3
    sched.remember((4, 5, 6, 7), 3)
    assert sched.place(Request("f", [4, 5, 6, 7, 8])) == 3
    assert sched.place(Request("g", [4, 5, 6, 7, 8], logits_processors=[grammar])) == 3
    assert sched.place(Request("h", [4, 5, 6, 7, 8], logits_processors=[own])) == 0


@pytest.mark.slow
def test_mpiexec_8_ranks_image_chat_in_another_group(dp_engine):
    """An image chat placed in group 1 (group 0 holds a text chat): the images travel to group 1's leader, its
    tower runs there, and both chats answer as the same engine in one process does."""
    from moe_export.runtime import LLM
    from test_vision_engine import GREEDY, THREE

    engine_dir = dp_engine("tiny-k3", 2, 8)
    chats = [[{"role": "user", "content": "Hi!"}], THREE]
    mpiexec = shutil.which("mpiexec") or str(Path(sys.executable).parent / "mpiexec")
    r = subprocess.run([mpiexec, "-n", "8", sys.executable, str(HERE / "mpi_wide_ep_vision_run.py"), str(engine_dir),
                        json.dumps(chats), str(GREEDY.max_tokens)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])["outputs"]
    local = LLM(engine_dir, threads=1).chat(chats, GREEDY, reasoning_effort="none")
    assert got == [o.output_ids for o in local]


def test_mpiexec_2_ranks_warm_turns_in_the_turns_group(dp_engine):
    """`mpiexec -n 2` (tp 1 x dp 2): warm turns run in the group that ran the turn and the next turn is placed there
    (`GroupedScheduler.add_warm`). A `required` tool-choice chat (group 0) resumes round 2 at the warm prompt's end;
    token prompts placed in group 1: the warm turn and the prompt continuing it go to group 1, which resumes it at the
    warm turn's end (the request sent before the warm turn ran waits for it). Greedy tokens equal a cacheless engine's
    in one process."""
    from mpi_wide_ep_warm_run import ANSWER, CONV, INSTRUCTION
    from test_warm_turns import REQUIRED, next_prompt_messages

    from moe_export.runtime import LLM

    engine_dir = dp_engine("tiny-k3", 1, 2)
    got = mpiexec_json("mpi_wide_ep_warm_run.py", 2, str(engine_dir))
    cacheless = LLM(engine_dir, threads=1, default_effort="low", prefix_caching=False, reuse_sessions=False)
    chat = got["chat"]
    messages = [{"role": "user", "content": "Plan a week in Rome."}]
    for k, max_tokens in enumerate((300, 24)):
        (want,) = cacheless.chat([messages], SamplingParams(max_tokens=max_tokens), **REQUIRED)
        assert chat["rounds"][k]["output_ids"] == want.output_ids, k
        if not k:
            assert want.tool_calls
            messages = next_prompt_messages("chat", messages, want, "rain, 14 C")
    assert chat["rounds"][1]["cached_tokens"] == chat["warm_len"] > chat["history_len"]
    group1 = got["group1"]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    first = cacheless.generate([CONV + INSTRUCTION], params)[0].output_ids
    warm = CONV + first
    want = [o.output_ids for o in cacheless.generate([[7, 8, 9], CONV + INSTRUCTION, warm + ANSWER + INSTRUCTION],
                                                     params)]
    cacheless.shutdown()
    assert group1["outputs"] == want
    assert group1["groups"] == [1, 1, 1]
    assert group1["cached_tokens"] == group1["warm_len"] == len(warm)
    assert got["warm_turns"] == 3  # the chat's two rounds' (round 2's ran during the token phase) and group 1's


def test_mpiexec_2_ranks_constrained_turn_in_the_conversations_group(dp_engine):
    """`mpiexec -n 2` (tp 1 x dp 2): a conversation placed in group 1 unconstrained, then a `required` tool-choice
    turn continuing it and a named forced call after that (`mpi_wide_ep_grammar_run`): both run in group 1 (their
    grammars rebuilt by its leader from their specs), the first resuming at the end of the conversation's kept
    session (its prompt and output but the last token, whose state was never computed), the second at the end of
    the first one's warm turn (group 1 too). Prompts, greedy tokens, tool calls and rank 0's grammar processor's
    final state (complete call: `completed`; cut short by max_tokens: not) equal a cacheless engine's in one
    process."""
    from mpi_wide_ep_grammar_run import (
        CALL,
        CONV,
        CUT,
        FIRST,
        NAMED,
        OTHER,
        WEATHER,
        constrained_turn,
        second_messages,
        third_messages,
        turn,
    )

    from moe_export.runtime import LLM

    engine_dir = dp_engine("tiny-k3", 1, 2)
    got = mpiexec_json("mpi_wide_ep_grammar_run.py", 2, str(engine_dir))
    other, first, second, third = got["turns"]
    assert got["groups"] == [0, 1, 1, 1, 1]  # other, conv, turn 2, turn 2's warm prompt, turn 3
    assert second["cached_tokens"] == len(first["prompt_ids"]) + len(first["output_ids"]) - 1
    assert third["cached_tokens"] == got["warm_len"]
    assert got["warm_turns"] == 1

    cacheless = LLM(engine_dir, threads=1, default_effort="none", prefix_caching=False, reuse_sessions=False)
    want_other, want_first = cacheless.chat([OTHER, CONV], FIRST, tools=WEATHER)
    messages = second_messages(want_first)
    want_second, second_grammar = constrained_turn(cacheless, messages, CALL, "required")
    want_third, third_grammar = constrained_turn(cacheless, third_messages(messages, want_second), CUT, NAMED)
    cacheless.shutdown()
    want = [turn(want_other), turn(want_first), turn(want_second, second_grammar), turn(want_third, third_grammar)]
    for k, (g, w) in enumerate(zip(got["turns"], want)):
        assert {**g, "cached_tokens": 0} == w, k
    # the grammar held: the call is whole and in the schema; cut short, the call is not complete
    (call,) = second["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) in ({"city": "Rome"}, {"city": "Oslo"})
    assert second["grammar"] == {"completed": True, "failed": False, "consumed": len(second["output_ids"]) - 1}
    assert third["grammar"] == {"completed": False, "failed": False, "consumed": len(third["output_ids"]) - 1}
