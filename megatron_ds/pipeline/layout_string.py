"""Layout strings in megatron-core's grammar (`--pp-layout`, `--pipeline-model-parallel-layout`).

Symbols: `E` the pre-processing group (embedding), `t` one transformer layer, `L` the
post-processing group (final norm, LM head, loss), `|` a stage boundary. `X*N` repeats a symbol
and `(...)*N` a parenthesised group N >= 0 times, e.g. `E|t*3|t*3|L`, `Et|tt|tL`, `E|(t|)*3L`.
Commas are cosmetic and removed first, as megatron-core's `PipelineParallelLayerLayout` does
(`Et*3|(tt|)*2,t|L`); so is whitespace (megatron-core refuses it).

k x P stages are megatron-core's k virtual stages per rank, run by the interleaved schedule (flat
stage i is chunk i // P of rank i % P). Where megatron-core accepts a string that we refuse, the
reason is our engine's, and the message says so: an empty stage (no parameters: DeepSpeed cannot
build its optimizer),
`m` (a multi-token-prediction layer, not built here), and the one construct megatron-core's
regular expressions expand by accident, a repeat of a repeated group (`(tt)*2*2`, five layers
there). Beyond megatron-core we accept whitespace, nested groups and a group without `*N`.
Where both accept, the stages are the same (tests/unit/test_megatron_lm_layouts.py compares them).
"""

from __future__ import annotations

from megatron_ds.errors import LayoutError

SYMBOLS = "EtL|"
MTP = "m"
"""megatron-core's multi-token-prediction layer symbol: parsed, then refused."""
EXAMPLE = "write it like 'E|t*3|t*3|L'"
_NO_EMPTY_FIX = (
    "give every stage a 't' (the first may hold E alone, the last L alone), or let "
    "--pp-dedicated-embedding-stages or --pp-partition-method memory place the boundaries"
)


def _error(flag: str, layout: str, problem: str, fix: str) -> LayoutError:
    return LayoutError(f"{flag} {layout!r}: {problem}; {fix}")


class _Parser:
    def __init__(self, layout: str, flag: str) -> None:
        self.layout, self.flag = layout, flag
        self.text = "".join(layout.split()).replace(",", "")
        self.pos = 0

    def fail(self, problem: str, fix: str = EXAMPLE) -> LayoutError:
        return _error(self.flag, self.layout, problem, fix)

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def sequence(self, closing: str = "") -> str:
        out = []
        while self.peek() and self.peek() != closing:
            out.append(self.item())
        return "".join(out)

    def item(self) -> str:
        ch, start = self.peek(), self.pos
        if ch == "(":
            self.pos += 1
            atom = self.sequence(closing=")")
            if self.peek() != ")":
                raise self.fail("'(' is never closed", "close every '(' with ')'")
            self.pos += 1
            if self.pos == start + 2:
                raise self.fail(f"empty group '()' at position {start}", "remove it")
        elif ch in SYMBOLS or ch == MTP:  # an 'm' left after expansion is refused by parse_layout_string
            self.pos += 1
            atom = ch
        elif ch == ")":
            raise self.fail(f"unmatched ')' at position {start}", "remove it or add the '('")
        elif ch == "*":
            raise self.fail(f"'*' at position {start} follows nothing", "write X*N after a symbol or ')'")
        else:
            raise self.fail(
                f"unknown symbol {ch!r} at position {start}",
                "use only E (embedding), t (transformer layer), L (loss head), | ( ) * , and digits",
            )
        atom *= self.repeat()
        if self.peek() == "*":
            raise self.fail(
                f"'*' at position {self.pos} repeats a repeat",
                "write one count per symbol or group (megatron-core expands 'X*N*M' inconsistently)",
            )
        return atom

    def repeat(self) -> int:
        if self.peek() != "*":
            return 1
        self.pos += 1
        start = self.pos
        while self.peek().isdigit():
            self.pos += 1
        if start == self.pos:
            raise self.fail(f"'*' at position {start - 1} is not followed by a count", "write X*N with N >= 0")
        return int(self.text[start : self.pos])


def expand(layout: str, flag: str = "--pp-layout") -> str:
    """Expand repetitions and drop commas and whitespace: `E|t*2,|L` -> `E|tt|L`."""
    parser = _Parser(layout, flag)
    flat = parser.sequence()
    if parser.pos != len(parser.text):
        raise parser.fail(f"unmatched ')' at position {parser.pos}", "remove it or add the '('")
    return flat


