"""An agent loop through `moe-export serve`: each round forced to call a tool, what the server prefills per round.

    python benchmarks/agent_loop.py [--rounds 30] [--apis chat,responses,messages] [--choices named,required]
        [--restart-round 15] [--restart-repeats 5] [--no-warm-turns] [--work DIR] [--json PATH]
    python benchmarks/agent_loop.py --smoke      # 3 rounds, Responses named, restart after round 2 measured twice
                                                 # (a test runs it)

Engine: tiny-cpu.yaml (the embedded default recipe, synthetic tiny-k3) built as the serving tests build it
(`tests/serve_support.py` `build_serve_engine`: world 1, so no mpiexec on a 2-core machine) with max_seq_len 32,768
(the shipped 4,096 holds about 8 rounds of this loop) and max_batch 2; built once into --work and reused. The server
is `moe-export serve ENGINE --default-effort low --served-model-name agent --store WORK/responses.sqlite`, with
`--no-warm-turns` when given (the mode is printed): without warm turns a `required` round prefills the model's
previous output itself; with them (the default) the server prefills it between rounds (`Scheduler.add_warm`).

One conversation per (API, tool choice), greedy (temperature 0; this `anthropic` client has no such argument, so
there it goes in `extra_body`), on the official clients:
  - `chat`: `openai` chat completions, the whole history resent each round (the assistant message as returned,
    its streamed `reasoning_content` included, as K3 wants every past turn's reasoning back, then a `tool` message);
  - `responses`: `openai` Responses, each round only the `function_call_output`, chained by `previous_response_id`;
  - `messages`: `anthropic` messages, the whole history resent (the `tool_use` blocks as returned, then a
    `tool_result`).
Tool choice `named` forces the function by name; `required` is "required" (OpenAI) / {"type": "any"} (Anthropic).
Round 1 is one user message; every later round adds the tool's output: 100-300 tokens (seeded by the round) of
words from a fixed list.


Per round: `input` (prompt tokens: chat `prompt_tokens`, Responses `input_tokens`, messages `input_tokens` +
`cache_read_input_tokens` + `cache_creation_input_tokens`), `cached` (`prompt_tokens_details.cached_tokens` /
`input_tokens_details.cached_tokens` / `cache_read_input_tokens`), `uncached` = input - cached (what the server
prefilled), `output` (completion / output tokens), `new` = input - the previous round's input (the growth of the
prompt), `ideal` = new - the previous round's output (the tokens no cache can hold), `ttft_s` (time from sending the
request to the first streamed delta; the client is built before the clock starts, below) and `wall_s`; `warm` is the
growth of the server's `moe_export_warm_prefill_tokens_total` since the previous round's response (the tokens warm turns prefilled between rounds: the previous round's output rendered as
the next prompt holds it; scraped right after each response, so a round's figure may hold the warm turn of the
round itself rather than of the one before; the sums are exact). The summary adds `uncached_sum`, `warm_sum` and
their total, the prefill work of the run wherever it was done.
Over rounds 2..N per (API, choice), the round after a restart excepted: medians and maxima of uncached / new / ideal and of the per-round ratios
uncached / ideal and uncached / new. Goals (issue 38): `named`: uncached / ideal median <= 1.2 and max <= 1.8
(1.5x the median goal; the next prompt continues the previous prompt and output); `required` / `any`: uncached /
new median <= 1.1 and max <= 1.65 (the format inserts the tool-choice text before the continuation, so the cache
must reach the exact divergence point). Each printed as met / NOT met.

Restart (Responses runs, after round --restart-round): the server is stopped, its store (database and offloaded
state) copied, and the next round measured as --restart-repeats interleaved pairs, each server started on a fresh
copy of that store: first with --no-prefix-caching, where the round's request is sent once (TTFT of re-prefilling
the whole chain; that response is not continued), then as before, resuming the chain (`restart_ttft_s`); the last
pair's second server serves the rest of the loop and its response is the round's (`restart_uncached`). One TTFT of
~0.15 s moves by 20-40 ms between runs on this machine, so the ratio `restart_ttft_over_reprefill` is the median
of the pairs' ratios (each pair's in `pairs`); goals: the restart round's uncached meets the run's goal and that
median <= 0.1.

Each conversation keeps one client per server start, as an agent keeps its client: it is built before the round's
clock starts (building an `openai` / `anthropic` client takes ~20 ms, mostly its TLS context, which the server's
work does not include) and its connection is reused from round to round.

`loadavg` is read before and after; numbers taken while other work loads the machine are not evidence.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from serve_support import build_serve_engine, start_cli_server, stop_process  # noqa: E402

APIS = ("chat", "responses", "messages")
CHOICES = ("named", "required")
MODEL = "agent"
LIMITS = {"max_seq_len": 32768, "max_batch": 2, "max_num_tokens": 512}
MAX_OUTPUT_TOKENS = 512  # a random-weight model's forced call takes 130-200 tokens
GOALS = {"named": ("ideal", 1.2), "required": ("new", 1.1)}
MAX_OVER_MEDIAN_GOAL = 1.5
RESTART_TTFT_GOAL = 0.1
TOOL = {"name": "search", "description": "Search the project's notes for a short query.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 24}},
                       "required": ["query"], "additionalProperties": False}}
WORDS = ("kernel cache block prefill decode token router expert latent state chunk window scan sparse index "  # noqa: SIM905 (one string is easier to edit than 31 quoted words)
         "topk softmax rank shard queue batch stream sample logit prompt reply agent tool search result note").split()
TASK = "Find out why the nightly build got slower. Search the notes one query at a time and report what you find."


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def tool_output(round_no: int, url: str) -> str:
    """The tool's answer in round `round_no`: 100-300 tokens (seeded by the round) of words from a fixed list, cut to
    that many tokens by the server's /tokenize and /detokenize."""
    rng = random.Random(round_no)
    tokens = rng.randint(100, 300)
    text = " ".join(rng.choice(WORDS) for _ in range(tokens))
    ids = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": text}, timeout=60).json()["tokens"]
    return httpx.post(f"{url}/detokenize", json={"model": MODEL, "tokens": ids[:tokens]}, timeout=60).json()["prompt"]


