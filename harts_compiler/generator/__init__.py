"""Seeded generator of agentic RL rollout batches (`harts gen`); presets in `presets.py`."""
from .cli import gen_main
from .presets import PRESETS, LogNormal, Pareto, Preset, resolve_preset
from .rollouts import RolloutBatch, generate, to_tree_records, write_jsonl
from .stats import BatchStats, batch_stats

__all__ = ["PRESETS", "BatchStats", "LogNormal", "Pareto", "Preset", "RolloutBatch", "batch_stats",
           "gen_main", "generate", "resolve_preset", "to_tree_records", "write_jsonl"]
