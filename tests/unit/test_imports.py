"""The dependency direction: config <- nn <- models <- {train, generate, interop, viz} <- cli."""

from __future__ import annotations

import ast
from pathlib import Path

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
