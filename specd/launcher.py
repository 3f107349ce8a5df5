"""Start target, draft and router as local processes (`specd up`, `specd demo`,
end-to-end tests). Ports are picked by the OS (port 0) and read back from
port files; readiness is the router's gRPC health saying SERVING.

Security flags pass through as extra arguments: `worker_args` (both workers,
e.g. --tls-cert/--tls-key/--tls-ca), `router_args` (--worker-tls-*,
--api-key-file, the router's own --tls-*). When the router serves TLS, give
`router_credentials` so the readiness check can reach its health service.
`api_key_file` locks all three with one key file, as one Secret mounted into
every pod: clients need a key, and the router presents the first key to the
workers, which refuse any call without it."""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


@dataclass
class ClusterSpec:
    target_model: str
    draft_model: str = ""
    ngram: str = ""
    # with ngram: draft in the router process (router --ngram), as `specd up`
    # does; False: in a draft worker process of its own (specd draft --ngram)
    ngram_in_router: bool = True
    target_threads: int = 1
    draft_threads: int = 1
    target_threads_batch: int = 0  # 0: target_threads
    draft_threads_batch: int = 0  # 0: draft_threads
    n_ctx: int = 2048
    n_seq: int = 4
    host: str = "127.0.0.1"
    router_port: int = 0
    router_args: list[str] = field(default_factory=list)
    worker_args: list[str] = field(default_factory=list)
    draft_args: list[str] = field(default_factory=list)
    metrics: bool = False  # give every process a /metrics port (cluster.metrics_ports)
    n_targets: int = 1  # target workers: "target", "target2", ...
    router_credentials: grpc.ChannelCredentials | None = None  # a router serving TLS: how to reach its health
    # the router's OpenAI-compatible HTTP API on a free port (cluster.http_url);
    # off otherwise, so that clusters side by side do not all take 8080
    http: bool = False
    http_port: int = 0  # with http: this port (0: a free one)
    api_key_file: str = ""  # --api-key-file of all three processes (the router presents its first key)
    # start the target without waiting for the draft to serve, as Kubernetes
    # starts pods: each worker then times its decodes while the other loads
    # and times its own (the router's cost model must survive that)
    start_together: bool = False


class ProcessDied(RuntimeError):
    pass


PARENT_ENV = "SPECD_PARENT_PID"


def die_with_parent() -> None:
    """In a process the launcher started (PARENT_ENV set): get SIGTERM when
    the launcher dies, however it dies. A `specd bench` killed with SIGKILL,
    or a test runner timed out, otherwise leaves its workers running and
    holding their models' memory. Linux only (prctl PR_SET_PDEATHSIG); the
    signal follows the launcher thread that started the process, and all
    of ours start from the thread that keeps the cluster."""
    parent = os.environ.pop(PARENT_ENV, "")
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(parent):  # died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


class Proc:
    def __init__(self, name: str, args: list[str], workdir: pathlib.Path):
        self.name = name
        self.args = args
        self.workdir = workdir
        self.port_file = workdir / f"{name}.port"
        self.log_path = workdir / f"{name}.log"
        self.port_file.unlink(missing_ok=True)  # a reused workdir's old port file would name a dead port
        self._log = open(self.log_path, "wb")
        cmd = [sys.executable, "-m", "specd", *args, "--port-file", str(self.port_file)]
        env = {**os.environ, PARENT_ENV: str(os.getpid())}
        self.popen = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def check_alive(self) -> None:
        if self.popen.poll() is not None:
            raise ProcessDied(f"{self.name} exited with code {self.popen.returncode}:\n{self.log_tail()}")

    def wait_port(self, deadline: float) -> int:
        while time.monotonic() < deadline:
            self.check_alive()
            if self.port_file.exists():
                return int(self.port_file.read_text())
            time.sleep(0.05)
        raise TimeoutError(f"{self.name} did not listen in time:\n{self.log_tail()}")

    def stop(self, timeout: float = 15.0) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._log.close()
        return self.popen.returncode


def wait_serving(address: str, deadline: float, procs: list[Proc],
                 credentials: grpc.ChannelCredentials | None = None) -> None:
    ch = grpc.insecure_channel(address) if credentials is None else grpc.secure_channel(address, credentials)
    with ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            for p in procs:
                p.check_alive()
            try:
                r = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise TimeoutError(f"{address} did not become SERVING in time")


