"""MPI backend: mpi4py collectives on numpy buffers (CPU tensors).

Allreduce follows one rule: the engine fuses small tensors into one buffer up to
``HOROVOD_FUSION_THRESHOLD``; each fusion buffer, and each tensor of at least
``HVD_MAGIC_ALLREDUCE_CHUNK_MB`` (reduced alone), goes to MPI in place where the caller
allows it (``allreduce_``), else through the backend's own buffer (:meth:`_allreduce_one`),
as MPI calls of at most that many bytes (one call when it fits, or with
``HVD_MAGIC_ALLREDUCE_CHUNK_MB=0``); on one host a buffer from 64 KiB to one piece goes
through shared memory instead (:mod:`.shm`). Pieces, because one big call runs through
temporaries of the whole size and falls out of the caches: 16 and 64 MiB run faster as
1 MiB pieces (``benchmarks/collectives.py`` prints both).
"""
from __future__ import annotations

import itertools
import math
import operator
import weakref
from typing import Any, Optional

import numpy as np
from mpi4py import MPI

from .. import ops
from ..handles import LocalReq
from ..adasum import adasum_allreduce
from ..ops import ReduceOp
from ..timeline import MEMCPY_IN, MEMCPY_OUT, now_us
from .common import chunk_spans, displacements, row_elems, scatter_rows
from .shm import SHM_MIN, ShmAllreduce

_MPI_OPS = {ReduceOp.SUM: MPI.SUM, ReduceOp.AVERAGE: MPI.SUM, ReduceOp.MIN: MPI.MIN,
            ReduceOp.MAX: MPI.MAX, ReduceOp.PRODUCT: MPI.PROD}
_BOOL_OPS = {ReduceOp.MIN: MPI.LAND, ReduceOp.MAX: MPI.LOR, ReduceOp.PRODUCT: MPI.LAND}


_UFUNCS = {}
for _op, _uf in ((ReduceOp.SUM, np.add), (ReduceOp.AVERAGE, np.add), (ReduceOp.MIN, np.minimum),
                 (ReduceOp.MAX, np.maximum), (ReduceOp.PRODUCT, np.multiply)):
    _UFUNCS[(_op, False)] = _uf
_UFUNCS.update({(ReduceOp.MIN, True): np.logical_and, (ReduceOp.MAX, True): np.logical_or,
                      (ReduceOp.PRODUCT, True): np.logical_and,
                      (ReduceOp.SUM, True): np.logical_or, (ReduceOp.AVERAGE, True): np.logical_or})


# ------------------------------------------------------ MPI's reductions, checked at start
# An MPI library's own reduction code can get integer arithmetic wrong: Open MPI 5's
# vectorized component (``op/avx``, chosen on CPUs with AVX) adds 8- and 16-bit integers
# with saturation once a buffer holds a full vector register (16 bytes and up), so uint8
# 229 + 229 gives 255, not 202, while 15 elements give 202. Each backend therefore has MPI
# reduce a probe of every (op, integer or bool dtype) locally at start (``Reduce_local``
# runs the same reduction functions as MPI's collectives on CPU buffers), compares with
# numpy, and sends the pairs MPI got wrong on any rank through an MPI op that reduces with
# numpy (the same algorithm and bytes on the wire, each reduction step done by numpy's
# wrapping arithmetic); the pairs MPI gets right, floats included, keep MPI's own op. The
# numpy op is a Python callback (it takes the GIL): at 2 ranks on one host it added about
# 1.4 us a call from 1 KiB to 60 KiB and 3% at 1 MiB. Buffers that go through shared memory
# (:mod:`.shm`) are reduced by numpy anyway.
_CHECKED_DTYPES = ("bool",) + ops.INTEGER
#: Probe length: 16 vectors of 64 bytes, then 63 elements that leave a 32-byte, a 16-byte
#: and a scalar remainder at 8-bit, so every vector width of the reduction code runs.
_PROBE_N = 1087
_NUMPY_OPS: dict = {}


