"""Rollout engines behind one small interface (`worker.engines.base.Engine`)."""

from worker.engines.base import (
    Engine,
    EngineBusy,
    EngineError,
    GenerationParams,
    InstallVerificationError,
    SnapshotMismatch,
    make_engine,
)

__all__ = ["Engine", "EngineBusy", "EngineError", "GenerationParams", "InstallVerificationError",
           "SnapshotMismatch", "make_engine"]
