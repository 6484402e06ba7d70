"""Policy-gradient algorithms: group advantages (GRPO/DAPO) and the clipped, off-policy-aware loss."""
