"""The demo's picture: the loss curve and the packed vs padded throughput."""

from __future__ import annotations

from pathlib import Path


def require_matplotlib():
    """matplotlib with a file backend, or a clear error naming the install line."""
    try:
        import matplotlib
    except ImportError as err:
        raise RuntimeError("the demo writes a PNG and needs matplotlib: pip install 'ssm-pack[demo]' "
                           "(or pip install matplotlib)") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def write_png(path: Path, losses: list[float], throughput: dict[str, float], title: str) -> Path:
    plt = require_matplotlib()
    fig, (ax_loss, ax_tput) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot(range(1, len(losses) + 1), losses, color="#1f77b4")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("next-byte cross-entropy (nats)")
    ax_loss.set_title("training loss (packed)")
    ax_loss.grid(alpha=0.3)
    names = list(throughput)
    bars = ax_tput.bar(names, [throughput[n] for n in names], color=["#2ca02c", "#d62728", "#7f7f7f"][: len(names)])
    for bar in bars:
        ax_tput.annotate(f"{bar.get_height():,.0f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                         ha="center", va="bottom")
    ax_tput.set_ylabel("real tokens / s (forward + backward + step)")
    ax_tput.set_title("training throughput")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
