"""Regenerate tests/data/chat_conformance.json: the vendors' renderings of tests/chat_corpus.py.

    python tests/data/make_chat_conformance.py --k3-vendor DIR --k2-template FILE

DIR holds the vendor's `encoding_k3.py` (vllm-project/vllm `vllm/tokenizers/encoding_k3.py`; its one vLLM import,
`VLLMValidationError`, replaced by a ValueError subclass), run outside this repository: K3 texts and segments
come from its `build_chat_segments`. FILE is ggml-org/llama.cpp `models/templates/moonshotai-Kimi-K2-Thinking.jinja`
with `tools | tojson()` restored to the vendor's `tools | tojson(separators=(',', ':'))`: K2 texts come from
transformers' `apply_chat_template(..., tokenize=False)` with that template, the tools deep-sorted by key first
(as the vendor's tokenization_kimi.py does). Neither vendor file is part of this repository.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from chat_corpus import ERROR_CASES, cases  # noqa: E402


def deep_sorted(value):
    if isinstance(value, dict):
        return {k: deep_sorted(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [deep_sorted(v) for v in value]
    return value


def k3_kwargs(options: dict) -> dict:
    kw = dict(options)
    if kw.get("thinking_effort") == "none":
        del kw["thinking_effort"]
        kw["reasoning_effort"] = "none"
    return kw


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k3-vendor", required=True, type=Path)
    ap.add_argument("--k2-template", required=True, type=Path)
    ap.add_argument("--source", required=True, help="where the vendor files came from (recorded in the data)")
    args = ap.parse_args()
    spec = importlib.util.spec_from_file_location("encoding_k3", args.k3_vendor / "encoding_k3.py")
    k3 = importlib.util.module_from_spec(spec)
    sys.modules["encoding_k3"] = k3
    spec.loader.exec_module(k3)
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]")))
    template = args.k2_template.read_text()
    out = {"source": args.source, "cases": {}, "errors": {}}
    for case in cases():
        messages = copy.deepcopy(case["messages"])
        if case["family"] == "k3":
            segs = k3.build_chat_segments(messages, case["tools"], **k3_kwargs(case["options"]))
            out["cases"][case["id"]] = {"text": "".join(s.text for s in segs), "segments": [[s.text, s.allow_special] for s in segs]}
        else:
            tools = deep_sorted(case["tools"]) if case["tools"] else None
            text = hf.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False,
                                          add_generation_prompt=case["options"].get("add_generation_prompt", True))
            out["cases"][case["id"]] = {"text": text}
    for cid, _family, messages, tools, options in ERROR_CASES:
        try:
            k3.build_chat_segments(copy.deepcopy(messages), tools, **k3_kwargs(options))
        except (ValueError, TypeError) as exc:
            out["errors"][cid] = str(exc)
        else:
            raise SystemExit(f"{cid}: the vendor accepted it")
    path = Path(__file__).with_name("chat_conformance.json")
    path.write_text(json.dumps(out, ensure_ascii=False, indent=1) + "\n")
    print(f"{path}: {len(out['cases'])} cases, {len(out['errors'])} errors")


if __name__ == "__main__":
    main()
