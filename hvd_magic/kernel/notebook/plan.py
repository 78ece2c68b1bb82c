"""Runs in the notebook kernel.

Deciding, not doing: turn a pool request into the controller and ``mpiexec`` command lines.

:func:`plan_pool` is a pure function of a :class:`PoolConfig`: it returns the argv of the
ipyparallel controller, the argv and environment of the ``mpiexec`` that starts the MPI
engines (planned by :func:`hvd_magic.runner.plan.plan_launch`, so hvdrun's rules for root,
oversubscription, shared memory and host lists apply), and the connection information both
sides use. Nothing here starts a process or touches a file, so every choice is unit-tested.

Where things listen:

* one host: the controller binds Unix sockets only (``ipc://`` in a private directory), and
  ``mpiexec`` with the engines runs in a loopback-only network namespace when one can be made
  (``netns=True``); then the pool opens no TCP port reachable from anywhere. Without a
  namespace, ``mpiexec`` (prterun) itself listens on all interfaces; the notes say so.
* several hosts: the engines' side of the controller listens on ``controller_ip`` (the
  address of this machine that the hosts reach) and nowhere else; the client side stays on
  Unix sockets.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

from ...runner.plan import LOCAL_NAMES, NETNS_NOTE, NO_NETNS_NOTE, OPENMPI, Host, LaunchArgs, \
    check_local_size, is_single_host, plan_launch

#: ipyparallel's controller heartbeat period for the pool (ms); its default of 3000 ms is
#: most of the default 6.7 s start (engines are confirmed on the next beat).
HEARTBEAT_MS = 100
#: Beats a rank may miss in a row before the controller drops it (ipyparallel's default: 10).
#: Busy or stopped: each engine answers the ping from a zmq thread that needs neither the
#: GIL nor the interpreter, so a rank that computes (even in C code holding the GIL) still
#: answers, and only a stopped or frozen process, or an unreachable host, misses 30 in a row;
#: the pool then ends the cell naming that rank (:func:`.liveness.unheard_text`).
#: ipyparallel's 10 x 100 ms is too short on a loaded machine: both ranks' answers can
#: arrive over half a second late together while mpiexec and every rank are up. Dead ranks
#: on one host are found from mpiexec's exit instead, and a lost host by prterun's keepalive
#: after about 5 s, so a 3 s limit costs no detection time.
HEARTBEAT_MISSES = 30

#: Cluster id in the connection files' names.
CLUSTER_ID = "hvd"

#: Connection channels of an ipyparallel controller (engine side / client side).
ENGINE_CHANNELS = ("registration", "control", "mux", "task", "iopub", "hb_ping", "hb_pong")
CLIENT_CHANNELS = ("control", "mux", "task", "iopub", "notification", "broadcast")

#: Start of the note shown when mpiexec runs without a private network namespace.
NO_NAMESPACE = "no loopback-only network namespace for this pool"

#: Unix socket paths must stay under this many bytes (sun_path is 108 bytes with the NUL).
MAX_IPC_PATH = 100


@dataclass
class PoolConfig:
    """Everything that decides how a pool starts. Two configs that compare equal (see
    :meth:`key`) can share a pool."""

    np: int
    workdir: str                              # private directory (mode 0700) of this pool
    key: str                                  # HMAC key of ipyparallel's messages
    hosts: Optional[List[Host]] = None
    hostfile: Optional[str] = None
    mpiexec: str = "mpiexec"
    mpi_impl: str = OPENMPI
    mpi_version: str = ""
    python: str = sys.executable
    netns: bool = False                       # loopback-only namespace for mpiexec + engines
    ipc: bool = True                          # Unix sockets for the controller
    controller_ip: str = "127.0.0.1"          # engines' side, when hosts are remote
    ports: Sequence[int] = ()                 # TCP ports for the engines' side (multi-host)
    oversubscribe: Optional[bool] = None      # None: allowed when no hosts were given
    local_names: FrozenSet[str] = LOCAL_NAMES
    env: Dict[str, str] = field(default_factory=dict)   # extra variables for the engines
    environ: Dict[str, str] = field(default_factory=dict)  # the caller's environment
    heartbeat_ms: int = HEARTBEAT_MS
    min_np: Optional[int] = None              # elastic: MPI fault tolerance, go on down to this
    cores: int = os.cpu_count() or 1          # this machine's (the one-machine size limit)
    slurm_job: Optional[int] = None           # a Slurm allocation holds ``hosts`` (its nodes)
    ray: Optional[str] = None                 # --ray: ray.init's address ("local": a new one)

    def key_fields(self) -> Tuple:
        """What makes a running pool unsuitable for another request when it differs."""
        hosts = tuple((h.name, h.slots) for h in self.hosts or ())
        return (self.np, hosts, self.hostfile, tuple(sorted(self.env.items())), self.min_np,
                self.slurm_job, self.ray)


@dataclass
class PoolPlan:
    """What :func:`plan_pool` decided (``engine_env`` is the whole environment of
    ``mpiexec``: the caller's ``environ`` with the pool's variables on top)."""

    controller_argv: List[str]
    engine_argv: List[str]
    engine_env: Dict[str, str]
    engine_info: Dict[str, object]
    client_info: Dict[str, object]
    engine_file: str
    client_file: str
    single_host: bool
    notes: List[str]

    @property
    def signal_via_pid(self) -> bool:
        """Interrupts go to the engines' pids (one host, no nannies), else through nannies."""
        return self.single_host


