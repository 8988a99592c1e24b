"""`ChunkedGPTModelPipe`: the GPT pipeline module holding v model chunks per rank (interleaved).

Chunk c of rank r is the layout's flat stage c x P + r (megatron-core's numbering), a contiguous
run of specs, built as `GPTModelPipe` builds its one stage (the same LayerSpecs, per-spec
seeds, spec-indexed module names and checkpoint files). DeepSpeed's `PipelineModule` runs one
range of functions per forward: `activate_chunk(c)` points it at chunk c, as DeepSpeed's own
`DualPipeVModule` does for its two phases. The tied word embedding lives on the rank of flat
stage 0 (rank 0, chunk 0) and of the last flat stage (rank P - 1, chunk v - 1); DeepSpeed ties
the two copies between those ranks as without interleaving.
"""

from __future__ import annotations

from typing import Any

from megatron_ds.model.gpt_pipe import GPTModelPipe


class ChunkedGPTModelPipe(GPTModelPipe):
    """A `GPTModelPipe` over a layout with `virtual_stages` > 1 (module docstring)."""

    def _partition_layers(self, method: str = "megatron_ds.layout") -> None:
        del method  # boundaries come from the layout engine
        layout = self._layout
        self.parts = layout.parts
        self.chunk_bounds = [(self.parts[s], self.parts[s + 1]) for s in layout.rank_stages(self.stage_id)]
        self._set_bounds(*self.chunk_bounds[0])

    def stage_owner(self, layer_idx: int) -> int:
        """The pipeline rank holding spec `layer_idx` (DeepSpeed's tied groups and our checks ask)."""
        return self._layout.rank_of_spec(layer_idx)

    def _build(self) -> None:
        self.chunk_funcs: list[list[Any]] = []
        for start, stop in self.chunk_bounds:
            self._set_bounds(start, stop)
            self.forward_funcs = []
            super()._build()
            self.chunk_funcs.append(self.forward_funcs)
        self.chunk_checkpointable: list[list[bool]] = [[] for _ in self.chunk_bounds]
        self.activate_chunk(0)

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_bounds)

    def activate_chunk(self, chunk: int) -> None:
        """Expose chunk `chunk`'s functions as this module's forward."""
        self.active_chunk = chunk
        self.forward_funcs = self.chunk_funcs[chunk]
        self.is_checkpointable_results = self.chunk_checkpointable[chunk]
        self._set_bounds(*self.chunk_bounds[chunk])

    def _precompute_checkpointable_values(self) -> None:
        for chunk in range(self.num_chunks):
            self.activate_chunk(chunk)
            self.is_checkpointable_results_interval = None  # cached per interval: not across chunks
            super()._precompute_checkpointable_values()
            self.chunk_checkpointable[chunk] = self.is_checkpointable_results
        self.activate_chunk(0)

    def save_state_dict(self, *args: Any, **kwargs: Any) -> None:
        for chunk in range(self.num_chunks):  # per-spec files, as from one stage
            self.activate_chunk(chunk)
            super().save_state_dict(*args, **kwargs)
        self.activate_chunk(0)

    def load_state_dir(self, *args: Any, **kwargs: Any) -> None:
        for chunk in range(self.num_chunks):
            self.activate_chunk(chunk)
            super().load_state_dir(*args, **kwargs)
        self.activate_chunk(0)
