"""``RayExecutor``: Horovod's ``horovod.ray.RayExecutor`` on hvd_magic.

The workers are Ray actors placed by one placement group: with ``num_workers`` alone, one
bundle per worker, packed onto as few nodes as fit (``PACK``); with ``num_hosts``, one
bundle per host holding ``num_workers_per_host`` workers, each on a different node
(``STRICT_SPREAD``). Ranks are numbered node by node (the node of bundle 0 first), so a
node's ranks are consecutive. Each worker gets torchrun's variables (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``GROUP_WORLD_SIZE``,
``ROLE_RANK``, ``ROLE_WORLD_SIZE``, ``MASTER_ADDR`` = rank 0's node address,
``MASTER_PORT`` = a port free there), so ``hvd.init()`` in the user's function takes the
torch.distributed controller, as under ``torchrun``.

A failure ends the job: when a rank's function raises or its worker process dies,
``run``/``execute`` stop every worker, remove the placement group and raise
:class:`RayWorkerError` naming the rank and its node; the other ranks, which may be
waiting for the lost one in a collective, are not left behind. ``start()`` makes new workers.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

try:
    import ray
    from ray.util.placement_group import (get_current_placement_group, placement_group,
                                          remove_placement_group)
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError:  # pragma: no cover - depends on the environment
    raise ImportError("hvd_magic.ray needs Ray: pip install 'ray>=2.58' "
                      "(or pip install 'hvd_magic[ray]')") from None

from .worker import BaseHorovodWorker

#: How often run/execute look at their workers' results (seconds): a dead worker is
#: noticed within this of Ray reporting it.
POLL_S = 0.1
#: After a rank raised, how long to wait for another rank's death to be reported: a
#: rank that lost its peer mid-collective often raises first, and the dead one is the news.
GRACE_S = 2.0


class RayWorkerError(RuntimeError):
    """A rank's function raised, or its worker process died: ``.rank``, ``.node`` (the
    node's address) and ``.cause`` (the exception Ray reported)."""

    def __init__(self, rank: int, node: str, what: str, cause: BaseException,
                 traceback: str = "") -> None:
        message = (f"rank {rank} (on node {node}) {what}. Every worker of the job was "
                   f"stopped; call start() to run again.")
        if traceback:
            message += f"\n\n--- traceback on rank {rank} ---\n{traceback.rstrip()}"
        super().__init__(message)
        self.rank = rank
        self.node = node
        self.cause = cause


@dataclass
class MiniSettings:
    """The settings :meth:`RayExecutor.create_settings` makes (Horovod's names).

    ``timeout_s`` bounds the workers' start and their rendezvous (it is
    ``HVD_MAGIC_TORCH_INIT_TIMEOUT`` in the workers: how long the process group may
    take to form); ``placement_group_timeout_s`` bounds
    the wait for the cluster to place the workers; ``nics`` (a set of interface names)
    become ``GLOO_SOCKET_IFNAME``. The ssh fields are kept for Horovod's signature: Ray
    starts the workers, so nothing here uses ssh.
    """

    nics: Optional[set] = None
    verbose: int = 1
    ssh_port: Optional[int] = None
    ssh_identity_file: Optional[str] = None
    timeout_s: int = 30
    placement_group_timeout_s: int = 100
    elastic: bool = False