def _numpy_op(ufunc: Any) -> MPI.Op:
    """An MPI op (commutative) that reduces with ``ufunc`` on any numpy dtype; one per ufunc
    for the process (mpi4py allows 32 ops made from Python functions)."""
    op = _NUMPY_OPS.get(ufunc)
    if op is None:
        def reduce(inbuf: Any, inoutbuf: Any, datatype: MPI.Datatype) -> None:
            dt = np.dtype(datatype.tocode())
            acc = np.frombuffer(inoutbuf, dtype=dt)
            ufunc(np.frombuffer(inbuf, dtype=dt), acc, out=acc)
        op = _NUMPY_OPS[ufunc] = MPI.Op.Create(reduce, commute=True)
    return op


def _probe(dtype: str, seed: int) -> np.ndarray:
    """Values over the whole range of ``dtype`` (sums and products overflow), different for
    each ``seed``."""
    x = np.arange(_PROBE_N, dtype=np.int64) * 2654435761 + (seed + 1) * 40503 + 13
    return (x & 1).astype(bool) if dtype == "bool" else x.astype(dtype)


def checked_ops(comm: MPI.Comm) -> tuple:
    """(MPI op per (int(ReduceOp), dtype name), the (op name, dtype) pairs reduced with
    numpy). Collective over ``comm`` (one allgather): each rank's finding is deterministic,
    but ranks may run on different CPUs, so the pairs any rank got wrong go through numpy
    on every rank, and all ranks reduce the same way."""
    table = {}
    for op in (ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT):
        for dtype in ops.DTYPES:
            mop = (_BOOL_OPS if dtype == "bool" else _MPI_OPS).get(op)
            if mop is not None:
                table[(int(op), dtype)] = mop
    wrong = []
    for (op, dtype), mop in table.items():
        if dtype in _CHECKED_DTYPES:
            a, got = _probe(dtype, 0), _probe(dtype, 1)
            want = _UFUNCS[(ReduceOp(op), dtype == "bool")](a, got)
            mop.Reduce_local(a, got)
            if not np.array_equal(got, want):
                wrong.append((op, dtype))
    bad = sorted({pair for found in comm.allgather(wrong) for pair in found})
    for op, dtype in bad:
        table[(op, dtype)] = _numpy_op(_UFUNCS[(ReduceOp(op), dtype == "bool")])
    for dtype in ops.DTYPES:             # Average is a Sum, divided afterwards
        if (int(ReduceOp.SUM), dtype) in table:
            table[(int(ReduceOp.AVERAGE), dtype)] = table[(int(ReduceOp.SUM), dtype)]
    return table, frozenset((ReduceOp(op).name, dtype) for op, dtype in bad)


_OPS = {int(o): o for o in ReduceOp}
_ADASUM = int(ReduceOp.ADASUM)
_AVERAGE = ReduceOp.AVERAGE
_IN_PLACE = MPI.IN_PLACE
_REQ_OF = operator.itemgetter(0)
_OUT_OF = operator.attrgetter("out")
_TENSOR_OF = operator.attrgetter("tensor")
_SIZE_OF = operator.attrgetter("size")
_NONE_T = type(None)
_SHAPE_OF = operator.attrgetter("shape")
_NDARRAY = {np.ndarray}
_DTYPES: dict = {}


def _dtypes(name: str) -> tuple:
    """(reduction dtype, carried dtype) of a dtype name, cached."""
    pair = (np.dtype("float32") if name in ops.HALF else np.dtype(name), ops.np_dtype(name))
    _DTYPES[name] = pair
    return pair


#: Out-of-place results up to this size are reduced in the backend's buffer, then copied out.
_KEEP_MAX = 64 * 1024 * 1024


def _bytes(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1).view(np.uint8)


def adasum_request(comm: Any, tl: Any, prefix: str, req: Optional[Any], ann: Any) -> None:
    """One tensor's Adasum (:mod:`..adasum`) over ``comm`` (an mpi4py communicator, or the
    gloo controller's), reduced in float32 for half types; in place where the caller allows
    it. A joined rank (``req`` None) contributes zeros, which
    change nothing."""
    dtype, n = ann.dtype, math.prod(ann.shape)
    red = (_DTYPES.get(dtype) or _dtypes(dtype))[0]
    half = dtype in ops.HALF
    target = None
    if req is None:
        work = np.zeros(n, dtype=red)
    else:
        src = req.src()
        target = None if half else (src if req.out is src else req.inplace_target())
        if target is not None:
            work = target.reshape(-1)
        else:
            work = ops.upcast(src.reshape(-1), dtype).astype(red, copy=not half)
    if ann.prescale != 1.0:
        np.multiply(work, red.type(ann.prescale), out=work)
    t0 = now_us() if tl.active else 0.0
    adasum_allreduce(comm, work)
    if tl.active:
        tl.add(ann.name, f"{prefix}_ADASUM", t0, now_us() - t0, {"bytes": int(work.nbytes)})
    if ann.postscale != 1.0:
        np.multiply(work, red.type(ann.postscale), out=work)
    if req is None:
        return
    if half:
        out = np.empty(n, dtype=ops.np_dtype(dtype))
        ops.downcast_into(out, work, dtype)
        work = out
    req.set_array(target if target is not None else work.reshape(ann.shape), dtype)


