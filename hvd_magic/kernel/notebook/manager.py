"""Runs in the notebook kernel.

Which pool a request needs: gather this machine's facts into a config, and keep at most
one pool per kernel (start on first use, reuse, restart for another size or hosts)."""
from __future__ import annotations

import os
import secrets
import socket
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from ... import config
from ...runner.plan import Host
from .output import OutputSink, n_ranks
from .plan import NO_NAMESPACE, PoolConfig, plan_pool
from .pool import Pool
from .ports import controller_ports


def _local_ip_towards(host: str) -> str:
    """This machine's address on the route to ``host`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError as exc:
        raise ValueError(f"cannot find a route to host {host!r} ({exc}); check the name in "
                         "-H / --hostfile") from None


def make_config(np: int, hosts: Optional[List[Host]] = None, hostfile: Optional[str] = None,
                env: Optional[Dict[str, str]] = None,
                workdir: str = "/tmp/hvdm-plan", oversubscribe: bool = False,
                min_np: Optional[int] = None, slurm: Optional[Any] = None) -> PoolConfig:
    """Gather the facts of this machine (mpiexec, MPI flavour, namespaces, addresses) into a
    :class:`PoolConfig`; raises ValueError/TypeError/RuntimeError for what cannot work.
    ``slurm``: an :class:`~hvd_magic.runner.slurm_alloc.Allocation` whose nodes the ranks run on."""
    from ...runner import launch
    from ...runner.plan import parse_hostfile
    environ = dict(os.environ)
    info = launch.detect_mpi(launch.find_mpiexec(environ))
    names = launch.local_names()
    if hostfile is not None:
        try:
            with open(hostfile) as fh:
                listed = parse_hostfile(fh.read(), hostfile)
        except OSError as exc:
            raise ValueError(f"--hostfile {hostfile}: cannot read it ({exc.strerror})") from None
        hosts = hosts or listed
    if slurm is not None:
        hosts, hostfile = slurm.hosts, None
        environ.update(slurm.env())
    single = slurm is None and (not hosts or all(h.name in names for h in hosts))
    oversub = True if oversubscribe or config.get("HVD_MAGIC_OVERSUBSCRIBE", environ) else None
    controller_ip, ports = "127.0.0.1", []
    if not single:
        if slurm is not None:       # the nodes' addresses as Slurm knows them (NodeAddr)
            others = [a for n, a in slurm.addrs.items() if n not in names] or \
                list(slurm.addrs.values()) or [h.name for h in hosts or []]
            remote = others[0]
        else:
            remote = next(h.name for h in hosts or [] if h.name not in names)
        controller_ip = _local_ip_towards(remote)
        ports = controller_ports(16)
    netns = single and launch.netns_wanted(environ) and launch.netns_available()
    return PoolConfig(np=np, workdir=workdir, key=secrets.token_hex(16), hosts=hosts,
                      hostfile=hostfile, mpiexec=info.path, mpi_impl=info.impl,
                      mpi_version=info.version, netns=netns, ipc=os.name == "posix",
                      controller_ip=controller_ip, ports=ports, oversubscribe=oversub,
                      local_names=names, env=dict(env or {}), environ=environ, min_np=min_np,
                      slurm_job=None if slurm is None else slurm.job_id)


class PoolRequest(NamedTuple):
    """What a pool was started for; two equal requests are served by the same pool."""

    np: int
    hosts: Optional[List[Host]]
    hostfile: Optional[str]
    min_np: Optional[int]
    slurm: Optional[Tuple]          # %%hvd --slurm's options, as sorted (key, value) pairs
    env: Optional[Tuple]            # a profile's variables, as sorted (name, value) pairs
    setup: Tuple[str, ...]          # a profile's set-up lines
    ray: Optional[str] = None       # --ray's address ("local": a Ray started for the pool)

    def same_place(self, other: "PoolRequest") -> bool:
        """Everything but the size is the same (an elastic pool resizes for it)."""
        return self._replace(np=0) == other._replace(np=0)


class PoolManager:
    """Keeps at most one pool; starts it on first use, reuses it while the request matches,
    restarts it for another size or hosts, and replaces it when it has died. A request that
    names nothing (``np``, ``hosts``, ``hostfile`` all None) means the last one made: a pool
    that died comes back with the same size and hosts."""

    def __init__(self, config_factory: Callable[..., PoolConfig] = make_config) -> None:
        self.pool: Optional[Pool] = None
        self.config_factory = config_factory
        self.last: Optional[PoolRequest] = None      # the last request a pool started for
        self._running: Optional[PoolRequest] = None  # the request self.pool was started for
        from .slurm_pool import SlurmKeeper
        self._slurm = SlurmKeeper(self.stop)         # the pool's Slurm allocation, if any

    def default_np(self) -> int:
        """The size a request without ``-np`` gets: the running or last pool's, else
        ``HVD_MAGIC_NP``, else 2."""
        if self.pool is not None and self.pool.alive():
            return self.pool.size
        if self.last is not None:
            return self.last.np
        value = config.get("HVD_MAGIC_NP")
        if value < 1:
            raise ValueError(f"HVD_MAGIC_NP={value}: a pool needs at least 1 rank")
        return value

    def ensure(self, np: Optional[int], hosts: Optional[List[Host]], hostfile: Optional[str],
               sink: Optional[OutputSink], oversubscribe: bool = False,
               min_np: Optional[int] = None, slurm: Optional[Dict[str, Any]] = None,
               env: Optional[Dict[str, str]] = None, setup: Sequence[str] = (),
               ray: Optional[str] = None) -> Pool:
        """A running pool for this request (planned and checked before anything starts);
        ``oversubscribe`` allows more ranks than the hosts' slots or this machine's limit;
        ``min_np``: an elastic pool (MPI fault tolerance), which survives lost ranks;
        ``slurm``: ``%%hvd --slurm``'s options (a Slurm allocation, kept across cells);
        ``env``, ``setup``: a cluster profile's variables for the ranks and the shell lines
        run on every host before a new pool starts; ``ray``: ``--ray``'s address, the
        ranks in actors on that Ray cluster (:mod:`.ray_pool`)."""
        if np is None and hosts is None and hostfile is None and slurm is None \
                and self.last is not None:
            last = self.last
            np, hosts, hostfile, min_np, setup, ray = (last.np, last.hosts, last.hostfile,
                                                       last.min_np, last.setup, last.ray)
            slurm = dict(last.slurm) if last.slurm is not None else None
            env = dict(last.env) if last.env is not None else None
        np = self.default_np() if np is None else np
        request = PoolRequest(np, hosts, hostfile, min_np,
                          None if slurm is None else tuple(sorted(slurm.items())),
                          None if not env else tuple(sorted(env.items())), tuple(setup), ray)
        old = self.pool
        if old is not None and old.alive() and request == self._running:
            return old                          # fast path: nothing to look up or plan
        if old is not None and old.alive() and old.elastic() and self._running is not None \
                and request.same_place(self._running):
            note = self.resize(np, sink)        # another -np on an elastic pool: resize it
            if sink is not None:
                sink.status(note)
            return old
        self._slurm.touch(True)                 # no idle timeout while a pool starts
        try:
            return self._ensure(request, np, hosts, hostfile, sink, oversubscribe, min_np,
                                slurm, env, setup, ray)
        finally:
            self._slurm.touch(False)

    def _ensure(self, request: PoolRequest, np: int, hosts: Optional[List[Host]],
                hostfile: Optional[str], sink: Optional[OutputSink], oversubscribe: bool,
                min_np: Optional[int], slurm: Optional[Dict[str, Any]],
                env: Optional[Dict[str, str]], setup: Sequence[str],
                ray: Optional[str] = None) -> Pool:
        old = self.pool
        extra: Dict[str, Any] = {"env": env} if env else {}
        if slurm is not None:
            extra["slurm"] = self._slurm.allocation_for(slurm, np, sink)
        elif self._slurm.allocation is not None:
            self._slurm.release(sink)
        if ray is not None:
            from .ray_pool import ray_config
            if hosts or hostfile or slurm is not None or min_np is not None:
                raise ValueError("--ray places the ranks on the Ray cluster: it goes without "
                                 "-H/--hostfile/--slurm/--min-np")
            config = ray_config(np, ray, env)
        else:
            config = self.config_factory(np, hosts=hosts, hostfile=hostfile,
                                         oversubscribe=oversubscribe, min_np=min_np, **extra)
            plan_pool(config)                   # bad requests fail here, before any process
        if old is not None:
            if old.alive() and old.config.key_fields() == config.key_fields():
                self._running = self.last = request
                return old
            if old.alive():
                sink and sink.status(f"hvd: restarting the pool ({old.size} -> {np} ranks)"
                                     if old.size != np else "hvd: restarting the pool (new hosts)")
            elif old.ended not in (None, "stopped"):
                sink and sink.status(f"hvd: the previous pool ended ({old.ended}); starting a "
                                     "new one")
            old.stop()
            self.pool = self._running = None
        if setup:
            from ...runner.setup_lines import run_setup
            run_setup(setup, config.hosts, config.slurm_job, config.environ,
                      status=sink.status if sink is not None else None)
        if ray is not None:
            from .ray_pool import RayPool
            pool: Pool = RayPool(config).start(sink)
        else:
            pool = Pool(config).start(sink)
        self.pool, self._running, self.last = pool, request, request
        if sink is not None:
            sink.status(f"hvd: {n_ranks(np)} ready in {pool.started_s:.1f} s")
            for note in pool.plan.notes if pool.plan else []:
                if note.startswith(NO_NAMESPACE):
                    sink.status(f"hvd: note: {note}")
        return pool

    def resize(self, np: int, sink: Optional[OutputSink] = None) -> str:
        """``%hvd resize N``: the elastic pool grows or shrinks to ``np`` ranks; a later cell
        that asks for another ``-np`` resizes it again (see :mod:`.resize`)."""
        pool = self.pool
        if pool is None or not pool.alive():
            raise ValueError("no pool is running; start an elastic one with %%hvd -np N "
                             "--min-np M")
        note = pool.resize(np, sink)
        if self._running is not None:
            self._running = self.last = self._running._replace(np=np)
        return note

    def stop(self) -> bool:
        """Stop the pool; True if one was running."""
        pool, self.pool, self._running = self.pool, None, None
        was = pool is not None and pool.alive()
        if pool is not None:
            pool.stop()
        self._slurm.release()                   # after the ranks: scancel would kill them
        return was

    @property
    def slurm(self) -> Any:
        """The Slurm side of the pool (:class:`~.slurm_pool.SlurmKeeper`): its allocation,
        the idle timeout, why the allocation failed."""
        return self._slurm
