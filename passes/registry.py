"""The one table of passes. The default pipeline is its order; options map onto pass fields."""
from __future__ import annotations

from .base import Pass
from .layout import Layout
from .prefix_compress import PrefixCompress
from .replay_min import ReplayMin
from .schedule import Schedule
from .cut_pieces import CutPieces

# name -> (pass class, {pass field: CompileOptions attribute})
PASSES: dict[str, tuple[type[Pass], dict[str, str]]] = {
    "prefix-compress": (PrefixCompress, {}),
    "layout": (Layout, {"conv_width": "conv_width", "chunk_size": "chunk_size"}),
    "replay-min": (ReplayMin, {"chunk_size": "chunk_size"}),
    "cut-pieces": (CutPieces, {"microbatch_tokens": "microbatch_tokens"}),
    "schedule": (Schedule, {"microbatch_tokens": "microbatch_tokens", "dp_size": "dp_size",
                            "objective": "objective", "time_limit_s": "schedule_time_limit_s",
                            "seed": "schedule_seed", "workers": "schedule_workers",
                            "cost_model": "cost_model", "linear_layers": "linear_layers",
                            "full_layers": "full_layers"}),
}


def build_pipeline(options, names=None) -> list[Pass]:
    """Instantiate passes `names` (default: the whole table, in order) from an options object."""
    names = list(PASSES) if names is None else list(names)
    pipeline = []
    for name in names:
        if name not in PASSES:
            raise KeyError(f"unknown pass {name!r}; known: {', '.join(PASSES)}")
        cls, fields = PASSES[name]
        kwargs = {field: getattr(options, attr) for field, attr in fields.items()}
        pipeline.append(cls(**kwargs))
    return pipeline
