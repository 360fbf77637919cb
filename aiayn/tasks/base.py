"""The task registry: ``@register`` a ``Task`` subclass, ``get_task(name, **options)`` builds one.

The ``Task`` protocol itself (with ``Batch`` and ``AttentionExample``) is the trainer's and lives in
``aiayn.train.task``; it is re-exported here and from ``aiayn.tasks``.
"""

from __future__ import annotations

from typing import Any

from aiayn.train.task import AttentionExample, Batch, Task

__all__ = ["TASKS", "AttentionExample", "Batch", "Task", "UnknownTaskError", "get_task", "register"]

TASKS: dict[str, type[Task]] = {}


def register(cls: type[Task]) -> type[Task]:
    TASKS[cls.name] = cls
    return cls


class UnknownTaskError(ValueError):
    pass


def get_task(name: str, **options: Any) -> Task:
    from aiayn import tasks as _  # noqa: F401  (registers the built-in tasks)

    if name not in TASKS:
        raise UnknownTaskError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name](**options)
