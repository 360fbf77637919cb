"""The design measures of docs/architecture.md's table, counted from the code of a checkout.

    python scripts/design_metrics.py [ROOT]        # ROOT: a checkout (default: this one)

Each measure is counted the same way on any checkout, so two checkouts give a before/after table:

- forward pass: a decoder-only forward (gpt-tiny, learned positions, batch 2 x 8 tokens, eval) traced
  with ``sys.settrace``: the aiayn functions it enters, their files, and their lines (def to end).
- attention branches: ``if`` / ``elif`` / conditional expressions in the functions of that trace that
  live in ``aiayn/nn/attention.py`` and ``aiayn/nn/masks.py`` (the attention path).
- cache classes: classes under aiayn/ that hold or wrap key/value storage (a method ``write`` taking
  keys and values, or a name ending in ``Cache``, ``KV`` or ``Layers`` in nn/, fast/, generate/, serve/).
- decode-step builders: functions in generate/, fast/ and serve/ that build a stack's inputs
  (``StackInputs(``, ``.attention_inputs(``), reserve a step's cache slots (``.reserve(``) or apply the
  output layer (``lm_head(``).
- long functions: over 80 lines (def to end, the docstring not counted); long files: over 500 lines.
- import cycles: strongly connected components of the import graph (every import counts, also under
  ``TYPE_CHECKING`` and inside functions; ``from a import b`` is an edge to ``a.b`` when that is a module).
- lines of Python in aiayn/ and benchmarks/.
"""

from __future__ import annotations

import argparse
import ast
import collections
import subprocess
import sys
from pathlib import Path

LONG_FUNCTION, LONG_FILE = 80, 500


def python_files(root: Path, folder: str) -> list[Path]:
    return sorted((root / folder).rglob("*.py"))


def line_count(root: Path, folder: str) -> int:
    return sum(len(p.read_text(encoding="utf-8").splitlines()) for p in python_files(root, folder))


def function_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from ``def`` to the function's end, its docstring not counted."""
    body = node.body
    docstring = 0
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        docstring = body[0].end_lineno - body[0].lineno + 1  # type: ignore[operator]
    return node.end_lineno - node.lineno + 1 - docstring  # type: ignore[operator]


def long_functions(root: Path) -> list[str]:
    found = []
    for path in python_files(root, "aiayn"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and function_lines(node) > LONG_FUNCTION:
                found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({function_lines(node)})")
    return found


def long_files(root: Path) -> list[str]:
    return [f"{p.relative_to(root)} ({n})" for p in python_files(root, "aiayn")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > LONG_FILE]


def module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    paths = {module_name(root, p): p for p in python_files(root, "aiayn")}
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for module, path in paths.items():
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
                target = ".".join(p for p in (base, node.module or "") if p)
                targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in paths else target for a in node.names]
            else:
                continue
            graph[module].update(t for t in targets if t in paths and t != module)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def cache_classes(root: Path) -> tuple[list[str], list[str]]:
    """(the cache classes, the ones among them that other cache classes derive from: their bases)."""
    found: dict[str, list[str]] = {}
    for folder in ("aiayn/nn", "aiayn/fast", "aiayn/generate", "aiayn/serve", "aiayn/models"):
        for path in python_files(root, folder):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if not isinstance(node, ast.ClassDef):
                    continue
                writes_kv = any(isinstance(f, ast.FunctionDef) and f.name == "write"
                                and [a.arg for a in f.args.args[1:3]] == ["k", "v"] for f in node.body)
                named = node.name.endswith(("Cache", "KV", "Layers")) and "Plan" not in node.name
                if writes_kv or named:
                    found[node.name] = [b.id for b in node.bases if isinstance(b, ast.Name)]
    bases = {b for parents in found.values() for b in parents if b in found}
    return sorted(found), sorted(bases)


