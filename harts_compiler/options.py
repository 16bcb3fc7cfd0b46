"""`CompileOptions`: the user-facing compile settings (pydantic, validated at the edge)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import InputError


class CompileOptions(BaseModel):
    """chunk_size: linear-attention chunk C; conv_width: short-conv width W;
    microbatch_tokens: compact-token budget per microbatch (None = one microbatch per rank);
    larger trees are split into parts that recompute their root path (`split-oversize`);
    dp_size: data-parallel ranks; vocab_size: reject tokens >= this when given;
    verify: run every IR verifier between passes (cheap, O(T)).
    split_time_limit_s: CP-SAT time for improving the greedy cuts of oversize trees (0 = greedy).
    Schedule (`passes/schedule.py`): objective `sum_of_slot_max` (ranks run slots in lockstep)
    or `max_rank_total`; schedule_time_limit_s: the CP-SAT planner's time limit (the greedy plan
    is the fallback); schedule_seed / schedule_workers: fixed so the same input gives the same
    plan; cost_model: a fitted cost-model JSON ("default" = the built-in guesses, None = the
    repository's fit when there is one, else the guesses); linear_layers / full_layers: the model's layer counts the cost model scales by."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    chunk_size: int = Field(64, ge=1)
    conv_width: int = Field(4, ge=1)
    microbatch_tokens: int | None = Field(None, ge=1)
    dp_size: int = Field(1, ge=1)
    vocab_size: int | None = Field(None, ge=1)
    verify: bool = True
    objective: Literal["sum_of_slot_max", "max_rank_total"] = "sum_of_slot_max"
    schedule_time_limit_s: float = Field(0.2, ge=0, le=600)
    split_time_limit_s: float = Field(0.5, ge=0, le=600)
    schedule_seed: int = Field(0, ge=0)
    schedule_workers: int = Field(1, ge=1, le=64)
    cost_model: str | None = None
    linear_layers: int = Field(36, ge=0)
    full_layers: int = Field(12, ge=0)

    @classmethod
    def checked(cls, **values) -> "CompileOptions":
        """Build options, turning validation errors into one-line-per-problem InputError."""
        try:
            return cls(**values)
        except ValidationError as exc:
            raise InputError([f"option {'.'.join(map(str, e['loc']))}: {e['msg']}"
                              for e in exc.errors()]) from None
