"""The scheduler's benchmarks (programs, not library code): `planning` measures activation,
the staleness model and the simulator (`echo-rl bench activation|staleness|simspeed`, or
`python -m scheduler.bench activation|staleness|speed`)."""
