"""rljob runtime: the APRIL partial-rollout RL loop."""
