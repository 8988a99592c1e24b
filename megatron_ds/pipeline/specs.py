"""The model's layer specs as the layout engine sees them: names, grouped pre / body / post.

The spec list is always `pre group + N transformer layers + post group`; the model builder
(`megatron_ds.model.naming.gpt_spec_groups`) says which names, this package only places them.
"""

from __future__ import annotations

from dataclasses import dataclass


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

    def layer_of(self, idx: int) -> int | None:
        """The transformer layer (from 0) that spec index `idx` is, None for a pre or post spec."""
        layer = idx - len(self.pre)
        return layer if 0 <= layer < self.num_layers else None

    def group_of(self, idx: int) -> str:
        """`pre`, `body` or `post` for spec index `idx`."""
        if idx < len(self.pre):
            return "pre"
        return "body" if idx < len(self.pre) + self.num_layers else "post"

    def layer_counts(self, parts: list[int]) -> list[int]:
        """Transformer layers inside each spec range of DeepSpeed `parts` (pre/post snap to the ends)."""
        first, last = len(self.pre), len(self.pre) + self.num_layers
        return [max(0, min(b, last) - max(a, first)) for a, b in zip(parts[:-1], parts[1:])]
