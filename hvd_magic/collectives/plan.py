"""Pure planning: which requests are ready on every rank, and how to fuse them.

Every rank runs the same :class:`Negotiator` on the same inputs (the messages of
all ranks from one negotiation cycle, in rank order), so every rank reaches the
same decisions in the same order without a coordinator. Nothing here sends a
byte or starts a thread; the engine feeds it and carries out what it returns.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, NamedTuple, Optional

import numpy as np

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


_tuple_new = tuple.__new__


def allreduce_ann(name: str, dtype: str, shape: tuple, op: int, prescale: float,
                  postscale: float, device: str) -> Ann:
    """``Ann(name, "allreduce", dtype, shape, op, -1, prescale, postscale, device)``, built
    without the namedtuple constructor's keyword handling (every allreduce makes one:
    ~0.2 us instead of ~0.4 us)."""
    return _tuple_new(Ann, (name, "allreduce", dtype, shape, op, -1, prescale, postscale,
                            device, None, False))


class RankMsg(NamedTuple):
    """One rank's contribution to one negotiation cycle."""

    anns: tuple = ()                # new Ann since the last cycle
    cancels: tuple = ()             # (name, reason) for requests this rank gives up (stall shutdown)
    join: bool = False              # this rank called join()
    shutdown: bool = False          # this rank called shutdown()
    events: tuple = ()              # timeline events for rank 0's file
    payloads: tuple = ()            # (index into anns, bytes): small allreduce inputs sent eagerly


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
    data: Optional[dict] = None     # rank -> bytes when every submitting rank sent its input eagerly

    @property
    def first(self) -> Ann:
        return next(iter(self.anns.values()))


@dataclass(slots=True)
class Pending:
    name: str
    anns: dict = field(default_factory=dict)
    since: float = 0.0
    data: dict = field(default_factory=dict)


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


def split_noname(name: str) -> Optional[tuple]:
    """``(head, number, rest)`` of an unnamed call's name (``kind.noname.N`` with an
    optional ``.suffix``), or None for any other name.

    >>> split_noname("allreduce.noname.17")
    ('allreduce.noname', 17, '')
    >>> split_noname("allreduce.noname.0.3")
    ('allreduce.noname', 0, '.3')
    """
    head, sep, tail = name.partition(".noname.")
    if not sep:
        return None
    num, dot, rest = tail.partition(".")
    if not num.isdigit():
        return None
    return head + ".noname", int(num), dot + rest


def table_entry(a: Ann) -> tuple:
    """``(entry, parts)``: what a full announcement enters a table as (the encoder's and
    every decoder's one rule), and ``split_noname`` of its name. An unnamed call enters
    without its number, so the next call of that kind and shape finds it."""
    nn = split_noname(a[0]) if ".noname." in a[0] else None
    if nn is None:
        return a, None
    return _tuple_new(Ann, (nn[0],) + a[1:]), nn


