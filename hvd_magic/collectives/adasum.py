"""Adasum: adaptive summation of every rank's vector (op=hvd.Adasum).

From Maleki et al., "Scaling Distributed Training with Adaptive Summation" (MLSys 2021).
Two vectors combine as::

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

(a side whose squared norm is below ~1.5e-154 keeps coefficient 1: it is added as it is).
Orthogonal vectors are summed, equal vectors give the vector itself, and in between a
vector loses half of its projection on the other.

Across ranks the vectors are combined pairwise in a binary tree by recursive vector
halving, distance doubling, as Horovod's CPU Adasum does. With ``p`` the largest power of
two not above the number of ranks:

1. fold: rank ``p + i`` sends its whole vector to rank ``i``, which combines the two
   (rank ``i``'s vector on the left); ranks ``p..size-1`` then wait for the result;
2. halving, for level = 1, 2, 4, ... < p: the partner is ``rank ^ level``; both hold the same
   element range; the rank without the level's bit keeps the lower half (``n // 2``
   elements), the other the upper half; each sends the half it gives up and receives the
   partner's copy of the half it keeps. Each rank then holds one piece of the left vector
   (the combined vector of the ranks without the bit) and the same piece of the right one.
   The partial ``[a.b, |left|^2, |right|^2]`` of the pieces are summed over the level's
   group (the ``2 * level`` ranks with the same ``rank // (2 * level)``), whose pieces make
   up the whole vector, and each rank combines its piece with the full dot products;
3. gathering: the levels run backwards and each rank sends the range it holds and receives
   the partner's, so each element is computed by exactly one rank and every rank ends
   with identical bytes; rank ``i`` sends the result to rank ``p + i``.

So the result is the tree ``adasum(adasum(v0, v1), adasum(v2, v3))`` (4 ranks), after the
fold at other sizes (:func:`reference_adasum` computes the same tree directly). Dot
products and norms accumulate in float64; the vector stays in its float32/float64 buffer.

The top half of this module is pure (numpy); :func:`adasum_allreduce` does the MPI calls.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import numpy as np

#: squared norms below this count as zero (the side is added with coefficient 1)
TINY = float(np.sqrt(np.finfo(np.float64).tiny))
#: message tag of the point-to-point exchanges
TAG = 0x4144
_CHUNK = 1 << 16      # elements per float64 conversion when a float32 vector's dots are taken


# ------------------------------------------------------------------ pure: the math

def coefficients(dot: float, anorm2: float, bnorm2: float) -> tuple:
    """The two coefficients ``(ca, cb)`` with ``adasum(a, b) = ca * a + cb * b``.

    >>> coefficients(0.0, 1.0, 4.0)          # orthogonal: a plain sum
    (1.0, 1.0)
    >>> coefficients(1.0, 1.0, 1.0)          # a == b: the vector itself
    (0.5, 0.5)
    """
    ca = 1.0 - dot / (2.0 * anorm2) if anorm2 >= TINY else 1.0
    cb = 1.0 - dot / (2.0 * bnorm2) if bnorm2 >= TINY else 1.0
    return ca, cb


def dot_norms(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``[a.b, |a|^2, |b|^2]`` of two 1-D arrays of one length, accumulated in float64."""
    out = np.zeros(3, dtype=np.float64)
    if a.dtype == np.float64 and b.dtype == np.float64:
        out[:] = np.dot(a, b), np.dot(a, a), np.dot(b, b)
        return out
    for lo in range(0, a.size, _CHUNK):
        x = a[lo:lo + _CHUNK].astype(np.float64)
        y = b[lo:lo + _CHUNK].astype(np.float64)
        out += (np.dot(x, y), np.dot(x, x), np.dot(y, y))
    return out


