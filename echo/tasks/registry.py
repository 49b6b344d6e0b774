"""Finding a task by name: the built-in tasks (imported here, which registers them) and any
`module:Class` path. Kept apart from `base` so the built-in tasks import `base` and nothing
imports them back."""

from __future__ import annotations

import difflib
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
        problems = "; ".join(_problem(err, cls.Options.model_fields) for err in e.errors())
        raise TaskError(f"bad options for task {name!r}: {problems}") from e
    return cls(opts)


def _problem(err: dict, options: dict) -> str:
    """One validation error of a task's options, as the rest of the config says them: an unknown
    option gets the closest known one and the list."""
    key = ".".join(str(p) for p in err["loc"])
    if err["type"] != "extra_forbidden":
        return f"{key}: {err['msg']}"
    close = difflib.get_close_matches(key, options, n=1)
    return (f"{key}: unknown option" + (f"; did you mean {close[0]!r}?" if close else "")
            + f"; this task's options: {', '.join(options) or 'none'}")
