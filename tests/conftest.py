"""Shared fixtures: the default models and local clusters of real processes."""
from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specd.launcher import Cluster, ClusterSpec
from specd.models import default_models

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "<|im_start|>user\nWrite a haiku about autumn.<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea,",
    "List three benefits of regular exercise:\n1.",
    "<|im_start|>user\nSummarise: \"The quick brown fox jumps over the lazy dog.\"<|im_end|>\n<|im_start|>assistant\n",
    "import numpy as np\n\n# compute the mean of an array\n",
    "Q: What is 12 times 12?\nA:",
    "The history of the printing press begins",
    "{\"name\": \"Alice\", \"age\": 30, \"city\": ",
]


def health(address: str, service: str = "") -> int | None:
    """A server's grpc.health.v1 status for `service`; None when it does not answer."""
    with grpc.insecure_channel(address) as ch:
        try:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
        except grpc.RpcError:
            return None


@pytest.fixture(scope="session")
def models() -> dict[str, str]:
    return default_models(quiet=True)


@pytest.fixture(scope="module")
def cluster_factory(models):
    """Start clusters of real processes; they are stopped at the end of the module."""
    started: list[Cluster] = []

    def make(router_args=(), adaptive: bool = False, **kw) -> Cluster:
        # fixed draft length unless a request asks for adaptive (or adaptive=True):
        # what these tests check (drafts reach the draft, metrics move, output
        # stays lossless while drafting) must not depend on how loaded the
        # machine is, which is what adaptive speculation reacts to. Nor do
        # they need the workers to time their decodes at start (seconds a
        # worker, for the cost model): without it a request asking for
        # adaptive speculation drafts n_max, and batches pad by the default
        if not adaptive:
            kw["worker_args"] = ["--no-calibrate", *kw.get("worker_args", [])]
        spec = ClusterSpec(target_model=kw.pop("target_model", models["target"]),
                           draft_model=kw.pop("draft_model", models["draft"]),
                           router_args=["--check-alignment", *([] if adaptive else ["--no-adaptive"]), *router_args],
                           **kw)
        c = Cluster(spec).start()
        started.append(c)
        return c

    yield make
    for c in started:
        c.stop()


@pytest.fixture(scope="module")
def cluster(cluster_factory):
    """Target + draft + router with the alignment check on."""
    return cluster_factory(n_ctx=1024, n_seq=2)
