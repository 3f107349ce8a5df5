"""Several target workers: sessions spread over them, and a session whose
target is killed (-9) mid-stream resumes on another by replaying its history,
with the same output."""
from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

from specd.client import RouterClient, collect, make_request
from tests.conftest import PROMPTS


def test_target_killed_mid_stream_sessions_resume_on_another(cluster_factory, models):
    c = cluster_factory(n_ctx=1024, n_seq=4, n_targets=2)
    prompts = [", ".join(str(i) for i in range(1, 21)) + ",", *PROMPTS[:3]]
    with RouterClient(c.router_address, timeout=300) as client:
        base = [client.generate(p, max_tokens=120, speculative=False) for p in prompts]
        streams = [client.stub.Generate(make_request(p, max_tokens=120), timeout=300) for p in prompts]
        firsts = [next(s) for s in streams]  # all four are generating, two on each target
        assert all(f.token_ids for f in firsts)
        c.procs["target"].popen.send_signal(signal.SIGKILL)
        with ThreadPoolExecutor(4) as pool:
            rests = list(pool.map(collect, streams))
        for b, f, r in zip(base, firsts, rests):
            assert list(f.token_ids) + r.tokens == b.tokens
            assert r.finish_reason == b.finish_reason
            # drafting went on after the failover: a fixed draft length of 4,
            # so a session drafting only before it would draft a few tokens
            assert r.n_drafted >= 2 * r.n_steps, (r.n_drafted, r.n_steps)
        assert "resuming on another target" in c.procs["router"].log_path.read_text()
        # new sessions go to the live target, with speculation
        t0 = time.monotonic()
        after = [client.generate(p, max_tokens=30) for p in prompts]
        assert [a.tokens for a in after] == [b.tokens[:30] for b in base]
        assert all(a.speculative for a in after) and sum(a.n_accepted for a in after) > 0
        assert time.monotonic() - t0 < 120


def test_a_prompt_cache_lost_with_its_target_leaves_the_draft_usable(cluster_factory):
    """Seq 0 ends with its prompt cache on target A and on the draft; A dies
    and another session's failover drops the cache entry. The draft still
    holds seq 0's tokens: the next session on seq 0 must clear them there
    and draft, not be refused at position 0 and decode without speculation."""
    c = cluster_factory(n_ctx=512, n_seq=2, n_targets=2)
    with RouterClient(c.router_address, timeout=300) as client:
        first = client.generate(PROMPTS[0], max_tokens=16)  # seq 0 on the first target
        assert first.n_drafted > 0
        stream = client.stub.Generate(make_request(PROMPTS[3], max_tokens=80), timeout=300)  # seq 1, same target
        assert next(stream).token_ids
        c.procs["target"].popen.send_signal(signal.SIGKILL)
        assert collect(stream).finish_reason
        again = client.generate(PROMPTS[0], max_tokens=16)  # seq 0, on the other target
        assert again.tokens == first.tokens
        assert again.speculative and again.n_drafted > 0
        assert "draft worker failed" not in c.procs["router"].log_path.read_text()
