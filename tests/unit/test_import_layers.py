"""Imports run one way: no cycles, and each layer imports only the layers below it.

The layers, bottom to top (docs/architecture.md explains each):

    base       errors, config, distributed, files    leaf facts: dataclasses, user errors, process groups, atomic files
    layout     pipeline                              pure stage placement; costs come in as functions
    model      model, data                           torch modules and specs; tokens and samples
    estimate   estimate                              memory and compute models (arithmetic over config + layout)
    runtime    training, inference                   engine, loop, checkpoints, single-process generation
    interface  flags, plan, interop, testing         the command line (flags -> config); the planner; format
                                                     conversion driven by our flags; test launchers

Every `import megatron_ds...` counts, including those inside functions (a lazy import that
dodges a cycle is still a cycle in the design); only imports under `if TYPE_CHECKING:` are
ignored.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_ds"

LAYERS = ("base", "layout", "model", "estimate", "runtime", "interface")
LAYER_OF = {
    "errors": "base",
    "files": "base",
    "config": "base",
    "distributed": "base",
    "pipeline": "layout",
    "model": "model",
    "data": "model",
    "estimate": "estimate",
    "training": "runtime",
    "interop": "interface",
    "inference": "runtime",
    "flags": "interface",
    "plan": "interface",
    "testing": "interface",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imports_of(path: Path) -> set[str]:
    """The megatron_ds modules `path` imports (a `from pkg import name` counts `pkg.name` when that is a module)."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_lines(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("megatron_ds"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megatron_ds"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if _is_module(sub) else node.module)
    return found


def _is_module(name: str) -> bool:
    rel = Path(*name.split(".")[1:])
    return (PACKAGE / rel).with_suffix(".py").is_file() or (PACKAGE / rel / "__init__.py").is_file()


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) - {module_name(p)} for p in sorted(PACKAGE.rglob("*.py"))}


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:  # megatron_ds/__init__.py: the public front door, may re-export anything lazily
        return "interface"
    return LAYER_OF[parts[1]]


def test_every_module_has_a_layer() -> None:
    missing = sorted({m.split(".")[1] for m in graph() if "." in m and m.split(".")[1] not in LAYER_OF})
    assert not missing, f"give these top-level modules a layer in LAYER_OF (and docs/architecture.md): {missing}"


def test_each_layer_imports_only_layers_below_it() -> None:
    upward = []
    for module, deps in graph().items():
        mine = LAYERS.index(layer(module))
        for dep in sorted(deps):
            if LAYERS.index(layer(dep)) > mine:
                upward.append(f"{module} ({layer(module)}) imports {dep} ({layer(dep)})")
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_no_import_cycles() -> None:
    g = graph()
    # Importing `pkg.mod` runs `pkg/__init__.py` too; treat a package's __init__ as a dependency.
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(g.get(node, ())):
            if dep not in g:
                continue
            if state.get(dep) == "open":
                cycles.append(" -> ".join(stack[stack.index(dep) :] + [dep]))
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = "done"

    for module in sorted(g):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_parser_sees_lazy_imports() -> None:
    """The check above would be empty if the parser missed imports inside functions."""
    deps = imports_of(PACKAGE / "training" / "loop.py")
    assert "megatron_ds.data.gpt_data" in deps  # imported inside a function there
