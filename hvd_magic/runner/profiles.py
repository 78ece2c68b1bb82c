"""Cluster profiles: a small TOML file that names a cluster, so that ``--profile NAME`` stands
for the hosts or scheduler, the ranks per host, the network and the set-up every host needs.

Deciding, not doing: :func:`parse_profile` checks a profile's text (errors name the key and
its line), :func:`launch_of` turns a profile into launch arguments, :func:`setup_steps` into
the set-up commands; reading the directory is :func:`find_profiles` / :func:`load_profile`.
Profiles live in ``~/.hvd_magic/profiles/NAME.toml`` or in ``HVD_MAGIC_PROFILE_DIR``.

Example (every key optional except ``scheduler``)::

    description = "the lab's GPU partition"
    scheduler = "slurm"            # "slurm", or "hosts" with a host list
    processes_per_host = 4         # ranks per node (np = processes_per_host x nodes)
    network_interface = "ib0"      # Open MPI's TCP and daemons, NCCL/Gloo: only this one
    modules = ["cuda/12.4", "openmpi/5.0"]    # `module load` before every set-up line
    setup = ["pip install -q -r requirements.txt", "python prepare_data.py"]

    [slurm]
    partition = "gpu"
    time = "2:00:00"
    nodes = 2
    gpus_per_node = 4

    [env]
    NCCL_DEBUG = "WARN"

With ``scheduler = "hosts"``: ``hosts = ["node1", "node2"]`` and ``slots_per_host = 4``
(or ``"node1:4"`` entries). With ``scheduler = "ray"`` (notebook pools only, ``%%hvd
--ray``): ``ray_address = "10.0.0.1:6379"`` as ``ray.init`` takes it (none: a Ray started on
this machine for the pool) and ``np``. The ``setup`` lines run in order on every host before the pool
or job starts, each line on all hosts at once, and the next line only after every host
finished the previous one (a barrier between lines, as RiseML's run lines); a line that
fails on any host stops the start with its output.
"""
from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from .options import RAY_LOCAL
from .plan import Host, interface_names, parse_hosts
from .slurm import SlurmRequest, check_request

SCHEDULERS = ("slurm", "hosts", "ray")
TOP_KEYS = {"description": str, "scheduler": str, "hosts": list, "slots_per_host": int,
            "processes_per_host": int, "np": int, "network_interface": str, "modules": list,
            "setup": list, "env": dict, "slurm": dict, "ray_address": str}
SLURM_KEYS = {"partition": str, "time": str, "nodes": int, "gpus_per_node": int}
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")
_KIND = {str: "a string", int: "a whole number", list: "a list", dict: "a table ([...])"}


class ProfileError(ValueError):
    """A profile that cannot be used; the message names the file, the key and its line."""


@dataclass
class Profile:
    """A checked profile."""

    name: str
    path: str
    scheduler: str
    description: str = ""
    hosts: List[Host] = field(default_factory=list)
    processes_per_host: Optional[int] = None
    np: Optional[int] = None
    network_interface: Optional[str] = None
    modules: List[str] = field(default_factory=list)
    setup: List[str] = field(default_factory=list)
    env: Dict[str, str] = field(default_factory=dict)
    slurm: Dict[str, Any] = field(default_factory=dict)
    ray_address: Optional[str] = None         # scheduler "ray": ray.init's address


@dataclass
class ProfileLaunch:
    """What a profile means for one launch (hvdrun, or a pool)."""

    np: int
    hosts: Optional[List[Host]]
    slurm: Optional[Dict[str, Any]]            # --slurm's options, or None for a host list
    network_interface: Optional[str]
    env: Dict[str, str]
    setup: List[str]                           # shell lines, modules loaded first
    ray: Optional[str] = None                  # --ray's address ("local": a Ray of its own)


def profile_dir(environ: Mapping[str, str]) -> str:
    """Where profiles live: ``HVD_MAGIC_PROFILE_DIR``, else ``~/.hvd_magic/profiles``."""
    from .. import config
    d = config.get("HVD_MAGIC_PROFILE_DIR", environ)
    home = environ.get("HOME") or os.path.expanduser("~")
    return d or os.path.join(home, ".hvd_magic", "profiles")


def _line_of(text: str, table: Optional[str], key: str) -> int:
    """The line where ``key`` is set (in ``[table]`` when given); 0 if not found."""
    current: Optional[str] = None
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        head = re.match(r"^\[\s*([^\]]+?)\s*\]", line)
        if head:
            current = head.group(1)
            if table and current == table and key == "":
                return n
            continue
        m = re.match(r'^("?)([A-Za-z0-9_\-]+)\1\s*=', line)
        if m and m.group(2) == key and current == table:
            return n
        if table and current is None and re.match(rf"^{re.escape(table)}\s*=", line) and \
                key == "":
            return n
    return 0


