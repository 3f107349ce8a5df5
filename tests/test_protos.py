"""The protos: committed stubs are what grpcio-tools generates now; buf lints
both packages and finds no breaking change against the released public API;
the public API stands alone."""
import subprocess

from specd import protogen

BUF = protogen.REPO / "tests" / "node" / "node_modules" / ".bin" / "buf"
# the public API as released: `buf breaking` compares against it. A
# deliberate breaking change is a new package (specd.v2), not a new baseline.
API_BASELINE = protogen.REPO / "protos" / "specd-v1.binpb"


def test_stubs_are_fresh(tmp_path):
    fresh = protogen.generate(tmp_path)
    assert fresh, "protoc generated nothing"
    for pkg in protogen.PACKAGES:
        committed_dir = protogen.REPO / pkg
        names = set()
        for f in (p for p in fresh if p.parent == tmp_path / pkg):
            committed = committed_dir / f.name
            assert committed.is_file(), f"{pkg}/{f.name} is not committed; run python -m specd.protogen"
            assert committed.read_text() == f.read_text(), f"{pkg}/{f.name} is stale; run python -m specd.protogen"
            names.add(f.name)
        extra = {p.name for p in committed_dir.glob("*_pb2*.py*")} - names
        assert not extra, f"stubs without a proto in {pkg}: {extra}"


def test_every_rpc_and_field_is_commented():
    for proto in protogen.proto_files():
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            s = line.strip()
            if s.startswith("rpc "):
                assert lines[i - 1].strip().startswith("//"), f"{proto.name}:{i + 1}: rpc without a comment"


def test_the_public_api_imports_nothing_internal():
    public = (protogen.PROTO_ROOT / "specd" / "v1" / "router.proto").read_text()
    assert "import " not in public, "a client must generate specd/v1 alone, without the worker protocol"


def _buf(*args: str) -> subprocess.CompletedProcess:
    assert BUF.is_file(), "buf is missing: scripts/test.sh installs it (npm ci in tests/node)"
    return subprocess.run([str(BUF), *args], cwd=protogen.REPO, capture_output=True, text=True, timeout=120)


def test_buf_lint_is_clean():
    r = _buf("lint")
    assert r.returncode == 0, r.stdout + r.stderr


def test_no_breaking_change_to_the_public_api():
    r = _buf("breaking", "--against", str(API_BASELINE.relative_to(protogen.REPO)))
    assert r.returncode == 0, r.stdout + r.stderr


def test_buf_breaking_sees_a_breaking_change(tmp_path):
    """The check is live: renumbering a field of the public API fails it."""
    changed = tmp_path / "protos"
    subprocess.run(["cp", "-r", str(protogen.PROTO_ROOT), str(changed)], check=True)
    router = changed / "specd" / "v1" / "router.proto"
    text = router.read_text()
    assert "  int32 n_keep = 8;" in text
    router.write_text(text.replace("  int32 n_keep = 8;", "  int32 n_keep = 18;"))
    (tmp_path / "buf.yaml").write_text((protogen.REPO / "buf.yaml").read_text())
    r = subprocess.run([str(BUF), "breaking", "--against", str(API_BASELINE)], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and "n_keep" in r.stdout, r.stdout + r.stderr
