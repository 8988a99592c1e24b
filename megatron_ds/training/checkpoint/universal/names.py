"""Layout-free names of the model's tensors, and where each one lives on a pipeline stage.

A tensor's layout-free name is its spec index, spec name and state-dict key, e.g.
`03.TransformerLayer.qkv.weight` or `01.WordEmbedding.weight`: the same for every P, layout, T
and DP. On a stage, DeepSpeed's `PipelineModule` names it `<spec index>.<key>` (`3.qkv.weight`),
or `tied_modules.word_embeddings.weight` for the tied word embedding, which the first and the
last stage each hold a copy of (one layout-free tensor). `stage_parameters` lists a stage's
parameters in the module's own order, including the optimizer-group placeholders
(`megatron_ds.training.optimizer`), which have no layout-free name: they are zero, with zero
optimizer state, wherever they exist.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_ds.config import ModelConfig
from megatron_ds.model import moe, naming, sharding
from megatron_ds.pipeline.layout import Layout
from megatron_ds.training.optimizer import GROUP_NAMES, GROUP_PLACEHOLDER_PREFIX

TIED_MODULE_NAME = f"tied_modules.{naming.TIED_EMBEDDING_KEY}.weight"
"""DeepSpeed's name of the tied word embedding on the first and last stage."""


@dataclass(frozen=True)
class ModelTensor:
    """One layout-free tensor of the model (full, T=1 shape; padded vocabulary rows included)."""

    name: str
    spec_index: int
    spec: str
    key: str
    rule: sharding.TensorRule

    @property
    def group(self) -> str:
        """The optimizer group: Megatron's rule, no weight decay for 1-D tensors (`training/optimizer.py`)."""
        return GROUP_NAMES[0] if len(self.rule.shape) >= 2 else GROUP_NAMES[1]


@dataclass(frozen=True)
class StageParameter:
    """A parameter as one stage's module holds it."""

    module_name: str
    """Its name in the stage's `named_parameters()`."""
    group: str
    tensor: ModelTensor | None
    """None for an optimizer-group placeholder."""


def tensor_name(spec_index: int, spec: str, key: str) -> str:
    return f"{spec_index:02d}.{spec}.{key}"


def model_tensors(model: ModelConfig) -> list[ModelTensor]:
    """Every layout-free tensor of the model, in spec order; the tied LM head has none of its own. A transformer layer
    with experts holds its MoE layer's tensors (`moe.layer_tensor_rules`: every expert by its global index)."""
    groups = naming.gpt_spec_groups(model)
    experts = model.experts_per_layer
    out = []
    for index, spec in enumerate(groups.names):
        layer = index - len(groups.pre)
        if spec == naming.TRANSFORMER_LAYER and experts[layer] > 1:
            rules = moe.layer_tensor_rules(model, experts[layer])
        else:
            rules = sharding.spec_tensors(model, spec)
        for key, rule in rules.items():
            out.append(ModelTensor(tensor_name(index, spec, key), index, spec, key, rule))
    return out


def module_name(model: ModelConfig, tensor: ModelTensor) -> str:
    """`tensor`'s parameter name in the one-process model (`GPTModel` at P = 1, T = 1): DeepSpeed's one-stage
    `PipelineModule` names, experts by their global index (`moe.global_named_parameters`)."""
    return TIED_MODULE_NAME if _is_tied(model, tensor.spec) else f"{tensor.spec_index}.{tensor.key}"


def _is_tied(model: ModelConfig, spec: str) -> bool:
    tied = not model.untie_embeddings_and_output_weights
    return tied and spec in (naming.WORD_EMBEDDING, naming.TIED_LM_HEAD)


def stage_parameters(model: ModelConfig, layout: Layout, stage: int) -> list[StageParameter]:
    """The parameters of pipeline rank `stage` (all its model chunks with virtual stages) in
    `named_parameters()` order: the placeholders of the groups the rank would leave empty (registered
    on the pipeline module itself, so listed first), the tied embedding (DeepSpeed registers
    `tied_modules` before the numbered layers), then each spec's tensors."""
    tensors = model_tensors(model)
    names = naming.gpt_spec_groups(model).names
    specs = layout.rank_specs(stage)
    out: list[StageParameter] = []
    if any(_is_tied(model, names[i]) for i in specs):
        word = next(t for t in tensors if t.spec == naming.WORD_EMBEDDING)
        out.append(StageParameter(TIED_MODULE_NAME, word.group, word))
    for t in tensors:
        if t.spec_index in specs and not _is_tied(model, t.spec):
            out.append(StageParameter(f"{t.spec_index}.{t.key}", t.group, t))
    present = {p.group for p in out}
    placeholders = [StageParameter(GROUP_PLACEHOLDER_PREFIX + g, g, None) for g in GROUP_NAMES if g not in present]
    return placeholders + out


def optimizer_order(params: list[StageParameter]) -> list[StageParameter]:
    """The parameters in the order a torch optimizer numbers them: group by group (`param_groups`)."""
    return [p for g in GROUP_NAMES for p in params if p.group == g]


def source_stage(model: ModelConfig, layout: Layout, tensor: ModelTensor) -> tuple[int, str]:
    """The pipeline rank a converter reads `tensor` from, and its module name there (the tied embedding:
    the first stage's copy; both copies are identical, DeepSpeed all-reduces their gradients)."""
    if _is_tied(model, tensor.spec):
        return layout.rank_of_spec(tensor.spec_index), TIED_MODULE_NAME
    return layout.rank_of_spec(tensor.spec_index), f"{tensor.spec_index}.{tensor.key}"
