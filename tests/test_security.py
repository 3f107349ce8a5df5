"""Security against real processes: mTLS between the router and its workers,
TLS and API keys on the router's public API, and clear startup errors.

Certificates are made here at test time (cryptography): a CA, a server
certificate for 127.0.0.1/localhost, the router's client certificate signed
by the CA, and a client certificate signed by another CA."""
from __future__ import annotations

import datetime
import ipaddress
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from specd.client import RouterClient, make_request
from specd.launcher import Proc
from specd.v1 import router_pb2 as rpb
from specd.v1 import router_pb2_grpc as rpb_grpc
from specd.worker.v1 import worker_pb2 as wpb
from specd.worker.v1 import worker_pb2_grpc as wpb_grpc

API_KEY = "sk-test-6f1d0c2b9a8e4d7c"
OTHER_KEY = "sk-test-second-key-0a1b2c"
WRONG_KEY = "sk-wrong-93e8d7c6b5a4"


# ---------------------------------------------------------------- certificates
def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, key, issuer_name: x509.Name, issuer_key, *, ca: bool = False, server: bool = False,
          client: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer_name)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        b = b.add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                          content_commitment=False, key_encipherment=False, data_encipherment=False,
                                          key_agreement=False, encipher_only=False, decipher_only=False),
                            critical=True)
    usages = [u for u, on in ((ExtendedKeyUsageOID.SERVER_AUTH, server), (ExtendedKeyUsageOID.CLIENT_AUTH, client)) if on]
    if usages:
        b = b.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    if server:
        b = b.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


@dataclass
class Pki:
    dir: Path

    def path(self, name: str) -> str:
        return str(self.dir / name)

    def read(self, name: str) -> bytes:
        return (self.dir / name).read_bytes()

    def creds(self, client: str | None = None) -> grpc.ChannelCredentials:
        """Trusting our CA; presenting `client` (e.g. "router", "stranger") when given."""
        if client is None:
            return grpc.ssl_channel_credentials(self.read("ca.pem"))
        return grpc.ssl_channel_credentials(self.read("ca.pem"), self.read(f"{client}.key"), self.read(f"{client}.pem"))


def make_pki(d: Path) -> Pki:
    def write(name: str, cert, key) -> None:
        (d / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        if key is not None:
            (d / f"{name}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                              serialization.PrivateFormat.PKCS8,
                                                              serialization.NoEncryption()))

    ca_key, other_key = _key(), _key()
    ca = _cert("specd test CA", ca_key, _name("specd test CA"), ca_key, ca=True)
    other = _cert("some other CA", other_key, _name("some other CA"), other_key, ca=True)
    write("ca", ca, None)
    for name, issuer, issuer_key, kw in [("server", ca, ca_key, {"server": True}),
                                         ("router", ca, ca_key, {"client": True}),
                                         ("stranger", other, other_key, {"client": True})]:
        key = _key()
        write(name, _cert(f"specd {name}", key, issuer.subject, issuer_key, **kw), key)
    (d / "keys.txt").write_text(f"# API keys of the test\n{API_KEY}\n\n{OTHER_KEY}\n")
    (d / "not-pem.pem").write_text("this is not a certificate\n")
    return Pki(d)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def secure(cluster_factory, pki):
    """Workers requiring the router's client certificate; the router serving
    TLS (server-authenticated) with API keys, logging at DEBUG."""
    server_tls = ["--tls-cert", pki.path("server.pem"), "--tls-key", pki.path("server.key")]
    return cluster_factory(
        n_ctx=512, n_seq=1,
        worker_args=[*server_tls, "--tls-ca", pki.path("ca.pem")],
        router_args=["--worker-tls-cert", pki.path("router.pem"), "--worker-tls-key", pki.path("router.key"),
                     "--worker-tls-ca", pki.path("ca.pem"), *server_tls, "--api-key-file", pki.path("keys.txt"),
                     "--log-level", "DEBUG"],
        router_credentials=pki.creds(),
    )


def worker_address(cluster, role: str) -> str:
    return f"127.0.0.1:{int(cluster.procs[role].port_file.read_text())}"


def model_info(address: str, creds: grpc.ChannelCredentials | None) -> wpb.ModelInfo:
    ch = grpc.insecure_channel(address) if creds is None else grpc.secure_channel(address, creds)
    with ch:
        return wpb_grpc.WorkerStub(ch).GetModelInfo(wpb.GetModelInfoRequest(), timeout=10)


# ------------------------------------------------------------------------ mTLS
def test_router_with_client_certificate_generates(secure, pki):
    with RouterClient(secure.router_address, api_key=API_KEY, credentials=pki.creds()) as client:
        r = client.generate("The capital of France is", max_tokens=12)
        assert r.n_generated == 12 and "Paris" in r.text
        assert r.speculative and r.n_drafted > 0  # the draft is reached over mTLS too
        assert client.info().draft_up


@pytest.mark.parametrize("role", ["target", "draft"])
def test_worker_accepts_only_the_router_certificate(secure, pki, role):
    address = worker_address(secure, role)
    assert model_info(address, pki.creds("router")).n_vocab == 49152  # the router's certificate works
    for creds, what in [(None, "plaintext"), (pki.creds(), "no client certificate"),
                        (pki.creds("stranger"), "certificate of another CA")]:
        with pytest.raises(grpc.RpcError) as err:
            model_info(address, creds)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, (what, err.value)


