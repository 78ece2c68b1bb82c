"""Which pool a request needs: gather this machine's facts into a config, and keep at most
one pool per kernel (start on first use, reuse, restart for another size or hosts)."""
from __future__ import annotations

import os
import secrets
import socket
from typing import Callable, Dict, List, Optional, Tuple

from .. import config
from ..runner.plan import Host
from .output import OutputSink, n_ranks
from .plan import NO_NAMESPACE, PoolConfig, plan_pool
from .pool import Pool


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
                min_np: Optional[int] = None) -> PoolConfig:
    """Gather the facts of this machine (mpiexec, MPI flavour, namespaces, addresses) into a
    :class:`PoolConfig`; raises ValueError/TypeError/RuntimeError for what cannot work."""
    from ..runner import launch
    from ..runner.plan import parse_hostfile
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
    single = not hosts or all(h.name in names for h in hosts)
    oversub = True if oversubscribe or config.get("HVD_MAGIC_OVERSUBSCRIBE", environ) else None
    controller_ip, ports = "127.0.0.1", []
    if not single:
        remote = next(h.name for h in hosts or [] if h.name not in names)
        controller_ip = _local_ip_towards(remote)
        from ipyparallel.util import select_random_ports
        ports = select_random_ports(16)
    netns = single and launch.netns_wanted(environ) and launch.netns_available()
    return PoolConfig(np=np, workdir=workdir, key=secrets.token_hex(16), hosts=hosts,
                      hostfile=hostfile, mpiexec=info.path, mpi_impl=info.impl,
                      mpi_version=info.version, netns=netns, ipc=os.name == "posix",
                      controller_ip=controller_ip, ports=ports, oversubscribe=oversub,
                      local_names=names, env=dict(env or {}), environ=environ, min_np=min_np)


Request = Tuple[int, Optional[List[Host]], Optional[str], Optional[int]]


class PoolManager:
    """Keeps at most one pool; starts it on first use, reuses it while the request matches,
    restarts it for another size or hosts, and replaces it when it has died. A request that
    names nothing (``np``, ``hosts``, ``hostfile`` all None) means the last one made: a pool
    that died comes back with the same size and hosts."""

    def __init__(self, config_factory: Callable[..., PoolConfig] = make_config) -> None:
        self.pool: Optional[Pool] = None
        self.config_factory = config_factory
        self.last: Optional[Request] = None         # the last request a pool started for
        self._running: Optional[Request] = None     # the request self.pool was started for

    def default_np(self) -> int:
        """The size a request without ``-np`` gets: the running or last pool's, else
        ``HVD_MAGIC_NP``, else 2."""
        if self.pool is not None and self.pool.alive():
            return self.pool.size
        if self.last is not None:
            return self.last[0]
        value = config.get("HVD_MAGIC_NP")
        if value < 1:
            raise ValueError(f"HVD_MAGIC_NP={value}: a pool needs at least 1 rank")
        return value

    def ensure(self, np: Optional[int], hosts: Optional[List[Host]], hostfile: Optional[str],
               sink: Optional[OutputSink], oversubscribe: bool = False,
               min_np: Optional[int] = None) -> Pool:
        """A running pool for this request (planned and checked before anything starts);
        ``oversubscribe`` allows more ranks than the hosts' slots or this machine's limit;
        ``min_np``: an elastic pool (MPI fault tolerance), which survives lost ranks."""
        if np is None and hosts is None and hostfile is None and self.last is not None:
            np, hosts, hostfile, min_np = self.last
        np = self.default_np() if np is None else np
        request: Request = (np, hosts, hostfile, min_np)
        old = self.pool
        if old is not None and old.alive() and request == self._running:
            return old                          # fast path: nothing to look up or plan
        config = self.config_factory(np, hosts=hosts, hostfile=hostfile,
                                     oversubscribe=oversubscribe, min_np=min_np)
        plan_pool(config)                       # bad requests fail here, before any process
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
        pool = Pool(config).start(sink)
        self.pool, self._running, self.last = pool, request, request
        if sink is not None:
            sink.status(f"hvd: {n_ranks(np)} ready in {pool.started_s:.1f} s")
            for note in pool.plan.notes if pool.plan else []:
                if note.startswith(NO_NAMESPACE):
                    sink.status(f"hvd: note: {note}")
        return pool

    def stop(self) -> bool:
        """Stop the pool; True if one was running."""
        pool, self.pool, self._running = self.pool, None, None
        if pool is None:
            return False
        was = pool.alive()
        pool.stop()
        return was
