"""Turn would-be hangs into errors: a structural check before the first step, and a watchdog.

Preflight: every rank describes what decides the collectives it will issue (optimizer group
names and sizes, tied-module keys and shapes, parameter dtypes, whether it trains anything); one
`all_gather_object` exchanges these and every rank compares them, so a mismatch stops all ranks
with the same clear error instead of a deadlock deep inside DeepSpeed.

Agreement (`check_run_agreement`, the first collective a build issues): every rank runs the same
pipeline schedule with the same virtual stages, micro-batches, sizes and layout; a rank given
other flags would issue other point-to-point messages and hang its peers. Then the whole config but
file locations (`check_config_agreement`): a replica with another `--lr` or `--seed` would train apart.

Watchdog: `Watchdog.watch(label)` arms a timer around a step; if it does not finish within
`--distributed-timeout-minutes`, the rank prints its rank, stage, the label and every thread's
stack, then exits non-zero (its peers then fail on the broken connection or their own watchdog).
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from megatron_ds.errors import UserError


class PreflightError(UserError):
    """Ranks disagree on something that decides which collectives they issue (a misconfiguration:
    reported as a one-line error like bad flags)."""


def install_stack_dump_handler() -> None:
    """`kill -USR1 <pid>` (used by the test launcher on timeout) prints every thread's stack."""
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)


def signature(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The structural facts about this rank that must agree across ranks."""
    groups = [(g.get("name", f"group{i}"), len(g["params"])) for i, g in enumerate(optimizer.param_groups)]
    tied = getattr(module, "tied_modules", {})
    tied_shapes = {k: [list(_full_shape(p)) for p in m.parameters()] for k, m in tied.items()}
    dtypes = sorted({str(p.dtype) for p in module.parameters()})
    trainable = any(p.requires_grad and _full_shape(p).numel() > 0 for p in module.parameters())
    return {
        "groups": [name for name, _ in groups],
        "group_sizes": [n for _, n in groups],
        "empty_groups": [name for name, n in groups if n == 0],
        "tied": tied_shapes,
        "dtypes": dtypes,
        "trainable": trainable,
    }


def _full_shape(p: torch.Tensor) -> torch.Size:
    """The parameter's shape, also for a ZeRO-3 partition (whose data is this rank's slice)."""
    return getattr(p, "ds_shape", None) or p.shape


def compare(signatures: list[dict[str, Any]], stages: list[int], tied_stages: set[int] | None = None) -> None:
    """Raise PreflightError describing the first disagreement that would deadlock."""
    ref = signatures[0]
    for rank, (sig, stage) in enumerate(zip(signatures, stages)):
        where = f"rank {rank} (stage {stage})"
        if not sig["trainable"]:
            raise PreflightError(
                f"{where} holds no trainable parameter; every stage needs one "
                f"(change the layout so no stage holds only functions)"
            )
        if sig["empty_groups"]:
            raise PreflightError(
                f"{where} has empty optimizer group(s) {sig['empty_groups']}, which DeepSpeed "
                f"drops, so it would issue fewer gradient-norm collectives than its peers"
            )
        if sig["groups"] != ref["groups"]:
            raise PreflightError(
                f"{where} has optimizer groups {sig['groups']} but rank 0 (stage {stages[0]}) has "
                f"{ref['groups']}; every stage must build the same groups or ZeRO's per-group "
                f"norm all-reduces deadlock"
            )
        if sig["dtypes"] != ref["dtypes"]:
            raise PreflightError(
                f"{where} has parameter dtypes {sig['dtypes']} but rank 0 has {ref['dtypes']}; "
                f"activations exchanged between stages would not match"
            )
    _compare_tied(signatures, stages)


def _compare_tied(signatures: list[dict[str, Any]], stages: list[int]) -> None:
    shapes: dict[str, tuple[int, list]] = {}
    for rank, sig in enumerate(signatures):
        for key, shape in sig["tied"].items():
            if key in shapes and shapes[key][1] != shape:
                first = shapes[key][0]
                raise PreflightError(
                    f"tied module {key!r} has shapes {shape} on rank {rank} (stage {stages[rank]}) "
                    f"but {shapes[key][1]} on rank {first} (stage {stages[first]}); the tied "
                    f"gradient all-reduce would fail or hang"
                )
            shapes.setdefault(key, (rank, shape))


def check_structure(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Exchange signatures over all ranks and raise the same PreflightError on every rank."""
    import torch.distributed as dist

    mine = signature(module, optimizer)
    stage = int(getattr(module, "stage_id", 0))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (mine, stage))
    compare([g[0] for g in gathered], [g[1] for g in gathered])


