"""Task adapters (the data plane): prompts, environments, rewards, eval sets."""

from echo.tasks.base import Environment, Message, OneTurn, Prompt, Step, Task, TaskError, TaskOptions, register_task
from echo.tasks.registry import load_task, task_names

__all__ = ["Environment", "Message", "OneTurn", "Prompt", "Step", "Task", "TaskError", "TaskOptions", "load_task",
           "register_task", "task_names"]
