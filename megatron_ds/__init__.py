"""megatron_ds: Megatron-DeepSpeed style GPT pretraining with dedicated embedding pipeline stages."""

import warnings

# megatron-core announces at import that it falls back to torch when apex / Transformer Engine are
# absent; that fallback is what we want (apex is optional, never required), so keep logs readable.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

# DeepSpeed's pipeline engine moves activations with c10d broadcasts on gloo; autograd never
# differentiates through them (the engine sends gradients back explicitly, and the equivalence
# tests against a single-process run check the result), so torch's warning about it is noise.
warnings.filterwarnings("ignore", message="c10d::broadcast_: an autograd kernel was not registered")

__version__ = "0.1.0"
