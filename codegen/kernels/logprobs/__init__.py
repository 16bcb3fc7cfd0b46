"""Per-trajectory token log-probs and entropy from compact hidden states (docs/design.md section 5)."""
from .function import target_plan_of, token_logprobs
from .plan import TargetPlan, check_targets, plan_targets
from .reference import dense_token_logprobs

__all__ = ["TargetPlan", "check_targets", "dense_token_logprobs", "plan_targets", "target_plan_of", "token_logprobs"]