class RayExecutor:
    """Runs functions on ``num_workers`` Ray actors, one rank each (Horovod's class).

    Args:
        settings: from :meth:`create_settings`.
        num_workers: number of workers (ranks), packed onto as few nodes as fit.
        num_hosts: instead (or with ``num_workers == num_hosts * num_workers_per_host``):
            number of nodes, each getting ``num_workers_per_host`` workers.
        num_workers_per_host: workers per node with ``num_hosts``.
        cpus_per_worker: CPUs Ray reserves for each worker.
        use_gpu: reserve GPUs; ``gpus_per_worker`` (default 1) per worker.
        use_current_placement_group: inside a placement group (a Ray Tune trial, say),
            place the workers in it instead of making one.
        min_workers, max_workers, reset_limit, cooldown_range, elastic_timeout,
            override_discovery: Horovod's elastic Ray job, not supported: elastic
            training runs under ``hvdrun --min-np`` (MPI).
    """

    @classmethod
    def create_settings(cls, timeout_s: int = 30, ssh_identity_file: Optional[str] = None,
                        ssh_str: Optional[str] = None, placement_group_timeout_s: int = 100,
                        nics: Optional[set] = None) -> MiniSettings:
        """Settings for :class:`RayExecutor` (``ssh_str`` is accepted and unused)."""
        return MiniSettings(ssh_identity_file=ssh_identity_file, timeout_s=timeout_s,
                            placement_group_timeout_s=placement_group_timeout_s, nics=nics)

    def __init__(self, settings, num_workers: Optional[int] = None,
                 num_hosts: Optional[int] = None, num_workers_per_host: int = 1,
                 cpus_per_worker: int = 1, use_gpu: bool = False,
                 gpus_per_worker: Optional[int] = None,
                 use_current_placement_group: bool = True,
                 min_workers: Optional[int] = None, max_workers: Optional[int] = None,
                 reset_limit: Optional[int] = None, cooldown_range: Optional[List[int]] = None,
                 elastic_timeout: int = 600, override_discovery: bool = True) -> None:
        if min_workers is not None or max_workers is not None:
            raise ValueError("elastic Ray jobs (min_workers/max_workers) are not supported by "
                             "hvd_magic.ray; give num_workers, or run elastic training with "
                             "hvdrun --min-np N --max-np M")
        if gpus_per_worker and not use_gpu:
            raise ValueError("gpus_per_worker is set, but use_gpu is False: pass use_gpu=True "
                             "to reserve GPUs")
        if use_gpu and isinstance(gpus_per_worker, int) and gpus_per_worker < 1:
            raise ValueError(f"gpus_per_worker must be >= 1: got {gpus_per_worker}")
        if num_workers is None and num_hosts is None:
            raise ValueError("give num_workers (ranks) or num_hosts (nodes, with "
                             "num_workers_per_host ranks on each)")
        if num_hosts is not None:
            if num_hosts < 1 or num_workers_per_host < 1:
                raise ValueError(f"num_hosts and num_workers_per_host must be >= 1: got "
                                 f"{num_hosts} and {num_workers_per_host}")
            if num_workers is not None and num_workers != num_hosts * num_workers_per_host:
                raise ValueError(f"num_workers={num_workers} does not match num_hosts="
                                 f"{num_hosts} x num_workers_per_host={num_workers_per_host}; "
                                 f"give one of them, or matching numbers")
        elif num_workers < 1:
            raise ValueError(f"num_workers must be >= 1: got {num_workers}")
        self.settings = settings
        self.num_hosts = num_hosts
        self.num_workers_per_host = num_workers_per_host
        self.num_workers = num_workers if num_hosts is None else num_hosts * num_workers_per_host
        self.cpus_per_worker = cpus_per_worker
        self.use_gpu = use_gpu
        self.gpus_per_worker = (gpus_per_worker or 1) if use_gpu else 0
        self.use_current_placement_group = use_current_placement_group
        self.workers: List[Any] = []          # actor handles, in rank order
        self.nodes: List[Dict[str, Any]] = []  # BaseHorovodWorker.node() per rank
        self._pg = None
        self._own_pg = False
        self._failure: Optional[str] = None

    # ------------------------------------------------------------------ start / stop
    def start(self, executable_cls: Optional[type] = None,
              executable_args: Optional[List] = None,
              executable_kwargs: Optional[Dict] = None,
              extra_env_vars: Optional[Dict] = None) -> None:
        """Place and start the workers, give them their rank's variables (and
        ``extra_env_vars``), and create ``executable_cls(*executable_args,
        **executable_kwargs)`` in each (the object :meth:`execute` passes to its functions)."""
        if self.workers:
            raise RuntimeError("this RayExecutor's workers are running; call shutdown() "
                               "before start()")
        self._failure = None
        try:
            self._place()
            self._start_workers(executable_cls, executable_args, executable_kwargs,
                                extra_env_vars or {})
        except BaseException:
            self.shutdown()
            raise

    def _bundle(self, workers: int) -> Dict[str, float]:
        bundle = {"CPU": float(self.cpus_per_worker * workers)}
        if self.gpus_per_worker:
            bundle["GPU"] = float(self.gpus_per_worker * workers)
        return bundle

    def _place(self) -> None:
        current = get_current_placement_group() if self.use_current_placement_group else None
        if current is not None:
            self._pg, self._own_pg = current, False
            return
        if self.num_hosts is not None:
            bundles = [self._bundle(self.num_workers_per_host)] * self.num_hosts
            strategy = "STRICT_SPREAD"
        else:
            bundles = [self._bundle(1)] * self.num_workers
            strategy = "PACK"
        self._pg, self._own_pg = placement_group(bundles, strategy=strategy), True
        timeout = self.settings.placement_group_timeout_s
        ready, _ = ray.wait([self._pg.ready()], timeout=timeout)
        if not ready:
            raise TimeoutError(
                f"Ray could not place {self.num_workers} workers as {len(bundles)} bundles "
                f"{bundles[0]} ({strategy}) within {timeout} s; the cluster has "
                f"{ray.cluster_resources()} on {len(ray.nodes())} node(s). Add nodes or "
                f"resources, ask for fewer workers/CPUs, or raise "
                f"create_settings(placement_group_timeout_s=...)")

    def _start_workers(self, executable_cls, executable_args, executable_kwargs,
                       extra_env_vars) -> None:
        actor_cls = ray.remote(BaseHorovodWorker)
        per_bundle = self.num_workers_per_host if self.num_hosts is not None else 1
        actors = []
        for i in range(self.num_workers):
            index = i // per_bundle if self._own_pg else -1
            actors.append(actor_cls.options(
                num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._pg, placement_group_bundle_index=index),
            ).remote())
        self.workers = actors
        nodes = self._get([a.node.remote() for a in actors], "the workers to start")
        # ranks node by node, in the order the nodes first appear
        by_node: "OrderedDict[str, List[int]]" = OrderedDict()
        for i, info in enumerate(nodes):
            by_node.setdefault(info["node_id"], []).append(i)
        order = [i for members in by_node.values() for i in members]
        self.workers = [actors[i] for i in order]
        self.nodes = [nodes[i] for i in order]
        master_addr = self.nodes[0]["ip"]
        master_port = self._get([self.workers[0].free_port.remote()], "a free port")[0]
        common = {"WORLD_SIZE": self.num_workers, "ROLE_WORLD_SIZE": self.num_workers,
                  "GROUP_WORLD_SIZE": len(by_node), "MASTER_ADDR": master_addr,
                  "MASTER_PORT": master_port,
                  "HVD_MAGIC_TORCH_INIT_TIMEOUT": self.settings.timeout_s}
        if self.settings.nics:
            common["GLOO_SOCKET_IFNAME"] = ",".join(sorted(self.settings.nics))
        calls = []
        rank = 0
        for group_rank, members in enumerate(by_node.values()):
            gpus = [g for i in members for g in nodes[i]["gpu_ids"]]
            for local_rank in range(len(members)):
                env = dict(common, RANK=rank, ROLE_RANK=rank, LOCAL_RANK=local_rank,
                           LOCAL_WORLD_SIZE=len(members), GROUP_RANK=group_rank)
                if gpus:
                    # every rank of a node sees the node's GPUs, listed in local-rank
                    # order: with one GPU per worker, device hvd.local_rank() is its own
                    env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
                env.update(extra_env_vars)
                calls.append(self.workers[rank].update_env_vars.remote(env))
                rank += 1
        self._get(calls, "the workers' environment")
        self._get([w.start_executable.remote(executable_cls, executable_args,
                                             executable_kwargs) for w in self.workers],
                  "executable_cls to start in the workers")

    def _get(self, refs: List[Any], what: str) -> List[Any]:
        """Results of a start-up step, within the settings' timeout_s."""
        timeout = self.settings.timeout_s
        try:
            return self._gather(refs, timeout=timeout)
        except TimeoutError:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}; the nodes "
                               f"may be overloaded or unreachable (raise "
                               f"create_settings(timeout_s=...))") from None

    def shutdown(self) -> None:
        """Stop the workers (their processes end) and remove the placement group."""
        for worker in self.workers:
            try:
                ray.kill(worker, no_restart=True)
            except Exception:
                pass                      # already dead
        self.workers = []
        if self._pg is not None and self._own_pg:
            try:
                remove_placement_group(self._pg)
            except Exception:
                pass
        self._pg = None

    @property
    def placement_group(self):
        """The placement group the workers run in (None when stopped)."""
        return self._pg

    # ------------------------------------------------------------------ running functions
    def _require(self) -> None:
        if not self.workers:
            if self._failure:
                raise RuntimeError(f"no workers: {self._failure}; call start() again")
            raise RuntimeError("the workers are not running: call start() first")

    def _gather(self, refs: List[Any], timeout: Optional[float] = None) -> List[Any]:
        """``ray.get(refs)``, but the first rank that raises or dies ends the job (see the
        module docstring). ``refs[i]`` is rank i's."""
        rank_of = {ref: i for i, ref in enumerate(refs)}
        results: Dict[int, Any] = {}
        died: Dict[int, BaseException] = {}
        raised: Dict[int, BaseException] = {}
        lost: Dict[int, BaseException] = {}

        def collect(ready: List[Any]) -> None:
            for ref in ready:
                rank = rank_of[ref]
                try:
                    results[rank] = ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    died[rank] = exc
                except ray.exceptions.RayTaskError as exc:
                    raised[rank] = exc
                except ray.exceptions.RayError as exc:     # its result was lost, say
                    lost[rank] = exc

        pending = list(refs)
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending and not (died or raised or lost):
            wait = POLL_S if deadline is None else max(0.0, min(POLL_S, deadline - time.monotonic()))
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=wait)
            collect(ready)
            if pending and deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"ranks {sorted(rank_of[r] for r in pending)} did not answer")
        if raised and not died and pending:
            # A rank whose peer died fails in its collective ("connection reset") before
            # Ray reports the death: wait briefly, so the dead rank is the one named.
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=GRACE_S)
            collect(ready)
        if died:
            rank = min(died)
            pid = self.nodes[rank]["pid"] if rank < len(self.nodes) else "?"
            self._fail(rank, f"died: its worker process (pid {pid}) ended", died[rank])
        if lost:
            rank = min(lost)
            self._fail(rank, f"failed: {type(lost[rank]).__name__}: {lost[rank]}", lost[rank])
        if raised:
            rank = min(raised)
            exc = raised[rank]
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            self._fail(rank, f"raised {type(cause).__name__}: {cause}", exc, str(exc))
        return [results[i] for i in range(len(refs))]

    def _fail(self, rank: int, what: str, cause: BaseException, traceback: str = "") -> None:
        node = self.nodes[rank]["ip"] if rank < len(self.nodes) else "unknown"
        self._failure = f"rank {rank} (on node {node}) {what.splitlines()[0]}"
        self.shutdown()
        raise RayWorkerError(rank, node, what, cause, traceback) from cause

    def execute(self, fn: Callable[[Any], Any]) -> List[Any]:
        """``fn(executable)`` on every worker; the results in rank order."""
        self._require()
        return self._gather([w.execute.remote(fn) for w in self.workers])

    def run(self, fn: Callable[..., Any], args: Optional[List] = None,
            kwargs: Optional[Dict] = None) -> List[Any]:
        """``fn(*args, **kwargs)`` on every worker; the results in rank order."""
        return self._gather(self.run_remote(fn, args, kwargs))

    def run_remote(self, fn: Callable[..., Any], args: Optional[List] = None,
                   kwargs: Optional[Dict] = None) -> List[Any]:
        """Start ``fn(*args, **kwargs)`` on every worker; Ray object refs in rank order
        (``ray.get`` them; a failure is not handled for you there, unlike :meth:`run`)."""
        self._require()
        return [w.run.remote(fn, args, kwargs) for w in self.workers]

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)`` on rank 0 only; its result."""
        self._require()
        return self._gather([self.workers[0].execute.remote(fn)])[0]
