"""The scheduler: pure logic that decides how much rollout capacity to rent and predicts
what a configuration will cost and how stale its data will be. It knows nothing of torch
or the network; the learner adapts it.

- `capacity`   the ECHO-2 overlap rule: R_req, feasibility, worst-case staleness bound, bubble
- `activation` min-cost worker choice: greedy by unit cost and the exact covering ILP (pulp/CBC)
- `controller` closed loop over heartbeats: EWMA throughput, hysteresis, activate/release decisions
- `pool`       pool files (TOML) of candidate workers
- `cost`       $/step, cumulative $, bubble ratio, $ per unit of eval improvement
- `staleness`  closed-form mean staleness (PQS, IQS), frontier helpers, the length model
- `simulator`  event-driven staleness simulator (blog's fully-async mode and ECHO-2's pipeline)
- `planner`    everything `echo-rl plan` predicts, as data; `plan` is the command itself
- `config`     the `[scheduler]` table of the learner config, its provider a tagged union
- `providers`  machines brought up and down (static, local, command) and `make_provider`
- `fleet`      the learner-side adapter: pool candidates, heartbeats, provider actions
- `bench`      benchmarks (`python -m scheduler.bench activation|staleness|speed`)
"""

from scheduler.activation import Activation, Candidate, compare, exact, greedy
from scheduler.capacity import required_rate, smallest_feasible_period, staleness_bound
from scheduler.controller import Controller, ControllerParams, Decision
from scheduler.cost import CostMeter, dollars_per_step
from scheduler.errors import (
    InfeasibleOverlap,
    InsufficientCapacity,
    PoolError,
    SchedulerError,
)
from scheduler.pool import Pool, load_pool

__all__ = [
    "Activation", "Candidate", "Controller", "ControllerParams", "CostMeter", "Decision",
    "InfeasibleOverlap", "InsufficientCapacity", "Pool", "PoolError", "SchedulerError", "compare",
    "dollars_per_step", "exact", "greedy", "load_pool", "required_rate", "smallest_feasible_period",
    "staleness_bound",
]
