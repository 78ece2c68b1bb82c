"""Runs in the notebook kernel (and, for :class:`EngineHost`, in each rank's Ray actor).

The pool on a Ray cluster: ``%%hvd -np N --ray [ADDRESS]``.

The ranks are placed as :class:`hvd_magic.ray.RayExecutor` places its workers (one Ray
actor per rank, a placement group, torchrun's variables in each actor), and each actor
starts the rank's ipyparallel engine as a subprocess with those variables
(:class:`EngineHost`), so ``hvd.init()`` there takes the torch.distributed controller and
the engine registers with the pool's controller under its rank as engine id. From then on
a cell runs as on the MPI pool (:class:`~.pool.Pool`, whose cell, push/pull, status and
output code this pool shares); what differs is where the ranks come from and how a dead
one is seen: each actor is asked every :data:`POLL_S` s whether its engine still runs, so
a killed engine (or a lost actor) ends the running cell naming its rank and node.

``ADDRESS`` is what ``ray.init(address=...)`` takes (``auto``, ``host:port``): this kernel
connects as Ray's driver (:class:`RayRanks`), and the engines' side of the controller
listens on the address of this machine on its route to the cluster's head (the address the
nodes reach it by) and nowhere else; the pool's start says so. Without one (``--ray``
alone, which is ``ray.init``'s ``local``) the pool starts a Ray of its own on this machine,
driven by a :mod:`.ray_host` process in a loopback-only network namespace
(:class:`HostedRanks`): Ray's processes bind every address they see, so there they are
reachable from nowhere else, and the ranks reach the controller over Unix sockets. Where
no namespace can be made, this kernel drives that Ray itself and the start says that it
listens on this machine's addresses. ``ray.shutdown()`` stops the processes the pool's
``ray.init`` started, never others (no ``ray stop``).
"""
from __future__ import annotations

import functools
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from typing import Any, Dict, List, Optional, Sequence

from ... import config as settings
from ...runner.options import RAY_LOCAL
from .cells import ipyparallel
from .liveness import Seen
from .output import OutputSink, PoolError, n_ranks
from .plan import CLUSTER_ID, NO_NAMESPACE, PoolConfig, PoolPlan, check_request, connection_info, \
    controller_argv, stacks_dir
from .pool import DIGEST_HISTORY, Pool
from .ports import controller_ports
from .procs import RankExit, describe_exit, descendants, spawn, stop_tree, tail

#: How often the kernel asks the actors whether their engines still run (seconds).
POLL_S = 0.25
#: When a rank is lost, how long its actor may take to say whether and how its engine ended
#: (milliseconds as a rule; seconds on a loaded machine, where a shorter wait took a killed
#: rank for a paused one).
EXIT_REPORT_S = 5.0
#: Seconds to wait for the actors to stop their engines before killing the actors.
STOP_WAIT_S = 3.0


# ------------------------------------------------------------------ in each rank's actor

class EngineHost:
    """The executable of a rank's Ray actor: starts the rank's engine
    (``python -m hvd_magic.kernel.ranks.engine --IPEngine.id=RANK``) with the actor's
    environment, which holds the rank's torchrun variables and the pool's connection
    information. The engine dies with the actor (it asks for SIGKILL when its parent dies)."""

    def __init__(self) -> None:
        rank = os.environ["RANK"]
        self.rank = int(rank)
        # the pool's stacks directory, made on this node too when it is not the kernel's:
        # the rank writes its stacks there and :func:`engine_stacks` reads them here
        self.stacks = settings.get("HVD_MAGIC_STACKS_DIR")
        self.made_stacks = bool(self.stacks) and not os.path.isdir(self.stacks)
        if self.made_stacks:
            os.makedirs(self.stacks, mode=0o700)
        # the engine's own output (its cells' output goes to the notebook): read back when
        # it ends, so that an engine that fails to start says why
        fd, self.log = tempfile.mkstemp(prefix=f"hvdm-engine{rank}-", suffix=".log")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "hvd_magic.kernel.ranks.engine", f"--IPEngine.id={rank}"],
                env=dict(os.environ), stdin=subprocess.DEVNULL, stdout=fd, stderr=fd,
                start_new_session=True)
        finally:
            os.close(fd)


