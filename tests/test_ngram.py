"""Unit tests for the model-free n-gram proposers (draft_worker.ngram); no model needed."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specd.draft_worker.ngram import (
    PROPOSER_NAMES, CacheProposer, ChainProposer, ModProposer, NgramMapProposer, Proposer,
    SimpleProposer, make_proposer,
)
from specd.tokens import ends_in_repeat

# Hand-built histories. L: lead tokens, K: the key n-gram, X / Y / Z: continuations.
L = list(range(100, 112))
K = [1, 2, 3]
X = list(range(10, 18))
Y = list(range(20, 28))
Z = list(range(30, 38))
A = L + K + X + K                # ends with K; K was followed by X before
PREFIX = L + K                   # A cut right after the first K (X removed)
NOREP = list(range(200, 230))    # no token repeats


def unique_tokens(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).permutation(100_000)[:n].tolist()


def small(name: str):
    """Each proposer with small sizes, so hand-built histories reach them."""
    return {
        "simple": lambda: SimpleProposer(size_n=3, size_m=4),
        "map-k": lambda: NgramMapProposer(key_only=True, size_n=3, size_m=4),
        "map-k4v": lambda: NgramMapProposer(key_only=False, size_n=3, size_m=4),
        "mod": lambda: ModProposer(n_match=3, n_max=4, n_min=1, table_size=1 << 16),
        "cache": lambda: CacheProposer(n_draft=4),
    }[name]()


# ---------------------------------------------------------------- all proposers

@pytest.mark.parametrize("name", PROPOSER_NAMES)
def test_match_proposes_continuation(name):
    assert small(name).propose(A, 4) == X[:4]


@pytest.mark.parametrize("name", PROPOSER_NAMES)
def test_no_match_proposes_nothing(name):
    assert small(name).propose(NOREP, 4) == []
    assert small(name).propose(L + K + X + [4, 5, 6], 4) == []


@pytest.mark.parametrize("name", PROPOSER_NAMES)
def test_n_max_cut(name):
    p = small(name)
    assert p.propose(A, 2) == X[:2]
    assert p.propose(A, 1) == X[:1]
    assert p.propose(A, 0) == []


@pytest.mark.parametrize("name", PROPOSER_NAMES)
def test_history_not_mutated_and_plain_ints(name):
    p = small(name)
    hist = list(A)
    arr = np.array(A, dtype=np.int32)
    p.observe(hist)
    out = p.propose(hist, 4)
    p.observe(arr)
    out2 = p.propose(arr, 4)
    assert hist == A and arr.tolist() == A
    assert out == out2 == X[:4]
    assert all(type(t) is int for t in out + out2)


@pytest.mark.parametrize("name", PROPOSER_NAMES)
def test_truncated_history_forgets_removed_continuation(name):
    p = small(name)
    assert p.propose(A, 4) == X[:4]
    p.observe(A)
    # llama_memory_seq_rm removed everything after PREFIX: X must not come back
    assert p.propose(PREFIX, 4) == []
    # regenerated differently: the new continuation is proposed, not the removed one
    if name.startswith("map-k"):
        # llama.cpp's map never indexes a key in the last size_n + size_m
        # tokens of a prompt (here the kept PREFIX): only a later copy counts
        assert p.propose(PREFIX + Z + K + Y + K + Y + K, 4) == Y[:4]
    else:
        assert p.propose(PREFIX + Z + K, 4) == Z[:4]


@pytest.mark.parametrize("name", PROPOSER_NAMES)
def test_defaults_match_llama_cpp(name):
    r = unique_tokens(400)
    hist = r + r[:30]
    d = make_proposer(name).propose(hist, 64)
    expected_len = {"simple": 48, "map-k": 48, "map-k4v": 48, "mod": 64, "cache": 8}[name]
    assert d == r[30 : 30 + expected_len]


def test_proposers_satisfy_protocol():
    for name in PROPOSER_NAMES:
        p = make_proposer(name)
        assert isinstance(p, Proposer) and p.name == name


# ---------------------------------------------------------------- simple

def test_simple_uses_latest_occurrence():
    h = L + K + X + [5] + K + Y + [6] + K
    assert SimpleProposer(3, 4).propose(h, 8) == Y[:4]


def test_simple_shortest_ngram_and_min_draft_rule():
    h = [50, 51, 52, 53, 54, 55] + [7] * 6
    # size_n = 1: the latest earlier 7 leaves one token before id_last -> 1-token draft
    assert SimpleProposer(size_n=1, size_m=4).propose(h, 4) == [7]
    # size_n = 3: only 1 token is available after the match, fewer than size_n -> nothing
    assert SimpleProposer(size_n=3, size_m=4).propose(h, 4) == []
    assert SimpleProposer(size_n=1, size_m=2).propose([9, 7] + X + [7], 4) == X[:2]


def test_simple_longest_ngram():
    r = unique_tokens(2100, seed=1)
    hist = [5] + r + r[:1024]
    assert SimpleProposer(size_n=1024, size_m=1024).propose(hist, 6) == r[1024:1030]
    # one token off in the 1024-gram: no match
    hist2 = [5] + r + [r[0] + 1] + r[1:1024]
    assert SimpleProposer(size_n=1024, size_m=1024).propose(hist2, 6) == []


def test_simple_needs_enough_history():
    short = [9] + K + X[:2] + K          # 9 tokens <= size_n + size_m + 2
    assert SimpleProposer(3, 4).propose(short, 4) == []


@pytest.mark.parametrize("kw", [{"size_n": 0}, {"size_n": 1025}, {"size_m": 0}, {"size_m": 1025}])
def test_simple_rejects_bad_sizes(kw):
    with pytest.raises(ValueError):
        SimpleProposer(**kw)


# ---------------------------------------------------------------- map-k / map-k4v

def test_map_k_latest_vs_k4v_majority():
    h = L + K + X + [5] + K + X + [6] + K + Y + [7] + K
    assert NgramMapProposer(True, 3, 4).propose(h, 8) == Y[:4]      # latest continuation
    # map-k4v: X follows K twice, Y once, so the count lets it draft; like
    # llama.cpp it drafts what follows the match (Y), X only sets the length
    assert NgramMapProposer(False, 3, 4).propose(h, 8) == Y[:4]
    tie = L + K + X + [5] + K + Y + [7] + K
    assert NgramMapProposer(False, 3, 4).propose(tie, 8) == []      # 1 vs 1: no clear winner
    assert NgramMapProposer(True, 3, 4).propose(tie, 8) == Y[:4]


def test_map_k_takes_the_first_copy_it_indexed():
    """The hash table keeps the first position it indexed for a key: once a
    copy is indexed, later copies do not replace it (llama.cpp's key_map)."""
    p = NgramMapProposer(True, 3, 4)
    assert p.propose(A, 8) == X[:4]                  # indexes the prompt, K at 12
    h = A + X[:4] + [9, 7] + K + Y + [6] + K         # the draft held; K again, then Y
    assert p.propose(h, 8) == X[:4]                  # K at 32 (then Y) is newer: 12 stays
    assert NgramMapProposer(True, 3, 4).propose(h, 8) == Y[:4]   # a fresh prompt: the latest


def test_map_min_hits():
    """min_hits counts lookups of the key (map-k4v only; map-k ignores it, as llama.cpp)."""
    p = NgramMapProposer(False, 3, 4, min_hits=2)
    assert p.propose(A, 4) == []                     # the key's first lookup
    p.observe(A)
    assert p.propose(A, 4) == X[:4]                  # its second
    assert NgramMapProposer(True, 3, 4, min_hits=2).propose(A, 4) == X[:4]


@pytest.mark.parametrize("key_only", [True, False])
def test_map_shortest_and_longest_ngram(key_only):
    h = [90, 7] + X + [91] + [7]
    assert NgramMapProposer(key_only, size_n=1, size_m=2).propose(h, 4) == X[:2]
    r = unique_tokens(2100, seed=2)
    hist = [5] + r + r[:1024]
    assert NgramMapProposer(key_only, size_n=1024, size_m=8).propose(hist, 8) == r[1024:1032]
    with pytest.raises(ValueError):
        NgramMapProposer(key_only, size_n=1025)
    with pytest.raises(ValueError):
        NgramMapProposer(key_only, size_n=0)


def test_map_k_learns_accepted_length():
    p = NgramMapProposer(True, 3, 4)
    assert p.propose(A, 4) == X[:4]
    p.observe(A + X[:2] + [99])          # 2 drafted tokens accepted, then a correction
    again = A + X[:2] + [99, 98] + K     # K again, now followed by X0 X1 99 98
    assert p.propose(again, 4) == X[:2]
    # a fresh proposer has not learned it
    assert NgramMapProposer(True, 3, 4).propose(again, 4) == X[:2] + [99, 98]


def test_map_k_rejected_key_stays_off():
    p = NgramMapProposer(True, 3, 4)
    assert p.propose(A, 4) == X[:4]
    p.observe(A + [99])                  # first drafted token rejected -> the key drafts 0 tokens
    assert p.propose(A + [99, 98] + K, 4) == []
    # truncating after the key keeps it, and what it learned (as llama.cpp's begin)
    assert p.propose(A, 4) == []
    # truncating before it forgets it
    assert p.propose(L + K + X[:1], 4) == []
    assert p.propose(L + K + Z + [7] + K + Y + [6] + K, 4) == Y[:4]


def test_map_k4v_learns_accepted_length():
    p = NgramMapProposer(False, 3, 4)
    assert p.propose(A, 4) == X[:4]
    p.observe(A + X[:1] + [99])          # value X: 1 accepted
    later = A + X[:1] + [99, 98] + K + X + [97] + K    # values after K: X, (X0 99 98 1), X
    assert p.propose(later, 4) == X[:1]
    assert NgramMapProposer(False, 3, 4).propose(later, 4) == X[:4]


# ---------------------------------------------------------------- mod

def mod(**kw) -> ModProposer:
    args = dict(n_match=3, n_max=6, n_min=1, table_size=1 << 16)
    args.update(kw)
    return ModProposer(**args)


def test_mod_follows_table_across_sequences_and_n_min():
    p = mod(n_min=4)
    p.observe(K + [10, 11, 12])          # teaches 1 2 3 -> 10 -> 11 -> 12, then nothing
    p.reset()                            # new sequence: the table is kept
    seq2 = [60, 61] + K
    assert p.propose(seq2, 6) == []      # the chain stops after 3 tokens < n_min = 4
    q = mod(n_min=3)
    q.observe(K + [10, 11, 12])
    q.reset()
    assert q.propose(seq2, 6) == [10, 11, 12]
    assert q.propose(seq2, 2) == [10, 11]          # n_min applies before the n_max cut
    assert mod(n_min=3).propose(seq2, 6) == []     # a fresh table knows nothing
    r = mod(n_min=4)
    r.observe(K + [10, 11, 12])
    r.reset()
    assert r.propose(seq2, 2) == []                # ... so a cut draft can still be dropped


def test_mod_shortest_and_longest_ngram():
    assert mod(n_match=1).propose([5, 10, 11, 12, 6, 5], 4) == [10, 11, 12, 6]
    r = unique_tokens(1100, seed=3)
    hist = r + r[:1024]
    p = ModProposer(n_match=1024, n_max=6, n_min=6, table_size=1 << 20)
    assert p.propose(hist, 6) == r[1024:1030]
    for bad in (0, 1025):
        with pytest.raises(ValueError):
            ModProposer(n_match=bad, table_size=16)


def test_mod_truncation_keeps_entries_from_kept_tokens():
    p = mod()
    assert p.propose(A, 6) == X[:6]
    p.observe(A + [99])                  # rewrites slot(1 2 3) := 99
    # seq_rm of the last token: slot(1 2 3) is restored from the first K in the kept history
    assert p.propose(A, 6) == X[:6]
    assert p.table.entries[p.table.slots(np.array(K + [0]), np.array([0]))][0] == X[0]


def test_mod_low_acceptance_streak_clears_table():
    p = mod(n_max=4)
    p.observe([70, 71, 72] + Y)          # an earlier sequence
    p.reset()
    assert p.propose([61, 70, 71, 72], 4) == Y[:4]
    p.reset()
    for _ in range(4):                   # 4 bad drafts, then a good one: streak broken
        assert p.propose(A, 4) == X[:4]
        p.observe(A + [99])
    assert p.propose(A, 4) == X[:4]
    p.observe(A + X[:4])
    for _ in range(4):
        assert p.propose(A, 4) == X[:4]
        p.observe(A + [99])
    p.reset()
    assert p.propose([61, 70, 71, 72], 4) == Y[:4]   # still known
    p.reset()
    for _ in range(5):                   # 5 in a row: the table is emptied
        assert p.propose(A, 4) == X[:4]
        p.observe(A + [99])
    p.reset()
    assert p.propose([61, 70, 71, 72], 4) == []


def overlap_rounds(p, hist: list[int], rounds: int, verified_lookahead: bool = True) -> list[int]:
    """What the router does with overlap, each round: the proposer drafts d
    after hist, then, while the target verifies d, a lookahead after hist + d
    (d not verified yet); the target rejects d[0] (says 500 + r), and plain
    steps bring the key K again. Returns the history after the last round."""
    for r in range(rounds):
        d = p.propose(hist, 4)
        assert d, r
        p.propose(hist + d, 4, len(hist) if verified_lookahead else None)
        hist = hist + [500 + r] + K
    return hist


def test_mod_low_acceptance_streak_counts_drafts_rejected_beside_a_lookahead():
    # the lookahead's history holds the drafts being verified: judged on it,
    # each rejected draft read as accepted and the streak never grew
    p = mod(n_max=4)
    p.observe([70, 71, 72] + Y)          # an earlier sequence
    p.reset()
    p.observe(overlap_rounds(p, A, 5))   # the 5th draft is judged once its rejection is verified
    p.reset()
    assert p.propose([61, 70, 71, 72], 4) == []      # 5 rejected drafts in a row emptied the table
    q = mod(n_max=4)
    q.observe([70, 71, 72] + Y)
    q.reset()
    q.observe(overlap_rounds(q, A, 4))
    q.reset()
    assert q.propose([61, 70, 71, 72], 4) == Y[:4]   # 4 are not enough


def test_mod_lookahead_holding_its_own_drafts_breaks_no_streak_when_taken_as_verified():
    # what judging on unverified tokens did: every rejected draft read as accepted
    p = mod(n_max=4)
    p.observe([70, 71, 72] + Y)
    p.reset()
    p.observe(overlap_rounds(p, A, 6, verified_lookahead=False))
    p.reset()
    assert p.propose([61, 70, 71, 72], 4) == Y[:4]


@pytest.mark.parametrize("name", ["mod", "cache"])
def test_unverified_tokens_teach_nothing(name):
    # a lookahead drafts after the drafts under verification but learns nothing from them
    p, fresh = small(name), small(name)
    p.propose(PREFIX + [40, 41, 42, 43] + K, 4, len(PREFIX))
    fresh.observe(PREFIX)
    if name == "mod":
        assert np.array_equal(p.table.entries, fresh.table.entries)
    else:
        assert p.context == fresh.context


def test_map_k_judges_a_lookahead_once_its_guess_held():
    p = NgramMapProposer(True, 3, 4)
    assert p.propose(A, 2) == X[:2]                  # d, verified by the target ...
    look = p.propose(A + X[:2], 4, len(A))           # ... while a lookahead drafts after it
    assert look == X[2:6]
    assert list(p.map.keys) == [tuple(K)]            # the lookahead changed nothing
    # the target accepted d and said X2 (the guess held); X3 then rejected
    p.observe(A + X[:3] + [99])
    assert p.map.keys[tuple(K)].values[0].n_accepted == 2
    q = NgramMapProposer(True, 3, 4)
    assert q.propose(A, 2) == X[:2]
    q.propose(A + X[:2], 4, len(A))
    q.observe(A + [98])                              # d rejected
    assert q.map.keys[tuple(K)].values[0].n_accepted == 0


def test_mod_clear():
    p = mod()
    p.observe(A)
    assert p.table.used > 0
    p.clear()
    assert p.table.used == 0 and p.propose(PREFIX, 4) == []


# ---------------------------------------------------------------- cache

def test_cache_shortest_ngram_and_lax_limits():
    assert CacheProposer().propose([5, 9, 7, 5, 9, 8, 5], 1) == [9]   # 1-gram (5) -> 9 twice
    assert CacheProposer().propose([5, 9, 7, 5], 1) == []             # seen once: below 2 samples


def test_cache_longest_ngram_is_4():
    # the 4-gram 1 2 3 4 decides even though the 3-gram 2 3 4 says 60
    assert CacheProposer().propose([1, 2, 3, 4, 50, 9, 2, 3, 4, 60, 8, 2, 3, 4, 60, 1, 2, 3, 4], 1) == [50]
    # a 5-gram (7 1 2 3 4 -> 50) is not used: the 4-gram 1 2 3 4 says 60 (2 of 3)
    h = [7, 1, 2, 3, 4, 50, 8, 1, 2, 3, 4, 60, 9, 1, 2, 3, 4, 60, 7, 1, 2, 3, 4]
    assert CacheProposer().propose(h, 1) == [60]


def test_cache_learns_across_reset_with_strict_limits():
    seq1 = L + K + X + [5] + K + X       # K -> X twice
    seq2 = [150, 151] + K
    p = CacheProposer()
    p.observe(seq1)
    p.reset()                            # context merged into dynamic
    assert p.context == {}
    assert p.propose(seq2, 8) == X
    assert CacheProposer().propose(seq2, 8) == []
    once = CacheProposer()               # seen once: too few samples for the dynamic cache
    once.observe(A)
    once.reset()
    assert once.propose(seq2, 8) == []


def test_cache_static_fallback():
    p = CacheProposer()
    p.learn_static([5, 6, 5, 6, 5, 6])
    assert p.propose([1, 5, 6], 4) == [5, 6, 5, 6]
    assert CacheProposer().propose([1, 5, 6], 4) == []


def test_cache_save_load_round_trip(tmp_path):
    seq1 = L + K + X + [5] + K + X
    seq2 = [150, 151] + K
    p = CacheProposer()
    p.learn_static([5, 6, 5, 6, 5, 6])
    p.observe(seq1)
    p.reset()
    path = tmp_path / "ngram.cache"
    p.save(path)
    assert path.exists() and list(tmp_path.iterdir()) == [path]
    q = make_proposer("cache", cache_path=path)
    assert q.static == p.static and q.dynamic == p.dynamic and q.context == {}
    q.reset()
    assert q.dynamic == p.dynamic        # reset keeps what was loaded
    assert q.propose(seq2, 8) == X
    assert q.propose([1, 5, 6], 2) == [5, 6]


def test_cache_save_includes_uncommitted_context(tmp_path):
    p = CacheProposer()
    p.observe(L + K + X + [5] + K + X)   # no reset yet
    p.save(tmp_path / "c")
    assert p.dynamic == {}               # saving does not commit
    q = CacheProposer(cache_path=tmp_path / "c")
    assert q.propose([150, 151] + K, 8) == X


def test_cache_load_errors(tmp_path):
    assert make_proposer("cache", cache_path=tmp_path / "missing").dynamic == {}
    bad = tmp_path / "bad.npz"
    np.savez(bad, something=np.zeros(3))
    with pytest.raises(ValueError, match="not a"):
        CacheProposer().load(bad)


def test_cache_truncation_keeps_dynamic():
    p = CacheProposer()
    p.observe(L + K + X + [5] + K + X)
    p.reset()
    p.observe(PREFIX + Z)
    assert p.propose(PREFIX + Z + K, 2) == Z[:2]      # context (lax) wins over dynamic
    assert p.propose(PREFIX, 2) == X[:2]              # Z forgotten, dynamic (earlier sequence) kept


# ---------------------------------------------------------------- chain and make_proposer

class Stub:
    match_needs_repeat = 0

    def __init__(self, name, draft):
        self.name, self.draft, self.calls = name, draft, []

    def propose(self, history, n_max, n_verified=None):
        self.calls.append("propose" if n_max else "withdraw")
        return list(self.draft)[:n_max]

    def observe(self, history):
        self.calls.append("observe")

    def reset(self):
        self.calls.append("reset")


def test_chain_first_non_empty_wins():
    a, b, c = Stub("a", []), Stub("b", [7, 8]), Stub("c", [9])
    chain = ChainProposer([a, b, c])
    assert chain.name == "a,b,c"
    assert chain.propose([1, 2, 3], 4) == [7, 8]
    assert chain.propose([1, 2, 3], 1) == [7]
    assert c.calls == ["withdraw"] * 2   # never asked to draft: b already drafted
    assert ChainProposer([Stub("c", [9]), Stub("b", [7])]).propose([1], 4) == [9]
    assert ChainProposer([Stub("a", [])]).propose([1], 4) == []
    chain.observe([1, 2, 3])
    chain.reset()
    assert a.calls[-2:] == b.calls[-2:] == c.calls[-2:] == ["observe", "reset"]


def test_make_proposer_chain_order():
    r = unique_tokens(400, seed=4)
    hist = r + r[:30]
    assert make_proposer("simple,cache").propose(hist, 64) == r[30:78]
    assert make_proposer("cache, simple").propose(hist, 64) == r[30:38]
    chain = make_proposer("simple,cache")
    assert isinstance(chain, ChainProposer) and chain.name == "simple,cache"
    # simple cannot draft from a short history, cache can
    assert make_proposer("simple,cache").propose(A, 4) == X[:4]


@pytest.mark.parametrize("spec, bad", [("bogus", "bogus"), ("simple,ngram-mod", "ngram-mod"), ("", ""),
                                       ("map-k,,cache", "")])
def test_make_proposer_rejects_unknown_names(spec, bad):
    with pytest.raises(ValueError) as err:
        make_proposer(spec)
    msg = str(err.value)
    assert repr(bad) in msg
    assert all(name in msg for name in PROPOSER_NAMES)


def test_make_proposer_rejects_repeats():
    with pytest.raises(ValueError, match="'mod' appears twice"):
        make_proposer("mod,simple,mod")


def test_make_proposer_takes_llama_cpp_parameters():
    p = make_proposer("simple:size-n=3:size-m=16")
    assert (p.size_n, p.size_m) == (3, 16)
    chain = make_proposer("map-k4v:size-n=2:size-m=8:min-hits=2, mod:n-match=4:n-min=0:n-max=16, cache")
    mk, mod, _ = chain.members
    assert (mk.key_only, mk.size_n, mk.size_m, mk.min_hits) == (False, 2, 8, 2)
    assert (mod.n_match, mod.n_min, mod.n_max) == (4, 0, 16)
    # a short n-gram drafts where the default 12-token key cannot
    r = unique_tokens(60, seed=5)
    hist = r + r[:3]
    assert make_proposer("simple").propose(hist, 8) == []
    assert make_proposer("simple:size-n=3:size-m=8").propose(hist, 8) == r[3:11]


@pytest.mark.parametrize("spec, words", [
    ("simple:size-x=3", ["'size-x'", "size-n, size-m"]),
    ("mod:n-match=abc", ["mod:n-match", "'abc'"]),
    ("simple:size-n", ["simple:size-n", "integer"]),
    ("mod:n-match=0", ["'mod:n-match=0'", "n_match", "[1, 1024]"]),
    ("cache:size-n=2", ["'size-n'", "none"]),
])
def test_make_proposer_rejects_bad_parameters(spec, words):
    with pytest.raises(ValueError) as err:
        make_proposer(spec)
    assert all(w in str(err.value) for w in words), str(err.value)


# ------------------------------------------------- what a match needs (go-on)

def _repeat_brute(history: list[int], n: int) -> bool:
    key = history[len(history) - n:]
    return n > 0 and any(history[j:j + n] == key for j in range(len(history) - n))


@given(st.lists(st.integers(0, 3), max_size=40), st.integers(0, 6))
@settings(max_examples=300, deadline=None)
def test_ends_in_repeat_is_an_earlier_copy_of_the_last_n(history, n):
    assert ends_in_repeat(np.array(history, dtype=np.int32), n) == _repeat_brute(history, n)


@pytest.mark.parametrize("make", [lambda: SimpleProposer(size_n=2, size_m=2),
                                  lambda: NgramMapProposer(key_only=True, size_n=2, size_m=2),
                                  lambda: NgramMapProposer(key_only=False, size_n=3, size_m=2),
                                  lambda: ChainProposer([SimpleProposer(size_n=3, size_m=2),
                                                         NgramMapProposer(size_n=2, size_m=2)])],
                         ids=["simple", "map-k", "map-k4v", "chain"])
@given(history=st.lists(st.integers(0, 2), min_size=1, max_size=30))
@settings(max_examples=200, deadline=None)
def test_a_draft_needs_the_repeat_its_proposer_declares(make, history):
    """The target goes on alone until a repeat of match_needs_repeat tokens
    (VerifyRequest.stop_on_repeat): a proposer that drafts without one would
    lose its matches to it."""
    p = make()
    assert p.match_needs_repeat > 0
    if p.propose(history, 8):
        assert ends_in_repeat(np.array(history, dtype=np.int32), p.match_needs_repeat)


def test_drafters_with_tables_of_their_own_declare_no_repeat():
    assert small("mod").match_needs_repeat == 0 and small("cache").match_needs_repeat == 0
    assert ChainProposer([small("simple"), small("mod")]).match_needs_repeat == 0
    assert ChainProposer([SimpleProposer(size_n=5), NgramMapProposer(size_n=3)]).match_needs_repeat == 3
