"""The target going on alone (VerifyRequest.n_more, the router's
--solo-tokens): the tokens are those of one-token steps, token for token,
greedy and sampled; it stops after an end-of-generation token, at the end of
the context and within max_tokens; and the router's history, the target's KV
and the alignment check agree afterwards."""
from __future__ import annotations

import numpy as np
import pytest

from specd.client import RouterClient
from specd.config import MAX_N_MORE, MAX_STOP_ON_REPEAT
from specd.errors import InvalidArgument
from specd.sampling import Sampling
from specd.tokens import ends_in_repeat

PROMPT = "The three most important inventions in history are"
SAMPLED = Sampling(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=7)


@pytest.fixture(scope="module")
def engine(models):
    from specd.llama import LlamaConfig
    from specd.target_worker.engine import TargetEngine

    e = TargetEngine(LlamaConfig(models["target"], n_ctx_seq=64, n_seq=2, n_threads=1))
    yield e
    e.model.close()


def _start(e, seq: int, text: str = PROMPT) -> tuple[int, int]:
    """Prefill all but the prompt's last token; (position, id_last)."""
    toks = e.tokenize(text, True, False)
    e.clear(seq)
    e.decode(seq, 0, toks[:-1])
    return len(toks) - 1, toks[-1]


def _one_at_a_time(e, seq: int, s: Sampling, n: int) -> list[int]:
    pos, last = _start(e, seq)
    out: list[int] = []
    for i in range(n):
        tok = e.verify(seq, pos, [last], s, i, True).tokens[0]
        out.append(tok)
        if tok in e.model.eog_tokens:
            break
        pos, last = pos + 1, tok
    return out


@pytest.mark.parametrize("s", [Sampling(), SAMPLED], ids=["greedy", "sampled"])
def test_going_on_alone_gives_the_tokens_of_one_token_steps(engine, s):
    want = _one_at_a_time(engine, 0, s, 8)
    pos, last = _start(engine, 1)
    got = engine.verify(1, pos, [last], s, 0, True, n_more=7)
    assert got.tokens == want and got.n_more == len(want) - 1
    # every token but the last is in the sequence, as after one-token steps
    assert got.state.pos_max == pos + len(want) - 1
    assert got.pieces == [engine.model.piece(t) for t in want]


def test_it_stops_after_an_end_of_generation_token(engine):
    pos, last = _start(engine, 0)
    got = engine.verify(0, pos, [last], Sampling(), 0, True, n_more=40)  # the answer ends in about 20
    assert got.tokens[-1] in engine.model.eog_tokens
    assert len(got.tokens) < 41 and not set(got.tokens[:-1]) & set(engine.model.eog_tokens)
    assert got.state.pos_max == pos + len(got.tokens) - 1


def test_it_stops_at_the_end_of_the_context(engine):
    pos, last = _start(engine, 0, "1, 2, 3, 4, 5,")  # counting goes on past 64 positions
    got = engine.verify(0, pos, [last], Sampling(), 0, True, n_more=MAX_N_MORE)
    assert not set(got.tokens) & set(engine.model.eog_tokens)
    # the last token generated is not decoded: the context holds the others
    assert got.state.pos_max == engine.n_ctx_seq - 1
    assert got.n_more == len(got.tokens) - 1 == engine.n_ctx_seq - 1 - pos


@pytest.mark.parametrize("n_more", [-1, MAX_N_MORE + 1])
def test_an_n_more_out_of_range_is_refused_and_changes_nothing(engine, n_more):
    pos, last = _start(engine, 0)
    before = engine.state(0)
    with pytest.raises(InvalidArgument) as err:
        engine.verify(0, pos, [last], Sampling(), 0, True, n_more=n_more)
    assert err.value.field == "n_more"
    assert engine.state(0) == before