class Server:
    """`moe-export serve` on the benchmark's engine and store (restartable)."""

    def __init__(self, engine: Path, store: Path, flags: tuple[str, ...] = ()) -> None:
        self.engine, self.store, self.flags = engine, store, flags
        self.proc = None
        self.url = ""
        self.warm_seen = 0.0  # the warm prefill counter at the last `warm_tokens()`

    def start(self, *extra: str) -> None:
        self.proc, self.url = start_cli_server([str(self.engine), "--default-effort", "low", "--served-model-name",
                                                MODEL, "--store", str(self.store), "--no-access-log", *self.flags, *extra])
        self.warm_seen = 0.0

    def warm_tokens(self) -> int:
        """Tokens warm turns prefilled since the last call (the server's counter; 0 after a restart)."""
        text = httpx.get(f"{self.url}/metrics", timeout=60).text
        value = next((float(line.split()[1]) for line in text.splitlines()
                      if line.startswith("moe_export_warm_prefill_tokens_total ")), 0.0)
        grown, self.warm_seen = value - self.warm_seen, value
        return int(grown)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None


class Conversation:
    """One agent conversation on one API; `step(tool_text)` sends a round (None: the first) and returns its
    figures."""

    def __init__(self, api: str, choice: str, server: Server) -> None:
        self.api, self.choice, self.server = api, choice, server
        self.history: list = [{"role": "user", "content": TASK}]
        self.previous_id: str | None = None
        self.call_id: str | None = None
        self._client, self._client_url = None, ""

    def client(self):
        """The official client for this API, one per server start (a new server listens on a new port), kept as an
        agent keeps its client: built before a round's clock starts (building one takes ~20 ms, mostly its TLS
        context) and reusing its connection."""
        if self._client is None or self._client_url != self.server.url:
            if self.api == "messages":
                import anthropic
                self._client = anthropic.Anthropic(base_url=self.server.url, api_key="none", max_retries=0, timeout=3600)
            else:
                import openai
                self._client = openai.OpenAI(base_url=f"{self.server.url}/v1", api_key="none", max_retries=0,
                                             timeout=3600)
            self._client_url = self.server.url
        return self._client

    def step(self, tool_text: str | None, keep: bool = True) -> dict:
        """Send one round (adding `tool_text` as the answer to the last call); `keep=False` sends it without
        continuing the conversation from it."""
        send = {"chat": self._chat, "responses": self._responses, "messages": self._messages}[self.api]
        client = self.client()
        start = time.perf_counter()
        ttft, usage, turn = send(client, tool_text, start)
        wall = time.perf_counter() - start
        if keep:
            self._keep(tool_text, turn)
        return {**usage, "uncached": usage["input"] - usage["cached"], "warm": self.server.warm_tokens(),
                "ttft_s": round(ttft, 4), "wall_s": round(wall, 4)}

    def _chat(self, client, tool_text, start):
        messages = self.history + ([{"role": "tool", "tool_call_id": self.call_id, "content": tool_text}]
                                   if tool_text is not None else [])
        choice = {"type": "function", "function": {"name": TOOL["name"]}} if self.choice == "named" else "required"
        stream = client.chat.completions.create(
            model=MODEL, messages=messages, tools=[{"type": "function", "function": TOOL}], tool_choice=choice,
            temperature=0, max_tokens=MAX_OUTPUT_TOKENS, stream=True, stream_options={"include_usage": True})
        ttft, usage, content, reasoning, calls = None, None, "", "", {}
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                if ttft is None and (c.delta.content or c.delta.tool_calls or getattr(c.delta, "reasoning_content", None)):
                    ttft = time.perf_counter() - start
                content += c.delta.content or ""
                reasoning += getattr(c.delta, "reasoning_content", None) or ""
                for tc in c.delta.tool_calls or []:
                    call = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                    call["id"] = tc.id or call["id"]
                    if tc.function is not None:
                        call["name"] += tc.function.name or ""
                        call["arguments"] += tc.function.arguments or ""
        if not calls:
            raise RuntimeError(f"chat/{self.choice}: the forced tool call is missing (content {content[:80]!r})")
        message = {"role": "assistant", "content": content or None, "reasoning_content": reasoning,
                   "tool_calls": [{"id": c["id"], "type": "function",
                                   "function": {"name": c["name"], "arguments": c["arguments"]}}
                                  for _, c in sorted(calls.items())]}
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        return ttft, {"input": usage.prompt_tokens, "cached": cached or 0, "output": usage.completion_tokens}, message

    def _responses(self, client, tool_text, start):
        if tool_text is None:
            items = [{"role": "user", "content": TASK}]
        else:
            items = [{"type": "function_call_output", "call_id": self.call_id, "output": tool_text}]
        choice = {"type": "function", "name": TOOL["name"]} if self.choice == "named" else "required"
        stream = client.responses.create(
            model=MODEL, input=items, previous_response_id=self.previous_id, tools=[{"type": "function", **TOOL}],
            tool_choice=choice, temperature=0, max_output_tokens=MAX_OUTPUT_TOKENS, stream=True)
        ttft, final = None, None
        for event in stream:
            if ttft is None and event.type.endswith(".delta"):
                ttft = time.perf_counter() - start
            if event.type in ("response.completed", "response.incomplete", "response.failed"):
                final = event.response
        if final is None or final.status != "completed":
            raise RuntimeError(f"responses/{self.choice}: the response did not complete "
                               f"({final.incomplete_details if final is not None else 'no final event'})")
        calls = [item for item in final.output if item.type == "function_call"]
        if not calls:
            raise RuntimeError(f"responses/{self.choice}: the forced tool call is missing")
        u = final.usage
        cached = u.input_tokens_details.cached_tokens if u.input_tokens_details else 0
        return ttft, {"input": u.input_tokens, "cached": cached or 0, "output": u.output_tokens}, (final.id, calls[-1].call_id)

    def _messages(self, client, tool_text, start):
        messages = self.history + ([{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": self.call_id, "content": tool_text}]}] if tool_text is not None else [])
        choice = {"type": "tool", "name": TOOL["name"]} if self.choice == "named" else {"type": "any"}
        tools = [{"name": TOOL["name"], "description": TOOL["description"], "input_schema": TOOL["parameters"]}]
        ttft = None
        with client.messages.stream(model=MODEL, messages=messages, tools=tools, tool_choice=choice,
                                           max_tokens=MAX_OUTPUT_TOKENS, extra_body={"temperature": 0}) as stream:
            for event in stream:
                if ttft is None and event.type == "content_block_delta":
                    ttft = time.perf_counter() - start
            final = stream.get_final_message()
        uses = [b for b in final.content if b.type == "tool_use"]
        if not uses:
            raise RuntimeError(f"messages/{self.choice}: the forced tool_use block is missing")
        u = final.usage
        cached = u.cache_read_input_tokens or 0
        total = u.input_tokens + cached + (u.cache_creation_input_tokens or 0)
        blocks = [b.model_dump(exclude_none=True) for b in final.content]
        return ttft, {"input": total, "cached": cached, "output": u.output_tokens}, {"role": "assistant", "content": blocks}

    def _keep(self, tool_text, turn) -> None:
        if self.api == "responses":
            self.previous_id, self.call_id = turn
            return
        if tool_text is not None:
            self.history.append({"role": "tool", "tool_call_id": self.call_id, "content": tool_text}
                                if self.api == "chat" else
                                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": self.call_id,
                                                              "content": tool_text}]})
        self.history.append(turn)
        self.call_id = (turn["tool_calls"][-1]["id"] if self.api == "chat"
                        else [b for b in turn["content"] if b["type"] == "tool_use"][-1]["id"])


