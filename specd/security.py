"""Transport security and authentication, shared by the router and the workers.

- mTLS between the router and its workers: a worker started with
  `--tls-cert/--tls-key` serves TLS; with `--tls-ca` as well it requires a
  client certificate signed by that CA (only the router holds one), so nothing
  else can drive its KV cache. The router's side is
  `--worker-tls-cert/--worker-tls-key/--worker-tls-ca`
  (+ `--worker-tls-server-name` when the certificate's name is not the address).
  The router's own public port takes the same `--tls-*` flags.
- API keys on the router's public API: `--api-key-file` (one key a line); every
  specd.v1.Router call must carry `authorization: Bearer <key>` or
  `x-api-key: <key>`. Health and reflection stay open for probes.
- API keys on the workers: the same `--api-key-file`; every call but the
  standard health service (probes) needs a key, Execute included, so nothing
  that merely reaches a worker port can clear or decode into live sessions.
  The router presents the first key of `--worker-api-key-file`, or, without
  it, the first key of its own `--api-key-file`: one Secret mounted into all
  three pods with SPECD_API_KEY_FILE set in each is a working setup. The key
  travels as call metadata (KeyedChannel), which also works on plaintext
  channels, where gRPC refuses call credentials.

Certificates, keys and API keys are files read once at startup; a file that is
missing, unreadable or not PEM ends the process with a message naming the
flag. Secrets never reach the logs: neither keys nor request metadata are
logged, and a refusal does not echo what the caller sent.

Kubernetes' native gRPC probes cannot present a client certificate (nor speak
TLS): on a worker that requires client certificates, probe the metrics HTTP
port (`--metrics-port`, liveness) or use an exec probe that has a client
certificate (e.g. grpc_health_probe -tls -tls-ca-cert ... -tls-client-cert ...
-tls-client-key ...).
"""
from __future__ import annotations

import hmac
import logging
from typing import Iterable, Sequence

import grpc

log = logging.getLogger("specd.security")

# Services callable without an API key: probes and tooling.
HEALTH_SERVICE = "/grpc.health.v1.Health/"
OPEN_SERVICES = (HEALTH_SERVICE, "/grpc.reflection.v1alpha.ServerReflection/",
                 "/grpc.reflection.v1.ServerReflection/")
# A worker leaves only health open: probes must work, and nothing but the
# router has any business on a worker port, listing its services included.
WORKER_OPEN_SERVICES = (HEALTH_SERVICE,)


class ConfigError(SystemExit):
    """A startup configuration error: the process exits with this message."""


def read_file(path: str, flag: str, pem: bool = False) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ConfigError(f"specd: cannot read {flag} {path!r}: {exc.strerror or exc}") from None
    if pem and b"-----BEGIN " not in data:
        raise ConfigError(f"specd: {flag} {path!r} is not a PEM file")
    return data


def server_credentials(cert: str = "", key: str = "", ca: str = "",
                       prefix: str = "--tls") -> grpc.ServerCredentials | None:
    """TLS for a server from `cert`/`key` paths; with `ca`, client
    certificates signed by it are required (mTLS). None: plaintext."""
    if not (cert or key or ca):
        return None
    if not (cert and key):
        raise ConfigError(f"specd: {prefix}-cert and {prefix}-key go together "
                          f"({prefix}-ca alone cannot serve TLS)")
    chain = read_file(cert, f"{prefix}-cert", pem=True)
    private = read_file(key, f"{prefix}-key", pem=True)
    root = read_file(ca, f"{prefix}-ca", pem=True) if ca else None
    return grpc.ssl_server_credentials([(private, chain)], root_certificates=root,
                                       require_client_auth=root is not None)


def channel_credentials(cert: str = "", key: str = "", ca: str = "",
                        prefix: str = "--worker-tls") -> grpc.ChannelCredentials | None:
    """TLS for a client channel: verify the server against `ca` (the system
    roots when empty) and present `cert`/`key` when given. None: plaintext."""
    if not (cert or key or ca):
        return None
    if bool(cert) != bool(key):
        raise ConfigError(f"specd: {prefix}-cert and {prefix}-key go together")
    return grpc.ssl_channel_credentials(
        root_certificates=read_file(ca, f"{prefix}-ca", pem=True) if ca else None,
        private_key=read_file(key, f"{prefix}-key", pem=True) if key else None,
        certificate_chain=read_file(cert, f"{prefix}-cert", pem=True) if cert else None,
    )


def server_credentials_of(cfg) -> grpc.ServerCredentials | None:
    """Server credentials from a ServerConfig's --tls-* flags."""
    return server_credentials(cfg.tls_cert, cfg.tls_key, cfg.tls_ca)


