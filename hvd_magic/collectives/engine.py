"""The per-rank background thread that owns all communication.

User threads call :meth:`Engine.submit`, which queues a request and returns a :class:`Handle`.
The engine thread negotiates with the other ranks in cycles: one non-blocking allgather of what
each rank has newly submitted. Every rank feeds the same messages to the same
:class:`~.negotiation.Negotiator`, so all ranks decide the same ready requests in the same
order, then carry them out (fused where possible).

Costs when idle and when waiting:
- with nothing pending anywhere the thread blocks on a condition variable (no CPU);
- waiting for other ranks it polls the non-blocking allgather (:mod:`.waiting`: spinning only
  while a user thread waits, else sleeping with exponential backoff);
- when every rank has something pending but nothing new to say, cycles are spaced out with
  the same backoff, so ranks that wait on each other do not spin.
"""
from __future__ import annotations

import marshal
import operator
import sys
import threading
import time
from typing import Any, Callable, Optional

import numpy as np
from mpi4py import MPI
from _thread import allocate_lock as _allocate_lock
from collections import deque

from .. import config as env
from . import autotune
from .codec import AnnCodec, CycleCache, KeptCycle
from .config import Config
from .errors import HvdError, RankLostError, ShutdownError, rank_lost_error
from .exchange import SLOT, BitExchange, SlotExchange
from .execute import Executor
from .fusion import plan_fusion
from .handles import NOT_TAKEN, Handle, LocalReq
from .interrupts import defer_sigint, restore_sigint
from .negotiation import Ann, Negotiator, RankMsg, new_tuple
from .response_cache import ResponseCache
from .stall import StallCheck
from ..stacks import dump as stack_dump
from .timeline import CYCLE, FLUSH_S, Timeline, TimelineWriter, now_us
from .waiting import INLINE_SPIN_S, next_cycle_in, tight_timer_slack, wait_request


_FIRST = operator.itemgetter(0)


