"""The configuration tree: one frozen, self-validating dataclass per concern, passed explicitly.

    Config
      model           ModelConfig           architecture; checked against a checkpoint on resume
      regularization  RegularizationConfig  dropout, init std; free to change on resume
      parallel        ParallelConfig        P, T, world size (data-parallel size derived), layout
      data            DataConfig            data paths, tokenizer
      optimizer       OptimizerConfig       optimizer, learning-rate schedule
      training        TrainingConfig        batch sizes, length, precision, recomputation
      checkpoint      CheckpointConfig      save / load
      logging         LoggingConfig         log lines, TensorBoard
      distillation    DistillationConfig    knowledge distillation from a teacher checkpoint (--kd)

Every section checks its own fields in `__post_init__` and `Config` checks the rules that span
sections, raising a one-line `megatron_ds.errors.ConfigError` that names the command-line flag; so
`pretrain_gpt.py` (through `megatron_ds.flags.parser`), a `Config` built in Python and the planner
get the same checks. Derived values live in one place: `ParallelConfig.data_parallel_size`, the
`ModelConfig` size properties and `padded_vocab_size` (weight shapes and parameter counts, built
from them, are `megatron_ds.model.shapes`).

Precedence: command-line flags > `--deepspeed_config` file (merged, contradictions are errors) >
the defaults below. Run state (iteration, consumed samples) is *not* configuration: it lives in
`megatron_ds.training.state.TrainState`. See docs/configuration.md.
"""

from megatron_ds.config.data import DATA_UPSTREAMS, TOKENIZER_TYPES, DataConfig
from megatron_ds.config.distillation import DistillationConfig
from megatron_ds.config.model import (
    ACTIVATIONS,
    NORMALIZATIONS,
    ModelConfig,
    RegularizationConfig,
    default_ffn_hidden_size,
    padded_vocab_size,
)
from megatron_ds.config.optimizer import LR_DECAY_STYLES, OPTIMIZERS, OptimizerConfig
from megatron_ds.config.output import PROFILER_MODES, CheckpointConfig, LoggingConfig
from megatron_ds.config.parallel import BACKENDS, DEDICATED_CHOICES, ParallelConfig
from megatron_ds.config.training import PRECISIONS, ZERO_STAGES, TrainingConfig
from megatron_ds.config.tree import Config

__all__ = [
    "ACTIVATIONS",
    "BACKENDS",
    "DATA_UPSTREAMS",
    "DEDICATED_CHOICES",
    "LR_DECAY_STYLES",
    "NORMALIZATIONS",
    "OPTIMIZERS",
    "PRECISIONS",
    "PROFILER_MODES",
    "TOKENIZER_TYPES",
    "ZERO_STAGES",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "DistillationConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "RegularizationConfig",
    "TrainingConfig",
    "default_ffn_hidden_size",
    "padded_vocab_size",
]