def check_request(np: object, hosts: Optional[List[Host]], oversubscribe: Optional[bool],
                  local_names: FrozenSet[str] = LOCAL_NAMES, cores: int = 1) -> None:
    """Raise TypeError/ValueError (saying what to do) for a size no pool can have."""
    if isinstance(np, bool) or not isinstance(np, int):
        raise TypeError(f"-np must be a whole number of ranks, e.g. -np 2; got {np!r}")
    if np < 1:
        raise ValueError(f"-np {np}: a pool needs at least 1 rank; e.g. -np 2")
    if hosts:
        slots = sum(h.slots for h in hosts)
        allowed = oversubscribe if oversubscribe is not None else False
        if np > slots and not allowed:
            listed = ",".join(f"{h.name}:{h.slots}" for h in hosts)
            raise ValueError(f"-np {np} but -H {listed} has only {slots} slot(s); add slots "
                             f"(-H host:slots), lower -np, or set HVD_MAGIC_OVERSUBSCRIBE=1 "
                             "(or --oversubscribe) to allow more ranks than slots")
    elif not hosts:
        check_local_size(np, cores, bool(oversubscribe))


def _ipc_interface(workdir: str, name: str) -> str:
    path = os.path.join(workdir, name)
    if len(path) + 8 > MAX_IPC_PATH:
        raise ValueError(f"the pool's directory {workdir!r} is too long for Unix socket paths "
                         f"(at most {MAX_IPC_PATH - 10} characters); set TMPDIR to a short "
                         "directory, e.g. TMPDIR=/tmp")
    return f"ipc://{path}"


def connection_info(config: PoolConfig, single: bool) -> Tuple[Dict[str, object],
                                                               Dict[str, object]]:
    """The engine and client connection dictionaries (ipyparallel's JSON files), chosen
    here so that the controller, the engines and the client can all start at once."""
    base = {"key": config.key, "curve_serverkey": None, "location": config.controller_ip,
            "pack": "json", "unpack": "json", "signature_scheme": "hmac-sha256", "ssh": ""}
    if single and config.ipc:
        engine_if = client_if = _ipc_interface(config.workdir, "s")
        ports = list(range(1, 20))
    else:
        engine_if = f"tcp://{config.controller_ip}"
        client_if = (_ipc_interface(config.workdir, "c") if config.ipc
                     else "tcp://127.0.0.1")
        need = len(ENGINE_CHANNELS) + 2 + (0 if config.ipc else len(CLIENT_CHANNELS))
        if len(config.ports) < need:
            raise ValueError(f"planning a TCP pool needs {need} free ports, got "
                             f"{len(config.ports)}")
        ports = list(config.ports) + list(range(100, 120))
    engine: Dict[str, object] = {"interface": engine_if}
    for i, name in enumerate(ENGINE_CHANNELS):
        engine[name] = ports[i]
    # one port per leaf broadcast scheduler (2 ** IPController.broadcast_scheduler_depth)
    engine["broadcast"] = [ports[len(ENGINE_CHANNELS)], ports[len(ENGINE_CHANNELS) + 1]]
    client: Dict[str, object] = {"interface": client_if, "registration": engine["registration"],
                                 "task_scheme": "leastload"}
    for i, name in enumerate(CLIENT_CHANNELS):
        # ipc: any distinct numbers; TCP without ipc: real free ports after the engines'
        client[name] = ports[10 + i] if config.ipc else ports[len(ENGINE_CHANNELS) + 2 + i]
    engine.update(base)
    client.update(base)
    if not single:
        client["location"] = "127.0.0.1"
    return engine, client


def stacks_dir(workdir: str) -> str:
    """The pool's directory of stack files (:mod:`hvd_magic.stacks`), in its private one."""
    return os.path.join(workdir, "stacks")


