"""Flags of Megatron's groups "data and tokenizer" and "checkpointing" (its "logging" group:
`megatron_ds.flags.logging_flags`)."""

from __future__ import annotations

from megatron_ds.config import DATA_UPSTREAMS, TOKENIZER_TYPES
from megatron_ds.flags.declare import NO_OP, VALUE, Flag, Refusal, accepted, no_op, refused, switch

_DATA, _CKPT = "data and tokenizer", "checkpointing"
_MMAP_ONLY = "only the mmap format is read"
_CONVERT = "convert with tools/preprocess_data.py and use mmap"
_GPT_TOKENIZERS = "use GPT2BPETokenizer, SentencePieceTokenizer or HuggingFaceTokenizer"
_NOT_GPT = "; GPT datasets never read it, nor does Megatron-DeepSpeed's pretrain_gpt.py"
_ORQA = f"the ORQA/REALM retriever's evidence data (megatron/data/orqa_wiki_dataset.py){_NOT_GPT}"
_MASKING = f"BERT's and T5's masking (their datasets){_NOT_GPT}"
_FORCED_INDEX = (
    "reads the training split's index file from this path instead of the one built for the data, split and seed; "
    "here the index is always built for them (and kept, keyed by its contents, in --data-cache-path)",
    "drop it",
)
_FORCED_INDEX_FLAGS = (
    "--train-desc-path",
    "--train-doc-idx-path",
    "--train-sample-idx-path",
    "--train-shuffle-idx-path",
)