def test_it_stops_at_a_token_that_repeats_the_last_n(engine):
    """stop_on_repeat: every token it goes on past leaves the last n tokens
    without an earlier copy; the one it stops at has one (an n-gram drafter's
    match), or it ran out of n_more. The tokens are those of one-token steps."""
    text = "1, 2, 3, 4, 1, 2, 3, 4, 1, 2,"
    want = _one_at_a_time_from(engine, text, 13)
    stopped = []
    for n in (2, 3, 6):
        pos, last = _start(engine, 0, text)
        history = engine.seqs[0].tokens().tolist() + [last]
        got = engine.verify(0, pos, [last], Sampling(), 0, True, n_more=12, stop_on_repeat=n)
        assert got.tokens == want[: len(got.tokens)]
        seen = history + got.tokens
        ends = [ends_in_repeat(np.array(seen[: len(history) + i + 1]), n) for i in range(len(got.tokens))]
        assert not any(ends[:-1]), (n, ends)
        assert ends[-1] or got.n_more == 12, (n, ends)
        assert got.state.pos_max == pos + len(got.tokens) - 1
        stopped.append(got.n_more < 12)
    assert any(stopped)  # a counting prompt repeats itself


def _one_at_a_time_from(e, text: str, n: int) -> list[int]:
    pos, last = _start(e, 1, text)
    out = []
    for i in range(n):
        tok = e.verify(1, pos, [last], Sampling(), i, True).tokens[0]
        out.append(tok)
        pos, last = pos + 1, tok
    return out


@pytest.mark.parametrize("field, value", [("stop_on_repeat", -1), ("stop_on_repeat", MAX_STOP_ON_REPEAT + 1),
                                          ("stream_every", -1), ("stream_every", MAX_N_MORE + 2)])
def test_a_field_of_going_on_out_of_range_is_refused_and_changes_nothing(engine, field, value):
    pos, last = _start(engine, 0)
    before = engine.state(0)
    with pytest.raises(InvalidArgument) as err:
        engine.verify(0, pos, [last], Sampling(), 0, True, n_more=3, **{field: value})
    assert err.value.field == field
    assert engine.state(0) == before


@pytest.fixture(scope="module")
def solo_cluster(cluster_factory):
    return cluster_factory(n_ctx=256, n_seq=2, router_args=["--solo-tokens", "5"])


def test_router_steps_cover_several_tokens_within_max_tokens(solo_cluster):
    """With the alignment check on (the factory's), every step's KV matches
    the history; max_tokens is met exactly, and a shorter answer is a prefix
    of a longer one."""
    with RouterClient(solo_cluster.router_address, timeout=120) as client:
        runs = {n: client.generate(PROMPT, max_tokens=n, speculative=False) for n in (1, 3, 7, 12)}
        sampled = [client.generate(PROMPT, max_tokens=12, speculative=False, temperature=0.8, seed=3)
                   for _ in range(2)]
    for n, r in runs.items():
        assert r.n_generated == n and r.finish_reason == "length", (n, r)
        assert r.tokens == runs[12].tokens[:n]
    assert runs[12].n_steps == 3  # 5 + 5 + 2 tokens: the target went on alone
    assert sampled[0].tokens == sampled[1].tokens  # the same seed, the same sample indices


def test_a_step_that_asked_for_drafts_goes_on_only_until_a_match_can_come():
    """A step that asked the draft and got nothing (an n-gram drafter without
    a match) goes on alone only when the drafter says what its matches need
    (a repeat of the last n tokens), and then stops at one; otherwise it stays
    one token long: any next token may bring a match."""
    from types import SimpleNamespace

    from specd.router.step import Plan, Solo, solo_tokens

    r = SimpleNamespace(settings=SimpleNamespace(solo_tokens=4, stream_tokens=4), n_ctx=100)

    def plan(k: int, n: int = 10) -> Plan:
        return Plan(t0=0.0, n=n, k=k, n_min=0, p_min=0.0, ckpt=False, load=None, hidden_now=0.0)

    assert solo_tokens(r, plan(0), 0, remaining=50) == Solo(3, 0)
    assert solo_tokens(r, plan(0), 0, remaining=50, match_needs_repeat=12) == Solo(3, 0)  # no drafter asked
    assert solo_tokens(r, plan(4), 0, remaining=50) == Solo(0)  # asked, none came, no rule
    assert solo_tokens(r, plan(4), 0, remaining=50, match_needs_repeat=12) == Solo(3, 12)
    assert solo_tokens(r, plan(4), 2, remaining=50, match_needs_repeat=12) == Solo(0)
    assert solo_tokens(r, plan(4), 0, remaining=1, match_needs_repeat=12) == Solo(0)  # the last token
    assert solo_tokens(r, plan(0), 0, remaining=2) == Solo(1)  # within max_tokens
    assert solo_tokens(r, plan(0, n=99), 0, remaining=50) == Solo(1)  # within the context


