"""``hvdrun``: Horovod's ``horovodrun`` for hvd_magic, a thin wrapper around ``mpiexec``."""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import sys
from typing import List, Optional, TextIO

from .launch import MpiNotFoundError, detect_mpi, execute, execute_elastic, find_mpiexec, \
    prepare, remote_size
from .options import HVDRUN, SLURM_OPTIONS, add_options, given_without
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
  hvdrun --gloo -np 8 -H node1:4,node2:4 python train.py   (no MPI: over ssh, torch.distributed)
  hvdrun --check-build
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n"
                     f"Try `{self.prog} -np 2 python script.py`, or `{self.prog} --help`.\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``hvdrun`` argument parser (its options: :mod:`.options`)."""
    p = _Parser(prog="hvdrun", description=DESCRIPTION, epilog=EPILOG,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(p, HVDRUN)
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
                          max_np=ns.max_np, host_discovery_script=ns.host_discovery_script,
                          reset_limit=ns.reset_limit,
                          blacklist_cooldown_range=(tuple(ns.blacklist_cooldown_range)
                                                    if ns.blacklist_cooldown_range else None),
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
    if ns.profiles:
        import os
        from .profiles import describe, find_profiles, profile_dir
        where = profile_dir(os.environ)
        print(describe(find_profiles(where), where))
        return 0
    try:
        setup = apply_profile(ns)
    except ValueError as exc:
        parser.error(str(exc))
    args = to_launch_args(ns, parser)
    args.extra_env.update(getattr(ns, "profile_env", {}))
    if slurm_wanted(ns):
        return run_in_slurm(ns, args, setup, parser)
    if setup:
        from .setup_lines import run_setup
        try:
            run_setup(setup, args.hosts, None, status=_say)
        except ValueError as exc:
            sys.stderr.write(f"hvdrun: {exc}\n")
            return 1
    if ns.gloo:
        from .gloo_run import run as run_gloo
        try:
            return run_gloo(args)
        except ValueError as exc:          # what --gloo does not do
            parser.error(str(exc))
    try:
        argv_, env = prepare(args)
    except MpiNotFoundError as exc:
        sys.stderr.write(f"hvdrun: {exc}\n")
        return 127
    except ValueError as exc:              # what only this MPI cannot do
        parser.error(str(exc))
    remote = remote_size(args)
    return (execute(argv_, env, remote_size=remote) if args.min_np is None
            else execute_elastic(argv_, env, remote))


def _say(text: str) -> None:
    sys.stderr.write(text.replace("hvd:", "hvdrun:", 1) + "\n")
    sys.stderr.flush()


def apply_profile(ns: argparse.Namespace) -> List[str]:
    """``--profile NAME``: fill the namespace from the profile (options given on the command
    line win); return its setup lines."""
    if ns.profile is None:
        return []
    import os
    from .profiles import launch_of, load_profile
    plan = launch_of(load_profile(ns.profile, os.environ), ns.np)
    if plan.ray is not None:
        raise ValueError(f"--profile {ns.profile}: a Ray profile (scheduler = \"ray\") is for "
                         "notebook pools (%%hvd --profile NAME); hvdrun starts ranks with "
                         "mpiexec, or with --gloo on -H hosts")
    ns.np = plan.np
    if plan.hosts:
        ns.hosts = ",".join(f"{h.name}:{h.slots}" for h in plan.hosts)
    if plan.slurm is not None:
        ns.slurm = True
        for key, value in plan.slurm.items():
            if getattr(ns, key) is None:
                setattr(ns, key, value)
    if ns.network_interface is None:
        ns.network_interface = plan.network_interface
    ns.profile_env = plan.env
    return plan.setup


def slurm_wanted(ns: argparse.Namespace) -> bool:
    """--slurm, or no host options inside an sbatch/salloc job (its allocation is used)."""
    import os
    from .slurm import allocation_from_env
    if given_without(ns, HVDRUN):
        flags = "/".join(f"--{dest.replace('_', '-')}" for dest in SLURM_OPTIONS)
        raise SystemExit(f"hvdrun: error: {flags} go with --slurm, e.g. hvdrun -np 8 "
                         "--slurm --nodes 2 python train.py")
    if ns.slurm:
        return True
    return ns.hosts is None and ns.hostfile is None and \
        allocation_from_env(os.environ) is not None


def run_in_slurm(ns: argparse.Namespace, args: LaunchArgs, setup: List[str],
                 parser: argparse.ArgumentParser) -> int:
    """Run the job in a Slurm allocation: the one this process is in (used as is), or one
    made for it with salloc and released (scancel) when the job ends."""
    import os
    from .slurm_alloc import Allocation, SlurmError
    from .slurm import SlurmRequest
    env = dict(os.environ)
    opts = {k: getattr(ns, k) for k in SLURM_OPTIONS}
    alloc = None
    if not any(v is not None for v in opts.values()):
        alloc = Allocation.from_env(env)
    try:
        if alloc is None:
            for key in ("SLURM_JOB_ID", "SLURM_JOBID"):
                env.pop(key, None)
            request = SlurmRequest(**{k: v for k, v in opts.items() if v is not None})
            alloc = Allocation.acquire(request, args.np, env, status=_say, watch=False)
        else:
            _say(f"hvd: using this Slurm job ({alloc.job_id}): "
                 + ", ".join(f"{h.name}:{h.slots}" for h in alloc.hosts))
        args.hosts, args.hostfile = alloc.hosts, None
        env.update(alloc.env())
        validate(args)
        if setup:
            from .setup_lines import run_setup
            run_setup(setup, alloc.hosts, alloc.job_id, env, status=_say)
        argv_, run_env = prepare(args, env)
        remote = remote_size(args)
        return (execute(argv_, run_env, remote_size=remote) if args.min_np is None
                else execute_elastic(argv_, run_env, remote))
    except (ValueError, SlurmError) as exc:
        sys.stderr.write(f"hvdrun: {exc}\n")
        return 1
    except MpiNotFoundError as exc:
        sys.stderr.write(f"hvdrun: {exc}\n")
        return 127
    finally:
        if alloc is not None and alloc.release():
            _say(f"hvd: Slurm job {alloc.job_id} released")


if __name__ == "__main__":
    sys.exit(main())
