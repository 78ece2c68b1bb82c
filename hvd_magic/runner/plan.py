"""Deciding, not doing: turn launch arguments into an ``mpiexec`` command line and environment.

Nothing here runs a process or reads a file; :func:`plan_launch` is a pure function of its
inputs, so every flag's effect is unit-tested without MPI.
"""
from __future__ import annotations

import ipaddress
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple

from .. import config

OPENMPI = "openmpi"
MPICH = "mpich"
MPI_IMPLS = (OPENMPI, MPICH)

#: Host names that always mean "this machine".
LOCAL_NAMES: FrozenSet[str] = frozenset({"localhost", "127.0.0.1", "::1", "localhost.localdomain"})

#: Prefixes of environment variables forwarded to every rank (besides those the flags set).
FORWARD_PREFIXES = config.PREFIXES

#: Variables also forwarded on multi-host runs: the ranks on other hosts start from a remote
#: shell's bare environment and must find the same Python and packages as this machine.
MULTIHOST_FORWARD = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV", "CONDA_PREFIX")
#: ... and the settings of torch.distributed's transports (NCCL_SOCKET_IFNAME, NCCL_DEBUG, ...).
MULTIHOST_FORWARD_PREFIXES = ("NCCL_", "GLOO_")

NETNS_NOTE = ("single-host runs start mpiexec and the ranks in a private network namespace "
              "with only loopback: no socket of the job is reachable from other machines, and "
              "the ranks cannot reach outside networks either (set HVD_MAGIC_NETNS=0 to turn "
              "this off)")
NO_NETNS_NOTE = ("mpiexec (Open MPI's prterun, MPICH's hydra) listens on all interfaces "
                 "(0.0.0.0 and [::]) while the job runs")


_HOST_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+)$")


@dataclass(frozen=True)
class Host:
    """One host and its number of slots."""

    name: str
    slots: int = 1


@dataclass
class LaunchArgs:
    """What the user asked for; the CLI and :func:`hvd_magic.run` both build one."""

    np: int
    command: List[str]
    hosts: Optional[List[Host]] = None      # from -H, or what the hostfile lists
    hostfile: Optional[str] = None          # passed to mpiexec as is (hosts then only inform)
    timeline_filename: Optional[str] = None
    fusion_threshold_mb: Optional[float] = None
    cycle_time_ms: Optional[float] = None
    stall_check_seconds: Optional[float] = None
    cache_capacity: Optional[int] = None
    output_filename: Optional[str] = None
    min_np: Optional[int] = None            # elastic: survive lost ranks down to this many
    max_np: Optional[int] = None            # elastic: grow to at most this many
    host_discovery_script: Optional[str] = None   # elastic: prints the hosts and slots there are
    reset_limit: Optional[int] = None       # elastic: the job ends at the reset after this many
    blacklist_cooldown_range: Optional[Tuple[int, int]] = None  # elastic: a failed host's wait
    network_interface: Optional[str] = None
    verbose: bool = False
    extra_env: Dict[str, str] = field(default_factory=dict)
    oversubscribe: bool = False             # allow more ranks than slots (or cores x 4)
    cores: int = os.cpu_count() or 1        # this machine's, for the one-machine limit


#: Ranks one machine may run per core: ranks beyond the cores take turns on them, and past
#: this many each mostly waits for the others; a larger request is refused as a mistake
#: (``%%hvd -np 100000`` would otherwise spend minutes starting) unless --oversubscribe.
RANKS_PER_CORE = 4


def check_local_size(np: int, cores: int, oversubscribe: bool) -> None:
    """Refuse more ranks on this one machine than :data:`RANKS_PER_CORE` per core."""
    limit = RANKS_PER_CORE * max(1, cores)
    if np > limit and not oversubscribe:
        raise ValueError(f"-np {np} is more than this machine holds: at most {limit} ranks "
                         f"({RANKS_PER_CORE} per core x {cores} cores); lower -np, spread the "
                         "ranks over hosts with -H, or add --oversubscribe to start them anyway")


