"""What compiler flags the installed llama-cpp-python's CPU library was built with.

`--has FLAG` exits 0 when FLAG is among them (recorded by -frecord-gcc-switches),
1 when not or when nothing was recorded; `--version` prints the installed version.
scripts/setup.sh uses it to find a cached wheel built without specd's flags.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import pathlib
import sys


def cpu_library() -> pathlib.Path | None:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    libs = sorted(pathlib.Path(next(iter(spec.submodule_search_locations)), "lib").glob("libggml-cpu.so*"))
    return libs[0] if libs else None


def main(argv: list[str]) -> int:
    if argv[:1] == ["--version"]:
        print(importlib.metadata.version("llama-cpp-python"))
        return 0
    if len(argv) != 2 or argv[0] != "--has":
        print("usage: llama_build_flags.py --has FLAG | --version", file=sys.stderr)
        return 2
    lib = cpu_library()
    return 0 if lib is not None and argv[1].encode() in lib.read_bytes() else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