def add_growth(rounds: list[dict]) -> None:
    """`new` and `ideal` of each round after the first, from the previous round's input and output."""
    for prev, cur in zip(rounds, rounds[1:]):
        cur["new"] = cur["input"] - prev["input"]
        cur["ideal"] = cur["new"] - prev["output"]


def summarize(rounds: list[dict], choice: str, restart_round: int | None) -> dict:
    """Medians / maxima over rounds 2..N but the one after a restart (reported on its own) and the goal of
    `choice`."""
    later = [r for i, r in enumerate(rounds[1:], start=2) if i != restart_round]
    out = {}
    for key in ("uncached", "new", "ideal", "ttft_s"):
        values = [r[key] for r in later]
        out[f"{key}_median"], out[f"{key}_max"] = statistics.median(values), max(values)
    base, goal = GOALS[choice]
    ratios = [r["uncached"] / max(r[base], 1) for r in later]
    out["goal"] = f"uncached / {base}: median <= {goal}, max <= {goal * MAX_OVER_MEDIAN_GOAL:.2f}"
    out["ratio_median"], out["ratio_max"] = round(statistics.median(ratios), 3), round(max(ratios), 3)
    out["met"] = out["ratio_median"] <= goal and out["ratio_max"] <= goal * MAX_OVER_MEDIAN_GOAL
    out["warm_median"] = statistics.median(r["warm"] for r in later)
    out["uncached_sum"], out["warm_sum"] = sum(r["uncached"] for r in later), sum(r["warm"] for r in later)
    return out


