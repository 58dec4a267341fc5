"""`curves.png`: training loss and validation rsum of a run against the optimisation step."""

from __future__ import annotations

import os
import pathlib

from sgraf.atomic_write import atomic_path
from sgraf.training.run_dir import CURVES_FILE, read_metrics


def plot_curves(run: str | os.PathLike[str], path: str | os.PathLike[str] | None = None) -> pathlib.Path | None:
    """Draws the curves of `run`'s metrics.jsonl into a PNG (default `RUN/curves.png`).

    Returns:
        The PNG path, or None when the run has no validation yet.
    """
    records = read_metrics(run)
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    out = pathlib.Path(path) if path is not None else pathlib.Path(run) / CURVES_FILE
    steps = [r["step"] for r in records]
    losses = [(r["step"], r["train_loss"]) for r in records if r.get("train_loss") is not None]
    fig, (ax_loss, ax_rsum) = plt.subplots(1, 2, figsize=(10, 3.8))
    if losses:
        ax_loss.plot(*zip(*losses), marker="o", color="tab:red")
    ax_loss.set(xlabel="step", ylabel="training loss (mean since last validation)", title="loss")
    ax_rsum.plot(steps, [r["rsum"] for r in records], marker="o", color="tab:blue")
    best = max(records, key=lambda r: r["rsum"])
    ax_rsum.axhline(best["rsum"], color="gray", linestyle=":", linewidth=1)
    ax_rsum.set(xlabel="step", ylabel="rsum (dev)", title=f"validation rsum (best {best['rsum']:.1f})")
    for ax in (ax_loss, ax_rsum):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        with atomic_path(out) as temporary:
            fig.savefig(temporary, format="png", dpi=100)
    finally:
        plt.close(fig)
    return out
