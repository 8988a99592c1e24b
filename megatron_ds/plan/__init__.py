"""The configuration advisor (`python -m megatron_ds.plan`, see `megatron_ds.plan.cli`): which
parallel sizes, ZeRO stage, precision and layout fit a model on given GPUs. It works on the
estimates of `megatron_ds.estimate`, without GPUs. Importing this package does not import torch
or deepspeed.
"""
