"""GPT as DeepSpeed pipeline layer specs, in three named groups, and `GPTModelPipe`.

    pre  : cast_token_ids, WordEmbedding (tied), PositionEmbedding (+ dropout) or, without a
           learned position embedding, EmbeddingDropout
    body : TransformerLayer x N
    post : FinalNorm, WordEmbedding.lm_head_logits (tied) or LMHead, logits_to_fp32
    loss : cross_entropy_loss

At T > 1 the word embedding, LM head and loss are their vocabulary-parallel forms from
`megatron_ds.model.tensor_parallel_layers` (same spec names, so layouts do not change) and the
transformer layers shard themselves; see `megatron_ds.model.tensor_parallel.TensorParallel`.

Stage boundaries come from `megatron_ds.pipeline.layout`, never from DeepSpeed's partitioner.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology, ProcessTopology

from megatron_ds.config import Config, ModelConfig, RegularizationConfig
from megatron_ds.model import naming, rng
from megatron_ds.model.init import spec_seed
from megatron_ds.model.layers import (
    EmbeddingDropout,
    FinalNorm,
    LMHead,
    PositionEmbedding,
    WordEmbedding,
    cast_token_ids,
    cross_entropy_loss,
    lm_head_logits,
    logits_to_fp32,
)
from megatron_ds.model.tensor_parallel import NO_TENSOR_PARALLEL, TensorParallel, reduce_partial_gradients
from megatron_ds.model.tensor_parallel_rank import NO_ULYSSES, UlyssesGroup
from megatron_ds.model.transformer import TransformerLayer
from megatron_ds.pipeline.layout import Layout

Spec = LayerSpec | Callable[..., Any]


def spec_name(spec: Spec) -> str:
    """The printable name of a spec: class name, function name, or `Class.forward_fn`.

    A class may name the role it plays with `SPEC_NAME` (the tensor-parallel forms do).
    """
    if isinstance(spec, TiedLayerSpec) and spec.forward_fn is not None:
        return f"{_class_name(spec.typename)}.{spec.forward_fn.__name__}"
    if isinstance(spec, LayerSpec):
        return _class_name(spec.typename)
    return spec.__name__


def _class_name(cls: type) -> str:
    return getattr(cls, "SPEC_NAME", cls.__name__)


def build_layer_specs(
    model: ModelConfig,
    regularization: RegularizationConfig,
    seed: int,
    tp: TensorParallel = NO_TENSOR_PARALLEL,
    ulysses: UlyssesGroup = NO_ULYSSES,
    selective_recompute: bool = False,
    document_mask: bool = False,
    expert_parallel_size: int = 1,
    carry_moe_loss: bool = False,
) -> list[Spec]:
    """The full spec list (the same for every layout; only the stage boundaries move). `document_mask`
    (`--reset-attention-mask`): the transformer layers attend within each packed document. The layers with experts
    (`ModelConfig.experts_per_layer`) hold DeepSpeed's MoE layer, its experts shared out over `expert_parallel_size`
    ranks. `carry_moe_loss` (a MoE model on the pipeline engine): the layers pass the aggregated load-balancing loss on
    to the final norm (`megatron_ds.model.moe_loss`)."""
    reg = regularization
    groups = naming.gpt_spec_groups(model)
    embedding_idx = groups.pre.index(naming.WORD_EMBEDDING)
    tied_seed = spec_seed(seed, embedding_idx)  # both tied copies start from the same draw

    first_layer = len(groups.pre)
    first_post = first_layer + model.num_layers

    def seeded(name: str, layer: int = 0) -> int:
        """The init seed of the spec `name` (the `layer`-th of the body), from its index."""
        if name == naming.TRANSFORMER_LAYER:
            return spec_seed(seed, first_layer + layer)
        index = groups.pre.index(name) if name in groups.pre else first_post + groups.post.index(name)
        return spec_seed(seed, index)

    if tp.size == 1:
        embedding, head_fn, untied_head, extra = WordEmbedding, lm_head_logits, LMHead, ()
    else:
        from megatron_ds.model import tensor_parallel_layers as tpl

        embedding, head_fn = tpl.VocabParallelWordEmbedding, tpl.VocabParallelWordEmbedding.lm_head_logits
        untied_head, extra = tpl.VocabParallelLMHead, (tp,)
    untied = model.untie_embeddings_and_output_weights
    # An untied head leaves the word embedding a plain spec: no tied module, no tied group.
    word: Spec = (
        LayerSpec(embedding, model, reg, tied_seed, *extra)
        if untied
        else TiedLayerSpec(naming.TIED_EMBEDDING_KEY, embedding, model, reg, tied_seed, *extra)
    )
    position, position_name = (
        (PositionEmbedding, naming.POSITION_EMBEDDING)
        if model.add_position_embedding
        else (EmbeddingDropout, naming.EMBEDDING_DROPOUT)
    )
    pre: list[Spec] = [cast_token_ids, word, LayerSpec(position, model, reg, seeded(position_name), tp, ulysses)]
    body: list[Spec] = [
        LayerSpec(
            TransformerLayer,
            model,
            reg,
            seeded(naming.TRANSFORMER_LAYER, i),
            tp,
            ulysses,
            selective_recompute,
            document_mask,
            experts,
            expert_parallel_size,
            window,
            (carry_moe_loss and i > 0, carry_moe_loss),
        )
        for i, (experts, window) in enumerate(zip(model.experts_per_layer, model.layer_windows))
    ]
    if untied:
        head: Spec = LayerSpec(untied_head, model, reg, seeded(naming.UNTIED_LM_HEAD), *extra)
    else:
        head = TiedLayerSpec(naming.TIED_EMBEDDING_KEY, embedding, model, reg, tied_seed, *extra, forward_fn=head_fn)
    post: list[Spec] = [
        LayerSpec(FinalNorm, model, seeded(naming.FINAL_NORM), tp, carry_moe_loss),
        head,
        logits_to_fp32,
    ]
    specs = pre + body + post
    assert [spec_name(s) for s in specs] == groups.names, ([spec_name(s) for s in specs], groups.names)
    return specs


def loss_function(tp: TensorParallel, ulysses: UlyssesGroup = NO_ULYSSES) -> Callable[..., torch.Tensor]:
    """`cross_entropy_loss`, or its vocabulary-parallel form at T > 1 (sequence-first logits under sequence
    parallelism), or under Ulysses the whole sequence's loss from this rank's part (same loss-mask rule)."""
    if ulysses.size > 1:
        from megatron_ds.model.ulysses import sequence_loss

        return functools.partial(sequence_loss, ulysses)
    if tp.size == 1:
        return cross_entropy_loss
    from megatron_ds.model import tensor_parallel_layers as tpl

    return tpl.sequence_first_cross_entropy_loss if tp.sequence_parallel else tpl.vocab_parallel_cross_entropy_loss


def build_topology(config: Config) -> ProcessTopology:
    """DeepSpeed's topology: tensor innermost, then data, then pipeline (as megatron-core). Under Ulysses
    the data axis holds DP x N ranks, the N of a sequence consecutive (`megatron_ds.model.ulysses`)."""
    par = config.parallel
    return PipeModelDataParallelTopology(
        num_pp=par.pipeline_model_parallel_size,
        num_mp=par.tensor_model_parallel_size,
        num_dp=par.data_parallel_size * par.ds_sequence_parallel_size,
    )


class GPTModelPipe(PipelineModule):
    """A GPT whose stage boundaries are `layout.parts`; needs torch.distributed initialised.

    At T > 1 pass the `TensorParallel` from `megatron_ds.model.tensor_parallel.setup` (run after
    torch.distributed and before this) and the topology it was checked against.
    """

    def __init__(
        self,
        config: Config,
        layout: Layout,
        topology: ProcessTopology | None = None,
        tp: TensorParallel = NO_TENSOR_PARALLEL,
    ) -> None:
        assert layout.num_ranks == config.parallel.pipeline_model_parallel_size, layout
        assert layout.virtual_stages == config.parallel.virtual_stages, (layout, config.parallel)
        assert tp.size == config.parallel.tensor_model_parallel_size, (tp, config.parallel)
        self._layout = layout
        self.tensor_parallel = tp
        train = config.training
        rng.reset_streams()  # this model's dropout streams start from their seeds
        is_moe = config.model.is_moe
        lm_loss = loss_function(tp)
        super().__init__(
            layers=build_layer_specs(
                config.model,
                config.regularization,
                train.seed,
                tp,
                selective_recompute=train.selective_recompute,
                document_mask=config.data.reset_attention_mask,
                expert_parallel_size=config.parallel.expert_parallel_size,
                carry_moe_loss=is_moe,
            ),
            topology=topology or build_topology(config),
            loss_fn=functools.partial(_loss_with_moe, self, lm_loss) if is_moe else lm_loss,
            partition_method="megatron_ds.layout",
            activation_checkpoint_interval=train.checkpoint_num_layers if train.checkpoint_activations else 0,
        )
        self.moe_loss_coeff = config.model.moe_loss_coeff
        self.moe_layers = [f for f in self.forward_funcs if isinstance(f, TransformerLayer) and f.moe is not None]
        """This stage's transformer layers with experts, in order (DeepSpeed numbers them from 0 in its expert files)."""
        self.last_losses: dict[str, torch.Tensor] | None = {} if is_moe else None
        """A MoE model's last micro-batch's `lm loss` and `moe loss` (detached; on the last stage), which DeepSpeed's
        engine averages over the step's micro-batches and data-parallel ranks (`get_additional_losses`)."""
        assert self._grid.get_slice_parallel_rank() == tp.rank, (self._grid.get_slice_parallel_rank(), tp)
        self._check_tied_group()
        mark_norm_counting(self, tp.rank)
        mark_embedding_and_output(self)
        reduce_partial_gradients(self, tp)  # sequence parallelism's norms and biases, --qk-layernorm's norms

    def _check_tied_group(self) -> None:
        # Invariant: each tied copy is reduced with exactly the other stage's copy of the same
        # (data, tensor) coordinate, i.e. with the same vocabulary shard.
        comm = self.tied_comms.get(naming.TIED_EMBEDDING_KEY)
        if comm is None:  # P = 1, or an untied head
            return
        me = self._topo.get_coord(self.global_rank)
        stages = sorted({self.stage_owner(i) for i, s in enumerate(self._layer_specs) if isinstance(s, TiedLayerSpec)})
        expected = [self._topo.get_rank(pipe=s, data=me.data, model=me.model) for s in stages]
        assert comm["ranks"] == expected, (comm["ranks"], expected)

    def _partition_layers(self, method: str = "megatron_ds.layout") -> None:
        del method  # boundaries come from the layout engine
        self.parts = self._layout.parts
        self._set_bounds(start=self.parts[self.stage_id], stop=self.parts[self.stage_id + 1])

    def _is_checkpointable(self, funcs: list[Any]) -> bool:
        # Recompute transformer layers only: the embedding's input does not require grad.
        return all(isinstance(f, TransformerLayer) for f in funcs)

    @property
    def layout(self) -> Layout:
        return self._layout

    def get_additional_losses(self) -> dict[str, torch.Tensor | None] | None:
        """DeepSpeed's hook: a MoE model's `lm loss` and `moe loss` of the last micro-batch (the same keys on every
        stage: DeepSpeed broadcasts the last stage's means to the others), None for a dense model."""
        if self.last_losses is None:
            return None
        return {name: self.last_losses.get(name) for name in ("lm loss", "moe loss")}


