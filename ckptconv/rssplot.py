"""RSS over time as a small SVG: the sampled RSS, the predicted and measured peaks as lines, stages as bands.

Plain SVG text (no plotting library): it is saved beside the report (``ckptconv-rss.svg``) and shown
inline in the Prefect UI. Input is the report's ``timeline`` (see ``ckptconv.monitor``).
"""

from __future__ import annotations

import base64
import logging
from html import escape

from ckptconv.units import human_bytes, human_seconds

PLOT_NAME = "ckptconv-rss.svg"
WIDTH, HEIGHT = 720, 300
LEFT, RIGHT, TOP = 70, 20, 28
LANE = 12  # height of one stage's band row under the plot
STAGE_COLOURS = {"plan": "#8c6bb1", "read": "#2b8cbe", "transform": "#41ab5d", "write": "#fd8d3c", "commit": "#e31a1c"}
RSS_COLOUR, PREDICTED_COLOUR, PEAK_COLOUR = "#08306b", "#cb181d", "#636363"


def render(timeline: dict, wall_seconds: float, peak_rss_bytes: int | None = None,
           predicted_peak_bytes: int | None = None, title: str = "RSS over time") -> str:
    """The SVG document for one run. Stages overlap (reads run beside writes), so each has its own band row."""
    rss = [(float(t), int(b)) for t, b in timeline.get("rss", [])]
    spans = {stage: spans for stage, spans in timeline.get("spans", {}).items() if spans}
    lanes = [stage for stage in STAGE_COLOURS if stage in spans] + sorted(set(spans) - set(STAGE_COLOURS))
    plot_bottom = HEIGHT - 30 - LANE * len(lanes) - 6
    x_max = max([wall_seconds, *(t for t, _ in rss)] or [1.0]) or 1.0
    y_max = 1.1 * max([b for _, b in rss] + [peak_rss_bytes or 0, predicted_peak_bytes or 0, 1])

    def x(t: float) -> float:
        return LEFT + (WIDTH - LEFT - RIGHT) * t / x_max

    def y(b: float) -> float:
        return plot_bottom - (plot_bottom - TOP) * b / y_max

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
             f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="11">',
             f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
             f'<text x="{LEFT}" y="16" font-size="13" font-weight="bold">{escape(title)}</text>',
             f'<line x1="{WIDTH - RIGHT - 150}" x2="{WIDTH - RIGHT - 130}" y1="12" y2="12" stroke="{RSS_COLOUR}" '
             f'stroke-width="2"/><text x="{WIDTH - RIGHT - 125}" y="16">RSS (sampled)</text>']
    for i in range(5):  # axes: four RSS levels, five times
        level = y_max * i / 4
        parts.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y(level):.1f}" y2="{y(level):.1f}" stroke="#e0e0e0"/>'
                     f'<text x="{LEFT - 4}" y="{y(level) + 4:.1f}" text-anchor="end">{human_bytes(level)}</text>')
        t = x_max * i / 4
        parts.append(f'<text x="{x(t):.1f}" y="{HEIGHT - 8}" text-anchor="middle">{human_seconds(t)}</text>')
    for row, stage in enumerate(lanes):
        top = plot_bottom + 6 + row * LANE
        colour = STAGE_COLOURS.get(stage, "#999999")
        parts.append(f'<text x="{LEFT - 4}" y="{top + LANE - 3}" text-anchor="end">{escape(stage)}</text>')
        for start, end in spans[stage]:
            parts.append(f'<rect x="{x(start):.1f}" y="{top + 1}" width="{max(x(end) - x(start), 1.0):.1f}" '
                         f'height="{LANE - 2}" fill="{colour}"/>')
    for value, colour, dash, label in ((predicted_peak_bytes, PREDICTED_COLOUR, "6 4", "predicted peak"),
                                       (peak_rss_bytes, PEAK_COLOUR, "2 3", "measured peak (VmHWM)")):
        if value:
            parts.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y(value):.1f}" y2="{y(value):.1f}" '
                         f'stroke="{colour}" stroke-dasharray="{dash}" stroke-width="1.5"/>'
                         f'<text x="{WIDTH - RIGHT - 2}" y="{y(value) - 3:.1f}" text-anchor="end" fill="{colour}">'
                         f'{label} {human_bytes(value)}</text>')
    if rss:
        points = " ".join(f"{x(t):.1f},{y(b):.1f}" for t, b in rss)
        parts.append(f'<polyline points="{points}" fill="none" stroke="{RSS_COLOUR}" stroke-width="2"/>')
    parts.append(f'<line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{plot_bottom}" stroke="black"/>'
                 f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{plot_bottom}" y2="{plot_bottom}" stroke="black"/>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def render_report(report: dict, predicted_peak_bytes: int | None = None) -> str | None:
    """The plot of a report that carries a ``timeline`` (None for one that does not, e.g. an older report)."""
    timeline = report.get("timeline")
    if not timeline or not timeline.get("rss"):
        return None
    predicted = predicted_peak_bytes or report.get("predicted_peak_rss_bytes")
    return render(timeline, report.get("wall_seconds") or 0.0, report.get("peak_rss_bytes"), predicted,
                  title=f"RSS of the conversion over {human_seconds(report.get('wall_seconds'))}")


def data_uri(svg: str) -> str:
    """The SVG as a ``data:`` URI, for an ``<img>`` or a markdown image."""
    return "data:image/svg+xml;base64," + base64.b64encode(svg.encode()).decode()


def save_beside(report_path: str, report: dict) -> str | None:
    """Write the report's plot as ``ckptconv-rss.svg`` in the report's directory (local or ``gs://``);
    returns its path, or None when the report has no timeline. Best effort: a picture never fails a run."""
    from etils import epath

    svg = render_report(report)
    if svg is None:
        return None
    target = epath.Path(report_path).parent / PLOT_NAME
    try:
        target.write_text(svg)
    except Exception as err:  # noqa: BLE001 - any storage error (gcsfs raises its own types): warn, go on
        logging.getLogger("ckptconv").warning("ckptconv: could not save the RSS plot %s: %s", target, err)
        return None
    return str(target)
