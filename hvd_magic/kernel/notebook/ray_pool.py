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

``ADDRESS`` is what ``ray.init(address=...)`` takes (``auto``, ``host:port``); without one
(``--ray`` alone, which is ``ray.init``'s ``local``) the pool starts a Ray instance of its
own on this machine, and ``ray.shutdown()`` stops the processes that call started when the
pool stops. That Ray listens on this machine's addresses (its GCS and raylets bind the
wildcard address whatever ``_node_ip_address`` says); the pool's start says so. Where the
controller listens: with a local Ray, on Unix sockets only (the ranks are on this
machine); on a cluster, the engines' side listens on the address of this machine on its
route to the cluster's head (the address the nodes reach it by) and nowhere else, and the
pool's start says so.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from typing import Any, Dict, List, Optional

from ... import config as settings
from .cells import clean_stale_dirs, ipyparallel, short_tmp
from .liveness import Seen
from .output import OutputSink, PoolError, n_ranks
from .plan import CLUSTER_ID, PoolConfig, PoolPlan, check_request, connection_info, \
    controller_argv, stacks_dir
from .pool import Pool
from .procs import RankExit, describe_exit, descendants, spawn, tail

#: ``--ray`` without an address: ``ray.init``'s own word for a new local instance.
LOCAL = "local"
#: How often the kernel asks the actors whether their engines still run (seconds).
POLL_S = 0.25
#: The kernel's variables that the ranks get (by prefix): the runtime's settings.
FORWARDED = ("HOROVOD_", "GLOO_", "NCCL_", "TORCH_")
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


def stop_engine(host: EngineHost) -> None:
    """Kill the engine and what it started (its nanny) and reap it."""
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


# ------------------------------------------------------------------ in the kernel

def ray_config(np: int, address: str, env: Optional[Dict[str, str]] = None) -> PoolConfig:
    """The config of a Ray pool of ``np`` ranks at ``address`` (``local``: a new local Ray)."""
    check_request(np, None, True)
    return PoolConfig(np=np, workdir="/tmp/hvdm-plan", key=secrets.token_hex(16),
                      ipc=os.name == "posix", env=dict(env or {}), environ=dict(os.environ),
                      ray=address)


def plan_ray_pool(config: PoolConfig, local: bool) -> PoolPlan:
    """The controller's command line and the engines' variables; ``local``: every rank runs
    on this machine (Unix sockets), else the engines reach ``config.controller_ip``."""
    engine_info, client_info = connection_info(config, local)
    security = os.path.join(config.workdir, "security")
    # the ranks run in Ray's workers, with the environment of each node's Ray: of this
    # kernel's, only what tells the ranks' runtime how to behave travels with them (as the
    # MPI pool's ranks inherit it), e.g. GLOO_SOCKET_IFNAME where a node's hostname does not
    # resolve to the address the other nodes reach
    env = {k: v for k, v in config.environ.items() if k.startswith(FORWARDED)}
    env.update(config.env)
    env.update(IPP_CONNECTION_INFO=json.dumps(engine_info, sort_keys=True),
               HVD_MAGIC_POOL="1", HVD_MAGIC_STACKS_DIR=stacks_dir(config.workdir),
               PYTHONUNBUFFERED="1")
    if local:
        notes = ["the controller listens on Unix sockets in the pool's private directory; "
                 "the Ray started for this pool listens on this machine's addresses, as Ray "
                 "does (no Ray setting keeps it on loopback), until the pool stops"]
    else:
        notes = [f"the Ray nodes reach the controller at {config.controller_ip}; it listens "
                 "there and on Unix sockets for this kernel only"]
    # single_host False: interrupts go through each engine's nanny, wherever it runs
    return PoolPlan(controller_argv(config, local, engine_info, client_info), [], env,
                    engine_info, client_info,
                    os.path.join(security, f"ipcontroller-{CLUSTER_ID}-engine.json"),
                    os.path.join(security, f"ipcontroller-{CLUSTER_ID}-client.json"),
                    False, notes)


