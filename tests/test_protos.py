"""The committed stubs are what grpcio-tools generates from protos/ now."""

from specd import protogen


def test_stubs_are_fresh(tmp_path):
    fresh = protogen.generate(tmp_path)
    assert fresh, "protoc generated nothing"
    committed_dir = protogen.REPO / "specd" / "v1"
    for f in fresh:
        committed = committed_dir / f.name
        assert committed.is_file(), f"{f.name} is not committed; run python -m specd.protogen"
        assert committed.read_text() == f.read_text(), f"{f.name} is stale; run python -m specd.protogen"
    names = {f.name for f in fresh}
    extra = {p.name for p in committed_dir.glob("*_pb2*.py*")} - names
    assert not extra, f"stubs without a proto: {extra}"


def test_every_rpc_and_field_is_commented():
    for proto in protogen.proto_files():
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            s = line.strip()
            if s.startswith("rpc "):
                assert lines[i - 1].strip().startswith("//"), f"{proto.name}:{i + 1}: rpc without a comment"
