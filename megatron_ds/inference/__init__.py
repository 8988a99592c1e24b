"""Run a trained checkpoint in one process: no launcher, no torch.distributed, no DeepSpeed engine.

    from megatron_ds.inference import load_model, generate
    model = load_model("checkpoints/gpt_cpu_demo")      # a torch.nn.Module, eval mode
    logits = model(tokens)                              # (b, s) int64 -> (b, s, vocab) float32
    new_ids = generate(model, prompt_ids, max_new_tokens=40, temperature=0.8, top_k=50, seed=1)

The module is built from the same layer classes as the pipeline (`megatron_ds.model`) at T=1,
whatever P, T and layout the checkpoint was trained with; its uncached forward is the training
forward. `generate` adds a KV cache (`megatron_ds.inference.model.KVCache`).
"""

from megatron_ds.inference.generate import generate, sample_next
from megatron_ds.inference.model import GPTModel, KVCache, load_model

__all__ = ["GPTModel", "KVCache", "generate", "load_model", "sample_next"]
