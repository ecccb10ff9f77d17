"""`--plot PATH.png`: time-to-first-token CDFs per policy (all requests, hits, misses), or with
`restore --rates`, p50 and p99 against offered load."""

from __future__ import annotations

import textwrap


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: str, title: str) -> None:
    # a bench's title names its model, network and load: wrapped to the figure's width
    fig.suptitle(textwrap.fill(title, int(fig.get_figwidth() * 12)), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def ttft_cdfs(results: list[dict], path: str, title: str) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), sharey=True)
    for ax, kind in zip(axes, ("all", "hit", "miss")):
        for r in results:
            samples = r["ttft_samples"]
            xs = sorted(samples["hit"] + samples["miss"]) if kind == "all" else samples[kind]
            if xs:
                ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post",
                        label=f"{r['policy']} (p99 {xs[min(len(xs) - 1, int(0.99 * len(xs)))]:.2f} s)")
        ax.set_xscale("log")
        ax.set_xlabel("time to first token (s)")
        ax.set_title({"all": "all requests", "hit": "cached prefix", "miss": "no cached prefix"}[kind])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    axes[0].set_ylabel("fraction of requests")
    _save(plt, fig, path, title)


def load_sweep(results: list[dict], path: str, title: str) -> None:
    """p50 and p99 time to first token against offered load, one line per policy."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharex=True)
    for ax, q in zip(axes, ("p50", "p99")):
        for policy in dict.fromkeys(r["policy"] for r in results):
            points = sorted((r["offered_rate"], r["ttft_all"][q]) for r in results
                            if r["policy"] == policy and r["ttft_all"].get("count"))
            ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=policy)
        ax.set_yscale("log")
        ax.set_xlabel("offered load (requests/s)")
        ax.set_ylabel(f"{q} time to first token (s)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    _save(plt, fig, path, title)
