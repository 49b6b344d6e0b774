"""Task adapters (the data plane): prompts, rewards, eval sets."""

from echo.tasks.base import Prompt, Task, TaskError, TaskOptions, register_task
from echo.tasks.registry import load_task, task_names

__all__ = ["Prompt", "Task", "TaskError", "TaskOptions", "load_task", "register_task", "task_names"]