def parse_hosts(spec: str) -> List[Host]:
    """Parse ``-H host1:slots,host2:slots`` (``:slots`` optional, default 1)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError("-H needs hosts, e.g. -H localhost:2 or -H node1:4,node2:4")
    hosts: List[Host] = []
    for item in spec.split(","):
        item = item.strip()
        if item.startswith("[") and "]" in item:          # [IPv6]:slots
            close = item.index("]") + 1
            name, rest = item[:close], item[close:]
            slots_text = rest[1:] if rest.startswith(":") else ("1" if not rest else "?")
        elif item.count(":") == 1:
            name, slots_text = item.split(":")
        else:
            name, slots_text = item, ("1" if ":" not in item else "?")
        if not name or not _HOST_RE.match(name):
            raise ValueError(f"-H {spec!r}: {item!r} has no valid host name; write "
                             "-H host:slots,host:slots, e.g. -H node1:4,node2:4")
        if not slots_text.isdigit() or int(slots_text) < 1:
            raise ValueError(f"-H {spec!r}: slots in {item!r} must be a positive integer; write "
                             "-H host:slots, e.g. -H node1:4")
        hosts.append(Host(name.strip("[]"), int(slots_text)))
    names = [h.name for h in hosts]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"-H {spec!r}: host(s) {dup} listed twice; give each host once with "
                         "its total slots")
    return hosts


def parse_hostfile(text: str, path: str = "hostfile") -> List[Host]:
    """Parse a hostfile: ``host slots=N`` (Open MPI) or ``host:N`` (MPICH/Horovod) per line."""
    hosts: List[Host] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        words = line.split()
        try:
            if len(words) == 1:
                found = parse_hosts(words[0])
            else:
                slots = [w for w in words[1:] if w.startswith(("slots=", "max_slots="))]
                if not slots or not words[1].startswith("slots="):
                    raise ValueError("expected 'host slots=N'")
                count = words[1].split("=", 1)[1]
                found = parse_hosts(f"{words[0]}:{count}")
        except ValueError:
            raise ValueError(f"{path}:{lineno}: cannot read {raw.strip()!r}; write one host per "
                             "line as 'host slots=N' or 'host:N'") from None
        hosts.extend(found)
    if not hosts:
        raise ValueError(f"{path}: no hosts in it; write one host per line as 'host slots=N'")
    return hosts


def is_single_host(args: LaunchArgs, local_names: FrozenSet[str] = LOCAL_NAMES) -> bool:
    """True when every rank runs on this machine (no hosts given, or only local names)."""
    if not args.hosts:
        return True
    return all(h.name in local_names for h in args.hosts)


def horovod_env(args: LaunchArgs) -> Dict[str, str]:
    """The HOROVOD_* variables the flags set."""
    env: Dict[str, str] = {}
    if args.timeline_filename:
        env["HOROVOD_TIMELINE"] = args.timeline_filename
    if args.fusion_threshold_mb is not None:
        env["HOROVOD_FUSION_THRESHOLD"] = str(int(round(args.fusion_threshold_mb * 1024 * 1024)))
    if args.cycle_time_ms is not None:
        env["HOROVOD_CYCLE_TIME"] = f"{args.cycle_time_ms:g}"
    if args.stall_check_seconds is not None:
        env["HOROVOD_STALL_CHECK_TIME_SECONDS"] = f"{args.stall_check_seconds:g}"
    if args.cache_capacity is not None:
        env["HOROVOD_CACHE_CAPACITY"] = str(args.cache_capacity)
    if args.min_np is not None:
        env["HVD_MAGIC_ELASTIC_MIN_NP"] = str(args.min_np)
        env["HVD_MAGIC_EXIT_REPORT"] = "1"
    if args.max_np is not None:
        env["HVD_MAGIC_ELASTIC_MAX_NP"] = str(args.max_np)
    if args.reset_limit is not None:
        env["HVD_MAGIC_ELASTIC_RESET_LIMIT"] = str(args.reset_limit)
    if args.blacklist_cooldown_range is not None:
        low, high = args.blacklist_cooldown_range
        env["HVD_MAGIC_BLACKLIST_COOLDOWN_RANGE"] = f"{low} {high}"
    if args.host_discovery_script:
        env["HVD_MAGIC_HOST_DISCOVERY_SCRIPT"] = os.path.abspath(args.host_discovery_script)
    names = interface_names(args.network_interface or "")
    if names:
        env["NCCL_SOCKET_IFNAME"] = ",".join(names)
        env["GLOO_SOCKET_IFNAME"] = ",".join(names)
    return env


#: hvdrun's autotune options (horovodrun's names) and the variables they set
AUTOTUNE_OPTIONS = {"autotune": "HOROVOD_AUTOTUNE", "autotune_log_file": "HOROVOD_AUTOTUNE_LOG",
                    "autotune_warmup_samples": "HOROVOD_AUTOTUNE_WARMUP_SAMPLES",
                    "autotune_steps_per_sample": "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE",
                    "autotune_bayes_opt_max_samples": "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES",
                    "autotune_gaussian_process_noise": "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE"}


def autotune_env(options: Dict[str, object]) -> Dict[str, str]:
    """The HOROVOD_AUTOTUNE* variables of the autotune options given (None / False: not given)."""
    env = {}
    for opt, var in AUTOTUNE_OPTIONS.items():
        value = options.get(opt)
        if value is True:
            env[var] = "1"
        elif value not in (None, False):
            env[var] = f"{value:g}" if isinstance(value, float) else str(value)
    return env


def interface_names(spec: str) -> List[str]:
    """The interface names in a ``--network-interface`` value: it may also name subnets
    (``10.0.0.0/24``) or addresses, which Open MPI takes but NCCL and Gloo do not."""
    names = []
    for item in spec.split(","):
        item = item.strip()
        if not item or "/" in item:
            continue
        try:
            ipaddress.ip_address(item)
        except ValueError:
            names.append(item)
    return names


def validate(args: LaunchArgs) -> None:
    """Raise ValueError/TypeError (with what to do) for arguments no launch can satisfy."""
    if isinstance(args.np, bool) or not isinstance(args.np, int):
        raise TypeError(f"np must be an int, not {type(args.np).__name__}")
    if args.np < 1:
        raise ValueError(f"-np {args.np}: the number of ranks must be at least 1")
    if not args.command:
        raise ValueError("no command to run; e.g. hvdrun -np 2 python train.py")
    for name in ("fusion_threshold_mb", "cycle_time_ms", "stall_check_seconds"):
        value = getattr(args, name)
        if value is not None and (not isinstance(value, (int, float)) or value < 0):
            raise ValueError(f"--{name.replace('_', '-')} {value!r}: must be a number >= 0")
    if args.min_np is not None and not 1 <= args.min_np <= args.np:
        raise ValueError(f"--min-np {args.min_np}: must be between 1 and -np ({args.np})")
    if args.max_np is not None and args.max_np < args.np:
        raise ValueError(f"--max-np {args.max_np}: must be at least -np ({args.np})")
    if (args.max_np is not None or args.host_discovery_script or args.reset_limit is not None
            or args.blacklist_cooldown_range is not None) and args.min_np is None:
        raise ValueError("--max-np, --host-discovery-script, --reset-limit and "
                         "--blacklist-cooldown-range are for elastic training: give --min-np too "
                         "(e.g. hvdrun -np 2 --min-np 1 --max-np 4 ...)")
    if args.reset_limit is not None and args.reset_limit < 0:
        raise ValueError(f"--reset-limit {args.reset_limit}: must be a whole number >= 0")
    if args.blacklist_cooldown_range is not None:
        from ..collectives.elastic import check_cooldown_range
        check_cooldown_range(args.blacklist_cooldown_range)
    script = args.host_discovery_script
    if script and not (os.path.isfile(script) and os.access(script, os.X_OK)):
        raise ValueError(f"--host-discovery-script {script}: not an executable file (chmod +x "
                         "it; it prints one 'host:slots' line per host)")
    cap = args.cache_capacity
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
        raise ValueError(f"--cache-capacity {cap!r}: must be a whole number >= 0 (0 turns the "
                         "cache off)")
    if args.hosts and not is_single_host(args):
        total = sum(h.slots for h in args.hosts)
        if args.np > total and not args.oversubscribe:
            raise ValueError(f"-np {args.np} but the hosts have only {total} slots; add slots "
                             f"(-H host:slots), lower -np, or add --oversubscribe")
    elif not args.hosts and not args.hostfile:
        check_local_size(args.np, args.cores, args.oversubscribe)


#: What each rank runs before the command (``sh -c PRELUDE hvdrun-rank COMMAND...``): the
#: variables Horovod's launcher sets for each worker, then ``exec`` of the command itself.
#: The rank, size and ranks on this host come from mpiexec (Open MPI's OMPI_COMM_WORLD_*,
#: else MPICH's PMI_RANK, PMI_SIZE, MPI_LOCALNRANKS); HOROVOD_HOSTNAME is the rank's host
#: name. The local and cross ranks are Horovod's for hosts filled in order with the same
#: number of ranks each (hvdrun's layout): Open MPI's own local rank follows its mapping,
#: not the rank order Horovod and hvd.local_rank() use. hvd.local_rank(), hvd.cross_rank()
#: and hvd.cross_size() are exact for any layout.
RANK_ENV_PRELUDE = (
    'export HOROVOD_RANK="${OMPI_COMM_WORLD_RANK:-$PMI_RANK}" '
    'HOROVOD_SIZE="${OMPI_COMM_WORLD_SIZE:-$PMI_SIZE}" '
    'HOROVOD_LOCAL_SIZE="${OMPI_COMM_WORLD_LOCAL_SIZE:-${MPI_LOCALNRANKS:-1}}" '
    'HOROVOD_HOSTNAME="$(uname -n)"; '
    'export HOROVOD_LOCAL_RANK=$((HOROVOD_RANK % HOROVOD_LOCAL_SIZE)) '
    'HOROVOD_CROSS_RANK=$((HOROVOD_RANK / HOROVOD_LOCAL_SIZE)) '
    'HOROVOD_CROSS_SIZE=$(((HOROVOD_SIZE + HOROVOD_LOCAL_SIZE - 1) / HOROVOD_LOCAL_SIZE)); '
    'exec "$@"')


def rank_command(command: Sequence[str]) -> List[str]:
    """``command`` as each rank starts it, with Horovod's per-worker variables set."""
    return ["sh", "-c", RANK_ENV_PRELUDE, "hvdrun-rank"] + list(command)


