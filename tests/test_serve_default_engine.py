"""The embedded default recipe (tiny-cpu.yaml, built as shipped) serves real chat features: a json_schema
request and a 4-turn Responses chain fit its context."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema

SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}


def test_json_schema_and_a_four_turn_responses_chain_fit_the_default_engine(default_engine):
    from moe_export.runtime.entrypoints.llm import AsyncLLM
    from moe_export.runtime.entrypoints.server.app import ServerSettings, create_app

    async def main(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=600) as client:
            chat = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Where shall we go, and for how long?"}], "temperature": 0,
                "max_tokens": 64, "reasoning_effort": "none",
                "response_format": {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}}})
            assert chat.status_code == 200, chat.text
            jsonschema.validate(json.loads(chat.json()["choices"][0]["message"]["content"]), SCHEMA)
            previous = None
            for turn in range(4):
                body = {"input": f"Turn {turn}: tell me one more thing about Rome.", "max_output_tokens": 24,
                        "temperature": 0, "reasoning": {"effort": "low"}}
                if previous is not None:
                    body["previous_response_id"] = previous
                r = await client.post("/v1/responses", json=body)
                assert r.status_code == 200, (turn, r.text)
                previous = r.json()["id"]
            return r.json()["usage"]["input_tokens"]

    allm = AsyncLLM(default_engine, default_effort="low")
    try:
        prompt_tokens = asyncio.run(main(create_app(allm, ServerSettings(default_engine, accept_any_model=True))))
    finally:
        allm.shutdown()
    assert prompt_tokens > 512  # the fourth turn's prompt alone is over the old 512-token context
