"""`moe-export eval`: checkable tasks through the chat path, once per thinking tier; pass rate, rounds,
token cost and latency per tier (report.json) and a pass-rate-vs-tokens plot (tiers.png).

Task file: JSONL, one task per line:
  {"id": "t1",
   "messages": [...chat messages...]          (or "prompt": "text", a single user message)
   "tools": [...OpenAI tool declarations...]  (optional)
   "check": {"type": "exact", "value": "..."}                       final content equals value (stripped)
          | {"type": "regex", "pattern": "..."}                     re.search on the final content
          | {"type": "json_schema", "schema": {...}}                final content is JSON valid under schema
          | {"type": "tool_call", "name": "f", "arguments": {...}}   some round calls f with these arguments
                                                                    (every given key equal; others free)
   "tool_results": {"f": "result" | ["1st call's result", "2nd", ...]}  (optional: scripted tool results;
                   with them the task runs multi-round: each round's tool calls get these results back)
   "max_rounds": 4, "max_tokens": 256}        (optional)
Scaffolding is fixed per run (same messages, tools, scripted results, greedy sampling); only the tier
(reasoning_effort) changes. All tasks of a tier run concurrently through one AsyncLLM.
"""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_export.common.errors import InputError
from moe_export.runtime.client.protocol import EngineClient

CHECK_TYPES = ("exact", "regex", "json_schema", "tool_call")


@dataclass
class EvalTask:
    id: str
    messages: list[dict]
    check: dict
    tools: list | None = None
    tool_results: dict | None = None
    max_rounds: int = 4
    max_tokens: int = 256


def _validate_check(check: Any, where: str) -> dict:
    if not isinstance(check, dict) or check.get("type") not in CHECK_TYPES:
        raise InputError(f"{where}: check must be an object with type one of {', '.join(CHECK_TYPES)}")
    kind = check["type"]
    if kind == "exact" and not isinstance(check.get("value"), str):
        raise InputError(f"{where}: an exact check needs a string value")
    if kind == "regex":
        try:
            re.compile(check.get("pattern"))
        except (re.error, TypeError) as exc:
            raise InputError(f"{where}: regex pattern {check.get('pattern')!r} does not compile ({exc})") from None
    if kind == "json_schema":
        import jsonschema

        try:
            jsonschema.validators.validator_for(check.get("schema", {})).check_schema(check.get("schema"))
        except jsonschema.SchemaError as exc:
            raise InputError(f"{where}: invalid JSON schema ({exc.message})") from None
    if kind == "tool_call" and (not isinstance(check.get("name"), str)
                                or not isinstance(check.get("arguments", {}), dict)):
        raise InputError(f"{where}: a tool_call check needs a string name and an arguments object")
    return check


def load_tasks(path: str | Path) -> list[EvalTask]:
    """Parse and validate the task file; InputError naming the line on any problem."""
    src = Path(path)
    if not src.is_file():
        raise InputError(f"--tasks {path}: no such file")
    tasks: list[EvalTask] = []
    seen: set[str] = set()
    for line_no, line in enumerate(src.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path} line {line_no}"
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(raw, dict):
            raise InputError(f"{where}: expected a JSON object")
        task_id = str(raw.get("id", f"line{line_no}"))
        if task_id in seen:
            raise InputError(f"{where}: duplicate task id {task_id}")
        seen.add(task_id)
        if isinstance(raw.get("prompt"), str):
            messages = [{"role": "user", "content": raw["prompt"]}]
        elif isinstance(raw.get("messages"), list) and raw["messages"]:
            messages = raw["messages"]
        else:
            raise InputError(f"{where}: give messages (a non-empty list) or prompt (a string)")
        results = raw.get("tool_results")
        if results is not None and not (isinstance(results, dict) and all(
                isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v)) for v in results.values())):
            raise InputError(f"{where}: tool_results maps a tool name to a string or a list of strings")
        rounds, max_tokens = raw.get("max_rounds", 4), raw.get("max_tokens", 256)
        if not (isinstance(rounds, int) and rounds >= 1 and isinstance(max_tokens, int) and max_tokens >= 1):
            raise InputError(f"{where}: max_rounds and max_tokens must be integers >= 1")
        tasks.append(EvalTask(task_id, messages, _validate_check(raw.get("check"), where), raw.get("tools"),
                              results, rounds, max_tokens))
    if not tasks:
        raise InputError(f"--tasks {path}: no tasks")
    return tasks


