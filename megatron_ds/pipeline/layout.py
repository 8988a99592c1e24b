"""Pipeline layout: which layer specs each stage holds, and `build_layout`, the one front door
from the layout options (dedicated stages, a layout string, a partition method, Megatron-LM's
split flags) to a `Layout`.
Pure logic: no torch; the costs a partition method balances come in from the caller.

The model's spec list is always `pre group + N transformer layers + post group` (see
`megatron_ds.model.naming`). Because the pre group is first and the post group last, and every
stage must hold a layer with parameters, a layout is fully described by the number of transformer
layers on each stage: the pre group sits whole on stage 0, the post group whole on the last stage.
This package is the only place that decides stage boundaries; `GPTModelPipe` takes `parts` from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_ds.errors import LayoutError
from megatron_ds.pipeline import megatron_lm, methods, partition
from megatron_ds.pipeline.layout_string import format_counts, parse_layout_string
from megatron_ds.pipeline.megatron_lm import MegatronLMFlags
from megatron_ds.pipeline.methods import DEFAULT_METHOD, Costs
from megatron_ds.pipeline.specs import SpecGroups

__all__ = ["Costs", "Layout", "LayoutError", "MegatronLMFlags", "SpecGroups", "build_layout", "requested_method"]
# Stages each --pp-dedicated-embedding-stages mode holds back (config.DEDICATED_CHOICES, same order).
DEDICATED_RESERVED = {"none": 0, "pre": 1, "post": 1, "both": 2}


@dataclass(frozen=True)
class Layout:
    """Stage assignment: `layers_per_stage[i]` transformer layers on stage i; pre on 0, post last.

    With v `virtual_stages` per rank (the interleaved schedule) the stages are megatron-core's flat
    stages: stage i is model chunk i // P of rank i % P, P = `num_ranks`.
    """

    groups: SpecGroups
    layers_per_stage: tuple[int, ...]
    method: str = DEFAULT_METHOD
    virtual_stages: int = 1

    def __post_init__(self) -> None:
        assert sum(self.layers_per_stage) == self.groups.num_layers, self
        assert all(k >= 0 for k in self.layers_per_stage), self
        p = self.num_stages
        assert all(self.layers_per_stage[i] > 0 for i in range(1, p - 1)), self
        assert self.virtual_stages >= 1 and p % self.virtual_stages == 0, self

    @property
    def num_stages(self) -> int:
        """Stages of the layout (v x P with virtual stages)."""
        return len(self.layers_per_stage)

    @property
    def num_ranks(self) -> int:
        """Pipeline ranks P (the stages without virtual stages)."""
        return self.num_stages // self.virtual_stages

    def rank_of_stage(self, stage: int) -> int:
        return stage % self.num_ranks

    def chunk_of_stage(self, stage: int) -> int:
        return stage // self.num_ranks

    def rank_stages(self, rank: int) -> list[int]:
        """The stages `rank` holds, chunk by chunk."""
        return [c * self.num_ranks + rank for c in range(self.virtual_stages)]

    def rank_specs(self, rank: int) -> list[int]:
        """Spec indices held by `rank` over its chunks, ascending."""
        return [i for s in self.rank_stages(rank) for i in self.stage_specs(s)]

    def rank_of_spec(self, idx: int) -> int:
        return self.rank_of_stage(self.stage_of_spec(idx))

    @property
    def parts(self) -> list[int]:
        """DeepSpeed's `parts`: stage i builds spec indices [parts[i], parts[i+1])."""
        parts = [0]
        offset = len(self.groups.pre)
        for i, k in enumerate(self.layers_per_stage):
            offset += k
            parts.append(offset if i < self.num_stages - 1 else self.groups.num_specs)
        return parts

    def stage_specs(self, stage: int) -> range:
        """Spec indices held by `stage`."""
        parts = self.parts
        return range(parts[stage], parts[stage + 1])

    def stage_of_spec(self, idx: int) -> int:
        for s in range(self.num_stages):
            if idx in self.stage_specs(s):
                return s
        raise AssertionError(f"spec {idx} not owned")

    def dedicated(self) -> str:
        """Which of the first/last stages hold no transformer layer: none/pre/post/both."""
        pre = self.num_stages > 1 and self.layers_per_stage[0] == 0
        post = self.num_stages > 1 and self.layers_per_stage[-1] == 0
        return {(False, False): "none", (True, False): "pre", (False, True): "post"}.get((pre, post), "both")

    def to_string(self) -> str:
        """The layout in Megatron-LM's grammar, e.g. `E|t*3|t*3|L`."""
        return format_counts(self.layers_per_stage)

    def stage_ranks(self, stage: int, data_parallel: int = 1, tensor_parallel: int = 1) -> list[list[int]]:
        """Global ranks of `stage`, one list of tensor ranks per data-parallel replica, in DeepSpeed's
        topology order (tensor innermost, then data, then pipeline; as megatron-core)."""
        per_stage = data_parallel * tensor_parallel
        rank = self.rank_of_stage(stage)
        return [
            [rank * per_stage + d * tensor_parallel + t for t in range(tensor_parallel)] for d in range(data_parallel)
        ]

    def format(self, data_parallel: int = 1, tensor_parallel: int = 1) -> str:
        """The stage table as DeepSpeed prints it, with real names, plus a summary line; with data or
        tensor parallelism, the global ranks that hold each stage."""
        names = self.groups.names
        lines = []
        virtual = self.virtual_stages > 1
        for s in range(self.num_stages):
            specs = self.stage_specs(s)
            where = f" (rank {self.rank_of_stage(s)}, chunk {self.chunk_of_stage(s)})" if virtual else ""
            lines.append(f"stage={s} layers={len(specs)}{where}")
            lines.extend(f"    {idx:2d}: {names[idx]}" for idx in specs)
        lines.append(f"  loss: {self.groups.loss_name}")
        counts = " ".join(str(k) for k in self.layers_per_stage)
        lines.append(f"transformer layers per stage: {counts} (layout {self.to_string()}, method {self.method})")
        if virtual:
            per_rank = " | ".join(
                f"rank {r}: stages {', '.join(map(str, self.rank_stages(r)))} "
                f"({sum(self.layers_per_stage[s] for s in self.rank_stages(r))} layers)"
                for r in range(self.num_ranks)
            )
            lines.append(f"{self.virtual_stages} model chunks (virtual stages) per rank: {per_rank}")
        if data_parallel * tensor_parallel > 1:
            lines.append(
                f"ranks per stage (tensor parallel {tensor_parallel} innermost, then data parallel "
                f"{data_parallel}, then pipeline):"
            )
            lines.extend(
                f"  stage {s}: {self._ranks_line(s, data_parallel, tensor_parallel)}" for s in range(self.num_stages)
            )
        return "\n".join(lines)

    def _ranks_line(self, stage: int, data_parallel: int, tensor_parallel: int) -> str:
        replicas = self.stage_ranks(stage, data_parallel, tensor_parallel)
        if data_parallel * tensor_parallel <= MAX_LISTED_RANKS:
            return " | ".join(f"data {d}: tensor ranks -> {','.join(map(str, r))}" for d, r in enumerate(replicas))
        # Many replicas: every one is the same pattern, so say it once instead of listing them all.
        first, last = replicas[0][0], replicas[-1][-1]
        if tensor_parallel == 1:
            holds = f"rank {first}+d"
        else:
            holds = f"tensor ranks {first}+{tensor_parallel}d .. {first + tensor_parallel - 1}+{tensor_parallel}d"
        return f"global ranks {first}-{last}; data replica d = 0..{data_parallel - 1} holds {holds}"


