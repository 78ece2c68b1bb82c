"""Runs in each rank (the telemetry) and in the notebook kernel (the widgets read its spans).

Timeline events of the runtime -> merged phase spans. Pure (standard library only); runs
on each rank for the telemetry (:mod:`.telemetry`) and is unit-tested on its own."""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

Span = Tuple[float, float, str, str]     # (start_us, end_us, phase, label)


def merge_intervals(intervals: Iterable[Tuple[float, float]]) -> List[Tuple[float, float]]:
    """Union of ``[start, end]`` intervals, sorted, overlapping or touching ones merged."""
    out: List[List[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1][1] = e
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def compact_events(events: Iterable[Sequence[Any]], max_spans: int = 400) -> Tuple[List[Span], float]:
    """Timeline events ``(rank, tensor, phase, start_us, dur_us, args)`` -> (spans, busy_us).

    Overlapping events of the same phase (many tensors negotiated or reduced together) merge
    into one span labelled with the tensors (``"grad.w +3"``). Instant events (no duration)
    are dropped. ``busy_us`` is the union of all phases (time with a collective in flight),
    computed before the newest ``max_spans`` spans are kept.
    """
    spans, busy, _cut = compact_tail(events, max_spans)
    return spans, busy


def compact_tail(events: Iterable[Sequence[Any]], max_spans: int = 400,
                 since_us: Optional[float] = None) -> Tuple[List[Span], float, Optional[float]]:
    """:func:`compact_events` for the engine's telemetry: (spans, busy_us, cut_us).

    ``busy_us`` covers every event; spans are built only from the newest events (the merge
    and the labels are the costly part, and all but the newest ``max_spans`` spans would be
    dropped anyway). ``cut_us`` is the start of the first kept span when older ones were
    left out (the receiver then draws no compute up to it), else None. With ``since_us``
    (events collected from that time on), events that ended before it are dropped and busy
    time counts only from it.
    """
    timed: List[Tuple[float, float, str, str]] = []
    for ev in events:
        dur, phase = ev[4], ev[2]
        if dur is None or phase == "CYCLE_START":
            continue
        s = float(ev[3])
        e = s + float(dur)
        if since_us is not None and e < since_us:
            continue
        timed.append((s, e, phase, ev[1]))
    if since_us is None:
        busy = _union_length(timed)
    else:
        busy = _union_length([(max(s, since_us), e, p, t) for s, e, p, t in timed])
    dropped = False
    if max_spans and len(timed) > 4 * max_spans:
        timed.sort()
        timed = timed[-4 * max_spans:]
        dropped = True
    by_phase: Dict[str, List[Tuple[float, float, str]]] = {}
    for s, e, phase, tensor in timed:
        by_phase.setdefault(phase, []).append((s, e, str(tensor)))
    spans: List[Span] = []
    for phase, items in by_phase.items():
        items.sort()
        cur: Optional[List[Any]] = None
        for s, e, tensor in items:
            if cur is not None and s <= cur[1]:
                if e > cur[1]:
                    cur[1] = e
                cur[2].append(tensor)
            else:
                if cur is not None:
                    spans.append((cur[0], cur[1], phase, _label(cur[2])))
                cur = [s, e, [tensor]]
        if cur is not None:
            spans.append((cur[0], cur[1], phase, _label(cur[2])))
    spans.sort()
    if max_spans and len(spans) > max_spans:
        spans = spans[-max_spans:]
        dropped = True
    cut = spans[0][0] if dropped and spans else None
    return spans, busy, cut


def _union_length(intervals: List[Tuple[float, float, str, str]]) -> float:
    """Total length of the union of ``(start, end, ...)`` intervals."""
    if not intervals:
        return 0.0
    total = 0.0
    cur_s = cur_e = None
    for item in sorted(intervals):
        s, e = item[0], item[1]
        if cur_e is not None and s <= cur_e:
            if e > cur_e:
                cur_e = e
        else:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
    total += cur_e - cur_s
    return total


def _label(tensors: List[str]) -> str:
    uniq = list(dict.fromkeys(tensors))
    return uniq[0] if len(uniq) == 1 else f"{uniq[0]} +{len(uniq) - 1}"