def _json_payload(text: str):
    body = text.strip()
    if body.startswith("```"):
        body = body.split("\n", 1)[1] if "\n" in body else ""
        body = body.rsplit("```", 1)[0]
    return json.loads(body)


def _arguments(call: dict) -> dict | None:
    try:
        args = json.loads(call["function"]["arguments"])
    except (KeyError, TypeError, json.JSONDecodeError):
        return None
    return args if isinstance(args, dict) else None


def check_answer(check: dict, content: str | None, tool_calls: list[dict]) -> bool:
    """Does the final content (or, for tool_call, any call made in any round) satisfy the check?"""
    kind = check["type"]
    if kind == "tool_call":
        want = check.get("arguments", {})
        for call in tool_calls:
            args = _arguments(call)
            if call.get("function", {}).get("name") == check["name"] and args is not None and all(
                    k in args and args[k] == v for k, v in want.items()):
                return True
        return False
    text = content or ""
    if kind == "exact":
        return text.strip() == check["value"].strip()
    if kind == "regex":
        return re.search(check["pattern"], text) is not None
    import jsonschema

    try:
        jsonschema.validate(_json_payload(text), check["schema"])
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def _scripted_result(task: EvalTask, name: str, calls_so_far: dict[str, int]) -> str:
    given = (task.tool_results or {}).get(name)
    index = calls_so_far.get(name, 0)
    calls_so_far[name] = index + 1
    if given is None:
        return json.dumps({"error": f"no scripted result for tool {name}"})
    if isinstance(given, str):
        return given
    return given[index] if index < len(given) else json.dumps({"error": f"tool {name} called more often than scripted"})


async def run_task(llm: EngineClient, task: EvalTask, tier: str) -> dict:
    """One task at one tier -> {id, passed, rounds, reasoning_tokens, output_tokens, latency_s, error}."""
    from moe_export.runtime.request_options import parse_request_options

    messages = [dict(m) for m in task.messages]
    sampling = parse_request_options({"max_tokens": task.max_tokens}, llm.default_sampling,
                                     where=f"task {task.id}").sampling
    calls: list[dict] = []
    calls_by_name: dict[str, int] = {}
    result = {"id": task.id, "tier": tier, "passed": False, "rounds": 0, "reasoning_tokens": 0, "output_tokens": 0,
              "prompt_tokens": 0, "latency_s": 0.0, "error": None, "final_content": None}
    start = time.perf_counter()
    try:
        while True:
            out = await llm.chat(messages, sampling, tools=task.tools, reasoning_effort=tier)
            result["rounds"] += 1
            result["reasoning_tokens"] += out.usage.get("reasoning_tokens", 0)
            result["output_tokens"] += out.usage["completion_tokens"]
            result["prompt_tokens"] += out.usage["prompt_tokens"]
            calls.extend(out.tool_calls)
            result["final_content"] = out.content
            if not (out.tool_calls and task.tool_results is not None and result["rounds"] < task.max_rounds):
                break
            messages.append(out.message())  # as generated: the next round continues the kept state
            for call in out.tool_calls:
                name = call["function"]["name"]
                messages.append({"role": "tool", "tool_call_id": call["id"], "name": name,
                                 "content": _scripted_result(task, name, calls_by_name)})
        result["passed"] = check_answer(task.check, result["final_content"], calls)
    except InputError as exc:
        result["error"] = str(exc)
    result["latency_s"] = time.perf_counter() - start
    return result


