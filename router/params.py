"""What goes in and out of the router, in plain Python: its settings, a
request's parameters, the steps it yields and the result it fills."""
from __future__ import annotations

from dataclasses import dataclass, field

from specd.sampling import DEFAULT_ACCEPTANCE, EXACT, Sampling


@dataclass
class RouterSettings:
    n_max: int = 4
    n_min: int = 0
    p_min: float = 0.0
    checkpoint_mode: bool = False  # force checkpoints even where partial removal works
    check_alignment: bool = False
    # draft the next step on the draft worker while the target verifies this one
    overlap: bool = True
    # keep a finished session's KV for a later prompt sharing its prefix
    prompt_cache: bool = True
    # choose each step's draft length from acceptance and load (router/adaptive.py)
    adaptive: bool = True
    max_queue: int = 64
    draft_wait: float = 60.0  # seconds to wait for a loading draft at start before serving target-only
    # seconds a new request waits for an attached target that takes no new
    # sessions now (draining, restarting, reconnecting) before UNAVAILABLE
    target_wait: float = 5.0
    # tokens the target generates per call when a step asks for no drafts: it
    # goes on alone instead of waiting for a round trip per token (1: a
    # call per token), and stops early when other operations wait for it
    solo_tokens: int = 16
    # while it goes on, the client's stream gets its tokens in groups this
    # large; for a request with stop strings a call is no longer than this,
    # so that the target never runs far past one
    stream_tokens: int = 4


@dataclass
class GenParams:
    """One request, validated, in plain Python."""

    prompt: list[int]
    max_tokens: int | None = None
    sampling: Sampling = field(default_factory=Sampling)
    speculative: bool | None = None
    n_max: int | None = None
    n_min: int | None = None
    p_min: float | None = None
    adaptive: bool | None = None
    context_shift: bool = False
    n_keep: int = 0
    acceptance: str | None = None  # specd.sampling.EXACT | REJECTION; None: DEFAULT_ACCEPTANCE
    stop_strings: bool = False  # the caller cuts the text at stop strings (RouterSettings.stream_tokens)

    @property
    def draft_sampling(self) -> Sampling | None:
        """The sampling a draft proposes with: the request's when sampled (the
        draft samples with the target's noise, so with either acceptance its
        token is the target's own sample as often as the two agree), else
        None (argmax drafts)."""
        return None if self.sampling.greedy else self.sampling

    @property
    def rejection(self) -> bool:
        """Whether sampled drafts are accepted by speculative sampling (the
        target gets their distributions) rather than by exact match."""
        return not self.sampling.greedy and (self.acceptance or DEFAULT_ACCEPTANCE) != EXACT


@dataclass
class StepStats:
    n_drafted: int
    n_accepted: int
    draft_seconds: float  # wall time of the Propose call, transport included
    verify_seconds: float  # wall time of the Verify call, transport included
    step_seconds: float
    draft_compute: float = 0.0  # of which the draft worker computed
    verify_compute: float = 0.0  # of which the target worker computed
    critical_compute: float = 0.0  # worker compute on the step's critical path


@dataclass
class Step:
    """Tokens accepted in one step (already cut at EOG / max_tokens)."""

    tokens: list[int]
    pieces: list[bytes]


@dataclass
class Result:
    reason: str = ""  # "eog" | "length"
    n_prompt: int = 0
    n_generated: int = 0
    n_drafted: int = 0
    n_accepted: int = 0
    n_steps: int = 0
    n_shifts: int = 0
    n_cached: int = 0  # prompt tokens the prompt cache kept
    n_divergences: int = 0
    n_failovers: int = 0  # times the session moved to another target worker
    n_ahead_used: int = 0  # steps whose drafts were computed during the previous verification
    prompt_seconds: float = 0.0
    generation_seconds: float = 0.0
    draft_compute_seconds: float = 0.0
    verify_compute_seconds: float = 0.0
    steps_seconds: float = 0.0
    critical_compute_seconds: float = 0.0
    speculative: bool = False
