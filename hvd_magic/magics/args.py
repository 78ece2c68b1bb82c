"""Deciding, not doing: parse ``%%hvd`` / ``%hvd`` arguments into request objects.

Pure functions of the argument string; nothing starts. Every error is a ``UsageError``-style
ValueError (:class:`HvdUsageError`) that says what to write instead.
"""
from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional

from ..runner.plan import Host, parse_hosts

CELL_USAGE = ("%%hvd [-np N] [-H host1:4,host2:4 | --hostfile FILE | --slurm [--partition P] "
              "[--time T] [--nodes N] [--gpus-per-node G] | --profile NAME] [--oversubscribe] "
              "[--min-np N] [--ranks 0,2 | --rank 0] "
              "[--timeout SECONDS] [--no-stream] [--out NAME]")
LINE_USAGE = ("%hvd status | stop | restart | push NAME... [--ranks 0,2] | "
              "pull NAME [--rank R] | start [-np N] [-H HOSTS | --hostfile F] | export PATH | "
              "doctor [-np N] [-H HOSTS | --hostfile F] [--model-bytes B | --model NAME] "
              "[--step-time S] [--network-interface IF] | profiles | resize N")
SUBCOMMANDS = ("status", "stop", "restart", "push", "pull", "start", "export", "doctor",
               "profiles", "resize")


class HvdUsageError(ValueError):
    """Bad ``%%hvd``/``%hvd`` arguments; the magics show it as IPython's UsageError."""


@dataclass
class CellRequest:
    """What a ``%%hvd`` line asked for. ``np``/``hosts`` None mean: the running pool's, or
    the default (``HVD_MAGIC_NP``, else 2) when none runs."""

    np: Optional[int] = None
    hosts: Optional[List[Host]] = None
    hostfile: Optional[str] = None
    ranks: Optional[List[int]] = None
    timeout: Optional[float] = None
    stream: bool = True
    out: Optional[str] = None
    oversubscribe: bool = False
    min_np: Optional[int] = None
    slurm: Optional[Dict[str, Any]] = None    # --slurm: partition, time, nodes, gpus_per_node
    profile: Optional[str] = None             # --profile NAME (a cluster profile)


