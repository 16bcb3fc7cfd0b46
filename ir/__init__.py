"""HARTS IR: the compact prefix forest and the Program the passes refine (numpy struct-of-arrays).

See docs/INTERFACES.md section 1-2 for the fields; `.hir` text form in `text`.
"""
from .errors import IRError
from .forest import Forest
from .program import Microbatches, Program, Sequences, Trajectories, structural_diff
from .text import format_program, parse_hir, read_hir, write_hir

__all__ = ["IRError", "Forest", "Microbatches", "Program", "Sequences", "Trajectories",
           "structural_diff", "format_program", "parse_hir", "read_hir", "write_hir"]
