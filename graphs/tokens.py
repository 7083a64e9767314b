"""The Kimi checkpoints' token facts: the special-token strings (the one table the renderers, the output
parser, the reasoning budget, the structured-output grammar, the tokenizer loader and the synthetic
checkpoints import), their offsets in the special range, and the tokenizer files' names and special-range size.

Sources: K3's `encoding_k3.py` (vllm-project/vllm `vllm/tokenizers/encoding_k3.py`), K2-Thinking's chat
template (ggml-org/llama.cpp `models/templates/moonshotai-Kimi-K2-Thinking.jinja`) and the checkpoints'
`tokenizer_config.json` (`added_tokens_decoder`). Ids are never hard-coded here: a real tokenizer reads
them from its checkpoint; only the synthetic tokenizer (`moe_export.export.convert.synth`) places names at the
offsets below.
"""

from __future__ import annotations

# Kimi tokenizer files: `tiktoken.model` (one `base64(token bytes) rank` per line) and `tokenizer_config.json`
# (`added_tokens_decoder`: id -> {content, special}); other checkpoints ship a Hugging Face `tokenizer.json`.
TIKTOKEN_FILE = "tiktoken.model"
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
# The special ids follow the last BPE rank: 256 of them (258 when the config names either of the two more that
# Kimi Linear's tokenization_kimi.py builds).
NUM_RESERVED_SPECIAL = 256
MAX_RESERVED_SPECIAL = 258

# K3 (XTML): a tag is `<|open|>NAME attrs<|sep|>` ... `<|close|>NAME<|sep|>`; a message ends with <|end_of_msg|>.
OPEN = "<|open|>"
CLOSE = "<|close|>"
SEP = "<|sep|>"
END_OF_MSG = "<|end_of_msg|>"
# An image part renders as IMAGE, a marker that is not a token: it is expanded into MEDIA_BEGIN "image WxH"
# MEDIA_CONTENT, one MEDIA_PAD per merged patch, MEDIA_END (`moe_export.runtime.images.image_token_ids`).
# MEDIA_PAD's id is config.json's `media_placeholder_token_id` (163605): the rows that take image embeddings.
IMAGE = "<|kimi_image_placeholder|>"
MEDIA_BEGIN = "<|media_begin|>"
MEDIA_CONTENT = "<|media_content|>"
MEDIA_END = "<|media_end|>"
MEDIA_PAD = "<|media_pad|>"

# K2 / Kimi Linear (role tokens).
IM_SYSTEM = "<|im_system|>"
IM_USER = "<|im_user|>"
IM_ASSISTANT = "<|im_assistant|>"
IM_MIDDLE = "<|im_middle|>"
IM_END = "<|im_end|>"
THINK = "<think>"
END_THINK = "</think>"
CALLS_BEGIN = "<|tool_calls_section_begin|>"
CALLS_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
CALL_ARGS = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"

FAMILIES = ("k3", "k2")
# The markers whose presence in a tokenizer identifies its chat family.
FAMILY_MARKERS = {"k3": (OPEN, CLOSE, SEP), "k2": (IM_USER, IM_ASSISTANT, IM_MIDDLE)}
# The token that ends a chat message: the generation stop token of each family.
END_OF_MESSAGE = {"k2": IM_END, "k3": END_OF_MSG}

# Special-token names by offset from the first special id (K2: 163584), as the public K2 tokenizer_config
# places them. K3 reuses the range with new names for the structural tokens; only names known from public
# sources are listed. The synthetic tokenizer uses these offsets.
K2_SPECIAL_NAMES = {
    0: "[BOS]", 1: "[EOS]", 2: IM_END, 3: IM_USER, 4: IM_ASSISTANT, 9: "[EOT]",
    10: IM_SYSTEM, 11: CALLS_BEGIN, 12: CALLS_END, 13: CALL_BEGIN, 14: CALL_ARGS, 15: CALL_END,
    17: IM_MIDDLE, 22: THINK, 23: END_THINK,
    254: "[UNK]", 255: "[PAD]",
}
K3_SPECIAL_NAMES = {
    0: "[BOS]", 1: "[EOS]", 2: END_OF_MSG, 3: OPEN, 4: CLOSE, 5: SEP, 9: "[EOT]",
    18: MEDIA_BEGIN, 19: MEDIA_CONTENT, 20: MEDIA_END, 21: MEDIA_PAD, 254: "[UNK]", 255: "[PAD]",
}
FAMILY_SPECIAL_NAMES = {"k2": K2_SPECIAL_NAMES, "k3": K3_SPECIAL_NAMES}
