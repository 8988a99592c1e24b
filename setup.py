"""megatron_ds: GPT pretraining on DeepSpeed's pipeline engine with dedicated embedding stages."""

from setuptools import find_packages, setup

setup(
    name="megatron_ds",
    version="0.1.0",
    description="Megatron-DeepSpeed style GPT pretraining with dedicated pre/post-processing pipeline stages",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_ds", "megatron_ds.*"]),
    # The planner's fixed prose and example programs, printed from the installed files.
    package_data={"megatron_ds.plan": ["guides/*.txt", "guides/*.py"]},
    py_modules=["pretrain_gpt"],
    install_requires=[
        "torch>=2.3",
        # Tested bounds (docs/training.md "Dependencies"). DeepSpeed: 0.19.8; 0.18.3-0.19.2 scale
        # pipeline gradients wrongly under gradient accumulation (start-up refuses them), and 0.19.3-0.19.7
        # fail activation checkpointing on DeepSpeed's CPU accelerator. megatron-core: 0.13.0 (the
        # first whose parallel layers take `tp_group`) and 0.16.1. Neither bound pulls another torch
        # (they ask for torch >= 2.0 and >= 2.6 at most; the CPU pin is the Makefile's).
        "deepspeed>=0.19.8,<0.20",
        "megatron-core>=0.13,<0.17",
        "sentencepiece>=0.2",
        "numpy>=1.24",
    ],
    extras_require={
        "test": [
            "pytest>=8",
            "pytest-timeout>=2.3",
            "pytest-xdist>=3.5",
            "ruff==0.17.6",
            "transformers>=4.40",
            "safetensors>=0.4",
            "tensorboard>=2.14",  # the real TensorBoard writer and --profile pt's trace directory run in the suite
        ],
        # Hugging Face export/import (tools/convert_checkpoint.py); the trainer never imports these.
        "hf": ["transformers>=4.40", "safetensors>=0.4", "tqdm>=4.60"],
        "plot": ["matplotlib>=3.7"],
        "tensorboard": ["tensorboard>=2.14"],
        "wandb": ["wandb>=0.15"],
    },
    entry_points={
        "console_scripts": [
            "megatron-ds-plan=megatron_ds.plan.__main__:main",
        ],
    },
)
