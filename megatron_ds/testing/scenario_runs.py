"""Run `megatron_ds.testing.scenario` on N ranks from a test: write the spec, launch, read every rank's results.

The ranks are forked from one process that imported what they all import (`megatron_ds.testing.zygote`), so
a launch pays torch's, DeepSpeed's and (at T > 1) megatron-core's import once rather than once per rank.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megatron_ds.testing.launch import RankResult, run_ranks
from megatron_ds.testing.zygote import RUN_PRELOAD


def run_scenarios(
    out: Path, world: int, scenarios: list[dict[str, Any]], timeout: float, check: bool = True
) -> list[list[dict[str, Any]]] | list[RankResult]:
    """Run `scenarios` in sequence in one process group of `world` ranks; per rank, the list of its scenario
    results (`OUT/rank<r>.json`). `check=False`: the ranks' exit statuses and output instead, failures included."""
    out.mkdir(parents=True, exist_ok=True)
    spec = out / "spec.json"
    spec.write_text(json.dumps({"scenarios": scenarios}))
    argv = ["-m", "megatron_ds.testing.scenario", str(spec), str(out)]
    results = run_ranks(argv, world, timeout=timeout, check=check, preload=RUN_PRELOAD)
    if not check:
        return results
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def by_name(names: list[str], per_rank: list[list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """Per scenario name (in spec order), every rank's result."""
    return {name: [ranks[i] for ranks in per_rank] for i, name in enumerate(names)}
