"""Every command-line option of ``hvdrun``, the magics and the doctor, declared once.

Each :class:`Option` names its flags, where its value goes (``dest``), how it is converted
and checked, its metavar and help, and the commands that take it. From this table come
``hvdrun``'s parser (:func:`.cli.build_parser`), the doctor's command line
(:func:`.doctor_run.main`), the magics' parsers and usage lines (``hvd_magic.magics.args``),
and the option tables of docs/magics.md, docs/api.md and docs/doctor.md
(``python -m hvd_magic.runner.options docs/*.md`` rewrites them; tests/test_docs.py fails
when they differ).

Two converters, because the two kinds of command report errors differently: ``type`` is
argparse's (``hvdrun`` and the doctor's command line: ``argument -np/--num-proc: ...``,
exit 2); ``check`` turns the magics' text into a value after parsing, and its ValueError's
text is the whole UsageError the notebook shows.
"""
from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from .plan import parse_hosts

#: ``--ray`` without an address: ``ray.init``'s own word for a new local instance.
RAY_LOCAL = "local"

#: The commands that take options (a parser each).
HVDRUN = "hvdrun"
DOCTOR_CLI = "python -m hvd_magic.runner.doctor_run"
CELL = "%%hvd"                 # %autohvd takes the same options
START = "%hvd start"
RESTART = "%hvd restart"
DOCTOR = "%hvd doctor"
PUSH = "%hvd push"
PULL = "%hvd pull"
SCALE = "%%hvd scale"

POOL = (CELL, START, RESTART, DOCTOR)          # the magics that start a pool
PLACING = (HVDRUN, DOCTOR_CLI) + POOL           # the commands that place ranks on hosts


@dataclass(frozen=True)
class Command:
    """A ``%hvd`` subcommand: its name and the words it takes besides options (usage)."""

    name: str
    words: str = ""


#: ``%hvd COMMAND``, in the order the usage lists them. A command whose ``words`` is not
#: empty takes them as ``names`` (a list of strings); its options are those declared for
#: ``"%hvd NAME"`` below.
SUBCOMMANDS: Tuple[Command, ...] = (
    Command("status"), Command("stop"), Command("restart"), Command("push", "NAME..."),
    Command("pull", "NAME"), Command("start"), Command("export", "PATH"), Command("doctor"),
    Command("profiles"), Command("resize", "N"), Command("stacks"))


@dataclass(frozen=True)
class Option:
    """One option. ``action`` is argparse's (``store``, ``store_true``, ``store_false``);
    options with the same ``group`` exclude each other; ``needs`` is the dest of the option
    it goes with (``--partition`` needs ``slurm``); ``spellings`` gives a command its own
    flags (``hvdrun -np/--num-proc``, Horovod's)."""

    flags: Tuple[str, ...]
    dest: str
    help: str
    commands: Tuple[str, ...]
    metavar: Any = None
    action: str = "store"
    type: Optional[Callable[[str], Any]] = None
    check: Optional[Callable[[str, str], Any]] = None     # (text, flag) -> value
    nargs: Any = None
    const: Any = None                   # the value of a flag given without one (nargs "?")
    group: Optional[str] = None
    needs: Optional[str] = None
    spellings: Mapping[str, Tuple[str, ...]] = field(default_factory=dict)

    def flags_for(self, command: str) -> Tuple[str, ...]:
        return self.spellings.get(command, self.flags)

    def takes_value(self) -> bool:
        return self.action == "store"


# ------------------------------------------------------------------ converters (argparse)

def non_negative(kind: type, name: str) -> Callable[[str], Any]:
    """argparse ``type``: a number of ``kind`` >= 0 (``name`` shows in argparse's errors)."""
    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
        return value
    convert.__name__ = name
    return convert