def restart_round_pairs(conv: Conversation, server: Server, tool_text: str, repeats: int) -> dict:
    """The round after a restart, measured `repeats` times as interleaved pairs on a copy of the store taken when the
    server stopped (each start gets that copy back, so no attempt sees another's state): a server started with
    --no-prefix-caching re-prefilling the whole chain, then one started as before resuming it. The last pair's
    second server goes on serving the loop, its response continuing the conversation. -> that round's figures,
    with `pairs` [{reprefill_ttft_s, reprefill_uncached, restart_ttft_s, restart_uncached, ratio}]."""
    server.stop()
    snapshot = server.store.parent / f"{server.store.name}.snapshot"
    shutil.rmtree(snapshot, ignore_errors=True)
    snapshot.mkdir()
    for path in server.store.parent.glob(f"{server.store.name}*"):
        if path != snapshot:
            (shutil.copytree if path.is_dir() else shutil.copy2)(path, snapshot / path.name)

    def restore() -> None:
        for path in server.store.parent.glob(f"{server.store.name}*"):
            if path != snapshot:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        for path in snapshot.iterdir():
            (shutil.copytree if path.is_dir() else shutil.copy2)(path, server.store.parent / path.name)

    pairs, figures = [], None
    for n in range(repeats):
        restore()
        server.start("--no-prefix-caching")
        reprefill = conv.step(tool_text, keep=False)
        server.stop()
        restore()
        server.start()
        last = n == repeats - 1
        figures = conv.step(tool_text, keep=last)
        if not last:
            server.stop()
        pairs.append({"reprefill_ttft_s": reprefill["ttft_s"], "reprefill_uncached": reprefill["uncached"],
                      "restart_ttft_s": figures["ttft_s"], "restart_uncached": figures["uncached"],
                      "ratio": round(figures["ttft_s"] / reprefill["ttft_s"], 4)})
    shutil.rmtree(snapshot)
    return {**figures, "pairs": pairs}


