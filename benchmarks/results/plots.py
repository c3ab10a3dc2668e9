"""The page's own plots (the layer and CP plots are the scaling report's): the model step against tokens, log-log;
the fine-tuning loss per step."""

from __future__ import annotations

from pathlib import Path

__all__ = ["loss_plot", "model_plot"]


def model_plot(rows: list[dict], path: Path) -> bool:
    """Step time and peak GiB of the proxy's measured lengths (``rows``: runner records), one point each, labelled
    with its recompute choice; a dotted line is linear growth from the shortest length. False if nothing to plot."""
    pts = sorted((r["shape"]["tokens"], r["ms"], r.get("peak_gib"), r["shape"].get("recompute", "none"))
                 for r in rows if r.get("ms"))
    if not pts:
        return False
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, col, label in ((axes[0], 1, "ms per training step"), (axes[1], 2, "GiB beyond the weights")):
        xs = [p[0] for p in pts if p[col] is not None]
        ys = [p[col] for p in pts if p[col] is not None]
        if not xs:
            continue
        ax.plot(xs, ys, marker="o")
        ax.plot(xs, [ys[0] * x / xs[0] for x in xs], linestyle=":", color="gray", label="linear in tokens")
        for p in pts:
            if p[col] is not None and p[3] != "none":
                ax.annotate(p[3], (p[0], p[col]), textcoords="offset points", xytext=(-40, 6), fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [f"{x // 1024}k" for x in xs])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_yscale("log")
        ax.set_xlabel("tokens per step")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("4-layer V4-Flash proxy, one training step, one GPU", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def loss_plot(losses: list[float], path: Path, title: str) -> bool:
    """The loss of each training step and its running mean over a tenth of the steps. False if nothing to plot."""
    if not losses:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = max(1, len(losses) // 10)
    mean = [sum(losses[max(0, i + 1 - width):i + 1]) / len(losses[max(0, i + 1 - width):i + 1])
            for i in range(len(losses))]
    steps = list(range(1, len(losses) + 1))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, losses, linewidth=0.8, alpha=0.5, label="loss per step")
    ax.plot(steps, mean, linewidth=1.8, label=f"mean of the last {width} steps")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats per token)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
