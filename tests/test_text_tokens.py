"""Token bookkeeping and streamed text assembly: pure, no model."""
import numpy as np

from specd.router.text import TextAssembler
from specd.tokens import SeqTokens, history_hash, token_hash


def test_seq_tokens_follow_llama_memory_semantics():
    s = SeqTokens()
    s.append(0, [10, 11, 12, 13, 14, 15])
    assert (s.pos_min, s.pos_max, len(s)) == (0, 5, 6)
    s.rm(4, -1)  # [4, inf)
    assert list(s.tok) == [10, 11, 12, 13]
    s.rm(1, 3)  # middle: [1, 3)
    assert list(s.pos) == [0, 3] and list(s.tok) == [10, 13]
    s.add(3, -1, -2)  # shift [3, inf) by -2
    assert list(s.pos) == [0, 1]
    assert s.hash() == history_hash([10, 13])
    s.rm(-1, -1)
    assert len(s) == 0 and s.pos_max == -1


def test_hash_depends_on_positions_and_tokens():
    assert token_hash(np.array([0, 1]), np.array([5, 6])) != token_hash(np.array([0, 2]), np.array([5, 6]))
    assert token_hash(np.array([0, 1]), np.array([5, 6])) != token_hash(np.array([0, 1]), np.array([6, 5]))


def test_text_holds_back_possible_stop_strings():
    t = TextAssembler(["END"])
    assert t.feed(b"hello E") == "hello"  # " E" may start "END"
    assert t.feed(b"N") == " "
    assert t.feed(b"D and more") == ""
    assert t.stopped and t.flush() == ""


def test_text_without_stop_is_flushed():
    t = TextAssembler(["STOP"])
    out = t.feed(b"abc") + t.feed(b"def") + t.flush()
    assert out == "abcdef" and not t.stopped


def test_text_joins_split_utf8():
    t = TextAssembler([])
    data = "é€".encode()
    out = t.feed(data[:1]) + t.feed(data[1:3]) + t.feed(data[3:]) + t.flush()
    assert out == "é€"


def test_text_reports_the_token_that_completed_a_stop():
    # one step's pieces: the stop " 8," completes with the 5th token; the 6th is past it
    t = TextAssembler([" 8,"])
    fed = t.feed_pieces([b" 6", b",", b" 7", b", 8", b",", b" 9"])
    assert (fed.text, fed.n_tokens, t.stopped) == (" 6, 7,", 5, True)
    assert t.feed_pieces([b" 10"]).n_tokens == 0 and t.flush() == ""
    # no stop: every piece is used, and text held back for a possible stop comes later
    t = TextAssembler(["END"])
    fed = t.feed_pieces([b"a", b"E"])
    assert (fed.text, fed.n_tokens, t.stopped) == ("", 2, False)
    assert t.flush() == "aE"


def test_text_finds_stops_across_feeds_and_the_earliest_one():
    # each stop is looked for only where it could end in the new text; a stop
    # spanning several feeds, and the earliest of several, are still found
    t = TextAssembler(["abcd", "cx", "zz"])
    assert t.feed(b"0ab") + t.feed(b"c") == "0"
    assert t.feed(b"x") == "ab" and t.stopped  # "cx" starts at "c", before "abcd" could end
    t = TextAssembler(["bcd", "abcde"])
    assert t.feed(b"xab") + t.feed(b"cd") == "xa" and t.stopped
    t = TextAssembler(["cd", "abcd"])  # both end in one feed: the text ends where the first starts
    assert t.feed(b"x") + t.feed(b"abcd") == "x" and t.stopped
    t = TextAssembler(["zz"])
    out = "".join(t.feed(b"z" if i % 7 == 0 else b"y") for i in range(50))
    assert not t.stopped and out + t.flush() == "".join("z" if i % 7 == 0 else "y" for i in range(50))