class MPIBackend:
    """Collectives over an mpi4py communicator (the engine's own duplicate)."""

    prefix = "MPI"

    def __init__(self, comm: MPI.Comm, timeline: Any, chunk: int = 0):
        """``chunk`` > 0 (every rank on one host; collective): allreduces bigger than that
        many bytes run as MPI calls of at most ``chunk`` bytes, each scaled while still in
        cache (``HVD_MAGIC_ALLREDUCE_CHUNK_MB``), and those from ``SHM_MIN`` up to ``chunk``
        bytes go through a shared-memory segment (:mod:`.shm`)."""
        self.comm = comm
        self.chunk = chunk
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.tl = timeline
        self._fusion: dict[str, np.ndarray] = {}
        self._layouts: dict = {}
        #: MPI op per (int(ReduceOp), dtype name); ``numpy_reduced``: the (op name, dtype)
        #: pairs this MPI computed wrong, reduced with numpy instead (:func:`checked_ops`)
        self.ops, self.numpy_reduced = checked_ops(comm)
        self.shm = ShmAllreduce.open(comm, chunk) if chunk >= SHM_MIN and self.size > 1 else None

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None

    def _fusion_buffer(self, dtype: np.dtype, n: int) -> np.ndarray:
        buf = self._fusion.get(dtype.str)
        if buf is None or buf.size < n:
            buf = self._fusion[dtype.str] = np.empty(max(n, 1024), dtype=dtype)
            self._layouts.clear()         # (their views are of the old buffer)
        return buf[:n]

    def _layout(self, red: np.dtype, shapes: tuple) -> tuple:
        """``(buffer, views)``: the fusion buffer for tensors of ``shapes`` packed in turn,
        and a view of each one's place in it, shaped as it is. Made once per layout: a
        training loop fuses the same tensors every step, and slicing 100 views costs
        about as much as copying 100 x 4 KiB out through them."""
        layout = self._layouts.get((red, shapes))
        if layout is None:
            sizes = [math.prod(shape) for shape in shapes]
            base = self._fusion_buffer(red, sum(sizes)).base
            if len(self._layouts) > 64:
                self._layouts.clear()
            ends = list(itertools.accumulate(sizes))
            layout = self._layouts[(red, shapes)] = (
                base[:ends[-1]], [base[end - n:end].reshape(shape)
                                  for n, end, shape in zip(sizes, ends, shapes)])
        return layout

    # -------------------------------------------------------------- allreduce
    def allreduce(self, entries: list, n_contrib: int) -> None:
        """entries: [(LocalReq or None, Ann)], all sharing dtype, op and scale factors."""
        ann0 = entries[0][1]
        if ann0.op == _ADASUM:
            for entry in entries:     # (the fusion plan gives each its own bucket)
                self._adasum(*entry)
            return
        dtype, op = ann0.dtype, _OPS[ann0.op]
        red = (_DTYPES.get(dtype) or _dtypes(dtype))[0]
        mop = self.ops[(ann0.op, dtype)]
        tl = self.tl.active
        names = [a.name for _, a in entries] if tl else []
        if len(entries) == 1 and entries[0][0] is not None and dtype not in ops.HALF:
            req, ann = entries[0]
            t0 = now_us() if tl else 0.0
            res = self._allreduce_one(req, ann0, op, red, mop, n_contrib)
            if tl:
                self.tl.add(ann.name, f"{self.prefix}_ALLREDUCE", t0, now_us() - t0,
                            {"bytes": res.nbytes, "tensors": names})
            req.set_array(res, dtype)
            return
        half = dtype in ops.HALF
        reqs = list(map(_REQ_OF, entries))
        whole = not half and ann0.prescale == 1.0 and None not in reqs
        if whole:
            tensors = list(map(_TENSOR_OF, reqs))
            outs = list(map(_OUT_OF, reqs))
            if set(map(type, outs)) == _NDARRAY and all(map(operator.is_, outs, tensors)):
                # every tensor a numpy array reduced in place (a training loop's usual
                # call): packed and unpacked as they are (numpy copies any layout and byte
                # order in and out), with no contiguous view of each made first
                buf, views = self._layout(red, tuple(map(_SHAPE_OF, tensors)))
                t0 = now_us() if tl else 0.0
                np.concatenate(tensors, axis=None, out=buf, casting="unsafe")
                t1 = now_us() if tl else 0.0
                self._reduce_into(buf, mop, op, ann0.postscale, n_contrib)
                t2 = now_us() if tl else 0.0
                for req, out, view in zip(reqs, outs, views):
                    out[...] = view
                    req.result = out
                if tl:
                    self._fused_events(entries, names, buf, t0, t1, t2)
                return
            srcs = list(map(LocalReq.src, reqs))
            sizes = list(map(_SIZE_OF, srcs))     # (C-level getters: ~0.5 us a tensor
        else:                                     # less than Python loops, 100 x 4 KiB)
            srcs = None
            sizes = [math.prod(a.shape) for _, a in entries]
        buf = self._fusion_buffer(red, sum(sizes))
        t0 = now_us() if tl else 0.0
        if whole:
            # one C call packs them all (100 x 4 KiB: 1 us a tensor less than the loop)
            np.concatenate(srcs, axis=None, out=buf, casting="unsafe")
        else:       # half types upcast, prescale, or a joined rank's identity values
            off = 0
            for (req, ann), n in zip(entries, sizes):
                dst = buf[off:off + n]
                if req is None:
                    dst.fill(ops.identity(op, red))
                else:
                    src = req.src().reshape(-1)
                    if half:
                        src = ops.upcast(src, dtype)
                    if ann0.prescale != 1.0:
                        np.multiply(src, ann0.prescale, out=dst, casting="unsafe")
                    else:
                        dst[...] = src
                off += n
        t1 = now_us() if tl else 0.0
        self._reduce_into(buf, mop, op, ann0.postscale, n_contrib)
        t2 = now_us() if tl else 0.0
        # (0 stands for a joined rank's missing request; None is an out-of-place result)
        outs = (list(map(_OUT_OF, reqs)) if None not in reqs
                else [0 if req is None else req.out for req in reqs])
        # (by type: ``None in outs`` would compare arrays elementwise)
        fresh = buf.copy() if not half and _NONE_T in set(map(type, outs)) else None
        off = 0                                 # out-of-place results are views into it
        for req, out, n, (_, ann) in zip(reqs, outs, sizes, entries):
            end = off + n
            if req is not None:
                if type(out) is np.ndarray and not half and out.flags.c_contiguous:
                    # in place into a numpy array: one copy
                    (out if out.ndim == 1 else out.reshape(-1))[...] = buf[off:end]
                    req.result = out
                    off = end
                    continue
                part = buf[off:end]
                if half:
                    out = np.empty(n, dtype=ops.np_dtype(dtype))
                    ops.downcast_into(out, part, dtype)
                elif out is None:
                    out = fresh[off:end]
                else:
                    out = part
                req.set_array(out.reshape(ann.shape), dtype)
            off = end
        if tl:
            self._fused_events(entries, names, buf, t0, t1, t2)

    def _fused_events(self, entries: list, names: list, buf: np.ndarray, t0: float,
                      t1: float, t2: float) -> None:
        """The timeline's spans of one fused allreduce: packing (``t0`` to ``t1``), MPI
        (to ``t2``) and unpacking (to now)."""
        t3 = now_us()
        args = {"bytes": int(buf.nbytes), "tensors": names}
        for _, ann in entries:
            self.tl.add(ann.name, MEMCPY_IN, t0, t1 - t0)
            self.tl.add(ann.name, f"{self.prefix}_ALLREDUCE", t1, t2 - t1, args)
            self.tl.add(ann.name, MEMCPY_OUT, t2, t3 - t2)

    def one(self, ann: Any, n_contrib: int) -> Any:
        """How one request with ``ann``'s metadata is reduced at once, decided once for every
        later call with the same metadata (:meth:`.engine.Engine.run_now`): a function
        ``run(tensor, out) -> result``. A small contiguous numpy array of a plain type (or
        such a CPU torch tensor, in place) is reduced by one MPI call with the same arithmetic as :meth:`_allreduce_one` (every
        rank gets the same bits whichever way it took), with none of its checks; anything
        else goes through :meth:`allreduce`."""
        dtype, op = ann.dtype, _OPS[ann.op]
        red = (_DTYPES.get(dtype) or _dtypes(dtype))[0]

        def run(tensor: Any, out: Any) -> Any:
            req = LocalReq(ann, tensor, None, out)
            self.allreduce([(req, ann)], n_contrib)
            return req.result

        if not (ann.op != _ADASUM and ann.prescale == 1.0 and red.kind in "fiu"
                and math.prod(ann.shape) * red.itemsize < SHM_MIN
                and (red.kind == "f" or (op != _AVERAGE and ann.postscale == 1.0))):
            return run
        mop, allreduce, shape = self.ops[(ann.op, dtype)], self.comm.Allreduce, ann.shape
        average = op == _AVERAGE
        inplace_scale = ann.postscale / n_contrib if average else ann.postscale
        inplace_scale = red.type(inplace_scale) if inplace_scale != 1.0 else None
        copy_scale = red.type(ann.postscale) if ann.postscale != 1.0 else None
        pre = 1.0 / n_contrib if average else None     # out of place: the 1/n rides on the copy

        # a CPU torch tensor in place is reduced in its own memory through a numpy view;
        # the same tensor as last time (same object, same memory) reuses its view, which
        # torch takes 0.6 us to make (a loop passes the same tensors step after step)
        last: list = [None, 0, None]        # [weakref to the tensor, its data_ptr, view]

        def run_plain(tensor: Any, out: Any) -> Any:
            if type(tensor) is not np.ndarray or tensor.dtype is not red or not tensor.flags.c_contiguous:
                if out is tensor and ops.is_torch(tensor) and tensor.is_contiguous():
                    ref, ptr, view = last
                    if ref is None or ref() is not tensor or tensor.data_ptr() != ptr:
                        view = tensor.detach().numpy()
                        last[:] = weakref.ref(tensor), tensor.data_ptr(), view
                    allreduce(_IN_PLACE, view, op=mop)
                    if inplace_scale is not None:
                        np.multiply(view, inplace_scale, out=view)
                    return tensor
                return run(tensor, out)
            if out is tensor:
                allreduce(_IN_PLACE, tensor, op=mop)
                if inplace_scale is not None:
                    np.multiply(tensor, inplace_scale, out=tensor)
                return tensor
            if out is not None:
                return run(tensor, out)
            res = np.empty(shape, red)
            if pre is not None:
                np.multiply(tensor, pre, out=res, casting="unsafe")
            else:
                np.copyto(res, tensor)
            allreduce(_IN_PLACE, res, op=mop)
            if copy_scale is not None:
                np.multiply(res, copy_scale, out=res)
            return res
        return run_plain

    def _adasum(self, req: Optional[Any], ann: Any) -> None:
        adasum_request(self.comm, self.tl, self.prefix, req, ann)

    def _allreduce_one(self, req: Any, ann0: Any, op: ReduceOp, red: np.dtype, mop: MPI.Op,
                       n_contrib: int) -> np.ndarray:
        """The result of one request's allreduce, not fused (not half precision). In place
        where the caller allows it. Out of place, the input is copied into a new array and
        reduced there, except when MPI carries 64 KiB to 64 MiB: then it is reduced in this
        backend's buffer and copied out, because Open MPI takes several times longer on
        memory it has not seen before (2 ranks, 1 MiB: ~1 ms into a new array, ~0.2 ms here)."""
        src = req.src()
        target = src if req.out is src else req.inplace_target()   # (numpy in place)
        post, pre = ann0.postscale, ann0.prescale
        if target is not None:
            self._reduce_into(target, mop, op, post, n_contrib, None, pre)
            return target
        if red.kind == "f" and op == _AVERAGE:
            op, pre = ReduceOp.SUM, pre / n_contrib    # the 1/n rides on the copy in
        nbytes = src.nbytes
        if SHM_MIN <= nbytes <= _KEEP_MAX and not self._via_shm(nbytes):
            work = self._fusion_buffer(red, src.size).reshape(src.shape)
            self._reduce_into(work, mop, op, post, n_contrib, src, pre)
            return work.copy()
        work = np.empty(src.shape, dtype=red)
        self._reduce_into(work, mop, op, post, n_contrib, src, pre)
        return work

    def _via_shm(self, nbytes: int) -> bool:
        """Whether a buffer of ``nbytes`` goes through the shared-memory segment."""
        return self.shm is not None and SHM_MIN <= nbytes <= self.shm.slot

    def _reduce_into(self, work: np.ndarray, mop: MPI.Op, op: ReduceOp, postscale: float,
                     n_contrib: int, src: Optional[np.ndarray] = None, pre: float = 1.0) -> None:
        """``work`` (contiguous) := allreduce of ``src * pre`` (``src`` of the same shape; of
        ``work * pre`` when ``src`` is None), averaged and post-scaled, as MPI calls of at most
        ``self.chunk`` bytes; each piece is copied in and finished while it is still in cache."""
        nbytes, chunk = work.nbytes, self.chunk
        if (nbytes <= chunk or not chunk) and not self._via_shm(nbytes):
            # one MPI call (smaller tensors, or no pieces), on ``work`` as it is shaped
            if pre != 1.0:
                np.multiply(work if src is None else src, pre, out=work, casting="unsafe")
            elif src is not None:
                np.copyto(work, src, casting="unsafe")
            self.comm.Allreduce(_IN_PLACE, work, op=mop)
            self._finish_into(work, work, op, postscale, n_contrib)
            return
        flat = work.reshape(-1)
        s = src.reshape(-1) if src is not None else flat
        if self._via_shm(nbytes):
            self.shm.allreduce(flat, s, _UFUNCS[(op, flat.dtype.kind == "b")],
                               lambda out: self._finish_into(out, out, op, postscale, n_contrib),
                               pre)
            return
        for lo, hi in chunk_spans(flat.size, flat.itemsize, self.chunk):
            part = flat[lo:hi]
            if pre != 1.0:
                np.multiply(s[lo:hi], pre, out=part, casting="unsafe")
            elif src is not None:
                np.copyto(part, s[lo:hi], casting="unsafe")
            self.comm.Allreduce(_IN_PLACE, part, op=mop)
            self._finish_into(part, part, op, postscale, n_contrib)

    @staticmethod
    def _finish_into(dst: np.ndarray, res: np.ndarray, op: ReduceOp, postscale: float,
                     n_contrib: int) -> None:
        """``dst`` := ``res`` averaged (integers rounded toward zero, as Horovod's) and post-scaled, in one
        pass; ``dst`` may be ``res`` (in place: nothing is done when there is nothing to do)."""
        kind = res.dtype.kind
        if kind == "f":
            factor = postscale / n_contrib if op == _AVERAGE else postscale
            if factor != 1.0:
                np.multiply(res, res.dtype.type(factor), out=dst)
                return
        elif op == _AVERAGE and n_contrib != 1 and kind != "b":
            # toward zero: -75 / 2 -> -37, not -38 (found before ``res`` may be overwritten)
            up = (res < 0) & (res % n_contrib != 0) if kind == "i" else None
            np.floor_divide(res, n_contrib, out=dst)
            if up is not None and up.any():
                dst += up
            if postscale != 1.0:
                np.copyto(dst, dst * postscale, casting="unsafe")
            return
        elif postscale != 1.0:
            np.copyto(dst, res * postscale, casting="unsafe")
            return
        if dst is not res:
            dst[...] = res

    # -------------------------------------------------------------- allgather
    def allgather(self, req: Any, anns: dict, n_ranks: int) -> None:
        """(Every rank takes part: an allgather never runs while a rank has joined.)"""
        ann0 = next(iter(anns.values()))
        item = ops.np_dtype(ann0.dtype).itemsize
        rows = [anns[r].shape[0] if anns[r].shape else 0 for r in range(self.size)]
        re = row_elems(ann0.shape) if ann0.shape else 1
        counts = [rw * re * item for rw in rows]
        recv = np.empty(sum(counts), dtype=np.uint8)
        send = _bytes(req.src())
        t0 = now_us() if self.tl.active else 0.0
        self.comm.Allgatherv(send, [recv, counts, displacements(counts), MPI.BYTE])
        if self.tl.active:
            self.tl.add(ann0.name, f"{self.prefix}_ALLGATHER", t0, now_us() - t0, {"bytes": int(recv.nbytes)})
        shape = (sum(rows),) + tuple(ann0.shape[1:]) if ann0.shape else (sum(rows),)
        req.set_array(recv.view(ops.np_dtype(ann0.dtype)).reshape(shape), ann0.dtype, rows=rows)

    # -------------------------------------------------------------- broadcast
    def broadcast(self, req: Any, anns: dict) -> None:
        ann0 = next(iter(anns.values()))
        root = ann0.root
        shape = anns[root].shape
        dt = ops.np_dtype(ann0.dtype)
        t0 = now_us() if self.tl.active else 0.0
        if self.rank == root:
            src = req.src()
            self.comm.Bcast(_bytes(src), root=root)
            out = src if req.inplace_target() is src else src.copy()
        else:
            target = req.inplace_target()
            out = target if target is not None else np.empty(shape, dtype=dt)
            self.comm.Bcast(_bytes(out), root=root)
        if self.tl.active:
            self.tl.add(ann0.name, f"{self.prefix}_BCAST", t0, now_us() - t0, {"bytes": int(out.nbytes)})
        req.set_array(out.reshape(shape), ann0.dtype)

    # -------------------------------------------------------------- alltoall
    def alltoall(self, req: Any, anns: dict) -> None:
        ann0 = anns[self.rank]
        item = ops.np_dtype(ann0.dtype).itemsize
        re = row_elems(ann0.shape)
        send_rows = list(ann0.splits)
        recv_rows = [anns[r].splits[self.rank] for r in range(self.size)]
        scounts = [r * re * item for r in send_rows]
        rcounts = [r * re * item for r in recv_rows]
        recv = np.empty(sum(rcounts), dtype=np.uint8)
        t0 = now_us() if self.tl.active else 0.0
        self.comm.Alltoallv([_bytes(req.src()), scounts, displacements(scounts), MPI.BYTE],
                            [recv, rcounts, displacements(rcounts), MPI.BYTE])
        if self.tl.active:
            self.tl.add(ann0.name, f"{self.prefix}_ALLTOALL", t0, now_us() - t0, {"bytes": int(recv.nbytes)})
        shape = (sum(recv_rows),) + tuple(ann0.shape[1:])
        req.set_array(recv.view(ops.np_dtype(ann0.dtype)).reshape(shape), ann0.dtype, rows=recv_rows)

    # -------------------------------------------------------------- reducescatter
    def reducescatter(self, req: Any, anns: dict) -> None:
        ann0 = anns[self.rank]
        dtype, op = ann0.dtype, ReduceOp(ann0.op)
        if op == ReduceOp.ADASUM:
            raise ValueError("reducescatter does not take op=Adasum (nor does Horovod); use "
                             "hvd.Sum or hvd.Average")
        red = np.dtype("float32") if dtype in ops.HALF else np.dtype(dtype)
        rows = scatter_rows(ann0.shape[0] if ann0.shape else 1, self.size)
        re = row_elems(ann0.shape) if ann0.shape else 1
        counts = [r * re for r in rows]
        src = ops.upcast(req.src().reshape(-1), dtype).astype(red, copy=False)
        if ann0.prescale != 1.0:
            src = (src * ann0.prescale).astype(red)
        recv = np.empty(counts[self.rank], dtype=red)
        t0 = now_us() if self.tl.active else 0.0
        self.comm.Reduce_scatter(src, recv, recvcounts=counts, op=self.ops[(int(op), dtype)])
        if self.tl.active:
            self.tl.add(ann0.name, f"{self.prefix}_REDUCESCATTER", t0, now_us() - t0, {"bytes": int(src.nbytes)})
        self._finish_into(recv, recv, op, ann0.postscale, self.size)
        if dtype in ops.HALF:
            out = np.empty(recv.size, dtype=ops.np_dtype(dtype))
            ops.downcast_into(out, recv, dtype)
            recv = out
        shape = (rows[self.rank],) + tuple(ann0.shape[1:]) if ann0.shape else (rows[self.rank],)
        req.set_array(recv.reshape(shape), dtype)