def summarize_tier(results: list[dict]) -> dict:
    latencies = sorted(r["latency_s"] for r in results)
    n = len(results)
    return {
        "tasks": n,
        "passed": sum(r["passed"] for r in results),
        "pass_rate": sum(r["passed"] for r in results) / n,
        "errors": sum(r["error"] is not None for r in results),
        "avg_rounds": statistics.fmean(r["rounds"] for r in results),
        "avg_reasoning_tokens": statistics.fmean(r["reasoning_tokens"] for r in results),
        "avg_output_tokens": statistics.fmean(r["output_tokens"] for r in results),
        "avg_prompt_tokens": statistics.fmean(r["prompt_tokens"] for r in results),
        "latency_s": {"mean": statistics.fmean(latencies), "p50": latencies[n // 2],
                      "p95": latencies[min(n - 1, int(round(0.95 * (n - 1))))]},
    }


async def run_eval_async(engine_dir: str, tasks: list[EvalTask], tiers: list[str]) -> dict:
    from moe_export.runtime.client.async_llm import AsyncLLM

    llm = AsyncLLM(engine_dir, warm_turns=False)  # one-shot tasks, never continued: no warm turns
    try:
        per_tier, rows = {}, []
        for tier in tiers:
            results = await asyncio.gather(*(run_task(llm, task, tier) for task in tasks))
            per_tier[tier] = summarize_tier(results)
            rows.extend(results)
        return {"engine": str(engine_dir), "tier_order": tiers, "tiers": per_tier, "results": rows}
    finally:
        llm.shutdown()


def parse_tiers(text: str) -> list[str]:
    from moe_export.runtime.core.budget import EFFORT_TIERS

    tiers = [t.strip() for t in text.split(",") if t.strip()]
    allowed = (*EFFORT_TIERS, "none")
    bad = [t for t in tiers if t not in allowed]
    if not tiers or bad:
        raise InputError(f"--tiers {text!r}: expected a comma-separated list of {', '.join(allowed)}")
    if len(set(tiers)) != len(tiers):
        raise InputError(f"--tiers {text!r}: a tier is listed twice")
    return tiers


def plot_points(report: dict) -> list[tuple[str, float, float]]:
    """(label, mean output tokens per task, pass rate) of each distinct point of the tier plot, in tier order; tiers
    that land on the same point share one label ("low, high"). Output tokens already include the reasoning."""
    points: dict[tuple[float, float], list[str]] = {}
    for tier in report["tier_order"]:
        row = report["tiers"][tier]
        points.setdefault((row["avg_output_tokens"], row["pass_rate"]), []).append(tier)
    return [(", ".join(names), x, y) for (x, y), names in points.items()]


def plot_tiers(report: dict, path: Path) -> None:
    """Pass rate against mean output tokens per task (reasoning included) for each tier, atomically written PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from moe_export.common.atomic import atomic_path

    tiers = report["tier_order"]
    xs = [report["tiers"][t]["avg_output_tokens"] for t in tiers]
    ys = [report["tiers"][t]["pass_rate"] for t in tiers]
    fig, ax = plt.subplots(figsize=(5, 3.5), dpi=100)
    ax.plot(xs, ys, marker="o")
    for label, x, y in plot_points(report):
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4))
    ax.set_xlabel("output tokens per task (reasoning included, mean)")
    ax.set_ylabel("pass rate")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("pass rate by thinking tier")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)


def run_eval(engine_dir: str, tasks_path: str, tiers_text: str, out_dir: str) -> dict:
    """The whole `moe-export eval`: writes OUT/report.json and OUT/tiers.png; returns the report."""
    from moe_export.common.atomic import atomic_write_json

    tiers = parse_tiers(tiers_text)
    tasks = load_tasks(tasks_path)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out_dir}: exists and is not a folder")
    report = asyncio.run(run_eval_async(engine_dir, tasks, tiers))
    report["tasks_file"] = str(tasks_path)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "report.json", report)
    plot_tiers(report, out / "tiers.png")
    return report