def combine_into(a: np.ndarray, b: np.ndarray, ca: float, cb: float) -> None:
    """``a := ca * a + cb * b`` in ``a``'s dtype; ``b`` is scratch (it is scaled in place)."""
    t = a.dtype.type
    if ca != 1.0:
        np.multiply(a, t(ca), out=a)
    if cb != 1.0:
        np.multiply(b, t(cb), out=b)
    np.add(a, b, out=a)


def adasum_pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The two-vector formula on whole vectors (float64 result); ``a`` is the left one.

    >>> adasum_pair(np.array([1., 0.]), np.array([0., 2.]))
    array([1., 2.])
    >>> adasum_pair(np.array([3., 4.]), np.array([3., 4.]))
    array([3., 4.])
    """
    a = np.asarray(a, dtype=np.float64).reshape(-1)
    b = np.asarray(b, dtype=np.float64).reshape(-1)
    dot, an, bn = dot_norms(a, b)
    ca, cb = coefficients(dot, an, bn)
    return ca * a + cb * b


def largest_pow2(n: int) -> int:
    """The largest power of two not above ``n`` (n >= 1)."""
    return 1 << (int(n).bit_length() - 1)


def reference_adasum(vectors: Sequence[np.ndarray]) -> np.ndarray:
    """Adasum of every rank's vector (``vectors[r]`` is rank r's), in float64, in the tree
    order :func:`adasum_allreduce` uses: fold rank ``p + i`` into rank ``i``, then pair
    neighbours level by level, the lower rank on the left."""
    if not vectors:
        raise ValueError("reference_adasum needs at least one vector")
    shape = np.shape(vectors[0])
    vs = [np.asarray(v, dtype=np.float64).reshape(-1) for v in vectors]
    p = largest_pow2(len(vs))
    for i in range(len(vs) - p):
        vs[i] = adasum_pair(vs[i], vs[p + i])
    vs = vs[:p]
    while len(vs) > 1:
        vs = [adasum_pair(vs[k], vs[k + 1]) for k in range(0, len(vs), 2)]
    return vs[0].reshape(shape)


# ------------------------------------------------------------------ pure: the plan

class Step(NamedTuple):
    """One level of the halving phase, seen from one rank."""

    level: int            # 1, 2, 4, ...
    partner: int          # rank ^ level
    high: bool            # this rank has the level's bit: it keeps the upper half
    keep: tuple           # element range [lo, hi) it keeps and combines
    send: tuple           # element range [lo, hi) it gives to the partner
    color: int            # its reduction group at this level: rank // (2 * level)


class Plan(NamedTuple):
    """What one rank does in an Adasum of ``n`` elements over ``size`` ranks."""

    p: int                # ranks taking part in the halving (largest power of two)
    fold: Optional[int]   # the partner of the fold (rank p + i <-> rank i), or None
    folded: bool          # True: this rank gives its vector to ``fold`` and gets the result
    steps: tuple          # Step per level, lowest level first (empty when folded)


def plan_adasum(rank: int, size: int, n: int) -> Plan:
    """The exchanges of ``rank`` in an Adasum of ``n`` elements over ``size`` ranks.

    >>> plan_adasum(2, 3, 5)                 # 3 ranks: rank 2 folds into rank 0
    Plan(p=2, fold=0, folded=True, steps=())
    >>> [(s.partner, s.keep, s.send) for s in plan_adasum(1, 4, 5).steps]
    [(0, (2, 5), (0, 2)), (3, (2, 3), (3, 5))]
    """
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside 0..{size - 1}")
    p = largest_pow2(size)
    if rank >= p:
        return Plan(p, rank - p, True, ())
    fold = rank + p if rank + p < size else None
    steps = []
    lo, hi = 0, n
    level = 1
    while level < p:
        mid = lo + (hi - lo) // 2
        high = bool(rank & level)
        keep, send = ((mid, hi), (lo, mid)) if high else ((lo, mid), (mid, hi))
        steps.append(Step(level, rank ^ level, high, keep, send, rank // (2 * level)))
        lo, hi = keep
        level <<= 1
    return Plan(p, fold, False, tuple(steps))


def group_colors(rank: int, size: int) -> list:
    """This rank's reduction group per level (None: not in any, a folded rank); the
    groups are made once per communicator by splitting it with these colors."""
    p = largest_pow2(size)
    levels = max(p.bit_length() - 1, 0)
    return [rank // (2 << k) if rank < p else None for k in range(levels)]


# ------------------------------------------------------------------ MPI driver

_GROUPS: dict = {}    # id(comm) -> (comm, [level communicators])


def _groups(comm) -> list:
    """The level communicators of ``comm`` (made on first use, collectively: every rank
    reaches its first Adasum of ``comm`` at the same request). Kept for the process's life."""
    entry = _GROUPS.get(id(comm))
    if entry is not None and entry[0] is comm:
        return entry[1]
    from mpi4py import MPI
    colors = group_colors(comm.Get_rank(), comm.Get_size())
    groups = [comm.Split(MPI.UNDEFINED if c is None else c, comm.Get_rank()) for c in colors]
    _GROUPS[id(comm)] = (comm, groups)
    return groups