@dataclass
class LineRequest:
    """What a ``%hvd`` line asked for."""

    command: str
    names: List[str] = field(default_factory=list)
    rank: Optional[int] = None
    ranks: Optional[List[int]] = None
    pool: CellRequest = field(default_factory=CellRequest)
    doctor: dict = field(default_factory=dict)   # %hvd doctor's model/step/interface options


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing and exiting."""

    def __init__(self, usage: str) -> None:
        super().__init__(prog="%%hvd", usage=usage, add_help=False, allow_abbrev=False)

    def error(self, message: str) -> None:  # type: ignore[override]
        raise HvdUsageError(f"{message}\nusage: {self.usage}")


def _np(text: str) -> int:
    if not text.strip().isdigit():
        raise HvdUsageError(f"-np {text!r}: give a whole number of ranks >= 1, e.g. -np 2")
    value = int(text)
    if value < 1:
        raise HvdUsageError(f"-np {value}: a pool needs at least 1 rank, e.g. -np 2")
    return value


def _rank_list(text: str, flag: str) -> List[int]:
    items = [t.strip() for t in text.split(",")]
    if not items or not all(t.isdigit() for t in items):
        raise HvdUsageError(f"{flag} {text!r}: give rank numbers separated by commas, "
                            "e.g. --ranks 0,2")
    ranks = [int(t) for t in items]
    if len(set(ranks)) != len(ranks):
        raise HvdUsageError(f"{flag} {text!r}: a rank is listed twice")
    return ranks


def _timeout(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise HvdUsageError(f"--timeout {text!r}: give seconds > 0, e.g. --timeout 60")
    return value


def _pool_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("-np", "--np", dest="np", default=None)
    hosts = p.add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", dest="hosts", default=None)
    hosts.add_argument("--hostfile", dest="hostfile", default=None)
    hosts.add_argument("--slurm", action="store_true", default=False)
    hosts.add_argument("--profile", dest="profile", default=None)
    p.add_argument("--partition", default=None)
    p.add_argument("--time", default=None)
    p.add_argument("--nodes", default=None)
    p.add_argument("--gpus-per-node", dest="gpus_per_node", default=None)
    p.add_argument("--oversubscribe", action="store_true", default=False)
    p.add_argument("--min-np", dest="min_np", default=None)


def _pool_fields(ns: argparse.Namespace, req: CellRequest) -> None:
    req.oversubscribe = ns.oversubscribe
    if ns.min_np is not None:
        req.min_np = _np(ns.min_np)
    if ns.np is not None:
        req.np = _np(ns.np)
    if ns.hosts is not None:
        try:
            req.hosts = parse_hosts(ns.hosts)
        except ValueError as exc:
            raise HvdUsageError(str(exc)) from None
    if ns.hostfile is not None:
        if not ns.hostfile.strip():
            raise HvdUsageError("--hostfile needs a file name, e.g. --hostfile hosts.txt")
        req.hostfile = ns.hostfile
    _slurm_fields(ns, req)


def _slurm_fields(ns: argparse.Namespace, req: CellRequest) -> None:
    """--slurm and its options (checked as salloc would), --profile's name."""
    opts = {k: getattr(ns, k) for k in ("partition", "time", "nodes", "gpus_per_node")}
    given = [f"--{k.replace('_', '-')}" for k, v in opts.items() if v is not None]
    if given and not ns.slurm:
        raise HvdUsageError(f"{' '.join(given)} go with --slurm, e.g. %%hvd -np 8 --slurm "
                            "--partition gpu --time 1:00:00")
    if ns.profile is not None:
        if not ns.profile.strip() or "/" in ns.profile:
            raise HvdUsageError(f"--profile {ns.profile!r}: give a profile's name (%hvd "
                                "profiles lists them), e.g. --profile mycluster")
        req.profile = ns.profile
    if not ns.slurm:
        return
    from ..runner.slurm import SlurmRequest, check_request
    for key in ("nodes", "gpus_per_node"):
        if opts[key] is not None:
            flag = f"--{key.replace('_', '-')}"
            if not opts[key].isdigit() or int(opts[key]) < 1:
                raise HvdUsageError(f"{flag} {opts[key]!r}: give a whole number >= 1, "
                                    f"e.g. {flag} 2")
            opts[key] = int(opts[key])
    try:
        check_request(SlurmRequest(**{k: v for k, v in opts.items() if v is not None}),
                      req.np)
    except ValueError as exc:
        raise HvdUsageError(str(exc)) from None
    req.slurm = opts


def _split(line: str, usage: str) -> List[str]:
    try:
        return shlex.split(line or "")
    except ValueError as exc:
        raise HvdUsageError(f"cannot read the arguments ({exc}); check the quotes\n"
                            f"usage: {usage}") from None


def parse_cell_args(line: str) -> CellRequest:
    """``%%hvd`` arguments -> :class:`CellRequest` (raises :class:`HvdUsageError`).

    The same line parses to the same request: the last few are kept (building the argparse
    parser was about 0.4 ms of an empty cell's round trip). Each call returns its own copy."""
    key = line or ""
    req = _CELL_CACHE.get(key)
    if req is None:
        req = _parse_cell_args(key)
        if len(_CELL_CACHE) >= 64:
            _CELL_CACHE.clear()
        _CELL_CACHE[key] = req
    return replace(req, hosts=list(req.hosts) if req.hosts is not None else None,
                   ranks=list(req.ranks) if req.ranks is not None else None,
                   slurm=dict(req.slurm) if req.slurm is not None else None)


_CELL_CACHE: "dict[str, CellRequest]" = {}


def _parse_cell_args(line: str) -> CellRequest:
    p = _Parser(CELL_USAGE)
    _pool_options(p)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--ranks", default=None)
    which.add_argument("--rank", default=None)
    p.add_argument("--timeout", default=None)
    p.add_argument("--no-stream", dest="stream", action="store_false", default=True)
    p.add_argument("--out", default=None)
    ns = p.parse_args(_split(line, CELL_USAGE))
    req = CellRequest(stream=ns.stream)
    _pool_fields(ns, req)
    if ns.ranks is not None:
        req.ranks = _rank_list(ns.ranks, "--ranks")
    if ns.rank is not None:
        req.ranks = _rank_list(ns.rank, "--rank")
        if len(req.ranks) != 1:
            raise HvdUsageError(f"--rank {ns.rank!r}: one rank; use --ranks for several")
    if ns.timeout is not None:
        req.timeout = _timeout(ns.timeout)
    if ns.out is not None:
        if not ns.out.isidentifier():
            raise HvdUsageError(f"--out {ns.out!r}: give a Python variable name, e.g. --out res")
        req.out = ns.out
    check_ranks(req)
    return req


