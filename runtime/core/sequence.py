"""A request's state in the engine core: its tokens, slot, cache blocks, progress and output text."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from moe_export.runtime.core.contracts import Request
from moe_export.runtime.tokenizer import IncrementalDecoder


@dataclass
class Sequence:
    request: Request
    tokens: list[int]  # prompt + output
    prompt_len: int
    seed: int  # the request's seed, or a random one drawn at admission
    slot: int = -1
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens fed to the engine by the steps planned so far (positions [0, num_computed))
    pending: int = 0  # tokens being chosen by started steps, not yet in `tokens` (0, 1, or 2 while planning ahead)
    future_row: int = -1  # its sampled row in the latest started step (its next input is future_token(future_row))
    cached_tokens: int = 0  # prompt tokens taken from a kept session or the prefix cache
    hashes: list[bytes] = field(default_factory=list)  # chained hashes of its full blocks (prefix caching)
    named: int = 0  # its blocks [0, named) are named in the prefix cache (or were already: shared)
    targets: list[int] = field(default_factory=list)  # prompt positions whose state is checkpointed, ascending
    lineage: str = ""  # the session its checkpoints belong to (`core.prefix_cache`)
    text: IncrementalDecoder | None = None  # the output's text, a step at a time (with a text_decoder)
    text_len: int = 0  # characters of output text decoded so far
    text_tail: str = ""  # their last characters, as many as a stop string may have begun in
    pad_positions: np.ndarray | None = None  # prompt positions of the image rows (`<|media_pad|>`), in order
    image_embeds: np.ndarray | None = None  # [len(pad_positions), hidden] once the tower has run
    key_prefix: tuple[int, ...] = ()  # the prompt with each image's pads replaced by a key of its content
    _key: np.ndarray | None = field(default=None, repr=False)  # int64 buffer: the key of tokens[:_key_len]
    _key_len: int = 0
    penalties: object = None  # its `rows.PenaltyCounts` once sampled with a penalty
    _block_ids: tuple[list[int], np.ndarray] | None = field(default=None, repr=False)  # (blocks it was made of, array)

    @property
    def block_ids(self) -> np.ndarray:
        """`blocks` as an int64 array, converted once per block list (a step's block table is a view of it: no
        per-step conversion of a long context's table)."""
        made = self._block_ids
        if made is None or made[0] is not self.blocks or len(made[1]) != len(self.blocks):
            made = self._block_ids = (self.blocks, np.asarray(self.blocks, dtype=np.int64))
        return made[1]

    def session_key(self, n: int) -> np.ndarray:
        """The first n tokens as a session key [n] int64 (a view: copy to keep it): an image's `<|media_pad|>` rows
        stand for its content hash, so a kept session is reused only by a prompt with the same images. Built
        once: each call converts only the tokens added since the last one (amortized O(new tokens))."""
        if self._key is None:
            self._key = np.asarray(self.key_prefix or self.tokens, dtype=np.int64)
            self._key_len = len(self._key)
        if n > self._key_len:
            if n > len(self._key):
                grown = np.empty(max(n, 2 * len(self._key)), dtype=np.int64)
                grown[:self._key_len] = self._key[:self._key_len]
                self._key = grown
            self._key[self._key_len:n] = self.tokens[self._key_len:n]
            self._key_len = n
        return self._key[:n]

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def request_id(self) -> str:
        return self.request.request_id
