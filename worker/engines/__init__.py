"""Rollout engines behind one small interface (`worker.engines.base.Engine`)."""

from worker.engines.base import (
    Engine,
    EngineBusy,
    EngineError,
    GenerationParams,
    InstallVerificationError,
    SnapshotMismatch,
    check_engine_here,
    make_engine,
)

__all__ = ["Engine", "EngineBusy", "EngineError", "GenerationParams", "InstallVerificationError",
           "SnapshotMismatch", "check_engine_here", "make_engine"]