def check_ranks(req: CellRequest, size: Optional[int] = None) -> None:
    """Ranks beyond the pool's size (``-np`` or ``size``) are a usage error."""
    n = req.np if req.np is not None else size
    if req.ranks is not None and n is not None:
        bad = [r for r in req.ranks if r >= n]
        if bad:
            raise HvdUsageError(f"rank(s) {bad} do not exist in a pool of {n} ranks (0..{n - 1})")


def _doctor_options(p: argparse.ArgumentParser) -> None:
    model = p.add_mutually_exclusive_group()
    model.add_argument("--model-bytes", dest="model_bytes", default=None)
    model.add_argument("--model", dest="model", default=None)
    p.add_argument("--step-time", dest="step_time", default=None)
    p.add_argument("--network-interface", dest="network_interface", default=None)


def _doctor_fields(ns: argparse.Namespace) -> dict:
    out: dict = {"model": ns.model, "network_interface": ns.network_interface}
    if ns.model is not None and not ns.model.isidentifier():
        raise HvdUsageError(f"--model {ns.model!r}: give the name of a torch model variable")
    for key, flag in (("model_bytes", "--model-bytes"), ("step_time", "--step-time")):
        text = getattr(ns, key)
        if text is None:
            out[key] = None
            continue
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        if not value > 0:
            raise HvdUsageError(f"{flag} {text!r}: give a number > 0, e.g. --model-bytes 2e6 "
                                "(gradient bytes per step) --step-time 0.05 (seconds)")
        out[key] = value
    return out


def parse_line_args(line: str) -> LineRequest:
    """``%hvd`` arguments -> :class:`LineRequest` (raises :class:`HvdUsageError`)."""
    words = _split(line, LINE_USAGE)
    if not words:
        raise HvdUsageError(f"%hvd needs a command\nusage: {LINE_USAGE}")
    command, rest = words[0], words[1:]
    if command not in SUBCOMMANDS:
        raise HvdUsageError(f"%hvd {command}: unknown command; use one of "
                            f"{', '.join(SUBCOMMANDS)}\nusage: {LINE_USAGE}\n"
                            "(to run code on the ranks use the cell magic %%hvd)")
    req = LineRequest(command)
    p = _Parser(LINE_USAGE)
    if command in ("status", "stop", "profiles"):
        p.parse_args(rest)
    elif command in ("restart", "start"):
        _pool_options(p)
        _pool_fields(p.parse_args(rest), req.pool)
    elif command == "export":
        p.add_argument("names", nargs="*")
        req.names = list(p.parse_args(rest).names)
        if len(req.names) != 1:
            raise HvdUsageError("%hvd export takes one file name, e.g. %hvd export train.py")
        return req
    elif command == "resize":
        p.add_argument("names", nargs="*")
        rest = p.parse_args(rest).names
        if len(rest) != 1 or not rest[0].isdigit() or int(rest[0]) < 1:
            raise HvdUsageError("%hvd resize takes the number of ranks the elastic pool "
                                "should have, e.g. %hvd resize 3")
        req.pool.np = int(rest[0])
        return req
    elif command == "doctor":
        _pool_options(p)
        _doctor_options(p)
        ns = p.parse_args(rest)
        _pool_fields(ns, req.pool)
        req.doctor = _doctor_fields(ns)
    elif command == "push":
        p.add_argument("names", nargs="*")
        p.add_argument("--ranks", default=None)
        ns = p.parse_args(rest)
        req.names = list(ns.names)
        if not req.names:
            raise HvdUsageError("%hvd push needs variable names, e.g. %hvd push model lr")
        if ns.ranks is not None:
            req.ranks = _rank_list(ns.ranks, "--ranks")
    else:
        p.add_argument("names", nargs="*")
        p.add_argument("--rank", default=None)
        ns = p.parse_args(rest)
        req.names = list(ns.names)
        if len(req.names) != 1:
            raise HvdUsageError("%hvd pull takes one variable name, e.g. %hvd pull loss "
                                "[--rank 0]")
        if ns.rank is not None:
            req.rank = _rank_list(ns.rank, "--rank")[0]
    bad = [n for n in req.names if not n.isidentifier()]
    if bad:
        raise HvdUsageError(f"{bad}: not Python variable names")
    return req