class AnnCodec:
    """Announcements as small table indices once a rank has announced them before.

    A training loop announces the same requests (same name, shape, dtype, op) every step.
    A rank's first announcement of one travels in full and every rank appends it to its
    copy of that rank's table; later ones travel as the index. The tables stay identical
    everywhere because every rank decodes the same messages in the same order and applies
    the same rule for what enters a table (a full entry enters while the table has room).
    A table that is full after a message starts again empty, on every rank at the same
    message (``resets`` counts it): names that change every step (``f"loss.{step}"``)
    cannot crowd out the loop's steady names for the rest of a long-lived pool's life.

    Unnamed calls are named ``kind.noname.N`` from a counter that moves on every call.
    Their table entry holds the name without the number (``kind.noname``), and a later one
    travels as ``(index, N - previous N, suffix)``: a loop of unnamed calls sends the same
    bytes every step too. Every rank keeps each rank's last ``N`` per head (``last``) by
    decoding; ``moved`` is what the latest decoded messages moved it by, and :meth:`replay`
    moves it the same way for a cycle taken from the :class:`CycleCache` without decoding.

    Example, 2 ranks, rank 0 announcing ``a`` then ``allreduce.noname.5``, ``.6``::

        cycle 1: rank 0 sends (('a', 'allreduce', ...),)   every rank: table[0] = [a]
        cycle 2: rank 0 sends (0,)                         every rank decodes a
        cycle 3: rank 0 sends (('allreduce.noname.5', ...),)   table[0] = [a, allreduce.noname]
        cycle 4: rank 0 sends ((1, 1, ''),)                every rank decodes allreduce.noname.6
    """

    def __init__(self, size: int, rank: int = 0, cap: int = 1024) -> None:
        self.cap = cap
        self.rank = rank
        self.mine: dict = {}                             # this rank's Ann -> index
        self.mine_last: dict = {}                        # this rank's head -> last N sent
        self.tables: list = [[] for _ in range(size)]   # rank -> its announced Anns
        self.last: list = [{} for _ in range(size)]     # rank -> head -> last N decoded
        self.moved: dict = {}                            # (rank, head) -> N moved since begin()
        self.resets = 0

    def encode(self, anns: Iterable[Ann]) -> tuple:
        """Plain data for the wire: an index for each Ann sent before, the fields otherwise."""
        mine, out = self.mine, []
        for a in anns:
            # (an unnamed call's Ann, new every time, is never in the table: not looked up)
            entry, nn = table_entry(a) if ".noname." in a[0] else (a, None)
            if nn is None:
                i = mine.get(a)
                if i is not None:
                    out.append(i)
                    continue
            else:
                head, num, rest = nn
                i = mine.get(entry)
                prev = self.mine_last.get(head)
                self.mine_last[head] = num
                if i is not None and prev is not None:
                    out.append((i, num - prev, rest))
                    continue
            if len(mine) < self.cap:
                mine[entry] = len(mine)
            out.append(tuple(a))
        return tuple(out)

    def begin(self) -> None:
        """A new cycle's messages are about to be decoded."""
        self.moved = {}

    def decode(self, rank: int, items: Iterable) -> tuple:
        """The Anns that ``rank`` encoded (every rank decodes every rank's items, in order)."""
        table, out = self.tables[rank], []
        for x in items:
            if type(x) is int:
                out.append(table[x])
                continue
            if len(x) == 3:                      # (index, N - previous N, suffix)
                key = table[x[0]]
                head = key[0]
                last = self.last[rank]
                num = last[head] + x[1]
                last[head] = num
                self.moved[(rank, head)] = self.moved.get((rank, head), 0) + x[1]
                out.append(_tuple_new(Ann, (f"{head}.{num}{x[2]}",) + key[1:]))
                continue
            a = Ann._make(x)
            entry, nn = table_entry(a)
            if nn is not None:
                head, num, _ = nn
                last = self.last[rank]
                self.moved[(rank, head)] = self.moved.get((rank, head), 0) + num - last.get(head, num)
                last[head] = num
            if len(table) < self.cap:
                table.append(entry)
            out.append(a)
        if len(table) >= self.cap > 0:
            # full: start again (this rank's encoder too, when the table is its own)
            table.clear()
            if rank == self.rank:
                self.mine.clear()
            self.resets += 1
        return tuple(out)

    def moves(self) -> dict:
        """What the latest decoded messages moved: (rank, head) -> (N moved, N now)."""
        return {(r, h): (d, self.last[r][h]) for (r, h), d in self.moved.items()}

    def replay(self, moved: dict) -> bool:
        """Move every rank's counters as decoding a kept cycle's messages did
        (``moved``: (rank, head) -> (N moved, that rank's N after it)), or return False
        and move nothing when the ranks' counters no longer stand alike relative to then:
        the same bytes would then pair calls the full path would not pair."""
        offsets: dict = {}
        last = self.last
        for (rank, head), (delta, after) in moved.items():
            off = last[rank].get(head, 0) + delta - after
            if offsets.setdefault(head, off) != off:
                return False
        for (rank, head), (delta, _) in moved.items():
            last[rank][head] = last[rank].get(head, 0) + delta
        return True


