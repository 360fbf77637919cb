"""The task registry: ``@register`` a ``Task`` subclass, ``get_task(name, **options)`` builds one.

The ``Task`` protocol itself (with ``Batch`` and ``AttentionExample``) is the trainer's and lives in
``aiayn.train.task``; it is re-exported here and from ``aiayn.tasks``.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any

from aiayn.train.task import AttentionExample, Batch, Task

__all__ = ["TASKS", "AttentionExample", "Batch", "Task", "UnknownTaskError", "get_task", "register", "task_options"]

TASKS: dict[str, type[Task]] = {}


def register(cls: type[Task]) -> type[Task]:
    TASKS[cls.name] = cls
    return cls


class UnknownTaskError(ValueError):
    pass


def get_task(name: str, **options: Any) -> Task:
    # The built-in tasks are registered: importing this module first runs the package's __init__,
    # which imports them.
    if name not in TASKS:
        close = difflib.get_close_matches(str(name), TASKS, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise UnknownTaskError(f"unknown task {name!r}{hint}; known tasks: {', '.join(sorted(TASKS))}")
    known = task_options(TASKS[name])
    unknown = sorted(set(options) - known)
    if unknown:  # a typo must not silently train the default
        named = []
        for key in unknown:
            close = difflib.get_close_matches(key, known, n=1)
            named.append(f"{key} (did you mean {close[0]}?)" if close else key)
        raise UnknownTaskError(f"task {name!r} has no option {', '.join(named)}; its options are "
                               f"{', '.join(sorted(known)) or 'none'}")
    return TASKS[name](**options)


def task_options(cls: type[Task]) -> set[str]:
    """The keyword options a task class takes: the named parameters of the ``__init__`` methods
    along its class hierarchy (each passes the rest up with ``**options``), and the options it
    records for its run (``Task.recorded_options``)."""
    names: set[str] = set(cls.recorded_options)
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        for parameter in inspect.signature(init).parameters.values():
            if parameter.name != "self" and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY):
                names.add(parameter.name)
    return names