def _loss_with_moe(
    model: GPTModelPipe,
    lm_loss: Callable[..., torch.Tensor],
    logits: torch.Tensor,
    labels: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """A MoE model's micro-batch loss on the pipeline engine: the lm loss + `--moe-loss-coeff` x the aggregated
    load-balancing losses the final norm took off (Megatron-DeepSpeed's GPTModelPipe `loss_func`); in evaluation the lm
    loss alone, as the plain engine's `eval_batch`."""
    lm = lm_loss(logits, labels)
    norm = next(m for m in model.modules() if isinstance(m, FinalNorm))  # the last stage holds the post specs
    assert norm.aggregated_moe_loss is not None, "the final norm of a MoE model takes the aggregated loss"
    moe = model.moe_loss_coeff * norm.aggregated_moe_loss
    model.last_losses = {"lm loss": lm.detach().float(), "moe loss": moe.detach().float()}
    return lm + moe if model.training else lm


COUNTED_IN_NORM = "model_parallel"
"""The parameter attribute that says "this rank counts me in the global gradient norm"."""


def mark_norm_counting(module: torch.nn.Module, tp_rank: int) -> None:
    """Mark the parameters this rank counts in the global gradient norm (`p.model_parallel`).

    Every gradient element must be counted on exactly one rank of the model-parallel group
    (all stages x tensor ranks): a tied copy that DeepSpeed flags `ds_pipe_replicated` is left to
    its first stage; a parameter replicated over tensor ranks (norms, row-parallel biases, the
    position embedding) to tensor rank 0; a tensor-parallel shard (megatron-core's
    `tensor_model_parallel`) is counted by its own rank.

    DeepSpeed's ZeRO and bf16 paths skip `ds_pipe_replicated` copies and count a parameter when
    `is_model_parallel_parameter(p)` or the tensor rank is 0, which with this marking is the same
    rule. Its no-ZeRO fp32 `clip_grad_norm_` ignores `ds_pipe_replicated` and counts any
    `tensor_model_parallel` parameter, so it would count the last stage's tied shard twice: the
    engine replaces it by a norm that reads this attribute alone
    (`megatron_ds.training.grad_norm`).
    """
    for p in module.parameters():
        replicated_copy = getattr(p, "ds_pipe_replicated", False)
        sharded = getattr(p, "tensor_model_parallel", False)
        setattr(p, COUNTED_IN_NORM, (not replicated_copy) and (sharded or tp_rank == 0))


EMBEDDING_OR_OUTPUT = "is_embedding_or_output_parameter"
"""The parameter attribute megatron-core sets on the word embedding and output layer weights (both
tied copies, or the untied head): the parameters Megatron-LM's `--decoupled-lr` applies to."""


def mark_embedding_and_output(module: torch.nn.Module) -> None:
    """Mark the word embedding's and the LM head's weights (`EMBEDDING_OR_OUTPUT`)."""
    for sub in module.modules():
        if _class_name(type(sub)) in (naming.WORD_EMBEDDING, naming.UNTIED_LM_HEAD):
            setattr(sub.weight, EMBEDDING_OR_OUTPUT, True)
