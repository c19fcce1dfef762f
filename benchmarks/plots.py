"""The benchmark's figures (matplotlib, written as PNG): TTFT and TPOT CDFs per server, a
per-request timeline of one run per server, and goodput against request rate."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from loadgen import Record  # noqa: E402


def cdfs(runs: dict[str, list[Record]], path: Path, title: str) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, records in runs.items():
        for ax, key in zip(axes, ("ttft", "tpot")):
            values = (getattr(r, key) * 1000 for r in records)
            xs = sorted(v for v in values if v == v)  # nan: no token, or no second one
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name)
    for ax, label in zip(axes, ("TTFT (ms)", "TPOT (ms)")):
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def timeline(runs: dict[str, list[Record]], path: Path, title: str, long_at: int = 1000) -> None:
    """One row per request in arrival order: waiting + prefill (+ KV transfer) until its first
    token, then decode until its last; long prompts in a darker shade."""
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 2 + 0.12 * max(
        len(r) for r in runs.values()) * len(runs)), squeeze=False)
    for ax, (name, records) in zip(axes[:, 0], runs.items()):
        for i, r in enumerate(sorted(records, key=lambda r: r.start)):
            long = r.prompt_tokens >= long_at
            ax.plot([r.start, r.first], [i, i], color="tab:red" if long else "salmon", lw=3)
            ax.plot([r.first, r.end], [i, i], color="tab:blue" if long else "lightblue", lw=3)
        ax.set_title(f"{name}: until the first token (red) and decode (blue); dark = "
                     f"prompts of {long_at}+ tokens", fontsize=9)
        ax.set_ylabel("request")
        ax.invert_yaxis()
    axes[-1, 0].set_xlabel("seconds since the first request")
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.4 / fig.get_figheight()))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def goodput(sweep: dict[str, list[tuple[float, float]]], path: Path, title: str) -> None:
    """sweep: server -> (offered rate, goodput) points."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, points in sweep.items():
        ax.plot([r for r, _ in points], [g for _, g in points], marker="o", label=name)
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("goodput (requests/s within the SLOs)")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
