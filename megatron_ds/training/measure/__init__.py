"""Measurements of a live run on this machine (the estimate layer predicts; this package measures).

    memory            per-rank memory of one `train_batch`: model states, saved activations, the peak
    allocation_trace  the most a rank's device held during that step (CPU: torch.profiler's memory
                      events; CUDA: the caching allocator's counters)
    stage_timers      each stage's compute per step apart from its waiting, and the 1F1B step it gives
    calibrate         each spec group's forward, backward and optimizer time, timed once in this
                      process: the per-group timing `--pp-partition-method profile` uses

docs/training.md (the memory report) and docs/compute.md section 6 (the stage timers) say what each
number means.
"""