def count_stages(layout: str, flag: str = "--pp-layout") -> int:
    """The '|'-separated stages of `layout` (megatron-core's `get_num_stages_from_str`): v x P when the
    string gives virtual stages."""
    return len(expand(layout, flag).split("|"))


def format_counts(counts: list[int] | tuple[int, ...]) -> str:
    """The layout string of transformer-layer counts per stage: [1, 3, 0] -> `Et|t*3|L`."""
    stages = []
    for i, k in enumerate(counts):
        body = "" if k == 0 else ("t" if k == 1 else f"t*{k}")
        stages.append(("E" if i == 0 else "") + body + ("L" if i == len(counts) - 1 else ""))
    return "|".join(stages)


def parse_layout_string(
    layout: str, num_layers: int, num_stages: int, flag: str = "--pp-layout", virtual_stages: int = 1
) -> list[int]:
    """Validate `layout` against the model and return the transformer-layer count per (flat) stage:
    `virtual_stages` x `num_stages` of them (megatron-core's flat stage i is chunk i // P of rank i % P).

    The checks run in megatron-core's order (stage count, then E, L and t over all stages), then
    ours (virtual stages, empty stages), so each message names the first thing megatron-core would
    object to, or else the reason our engine cannot run what megatron-core would.
    """
    flat = expand(layout, flag)
    if not flat:
        raise _error(flag, layout, "the layout is empty", EXAMPLE)
    if MTP in flat:
        raise _error(
            flag, layout, "'m' is a multi-token-prediction layer, which is not built here", "drop it (E, t, L only)"
        )
    stages = flat.split("|")
    if len(stages) % num_stages != 0:
        raise _error(
            flag,
            layout,
            f"has {len(stages)} stages, neither --pipeline-model-parallel-size {num_stages} nor a multiple of it",
            f"write {num_stages} '|'-separated stages",
        )
    _check_symbols(flag, layout, flat.replace("|", ""), num_layers)
    counts = [s.count("t") for s in stages]
    if len(stages) != num_stages * virtual_stages:
        raise _error(flag, layout, *_virtual_problem(counts, num_stages, virtual_stages))
    empty = [i for i, s in enumerate(stages) if not s]
    if empty:
        raise _error(
            flag,
            layout,
            f"stage {empty[0]} is empty, and DeepSpeed cannot build an optimizer for a stage without parameters",
            _NO_EMPTY_FIX,
        )
    return counts


def _check_symbols(flag: str, layout: str, symbols: str, num_layers: int) -> None:
    """One E first and one L last over all stages, one t per layer (megatron-core's checks)."""
    for symbol, where, name in (("E", "first", "embedding"), ("L", "last", "loss head")):
        count = symbols.count(symbol)
        if count == 0:
            raise _error(flag, layout, f"'{symbol}' ({name}) is missing", f"put one '{symbol}' {where}")
        if count > 1:
            raise _error(flag, layout, f"'{symbol}' ({name}) appears {count} times", f"keep exactly one '{symbol}'")
    if symbols[0] != "E":
        raise _error(flag, layout, f"'{symbols[0]}' comes before 'E'", "the embedding group must start stage 0")
    if symbols[-1] != "L":
        raise _error(flag, layout, f"'{symbols[-1]}' comes after 'L'", "the loss head group must end the last stage")
    if symbols.count("t") != num_layers:
        raise _error(
            flag,
            layout,
            f"has {symbols.count('t')} 't' but --num-layers is {num_layers}",
            "use one 't' per transformer layer",
        )


def _virtual_problem(counts: list[int], num_stages: int, virtual_stages: int) -> tuple[str, str]:
    """(problem, fix) for k x P stages where the run has another number of chunks per rank."""
    k = len(counts) // num_stages
    problem = (
        f"has {len(counts)} stages, {k} x --pipeline-model-parallel-size {num_stages}: megatron-core's {k} virtual "
        f"stages per rank, but the run has {virtual_stages}"
    )
    return problem, (
        f"run it with {k} virtual stages per rank (--num-virtual-stages-per-pipeline-rank {k}, the interleaved "
        f"schedule), or write {num_stages * virtual_stages} '|'-separated stages"
    )
