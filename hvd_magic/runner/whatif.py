"""Deciding, not doing: the scaling of a cluster that does not exist yet (``%hvd doctor
--what-if``). Pure arithmetic over the numbers given; nothing here runs MPI or imports a
framework. The formulae, defaults and assumptions are in docs/doctor.md ("What if").

One training step on ``n`` ranks = the step on one rank (``step_time_s``) plus the part of
the gradients' allreduce that the backward pass does not hide:

- bytes: ``model_bytes``, halved with fp16 compression;
- tensor fusion: the bytes go as ``ceil(bytes / fusion_threshold)`` buffers (one when the
  threshold is 0 or larger than the gradients), each waiting one cycle time before its
  allreduce starts;
- one buffer's allreduce: a flat ring over all ranks, ``2(n-1)/n * B / bw + 2(n-1) * lat``
  with the slowest hop's bandwidth and latency; or hierarchical (reduce-scatter inside each
  host over the intra-host link, a ring across the hosts, allgather inside): ``2(g-1)/g *
  B / intra_bw + 2(g-1) * intra_lat + 2(h-1)/h * B / link_bw + 2(h-1) * lat`` for ``h``
  hosts of ``g`` ranks;
- overlap: gradients become ready during the backward pass, ``backward_fraction`` of the
  step; the communication that fits in it is hidden, except that the last gradients are
  ready only when backward ends, so at least one cycle and one allreduce's latency stay
  exposed: ``exposed = max(comm - backward, cycle + latency steps)``; with the number of
  gradient tensors ``L`` known, each is ready ``backward / L`` after the one before and
  allreduced alone (``each`` s, cycle included): ``exposed = max(L * each - backward +
  backward / L, each)``;
- efficiency at ``n`` ranks = ``step / (step + exposed)``; throughput = ``n * batch /
  (step + exposed)``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Mapping, Optional

from .. import config

#: Bandwidth between ranks of one host when none is given: PCIe 3.0 x16 (about 12.5 GB/s),
#: what GPUs without NVLink share.
DEFAULT_INTRA_GBIT = 100.0
#: One step's latency between ranks of one host (shared memory, PCIe).
DEFAULT_INTRA_LATENCY_US = 5.0
#: Share of a step that the backward pass takes when none is given: backward costs about
#: twice the forward pass, and the optimizer step and input pipeline take the rest.
DEFAULT_BACKWARD_FRACTION = 0.5
#: Horovod's defaults, as this runtime reads them (docs/environment.md).
DEFAULT_FUSION_THRESHOLD = int(config.VARS["HOROVOD_FUSION_THRESHOLD"].default)
DEFAULT_CYCLE_TIME_MS = float(config.VARS["HOROVOD_CYCLE_TIME"].default)
#: The efficiency the report calls good: where it "bends", and the link it asks for.
GOOD = 0.9


@dataclass(frozen=True)
class Scenario:
    """A cluster and a model: everything a prediction needs. ``None`` = the default above;
    ``hierarchical`` None = a flat ring (Horovod's default)."""

    hosts: int
    ranks_per_host: int
    link_gbit: float
    latency_us: float
    model_bytes: float
    step_time_s: float
    intra_gbit: Optional[float] = None
    backward_fraction: Optional[float] = None
    fp16: bool = False
    hierarchical: Optional[bool] = None
    fusion_threshold: Optional[int] = None       # bytes; 0 = no fusion (one buffer here)
    cycle_time_ms: Optional[float] = None
    batch: Optional[int] = None                  # images per rank per step, for images/s
    tensors: Optional[int] = None                # gradient tensors, when known (--model)
    intra_latency_us: float = DEFAULT_INTRA_LATENCY_US

    def __post_init__(self) -> None:
        checks = [(self.hosts >= 1, "hosts must be >= 1"),
                  (self.ranks_per_host >= 1, "ranks per host must be >= 1"),
                  (self.link_gbit > 0, "the link bandwidth must be > 0 Gbit/s"),
                  (self.latency_us >= 0, "the latency must be >= 0 us"),
                  (self.model_bytes > 0, "the gradient bytes must be > 0 (--model-bytes B or "
                                         "--model NAME)"),
                  (self.step_time_s > 0, "the step time must be > 0 s (--step-time S, or "
                                         "--images-per-sec with --batch)"),
                  (self.intra_gbit is None or self.intra_gbit > 0,
                   "the intra-host bandwidth must be > 0 Gbit/s"),
                  (self.backward_fraction is None or 0 <= self.backward_fraction <= 1,
                   "the backward fraction must be between 0 and 1"),
                  (self.fusion_threshold is None or self.fusion_threshold >= 0,
                   "the fusion threshold must be >= 0 bytes"),
                  (self.cycle_time_ms is None or self.cycle_time_ms >= 0,
                   "the cycle time must be >= 0 ms"),
                  (self.tensors is None or self.tensors >= 1, "tensors must be >= 1"),
                  (self.batch is None or self.batch >= 1, "the batch must be >= 1")]
        for ok, why in checks:
            if not ok:
                raise ValueError(f"what-if: {why}")

    # the defaults filled in
    @property
    def intra(self) -> float:
        return DEFAULT_INTRA_GBIT if self.intra_gbit is None else self.intra_gbit

    @property
    def backward(self) -> float:
        return (DEFAULT_BACKWARD_FRACTION if self.backward_fraction is None
                else self.backward_fraction)

    @property
    def fusion(self) -> int:
        return DEFAULT_FUSION_THRESHOLD if self.fusion_threshold is None else self.fusion_threshold

    @property
    def cycle_s(self) -> float:
        return (DEFAULT_CYCLE_TIME_MS if self.cycle_time_ms is None else self.cycle_time_ms) / 1e3

    @property
    def size(self) -> int:
        return self.hosts * self.ranks_per_host


def _bps(gbit: float) -> float:
    return gbit * 1e9 / 8


def flat_ring_time(nbytes: float, hosts: int, per_host: int, link_gbit: float,
                   latency_s: float, intra_gbit: float, intra_latency_s: float) -> float:
    """One ring allreduce of ``nbytes`` over ``hosts * per_host`` ranks: every rank moves
    ``2(n-1)/n`` of the bytes, at the pace of the slowest hop (the link between hosts when
    there are several, else the intra-host one)."""
    n = hosts * per_host
    if n < 2:
        return 0.0
    if hosts > 1:
        bw, lat = min(_bps(link_gbit), _bps(intra_gbit)), max(latency_s, intra_latency_s)
    else:
        bw, lat = _bps(intra_gbit), intra_latency_s
    return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * lat


def hierarchical_time(nbytes: float, hosts: int, per_host: int, link_gbit: float,
                      latency_s: float, intra_gbit: float, intra_latency_s: float) -> float:
    """Reduce-scatter inside each host, a ring allreduce across the hosts (the ``g`` ranks of
    a host each carry ``1/g`` of the bytes, together ``2(h-1)/h`` of them through the host's
    link), allgather inside."""
    g, h = per_host, hosts
    inside = 2 * (g - 1) / g * nbytes / _bps(intra_gbit) + 2 * (g - 1) * intra_latency_s
    across = (2 * (h - 1) / h * nbytes / _bps(link_gbit) + 2 * (h - 1) * latency_s) if h > 1 \
        else 0.0
    return inside + across


@dataclass
class Point:
    """The prediction at one size."""

    ranks: int
    hosts: int
    efficiency: float
    step_s: float             # one step on these ranks
    comm_s: float             # all buffers' allreduce time, hidden or not
    exposed_s: float          # the part the backward pass does not hide
    images_per_s: Optional[float]
    hierarchical: bool


def point(sc: Scenario, ranks: int) -> Point:
    """The prediction at ``ranks`` ranks, filling hosts of ``ranks_per_host`` in order."""
    per_host = min(sc.ranks_per_host, ranks)
    hosts = math.ceil(ranks / per_host)
    nbytes = sc.model_bytes / 2 if sc.fp16 else sc.model_bytes
    count = max(1, math.ceil(nbytes / sc.fusion)) if sc.fusion > 0 else 1
    last = nbytes - (count - 1) * sc.fusion if count > 1 else nbytes
    hier = bool(sc.hierarchical) and per_host > 1 and hosts > 1
    algo = hierarchical_time if hier else flat_ring_time
    args = (hosts, per_host, sc.link_gbit, sc.latency_us / 1e6, sc.intra, sc.intra_latency_us / 1e6)
    if ranks < 2:
        comm = exposed = 0.0
    else:
        full = algo(sc.fusion, *args) if count > 1 else 0.0
        comm = (count - 1) * full + algo(last, *args) + count * sc.cycle_s
        backward = sc.backward * sc.step_time_s
        if backward > 0 and sc.tensors:
            # L tensors ready one by one, every backward/L s, each allreduced alone (after
            # one cycle): the last one's allreduce, or the queue, is what stays exposed
            each = algo(nbytes / sc.tensors, *args) + sc.cycle_s
            comm = sc.tensors * each
            exposed = max(comm - backward + backward / sc.tensors, each)
        else:
            # the last gradients are ready when backward ends: one cycle and one
            # allreduce's latency steps stay exposed however much backward hides
            tail = sc.cycle_s + algo(0.0, *args)
            exposed = max(comm - backward, tail)
    step = sc.step_time_s + exposed
    ips = ranks * sc.batch / step if sc.batch else None
    return Point(ranks, hosts, sc.step_time_s / step, step, comm, exposed, ips, hier)


def sizes(total: int) -> List[int]:
    """1, 2, 4, ... below ``total``, then ``total``."""
    out, k = [], 1
    while k < total:
        out.append(k)
        k *= 2
    return out + [total]


def link_for(sc: Scenario, target: float = GOOD) -> Optional[float]:
    """The inter-host bandwidth (Gbit/s) at which the full size reaches ``target``
    efficiency; None when no bandwidth does (latency, the intra-host link or the cycle time
    alone cost more), 0.0 when one host needs no link."""
    if sc.hosts < 2:
        return 0.0
    if point(replace(sc, link_gbit=1e9), sc.size).efficiency < target:
        return None
    lo, hi = 1e-6, 1e9
    for _ in range(200):                       # bisection on a log scale
        mid = math.sqrt(lo * hi)
        if point(replace(sc, link_gbit=mid), sc.size).efficiency >= target:
            hi = mid
        else:
            lo = mid
        if hi / lo < 1.0001:
            break
    return hi


@dataclass
class WhatIfReport:
    """``%hvd doctor --what-if``'s answer."""

    scenario: Scenario
    points: List[Point]
    bend: Optional[int]                  # first size below GOOD; None = none is
    link_for_good: Optional[float]       # Gbit/s that keeps the full size at GOOD
    other: Optional[Point] = None        # the other allreduce (flat/hierarchical) at full size
    notes: List[str] = field(default_factory=list)


def what_if(sc: Scenario) -> WhatIfReport:
    """Efficiency (and images/s with a batch) at 1, 2, 4, ... up to the full size, where it
    first falls below 0.9, and the link that would keep the full size at 0.9."""
    pts = [point(sc, n) for n in sizes(sc.size)]
    bend = next((p.ranks for p in pts if p.efficiency < GOOD), None)
    other = None
    if sc.ranks_per_host > 1 and sc.hosts > 1:
        other = point(replace(sc, hierarchical=not sc.hierarchical), sc.size)
    rep = WhatIfReport(sc, pts, bend, link_for(sc), other)
    if sc.batch is None:
        rep.notes.append("images/s needs the batch per rank (--batch)")
    return rep


def predict(hosts: int, ranks_per_host: int, link_gbit: float, latency_us: float,
            model_bytes: float, step_time_s: float, intra_gbit: Optional[float] = None,
            backward_fraction: Optional[float] = None, fp16: bool = False,
            hierarchical: Optional[bool] = None) -> float:
    """Predicted scaling efficiency (0..1] of data-parallel training on ``hosts`` hosts of
    ``ranks_per_host`` ranks (GPUs) each: the one-rank step time over the ``n``-rank one.

    - ``link_gbit``, ``latency_us``: the link between hosts (bandwidth in Gbit/s, one-way
      latency in microseconds), e.g. what ``%hvd doctor`` measured;
    - ``model_bytes``: gradient bytes per step (4 x parameters for float32);
    - ``step_time_s``: one training step on one rank;
    - ``intra_gbit``: bandwidth between ranks of one host; None = 100 Gbit/s (PCIe 3.0 x16);
    - ``backward_fraction``: the share of the step the backward pass takes, during which
      the allreduce runs hidden; None = 0.5; 0 = no overlap;
    - ``fp16``: gradients compressed to 16 bits (half the bytes);
    - ``hierarchical``: True = reduce inside hosts, ring across, broadcast inside
      (Horovod's hierarchical allreduce); None or False = one flat ring (Horovod's
      default).

    Tensor fusion uses Horovod's defaults (``HOROVOD_FUSION_THRESHOLD`` 64 MiB, this
    runtime's ``HOROVOD_CYCLE_TIME``); :func:`what_if` with a :class:`Scenario` takes others.
    The formulae: docs/doctor.md. e.g. 25 MB of gradients, 0.1 s steps, 2 hosts of 1 rank on
    10 Gbit/s and 50 us, no overlap: ``predict(2, 1, 10, 50, 25e6, 0.1,
    backward_fraction=0)`` = 0.83.
    """
    sc = Scenario(hosts, ranks_per_host, link_gbit, latency_us, model_bytes, step_time_s,
                  intra_gbit=intra_gbit, backward_fraction=backward_fraction, fp16=fp16,
                  hierarchical=hierarchical)
    return point(sc, sc.size).efficiency


#: What ``--what-if`` assumes for a cluster option not given.
DEFAULT_HOSTS = 2
DEFAULT_RANKS_PER_HOST = 1
DEFAULT_LINK_GBIT = 10.0
DEFAULT_LATENCY_US = 50.0


def scenario_from(options: Mapping[str, Any], model_bytes: float,
                  tensors: Optional[int] = None) -> Scenario:
    """``%hvd doctor --what-if``'s options (dests as declared in
    :mod:`hvd_magic.runner.options`; absent or None = the default) and the gradient bytes
    -> :class:`Scenario`. Raises ValueError saying what to give."""
    def get(key: str, default: Any = None) -> Any:
        value = options.get(key)
        return default if value is None else value
    step, ips, batch = get("step_time"), get("images_per_sec"), get("batch")
    if step is not None and ips is not None:
        raise ValueError("what-if: give --step-time S or --images-per-sec R (with --batch), "
                         "not both")
    if step is None:
        if ips is None or batch is None:
            raise ValueError("what-if: give the time of one training step on one rank: "
                             "--step-time S, or --images-per-sec R with --batch B")
        step = batch / ips
    mb = get("fusion_threshold_mb")
    return Scenario(int(get("num_hosts", DEFAULT_HOSTS)),
                    int(get("ranks_per_host", DEFAULT_RANKS_PER_HOST)),
                    float(get("link_gbit", DEFAULT_LINK_GBIT)),
                    float(get("latency_us", DEFAULT_LATENCY_US)), float(model_bytes),
                    float(step), intra_gbit=get("intra_gbit"),
                    backward_fraction=get("backward_fraction"), fp16=bool(get("fp16", False)),
                    hierarchical=bool(get("hierarchical_allreduce", False)),
                    fusion_threshold=None if mb is None else int(round(mb * 2**20)),
                    cycle_time_ms=get("cycle_time_ms"), batch=batch, tensors=tensors)


def render(rep: WhatIfReport) -> str:
    """The report as text."""
    sc = rep.scenario
    lines = [f"hvd doctor --what-if: {sc.hosts} host(s) x {sc.ranks_per_host} rank(s), link "
             f"{sc.link_gbit:g} Gbit/s and {sc.latency_us:g} us between hosts, {sc.intra:g} "
             f"Gbit/s inside; {sc.model_bytes / 1e6:.2f} MB of gradients"
             f"{' (fp16: half sent)' if sc.fp16 else ''}, {sc.step_time_s * 1e3:.1f} ms per "
             f"step on one rank, backward {sc.backward:.2f} of it; fusion "
             f"{sc.fusion / 2**20:g} MiB, cycle {sc.cycle_s * 1e3:g} ms; "
             + ("hierarchical" if sc.hierarchical else "flat ring") + " allreduce"]
    lines.append(f"  {'ranks':>6} {'hosts':>5} {'efficiency':>10} {'step ms':>8} "
                 f"{'allreduce ms':>12} {'exposed ms':>10} {'images/s':>9}")
    for p in rep.points:
        ips = f"{p.images_per_s:9.1f}" if p.images_per_s is not None else f"{'-':>9}"
        lines.append(f"  {p.ranks:>6} {p.hosts:>5} {p.efficiency:>10.3f} {p.step_s * 1e3:>8.1f} "
                     f"{p.comm_s * 1e3:>12.1f} {p.exposed_s * 1e3:>10.1f} {ips}")
    if rep.bend is None:
        lines.append(f"  bends: no; efficiency stays at or above {GOOD} up to {sc.size} ranks")
    else:
        lines.append(f"  bends: at {rep.bend} ranks, the first size below {GOOD}")
    if sc.hosts < 2:
        lines.append("  link: one host, no link between hosts")
    elif rep.link_for_good is None:
        lines.append(f"  link: no bandwidth keeps {sc.size} ranks at {GOOD}: latency, the "
                     "intra-host link or the cycle time alone cost more")
    else:
        lines.append(f"  link: {rep.link_for_good:.3g} Gbit/s between hosts keeps {sc.size} "
                     f"ranks at {GOOD} (given: {sc.link_gbit:g})")
    if rep.other is not None:
        name = "flat ring" if sc.hierarchical else "hierarchical"
        lines.append(f"  {name} allreduce instead: efficiency {rep.other.efficiency:.3f} at "
                     f"{sc.size} ranks")
    lines += [f"  note: {t}" for t in rep.notes]
    return "\n".join(lines)


def as_dict(rep: WhatIfReport) -> Dict[str, object]:
    """The report as plain data (``--json``)."""
    from dataclasses import asdict
    return asdict(rep)
