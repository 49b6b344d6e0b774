"""The worker's benchmarks (programs, not library code): `engines` compares the rollout
engines (`echo-rl bench engines`)."""
