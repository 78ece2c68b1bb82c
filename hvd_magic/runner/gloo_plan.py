"""Deciding, not doing: where ``hvdrun --gloo -H ...`` starts each rank, and with what.

:func:`plan_hosts` is a pure function of the launch arguments and the environment: it
places the ranks host by host, gives each torchrun's and Horovod's variables, and builds
the command that starts it: on this machine directly, elsewhere through the ssh agent as
one shell line (a remote shell starts with a bare environment, so the variables travel on
that line). Every rank runs under :mod:`.gloo_nanny`, which reports the rank's exit status
as its last line and stops the rank when hvdrun's end of the connection closes.
:mod:`.gloo_run` does the starting and watching.
"""
from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass
from typing import Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple

from .plan import FORWARD_PREFIXES, LOCAL_NAMES, MULTIHOST_FORWARD, \
    MULTIHOST_FORWARD_PREFIXES, Host, LaunchArgs, horovod_env

#: The ssh command when no agent is set: never prompt (a job must not hang on a password).
DEFAULT_AGENT = ("ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=30")

#: Variables that name the ssh agent, as the MPI path's launchers read them (PRRTE's, Open
#: MPI 4's): ``hvdrun --gloo`` reaches the hosts the same way ``hvdrun`` does.
AGENT_VARS = ("PRTE_MCA_plm_ssh_agent", "OMPI_MCA_plm_rsh_agent")

#: Variables of MPI launchers, never passed on: the ranks must find no MPI world.
MPI_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "PRTE_")


@dataclass(frozen=True)
class Placement:
    """One rank's place: its host and Horovod's local and cross ranks there."""

    rank: int
    host: str
    host_index: int          # torchrun's GROUP_RANK: the host's place among the used hosts
    local_rank: int
    local_size: int
    cross_rank: int          # Horovod's: among the ranks with the same local rank
    cross_size: int


@dataclass(frozen=True)
class RankStart:
    """How one rank is started: ``argv`` with ``env`` on this machine (``remote``: ``argv``
    is the agent's command line, and ``env`` the agent's environment)."""

    place: Placement
    remote: bool
    argv: List[str]
    env: Dict[str, str]


def place(hosts: Sequence[Host], np: int) -> List[Placement]:
    """Ranks 0..np-1 host by host: each host's slots in order; past the slots (only with
    --oversubscribe, which :func:`.plan.validate` checks) one more per host in turn. Hosts
    left without a rank are not used."""
    counts = [min(h.slots, max(0, np - sum(x.slots for x in hosts[:i])))
              for i, h in enumerate(hosts)]
    extra, i = np - sum(counts), 0
    while extra > 0:
        counts[i % len(hosts)] += 1
        extra, i = extra - 1, i + 1
    used = [(h.name, c) for h, c in zip(hosts, counts) if c > 0]
    out: List[Placement] = []
    for index, (name, count) in enumerate(used):
        for local in range(count):
            same = [j for j, (_, c) in enumerate(used) if c > local]   # hosts with this local rank
            out.append(Placement(len(out), name, index, local, count, same.index(index),
                                 len(same)))
    return out


def agent_command(env: Mapping[str, str]) -> List[str]:
    """The ssh agent: the first of :data:`AGENT_VARS` set (PRRTE's ``ssh : rsh`` list: its
    first), else :data:`DEFAULT_AGENT`."""
    for var in AGENT_VARS:
        value = env.get(var, "").split(" : ")[0].strip()
        if value:
            return shlex.split(value)
    return list(DEFAULT_AGENT)