def positive_int(text: str) -> int:
    """argparse ``type``: a whole number of ranks (or nodes) >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of ranks") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: need at least 1 rank")
    return value


# ------------------------------------------------------------------ checks (the magics)

def pool_size(text: str, _flag: str) -> int:
    if not text.strip().isdigit():
        raise ValueError(f"-np {text!r}: give a whole number of ranks >= 1, e.g. -np 2")
    value = int(text)
    if value < 1:
        raise ValueError(f"-np {value}: a pool needs at least 1 rank, e.g. -np 2")
    return value


def rank_list(text: str, flag: str) -> List[int]:
    items = [t.strip() for t in text.split(",")]
    if not items or not all(t.isdigit() for t in items):
        raise ValueError(f"{flag} {text!r}: give rank numbers separated by commas, "
                         "e.g. --ranks 0,2")
    ranks = [int(t) for t in items]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"{flag} {text!r}: a rank is listed twice")
    return ranks


def one_rank(text: str, flag: str) -> int:
    ranks = rank_list(text, flag)
    if len(ranks) != 1:
        raise ValueError(f"{flag} {text!r}: one rank; use --ranks for several")
    return ranks[0]


def whole_number(text: str, flag: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{flag} {text!r}: give a whole number >= 1, e.g. {flag} 2")
    return int(text)


def _number(text: str, ok: Callable[[float], bool], message: str) -> float:
    """``text`` as a number that ``ok`` accepts; else ValueError(``message``)."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(message) from None
    if not ok(value):
        raise ValueError(message)
    return value


def seconds(text: str, _flag: str) -> float:
    return _number(text, lambda v: v > 0, f"--timeout {text!r}: give seconds > 0, e.g. "
                   "--timeout 60")


def positive_number(text: str, flag: str) -> float:
    return _number(text, lambda v: v > 0, f"{flag} {text!r}: give a number > 0, e.g. "
                   "--model-bytes 2e6 (gradient bytes per step) --step-time 0.05 (seconds)")


def non_negative_number(text: str, flag: str) -> float:
    return _number(text, lambda v: v >= 0, f"{flag} {text!r}: give a number >= 0, e.g. {flag} 0")


def fraction(text: str, flag: str = "--backward-fraction") -> float:
    return _number(text, lambda v: 0 <= v <= 1, f"{flag} {text!r}: give a share of the step "
                   f"between 0 and 1, e.g. {flag} 0.5")


