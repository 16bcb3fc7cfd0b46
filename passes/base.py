"""Pass base class. A pass is a frozen dataclass whose fields are its options; `run` is pure
(`Program -> Program`, never mutating its input). Each pass documents its invariants and
complexity in its docstring; the pass manager verifies the Program between passes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from harts_compiler.ir import Program


class PassError(ValueError):
    """A pass was run on a Program that lacks what it needs (a pipeline-order bug)."""


@dataclass(frozen=True)
class Pass:
    name: ClassVar[str] = "pass"

    def run(self, program: Program) -> Program:  # pragma: no cover - interface
        raise NotImplementedError

    def require(self, condition: bool, what: str) -> None:
        if not condition:
            raise PassError(f"pass {self.name}: needs {what}")
