"""Interoperability with the rest of the ecosystem: our checkpoints <-> Hugging Face directories,
and Megatron-DeepSpeed's checkpoints -> ours.

    (training.checkpoint.reader: our per-spec DeepSpeed files -> full (T=1) tensors, one at a time)
    sharding            how each spec's tensors are split over tensor-parallel ranks (both ways)
    hf_architectures    which Hugging Face architecture our model is, and what each requires of it
    hf_config           ModelConfig -> Hugging Face `config.json` (`hf_config_read`: back to our flags)
    hf_weights          our tensor names <-> Hugging Face tensor names, one table per architecture
    hf_weights_reader   Hugging Face weight files (safetensors, or .bin with weights_only=True)
    hf_export           checkpoint -> Hugging Face directory (safetensors, config, tokenizer)
    hf_import           Hugging Face directory -> checkpoint that `pretrain_gpt.py --load` trains from
                        (`hf_import_experts`: a Mixtral's weights in universal form)
    hf_tokenizer        our tokenizers <-> Hugging Face tokenizer files
    sentencepiece_json  a SentencePiece model as a `tokenizer.json`
    files               atomic output directories, safetensors shards, progress bars
    megatron_deepspeed  a Megatron-DeepSpeed GPTModelPipe checkpoint -> ours (weights + universal
                        training state); `_files` (its files, restricted unpickler), `_layout`
                        (where its tensors are), `_source` (its state as full tensors), `_args`
                        (its saved args as our flags)

Only export and import need the optional `hf` extra (`safetensors`; `tokenizers`, which comes
with `transformers`, for the SentencePiece tokenizer.json); nothing in training, model, pipeline or config
imports this package. Hugging Face weights are read with safetensors (or `torch.load(...,
weights_only=True)` for a `.bin`), so importing a downloaded model never runs code from it.
"""
