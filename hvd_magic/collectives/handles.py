"""What a collective call hands back (:class:`Handle`) and what the engine keeps of it
(:class:`LocalReq`): one request on this rank, its tensor, and the way to its result.

A handle knows the object that resolves it only through :class:`Resolver`: waiting is
``resolver.wait_for(handle, timeout)``, and the resolver hands in the outcome with
:meth:`Handle.resolve`."""
from __future__ import annotations

import sys
import time
from typing import Any, Callable, Optional, Protocol

import numpy as np
from _thread import allocate_lock as _allocate_lock

from . import ops
from .negotiation import Ann


_MAKING = _allocate_lock()

#: What :meth:`.engine.Engine.run_now` returns when it did nothing (then submit).
NOT_TAKEN = object()


class Resolver(Protocol):
    """What a handle waits through (the engine)."""

    def wait_for(self, handle: "Handle", timeout: Optional[float]) -> None:
        """Return once ``handle`` is resolved; raise TimeoutError after ``timeout`` s."""


class Handle:
    """What an ``*_async`` call returns; pass it to ``poll`` or ``synchronize``."""

    __slots__ = ("name", "kind", "_lock", "_done", "_result", "_error", "_post", "_engine", "extra")

    def __init__(self, name: str, kind: str, engine: Resolver,
                 post: Optional[Callable[[Any, Any], Any]] = None):
        self.name = name
        self.kind = kind
        # made by the first thread that blocks on the handle (most results are in before
        # anyone waits: an inline cycle or a synchronize after it), held until resolved
        self._lock = None
        self._done = False
        self._result: Any = None
        self._error: Optional[BaseException] = None
        self._post = post
        self._engine = engine
        self.extra: Any = None     # rows per rank (allgather) or received splits (alltoall)

    def done(self) -> bool:
        return self._done

    def poll(self, wait_s: float) -> bool:
        """:meth:`done`, after waiting for it up to ``wait_s`` s as :meth:`wait` does."""
        if not self._done:
            try:
                self._engine.wait_for(self, wait_s)
            except TimeoutError:
                return False
        return True

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Block until done (interruptible), then return the result or raise the error."""
        if not self._done:
            self._engine.wait_for(self, timeout)
        if self._error is not None:
            raise self._error
        return self._post(self._result, self.extra) if self._post is not None else self._result

    def block(self, timeout: float) -> bool:
        """Wait at most ``timeout`` s for :meth:`resolve` (no progress is made here);
        True: the handle is resolved."""
        lock = self._lock
        if lock is None:
            with _MAKING:          # (one lock per handle, whoever blocks first)
                lock = self._lock
                if lock is None:
                    lock = _allocate_lock()
                    lock.acquire()
                    self._lock = lock
        # resolve() sets _done before it looks for a lock: either it saw this lock and
        # releases it, or _done is already set here
        if self._done:
            return True
        if lock.acquire(True, timeout):
            lock.release()   # leave it open for any other waiter
            return True
        return False

    def resolve(self, result: Any = None, error: Optional[BaseException] = None) -> None:
        """Hand in the outcome (the first call wins) and wake the waiters."""
        if self._done:
            return
        self._result, self._error = result, error
        self._done = True
        lock = self._lock
        if lock is not None:
            lock.release()

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<hvd_magic handle {self.kind} '{self.name}' {state}>"


class LocalReq:
    """One request on this rank: the agreed metadata plus this rank's tensor (``handle``
    None: run at once on the caller's thread, :meth:`.engine.Engine.run_now`)."""

    __slots__ = ("ann", "tensor", "out", "handle", "t_submit", "result", "_src")

    def __init__(self, ann: Ann, tensor: Any, handle: Handle, out: Any = None):
        self.ann = ann
        self.tensor = tensor
        self.out = out                 # in-place target (the user's tensor), or None
        self.handle = handle
        self.t_submit = time.monotonic()
        self.result: Any = None        # the backend's result; the handle gets it (resolve)
        self._src: Optional[np.ndarray] = None

    def src(self) -> np.ndarray:
        """Contiguous numpy view (or copy) of the input."""
        if self._src is None:
            self._src = ops.as_numpy(self.tensor)
        return self._src

    def inplace_target(self) -> Optional[np.ndarray]:
        """The input's own memory when the result may be written straight into it."""
        if self.out is None:
            return None
        src = self.src()
        if ops.is_torch(self.out):
            ok = self.out.is_contiguous() and self.out.device.type == "cpu"
        else:
            ok = src is self.out or (isinstance(self.out, np.ndarray) and self.out.flags.c_contiguous
                                     and np.shares_memory(src, self.out))
        return src if ok else None

    def set_array(self, arr: Any, dtype: str, rows: Any = None) -> None:
        """Store the result (numpy carrying ``dtype``, or a torch tensor) in the user's type
        as ``result``; ``rows`` go to the handle (a request run without one has none)."""
        if rows is not None:
            self.handle.extra = rows
        if arr is self.out or (self.out is None and type(self.tensor) is np.ndarray
                               and type(arr) is np.ndarray):
            self.result = arr      # (reduced in place, or numpy in and out: as it is)
        elif self.out is not None:
            if ops.is_torch(self.out):
                torch = sys.modules["torch"]
                if isinstance(arr, np.ndarray) and self._src is not None and arr is self._src:
                    pass                                   # reduced in place already
                elif isinstance(arr, np.ndarray) and self.inplace_target() is not None:
                    # numpy copy into the tensor's own memory: a few us less than torch's copy_
                    np.copyto(self._src, arr.reshape(self._src.shape), casting="unsafe")
                else:
                    t = arr if isinstance(arr, torch.Tensor) else ops.wrap_like(arr, dtype, self.out)
                    self.out.copy_(t.reshape(self.out.shape))
            elif arr is not self.out:
                np.copyto(self.out, np.asarray(arr).reshape(self.out.shape), casting="unsafe")
            self.result = self.out
        elif isinstance(arr, np.ndarray):
            self.result = ops.wrap_like(arr, dtype, self.tensor)
        else:
            self.result = arr


def poll_first(items: list, wait_s: float) -> bool:
    """Whether every one of ``items`` (handles, or parts of a group) is done, after waiting
    up to ``wait_s`` s for the first that is not (its ``poll``)."""
    first = next((x for x in items if not x.done()), None)
    return first is None or (first.poll(wait_s) and all(x.done() for x in items))


class GroupHandle:
    """Handle of a grouped allreduce: ``synchronize`` returns the list of results."""

    def __init__(self, parts: list, count: int):
        self._parts = parts          # [(Handle, [indices into the user's list])]
        self._count = count

    def done(self) -> bool:
        return all(h.done() for h, _ in self._parts)

    def poll(self, wait_s: float) -> bool:
        return poll_first([part for part, _ in self._parts], wait_s)

    def wait(self, timeout: Optional[float] = None) -> list:
        if len(self._parts) == 1 and len(self._parts[0][1]) == self._count:
            return self._parts[0][0].wait(timeout)     # one part, already in the user's order
        out: list = [None] * self._count
        for handle, idxs in self._parts:
            for i, piece in zip(idxs, handle.wait(timeout)):
                out[i] = piece
        return out
