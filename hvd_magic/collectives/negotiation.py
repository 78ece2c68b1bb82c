"""The negotiation protocol: what ranks say to each other, and the replicated table that
decides which requests are ready on every rank.

A rank's :class:`RankMsg` for one cycle carries its new announcements (:class:`Ann`), plus
cancels, join and shutdown. Every rank runs the same :class:`Negotiator` on the same inputs
(the messages of all ranks from one negotiation cycle, in rank order), so every rank reaches
the same decisions (:class:`Response`) in the same order without a coordinator; a
disagreement in a request's metadata becomes a mismatch error (:func:`check_agreement`).
Nothing here sends a byte or starts a thread; the engine feeds it and carries out what it
returns. How messages travel compactly is :mod:`.codec`; how ready allreduces are fused
is :mod:`.fusion`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, NamedTuple, Optional

from .errors import group_ranks
from .ops import ReduceOp


class Ann(NamedTuple):
    """What one rank says about one request: the metadata every rank compares."""

    name: str
    kind: str                      # allreduce, allgather, broadcast, alltoall, reducescatter, barrier
    dtype: Optional[str] = None
    shape: Optional[tuple] = None
    op: int = int(ReduceOp.SUM)
    root: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    device: str = "cpu"
    splits: Optional[tuple] = None  # alltoall: rows this rank sends to each rank
    obj: bool = False               # broadcast_object: only the root's shape counts


#: ``new_tuple(Ann, fields)`` builds a namedtuple without its constructor's argument
#: handling (~0.3 us less a call on the hot paths that make one per request).
new_tuple = tuple.__new__


def allreduce_ann(name: str, dtype: str, shape: tuple, op: int, prescale: float,
                  postscale: float, device: str) -> Ann:
    """``Ann(name, "allreduce", dtype, shape, op, -1, prescale, postscale, device)``, built
    without the namedtuple constructor's keyword handling (every allreduce makes one:
    ~0.2 us instead of ~0.4 us)."""
    return new_tuple(Ann, (name, "allreduce", dtype, shape, op, -1, prescale, postscale,
                            device, None, False))


class RankMsg(NamedTuple):
    """One rank's contribution to one negotiation cycle."""

    anns: tuple = ()                # new Ann since the last cycle
    cancels: tuple = ()             # (name, reason) for requests this rank gives up (stall shutdown)
    join: bool = False              # this rank called join()
    shutdown: bool = False          # this rank called shutdown()
    events: tuple = ()              # timeline events for rank 0's file
    tune: tuple = ()                # rank 0: an autotune setting every rank applies now
    invalid: tuple = ()             # response-cache slots every rank drops (.response_cache)


@dataclass(slots=True)
class Response:
    """A decision every rank carries out identically."""

    name: str
    kind: str
    anns: dict                      # rank -> Ann, for the ranks that submitted
    joined: frozenset = frozenset()
    error: Optional[str] = None
    error_kind: str = ""            # mismatch, stall, joined, shutdown
    last_joined: int = -1

    @property
    def first(self) -> Ann:
        return next(iter(self.anns.values()))


@dataclass(slots=True)
class Pending:
    name: str
    anns: dict = field(default_factory=dict)
    since: float = 0.0


@dataclass
class StallInfo:
    name: str
    kind: str
    ready_ranks: list
    missing_ranks: list
    since: float

    def describe(self, now: float) -> str:
        return (f"{self.kind} of tensor '{self.name}' has waited {now - self.since:.1f} s: "
                f"submitted by rank(s) {_ranks(self.ready_ranks)}, "
                f"not yet by rank(s) {_ranks(self.missing_ranks)}")


def _ranks(ranks: Iterable[int]) -> str:
    return ", ".join(map(str, ranks))


# Fields compared across ranks, per kind (name, how to read it from an Ann).
def _compare_fields(kind: str) -> list:
    shape = ("shape", lambda a: a.shape)
    tail = ("shape (all but the first dimension)", lambda a: None if a.shape is None else a.shape[1:])
    dtype = ("dtype", lambda a: a.dtype)
    dev = ("device", lambda a: a.device)
    scale = [("op", lambda a: ReduceOp(a.op).name.capitalize()),
             ("prescale_factor", lambda a: a.prescale), ("postscale_factor", lambda a: a.postscale)]
    if kind == "allreduce":
        return [dtype, shape, *scale, dev]
    if kind == "reducescatter":
        return [dtype, shape, *scale, dev]
    if kind in ("allgather", "alltoall"):
        return [dtype, tail, dev]
    if kind == "broadcast":
        return [("root_rank", lambda a: a.root), dtype, shape, dev]
    if kind == "broadcast_object":
        return [("root_rank", lambda a: a.root)]
    return []