class Cluster:
    """Target, optional draft and router as subprocesses."""

    def __init__(self, spec: ClusterSpec, workdir: str | None = None):
        self.spec = spec
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="specd-")
        self.workdir = pathlib.Path(workdir or self._tmp.name)
        self.procs: dict[str, Proc] = {}
        self.router_address = ""
        self.metrics_ports: dict[str, int] = {}
        self.http_port = 0

    def _metrics_args(self, name: str) -> list[str]:
        if not self.spec.metrics:
            return []
        self.metrics_ports[name] = free_port(self.spec.host)
        return ["--metrics-port", str(self.metrics_ports[name]), "--host", self.spec.host]

    def _key_args(self) -> list[str]:
        return ["--api-key-file", self.spec.api_key_file] if self.spec.api_key_file else []

    def _worker_args(self, role: str, threads: int, name: str = "") -> list[str]:
        s = self.spec
        return [role, "--host", s.host, "--port", "0", "--threads", str(threads), "--n-ctx", str(s.n_ctx),
                "--n-seq", str(s.n_seq), *self._metrics_args(name or role), *self._key_args(), *s.worker_args]

    def start(self, timeout: float = 180.0) -> "Cluster":
        s = self.spec
        deadline = time.monotonic() + timeout
        try:
            names = ["target"] + [f"target{i + 1}" for i in range(1, s.n_targets)]
            draft_addr = ""
            if s.draft_model or (s.ngram and not s.ngram_in_router):
                src = ["--ngram", s.ngram] if s.ngram else ["--model", s.draft_model]
                batch = ["--threads-batch", str(s.draft_threads_batch)] if s.draft_threads_batch else []
                self.procs["draft"] = Proc("draft", [*self._worker_args("draft", s.draft_threads), *batch, *src,
                                                     *s.draft_args], self.workdir)
                draft_addr = f"{s.host}:{self.procs['draft'].wait_port(deadline)}"
                if s.target_threads_batch > s.target_threads and not s.start_together:
                    # the target times its batches on the draft's cores too
                    # when it loads: not while the draft loads and times its own
                    wait_serving(draft_addr, deadline, list(self.procs.values()))
            for name in names:
                self.procs[name] = Proc(name, [*self._worker_args("target", s.target_threads, name), "--model", s.target_model,
                                         "--threads-batch", str(s.target_threads_batch)],
                                        self.workdir)
            target_addrs = [f"{s.host}:{self.procs[n].wait_port(deadline)}" for n in names]
            if len(target_addrs) > 1 and not s.start_together:
                # the router serves once one target answers; the others, still
                # loading, would be attached by a watcher seconds later: a
                # cluster counted on to start whole waits for them all
                for addr in target_addrs:
                    wait_serving(addr, deadline, list(self.procs.values()))
            target_addr = ",".join(target_addrs)
            self.http_port = (s.http_port or free_port(s.host)) if s.http else 0
            args = ["router", "--host", s.host, "--port", str(s.router_port), "--target", target_addr,
                    "--http-port", str(self.http_port),
                    *self._metrics_args("router"), *self._key_args(), *s.router_args]
            if draft_addr:
                args += ["--draft", draft_addr]
            elif s.ngram:
                args += ["--ngram", s.ngram]
            self.procs["router"] = Proc("router", args, self.workdir)
            self.router_address = f"{s.host}:{self.procs['router'].wait_port(deadline)}"
            wait_serving(self.router_address, deadline, list(self.procs.values()), s.router_credentials)
        except BaseException:
            self.stop()
            raise
        return self

    def restart(self, name: str, sig: int = signal.SIGKILL, timeout: float = 120.0) -> None:
        """Kill one worker with `sig` and start it again on the same port (as
        a process manager or Kubernetes would); return once it serves."""
        self.kill(name, sig)
        self.start_again(name, timeout)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Stop one worker with `sig` and wait for it to exit."""
        old = self.procs[name]
        old.popen.send_signal(sig)
        old.popen.wait()
        old.stop()

    def start_again(self, name: str, timeout: float = 120.0) -> None:
        """Start a worker stopped by `kill` on its port; return once it serves."""
        old = self.procs[name]
        port = int(old.port_file.read_text())
        args = list(old.args)
        args[args.index("--port") + 1] = str(port)
        self.procs[name] = Proc(name, args, old.workdir)
        deadline = time.monotonic() + timeout
        self.procs[name].wait_port(deadline)
        wait_serving(f"{self.spec.host}:{port}", deadline, [self.procs[name]])

    @property
    def http_url(self) -> str:
        """Base URL of the router's HTTP API (an openai client's base_url is this + "/v1")."""
        return f"http://{self.spec.host}:{self.http_port}" if self.http_port else ""

    def stop(self) -> dict[str, int]:
        codes = {}
        for name in ["router", "draft", *[n for n in self.procs if n.startswith("target")]]:
            if name in self.procs:
                codes[name] = self.procs[name].stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        return codes

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now (for HTTP metrics, which cannot report a port 0 back)."""
    import socket

    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class Threads(NamedTuple):
    target: int
    target_batch: int
    draft: int
    draft_batch: int


def default_threads() -> Threads:
    """Target threads, target batch threads, draft threads and draft batch
    threads for one machine.

    The draft keeps one core while it computes. Otherwise the target
    decodes on every core, single tokens included: while it verifies, the
    draft mostly waits for the result, and with drafting off (target-only,
    or adaptive under load) it idles. A single token is memory-bound and an
    idle core reads half the weights for it (docs/perf). The worker drops to
    its base threads whenever the router says the draft is computing.
    Likewise the draft drafts on every core while the target waits for its
    drafts (a step whose drafts overlap did not make), and on one beside a
    verification (ProposeRequest.target_busy).
    """
    n = os.cpu_count() or 2
    return Threads(target=max(1, n - 1), target_batch=n, draft=1, draft_batch=n)
