"""The static HTML of a finished cell (what a saved notebook keeps): status badges, metrics,
the banner, a small SVG timeline. Pure functions of a :class:`.model.CellState`."""
from __future__ import annotations

import html
from typing import Mapping, Optional, Sequence, Tuple

from ..kernel.ranks.spans import Span
from .model import (COMPUTE, GROUP_COLOR, RESET_COLOR, STATUS_COLOR, STATUS_TEXT, CellState,
                    autotune_text, fmt_pct, fmt_rate, phase_group)


def timeline_svg(spans: Mapping[int, Sequence[Span]], width: int = 900, row: int = 22,
                 max_spans: int = 250, resets: Sequence[Tuple[float, float, str]] = ()) -> str:
    """A small static SVG of the last ``max_spans`` spans per rank (saved notebooks);
    ``resets``: elastic resets ``(start_us, end_us, text)``, grey bands across every rank."""
    ranks = sorted(spans)
    keep = {r: list(spans[r])[-max_spans:] for r in ranks}
    allsp = [s for r in ranks for s in keep[r]]
    if not allsp:
        return ""
    t0 = min(s[0] for s in allsp)
    t1 = max(s[1] for s in allsp)
    scale = (width - 60) / max(t1 - t0, 1.0)
    h = row * len(ranks) + 20
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{h}" '
           'style="font:11px sans-serif">']
    for i, r in enumerate(ranks):
        y = 4 + i * row
        out.append(f'<text x="0" y="{y + row * 0.6:.0f}">rank {r}</text>')
        for s, e, phase, label in keep[r]:
            grp = phase_group(phase)
            x = 55 + (s - t0) * scale
            w = max((e - s) * scale, 0.5)
            hh = row * (0.35 if phase == COMPUTE else 0.8)
            yy = y + (row - hh) / 2
            out.append(f'<rect x="{x:.1f}" y="{yy:.1f}" width="{w:.1f}" height="{hh:.1f}" '
                       f'fill="{GROUP_COLOR[grp]}"><title>{html.escape(phase)} '
                       f'{html.escape(label)} {(e - s) / 1e3:.3f} ms</title></rect>')
    for s, e, text in resets:
        if e >= t0 and s <= t1:
            x = 55 + (max(s, t0) - t0) * scale
            out.append(f'<rect class="hvdm-reset" x="{x:.1f}" y="0" height="{h - 16}" '
                       f'width="{max((min(e, t1) - max(s, t0)) * scale, 2):.1f}" '
                       f'fill="{RESET_COLOR}" fill-opacity="0.35"><title>{html.escape(text)}'
                       '</title></rect>')
    out.append(f'<text x="55" y="{h - 3}">{(t1 - t0) / 1e6:.3f} s shown</text></svg>')
    return "".join(out)


def badge_html(rank: int, status: str, why: str = "") -> str:
    color = STATUS_COLOR.get(status, "#888")
    title = html.escape(why, quote=True)
    return (f'<span class="hvdm-badge hvdm-{status}" data-rank="{rank}" title="{title}" '
            f'style="display:inline-block;padding:1px 8px;margin-right:6px;border-radius:9px;'
            f'color:white;background:{color};font-size:12px">rank {rank}: '
            f'{html.escape(STATUS_TEXT.get(status, status))}</span>')


def metrics_html(cell: CellState) -> str:
    rates = cell.rates()
    comm = cell.comm()
    eff = cell.efficiency()
    base = (f"{fmt_pct(eff)} <span style='color:#888'>(vs 1 rank: {fmt_rate(cell.single_rate)}"
            " samples/s)</span>" if eff is not None else
            "<span style='color:#888'>no 1-rank baseline (run with -np 1 or %hvd scale)</span>")
    tune = autotune_text(cell.autotune)
    extra = f"<div class='hvdm-autotune'>{html.escape(tune)}</div>" if tune else ""
    pred = cell.predicted()
    if pred is not None:
        extra = f"<div class='hvdm-predicted'>{html.escape(pred.text())}</div>" + extra
    origin = cell.origin()
    extra += "".join(f"<div class='hvdm-reset-note' style='color:{RESET_COLOR}'>"
                    f"{html.escape(r.text(origin))}</div>" for r in cell.resets)
    since = (" <span style='color:#888'>(since the last reset)</span>"
             if cell.resets.last_resume() is not None else "")
    rows = "".join(f"<td style='padding:0 10px'>rank {r}: {fmt_rate(rates[r])} samples/s, "
                   f"comm {fmt_pct(comm[r])}</td>" for r in cell.live_ranks())
    return ("<div class='hvdm-metrics' style='font-size:13px'>"
            f"<b>throughput</b> <span class='hvdm-total'>{fmt_rate(cell.total_rate())}</span> "
            f"samples/s{since} &nbsp; <b>scaling efficiency</b> <span class='hvdm-eff'>{base}</span> "
            f"&nbsp; <b>communication</b> <span class='hvdm-comm'>{fmt_pct(cell.comm_mean())}"
            "</span> of step time<table><tr>" + rows + "</tr></table>" + extra + "</div>")


def banner_html(cell: CellState) -> str:
    level, text = cell.banner()
    if not level:
        return ""
    bg = "#fdecea" if level == "error" else "#fff4e5"
    fg = "#b71c1c" if level == "error" else "#8a4b00"
    return (f"<div class='hvdm-banner hvdm-{level}' style='background:{bg};color:{fg};"
            f"padding:4px 8px;border-radius:4px'>{html.escape(text)}</div>")


def snapshot_html(cell: CellState, spans: Optional[Mapping[int, Sequence[Span]]] = None) -> str:
    """The whole panel as static HTML (kept in the saved notebook; no kernel, no JavaScript)."""
    badges = "".join(badge_html(r, cell.rank[r].status, cell.rank[r].why) for r in cell.ranks)
    lanes = "".join(
        f"<div><b>rank {r}</b><pre style='max-height:220px;overflow:auto;margin:2px 0;"
        f"background:#f7f7f7;padding:4px'>{cell.logs[r].html()}</pre></div>" for r in cell.ranks)
    origin = cell.origin()
    resets = [(r.t0 * 1e6, r.t1 * 1e6, r.text(origin)) for r in cell.resets.finished()]
    svg = timeline_svg(spans if spans is not None else cell.track.all_spans(), resets=resets)
    return ("<details class='hvdm-snapshot'><summary>hvd: static copy of this cell's panel "
            "(what a saved notebook shows without a kernel)</summary>"
            f"{banner_html(cell)}<div>{badges}</div>{metrics_html(cell)}{lanes}{svg}"
            "</details>")
