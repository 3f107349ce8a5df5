"""Fuzzing the public API (hypothesis): random Generate requests to a real
router, target and draft (subprocesses on 127.0.0.1, alignment check on).

Prompts are text (empty, unicode, special tokens, longer than the context,
larger than the message limit) or token ids (empty, negative, past the
vocabulary, too many); max_tokens is unset, 0, negative, small, exactly the
room left, one past it or huge; sampling and speculative parameters are
valid or not (NaN, infinities, negative, past their bounds); context_shift,
n_keep, add_special and stop strings vary.

Each request's outcome is predicted here, from the API's documented rules,
before it is sent: it must either complete (a finish message, the prompt
length the router tokenized, at most max_tokens generated) or fail with the
predicted code and a message naming the first field at fault. Afterwards
nothing leaks and the cluster still answers a greedy request exactly as
before the fuzzing.
"""
from __future__ import annotations

import math
import os

import grpc
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specd.client import RouterClient, collect
from specd.v1 import router_pb2 as rpb
from specd.v1 import router_pb2_grpc as rpb_grpc
from tests.conftest import PROMPTS
from tests.leaks import wait_no_leaks

N_CTX = 256  # a multiple of 256: llama.cpp pads a context to one
N_VOCAB = 49152
DEFAULT_N_MAX = 4  # the router's --n-max
MAX_MESSAGE = 4 << 20  # the router's --max-message-bytes
INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1
INVALID = grpc.StatusCode.INVALID_ARGUMENT

_state: dict = {}


def _cluster(cluster_factory):
    if "cluster" not in _state:
        c = cluster_factory(n_ctx=N_CTX, n_seq=2, metrics=True)
        with RouterClient(c.router_address, timeout=120) as client:
            info = client.info()
            assert info.target.n_ctx_seq == info.draft.n_ctx_seq == N_CTX and info.target.n_vocab == N_VOCAB
            _state["reference"] = client.generate(PROMPTS[0], max_tokens=16).tokens
            assert client.generate(PROMPTS[0], max_tokens=16, speculative=False).tokens == _state["reference"]
        _state["cluster"] = c
        _state["channel"] = grpc.insecure_channel(c.router_address)
        _state["stub"] = rpb_grpc.RouterStub(_state["channel"])
        _state["counts"] = {"completed": 0, "refused": 0}
    return _state["cluster"], _state["stub"]


# -------------------------------------------------------------- strategies
def f32(x: float) -> float:
    """What a proto float field carries."""
    return float(np.float32(x))


ODD_FLOATS = [math.nan, math.inf, -math.inf, -0.0, -1e-30, 1e-45, 1e38, -1.0, 1.0000001, 0.9999999, 2.0]


def floats(lo: float, hi: float) -> st.SearchStrategy[float]:
    ok = st.floats(lo, hi, width=32)
    return st.one_of(ok, ok, ok, ok, st.sampled_from(ODD_FLOATS), st.floats(width=32))


def int32s(lo: int, hi: int) -> st.SearchStrategy[int]:
    ok = st.integers(lo, hi)
    return st.one_of(ok, ok, ok, ok, ok, st.sampled_from([INT32_MIN, -1, 0, INT32_MAX]))


TEXTS = st.one_of(
    st.text(min_size=1, max_size=40),
    st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=20),
    st.sampled_from(PROMPTS + ["\x00", " ", "\n\n", "<|im_start|>", "<|endoftext|>", "🦙" * 30, "é" * 50,
                               "word " * 400]),  # the last: more tokens than the context holds
)
HUGE_TEXT = "x" * (MAX_MESSAGE + 1024)  # past the message limit


