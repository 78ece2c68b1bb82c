"""Deciding, not doing: Slurm allocations for hvdrun and the ``%%hvd`` pool.

Pure functions of their inputs (text that Slurm's commands printed, an environment), so
every rule is unit-tested without Slurm; :mod:`hvd_magic.runner.slurm_alloc` runs the
commands. The flow:

* :func:`salloc_argv`: ``--slurm [--partition P] [--time T] [--nodes N] [--gpus-per-node G]``
  with ``-np`` -> ``salloc --no-shell ...`` (an allocation without a shell; its job id comes
  back in salloc's output, :func:`parse_job_id`);
* :func:`parse_job_detail` on ``scontrol show job -d ID``: the state, the nodes and the CPUs
  each node gave the job (the ranks it holds);
* :func:`job_env`: the variables Open MPI's launcher (PRRTE, ``ras``/``plm: slurm``) needs to
  use that allocation from outside its shell: ``SLURM_JOBID``, ``SLURM_JOB_ID``,
  ``SLURM_NODELIST`` and ``SLURM_TASKS_PER_NODE`` (with ``SLURM_JOB_ID`` alone PRRTE runs
  every rank here; without it, its ``srun`` makes a new job instead of a step);
* :func:`allocation_from_env`: inside ``sbatch``/``salloc`` the allocation is used as is;
* :func:`failure_text`: why an allocation ended (a node down, the time limit), in words.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from .plan import Host

#: Slurm's time formats: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, or unlimited.
_TIME_RE = re.compile(r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d{1,2}(:\d{1,2}){0,2}|"
                      r"unlimited|infinite|UNLIMITED|INFINITE)$")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")

#: Job states after which an allocation can run nothing more.
ENDED_STATES = frozenset({"CANCELLED", "COMPLETED", "FAILED", "NODE_FAIL", "TIMEOUT",
                          "PREEMPTED", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY", "REVOKED",
                          "SPECIAL_EXIT"})
#: Node states (their first word, flags such as ``*`` or ``+DRAIN`` aside) of a node that
#: can no longer run a job's ranks.
BAD_NODE_STATES = ("DOWN", "DRAIN", "FAIL", "FUTURE", "NOT_RESPONDING", "POWER")


@dataclass(frozen=True)
class SlurmRequest:
    """What ``--slurm`` and its options asked for (None: Slurm's default)."""

    partition: Optional[str] = None
    time: Optional[str] = None
    nodes: Optional[int] = None
    gpus_per_node: Optional[int] = None
    job_name: str = "hvd_magic"


@dataclass
class JobInfo:
    """What ``scontrol show job -d`` says about one job."""

    job_id: int
    state: str
    reason: str
    nodelist: str
    nodes: List[Tuple[str, int]] = field(default_factory=list)   # (node, CPUs) in order
    time_limit: str = ""

    @property
    def hosts(self) -> List[Host]:
        """The allocation's nodes as hosts, slots = the CPUs each gave the job."""
        return [Host(name, cpus) for name, cpus in self.nodes]


def _positive(value: object, flag: str, example: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{flag} {value!r}: give a whole number >= 1, e.g. {flag} {example}")
    return value


def check_request(req: SlurmRequest, np: Optional[int] = None) -> None:
    """Raise ValueError (saying what to write) for options ``salloc`` would refuse."""
    if req.partition is not None and not _NAME_RE.match(req.partition):
        raise ValueError(f"--partition {req.partition!r}: give a partition name, e.g. "
                         "--partition gpu (sinfo lists them)")
    if req.time is not None and not _TIME_RE.match(str(req.time)):
        raise ValueError(f"--time {req.time!r}: use Slurm's formats: minutes (30), "
                         "HH:MM:SS (1:30:00) or D-HH:MM (1-12:00)")
    if req.nodes is not None:
        _positive(req.nodes, "--nodes", "2")
        if np is not None and req.nodes > np:
            raise ValueError(f"--nodes {req.nodes} is more nodes than ranks (-np {np}); every "
                             "node needs at least one rank: lower --nodes or raise -np")
    if req.gpus_per_node is not None:
        _positive(req.gpus_per_node, "--gpus-per-node", "4")
    if not _NAME_RE.match(req.job_name):
        raise ValueError(f"job name {req.job_name!r}: letters, digits, '_', '.', '-' only")


def salloc_argv(req: SlurmRequest, np: int, salloc: str = "salloc") -> List[str]:
    """``salloc --no-shell`` for ``np`` ranks (one CPU each) on ``req``'s nodes. (An
    allocation without a batch script is never requeued: a failed node ends it.)"""
    check_request(req, np)
    _positive(np, "-np", "4")
    argv = [salloc, "--no-shell", f"--job-name={req.job_name}", f"--ntasks={np}"]
    if req.nodes is not None:
        argv.append(f"--nodes={req.nodes}")
    if req.partition:
        argv.append(f"--partition={req.partition}")
    if req.time:
        argv.append(f"--time={req.time}")
    if req.gpus_per_node is not None:
        argv.append(f"--gpus-per-node={req.gpus_per_node}")
    return argv


_GRANTED_RE = re.compile(r"(?:Granted|Pending) job allocation (\d+)")


def parse_job_id(text: str) -> int:
    """The job id in salloc's output ("salloc: Granted job allocation 42")."""
    found = _GRANTED_RE.findall(text or "")
    if not found:
        raise ValueError("salloc gave no job allocation; it said:\n"
                         f"{(text or '(nothing)').strip()[-2000:]}")
    return int(found[-1])


_PAIR_RE = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_/:]*)=")


