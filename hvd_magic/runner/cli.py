"""``hvdrun``: Horovod's ``horovodrun`` for hvd_magic, a thin wrapper around ``mpiexec``."""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import sys
from typing import List, Optional, TextIO

from .launch import MpiNotFoundError, detect_mpi, execute, find_mpiexec, prepare
from .plan import LaunchArgs, autotune_env, parse_hostfile, parse_hosts, validate

DESCRIPTION = """\
Run COMMAND on N ranks with mpiexec (Open MPI 5 or MPICH), Horovod-style.

On one host it works as root and with more ranks than cores, keeps ranks on shared
memory, and by default starts mpiexec and the ranks in a private network namespace that
has only loopback: nothing of the job listens on a reachable address, but the ranks
cannot reach outside networks (downloads, remote storage) either. Set HVD_MAGIC_NETNS=0
to run in the normal network (then Open MPI's prterun listens on all interfaces).

With -H or --hostfile the ranks on other hosts are started over ssh and get PATH,
PYTHONPATH, LD_LIBRARY_PATH, VIRTUAL_ENV, CONDA_PREFIX and the HOROVOD_*, HVD_MAGIC_*,
NCCL_* and GLOO_* variables from here; each host needs the same paths.
"""

EPILOG = """\
examples:
  hvdrun -np 2 python train.py
  hvdrun -np 4 --fusion-threshold-mb 32 --timeline-filename /tmp/tl.json python train.py
  hvdrun -np 8 -H node1:4,node2:4 python train.py
  hvdrun --check-build
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n"
                     f"Try `{self.prog} -np 2 python script.py`, or `{self.prog} --help`.\n")


def _nonneg(kind: type, flag: str):
    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
        return value
    convert.__name__ = flag
    return convert


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of ranks") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: need at least 1 rank")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``hvdrun`` argument parser."""
    p = _Parser(prog="hvdrun", description=DESCRIPTION, epilog=EPILOG,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-np", "--num-proc", dest="np", type=_positive_int, metavar="N",
                   help="number of ranks to start")
    hosts = p.add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", dest="hosts", metavar="HOST:SLOTS,...",
                       help="hosts and their slots, e.g. node1:4,node2:4 (default: this machine)")
    hosts.add_argument("--hostfile", metavar="FILE",
                       help="file with one host per line, 'host slots=N' or 'host:N'")
    p.add_argument("--oversubscribe", action="store_true",
                   help="allow more ranks than the hosts' slots, or than 4 per core here")
    p.add_argument("--timeline-filename", metavar="F",
                   help="write a Horovod timeline (HOROVOD_TIMELINE)")
    p.add_argument("--fusion-threshold-mb", type=_nonneg(float, "MB"), metavar="M",
                   help="tensor fusion buffer in MiB (HOROVOD_FUSION_THRESHOLD, bytes)")
    p.add_argument("--cycle-time-ms", type=_nonneg(float, "ms"), metavar="T",
                   help="engine cycle time in ms (HOROVOD_CYCLE_TIME)")
    p.add_argument("--min-np", type=_positive_int, metavar="N",
                   help="elastic training (hvd.elastic.run): go on while at least N ranks are "
                        "left (starts MPI with fault tolerance, ULFM)")
    p.add_argument("--autotune", action="store_true",
                   help="tune the fusion threshold and cycle time while training (HOROVOD_AUTOTUNE)")
    p.add_argument("--autotune-log-file", metavar="F",
                   help="CSV of every autotune trial, by rank 0 (HOROVOD_AUTOTUNE_LOG)")
    for flag, kind in (("warmup-samples", int), ("steps-per-sample", int),
                       ("bayes-opt-max-samples", int), ("gaussian-process-noise", float)):
        p.add_argument(f"--autotune-{flag}", type=_nonneg(kind, "N"), metavar="N",
                       help=f"(HOROVOD_AUTOTUNE_{flag.upper().replace('-', '_')})")
    p.add_argument("--stall-check-seconds", type=_nonneg(float, "s"), metavar="S",
                   help="warn about stalled collectives after S s "
                        "(HOROVOD_STALL_CHECK_TIME_SECONDS)")
    p.add_argument("--cache-capacity", type=_nonneg(int, "N"), metavar="N",
                   help="requests each rank remembers so that repeated ones negotiate cheaply "
                        "(HOROVOD_CACHE_CAPACITY, default 1024; 0: off)")
    p.add_argument("--output-filename", metavar="DIR",
                   help="write each rank's output to files under DIR")
    p.add_argument("--network-interface", metavar="IF",
                   help="network for multi-host traffic: an interface name (eth0), or with "
                        "Open MPI also a subnet (10.0.0.0/24) or a comma-separated list; "
                        "Open MPI's daemons and TCP transport use only it, NCCL and Gloo get "
                        "the interface names (NCCL/GLOO_SOCKET_IFNAME)")
    p.add_argument("--verbose", action="store_true",
                   help="print the mpiexec command and what it means")
    p.add_argument("--check-build", action="store_true",
                   help="show which frameworks, controllers and operations are available, and exit")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="COMMAND...",
                   help="the program to run on every rank, e.g. python train.py")
    return p