def engine_pid(host: EngineHost) -> int:
    return host.proc.pid


def engine_exit(host: EngineHost) -> Optional[tuple]:
    """``(exit status, the end of its output)`` once the engine ended (negative status: the
    signal that killed it); None while it runs."""
    code = host.proc.poll()
    return None if code is None else (code, tail(host.log, 1500).strip())


def engine_stacks(host: EngineHost, timeout: float) -> Any:
    """The rank's stack (:class:`hvd_magic.stacks.group.RankStack`), asked and read on its
    node, as ``%hvd stacks`` does for the ranks on the kernel's machine."""
    from ...stacks import dump
    return dump.gather(host.stacks or None, [host.rank], timeout,
                       pids={host.rank: host.proc.pid})[0]


def stop_engine(host: EngineHost) -> None:
    """Kill the engine and what it started (its nanny) and reap it; remove the stacks
    directory it made on this node."""
    try:
        os.killpg(host.proc.pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        host.proc.wait(2.0)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.unlink(host.log)
    except OSError:
        pass
    if host.made_stacks:
        shutil.rmtree(host.stacks, ignore_errors=True)


# ------------------------------------------------------------------ in the kernel

def ray_config(np: int, address: str, env: Optional[Dict[str, str]] = None) -> PoolConfig:
    """The config of a Ray pool of ``np`` ranks at ``address`` (``local``: a new local Ray)."""
    from ...runner import launch
    check_request(np, None, True)
    environ = dict(os.environ)
    netns = address == RAY_LOCAL and launch.netns_wanted(environ) and launch.netns_available()
    return PoolConfig(np=np, workdir="/tmp/hvdm-plan", key=secrets.token_hex(16),
                      ipc=os.name == "posix", env=dict(env or {}), environ=environ,
                      ray=address, netns=netns)


def plan_ray_pool(config: PoolConfig, local: bool) -> PoolPlan:
    """The controller's command line and the engines' variables; ``local``: every rank runs
    on this machine (Unix sockets), else the engines reach ``config.controller_ip``."""
    engine_info, client_info = connection_info(config, local)
    security = os.path.join(config.workdir, "security")
    # the ranks run in Ray's workers, with the environment of each node's Ray: of this
    # kernel's, only what tells the ranks' runtime how to behave travels with them (as the
    # MPI pool's ranks inherit it)
    env = {k: v for k, v in config.environ.items() if k.startswith(settings.RAY_FORWARDED)}
    env.update(config.env)
    env.update(IPP_CONNECTION_INFO=json.dumps(engine_info, sort_keys=True),
               HVD_MAGIC_POOL="1", HVD_MAGIC_STACKS_DIR=stacks_dir(config.workdir),
               PYTHONUNBUFFERED="1")
    if local and config.netns:
        notes = ["the Ray started for this pool and its ranks run in a loopback-only network "
                 "namespace, and the controller listens on Unix sockets in the pool's "
                 "private directory: the pool opens no TCP port reachable from outside"]
    elif local:
        notes = [f"{NO_NAMESPACE}: the Ray started for it listens on this machine's "
                 "addresses (no Ray setting keeps it on loopback); the controller listens on "
                 "Unix sockets in the pool's private directory"]
    else:
        notes = [f"the Ray nodes reach the controller at {config.controller_ip}; it listens "
                 "there and on Unix sockets for this kernel only"]
    # single_host False: interrupts go through each engine's nanny, wherever it runs
    return PoolPlan(controller_argv(config, local, engine_info, client_info), [], env,
                    engine_info, client_info,
                    os.path.join(security, f"ipcontroller-{CLUSTER_ID}-engine.json"),
                    os.path.join(security, f"ipcontroller-{CLUSTER_ID}-client.json"),
                    False, notes)


class RayRanks:
    """The ranks' actors, seen from Ray's driver (this kernel, or for a local Ray the
    :mod:`.ray_host` process in its loopback-only namespace): connect, place, poll, stop."""

    def __init__(self) -> None:
        self.executor: Any = None
        self.own_ray = False            # this driver called ray.init (so it calls ray.shutdown)
        self.pids: List[int] = []
        self._polls: Optional[List[Any]] = None
        self._polled = 0.0

    def connect(self, address: str, np: int) -> str:
        """``ray.init`` unless connected already (then that connection is used and left
        open); the cluster's GCS address."""
        import ray
        if not ray.is_initialized():
            if address == RAY_LOCAL:
                ray.init(address=RAY_LOCAL, include_dashboard=False,
                         num_cpus=max(np, os.cpu_count() or 1),
                         log_to_driver=False, configure_logging=False)
            else:
                ray.init(address=address, log_to_driver=False, configure_logging=False)
            self.own_ray = True
        return ray.get_runtime_context().gcs_address

    def place(self, np: int, env: Dict[str, str], limit: float) -> Dict[str, Any]:
        """Start ``np`` actors, each starting its rank's engine with ``env``: where each
        rank runs (RayExecutor's node records), the engines' pids, the cluster's nodes."""
        import ray
        from ...ray import RayExecutor
        self.executor = RayExecutor(
            RayExecutor.create_settings(timeout_s=int(limit), placement_group_timeout_s=int(limit)),
            num_workers=np, cpus_per_worker=1)
        self.executor.start(executable_cls=EngineHost, extra_env_vars=env)
        self.pids = ray.get([w.execute.remote(engine_pid) for w in self.executor.workers],
                            timeout=limit)
        return {"nodes": self.executor.nodes, "pids": self.pids,
                "alive": len([n for n in ray.nodes() if n.get("Alive")])}

    def poll(self, wait: float = 0.0) -> Dict[int, str]:
        """Ask every actor whether its engine still runs: rank -> how it ended, for those
        that did. Without ``wait``, at most every :data:`POLL_S` s and without blocking;
        with ``wait``, the answer rests on a round of questions asked after this call
        (so an engine that ended just before it is seen), waiting up to ``wait`` s."""
        executor = self.executor
        if executor is None or not executor.workers:
            return {}
        import ray
        since = time.monotonic()
        deadline = since + wait
        while True:
            if self._polls is None:
                if not wait and time.monotonic() - self._polled < POLL_S:
                    return {}
                self._polls = [w.execute.remote(engine_exit) for w in executor.workers]
                self._polled = time.monotonic()
            asked = self._polled
            ready, _ = ray.wait(self._polls, num_returns=len(self._polls),
                                timeout=max(0.0, deadline - time.monotonic()))
            if len(ready) < len(self._polls):
                return {}
            polls, self._polls = self._polls, None
            exits = self._answers(polls)
            if exits or not wait or asked >= since or time.monotonic() >= deadline:
                return exits

    def _answers(self, polls: List[Any]) -> Dict[int, str]:
        """A complete round's answers: rank -> how its engine (or actor) ended."""
        import ray
        executor = self.executor
        exits: Dict[int, str] = {}
        for r, ref in enumerate(polls):
            node = executor.nodes[r] if r < len(executor.nodes) else {}
            on = f"on node {node.get('hostname', '?')} ({node.get('ip', '?')})"
            try:
                ended = ray.get(ref)
            except ray.exceptions.RayError as exc:
                exits[r] = (f"lost its Ray actor (worker pid {node.get('pid', '?')}) {on}: "
                            f"{type(exc).__name__}")
                continue
            if ended is not None:
                code, output = ended
                pid = self.pids[r] if r < len(self.pids) else "?"
                how = describe_exit(code).replace("killed by SIG", "killed by signal SIG")
                said = f"; its output ended with:\n{output}" if output and code > 0 else ""
                exits[r] = f"{how} {on} (engine pid {pid}){said}"
        return exits

    def stacks(self, timeout: float) -> List[Any]:
        """Every rank's stack, each asked and read on its node by its actor."""
        import ray
        from ...stacks import dump
        workers = self.executor.workers if self.executor is not None else []
        ask = functools.partial(engine_stacks, timeout=timeout)
        refs = [w.execute.remote(ask) for w in workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout + 3.0)
        answered = set(ready)
        out = []
        for r, ref in enumerate(refs):
            try:
                if ref not in answered:
                    raise TimeoutError(f"not within {timeout + 3.0:g} s")
                out.append(ray.get(ref))
            except Exception as exc:  # noqa: BLE001 - a lost actor: named, not shown
                out.append(dump.RankStack(r, missing=f"its Ray actor did not answer "
                                                     f"({type(exc).__name__}: {exc})"))
        return out

    def stop(self) -> None:
        """Stop the engines, the actors (and their placement group); then the Ray instance
        this driver started (or its connection)."""
        executor, self.executor = self.executor, None
        if executor is not None and executor.workers:
            try:
                import ray
                refs = [w.execute.remote(stop_engine) for w in executor.workers]
                ray.wait(refs, num_returns=len(refs), timeout=STOP_WAIT_S)
            except Exception:  # noqa: BLE001 - the actors are killed next anyway
                pass
            executor.shutdown()
        if self.own_ray:
            self.own_ray = False
            import ray
            ray.shutdown()


class HostedRanks:
    """:class:`RayRanks` in a :mod:`.ray_host` process that runs a local Ray inside a
    loopback-only network namespace: the same calls, as JSON lines over its stdin/stdout.
    The host stops its Ray when its stdin closes (this kernel ended)."""

    def __init__(self, workdir: str, host: Sequence[str] = ()) -> None:
        """``host``: the command of the host process (:mod:`.ray_host` unless given)."""
        import queue
        import threading
        log = os.open(os.path.join(workdir, "ray_host.log"), os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            self.proc = subprocess.Popen(
                list(host) or [sys.executable, "-m", "hvd_magic.kernel.notebook.ray_host"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                start_new_session=True)
        finally:
            os.close(log)
        self.log = os.path.join(workdir, "ray_host.log")
        self.replies: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._waiting = False           # a poll was sent and its reply not read yet
        self._polled = 0.0
        self.np = 0
        self.known: List[Any] = []
        threading.Thread(target=self._read, name="hvd_magic-ray-host", daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.replies.put(json.loads(line))
            except ValueError:
                continue
        self.replies.put({"error": "the Ray host process ended"})

    def _send(self, msg: Dict[str, Any]) -> None:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def _reply(self, timeout: float) -> Dict[str, Any]:
        import queue
        try:
            reply = self.replies.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"the Ray host process did not answer within {timeout:g} s") \
                from None
        if "error" in reply:
            raise PoolError(f"{reply['error']}\n--- ray_host.log ---\n"
                            + tail(self.log, 2000).strip())
        return reply

    def connect(self, address: str, np: int) -> str:
        self._send({"cmd": "connect", "np": np})
        return self._reply(settings.get("HVD_MAGIC_START_TIMEOUT"))["gcs"]

    def place(self, np: int, env: Dict[str, str], limit: float) -> Dict[str, Any]:
        self.np = np
        self._send({"cmd": "place", "np": np, "env": env, "limit": limit})
        reply = self._reply(limit + 10)
        self.known = descendants(self.proc.pid)     # Ray's processes: stopped by pid at the end
        return reply

    def poll(self, wait: float = 0.0) -> Dict[int, str]:
        """As :meth:`RayRanks.poll`. Without ``wait``, a question is sent and its answer
        read at a later call; with ``wait``, an answer still on its way is read first (it
        may name an exit), then a question asked now is answered within ``wait`` s."""
        import queue
        deadline = time.monotonic() + wait
        if not self._waiting:
            if not wait:
                if time.monotonic() - self._polled < POLL_S:
                    return {}
                self._send({"cmd": "poll", "wait": 0.0})
                self._waiting, self._polled = True, time.monotonic()
                return {}
        else:
            try:
                reply = self.replies.get(timeout=wait + 1.0) if wait \
                    else self.replies.get_nowait()
            except queue.Empty:
                return {}
            self._waiting = False
            exits = self._exits(reply)
            if exits or not wait or time.monotonic() >= deadline:
                return exits
        self._send({"cmd": "poll", "wait": deadline - time.monotonic()})
        self._polled = time.monotonic()
        try:
            reply = self.replies.get(timeout=max(0.0, deadline - time.monotonic()) + 1.0)
        except queue.Empty:
            self._waiting = True        # its reply is read by the next poll
            return {}
        return self._exits(reply)

    def _exits(self, reply: Dict[str, Any]) -> Dict[int, str]:
        if "error" in reply:
            return {r: f"was lost: {reply['error']}" for r in range(self.np)}
        return {int(r): how for r, how in reply.get("exits", {}).items()}

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self._send({"cmd": "stop"})
                self.proc.wait(STOP_WAIT_S + 10)
            except Exception:  # noqa: BLE001 - killed below
                pass
        stop_tree([], [self.proc], self.known)


def _address_towards(host: str) -> str:
    """This machine's address on the route to ``host`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


class RayPool(Pool):
    """A :class:`~.pool.Pool` whose ranks are engines started by Ray actors."""

    def __init__(self, config: PoolConfig) -> None:
        super().__init__(config)
        self.ranks: Any = None           # RayRanks (this kernel drives Ray) or HostedRanks
        self.exits: Dict[int, str] = {}  # rank -> how its engine or actor ended
        self.engine_pids: Dict[int, int] = {}
        self.nodes_text = ""

    # ------------------------------------------------------------------ start / stop
    def start(self, sink: Optional[OutputSink] = None) -> "RayPool":
        ipp = ipyparallel()
        try:
            import ray  # noqa: F401 - only to say early that it is missing
        except ImportError as exc:
            raise PoolError(f"--ray needs Ray in this kernel's environment ({exc}); "
                            "pip install 'ray>=2.58'") from None
        t0 = time.monotonic()
        local = self.config.ray == RAY_LOCAL
        where = "a local Ray" if local else f"the Ray cluster at {self.config.ray}"
        if sink is not None:
            sink.status(f"hvd: starting {n_ranks(self.config.np)} on {where} ...")
        workdir = self.make_workdir()
        limit = settings.get("HVD_MAGIC_START_TIMEOUT")
        try:
            # a local Ray runs in a loopback-only network namespace where one can be made
            # (its processes listen on every address otherwise)
            hosted = local and self.config.netns
            self.ranks = HostedRanks(workdir) if hosted else RayRanks()
            gcs = self.ranks.connect(self.config.ray, self.config.np)
            if not local:
                self.config.controller_ip = _address_towards(gcs.rsplit(":", 1)[0])
                self.config.ports = controller_ports(16)
            self.plan = plan = plan_ray_pool(self.config, local)
            os.makedirs(os.path.dirname(plan.engine_file), mode=0o700, exist_ok=True)
            os.makedirs(stacks_dir(workdir), mode=0o700, exist_ok=True)
            for path, info in ((plan.engine_file, plan.engine_info),
                               (plan.client_file, plan.client_info)):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as fh:
                    json.dump(info, fh)
            self.controller = spawn(plan.controller_argv, dict(os.environ, PYTHONUNBUFFERED="1"),
                                    os.path.join(workdir, "controller.log"))
            self.client = ipp.Client(plan.client_file, timeout=limit)
            self.client.session.digest_history_size = DIGEST_HISTORY
            placed = self.ranks.place(self.config.np, plan.engine_env, limit)
            self.engine_pids = dict(enumerate(placed["pids"]))
            self._wait_until_registered(sink, t0, limit)
        except BaseException as exc:
            log = tail(os.path.join(workdir, "controller.log"), 2000).strip()
            self.stop()
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise PoolError(f"the pool did not start on {where}: {type(exc).__name__}: {exc}"
                            + (f"\n--- controller.log ---\n{log}" if log else "")) from exc
        self.known = descendants(self.controller.pid)
        self._learn_where()
        for r, node in enumerate(placed["nodes"]):
            self.hosts[r] = f"{node['hostname']} ({node['ip']})"
        self.nodes_text = self._nodes_text(placed)
        self.started_s = time.monotonic() - t0
        if sink is not None:
            sink.status(self.nodes_text)
            for note in plan.notes:
                sink.status(f"hvd: note: {note}")
        return self

    def _nodes_text(self, placed: Dict[str, Any]) -> str:
        """``hvd: Ray cluster ...: 2 nodes; node A (10.0.0.1): rank 0; ...``."""
        by_node: Dict[str, List[int]] = {}
        for r, node in enumerate(placed["nodes"]):
            by_node.setdefault(f"{node['hostname']} ({node['ip']})", []).append(r)
        alive = placed.get("alive") or len(by_node)
        where = "local Ray" if self.config.ray == RAY_LOCAL else f"Ray cluster {self.config.ray}"
        parts = [f"node {name}: {'ranks' if len(rs) > 1 else 'rank'} "
                 f"{','.join(map(str, rs))}" for name, rs in by_node.items()]
        return (f"hvd: {where}, {alive} node{'s' if alive != 1 else ''}; "
                f"{n_ranks(self.config.np)} on {len(by_node)}: " + "; ".join(parts))

    def _wait_until_registered(self, sink: Optional[OutputSink], t0: float,
                               limit: float) -> None:
        n, last = self.config.np, -1
        while True:
            count = len(self.client.ids)
            if count >= n:
                return
            if self.controller.poll() is not None:
                raise PoolError(f"the controller {describe_exit(self.controller.returncode)} "
                                "while the pool was starting")
            self._poll(wait=0.5)
            if self.exits:
                raise PoolError("; ".join(f"rank {r} {how}" for r, how in
                                          sorted(self.exits.items()))
                                + " while the pool was starting")
            if time.monotonic() - t0 > limit:
                raise PoolError(f"only {count} of {n} ranks registered within {limit:g} s "
                                "(HVD_MAGIC_START_TIMEOUT); check that the Ray nodes can reach "
                                f"this machine at {self.config.controller_ip}")
            if sink is not None and count != last:
                sink.status(f"hvd: starting {n_ranks(n)} ... {count}/{n} ready "
                            f"({time.monotonic() - t0:.1f} s)")
                last = count
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop the engines, the actors (and their placement group), the controller; then
        the Ray instance this pool started (or this kernel's connection it opened)."""
        self._end_gracefully()
        ranks, self.ranks = self.ranks, None
        if ranks is not None:
            ranks.stop()
        super().stop()

    def _engines_gone(self) -> bool:
        self._poll()
        return self.ranks is None or len(self.exits) >= self.size

    # ------------------------------------------------------------------ liveness
    def _poll(self, wait: float = 0.0) -> None:
        """What ended among the ranks' engines and actors goes to :attr:`exits`."""
        if self.ranks is not None:
            for r, how in self.ranks.poll(wait).items():
                self.exits.setdefault(r, how)

    def _job_ended(self) -> Optional[str]:
        if self.controller is None or self.ranks is None:
            return "the pool was stopped"
        if self.controller.poll() is not None:
            return f"the controller {describe_exit(self.controller.returncode)}"
        self._poll()
        if self.exits:
            return "; ".join(f"rank {r} {how}" for r, how in sorted(self.exits.items()))
        return None

    def _seen(self, ar: Any = None, exits: bool = False, cell: Any = None,
              targets: Any = ()) -> Seen:
        seen = super()._seen(ar, False, cell, targets)
        found = [RankExit(r, how) for r, how in sorted(self.exits.items())] if exits else []
        return replace(seen, exits=found, job="the Ray job")

    def _death(self, failures: Any, targets: Any) -> Any:
        self._poll(wait=EXIT_REPORT_S)  # let the actors say which engine ended, and how
        return super()._death(failures, targets)

    def _log(self) -> str:
        return tail(os.path.join(self.config.workdir, "controller.log"), 20000)

    def stacks(self, timeout: float = 2.0) -> List[Any]:
        """Every rank's stack: on a Ray cluster each actor asks its rank and reads the
        answer on its node; a local Ray's ranks all run on this machine."""
        if isinstance(self.ranks, RayRanks) and self.config.ray != RAY_LOCAL:
            return self.ranks.stacks(timeout)
        return super().stacks(timeout)

    def _elsewhere(self) -> List[int]:
        return []          # (a local Ray; a cluster's ranks answer through their actors)

    def status(self, timeout: float = 2.0) -> Dict[str, Any]:
        st = super().status(timeout)
        st["notes"] = [self.nodes_text[len("hvd: "):]] + st["notes"]
        return st