def parse_profile(text: str, name: str = "profile", path: str = "profile.toml") -> Profile:
    """Check a profile's TOML text; raise :class:`ProfileError` naming the key and line."""
    import tomllib
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{path}: not valid TOML: {exc}") from None

    def fail(key: str, what: str, table: Optional[str] = None) -> ProfileError:
        line = _line_of(text, table, key)
        where = f"{path}:{line}" if line else path
        shown = f"{table}.{key}" if table else key
        return ProfileError(f"{where}: {shown}: {what}")

    for key, value in data.items():
        if key not in TOP_KEYS:
            raise fail(key, f"unknown key; a profile takes {', '.join(sorted(TOP_KEYS))}")
        if not isinstance(value, TOP_KEYS[key]) or isinstance(value, bool):
            raise fail(key, f"must be {_KIND[TOP_KEYS[key]]}, not {value!r}")
    scheduler = data.get("scheduler")
    if scheduler not in SCHEDULERS:
        raise fail("scheduler", f"{scheduler!r}: use \"slurm\" or \"hosts\" (or \"ray\" for "
                   "notebook pools)" if scheduler else "missing; add scheduler = \"slurm\" or "
                   "scheduler = \"hosts\" (or \"ray\")")
    prof = Profile(name=name, path=path, scheduler=scheduler,
                   description=data.get("description", ""))
    for key in ("slots_per_host", "processes_per_host", "np"):
        if key in data and data[key] < 1:
            raise fail(key, f"{data[key]}: must be at least 1")
    prof.processes_per_host = data.get("processes_per_host")
    prof.np = data.get("np")
    for key in ("modules", "setup"):
        for item in data.get(key, []):
            if not isinstance(item, str) or not item.strip():
                raise fail(key, f"entries must be non-empty strings, got {item!r}")
    prof.modules = list(data.get("modules", []))
    prof.setup = list(data.get("setup", []))
    bad = [m for m in prof.modules if not re.match(r"^[A-Za-z0-9_.+\-/@]+$", m)]
    if bad:
        raise fail("modules", f"{bad[0]!r} is not a module name (e.g. \"cuda/12.4\")")
    iface = data.get("network_interface")
    if iface is not None and not [p for p in iface.split(",") if p.strip()]:
        raise fail("network_interface", "empty; e.g. \"eth0\" or \"10.0.0.0/24\"")
    prof.network_interface = iface
    for k, v in data.get("env", {}).items():
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", k):
            raise fail(k, "not an environment variable name", "env")
        if isinstance(v, bool) or not isinstance(v, (str, int, float)):
            raise fail(k, f"must be a string or number, not {type(v).__name__}", "env")
        prof.env[k] = str(v)
    if "ray_address" in data and scheduler != "ray":
        raise fail("ray_address", "goes with scheduler = \"ray\"")
    if scheduler == "ray":
        for key in ("hosts", "slurm", "slots_per_host"):
            if key in data:
                raise fail(key, "Ray places the ranks (scheduler = \"ray\"); give np")
        prof.ray_address = data.get("ray_address")
    elif scheduler == "hosts":
        if "slurm" in data:
            raise fail("slurm", "a [slurm] table goes with scheduler = \"slurm\"", None)
        if not data.get("hosts"):
            raise fail("hosts" if "hosts" in data else "scheduler",
                       "scheduler = \"hosts\" needs hosts = [\"node1\", \"node2\"]")
        slots = data.get("slots_per_host", 1)
        for item in data["hosts"]:
            if not isinstance(item, str):
                raise fail("hosts", f"entries are \"host\" or \"host:slots\", not {item!r}")
            try:
                found = parse_hosts(item if ":" in item else f"{item}:{slots}")
            except ValueError as exc:
                raise fail("hosts", str(exc)) from None
            prof.hosts += found
        names = [h.name for h in prof.hosts]
        if len(set(names)) != len(names):
            raise fail("hosts", "a host is listed twice")
    else:
        if "hosts" in data:
            raise fail("hosts", "a host list goes with scheduler = \"hosts\"; Slurm chooses "
                                "the nodes (set [slurm] nodes = N)")
        for key, value in data.get("slurm", {}).items():
            if key not in SLURM_KEYS:
                raise fail(key, f"unknown key; [slurm] takes {', '.join(SLURM_KEYS)}", "slurm")
            kind = SLURM_KEYS[key]
            if not isinstance(value, kind) or isinstance(value, bool):
                raise fail(key, f"must be {_KIND[kind]}, not {value!r}", "slurm")
            try:
                check_request(SlurmRequest(**{key: value}))
            except ValueError as exc:
                raise fail(key, str(exc), "slurm") from None
            prof.slurm[key] = value
        if "slots_per_host" in data:
            raise fail("slots_per_host", "Slurm gives each node's slots; use "
                                         "processes_per_host for ranks per node")
    return prof