# -------------------------------------------------------------------- API keys
def call_all(address: str, creds, metadata) -> None:
    with grpc.secure_channel(address, creds) as ch:
        stub = rpb_grpc.RouterStub(ch)
        assert stub.GetInfo(rpb.GetInfoRequest(), timeout=10, metadata=metadata).target.n_vocab == 49152
        assert list(stub.Tokenize(rpb.TokenizeRequest(text="Hello world"), timeout=10, metadata=metadata).tokens)
        msgs = list(stub.Generate(make_request("Hello", max_tokens=4), timeout=30, metadata=metadata))
        assert msgs[-1].finish.usage.generated_tokens == 4


@pytest.mark.parametrize("metadata", [
    (("authorization", f"Bearer {API_KEY}"),),
    (("authorization", f"bearer {OTHER_KEY}"),),
    (("x-api-key", API_KEY),),
], ids=["bearer", "bearer-second-key", "x-api-key"])
def test_right_api_key_is_served(secure, pki, metadata):
    call_all(secure.router_address, pki.creds(), metadata)


@pytest.mark.parametrize("metadata,message", [
    ((), "requires an API key"),
    ((("authorization", f"Bearer {WRONG_KEY}"),), "not valid"),
    ((("x-api-key", WRONG_KEY),), "not valid"),
    ((("authorization", f"Basic {API_KEY}"),), "requires an API key"),
    ((("authorization", f"Bearer {API_KEY}x"),), "not valid"),
], ids=["missing", "wrong-bearer", "wrong-x-api-key", "other-scheme", "key-prefix"])
def test_missing_or_wrong_api_key_is_unauthenticated(secure, pki, metadata, message):
    with grpc.secure_channel(secure.router_address, pki.creds()) as ch:
        stub = rpb_grpc.RouterStub(ch)
        calls = [lambda: stub.GetInfo(rpb.GetInfoRequest(), timeout=10, metadata=metadata),
                 lambda: stub.Tokenize(rpb.TokenizeRequest(text="Hi"), timeout=10, metadata=metadata),
                 lambda: list(stub.Generate(make_request("Hello", max_tokens=4), timeout=10, metadata=metadata))]
        for call in calls:
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert message in err.value.details()
            assert WRONG_KEY not in err.value.details() and API_KEY not in err.value.details()


def test_health_and_reflection_need_no_key(secure, pki):
    with grpc.secure_channel(secure.router_address, pki.creds()) as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert r.status == health_pb2.HealthCheckResponse.SERVING
        stream = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
        names = {s.name for s in next(stream).list_services_response.service}
        assert "specd.v1.Router" in names


def test_plaintext_client_cannot_reach_the_tls_router(secure):
    with grpc.insecure_channel(secure.router_address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_cli_generate_with_api_key(secure, pki):
    base = [sys.executable, "-m", "specd", "generate", "--router", secure.router_address,
            "--tls-ca", pki.path("ca.pem"), "--json", "--max-tokens", "6", "The capital of France is"]
    out = subprocess.run([*base, "--api-key", API_KEY], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout)["n_generated"] == 6
    out = subprocess.run(base, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "UNAUTHENTICATED" in out.stderr


def test_keys_never_reach_the_router_log(secure, pki):
    call_all(secure.router_address, pki.creds(), (("authorization", f"Bearer {API_KEY}"),))
    call_all(secure.router_address, pki.creds(), (("x-api-key", OTHER_KEY),))
    with grpc.secure_channel(secure.router_address, pki.creds()) as ch:
        for md in [(("authorization", f"Bearer {WRONG_KEY}"),), (("x-api-key", WRONG_KEY),)]:
            with pytest.raises(grpc.RpcError):
                list(rpb_grpc.RouterStub(ch).Generate(make_request("Hello", max_tokens=4), timeout=10, metadata=md))
    time.sleep(0.5)  # let the router's log reach the file
    log = secure.procs["router"].log_path.read_text(errors="replace")
    assert "DEBUG" in log and "refused /specd.v1.Router/" in log  # the log was written, at DEBUG
    for key in (API_KEY, OTHER_KEY, WRONG_KEY):
        assert key not in log


# -------------------------------------------------------------- startup errors
def exits_with(args: list[str], tmp_path: Path, *needles: str) -> None:
    p = Proc("bad", args, tmp_path)
    try:
        code = p.popen.wait(60)
    finally:
        p.stop()
    assert code != 0
    log = p.log_path.read_text(errors="replace")
    for needle in needles:
        assert needle in log, log


def test_missing_tls_file_is_a_startup_error(pki, models, tmp_path):
    exits_with(["target", "--port", "0", "--model", models["target"], "--tls-cert", str(tmp_path / "nope.pem"),
                "--tls-key", pki.path("server.key")], tmp_path, "--tls-cert", "nope.pem", "No such file")
    exits_with(["router", "--port", "0", "--target", "127.0.0.1:1", "--worker-tls-ca", pki.path("not-pem.pem")],
               tmp_path, "--worker-tls-ca", "not a PEM file")
    exits_with(["router", "--port", "0", "--target", "127.0.0.1:1", "--api-key-file", str(tmp_path / "keys")],
               tmp_path, "--api-key-file", "cannot read")
