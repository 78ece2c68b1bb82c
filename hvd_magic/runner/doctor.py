"""Deciding, not doing: what ``%hvd doctor``'s measurements say, and the scaling it predicts.

Pure functions over the record the ranks' probe (:mod:`.doctor_probe`) prints; nothing here
runs MPI. The cost model (docs/doctor.md):

- a link between two hosts: one-way time of a message of ``b`` bytes = ``latency + b /
  bandwidth`` (fitted to a ping-pong sweep between the first rank of each pair of hosts);
- a ring allreduce of ``B`` bytes over ``n`` ranks: ``2(n-1)/n * B / bandwidth + 2(n-1) *
  latency``, with the slowest link's bandwidth and latency (a ring moves at its slowest hop);
- one training step on ``n`` ranks: the step time on one rank plus that allreduce (no
  overlap of communication with the backward pass is assumed, so the prediction is a floor);
  scaling efficiency = ``step_time / (step_time + allreduce_time)``.

Two allreduce times are given: the ring model on the slowest link (what an ideal ring
allreduce would take), and the allreduce actually measured at ``n`` ranks, fitted as
``a + b * bytes`` (what this MPI's own algorithm takes). The prediction uses the measured
one when there is one. When the hosts talk over Open MPI's TCP transport and the allreduce
reaches well under the link's speed, the report says how to raise Open MPI's TCP eager
limit (:func:`eager_note`).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

#: Open MPI's TCP eager limit suggested when a multi-host allreduce is slow (bytes), and
#: the ranks' environment that sets it (what :func:`eager_note` tells the user to set).
TCP_EAGER_LIMIT = 4 << 20
TCP_EAGER_ENV = {"OMPI_MCA_btl_tcp_eager_limit": str(TCP_EAGER_LIMIT),
                 "OMPI_MCA_btl_tcp_rndv_eager_limit": str(TCP_EAGER_LIMIT)}

#: Packages whose versions must agree on every rank.
PACKAGES = ("hvd_magic", "torch", "tensorflow", "mpi4py", "numpy")


@dataclass
class Link:
    """What the ping-pong between two hosts measured."""

    a: str
    b: str
    bandwidth: float          # bytes/s
    latency: float            # s, one way
    interface: str = "?"      # the interface rank a's traffic to b leaves by


@dataclass
class Report:
    """Everything ``%hvd doctor`` found, plus what it predicts; ``problems`` empty = go."""

    np: int
    hosts: Dict[str, List[int]]                        # host -> its ranks
    versions: Dict[str, Dict[str, List[int]]]          # package -> version -> ranks
    gpus: Dict[int, str]                               # rank -> what it sees
    links: List[Link] = field(default_factory=list)
    allreduce: Optional[Dict[str, float]] = None       # fitted bandwidth/latency at np ranks
    mpi_interface: str = ""
    prediction: Optional[Dict[str, float]] = None
    problems: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> Tuple[float, float]:
    """Least-squares ``y = a + b x`` -> ``(a, b)``; needs two distinct x."""
    if len(xs) != len(ys) or len(set(xs)) < 2:
        raise ValueError("fit_line needs at least two points with different x")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def link_from_pingpong(sizes: Sequence[int], one_way: Sequence[float]) -> Tuple[float, float]:
    """Ping-pong sweep (bytes, median one-way seconds) -> ``(bandwidth B/s, latency s)``.

    Bandwidth: the slope between the two largest messages (start-up costs cancel out).
    Latency: the smallest message's one-way time less its bytes at that bandwidth."""
    pts = sorted(zip(sizes, one_way))
    if len(pts) < 3:
        raise ValueError("a ping-pong sweep needs at least 3 message sizes")
    (s1, t1), (s2, t2) = pts[-2], pts[-1]
    slope = (t2 - t1) / (s2 - s1)
    if slope <= 0:                       # noise: fall back on the largest message alone
        slope = (t2 - pts[0][1]) / (s2 - pts[0][0])
    if slope <= 0:
        return float("inf"), pts[0][1]
    return 1.0 / slope, max(pts[0][1] - pts[0][0] * slope, 0.0)


