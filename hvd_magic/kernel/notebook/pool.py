"""Runs in the notebook kernel.

The pool: ipyparallel engines started by ``mpiexec`` (engine i is MPI rank i).

:class:`Pool` does the work (start, run a cell, interrupt, stop); :mod:`.manager` decides
which pool a request needs; the magics only parse and render. Start-up runs the controller,
``mpiexec`` and the client at once (the connection files are written beforehand, see
:mod:`.plan`) with a 100 ms heartbeat and no nanny processes on one host, so a 2-rank pool
is ready in about 1 to 1.5 s instead of ipyparallel's default 6.7 s.
"""
from __future__ import annotations

import atexit
import json
import os
import queue
import shutil
import signal
import socket
import tempfile
import threading
import time
import weakref
from typing import Any, Dict, List, Optional, Sequence

from ... import config
from ...runner.launch import clear_stale_sessions
from . import liveness
from .cells import CellOutcome, Pump, clean_stale_dirs, engine_lost, ipyparallel, notify, \
    rank_done, rank_error, rank_futures, short_tmp
from .output import OutputSink, PoolCellError, PoolCellInterrupted, PoolCellTimeout, PoolError, \
    RankDiedError, RankFailure, n_ranks, ranks_text
from .plan import HEARTBEAT_MISSES, PoolConfig, PoolPlan, plan_pool, stacks_dir
from .settle import settle
from .procs import descendants, describe_exit, end_job_first, parse_rank_exits, pids_gone, \
    spawn, stop_tree, tail, wait_until

#: Message signatures the pool's client remembers (jupyter_client's default is 65,536).
DIGEST_HISTORY = 4096
#: Seconds to wait for the ranks to switch their telemetry on or off.
SWITCH_TIMEOUT = 30.0
#: Seconds a finished cell waits at most for the rest of its ranks' output.
OUTPUT_WAIT_S = 5.0
#: Seconds the ranks have to end as Python processes do (atexit handlers, files flushed,
#: MPI finalized) once the pool's stop asks them to; then they are killed.
EXIT_GRACE_S = 3.0


_POOLS: "weakref.WeakSet[Pool]" = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for pool in list(_POOLS):
        pool.stop()