# ---------------------------------------------------------------- API keys
def load_api_keys(path: str, flag: str = "--api-key-file") -> list[bytes]:
    """Keys from a file, one a line; blank lines and `#` comments ignored."""
    text = read_file(path, flag)
    keys = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if line and not line.startswith(b"#"):
            # gRPC metadata values are printable ASCII: any other key could never be sent
            if not all(0x20 <= b < 0x7F for b in line):
                raise ConfigError(f"specd: {flag} {path!r} line {n}: a key must be printable ASCII")
            keys.append(line)
    if not keys:
        raise ConfigError(f"specd: {flag} {path!r} holds no key")
    return keys


def worker_api_key(cfg) -> str | None:
    """The key a router (RouterConfig) presents to its workers: the first of
    --worker-api-key-file, else the first of its own --api-key-file, so that
    one key file shared by all three processes works; None: no key."""
    if cfg.worker_api_key_file:
        return load_api_keys(cfg.worker_api_key_file, "--worker-api-key-file")[0].decode()
    if cfg.api_key_file:
        return load_api_keys(cfg.api_key_file)[0].decode()
    return None


def worker_interceptors(cfg) -> list[grpc.aio.ServerInterceptor] | None:
    """A worker's (WorkerConfig) interceptors: with --api-key-file, a key on
    every call but health checks."""
    if not cfg.api_key_file:
        return None
    return [ApiKeyInterceptor(load_api_keys(cfg.api_key_file), WORKER_OPEN_SERVICES, server="worker")]


def api_key_metadata(key: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying `key` (empty when there is none)."""
    return (("authorization", f"Bearer {key}"),) if key else ()


def _presented(metadata: Iterable) -> list[bytes]:
    out = []
    for item in metadata or ():
        k, v = item[0], item[1]
        if isinstance(v, str):
            v = v.encode()
        k = k.lower()
        if k == "authorization":
            scheme, _, rest = v.strip().partition(b" ")
            if scheme.lower() == b"bearer" and rest.strip():
                out.append(rest.strip())
        elif k == "x-api-key" and v.strip():
            out.append(v.strip())
    return out


def authorized(metadata: Iterable, keys: Sequence[bytes]) -> bool | None:
    """True: a valid key; False: a key that is not valid; None: no key."""
    presented = _presented(metadata)
    if not presented:
        return None
    ok = False
    for candidate in presented:
        for key in keys:  # compare with every key: the time does not tell which one matched
            ok |= hmac.compare_digest(candidate, key)
    return ok


MISSING = ("this {server} requires an API key: send call metadata `authorization: Bearer <key>` "
           "or `x-api-key: <key>`")
INVALID = "the API key is not valid"


def _deny(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    async def abort(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler is None:
        return grpc.unary_unary_rpc_method_handler(abort)
    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(abort, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(abort, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(abort, **kw)
    return grpc.stream_stream_rpc_method_handler(abort, **kw)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuse calls without a valid API key with UNAUTHENTICATED; health and
    reflection stay open. Never logs keys or metadata."""

    def __init__(self, keys: Sequence[bytes], open_services: Sequence[str] = OPEN_SERVICES, server: str = "router"):
        self.keys = list(keys)
        self.open_services = tuple(open_services)
        self.missing = MISSING.format(server=server)

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method or ""
        if method.startswith(self.open_services):
            return await continuation(handler_call_details)
        ok = authorized(handler_call_details.invocation_metadata, self.keys)
        if ok:
            return await continuation(handler_call_details)
        log.info("refused %s: %s API key", method, "missing" if ok is None else "invalid")
        return _deny(await continuation(handler_call_details), self.missing if ok is None else INVALID)


# ------------------------------------------------------------ client side
class _WithMetadata:
    """A multicallable that adds `metadata` to every call."""

    def __init__(self, call, metadata: tuple[tuple[str, str], ...]):
        self._call = call
        self._metadata = metadata

    def __call__(self, *args, metadata=None, **kwargs):
        return self._call(*args, metadata=(*self._metadata, *(metadata or ())), **kwargs)

    def __getattr__(self, name):
        return getattr(self._call, name)


class KeyedChannel:
    """`channel` for building stubs whose every call carries `metadata` (the
    API key of a worker). Metadata rather than call credentials: gRPC sends
    call credentials over TLS only, and router and workers may talk plaintext
    on a private network. Everything else is the channel's own."""

    def __init__(self, channel, metadata: tuple[tuple[str, str], ...]):
        self._channel = channel
        self._metadata = tuple(metadata)

    def unary_unary(self, *args, **kwargs):
        return _WithMetadata(self._channel.unary_unary(*args, **kwargs), self._metadata)

    def unary_stream(self, *args, **kwargs):
        return _WithMetadata(self._channel.unary_stream(*args, **kwargs), self._metadata)

    def stream_unary(self, *args, **kwargs):
        return _WithMetadata(self._channel.stream_unary(*args, **kwargs), self._metadata)

    def stream_stream(self, *args, **kwargs):
        return _WithMetadata(self._channel.stream_stream(*args, **kwargs), self._metadata)

    def __getattr__(self, name):
        return getattr(self._channel, name)
