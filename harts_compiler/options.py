"""`CompileOptions`: the user-facing compile settings (pydantic, validated at the edge)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import InputError


class CompileOptions(BaseModel):
    """chunk_size: linear-attention chunk C; conv_width: short-conv width W;
    microbatch_tokens: compact-token budget per microbatch (None = one microbatch per rank);
    dp_size: data-parallel ranks; vocab_size: reject tokens >= this when given;
    verify: run every IR verifier between passes (cheap, O(T))."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    chunk_size: int = Field(64, ge=1)
    conv_width: int = Field(4, ge=1)
    microbatch_tokens: int | None = Field(None, ge=1)
    dp_size: int = Field(1, ge=1)
    vocab_size: int | None = Field(None, ge=1)
    verify: bool = True

    @classmethod
    def checked(cls, **values) -> "CompileOptions":
        """Build options, turning validation errors into one-line-per-problem InputError."""
        try:
            return cls(**values)
        except ValidationError as exc:
            raise InputError([f"option {'.'.join(map(str, e['loc']))}: {e['msg']}"
                              for e in exc.errors()]) from None
