"""``%hvd doctor``'s report as a widget (an HTML table in a Jupyter kernel with ipywidgets),
else as text. :func:`report_html` is pure; :func:`show_report` displays."""
from __future__ import annotations

import html
from typing import Any, List

from ..runner.doctor import Report, gbit, prediction_text, render_text
from ..runner.whatif import GOOD, WhatIfReport, render as render_what_if

OK, BAD = "#2e7d32", "#c62828"


def _row(cells: List[str], head: bool = False) -> str:
    tag = "th" if head else "td"
    return "<tr>" + "".join(f'<{tag} style="padding:2px 8px;text-align:left">{c}</{tag}>'
                            for c in cells) + "</tr>"


def _badge(ok: bool, text: str) -> str:
    return (f'<span style="background:{OK if ok else BAD};color:white;border-radius:3px;'
            f'padding:0 5px">{html.escape(text)}</span>')


def report_html(rep: Report) -> str:
    """The report as one HTML fragment: verdict, versions, links, GPUs, prediction."""
    e = html.escape
    out = [f'<div style="font:13px sans-serif"><b>hvd doctor</b>: {rep.np} ranks on '
           f'{len(rep.hosts)} host(s) ' + _badge(not rep.problems, "ready" if not rep.problems
                                                else f"{len(rep.problems)} problem(s)")]
    out.append("<table>" + _row(["host", "ranks", "GPUs"], head=True))
    for host, ranks in rep.hosts.items():
        gpus = "; ".join(f"rank {r}: {rep.gpus.get(r, '?')}" for r in ranks)
        out.append(_row([e(host), e(str(ranks)), e(gpus)]))
    out.append("</table><table>" + _row(["package", "versions"], head=True))
    for pkg, seen in rep.versions.items():
        text = "; ".join(v if len(seen) == 1 else f"{v} (ranks {rs})" for v, rs in seen.items())
        out.append(_row([_badge(len(seen) == 1, pkg), e(text)]))
    out.append("</table>")
    if rep.links or rep.allreduce:
        out.append("<table>" + _row(["link", "interface", "bandwidth", "latency"], head=True))
        for k in rep.links:
            out.append(_row([e(f"{k.a} - {k.b}"), e(k.interface), gbit(k.bandwidth),
                             f"{k.latency * 1e6:.0f} us"]))
        if rep.allreduce:
            out.append(_row([f"allreduce, {rep.np} ranks", e(rep.mpi_interface),
                             gbit(rep.allreduce["bandwidth"]),
                             f"{rep.allreduce['latency'] * 1e6:.0f} us"]))
        out.append("</table>")
    if rep.prediction:
        out.append(f"<p><b>prediction</b>: {e(prediction_text(rep.prediction))}</p>")
    out += [f"<p>note: {e(t)}</p>" for t in rep.notes]
    out += [f'<p style="color:{BAD}">problem: {e(t)}</p>' for t in rep.problems]
    return "".join(out) + "</div>"


def _show(html_text: str, text: str) -> Any:
    """An ipywidgets HTML in a Jupyter kernel with ipywidgets, plain text elsewhere."""
    from .sink import widgets_available
    if widgets_available():
        import ipywidgets
        from IPython.display import display
        w = ipywidgets.HTML(html_text)
        display(w)
        return w
    print(text)
    return None


def show_report(rep: Report) -> Any:
    """The doctor's report: a widget in Jupyter, plain text elsewhere."""
    return _show(report_html(rep), render_text(rep))


def what_if_html(rep: WhatIfReport) -> str:
    """``--what-if``'s forecast as one HTML fragment: the table of sizes (efficiency below
    0.9 in red), then where it bends and the link that keeps 0.9 (the text report's lines)."""
    e = html.escape
    head, *rest = render_what_if(rep).split("\n")
    out = [f'<div style="font:13px sans-serif"><b>hvd doctor --what-if</b>: '
           f'{e(head.split(": ", 1)[1])}<table>'
           + _row(["ranks", "hosts", "efficiency", "step ms", "allreduce ms", "exposed ms",
                   "images/s"], head=True)]
    for p in rep.points:
        eff = f"{p.efficiency:.3f}"
        out.append(_row([str(p.ranks), str(p.hosts),
                         eff if p.efficiency >= GOOD else f'<span style="color:{BAD}">{eff}</span>',
                         f"{p.step_s * 1e3:.1f}", f"{p.comm_s * 1e3:.1f}",
                         f"{p.exposed_s * 1e3:.1f}",
                         "-" if p.images_per_s is None else f"{p.images_per_s:.1f}"]))
    out.append("</table>")
    out += [f"<p>{e(line.strip())}</p>" for line in rest[1 + len(rep.points):]]
    return "".join(out) + "</div>"


def show_what_if(rep: WhatIfReport) -> Any:
    """Like :func:`show_report`, for ``%hvd doctor --what-if``."""
    return _show(what_if_html(rep), render_what_if(rep))
