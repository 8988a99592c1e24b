"""Pipeline layout: which layer specs each pipeline stage holds. Pure: no torch, no process groups.

    specs.py          SpecGroups: the spec names, pre / body / post
    layout_string.py  the layout-string grammar (`E|t*3|t*3|L`), megatron-core's, for --pp-layout and
                      --pipeline-model-parallel-layout
    megatron_lm.py    Megatron-LM's split flags (--decoder-first/last-pipeline-num-layers,
                      --account-for-*-in-pipeline-split) with megatron-core's stage counts
    partition.py      DeepSpeed's uniform / balanced splits over per-item weights
    costs.py          what the searches take: StageTime, StepEstimate, cost functions, the shape check
    balance.py        the minimax split over per-stage cost functions (the memory method and others)
    fastest.py        the fastest split under a memory limit (`fastest`, `profile`)
    methods.py        the `--pp-partition-method` registry
    layout.py         Layout (parts, printed table) and build_layout, the front door

Import rule: modules here import only the standard library (and numpy), `megatron_ds.errors`,
`megatron_ds.units` and each other
(tests/unit/test_layout_methods.py checks it). Costs that need the model or the memory model
(parameter counts, predicted stage memory) are computed above this package and passed in.
"""