MAX_LISTED_RANKS = 16
"""Beyond this many ranks per stage the rank table states the pattern instead of listing them (at 8 x 8 the
list was a 600-character line per stage)."""


def requested_method(
    dedicated: str = "none",
    layout: str | None = None,
    partition_method: str | None = None,
    megatron: MegatronLMFlags | None = None,
) -> str | None:
    """The `--pp-partition-method` these options amount to, or None for a dedicated mode, a layout
    string or Megatron-LM's split flags (`--pp-layout auto` is the memory method). LayoutError when
    options of more than one way are given or the method is unknown."""
    ways = [
        flags
        for flags in (
            ["--pp-dedicated-embedding-stages"] if dedicated != "none" else [],
            ["--pp-layout"] if layout is not None else [],
            ["--pp-partition-method"] if partition_method is not None else [],
            *(megatron or MegatronLMFlags()).ways(),
        )
        if flags
    ]
    if len(ways) > 1:
        given = [f for flags in ways for f in flags]
        raise LayoutError(f"{' and '.join(given)} were both given; choose one way to place the stage boundaries")
    alias = methods.from_layout_alias(layout) if layout is not None else None
    if alias is not None:
        return alias.name
    if ways and partition_method is None:
        return None  # a dedicated mode, a layout string or Megatron-LM's split flags
    method = partition_method or DEFAULT_METHOD
    methods.find(method)  # unknown names fail here, before any cost is computed
    return method


