"""The public API against real processes: bad input, stop strings, seeds,
vocabulary checks and a draft worker that dies mid-stream."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import google.rpc
import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from specd.client import RouterClient, collect, make_request
from specd.launcher import Cluster, ClusterSpec, Proc, ProcessDied
from specd.models import gemma3_model
from specd.v1 import router_pb2 as rpb
from specd.v1 import router_pb2_grpc as rpb_grpc

BAD_REQUESTS = [
    ("prompt", lambda r: r.ClearField("prompt")),
    ("prompt", lambda r: setattr(r, "prompt", "")),
    ("prompt_tokens[1]", lambda r: r.prompt_tokens.ids.extend([1, 49152])),
    ("prompt_tokens[0]", lambda r: r.prompt_tokens.ids.extend([-3])),
    ("prompt", lambda r: r.prompt_tokens.ids.extend([42] * 5000)),
    ("max_tokens", lambda r: setattr(r, "max_tokens", 0)),
    ("max_tokens", lambda r: setattr(r, "max_tokens", -5)),
    ("max_tokens", lambda r: setattr(r, "max_tokens", 5000)),
    ("sampling.temperature", lambda r: setattr(r.sampling, "temperature", -1.0)),
    ("sampling.top_p", lambda r: setattr(r.sampling, "top_p", 1.5)),
    ("sampling.top_k", lambda r: setattr(r.sampling, "top_k", -2)),
    ("speculative.n_max", lambda r: setattr(r.speculative, "n_max", 0)),
    ("speculative.n_max", lambda r: setattr(r.speculative, "n_max", 65)),
    ("speculative.n_min", lambda r: (setattr(r.speculative, "n_max", 2), setattr(r.speculative, "n_min", 3))),
    ("speculative.p_min", lambda r: setattr(r.speculative, "p_min", 1.5)),
    ("n_keep", lambda r: setattr(r, "n_keep", -1)),
]


@pytest.mark.parametrize("field,mutate", BAD_REQUESTS, ids=[f"{i}-{f}" for i, (f, _) in enumerate(BAD_REQUESTS)])
def test_bad_request_is_invalid_argument_naming_the_field(cluster, field, mutate):
    req = rpb.GenerateRequest(prompt="Hello", max_tokens=4)
    mutate(req)
    with grpc.insecure_channel(cluster.router_address) as ch:
        stub = rpb_grpc.RouterStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(req, timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in err.value.details()
        # the standard error model: a google.rpc.BadRequest names the field
        status = rpc_status.from_call(err.value)
        assert status is not None and status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        (detail,) = status.details
        bad = error_details_pb2.BadRequest()
        assert detail.Unpack(bad), detail.type_url
        assert [v.field for v in bad.field_violations] == [field]
    # the workers keep serving, and nothing leaked into the next request
    with RouterClient(cluster.router_address) as client:
        r = client.generate("The capital of France is", max_tokens=6)
        assert r.n_generated == 6 and r.text


def test_stop_string_cuts_text(cluster):
    with RouterClient(cluster.router_address) as client:
        full = client.generate("1, 2, 3, 4, 5,", max_tokens=20, speculative=False)
        assert " 8," in full.text
        r = client.generate("1, 2, 3, 4, 5,", max_tokens=20, stop=[" 8,"])
        assert r.finish_reason == "stop"
        assert r.text == full.text[: full.text.index(" 8,")]


def test_seed_reproduces_output_with_and_without_speculation(cluster):
    # exact acceptance keeps "same seed, same text with or without a draft";
    # speculative sampling (the default) draws the draft's own numbers
    with RouterClient(cluster.router_address) as client:
        kw = dict(max_tokens=24, temperature=0.9, seed=1234)
        a = client.generate("Once upon a time", acceptance="exact", **kw)
        b = client.generate("Once upon a time", acceptance="exact", **kw)
        c = client.generate("Once upon a time", speculative=False, **kw)
        d = client.generate("Once upon a time", max_tokens=24, temperature=0.9, seed=99, acceptance="exact")
        assert a.tokens == b.tokens == c.tokens
        assert a.n_drafted > 0
        assert d.tokens != a.tokens
        # with the default the same seed still gives the same text run after run
        e = client.generate("Once upon a time", **kw)
        assert client.generate("Once upon a time", **kw).tokens == e.tokens and e.n_drafted > 0


def test_info_and_tokenize(cluster, models):
    with RouterClient(cluster.router_address) as client:
        info = client.info()
        assert info.target.n_vocab == info.draft.n_vocab == 49152
        assert info.target.vocab_fingerprint == info.draft.vocab_fingerprint
        assert info.draft_up and info.target.model_path == models["target"]
        assert client.tokenize("Hello world") == [19556, 905]


def test_cli_generate_json(cluster):
    out = subprocess.run(
        [sys.executable, "-m", "specd", "generate", "--router", cluster.router_address, "--json",
         "--max-tokens", "12", "The capital of France is"],
        capture_output=True, text=True, timeout=120, check=True,
    )
    d = json.loads(out.stdout)
    assert set(d) >= {"text", "tokens", "n_prompt", "n_generated", "n_drafted", "n_accepted", "finish_reason",
                      "tokens_per_second"}
    assert d["n_generated"] == len(d["tokens"]) == 12 and d["tokens_per_second"] > 0
    assert "Paris" in d["text"]


def test_mismatched_vocabularies_refuse_to_start(models):
    gemma = gemma3_model(quiet=True)
    with pytest.raises(ProcessDied) as err:
        Cluster(ClusterSpec(target_model=models["target"], draft_model=gemma, n_ctx=512, n_seq=1)).start(timeout=120)
    msg = str(err.value)
    assert "router exited" in msg and "vocabulary" in msg
    assert os.path.basename(models["target"]) in msg and os.path.basename(gemma) in msg


def test_draft_killed_mid_stream_degrades_to_target_only(cluster_factory, models):
    c = cluster_factory(n_ctx=1024, n_seq=1)
    prompt = ", ".join(str(i) for i in range(1, 21)) + ","
    with RouterClient(c.router_address) as client:
        base = client.generate(prompt, max_tokens=160, speculative=False)
        stream = client.stub.Generate(make_request(prompt, max_tokens=160), timeout=120)
        first = next(stream)
        assert first.token_ids
        c.procs["draft"].popen.send_signal(signal.SIGKILL)
        rest = collect(stream)
        tokens = list(first.token_ids) + rest.tokens
        assert tokens == base.tokens
        assert rest.finish_reason == "length" and rest.n_generated == 160
        # later requests are served target-only, without error, and the router says the draft is down
        after = client.generate(prompt, max_tokens=20)
        assert after.tokens == base.tokens[:20] and not after.speculative
        assert not client.info().draft_up
        # a draft coming back on the same address is attached again and used
        port = int(c.procs["draft"].port_file.read_text())
        c.procs["draft"] = Proc("draft2", ["draft", "--model", models["draft"], "--port", str(port), "--threads", "1",
                                           "--n-ctx", "1024", "--n-seq", "1"], c.workdir)
        deadline = time.monotonic() + 60
        while not client.info().draft_up:
            assert time.monotonic() < deadline, c.procs["draft"].log_tail()
            time.sleep(0.5)
        again = client.generate(prompt, max_tokens=40)
        assert again.speculative and again.n_accepted > 0
        assert again.tokens == base.tokens[:40]


def test_target_killed_mid_stream_ends_with_unavailable(cluster_factory):
    c = cluster_factory(n_ctx=1024, n_seq=1)
    prompt = ", ".join(str(i) for i in range(1, 21)) + ","
    with RouterClient(c.router_address) as client:
        stream = client.stub.Generate(make_request(prompt, max_tokens=400), timeout=120)
        assert next(stream).token_ids
        c.procs["target"].popen.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            collect(stream)
        assert time.monotonic() - t0 < 2.0
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "target" in err.value.details()
        # new requests get a clear status too, not a hang
        with pytest.raises(grpc.RpcError) as err:
            client.generate("Hello", max_tokens=4)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


# A Node.js client (@grpc/grpc-js) generated from the public protos alone
# streams a completion and reads which field of an invalid request was wrong.
NODE_DIR = pathlib.Path(__file__).parent / "node"
PROTOS = pathlib.Path(__file__).parents[1] / "protos"
# google/rpc/{status,error_details}.proto ship with googleapis-common-protos
GOOGLEAPIS = pathlib.Path(google.rpc.__path__[0]).parents[1]


def test_a_node_client_streams_and_reads_a_field_violation(cluster):
    node = shutil.which("node")
    assert node, "node is not installed (scripts/test.sh needs Node.js and npm)"
    assert (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir(), "run npm ci in tests/node (scripts/test.sh)"
    assert (GOOGLEAPIS / "google" / "rpc" / "error_details.proto").is_file()
    r = subprocess.run([node, "client.js", cluster.router_address, str(PROTOS), str(GOOGLEAPIS)], cwd=NODE_DIR,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    with RouterClient(cluster.router_address) as client:
        expected = client.generate("1, 2, 3, 4,", max_tokens=8)
    assert out["text"] == expected.text and out["generated_tokens"] == 8
    assert out["finish_reason"] == "FINISH_REASON_LENGTH"
    invalid = out["invalid"]
    assert invalid["code"] == 3 and invalid["status_code"] == 3  # INVALID_ARGUMENT
    (detail,) = invalid["details"]
    assert detail["type"] == "google.rpc.BadRequest"
    assert [v["field"] for v in detail["value"]["fieldViolations"]] == ["speculative.n_max"]