def test_calls_longer_than_a_stream_group_hand_their_tokens_on_in_groups():
    """--solo-tokens 16, --stream-tokens 4: a call of 16 tokens hands them on
    every 4; a request with stop strings asks for 4 at a time (the target
    never runs far past one); a call no longer than a group hands nothing on."""
    from types import SimpleNamespace

    from specd.router.step import Plan, Solo, solo_tokens

    r = SimpleNamespace(settings=SimpleNamespace(solo_tokens=16, stream_tokens=4), n_ctx=100)
    plan = Plan(t0=0.0, n=10, k=0, n_min=0, p_min=0.0, ckpt=False, load=None, hidden_now=0.0)
    assert solo_tokens(r, plan, 0, remaining=50) == Solo(15, 0, 4)
    assert solo_tokens(r, plan, 0, remaining=50, stop_strings=True) == Solo(3, 0, 0)
    assert solo_tokens(r, plan, 0, remaining=3) == Solo(2, 0, 0)
    assert solo_tokens(r, plan, 0, remaining=6) == Solo(5, 0, 4)


def test_it_hands_its_tokens_on_as_it_goes_and_stops_for_waiting_work(engine):
    """stream_every: the tokens come in groups, in order, before the answer,
    which has them all; `others_waiting`: it stops going on after its next
    token, so that queued operations batch sooner."""
    want = _one_at_a_time(engine, 0, Sampling(), 10)
    pos, last = _start(engine, 1)
    parts = []
    got = engine.verify(1, pos, [last], Sampling(), 0, True, n_more=9, stream_every=3, on_partial=parts.append)
    assert got.tokens == want[: len(got.tokens)] and len(got.tokens) == 10
    assert [(p.offset, len(p.tokens)) for p in parts] == [(0, 3), (3, 3), (6, 3)]
    assert sum((p.tokens for p in parts), []) == got.tokens[:9]
    assert sum((p.pieces for p in parts), []) == got.pieces[:9]
    pos, last = _start(engine, 1)
    got = engine.verify(1, pos, [last], Sampling(), 0, True, n_more=9, others_waiting=lambda: True)
    assert got.tokens == want[:1] and got.n_more == 0 and got.state.pos_max == pos


@pytest.fixture(scope="module")
def streaming_cluster(cluster_factory):
    return cluster_factory(n_ctx=256, n_seq=2, router_args=["--solo-tokens", "12", "--stream-tokens", "4"])


COUNTING = "1, 2, 3, 4, 5,"  # goes on past 30 tokens


def _messages(client: RouterClient, **kw) -> list[list[int]]:
    from specd.client import make_request

    return [list(m.token_ids) for m in client.stub.Generate(make_request(COUNTING, **kw), timeout=120) if m.token_ids]


def test_the_stream_gets_groups_while_the_target_goes_on_for_longer(streaming_cluster):
    """Over gRPC, from real worker processes: calls of 12 tokens reach the
    client in messages of at most 4, the same tokens as calls of 4 (a
    request with a stop string that never matches); the alignment check
    (the factory's) passes after every step."""
    with RouterClient(streaming_cluster.router_address, timeout=120) as client:
        long = client.generate(COUNTING, max_tokens=30, speculative=False)
        short = client.generate(COUNTING, max_tokens=30, speculative=False, stop=["<never in this text>"])
        messages = _messages(client, max_tokens=30, speculative=False)
    assert long.tokens == short.tokens and long.n_generated == 30
    assert long.n_steps == 3 and short.n_steps == 8  # 12 + 12 + 6 against 4 a call
    assert sum(messages, []) == long.tokens
    assert max(len(m) for m in messages) <= 4 and len(messages) >= 8, [len(m) for m in messages]
