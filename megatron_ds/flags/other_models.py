"""Flags of Megatron-DeepSpeed's argument groups for its other models and tools: the text-generation server
("inference"), Retro, ADLR autoresume, the ICT/REALM biencoder, vision and knowledge distillation.

Its pretrain_gpt.py parses them all. Most are read only by those models, so they change nothing in its GPT
training either: a no-op here, saying so. Those that do change its GPT training (Retro's retriever layers, the
autoresume hook, vision pretraining's steps, mixture of students) are refused in one line. Knowledge distillation
(`--kd` and its teacher) is built: `megatron_ds.config.distillation`, docs/training.md. Declared so
that every flag of its `megatron/arguments.py` is accepted, a no-op or refused with the reason
(`tests/data/megatron_deepspeed_flags.json`, `tests/unit/test_compat.py`).
"""

from __future__ import annotations

from megatron_ds.flags.declare import VALUE, VALUES, Flag, accepted, no_op, refused, switch

_INFER, _RETRO, _AUTO, _BIENC, _VISION, _KD = (
    "inference",
    "retro",
    "autoresume",
    "biencoder",
    "vision",
    "knowledge distillation",
)
_NOT_GPT = "; GPT training never reads it, nor does Megatron-DeepSpeed's pretrain_gpt.py"
_SERVER = f"a setting of Megatron-DeepSpeed's text-generation server (megatron/text_generation){_NOT_GPT}"
_BERT_EMBEDDER = f"BERT's embedder (megatron/model/bert_model.py, for Retro's preprocessing){_NOT_GPT}"
_RETRO_ONLY = "a Retro setting, read only with --retro-add-retriever (refused): the GPT is the same without it"
_ICT = f"an ICT/REALM retriever setting (pretrain_ict.py, tasks/orqa, the indexer){_NOT_GPT}"
_VIT = f"a vision model's setting (pretrain_vision_*.py){_NOT_GPT}"

INFERENCE: tuple[Flag, ...] = (
    no_op("--inference-batch-times-seqlen-threshold", _INFER, _SERVER, VALUE),
    no_op("--max-tokens-to-oom", _INFER, _SERVER, VALUE),
    no_op("--output-bert-embeddings", _INFER, _BERT_EMBEDDER),
    no_op("--bert-embedder-type", _INFER, _BERT_EMBEDDER, VALUE),
)

RETRO: tuple[Flag, ...] = (
    no_op("--retro-workdir", _RETRO, _RETRO_ONLY, VALUE),
    refused(
        "--retro-add-retriever",
        _RETRO,
        "Retro's retriever (neighbour chunks from its database through a retrieval encoder, pretrain_retro.py) is "
        "not built",
    ),
    no_op(
        "--retro-cyclic-train-iters",
        _RETRO,
        "a Retro setting, read only with --retro-add-retriever and --dataloader-type cyclic (both refused)",
        VALUE,
    ),
    no_op("--retro-encoder-layers", _RETRO, _RETRO_ONLY, VALUE),
    no_op("--retro-encoder-hidden-dropout", _RETRO, _RETRO_ONLY, VALUE),
    no_op("--retro-encoder-attention-dropout", _RETRO, _RETRO_ONLY, VALUE),
    no_op("--retro-num-neighbors", _RETRO, _RETRO_ONLY, VALUE),
    no_op("--retro-num-retrieved-chunks", _RETRO, _RETRO_ONLY, VALUE),
    no_op("--retro-return-doc-ids", _RETRO, f"for Retro's preprocessing tools{_NOT_GPT}"),
)

AUTORESUME: tuple[Flag, ...] = (
    refused(
        "--adlr-autoresume",
        _AUTO,
        "NVIDIA's ADLR cluster autoresume (its userlib.auto_resume) is not available",
        "drop it; --exit-signal-handler saves and exits on SIGTERM, and --load resumes",
    ),
    no_op("--adlr-autoresume-interval", _AUTO, "read only with --adlr-autoresume (refused)", VALUE),
)

BIENCODER: tuple[Flag, ...] = (
    no_op("--ict-head-size", _BIENC, _ICT, VALUE),
    no_op("--biencoder-projection-dim", _BIENC, _ICT, VALUE),
    no_op("--biencoder-shared-query-context-model", _BIENC, _ICT),
    no_op("--ict-load", _BIENC, _ICT, VALUE),
    no_op("--bert-load", _BIENC, _ICT, VALUE),
    no_op("--titles-data-path", _BIENC, _ICT, VALUE),
    no_op("--query-in-block-prob", _BIENC, _ICT, VALUE),
    no_op("--use-one-sent-docs", _BIENC, _ICT),
    no_op("--evidence-data-path", _BIENC, _ICT, VALUE),
    no_op("--retriever-report-topk-accuracies", _BIENC, _ICT, VALUES),
    no_op("--retriever-score-scaling", _BIENC, _ICT),
    no_op("--block-data-path", _BIENC, _ICT, VALUE),
    no_op("--embedding-path", _BIENC, _ICT, VALUE),
    no_op("--indexer-batch-size", _BIENC, _ICT, VALUE),
    no_op("--indexer-log-interval", _BIENC, _ICT, VALUE),
)

