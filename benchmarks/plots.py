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


# a request's phases from the server's spans (spans.py), drawn over its client-side bar
PHASE_COLORS = {"queue": ("0.6", "queued at the scheduler"),
                "prefill": ("tab:red", "prefill step on a prefill worker"),
                "local": ("tab:orange", "prefill step on its decode worker"),
                "kv": ("tab:green", "KV sent"),
                "decode": ("tab:blue", "decode")}


def timeline(runs: dict[str, list[Record]], path: Path, title: str, long_at: int = 1000) -> None:
    """One row per request in arrival order. From the client: waiting + prefill (+ KV transfer)
    until its first token, then decode until its last; long prompts in a darker shade. Where
    the server's spans came with a request (serve.py --spans), its phases instead, over a thin
    grey bar of what the client saw, long prompts' rows thicker."""
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 2 + 0.12 * max(
        len(r) for r in runs.values()) * len(runs)), squeeze=False)
    for ax, (name, records) in zip(axes[:, 0], runs.items()):
        traced = any(r.phases for r in records)
        for i, r in enumerate(sorted(records, key=lambda r: r.start)):
            long = r.prompt_tokens >= long_at
            if traced:
                ax.plot([r.start, r.end], [i, i], color="0.85", lw=1)
                for phase, start, end, *_ in r.phases:
                    # KV goes out chunk by chunk while a prompt computes: thinner, over it
                    width = (4 if long else 2.5) / (3 if phase == "kv" else 1)
                    ax.plot([start, max(end, start + 0.01)], [i, i], lw=width,
                            color=PHASE_COLORS[phase][0], solid_capstyle="butt")
                continue
            ax.plot([r.start, r.first], [i, i], color="tab:red" if long else "salmon", lw=3)
            ax.plot([r.first, r.end], [i, i], color="tab:blue" if long else "lightblue", lw=3)
        if traced:
            ax.set_title(f"{name}: each request's spans in the server (thick rows: prompts of "
                         f"{long_at}+ tokens; grey: the client's view, arrival to last token)",
                         fontsize=9)
        else:
            ax.set_title(f"{name}: until the first token (red) and decode (blue); dark = "
                         f"prompts of {long_at}+ tokens", fontsize=9)
        ax.set_ylabel("request")
        ax.invert_yaxis()
    axes[-1, 0].set_xlabel("seconds since the first request")
    fig.suptitle(title)
    bottom = 0.0
    if any(r.phases for records in runs.values() for r in records):
        fig.legend(handles=[plt.Line2D([], [], color=c, lw=4, label=label)
                            for c, label in PHASE_COLORS.values()],
                   loc="lower center", ncol=len(PHASE_COLORS), fontsize=8)
        bottom = 0.35 / fig.get_figheight()
    fig.tight_layout(rect=(0, bottom, 1, 1 - 0.4 / fig.get_figheight()))
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


def cores(runs: dict[str, dict], path: Path, title: str, top: int = 7) -> None:
    """runs: server -> cores.usage of its run. One panel each: the cores each process used over
    the run, stacked (its `top` busiest names, the rest as "other"), idle above them."""
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 1.2 + 2.4 * len(runs)), squeeze=False)
    for ax, (name, u) in zip(axes[:, 0], runs.items()):
        names = list(u["processes"])[:top]
        ts = [t for t, _, _ in u["timeline"]]
        layers = [[by.get(n, 0.0) for _, _, by in u["timeline"]] for n in names]
        rest = [sum(c for n, c in by.items() if n not in names) for _, _, by in u["timeline"]]
        idle = [i for _, i, _ in u["timeline"]]
        ax.stackplot(ts, *layers, rest, idle, step="post",
                     labels=[f"{n} ({u['processes'][n]:.2f})" for n in names] +
                     ["other", f"idle ({u['idle']:.2f})"],
                     colors=[plt.get_cmap("tab10")(i) for i in range(len(names))] +
                     ["0.55", "0.92"])
        ax.set_ylim(0, u["cores"] * 1.05)
        ax.set_ylabel("cores")
        ax.set_title(f"{name}: {u['wall_s']:.1f} s, cores on average in brackets", fontsize=9)
        ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    axes[-1, 0].set_xlabel("seconds since the load began")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
