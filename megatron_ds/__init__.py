"""megatron_ds: Megatron-DeepSpeed style GPT pretraining with dedicated embedding pipeline stages.

`megatron_ds.build_pipeline(config, optimizer=...)` builds the pipeline engine for your own training
loop, with every invariant that keeps it from hanging (docs/training.md).
"""

import warnings
from typing import Any

# megatron-core announces at import that it falls back to torch when apex / Transformer Engine are
# absent; that fallback is what we want (apex is optional, never required), so keep logs readable.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

# DeepSpeed's pipeline engine moves activations with c10d broadcasts on gloo; autograd never
# differentiates through them (the engine sends gradients back explicitly, and the equivalence
# tests against a single-process run check the result), so torch's warning about it is noise.
warnings.filterwarnings("ignore", message="c10d::broadcast_: an autograd kernel was not registered")

__version__ = "0.1.0"

__all__ = ["Pipeline", "__version__", "build_pipeline"]


def __getattr__(name: str) -> Any:
    # Loaded on first use: `import megatron_ds` stays light (no torch, no DeepSpeed) for the
    # flag parser, the planner and tools.
    if name in ("build_pipeline", "Pipeline"):
        from megatron_ds.training import builder

        return getattr(builder, name)
    raise AttributeError(f"module 'megatron_ds' has no attribute {name!r}")
