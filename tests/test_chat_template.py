"""Checkpoint chat templates: rendered by our sandboxed Jinja environment exactly as transformers'
`apply_chat_template` renders them (transformers is the oracle, run live on the same template and messages),
loaded from `chat_template.jinja` or `tokenizer_config.json`, carried into a built engine, used by `serve`'s
/tokenize, named by `inspect`; typed special-token strings stay text; the sandbox holds."""

from __future__ import annotations

import copy
import json

import pytest
from moe_export.common.errors import InputError
from moe_export.export.convert.synth import write_synthetic_tokenizer
from moe_export.runtime.chat import generation_prompt_ids, render, render_ids
from moe_export.runtime.formats.template import ChatTemplate
from moe_export.runtime.tokenizer import load_tokenizer

# Written for these tests (role tokens as K2 / Kimi Linear use them): trim / lstrip blocks, loop controls,
# namespace, tojson arguments, generation blocks, special-token variables, None-dropped keys, reasoning alias.
ROLE_TEMPLATE = """
{%- if tools -%}
  <|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>
{%- endif -%}
{%- set ns = namespace(has_system=false, calls=0) -%}
{%- for m in messages -%}
  {%- if m.role == 'system' %}{% set ns.has_system = true %}{% break %}{% endif -%}
{%- endfor -%}
{%- if not ns.has_system -%}
  <|im_system|>system<|im_middle|>{{ bos_token }}You are helpful.<|im_end|>
{%- endif %}
{% for m in messages %}
  {% if m.role == 'user' %}<|im_user|>{{ m.name or 'user' }}<|im_middle|>
  {% elif m.role == 'assistant' %}<|im_assistant|>assistant<|im_middle|>
  {% else %}<|im_system|>{{ m.name or m.role }}<|im_middle|>
  {% endif %}
  {%- if m.role == 'tool' %}## Return of {{ m.tool_call_id }}
{% endif -%}
  {%- if m.content is string %}{{ m.content }}{% elif m.content %}{% for p in m.content %}{% if p.type != 'text' %}{% continue %}{% endif %}{{ p.text }}{% endfor %}{% endif -%}
  {%- if m.role == 'assistant' -%}
    {% generation %}<think>{{ m.reasoning_content | default('') }}</think>{% endgeneration %}
    {%- for c in m.tool_calls | default([]) -%}
      {%- set ns.calls = ns.calls + 1 -%}
      <|tool_call_begin|>{{ c.id }}<|tool_call_argument_begin|>{{ c.function.arguments if c.function.arguments is string else c.function.arguments | tojson(indent=1, sort_keys=true) }}<|tool_call_end|>
    {%- endfor -%}
  {%- endif -%}
  <|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif -%}
{%- if ns.calls > 2 %}{{ raise_exception('too many calls: ' ~ ns.calls) }}{% endif -%}
"""
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"unit": {"type": "string"}, "city": {"type": "string"}}}}}
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Sys"}, {"role": "user", "content": "Hi <|im_end|> there", "name": "ann"}],
    [{"role": "user", "content": [{"type": "text", "text": "a "}, {"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "b"}]},
     {"role": "assistant", "content": None, "reasoning": "via alias", "tool_calls": [
         {"id": "functions.get_weather:0", "type": "function", "function": {"name": "get_weather", "arguments": {"z": 1, "a": [1, 2]}}}]},
     {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny 東京"},
     {"role": "assistant", "content": "Done.", "reasoning_content": "wrap up"}],
]


def oracle(template: str, messages, tools=None, add_generation_prompt=True) -> str:
    """transformers' apply_chat_template with the same template and special tokens."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"[UNK]": 0, "[BOS]": 1, "[EOS]": 2}, unk_token="[UNK]")),
                                 bos_token="[BOS]", eos_token="[EOS]")
    return hf.apply_chat_template(copy.deepcopy(messages), tools=tools, chat_template=template, tokenize=False,
                                  add_generation_prompt=add_generation_prompt)


def ours(template: str, **specials) -> ChatTemplate:
    return ChatTemplate(template, "test", {"bos_token": "[BOS]", "eos_token": "[EOS]", **specials}, sort_tools=False)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("tools", [None, [WEATHER]])
def test_renders_as_transformers(messages, add_generation_prompt, tools):
    want = oracle(ROLE_TEMPLATE, messages, tools, add_generation_prompt)
    got = render(messages, chat_template=ours(ROLE_TEMPLATE), tools=tools, add_generation_prompt=add_generation_prompt)
    assert got == want


def test_template_errors_and_sandbox():
    calls = [{"id": f"c{k}", "function": {"name": "f", "arguments": "{}"}} for k in range(3)]
    with pytest.raises(InputError, match="too many calls: 3"):
        render([{"role": "assistant", "content": "", "tool_calls": calls}], chat_template=ours(ROLE_TEMPLATE))
    with pytest.raises(InputError, match="SecurityError"):
        render([], chat_template=ours("{{ ''.__class__.__mro__ }}"))
    with pytest.raises(InputError, match="SecurityError"):
        render([], chat_template=ours("{% set ns = namespace(_x=1) %}"))
    with pytest.raises(InputError, match="does not parse"):
        render([], chat_template=ours("{% for %}"))
    assert render([], chat_template=ours("{{ strftime_now('%Y') | length }}")) == "4"


def test_token_ids_equal_transformers_sanitized_encoding(tmp_path):
    """A tokenizer.json checkpoint with a chat template: our ids equal transformers' apply_chat_template(tokenize=True,
    sanitize_control_tokens=True) on the same files, a typed `<|im_end|>` in a message included (text, not a marker)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>", "<think>", "</think>",
                "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>", "[BOS]", "[EOS]"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(["Hello world, the weather is sunny in Paris. You are helpful. Return of tool calls"] * 50, trainer)
    bpe.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "[BOS]", "eos_token": "[EOS]", "chat_template": ROLE_TEMPLATE}))
    tok = load_tokenizer(tmp_path)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), bos_token="[BOS]", eos_token="[EOS]")
    for messages in CONVERSATIONS:
        want = hf.apply_chat_template(copy.deepcopy(messages), tools=[WEATHER], chat_template=ROLE_TEMPLATE, tokenize=True,
                                      add_generation_prompt=True, sanitize_control_tokens=True, return_dict=False)
        assert render_ids(tok, messages, tools=[WEATHER]) == want


