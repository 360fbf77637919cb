"""The dependency direction: config <- nn <- models <- {train, generate, interop} <- tasks <- the
applications {explain, experiments, serve, explore} <- cli, with fast/ beside the spine (it depends on config, nn
and models; nn and models never on it).

Every module of the package is parsed with ``ast``; every import counts, including the ones inside
functions (lazy imports) and under ``if TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "aiayn"
HIGHER = ("aiayn.train", "aiayn.generate", "aiayn.interop", "aiayn.cli", "aiayn.viz", "aiayn.data",
          "aiayn.tokenizers")


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


# ---- the layering, module by module -----------------------------------------------------------
def module_name(path: Path) -> str:
    parts = ("aiayn", *path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def resolved_imports(path: Path) -> Iterator[tuple[str, list[str]]]:
    """Every import of ``path``, anywhere in it, as (module, the names imported from it; none for
    ``import a.b``), relative imports resolved."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from ((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            yield ".".join(p for p in (base, node.module or "") if p), [alias.name for alias in node.names]


def aiayn_imports(path: Path) -> set[str]:
    """The aiayn modules ``path`` imports, anywhere in it: ``from aiayn import viz`` counts as
    aiayn.viz, relative imports are resolved."""
    names: set[str] = set()
    for module, imported in resolved_imports(path):
        names.add(module)
        if module == "aiayn":  # from aiayn import viz, tasks, ...
            names.update(f"aiayn.{name}" for name in imported)
    return {n for n in names if n == "aiayn" or n.startswith("aiayn.")}


MODULES = {module_name(path): aiayn_imports(path) for path in sorted(PACKAGE.rglob("*.py"))}