def plan_launch(args: LaunchArgs, env: Mapping[str, str], mpi_impl: str, *,
                mpiexec: str = "mpiexec", mpi_version: str = "", netns: bool = False,
                local_names: FrozenSet[str] = LOCAL_NAMES,
                python: str = sys.executable) -> Tuple[List[str], Dict[str, str]]:
    """Return ``(argv, env)`` that run ``args.command`` on ``args.np`` ranks.

    ``env`` is the caller's environment (not modified); ``mpi_impl`` is ``"openmpi"`` or
    ``"mpich"`` (``mpi_version`` its version, e.g. ``"5.0.11"``); ``netns`` wraps a single-host run in a
    loopback-only network namespace (through ``python -m hvd_magic.runner.netns``).
    """
    if mpi_impl not in MPI_IMPLS:
        raise ValueError(f"unknown MPI implementation {mpi_impl!r}; use one of {MPI_IMPLS}")
    validate(args)
    single = is_single_host(args, local_names)
    out = dict(env)
    out.update(args.extra_env)
    hvd = horovod_env(args)
    out.update(hvd)
    out.setdefault("PYTHONUNBUFFERED", "1")
    bindir = os.path.dirname(python)
    path = out.get("PATH", "")
    if bindir and bindir not in path.split(os.pathsep):
        # `hvdrun ... python x.py` from an unactivated venv runs that venv's python
        out["PATH"] = bindir + (os.pathsep + path if path else "")
    forward = sorted(set(hvd) | set(args.extra_env)
                     | {k for k in out if k.startswith(FORWARD_PREFIXES)} | {"PYTHONUNBUFFERED"}
                     | (set() if single else {k for k in out if out[k] and (
                         k in MULTIHOST_FORWARD or k.startswith(MULTIHOST_FORWARD_PREFIXES))}))
    argv: List[str] = [mpiexec, "-n", str(args.np)]
    if mpi_impl == OPENMPI:
        out["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
        out["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
        if single:
            out.setdefault("PRTE_MCA_rmaps_default_mapping_policy", ":oversubscribe")
            out.setdefault("OMPI_MCA_btl", "self,sm")
            if args.min_np is not None and not out["OMPI_MCA_btl"].startswith("^") \
                    and "tcp" not in out["OMPI_MCA_btl"].split(","):
                # ranks that elastic training spawns later (a host discovery script, or
                # %hvd resize in a pool) reach the others over TCP on
                # loopback: shared memory connects only ranks started together (measured:
                # "unreachable proc"), and a private namespace has no other interface
                out["OMPI_MCA_btl"] += ",tcp"
                out.setdefault("OMPI_MCA_btl_tcp_if_include", "lo")
        elif args.oversubscribe:
            # "slot:": fill each host's slots in order, then go round again; a bare
            # ":oversubscribe" puts every rank on the first host, even -np 2 on -H a:1,b:1
            out["PRTE_MCA_rmaps_default_mapping_policy"] = "slot:oversubscribe"
        if args.min_np is not None:      # elastic: MPI's fault tolerance (ULFM) on
            argv += ["--with-ft", "ulfm"]
        if args.hostfile:
            argv += ["--hostfile", args.hostfile]
        elif args.hosts:
            argv += ["-H", ",".join(f"{h.name}:{h.slots}" for h in args.hosts)]
        if args.output_filename:
            if mpi_version[:2] in ("2.", "3.", "4."):
                argv += ["--output-filename", args.output_filename]
            else:  # Open MPI 5 turned --output-filename into a file prefix; dir= keeps a tree
                argv += ["--output", f"dir={args.output_filename}"]
        if args.network_interface and not single:
            argv += ["--mca", "btl_tcp_if_include", args.network_interface,
                     "--prtemca", "prte_if_include", args.network_interface]
        for name in forward:
            argv += ["-x", name]
    else:
        if args.min_np is not None:
            raise ValueError("--min-np (elastic training) needs Open MPI 5's fault tolerance "
                             "(ULFM); this mpiexec is MPICH")
        if args.hostfile:
            argv += ["-f", args.hostfile]
        elif args.hosts:
            argv += ["-hosts", ",".join(f"{h.name}:{h.slots}" for h in args.hosts)]
        if args.output_filename:
            base = args.output_filename.rstrip("/")
            argv += ["-outfile-pattern", f"{base}/rank.%r.stdout",
                     "-errfile-pattern", f"{base}/rank.%r.stderr"]
        if args.network_interface and not single:
            if interface_names(args.network_interface) != [args.network_interface.strip()]:
                raise ValueError(f"--network-interface {args.network_interface!r}: MPICH takes "
                                 "one interface name, e.g. eth0 (subnets such as "
                                 "10.0.0.0/24 work with Open MPI only)")
            argv += ["-iface", args.network_interface.strip()]
        for name in forward:
            argv += ["-genv", name, out[name]]
    argv += rank_command(args.command)
    if netns and single:
        argv = [python, "-m", "hvd_magic.runner.netns", "--"] + argv
    return argv, out


def describe(argv: Sequence[str], env: Mapping[str, str], base_env: Mapping[str, str]) -> str:
    """A copy-pasteable shell line for ``--verbose``: the variables set or changed, then argv."""
    import shlex
    changed = [f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()) if base_env.get(k) != v]
    return " ".join(changed + [shlex.quote(a) for a in argv])


def elastic_exit(launcher_rc: int, reports: Sequence[str]) -> Tuple[int, Optional[str]]:
    """An elastic job's exit code, and a note for the user or None.

    ``reports`` are the ranks' ``config.EXIT_MARK`` lines (``rank=R size=S ok=1``). Open
    MPI's launcher can die of a signal in its own teardown after a spawn onto an added host,
    when every rank has finished; then the ranks decide: 0 when ranks 0..S-1 of the job's
    final size S (rank 0's) all ended without an uncaught exception. Otherwise the
    launcher's code stands."""
    if launcher_rc <= 128 or not reports:
        return launcher_rc, None
    seen: Dict[int, Tuple[int, bool]] = {}
    for line in reports:
        text = line.split(config.EXIT_MARK, 1)[-1]
        fields = dict(f.split("=", 1) for f in text.split() if "=" in f)
        try:
            seen[int(fields["rank"])] = (int(fields["size"]), fields["ok"] == "1")
        except (KeyError, ValueError):
            continue
    size = seen.get(0, (0, False))[0]
    if size < 1 or any(seen.get(r) != (size, True) for r in range(size)):
        return launcher_rc, None
    return 0, (f"hvdrun: mpiexec was ended by signal {launcher_rc - 128} after all {size} "
               "rank(s) had finished; the job succeeded (Open MPI's launcher can crash while "
               "tearing down a job that grew onto added hosts)")