def _kimi_dir(tmp_path, family="k2", **config):
    d = tmp_path / "tok"
    d.mkdir(parents=True)
    write_synthetic_tokenizer(d, family, 4096)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, **config}))
    return d


def test_loaded_from_the_checkpoint_and_used_for_ids(tmp_path):
    d = _kimi_dir(tmp_path, chat_template=ROLE_TEMPLATE)
    tok = load_tokenizer(d)
    assert tok.chat_template is not None and "tokenizer_config.json" in tok.chat_template.origin
    tools = [WEATHER]
    for messages in CONVERSATIONS:
        # Kimi tokenizers deep-sort the tools before rendering (the vendor's tokenization_kimi.py does)
        sorted_tools = json.loads(json.dumps(tools, sort_keys=True))
        want = oracle(ROLE_TEMPLATE, messages, sorted_tools)
        ids = render_ids(tok, messages, tools=tools)
        assert tok.decode(ids) == want
        # the template's markers are special tokens; the user's typed "<|im_end|>" is text
        im_end = tok.encode_special("<|im_end|>")
        assert ids.count(im_end) == want.count("<|im_end|>") - "".join(str(m.get("content")) for m in messages).count("<|im_end|>")
    gen = generation_prompt_ids(tok, "k2", True)
    assert tok.decode(gen) == "<|im_assistant|>assistant<|im_middle|>"
    # chat_template.jinja takes precedence; named templates pick tool_use with tools, else default
    (d / "chat_template.jinja").write_text("FILE{{ messages | length }}")
    assert render_ids(load_tokenizer(d), CONVERSATIONS[0]) == load_tokenizer(d).encode("FILE1")
    (d / "chat_template.jinja").unlink()
    named = _kimi_dir(tmp_path / "named", chat_template=[{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}])
    tok = load_tokenizer(named)
    assert tok.decode(render_ids(tok, CONVERSATIONS[0])) == "D"
    assert tok.decode(render_ids(tok, CONVERSATIONS[0], tools=[WEATHER])) == "T"
    with pytest.raises(InputError, match="chat_template must be a string"):
        load_tokenizer(_kimi_dir(tmp_path / "bad", chat_template=5))


def test_engine_carries_the_template_and_serve_tokenizes_with_it(tmp_path, capsys):
    """A Kimi Linear checkpoint shipping chat_template.jinja: the build copies it, `inspect` names it, and
    serve's /tokenize renders with it (transformers' text for the same messages)."""
    import httpx
    import yaml
    from conftest import run_cli
    from moe_export.common.recipe import load_recipe
    from moe_export.export.build import build
    from moe_export.export.convert.synth import write_synthetic_checkpoint
    from serve_support import InProcessServer

    ckpt = write_synthetic_checkpoint("tiny-kimi-linear", tmp_path / "ckpt")
    (ckpt / "chat_template.jinja").write_text(ROLE_TEMPLATE)
    data = yaml.safe_load(load_recipe("tiny-cpu.yaml")[1].read_text())
    data.update(name="kl-template", model={"source": str(ckpt)}, parallel={"tp": 1, "ep": 1},
                limits={"max_batch": 2, "max_seq_len": 512, "max_num_tokens": 128, "block_size": 16})
    data["target"]["gpus_per_node"] = 1
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(data))
    rec, _ = load_recipe(tmp_path / "r.yaml")
    engine = tmp_path / "engine"
    build(rec, engine)
    assert (engine / "chat_template.jinja").read_text() == ROLE_TEMPLATE
    code, out, _ = run_cli(capsys, "inspect", str(engine), "--json")  # the CLI names the runtime's renderer
    assert code == 0 and json.loads(out)["chat_format"] == f"checkpoint chat template ({engine / 'chat_template.jinja'})"
    srv = InProcessServer(engine)
    try:
        messages = copy.deepcopy(CONVERSATIONS[2])  # OpenAI clients send arguments as a JSON string
        call = messages[1]["tool_calls"][0]["function"]
        call["arguments"] = json.dumps(call["arguments"])
        r = httpx.post(f"{srv.url}/tokenize", json={"messages": messages, "tools": [WEATHER]})
        assert r.status_code == 200, r.text
        ids = r.json()["tokens"]
    finally:
        srv.stop()
    tok = load_tokenizer(engine)
    sorted_tools = json.loads(json.dumps([WEATHER], sort_keys=True))
    assert tok.decode(ids) == oracle(ROLE_TEMPLATE, messages, sorted_tools)
