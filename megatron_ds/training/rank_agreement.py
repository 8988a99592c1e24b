"""Every rank fails together when a step that reads per-rank files fails on some ranks only.

Ranks read different files: a mixture-of-experts `--kd` teacher's rank its own experts, a resume each rank its
stage's layer files, its experts, its ZeRO partition and RNG state. A damaged file then fails only the rank that
reads it; that rank exits, and the others go on to their next collective and wait there until the launcher (or
the collective timeout, minutes later) tears the job down. `fail_together` closes such a step with one agreement:
every rank contributes ok or failed (one all-reduce of one flag per rank), and when some rank failed, the lowest
failing rank's error travels to all (one broadcast), so every rank raises the same one-line error naming the
file and the rank, and exits at once.

The step inside must run no collective itself (a rank that fails before it would strand the others there): read
first, agree, then do what needs the other ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from megatron_ds.errors import UserError


@contextlib.contextmanager
def fail_together(group: Any = None) -> Iterator[None]:
    """Run the block on every rank of `group` (the world when None), then agree: when the block raised on some
    rank, every rank raises the lowest failing rank's error, its message naming that rank (and the others
    that failed). A `UserError` keeps its class and becomes one line on every rank; any other exception (a bug) is
    re-raised as it is on the rank that raised it, with its traceback, and the others raise a `UserError` naming
    it. Without a process group, or on one rank, the block's error passes through untouched."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        yield
        return
    failure: Exception | None = None
    try:
        yield
    except Exception as err:  # noqa: BLE001 - shared with the other ranks below, then raised
        failure = err
    agreed = agree(failure, group)
    if agreed is None:
        return
    if failure is not None and not isinstance(failure, UserError):
        raise failure  # a bug: its traceback, on the rank where it happened
    raise agreed.error()


@dataclass(frozen=True)
class Failure:
    """What every rank learns when some rank of a group failed (`agree`)."""

    ranks: tuple[int, ...]
    """The global ranks that failed, lowest first."""
    kind: type[UserError] | None
    """The lowest failing rank's error class when it is a user error; None for a bug."""
    message: str
    """That error's message, as one line."""

    def error(self) -> Exception:
        """The error every rank raises: the message naming the lowest failing rank (and the others)."""
        first, others = self.ranks[0], self.ranks[1:]
        also = f"; ranks {', '.join(map(str, others))} failed too" if others else ""
        if self.kind is None:  # a bug on `first`: its traceback is in that rank's output
            return UserError(
                f"{self.message} (on rank {first}{also}, whose output has its traceback; every rank stops)"
            )
        return self.kind(f"{self.message} (on rank {first}{also}; every rank stops)")


def agree(failure: Exception | None, group: Any = None) -> Failure | None:
    """Whether any rank of `group` (the world when None) failed, and the lowest failing rank's error, on every rank
    (None when none did): one all-reduce of a flag per rank, and one broadcast only when some rank failed.
    Collective: every rank of the group calls it."""
    import torch
    import torch.distributed as dist

    device = _device(group)
    size, me = dist.get_world_size(group), dist.get_rank(group)
    failed = torch.zeros(size, dtype=torch.int32, device=device)
    failed[me] = int(failure is not None)
    dist.all_reduce(failed, group=group)  # one flag per rank: who failed
    ranks = [r for r, f in enumerate(failed.tolist()) if f]
    if not ranks:
        return None
    box: list[Any] = [_portable(failure) if me == ranks[0] else None]
    if group is not None:  # named, and broadcast from, by their global ranks
        ranks = [dist.get_global_rank(group, r) for r in ranks]
    first = ranks[0]
    dist.broadcast_object_list(box, src=first, group=group, device=device)
    kind, message = box[0]
    return Failure(tuple(ranks), kind, message)


def _portable(failure: Exception | None) -> tuple[type[UserError] | None, str]:
    """(the error's class when it is a user error, else None; its message as one line)."""
    assert failure is not None
    if isinstance(failure, UserError):
        return type(failure), " ".join(str(failure).split("\n"))
    text = str(failure).strip().splitlines()
    return None, f"{type(failure).__name__}: {text[0] if text else ''}"


def _device(group: Any) -> Any:
    """Where the group's collectives take their tensors: the current GPU for NCCL, else the CPU."""
    import torch
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
