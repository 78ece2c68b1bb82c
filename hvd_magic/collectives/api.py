"""Horovod's collectives on numpy arrays and CPU torch tensors.

Each collective is called by every rank with a tensor of its own; each has an
``_async`` twin returning a handle for :func:`poll` / :func:`synchronize`.
Tensors are matched across ranks by ``name`` (generated from the call order when
not given, so unnamed calls must come in the same order on every rank).
"""
from __future__ import annotations

import itertools
import math
import pickle
import threading
from typing import Any, Optional

import numpy as np

from . import ops, progress
from .errors import OpNotSupportedError
from .handles import NOT_TAKEN, GroupHandle, Handle
from .ops import Average
from .negotiation import Ann, allreduce_ann, new_tuple
from .process_sets import ProcessSet, engine_of, global_process_set
from .state import engine, require, runtime

_GLOBAL = global_process_set

_counters: dict[str, itertools.count] = {}
_counter_lock = threading.Lock()


def request_name(kind: str, name: Optional[str], eng: Any = None) -> str:
    """``name``, checked, or the next ``kind.noname.N``. Each engine (``eng``, default the
    global one) numbers its own unnamed calls from 0: a process set's ranks number them alike
    whatever other sets they are in, and after an elastic reset a joined rank numbers them
    as the others do."""
    if name is not None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty string, got {name!r}")
        return name
    if eng is None:
        eng = runtime.engine
    counters = _counters if eng is None else eng.noname
    c = counters.get(kind)
    if c is None:
        with _counter_lock:
            c = counters.setdefault(kind, itertools.count())
    return f"{kind}.noname.{next(c)}"     # (next() on a count is atomic: no lock needed)


_NP_NAMES = ops._NP_NAMES


def check_tensor(tensor: Any, what: str) -> tuple:
    if type(tensor) is np.ndarray:          # the common case, without the torch checks
        name = _NP_NAMES.get(tensor.dtype)
        if name is not None:
            return name, tensor.shape, "cpu"
    if not (isinstance(tensor, np.ndarray) or ops.is_torch(tensor)):
        raise TypeError(f"{what} takes a numpy array or a torch tensor, not {type(tensor).__name__}")
    return ops.dtype_name(tensor), tuple(tensor.shape), ops.device_of(tensor)


def scale_factor(x: Any, label: str) -> float:
    if type(x) is float:
        return x
    try:
        return float(x)
    except (TypeError, ValueError):
        raise TypeError(f"{label} must be a number, got {x!r}") from None


# ---------------------------------------------------------------- allreduce

