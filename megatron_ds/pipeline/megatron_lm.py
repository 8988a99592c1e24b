"""Megatron-LM's pipeline-split flags, with megatron-core's meaning (`MegatronLMFlags`, `split_counts`).

    --decoder-first-pipeline-num-layers F   F transformer layers on the first stage
    --decoder-last-pipeline-num-layers L    L on the last stage; the layers left over split evenly
                                            over the stages in between
    --account-for-embedding-in-pipeline-split  the embedding counts as a layer in an even split
    --account-for-loss-in-pipeline-split       the loss head counts as a layer in an even split
    --pipeline-model-parallel-layout S      a layout string (`layout_string`)
    --num-virtual-stages-per-pipeline-rank  V model chunks per rank (`flags/schedule_flags.py`)

The stage counts and the accept/refuse decision are megatron-core's (`TransformerConfig` and
`get_num_layers_to_build`; tests/unit/test_megatron_lm_layouts.py compares them over layers 1..24
and P 2..8), except where megatron-core is wrong: it accepts first + last counts above
--num-layers when they leave a negative multiple of the middle stages (4 layers, P=3, first and
last 3: middle stage -2), and at P=1 it builds only the last count. Both are refused here.
Pure: no torch, no process groups.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_ds.errors import LayoutError

FIRST = "--decoder-first-pipeline-num-layers"
LAST = "--decoder-last-pipeline-num-layers"
ACCOUNT_EMBEDDING = "--account-for-embedding-in-pipeline-split"
ACCOUNT_LOSS = "--account-for-loss-in-pipeline-split"
LAYOUT = "--pipeline-model-parallel-layout"
VIRTUAL = "--num-virtual-stages-per-pipeline-rank"
_SUPPORTED = (
    "give uneven stages with --pp-layout, --decoder-first/last-pipeline-num-layers or --pp-partition-method memory"
)


@dataclass(frozen=True)
class MegatronLMFlags:
    """Megatron-LM's layout flags as given (None / False: not given)."""

    layout: str | None = None
    """--pipeline-model-parallel-layout."""
    first_stage_layers: int | None = None
    """--decoder-first-pipeline-num-layers."""
    last_stage_layers: int | None = None
    """--decoder-last-pipeline-num-layers."""
    account_for_embedding: bool = False
    """--account-for-embedding-in-pipeline-split."""
    account_for_loss: bool = False
    """--account-for-loss-in-pipeline-split."""

    @property
    def uneven(self) -> list[str]:
        """The first/last-stage flags given (one way to place the boundaries)."""
        return [f for f, v in ((FIRST, self.first_stage_layers), (LAST, self.last_stage_layers)) if v is not None]

    @property
    def accounting(self) -> list[str]:
        """The account-for flags given (another way)."""
        return [
            f
            for f, on in ((ACCOUNT_EMBEDDING, self.account_for_embedding), (ACCOUNT_LOSS, self.account_for_loss))
            if on
        ]

    def ways(self) -> list[list[str]]:
        """The flags given, one list per way of placing the boundaries (layout, first/last, account-for)."""
        return [flags for flags in ([LAYOUT] if self.layout is not None else [], self.uneven, self.accounting) if flags]

    def describe(self) -> str:
        """The split flags as given, e.g. `--decoder-first-pipeline-num-layers 3` (the layout's method)."""
        values = {FIRST: self.first_stage_layers, LAST: self.last_stage_layers}
        return " ".join([*(f"{f} {values[f]}" for f in self.uneven), *self.accounting])


def split_counts(flags: MegatronLMFlags, num_layers: int, num_stages: int) -> list[int]:
    """Transformer layers per stage for the first/last or the account-for flags (one of the two)."""
    assert bool(flags.uneven) != bool(flags.accounting), flags  # build_layout allows exactly one way
    if flags.uneven:
        return _uneven(flags.first_stage_layers, flags.last_stage_layers, num_layers, num_stages)
    return _accounted(flags.account_for_embedding, flags.account_for_loss, num_layers, num_stages)


def _uneven(first: int | None, last: int | None, num_layers: int, num_stages: int) -> list[int]:
    given = {f: v for f, v in ((FIRST, first), (LAST, last)) if v is not None}
    for flag, value in given.items():
        if value < 1:
            raise LayoutError(f"{flag} {value} must be >= 1; drop it to split the layers evenly")
    named = " + ".join(f"{f} {v}" for f, v in given.items())
    if num_stages == 1:
        wrong = [f for f, v in given.items() if v != num_layers]
        if wrong:
            raise LayoutError(
                f"{named} with --pipeline-model-parallel-size 1: the only stage is both first and last and holds "
                f"all --num-layers {num_layers}; drop {' and '.join(wrong)}"
            )
        return [num_layers]
    ends = sum(given.values())
    middle_stages, middle = num_stages - len(given), num_layers - ends
    if middle < 0:  # megatron-core accepts this when it divides, with negative middle stages
        raise LayoutError(
            f"{named} = {ends} exceeds --num-layers {num_layers}; give the end stages at most {num_layers} layers"
        )
    if middle_stages == 0 and middle > 0:
        raise LayoutError(
            f"{named} leaves {middle} of --num-layers {num_layers} layers but there is no middle stage at "
            f"--pipeline-model-parallel-size {num_stages}; make them add up to {num_layers}"
        )
    if middle_stages > 0 and (middle == 0 or middle % middle_stages != 0):
        raise LayoutError(
            f"{named} leaves {middle} of --num-layers {num_layers} layers for {middle_stages} middle stage(s), "
            f"which megatron-core splits evenly and at least one per stage; leave a positive multiple of "
            f"{middle_stages}{_nearest(given, num_layers, middle_stages)}, or write the layout with --pp-layout"
        )
    per = middle // middle_stages if middle_stages else 0
    counts = [per] * num_stages
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def _nearest(given: dict[str, int], num_layers: int, middle_stages: int) -> str:
    """` (e.g. FLAG V)`: the smallest change of one given flag that splits the middle evenly."""
    options = []
    for flag, value in given.items():
        other = sum(given.values()) - value
        for v in range(1, num_layers):
            left = num_layers - v - other
            if left > 0 and left % middle_stages == 0:
                options.append((abs(v - value), flag, v))
    return f" (e.g. {min(options)[1]} {min(options)[2]})" if options else ""


def _accounted(embedding: bool, loss: bool, num_layers: int, num_stages: int) -> list[int]:
    total = num_layers + embedding + loss
    if total % num_stages != 0:
        counted = " and ".join(f for f, on in ((ACCOUNT_EMBEDDING, embedding), (ACCOUNT_LOSS, loss)) if on)
        raise LayoutError(
            f"--num-layers {num_layers} + {int(embedding) + int(loss)} counted by {counted} = {total} is not "
            f"divisible by --pipeline-model-parallel-size {num_stages}, as megatron-core requires; choose sizes "
            f"where it divides, or write the layout with --pp-layout"
        )
    per = total // num_stages
    counts = [per] * num_stages
    counts[0] -= embedding
    counts[-1] -= loss
    return counts
