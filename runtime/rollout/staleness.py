"""Staleness: the one rule for how old a token, a sample and a batch are.

The rule: a token's **staleness** is the number of policy versions between the policy being trained
(or rolled out for) and the version that generated the token, ``policy_version - token_version``.
Every other word is a threshold on that one number:

- a token is **stale** (off-policy) when its staleness is above 0: an older policy generated it.
  The trainer masks or reweights exactly these tokens; the batch statistics count exactly these;
- a sample's staleness is that of its oldest token (0 while it has none);
- a sample is **over the bound** when its staleness is above ``maxStaleness``: the scheduler throws
  its response away and regenerates it (when it leaves the buffer and again at acceptance), so no
  trained token is more than ``maxStaleness`` versions old.

Versions are stamped per token (``Sample.versions``), so all of this is exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def token_staleness(token_version: int, policy_version: int) -> int:
    """Policy versions between `policy_version` and the version that generated the token."""
    return policy_version - token_version


def is_stale(token_version: int, policy_version: int) -> bool:
    """Whether an older policy than `policy_version` generated the token (off-policy)."""
    return token_staleness(token_version, policy_version) > 0


def stale_flags(versions: Sequence[int], policy_version: int) -> list[bool]:
    """`is_stale` of every token, in order (the trainer's stale mask)."""
    return [is_stale(v, policy_version) for v in versions]


def stale_token_count(versions: Iterable[int], policy_version: int) -> int:
    """Tokens an older policy generated."""
    return sum(1 for v in versions if is_stale(v, policy_version))


def sample_staleness(versions: Sequence[int], policy_version: int) -> int:
    """Staleness of a sample: that of its oldest token, 0 while it has none."""
    return token_staleness(min(versions), policy_version) if versions else 0


def over_bound(versions: Sequence[int], policy_version: int, max_staleness: int) -> bool:
    """Whether a sample's oldest token is more than `max_staleness` versions old (regenerate it)."""
    return sample_staleness(versions, policy_version) > max_staleness