def allreduce_async(tensor: Any, name: Optional[str] = None, op: Any = Average,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start an allreduce; see :func:`allreduce`."""
    return submit_allreduce(tensor, None, name, op, prescale_factor, postscale_factor,
                            process_set=process_set)


def allreduce_async_(tensor: Any, name: Optional[str] = None, op: Any = Average,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """In-place :func:`allreduce_async`: the result is written into ``tensor``."""
    return submit_allreduce(tensor, tensor, name, op, prescale_factor, postscale_factor,
                            process_set=process_set)


#: What a call's arguments decide, kept per (name, dtype, shape, device, op, scale factors):
#: for a named call its request, for an unnamed one (name None) the request's fields after
#: its name and the response cache's key of such a call; and its size. A training loop
#: calls with the same names and keys every step, so the checks and conversions below run
#: once per key, not per call.
_DECIDED: dict = {}
_DECIDED_CAP = 1 << 15


def decide(tensor, name, op, prescale, postscale, e) -> Optional[tuple]:
    """``(request, key)`` of a global-set allreduce whose arguments were decided before (see
    ``_DECIDED``), counted in the live panel's bytes: ``key`` is the response cache's key of
    an unnamed call's request (what ``ResponseCache.key`` makes of its numbered name, made
    once: 0.25 us a call less), None for a named one. None: not seen yet (or not a tensor).
    (A name that is not a non-empty string is never kept: such a call is checked in full.)"""
    try:
        decided = _DECIDED.get((name, tensor.dtype, tensor.shape,
                                getattr(tensor, "device", None), op, prescale, postscale))
    except (AttributeError, TypeError):       # not a tensor, or an unhashable argument
        return None
    if decided is None:
        return None
    ann, size, unnamed = decided
    progress.allreduce_bytes += size          # the live panel's gradient bytes per step
    if unnamed is None:
        return ann, None
    return new_tuple(Ann, (request_name("allreduce", None, e),) + ann), unnamed


def submit_allreduce(tensor, out, name, op, prescale, postscale, urgent=False,
                     process_set=_GLOBAL) -> Handle:
    e = runtime.engine
    if process_set is _GLOBAL and e is not None:
        d = decide(tensor, name, op, prescale, postscale, e)
        if d is not None:
            return e.submit(d[0], tensor, out, None, urgent)
    dtype, shape, device = check_tensor(tensor, "allreduce")
    op_ = ops.to_op(op)
    ops.check_op_dtype(op_, dtype)
    eng = engine_of(process_set)
    ann = allreduce_ann(request_name("allreduce", name, eng), dtype, shape, int(op_),
                        scale_factor(prescale, "prescale_factor"), scale_factor(postscale, "postscale_factor"),
                        device)
    size = math.prod(shape) * ops.np_dtype(dtype).itemsize
    if eng is e:
        try:
            key = (name, tensor.dtype, tensor.shape, getattr(tensor, "device", None), op,
                   prescale, postscale)
            if len(_DECIDED) > _DECIDED_CAP:
                _DECIDED.clear()
            _DECIDED[key] = ((ann, size, None) if name is not None else
                             (ann[1:], size, ("allreduce.noname\0",) + ann[1:]))
        except TypeError:                     # an unhashable argument: decided per call
            pass
    progress.allreduce_bytes += size
    return eng.submit(ann, tensor, out, urgent=urgent)


def run_allreduce(tensor, out, name, op, prescale, postscale, process_set=_GLOBAL) -> Any:
    """A blocking allreduce: on the engine's short path (:meth:`Engine.run_now`) when the
    request was decided and carried out before, else submitted and waited for."""
    e = runtime.engine
    if process_set is _GLOBAL and e is not None and e.short_path:
        d = decide(tensor, name, op, prescale, postscale, e)
        if d is not None:
            ann = d[0]
            res = e.run_now(ann, tensor, out, d[1])
            if res is NOT_TAKEN:
                return e.submit(ann, tensor, out, urgent=True).wait()
            return res.wait() if type(res) is Handle else res
    return submit_allreduce(tensor, out, name, op, prescale, postscale, True,
                            process_set).wait()


def allreduce(tensor: Any, name: Optional[str] = None, op: Any = Average,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> Any:
    """Reduce ``tensor`` over all ranks; every rank gets the result (a new tensor).

    ``op`` is Average (default), Sum, Min, Max or Product. The input is multiplied by
    ``prescale_factor`` before and the result by ``postscale_factor`` after the reduction.
    Integer Average rounds toward zero; float16/bfloat16 are reduced in float32. With
    ``process_set``, only its ranks take part (and only they call it).

    Example, 2 ranks::

        rank 0: allreduce(np.array([1., 2.]))            -> [2., 3.]
        rank 1: allreduce(np.array([3., 4.]))            -> [2., 3.]
        rank 0: allreduce(np.array([1., 2.]), op=hvd.Sum) -> [4., 6.]
    """
    return run_allreduce(tensor, None, name, op, prescale_factor, postscale_factor, process_set)


def allreduce_(tensor: Any, name: Optional[str] = None, op: Any = Average,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> Any:
    """In-place :func:`allreduce`: ``tensor`` holds the result and is returned."""
    return run_allreduce(tensor, tensor, name, op, prescale_factor, postscale_factor, process_set)


# ---------------------------------------------------------------- allgather

def allgather_async(tensor: Any, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    dtype, shape, device = check_tensor(tensor, "allgather")
    if shape == ():
        tensor = tensor.reshape(1)
        shape = (1,)
    eng = engine_of(process_set)
    return eng.submit(Ann(request_name("allgather", name, eng), "allgather", dtype, shape,
                          device=device), tensor)


def allgather(tensor: Any, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> Any:
    """Concatenate every rank's tensor along the first dimension (which may differ by rank).

    Example, 2 ranks::

        rank 0: allgather(np.array([[1, 2]]))          -> [[1, 2], [3, 4], [5, 6]]
        rank 1: allgather(np.array([[3, 4], [5, 6]]))  -> [[1, 2], [3, 4], [5, 6]]
    """
    return allgather_async(tensor, name, process_set).wait()


# ---------------------------------------------------------------- broadcast

def check_root(root_rank: Any, eng: Any = None) -> int:
    """``root_rank`` (an hvd rank) checked, as ``eng``'s communicator numbers it."""
    if isinstance(root_rank, bool) or not isinstance(root_rank, (int, np.integer)):
        raise TypeError(f"root_rank must be an int, got {root_rank!r}")
    n = require().size
    if not 0 <= int(root_rank) < n:
        raise ValueError(f"root_rank={root_rank} is out of range: there are {n} ranks (0..{n - 1})")
    if eng is None or eng.ranks is None:
        return int(root_rank)
    if root_rank not in eng.ranks:
        raise ValueError(f"root_rank={root_rank} is not in process set {eng.set_id} (ranks "
                         f"{', '.join(map(str, eng.ranks))}); root_rank is the global rank of "
                         "one of its ranks")
    return eng.ranks.index(root_rank)


