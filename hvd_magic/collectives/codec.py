"""Announcements on the wire, and the cache of recurring cycles.

:class:`AnnCodec` sends an announcement a rank has made before as a small index into a
table every rank keeps alike (unnamed calls as the step of their number);
:class:`CycleCache` keeps the decisions of cycles whose message bytes recur (a training
loop's steady state), so a hit skips decoding and negotiation. Pure: no I/O, no threads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from .negotiation import Ann, RankMsg, new_tuple


def split_noname(name: str) -> Optional[tuple]:
    """``(head, number, rest)`` of an unnamed call's name (``kind.noname.N`` with an
    optional ``.suffix``), or None for any other name.

    >>> split_noname("allreduce.noname.17")
    ('allreduce.noname', 17, '')
    >>> split_noname("allreduce.noname.0.3")
    ('allreduce.noname', 0, '.3')
    """
    head, sep, num = name.rpartition(".")
    if num.isdigit() and head.endswith(".noname") and ".noname." not in head:
        return head, int(num), ""           # (the usual form, in fewer steps)
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
    return new_tuple(Ann, (nn[0],) + a[1:]), nn


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
                out.append(new_tuple(Ann, (f"{head}.{num}{x[2]}",) + key[1:]))
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


@dataclass
class KeptCycle:
    """A cycle's decisions kept by :class:`CycleCache`."""

    responses: list                 # the decisions, in order
    plan: Optional[list]            # their fusion plan (None for one decision)
    moved: Optional[dict]           # unnamed calls: how the cycle moved the counters
    where: Optional[list]           # unnamed calls: each decision's place in this rank's message


class CycleCache:
    """Decisions of cycles that recur byte for byte (a training loop's steady state).

    A cycle is kept when it started and ended with nothing pending, every rank's message is
    :meth:`cacheable` (only announcements made by table index, see :class:`AnnCodec`, and
    no joins, cancels, shutdowns or timeline events), and none of its
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

    def get(self, key: Optional[tuple], busy: bool) -> Optional[KeptCycle]:
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
                and not (wire.cancels or wire.join or wire.shutdown or wire.events or wire.tune
                     or wire.invalid)
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
        self.cycles[key] = KeptCycle(responses, plan, moved or None, where)