def build_layout(
    groups: SpecGroups,
    num_stages: int,
    dedicated: str = "none",
    layout: str | None = None,
    partition_method: str | None = None,
    costs: Costs | None = None,
    megatron: MegatronLMFlags | None = None,
    virtual_stages: int = 1,
) -> Layout:
    """The front door: turn the layout options into a `Layout`; options of at most one way may be set.

    `dedicated` is a `--pp-dedicated-embedding-stages` mode, `layout` a `--pp-layout` string,
    `partition_method` a registry method (`megatron_ds.pipeline.methods`), `megatron` Megatron-LM's
    flags (`megatron_lm`); none of them means the default method. `costs` carries what the
    method's registry entry `needs`. With `virtual_stages` v > 1 the layout has v x `num_stages`
    (flat) stages: every way places them as it places stages (a dedicated embedding stage is flat
    stage 0, a dedicated head stage the last), except the methods that balance per-rank memory or
    time (one stage per rank).
    """
    if virtual_stages > 1:
        return _virtual_layout(groups, num_stages, virtual_stages, dedicated, layout, partition_method, costs, megatron)
    megatron = megatron or MegatronLMFlags()
    method = requested_method(dedicated, layout, partition_method, megatron)
    if num_stages < 1:
        raise LayoutError(f"--pipeline-model-parallel-size must be >= 1, got {num_stages}")
    if groups.num_layers < 1:
        raise LayoutError(f"--num-layers must be >= 1, got {groups.num_layers}")
    n = groups.num_layers
    if method is not None:
        entry, costs = methods.find(method), costs or Costs()
        missing = [name for name in entry.needs if getattr(costs, name) is None]
        assert not missing, f"partition method {entry.name!r} needs {missing} from its caller"
        return Layout(groups, tuple(entry.counts(groups, num_stages, method, costs)), method)
    if layout is not None:
        return Layout(groups, tuple(parse_layout_string(layout, n, num_stages)), f"layout {layout}")
    if megatron.layout is not None:
        counts = parse_layout_string(megatron.layout, n, num_stages, flag=megatron_lm.LAYOUT)
        return Layout(groups, tuple(counts), f"layout {megatron.layout}")
    if megatron.ways():
        counts = megatron_lm.split_counts(megatron, n, num_stages)
        return Layout(groups, tuple(counts), megatron.describe())
    return Layout(groups, tuple(_dedicated_counts(n, num_stages, dedicated)), f"dedicated {dedicated}")


def _virtual_layout(
    groups: SpecGroups,
    num_ranks: int,
    virtual: int,
    dedicated: str,
    layout: str | None,
    partition_method: str | None,
    costs: Costs | None,
    megatron: MegatronLMFlags | None,
) -> Layout:
    """`build_layout` with v > 1 chunks per rank: the same ways over v x P flat stages."""
    megatron = megatron or MegatronLMFlags()
    method = requested_method(dedicated, layout, partition_method, megatron)
    n, flat = groups.num_layers, num_ranks * virtual
    if method is not None:
        entry = methods.find(method)
        if set(entry.needs) - {methods.SPEC_WEIGHTS}:
            raise LayoutError(
                f"--pp-partition-method {method} balances one stage per rank, not {virtual} model chunks per rank; "
                f"with virtual stages give a layout string (--pp-layout), --pp-dedicated-embedding-stages or a "
                f"count-based method (uniform, parameters, type:transformer)"
            )
        return Layout(groups, tuple(entry.counts(groups, flat, method, costs or Costs())), method, virtual)
    text = layout if layout is not None else megatron.layout
    if text is not None:
        flag = "--pp-layout" if layout is not None else megatron_lm.LAYOUT
        counts = parse_layout_string(text, n, num_ranks, flag=flag, virtual_stages=virtual)
        return Layout(groups, tuple(counts), f"layout {text}", virtual)
    if megatron.uneven:
        raise LayoutError(
            f"{' and '.join(megatron.uneven)} with {virtual} virtual stages per rank is not supported here; give the "
            f"stages with a layout string of {flat} stages (--pipeline-model-parallel-layout)"
        )
    if megatron.ways():
        return Layout(groups, tuple(megatron_lm.split_counts(megatron, n, flat)), megatron.describe(), virtual)
    return Layout(groups, tuple(_dedicated_counts(n, flat, dedicated)), f"dedicated {dedicated}", virtual)


def _dedicated_counts(num_layers: int, num_stages: int, dedicated: str) -> list[int]:
    reserved = DEDICATED_RESERVED.get(dedicated)
    if reserved is None:
        raise LayoutError(
            f"--pp-dedicated-embedding-stages {dedicated!r} is not one of {', '.join(DEDICATED_RESERVED)}"
        )
    flag = f"--pp-dedicated-embedding-stages {dedicated}"
    if num_stages < reserved + 1:
        raise LayoutError(
            f"{flag} needs --pipeline-model-parallel-size >= {reserved + 1} (got {num_stages}): "
            f"{reserved} reserved stage(s) plus at least one for the transformer layers; "
            f"raise the pipeline size or drop the flag"
        )
    body_stages = num_stages - reserved
    if body_stages > num_layers:
        raise LayoutError(
            f"{flag} with --pipeline-model-parallel-size {num_stages} leaves {body_stages} stages "
            f"for --num-layers {num_layers}; use at most {num_layers + reserved} stages or more layers"
        )
    parts = partition.uniform(num_layers, body_stages)
    body = [b - a for a, b in zip(parts[:-1], parts[1:])]
    return ([0] if dedicated in ("pre", "both") else []) + body + ([0] if dedicated in ("post", "both") else [])