def within(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


# Each layer: the aiayn packages its modules may import (not "aiayn" itself, the top-level package:
# it imports models; ``from aiayn import x`` counts as importing aiayn.x).
ALLOWED = {
    "aiayn.config": (),
    "aiayn.device": (),  # the placement and precision policy: torch only, asked by every layer above nn
    # aiayn.device, like config, is a leaf every layer may ask (placement and precision)
    "aiayn.nn": ("aiayn.config", "aiayn.device", "aiayn.nn"),
    "aiayn.models": ("aiayn.config", "aiayn.device", "aiayn.nn", "aiayn.models"),
    "aiayn.fast": ("aiayn.config", "aiayn.device", "aiayn.nn", "aiayn.models", "aiayn.fast"),
}
# The middle of the spine may import what it needs, except what sits above it.
ABOVE_THE_MIDDLE = ("aiayn.tasks", "aiayn.cli", "aiayn.translate", "aiayn.textgen", "aiayn.embed",
                    "aiayn.demo", "aiayn.explain", "aiayn.serve", "aiayn.explore", "aiayn.experiments")
# on top of everything but the CLI
APPLICATIONS = ("aiayn.explain", "aiayn.serve", "aiayn.explore", "aiayn.experiments")
# Known violations in files this test does not own, as {layer: reason naming them}: each is an
# xfail(strict=True), so the test turns red (asking to remove the entry) once it is fixed.
KNOWN_VIOLATIONS: dict[str, str] = {}


def violations(layer: str) -> list[str]:
    found = []
    for module, imports in MODULES.items():
        if not within(module, layer):
            continue
        for name in sorted(imports):
            if layer in ALLOWED:
                bad = not within(name, *ALLOWED[layer])
            elif layer == "aiayn.tasks":
                bad = within(name, "aiayn.cli", *APPLICATIONS)
            elif layer in APPLICATIONS:
                bad = within(name, "aiayn.cli")
            else:
                bad = within(name, *ABOVE_THE_MIDDLE)
            if bad:
                found.append(f"{module} imports {name}")
    return found


LAYERS = [*ALLOWED, "aiayn.train", "aiayn.generate", "aiayn.interop", "aiayn.tasks", *APPLICATIONS]


@pytest.mark.parametrize("layer", [
    pytest.param(layer, marks=pytest.mark.xfail(strict=True, reason=KNOWN_VIOLATIONS[layer]))
    if layer in KNOWN_VIOLATIONS else layer
    for layer in LAYERS
])
def test_each_layer_imports_only_what_sits_below_it(layer):
    assert any(within(m, layer) for m in MODULES), f"no module of {layer} found"
    assert not violations(layer), violations(layer)


def test_nothing_imports_the_cli_but_main():
    offenders = [f"{module} imports {name}" for module, imports in MODULES.items()
                 if not within(module, "aiayn.cli") and module != "aiayn.__main__"
                 for name in imports if within(name, "aiayn.cli")]
    assert not offenders, offenders
    assert "aiayn.cli" in MODULES["aiayn.__main__"]


def test_nn_and_models_never_import_fast():
    """The CPU kernels are applied to a built model from outside (aiayn.fast.optimize)."""
    offenders = [f"{module} imports {name}" for module, imports in MODULES.items()
                 if within(module, "aiayn.nn", "aiayn.models") for name in imports if within(name, "aiayn.fast")]
    assert not offenders, offenders


def test_the_layer_walk_sees_lazy_and_package_imports():
    # a function-level import (aiayn.data.fetch_hint) and ``from aiayn import x`` (train.trainer)
    assert "aiayn.data.fetch" in MODULES["aiayn.data"]
    assert "aiayn.viz" in MODULES["aiayn.train.trainer"]
    assert "aiayn.nn.attention" in MODULES["aiayn.models.blocks"]
    assert {"aiayn.cli", "aiayn.nn.kv_cache", "aiayn.tasks.runs", "aiayn.explore.app"} <= set(MODULES)
    assert "aiayn.tasks.trained" in MODULES["aiayn.explore.models"]  # a lazy import, seen


def test_the_task_protocol_is_the_trainers():
    """Task lives in aiayn.train (the trainer drives it); aiayn.tasks re-exports it."""
    from aiayn.tasks import Task
    from aiayn.tasks.base import Task as BaseTask
    from aiayn.train.task import Task as TrainTask

    assert Task is BaseTask is TrainTask


# ---- no import circles --------------------------------------------------------------------------
def import_edges(path: Path) -> set[str]:
    """The aiayn modules ``path`` imports, anywhere in it: ``from a.b import c`` is an edge to the
    module a.b.c if there is one, else to a.b."""
    edges: set[str] = set()
    for module, imported in resolved_imports(path):
        edges.update([f"{module}.{name}" if f"{module}.{name}" in MODULES else module for name in imported] or [module])
    return edges & set(MODULES)


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components (more than one module) of an import graph (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = [stack.pop()]
            while component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1 or node in graph[node]:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_no_import_cycles():
    """Each shared thing has one owner: no module imports, even lazily, one that imports it back."""
    graph = {module_name(path): import_edges(path) for path in sorted(PACKAGE.rglob("*.py"))}
    cycles = import_cycles(graph)
    assert not cycles, "import circles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_walk_sees_circles_and_lazy_imports():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert sorted(import_cycles(graph)) == [["a", "b", "c"], ["e"]]
    assert "aiayn.data.fetch" in import_edges(PACKAGE / "data" / "__init__.py")  # inside a function
    assert "aiayn.tasks.copy" in import_edges(PACKAGE / "tasks" / "__init__.py")  # from aiayn.tasks import copy


# ---- the earlier, coarser checks ---------------------------------------------------------------
def test_nn_and_models_never_import_higher_layers():
    offenders = []
    for sub in ("nn", "models"):
        for path in sorted((PACKAGE / sub).rglob("*.py")):
            for name in imported_modules(path):
                if name.startswith(HIGHER) or (sub == "nn" and name.startswith("aiayn.models")):
                    offenders.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert not offenders, offenders


def test_config_does_not_import_torch():
    assert not any(n.split(".")[0] in ("torch", "aiayn") for n in imported_modules(PACKAGE / "config.py"))


def test_the_walk_sees_real_imports():
    assert "aiayn.nn.attention" in imported_modules(PACKAGE / "models" / "blocks.py")


def test_nn_and_models_never_import_torch_distributed():
    """Parallelism (aiayn.train.distributed, aiayn.train.parallel) wraps the models from outside."""
    offenders = [f"{path.relative_to(PACKAGE)} imports {name}"
                 for sub in ("nn", "models") for path in sorted((PACKAGE / sub).rglob("*.py"))
                 for name in imported_modules(path) if name.startswith("torch.distributed")]
    assert not offenders, offenders
    assert "torch.distributed.tensor.parallel" in imported_modules(PACKAGE / "train" / "parallel.py")


def test_cli_verbs_only_parse_and_call():
    """No command body of aiayn.cli (after its docstring) is over 40 lines: the work is the library's."""
    long_verbs = []
    for path in sorted((PACKAGE / "cli").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef) and any(
                    isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr in ("command", "group")
                    for d in node.decorator_list):
                code = node.body[1:] if ast.get_docstring(node) else node.body
                lines = node.end_lineno - code[0].lineno + 1 if code else 0
                if lines > 40:
                    long_verbs.append(f"{path.name}:{node.name}: {lines} lines")
    assert not long_verbs, long_verbs


# ---- what importing costs ---------------------------------------------------------------------
def test_importing_aiayn_leaves_torch_compile_unloaded() -> None:
    """torch._dynamo (~70 MiB resident, and sympy with it) is imported only by code that compiles:
    an eager process (generate, translate, a packed 4-bit model) does not pay for it. Decorators
    that would import it at module level are applied lazily (aiayn.fast.matvec.mark_for_compile,
    fused_loss's torch._disable_dynamo)."""
    import subprocess
    import sys

    modules = ["aiayn.cli", "aiayn.fast", "aiayn.fast.q4", "aiayn.fast.quantize", "aiayn.generate",
               "aiayn.interop", "aiayn.train", "aiayn.translate", "aiayn.serve"]
    code = ("import importlib, sys\n"
            f"for name in {modules!r}:\n"
            "    importlib.import_module(name)\n"
            "print(sorted(m for m in ('torch._dynamo', 'torch._inductor', 'sympy') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_only_the_device_module_places_tensors_by_hand():
    """One module owns placement (``aiayn.device``): nothing else calls ``.cuda()`` or names a GPU."""
    offenders = [f"{path.relative_to(PACKAGE)}:{i}" for path in sorted(PACKAGE.rglob("*.py"))
                 if path.name != "device.py"
                 for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
                 if ".cuda(" in line or 'torch.device("cuda' in line]
    assert not offenders, offenders
