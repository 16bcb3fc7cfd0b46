"""`CompileOptions`: the user-facing compile settings (pydantic, validated at the edge)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from harts_compiler.ir.program import INT64_MAX, MAX_DP_SIZE

from .errors import InputError

# the chunk of the Gated DeltaNet kernels (and of transformers' torch_chunk_gated_delta_rule)
GDN_CHUNK_SIZE = 64


class CompileOptions(BaseModel):
    """chunk_size: linear-attention chunk C; conv_width: short-conv width W;
    microbatch_tokens: compact-token budget per microbatch (None = one microbatch per rank), at least one chunk;
    larger trees run as pieces that carry their path's state to each other (`cut-pieces`);
    dp_size: data-parallel ranks; vocab_size: reject tokens >= this when given;
    verify: run every IR verifier between passes (cheap, O(T)).
    Schedule (`passes/schedule.py`): objective `sum_of_slot_max` (ranks run slots in lockstep)
    or `max_rank_total`; schedule_time_limit_s: the CP-SAT planner's time limit (the greedy plan
    is the fallback); schedule_seed / schedule_workers: fixed so the same input gives the same
    plan; cost_model: a fitted cost-model JSON ("default" = the built-in guesses, None = the
    repository's fit when there is one, else the guesses); linear_layers / full_layers: the model's layer
    counts the cost model scales by (None: those of Qwen3-Next-80B, 36 / 12; when given, a model with other
    counts refuses the plan).

    `CompileOptions.for_model(model)` takes chunk_size, conv_width, vocab_size and the layer counts from the
    model, so a plan and the model it runs on cannot disagree."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    chunk_size: int = Field(64, ge=1, le=INT64_MAX)
    conv_width: int = Field(4, ge=1, le=INT64_MAX)
    microbatch_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    dp_size: int = Field(1, ge=1, le=MAX_DP_SIZE)
    vocab_size: int | None = Field(None, ge=1, le=INT64_MAX)
    verify: bool = True
    objective: Literal["sum_of_slot_max", "max_rank_total"] = "sum_of_slot_max"
    schedule_time_limit_s: float = Field(0.2, ge=0, le=600)
    schedule_seed: int = Field(0, ge=0, le=INT64_MAX)
    schedule_workers: int = Field(1, ge=1, le=64)
    cost_model: str | None = None
    linear_layers: int | None = Field(None, ge=0, le=INT64_MAX)
    full_layers: int | None = Field(None, ge=0, le=INT64_MAX)

    @model_validator(mode="after")
    def _budget_holds_a_chunk(self):
        if self.microbatch_tokens is not None and self.microbatch_tokens < self.chunk_size:
            raise ValueError(f"microbatch_tokens={self.microbatch_tokens} is smaller than one chunk "
                             f"(chunk_size={self.chunk_size})")
        return self

    @classmethod
    def for_model(cls, model, **overrides) -> "CompileOptions":
        """Options whose model facts come from `model`: a TreeModel, its ModelConfig, or a transformers
        config / model of the Qwen3-Next family (anything with `layer_types`, `linear_conv_kernel_dim` and
        `vocab_size`, directly or under `.config`). `overrides` set the other options."""
        config = model if hasattr(model, "layer_types") else getattr(model, "config", None)
        if config is None or not hasattr(config, "layer_types"):
            raise InputError(f"CompileOptions.for_model: cannot read layer_types from {type(model).__name__}")
        kinds = list(config.layer_types)
        facts = dict(chunk_size=GDN_CHUNK_SIZE, conv_width=int(getattr(config, "linear_conv_kernel_dim", 4)),
                     vocab_size=int(config.vocab_size),
                     linear_layers=kinds.count("linear_attention"), full_layers=kinds.count("full_attention"))
        return cls.checked(**{**facts, **overrides})

    def check_model(self, model) -> None:
        """Raise InputError naming the field where these options disagree with `model` (see for_model)."""
        mine = self.for_model(model)
        for field in ("conv_width", "linear_layers", "full_layers"):
            stated = getattr(self, field)
            if stated is not None and stated != getattr(mine, field):
                raise InputError(f"plan option {field}={stated} but the model has {getattr(mine, field)}: "
                                 "compile with CompileOptions.for_model(model)")
        if self.vocab_size is not None and self.vocab_size > mine.vocab_size:
            raise InputError(f"plan option vocab_size={self.vocab_size} but the model's vocabulary is "
                             f"{mine.vocab_size}")

    @classmethod
    def checked(cls, **values) -> "CompileOptions":
        """Build options, turning validation errors into one-line-per-problem InputError."""
        try:
            return cls(**values)
        except ValidationError as exc:
            # a check across fields has no location: its message names the fields itself
            raise InputError([f"option {'.'.join(map(str, e['loc']))}: {e['msg']}" if e["loc"] else
                              f"option {e['msg'].removeprefix('Value error, ')}" for e in exc.errors()]) from None
