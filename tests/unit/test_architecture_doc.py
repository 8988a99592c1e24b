"""docs/architecture.md stays true: it places every module of the package, and its layer diagram
names the same top-level modules per layer as the import-direction test."""

from __future__ import annotations

import re
from pathlib import Path

from tests.unit.test_import_layers import LAYER_OF, LAYERS

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "architecture.md").read_text()


def test_every_module_is_in_the_map() -> None:
    missing = []
    for path in sorted((ROOT / "megatron_ds").rglob("*.py")):
        rel = path.relative_to(ROOT / "megatron_ds")
        if rel.name == "__init__.py" or rel.name == "__main__.py":
            continue
        name = str(rel)
        # a module is placed when its path is named, or (for plan/ and interop/) its file name in its package's row
        if f"`{name}`" not in DOC and not (
            len(rel.parts) == 2 and f"`{rel.name}`" in DOC and f"`{rel.parts[0]}/`" in DOC
        ):
            missing.append(name)
    assert not missing, f"docs/architecture.md does not place: {missing}"


def test_layer_diagram_matches_the_import_test() -> None:
    diagram = DOC.split("```", 2)[1]
    for layer in LAYERS:
        assert any(ln.split()[:1] == [layer] for ln in diagram.splitlines()), f"layer {layer} missing"
    for module, layer in LAYER_OF.items():
        row_text = _layer_text(diagram, layer)
        assert re.search(rf"\b{module}\b", row_text), f"{module} ({layer}) is not in the diagram's {layer} row"


def _layer_text(diagram: str, layer: str) -> str:
    """The text of a layer's row and its continuation lines (indented), first column only."""
    lines = diagram.strip("\n").splitlines()
    out, inside = [], False
    for ln in lines:
        if ln.split()[:1] and ln.split()[0] in LAYERS:
            inside = ln.split()[0] == layer
        if inside:
            out.append(ln[:50])
    return " ".join(out)
