"""A worker's model on a shared volume (the Kubernetes init container).

The manifests point a worker at a fixed path (`/models/target.gguf`). What is
there belongs to the user: a model already at that path is never replaced.
Only an empty slot is filled, and only when the caller asks for the default
model; otherwise the pod fails with a message saying what to put where.
"""
from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Placement:
    path: str
    kept: bool  # True: a model was already there and is left as it is
    source: str = ""  # the default model linked in, when not kept


class NoModel(Exception):
    pass


def place(path: str, prepare_default: Callable[[], str] | None) -> Placement:
    """Keep the model at `path`, or link the one `prepare_default()` returns.

    `prepare_default` None means the caller did not ask for the default model:
    an empty slot is then an error naming the path."""
    p = pathlib.Path(path)
    if p.is_file():  # a file, or a link to one: the user's (or an earlier run's) model
        return Placement(path, kept=True)
    if prepare_default is None:
        raise NoModel(f"no model at {path}: put a GGUF file there (e.g. a pre-populated volume), "
                      f"or ask for the default model with --default")
    source = prepare_default()
    if not os.path.isfile(source):
        raise NoModel(f"the default model {source} does not exist")
    tmp = p.with_name(p.name + ".tmp")
    if os.path.lexists(tmp):
        os.remove(tmp)
    os.symlink(source, tmp)
    os.replace(tmp, p)  # atomic: a reader sees no link or a whole one
    return Placement(path, kept=False, source=source)
