"""Property-based fuzzing of the served API, the way it is deployed: `mpiexec -n 2 moe-export serve` on the
embedded default model (tiny-k3, tp 2 x ep 2 over 2 ranks, a 384-token context so that every generation is
short).

- schemathesis: requests generated from the server's own OpenAPI document (`/openapi.json`, the request
  models' JSON schemas), every operation, bodies that fit the schemas and bodies that break them;
- hypothesis: the sampling fields of Chat Completions, Completions and Messages over their whole ranges and
  beyond (integers past int64, tiny / subnormal / huge / non-finite floats, top_k past the vocabulary).

After every generated request: it answered below 500 (a bad value is a 400, never a crash), a normal request
answers 200 and `/health` 200. A request that takes the world down restarts the server for the next test.
Bounded: FUZZ_SECONDS (default 180 s) for the generated requests of the whole module, shared out among the
tests (the sampling routes get half of it), on top of the engine build and the server's start (about 20 s); each
test sends at least MIN_EXAMPLES requests. Marked slow (CI runs it after the default suite).

FUZZ_CORPUS holds the requests that failed when found; they are replayed first, each on its own. The generated
requests are the same in every run (hypothesis derandomized: a CI run does not fail by chance); FUZZ_RANDOM=1
explores new ones (a failure prints its request: add it to the corpus).
"""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from serve_support import build_serve_engine, start_cli_server, stop_process

pytestmark = pytest.mark.slow

FUZZ_SECONDS = float(os.environ.get("FUZZ_SECONDS", "180"))
EXAMPLES_PER_TEST = 200  # at most, per operation / route; the time budget ends a test first
MIN_EXAMPLES = 5  # requests a test sends whatever its time (unless its operation has fewer distinct inputs)
NORMAL = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0,
          "reasoning_effort": "none"}
INT64 = 1 << 63

# (route, body) of every failure the fuzzing found, replayed as regression tests
FUZZ_CORPUS = [
    # the cases: top_k past the vocabulary (576) with sampling, a top_p below the smallest mass
    ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
                      "temperature": 1, "top_k": 577}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 1,
                              "top_p": 1e-300}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 1,
                              "top_k": INT64}),
    # found by test_sampling_values_never_take_the_server_down (each ended the world under mpiexec -n 2, or the
    # engine core: 503 "Overflow when unpacking long long")
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 2, "temperature": 1, "seed": 1613, "top_k": 798,
                         "presence_penalty": 1e-08}),
    ("/v1/messages", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "top_p": 1e-300,
                      "temperature": 1e-08}),
    ("/v1/messages", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 1,
                      "top_k": INT64}),
]


class Served:
    """`mpiexec -n 2 moe-export serve ENGINE`, restarted when a request took it down."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.restarts = 0
        self.start()

    def start(self) -> None:
        self.proc, self.url = start_cli_server([str(self.engine), "--served-model-name", "m", "--default-effort", "low",
                                                "--no-access-log"], mpiexec_ranks=2)

    def ensure(self) -> None:
        """A serving server: the one running, or a new one when it exited or its engine core died."""
        if self.proc.poll() is None:
            try:
                if httpx.get(f"{self.url}/health", timeout=10).status_code == 200:
                    return
            except httpx.TransportError:
                pass
        stop_process(self.proc, timeout=15)
        self.restarts += 1
        self.start()

    def stop(self) -> None:
        stop_process(self.proc)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    engine = build_serve_engine(tmp_path_factory.mktemp("fuzz-engine"), tp=2, ep=2, world=2,
                                limits={"max_seq_len": 384, "max_num_tokens": 256})
    srv = Served(engine)
    yield srv
    srv.stop()


class Budget:
    """A test's share of FUZZ_SECONDS: `spent()` once it is used up (after MIN_EXAMPLES requests at least)."""

    def __init__(self, share: float) -> None:
        self.seconds, self.start, self.examples = FUZZ_SECONDS * share, time.monotonic(), 0
        self.failed = False  # a request failed: hypothesis replays it, and the replay must run too

    def spent(self) -> bool:
        if not self.failed and self.examples >= MIN_EXAMPLES and time.monotonic() - self.start > self.seconds:
            return True
        self.examples += 1
        return False

    def check(self, served: Served, what: str, status: int | None, text: str) -> None:
        try:
            answered_below_500(served, what, status, text)
        except AssertionError:
            self.failed = True
            raise


def still_serving(served: Served, what: str) -> None:
    """AssertionError naming `what` unless /health is 200 and a normal request answers 200."""
    try:
        health = httpx.get(f"{served.url}/health", timeout=30)
        normal = httpx.post(f"{served.url}/v1/chat/completions", json=NORMAL, timeout=120)
    except httpx.TransportError as exc:
        raise AssertionError(f"after {what}: the server went down ({type(exc).__name__})") from None
    assert health.status_code == 200, f"after {what}: /health answered {health.status_code} {health.text[:300]}"
    assert normal.status_code == 200, f"after {what}: a normal request answered {normal.status_code} {normal.text[:300]}"


def answered_below_500(served: Served, what: str, status: int | None, text: str) -> None:
    assert status is not None and status < 500, f"{what} answered {status}: {text[:500]}"
    still_serving(served, what)


def send(served: Served, path: str, body) -> tuple[int | None, str]:
    """POST `body` as JSON, non-finite floats as the NaN / Infinity tokens Python's json writes (and reads)."""
    try:
        r = httpx.post(f"{served.url}{path}", content=json.dumps(body).encode(), timeout=120,
                       headers={"content-type": "application/json"})
        return r.status_code, r.text
    except httpx.TransportError as exc:
        return None, f"no answer ({type(exc).__name__})"


