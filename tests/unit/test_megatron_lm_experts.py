"""A Megatron-LM mixture-of-experts checkpoint's experts as our tensors: one expert of one layer read from the
torch_dist chunks that hold it (the tensor stacked [layers, experts, ...]), and the `torch` format's files of each
expert-parallel rank seen as one model whose experts have their global index."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron_ds.interop.megatron_lm_experts import global_experts
from megatron_ds.interop.megatron_lm_files import DistTensors
from megatron_ds.training.checkpoint.directory import CheckpointError

KEY = "decoder.layers.mlp.experts.experts.linear_fc1.weight"


def _stacked(tmp_path: Path, full: torch.Tensor, skip: tuple[int, ...] | None = None) -> tuple[DistTensors, list]:
    """`full` [layers, experts, rows, hidden] stored as megatron-core saves it at expert-parallel size 2 with SwiGLU:
    a chunk per layer, expert-parallel rank (2 experts) and half of the rows (gate, up); `skip`: a chunk left out.
    Served from memory (torch's one-process save writes one chunk); the chunks read are recorded."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata

    dcp.save({"other": torch.zeros(1)}, checkpoint_id=str(tmp_path), no_dist=True)
    dist = DistTensors(str(tmp_path))
    layers, experts, rows, hidden = full.shape
    sizes = (1, experts // 2, rows // 2, hidden)
    offsets = [(n, e, r, 0) for n in range(layers) for e in (0, experts // 2) for r in (0, rows // 2)]
    offsets = [o for o in offsets if o != skip]
    chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(sizes)) for o in offsets]
    dist.tensors[KEY] = TensorStorageMetadata(TensorProperties(dtype=full.dtype), full.shape, chunks)
    read: list[tuple[int, ...]] = []

    def chunk(key: str, o: tuple[int, ...], s: tuple[int, ...]) -> torch.Tensor:
        assert key == KEY and tuple(s) == sizes
        read.append(tuple(o))
        return full[tuple(slice(a, a + n) for a, n in zip(o, s))].clone()

    dist.chunk = chunk  # type: ignore[method-assign]
    return dist, read


def test_one_expert_of_one_layer_is_read_from_the_chunks_that_hold_it(tmp_path: Path) -> None:
    full = torch.randn(3, 4, 6, 5, generator=torch.Generator().manual_seed(0))
    dist, read = _stacked(tmp_path, full)
    assert torch.equal(dist.read(KEY, 2, 3), full[2, 3])
    assert read == [(2, 2, 0, 0), (2, 2, 3, 0)]  # its rank's gate and up halves of that layer, nothing else
    assert torch.equal(dist.read(KEY, 1), full[1]) and torch.equal(dist.read(KEY), full)


def test_an_expert_whose_chunk_is_missing_is_named(tmp_path: Path) -> None:
    full = torch.randn(2, 4, 6, 5)
    dist, _ = _stacked(tmp_path, full, skip=(1, 0, 3, 0))
    assert torch.equal(dist.read(KEY, 1, 2), full[1, 2])  # another rank's expert: whole
    with pytest.raises(CheckpointError, match=rf"{KEY}\[1\]\[0\] has 15 of its 30 elements .* it is incomplete$"):
        dist.read(KEY, 1, 0)


def _rank(rank: int, local: int = 2) -> dict[str, torch.Tensor]:
    """A rank's state dict: a replicated tensor and each layer's local experts (values: rank x 10 + local index)."""
    out = {"decoder.final_layernorm.weight": torch.ones(2)}
    for layer in (0, 1):
        for e in range(local):
            out[f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.linear_fc1.weight"] = torch.tensor(
                10.0 * rank + e
            )
        out[f"decoder.layers.{layer}.mlp.router.weight"] = torch.zeros(2 * local, 2)
    return out


def test_each_expert_parallel_ranks_experts_take_their_global_index() -> None:
    merged = global_experts([_rank(0), _rank(1)], "/ckpt/mp_rank_00_000/model_optim_rng.pt")
    experts = {k: float(v) for k, v in merged.items() if "local_experts" in k}
    assert experts == {
        f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.linear_fc1.weight": [0.0, 1.0, 10.0, 11.0][e]
        for layer in (0, 1)
        for e in range(4)
    }
    assert set(merged) - set(experts) == {
        "decoder.final_layernorm.weight",
        *(f"decoder.layers.{i}.mlp.router.weight" for i in (0, 1)),
    }
    plain = _rank(0)
    assert global_experts([plain], "f") is plain  # expert-parallel size 1: the file as it is


def test_ranks_that_hold_different_numbers_of_experts_are_refused() -> None:
    with pytest.raises(CheckpointError, match=r"^f: expert-parallel rank 1's file holds local experts \[0\]; "):
        global_experts([_rank(0), _rank(1, local=1)], "f")


def test_grouped_gemm_experts_in_torch_format_are_one_line(tmp_path: Path) -> None:
    """GroupedMLP's `weight1` (all local experts in one tensor) is read from torch_dist only, where megatron-core
    saves it under SequentialMLP's names; in a `torch` file it is refused naming the tensor and the fix."""
    from megatron_ds.interop.megatron_lm_files import MegatronLMCheckpoint, RankTensors

    args = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "expert_model_parallel_size": 1}
    ckpt = MegatronLMCheckpoint(str(tmp_path), 5, "torch", args, {})
    (tmp_path / "mp_rank_00").mkdir()
    model = {"decoder.layers.0.mlp.experts.weight1": torch.zeros(4, 8), "decoder.final_layernorm.weight": torch.ones(4)}
    torch.save({"model": model}, tmp_path / "mp_rank_00" / "model_optim_rng.pt")
    with pytest.raises(CheckpointError) as err:
        RankTensors(ckpt)
    assert str(err.value) == (
        f"{tmp_path}/mp_rank_00/model_optim_rng.pt: its experts are stored as one grouped-GEMM tensor "
        "(decoder.layers.0.mlp.experts.weight1: --moe-grouped-gemm), which is read here only from --ckpt-format "
        "torch_dist; load it in Megatron-LM and save it with --ckpt-format torch_dist"
    )