def launch_of(prof: Profile, np: Optional[int] = None) -> ProfileLaunch:
    """The launch a profile stands for; ``np`` (from -np) wins over the profile's.

    Ranks: ``np``, else the profile's ``np``, else ``processes_per_host`` x hosts (or x
    ``[slurm] nodes``), else one per slot of the host list."""
    per = prof.processes_per_host
    slurm: Optional[Dict[str, Any]] = None
    hosts: Optional[List[Host]] = None
    if prof.scheduler == "ray":
        count = np or prof.np or per
        if count is None:
            raise ProfileError(f"{prof.path}: says not how many ranks (np); add np, or give -np")
    elif prof.scheduler == "slurm":
        slurm = {k: prof.slurm.get(k) for k in SLURM_KEYS}
        nodes = prof.slurm.get("nodes")
        count = np or prof.np or (per * nodes if per and nodes else None) or per or nodes
        if count is None:
            raise ProfileError(f"{prof.path}: says neither how many ranks (np) nor "
                               "processes_per_host; add one, or give -np")
    else:
        hosts = [Host(h.name, per or h.slots) for h in prof.hosts]
        count = np or prof.np or sum(h.slots for h in hosts)
    env = dict(prof.env)
    names = interface_names(prof.network_interface or "")
    if prof.network_interface:
        env.setdefault("OMPI_MCA_btl_tcp_if_include", prof.network_interface)
        env.setdefault("PRTE_MCA_prte_if_include", prof.network_interface)
    if names:
        env.setdefault("NCCL_SOCKET_IFNAME", ",".join(names))
        env.setdefault("GLOO_SOCKET_IFNAME", ",".join(names))
    return ProfileLaunch(np=count, hosts=hosts, slurm=slurm,
                         network_interface=prof.network_interface, env=env,
                         setup=setup_steps(prof),
                         ray=(prof.ray_address or RAY_LOCAL) if prof.scheduler == "ray" else None)


def setup_steps(prof: Profile) -> List[str]:
    """The shell lines to run on every host, in order (modules loaded in each: every line
    is its own shell)."""
    if not prof.setup:
        return []
    prefix = f"module load {' '.join(shlex.quote(m) for m in prof.modules)} && " \
        if prof.modules else ""
    return [prefix + line for line in prof.setup]


def find_profiles(directory: str) -> List[Tuple[str, str]]:
    """``(name, path)`` of every ``NAME.toml`` in ``directory``, sorted (none: ``[]``)."""
    try:
        entries = sorted(os.listdir(directory))
    except OSError:
        return []
    return [(e[:-5], os.path.join(directory, e)) for e in entries
            if e.endswith(".toml") and _NAME_RE.match(e[:-5])]


def load_profile(name: str, environ: Mapping[str, str]) -> Profile:
    """Read and check profile ``name`` from :func:`profile_dir`."""
    if not name or not _NAME_RE.match(name):
        raise ProfileError(f"--profile {name!r}: a profile name is letters, digits, '_', "
                           "'.', '-' (the file NAME.toml)")
    directory = profile_dir(environ)
    path = os.path.join(directory, f"{name}.toml")
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError:
        have = ", ".join(n for n, _ in find_profiles(directory)) or "none"
        raise ProfileError(f"--profile {name}: no {path} (profiles there: {have}); write one "
                           "(see docs/clusters.md) or set HVD_MAGIC_PROFILE_DIR") from None
    return parse_profile(text, name, path)


def describe(profiles: Sequence[Tuple[str, str]], directory: str) -> str:
    """``%hvd profiles`` / ``hvdrun --profiles``: one line per profile, a bad one says why."""
    if not profiles:
        return (f"no cluster profiles in {directory}; write NAME.toml there (see "
                "docs/clusters.md) or set HVD_MAGIC_PROFILE_DIR")
    lines = [f"cluster profiles in {directory}:"]
    for name, path in profiles:
        try:
            with open(path, encoding="utf-8") as fh:
                prof = parse_profile(fh.read(), name, path)
        except (OSError, ProfileError) as exc:
            lines.append(f"  {name:<16} (unusable: {exc})")
            continue
        if prof.scheduler == "ray":
            where = f"ray {prof.ray_address or '(a local Ray)'}"
        elif prof.scheduler == "slurm":
            where = "slurm " + " ".join(f"{k}={v}" for k, v in prof.slurm.items())
        else:
            where = "hosts " + ",".join(f"{h.name}:{h.slots}" for h in prof.hosts)
        extra = f"; {len(prof.setup)} setup line(s)" if prof.setup else ""
        desc = f" - {prof.description}" if prof.description else ""
        lines.append(f"  {name:<16} {where.strip()}{extra}{desc}")
    return "\n".join(lines)