def decode_step_builders(root: Path) -> list[str]:
    found = []
    for folder in ("aiayn/generate", "aiayn/fast", "aiayn/serve"):
        for path in python_files(root, folder):
            text = path.read_text(encoding="utf-8")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    source = ast.get_source_segment(text, node) or ""
                    inner = [n for n in ast.walk(node) if n is not node
                             and isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
                    for n in inner:  # only this function's own body
                        source = source.replace(ast.get_source_segment(text, n) or "\0", "")
                    if any(mark in source for mark in ("StackInputs(", ".attention_inputs(", "lm_head(", ".reserve(")):
                        found.append(f"{path.relative_to(root)}:{node.lineno} {node.name}")
    return found


def trace_forward(root: Path) -> dict[str, object]:
    """Run the traced forward in a child process importing ROOT's aiayn."""
    code = f"""
import sys, torch, json
sys.path.insert(0, {str(root)!r})
from aiayn.models.decoder_only import DecoderOnly
from aiayn.models.presets import get_preset
torch.manual_seed(0)
model = DecoderOnly(get_preset("gpt-tiny", positional="learned")).eval()
tokens = torch.randint(1, model.config.vocab_size, (2, 8))
seen = set()
pkg = {str(root / "aiayn")!r}
def tracer(frame, event, arg):
    if event == "call" and frame.f_code.co_filename.startswith(pkg):
        c = frame.f_code
        seen.add((c.co_filename, c.co_name, c.co_firstlineno))
    return None
with torch.no_grad():
    model(tokens)  # warm: first-call imports and caches
    sys.settrace(tracer)
    model(tokens)
    sys.settrace(None)
print(json.dumps(sorted(seen)))
"""
    import json
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    lines, branches = 0, 0
    trees: dict[str, ast.Module] = {}
    for filename, name, first in seen:
        tree = trees.setdefault(filename, ast.parse(Path(filename).read_text(encoding="utf-8")))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                decorated = min([node.lineno, *[d.lineno for d in node.decorator_list]])
                if first in (node.lineno, decorated):
                    lines += node.end_lineno - node.lineno + 1  # type: ignore[operator]
                    if filename.endswith(("aiayn/nn/attention.py", "aiayn/nn/masks.py")):
                        branches += sum(isinstance(n, (ast.If, ast.IfExp)) for n in ast.walk(node))
                    break
    return {"functions": len(seen), "files": len({f for f, _, _ in seen}), "lines": lines,
            "attention branches": branches}


def duplicate_pairs(root: Path) -> str:
    try:
        out = subprocess.run(["duplicates", "--most", "1", "--seconds", "120"], cwd=root / "aiayn",
                             capture_output=True, text=True, timeout=180)
    except (OSError, subprocess.TimeoutExpired):
        return "n/a (the duplicates tool is not on PATH)"
    first = out.stdout.splitlines()[0] if out.stdout else ""
    return first.split(" pairs")[0] if " pairs" in first else ("0" if "no duplicates" in first else "n/a")


def main() -> None:
    parser = argparse.ArgumentParser(description="Print the design measures of docs/architecture.md's table.")
    parser.add_argument("root", nargs="?", type=Path, default=Path(__file__).resolve().parents[1],
                        help="a checkout of aiayn (default: this one)")
    root = parser.parse_args().root.resolve()
    if not (root / "aiayn").is_dir():
        parser.error(f"{root} is not a checkout of aiayn (no aiayn/ folder)")
    forward = trace_forward(root)
    cycles = import_cycles(import_graph(root))
    (caches, bases), builders = cache_classes(root), decode_step_builders(root)
    functions, files = long_functions(root), long_files(root)
    rows = [
        ("decoder-only forward: functions / files / lines",
         f"{forward['functions']} / {forward['files']} / {forward['lines']}"),
        ("branches in the attention path (nn/attention.py, nn/masks.py)", str(forward["attention branches"])),
        ("KV-cache classes (of them bases of others)", f"{len(caches)} ({len(bases)}): {', '.join(caches)}"),
        ("decode-step builders (stack inputs, slots or output layer in generate/, fast/, serve/)",
         f"{len(builders)}: {', '.join(b.split(' ')[-1] for b in builders)}"),
        (f"functions over {LONG_FUNCTION} lines", f"{len(functions)}" + (f": {'; '.join(functions)}" if functions else "")),
        (f"files over {LONG_FILE} lines", f"{len(files)}" + (f": {'; '.join(files)}" if files else "")),
        ("import cycles", f"{len(cycles)}" + (f": {'; '.join(' <-> '.join(c) for c in cycles)}" if cycles else "")),
        ("lines of Python in aiayn/", f"{line_count(root, 'aiayn'):,}"),
        ("lines of Python in benchmarks/", f"{line_count(root, 'benchmarks'):,}"),
        ("duplicated places in aiayn/ (`duplicates`)", duplicate_pairs(root)),
    ]
    for name, value in rows:
        print(f"{name}: {value}")


if __name__ == "__main__":
    main()
