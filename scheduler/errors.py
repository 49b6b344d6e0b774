"""Typed errors of the scheduler. Each message says what is wrong and what to do about it."""

from __future__ import annotations


class SchedulerError(ValueError):
    """Base of every error the scheduler raises on purpose."""


class InfeasibleOverlap(SchedulerError):
    """No rollout capacity can keep the learner busy with this `I`, `S` and broadcast time.

    `condition` names what fails (`overlap`: the paper's `I·T ≤ T_b`; `admissibility`: rollouts
    of a new snapshot cannot reach the learner within `S`; `throughput`: installs take a whole
    period). The message names `I`, `S` and `T_bcast` together and what to change: the largest
    feasible `I` for this `S`, the smallest feasible `S` for this `I`, or the broadcast time
    that would do. `smallest_feasible_period` is kept for the paper's rule (None otherwise).
    """

    def __init__(self, message: str, *, condition: str = "overlap", publish_every: int = 0,
                 max_staleness: int | None = None, t_train: float = 0.0, t_bcast: float = 0.0,
                 smallest_feasible_period: int | None = None, largest_feasible_period: int | None = None,
                 smallest_feasible_staleness: int | None = None):
        self.condition = condition
        self.publish_every, self.max_staleness = publish_every, max_staleness
        self.t_train, self.t_bcast = t_train, t_bcast
        self.smallest_feasible_period = smallest_feasible_period
        self.largest_feasible_period = largest_feasible_period
        self.smallest_feasible_staleness = smallest_feasible_staleness
        super().__init__(message)


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