def to_launch_args(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> LaunchArgs:
    """Check the parsed namespace and turn it into LaunchArgs (usage errors exit 2)."""
    if ns.np is None:
        parser.error("-np N is required (the number of ranks)")
    command = list(ns.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        parser.error("no COMMAND given; put the program after the options, e.g. python train.py")
    try:
        hosts = parse_hosts(ns.hosts) if ns.hosts is not None else None
        if ns.hostfile is not None:
            try:
                with open(ns.hostfile) as fh:
                    hosts = parse_hostfile(fh.read(), ns.hostfile)
            except OSError as exc:
                raise ValueError(f"--hostfile {ns.hostfile}: cannot read it "
                                 f"({exc.strerror})") from None
        args = LaunchArgs(np=ns.np, command=command, hosts=hosts, hostfile=ns.hostfile,
                          timeline_filename=ns.timeline_filename,
                          fusion_threshold_mb=ns.fusion_threshold_mb,
                          cycle_time_ms=ns.cycle_time_ms,
                          stall_check_seconds=ns.stall_check_seconds,
                          cache_capacity=ns.cache_capacity, min_np=ns.min_np,
                          output_filename=ns.output_filename,
                          network_interface=ns.network_interface, verbose=ns.verbose,
                          oversubscribe=ns.oversubscribe, extra_env=autotune_env(vars(ns)))
        validate(args)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_build(out: Optional[TextIO] = None) -> int:
    """Print what is available, Horovod's ``--check-build`` style; return 0."""
    from .. import __version__
    out = out or sys.stdout

    def row(ok: bool, label: str, detail: str = "") -> None:
        out.write(f"    [{'X' if ok else ' '}] {label}{f' ({detail})' if detail else ''}\n")

    torch_ok = importlib.util.find_spec("torch") is not None
    tf_ok = importlib.util.find_spec("tensorflow") is not None
    gloo = nccl = False
    if torch_ok:
        try:
            import torch.distributed as dist
            gloo = bool(dist.is_available() and dist.is_gloo_available())
            nccl = bool(dist.is_available() and dist.is_nccl_available())
        except Exception:  # a broken torch install: report it as unavailable
            torch_ok = False
    try:
        info = detect_mpi(find_mpiexec())
        mpi_text, mpi_ok = f"{info.impl} {info.version}, {info.path}", True
    except MpiNotFoundError as exc:
        mpi_text, mpi_ok = str(exc), False
    mpi4py_version = _version("mpi4py")
    out.write(f"hvd_magic v{__version__}:\n\nAvailable Frameworks:\n")
    row(torch_ok, "PyTorch", _version("torch") or "")
    row(tf_ok, "TensorFlow", _version("tensorflow-cpu") or _version("tensorflow") or "")
    out.write("\nAvailable Controllers:\n")
    row(mpi_ok and mpi4py_version is not None, "MPI",
        f"{mpi_text}; mpi4py {mpi4py_version or 'missing: pip install mpi4py'}")
    row(gloo, "Gloo", "torch.distributed" if gloo else "")
    out.write("\nAvailable Tensor Operations:\n")
    row(nccl, "NCCL")
    row(gloo, "Gloo", "torch.distributed" if gloo else "")
    row(mpi_ok and mpi4py_version is not None, "MPI")
    out.flush()
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """``hvdrun`` entry point; returns (and, as a script, exits with) the job's exit code."""
    parser = build_parser()
    ns = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if ns.check_build:
        return check_build()
    args = to_launch_args(ns, parser)
    try:
        argv_, env = prepare(args)
    except MpiNotFoundError as exc:
        sys.stderr.write(f"hvdrun: {exc}\n")
        return 127
    except ValueError as exc:              # what only this MPI cannot do
        parser.error(str(exc))
    return execute(argv_, env)


if __name__ == "__main__":
    sys.exit(main())
