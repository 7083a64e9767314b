"""`moe-export eval`: checks, task-file validation, the multi-round tool loop, and the whole run per tier
on a tiny engine (its answers are noise: the pipeline is what is tested, plus each tier's reasoning cap)."""

from __future__ import annotations

import asyncio
import json

import pytest
from conftest import run_cli
from moe_export.common.errors import InputError
from moe_export.runtime.entrypoints.eval import (
    EvalTask,
    check_answer,
    load_tasks,
    run_task,
)
from moe_export.runtime.entrypoints.llm import ChatOutput


def call(name: str, args: dict, idx: int = 0) -> dict:
    return {"id": f"functions.{name}:{idx}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def test_checks_pass_and_fail():
    assert check_answer({"type": "exact", "value": "42"}, " 42\n", [])
    assert not check_answer({"type": "exact", "value": "42"}, "42.0", [])
    assert check_answer({"type": "regex", "pattern": r"\b4\d\b"}, "it is 42.", [])
    assert not check_answer({"type": "regex", "pattern": r"^\d+$"}, "forty-two", [])
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    assert check_answer({"type": "json_schema", "schema": schema}, '```json\n{"n": 3}\n```', [])
    assert not check_answer({"type": "json_schema", "schema": schema}, '{"n": "3"}', [])
    assert not check_answer({"type": "json_schema", "schema": schema}, "not json", [])
    want = {"type": "tool_call", "name": "weather", "arguments": {"city": "Paris"}}
    assert check_answer(want, None, [call("time", {}), call("weather", {"city": "Paris", "unit": "C"}, 1)])
    assert not check_answer(want, None, [call("weather", {"city": "Rome"})])
    assert not check_answer(want, None, [{"id": "x", "type": "function", "function": {"name": "weather", "arguments": "{bad"}}])


@pytest.mark.parametrize("line,message", [
    ('{"id": "a", "prompt": "x", "check": {"type": "fuzzy"}}', "check must be"),
    ('{"id": "a", "prompt": "x", "check": {"type": "regex", "pattern": "("}}', "does not compile"),
    ('{"id": "a", "prompt": "x", "check": {"type": "json_schema", "schema": {"type": 5}}}', "invalid JSON schema"),
    ('{"id": "a", "check": {"type": "exact", "value": "y"}}', "give messages"),
    ('{"id": "a", "prompt": "x", "check": {"type": "exact", "value": "y"}, "tool_results": {"f": 3}}', "tool_results"),
    ('{"id": "a", "prompt": "x", "check": {"type": "exact", "value": "y"}, "max_rounds": 0}', "max_rounds"),
    ('[1]', "JSON object"),
])
def test_bad_task_lines_are_named(tmp_path, line, message):
    path = tmp_path / "tasks.jsonl"
    path.write_text('{"id": "ok", "prompt": "p", "check": {"type": "exact", "value": "v"}}\n' + line + "\n")
    with pytest.raises(InputError, match=message) as exc:
        load_tasks(path)
    assert "line 2" in str(exc.value)


class ScriptedChat:
    """Stands in for AsyncLLM.chat in the round-loop unit test: replies from a script, records what it got."""

    def __init__(self, replies):
        from moe_export.runtime.sampling import SamplingParams

        self.default_sampling = SamplingParams()
        self.replies = list(replies)
        self.seen = []

    async def chat(self, messages, sampling, *, tools=None, reasoning_effort=None):
        self.seen.append(([dict(m) for m in messages], reasoning_effort))
        content, calls = self.replies.pop(0)
        usage = {"prompt_tokens": 10, "completion_tokens": 5, "reasoning_tokens": 2, "cached_tokens": 0}
        return ChatOutput("r", [], [], "", "r", content, calls, "tool_calls" if calls else "stop", usage, None)


def test_multi_round_tool_loop_feeds_scripted_results_in_call_order():
    task = EvalTask("t", [{"role": "user", "content": "weather in Paris then Rome?"}],
                    {"type": "regex", "pattern": "sunny.*rain"}, tools=[{"type": "function", "function": {"name": "weather"}}],
                    tool_results={"weather": ["sunny", "rain"]}, max_rounds=4)
    llm = ScriptedChat([(None, [call("weather", {"city": "Paris"})]), (None, [call("weather", {"city": "Rome"}, 1)]),
                        ("Paris is sunny, Rome has rain", [])])
    result = asyncio.run(run_task(llm, task, "high"))
    assert result["passed"] and result["rounds"] == 3 and result["output_tokens"] == 15 and result["reasoning_tokens"] == 6
    second_round, effort = llm.seen[1]
    assert effort == "high"
    assert second_round[-2]["role"] == "assistant" and second_round[-2]["tool_calls"][0]["function"]["name"] == "weather"
    assert second_round[-1] == {"role": "tool", "tool_call_id": "functions.weather:0", "name": "weather", "content": "sunny"}
    assert llm.seen[2][0][-1]["content"] == "rain"
    capped = ScriptedChat([(None, [call("weather", {})])] * 2)  # max_rounds stops a model that never answers
    task.max_rounds = 2
    assert asyncio.run(run_task(capped, task, "low"))["rounds"] == 2


THINKING_CAPS = {"low": 5, "high": 8, "max": 12}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """tiny-k3 on one rank with room for tool declarations (max_seq_len 1024) and small thinking caps."""
    import yaml
    from moe_export.common.recipe import load_recipe
    from moe_export.export.build import build

    root = tmp_path_factory.mktemp("eval-engine")
    data = yaml.safe_load(load_recipe("tiny-cpu.yaml")[1].read_text())
    data.update(name="eval-tiny", parallel={"tp": 1, "ep": 1}, thinking=THINKING_CAPS)
    data["target"]["gpus_per_node"] = 1
    data["limits"].update({"max_batch": 8, "max_seq_len": 1024, "max_num_tokens": 256})
    (root / "eval.yaml").write_text(yaml.safe_dump(data))
    build(load_recipe(root / "eval.yaml")[0], root / "engine")
    return root / "engine"


def test_eval_cli_report_and_plot_per_tier(engine, tmp_path, capsys):
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    tasks = [
        {"id": "anything", "prompt": "Say something.", "check": {"type": "regex", "pattern": r"(?s).*"}, "max_tokens": 20},
        {"id": "exact", "prompt": "Reply with 7.", "check": {"type": "exact", "value": "7"}, "max_tokens": 4},
        {"id": "schema", "prompt": "JSON please", "check": {"type": "json_schema", "schema": {"type": "object"}},
         "max_tokens": 4},
        {"id": "tool", "messages": [{"role": "user", "content": "look up cat"}], "tools": tools,
         "check": {"type": "tool_call", "name": "lookup", "arguments": {"q": "cat"}}, "max_tokens": 4},
        {"id": "multi", "messages": [{"role": "user", "content": "look up dog, then answer"}], "tools": tools,
         "tool_results": {"lookup": ["a dog is an animal"]}, "check": {"type": "regex", "pattern": "animal"},
         "max_rounds": 3, "max_tokens": 4},
    ]
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(json.dumps(t) for t in tasks) + "\n")
    out = tmp_path / "report"
    code, stdout, err = run_cli(capsys, "eval", str(engine), "--tasks", str(path), "--tiers", "low,high,max", "--out", str(out))
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    assert report["tier_order"] == ["low", "high", "max"] and set(report["tiers"]) == {"low", "high", "max"}
    assert json.loads((engine / "config.json").read_text())["thinking"] == THINKING_CAPS
    for row in report["tiers"].values():
        assert row["tasks"] == 5 and 0.0 <= row["pass_rate"] <= 1.0 and row["avg_rounds"] >= 1, json.dumps(report["results"])
        assert row["latency_s"]["p50"] > 0 and row["latency_s"]["p95"] >= row["latency_s"]["p50"]
    by = {(r["id"], r["tier"]): r for r in report["results"]}
    for (task_id, tier), r in by.items():
        assert r["error"] is None, r
        assert r["reasoning_tokens"] <= THINKING_CAPS[tier] * r["rounds"], r  # each tier's thinking cap held
        assert r["output_tokens"] <= (20 if task_id == "anything" else 4) * r["rounds"]
    # 20 tokens leave room past every cap (+ the forced close marker): the tier decides how many were reasoning
    assert [by[("anything", t)]["reasoning_tokens"] for t in ("low", "high", "max")] == [5, 8, 12]
    assert all(by[("anything", t)]["passed"] for t in ("low", "high", "max"))
    assert (out / "tiers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    assert matplotlib.image.imread(out / "tiers.png").shape[2] in (3, 4)
    assert "pass rate" in stdout

    code, _, err = run_cli(capsys, "eval", str(engine), "--tasks", str(path), "--tiers", "low,ultra", "--out", str(out))
    assert code == 2 and "--tiers" in err
    code, _, err = run_cli(capsys, "eval", str(engine), "--tasks", str(tmp_path / "none.jsonl"), "--out", str(out))
    assert code == 2 and "no such file" in err


def test_tier_plot_points_count_output_tokens_once_and_share_labels():
    """Output tokens already include the reasoning (37.3 per task is plotted at 37.3, not 74.6); tiers landing on
    the same point share one label instead of overlapping ones."""
    from moe_export.runtime.entrypoints.eval import plot_points

    def row(reasoning, output, rate):
        return {"avg_reasoning_tokens": reasoning, "avg_output_tokens": output, "pass_rate": rate}

    report = {"tier_order": ["low", "high", "max"],
              "tiers": {"low": row(20.0, 37.3, 0.5), "high": row(30.0, 50.0, 0.8), "max": row(30.0, 50.0, 0.8)}}
    assert plot_points(report) == [("low", 37.3, 0.5), ("high, max", 50.0, 0.8)]