class CycleCache:
    """Decisions of cycles that recur byte for byte (a training loop's steady state).

    A cycle is kept when it started and ended with nothing pending, every rank's message is
    :meth:`cacheable` (only announcements made by table index, see :class:`AnnCodec`, and
    no joins, cancels, shutdowns, timeline events or eager payloads), and none of its
    decisions is an error.
    The same message bytes seen again while nothing is pending then decode to the same
    requests (unnamed calls to the next numbers of the same names), and the negotiation
    would reach the same decisions: the cached ones (and their fusion plan) are used
    instead. Every rank sees the same bytes and the same
    table, so every rank hits or misses alike. At most ``cap`` cycles, oldest dropped.
    """

    def __init__(self, cap: int = 256) -> None:
        self.cap = cap
        self.cycles: dict = {}       # key (every rank's message bytes) -> (responses, plan)
        self.hits = 0

    def get(self, key: Optional[tuple], busy: bool) -> Optional[tuple]:
        if key is None or busy:
            return None
        hit = self.cycles.get(key)
        if hit is not None:
            self.hits += 1
        return hit

    @staticmethod
    def cacheable(wire: RankMsg) -> bool:
        """A message as it travels (announcements still encoded) that a kept cycle may hold.
        A rank checks its own before sending: when it is not, no rank can hit or keep the
        cycle, so nobody needs the key. With ``HOROVOD_CACHE_CAPACITY=0`` nothing is ever
        indexed, so no message is."""
        anns = wire.anns
        return (bool(anns) and (type(anns[0]) is int or len(anns[0]) == 3)
                and not (wire.cancels or wire.join or wire.shutdown or wire.events or wire.payloads)
                and (len(anns) == 1 or all(type(a) is int or len(a) == 3 for a in anns)))

    def clear(self) -> None:
        """Forget every cycle (the announcement tables started again: indices changed)."""
        self.cycles.clear()

    def put(self, key: tuple, responses: list, plan: Optional[list], moved: Optional[dict] = None,
            own: tuple = ()) -> None:
        """Keep a cycle. With unnamed calls in it (``moved``: see :meth:`AnnCodec.replay`),
        a later hit names its decisions after what this rank sent then: each decision
        remembers where its request stood in this rank's message (``own``, decoded)."""
        if self.cap <= 0 or any(r.error is not None for r in responses):
            return
        where = None
        if moved:
            at = {a.name: i for i, a in enumerate(own)}
            where = [at.get(r.name) for r in responses]
            if None in where:
                return
        if len(self.cycles) >= self.cap:
            del self.cycles[next(iter(self.cycles))]
        self.cycles[key] = (responses, plan, moved or None, where)


class Negotiator:
    """Replicated table of requests that some but not all ranks have submitted."""

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size = size
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
            eager = dict(msg.payloads) if msg.payloads else None
            for i, ann in enumerate(msg.anns):
                p = self.pending.get(ann.name)
                if p is None:
                    p = self.pending[ann.name] = Pending(ann.name, since=now)
                if rank in p.anns:
                    # Cannot happen with a well-behaved engine (names in flight are refused locally).
                    out.append(Response(ann.name, ann.kind, {rank: ann}, error=(
                        f"tensor '{ann.name}' was submitted twice by rank {rank}"), error_kind="mismatch"))
                    continue
                p.anns[rank] = ann
                if eager is not None and i in eager:
                    p.data[rank] = eager[i]
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
        eager = [dict(m.payloads) if m.payloads else None for m in msgs]
        out = []
        ranks = range(self.size)
        if all(m.anns == m0.anns for m in msgs) and not any(eager) and all(
                a.kind != "alltoall" for a in m0.anns):
            # Every rank sent the very same requests: they agree, nothing to compare one by one.
            for a in m0.anns:
                out.append(Response(a.name, a.kind, dict.fromkeys(ranks, a)))
            return out
        for i, name in enumerate(names):
            anns = {r: msgs[r].anns[i] for r in ranks}
            first = m0.anns[i]
            err = check_agreement(first.kind, name, anns)
            if err:
                out.append(Response(name, first.kind, anns, error=err, error_kind="mismatch"))
                continue
            if first.kind == "alltoall" and any(
                    a.splits is not None and len(a.splits) != self.size for a in anns.values()):
                return None   # let the general path report it
            data = None
            if all(e is not None and i in e for e in eager):
                data = {r: eager[r][i] for r in ranks}
            out.append(Response(name, first.kind, anns, data=data))
        return out

    def _decide(self, p: Pending, joined: frozenset) -> Optional[Response]:
        first = next(iter(p.anns.values()))
        missing = [r for r in range(self.size) if r not in p.anns and r not in joined]
        gone = [r for r in missing if r in self.shut]
        if gone:
            return Response(p.name, first.kind, p.anns, error=(
                f"{first.kind} of tensor '{p.name}' cannot complete: rank(s) {_ranks(gone)} "
                "called shutdown() without submitting it"), error_kind="shutdown")
        if missing:
            return None
        err = check_agreement(first.kind, p.name, p.anns)
        if err:
            return Response(p.name, first.kind, p.anns, joined=joined, error=err, error_kind="mismatch")
        part_joined = frozenset(r for r in joined if r not in p.anns)
        if part_joined and first.kind not in ("allreduce", "allgather", "barrier"):
            return Response(p.name, first.kind, p.anns, joined=part_joined, error=(
                f"{first.kind} of tensor '{p.name}' cannot run while rank(s) "
                f"{_ranks(sorted(part_joined))} have joined; only allreduce, allgather and "
                "barrier continue after hvd.join()"), error_kind="joined")
        if first.kind == "alltoall":
            bad = {r: a.splits for r, a in p.anns.items() if a.splits is not None and len(a.splits) != self.size}
            if bad:
                return Response(p.name, first.kind, p.anns, error=(
                    f"alltoall of tensor '{p.name}': splits must have one entry per rank "
                    f"({self.size}): {group_ranks(bad)}"), error_kind="mismatch")
        data = p.data if p.data and len(p.data) == len(p.anns) else None
        return Response(p.name, first.kind, p.anns, joined=part_joined, data=data)

    def stalled(self, now: float, older_than: float) -> list:
        """Requests some ranks submitted and others have not, for longer than ``older_than`` s."""
        joined = set(self.joined)
        out = []
        for p in self.pending.values():
            if now - p.since >= older_than and p.anns:
                missing = [r for r in range(self.size) if r not in p.anns and r not in joined]
                if missing:
                    out.append(StallInfo(p.name, next(iter(p.anns.values())).kind,
                                         sorted(p.anns), missing, p.since))
        return out


