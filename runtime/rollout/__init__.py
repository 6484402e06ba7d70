"""Rollout scheduling: samples, groups, the partial buffer and the sync/APRIL strategies."""
