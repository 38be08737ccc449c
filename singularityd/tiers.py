"""Service tiers (Singularity's SLA tiers): a job's tier ranks it before its priority does. Pure.

A premium job is served before, and may preempt or shrink, standard and basic jobs whatever
their priorities; a standard job likewise outranks basic ones; within a tier the priority decides,
then the order of submission. `sing` imports this module for the names it offers.
"""

from __future__ import annotations

PREMIUM = "premium"
"""The highest tier, which the daemon's premium_group may keep for some users."""

TIERS = ("basic", "standard", PREMIUM)
"""The tiers, lowest first."""

DEFAULT_TIER = "standard"


def tier_rank(tier: str) -> int:
    """How a tier ranks (higher outranks lower); a name this version does not know (a job from a
    newer peer) ranks as the default tier."""
    return TIERS.index(tier if tier in TIERS else DEFAULT_TIER)


def standing(tier: str, priority: int) -> tuple[int, int]:
    """What the scheduler orders jobs by: tier, then priority (a larger standing outranks)."""
    return (tier_rank(tier), priority)


class Ranked:
    """What the scheduler's views of a job share: a tier and a priority, and the standing they
    give it (the policy's dataclasses declare the two as fields)."""

    tier: str
    priority: int

    @property
    def standing(self) -> tuple[int, int]:
        """Its tier, then its priority: a larger standing outranks (orders the queue, decides who
        may preempt or shrink whom)."""
        return standing(self.tier, self.priority)
