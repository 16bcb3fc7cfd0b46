"""HARTS: compile rollout trees so every shared prefix token is computed once, exactly.

Public API: `TreeBatch` (input), `CompileOptions`, `compile(batch, options) -> Plan`,
`InputError` (bad input; one line per problem).
"""
from .errors import InputError  # first: passes import it while this package initialises
from .batch import TreeBatch
from .options import CompileOptions
from .plan import Plan, PlannedMicrobatch
from .driver import compile

__version__ = "0.1.0"
__all__ = ["TreeBatch", "InputError", "CompileOptions", "compile", "Plan", "PlannedMicrobatch"]