_SAME_ALL = ("allreduce", "reducescatter", "broadcast", "barrier")


def check_agreement(kind: str, name: str, anns: dict) -> Optional[str]:
    """Return an error message if the ranks' metadata for one request differ."""
    it = iter(anns.values())
    first = next(it)
    if kind in _SAME_ALL:
        if all(a == first for a in it):
            return None
    elif kind in ("allgather", "alltoall"):
        key = (first.kind, first.dtype, first.shape[1:] if first.shape else None, first.device)
        if all((a.kind, a.dtype, a.shape[1:] if a.shape else None, a.device) == key for a in it):
            return None
    kinds = {r: a.kind for r, a in anns.items()}
    if len(set(kinds.values())) > 1:
        return f"tensor '{name}' was submitted to different operations: {group_ranks(kinds)}"
    for label, get in _compare_fields(kind):
        values = {r: get(a) for r, a in anns.items()}
        if len(set(map(repr, values.values()))) > 1:
            return f"{kind} of tensor '{name}': {label} differs across ranks: {group_ranks(values)}"
    return None



class Negotiator:
    """Replicated table of requests that some but not all ranks have submitted."""

    def __init__(self, size: int, names: Optional[list] = None):
        """``names``: how messages name each rank (a process set's hvd ranks); default 0..size-1."""
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size = size
        self.names = names
        self.pending: dict[str, Pending] = {}     # insertion order = decision order
        self.joined: list[int] = []               # ranks in join(), in the order they joined
        self.shut: set[int] = set()

    @property
    def busy(self) -> bool:
        """True while some rank waits for another."""
        return bool(self.pending) or bool(self.joined) or bool(self.shut)

    def waiting(self, rank: int) -> bool:
        """True while ``rank`` has said something the others have not matched yet (a request
        they have not submitted, a join or a shutdown): it should post the next cycle and
        wait there for them. A rank that only *owes* submissions need not negotiate until it
        has something to say: the cycle cannot complete without its submission anyway."""
        if rank in self.shut or rank in self.joined:
            return True
        for p in self.pending.values():
            if rank in p.anns:
                return True
        return False

    def step(self, msgs: list, now: float = 0.0) -> list:
        """Apply one cycle's messages (index = rank); return the decisions, in order."""
        if len(msgs) != self.size:
            raise ValueError(f"expected {self.size} messages, got {len(msgs)}")
        fast = self._step_lockstep(msgs)
        if fast is not None:
            return fast
        out: list[Response] = []
        for rank, msg in enumerate(msgs):
            for ann in msg.anns:
                p = self.pending.get(ann.name)
                if p is None:
                    p = self.pending[ann.name] = Pending(ann.name, since=now)
                if rank in p.anns:
                    # Cannot happen with a well-behaved engine (names in flight are refused locally).
                    out.append(Response(ann.name, ann.kind, {rank: ann}, error=(
                        f"tensor '{ann.name}' was submitted twice by rank {self._name(rank)}"),
                        error_kind="mismatch"))
                    continue
                p.anns[rank] = ann
            if msg.join and rank not in self.joined:
                self.joined.append(rank)
            if msg.shutdown:
                self.shut.add(rank)
        for rank, msg in enumerate(msgs):
            for name, reason in msg.cancels:
                p = self.pending.pop(name, None)
                if p is not None and p.anns:
                    out.append(Response(name, next(iter(p.anns.values())).kind, p.anns,
                                        error=reason, error_kind="stall"))
        joined = frozenset(self.joined)
        for name in list(self.pending):
            p = self.pending[name]
            resp = self._decide(p, joined)
            if resp is not None:
                del self.pending[name]
                out.append(resp)
        if len(self.joined) == self.size:
            # Everyone has joined: the join completes, returning the last rank to join.
            out.append(Response("join", "join", {}, last_joined=self.joined[-1]))
            self.joined = []
        if len(self.shut) == self.size:
            for name, p in self.pending.items():
                out.append(Response(name, p.anns and next(iter(p.anns.values())).kind or "", p.anns,
                                    error="the runtime shut down on every rank before "
                                          f"tensor '{name}' was submitted everywhere",
                                    error_kind="shutdown"))
            self.pending.clear()
            out.append(Response("shutdown", "shutdown", {}))
            self.shut = set()
        return out

    def _step_lockstep(self, msgs: list) -> Optional[list]:
        """Fast path for the common case: nothing pending, and every rank announced the same
        names in this cycle (and nothing else). Returns None when it does not apply."""
        if self.pending or self.joined or self.shut:
            return None
        m0 = msgs[0]
        n = len(m0.anns)
        for m in msgs:
            if m.cancels or m.join or m.shutdown or len(m.anns) != n:
                return None
        if n == 1:    # the most common cycle: one request, named alike everywhere
            name0 = m0.anns[0].name
            for m in msgs:
                if m.anns[0].name != name0:
                    return None
            names = [name0]
        else:
            names = [a.name for a in m0.anns]
            if len(set(names)) != n:
                return None
            for m in msgs[1:]:
                if [a.name for a in m.anns] != names:
                    return None
        out = []
        ranks = range(self.size)
        if all(m.anns == m0.anns for m in msgs) and all(
                a.kind != "alltoall" for a in m0.anns):
            # Every rank sent the very same requests: they agree, nothing to compare one by one.
            for a in m0.anns:
                out.append(Response(a.name, a.kind, dict.fromkeys(ranks, a)))
            return out
        for i, name in enumerate(names):
            anns = {r: msgs[r].anns[i] for r in ranks}
            first = m0.anns[i]
            err = check_agreement(first.kind, name, self._named(anns))
            if err:
                out.append(Response(name, first.kind, anns, error=err, error_kind="mismatch"))
                continue
            if first.kind == "alltoall" and any(
                    a.splits is not None and len(a.splits) != self.size for a in anns.values()):
                return None   # let the general path report it
            out.append(Response(name, first.kind, anns))
        return out

    def _decide(self, p: Pending, joined: frozenset) -> Optional[Response]:
        first = next(iter(p.anns.values()))
        missing = [r for r in range(self.size) if r not in p.anns and r not in joined]
        gone = [r for r in missing if r in self.shut]
        if gone:
            return Response(p.name, first.kind, p.anns, error=(
                f"{first.kind} of tensor '{p.name}' cannot complete: rank(s) {_ranks(map(self._name, gone))} "
                "called shutdown() without submitting it"), error_kind="shutdown")
        if missing:
            return None
        err = check_agreement(first.kind, p.name, self._named(p.anns))
        if err:
            return Response(p.name, first.kind, p.anns, joined=joined, error=err, error_kind="mismatch")
        part_joined = frozenset(r for r in joined if r not in p.anns)
        if part_joined and first.kind not in ("allreduce", "barrier"):
            return Response(p.name, first.kind, p.anns, joined=part_joined, error=(
                f"{first.kind} of tensor '{p.name}' cannot run while rank(s) "
                f"{_ranks(map(self._name, sorted(part_joined)))} have joined; only allreduce and "
                "barrier continue after hvd.join() (as in Horovod)"), error_kind="joined")
        if first.kind == "alltoall":
            bad = {r: a.splits for r, a in p.anns.items() if a.splits is not None and len(a.splits) != self.size}
            if bad:
                return Response(p.name, first.kind, p.anns, error=(
                    f"alltoall of tensor '{p.name}': splits must have one entry per rank "
                    f"({self.size}): {group_ranks(self._named(bad))}"), error_kind="mismatch")
        return Response(p.name, first.kind, p.anns, joined=part_joined)

    def stalled(self, now: float, older_than: float) -> list:
        """Requests some ranks submitted and others have not, for longer than ``older_than`` s."""
        joined = set(self.joined)
        out = []
        for p in self.pending.values():
            if now - p.since >= older_than and p.anns:
                missing = [r for r in range(self.size) if r not in p.anns and r not in joined]
                if missing:
                    out.append(StallInfo(p.name, next(iter(p.anns.values())).kind,
                                         [self._name(r) for r in sorted(p.anns)],
                                         [self._name(r) for r in missing], p.since))
        return out

    def _name(self, rank: int) -> int:
        return rank if self.names is None else self.names[rank]

    def _named(self, per_rank: dict) -> dict:
        """``per_rank`` keyed as messages name the ranks."""
        return per_rank if self.names is None else {self.names[r]: v for r, v in per_rank.items()}