def broadcast_async(tensor: Any, root_rank: int, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    return _broadcast(tensor, root_rank, name, process_set, None)


def broadcast_async_(tensor: Any, root_rank: int, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Handle:
    return _broadcast(tensor, root_rank, name, process_set, tensor)


def _broadcast(tensor: Any, root_rank: int, name: Optional[str], process_set: Any, out: Any) -> Handle:
    dtype, shape, device = check_tensor(tensor, "broadcast")
    eng = engine_of(process_set)
    ann = Ann(request_name("broadcast", name, eng), "broadcast", dtype, shape,
              root=check_root(root_rank, eng), device=device)
    return eng.submit(ann, tensor, out=out)


def broadcast(tensor: Any, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> Any:
    """Every rank gets a copy of ``root_rank``'s tensor (shapes and dtypes must match).

    Example, 2 ranks::

        rank 0: broadcast(np.array([1, 2]), root_rank=0)  -> [1, 2]
        rank 1: broadcast(np.array([0, 0]), root_rank=0)  -> [1, 2]

    With ``process_set``, ``root_rank`` is still the global rank of one of its ranks.
    """
    return broadcast_async(tensor, root_rank, name, process_set).wait()


def broadcast_(tensor: Any, root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> Any:
    """In-place :func:`broadcast`: ``tensor`` is overwritten with the root's values."""
    return broadcast_async_(tensor, root_rank, name, process_set).wait()


# ---------------------------------------------------------------- alltoall

def alltoall_async(tensor: Any, splits: Any = None, name: Optional[str] = None,
                   process_set: ProcessSet = global_process_set) -> Handle:
    dtype, shape, device = check_tensor(tensor, "alltoall")
    eng = engine_of(process_set)
    n = eng.size
    if shape == ():
        raise ValueError("alltoall needs a tensor with at least one dimension")
    if splits is None:
        if shape[0] % n:
            raise ValueError(f"alltoall without splits needs the first dimension ({shape[0]}) to be "
                             f"divisible by the number of ranks ({n}); pass splits=[rows per rank]")
        sp = tuple([shape[0] // n] * n)
    else:
        sp = tuple(int(s) for s in (splits.tolist() if hasattr(splits, "tolist") else splits))
        if len(sp) != n or any(s < 0 for s in sp) or sum(sp) != shape[0]:
            raise ValueError(f"alltoall splits={list(sp)} must have {n} non-negative entries summing "
                             f"to the first dimension ({shape[0]})")
    give_splits = splits is not None
    like = tensor

    def post(result: Any, received: Any) -> Any:
        if not give_splits:
            return result
        recv = np.asarray(received, dtype=np.int32)
        return result, ops.wrap_like(recv, "int32", like) if ops.is_torch(like) else recv

    ann = Ann(request_name("alltoall", name, eng), "alltoall", dtype, shape, device=device,
              splits=sp)
    return eng.submit(ann, tensor, post=post)


def alltoall(tensor: Any, splits: Any = None, name: Optional[str] = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[j]`` rows of ``tensor`` to rank j (equal shares when ``splits`` is None)
    and concatenate what every rank sent here. With ``splits`` given, returns
    ``(output, received_splits)``, as Horovod does.

    Example, 2 ranks::

        rank 0: alltoall(np.array([1, 2]))  -> [1, 3]
        rank 1: alltoall(np.array([3, 4]))  -> [2, 4]
    """
    return alltoall_async(tensor, splits, name, process_set).wait()


# ---------------------------------------------------------------- reducescatter

def reducescatter_async(tensor: Any, name: Optional[str] = None, op: Any = Average,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                        process_set: ProcessSet = global_process_set) -> Handle:
    dtype, shape, device = check_tensor(tensor, "reducescatter")
    if shape == ():
        raise ValueError("reducescatter needs a tensor with at least one dimension")
    op = ops.to_op(op)
    if op == ops.Adasum:
        raise OpNotSupportedError("reducescatter does not take op=hvd.Adasum (Adasum is an allreduce); "
                         "use hvd.Average or hvd.Sum")
    ops.check_op_dtype(op, dtype)
    eng = engine_of(process_set)
    ann = Ann(request_name("reducescatter", name, eng), "reducescatter", dtype, shape,
              int(op), -1, scale_factor(prescale_factor, "prescale_factor"),
              scale_factor(postscale_factor, "postscale_factor"), device)
    return eng.submit(ann, tensor)


def reducescatter(tensor: Any, name: Optional[str] = None, op: Any = Average,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                  process_set: ProcessSet = global_process_set) -> Any:
    """Reduce over all ranks, then give each rank its share of the first dimension
    (equal shares; the first ranks get one more row when it does not divide).

    Example, 2 ranks, op=Sum::

        rank 0: reducescatter(np.array([1, 2, 3]), op=hvd.Sum)  -> [2, 4]
        rank 1: reducescatter(np.array([1, 2, 3]), op=hvd.Sum)  -> [6]
    """
    return reducescatter_async(tensor, name, op, prescale_factor, postscale_factor, process_set).wait()


# ---------------------------------------------------------------- barrier, join

def barrier(name: Optional[str] = None, process_set: ProcessSet = global_process_set) -> None:
    """Return once every rank (of ``process_set``) has called barrier (ranks that joined
    count as arrived)."""
    eng = engine_of(process_set)
    eng.submit(Ann(request_name("barrier", name, eng), "barrier"), None).wait()


def join() -> int:
    """This rank has no more data: keep serving the other ranks' allreduces (contributing
    nothing) until every rank has joined. Returns the last rank to join."""
    return engine().submit_join().wait()


# ---------------------------------------------------------------- objects

def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Every rank gets ``root_rank``'s picklable object.

    Example, 2 ranks::

        rank 0: broadcast_object({"lr": 0.1})  -> {"lr": 0.1}
        rank 1: broadcast_object(None)         -> {"lr": 0.1}
    """
    eng = engine_of(process_set)
    root = check_root(root_rank, eng)
    if eng.rank == root:
        data = np.frombuffer(_dumps(obj), dtype=np.uint8)
        shape: Optional[tuple] = data.shape
    else:
        data, shape = np.empty(0, dtype=np.uint8), None
    ann = Ann(request_name("broadcast_object", name, eng), "broadcast_object", "uint8",
              shape, root=root, obj=True)
    raw = eng.submit(ann, data).wait()
    return obj if eng.rank == root else pickle.loads(raw.tobytes())


def allgather_object(obj: Any, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> list:
    """List of every rank's picklable object, in rank order.

    Example, 2 ranks::

        rank 0: allgather_object("a")  -> ["a", "b"]
        rank 1: allgather_object("b")  -> ["a", "b"]
    """
    data = np.frombuffer(_dumps(obj), dtype=np.uint8)
    eng = engine_of(process_set)
    ann = Ann(request_name("allgather_object", name, eng), "allgather", "uint8", data.shape)
    return eng.submit(ann, data, post=_split_objects).wait()


def _dumps(obj: Any) -> bytes:
    try:
        import cloudpickle  # functions and lambdas defined in a notebook cell
        return cloudpickle.dumps(obj)
    except ImportError:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _split_objects(raw: np.ndarray, rows: Any) -> list:
    out, off = [], 0
    for n in rows:
        out.append(pickle.loads(raw[off:off + n].tobytes()))
        off += n
    return out


# ---------------------------------------------------------------- handles

#: How long :func:`poll` of an unfinished operation waits for it before it answers False.
POLL_WAIT_S = 200e-6


def poll(handle: Handle) -> bool:
    """True once the operation behind ``handle`` has finished. While it has not, the call
    waits for it up to ``POLL_WAIT_S`` (0.2 ms) as :func:`synchronize` would, releasing the
    GIL: the engine thread that carries the operation out needs the GIL between its MPI
    calls, and a loop of polls that held it would hand it over only every 5 ms (Python's
    switch interval). A 400 KB allreduce polled in such a loop took 27 ms at 2 ranks
    instead of 0.4 ms."""
    if not isinstance(handle, (Handle, GroupHandle)):
        raise TypeError(f"poll takes a handle from an *_async call, not {type(handle).__name__}")
    return handle.poll(POLL_WAIT_S)


def synchronize(handle: Handle, timeout: Optional[float] = None) -> Any:
    """Wait for ``handle``'s operation and return its result (raising its error, if any).
    The wait can be interrupted (Ctrl-C, the notebook's stop button)."""
    if not isinstance(handle, (Handle, GroupHandle)):
        raise TypeError(f"synchronize takes a handle from an *_async call, not {type(handle).__name__}")
    return handle.wait(timeout)


# ---------------------------------------------------------------- introspection, timeline

def pending() -> list:
    """Requests of this rank, or known from others, still waiting for some ranks."""
    return engine().pending()


def autotune_status() -> Optional[dict]:
    """With ``HOROVOD_AUTOTUNE=1``, the setting in effect on this rank: ``{"active": True
    while trying, "trial": n, "fusion_mb": ..., "cycle_ms": ...}``; None without autotune."""
    return engine().tune_status


def subscribe(callback: Any) -> Any:
    """Call ``callback(events)`` on this rank's engine thread with each batch of timeline
    events ``(rank, tensor, phase, start_us, dur_us, args)``; returns an unsubscribe function."""
    st = require()
    return st.timeline.subscribers.add(callback)


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record a Chrome-trace timeline to ``file_path`` (written by rank 0). Call on every rank."""
    from .timeline import TimelineWriter
    st = require()
    eng = engine()
    barrier(name=request_name("timeline.start", None))
    if st.rank == 0:
        if eng.writer is not None:
            eng.writer.close()
        eng.writer = TimelineWriter(file_path, mark_cycles)
    st.timeline.mark_cycles = mark_cycles
    st.timeline.recording = True


def stop_timeline() -> None:
    """Stop recording and close the timeline file (valid JSON from then on). Call on every rank."""
    st = require()
    eng = engine()
    barrier(name=request_name("timeline.stop", None))   # carries every rank's remaining events to rank 0
    st.timeline.recording = False
    if eng.writer is not None:
        eng.writer.close()
        eng.writer = None
