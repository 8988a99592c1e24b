#!/usr/bin/env python
"""Fine-tune a GPT or Llama on instruction examples, as Megatron-DeepSpeed's finetune_llama.py does.

    deepspeed finetune_llama.py --load CKPT --finetune --tokenizer-type HFTokenizer --tokenizer-model HF_DIR \
        --data-path alpaca_data.json --repeated-dataloader <the model and training flags of pretrain_gpt.py>

`pretrain_gpt.py --prompt-data`: `--data-path` is one JSON list of Alpaca-style examples
({"instruction", "input", "output"}), each made into one sample with its prompt kept out of the loss,
sample for sample as upstream makes them (megatron_ds/data/prompt_data.py; docs/data.md). Weights
come from `--load` of one of our checkpoints: convert a Hugging Face model with
`tools/convert_checkpoint.py --from hf` (or Megatron-DeepSpeed's with `--from megatron-deepspeed`).
"""

from __future__ import annotations

import sys

from pretrain_gpt import run_script

if __name__ == "__main__":
    run_script([*sys.argv[1:], "--prompt-data"])
