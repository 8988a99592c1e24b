"""Pipeline layout: which layer specs each stage holds. Pure logic, no torch.distributed.

The model's spec list is always `pre group + N transformer layers + post group` (see
`megatron_ds.model.naming`). Because the pre group is first and the post group last, and every
stage must hold a layer with parameters, a layout is fully described by the number of transformer
layers on each stage: the pre group sits whole on stage 0, the post group whole on the last stage.
This module is the only place that decides stage boundaries; `GPTModelPipe` takes `parts` from it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_ds.errors import LayoutError
from megatron_ds.pipeline import partition
from megatron_ds.pipeline.layout_string import parse_layout_string


@dataclass(frozen=True)
class SpecGroups:
    """Names of the model's layer specs, grouped: pre-processing, body, post-processing."""

    pre: tuple[str, ...]
    num_layers: int
    post: tuple[str, ...]
    layer_name: str = "TransformerLayer"
    loss_name: str = "cross_entropy_loss"

    @property
    def names(self) -> list[str]:
        """All spec names in spec-index order."""
        return [*self.pre, *([self.layer_name] * self.num_layers), *self.post]

    @property
    def num_specs(self) -> int:
        return len(self.pre) + self.num_layers + len(self.post)

    def group_of(self, idx: int) -> str:
        """`pre`, `body` or `post` for spec index `idx`."""
        if idx < len(self.pre):
            return "pre"
        return "body" if idx < len(self.pre) + self.num_layers else "post"


@dataclass(frozen=True)
class Layout:
    """Stage assignment: `layers_per_stage[i]` transformer layers on stage i; pre on 0, post last."""

    groups: SpecGroups
    layers_per_stage: tuple[int, ...]
    method: str = "type:transformer"

    def __post_init__(self) -> None:
        assert sum(self.layers_per_stage) == self.groups.num_layers, self
        assert all(k >= 0 for k in self.layers_per_stage), self
        p = self.num_stages
        assert all(self.layers_per_stage[i] > 0 for i in range(1, p - 1)), self

    @property
    def num_stages(self) -> int:
        return len(self.layers_per_stage)

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
        stages = []
        for i, k in enumerate(self.layers_per_stage):
            body = "" if k == 0 else ("t" if k == 1 else f"t*{k}")
            stages.append(("E" if i == 0 else "") + body + ("L" if i == self.num_stages - 1 else ""))
        return "|".join(stages)

    def stage_ranks(self, stage: int, data_parallel: int = 1, tensor_parallel: int = 1) -> list[list[int]]:
        """Global ranks of `stage`, one list of tensor ranks per data-parallel replica, in DeepSpeed's
        topology order (tensor innermost, then data, then pipeline; as megatron-core)."""
        per_stage = data_parallel * tensor_parallel
        return [
            [stage * per_stage + d * tensor_parallel + t for t in range(tensor_parallel)] for d in range(data_parallel)
        ]

    def format(self, data_parallel: int = 1, tensor_parallel: int = 1) -> str:
        """The stage table as DeepSpeed prints it, with real names, plus a summary line; with data or
        tensor parallelism, the global ranks that hold each stage."""
        names = self.groups.names
        lines = []
        for s in range(self.num_stages):
            specs = self.stage_specs(s)
            lines.append(f"stage={s} layers={len(specs)}")
            lines.extend(f"    {idx:2d}: {names[idx]}" for idx in specs)
        lines.append(f"  loss: {self.groups.loss_name}")
        counts = " ".join(str(k) for k in self.layers_per_stage)
        lines.append(f"transformer layers per stage: {counts} (layout {self.to_string()}, method {self.method})")
        if data_parallel * tensor_parallel > 1:
            lines.append(
                f"ranks per stage (tensor parallel {tensor_parallel} innermost, then data parallel "
                f"{data_parallel}, then pipeline):"
            )
            for s in range(self.num_stages):
                replicas = " | ".join(
                    f"data {d}: tensor ranks -> {','.join(map(str, r))}"
                    for d, r in enumerate(self.stage_ranks(s, data_parallel, tensor_parallel))
                )
                lines.append(f"  stage {s}: {replicas}")
        return "\n".join(lines)


