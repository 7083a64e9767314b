"""Serving throughput and latency of `moe-export serve` against the in-process runtime.

Builds the tiny-k3 preset (world 1, ONNX Runtime, 16 sequences), starts `moe-export serve` as a
subprocess on loopback, and measures in interleaved rounds (equal repetitions):
  - server at 1, 4 and 16 concurrent clients: each client streams chat completions (greedy, thinking
    off, fixed length via `max_tokens`) through the official `openai` async client; aggregate generated
    tokens/s, and p50 / p99 time to first token (first streamed delta);
  - in-process runtime at 16 sequences: `LLM.chat` on the same 16 conversations in one call (the baseline
    a user would run without HTTP).
  - structured output: seeded, sampled (temperature 1) json_schema requests over 5 schemas (strings,
    enums, nested objects, arrays, optional / nullable fields), 16 in flight: the fraction whose content
    parses (strict JSON) and validates against its schema. String lengths are bounded so that a random-weight
    model ends them; what the grammar must guarantee is that whatever it writes parses.
  - prefix caching: on an engine with a 4,096-token context, `--prefix-requests` (32) requests sharing a
    2,000-token preamble (token ids, /v1/completions) with different 50-token suffixes, sent one after
    another (each alone, so TTFT is its prefill, not queueing), to a server with prefix caching and to one
    started with --no-prefix-caching: TTFT = time to the first streamed chunk (max_tokens 1). The first
    request of the cached run is a miss; the second resumes from the last periodic state checkpoint below
    2,000 and checkpoints the divergence point; the others resume there and prefill their 50 tokens.
Throughput rounds use prompts that differ per round from their first token on, so they measure prefill
as before (no prefix is shared across rounds).
Prints `serve_speedup_16` (aggregate tokens/s at 16 clients / at 1, goal >= 4), `serve_overhead_16`
(server tokens/s at 16 / in-process tokens/s at 16, goal >= 0.85), `structured_valid_rate` (goal 1.0) and
`prefix_cache_ttft_speedup` (mean TTFT without the cache / with it, goal >= 5).

    python benchmarks/serve.py [--tokens 32] [--rounds 2] [--structured 100] [--prefix-requests 32] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from serve_support import build_serve_engine, start_cli_server, stop_process  # noqa: E402

CLIENTS = (1, 4, 16)
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "note": {"type": "string", "maxLength": 20}},
     "required": ["name", "note"], "additionalProperties": False},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M", "L"]},
                                      "count": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["colour", "size", "count"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 10}, "location": {"type": "object", "properties": {
            "lat": {"type": "number", "minimum": -90, "maximum": 90}, "lon": {"type": "number", "minimum": -180, "maximum": 180}},
            "required": ["lat", "lon"], "additionalProperties": False}}, "required": ["name", "location"],
        "additionalProperties": False}}, "required": ["city"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 4},
                                      "scores": {"type": "array", "items": {"type": "integer", "maximum": 9}, "minItems": 1,
                                                 "maxItems": 3}},
     "required": ["tags", "scores"], "additionalProperties": False},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 16}, "subtitle": {"type": ["string", "null"], "maxLength": 8},
                                      "year": {"anyOf": [{"type": "integer", "maximum": 2100}, {"type": "null"}]},
                                      "draft": {"type": "boolean"}},
     "required": ["title", "year"], "additionalProperties": False},
]


def conversation(i: int, nonce: int = 0) -> list[dict]:
    return [{"role": "user", "content": f"{nonce} Client {i}: summarize the history of city number {i} in detail."}]


PREAMBLE, SUFFIX = 2000, 50
PREFIX_LIMITS = {"max_seq_len": 4096}


async def prefix_round(url: str, requests: int) -> list[float]:
    """TTFT (s) of each of `requests` completions sharing a PREAMBLE-token prefix with SUFFIX-token tails, one at a
    time (max_tokens 1, streamed: the first chunk comes once the first token is sampled)."""
    import numpy as np
    import openai

    rng = np.random.default_rng(0)
    preamble = rng.integers(100, 500, PREAMBLE).tolist()
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600) as client:
        await client.completions.create(model="m", prompt=rng.integers(100, 500, 64).tolist(), max_tokens=1)  # warm-up
        ttfts = []
        for _ in range(requests):
            prompt = preamble + rng.integers(100, 500, SUFFIX).tolist()
            start = time.perf_counter()
            stream = await client.completions.create(model="m", prompt=prompt, max_tokens=1, temperature=0, stream=True)
            first = None
            async for chunk in stream:
                if first is None and chunk.choices:
                    first = time.perf_counter() - start
            ttfts.append(first)
    return ttfts


def prefix_cache_run(root: Path, requests: int) -> dict:
    """TTFTs of `prefix_round` on a server with prefix caching, then on one without."""
    engine = build_serve_engine(root, limits=PREFIX_LIMITS)
    out = {}
    for label, extra in (("cached", []), ("uncached", ["--no-prefix-caching"])):
        proc, url = start_cli_server([str(engine), "--default-effort", "none", "--served-model-name", "m", *extra])
        try:
            out[label] = asyncio.run(prefix_round(url, requests))
        finally:
            stop_process(proc)
    return out


async def client_round(url: str, clients: int, tokens: int, nonce: int = 0) -> tuple[float, list[float]]:
    """(generated tokens per second over the round, time to first token of each request in s)."""
    import openai

    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600) as client:
        async def one(i: int) -> tuple[int, float]:
            start = time.perf_counter()
            ttft, generated = None, 0
            stream = await client.chat.completions.create(
                model="m", messages=conversation(i, nonce), max_tokens=tokens, temperature=0, reasoning_effort="none",
                stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            async for chunk in stream:
                if ttft is None and chunk.choices and chunk.choices[0].delta.content:
                    ttft = time.perf_counter() - start
                if chunk.usage is not None:
                    generated = chunk.usage.completion_tokens
            return generated, ttft if ttft is not None else time.perf_counter() - start

        start = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(clients)))
        elapsed = time.perf_counter() - start
    return sum(g for g, _ in results) / elapsed, [t for _, t in results]


async def structured_round(url: str, requests: int) -> float:
    """Fraction of seeded json_schema answers that parse strictly and validate."""
    import jsonschema
    import openai

    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600) as client:
        gate = asyncio.Semaphore(16)

        async def one(i: int) -> bool:
            schema = SCHEMAS[i % len(SCHEMAS)]
            async with gate:
                r = await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": f"Answer {i} as JSON."}], max_tokens=300,
                    temperature=1.0, seed=i, reasoning_effort="none",
                    response_format={"type": "json_schema", "json_schema": {"name": f"s{i % len(SCHEMAS)}", "schema": schema}})
            try:
                jsonschema.validate(json.loads(r.choices[0].message.content or ""), schema)
            except (json.JSONDecodeError, jsonschema.ValidationError):
                return False
            return True

        results = await asyncio.gather(*(one(i) for i in range(requests)))
    return sum(results) / len(results)


def in_process_round(llm, tokens: int, nonce: int = 0) -> float:
    from moe_export.runtime.sampling import SamplingParams

    sampling = SamplingParams(max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.chat([conversation(i, nonce) for i in range(16)], sampling, reasoning_effort="none")
    elapsed = time.perf_counter() - start
    return sum(len(o.output_ids) for o in outs) / elapsed


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def run(tokens: int, rounds: int, structured: int, prefix_requests: int) -> dict:
    from moe_export.runtime.client.llm import LLM

    load_start = os.getloadavg()[0]

    with tempfile.TemporaryDirectory() as tmp:
        engine = build_serve_engine(Path(tmp))
        llm = LLM(engine, default_effort="none")
        # the server gets this process's thread count, as the in-process baseline has it (the test helper pins
        # servers to one OpenMP thread, which a user's `moe-export serve` does not do)
        proc, url = start_cli_server([str(engine), "--default-effort", "none", "--served-model-name", "m"],
                                     env={"OMP_NUM_THREADS": str(torch_threads())})
        try:
            asyncio.run(client_round(url, 1, 4))  # warm-up (first request compiles nothing, but pages in)
            in_process_round(llm, 4)
            rates = {n: [] for n in CLIENTS}
            ttfts = {n: [] for n in CLIENTS}
            local: list[float] = []
            nonce = 1
            for _ in range(rounds):
                for n in CLIENTS:
                    rate, firsts = asyncio.run(client_round(url, n, tokens, nonce))
                    nonce += 1
                    rates[n].append(rate)
                    ttfts[n].extend(firsts)
                local.append(in_process_round(llm, tokens, nonce))
                nonce += 1
            valid = asyncio.run(structured_round(url, structured)) if structured else None
        finally:
            stop_process(proc)
            llm.shutdown()
        prefix = prefix_cache_run(Path(tmp), prefix_requests) if prefix_requests else None
    result = {"tokens_per_request": tokens, "rounds": rounds}
    for n in CLIENTS:
        result[f"serve_tokens_per_s_{n}"] = statistics.median(rates[n])
        result[f"serve_ttft_p50_s_{n}"] = percentile(ttfts[n], 0.5)
        result[f"serve_ttft_p99_s_{n}"] = percentile(ttfts[n], 0.99)
    result["in_process_tokens_per_s_16"] = statistics.median(local)
    result["loadavg_1min"] = os.getloadavg()[0]
    result["serve_speedup_16"] = result["serve_tokens_per_s_16"] / result["serve_tokens_per_s_1"]
    result["serve_overhead_16"] = result["serve_tokens_per_s_16"] / result["in_process_tokens_per_s_16"]
    if valid is not None:
        result["structured_requests"] = structured
        result["structured_valid_rate"] = valid
    if prefix is not None:
        result["prefix_requests"] = prefix_requests
        for label, values in prefix.items():
            result[f"prefix_ttft_mean_s_{label}"] = statistics.fmean(values)
            result[f"prefix_ttft_p50_s_{label}"] = percentile(values, 0.5)
        result["prefix_cache_ttft_speedup"] = result["prefix_ttft_mean_s_uncached"] / result["prefix_ttft_mean_s_cached"]
    result["loadavg_1min_start"] = load_start
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32, help="generated tokens per request")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (medians are reported)")
    parser.add_argument("--structured", type=int, default=100, help="json_schema requests for structured_valid_rate (0: skip)")
    parser.add_argument("--prefix-requests", type=int, default=32,
                        help="requests sharing a 2,000-token preamble for prefix_cache_ttft_speedup (0: skip)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (seconds): checks the script runs, no figures")
    args = parser.parse_args()
    if args.smoke:
        args.tokens, args.rounds, args.structured, args.prefix_requests = 2, 1, 2, 2
    start = time.perf_counter()
    result = run(args.tokens, args.rounds, args.structured, args.prefix_requests)
    result["wall_s"] = time.perf_counter() - start
    for key, value in result.items():
        print(f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}")
    print(f"serve_speedup_16 {result['serve_speedup_16']:.2f}x (goal >= 4): "
          f"{'met' if result['serve_speedup_16'] >= 4 else 'NOT met'}")
    print(f"serve_overhead_16 {result['serve_overhead_16']:.2f} (goal >= 0.85): "
          f"{'met' if result['serve_overhead_16'] >= 0.85 else 'NOT met'}")
    if "structured_valid_rate" in result:
        print(f"structured_valid_rate {result['structured_valid_rate']:.3f} (goal 1.0): "
              f"{'met' if result['structured_valid_rate'] == 1.0 else 'NOT met'}")
    if "prefix_cache_ttft_speedup" in result:
        print(f"prefix_cache_ttft_speedup {result['prefix_cache_ttft_speedup']:.2f}x (goal >= 5): "
              f"{'met' if result['prefix_cache_ttft_speedup'] >= 5 else 'NOT met'}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
