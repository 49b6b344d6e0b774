"""The control API workers talk to (aiohttp; JSON bodies are `echo.protocol` models), one room per concern.

    POST /v1/join            run token -> worker id + credential, ...   learner.api.workers
    POST /v1/heartbeat       liveness + measurements; renews leases     learner.api.workers
    POST /v1/lease           prompts or an eval lease; long-polls       learner.api.leases
    POST /v1/release         hand a lease back unanswered               learner.api.leases
    POST /v1/trajectories    zstd msgpack groups (echo.wire)            learner.api.uploads
    POST /v1/eval            an eval lease's rewards                    learner.api.evals
    GET  /v1/model, /v1/snapshots/..., /v1/status, /metrics             learner.api.status

`learner.api.app.ControlApi` builds the rooms from the parts each uses; `learner.api.run.Run`
holds the few facts of the run many rooms read. Peers are untrusted: every body is validated
against its model (unknown keys refused, strings and lists bounded), every upload is checked and
its rewards recomputed (`learner.verify`), heartbeat claims are believed only as far as
measurements support them, and a worker caught lying is quarantined. Nothing heavy runs on the
event loop: decoding uploads and rescoring run on the `offload` threads.
"""

from learner.api.app import ControlApi, link_table, worker_connections
from learner.api.run import Run

__all__ = ["ControlApi", "Run", "link_table", "worker_connections"]
