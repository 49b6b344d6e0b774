"""Finding a task by name: the built-in tasks (imported here, which registers them) and any
`module:Class` path. Kept apart from `base` so the built-in tasks import `base` and nothing
imports them back."""

from __future__ import annotations

import importlib
from typing import Any

from pydantic import ValidationError

from echo.tasks import arith, calculator, math, poker  # noqa: F401  (importing them registers them)
from echo.tasks.base import _REGISTRY, Task, TaskError


def task_names() -> list[str]:
    return sorted(_REGISTRY)


def load_task(name: str, options: dict[str, Any] | None = None) -> Task:
    """Instantiate a task by registered name or `module:Class` path, validating its options."""
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise TaskError(f"cannot import task {name!r}: {e}") from e
        if not (isinstance(cls, type) and issubclass(cls, Task)):
            raise TaskError(f"{name!r} is not a subclass of echo.tasks.Task")
    elif name in _REGISTRY:
        cls = _REGISTRY[name]
    else:
        raise TaskError(
            f"unknown task {name!r}; built-in tasks: {', '.join(task_names())} "
            "(or give 'package.module:ClassName')"
        )
    try:
        opts = cls.Options(**(options or {}))
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()
        )
        raise TaskError(f"bad options for task {name!r}: {problems}") from e
    return cls(opts)
