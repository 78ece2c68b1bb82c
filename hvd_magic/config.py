"""Every environment variable hvd_magic reads, declared once: name, type, default, meaning.

Horovod's names (``HOROVOD_*``) keep Horovod's meaning and defaults; hvd_magic's own start
with ``HVD_MAGIC_``. Read them with :func:`get`, which turns the text into the declared type
and raises ValueError naming the variable and the accepted values. docs/environment.md is
:func:`markdown_table`, and a test checks that the code reads no variable this table lacks.
Standard library only: every layer may import it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Tuple

#: The prefixes of the settings every rank must share: hvdrun forwards them to the ranks, and
#: ranks that elastic training spawns get them from rank 0 (a remote host starts bare).
PREFIXES = ("HOROVOD_", "HVD_MAGIC_")

#: The prefixes of the driver's variables that ranks in Ray actors get (a node's Ray starts
#: them with its own environment): those that tell the ranks' runtime and its libraries how
#: to behave, e.g. GLOO_SOCKET_IFNAME where a node's hostname does not resolve to the
#: address the other nodes reach. A notebook's Ray pool and an exported Ray driver use them.
RAY_FORWARDED = ("HOROVOD_", "GLOO_", "NCCL_", "TORCH_")

#: With HVD_MAGIC_EXIT_REPORT, each rank's last line on stderr: ``EXIT_MARK rank=R size=S ok=1``.
EXIT_MARK = "[hvd_magic exit]"

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Var:
    name: str
    kind: str                 # "int", "float", "bool", "str" or "choice"
    default: Any              # what an unset or empty variable means (None: unset)
    meaning: str
    choices: Tuple[str, ...] = ()
    internal: bool = False    # set by hvd_magic itself for the processes it starts


_VARS = [
    # -- Horovod's, read by each rank's runtime
    Var("HOROVOD_FUSION_THRESHOLD", "int", 64 * 1024 * 1024,
        "fusion buffer bytes: ready allreduces of one dtype and op are reduced together up "
        "to this size; 0 disables fusion"),
    Var("HOROVOD_CYCLE_TIME", "float", 0.0,
        "ms that asynchronous requests may gather before a negotiation; a call that waits "
        "never waits for it"),
    Var("HOROVOD_CACHE_CAPACITY", "int", 1024,
        "requests each rank remembers, so that one announced before travels as an index and "
        "a cycle that recurs byte for byte reuses its decisions; 0 turns both off; rank 0's "
        "value holds"),
    Var("HOROVOD_STALL_CHECK_TIME_SECONDS", "float", 60.0,
        "rank 0 warns when some ranks submitted a tensor and others have not for this long"),
    Var("HOROVOD_STALL_CHECK_DISABLE", "bool", False, "1 turns the stall warning off"),
    Var("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "float", 0.0,
        "stalled requests fail on every rank with StallError after this long (0: never)"),
    Var("HOROVOD_TIMELINE", "str", "", "Chrome-trace timeline file written by rank 0 from "
        "hvd.init() on, while the job runs; DYNAMIC: none until hvd.start_timeline(path), "
        "as in Horovod"),
    Var("HOROVOD_TIMELINE_MARK_CYCLES", "bool", False,
        "1 marks every negotiation cycle in the timeline"),
    Var("HOROVOD_DYNAMIC_PROCESS_SETS", "bool", False,
        "1 lets hvd.add_process_set / remove_process_set run after hvd.init()"),
    Var("HOROVOD_CONTROLLER", "choice", "",
        "what coordinates the ranks: mpi, or gloo (torch.distributed); unset: MPI when an MPI "
        "launcher started the job, gloo under torchrun / hvdrun --gloo or an initialized "
        "torch.distributed process group (docs/controllers.md)", choices=("mpi", "gloo")),
    Var("HOROVOD_CPU_OPERATIONS", "choice", "mpi",
        "how CPU tensors are reduced: MPI (mpi4py), or torch.distributed with gloo (the "
        "code path CUDA tensors take with NCCL)", choices=("mpi", "gloo")),
    Var("HOROVOD_GPU_OPERATIONS", "choice", "nccl",
        "how CUDA tensors are reduced: NCCL (torch.distributed) when every rank has a GPU of "
        "its own, else copied to host memory and reduced over MPI; MPI: always through host "
        "memory", choices=("nccl", "mpi")),
    Var("HOROVOD_AUTOTUNE", "bool", False,
        "1: rank 0 tries fusion thresholds and cycle times during the first steps of "
        "training, scored by measured throughput, then keeps the best; a knob set explicitly "
        "stays fixed"),
    Var("HOROVOD_AUTOTUNE_LOG", "str", "",
        "CSV file rank 0 writes each autotune trial to, in Horovod's columns; the last row "
        "is the setting chosen"),
    Var("HOROVOD_AUTOTUNE_WARMUP_SAMPLES", "int", 3,
        "autotune trials of the starting setting that are discarded before scoring"),
    Var("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", "int", 10,
        "steps (times a tensor is reduced) per autotune sample; a trial is the median of 5"),
    Var("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", "int", 20,
        "most settings autotune tries (Horovod's name; the search here is a coordinate "
        "search over fixed candidates, not Bayesian optimisation)"),
    Var("HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", "float", 0.8,
        "accepted for Horovod's scripts and ignored: no Gaussian process here"),
    # -- hvd_magic's runtime
    Var("HVD_MAGIC_ALLREDUCE_CHUNK_MB", "float", 1.0,
        "on one host, an allreduce bigger than this runs as MPI calls of this size; 0: one "
        "call per buffer; rank 0's value holds"),
    Var("HVD_MAGIC_ELASTIC_MIN_NP", "int", 1,
        "hvd.elastic.run stops with an error when fewer ranks than this survive (hvdrun "
        "--min-np sets it)"),
    Var("HVD_MAGIC_ELASTIC_MAX_NP", "int", None,
        "hvd.elastic.run grows the job to at most this many ranks when the host discovery "
        "script lists more slots (hvdrun --max-np sets it); unset: as many as the slots"),
    Var("HVD_MAGIC_ELASTIC_RESET_LIMIT", "int", None,
        "hvd.elastic.run ends the job with an error when it would reset (a lost or failed "
        "rank, hosts updated) more than this many times (hvdrun --reset-limit sets it); "
        "unset: no limit"),
    Var("HVD_MAGIC_BLACKLIST_COOLDOWN_RANGE", "str", "",
        "'MIN MAX' seconds: a host where a rank was lost or failed is left out of the host "
        "discovery script's hosts for a cooldown between them, doubling with each failure "
        "(hvdrun --blacklist-cooldown-range sets it); unset: for the rest of the job"),
    Var("HVD_MAGIC_HOST_DISCOVERY_SCRIPT", "str", "",
        "executable printing one 'host' or 'host:slots' line per available host; rank 0 runs "
        "it at commits (at most once a second) and the job grows or shrinks to the slots "
        "(hvdrun --host-discovery-script sets it)"),
    Var("HVD_MAGIC_EXIT_REPORT", "bool", False,
        "each rank tells hvdrun on stderr how it ended (hvdrun sets it for elastic jobs, "
        "whose launcher may crash in its teardown after every rank finished)", internal=True),
    Var("HVD_MAGIC_INLINE", "bool", True,
        "0: a waiting caller never runs the negotiation cycle itself; the background thread "
        "does all communication"),
    Var("HVD_MAGIC_SWITCH_INTERVAL_MS", "float", None,
        "set the interpreter's GIL switch interval (ms) at hvd.init(); unset leaves "
        "Python's 5 ms"),
    Var("HVD_MAGIC_SHUTDOWN_TIMEOUT", "float", 30.0,
        "seconds hvd.shutdown() waits for the other ranks"),
    Var("HVD_MAGIC_EXIT_TIMEOUT", "float", 10.0,
        "seconds the shutdown at interpreter exit waits for the other ranks"),
    Var("HVD_MAGIC_RENDEZVOUS_ADDR", "str", "",
        "address at which torch.distributed's ranks meet (rank 0's); default: the address "
        "of GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME, else rank 0's host name"),
    Var("HVD_MAGIC_TORCH_INIT_TIMEOUT", "float", 120.0,
        "seconds torch.distributed's process group may take to form"),
    # -- the PyTorch face
    Var("HVD_MAGIC_BUCKET_BYTES", "str", "1048576,4194304",
        "DistributedOptimizer gradient buckets: the first, then later bucket caps in bytes; "
        "0: one request per parameter"),
    Var("HVD_MAGIC_GRAD_VIEWS", "bool", True,
        "0: copy reduced gradients back instead of making p.grad a view into the bucket"),
    # -- Horovod's per-worker variables: hvdrun sets them for each rank, as horovodrun does,
    #    for scripts that read them; the runtime itself asks MPI
    Var("HOROVOD_RANK", "int", None, "this rank's number (set by hvdrun for each rank)"),
    Var("HOROVOD_SIZE", "int", None, "the number of ranks (set by hvdrun for each rank)"),
    Var("HOROVOD_LOCAL_RANK", "int", None,
        "this rank's number among the ranks on its host (set by hvdrun for each rank)"),
    Var("HOROVOD_LOCAL_SIZE", "int", None,
        "the number of ranks on this rank's host (set by hvdrun for each rank)"),
    Var("HOROVOD_CROSS_RANK", "int", None,
        "this rank's host among the hosts (set by hvdrun for each rank; for hosts with the "
        "same number of ranks each: hvd.cross_rank() is exact for any layout)"),
    Var("HOROVOD_CROSS_SIZE", "int", None,
        "the number of hosts (set by hvdrun for each rank, as HOROVOD_CROSS_RANK)"),
    Var("HOROVOD_HOSTNAME", "str", "", "this rank's host name (set by hvdrun for each rank)"),
    # -- launching: hvdrun, hvd_magic.run, the pool
    Var("HVD_MAGIC_NETNS", "bool", True,
        "0: single-host jobs and pools stay in the normal network namespace (otherwise "
        "mpiexec and the ranks run in a private loopback-only one when it can be made)"),
    Var("HVD_MAGIC_OVERSUBSCRIBE", "bool", False,
        "1: a pool may have more ranks than its hosts' slots, or than 4 per core on this "
        "machine (as --oversubscribe)"),
    Var("HVD_MAGIC_PROFILE_DIR", "str", "",
        "directory of cluster profiles (NAME.toml) for --profile NAME; unset: "
        "~/.hvd_magic/profiles"),
    Var("HVD_MAGIC_SLURM_IDLE_TIMEOUT", "float", 3600.0,
        "seconds without a %%hvd cell after which a pool's Slurm allocation (%%hvd --slurm) is "
        "released (scancel); 0: kept until %hvd stop or kernel exit"),
    Var("HVD_MAGIC_PIN_GPU", "bool", True,
        "0: a pool's ranks do not set CUDA_VISIBLE_DEVICES to their local rank"),
    Var("HVD_MAGIC_NP", "int", 2, "ranks of a pool when neither -np nor a running pool says"),
    Var("HVD_MAGIC_START_TIMEOUT", "float", 60.0,
        "seconds a pool may take until every rank has registered"),
    Var("HVD_MAGIC_SYS_PATH", "str", "",
        "sys.path entries hvd_magic.run gives its ranks", internal=True),
    Var("HVD_MAGIC_POOL", "bool", False, "set to 1 in a pool's ranks", internal=True),
    Var("HVD_MAGIC_STACKS_DIR", "str", "",
        "directory where each rank writes its stacks when asked (SIGUSR2); hvdrun and a "
        "notebook's pool set it; unset: one directory per MPI job under the temporary "
        "directory", internal=True),
    Var("HVD_MAGIC_LAUNCHER", "str", "",
        "'PID HOST' of the hvdrun that started a job across hosts: at a stall, a rank on "
        "that host asks it (SIGUSR1) for the stacks of the ranks on the other hosts",
        internal=True),
    Var("HVD_MAGIC_AUTOHVD", "str", "",
        "%autohvd options that every cell runs with (the hvd_magic Jupyter kernel sets it)"),
    # -- the live panel
    Var("HVD_MAGIC_WIDGETS", "bool", True, "0: text output instead of the live panel"),
    Var("HVD_MAGIC_TELEMETRY_INTERVAL", "float", 1.0,
        "seconds between the ranks' telemetry batches while a live cell runs (the live panel "
        "redraws as often)"),
    Var("HVD_MAGIC_TELEMETRY_MAX_SPANS", "int", 50,
        "timeline spans per telemetry batch (the newest; a loop with more is sampled, a slice "
        "of each interval); 0: all"),
    Var("HVD_MAGIC_RENDER_THREAD", "bool", True,
        "0: live panels redraw on the kernel's main thread instead of a background thread"),
    Var("HVD_MAGIC_KEEP_BOKEHJS", "bool", False,
        "1: keep BokehJS (about 8 MB) in the saved notebook instead of dropping it once "
        "loaded"),
]

VARS = {v.name: v for v in _VARS}


def _convert(var: Var, raw: str) -> Any:
    text = raw.strip()
    if var.kind == "bool":
        if text.lower() in TRUE:
            return True
        if text.lower() in FALSE:
            return False
        raise ValueError(f"{var.name}={raw!r}: use 1 or 0 (also true/false, yes/no, on/off)")
    if var.kind in ("int", "float"):
        try:
            return int(text) if var.kind == "int" else float(text)
        except ValueError:
            what = "a whole number" if var.kind == "int" else "a number"
            raise ValueError(f"{var.name}={raw!r}: use {what}, e.g. "
                             f"{var.name}={var.default if var.default is not None else 1}"
                             ) from None
    if var.kind == "choice":
        if text.lower() not in var.choices:
            raise ValueError(f"{var.name}={raw!r}: use one of {', '.join(var.choices)}")
        return text.lower()
    return raw


def get(name: str, environ: Optional[Mapping[str, str]] = None) -> Any:
    """The value of the declared variable ``name`` in ``environ`` (default ``os.environ``),
    as its declared type; its default when unset or empty. Raises ValueError for a value of
    the wrong form, KeyError for a name this module does not declare."""
    var = VARS[name]
    raw = (os.environ if environ is None else environ).get(name, "")
    if raw.strip() == "":
        return var.default
    return _convert(var, raw)


def is_set(name: str, environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether the declared variable ``name`` has a value (not unset, not empty)."""
    return (os.environ if environ is None else environ).get(VARS[name].name, "").strip() != ""


def markdown_table() -> str:
    """The table of docs/environment.md."""
    rows = ["| variable | type | default | meaning |", "|---|---|---|---|"]
    for v in _VARS:
        kind = "|".join(v.choices) if v.kind == "choice" else v.kind
        default = "unset" if v.default in (None, "") else (
            ("1" if v.default else "0") if v.kind == "bool" else str(v.default))
        meaning = v.meaning + (" (internal)" if v.internal else "")
        rows.append(f"| `{v.name}` | {kind} | {default} | {meaning} |")
    return "\n".join(rows) + "\n"


def settings(environ: Optional[Mapping[str, str]] = None) -> dict:
    """The variables of ``environ`` (default ``os.environ``) under :data:`PREFIXES`."""
    return {k: v for k, v in (os.environ if environ is None else environ).items()
            if k.startswith(PREFIXES)}