# ---------------------------------------------------------------- fusion

_ITEMSIZE = {"bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8,
             "float16": 4, "bfloat16": 4, "float32": 4, "float64": 8}


def buffer_itemsize(dtype: str) -> int:
    """Bytes per element in a reduction buffer (half types reduce in float32)."""
    size = _ITEMSIZE.get(dtype)
    return size if size is not None else np.dtype(dtype).itemsize


def nbytes(ann: Ann) -> int:
    return math.prod(ann.shape or ()) * buffer_itemsize(ann.dtype or "uint8")


@dataclass
class Bucket:
    """Allreduces carried out as one reduction over one fusion buffer."""

    responses: list
    key: tuple

    @property
    def names(self) -> list:
        return [r.name for r in self.responses]


def plan_fusion(responses: list, threshold: int, alone: int = 0) -> list:
    """Group ready allreduces that share dtype, op, scale factors, device and joined ranks
    into buckets of at most ``threshold`` bytes (a larger tensor gets a bucket of its own;
    ``threshold`` 0 disables fusion). Other responses pass through unchanged, in order;
    a bucket takes the place of its first member.

    A CPU tensor of at least ``alone`` bytes (when > 0) also gets a bucket of its own and
    leaves the open bucket open: the MPI backend reduces a big tensor in cache-sized pieces
    in its own memory, where fusing it would only add a pass to pack it and one to unpack.
    """
    plan: list = []
    open_buckets: dict[tuple, tuple[Bucket, int]] = {}
    for resp in responses:
        if resp.kind != "allreduce" or resp.error is not None or resp.data is not None:
            plan.append(resp)   # eager allreduces are reduced locally from the negotiation data
            continue
        a = next(iter(resp.anns.values()))      # resp.first, without the property call
        key = (a.dtype, a.op, a.prescale, a.postscale, a.device, resp.joined)   # fusion key
        size = nbytes(a)
        if 0 < alone <= size and a.device == "cpu":
            plan.append(Bucket([resp], key))
            continue
        current = open_buckets.get(key)
        if threshold > 0 and current is not None and current[1] + size <= threshold:
            current[0].responses.append(resp)
            open_buckets[key] = (current[0], current[1] + size)
            continue
        bucket = Bucket([resp], key)
        plan.append(bucket)
        open_buckets[key] = (bucket, size)
    return plan
