"""Rollout engines behind one small interface (`worker.engines.base.Engine`)."""

from worker.engines.base import Engine, EngineError, GenerationParams, make_engine

__all__ = ["Engine", "EngineError", "GenerationParams", "make_engine"]