def run_loop(api: str, choice: str, server: Server, rounds: int, restart_round: int, restart_repeats: int = 1) -> dict:
    conv = Conversation(api, choice, server)
    figures, restart = [], None
    for r in range(1, rounds + 1):
        tool_text = tool_output(r, server.url) if r > 1 else None
        if api == "responses" and r == restart_round + 1:
            figures.append(restart_round_pairs(conv, server, tool_text, restart_repeats))
            pairs = figures[-1].pop("pairs")
            restart = {"round": r, "reprefill_uncached": pairs[-1]["reprefill_uncached"],
                       "restart_uncached": figures[-1]["uncached"], "pairs": pairs,
                       "reprefill_ttft_s": statistics.median(p["reprefill_ttft_s"] for p in pairs),
                       "restart_ttft_s": statistics.median(p["restart_ttft_s"] for p in pairs),
                       "restart_ttft_over_reprefill": round(statistics.median(p["ratio"] for p in pairs), 3)}
        else:
            figures.append(conv.step(tool_text))
        print(f"  {api}/{choice} round {r}: " + " ".join(f"{k}={v}" for k, v in figures[-1].items()), flush=True)
    add_growth(figures)
    out = {"rounds": figures, **summarize(figures, choice, restart["round"] if restart else None)}
    if restart is not None:
        cur = figures[restart["round"] - 1]
        base, goal = GOALS[choice]
        restart["restart_ratio"] = round(cur["uncached"] / max(cur[base], 1), 3)
        restart["met"] = restart["restart_ratio"] <= goal and restart["restart_ttft_over_reprefill"] <= RESTART_TTFT_GOAL
        out["restart"] = restart
    return out


def run(work: Path, rounds: int, apis: list[str], choices: list[str], restart_round: int, warm_turns: bool = True,
        restart_repeats: int = 1) -> dict:
    engine = build_serve_engine(work, limits=LIMITS)  # content-addressed: a rerun in the same --work reuses it
    result = {"loadavg_before": loadavg(), "rounds": rounds, "engine": "tiny-cpu.yaml, synthetic tiny-k3, world 1, "
              + ", ".join(f"{k} {v}" for k, v in LIMITS.items()), "warm_turns": warm_turns, "runs": {}}
    for api in apis:
        for choice in choices:
            store = work / f"responses-{api}-{choice}.sqlite"
            for path in work.glob(f"{store.name}*"):  # the database, its WAL files and its offloaded state
                shutil.rmtree(path) if path.is_dir() else path.unlink()
            server = Server(engine, store, () if warm_turns else ("--no-warm-turns",))
            server.start()
            try:
                result["runs"][f"{api}/{choice}"] = run_loop(api, choice, server, rounds, restart_round, restart_repeats)
            finally:
                server.stop()
    result["loadavg_after"] = loadavg()
    return result