class Engine:
    """Background negotiation and execution for one rank."""

    def __init__(self, comm: MPI.Comm, config: Config, timeline: Timeline,
                 ranks: Optional[list] = None, set_id: int = 0):
        """``ranks``: the hvd rank of each rank of ``comm`` (for messages), when it runs a
        process set (``set_id`` > 0)."""
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.cfg = config
        self.tl = timeline
        self.set_id = set_id
        self.ranks = ranks           # a process set's hvd ranks, in this communicator's order
        self.noname: dict = {}       # a process set's counters of unnamed calls, per kind
        self.me = ranks[self.rank] if ranks else self.rank     # this rank as messages name it
        self.where = f" in process set {set_id}" if set_id else ""
        # (timeline events travel to rank 0's file with the global set's cycles only; rank 0
        # hands its own to the writer after each cycle)
        self._events = timeline.take if set_id == 0 and self.rank != 0 else tuple
        self.neg = Negotiator(self.size, ranks if set_id else None)
        self.codec = AnnCodec(self.size, self.rank, cap=config.cache_capacity)
        self._codec_resets = 0
        self._sent: list = []        # the Anns of this rank's latest message
        self.cycle_cache = CycleCache(cap=min(256, config.cache_capacity))
        # Requests carried out before are announced by a bit each (:mod:`.response_cache`);
        # with HOROVOD_CACHE_CAPACITY=0 every cycle is the full messages' allgather alone.
        self.cache = ResponseCache(config.cache_capacity) if config.cache_capacity > 0 else None
        self._cached: dict = {}      # slot -> this rank's LocalReq announced by that bit
        self._queued: dict = {}      # slot -> deque of later LocalReqs of that slot
        self._invalid: list = []     # slots to invalidate in the next message
        self._demoted: set = set()   # slots this rank asked to invalidate (waited too long)
        self.bits = BitExchange(comm)  # the vector's allreduce, every cycle's
        self._now: dict = {}          # run_now: slot -> (its bits alone, the backend's way)
        self._now_version = -1        # ... for this version of the response cache
        self._plans: dict = {}       # (cache version, ready slots) -> fusion plan
        # The engine thread sleeps on ``_bell`` (a lock used as a doorbell: released = rung).
        # Plain locks are C-level and release the GIL while blocked, keeping hand-offs cheap.
        self._bell = _allocate_lock()
        self._bell.acquire()
        self._mu = threading.Lock()          # guards compound updates of the fields below
        self._table_lock = threading.Lock()
        self._new: deque = deque()
        self.inflight: dict[str, LocalReq] = {}
        self._cancels: list = []
        self.cancelled: set = set()
        self._join: Optional[Handle] = None
        self._join_announce = False
        self._shutdown_announce = False
        self._urgent = False
        self._stop_requested = False
        self.waiters = 0      # user threads blocked on a handle: then polling may spin
        self.dead: Optional[BaseException] = None
        self.stopped = threading.Event()
        # One negotiation cycle at a time, run by the engine thread or, while it sleeps, by a
        # user thread that is about to wait for its result anyway (no two thread hand-offs).
        self._cycle_lock = _allocate_lock()
        self._px: Optional[tuple] = None            # posted exchange: (MPI request, message)
        self._inline_exc: Optional[BaseException] = None
        self._ended = False
        self.inline = env.get("HVD_MAGIC_INLINE")
        self.wire = SlotExchange(comm, SLOT)
        self.stall = StallCheck(config.stall_check_s, config.stall_shutdown_s, self.me, self.where,
                                self.rank == 0, ranks or range(self.size))
        self.sites: dict = {}        # tensor name -> "file:line" of the user's code
        if set_id == 0:
            stack_dump.install(self.rank)   # answer SIGUSR2 with every thread's stack
        self._next_tick = 0.0
        self._empty_streak = 0
        self._in_cycle_since = 0.0
        self.cycles = 0
        self.exchanges = 0           # cycles whose full messages were allgathered
        self.writer: Optional[TimelineWriter] = None
        self.executor = Executor(comm, config, timeline, self.inflight, self.cancelled,
                                 self.take, self.take_join, self.me, set_id)
        self._execute = self.executor.execute
        self.mpi_backend = self.executor.mpi_backend
        # run_now may run: cycles on the caller's thread, CPU tensors over MPI, bits
        self.short_path = bool(self.inline and self.executor.cpu_mpi and self.cache is not None)
        # CPU tensors this big are reduced alone, never fused (plan_fusion)
        self._alone = config.allreduce_chunk if config.cpu_operations == "mpi" else 0
        self.tuner, self.tune_status = autotune.for_engine(config, self.rank, set_id)
        self._tune_out: tuple = ()     # rank 0: a setting for the next message
        self.thread = threading.Thread(target=self._main, name=f"hvd_magic-engine-{self.me}{'-set-%d' % set_id if set_id else ''}",
                                       daemon=True)
        self.thread.start()

    def _ring(self) -> None:
        if self._bell.locked():
            try:
                self._bell.release()
            except RuntimeError:   # rung by another thread in between
                pass

    # ------------------------------------------------------------------ user side
    def submit(self, ann: Ann, tensor: Any, out: Any = None,
               post: Optional[Callable[[Any, Any], Any]] = None, urgent: bool = False) -> Handle:
        """Queue one request; ``urgent`` (the caller waits right away) skips the cycle time."""
        if self.dead is not None or self._stop_requested:
            if isinstance(self.dead, RankLostError):
                raise self.dead
            raise ShutdownError(f"the hvd_magic runtime on rank {self.me}{self.where} has stopped "
                                f"({self.dead or 'shutdown() was called'}); call hvd.init() again")
        name = ann[0]
        handle = Handle(name, ann[1], self, post)
        req = LocalReq(ann, tensor, handle, out)
        if self.inflight.setdefault(name, req) is not req:
            raise ValueError(f"a {self.inflight[name].ann.kind} of tensor '{name}' is "
                             "already in flight on this rank; wait for it (hvd.synchronize) "
                             "or use another name")
        if ann.device != "cpu" and self.inline:
            # CUDA tensors: NCCL's streams and the current device are set up on the engine
            # thread; from now on every cycle runs there.
            self.inline = self.short_path = False
        if name not in self.sites and ".noname." not in name:
            # where the user's code first submitted this name, for the stall report (once
            # per name: a training loop's names repeat; unnamed calls wait where they are)
            if len(self.sites) < stack_dump.SITES_CAP:
                self.sites[name] = stack_dump.submit_site()
        self._new.append(req)
        if urgent:
            self._urgent = True
            if self.inline:
                return handle   # the caller waits at once: Handle.wait runs or rings the cycle
        if self._bell.locked():   # (the engine thread sleeps: only then a call to _ring)
            self._ring()
        return handle

    def run_now(self, ann: Ann, tensor: Any, out: Any = None, key: Optional[tuple] = None) -> Any:
        """A blocking allreduce of a CPU tensor in a training loop's steady state, run on
        the caller's thread with none of the general path's bookkeeping: when this rank
        has nothing else under way and the response cache holds the request (every rank
        carried it out before), the caller posts the cycle's bit vector itself, and when
        every rank has the same bit and nothing else to say, runs the data's allreduce at
        once. The vector is the one the general path would send for this request alone,
        so ranks on either path meet alike. ``key``: the response cache's key of the request,
        when the caller has it (None: made from ``ann``).

        Returns the result; or a :class:`Handle` to wait on, when the cycle did not bring
        the result at once (the request then waits as any other); or ``NOT_TAKEN`` when
        nothing was done (submit it)."""
        if (self.inflight or self._px is not None or self._join is not None or self._invalid
                or self._cancels or self._shutdown_announce or self._tune_out or self.tl.active
                or self.dead is not None or self._stop_requested or not self.short_path
                or ann.device != "cpu" or (self.tuner is not None and self.tuner.active)):
            return NOT_TAKEN
        lock = self._cycle_lock
        if not lock.acquire(False):
            return NOT_TAKEN
        neg, cache = self.neg, self.cache
        slot = cache.slot(ann) if key is None else cache.by_ann.get(key)
        if (slot is None or self.inflight or self._px is not None or neg.joined or neg.shut
                or ann.name in neg.pending):        # (another user thread, or news: in turn)
            lock.release()
            return NOT_TAKEN
        if self._now_version != cache.version:
            self._now_version, self._now = cache.version, {}
        now = self._now.get(slot)
        if now is None:
            now = self._now[slot] = (cache.vector(True, (slot,)).tobytes(),
                                     self.mpi_backend.one(ann, self.size))
        vec, reduce_now = now
        bits = self.bits
        if len(vec) != 8 * bits.words:
            bits.buffer(len(vec) // 8)
        deferred = defer_sigint()
        try:
            self._in_cycle_since = time.monotonic()
            bits.send_bytes[:] = vec
            req = bits.start()
            recv = bits.recv
            done = req.Test()
            if not done:
                t0 = time.perf_counter()
                while not done and time.perf_counter() - t0 < INLINE_SPIN_S:
                    done = req.Test()
            if done and recv[0] and recv[1 + (slot >> 6)]:     # every rank: this bit alone
                self._in_cycle_since = 0.0
                self.cycles += 1
                self._empty_streak = 0
                cache.hits += 1
                try:
                    return reduce_now(tensor, out)
                except Exception as exc:  # noqa: BLE001 - as the general path reports it
                    raise self.executor.failed(f"allreduce of {ann.name}", exc) from None
            # the general path takes the request from here: the posted cycle, as if its
            # message had been taken (the caller's wait finishes the cycle)
            handle = Handle(ann.name, ann.kind, self)
            self.inflight[ann.name] = self._cached[slot] = LocalReq(ann, tensor, handle, out)
            self._px = (req, QUIET_DATA, False, recv)
            self._urgent = True
            return handle
        except HvdError:
            raise
        except BaseException as exc:  # noqa: BLE001 - MPI failed: the engine thread reports
            self._inline_exc = exc    # it, stops and fails every pending request
            self._ring()
            raise self.executor.failed(f"allreduce of {ann.name}", exc) from None
        finally:
            lock.release()
            restore_sigint(deferred)

    def submit_join(self) -> Handle:
        handle = Handle("join", "join", self)
        with self._mu:
            if self._join is not None:
                raise ValueError("join() is already in progress on this rank")
            self._join = handle
            self._join_announce = True
        self._urgent = True
        self._ring()
        return handle

    def urgent(self, ring: bool = False) -> None:
        """Someone waits on a result: stop gathering requests for the cycle time."""
        if not self._urgent:
            self._urgent = True
            if self.cfg.cycle_time_s > 0:
                ring = True
        if ring:
            self._ring()

    def wait_for(self, handle: Handle, timeout: Optional[float] = None) -> None:
        """Block the calling user thread until ``handle`` is resolved (interruptible):
        TimeoutError after ``timeout`` s, HvdError if the runtime stops meanwhile. While
        the engine thread sleeps, the caller runs the cycle itself first (no hand-offs)."""
        if self.inline and self._cycle_lock.acquire(False):
            self._run_inline()   # releases the cycle lock
            if handle.done():
                return
        self.urgent(ring=True)
        deadline = None if timeout is None else time.monotonic() + timeout
        self.waiters += 1
        try:
            while not handle.block(0.5 if deadline is None else
                                   max(0.0, min(0.5, deadline - time.monotonic()))):
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"{handle.kind} of tensor '{handle.name}' did not finish "
                                       f"within {timeout} s")
                self.raise_if_dead(handle.name)
        finally:
            self.waiters -= 1

    def raise_if_dead(self, name: str) -> None:
        if self.dead is not None and self.stopped.is_set():
            raise HvdError(f"the hvd_magic runtime on rank {self.me}{self.where} stopped while "
                           f"'{name}' was pending: {self.dead}")

    def shutdown(self, timeout: float = 30.0) -> bool:
        """Ask every rank to stop; wait up to ``timeout`` s for all of them to agree."""
        self._stop_requested = True
        self._shutdown_announce = True
        self._urgent = True
        self._ring()
        self.stopped.wait(timeout)
        return self.stopped.is_set()

    def pending(self) -> list:
        """Requests waiting for other ranks: dicts with name, kind, ranks, since (s ago)."""
        now = time.monotonic()
        with self._table_lock:
            infos = self.neg.stalled(now, 0.0)
        out = [{"name": i.name, "kind": i.kind, "submitted_by": i.ready_ranks,
                "missing_ranks": i.missing_ranks, "waiting_s": round(now - i.since, 3)} for i in infos]
        known = {i["name"] for i in out}
        for r in list(self.inflight.values()):
            if r.ann.name not in known:
                out.append({"name": r.ann.name, "kind": r.ann.kind, "submitted_by": [self.me],
                            "missing_ranks": None, "waiting_s": round(now - r.t_submit, 3)})
        return out

    # ------------------------------------------------------------------ engine thread
    def _main(self) -> None:
        tight_timer_slack()
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - report anything, then fail pending work
            lost = rank_lost_error(exc, f"rank {self.me}{self.where}", self.comm)   # (no traceback then)
            self.dead = lost or exc
            if lost is None:
                import traceback
                sys.stderr.write(f"[hvd_magic rank {self.me}{self.where}] engine thread failed:\n"
                                 + "".join(traceback.format_exception(exc)))
            self._fail_all(lost or HvdError(f"hvd_magic's engine thread on rank {self.me}{self.where} failed: {exc!r}"))
        finally:
            self._ended = True
            if self.dead is None:
                self.dead = ShutdownError("hvd_magic was shut down")
            self._fail_all(ShutdownError("hvd_magic was shut down before this request finished"))
            if self.writer is not None:
                self.writer.close()
            if self._cycle_lock.acquire(True, 1.0):   # (not while a caller's cycle runs)
                self.bits.free()
                self._cycle_lock.release()
            self.executor.close()
            self.stopped.set()

    def _fail_all(self, err: BaseException) -> None:
        with self._mu:
            reqs = list(self.inflight.values())
            self.inflight.clear()
            self._new.clear()
            join, self._join = self._join, None
        for r in reqs:
            r.handle.resolve(error=err)
        if join is not None:
            join.resolve(error=err)

    def _sleep(self, timeout: Optional[float]) -> None:
        """Sleep until rung or ``timeout`` (None: forever) passes."""
        if timeout is None:
            self._bell.acquire()
        elif timeout > 0:
            self._bell.acquire(True, timeout)

    def _has_news(self) -> bool:
        return bool(self._new or self._cancels or self._join_announce or self._shutdown_announce
                    or self._invalid or self._px is not None or self._inline_exc is not None)

    def _await_reason(self) -> bool:
        """Block until there is a reason to negotiate (:func:`~.waiting.next_cycle_in`
        decides when). True: news to send (or a posted exchange to finish); False: a poll
        or heartbeat cycle is due."""
        waited_from = time.monotonic()
        heartbeat = self.stall.heartbeat_s
        if self.tl.recording and self.set_id == 0:
            # an idle rank still brings its last timeline events to rank 0's file soon
            heartbeat = min(heartbeat or FLUSH_S, FLUSH_S)
        while True:
            news = self._has_news()
            delay = next_cycle_in(news, self._join is not None or bool(self._cached)
                                  or self.neg.waiting(self.rank),
                                  self._empty_streak, time.monotonic() - waited_from,
                                  heartbeat)
            if delay == 0.0:
                break
            self._sleep(delay)
        if not news:
            return False
        if self._new and self.cfg.cycle_time_s > 0 and not self._urgent:
            deadline = time.monotonic() + self.cfg.cycle_time_s
            while not self._urgent and not self._shutdown_announce:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._sleep(left)
        return True

    def _take_message(self) -> RankMsg:
        """What this rank has to say in the next cycle (takes the queued news); requests the
        response cache holds go into ``_cached`` instead, to be announced by their bit."""
        self._urgent = False
        new = []
        pop = self._new.popleft
        cache = self.cache
        if cache is not None and cache.by_ann and not (self.neg.joined or self.neg.shut):
            cached, announced = self._cached, self.neg.pending
            slot_of = cache.slot
            while self._new:
                r = pop()
                ann = r.ann
                slot = slot_of(ann)
                if slot is None or (announced and ann.name in announced):  # (another rank
                    new.append(r)                    # announced it in full: metadata differ)
                elif slot in cached:       # (unnamed calls of one slot: in turn)
                    self._queued.setdefault(slot, deque()).append(r)
                else:
                    cached[slot] = r
        else:
            while self._new:
                new.append(pop())
        if self._cancels or self._join_announce:
            with self._mu:
                cancels, self._cancels = tuple(self._cancels), []
                join, self._join_announce = self._join_announce, False
        else:
            cancels, join = (), False
        shut, self._shutdown_announce = self._shutdown_announce, False
        self._sent = anns = [r.ann for r in new]
        tune, self._tune_out = self._tune_out, ()
        invalid, self._invalid = tuple(self._invalid), []
        events = self._events()
        if not (anns or cancels or join or shut or events or tune or invalid):
            return QUIET            # (a steady-state cycle: bits alone, nothing to encode)
        # (tuple.__new__: the namedtuple constructor's argument handling costs ~0.3 us)
        return new_tuple(RankMsg, (self.codec.encode(anns), cancels, join, shut, events,
                                    tune, invalid))

    def _loop(self) -> None:
        lock = self._cycle_lock
        while True:
            seen = self.cycles
            news = self._await_reason()
            with lock:
                if self._inline_exc is not None:
                    if isinstance(self._inline_exc, _Stop):
                        return
                    raise self._inline_exc
                if self._ended:
                    return
                if self._px is None:
                    if self.cycles != seen or (news and not self._has_news()):
                        # a waiting user thread ran a cycle meanwhile: what this one was
                        # for (news, or polling for requests then announced) may be done
                        continue
                    self._post_exchange(self._take_message())
                if self._after_exchange(*self._finish_exchange()):
                    self._ended = True
                    return

    def _run_inline(self) -> None:
        """Run one cycle in the calling (waiting) user thread; the caller holds the cycle lock.

        A cycle that is not complete after ``INLINE_SPIN_S`` (other ranks not there yet) is
        left posted for the engine thread to finish. SIGINT is held back while the cycle runs
        (only the main thread gets it) so that an interrupt never leaves a cycle half done."""
        deferred = defer_sigint()
        try:
            if self._ended or self._inline_exc is not None or not self.inline:
                return
            if self._px is None:
                if not self._has_news():
                    return
                self._post_exchange(self._take_message())
            req = self._px[0]
            if not req.Test():
                t0 = time.perf_counter()
                while not req.Test():
                    if time.perf_counter() - t0 > INLINE_SPIN_S:
                        return           # the engine thread finishes it (Handle.wait rings)
            if self._after_exchange(*self._finish_exchange(done=True)):
                self._inline_exc = _Stop()
        except BaseException as exc:  # noqa: BLE001 - the engine thread reports it and stops
            self._inline_exc = exc
        finally:
            self._cycle_lock.release()
            if self._inline_exc is not None:
                self._ring()
            restore_sigint(deferred)

    def _after_exchange(self, msgs: Optional[list], key: Optional[tuple] = None,
                        hit: Optional[KeptCycle] = None, ready: tuple = ()) -> bool:
        """Decide and carry out one cycle from every rank's message (or the decisions of
        the same cycle seen before: ``hit``; with ``msgs`` None then, or when no rank had
        more than bits to say), plus the response cache's ``ready`` requests; True: shut
        down."""
        t_cycle = now_us() if self.tl.active else 0.0
        self.cycles += 1
        now = time.monotonic()
        if msgs is None and hit is None:            # bits alone: the steady state
            responses, plan = self._take_ready(ready)
        else:
            cached = self._take_ready(ready)[0]     # (before a slot can be invalidated)
            if hit is not None:
                responses, plan = hit.responses, hit.plan
            else:
                if msgs[0].tune:       # rank 0's autotune setting: every rank applies it now
                    self.tune_status = autotune.apply(msgs[0].tune, self.cfg, self.tuner, now)
                    self.cycle_cache.clear()    # (its fusion plans were for the old threshold)
                    self._plans.clear()
                with self._table_lock:
                    keep = key is not None and not self.neg.busy
                    responses = self.neg.step(msgs, now)
                    keep = keep and not self.neg.busy
                plan = (plan_fusion(responses, self.cfg.fusion_threshold, self._alone)
                        if len(responses) != 1 else None)
                if keep:
                    self.cycle_cache.put(key, responses, plan,
                                         self.codec.moves() if self.codec.moved else None,
                                         msgs[self.rank].anns)
                if self.writer is not None:
                    for m in msgs:
                        if m.events:
                            self.writer.write(list(m.events))
            if self.cache is not None:
                self._update_cache(msgs, responses)
            if cached:
                responses = cached + responses
                plan = plan_fusion(responses, self.cfg.fusion_threshold, self._alone)
        if self.tl.active and self.tl.mark_cycles:
            self.tl.add("cycle", CYCLE, t_cycle, None, {"cycle": self.cycles})
        news = hit is not None or bool(ready) or (msgs is not None and any(
            m.anns or m.cancels or m.join or m.shutdown for m in msgs))
        self._empty_streak = 0 if (news or responses) else self._empty_streak + 1
        stop = self._execute(responses, now, plan)
        if self.tuner is not None and self.tuner.active and not stop:
            setting = self.tuner.observe(autotune.carried(responses), time.monotonic())
            if setting is not None:
                self._tune_out = autotune.message(setting, self.tuner)
        if self.tl.active:
            self.tl.publish()
        if self.writer is not None:
            self.writer.write(self.tl.take())
        now = time.monotonic()
        if now >= self._next_tick:
            self._next_tick = now + 0.2
            self._stall_tick(now)
        return stop

    def _take_ready(self, ready: tuple) -> tuple:
        """The response cache's ready requests as (responses, fusion plan); this rank no
        longer announces them (the next of a slot's waiting unnamed calls takes its bit)."""
        if not ready:
            return [], []
        cached, queued, demoted = self._cached, self._queued, self._demoted
        responses = []
        for slot, resp in ready:
            req = cached.pop(slot)
            name = req.ann.name
            if resp.name != name:       # an unnamed call: this one's number
                resp.name = name
                if resp.kind != "allreduce":    # (their backends label from these)
                    resp.anns = {r: a._replace(name=name) for r, a in resp.anns.items()}
            responses.append(resp)
            if demoted:
                demoted.discard(slot)
            if queued:
                later = queued.get(slot)
                if later:
                    cached[slot] = later.popleft()
                    if not later:
                        del queued[slot]
        self.cache.hits += len(ready)
        if len(responses) == 1:
            return responses, None
        key = (self.cache.version, tuple(map(_FIRST, ready)))
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) > 64:
                self._plans.clear()
            plan = self._plans[key] = plan_fusion(responses, self.cfg.fusion_threshold,
                                                  self._alone)
        return responses, plan

    def _update_cache(self, msgs: Optional[list], responses: list) -> None:
        """After a negotiated cycle, alike on every rank: drop the slots some rank
        invalidated, keep this cycle's decisions. This rank's cached requests go back to
        the full messages when their slot went or changed, when another rank announced the
        same request in full (its metadata differ there), or, all of them, while a rank
        has joined or shut down and when the cache started again."""
        cache = self.cache
        invalid = sorted({s for m in msgs for s in m.invalid}) if msgs is not None else ()
        for slot in invalid:
            cache.drop(slot)
        fresh = cache.add(responses)
        cached = self._cached
        if not cached:
            return
        every = not fresh or bool(self.neg.joined or self.neg.shut)
        announced = {a.name for m in msgs for a in m.anns} if msgs is not None else ()
        slots = cache.slots
        waiting = [(s, r) for s, r in cached.items()] + [
            (s, r) for s, q in self._queued.items() for r in q]
        back = [r for s, r in waiting if every or r.ann.name in announced or s >= len(slots)
                or slots[s] is None or cache.keys[s] != cache.key(r.ann)]
        if not back:
            return
        gone = {id(r) for r in back}
        for s in list(cached):
            if id(cached[s]) in gone:
                del cached[s]
                self._demoted.discard(s)
        for s in list(self._queued):
            q = deque(r for r in self._queued[s] if id(r) not in gone)
            if q and s not in cached:
                cached[s] = q.popleft()
            if q:
                self._queued[s] = q
            else:
                del self._queued[s]
        for r in sorted(back, key=lambda r: r.t_submit, reverse=True):
            self._new.appendleft(r)

    # ------------------------------------------------------------------ negotiation
    def _post_exchange(self, msg: RankMsg) -> None:
        """Start the cycle: the allreduce of the response cache's bits (the full messages,
        marshal-encoded plain tuples, follow only when some rank has more to say), or,
        without a response cache, the allgather of the full messages."""
        self._in_cycle_since = time.monotonic()
        quiet = msg is QUIET
        data = QUIET_DATA if quiet else marshal.dumps(tuple(msg))
        # (the key and lookup of the cycle cache are skipped unless this message can be kept)
        cacheable = not quiet and CycleCache.cacheable(msg)
        if self.cache is None:
            self._px = (self.wire.post(data), data, cacheable, None)
            self.exchanges += 1
            return
        bits = self.bits
        self.cache.vector(quiet, self._cached, out=bits.buffer(self.cache.words()))
        self._px = (bits.start(), data, cacheable, bits.recv)

    def _finish_exchange(self, done: bool = False) -> tuple:
        """Complete the posted cycle (``done``: its request is known to be complete):
        (every rank's message in rank order, the cycle's cache key or None, the cycle
        cache's decisions of the same cycle or None, the ready requests of the response
        cache as ``[(slot, Response)]``). On a cycle cache hit, or when no rank had more
        than bits to say, nothing is decoded and the messages are None."""
        req, data, cacheable, vec = self._px
        if not done:
            self._wait(req)
        self._px = None
        ready = ()
        if vec is not None:
            ready = self.cache.ready(vec)
            if self.cache.quiet(vec):
                self._in_cycle_since = 0.0
                return None, None, None, ready
            self._wait(self.wire.post(data))
            self.exchanges += 1
        # (a second round, for what did not fit in the slot, is never cached)
        wire, keyed = self.wire.received(data, cacheable, self._wait)
        key = None
        if keyed:
            key = wire
            hit = self.cycle_cache.get(key, self.neg.busy)
            if hit is not None and (hit.moved is None or self.codec.replay(hit.moved)):
                if hit.where is not None:
                    # unnamed calls: this cycle's numbers, as this rank sent them
                    sent = self._sent
                    for resp, i in zip(hit.responses, hit.where):
                        resp.name = name = sent[i][0]
                        if resp.kind != "allreduce":    # (their backends label from these)
                            resp.anns = {r: a._replace(name=name) for r, a in resp.anns.items()}
                self._in_cycle_since = 0.0
                return None, key, hit, ready
        out = []
        decode = self.codec.decode
        self.codec.begin()
        for r, buf in enumerate(wire):
            msg = RankMsg(*marshal.loads(buf))
            if key is not None and not CycleCache.cacheable(msg):
                key = None            # another rank's message cannot be kept
            out.append(msg._replace(anns=decode(r, msg.anns)))
        if self.codec.resets != self._codec_resets:
            # a table started again: the same index bytes may now mean other requests
            self._codec_resets = self.codec.resets
            self.cycle_cache.clear()
            key = None
        self._in_cycle_since = 0.0
        return out, key, None, ready

    def _wait(self, req: MPI.Request) -> None:
        wait_request(req, self._someone_waits, self._stall_tick)

    def _someone_waits(self) -> bool:
        """A user thread is blocked on a result (then polling may spin)."""
        return self.waiters > 0

    # ------------------------------------------------------------------ execution
    def take(self, name: str) -> Optional[LocalReq]:
        if name in self.cancelled:
            # The name may be reused (and stall again) from now on; a cancel not yet sent
            # must not hit the next request of the same name.
            self.cancelled.discard(name)
            with self._mu:
                self._cancels = [c for c in self._cancels if c[0] != name]
        return self.inflight.pop(name, None)

    def take_join(self) -> Optional[Handle]:
        with self._mu:
            handle, self._join = self._join, None
        return handle

    # ------------------------------------------------------------------ stall check
    def _stall_tick(self, now: float) -> None:
        """Run the stall check (:class:`~.stall.StallCheck`) on this rank's tables."""
        sc = self.stall
        if sc.heartbeat_s is None:
            return
        if self._cached:
            # a cached request that waits this long goes back to the full messages, so that
            # the negotiation knows (and the stall check names) the ranks it waits for
            late = now - sc.first / 2
            for slot, r in self._cached.items():
                if r.t_submit < late and slot not in self._demoted:
                    self._demoted.add(slot)
                    self._invalid.append(slot)
        if self.set_id == 0:
            sc.note_submitted(now, list(self.inflight.values()), self.sites)
        since = self._in_cycle_since
        stuck = sc.stuck(now, since)
        if sc.warn_due(now, stuck):
            with self._table_lock:
                infos = self.neg.stalled(now, sc.check)
            with self._mu:
                mine = list(self.inflight.values()) if stuck else []
            sc.warn(now, infos, mine, since)
        if sc.kill > 0:
            with self._table_lock:
                infos = {i.name: i for i in self.neg.stalled(now, 0.0)}
            with self._mu:
                cancels, local = sc.to_fail(now, infos, list(self.inflight.values()),
                                            self.cancelled, stuck, since)
                for name, msg in cancels:
                    self.cancelled.add(name)
                    self._cancels.append((name, msg))
                for r in local:
                    self.inflight.pop(r.ann.name)
            for r in local:
                r.handle.resolve(error=sc.local_error(r, now, since))



#: The message of a rank with nothing to say beyond its cached requests' bits.
QUIET = RankMsg()
QUIET_DATA = marshal.dumps(tuple(QUIET))


class _Stop(Exception):
    """An inline cycle carried out the agreed shutdown: the engine thread ends."""
