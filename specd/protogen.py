"""Generate the Python and mypy stubs of protos/ into the specd package.

Run ``python -m specd.protogen`` after editing a .proto; tests/test_protos.py
fails while the committed stubs differ from what this produces.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "protos"


# the public API (specd.v1) and the internal worker protocol (specd.worker.v1)
PACKAGES = ("specd/v1", "specd/worker/v1")


def proto_files() -> list[pathlib.Path]:
    return sorted(p for pkg in PACKAGES for p in PROTO_ROOT.glob(f"{pkg}/*.proto"))


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Run protoc (grpcio-tools) on every proto; return the files written."""
    from grpc_tools import protoc
    import grpc_tools

    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    bindir = pathlib.Path(sys.executable).parent
    args = [
        "protoc",
        f"--plugin=protoc-gen-mypy={bindir / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={bindir / 'protoc-gen-mypy_grpc'}",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *[str(p.relative_to(PROTO_ROOT)) for p in proto_files()],
    ]
    cwd = os.getcwd()
    os.chdir(PROTO_ROOT)
    try:
        rc = protoc.main(args)
    finally:
        os.chdir(cwd)
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")
    return sorted(p for pkg in PACKAGES for p in (out_dir / pkg).glob("*_pb2*.py*"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, default=REPO, help="output root (default: the repo)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
