"""The trainer side of the learner: the policy model and its sharding (`model`, `dist`),
micro-batches under a token budget (`microbatch`), the GRPO loss (`losses`), memory prediction
and the start-up check that the run fits (`memory`, `preflight`), and the `Trainer` that ties
them into one update (`trainer`). Torch lives here; the control API does not import it."""
