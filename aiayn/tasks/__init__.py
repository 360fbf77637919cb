"""Built-in tasks; importing this package registers them. See ``base.Task``."""

from aiayn.tasks import chat, copy, language_model, reverse, set_anomaly, translation  # noqa: F401  (registration side effect)
from aiayn.tasks.base import TASKS, AttentionExample, Task, get_task, register

__all__ = ["TASKS", "AttentionExample", "Task", "get_task", "register"]