def rank_vars(p: Placement, size: int, hosts: int, addr: str, port: int,
              store_here: bool) -> Dict[str, str]:
    """torchrun's and Horovod's variables for rank ``p`` (the gloo controller reads them)."""
    out = {"RANK": str(p.rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(p.local_rank),
           "LOCAL_WORLD_SIZE": str(p.local_size), "GROUP_RANK": str(p.host_index),
           "GROUP_WORLD_SIZE": str(hosts), "MASTER_ADDR": addr, "MASTER_PORT": str(port),
           "HOROVOD_RANK": str(p.rank), "HOROVOD_SIZE": str(size),
           "HOROVOD_LOCAL_RANK": str(p.local_rank), "HOROVOD_LOCAL_SIZE": str(p.local_size),
           "HOROVOD_CROSS_RANK": str(p.cross_rank), "HOROVOD_CROSS_SIZE": str(p.cross_size),
           "HOROVOD_CONTROLLER": "gloo", "HOROVOD_HOSTNAME": p.host,
           "PYTHONUNBUFFERED": "1"}
    if store_here:
        # the store is hvdrun's (it outlives every rank); otherwise rank 0 keeps it
        out["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    return out


def forwarded(env: Mapping[str, str]) -> Dict[str, str]:
    """What a rank on another host gets from this environment (it must find the same Python
    and packages there): PATH, PYTHONPATH, ..., and the HOROVOD_*, HVD_MAGIC_*, NCCL_* and
    GLOO_* variables."""
    return {k: v for k, v in env.items()
            if v and (k in MULTIHOST_FORWARD
                      or k.startswith(FORWARD_PREFIXES + MULTIHOST_FORWARD_PREFIXES))}


def plan_hosts(args: LaunchArgs, env: Mapping[str, str], *, cwd: str, port: int,
               store_here: bool, local_names: FrozenSet[str] = LOCAL_NAMES,
               python: str = sys.executable) -> List[RankStart]:
    """How to start every rank of ``args`` on ``args.hosts``.

    ``env``: hvdrun's environment; ``cwd``: the directory the ranks start in (the same path
    on every host); ``port``: the rendezvous port on the first host, whose name (as given)
    is ``MASTER_ADDR``; ``store_here``: hvdrun keeps the rendezvous store (the first host
    is this machine), else rank 0 does. Raises ValueError for hosts that cannot work."""
    if not args.hosts:
        raise ValueError("plan_hosts needs hosts (-H or --hostfile)")
    places = place(args.hosts, args.np)
    used = sorted({p.host for p in places}, key=[p.host for p in places].index)
    addr = used[0]
    if addr in LOCAL_NAMES and any(h not in local_names for h in used):
        raise ValueError(f"the first host, {addr}, is where the ranks meet (MASTER_ADDR), and "
                         "the other hosts cannot reach it by that name: name this machine by "
                         "an address or host name the others reach (e.g. -H node1:2,node2:2)")
    clean = {k: v for k, v in env.items() if not k.startswith(MPI_PREFIXES)}
    bindir = os.path.dirname(python)
    if bindir and bindir not in clean.get("PATH", "").split(os.pathsep):
        # `hvdrun ... python x.py` from an unactivated venv runs that venv's python
        clean["PATH"] = os.pathsep.join(x for x in (bindir, clean.get("PATH")) if x)
    settings = dict(horovod_env(args))
    settings.update(args.extra_env)
    agent = agent_command(env)
    nanny = [python, "-m", "hvd_magic.runner.gloo_nanny", "--"]
    out: List[RankStart] = []
    for p in places:
        mine = dict(settings)
        mine.update(rank_vars(p, args.np, len(used), addr, port, store_here))
        if p.host in local_names:
            full = dict(clean)
            full.update(mine)
            out.append(RankStart(p, False, nanny + list(args.command), full))
            continue
        remote = forwarded(clean)
        remote.update(mine)
        line = (f"cd {shlex.quote(cwd)} 2>/dev/null; exec env "
                + " ".join(shlex.quote(f"{k}={v}") for k, v in sorted(remote.items())) + " "
                + " ".join(shlex.quote(a) for a in nanny + list(args.command)))
        out.append(RankStart(p, True, agent + [p.host, line], dict(env)))
    return out


def hosts_text(starts: Sequence[RankStart]) -> str:
    """``host: ranks a-b`` for each host, for --verbose."""
    seen: Dict[str, List[int]] = {}
    for s in starts:
        seen.setdefault(s.place.host, []).append(s.place.rank)
    return ", ".join(f"{h}: rank{'s' if len(r) > 1 else ''} "
                     f"{r[0] if len(r) == 1 else f'{r[0]}-{r[-1]}'}" for h, r in seen.items())


def exit_text(status: Optional[int], agent_status: Optional[int]) -> Tuple[str, int]:
    """What happened to a rank, and the job's exit code for it: ``status`` is what the
    nanny reported (a negative number: the signal that killed the rank), None when the
    connection ended without a report (``agent_status``: how the agent ended, if it did)."""
    if status is None:
        how = "" if agent_status is None else f" (the agent exited with status {agent_status})"
        return (f"was lost: its connection ended before it reported an exit status{how}; "
                "check that the host is up and that the ssh agent reaches it"), 255
    if status < 0:
        return f"was killed by signal {-status}", 128 - status
    return f"exited with status {status}", status