def _fraction_type(text: str) -> float:
    """argparse ``type`` of a share between 0 and 1."""
    try:
        return fraction(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_float(text: str) -> float:
    """argparse ``type``: a number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return value


def hosts(text: str, _flag: str):
    return parse_hosts(text)


def file_name(text: str, _flag: str) -> str:
    if not text.strip():
        raise ValueError("--hostfile needs a file name, e.g. --hostfile hosts.txt")
    return text


def profile_name(text: str, _flag: str) -> str:
    if not text.strip() or "/" in text:
        raise ValueError(f"--profile {text!r}: give a profile's name (%hvd profiles lists "
                         "them), e.g. --profile mycluster")
    return text


def variable(text: str, _flag: str) -> str:
    if not text.isidentifier():
        raise ValueError(f"--out {text!r}: give a Python variable name, e.g. --out res")
    return text


def model_variable(text: str, _flag: str) -> str:
    if not text.isidentifier():
        raise ValueError(f"--model {text!r}: give the name of a torch model variable, "
                         "or a torchvision or Keras applications model (resnet50, ResNet50)")
    return text


# ------------------------------------------------------------------ the options

def _autotune(flag: str, kind: type) -> "Option":
    return Option((f"--autotune-{flag}",), f"autotune_{flag.replace('-', '_')}",
                  f"(HOROVOD_AUTOTUNE_{flag.upper().replace('-', '_')})", (HVDRUN,),
                  metavar="N", type=non_negative(kind, "N"))


OPTIONS: Tuple[Option, ...] = (
    Option(("-np", "--np"), "np", "number of ranks to start", PLACING, metavar="N",
           type=positive_int, check=pool_size, spellings={HVDRUN: ("-np", "--num-proc")}),
    Option(("-H", "--hosts"), "hosts",
           "hosts and their slots, e.g. node1:4,node2:4 (default: this machine)", PLACING,
           metavar="HOST:SLOTS,...", check=hosts, group="where"),
    Option(("--hostfile",), "hostfile",
           "file with one host per line, 'host slots=N' or 'host:N'", PLACING, metavar="FILE",
           check=file_name, group="where"),
    Option(("--slurm",), "slurm",
           "get a Slurm allocation for the ranks (salloc), run in it, release it at the end; "
           "inside an sbatch/salloc job, hvdrun uses its allocation without this flag",
           PLACING,
           action="store_true", group="where"),
    Option(("--ray",), "ray",
           "run the ranks in actors on a Ray cluster: ADDRESS as ray.init takes it (auto, "
           "HOST:PORT); without one, a Ray started on this machine for the pool",
           (CELL, START, RESTART), metavar="ADDRESS", nargs="?", const=RAY_LOCAL, group="where"),
    Option(("--profile",), "profile",
           "a cluster profile (NAME.toml in HVD_MAGIC_PROFILE_DIR or ~/.hvd_magic/profiles): "
           "hosts or Slurm, ranks, network, setup", PLACING, metavar="NAME",
           check=profile_name, group="where"),
    Option(("--partition",), "partition", "--slurm: the partition", PLACING, metavar="P",
           needs="slurm"),
    Option(("--time",), "time", "--slurm: the time limit (minutes, H:MM:SS)", PLACING,
           metavar="T", needs="slurm"),
    Option(("--nodes",), "nodes", "--slurm: number of nodes", PLACING, metavar="N",
           type=positive_int, check=whole_number, needs="slurm"),
    Option(("--gpus-per-node",), "gpus_per_node", "--slurm: GPUs on each node", PLACING,
           metavar="G", type=positive_int, check=whole_number, needs="slurm"),
    Option(("--profiles",), "profiles", "list the cluster profiles, and exit", (HVDRUN,),
           action="store_true"),
    Option(("--oversubscribe",), "oversubscribe",
           "allow more ranks than the hosts' slots, or than 4 per core here",
           (HVDRUN,) + POOL, action="store_true"),
    Option(("--gloo",), "gloo",
           "start the ranks without MPI: hvd.init() coordinates over torch.distributed "
           "(gloo; NCCL for CUDA tensors), as under torchrun; with -H/--hostfile over ssh",
           (HVDRUN,), action="store_true"),
    Option(("--timeline-filename",), "timeline_filename",
           "write a Horovod timeline (HOROVOD_TIMELINE)", (HVDRUN,), metavar="F"),
    Option(("--fusion-threshold-mb",), "fusion_threshold_mb",
           "tensor fusion buffer in MiB (HOROVOD_FUSION_THRESHOLD, bytes)",
           (HVDRUN, DOCTOR_CLI, DOCTOR), metavar="M", type=non_negative(float, "MB"),
           check=non_negative_number),
    Option(("--cycle-time-ms",), "cycle_time_ms", "engine cycle time in ms (HOROVOD_CYCLE_TIME)",
           (HVDRUN, DOCTOR_CLI, DOCTOR), metavar="T", type=non_negative(float, "ms"),
           check=non_negative_number),
    Option(("--min-np",), "min_np",
           "elastic training (hvd.elastic.run): go on while at least N ranks are left "
           "(starts MPI with fault tolerance, ULFM)", (HVDRUN,) + POOL, metavar="N",
           type=positive_int, check=pool_size),
    Option(("--max-np",), "max_np",
           "elastic training: grow to at most N ranks when the host discovery script lists "
           "more slots", (HVDRUN,), metavar="N", type=positive_int),
    Option(("--host-discovery-script",), "host_discovery_script",
           "elastic training: an executable printing 'host:slots' lines; the job grows or "
           "shrinks to the slots at the next commit", (HVDRUN,), metavar="S"),
    Option(("--reset-limit",), "reset_limit",
           "elastic training: maximum number of times that the training job can scale up or "
           "down the number of workers after which the job is terminated (default: None)",
           (HVDRUN,), metavar="N", type=non_negative(int, "N")),
    Option(("--blacklist-cooldown-range",), "blacklist_cooldown_range",
           "elastic training: range of seconds (min, max) a failing host will remain in "
           "blacklist (default: None: for the rest of the job)", (HVDRUN,),
           metavar=("MIN", "MAX"), type=int, nargs=2),
    Option(("--autotune",), "autotune",
           "tune the fusion threshold and cycle time while training (HOROVOD_AUTOTUNE)",
           (HVDRUN,), action="store_true"),
    Option(("--autotune-log-file",), "autotune_log_file",
           "CSV of every autotune trial, by rank 0 (HOROVOD_AUTOTUNE_LOG)", (HVDRUN,),
           metavar="F"),
    _autotune("warmup-samples", int),
    _autotune("steps-per-sample", int),
    _autotune("bayes-opt-max-samples", int),
    _autotune("gaussian-process-noise", float),
    Option(("--stall-check-seconds",), "stall_check_seconds",
           "warn about stalled collectives after S s (HOROVOD_STALL_CHECK_TIME_SECONDS)",
           (HVDRUN,), metavar="S", type=non_negative(float, "s")),
    Option(("--cache-capacity",), "cache_capacity",
           "requests each rank remembers so that repeated ones negotiate cheaply "
           "(HOROVOD_CACHE_CAPACITY, default 1024; 0: off)", (HVDRUN,), metavar="N",
           type=non_negative(int, "N")),
    Option(("--output-filename",), "output_filename",
           "write each rank's output to files under DIR", (HVDRUN,), metavar="DIR"),
    Option(("--network-interface",), "network_interface",
           "network for multi-host traffic: an interface name (eth0), or with Open MPI also "
           "a subnet (10.0.0.0/24) or a comma-separated list; Open MPI's daemons and TCP "
           "transport use only it, NCCL and Gloo get the interface names "
           "(NCCL/GLOO_SOCKET_IFNAME)", (HVDRUN, DOCTOR_CLI, DOCTOR), metavar="IF"),
    Option(("--verbose",), "verbose", "print the mpiexec command and what it means",
           (HVDRUN,), action="store_true"),
    Option(("--check-build",), "check_build",
           "show which frameworks, controllers and operations are available, and exit",
           (HVDRUN,), action="store_true"),
    Option(("--ranks",), "ranks", "run on (push to) these ranks only", (CELL, PUSH),
           metavar="0,2", check=rank_list, group="which"),
    Option(("--rank",), "rank", "run on (pull from) this rank only", (CELL, PULL),
           metavar="0", check=one_rank, group="which"),
    Option(("--timeout",), "timeout",
           "interrupt the cell after SECONDS (the pool stays)", (CELL,), metavar="SECONDS",
           check=seconds),
    Option(("--no-stream",), "stream", "plain text output instead of the live panel",
           (CELL,), action="store_false"),
    Option(("--out",), "out", "store the cell's value of each rank as {rank: value} in NAME",
           (CELL,), metavar="NAME", check=variable),
    Option(("--model-bytes",), "model_bytes",
           "gradient bytes per step, for the scaling forecast", (DOCTOR_CLI, DOCTOR),
           metavar="B", type=float, check=positive_number, group="model"),
    Option(("--model",), "model",
           "its gradient bytes per step: a torch model variable of the notebook, or a "
           "torchvision or Keras applications model name (resnet50, ResNet50), built without "
           "weights", (DOCTOR_CLI, DOCTOR), metavar="NAME", check=model_variable,
           group="model"),
    Option(("--step-time",), "step_time", "seconds of compute per step, for the forecast",
           (DOCTOR_CLI, DOCTOR), metavar="S", type=float, check=positive_number),
    Option(("--json",), "json", "print the report as JSON", (DOCTOR_CLI,),
           action="store_true"),
    Option(("--what-if",), "what_if",
           "forecast a cluster that does not exist yet from the numbers given, probing "
           "nothing: efficiency and images/s at 1, 2, 4, ... ranks, where it bends, the link "
           "that keeps 0.9 (needs the gradient bytes and --step-time, or --images-per-sec "
           "with --batch)", (DOCTOR_CLI, DOCTOR), action="store_true"),
    Option(("--num-hosts",), "num_hosts", "--what-if: hosts (default 2)", (DOCTOR_CLI, DOCTOR),
           metavar="N", type=positive_int, check=whole_number, needs="what_if"),
    Option(("--ranks-per-host",), "ranks_per_host", "--what-if: ranks (GPUs) per host "
           "(default 1)", (DOCTOR_CLI, DOCTOR), metavar="G", type=positive_int,
           check=whole_number, needs="what_if"),
    Option(("--link-gbit",), "link_gbit", "--what-if: bandwidth between hosts in Gbit/s "
           "(default 10)", (DOCTOR_CLI, DOCTOR), metavar="G", type=_positive_float,
           check=positive_number, needs="what_if"),
    Option(("--latency-us",), "latency_us", "--what-if: one-way latency between hosts in us "
           "(default 50)", (DOCTOR_CLI, DOCTOR), metavar="US", type=non_negative(float, "us"),
           check=non_negative_number, needs="what_if"),
    Option(("--intra-gbit",), "intra_gbit", "--what-if: bandwidth between the ranks of one "
           "host in Gbit/s (default 100, PCIe 3.0 x16)", (DOCTOR_CLI, DOCTOR), metavar="G",
           type=_positive_float, check=positive_number, needs="what_if"),
    Option(("--images-per-sec",), "images_per_sec", "--what-if: images/s of one rank "
           "alone, with --batch (instead of --step-time)", (DOCTOR_CLI, DOCTOR), metavar="R",
           type=_positive_float, check=positive_number, needs="what_if"),
    Option(("--batch",), "batch", "--what-if: images per rank per step", (DOCTOR_CLI, DOCTOR),
           metavar="B", type=positive_int, check=whole_number, needs="what_if"),
    Option(("--fp16",), "fp16", "--what-if: gradients compressed to fp16 (half the bytes)",
           (DOCTOR_CLI, DOCTOR), action="store_true", needs="what_if"),
    Option(("--backward-fraction",), "backward_fraction", "--what-if: share of a step the "
           "backward pass takes, hiding the allreduce (default 0.5; 0: no overlap)",
           (DOCTOR_CLI, DOCTOR), metavar="F", type=_fraction_type, check=fraction,
           needs="what_if"),
    Option(("--hierarchical-allreduce",), "hierarchical_allreduce", "--what-if: reduce "
           "inside each host, ring across hosts (Horovod's hierarchical allreduce)",
           (DOCTOR_CLI, DOCTOR), action="store_true", needs="what_if"),
    Option(("--np", "-np"), "np", "the pool sizes to run the cell at", (SCALE,),
           metavar="1,2,4"),
)


def options_of(command: str) -> List[Option]:
    """The options ``command`` takes, in declaration order."""
    return [o for o in OPTIONS if command in o.commands]


def dests_needing(command: str, dest: str) -> List[str]:
    """The dests of ``command``'s options that go with option ``dest`` (``slurm``)."""
    return [o.dest for o in options_of(command) if o.needs == dest]


#: ``--slurm``'s options, as ``SlurmRequest`` takes them.
SLURM_OPTIONS = tuple(dests_needing(HVDRUN, "slurm"))


def given_without(ns: argparse.Namespace, command: str) -> List[str]:
    """Flags given although the option they go with was not (``--nodes`` without
    ``--slurm``)."""
    return [o.flags_for(command)[0] for o in options_of(command)
            if o.needs and getattr(ns, o.dest) not in (None, False)
            and not getattr(ns, o.needs)]


def without_message(ns: argparse.Namespace, command: str) -> str:
    """``"--nodes --time go with --slurm"`` for the flags :func:`given_without` finds, each
    named with the option it needs; ``""`` when there are none."""
    needed: Dict[str, List[str]] = {}
    by_dest = {o.dest: o for o in options_of(command)}
    for o in options_of(command):
        if o.needs and getattr(ns, o.dest) not in (None, False) and not getattr(ns, o.needs):
            needed.setdefault(by_dest[o.needs].flags_for(command)[0], []).append(
                o.flags_for(command)[0])
    return "; ".join(f"{' '.join(flags)} go{'es' if len(flags) == 1 else ''} with {need}"
                     for need, flags in needed.items())


# ------------------------------------------------------------------ builders

def add_options(parser: argparse.ArgumentParser, command: str, typed: bool = True) -> None:
    """Add ``command``'s options to ``parser``. ``typed`` False: values stay text (the
    magics convert them with ``check`` after parsing)."""
    groups: Dict[str, Any] = {}
    for opt in options_of(command):
        target: Any = parser
        if opt.group is not None:
            if opt.group not in groups:
                groups[opt.group] = parser.add_mutually_exclusive_group()
            target = groups[opt.group]
        kw: Dict[str, Any] = {"dest": opt.dest, "help": opt.help}
        if opt.takes_value():
            kw.update(metavar=opt.metavar, default=None)
            if opt.nargs is not None:
                kw["nargs"] = opt.nargs
            if opt.const is not None:
                kw["const"] = opt.const
            if typed and opt.type is not None:
                kw["type"] = opt.type
        else:
            kw["action"] = opt.action
        target.add_argument(*opt.flags_for(command), **kw)


def convert(ns: argparse.Namespace, command: str) -> Dict[str, Any]:
    """The magics: ``{dest: value}`` of ``command``'s options, each given one through its
    ``check`` (ValueError: the message to show)."""
    out = {}
    for opt in options_of(command):
        value = getattr(ns, opt.dest)
        if opt.check is not None and value is not None:
            value = opt.check(value, opt.flags_for(command)[0])
        out[opt.dest] = value
    return out


def _word(opt: Option, flag: str) -> str:
    """``-np N``: a flag and its metavar."""
    if not opt.takes_value():
        return flag
    if opt.nargs == "?":
        return f"{flag} [{opt.metavar}]"
    meta = opt.metavar if isinstance(opt.metavar, tuple) else (opt.metavar,)
    return " ".join((flag,) + meta)


def usage_words(command: str) -> str:
    """``[-np N] [-H HOST:SLOTS,... | --hostfile FILE | ...] ...``: the options of
    ``command`` for a usage line; an option's companions follow it (``--slurm
    [--partition P]``), options that exclude each other share brackets."""
    opts = options_of(command)
    parts, done = [], set()
    for opt in opts:
        if opt.dest in done or opt.needs is not None:
            continue
        members = [o for o in opts if o.group == opt.group] if opt.group else [opt]
        words = []
        for o in members:
            done.add(o.dest)
            words.append(" ".join([_word(o, o.flags_for(command)[0])] + [
                f"[{_word(c, c.flags_for(command)[0])}]" for c in opts if c.needs == o.dest]))
        parts.append(f"[{' | '.join(words)}]")
    return " ".join(parts)


def markdown_table(commands: Sequence[str]) -> str:
    """The Markdown table of the options of ``commands`` (a column saying which takes each
    when there are several): what docs/*.md show between their ``options`` markers."""
    several = len(commands) > 1
    head = "| option | taken by | meaning |\n|---|---|---|" if several else \
        "| option | meaning |\n|---|---|"
    rows = [head]
    for opt in OPTIONS:
        mine = [c for c in commands if c in opt.commands]
        if not mine:
            continue
        flags = ", ".join(f"`{_word(opt, f)}`" for f in opt.flags_for(mine[0]))
        text = opt.help.replace("|", "\\|")
        rows.append(f"| {flags} | {', '.join(f'`{c}`' for c in mine)} | {text} |" if several
                    else f"| {flags} | {text} |")
    return "\n".join(rows)


#: A table's place in a page: ``<!-- options: COMMAND, COMMAND -->`` ... ``<!-- end -->``.
MARKED = re.compile(r"(<!-- options: (.*?) -->\n)(.*?)(<!-- end of options -->)", re.S)


def with_tables(page: str) -> str:
    """``page`` with each marked table made anew from the declaration."""
    return MARKED.sub(lambda m: m.group(1) + markdown_table(
        [c.strip() for c in m.group(2).split(",")]) + "\n" + m.group(4), page)


if __name__ == "__main__":
    # python -m hvd_magic.runner.options docs/*.md: rewrite the option tables of the pages
    for path in sys.argv[1:]:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        if with_tables(text) != text:
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(with_tables(text))
            print(f"{path}: option tables rewritten")
