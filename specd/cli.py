"""`specd`: run the workers and the router, prepare models, generate, demo."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time

from specd import config as C


def _worker(role: str, args: argparse.Namespace) -> int:
    from specd.server import setup_logging

    setup_logging(args.log_level)
    cfg = C.build(C.WorkerConfig, args, role=role)
    if not cfg.model and not cfg.ngram:
        from specd.models import default_model

        cfg.model = default_model(role)
    if role == "target":
        from specd.target_worker.server import serve
    else:
        from specd.draft_worker.server import serve
    asyncio.run(serve(cfg))
    return 0


def _router(args: argparse.Namespace) -> int:
    from specd.router.server import serve
    from specd.server import setup_logging

    setup_logging(args.log_level)
    asyncio.run(serve(C.build(C.RouterConfig, args)))
    return 0


def _models(args: argparse.Namespace) -> int:
    from specd.models import default_models

    if args.link:
        return _place_model(args)
    paths = default_models(quiet=args.json)
    if args.json:
        print(json.dumps(paths))
    else:
        for role, path in paths.items():
            print(f"{role}: {path}")
    return 0


def _place_model(args: argparse.Namespace) -> int:
    from specd.model_volume import NoModel, place
    from specd.models import default_model

    if not args.role:
        raise SystemExit("specd models: --link needs --role (target or draft)")
    prepare = (lambda: default_model(args.role)) if args.default else None
    try:
        placed = place(args.link, prepare)
    except NoModel as exc:
        raise SystemExit(f"specd models: {exc}")
    print(f"[specd models] {placed.path}: " + ("kept the model that is there" if placed.kept
                                               else f"linked the default {args.role} model {placed.source}"),
          file=sys.stderr)
    return 0


def _cluster_spec(args: argparse.Namespace, router_port: int, api_key_file: str = ""):
    from specd.launcher import ClusterSpec, default_threads
    from specd.models import default_models

    paths = default_models(quiet=True)
    threads = default_threads()
    return ClusterSpec(
        target_model=args.target_model or paths["target"],
        draft_model="" if args.ngram else (args.draft_model or paths["draft"]),
        ngram=args.ngram,
        target_threads=args.target_threads or threads.target,
        target_threads_batch=args.target_threads_batch or (threads.target_batch if not args.target_threads else 0),
        draft_threads=args.draft_threads or threads.draft,
        draft_threads_batch=threads.draft_batch if not args.draft_threads else 0,
        n_ctx=args.n_ctx,
        n_seq=args.n_seq,
        router_port=router_port,
        api_key_file=api_key_file,
    )


def _up(args: argparse.Namespace) -> int:
    from specd.launcher import Cluster

    print("[specd up] preparing models and starting target, draft and router ...", file=sys.stderr, flush=True)
    spec = _cluster_spec(args, args.port, args.api_key_file)
    spec.http, spec.http_port = bool(args.http_port), args.http_port
    cluster = Cluster(spec).start()
    http = f", OpenAI-compatible HTTP on {cluster.http_url}/v1" if cluster.http_url else ""
    print(f"[specd up] router listening on {cluster.router_address}{http} (Ctrl-C to stop)", flush=True)
    stop = {"now": False}

    def handler(*_):
        stop["now"] = True

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    try:
        while not stop["now"]:
            for p in cluster.procs.values():
                p.check_alive()
            time.sleep(0.2)
    finally:
        cluster.stop()
    print("[specd up] stopped", file=sys.stderr)
    return 0


def _print_stats(c, label: str = "") -> None:
    acc = f", acceptance {c.acceptance:.0%} ({c.n_accepted}/{c.n_drafted})" if c.n_drafted else ""
    print(f"[{label or 'stats'}] {c.n_generated} tokens in {c.generation_seconds:.2f}s = {c.tokens_per_second:.1f} tok/s"
          f"{acc}, prompt {c.n_prompt} tokens, finish: {c.finish_reason}", file=sys.stderr, flush=True)


def _prompt(args) -> str | list[dict]:
    """PROMPT as text, or with --chat (or --system) as the user's message of a
    conversation the router renders with the target model's chat template."""
    if not (args.chat or args.system):
        return args.prompt
    system = [{"role": "system", "content": args.system}] if args.system else []
    return [*system, {"role": "user", "content": args.prompt}]


def _gen_kwargs(args) -> dict:
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                speculative=False if args.no_spec else None, n_draft=args.n_draft)