def draw_request(data, tokenize) -> tuple[rpb.GenerateRequest, int | None]:
    """A random request and the number of prompt tokens the router will see
    (None when the prompt never gets that far)."""
    r = rpb.GenerateRequest()
    kind = data.draw(st.sampled_from(["text"] * 6 + ["tokens"] * 3 + ["empty_text", "empty_tokens", "unset", "huge"]),
                     label="prompt kind")
    n_prompt = None
    if kind == "text":
        r.prompt = data.draw(TEXTS, label="prompt")
        if data.draw(st.booleans(), label="set add_special"):
            r.add_special = data.draw(st.booleans(), label="add_special")
        n_prompt = len(tokenize(r.prompt, r.add_special if r.HasField("add_special") else True))
    elif kind == "tokens":
        ids = data.draw(st.one_of(
            st.lists(st.integers(0, N_VOCAB - 1), min_size=1, max_size=20),
            st.lists(st.integers(0, N_VOCAB - 1), min_size=N_CTX - 12, max_size=N_CTX + 4),
            st.lists(st.one_of(st.integers(0, N_VOCAB - 1), st.sampled_from([-1, N_VOCAB, INT32_MIN, INT32_MAX])),
                     min_size=1, max_size=8)), label="prompt_tokens")
        r.prompt_tokens.ids.extend(ids)
        n_prompt = len(ids)
    elif kind == "empty_text":
        r.prompt = ""
    elif kind == "empty_tokens":
        r.prompt_tokens.SetInParent()
    elif kind == "huge":
        r.prompt = HUGE_TEXT

    room = N_CTX - (n_prompt or 0)
    mt = data.draw(st.one_of(
        st.integers(1, 12), st.integers(1, 12), st.integers(1, 12),
        st.sampled_from([None, 0, -1, -5, INT32_MIN, INT32_MAX, 10**6, room, room + 1, max(room - 1, 1)])),
        label="max_tokens")
    if mt is None and room > 40:  # unset runs to the end of the context: keep that short
        mt = data.draw(st.integers(1, 12), label="max_tokens instead of unset")
    shift = data.draw(st.sampled_from([False, False, True]), label="context_shift")
    if shift and (mt is None or mt > 24):
        mt = data.draw(st.integers(1, 24), label="max_tokens with context_shift")  # bounded run time
    if mt is not None:
        r.max_tokens = mt
    r.context_shift = shift
    r.n_keep = data.draw(st.one_of(st.just(0), st.just(0), int32s(-2, N_CTX // 2 + 2)), label="n_keep")

    if data.draw(st.booleans(), label="sampling"):
        s = r.sampling
        s.temperature = data.draw(st.one_of(st.just(0.0), floats(0.0, 2.0)), label="temperature")
        s.top_k = data.draw(int32s(-2, 60), label="top_k")
        s.top_p = data.draw(floats(0.0, 1.0), label="top_p")
        s.min_p = data.draw(st.one_of(st.just(0.0), floats(0.0, 1.0)), label="min_p")
        if data.draw(st.booleans(), label="set seed"):
            s.seed = data.draw(st.integers(0, (1 << 64) - 1), label="seed")
    if data.draw(st.booleans(), label="speculative"):
        sp = r.speculative
        if data.draw(st.booleans()):
            sp.enabled = data.draw(st.booleans(), label="enabled")
        if data.draw(st.booleans()):
            sp.n_max = data.draw(int32s(-1, 66), label="n_max")
        if data.draw(st.booleans()):
            sp.n_min = data.draw(int32s(-1, 66), label="n_min")
        if data.draw(st.booleans()):
            sp.p_min = data.draw(floats(0.0, 1.0), label="p_min")
        if data.draw(st.booleans()):
            sp.adaptive = data.draw(st.booleans(), label="adaptive")
    r.stop.extend(data.draw(st.lists(st.one_of(st.text(max_size=4), st.sampled_from(["", ".", "\n", " the", "é"])),
                                     max_size=3), label="stop"))
    return r, n_prompt


def predict(r: rpb.GenerateRequest, n_prompt: int | None) -> tuple[grpc.StatusCode, str] | None:
    """(code, what the message must name) of the first fault, None when the
    request is valid — in the order the router checks."""
    if r.ByteSize() > MAX_MESSAGE:
        return grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max"
    which = r.WhichOneof("input")
    if which is None or (which == "prompt" and not r.prompt):
        return INVALID, "prompt"
    if which == "prompt_tokens" and not r.prompt_tokens.ids:
        return INVALID, "prompt_tokens"
    if n_prompt == 0:
        return INVALID, "prompt"
    if which == "prompt_tokens":
        for i, t in enumerate(r.prompt_tokens.ids):
            if not 0 <= t < N_VOCAB:
                return INVALID, f"prompt_tokens[{i}]"
    if n_prompt > N_CTX:
        return INVALID, "prompt"
    if r.HasField("max_tokens"):
        if r.max_tokens <= 0:
            return INVALID, "max_tokens"
        if not r.context_shift and n_prompt + r.max_tokens > N_CTX:
            return INVALID, "max_tokens"
    s = r.sampling
    top_p = s.top_p or 1.0
    if not math.isfinite(s.temperature) or s.temperature < 0:
        return INVALID, "sampling.temperature"
    if s.top_k < 0:
        return INVALID, "sampling.top_k"
    if not 0.0 < top_p <= 1.0:
        return INVALID, "sampling.top_p"
    if not 0.0 <= s.min_p < 1.0:
        return INVALID, "sampling.min_p"
    sp = r.speculative
    if sp.HasField("n_max") and not 1 <= sp.n_max <= 64:
        return INVALID, "speculative.n_max"
    n_max = sp.n_max if sp.HasField("n_max") else DEFAULT_N_MAX
    if sp.HasField("n_min") and not 0 <= sp.n_min <= n_max:
        return INVALID, "speculative.n_min"
    if sp.HasField("p_min") and not 0.0 <= sp.p_min <= 1.0:
        return INVALID, "speculative.p_min"
    if not 0 <= r.n_keep < N_CTX // 2:
        return INVALID, "n_keep"
    return None


def describe(r: rpb.GenerateRequest, n_prompt: int | None) -> str:
    """The request for a failure message (a huge prompt shortened)."""
    short = rpb.GenerateRequest()
    short.CopyFrom(r)
    if len(short.prompt) > 200:
        short.prompt = short.prompt[:60] + f"... ({len(r.prompt)} chars)"
    if len(short.prompt_tokens.ids) > 20:
        del short.prompt_tokens.ids[20:]
    return f"{n_prompt} prompt tokens; " + " ".join(str(short).split())


# ------------------------------------------------------------------- test
# about 0.1 s an example on 2 shared cores; SPECD_FUZZ_EXAMPLES runs more
@settings(max_examples=int(os.environ.get("SPECD_FUZZ_EXAMPLES", "240")), deadline=None, database=None,
          print_blob=True, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                                   HealthCheck.data_too_large])
@given(data=st.data())
def test_random_generate_requests_complete_or_name_their_fault(cluster_factory, data):
    cluster, stub = _cluster(cluster_factory)

    def tokenize(text: str, add_special: bool) -> list[int]:
        return list(stub.Tokenize(rpb.TokenizeRequest(text=text, add_special=add_special, parse_special=True),
                                  timeout=30).tokens)

    req, n_prompt = draw_request(data, tokenize)
    want = predict(req, n_prompt)
    try:
        out = collect(stub.Generate(req, timeout=120))
    except grpc.RpcError as exc:
        assert cluster.procs["router"].popen.poll() is None
        assert want is not None, f"a valid request failed: {exc.code().name}: {exc.details()}; {describe(req, n_prompt)}"
        code, word = want
        assert exc.code() == code and word in exc.details(), \
            f"expected {code.name} naming {word!r}, got {exc.code().name}: {exc.details()}; {describe(req, n_prompt)}"
        _state["counts"]["refused"] += 1
        return
    assert want is None, (f"the request should fail with {want[0].name} naming {want[1]!r}, it completed: {out}; "
                          f"{describe(req, n_prompt)}")
    assert out.finish_reason in ("eog", "length", "stop"), out
    assert out.n_prompt == n_prompt
    assert len(out.tokens) <= out.n_generated
    if req.HasField("max_tokens"):
        assert out.n_generated <= req.max_tokens
    if req.speculative.HasField("enabled") and not req.speculative.enabled:
        assert out.n_drafted == 0 and not out.speculative
    assert out.n_accepted <= out.n_drafted
    assert all(0 <= t < N_VOCAB for t in out.tokens)
    _state["counts"]["completed"] += 1


def test_cluster_serves_as_before_and_nothing_leaked(cluster_factory):
    """Runs after the fuzz test (file order)."""
    cluster, _ = _cluster(cluster_factory)
    print(f"\nfuzzed requests: {_state['counts']}")
    with RouterClient(cluster.router_address, timeout=120) as client:
        assert client.generate(PROMPTS[0], max_tokens=16).tokens == _state["reference"]
        assert client.generate(PROMPTS[0], max_tokens=16, speculative=False).tokens == _state["reference"]
    for role in ("router", "target", "draft"):
        assert cluster.procs[role].popen.poll() is None, role
    wait_no_leaks(cluster)
    _state["channel"].close()
