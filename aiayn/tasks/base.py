"""The task registry: ``@register`` a ``Task`` subclass (``aiayn.train.task``), ``get_task(name, **options)``."""

from __future__ import annotations

import difflib
import inspect
from typing import Any

import torch

from aiayn.train.task import Batch, Task

TASKS: dict[str, type[Task]] = {}


def register(cls: type[Task]) -> type[Task]:
    TASKS[cls.name] = cls
    return cls


class UnknownTaskError(ValueError):
    """A task name or task option that does not exist."""


def get_task(name: str, **options: Any) -> Task:
    # Importing this module runs the package's __init__, which registers the built-in tasks.
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
    """Its ``__init__`` keyword parameters along the class hierarchy, and ``recorded_options``."""
    names: set[str] = set(cls.recorded_options)
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        for parameter in inspect.signature(init).parameters.values():
            if parameter.name != "self" and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY):
                names.add(parameter.name)
    return names


class GeneratedTask(Task):
    """A task whose examples are drawn from the seed: ``sizes`` of each split, made by ``generate``."""

    def __init__(self, *, seq_len: int, n_train: int = 50_000, n_val: int = 1_000, n_test: int = 10_000,
                 **options: Any) -> None:
        super().__init__(**options)
        self.seq_len = seq_len
        self.sizes = {"train": n_train, "val": n_val, "test": n_test}

    def generate(self, n: int, generator: torch.Generator) -> Batch:
        raise NotImplementedError

    def prepare(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for split, n in self.sizes.items():
            self.splits[split] = self.generate(n, generator)