def build_layout(
    groups: SpecGroups,
    num_stages: int,
    dedicated: str = "none",
    layout: str | None = None,
    partition_method: str | None = None,
    spec_weights: Sequence[float] | None = None,
    memory_inputs: object | None = None,
) -> Layout:
    """Turn the layout options into a `Layout`; at most one of the three options may be set.

    `spec_weights` is one number per spec (parameter counts) for `partition_method='parameters'`;
    `memory_inputs` (a `megatron_ds.estimate.memory_model.MemoryInputs`) is what the `memory` method
    (also `--pp-layout auto`) balances.
    """
    given = [
        f
        for f, v in (
            ("--pp-dedicated-embedding-stages", dedicated != "none"),
            ("--pp-layout", layout is not None),
            ("--pp-partition-method", partition_method is not None),
        )
        if v
    ]
    if len(given) > 1:
        raise LayoutError(f"{' and '.join(given)} were both given; choose one way to place the stage boundaries")
    if num_stages < 1:
        raise LayoutError(f"--pipeline-model-parallel-size must be >= 1, got {num_stages}")
    if groups.num_layers < 1:
        raise LayoutError(f"--num-layers must be >= 1, got {groups.num_layers}")
    if layout is not None and layout.strip().lower() == "auto":
        layout, partition_method = None, "memory"
    if partition_method == "memory":
        from megatron_ds.pipeline.balance import memory_balanced_layout

        assert memory_inputs is not None, "the memory partition needs the memory model's inputs"
        return memory_balanced_layout(groups, num_stages, memory_inputs)
    if layout is not None:
        counts = parse_layout_string(layout, groups.num_layers, num_stages)
        return Layout(groups, tuple(counts), f"layout {layout}")
    if dedicated != "none":
        return Layout(
            groups, tuple(_dedicated_counts(groups.num_layers, num_stages, dedicated)), f"dedicated {dedicated}"
        )
    method = partition_method or "type:transformer"
    weights = _method_weights(groups, method, spec_weights)
    parts = (
        partition.uniform(groups.num_specs, num_stages)
        if method == "uniform"
        else partition.balanced(weights, num_stages)
    )
    return _layout_from_spec_parts(groups, parts, method)


def _dedicated_counts(num_layers: int, num_stages: int, dedicated: str) -> list[int]:
    reserved = {"pre": 1, "post": 1, "both": 2}.get(dedicated)
    if reserved is None:
        raise LayoutError(f"--pp-dedicated-embedding-stages {dedicated!r} is not one of none, pre, post, both")
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
    body = [
        b - a
        for a, b in zip(partition.uniform(num_layers, body_stages)[:-1], partition.uniform(num_layers, body_stages)[1:])
    ]
    return ([0] if dedicated in ("pre", "both") else []) + body + ([0] if dedicated in ("post", "both") else [])


def _method_weights(groups: SpecGroups, method: str, spec_weights: Sequence[float] | None) -> list[float]:
    names = groups.names
    flag = f"--pp-partition-method {method}"
    if method == "uniform":
        return [1.0] * len(names)
    if method == "parameters":
        if spec_weights is None or len(spec_weights) != len(names):
            raise AssertionError("partition method 'parameters' needs one parameter count per spec")
        return [float(w) for w in spec_weights]
    if not method.startswith("type:"):
        raise LayoutError(
            f"{flag} is not a known method; use uniform, parameters, memory, type:REGEX or type:NAME:WEIGHT|NAME:WEIGHT"
        )
    body = method[len("type:") :]
    terms = body.split("|")
    weighted = [re.fullmatch(r"(.+):([-+0-9.eE]+)", t) for t in terms]
    if all(weighted):
        patterns = [(m.group(1), _weight(m.group(2), flag)) for m in weighted]
    else:
        patterns = [(body, 1.0)]
    weights = [0.0] * len(names)
    for pattern, w in patterns:
        try:
            regex = re.compile(pattern, re.IGNORECASE)
        except re.error as e:
            raise LayoutError(f"{flag}: {pattern!r} is not a valid regular expression ({e}); fix the pattern") from None
        hits = [i for i, n in enumerate(names) if regex.search(n)]
        if not hits:
            raise LayoutError(
                f"{flag}: {pattern!r} matches no layer (layers: {', '.join(dict.fromkeys(names))}); "
                f"use one of those names"
            )
        for i in hits:
            if weights[i] == 0.0:
                weights[i] = w
    return weights


def _weight(text: str, flag: str) -> float:
    try:
        w = float(text)
    except ValueError:
        raise LayoutError(f"{flag}: weight {text!r} is not a number; write NAME:WEIGHT with WEIGHT > 0") from None
    if not w > 0:
        raise LayoutError(f"{flag}: weight {text} must be > 0; give every type a positive weight")
    return w


def _layout_from_spec_parts(groups: SpecGroups, parts: Sequence[int], method: str) -> Layout:
    """Count the transformer layers inside each spec range (pre/post snap to the first/last stage)."""
    first, last = len(groups.pre), len(groups.pre) + groups.num_layers
    counts = [max(0, min(b, last) - max(a, first)) for a, b in zip(parts[:-1], parts[1:])]
    empty = [i for i in range(1, len(counts) - 1) if counts[i] == 0]
    if empty:
        raise LayoutError(
            f"--pp-partition-method {method} splits --num-layers {groups.num_layers} over "
            f"--pipeline-model-parallel-size {len(counts)} leaving stage(s) "
            f"{', '.join(map(str, empty))} without a transformer layer; use fewer stages, "
            f"more layers, or --pp-dedicated-embedding-stages"
        )
    return Layout(groups, tuple(counts), method)