def adasum_allreduce(comm, buf: np.ndarray) -> np.ndarray:
    """Replace ``buf`` (1-D, contiguous, float32 or float64, the same length on every rank)
    by the Adasum of every rank's ``buf``; every rank of ``comm`` calls it. Returns ``buf``.

    Example, 2 ranks::

        rank 0: adasum_allreduce(comm, np.array([1., 0.]))  -> [1., 1.]
        rank 1: adasum_allreduce(comm, np.array([0., 1.]))  -> [1., 1.]
        rank 0: adasum_allreduce(comm, np.array([2., 2.]))  -> [2., 2.]
        rank 1: adasum_allreduce(comm, np.array([2., 2.]))  -> [2., 2.]
    """
    if buf.ndim != 1 or not buf.flags.c_contiguous or buf.dtype.kind != "f" or buf.itemsize < 4:
        raise TypeError(f"adasum_allreduce takes a 1-D contiguous float32/float64 array, got "
                        f"{buf.dtype} of shape {buf.shape}")
    size = comm.Get_size()
    if size == 1:
        return buf
    groups = _groups(comm)
    from mpi4py import MPI
    plan = plan_adasum(comm.Get_rank(), size, buf.size)
    if plan.folded:
        comm.Send(buf, dest=plan.fold, tag=TAG)
        comm.Recv(buf, source=plan.fold, tag=TAG)
        return buf
    if plan.fold is not None:
        other = np.empty_like(buf)
        comm.Recv(other, source=plan.fold, tag=TAG)
        combine_into(buf, other, *coefficients(*dot_norms(buf, other)))
        del other
    scratch = np.empty((buf.size + 1) // 2, dtype=buf.dtype)
    for step, group in zip(plan.steps, groups):
        mine = buf[step.keep[0]:step.keep[1]]
        theirs = scratch[:mine.size]
        comm.Sendrecv(buf[step.send[0]:step.send[1]], step.partner, TAG,
                      theirs, step.partner, TAG)
        dots = dot_norms(mine, theirs)
        if step.high:                     # slot 1: the left (low) side's norm
            dots[1], dots[2] = dots[2], dots[1]
        group.Allreduce(MPI.IN_PLACE, dots, op=MPI.SUM)
        dot, left, right = dots
        ca, cb = coefficients(dot, right, left) if step.high else coefficients(dot, left, right)
        combine_into(mine, theirs, ca, cb)
    for step in reversed(plan.steps):
        comm.Sendrecv(buf[step.keep[0]:step.keep[1]], step.partner, TAG,
                      buf[step.send[0]:step.send[1]], step.partner, TAG)
    if plan.fold is not None:
        comm.Send(buf, dest=plan.fold, tag=TAG)
    return buf
