"""What the runtime accepts for the knobs that change while a job runs: one source of truth.

The spec's fields, the autotuner's bounds (spec.autotune.*), the runtime's knobs file and its
apply_knobs clamp all read these, so a value the CRD admits is a value the runtime runs with.

- over-sampling below 1 would launch fewer groups than a batch needs: the runtime clamps it to 1;
- the sigma multiplier k must be positive (mean + k*std is a cap above the mean);
- a segment cap is at least one token, and at most the largest response cap the spec admits.
"""

from __future__ import annotations

OVER_SAMPLING_MIN = 1.0
OVER_SAMPLING_MAX = 16.0
TRUNCATION_K_MIN_EXCLUSIVE = 0.0
TRUNCATION_K_MAX = 20.0
TRUNCATION_TOKENS_MIN = 1
# Also the bound of rollout.maxResponseLength: a segment cap above the response cap never applies.
MAX_RESPONSE_TOKENS = 1_000_000
TRUNCATION_TOKENS_MAX = MAX_RESPONSE_TOKENS
