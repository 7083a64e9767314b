"""Host work per step independent of the context: penalty counts kept a token at a time, session keys built once
per token, kept sessions matched by comparing int64 arrays, block names reused from the session a prompt continues.
Each is checked against the direct computation (np.unique, tuples, hashing the whole key)."""

from __future__ import annotations

import numpy as np
import torch

from moe_export.runtime.core.contracts import Request
from moe_export.runtime.core.prefix_cache import block_hashes
from moe_export.runtime.core.rows import build_row
from moe_export.runtime.core.sequence import Sequence
from moe_export.runtime.core.sessions import KeptSequence, SessionCache
from moe_export.runtime.sampling import SamplingParams


def test_penalty_counts_follow_the_tokens_a_step_at_a_time():
    """Rows built after each appended token (and after several at once) carry exactly np.unique's ids and counts,
    and each build counts only the tokens added since the previous one."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 50, 300).tolist()
    params = SamplingParams(max_tokens=64, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2)
    seq = Sequence(Request("r", prompt, params), list(prompt), len(prompt), seed=1)
    for added in [1, 1, 3, 1, 7, 1]:
        seq.tokens += rng.integers(0, 60, added).tolist()
        row = build_row(seq, frozenset(), None)
        assert seq.penalties.absorbed == len(seq.tokens)
        assert np.array_equal(np.sort(row.seen), np.unique(seq.tokens))
        want_ids, want_counts = np.unique(seq.tokens[len(prompt):], return_counts=True)
        order = np.argsort(row.output_ids)
        assert np.array_equal(row.output_ids[order], want_ids)
        assert np.array_equal(row.output_counts[order], want_counts)


def test_session_key_is_built_once_and_equals_the_tuple_key():
    """The key of the first n tokens (image pads replaced by their stand-ins) as the tuple form gave it, also after
    tokens are appended (the buffer grows; earlier entries are not rebuilt)."""
    prompt = [5, 6, 7, 8, 9]
    seq = Sequence(Request("r", prompt), list(prompt), len(prompt), seed=0)
    seq.key_prefix = (5, -77, -77, 8, 9)  # an image's stand-in over two pad rows
    assert seq.session_key(5).tolist() == [5, -77, -77, 8, 9]
    seq.tokens += list(range(100, 300))
    assert seq.session_key(205).tolist() == [5, -77, -77, 8, 9, *range(100, 300)]
    assert seq.session_key(3).tolist() == [5, -77, -77]


def test_kept_sessions_matched_by_array_comparison():
    """The longest kept sequence that is a proper prefix of the prompt is taken; equal tokens replace an entry."""
    cache = SessionCache()
    short, long_, other = (np.arange(n, dtype=np.int64) for n in (100, 1000, 400))
    other[50] = -1
    for i, tokens in enumerate((short, long_, other)):
        assert cache.keep(KeptSequence(tokens, i, [i])) is None
    assert cache.keep(KeptSequence(short.copy(), 9, [9])).slot == 0  # same tokens: the old entry comes back
    prompt = np.arange(2000, dtype=np.int64)
    assert cache.take_longest_prefix(prompt).slot == 1
    assert cache.take_longest_prefix(prompt).slot == 9
    assert cache.take_longest_prefix(prompt) is None  # `other` differs at 50
    assert cache.take_longest_prefix(np.arange(400, dtype=np.int64)) is None  # not a proper prefix of itself
    assert len(cache) == 1


def test_block_hashes_continue_from_stored_ones():
    """Names of a key's blocks computed in two parts (the second from the first's last name) equal those computed
    at once, for tuples and int64 arrays alike."""
    key = np.random.default_rng(1).integers(-5, 1000, 1000)
    whole = block_hashes(tuple(key.tolist()), 64)
    first = block_hashes(key[:640], 64)
    assert first + block_hashes(key, 64, len(first), first[-1]) == whole == block_hashes(key, 64)


def test_packed_seen_ids_are_views_that_never_change():
    """The repetition penalty's (row, token) pairs of a lone penalized row come from buffers kept across steps:
    equal to the direct packing, and a pair handed to an earlier step is not altered by later steps (a step in
    flight may still read it), also when the sequence's batch row changes."""
    from moe_export.runtime.core.rows import pack_rows

    prompt = list(range(40))
    seq = Sequence(Request("r", prompt, SamplingParams(max_tokens=64, repetition_penalty=1.3)), list(prompt), 40, 0)
    handed = []
    for step, token in enumerate([7, 99, 100, 7, 101]):
        seq.tokens.append(token)
        row = build_row(seq, frozenset(), None)
        others = [build_row(Sequence(Request("o", [1]), [1], 1, 0), frozenset(), None)] * (step % 2)  # moves our row
        sb = pack_rows(others + [row], list(range(len(others) + 1)), None)
        rows, ids = sb.seen
        assert rows.tolist() == [len(others)] * len(set(seq.tokens)) and sorted(ids.tolist()) == sorted(set(seq.tokens))
        handed.append((rows, ids, rows.clone(), ids.clone()))
    for rows, ids, rows_then, ids_then in handed:
        assert torch.equal(rows, rows_then) and torch.equal(ids, ids_then)