class Pool:
    """One running set of MPI engines plus their controller. Use :meth:`start` (or
    :class:`PoolManager`), :meth:`run_cell`, :meth:`interrupt`, :meth:`stop`."""

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self.plan: Optional[PoolPlan] = None
        self.client: Any = None
        self.controller: Any = None
        self.mpiexec: Any = None
        self.known: List[Any] = []
        self.ended: Optional[str] = None        # why the pool is gone (None while usable)
        self.started_s = 0.0
        self.last_cell: Dict[int, str] = {}
        self.pids: Dict[int, int] = {}          # rank -> engine pid
        self.hosts: Dict[int, str] = {}         # rank -> host name
        self._views: Dict[tuple, Any] = {}      # targets -> DirectView
        self.engines: List[int] = list(range(config.np))   # rank -> engine id (elastic: changes)
        self.top_engine = config.np - 1         # the highest engine id this pool has had
        self.telemetry: Optional[float] = None  # the ranks' telemetry interval (None: off)
        self.history: List[tuple] = []          # ("cell", code) / ("push", values) on all ranks

    @property
    def size(self) -> int:
        return len(self.engines)

    # ------------------------------------------------------------------ start / stop
    def make_workdir(self) -> str:
        """A private directory for this pool's files (stale ones of dead pools removed
        first), set as ``config.workdir``."""
        try:
            clean_stale_dirs(short_tmp())
        except Exception:  # noqa: BLE001 - housekeeping only
            pass
        workdir = tempfile.mkdtemp(prefix="hvdm-", dir=short_tmp())
        os.chmod(workdir, 0o700)
        self.config.workdir = workdir
        return workdir

    def start(self, sink: Optional[OutputSink] = None) -> "Pool":
        """Start controller, engines and client; return when every rank is registered."""
        ipp = ipyparallel()
        t0 = time.monotonic()
        if sink is not None:
            sink.status(f"hvd: starting {n_ranks(self.config.np)} ...")
        workdir = self.make_workdir()
        self.plan = plan = plan_pool(self.config)
        _POOLS.add(self)
        try:
            os.makedirs(os.path.dirname(plan.engine_file), mode=0o700, exist_ok=True)
            os.makedirs(stacks_dir(workdir), mode=0o700, exist_ok=True)
            for path, info in ((plan.engine_file, plan.engine_info),
                               (plan.client_file, plan.client_info)):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as fh:
                    json.dump(info, fh)
            env = dict(os.environ)
            env["PYTHONUNBUFFERED"] = "1"
            self.controller = spawn(plan.controller_argv, env,
                                    os.path.join(workdir, "controller.log"))
            clear_stale_sessions(plan.engine_env)
            self.mpiexec = spawn(plan.engine_argv, plan.engine_env,
                                 os.path.join(workdir, "mpiexec.log"))
            self.client = ipp.Client(plan.client_file, timeout=config.get("HVD_MAGIC_START_TIMEOUT"))
            # The client's session remembers the signature of every message it received
            # (replay protection) up to 65,536 of them, ~10 a live cell: bound it lower.
            self.client.session.digest_history_size = DIGEST_HISTORY
            self._wait_for_engines(sink, t0)
        except BaseException as exc:
            why = self._start_failure(exc)
            self.stop()
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise PoolError(why) from exc
        self.known = descendants(self.mpiexec.pid) + descendants(self.controller.pid)
        self._learn_where()
        self.started_s = time.monotonic() - t0
        return self

    def _wait_for_engines(self, sink: Optional[OutputSink], t0: float) -> None:
        n, last, shown = self.config.np, 0, time.monotonic()
        limit = config.get("HVD_MAGIC_START_TIMEOUT")
        deadline = t0 + limit
        while True:
            count = len(self.client.ids)
            if count >= n:
                return
            for name, proc in (("mpiexec", self.mpiexec), ("the controller", self.controller)):
                if proc.poll() is not None:
                    raise PoolError(f"{name} {describe_exit(proc.returncode)} while the pool "
                                    "was starting")
            now = time.monotonic()
            if now > deadline:
                hint = "" if self.plan is None or self.plan.single_host else (
                    "; check that every host is reachable by ssh without a password and "
                    "can reach this machine, e.g. hvdrun -np 2 -H HOSTS python -c 'print(1)'")
                raise PoolError(f"only {count} of {n} ranks registered within {limit:g} "
                                f"s (HVD_MAGIC_START_TIMEOUT){hint}")
            if sink is not None and (count != last or now - shown > 5.0):
                sink.status(f"hvd: starting {n_ranks(n)} ... {count}/{n} ready "
                            f"({now - t0:.1f} s)")
                last, shown = count, now
            time.sleep(0.01)

    def _learn_where(self) -> None:
        """Each rank's host and pid, asked once (one round trip): a rank that later stops
        answering can then still be named by where it runs, and local interrupts go to the
        pids."""
        from ..ranks.calls import where
        ranks = list(range(self.config.np))
        for r, (host, pid) in zip(ranks, self.client[ranks].apply_async(where).get(
                config.get("HVD_MAGIC_START_TIMEOUT"))):
            self.hosts[r], self.pids[r] = host, pid

    def _start_failure(self, exc: BaseException) -> str:
        workdir = self.config.workdir
        logs = "".join(f"\n--- {name} ---\n{text}" for name in ("mpiexec.log", "controller.log")
                       if (text := tail(os.path.join(workdir, name), 2000).strip()))
        return f"the pool did not start: {exc}{logs}"

    def alive(self) -> bool:
        """True while the controller, mpiexec and every rank are up."""
        if self.ended is not None or self.client is None:
            return False
        if self._job_ended() is not None:
            self.ended = liveness.ended_text(self._seen(exits=True))
            return False
        return set(self.engines) <= set(self.client.ids)

    def _job_ended(self) -> Optional[str]:
        """How mpiexec or the controller ended, in words; None while both run."""
        for name, proc in (("mpiexec", self.mpiexec), ("the controller", self.controller)):
            if proc is None:
                return f"{name} was stopped"
            if proc.poll() is not None:
                return f"{name} {describe_exit(proc.returncode)}"
        return None

    def _seen(self, ar: Any = None, exits: bool = False, cell: Optional[List[RankFailure]] = None,
              targets: Sequence[int] = ()) -> liveness.Seen:
        """What this pool observes now, for :func:`.liveness.judge`: ``exits`` reads the rank
        exits in mpiexec's log; ``ar`` (a running cell) adds the ranks whose engine was lost;
        ``cell``: the failures of a cell that ended."""
        unheard = self._unheard()
        elastic = self.elastic()
        lost = []
        if ar is not None and cell is None:
            lost = [r for r, md in zip(targets, ar.metadata) if engine_lost(md.get("error"))]
        return liveness.Seen(
            size=self.size, heartbeat_s=HEARTBEAT_MISSES * self.config.heartbeat_ms / 1000,
            elastic=elastic, min_np=self.config.min_np or 1, job_ended=self._job_ended(),
            exits=parse_rank_exits(self._log()) if exits else (), unheard=unheard,
            unheard_exited=bool(unheard and elastic and self.plan.signal_via_pid and pids_gone(
                [self.pids.get(r) for r in unheard])),
            engines_lost=lost, engines=list(self.engines), cell=cell, targets=list(targets),
            where={r: f"pid {self.pids.get(r, '?')} on {self.hosts.get(r, '?')}"
                   for r in unheard})

    def _log(self) -> str:
        return tail(os.path.join(self.config.workdir, "mpiexec.log"), 20000)

    def _unheard(self) -> List[int]:
        """Ranks the controller no longer lists (it dropped them after missed heartbeats)."""
        try:
            ids = set(self.client.ids) if self.client is not None else set()
        except Exception:  # noqa: BLE001 - client closed
            ids = set()
        return [r for r, e in enumerate(self.engines) if e not in ids]

    def stop(self) -> None:
        """Stop everything this pool started (idempotent); no process is left behind."""
        self._end_gracefully()
        if self.plan is not None and not self.plan.single_host:
            end_job_first(self.mpiexec, self.client, self.controller)
        if self.client is not None:
            try:
                self.client.close(linger=0)
            except Exception:  # noqa: BLE001 - tearing down anyway
                pass
            self.client = None
        self._views = {}
        if self.controller is not None or self.mpiexec is not None:
            stop_tree([self.mpiexec], [self.controller], self.known)
        self.controller = self.mpiexec = None
        self.known = []
        if self.config.workdir.startswith(short_tmp()) and "hvdm-" in self.config.workdir:
            shutil.rmtree(self.config.workdir, ignore_errors=True)
        _POOLS.discard(self)

    def _end_gracefully(self) -> None:
        """The start of :meth:`stop`: the pool is marked stopped, and every rank's engine
        asked to exit as a script's process ends (its ``atexit`` handlers run, its open
        files are flushed: a cell's checkpoint writer, TF's temporary files), with
        :data:`EXIT_GRACE_S` to do so. Not when the pool had ended already, nor while a cell
        is in flight (a rank that runs code does not take the request): killed at once."""
        if self.ended is not None:
            return
        self.ended = "stopped"
        client = self.client
        if client is None or client.outstanding:
            return
        try:
            client.shutdown(targets="all", block=False)
        except Exception:  # noqa: BLE001 - the ranks are killed next anyway
            return
        wait_until(self._engines_gone, EXIT_GRACE_S)

    def _engines_gone(self) -> bool:
        """Whether every rank's engine has ended (mpiexec ends with its last rank)."""
        return self.mpiexec is None or self.mpiexec.poll() is not None

    # ------------------------------------------------------------------ cells
    def targets(self, ranks: Optional[Sequence[int]]) -> List[int]:
        """Validated target ranks (all when None)."""
        if ranks is None:
            return list(range(self.size))
        bad = [r for r in ranks if not 0 <= r < self.size]
        if bad:
            raise ValueError(f"rank(s) {bad} do not exist: the pool has ranks 0..{self.size - 1}")
        return sorted(set(ranks))

    def run_cell(self, code: str, sink: OutputSink, ranks: Optional[Sequence[int]] = None,
                 timeout: Optional[float] = None) -> CellOutcome:
        """Run ``code`` on ``ranks`` (all by default), streaming output to ``sink``.

        The sink observes the cell (see :class:`OutputSink`): with a ``telemetry_interval``
        the ranks send telemetry batches (``sink.ingest``) while it runs; ``begin`` before,
        ``failed`` or ``finalize`` after.

        Raises :class:`PoolCellError` when ranks raise, :class:`RankDiedError` when a rank
        dies (the pool is then stopped), :class:`PoolCellTimeout` past ``timeout``, and
        KeyboardInterrupt after stopping the cell on every rank when interrupted.
        """
        targets = self.targets(ranks)
        if not self.alive():
            raise PoolError(f"the pool is gone ({self.ended}); the next %%hvd cell starts a "
                            "new one")
        self.set_telemetry(getattr(sink, "telemetry_interval", None))
        notify(sink, "begin", targets, self.size, code)
        try:
            outcome = self._run(code, sink, targets, timeout)
        except PoolCellError as exc:
            notify(sink, "failed", exc)
            raise
        except BaseException:
            notify(sink, "finalize")
            raise
        notify(sink, "finalize")
        if self.elastic() and targets == list(range(self.size)):
            self.history.append(("cell", code))    # what a rank that joins runs first
        return outcome

    def set_telemetry(self, interval: Optional[float]) -> None:
        """The ranks send a telemetry batch every ``interval`` s while a cell runs (None:
        none, and no timeline subscription). One round trip, only when it changes."""
        if interval == self.telemetry:
            return
        from ..ranks import telemetry
        view = self.view(list(range(self.size)))
        fn, args = (telemetry.disable, ()) if interval is None else (telemetry.enable, (interval,))
        self._ask(lambda: view.apply_async(fn, *args).get(SWITCH_TIMEOUT))
        self.telemetry = interval

    def _ask(self, call: Any) -> Any:
        """``call()``, a round trip to the ranks; if a rank went away meanwhile (it died, or
        was paused between cells) the pool ends with :class:`RankDiedError` naming it, not
        with ipyparallel's CompositeError for the stranded task."""
        try:
            return call()
        except Exception:
            if self._unheard() or not self.alive():
                raise self._death([], list(range(self.size))) from None
            raise

    def _run(self, code: str, sink: OutputSink, targets: List[int],
             timeout: Optional[float]) -> CellOutcome:
        ar = self.view(targets).execute(code, silent=False, block=False)
        poke: "queue.SimpleQueue[int]" = queue.SimpleQueue()
        for fut in rank_futures(ar):
            fut.iopub_callbacks.append(lambda _msg: poke.put(1))
        ar.add_done_callback(lambda _f: poke.put(1))
        for r in targets:
            self.last_cell[r] = "running a cell"
        pump = Pump(ar, targets, sink)
        try:
            self._wait(ar, pump, poke, targets, timeout)
        except KeyboardInterrupt:
            note = settle(self, ar, pump, targets, "interrupted")
            raise PoolCellInterrupted(note) from None
        except _Timeout:
            late = [r for i, r in enumerate(targets) if not rank_done(ar, i)]  # before settling
            note = settle(self, ar, pump, targets, f"ran past --timeout {timeout:g} s")
            raise PoolCellTimeout([RankFailure(r, "timeout", "TimeoutError",
                                               f"cell ran past --timeout {timeout:g} s")
                                   for r in late], note) from None
        finally:
            pump.flush()
            sink.close()
            for r in targets:
                self.last_cell[r] = "idle"
        return self._outcome(ar, targets, sink)

    def view(self, targets: List[int]) -> Any:
        """The DirectView on ``targets``, made once per pool (a view costs ~0.1 ms)."""
        key = tuple(targets)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = self.client[[self.engines[r] for r in targets]]
        return view

    def _wait(self, ar: Any, pump: "Pump", poke: "queue.SimpleQueue[int]", targets: List[int],
              timeout: Optional[float]) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        wants_stacks = getattr(pump.sink, "wants_stacks", None)
        while not ar.ready():
            try:
                poke.get(timeout=0.05)
            except queue.Empty:
                pass
            pump.flush()
            if wants_stacks is not None and wants_stacks():
                # a stall: the live panel shows each rank's stack under its lane (gathered
                # on a thread, at most 2 s; the cell goes on meanwhile)
                threading.Thread(target=lambda: pump.sink.stacks(self.stacks()),
                                 name="hvd_magic-stacks", daemon=True).start()
            verdict = liveness.judge(self._seen(ar, targets=targets))
            if verdict.action != liveness.WAIT:
                # the job is over (its results are on their way), or mpiexec is about to
                # say which rank ended: give it ``grace`` s
                try:
                    if self.mpiexec.poll() is not None:
                        ar.wait(verdict.grace)
                    elif verdict.grace:
                        self.mpiexec.wait(verdict.grace)
                except Exception:  # noqa: BLE001 - still running: stopped by _death
                    pass
                return
            if deadline is not None and time.monotonic() > deadline:
                raise _Timeout()
        self._wait_for_output(ar)

    @staticmethod
    def _wait_for_output(ar: Any, timeout: float = OUTPUT_WAIT_S) -> None:
        """Wait until each rank that finished the cell has delivered all its output: its
        result and its output travel on different sockets, and output after the result
        would be cut off. A rank's "idle" status follows its last output; a rank whose
        engine was lost sends none, so it is not waited for (ipyparallel's
        ``wait_for_output`` waits for every rank, and its whole timeout when one is lost)."""
        import concurrent.futures as cf
        mds = ar.metadata
        outputs = [f.output for i, f in enumerate(rank_futures(ar))
                   if f.done() and not engine_lost(rank_error(ar, i, mds[i]))]
        cf.wait(outputs, timeout)

    def interrupt(self, ranks: Optional[Sequence[int]] = None) -> None:
        """SIGINT to ``ranks`` (default all): KeyboardInterrupt in the running cell there (an
        idle engine ignores it). Local pools signal the engine pids, others go through
        ipyparallel's nannies; ``mpiexec`` and the MPI job are not touched."""
        targets = self.targets(ranks)
        if self.plan is not None and self.plan.signal_via_pid:
            for r in targets:
                pid = self.pids.get(r)
                if pid is not None:
                    try:
                        os.kill(pid, signal.SIGINT)
                    except OSError:
                        pass
        elif self.client is not None:
            self.client.send_signal("SIGINT", targets=[self.engines[r] for r in targets],
                                    block=False)

    def reset_runtime(self, timeout: float = 8.0) -> str:
        """``hvd.shutdown()`` + ``hvd.init()`` on every rank (drops requests an interrupt left in
        flight). Stops the pool if that fails; returns a sentence saying which happened."""
        from ..ranks.calls import reset
        try:
            ar = self.view(list(range(self.size))).apply_async(reset, 5.0)
            replies = ar.get(timeout)
            bad = [r for r, rep in enumerate(replies) if rep != "ok"]
            if not bad:
                return "hvd runtime reset on every rank; the pool is ready"
            why = f"resetting the runtime failed on {ranks_text(bad)}"
        except Exception as exc:  # noqa: BLE001 - any failure means: restart
            why = f"resetting the runtime failed ({type(exc).__name__}: {exc})"
        self.ended = why
        self.stop()
        return f"{why}; the pool was stopped, the next %%hvd cell starts a new one"

    def _outcome(self, ar: Any, targets: List[int], sink: OutputSink) -> CellOutcome:
        out = CellOutcome(targets)
        failures: List[RankFailure] = []
        died = False
        mds = ar.metadata
        for i, r in enumerate(targets):
            md = mds[i]
            err = rank_error(ar, i, md)
            if engine_lost(err) or (err is None and not rank_done(ar, i)):
                died = True
                failures.append(RankFailure(r, "died", "EngineError", "rank ended"))
            elif getattr(err, "ename", "") == liveness.LEFT and self.elastic():
                died = True     # its training raised; it left the job (its engine exits)
                failures.append(RankFailure(r, "died", liveness.LEFT, str(err.evalue)))
            elif err is not None:
                tb = getattr(err, "traceback", None) or ""
                failures.append(RankFailure(r, "error", getattr(err, "ename", type(err).__name__),
                                            str(getattr(err, "evalue", err)),
                                            tb.splitlines() if isinstance(tb, str) else list(tb)))
            else:
                res = md.get("execute_result")
                if res:
                    out.results[r] = res.get("data", {})
                    sink.result(r, out.results[r])
                    out.counts[r] = res.get("execution_count", 0)
        if died or not self.alive():
            verdict = liveness.judge(self._seen(exits=True, cell=failures, targets=targets))
            if verdict.action == liveness.GO_ON:
                for r in verdict.lost:
                    notify(sink, "lost", r, verdict.how[r])
                self.set_members([r for r in range(self.size) if r not in verdict.lost])
                sink.status(verdict.text)
                return out
            raise self._death(failures, targets)
        if failures:
            raise PoolCellError(failures)
        return out

    def elastic(self) -> bool:
        """Started with ``--min-np`` (MPI fault tolerance) and its MPI job still runs."""
        return self.config.min_np is not None and self.mpiexec is not None \
            and self.mpiexec.poll() is None

    def set_members(self, ranks: List[int], joined: Sequence[int] = (),
                    where: Optional[Dict[int, tuple]] = None) -> None:
        """An elastic pool's ranks changed: the old ``ranks`` go on, renumbered 0.., then the
        engines ``joined``; ``where``: new rank -> (host, pid)."""
        self.pids = {i: self.pids[r] for i, r in enumerate(ranks) if r in self.pids}
        self.hosts = {i: self.hosts[r] for i, r in enumerate(ranks) if r in self.hosts}
        self.engines = [self.engines[r] for r in ranks] + list(joined)
        self.top_engine = max([self.top_engine] + list(joined))
        for r, (host, pid) in (where or {}).items():
            self.hosts[r], self.pids[r] = host, pid
        self._views, self.telemetry = {}, None    # new engines: no telemetry yet

    def resize(self, n: int, sink: Optional[OutputSink] = None) -> str:
        """``%hvd resize N``: grow or shrink an elastic pool (see :mod:`.resize`)."""
        from .resize import resize
        return resize(self, n, sink)

    def _death(self, failures: List[RankFailure], targets: List[int]) -> RankDiedError:
        """Stop the pool, naming the ranks that ended and how (:func:`.liveness.stop`)."""
        if self.mpiexec is not None and not self._unheard():
            try:
                self.mpiexec.wait(2.0)      # let mpiexec log which rank ended and how
            except Exception:  # noqa: BLE001
                pass
        verdict = liveness.stop(self._seen(exits=True, cell=failures, targets=targets), failures)
        log = self._log()
        self.ended = verdict.ended
        self.stop()
        err = RankDiedError(list(verdict.failures), verdict.text)
        err.log = log  # type: ignore[attr-defined]
        return err

    # ------------------------------------------------------------------ data, status
    def push(self, names: Dict[str, Any], ranks: Optional[Sequence[int]] = None) -> None:
        """Copy variables from here into the ranks' namespaces."""
        view = self.view(self.targets(ranks))
        self._ask(lambda: view.push(names, block=True))
        if self.elastic() and ranks is None:
            self.history.append(("push", dict(names)))

    def pull(self, name: str, ranks: Optional[Sequence[int]] = None) -> List[Any]:
        """The value of ``name`` on each of ``ranks`` (a list in rank order)."""
        view = self.view(self.targets(ranks))
        return list(self._ask(lambda: view.pull(name, block=True)))

    def result_values(self, ranks: Sequence[int]) -> List[Any]:
        """The values the last cell produced on ``ranks`` (``Out[n]`` there; None if none)."""
        from ..ranks.calls import last_result
        view = self.view(list(ranks))
        return list(self._ask(lambda: view.apply_sync(last_result)))

    def status(self, timeout: float = 2.0) -> Dict[str, Any]:
        """Ranks, hosts, pids, what each is doing, pending collectives; plus notes."""
        from ..ranks.calls import info
        ranks: Dict[int, Dict[str, Any]] = {r: {"state": "unknown"} for r in range(self.size)}
        if self.alive():
            ar = self.view(list(range(self.size))).apply_async(info)
            ar.wait(timeout)
            for i, r in enumerate(range(self.size)):
                if rank_done(ar, i) and rank_futures(ar)[i].exception() is None:
                    ranks[r] = dict(rank_futures(ar)[i].result())
                    ranks[r]["state"] = self.last_cell.get(r, "idle")
                else:
                    ranks[r] = {"state": "busy (not answering)"}
        return {"size": self.size, "alive": self.alive(), "ended": self.ended,
                "start_s": self.started_s, "notes": list(self.plan.notes if self.plan else []),
                "mpiexec_pid": getattr(self.mpiexec, "pid", None),
                "controller_pid": getattr(self.controller, "pid", None), "ranks": ranks}


    def stacks(self, timeout: float = 2.0) -> List[Any]:
        """Every rank's stack (:class:`hvd_magic.stacks.group.RankStack` each), asked by a
        signal the ranks answer even while a cell runs or holds the GIL; the cell goes on.
        Ranks on this host are signalled here and write into the pool's stacks directory;
        those on other hosts are signalled by their nannies and answer on their stderr,
        which ``mpiexec`` brings into its log here. A rank that has not answered after
        ``timeout`` s is named as such."""
        from ...stacks import dump
        ranks = list(range(self.size))
        elsewhere = self._elsewhere()
        log = os.path.join(self.config.workdir, "mpiexec.log")
        offset = os.path.getsize(log) if elsewhere and os.path.exists(log) else 0
        if elsewhere and self.client is not None:
            try:
                self.client.send_signal(dump.SIGNAL.name, block=False,
                                        targets=[self.engines[r] for r in elsewhere])
            except Exception:  # noqa: BLE001 - then they are named as not answering
                pass
        t0 = time.monotonic()
        d = stacks_dir(self.config.workdir)
        out = {s.rank: s for s in dump.gather(d, [r for r in ranks if r not in elsewhere],
                                              timeout)}
        if elsewhere:
            left = max(0.1, timeout - (time.monotonic() - t0))
            got = dump.answers_in(log, offset, elsewhere, left)
            for r in elsewhere:
                out[r] = got.get(r) or dump.RankStack(
                    r, missing=f"did not answer within {timeout:g} s (it runs on "
                               f"{self.hosts[r]}; stopped, or gone)")
        return [out[r] for r in ranks]

    def _elsewhere(self) -> List[int]:
        """The ranks that run on another host than this kernel's."""
        here = socket.gethostname()
        return [r for r in range(self.size) if self.hosts.get(r, here) != here]


class _Timeout(Exception):
    pass
