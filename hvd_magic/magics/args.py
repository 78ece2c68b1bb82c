"""Deciding, not doing: parse ``%%hvd`` / ``%hvd`` arguments into request objects.

Pure functions of the argument string; nothing starts. Every error is a ``UsageError``-style
ValueError (:class:`HvdUsageError`) that says what to write instead.
"""
from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Tuple

from ..runner.options import CELL, DOCTOR, SCALE, SLURM_OPTIONS, START, \
    SUBCOMMANDS as COMMANDS, Command, add_options, convert, options_of, without_message, \
    usage_words
from ..runner.plan import Host

CELL_USAGE = f"{CELL} {usage_words(CELL)}"


def _line_usage(command: Command) -> str:
    return " ".join(w for w in (command.name, command.words,
                                usage_words(f"%hvd {command.name}")) if w)


LINE_USAGE = "%hvd " + " | ".join(_line_usage(c) for c in COMMANDS)
SUBCOMMANDS = tuple(c.name for c in COMMANDS)


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
    ray: Optional[str] = None                 # --ray [ADDRESS] ("local" without one)


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


def _parse(command: str, words: List[str], usage: str, names: bool = False,
           known: bool = False) -> Tuple[Dict[str, Any], List[str]]:
    """``command``'s options (declared in :mod:`hvd_magic.runner.options`) parsed from
    ``words`` and checked: ``({dest: value}, rest)``; ``names``: the words besides options go
    to ``"names"``; ``known``: words it does not know come back in ``rest``."""
    p = _Parser(usage)
    add_options(p, command, typed=False)
    if names:
        p.add_argument("names", nargs="*")
    ns, rest = p.parse_known_args(words) if known else (p.parse_args(words), [])
    given = without_message(ns, command)
    if given:
        example = (", e.g. %%hvd -np 8 --slurm --partition gpu --time 1:00:00"
                   if given.endswith("--slurm") else "")
        raise HvdUsageError(given + example)
    try:
        values = convert(ns, command)
    except ValueError as exc:
        raise HvdUsageError(str(exc)) from None
    if names:
        values["names"] = list(ns.names)
    return values, rest


def _pool_fields(values: Dict[str, Any], req: CellRequest) -> None:
    """The pool's options (-np, hosts, --slurm, --profile, ...) into ``req``."""
    req.oversubscribe = values["oversubscribe"]
    req.min_np, req.np, req.hosts = values["min_np"], values["np"], values["hosts"]
    req.hostfile, req.profile = values["hostfile"], values["profile"]
    req.ray = values.get("ray")
    if not values["slurm"]:
        return
    from ..runner.slurm import SlurmRequest, check_request
    opts = {k: values[k] for k in SLURM_OPTIONS}
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
    values, _ = _parse(CELL, _split(line, CELL_USAGE), CELL_USAGE)
    req = CellRequest(stream=values["stream"], timeout=values["timeout"], out=values["out"])
    _pool_fields(values, req)
    req.ranks = values["ranks"] if values["rank"] is None else [values["rank"]]
    check_ranks(req)
    return req


def check_ranks(req: CellRequest, size: Optional[int] = None) -> None:
    """Ranks beyond the pool's size (``-np`` or ``size``) are a usage error."""
    n = req.np if req.np is not None else size
    if req.ranks is not None and n is not None:
        bad = [r for r in req.ranks if r >= n]
        if bad:
            raise HvdUsageError(f"rank(s) {bad} do not exist in a pool of {n} ranks (0..{n - 1})")


#: ``%hvd doctor``'s own options (beside the pool's): its ``LineRequest.doctor``.
_DOCTOR_ONLY = [o.dest for o in options_of(DOCTOR) if o not in options_of(START)]


def parse_line_args(line: str) -> LineRequest:
    """``%hvd`` arguments -> :class:`LineRequest` (raises :class:`HvdUsageError`)."""
    words = _split(line, LINE_USAGE)
    if not words:
        raise HvdUsageError(f"%hvd needs a command\nusage: {LINE_USAGE}")
    name, rest = words[0], words[1:]
    if name not in SUBCOMMANDS:
        raise HvdUsageError(f"%hvd {name}: unknown command; use one of "
                            f"{', '.join(SUBCOMMANDS)}\nusage: {LINE_USAGE}\n"
                            "(to run code on the ranks use the cell magic %%hvd)")
    command = COMMANDS[SUBCOMMANDS.index(name)]
    req = LineRequest(name)
    values, _ = _parse(f"%hvd {name}", rest, f"%hvd {_line_usage(command)}",
                       names=bool(command.words))
    req.names = values.get("names", [])
    if name in ("restart", "start", "doctor"):
        _pool_fields(values, req.pool)
    if name == "doctor":
        req.doctor = {dest: values[dest] for dest in _DOCTOR_ONLY}
    elif name == "export":
        if len(req.names) != 1:
            raise HvdUsageError("%hvd export takes one file name, e.g. %hvd export train.py")
        return req
    elif name == "resize":
        if len(req.names) != 1 or not req.names[0].isdigit() or int(req.names[0]) < 1:
            raise HvdUsageError("%hvd resize takes the number of ranks the elastic pool "
                                "should have, e.g. %hvd resize 3")
        req.pool.np, req.names = int(req.names[0]), []
        return req
    elif name == "push":
        if not req.names:
            raise HvdUsageError("%hvd push needs variable names, e.g. %hvd push model lr")
        req.ranks = values["ranks"]
    elif name == "pull":
        if len(req.names) != 1:
            raise HvdUsageError("%hvd pull takes one variable name, e.g. %hvd pull loss "
                                "[--rank 0]")
        req.rank = values["rank"]
    bad = [n for n in req.names if not n.isidentifier()]
    if bad:
        raise HvdUsageError(f"{bad}: not Python variable names")
    return req


SCALE_USAGE = f"{SCALE} {usage_words(SCALE)} (then the cell)"


def parse_scale_args(line: str) -> str:
    """``scale --np 1,2,4`` (a ``%%hvd scale`` / ``%hvd scale`` line) -> the ``--np`` text
    (``"1,2,4"``; raises :class:`HvdUsageError`)."""
    values, rest = _parse(SCALE, _split(line, SCALE_USAGE)[1:], SCALE_USAGE, known=True)
    if rest:
        raise HvdUsageError(f"%hvd scale takes only --np (got {rest[0]!r}); it runs the cell "
                            "on one host at each size: %%hvd scale --np 1,2,4")
    if values["np"] is None:
        raise HvdUsageError("usage: %%hvd scale --np 1,2,4 (then the cell), or %hvd scale "
                            "--np 1,2,4 to re-run the last %%hvd cell")
    return values["np"]