DATA: tuple[Flag, ...] = (
    accepted(
        "--data-path",
        _DATA,
        "a prefix or a weighted blend, through megatron-core's GPTDataset",
        "data.data_path",
        nargs="+",
        default=(),
    ),
    accepted("--split", _DATA, "train/validation/test weights", "data.split"),
    accepted("--data-cache-path", _DATA, "where index caches go", "data.data_cache_path"),
    switch(
        "--mock-data",
        _DATA,
        "Megatron-LM's flag: under its data rules (--data-upstream megatron-lm, or auto picking it) Megatron-LM's "
        "samples, megatron-core's MockGPTDataset (its documents split 1,1,1 whatever --split says); under "
        "Megatron-DeepSpeed's (which has no mock data) seeded random tokens (our MockGPTData: values follow --seed, "
        "a split of --split weight 0 is not built), said in a NOTICE",
        "data.mock_data",
    ),
    accepted(
        "--data-impl",
        _DATA,
        "`mmap`, the format our tools and megatron-core write, or `infer` (Megatron-DeepSpeed's default: the "
        "index header decides, so an mmap index reads and a legacy lazy/cached one is refused when opened)",
        default="mmap",
        choices=("mmap", "infer"),
        refused_values=(
            Refusal("lazy", _MMAP_ONLY, _CONVERT),
            Refusal("cached", _MMAP_ONLY, _CONVERT),
        ),
    ),
    accepted("--seq-length", _DATA, "tokens per sample", "model.seq_length", type=int, default=None),
    accepted(
        "--vocab-size",
        _DATA,
        "vocabulary size; else the tokenizer's (then padded); the NullTokenizer's ids. Beside another tokenizer it "
        "still sizes the vocabulary (an imported model's embedding may have more rows than its tokenizer), where "
        "both upstreams ignore it and size it from the tokenizer: a NOTICE at launch gives upstream's padded size",
        fields=("model.vocab_size", "data.null_tokenizer_vocab_size", "data.unpadded_vocab_size"),
        type=int,
        default=None,
        derived=True,
    ),
    accepted("--vocab-file", _DATA, "GPT-2 vocab.json", "data.vocab_file"),
    accepted("--merge-file", _DATA, "GPT-2 merges.txt", "data.merge_file"),
    accepted("--vocab-extra-ids", _DATA, "only 0 (extra sentinel ids are for T5)", type=int, default=0),
    accepted(
        "--tokenizer-type",
        _DATA,
        "`GPT2BPETokenizer` (the default with --vocab-file/--merge-file, as in Megatron's pretrain_gpt.py), "
        "`SentencePieceTokenizer` or `GPTSentencePieceTokenizer`, `NullTokenizer` (token ids as they are, "
        "--vocab-size of them, eod the last: megatron-core's; a Megatron-DeepSpeed line is told that its NullTokenizer "
        "had one id more) or `HuggingFaceTokenizer` (--tokenizer-model a "
        "local directory read by transformers' AutoTokenizer; nothing is downloaded) or `HFTokenizer` (Megatron-DeepSpeed's: "
        "the same directory read as its finetune_llama.py reads it: AutoTokenizer with use_fast=False, a missing pad, eos, "
        "bos or unk token added, the model's vocabulary the base one without them). SentencePieceTokenizer is "
        "Megatron's GPTSentencePieceTokenizer here: eod is the model's eos and no special tokens are added (a "
        "Megatron-DeepSpeed line is told at launch the ids and <EOD> its SentencePieceTokenizer has); "
        "`Llama2Tokenizer` is Megatron-LM's: the same ids, its bos before each text tools/preprocess_data.py writes",
        "data.tokenizer_type",
        choices=TOKENIZER_TYPES,
        derived=True,
        refused_values=(
            Refusal("BertWordPieceLowerCase", "BERT tokenizers are not provided", _GPT_TOKENIZERS),
            Refusal("BertWordPieceCase", "BERT tokenizers are not provided", _GPT_TOKENIZERS),
        ),
    ),
    accepted(
        "--tokenizer-model",
        _DATA,
        "SentencePiece model file, or HuggingFaceTokenizer's (HFTokenizer's) local directory",
        "data.tokenizer_model",
    ),
    refused(
        "--trust-remote-code",
        _DATA,
        "code from a tokenizer directory is never run (HFTokenizer and HuggingFaceTokenizer read it with "
        "trust_remote_code off)",
        "drop it; a directory that needs its own code can be saved as a standard tokenizer with transformers first",
    ),
    accepted("--num-workers", _DATA, "DataLoader worker processes", "data.num_workers", type=int),
    no_op("--mmap-warmup", _DATA, "reads every memory-mapped file once before training; the same tokens are read"),
    switch("--eod-mask-loss", _DATA, "end-of-document tokens do not count in the loss", "data.eod_mask_loss"),
    *(
        accepted(
            f"--{name}-data-path",
            _DATA,
            f"the {split} split's own data, all its documents: a prefix or a weighted blend `W1 P1 W2 P2 ...`, "
            f"instead of --data-path and --split; {without}. Sized and blended by --data-upstream's rules (docs/data.md)",
            f"data.{name}_data_path",
            nargs="+",
            default=(),
        )
        for name, split, without in (
            ("train", "training", "needed when the run trains"),
            ("valid", "validation", "without it, no validation"),
            ("test", "test", "without it, no test evaluation"),
        )
    ),
    refused("--encoder-seq-length", _DATA, "encoder-decoder models are not built", "use --seq-length", VALUE),
    refused("--decoder-seq-length", _DATA, "encoder-decoder models are not built", "use --seq-length", VALUE),
    switch(
        "--reset-position-ids",
        _DATA,
        "position ids restart at 0 after each end-of-document token (the tokenizer's eod) of a sample's input "
        "tokens, for the position embedding and rotary embeddings; not in generation (as upstream's); refused with "
        "--ds-sequence-parallel-size > 1 and --prompt-data",
        "data.reset_position_ids",
    ),
    switch(
        "--prompt-data",
        _DATA,
        "--data-path is one JSON list of Alpaca-style examples ({instruction, input, output}), each one sample with "
        "its prompt kept out of the loss, as Megatron-DeepSpeed's finetune_llama.py makes them; finetune_llama.py "
        "sets it (docs/data.md)",
        "data.prompt_data",
        megatron=False,
    ),
    switch(
        "--repeated-dataloader",
        _DATA,
        "when the training samples run out, read them again from the first (finetune_llama.py's JSON examples; the "
        "indexed datasets of pretrain_gpt.py are built for every sample the run asks for and never run out). A "
        "resumed run continues where an uninterrupted one would be; Megatron-DeepSpeed's restarts each later pass at "
        "the sample it resumed from",
        "data.repeated_dataloader",
    ),
    switch(
        "--reset-attention-mask",
        _DATA,
        "tokens after an end-of-document token (the tokenizer's eod) attend to nothing at or before it: each packed "
        "document attends within itself, through a dense (b, 1, s, s) mask instead of SDPA's causal fast path; not "
        "in generation (as upstream's); refused with --ds-sequence-parallel-size > 1 and --prompt-data",
        "data.reset_attention_mask",
    ),
    accepted(
        "--aml-data-download-path",
        _DATA,
        "the directory an AzureML job mounted its data in: each --data-path prefix is read as <it>/<prefix>, as "
        "Megatron-DeepSpeed joins them (its examples_deepspeed/azureml line); a weighted blend is refused (it joins "
        "the weights too)",
    ),
    no_op("--retriever-seq-length", _DATA, _ORQA, VALUE),
    no_op("--sample-rate", _DATA, _ORQA, VALUE),
    no_op("--mask-prob", _DATA, _MASKING, VALUE),
    no_op("--short-seq-prob", _DATA, _MASKING, VALUE),
    refused(
        "--train-data-exact-num-epochs",
        _DATA,
        "makes the training split's index exactly N passes over its documents (Megatron-DeepSpeed's gpt_dataset.py), "
        "which changes the sample order; not implemented",
        "drop it (the passes follow the samples the run asks for, as without it upstream)",
        VALUE,
    ),
    no_op(
        "--return-data-index",
        _DATA,
        "adds each sample's index to the batch, which training never reads (Megatron-DeepSpeed's pretrain_gpt.py "
        "neither)",
    ),
    no_op(
        "--train-idx-path",
        _DATA,
        "the samples-mapping file of BERT's, T5's and ICT's datasets (megatron/data/dataset_utils.py); GPT datasets "
        "never read it",
        VALUE,
    ),
    *(refused(name, _DATA, *_FORCED_INDEX, VALUE) for name in _FORCED_INDEX_FLAGS),
    refused(
        "--data-efficiency-curriculum-learning",
        _DATA,
        "DeepSpeed's data-efficiency curriculum (the data_efficiency section) is not implemented",
        "use the legacy curriculum_learning section of --deepspeed_config (implemented)",
    ),
    accepted(
        "--data-upstream",
        _DATA,
        "whose rules pick each split's documents and size a blend's parts, so that the samples and their order "
        "are that upstream's: megatron-deepspeed, megatron-lm (megatron-core's), or auto: megatron-lm when the "
        "line sets a flag only Megatron-LM has (e.g. --decoder-first-pipeline-num-layers), else megatron-deepspeed "
        "(docs/data.md)",
        "data.data_upstream",
        choices=("auto", *DATA_UPSTREAMS),
        default="auto",
        derived=True,
        megatron=False,
    ),
    switch(
        "--misaligned-append-eod",
        _DATA,
        "read Megatron-DeepSpeed's --append-eod files as it does: their index leaves out each document's EOD, so "
        "document k is read from k tokens too early and samples mix in neighbouring documents; only to continue, "
        "sample for sample, a run started there on such files (by default each EOD is read with its document)",
        "data.misaligned_append_eod",
        megatron=False,
    ),
)

