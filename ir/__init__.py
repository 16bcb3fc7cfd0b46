"""HARTS IR: the compact prefix forest and the Program the passes refine (numpy struct-of-arrays).

See docs/INTERFACES.md section 1-2 for the fields; `.hir` text form in `text`.
"""
from .artifact import arrays_path, check_plan_path, load_hir, read_hir, read_hir_text, write_hir
from .errors import ArtifactError, IRError
from .forest import Forest
from .program import Microbatches, Pieces, Program, Sequences, Trajectories, structural_diff
from .text import format_program, parse_hir

__all__ = ["ArtifactError", "IRError", "Forest", "Microbatches", "Pieces", "Program", "Sequences", "Trajectories",
           "structural_diff", "format_program", "parse_hir", "arrays_path", "check_plan_path", "load_hir",
           "read_hir", "read_hir_text", "write_hir"]
