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


def max_diff(a: Any, b: Any) -> float:
    """The largest absolute difference of two weights as the scenarios report them (nested lists)."""
    import torch

    return float((torch.tensor(a) - torch.tensor(b)).abs().max())


def model_weights(weights: dict[str, Any]) -> dict[str, Any]:
    """A scenario's reported weights without the optimizer's empty group placeholders (not model weights)."""
    from megatron_ds.training.optimizer import GROUP_PLACEHOLDER_PREFIX

    return {n: v for n, v in weights.items() if not n.startswith(GROUP_PLACEHOLDER_PREFIX)}


def assert_weights_match(ranks: list[dict[str, Any]], ref: dict[str, Any], tol: float, what: str) -> None:
    """Each rank's model weights within `tol` of `ref`'s (by global name), and every one of `ref`'s covered by some
    rank (each pipeline stage reports its own)."""
    seen: set[str] = set()
    for r in ranks:
        for name, value in model_weights(r["weights"]).items():
            assert max_diff(value, ref[name]) <= tol, (what, name)
            seen.add(name)
    assert seen == set(model_weights(ref)), what
