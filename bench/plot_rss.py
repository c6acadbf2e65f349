"""Plot RSS over time for the benchmark's runs (needs matplotlib: run it with MaxText's bench venv).

    python bench/plot_rss.py SERIES.json OUT.png

SERIES.json: {"title": str, "series": [{"label", "color", "t": [s], "rss": [bytes], "peak": bytes,
"markers": [[t, text], ...]}]}. Each series is one child process sampled from /proc/PID/status
(VmRSS, every ~50 ms); the dashed line is its kernel high-water mark (wait4 ru_maxrss), which a
sampler can only undershoot.
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

GIB = 1024**3


def cluster(markers: list, width: float) -> list[tuple[float, str]]:
    """Marks closer than ``width`` seconds share one line and one label ("a / b"), so labels never overlap."""
    out: list[tuple[float, str]] = []
    for t, text in sorted(markers):
        if out and t - out[-1][0] < width:
            out[-1] = (out[-1][0], f"{out[-1][1]} / {text}")
        else:
            out.append((t, text))
    return out


def plot(data: dict, out: str) -> None:
    series = data["series"]
    fig, axes = plt.subplots(len(series), 1, figsize=(11, 2.9 * len(series) + 0.6), sharex=True, squeeze=False)
    xmax = max(s["t"][-1] for s in series if s["t"])
    top = max(max(s["peak"], max(s["rss"], default=0)) for s in series) / GIB * 1.15
    for ax, s in zip(axes[:, 0], series):
        rss = [r / GIB for r in s["rss"]]
        ax.plot(s["t"], rss, color=s["color"], lw=1.6, label=s["label"])
        ax.fill_between(s["t"], rss, color=s["color"], alpha=0.15)
        ax.axhline(s["peak"] / GIB, color=s["color"], ls="--", lw=1)
        ax.text(0.005, s["peak"] / GIB, f"peak {s['peak'] / GIB:.2f} GiB (ru_maxrss)", color=s["color"],
                ha="left", va="bottom", transform=ax.get_yaxis_transform(), fontsize=9)
        for i, (t, text) in enumerate(cluster(s["markers"], width=xmax * 0.02)):
            ax.axvline(t, color="0.45", ls=":", lw=0.9)
            ax.text(t, top * (0.97 - 0.1 * (i % 3)), f" {text}", fontsize=8, color="0.25", va="top")
        ax.set_ylim(0, top)
        ax.set_ylabel("RSS (GiB)")
        ax.set_title(f"{s['label']}: {s['t'][-1] if s['t'] else 0:.1f} s wall", fontsize=10, loc="left")
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("seconds since the process started")
    fig.suptitle(data["title"], fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    with open(sys.argv[1]) as f:
        plot(json.load(f), sys.argv[2])