def parse_pairs(text: str) -> Dict[str, str]:
    """``Key=Value Key2=Value with spaces ...`` (scontrol's output) -> dict; on a repeated
    key the first one holds."""
    out: Dict[str, str] = {}
    matches = list(_PAIR_RE.finditer(text))
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        out.setdefault(m.group(1), text[m.end():end].strip())
    return out


def count_cpu_ids(spec: str) -> int:
    """``0-1,4`` (scontrol's CPU_IDs) -> 3."""
    total = 0
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"cannot read CPU_IDs {spec!r}")
        total += (int(hi) - int(lo) + 1) if hi else 1
    return total


def parse_job_detail(text: str) -> JobInfo:
    """``scontrol show job -d ID`` -> :class:`JobInfo` (the per-node lines give each node's
    CPUs; ``Nodes=a[1-2] CPU_IDs=0-1`` counts for both nodes)."""
    pairs = parse_pairs(text)
    if "JobId" not in pairs:
        raise ValueError(f"no job in scontrol's output: {text.strip()[:500]!r}")
    nodes: List[Tuple[str, int]] = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("Nodes=") and "CPU_IDs=" in line:
            detail = parse_pairs(line)
            cpus = count_cpu_ids(detail["CPU_IDs"])
            nodes += [(name, cpus) for name in expand_hostlist(detail["Nodes"])]
    return JobInfo(job_id=int(pairs["JobId"]), state=pairs.get("JobState", "UNKNOWN"),
                   reason=pairs.get("Reason", ""), nodelist=pairs.get("NodeList", ""),
                   nodes=nodes, time_limit=pairs.get("TimeLimit", ""))


def expand_hostlist(spec: str) -> List[str]:
    """Slurm's compressed host list -> names: ``n[01-03,7],gpu1`` -> n01 n02 n03 n7 gpu1."""
    names: List[str] = []
    for item in _split_top(spec.strip()):
        if not item or item == "(null)":
            continue
        m = re.match(r"^([^\[]*)\[([^\]]+)\](.*)$", item)
        if not m:
            names.append(item)
            continue
        head, ranges, tail = m.groups()
        for r in ranges.split(","):
            lo, _, hi = r.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise ValueError(f"cannot read the host list {spec!r}")
            for i in range(int(lo), int(hi or lo) + 1):
                names += [f"{head}{str(i).zfill(len(lo))}{t}" for t in expand_hostlist(tail)
                          or [""]]
    return names


def _split_top(spec: str) -> List[str]:
    """Split on commas outside brackets."""
    out, depth, cur = [], 0, ""
    for ch in spec:
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
            continue
        depth += (ch == "[") - (ch == "]")
        cur += ch
    out.append(cur)
    return out


def compress_counts(counts: Sequence[int]) -> str:
    """Per-node counts in Slurm's form: [2, 2, 1] -> ``2(x2),1``."""
    out: List[str] = []
    i = 0
    while i < len(counts):
        j = i
        while j < len(counts) and counts[j] == counts[i]:
            j += 1
        out.append(f"{counts[i]}(x{j - i})" if j - i > 1 else str(counts[i]))
        i = j
    return ",".join(out)


