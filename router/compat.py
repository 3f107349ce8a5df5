"""Which workers can serve one router together: every target the same
model, every draft the target's vocabulary."""
from __future__ import annotations

from specd.engine import ModelInfo
from specd.errors import FailedPrecondition


def check_same_model(first: ModelInfo, other: ModelInfo, role: str) -> None:
    """Targets must be one model: a session that fails over replays its
    history on another and must get the same text."""
    check_vocab(first, other, role)
    if (other.architecture, other.description) != (first.architecture, first.description):
        raise FailedPrecondition(
            f"the {role} model {other.model_path or other.description!r} ({other.description}) is not the model "
            f"the router serves ({first.description}); every target worker must load the same model"
        )


def check_vocab(target: ModelInfo, draft: ModelInfo, role: str = "draft") -> None:
    """The draft must tokenize like the target. Model-free drafters have no
    vocabulary: only the size they were given (--n-vocab), if any, must match."""
    if not draft.vocab_fingerprint:
        mismatch = draft.n_vocab not in (0, target.n_vocab)
    else:
        mismatch = draft.n_vocab != target.n_vocab or draft.vocab_fingerprint != target.vocab_fingerprint
    if mismatch:
        raise FailedPrecondition(
            f"the {role} model {draft.model_path or draft.description!r} (n_vocab {draft.n_vocab}) does not share "
            f"the vocabulary of the target model {target.model_path or target.description!r} "
            f"(n_vocab {target.n_vocab}); speculative decoding needs identical vocabularies"
        )