def _generate(args: argparse.Namespace) -> int:
    import grpc

    from specd.client import RouterClient
    from specd.security import ConfigError, channel_credentials

    try:  # TLS towards the router when any --tls-* flag is given
        creds = channel_credentials(args.tls_cert, args.tls_key, args.tls_ca, prefix="--tls")
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    with RouterClient(args.router, api_key=args.api_key or None, credentials=creds) as client:
        try:
            if args.json:
                c = client.generate(_prompt(args), **_gen_kwargs(args))
                print(json.dumps(c.as_json()))
            else:
                c = client.generate(_prompt(args), on_text=lambda t: print(t, end="", flush=True), **_gen_kwargs(args))
                print()
                _print_stats(c)
        except grpc.RpcError as exc:
            print(f"specd generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    return 0


def _demo(args: argparse.Namespace) -> int:
    from specd.client import RouterClient
    from specd.launcher import Cluster

    print("[specd demo] preparing the default models and starting target, draft and router ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    with Cluster(_cluster_spec(args, 0)) as cluster:
        print(f"[specd demo] all three up in {time.perf_counter() - t0:.1f}s; router at {cluster.router_address}",
              file=sys.stderr, flush=True)
        with RouterClient(cluster.router_address) as client:
            # a short request first: the first decodes of fresh workers allocate
            # their buffers, which would count against whichever run came first
            client.generate(_prompt(args), **(_gen_kwargs(args) | {"max_tokens": 8}))
            print(f"\n> {args.prompt}\n" if args.chat or args.system else f"\n{args.prompt}", end="", flush=True)
            spec = client.generate(_prompt(args), on_text=lambda t: print(t, end="", flush=True), **_gen_kwargs(args))
            print("\n", flush=True)
            _print_stats(spec, "speculative" if spec.speculative else "target-only")
            if not args.no_spec and args.compare:
                kw = _gen_kwargs(args) | {"speculative": False}
                base = client.generate(_prompt(args), **kw)
                _print_stats(base, "target-only")
                same = "identical" if base.tokens == spec.tokens else "DIFFERENT"
                print(f"[specd demo] speculative output is {same} to target-only "
                      f"({spec.tokens_per_second / max(base.tokens_per_second, 1e-9):.2f}x tokens/s)", file=sys.stderr)
    print("[specd demo] shut down cleanly", file=sys.stderr)
    return 0


def _add_cluster_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target-model", default="", help="target GGUF (default: the default target)")
    p.add_argument("--draft-model", default="", help="draft GGUF (default: the default draft)")
    p.add_argument("--ngram", default="", help="use a model-free drafter instead of a draft model")
    p.add_argument("--target-threads", type=int, default=0, help="target threads while the draft computes (default: cores - 1)")
    p.add_argument("--target-threads-batch", type=int, default=0,
                   help="target threads while the draft does not compute (default: all cores, or --target-threads if given)")
    p.add_argument("--draft-threads", type=int, default=0, help="default: 1")
    p.add_argument("--n-ctx", type=C.at_least(C.MIN_N_CTX), default=2048,
                   help="context of ONE sequence, in positions (llama.cpp's -c is the total over its slots: each "
                        "worker allocates --n-ctx × --n-seq)")
    p.add_argument("--n-seq", type=C.at_least(1), default=4, help="sequences (concurrent sessions) each worker hosts")


def _add_gen_flags(p: argparse.ArgumentParser, max_tokens: int | None, chat: bool = False) -> None:
    p.add_argument("prompt")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=chat,
                   help="send PROMPT as a user message, rendered with the target model's chat template")
    p.add_argument("--system", default="", help="system message before PROMPT (implies --chat)")
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--no-spec", action="store_true", help="target-only decoding")
    p.add_argument("--n-draft", type=int, default=None, help="draft tokens per step (default: the router's)")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specd", description="Distributed speculative decoding on llama.cpp")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for role in ("target", "draft"):
        p = sub.add_parser(role, help=f"run the {role} worker")
        C.add_worker_flags(p, role)
        p.set_defaults(fn=lambda a, r=role: _worker(r, a))
    p = sub.add_parser("router", help="run the router (public API)")
    C.add_router_flags(p)
    p.set_defaults(fn=_router)
    p = sub.add_parser("models", help="prepare the default models and print their paths")
    p.add_argument("--json", action="store_true", help='print {"target": PATH, "draft": PATH}')
    p.add_argument("--link", metavar="PATH", help="make PATH hold the --role model: a model already there is kept; "
                   "an empty PATH is an error unless --default")
    p.add_argument("--role", choices=("target", "draft"), help="whose model --link places")
    p.add_argument("--default", action="store_true", help="with --link: fill an empty PATH with the default model")
    p.set_defaults(fn=_models)
    p = sub.add_parser("up", help="run target, draft and router locally on the default models")
    _add_cluster_flags(p)
    p.add_argument("--port", type=int, default=50051, help="router port")
    p.add_argument("--http-port", type=int, default=8080, help="router's OpenAI-compatible HTTP port (0: off)")
    p.add_argument("--api-key-file", default="",
                   help="API keys, one a line, for all three: clients must send one (specd generate --api-key), "
                        "and the router presents the first to the workers, which refuse calls without it")
    p.set_defaults(fn=_up)
    p = sub.add_parser("demo", help="up + generate + clean shutdown")
    _add_cluster_flags(p)
    # an instruct model answers as a chat model would (--no-chat: PROMPT continued as text)
    _add_gen_flags(p, 96, chat=True)
    p.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True,
                   help="also run target-only and compare")
    p.set_defaults(fn=_demo)
    p = sub.add_parser("generate", help="stream a completion from a router")
    p.add_argument("--router", default=os.environ.get("SPECD_ROUTER", "127.0.0.1:50051"), help="HOST:PORT [env SPECD_ROUTER]")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--api-key", default=os.environ.get("SPECD_API_KEY", ""),
                   help="API key of a router started with --api-key-file [env SPECD_API_KEY]")
    p.add_argument("--tls-ca", default="", help="connect over TLS, verifying the router against this PEM CA")
    p.add_argument("--tls-cert", default="", help="PEM client certificate, for a router that requires one")
    p.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    _add_gen_flags(p, None)
    p.set_defaults(fn=_generate)
    from specd.bench import add_parser as add_bench

    add_bench(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    from specd.launcher import die_with_parent

    die_with_parent()
    # SIGTERM unwinds like Ctrl-C, so a `specd bench` or `specd demo` stops the
    # processes it started (servers install their own handlers when they run)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    args = parser().parse_args(argv)
    return args.fn(args)


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
