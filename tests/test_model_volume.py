"""The init container's model placement (specd/model_volume.py, `specd models
--link`): a model already at the path is never replaced; an empty path is
filled only when the default model is asked for (issue #23)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from specd.model_volume import NoModel, place


def test_a_model_that_is_there_is_kept(tmp_path):
    mine = tmp_path / "target.gguf"
    mine.write_bytes(b"GGUF the user's model")
    asked = []
    placed = place(str(mine), lambda: asked.append(1) or "/nonexistent")
    assert placed.kept and not asked and mine.read_bytes() == b"GGUF the user's model"
    link = tmp_path / "draft.gguf"  # a link to a model (an earlier run's) counts as there
    link.symlink_to(mine)
    assert place(str(link), None).kept


def test_an_empty_path_is_an_error_unless_the_default_is_asked_for(tmp_path):
    path = tmp_path / "target.gguf"
    with pytest.raises(NoModel, match=str(path)):
        place(str(path), None)
    assert not os.path.lexists(path)
    default = tmp_path / "cache" / "default.gguf"
    default.parent.mkdir()
    default.write_bytes(b"GGUF default")
    placed = place(str(path), lambda: str(default))
    assert not placed.kept and placed.source == str(default)
    assert path.is_symlink() and path.read_bytes() == b"GGUF default"
    # a dangling link (its target gone) is an empty slot, refilled
    default.unlink()
    other = tmp_path / "cache" / "again.gguf"
    other.write_bytes(b"GGUF again")
    assert not place(str(path), lambda: str(other)).kept and path.read_bytes() == b"GGUF again"


def test_the_cli_keeps_or_refuses_in_one_line(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "specd", "models", *args], capture_output=True, text=True,
                              timeout=120)

    path = tmp_path / "draft.gguf"
    r = run("--link", str(path), "--role", "draft")
    assert r.returncode == 1 and "Traceback" not in r.stderr and f"no model at {path}" in r.stderr
    path.write_bytes(b"GGUF mine")
    r = run("--link", str(path), "--role", "draft", "--default")
    assert r.returncode == 0 and "kept" in r.stderr and path.read_bytes() == b"GGUF mine"


def test_the_draft_default_prepares_the_draft_alone(tmp_path):
    # a draft's init container must not derive the F32 target (seconds of
    # CPU and half a GiB of a volume it never reads)
    path = tmp_path / "draft.gguf"
    env = {**os.environ, "SPECD_CACHE_DIR": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "specd", "models", "--link", str(path), "--role", "draft", "--default"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert path.is_symlink() and path.read_bytes()[:4] == b"GGUF"
    assert sorted(p.name for p in (tmp_path / "cache" / "models").iterdir()) == [
        "SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct.Q8_0.gguf"]  # the shipped file and the draft
    assert path.resolve().name == "SmolLM2-135M-Instruct.Q8_0.gguf"