def fit_allreduce(sizes: Sequence[int], times: Sequence[float], n: int) -> Dict[str, float]:
    """Allreduce sweep at ``n`` ranks -> the ring model's bandwidth and latency that fit it:
    ``t = 2(n-1) * latency + 2(n-1)/n * bytes / bandwidth``."""
    if n < 2:
        raise ValueError("an allreduce over 1 rank moves nothing; fit needs n >= 2")
    a, b = fit_line([float(s) for s in sizes], list(times))
    bw = 2 * (n - 1) / n / b if b > 0 else float("inf")
    return {"bandwidth": bw, "latency": max(a, 0.0) / (2 * (n - 1)), "intercept": a,
            "slope": b}


def ring_allreduce_time(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Seconds a ring allreduce of ``nbytes`` takes over ``n`` ranks (0 for one rank)."""
    if n < 2:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency


def predict_efficiency(model_bytes: float, step_time: float, n: int, bandwidth: float,
                       latency: float) -> Dict[str, float]:
    """Scaling efficiency at ``n`` ranks of a model with ``model_bytes`` of gradients per step
    and ``step_time`` s per step on one rank: ``step / (step + allreduce)``.

    e.g. 25 MB of gradients, 0.1 s steps, 2 hosts on 10 Gbit/s (1.25e9 B/s), 50 us:
    allreduce 0.0201 s -> efficiency 0.83."""
    if model_bytes <= 0 or step_time <= 0:
        raise ValueError("model bytes and step time must be > 0 (e.g. --model-bytes 2e6 "
                         "--step-time 0.05)")
    comm = ring_allreduce_time(model_bytes, n, bandwidth, latency)
    return {"n": n, "model_bytes": model_bytes, "step_time": step_time,
            "allreduce_time": comm, "efficiency": step_time / (step_time + comm)}


def gradient_bytes(model: Any) -> float:
    """Bytes of gradients one step of ``model`` (a torch module) produces."""
    params = getattr(model, "parameters", None)
    if not callable(params):
        raise TypeError(f"--model: a {type(model).__name__} has no .parameters(); give a torch "
                        "model (nn.Module) or --model-bytes B")
    total = sum(p.numel() * p.element_size() for p in params() if p.requires_grad)
    if total <= 0:
        raise ValueError("--model: the model has no trainable parameters")
    return float(total)


def unreached_hosts(output: str) -> List[str]:
    """Hosts a failed launch names as not reached (Open MPI's "Remote host:" lines, the
    ssh stand-in's "unknown host"), in order, once each."""
    import re
    found = re.findall(r"Remote host:\s+(\S+)|unknown host (\S+)|"
                       r"ssh: Could not resolve hostname (\S+?):", output)
    out: List[str] = []
    for groups in found:
        name = next(g for g in groups if g)
        if name not in out:
            out.append(name)
    return out


def failed_report(np: int, output: str, why: str) -> Report:
    """The report of a probe that did not complete: the hosts not reached, named."""
    rep = Report(np=np, hosts={}, versions={}, gpus={})
    missing = unreached_hosts(output)
    if missing:
        rep.problems.append(f"host(s) not reached: {', '.join(missing)}; check that ssh to "
                            "each works without a password, the name resolves, and no "
                            "firewall blocks it")
    rep.problems.append(why)
    return rep


def _by(records: Sequence[Mapping[str, Any]], key: str) -> Dict[str, List[int]]:
    out: Dict[str, List[int]] = {}
    for r in records:
        out.setdefault(str(r.get(key)), []).append(int(r["rank"]))
    return out


def analyse(probe: Mapping[str, Any], model_bytes: Optional[float] = None,
            step_time: Optional[float] = None) -> Report:
    """The probe's record (see :mod:`.doctor_probe`) -> :class:`Report`."""
    ranks = sorted(probe["ranks"], key=lambda r: r["rank"])
    n = len(ranks)
    hosts = _by(ranks, "host")
    versions = {"python": _by(ranks, "python")}
    for pkg in PACKAGES:
        versions[pkg] = _by([dict(r, v=r["packages"].get(pkg) or "not installed")
                             for r in ranks], "v")
    rep = Report(np=n, hosts=hosts, versions=versions,
                 gpus={int(r["rank"]): r.get("gpus") or "none" for r in ranks},
                 mpi_interface=str(probe.get("mpi_interface") or ""))
    for pkg, seen in versions.items():
        if len(seen) > 1:
            parts = "; ".join(f"{v} on ranks {rs}" for v, rs in sorted(seen.items()))
            rep.problems.append(f"{pkg} differs between ranks: {parts}; install the same "
                                "version on every host")
    for pair in probe.get("pairs", []):
        bw, lat = link_from_pingpong(pair["sizes"], pair["one_way_s"])
        rep.links.append(Link(pair["a"], pair["b"], bw, lat, pair.get("interface") or "?"))
    if len(hosts) == 1:
        rep.notes.append("one host: the ranks talk through shared memory; no network link "
                         "to measure")
    sweep = probe.get("allreduce")
    if sweep and n >= 2 and len(set(sweep["sizes"])) >= 2:
        fit = fit_allreduce(sweep["sizes"], sweep["times_s"], n)
        if fit["slope"] > 0:
            rep.allreduce = fit
        else:
            rep.notes.append(unfit_note(sweep["sizes"], sweep["times_s"]))
    note = eager_note(rep, probe.get("tcp_eager_limit"))
    if note:
        rep.notes.append(note)
    if model_bytes is not None and step_time is not None:
        bw, lat = _bottleneck(rep)
        if bw is not None:
            ring = predict_efficiency(model_bytes, step_time, n, bw, lat)
            rep.prediction = dict(ring, bandwidth=bw, latency=lat,
                                  ring_allreduce_time=ring["allreduce_time"],
                                  ring_efficiency=ring["efficiency"])
            if rep.allreduce:
                comm = rep.allreduce["intercept"] + rep.allreduce["slope"] * model_bytes
                comm = max(comm, 0.0)
                rep.prediction.update(allreduce_time=comm,
                                      efficiency=step_time / (step_time + comm))
    elif model_bytes is not None or step_time is not None:
        rep.notes.append("a prediction needs both the gradient bytes (--model-bytes or "
                         "--model NAME) and --step-time")
    return rep


def eager_note(rep: Report, eager_limit: Optional[str]) -> Optional[str]:
    """Advice when the allreduce across hosts reaches under 3/4 of the slowest link (its
    ring-model bandwidth against the ping-pong's) while Open MPI's TCP eager limit
    (``eager_limit``: the ranks' ``OMPI_MCA_btl_tcp_eager_limit``; unset or empty: Open
    MPI's 64 KiB) is below :data:`TCP_EAGER_LIMIT`; else None.

    Why it is slow: above the eager limit, a message is sent only after the receiver's
    go-ahead, and that reply queues on the same TCP connection behind the receiver's own
    data for the sender, so the two directions of a ring step often run one after the other.
    """
    if len(rep.hosts) < 2 or not rep.links or not rep.allreduce:
        return None
    try:
        if eager_limit and int(eager_limit) >= TCP_EAGER_LIMIT:
            return None
    except ValueError:
        pass
    link = min(k.bandwidth for k in rep.links)
    got = rep.allreduce["bandwidth"]
    if got >= 0.75 * link:
        return None
    limit = f"{eager_limit} bytes" if eager_limit else "64 KiB"
    settings = " ".join(f"{k}={v}" for k, v in TCP_EAGER_ENV.items())
    return (f"the allreduce across hosts reached {got / link:.0%} of the slowest link "
            f"({gbit(got)} of {gbit(link)}). Over TCP, Open MPI sends a message above its "
            f"eager limit ({limit}) after the receiver's go-ahead, which queues behind the "
            f"receiver's own data on the same connection: try the ranks with {settings} "
            "(docs/doctor.md: on 2 hosts at 0.5 Gbit/s it took the allreduce from 0.24 to "
            "0.47 Gbit/s)")


def unfit_note(sizes: Sequence[int], times: Sequence[float]) -> str:
    """Why a sweep whose larger allreduces did not take longer fits no bandwidth."""
    pts = ", ".join(f"{_size(s)} {t * 1e3:.2f} ms" for s, t in sorted(zip(sizes, times)))
    return (f"the allreduce sweep took no longer for larger messages ({pts}), so no "
            "bandwidth fits it: other processes were most likely running on these cores; "
            "run the doctor again when the machine is quiet")


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def _bottleneck(rep: Report) -> Tuple[Optional[float], float]:
    """The slowest link (bandwidth, its latency), else the allreduce fit, else nothing."""
    if rep.links:
        slow = min(rep.links, key=lambda k: k.bandwidth)
        return slow.bandwidth, max(k.latency for k in rep.links)
    if rep.allreduce:
        return rep.allreduce["bandwidth"], rep.allreduce["latency"]
    return None, 0.0


def gbit(bytes_per_s: float) -> str:
    """``1.25e8`` -> ``"1.00 Gbit/s"``."""
    return f"{bytes_per_s * 8 / 1e9:.2f} Gbit/s"


def prediction_text(p: Dict[str, float]) -> str:
    """A :attr:`Report.prediction` in words: ``"1.95 MB of gradients per step, 49.6 ms per
    step on one rank -> allreduce 18.1 ms, scaling efficiency 0.73 at 2 ranks (an ideal ring
    on the slowest link: 16.0 ms, 0.76)"``."""
    return (f"{p['model_bytes'] / 1e6:.2f} MB of gradients per step, {p['step_time'] * 1e3:.1f} "
            f"ms per step on one rank -> allreduce {p['allreduce_time'] * 1e3:.1f} ms, scaling "
            f"efficiency {p['efficiency']:.2f} at {int(p['n'])} ranks (an ideal ring on the "
            f"slowest link: {p['ring_allreduce_time'] * 1e3:.1f} ms, {p['ring_efficiency']:.2f})")


def render_text(rep: Report) -> str:
    """The report as plain text (the widget's fallback and ``--json``-less CLI output)."""
    lines = [f"hvd doctor: {rep.np} ranks on {len(rep.hosts)} host(s): "
             + ", ".join(f"{h} (ranks {rs})" for h, rs in rep.hosts.items())]
    lines.append("  reachable: " + ("every host started its ranks" if rep.hosts else
                                    "NO (the probe did not run on every rank)"))
    for pkg, seen in rep.versions.items():
        mark = "ok " if len(seen) == 1 else "BAD"
        lines.append(f"  {mark} {pkg:<11} " + "; ".join(
            f"{v}" + ("" if len(seen) == 1 else f" (ranks {rs})") for v, rs in seen.items()))
    if rep.mpi_interface:
        lines.append(f"  MPI network: {rep.mpi_interface}")
    for k in rep.links:
        lines.append(f"  link {k.a} <-> {k.b} via {k.interface}: {gbit(k.bandwidth)}, "
                     f"latency {k.latency * 1e6:.0f} us (one way)")
    if rep.allreduce:
        lines.append(f"  allreduce at {rep.np} ranks fits the ring model with "
                     f"{gbit(rep.allreduce['bandwidth'])}, latency "
                     f"{rep.allreduce['latency'] * 1e6:.0f} us")
    lines.append("  GPUs: " + ", ".join(f"rank {r}: {g}" for r, g in sorted(rep.gpus.items())))
    if rep.prediction:
        lines.append(f"  prediction: {prediction_text(rep.prediction)}")
    lines += [f"  note: {t}" for t in rep.notes]
    lines += [f"  PROBLEM: {t}" for t in rep.problems]
    lines.append("  verdict: " + ("ready" if not rep.problems else
                                  f"{len(rep.problems)} problem(s) to fix first"))
    return "\n".join(lines)


# The what-if model lives in its own pure module; ``hvd_magic.runner.doctor.predict`` is
# where users import it from.
from .whatif import predict  # noqa: E402,F401