def run_facts(config: Any, layout: Any = None) -> dict[str, Any]:
    """What decides the order of every point-to-point message and collective of a step."""
    par = config.parallel
    return {
        "pipeline schedule": par.pipeline_schedule,
        "virtual stages per rank": par.virtual_stages,
        "micro-batches per step": config.grad_accumulation_steps,
        "pipeline x tensor x data sizes": [
            par.pipeline_model_parallel_size,
            par.tensor_model_parallel_size,
            par.data_parallel_size,
        ],
        "layout": None if layout is None else layout.to_string(),
    }


def compare_run_facts(facts: list[dict[str, Any]]) -> None:
    """Raise PreflightError naming the first rank whose facts differ from rank 0's."""
    for rank, mine in enumerate(facts):
        for key, value in mine.items():
            if value != facts[0][key]:
                raise PreflightError(
                    f"rank {rank} has {key} {value} but rank 0 has {facts[0][key]}; every rank must run the same "
                    f"pipeline schedule on the same layout, or their point-to-point messages deadlock (were the "
                    f"ranks launched with different flags?)"
                )


def check_run_agreement(config: Any, layout: Any = None) -> None:
    """Exchange `run_facts` over all ranks (one all_gather_object) and raise the same PreflightError
    on every rank when they differ; then the same for the rest of the config (`check_config_agreement`)."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, run_facts(config, layout))
    compare_run_facts(gathered)
    check_config_agreement(config)


LOCAL_PATHS = frozenset(
    {
        "data.data_path",
        "data.train_data_path",
        "data.valid_data_path",
        "data.test_data_path",
        "data.data_cache_path",
        "data.tokenizer_model",
        "data.vocab_file",
        "data.merge_file",
        "data.prompt_data",
        "training.offload_nvme_path",
        "training.deepspeed_config",
        "training.kill_switch_file",
        "logging.tensorboard_dir",
        "logging.wandb_save_dir",
    }
)
"""Config fields that may differ between ranks: where a node finds or keeps its files (a copy of the corpus on its
own disk, its NVMe, its logs) is the node's business; what they hold is checked where they are read."""


def _shared(config: Any) -> dict[str, Any]:
    """Every config field but `LOCAL_PATHS`, as `section.field` -> value."""
    return {
        f"{section}.{name}": value
        for section, fields in config.to_dict().items()
        for name, value in fields.items()
        if f"{section}.{name}" not in LOCAL_PATHS
    }


def _digest(fields: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


def check_config_agreement(config: Any) -> None:
    """Every rank was given the same settings. A data-parallel replica launched with another `--lr` or `--seed`
    trains apart silently, and other differences (intervals, lengths) end in mismatched collectives; neither
    upstream checks. One all_gather of a digest; the settings themselves only when the digests differ (every
    rank sees that alike, so every rank takes the same branch)."""
    import torch.distributed as dist

    mine, world = _shared(config), dist.get_world_size()
    digests: list[Any] = [None] * world
    dist.all_gather_object(digests, _digest(mine))
    if len(set(digests)) == 1:
        return
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    raise PreflightError(config_difference(everyone))


def config_difference(settings: list[dict[str, Any]], shown: int = 3) -> str:
    """The line naming the first rank whose settings differ from rank 0's, and how (up to `shown` fields)."""
    rank, other = next((r, s) for r, s in enumerate(settings) if s != settings[0])
    keys = list(settings[0]) + [k for k in other if k not in settings[0]]  # in the config's order
    differ = [k for k in keys if other.get(k) != settings[0].get(k)]
    listed = "; ".join(f"{k} {other.get(k)!r} (rank 0: {settings[0].get(k)!r})" for k in differ[:shown])
    more = f"; and {len(differ) - shown} more" if len(differ) > shown else ""
    return (
        f"rank {rank} was launched with other settings than rank 0: {listed}{more}; give every rank the same flags "
        f"(only file locations may differ between nodes)"
    )


class Watchdog:
    """Per-step timer: a step that outlives `timeout_s` dumps stacks and ends the process."""

    def __init__(self, timeout_s: float, rank: int, stage: int, exit_code: int = 3) -> None:
        self.timeout_s, self.rank, self.stage, self.exit_code = timeout_s, rank, stage, exit_code
        self._timer: threading.Timer | None = None

    def _fire(self, label: str) -> None:
        sys.stderr.write(
            f"[watchdog] rank {self.rank} (stage {self.stage}) stalled for more than "
            f"{self.timeout_s:.0f}s in {label}; stacks follow, exiting with code {self.exit_code}\n"
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(self.exit_code)

    @contextmanager
    def watch(self, label: str) -> Iterator[None]:
        timer = threading.Timer(self.timeout_s, self._fire, args=(label,))
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()