def _address_towards(host: str) -> str:
    """This machine's address on the route to ``host`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


class RayPool(Pool):
    """A :class:`~.pool.Pool` whose ranks are engines started by Ray actors."""

    def __init__(self, config: PoolConfig) -> None:
        super().__init__(config)
        self.executor: Any = None
        self.own_ray = False            # this pool called ray.init (so it calls ray.shutdown)
        self.exits: Dict[int, str] = {}  # rank -> how its engine or actor ended
        self.engine_pids: Dict[int, int] = {}
        self._polls: Optional[List[Any]] = None
        self._polled = 0.0
        self.nodes_text = ""

    # ------------------------------------------------------------------ start / stop
    def start(self, sink: Optional[OutputSink] = None) -> "RayPool":
        ipp = ipyparallel()
        try:
            import ray
            from ...ray import RayExecutor
        except ImportError as exc:
            raise PoolError(f"--ray needs Ray in this kernel's environment ({exc}); "
                            "pip install 'ray>=2.58'") from None
        t0 = time.monotonic()
        local = self.config.ray == LOCAL
        where = "a local Ray" if local else f"the Ray cluster at {self.config.ray}"
        if sink is not None:
            sink.status(f"hvd: starting {n_ranks(self.config.np)} on {where} ...")
        try:
            clean_stale_dirs(short_tmp())
        except Exception:  # noqa: BLE001 - housekeeping only
            pass
        workdir = tempfile.mkdtemp(prefix="hvdm-", dir=short_tmp())
        os.chmod(workdir, 0o700)
        self.config.workdir = workdir
        limit = settings.get("HVD_MAGIC_START_TIMEOUT")
        try:
            self._connect(ray, local)
            if not local:
                from ipyparallel.util import select_random_ports
                gcs = ray.get_runtime_context().gcs_address
                self.config.controller_ip = _address_towards(gcs.rsplit(":", 1)[0])
                self.config.ports = select_random_ports(16)
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
            self.client.session.digest_history_size = 4096
            self.executor = RayExecutor(
                RayExecutor.create_settings(timeout_s=int(limit),
                                            placement_group_timeout_s=int(limit)),
                num_workers=self.config.np, cpus_per_worker=1)
            self.executor.start(executable_cls=EngineHost, extra_env_vars=plan.engine_env)
            pids = ray.get([w.execute.remote(engine_pid) for w in self.executor.workers],
                           timeout=limit)
            self.engine_pids = dict(enumerate(pids))
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
        for r, node in enumerate(self.executor.nodes):
            self.hosts[r] = f"{node['hostname']} ({node['ip']})"
        self.nodes_text = self._nodes_text(ray)
        self.started_s = time.monotonic() - t0
        if sink is not None:
            sink.status(self.nodes_text)
            for note in plan.notes:
                sink.status(f"hvd: note: {note}")
        return self

    def _connect(self, ray: Any, local: bool) -> None:
        """``ray.init`` unless this kernel is connected already (then the pool uses that
        connection and leaves it open)."""
        if ray.is_initialized():
            return
        if local:
            ray.init(address=LOCAL, _node_ip_address="127.0.0.1", include_dashboard=False,
                     num_cpus=max(self.config.np, os.cpu_count() or 1),
                     log_to_driver=False, configure_logging=False)
        else:
            ray.init(address=self.config.ray, log_to_driver=False, configure_logging=False)
        self.own_ray = True

    def _nodes_text(self, ray: Any) -> str:
        """``hvd: Ray cluster ...: 2 nodes; node A (10.0.0.1): rank 0; ...``."""
        by_node: Dict[str, List[int]] = {}
        for r, node in enumerate(self.executor.nodes):
            by_node.setdefault(f"{node['hostname']} ({node['ip']})", []).append(r)
        try:
            alive = len([n for n in ray.nodes() if n.get("Alive")])
        except Exception:  # noqa: BLE001 - only for the words
            alive = len(by_node)
        where = "local Ray" if self.config.ray == LOCAL else f"Ray cluster {self.config.ray}"
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
        executor, self.executor = self.executor, None
        if executor is not None and executor.workers:
            try:
                import ray
                refs = [w.execute.remote(stop_engine) for w in executor.workers]
                ray.wait(refs, num_returns=len(refs), timeout=STOP_WAIT_S)
            except Exception:  # noqa: BLE001 - the actors are killed next anyway
                pass
            executor.shutdown()
        super().stop()
        if self.own_ray:
            self.own_ray = False
            import ray
            ray.shutdown()

    # ------------------------------------------------------------------ liveness
    def _poll(self, wait: float = 0.0) -> None:
        """Ask every actor whether its engine still runs (at most every :data:`POLL_S` s,
        without blocking unless ``wait``); what ended goes to :attr:`exits`."""
        executor = self.executor
        if executor is None or not executor.workers:
            return
        import ray
        if self._polls is None:
            if not wait and time.monotonic() - self._polled < POLL_S:
                return
            self._polls = [w.execute.remote(engine_exit) for w in executor.workers]
            self._polled = time.monotonic()
        ready, _ = ray.wait(self._polls, num_returns=len(self._polls), timeout=wait)
        if len(ready) < len(self._polls):
            return
        polls, self._polls = self._polls, None
        for r, ref in enumerate(polls):
            node = executor.nodes[r] if r < len(executor.nodes) else {}
            on = f"on node {node.get('hostname', '?')} ({node.get('ip', '?')})"
            try:
                ended = ray.get(ref)
            except ray.exceptions.RayError as exc:
                self.exits.setdefault(r, f"lost its Ray actor (worker pid {node.get('pid', '?')}) "
                                         f"{on}: {type(exc).__name__}")
                continue
            if ended is not None:
                code, output = ended
                pid = self.engine_pids.get(r, "?")
                how = describe_exit(code).replace("killed by SIG", "killed by signal SIG")
                said = f"; its output ended with:\n{output}" if output and code > 0 else ""
                self.exits.setdefault(r, f"{how} {on} (engine pid {pid}){said}")

    def _job_ended(self) -> Optional[str]:
        if self.controller is None or self.executor is None:
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
        self._poll(wait=2.0)            # let the actors say which engine ended, and how
        return super()._death(failures, targets)

    def _log(self) -> str:
        return tail(os.path.join(self.config.workdir, "controller.log"), 20000)

    def status(self, timeout: float = 2.0) -> Dict[str, Any]:
        st = super().status(timeout)
        st["notes"] = [self.nodes_text[len("hvd: "):]] + st["notes"]
        return st
