"""The partition-method registry: one entry per method, and everything that names a method reads it.

Help, docs, errors, the run's cost building and the planner's choices come from
`megatron_ds.pipeline.methods.REGISTRY`; the pipeline package imports nothing above itself.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from megatron_ds.config import DEDICATED_CHOICES, ParallelConfig
from megatron_ds.estimate.layout_costs import method_costs
from megatron_ds.estimate.machine import CPU
from megatron_ds.estimate.memory_inputs import MemoryInputs
from megatron_ds.estimate.run_layout import build_run_layout, run_method, uses_memory_model
from megatron_ds.flags.parser import build_parser, parse_config
from megatron_ds.pipeline import methods
from megatron_ds.pipeline.costs import StageTime
from megatron_ds.pipeline.layout import (
    DEDICATED_RESERVED,
    Costs,
    LayoutError,
    SpecGroups,
    build_layout,
    requested_method,
)
from megatron_ds.pipeline.methods import DEFAULT_METHOD, REGISTRY, PartitionMethod
from megatron_ds.plan import ds_json, inputs, search, zero_options

ROOT = Path(__file__).resolve().parents[2]
PIPELINE = ROOT / "megatron_ds" / "pipeline"
DOCS = ROOT / "docs" / "layouts.md"
MODEL = ["--num-layers", "6", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32"]
GROUPS = SpecGroups(pre=("cast_token_ids", "WordEmbedding", "PositionEmbedding"), num_layers=6, post=("LMHead",))


def spelled(entry: PartitionMethod) -> str:
    """A value of --pp-partition-method that selects `entry` (a family's is the default)."""
    return DEFAULT_METHOD if entry.name.endswith(":") else entry.name


def config(*argv: str):
    return parse_config([*MODEL, "--vocab-size", "1000", "--print-layout", *argv])[0]


def limit_flags(entry: PartitionMethod) -> list[str]:
    """--pp-memory-limit where the method needs it (on CPU there is no device memory to default to)."""
    return ["--pp-memory-limit", "1GiB"] if methods.MEMORY_LIMIT in entry.needs else []


def test_pipeline_imports_nothing_above_it() -> None:
    """Only the standard library (and numpy), megatron_ds.errors, megatron_ds.units and the package
    itself; no import inside a function."""
    for path in sorted(PIPELINE.glob("*.py")):
        tree = ast.parse(path.read_text())
        top = set(map(id, tree.body))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            assert id(node) in top, f"{path.name}:{node.lineno}: imports belong at the top of the module"
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for name in names:
                if name.startswith("megatron_ds"):
                    allowed = name in ("megatron_ds.errors", "megatron_ds.units")
                    assert allowed or name.startswith("megatron_ds.pipeline"), (path.name, name)


def test_importing_the_package_loads_no_torch_and_nothing_above() -> None:
    code = (
        "import sys, megatron_ds.pipeline.layout, megatron_ds.pipeline.methods; "
        "bad = [m for m in sys.modules if m == 'torch' or m.split('.')[:2] in "
        "(['megatron_ds', 'model'], ['megatron_ds', 'estimate'], ['megatron_ds', 'plan'], ['megatron_ds', 'training'])]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_every_entry_is_in_the_help_and_the_docs() -> None:
    action = next(a for a in build_parser()._actions if "--pp-partition-method" in a.option_strings)
    assert action.help.startswith(methods.partition_method_help())  # then "[sets <config field>]"
    docs = DOCS.read_text()
    for entry in REGISTRY.values():
        assert f"{entry.syntax} = {entry.summary}" in action.help
        assert f"| `{entry.syntax.replace('|', chr(92) + '|')}` | {entry.summary}" in docs
        if entry.layout_alias:
            assert f"also --pp-layout {entry.layout_alias}" in action.help
    assert methods.partition_method_help().endswith(f"default {DEFAULT_METHOD}")


def test_docs_table_is_the_generated_one() -> None:
    """Drift check: docs/layouts.md holds exactly what `python -m megatron_ds.pipeline.methods` prints."""
    block = re.search(r"<!-- BEGIN methods table[^\n]*-->\n(.*?)\n<!-- END methods table -->", DOCS.read_text(), re.S)
    assert block is not None, "docs/layouts.md lost its methods table markers"
    assert block.group(1) == methods.markdown_table(), (
        "docs/layouts.md's methods table is stale: replace it with `python -m megatron_ds.pipeline.methods`"
    )
    out = subprocess.run([sys.executable, "-m", "megatron_ds.pipeline.methods"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout == methods.markdown_table() + "\n"


def test_entries_are_well_formed() -> None:
    cost_fields = {f.name for f in fields(Costs)} - {"max_visits"}  # a caller's limit, not a need
    assert set(methods.NEED_DOCS) == cost_fields
    for name, entry in REGISTRY.items():
        assert name == entry.name and entry.summary and "\n" not in entry.summary
        assert set(entry.needs) <= cost_fields
        assert methods.find(spelled(entry)) is entry


@pytest.mark.parametrize(
    "method,weights",
    [
        ("type:transformer", [0, 0, 0, 1, 1, 1, 1, 1, 1, 0]),
        ("type:TRANSFORMER", [0, 0, 0, 1, 1, 1, 1, 1, 1, 0]),
        ("type:embedding|head", [0, 1, 1, 0, 0, 0, 0, 0, 0, 1]),  # a regex alternation, not weights
        ("type:embedding:2|transformer:1", [0, 2, 2, 1, 1, 1, 1, 1, 1, 0]),
        ("type:Word:3|embedding:2|layer:1.5|head:1", [0, 3, 2, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1]),
    ],
)
def test_type_family(method: str, weights: list[float]) -> None:
    assert methods.find(method) is REGISTRY["type:"]
    assert methods.type_weights(GROUPS.names, method) == weights
    layout = build_layout(GROUPS, 2, partition_method=method)
    assert layout.method == method and sum(layout.layers_per_stage) == 6


def test_default_is_the_type_family_entry() -> None:
    assert requested_method() == DEFAULT_METHOD
    assert build_layout(GROUPS, 3) == build_layout(GROUPS, 3, partition_method=DEFAULT_METHOD)
    assert build_layout(GROUPS, 3).method == DEFAULT_METHOD


@pytest.mark.parametrize("bad", ["balanced", "Memory", "uniform ", "types:transformer", "auto"])
def test_unknown_names_are_one_line_naming_the_flag_and_every_method(bad: str) -> None:
    with pytest.raises(LayoutError) as err:
        build_layout(GROUPS, 3, partition_method=bad)
    msg = str(err.value)
    assert msg.startswith(f"--pp-partition-method {bad} is not a known method; use ") and "\n" not in msg
    assert all(entry.syntax in msg for entry in REGISTRY.values())


def test_layout_alias_and_requested_method() -> None:
    assert requested_method(layout="auto") == "memory" and requested_method(layout=" AUTO ") == "memory"
    assert requested_method(layout="E|t*6|L") is None
    assert requested_method(dedicated="both") is None
    assert requested_method(partition_method="type:x") == "type:x"
    for kwargs in (dict(layout="auto", partition_method="memory"), dict(dedicated="pre", layout="auto")):
        with pytest.raises(LayoutError, match="were both given"):
            requested_method(**kwargs)
    with pytest.raises(LayoutError, match="not a known method"):
        requested_method(partition_method="nope")


def test_costs_are_built_from_needs_only() -> None:
    model = config().model
    calls = []

    def memory_inputs() -> MemoryInputs:
        calls.append(1)
        return MemoryInputs(model=model, micro_batch_size=1, num_micro_batches=4)

    def limit() -> float:
        calls.append("limit")
        return 2.0**30

    def measured():
        calls.append("measured")
        return lambda s, k: StageTime(1.0, 2.0)

    for entry in REGISTRY.values():
        costs = method_costs(entry, model, 3, memory_inputs, memory_limit=limit, measured_time=measured)
        for f in (f for f in fields(Costs) if f.name in methods.NEED_DOCS):
            assert (getattr(costs, f.name) is not None) == (f.name in entry.needs), (entry.name, f.name)
    assert calls.count(1) == sum(e.needs_stage_memory for e in REGISTRY.values())
    assert calls.count("limit") == sum(methods.MEMORY_LIMIT in e.needs for e in REGISTRY.values())
    assert calls.count("measured") == sum(methods.MEASURED_STAGE_TIME in e.needs for e in REGISTRY.values())
    stage_cost = method_costs(REGISTRY["memory"], model, 3, memory_inputs).stage_memory
    assert stage_cost(0, 2) < stage_cost(0, 3)  # bytes grow with layers on a stage
    with pytest.raises(AssertionError, match="needs"):
        build_layout(GROUPS, 3, partition_method="memory")  # a caller that forgot the costs is a bug


@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_method_runs_from_the_command_line(name: str) -> None:
    entry = REGISTRY[name]
    cfg = config("--pipeline-model-parallel-size", "3", "--pp-partition-method", spelled(entry), *limit_flags(entry))
    layout = build_run_layout(cfg, CPU)
    assert layout.method == spelled(entry) and sum(layout.layers_per_stage) == 6
    assert run_method(cfg) is entry and uses_memory_model(cfg) == entry.needs_stage_memory


def test_auto_is_the_memory_method_for_a_run() -> None:
    auto = config("--pipeline-model-parallel-size", "4", "--pp-layout", "auto")
    memory = config("--pipeline-model-parallel-size", "4", "--pp-partition-method", "memory")
    assert uses_memory_model(auto) and build_run_layout(auto, CPU) == build_run_layout(memory, CPU)
    assert not uses_memory_model(config("--pipeline-model-parallel-size", "4", "--pp-layout", "E|t*3|t*3|L"))


def test_a_new_method_is_one_registry_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry alone makes a method usable: front door, help, table, errors, run costs."""

    def front_heavy(groups: SpecGroups, num_stages: int, method: str, costs: Costs) -> list[int]:
        return [groups.num_layers - (num_stages - 1), *[1] * (num_stages - 1)]

    entry = PartitionMethod("front-heavy", "front-heavy", "all but one layer per stage on stage 0", front_heavy)
    monkeypatch.setitem(REGISTRY, entry.name, entry)
    assert build_layout(GROUPS, 3, partition_method="front-heavy").layers_per_stage == (4, 1, 1)
    assert "front-heavy = all but one layer" in methods.partition_method_help()
    assert "| `front-heavy` |" in methods.markdown_table()
    with pytest.raises(LayoutError, match="front-heavy"):
        methods.find("nope")
    cfg = config("--pipeline-model-parallel-size", "3", "--pp-partition-method", "front-heavy")
    assert build_run_layout(cfg, CPU).to_string() == "Et*4|t|tL"


def test_planner_choices_come_from_the_registry() -> None:
    planned = methods.planned_methods()
    assert planned == ("memory", "fastest")
    assert inputs.CHOICES["layout"] == (*DEDICATED_CHOICES, *planned)
    assert sorted(search.METHODS) == sorted(inputs.CHOICES["layout"])
    assert tuple(DEDICATED_RESERVED) == DEDICATED_CHOICES
    assert search.layout_options("none") == {}
    assert search.layout_options("both") == {"dedicated": "both"}
    assert search.layout_options("memory") == {"partition_method": "memory"}


def test_planned_partition_method_is_passed_as_its_layout_string() -> None:
    raw = inputs.PlanInputs(model="350m", num_gpus=4, gpu="A100-80GB", layout="memory", pipeline_model_parallel_size=4)
    res = inputs.resolve(raw)
    cand = zero_options.choose(res, "bf16")
    assert cand.method == "memory"
    par = ds_json.plan_config(res, cand).parallel
    assert par == ParallelConfig(
        pipeline_model_parallel_size=4,
        tensor_model_parallel_size=cand.tp,
        pipeline_schedule=cand.inputs.schedule,  # the fastest schedule's
        virtual_stages=cand.virtual_stages,
        world_size=4 * cand.tp * cand.dp,
        pp_layout=cand.layout.to_string(),
    )
    assert search.layout_flag("memory", cand.layout) == f"--pp-layout '{cand.layout.to_string()}'"
    assert search.layout_flag("pre", cand.layout) == "--pp-dedicated-embedding-stages pre"


@pytest.mark.parametrize("text,num_stages", [("E|t*3|t*3|L", 4), ("Et|tt|ttt|L", 4), ("E|(t*2|)*3L", 5)])
def test_docs_layout_string_examples(text: str, num_stages: int) -> None:
    assert f"`{text}`" in DOCS.read_text()
    assert sum(build_layout(GROUPS, num_stages, layout=text).layers_per_stage) == 6