def short(body) -> str:
    text = json.dumps(body, default=str)
    return text if len(text) < 600 else text[:600] + "..."


@pytest.mark.parametrize("path, body", FUZZ_CORPUS, ids=[f"{p}-{i}" for i, (p, _) in enumerate(FUZZ_CORPUS)])
def test_corpus_of_earlier_findings(served, path, body):
    served.ensure()
    status, text = send(served, path, body)
    answered_below_500(served, f"POST {path} {short(body)}", status, text)


FUZZ_SETTINGS = settings(max_examples=EXAMPLES_PER_TEST, deadline=None, database=None,
                         derandomize=not os.environ.get("FUZZ_RANDOM"),
                         phases=[Phase.explicit, Phase.generate], report_multiple_bugs=False,
                         suppress_health_check=list(HealthCheck))

OPERATIONS = ["GET /health", "GET /metrics", "GET /v1/models", "GET /v1/models/{model_id}", "GET /version",
              "POST /tokenize", "POST /detokenize", "POST /v1/chat/completions", "POST /v1/completions",
              "POST /v1/responses", "GET /v1/responses/{response_id}", "DELETE /v1/responses/{response_id}",
              "GET /v1/responses/{response_id}/input_items", "POST /v1/messages/count_tokens", "POST /v1/messages"]


def operation_weight(label: str) -> int:
    """An operation's part of the schemathesis time: those with a body have more to generate."""
    return 3 if label.startswith("POST") else 1


def test_the_openapi_document_lists_every_operation(served):
    import schemathesis

    schema = schemathesis.openapi.from_url(f"{served.url}/openapi.json")
    assert sorted(op.ok().label for op in schema.get_all_operations()) == sorted(OPERATIONS)


@pytest.mark.parametrize("label", OPERATIONS)
def test_schemathesis_requests_never_take_the_server_down(served, label):
    import schemathesis
    from schemathesis import GenerationMode

    served.ensure()
    schema = schemathesis.openapi.from_url(f"{served.url}/openapi.json")
    (operation,) = [op.ok() for op in schema.get_all_operations() if op.ok().label == label]
    cases = st.one_of(operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE))
    budget = Budget(0.5 * operation_weight(label) / sum(map(operation_weight, OPERATIONS)))

    @FUZZ_SETTINGS
    @given(case=cases)
    def check(case):
        if budget.spent():
            return
        served.ensure()
        what = f"{label} {short(case.body) if case.body is not None else ''} path {case.path_parameters} query {case.query}"
        try:
            response = case.call(base_url=served.url, timeout=120)
            status, text = response.status_code, response.text
        except Exception as exc:  # a connection the server dropped (requests' errors)
            status, text = None, f"no answer ({type(exc).__name__})"
        budget.check(served, what, status, text)

    check()
    print(f"{label}: {budget.examples} requests")


# each value: inside its range most of the time (so that requests reach the sampler together), at its edges
# (the smallest floats, the vocabulary's size, int64's ends) or outside it (non-finite, huge) the rest
any_float = st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True)
edge_floats = st.sampled_from([0.0, -0.0, 1e-300, 5e-324, 1e-45, 1e-8, 1.0, 2.0, 1e308])
any_int = st.one_of(st.sampled_from([575, 576, 577, 1 << 31, INT64 - 1, INT64, 1 << 64, -INT64]),
                    st.integers(-(1 << 70), 1 << 70))


def ranged(low: float, high: float) -> st.SearchStrategy:
    return st.one_of(st.floats(low, high), st.floats(low, high), edge_floats, any_float)


SAMPLING = {"temperature": ranged(0, 2), "top_p": ranged(0, 1), "min_p": ranged(0, 1),
            "top_k": st.one_of(st.integers(-1, 1000), st.integers(-1, 1000), any_int),
            "presence_penalty": ranged(-2, 2), "frequency_penalty": ranged(-2, 2), "repetition_penalty": ranged(0, 3),
            "seed": st.one_of(st.integers(0, 1 << 64), any_int), "min_tokens": st.one_of(st.integers(0, 4), any_int),
            "max_tokens": st.one_of(st.integers(1, 8), st.integers(1, 8), any_int)}
ROUTE_FIELDS = {
    "/v1/chat/completions": ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                             "repetition_penalty", "seed", "min_tokens", "max_tokens"),
    "/v1/completions": ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                        "repetition_penalty", "seed", "min_tokens", "max_tokens"),
    "/v1/messages": ("temperature", "top_p", "top_k", "max_tokens"),
}
BASE = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "none"},
        "/v1/completions": {"prompt": "Once upon a time"},
        "/v1/messages": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}


@pytest.mark.parametrize("path", list(ROUTE_FIELDS))
def test_sampling_values_never_take_the_server_down(served, path):
    fields = ROUTE_FIELDS[path]  # 1 to 3 of them at a time over a sampled request, so that most reach the sampler
    bodies = st.lists(st.sampled_from(fields), min_size=1, max_size=3, unique=True).flatmap(
        lambda chosen: st.fixed_dictionaries({k: SAMPLING[k] for k in chosen}))
    budget = Budget(0.5 / len(ROUTE_FIELDS))

    @FUZZ_SETTINGS
    @given(values=bodies)
    def check(values):
        if budget.spent():
            return
        served.ensure()
        body = {**BASE[path], "max_tokens": 2, "temperature": 1, **values}
        status, text = send(served, path, body)
        budget.check(served, f"POST {path} {short(body)}", status, text)

    check()
    print(f"{path}: {budget.examples} requests")
