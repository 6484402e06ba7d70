"""Discrete-event simulator of RL rollout scheduling at cluster scale.

The runtime's own RolloutScheduler runs unchanged on a virtual-time event loop against simulated
engines (event-driven continuous batching with a KV limit and the perf_model step-time law).
Entry points: `load_scenario`, `simulate`, and `rljob simulate scenario.yaml` (cli.py).
"""
