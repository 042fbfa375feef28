"""Pure decoding rules on (B, L) arrays: token statistics, commit rules, schedules.

The split every engine in the field shares: statistics of the logits (stats.py), a commit rule that
ranks candidate positions and commits a prefix of the ranking (rules.py), a schedule of per-step
quotas and block boundaries (schedule.py). The `sampler` setting's shared names map onto the rules
in one table (samplers.py; a family's own samplers are named in its model file); the families' own
rules sit in block.py, dream.py, dimple.py, rnd1.py, llada.py and canvas.py. No
function here owns state or calls a model.
"""

from .canvas import (
    CanvasStats,
    canvas_stats,
    linear_temperature,
    renoise,
    stable_and_confident,
)
from .rules import (
    edit_commit,
    entropy_commit,
    factor_commit,
    quota_commit,
    threshold_commit,
)
from .schedule import block_ranges, transfer_schedule
from .stats import TokenStats, filter_logits, token_stats

__all__ = [
    "TokenStats",
    "token_stats",
    "filter_logits",
    "quota_commit",
    "threshold_commit",
    "factor_commit",
    "entropy_commit",
    "edit_commit",
    "transfer_schedule",
    "block_ranges",
    "CanvasStats",
    "canvas_stats",
    "linear_temperature",
    "renoise",
    "stable_and_confident",
]