def report(result: dict) -> None:
    print(f"\nagent loop, {result['rounds']} rounds, {result['engine']}; warm turns "
          f"{'on' if result['warm_turns'] else 'off (--no-warm-turns)'}; loadavg {result['loadavg_before']} -> "
          f"{result['loadavg_after']}")
    print("API/choice          uncached med/max   new med/max   ideal med/max   ratio med/max   goal")
    for name, run_ in result["runs"].items():
        print(f"{name:<19} {run_['uncached_median']:>7}/{run_['uncached_max']:<7} {run_['new_median']:>6}/"
              f"{run_['new_max']:<6} {run_['ideal_median']:>6}/{run_['ideal_max']:<7} {run_['ratio_median']:>6}/"
              f"{run_['ratio_max']:<7} {run_['goal']}: {'met' if run_['met'] else 'NOT met'}")
        print(f"  prefill work: uncached {run_['uncached_sum']} + warm {run_['warm_sum']} = "
              f"{run_['uncached_sum'] + run_['warm_sum']} tokens; warm per round median {run_['warm_median']}")
        if "restart" in run_:
            rs = run_["restart"]
            print(f"  restart before round {rs['round']}: uncached {rs['restart_uncached']} (ratio "
                  f"{rs['restart_ratio']}), TTFT {rs['restart_ttft_s']} s vs re-prefill {rs['reprefill_ttft_s']} s "
                  f"({rs['reprefill_uncached']} tokens): {rs['restart_ttft_over_reprefill']} (goal <= "
                  f"{RESTART_TTFT_GOAL}): {'met' if rs['met'] else 'NOT met'}")
            print("    pairs (re-prefill s, restart s, ratio): " + "; ".join(
                f"{p['reprefill_ttft_s']}, {p['restart_ttft_s']}, {p['ratio']}" for p in rs["pairs"]))


def names(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    chosen = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in chosen if n not in allowed]
    if bad or not chosen:
        raise SystemExit(f"{flag}: unknown {bad or 'empty list'}; choose from {', '.join(allowed)}")
    return chosen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--apis", default=",".join(APIS), help=f"comma-separated among {', '.join(APIS)}")
    ap.add_argument("--choices", default=",".join(CHOICES), help="comma-separated among named, required")
    ap.add_argument("--restart-round", type=int, default=15, help="Responses: restart the server after this round")
    ap.add_argument("--work", type=Path, default=None, help="folder for the engine and stores (default: a temporary one)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--restart-repeats", type=int, default=5, help="the restart round measured as this many "
                    "interleaved pairs (re-prefill, resume) on copies of the store; the ratio is their median")
    ap.add_argument("--smoke", action="store_true", help="3 rounds, Responses named, restart after round 2")
    ap.add_argument("--no-warm-turns", action="store_true", help="serve with --no-warm-turns (the next round prefills "
                    "the model's previous output itself)")
    args = ap.parse_args()
    apis, choices = names(args.apis, APIS, "--apis"), names(args.choices, CHOICES, "--choices")
    rounds, restart_round = args.rounds, args.restart_round
    if args.smoke:
        rounds, restart_round, apis, choices = 3, 2, ["responses"], ["named"]
        args.restart_repeats = 2
    if args.restart_repeats < 1:
        raise SystemExit(f"--restart-repeats {args.restart_repeats}: at least 1")
    if rounds < 2:
        raise SystemExit(f"--rounds {rounds}: at least 2 (figures are taken over rounds 2..N)")
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        result = {"smoke": args.smoke, **run(work, rounds, apis, choices, restart_round, not args.no_warm_turns,
                                                   args.restart_repeats)}
    report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