CHECKPOINTING: tuple[Flag, ...] = (
    accepted("--save", _CKPT, "written atomically through DeepSpeed's engine", "checkpoint.save"),
    accepted(
        "--save-interval",
        _CKPT,
        "save every this many iterations, and at the end",
        "checkpoint.save_interval",
        type=int,
    ),
    accepted(
        "--load",
        _CKPT,
        "resume from `latest`. A directory that does not exist or holds nothing yet (the first launch of a "
        "`--save DIR --load DIR` script) starts from scratch with a NOTICE, as in Megatron; one that holds "
        "something else but no `latest` is an error naming what it found",
        "checkpoint.load",
    ),
    accepted(
        "--load-tag",
        _CKPT,
        "resume from this checkpoint of --load (e.g. global_step1000) instead of the one `latest` names; it must "
        "exist and be complete, first launch or not",
        "checkpoint.load_tag",
    ),
    Flag(
        "--load-optional",
        _CKPT,
        NO_OP,
        "starting from scratch when --load holds no checkpoint yet is the default (our 0.1.0 flag, kept so its "
        "launch lines run)",
        nargs=0,
        megatron=False,
    ),
    switch(
        "--no-load-optim",
        _CKPT,
        "weights only (the iteration and consumed samples are kept; optimizer and lr schedule restart), "
        "Megatron-LM's meaning and Megatron-DeepSpeed's help text (its DeepSpeed path loads the optimizer anyway: "
        "a NOTICE says so); not needed to change the layout",
        "checkpoint.no_load_optim",
    ),
    switch(
        "--no-load-lr-state",
        _CKPT,
        "resume everything but the lr schedule, which starts again from step 0 with the flags' values (its "
        "help text; Megatron-DeepSpeed declares the flag but never reads it: a NOTICE says so)",
        "checkpoint.no_load_lr_state",
    ),
    switch(
        "--reset-iteration",
        _CKPT,
        "resume weights, optimizer, lr schedule and RNG, but count iterations and consumed samples from 0 (data "
        "from its first sample), as Megatron-DeepSpeed",
        "checkpoint.reset_iteration",
    ),
    switch("--no-load-rng", _CKPT, "keep this run's RNG states", "checkpoint.no_load_rng"),
    switch(
        "--finetune",
        _CKPT,
        "weights only; iteration and consumed samples start at 0",
        "checkpoint.finetune",
    ),
    switch(
        "--exit-on-missing-checkpoint",
        _CKPT,
        "a --load that holds no checkpoint yet is an error instead of a start from scratch",
        "checkpoint.exit_on_missing_checkpoint",
    ),
    switch(
        "--no-save-optim",
        _CKPT,
        "checkpoints hold weights, iteration and RNG, no optimizer or lr schedule state (Megatron-LM's meaning; "
        "resuming one restarts both, as --no-load-optim)",
        "checkpoint.no_save_optim",
    ),
    refused("--no-save-rng", _CKPT, "checkpoints always hold every rank's RNG state"),
    switch(
        "--use-checkpoint-args",
        _CKPT,
        "the architecture (and, without tokenizer flags, the tokenizer) from --load's checkpoint; model flags given "
        "win, and one that differs from the checkpoint is refused at --load. T and P stay this run's (a NOTICE names "
        "the checkpoint's when they differ; Megatron-DeepSpeed takes them too)",
    ),
    refused("--no-initialization", _CKPT, "weights are always initialised"),
    no_op(
        "--universal-checkpoint",
        _CKPT,
        "--load resumes the whole training state under another P, layout, T, DP or ZeRO stage by itself, through "
        "the universal form (docs/checkpoints.md)",
    ),
)