_VISION_VALUES = (
    "--num-classes",
    "--img-h",
    "--img-w",
    "--num-channels",
    "--patch-dim",
    "--classes-fraction",
    "--data-per-class-fraction",
    "--head-lr-mult",
    "--vision-pretraining-type",
    "--vision-backbone-type",
    "--swin-backbone-type",
    "--mask-type",
    "--mask-factor",
    "--iter-per-epoch",
    "--dino-local-img-size",
    "--dino-local-crops-number",
    "--dino-head-hidden-size",
    "--dino-bottleneck-size",
    "--dino-freeze-last-layer",
)

VISION: tuple[Flag, ...] = (
    *(no_op(name, _VISION, _VIT, VALUE) for name in _VISION_VALUES),
    no_op(
        "--no-data-sharding",
        _VISION,
        "read only by the sampler of --dataloader-type cyclic (refused); the single-pass sampler is the same",
    ),
    refused(
        "--vision-pretraining",
        _VISION,
        "vision pretraining (pretrain_vision_*.py) is not built (Megatron-DeepSpeed's training loop then runs DINO's "
        "teacher updates with --vision-pretraining-type dino)",
    ),
    no_op("--dino-norm-last-layer", _VISION, _VIT),
    no_op("--dino-warmup-teacher-temp", _VISION, _VIT, VALUE),
    no_op("--dino-teacher-temp", _VISION, _VIT, VALUE),
    no_op("--dino-warmup-teacher-temp-epochs", _VISION, _VIT, VALUE),
)

_TEACHER = (
    "; must equal what --load-teacher's checkpoint saved (its own architecture is the teacher's); when not given, "
    "the checkpoint's"
)

DISTILLATION: tuple[Flag, ...] = (
    accepted(
        "--num-layers-teacher", _KD, f"the teacher's layers{_TEACHER}", "distillation.num_layers_teacher", type=int
    ),
    accepted(
        "--num-experts-teacher",
        _KD,
        "the teacher's experts, one count or one per mixture-of-experts layer (as --num-experts); its experts per "
        "layer must equal what --load-teacher's checkpoint saved; when not given, the checkpoint's. A "
        "mixture-of-experts teacher shares the student's --moe-expert-parallel-size (docs/training.md)",
        "distillation.num_experts_teacher",
        type=int,
        nargs="+",
    ),
    accepted(
        "--hidden-size-teacher", _KD, f"the teacher's width{_TEACHER}", "distillation.hidden_size_teacher", type=int
    ),
    accepted(
        "--num-attention-heads-teacher",
        _KD,
        f"the teacher's attention heads{_TEACHER}",
        "distillation.num_attention_heads_teacher",
        type=int,
    ),
    switch(
        "--mos",
        _KD,
        "mixture of students: --kd's loss from the same teacher (--load-teacher, dense or mixture-of-experts), logged as "
        "mos loss, as "
        "Megatron-DeepSpeed (a mixture-of-experts student's step adds lm, moe and mos loss); docs/training.md",
        "distillation.mos",
    ),
    switch(
        "--kd",
        _KD,
        "knowledge distillation from the teacher of --load-teacher, as Megatron-DeepSpeed: each training step adds "
        "kd loss = T^2 KL(softmax(teacher/T) || softmax(student/T)) per sample / --seq-length x --kd-beta-ce to the lm "
        "loss, the teacher run forward without gradients (not in evaluation); at pipeline size 1, any tensor size "
        "(the full vocabulary's KL divergence at T > 1, not upstream's per-shard one: a NOTICE; docs/training.md)",
        "distillation.kd",
    ),
    accepted(
        "--kd-alpha-ce",
        _KD,
        "read but scales nothing, as in Megatron-DeepSpeed (a NOTICE says so when it is not 1)",
        "distillation.kd_alpha_ce",
        type=float,
    ),
    accepted("--kd-beta-ce", _KD, "beta: the kd loss's factor", "distillation.kd_beta_ce", type=float),
    accepted("--kd-temp", _KD, "T: the softmax temperature of student and teacher", "distillation.kd_temp", type=float),
    accepted(
        "--load-teacher",
        _KD,
        "the teacher's checkpoint (pretrain_gpt.py --save DIR, any layout; weights only); needed with --kd or --mos",
        "distillation.load_teacher",
    ),
)

GROUPS: tuple[tuple[Flag, ...], ...] = (INFERENCE, RETRO, AUTORESUME, BIENCODER, VISION, DISTILLATION)
"""In Megatron-DeepSpeed's order of its argument groups."""
