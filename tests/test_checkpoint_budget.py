"""The prefix cache's recurrent-state checkpoints have a budget (`limits.checkpoints_per_slot`): checked in the recipe
(file, line and field named), priced by the planner where the checkpoints live (the rank's own memory on a CPU target,
pinned host memory beside a GPU), refused when they leave no room for one max_seq_len sequence, written into
config.json and allocated by the runner, so an engine built with more holds more and evicts later."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from moe_export.common.errors import InputError
from moe_export.common.recipe import MAX_CHECKPOINTS_PER_SLOT, LimitsSection, load_recipe, shipped_dir
from moe_export.export.plan.planner import make_plan

HEAD = "name: bad\nmodel:\n  source: x\n  config: kimi-k3\ntarget:\n  gpu: h100\n  nodes: 1\n  gpus_per_node: 8\n"


def with_checkpoints(recipe, per_slot: int, **target):
    """`recipe` with limits.checkpoints_per_slot = per_slot (and target fields replaced)."""
    update = {"limits": recipe.limits.model_copy(update={"checkpoints_per_slot": per_slot})}
    if target:
        update["target"] = recipe.target.model_copy(update=target)
    return recipe.model_copy(update=update)


def run_cli(*args):
    return subprocess.run([sys.executable, "-c", "from moe_export.runtime.entrypoints.cli import main; main()", *args],
                          capture_output=True, text=True)


@pytest.mark.parametrize("value, problem", [("-1", "greater than or equal to 0"),
                                            (str(MAX_CHECKPOINTS_PER_SLOT + 1), f"less than or equal to {MAX_CHECKPOINTS_PER_SLOT}"),
                                            ("many", "valid integer"), ("2.5", "valid integer")])
def test_a_bad_checkpoints_per_slot_names_file_line_and_field(tmp_path, value, problem):
    p = tmp_path / "bad.yaml"
    p.write_text(HEAD + f"limits:\n  max_batch: 4\n  checkpoints_per_slot: {value}\n")
    with pytest.raises(InputError) as err:
        load_recipe(p)
    assert f"{p}:11: limits.checkpoints_per_slot: " in str(err.value) and problem in str(err.value)
    res = run_cli("plan", "--recipe", str(p))
    assert res.returncode == 2 and f"{p}:11: limits.checkpoints_per_slot" in res.stderr
    assert "Traceback" not in res.stderr


def test_recipes_without_the_field_keep_at_least_the_old_four():
    assert LimitsSection().checkpoints_per_slot >= 4
    for path in sorted(shipped_dir().glob("*.yaml")):  # none of them sets it
        assert load_recipe(path)[0].limits.checkpoints_per_slot == LimitsSection().checkpoints_per_slot


def test_the_plan_prices_the_checkpoint_pool_where_it_lives():
    """CPU target (tiny-cpu): 32 more checkpoints per slot take 32 x max_batch x one slot's state from the rank's
    memory, so the cache blocks are what is left after them; beside a GPU (h100x64) they are pinned host memory:
    the GPU's blocks stay, the host's run peak grows by the same bytes."""
    for name, on_cpu in (("tiny-cpu.yaml", True), ("h100x64.yaml", False)):
        rec = load_recipe(name)[0]
        few, many = make_plan(with_checkpoints(rec, 4)), make_plan(with_checkpoints(rec, 36))
        for a, b in zip(few.per_rank, many.per_rank):
            slot = a.pools.bytes_per_slot
            extra = 32 * rec.limits.max_batch * slot
            assert slot > 0 and b.pools.num_checkpoints == 36 * rec.limits.max_batch
            assert b.pools.checkpoint_host_bytes - a.pools.checkpoint_host_bytes == extra
            assert b.host_bytes["run"] - a.host_bytes["run"] == extra
            assert b.to_dict()["checkpoint_host_bytes"] == b.pools.num_checkpoints * slot
            if on_cpu:
                assert b.memory["state_checkpoints"] - a.memory["state_checkpoints"] == extra
                left = b.free_bytes - rec.limits.max_batch * slot - b.pools.num_checkpoints * slot
                assert b.pools.num_blocks == left // b.pools.bytes_per_block < a.pools.num_blocks
                assert a.margin_bytes - b.margin_bytes == extra
                parts = [v for k, v in b.memory.items() if not k.startswith("workspace.") and k not in ("total", "capacity")]
                assert b.memory["total"] == sum(parts)
            else:
                assert "state_checkpoints" not in b.memory and b.pools.num_blocks == a.pools.num_blocks
                assert b.margin_bytes == a.margin_bytes


def test_checkpoints_that_leave_no_room_for_one_sequence_are_refused(tmp_path):
    """tiny-cpu with just enough memory for its slots, one max_seq_len sequence and 1,000 checkpoints per slot:
    16 per slot fit, 4,096 do not, and `plan` exits 2 naming the field."""
    rec = load_recipe("tiny-cpu.yaml")[0]
    bare = make_plan(with_checkpoints(rec, 0))
    seq_blocks = -(-rec.limits.max_seq_len // rec.limits.block_size)
    need = max(bare.memory_bytes - r.free_bytes + rec.limits.max_batch * r.pools.bytes_per_slot
               + seq_blocks * r.pools.bytes_per_block + 1000 * rec.limits.max_batch * r.pools.bytes_per_slot
               for r in bare.per_rank)
    gib = need / 2**30
    assert make_plan(with_checkpoints(rec, 16, memory_gib=gib)).fits
    tight = make_plan(with_checkpoints(rec, 4096, memory_gib=gib))
    assert not tight.fits and "limits.checkpoints_per_slot=4096" in tight.verdict()
    text = (shipped_dir() / "tiny-cpu.yaml").read_text().replace("memory_gib: 2", f"memory_gib: {gib!r}")
    text = text.replace("limits:\n", "limits:\n  checkpoints_per_slot: 4096\n")
    p = tmp_path / "tight.yaml"
    p.write_text(text)
    res = run_cli("plan", "--recipe", str(p))
    said = " ".join(res.stderr.split())  # (rich wraps lines)
    assert res.returncode == 2 and "lower limits.checkpoints_per_slot" in said and "Traceback" not in said


def test_pinned_checkpoints_beyond_a_nodes_host_memory_are_refused(tmp_path):
    """h100x64 (8 ranks a node): a node's run-time host memory is its 8 ranks' pinned checkpoints and read buffers;
    with target.host_memory_gib just above it the plan fits, just below it does not, the verdict naming both fields;
    `plan` exits 2 on such a recipe, and a CPU target refuses the field (its ranks plan in target.memory_gib)."""
    rec = load_recipe("h100x64.yaml")[0]
    plan = make_plan(rec)
    node = max(plan.host_run_bytes_per_node())
    assert node == sum(r.host_bytes["run"] for r in plan.per_rank[:8]) > 8 * 16 * rec.limits.max_batch * 2**20
    assert plan.to_dict()["host_run_bytes_per_node"] == node and plan.to_dict()["host_memory_bytes_per_node"] is None
    roomy = make_plan(with_checkpoints(rec, 16, host_memory_gib=(node + 2**20) / 2**30))
    assert roomy.fits and roomy.to_dict()["host_memory_bytes_per_node"] >= node
    short = make_plan(with_checkpoints(rec, 16, host_memory_gib=(node - 2**20) / 2**30))
    assert not short.fits and "target.host_memory_gib" in short.verdict()
    assert "limits.checkpoints_per_slot=16" in short.verdict() and short.to_dict()["fits"] is False
    text = (shipped_dir() / "h100x64.yaml").read_text().replace("memory_gib: 80", "memory_gib: 80\n  host_memory_gib: 4")
    p = tmp_path / "small-host.yaml"
    p.write_text(text)
    res = run_cli("plan", "--recipe", str(p))
    said = " ".join(res.stderr.split())
    assert res.returncode == 2 and "target.host_memory_gib is 4" in said and "Traceback" not in said
    cpu = (shipped_dir() / "tiny-cpu.yaml").read_text().replace("memory_gib: 2", "memory_gib: 2\n  host_memory_gib: 4")
    p.write_text(cpu)
    with pytest.raises(InputError, match="host_memory_gib is for GPU targets"):
        load_recipe(p)


def tail(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, 500, n).tolist()


def cached_tokens(core, rid: str, prompt: list[int], session: str | None = None) -> int:
    """Run a request (naming `session`, if given) to its end (3 greedy tokens): the prompt tokens it took from the
    prefix cache."""
    from moe_export.runtime.core.contracts import Request
    from moe_export.runtime.sampling import SamplingParams

    core.add(Request(rid, prompt, SamplingParams(max_tokens=3, ignore_eos=True), session=session))
    cached = 0
    while core.has_work:
        for u in core.step():
            if u.request_id == rid:
                cached = max(cached, u.cached_tokens)
    return cached


BASE = tail(70, 99)  # shared prompt head: each 90-token prompt is checkpointed at 64 (interval) and 80 (last boundary)


def test_an_engine_built_with_more_checkpoints_per_slot_evicts_later(runtime_engine):
    """Engines built with 1 and 2 checkpoints per slot (max_batch 6): config.json records the value, the runner
    allocates 6 and 12 checkpoints; after four 90-token prompts (2 checkpoints each) the first one's are gone from
    the smaller pool only."""
    from moe_export.common.engine_config import CONFIG
    from moe_export.runtime.core.engine_core import EngineCore
    from moe_export.runtime.engine.ort import Engine

    resumed = {}
    for per_slot in (1, 2):
        engine_dir = runtime_engine("tiny-k3", 1, 1, 1, checkpoints_per_slot=per_slot)
        written = json.loads((engine_dir / CONFIG).read_text())
        assert written["limits"]["checkpoints_per_slot"] == written["recipe"]["limits"]["checkpoints_per_slot"] == per_slot
        eng = Engine(engine_dir, threads=1)
        assert eng.checkpoint_interval == 64 and eng.num_checkpoints == 6 * per_slot
        assert all(len(rows) == 6 * per_slot for rows in eng.ranks[0].checkpoints.values())
        core = EngineCore(eng, keep_sessions=False)
        assert cached_tokens(core, "first", BASE + tail(20, 0)) == 0
        for i in range(1, 4):
            assert cached_tokens(core, f"other{i}", tail(90, i)) == 0
        assert core.stats()["prefix_checkpoints"] == min(8, 6 * per_slot)
        resumed[per_slot] = cached_tokens(core, "again", BASE + tail(25, 10))
    assert resumed == {1: 0, 2: 64}
