"""Closed-loop autotuning of the partial-rollout knobs (over-sampling, truncation threshold).

`controller` is the pure control law; `prometheus` reads the runtime metrics; `timer` is the kopf
timer that runs the loop per RLJob and writes status.effectiveKnobs. See docs/autotune.md.
"""
