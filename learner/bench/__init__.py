"""The learner's benchmarks and experiments (programs, not library code; the library never
imports them): `overlap` (the capacity rule against the real system's bubble), `control_plane`
(the control API under a simulated fleet), `trainer` (memory and time per batch), `experiment`
(sync vs bounded staleness end to end). Each is reached through `echo-rl bench NAME` or
`echo-rl experiment`."""