def controller_argv(config: PoolConfig, single: bool, engine_info: Dict[str, object],
                    client_info: Dict[str, object]) -> List[str]:
    """The ipyparallel controller's command line: Unix sockets only on one host, else the
    engines' side on TCP at ``config.controller_ip`` (the client's side stays on Unix
    sockets when ``config.ipc``)."""
    controller = [config.python, "-m", "hvd_magic.kernel.controller", f"--profile-dir={config.workdir}",
                  f"--cluster-id={CLUSTER_ID}", "--reuse", "--log-level=WARN",
                  f"--HeartMonitor.period={config.heartbeat_ms}",
                  f"--HeartMonitor.max_heartmonitor_misses={HEARTBEAT_MISSES}",
                  "--IPController.registration_timeout=10",
                  "--IPController.broadcast_scheduler_depth=1"]
    if single and config.ipc:
        ipc = str(engine_info["interface"])[len("ipc://"):]
        controller += ["--IPController.transport=ipc", f"--IPController.ip={ipc}"]
    else:
        controller += ["--IPController.engine_transport=tcp",
                       f"--IPController.engine_ip={config.controller_ip}"]
        if config.ipc:
            controller += ["--IPController.client_transport=ipc",
                           f"--IPController.client_ip={str(client_info['interface'])[6:]}",
                           "--IPController.monitor_transport=ipc",
                           f"--IPController.monitor_ip={os.path.join(config.workdir, 'm')}"]
        else:
            controller += ["--IPController.client_ip=127.0.0.1",
                           "--IPController.monitor_ip=127.0.0.1"]
    return controller


def plan_pool(config: PoolConfig) -> PoolPlan:
    """Plan the controller and the engines of a pool; raises ValueError/TypeError for a
    request no pool can satisfy (before anything starts)."""
    check_request(config.np, config.hosts, config.oversubscribe, config.local_names,
                  config.cores)
    largs = LaunchArgs(np=config.np, command=["python"], hosts=config.hosts,
                       hostfile=config.hostfile)
    # in a Slurm allocation mpiexec (PRRTE) starts its daemons with srun, even on this node
    slurm = config.slurm_job is not None
    single = not slurm and is_single_host(largs, config.local_names)
    engine_info, client_info = connection_info(config, single)
    security = os.path.join(config.workdir, "security")
    engine_file = os.path.join(security, f"ipcontroller-{CLUSTER_ID}-engine.json")
    client_file = os.path.join(security, f"ipcontroller-{CLUSTER_ID}-client.json")
    py = config.python
    controller = controller_argv(config, single, engine_info, client_info)
    extra = dict(config.env)
    extra["IPP_CONNECTION_INFO"] = json.dumps(engine_info, sort_keys=True)
    extra["HVD_MAGIC_POOL"] = "1"
    # where each rank writes its stacks when the notebook asks (%hvd stacks, a stall)
    extra["HVD_MAGIC_STACKS_DIR"] = stacks_dir(config.workdir)
    oversub = config.oversubscribe if config.oversubscribe is not None else not config.hosts
    engine_cmd = [py, "-m", "hvd_magic.kernel.ranks.engine"]
    if single:
        # no nanny process per engine (its start is ~0.3 s of the pool's start): interrupts
        # go straight to the engines' pids, which are local
        engine_cmd.append("--IPEngine.enable_nanny=False")
    largs = LaunchArgs(np=config.np, command=engine_cmd, hosts=config.hosts,
                       hostfile=config.hostfile, extra_env=extra,
                       oversubscribe=bool(oversub), min_np=config.min_np)
    argv, env = plan_launch(largs, config.environ, config.mpi_impl, mpiexec=config.mpiexec,
                            mpi_version=config.mpi_version, netns=config.netns and single,
                            local_names=frozenset() if slurm else config.local_names,
                            python=py)
    if config.mpi_impl == OPENMPI and not oversub and single:
        env.pop("PRTE_MCA_rmaps_default_mapping_policy", None)
    notes: List[str] = []
    if single:
        notes.append(NETNS_NOTE if config.netns else
                     f"{NO_NAMESPACE}: {NO_NETNS_NOTE}")
        notes.append("the controller listens on Unix sockets in the pool's private directory"
                     if config.ipc else "the controller listens on 127.0.0.1 only")
    else:
        notes.append(f"the engines reach the controller at {config.controller_ip}; it "
                     "listens there and on Unix sockets for this kernel only")
    if slurm:
        notes.append(f"the ranks run in Slurm job {config.slurm_job} on "
                     + ", ".join(h.name for h in config.hosts or ()))
    return PoolPlan(controller, argv, env, engine_info, client_info, engine_file, client_file,
                    single, notes)