def expand_counts(spec: str) -> List[int]:
    """``2(x2),1`` -> [2, 2, 1]."""
    out: List[int] = []
    for part in (spec or "").split(","):
        m = re.match(r"^\s*(\d+)(?:\(x(\d+)\))?\s*$", part)
        if not m:
            raise ValueError(f"cannot read SLURM_TASKS_PER_NODE={spec!r}")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def job_env(job: JobInfo) -> Dict[str, str]:
    """What PRRTE (and ``srun``) need to use the allocation from outside its shell."""
    counts = compress_counts([cpus for _, cpus in job.nodes])
    return {"SLURM_JOBID": str(job.job_id), "SLURM_JOB_ID": str(job.job_id),
            "SLURM_NODELIST": job.nodelist, "SLURM_JOB_NODELIST": job.nodelist,
            "SLURM_TASKS_PER_NODE": counts, "SLURM_NNODES": str(len(job.nodes)),
            "SLURM_JOB_NUM_NODES": str(len(job.nodes))}


def allocation_from_env(environ: Mapping[str, str]) -> Optional[JobInfo]:
    """The allocation this process runs in (inside ``sbatch`` or ``salloc``), else None."""
    job = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not job or not nodelist:
        return None
    if not job.isdigit():
        raise ValueError(f"SLURM_JOB_ID={job!r} is not a job id")
    names = expand_hostlist(nodelist)
    per_node = environ.get("SLURM_TASKS_PER_NODE") or environ.get("SLURM_JOB_CPUS_PER_NODE")
    counts = expand_counts(per_node) if per_node else [1] * len(names)
    if len(counts) != len(names):
        raise ValueError(f"SLURM_TASKS_PER_NODE={per_node!r} does not match the "
                         f"{len(names)} nodes of SLURM_JOB_NODELIST={nodelist!r}")
    return JobInfo(job_id=int(job), state="RUNNING", reason="", nodelist=nodelist,
                   nodes=list(zip(names, counts)))


def parse_nodes(text: str) -> Dict[str, Dict[str, str]]:
    """``scontrol show node -o`` (one node per line) -> {name: fields}."""
    out: Dict[str, Dict[str, str]] = {}
    for line in text.splitlines():
        pairs = parse_pairs(line)
        if "NodeName" in pairs:
            out[pairs["NodeName"]] = pairs
    return out


def bad_nodes(nodes: Mapping[str, Mapping[str, str]], names: Sequence[str]) -> List[str]:
    """``"name (STATE: reason)"`` for each of ``names`` that cannot run ranks."""
    out = []
    for name in names:
        info = nodes.get(name)
        if info is None:
            continue
        state = info.get("State", "")
        if any(s in state.upper() for s in BAD_NODE_STATES):
            reason = info.get("Reason", "").split(" [")[0].strip()
            out.append(f"{name} ({state}" + (f": {reason})" if reason else ")"))
    return out


def failure_text(job: Optional[JobInfo], nodes: Mapping[str, Mapping[str, str]],
                 names: Sequence[str], job_id: int) -> str:
    """Why allocation ``job_id`` can no longer run the pool, naming the nodes at fault;
    ``""`` when it still can."""
    down = bad_nodes(nodes, names)
    state = job.state if job is not None else "gone"
    if not down and job is not None and state not in ENDED_STATES:
        return ""
    text = f"the Slurm allocation (job {job_id}) "
    text += f"ended ({state})" if state in ENDED_STATES or job is None else f"is {state}"
    if down:
        text += f": node {', '.join(down)} is out of service" if len(down) == 1 else \
            f": nodes {', '.join(down)} are out of service"
    elif state == "NODE_FAIL":
        text += (": one of its nodes failed and is back in service already (`sinfo -R` "
                 "and the slurmctld log say which)")
    elif job is not None and job.reason not in ("", "None"):
        text += f": {job.reason}"
    return text + "; the next %%hvd --slurm cell asks for a new allocation"


def scancel_argv(job_id: int, scancel: str = "scancel") -> List[str]:
    """Release an allocation."""
    return [scancel, str(job_id)]


def squeue_job_argv(job_id: int, squeue: str = "squeue") -> List[str]:
    """The job's state while Slurm still lists it (nothing once it has ended)."""
    return [squeue, "-h", "-j", str(job_id), "-o", "%T"]


def scontrol_job_argv(job_id: int, scontrol: str = "scontrol") -> List[str]:
    return [scontrol, "show", "job", "-d", str(job_id)]


def scontrol_nodes_argv(names: Sequence[str], scontrol: str = "scontrol") -> List[str]:
    return [scontrol, "show", "node", "-o", ",".join(names)]
