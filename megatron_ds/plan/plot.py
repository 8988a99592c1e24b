"""`--plot FILE.png`: predicted memory per stage as stacked bars (matplotlib is optional)."""

from __future__ import annotations


def plot_stages(plan, usable_bytes: float | None, path: str) -> bool:
    """Write the chart; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    gib = 1024**3
    stages = plan.stages
    xs = [s.stage for s in stages]
    parts = [
        ("parameters", [s.params for s in stages]),
        ("gradients", [s.grads for s in stages]),
        ("optimizer", [s.optimizer for s in stages]),
        ("activations", [s.activations for s in stages]),
        ("buffers + transient", [s.pipe_buffers + s.transient for s in stages]),
    ]
    fig, ax = plt.subplots(figsize=(max(7, len(stages) * 0.5 + 3), 4))
    bottom = [0.0] * len(stages)
    for label, values in parts:
        ax.bar(xs, [v / gib for v in values], bottom=bottom, label=label)
        bottom = [b + v / gib for b, v in zip(bottom, values)]
    if usable_bytes:
        ax.axhline(usable_bytes / gib, color="red", linestyle="--", label="usable GPU memory")
    ax.set_xticks(xs)
    ax.set_xlabel("pipeline stage")
    ax.set_ylabel("GiB per GPU (estimate)")
    ax.set_title(f"Predicted memory per stage, layout {plan.layout.to_string()}")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True
