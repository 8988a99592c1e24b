"""Imports run one way: no cycles, and each layer imports only the layers below it.

The layers, bottom to top (docs/architecture.md explains each):

    base       errors, config, distributed, files,   leaf facts: dataclasses, user errors, process groups, atomic files,
               units                                 byte sizes
    layout     pipeline                              pure stage placement; costs come in as functions
    model      model, data                           torch modules and specs; tokens and samples
    estimate   estimate                              memory and compute models (arithmetic over config + layout)
    runtime    training, inference                   engine, loop, checkpoints, single-process generation
    interface  flags, plan, interop, testing         the command line (flags -> config); the planner; format
                                                     conversion driven by our flags; test launchers

Every `import megatron_ds...` counts, including those inside functions (a lazy import that
dodges a cycle is still a cycle in the design) and those under `if TYPE_CHECKING:` (a type a
module needs is a dependency of its design too). `from pkg import name` runs and reads
`pkg/__init__.py`, so it counts as importing the package as well as `pkg.name` when that is a
module: a package whose `__init__` imports its own modules would close a cycle with any of them
that imports a sibling this way, so our package files import nothing of their own (the flag
package's re-export of its table is read only from outside it).

The estimate layer is pure arithmetic: no module in `estimate/` imports torch, DeepSpeed or
megatron-core, even lazily (what measures lives in the runtime layer and hands numbers down).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_ds"

LAYERS = ("base", "layout", "model", "estimate", "runtime", "interface")
LAYER_OF = {
    "errors": "base",
    "files": "base",
    "units": "base",
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


def imports_of(path: Path) -> set[str]:
    """The megatron_ds modules `path` imports: `from pkg import name` counts `pkg` and, when it is a
    module, `pkg.name` (`from megatron_ds import files` counts only `files`: every import runs the
    root package's file, which loads nothing until `megatron_ds.build_pipeline` is asked for)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("megatron_ds"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megatron_ds"):
            if node.module != "megatron_ds":  # the root: the front door every import runs anyway
                found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names if _is_module(f"{node.module}.{a.name}"))
    return found


def third_party_imports(path: Path) -> set[str]:
    """Top-level names of everything else `path` imports (lazily or not)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found - {"megatron_ds"}


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
    deps = imports_of(PACKAGE / "training" / "run_data.py")
    assert "megatron_ds.data.gpt_data" in deps  # imported inside a function there


def test_the_estimate_layer_imports_no_torch_deepspeed_or_megatron() -> None:
    heavy = {"torch", "deepspeed", "megatron"}
    found = {
        str(path.relative_to(PACKAGE)): sorted(third_party_imports(path) & heavy)
        for path in sorted((PACKAGE / "estimate").rglob("*.py"))
    }
    assert not {k: v for k, v in found.items() if v}, found


def test_the_cycle_check_counts_package_files() -> None:
    """The rule that makes package-level cycles visible: `from pkg import mod` depends on `pkg`."""
    deps = imports_of(PACKAGE / "flags" / "parser.py")
    assert "megatron_ds.flags" in deps and "megatron_ds.flags.compat" in deps
