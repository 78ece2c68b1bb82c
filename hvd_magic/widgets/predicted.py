"""Predicted beside measured: the scaling efficiency the what-if model
(:mod:`hvd_magic.runner.whatif`) predicts for a running cell's pool, next to the measured
one, and which part of the gap between them is communication. Pure: numbers in, numbers
and words out; the live panel and the text summary show :meth:`Comparison.text`.

The inputs, all measured while the cell runs (docs/magics.md, "The live panel"):

- the step: ``step_s``, the time of one training step on the pool (samples per
  ``hvd_magic.report()`` call over the samples/s), and ``comm_share``, the share of that
  time with a collective in flight;
- the step on one rank, ``single_step_s``: from the 1-rank baseline when the session has
  one, else the pool's step less its time in collectives;
- the gradient bytes per step: what the rank's allreduces carried over its ``report()``
  calls;
- the link: the last ``%hvd doctor`` of exactly these hosts (:func:`link_of`), else, for a
  pool on one host, the model's intra-host defaults.

The gap: the model predicts ``single / (single + exposed communication)``. Measured is
``single / step``. Had only the communication been as measured (the compute as fast as on
one rank), the efficiency would be ``single / (single + comm_share * step)``: the gap from
the prediction down to that is communication; the rest (compute slower than on one rank:
ranks sharing cores or memory bandwidth, the input pipeline, ranks waiting for each other
outside collectives) is the rest of the gap.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

from ..runner.whatif import DEFAULT_LINK_GBIT, DEFAULT_LATENCY_US, Scenario, point


@dataclass(frozen=True)
class Link:
    """What the prediction assumes about the network: ``gbit`` (Gbit/s) and ``latency_us``
    (one way) between hosts, or between the ranks of the one host; ``doctor`` False: the
    model's defaults (nothing was measured)."""

    gbit: float
    latency_us: float
    doctor: bool


def link_of(report: Any, hosts: Iterable[str]) -> Optional[Link]:
    """The link ``%hvd doctor``'s ``report`` measured, when it probed exactly ``hosts``: the
    bandwidth and latency of the ring model fitted to its allreduce sweep (what MPI's
    allreduce really reached; docs/doctor.md, "Checked against runs measured here"), else
    the slowest ping-pong link between hosts. None when it probed other hosts or measured
    nothing usable."""
    if report is None or set(getattr(report, "hosts", {}) or {}) != set(hosts):
        return None
    links = getattr(report, "links", None) or []
    if getattr(report, "allreduce", None):
        bw, lat = report.allreduce["bandwidth"], report.allreduce["latency"]
    elif links:
        slow = min(links, key=lambda k: k.bandwidth)
        bw, lat = slow.bandwidth, max(k.latency for k in links)
    else:
        return None
    if not 0 < bw < float("inf"):
        return None
    return Link(bw * 8 / 1e9, lat * 1e6, True)


@dataclass(frozen=True)
class Comparison:
    """Measured and predicted efficiency (0..1) and the gap ``predicted - measured`` split
    into ``comm`` (communication) and ``rest`` (everything else), both in efficiency units
    (0.05 = 5 points). ``baseline``: measured against a 1-rank run (else against the pool's
    own compute time); ``link``: what the prediction assumed."""

    measured: float
    predicted: float
    comm: float
    rest: float
    baseline: bool
    link: Link

    def source(self) -> str:
        """What the prediction assumed about the link: ``"doctor: 9.8 Gbit/s, 40 us"`` or
        ``"no doctor measurement: defaults"``."""
        if self.link.doctor:
            return f"doctor: {self.link.gbit:.3g} Gbit/s, {self.link.latency_us:.0f} us"
        return "no doctor measurement: defaults"

    def text(self) -> str:
        """``"efficiency: measured 62%, predicted 95% (doctor: 9.8 Gbit/s, 40 us); of the
        33-point gap, 30 points are communication, 3 the rest"``."""
        how = "" if self.baseline else " (compute share of the step: no 1-rank baseline)"
        src = self.source()
        head = (f"efficiency: measured {_pct(self.measured)}{how}, predicted "
                f"{_pct(self.predicted)} ({src})")
        gap = round(100 * self.predicted) - round(100 * self.measured)
        if gap <= 0:
            return head + ("; as predicted" if gap == 0 else "; better than predicted")
        comm = max(0, min(gap, round(100 * self.comm)))
        return (f"{head}; of the {gap}-point gap, {comm} point{'s' if comm != 1 else ''} "
                f"{'are' if comm != 1 else 'is'} communication, {gap - comm} the rest")


def compare(step_s: float, comm_share: float, grad_bytes: float, hosts: int,
            ranks_per_host: int, link: Optional[Link],
            single_step_s: Optional[float] = None) -> Optional[Comparison]:
    """The comparison for a pool of ``hosts`` x ``ranks_per_host`` ranks (see the module
    docstring); None when there is nothing to compare: no step measured, no gradient
    bytes, or several hosts and no ``link`` (only ``%hvd doctor`` can say what theirs is).
    ``link`` None on one host: the model's intra-host defaults."""
    if step_s <= 0 or grad_bytes <= 0 or hosts < 1 or ranks_per_host < 1:
        return None
    if link is None:
        if hosts > 1:
            return None
        link = Link(DEFAULT_LINK_GBIT, DEFAULT_LATENCY_US, False)
    share = max(0.0, min(1.0, comm_share))
    baseline = single_step_s is not None and single_step_s > 0
    single = single_step_s if baseline else step_s * (1.0 - share)
    if single <= 0:
        return None
    if hosts == 1 and link.doctor:      # one host: what the doctor measured is the intra link
        sc = Scenario(1, ranks_per_host, link.gbit, link.latency_us, grad_bytes, single,
                      intra_gbit=link.gbit, intra_latency_us=link.latency_us)
    else:
        sc = Scenario(hosts, ranks_per_host, link.gbit, link.latency_us, grad_bytes, single)
    predicted = point(sc, sc.size).efficiency
    measured = single / step_s
    comm_only = single / (single + share * step_s)
    return Comparison(measured, predicted, predicted - comm_only, comm_only - measured,
                      baseline, link)


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"
