"""Parser for layout strings in Megatron-LM's grammar (`--pp-layout`).

Symbols: `E` the pre-processing group (embedding), `t` one transformer layer, `L` the
post-processing group (final norm, LM head, loss), `|` a stage boundary. `X*N` repeats a symbol
and `(...)*N` a parenthesised group, e.g. `E|t*3|t*3|L`, `Et|tt|tL`, `E|(t|)*3L`. Whitespace is
ignored.
"""

from __future__ import annotations

from megatron_ds.errors import LayoutError

SYMBOLS = "EtL|"


def _error(layout: str, problem: str, fix: str) -> LayoutError:
    return LayoutError(f"--pp-layout {layout!r}: {problem}; {fix}")


class _Parser:
    def __init__(self, layout: str) -> None:
        self.layout = layout
        self.text = "".join(layout.split())
        self.pos = 0

    def fail(self, problem: str, fix: str = "write it like 'E|t*3|t*3|L'") -> LayoutError:
        return _error(self.layout, problem, fix)

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def sequence(self, closing: str = "") -> str:
        out = []
        while self.peek() and self.peek() != closing:
            out.append(self.item())
        return "".join(out)

    def item(self) -> str:
        ch = self.peek()
        if ch == "(":
            self.pos += 1
            inner = self.sequence(closing=")")
            if self.peek() != ")":
                raise self.fail("'(' is never closed", "close every '(' with ')'")
            self.pos += 1
            atom = inner
        elif ch in SYMBOLS:
            self.pos += 1
            atom = ch
        elif ch == ")":
            raise self.fail(f"unmatched ')' at position {self.pos}", "remove it or add the '('")
        elif ch == "*":
            raise self.fail(f"'*' at position {self.pos} follows nothing", "write X*N after a symbol or ')'")
        else:
            raise self.fail(
                f"unknown symbol {ch!r} at position {self.pos}",
                "use only E (embedding), t (transformer layer), L (loss head), | ( ) * and digits",
            )
        return atom * self.repeat()

    def repeat(self) -> int:
        if self.peek() != "*":
            return 1
        self.pos += 1
        start = self.pos
        while self.peek().isdigit():
            self.pos += 1
        if start == self.pos:
            raise self.fail(f"'*' at position {start - 1} is not followed by a count", "write X*N with N >= 1")
        count = int(self.text[start : self.pos])
        if count < 1:
            raise self.fail(f"repeat count {count} at position {start}", "use a count >= 1")
        return count


def expand(layout: str) -> str:
    """Expand repetitions: `E|t*2|L` -> `E|tt|L`."""
    parser = _Parser(layout)
    flat = parser.sequence()
    if parser.pos != len(parser.text):
        raise parser.fail(f"unmatched ')' at position {parser.pos}", "remove it or add the '('")
    return flat


def parse_layout_string(layout: str, num_layers: int, num_stages: int) -> list[int]:
    """Validate `layout` against the model and return the transformer-layer count per stage."""
    flat = expand(layout)
    if not flat:
        raise _error(layout, "the layout is empty", "write it like 'E|t*3|t*3|L'")
    stages = flat.split("|")
    if len(stages) != num_stages:
        raise _error(
            layout,
            f"has {len(stages)} stages but --pipeline-model-parallel-size is {num_stages}",
            "make the number of '|'-separated stages equal the pipeline size",
        )
    for symbol, where, name in (("E", "first", "embedding"), ("L", "last", "loss head")):
        count = flat.count(symbol)
        if count == 0:
            raise _error(layout, f"'{symbol}' ({name}) is missing", f"put one '{symbol}' {where}")
        if count > 1:
            raise _error(layout, f"'{symbol}' ({name}) appears {count} times", f"keep exactly one '{symbol}'")
    if not flat.startswith("E"):
        raise _error(layout, "'E' is not the first symbol", "the embedding group must start stage 0")
    if not flat.endswith("L"):
        raise _error(layout, "'L' is not the last symbol", "the loss head group must end the last stage")
    empty = [i for i, s in enumerate(stages) if not s]
    if empty:
        raise _error(layout, f"stage {empty[0]} is empty", "give every stage at least one symbol")
    counts = [s.count("t") for s in stages]
    if sum(counts) != num_layers:
        raise _error(
            layout, f"has {sum(counts)} 't' but --num-layers is {num_layers}", "use one 't' per transformer layer"
        )
    return counts
