"""Built-in tasks; importing this package registers them. See ``base.Task``."""

from aiayn.tasks import (  # noqa: F401  (registration side effect)
    chat,
    copy,
    language_model,
    reverse,
    set_anomaly,
    text,
    translation,
)
from aiayn.tasks.base import TASKS, get_task, register
from aiayn.train.task import AttentionExample, Task

__all__ = ["TASKS", "AttentionExample", "Task", "get_task", "register"]
