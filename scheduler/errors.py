"""Typed errors of the scheduler. Each message says what is wrong and what to do about it."""

from __future__ import annotations


class SchedulerError(ValueError):
    """Base of every error the scheduler raises on purpose."""


class InfeasibleOverlap(SchedulerError):
    """`I·T_train ≤ T_bcast`: no rollout capacity can hide the broadcast.

    `smallest_feasible_period` is the smallest publication period `I` that makes it feasible.
    """

    def __init__(self, publish_every: int, t_train: float, t_bcast: float, smallest_feasible_period: int):
        self.publish_every = publish_every
        self.t_train = t_train
        self.t_bcast = t_bcast
        self.smallest_feasible_period = smallest_feasible_period
        super().__init__(
            f"overlap is infeasible: I·T_train = {publish_every}·{t_train:g} s = "
            f"{publish_every * t_train:g} s does not exceed T_bcast = {t_bcast:g} s, so the learner "
            f"waits whatever the rollout capacity. Publish less often (smallest feasible I = "
            f"{smallest_feasible_period}, which needs staleness budget S ≥ {smallest_feasible_period + 1}) "
            f"or make the broadcast faster."
        )


class InsufficientCapacity(SchedulerError):
    """The whole candidate pool cannot reach the rollout-rate target."""

    def __init__(self, target: float, available: float):
        self.target = target
        self.available = available
        super().__init__(
            f"not enough rollout capacity: the target is {target:.3g} rollouts/s but every candidate "
            f"together gives {available:.3g} rollouts/s. Add workers to the pool, raise the "
            f"staleness budget S (a larger publication period I lowers R_req), or lower alpha."
        )


class PoolError(SchedulerError):
    """A pool file is missing, not TOML, or has a bad entry; the message names file and key."""
