"""Deciding, not doing: turn the ``%%hvd`` cells a notebook session ran into a script.

``%hvd export PATH`` hands :func:`build_script` the session's records, in order, and writes
what it returns. Pure: nothing here runs, imports a framework or touches a file.

A record is a dict (the magics make them):

- ``{"kind": "cell", "line": "-np 2 --rank 0", "source": "...", "size": 2,
  "ok": True, "hosts": "a:1,b:1" or None, "hostfile": None, "slurm": {...} or None,
  "ray": "host:port" or "local" or None}``;
- ``{"kind": "push", "names": ["lr"], "ranks": None or [0], "carried": {"lr": "0.1"},
  "not_carried": {"model": "why"}}`` (:func:`carry_value` made ``carried``, at push time);
- ``{"kind": "scale", "nps": "1,2", "source": "..."}``;
- ``{"kind": "pull", "names": ["acc"]}``; ``{"kind": "stop"}`` / ``{"kind": "restart"}``;
  ``{"kind": "resize", "np": 3}``.

The script runs as is under ``hvdrun -np N python PATH`` (from a Ray pool: ``python PATH``, a
Ray driver that runs the same lines on N ``RayExecutor`` workers): ``hvd.init()`` first (the pool did
it when it started), then each cell in order; ``--rank``/``--ranks`` cells under
``if _hvd.rank() in (...)``; a pushed variable assigned where it was pushed; a cell's last
expression printed as the pool showed it; notebook-only lines (``%magic``, ``!shell``) and
what could not be carried left as comments saying so.
"""
from __future__ import annotations

import ast
import base64
import pickle
import shlex
import textwrap
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

#: A pushed value whose pickle is larger than this is not written into the script.
MAX_CARRIED_BYTES = 8 << 20


@dataclass
class Export:
    """What :func:`build_script` made: the script, the command that runs it, the size."""

    script: str
    command: str
    np: int
    notes: List[str]


def carry_value(name: str, value: Any) -> Tuple[Optional[str], Optional[str]]:
    """``(python_expression, None)`` that rebuilds ``value``, or ``(None, why_not)``.

    Plain values (numbers, strings, lists/dicts/tuples/sets of them) become their ``repr``;
    anything else that pickles becomes ``pickle.loads(base64.b64decode(...))``; the rest
    (open files, locks, lambdas, values over :data:`MAX_CARRIED_BYTES`) is not carried."""
    try:
        text = repr(value)
        if ast.literal_eval(text) == value and type(ast.literal_eval(text)) is type(value):
            return text, None
    except Exception:  # noqa: BLE001 - any repr that is no literal falls through to pickle
        pass
    try:
        data = pickle.dumps(value, protocol=4)
    except Exception as exc:  # noqa: BLE001 - the reason goes into the script as a comment
        return None, f"{type(value).__name__} does not pickle ({type(exc).__name__}: {exc})"
    if len(data) > MAX_CARRIED_BYTES:
        return None, (f"its pickle is {len(data) / 2**20:.1f} MiB (over "
                      f"{MAX_CARRIED_BYTES >> 20} MiB); save it to a file and load it instead")
    b64 = base64.b64encode(data).decode("ascii")
    return f"_hvd_unpickle({b64!r})", None


def _comment_notebook_lines(source: str) -> Tuple[str, List[str]]:
    """IPython-only lines (``%magic``, ``!cmd``, ``%%cellmagic``) become comments."""
    out, dropped = [], []
    for line in source.splitlines():
        stripped = line.lstrip()
        if stripped.startswith(("%", "!")):
            indent = line[:len(line) - len(stripped)]
            out.append(f"{indent}pass  # notebook only, not run here: {stripped}")
            dropped.append(stripped)
        else:
            out.append(line)
    return "\n".join(out), dropped


def _print_last_expression(source: str) -> str:
    """A cell's final bare expression is shown by the pool; the script prints its repr."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return source
    if not tree.body or not isinstance(tree.body[-1], ast.Expr):
        return source
    last = tree.body[-1]
    call = last.value
    if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and \
            call.func.id == "print":          # shows nothing: keep the cell as written
        return source
    lines = source.splitlines()
    start, end = last.lineno - 1, last.end_lineno or last.lineno
    if last.col_offset != 0 or (start > 0 and lines[start - 1].rstrip().endswith(";")):
        return source
    if lines[end - 1].split("#")[0].rstrip().endswith(";"):   # IPython: ';' hides the value
        return source
    expr = ast.get_source_segment(source, last) or "None"
    return "\n".join(lines[:start] + [f"_hvd_value = ({expr}\n)",
                                      "if _hvd_value is not None:",
                                      "    print(repr(_hvd_value))"] + lines[end:])


def _guard(body: str, ranks: Optional[Sequence[int]]) -> str:
    if ranks is None:
        return body
    cond = f"_hvd.rank() == {ranks[0]}" if len(ranks) == 1 else \
        f"_hvd.rank() in {tuple(ranks)!r}"
    return f"if {cond}:\n" + textwrap.indent(body if body.strip() else "pass", "    ")


def _cell_ranks(line: str) -> Optional[List[int]]:
    words = shlex.split(line or "")
    for i, w in enumerate(words):
        for flag in ("--ranks", "--rank"):
            value = None
            if w == flag and i + 1 < len(words):
                value = words[i + 1]
            elif w.startswith(flag + "="):
                value = w.split("=", 1)[1]
            if value is not None:
                return [int(t) for t in value.split(",") if t.strip().isdigit()]
    return None


def launcher_command(np: int, path: str, hosts: Optional[str] = None,
                     hostfile: Optional[str] = None,
                     slurm: Optional[Mapping[str, Any]] = None) -> str:
    """The shell line that runs the exported script: ``hvdrun ...``, or an ``sbatch`` line
    wrapping it when the pool was a Slurm allocation (``slurm``: partition, time, nodes,
    gpus_per_node, as ``%%hvd --slurm`` took them)."""
    run = ["hvdrun", "-np", str(np)]
    if hosts:
        run += ["-H", hosts]
    elif hostfile:
        run += ["--hostfile", hostfile]
    run += ["python", path]
    line = " ".join(shlex.quote(w) for w in run)
    if slurm is None:
        return line
    sb = ["sbatch"]
    for key, flag in (("partition", "--partition"), ("time", "--time"), ("nodes", "--nodes"),
                      ("gpus_per_node", "--gpus-per-node")):
        if slurm.get(key) not in (None, ""):
            sb += [f"{flag}={slurm[key]}"]
    sb += [f"--ntasks={np}", f"--wrap={line}"]
    return " ".join(shlex.quote(w) for w in sb)


HEADER = '''\
"""Exported by hvd_magic's %hvd export from the %%hvd cells of a notebook session.

Run it with:  {command}
"""
'''

#: What every exported script starts its cells with (after its header).
PRELUDE = '''\
import base64 as _hvd_base64
import pickle as _hvd_pickle

import hvd_magic.collectives as _hvd

_hvd.init()      # {init_note}


def _hvd_unpickle(text):
    return _hvd_pickle.loads(_hvd_base64.b64decode(text))

'''


RAY_HEADER = '''\
"""Exported by hvd_magic's %hvd export from the %%hvd cells of a notebook session whose
pool ran on Ray ({where}).

Run it with:  {command}
It is a Ray driver: it connects to Ray, starts {np} RayExecutor workers (the pool's ranks)
and runs everything below its driver block on each of them, as the pool ran the cells;
what each worker printed is shown here as [rank] lines when they are done (meanwhile it
is in Ray's worker logs); an error names the rank and its node.
"""
import os as _hvd_os


def _hvd_on_worker(text, path):
    """Run this file's cells here (a worker); what they printed, also left in Ray's log."""
    import io
    import sys

    class Tee(io.TextIOBase):
        def __init__(self, out):
            self.out, self.kept = out, io.StringIO()

        def write(self, s):
            self.kept.write(s)
            return self.out.write(s)

        def flush(self):
            self.out.flush()

    tee = sys.stdout = Tee(sys.stdout)
    try:
        exec(compile(text, path, "exec"), {{"__name__": "__hvd_worker__", "__file__": path}})
    finally:
        sys.stdout = tee.out
    return tee.kept.getvalue()


if __name__ == "__main__":
    import ray
    from hvd_magic.ray import RayExecutor

    ray.init({init}, log_to_driver=False)
    _executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers={np})
    # the workers start with their node's environment: these travel from this one, as the
    # notebook's Ray pool forwarded them
    _executor.start(extra_env_vars={{k: v for k, v in _hvd_os.environ.items()
                                     if k.startswith({forwarded!r})}})
    try:
        with open(__file__) as _f:
            _printed = _executor.run(_hvd_on_worker, args=[_f.read(), __file__])
    finally:
        _executor.shutdown()
        ray.shutdown()
    for _rank, _text in enumerate(_printed):     # each worker's output, as [rank] lines
        for _line in _text.splitlines():
            print(f"[{{_rank}}] {{_line}}")
    raise SystemExit(0)

'''

def ray_header(np: int, path: str, address: str) -> Tuple[str, str]:
    """``(header, command)`` of a script exported from a Ray pool: a driver that runs the
    rest of the file on ``np`` RayExecutor workers, on the cluster at ``address`` (or, for
    :data:`RAY_LOCAL`, on a Ray it starts on this machine, as the pool did)."""
    from ..config import RAY_FORWARDED
    from .options import RAY_LOCAL
    command = f"python {shlex.quote(path)}"
    if address == RAY_LOCAL:
        where = "a Ray started on this machine for the pool"
        init = (f'address="local", include_dashboard=False, '
                f'num_cpus=max({np}, _hvd_os.cpu_count() or 1)')
    else:
        where = f"the cluster at {address}"
        init = f"address={address!r}"
    return RAY_HEADER.format(where=where, command=command, np=np, init=init,
                             forwarded=RAY_FORWARDED), command


def build_script(records: Sequence[Mapping[str, Any]], path: str = "script.py") -> Export:
    """The session's records (see the module docstring) -> :class:`Export`.

    rank 0 and rank 1 of ``hvdrun -np 2 python PATH`` then run what the notebook's cells
    ran on ranks 0 and 1, in the same order. Raises ValueError when no ``%%hvd`` cell ran."""
    cells = [r for r in records if r.get("kind") in ("cell", "scale")]
    if not cells:
        raise ValueError("%hvd export: no %%hvd cell has run in this session yet; run the "
                         "cells first, then %hvd export PATH")
    sizes = [int(r.get("size") or 0) for r in records if r.get("kind") == "cell"]
    sizes += [max(int(t) for t in str(r["nps"]).split(",") if t.strip().isdigit())
              for r in records if r.get("kind") == "scale" and r.get("nps")]
    np = max(sizes) if sizes else 1
    last = next((r for r in reversed(records) if r.get("kind") == "cell"), {})
    notes: List[str] = []
    if last.get("ray") is not None:       # the pool's ranks were Ray actors: a Ray driver
        header, command = ray_header(np, path, str(last["ray"]))
        init_note = "on each worker, as the notebook's pool did when it started"
        notes.append("the pool ran on Ray: the script is a Ray driver (RayExecutor), run "
                     "it with python")
    else:
        command = launcher_command(np, path, last.get("hosts"), last.get("hostfile"),
                                   last.get("slurm"))
        header = HEADER.format(command=command)
        init_note = "the notebook's pool did this when it started"
    parts: List[str] = [header + PRELUDE.format(init_note=init_note)]
    number = 0
    for rec in records:
        kind = rec.get("kind")
        if kind == "push":
            parts.append(_push_block(rec, notes))
        elif kind == "pull":
            parts.append(f"# %hvd pull {' '.join(rec.get('names', []))}: the notebook took "
                         "this value back; its own (non-%%hvd) code is not exported\n")
        elif kind in ("stop", "restart"):
            parts.append(f"# %hvd {kind}: the notebook's pool {kind}ed here; its variables "
                         "were lost, but this script keeps its own\n")
        elif kind == "resize":
            parts.append(f"# %hvd resize {rec.get('np')}: the notebook's elastic pool changed "
                         "size here; a script does so with hvdrun --max-np and "
                         "--host-discovery-script\n")
        elif kind in ("cell", "scale"):
            number += 1
            parts.append(_cell_block(rec, number, np, notes))
    return Export("\n".join(parts).rstrip() + "\n", command, np, notes)


def _push_block(rec: Mapping[str, Any], notes: List[str]) -> str:
    ranks = rec.get("ranks")
    lines = [f"# %hvd push {' '.join(rec.get('names', []))}"
             + (f" --ranks {','.join(map(str, ranks))}" if ranks else "")]
    body = []
    for name, expr in (rec.get("carried") or {}).items():
        body.append(f"{name} = {expr}")
    for name, why in (rec.get("not_carried") or {}).items():
        msg = f"NOT CARRIED: {name} could not be written into this script: {why}"
        body.append(f"# {msg}")
        notes.append(msg)
    lines.append(_guard("\n".join(body) or "pass", ranks))
    return "\n".join(lines) + "\n"


def _cell_block(rec: Mapping[str, Any], number: int, np: int, notes: List[str]) -> str:
    source = str(rec.get("source") or "")
    source, dropped = _comment_notebook_lines(source)
    notes += [f"cell {number}: notebook-only line not run: {d}" for d in dropped]
    source = _print_last_expression(source)
    if rec.get("kind") == "scale":
        head = (f"# cell {number}: %%hvd scale --np {rec.get('nps')} (ran at each size in the "
                f"notebook; here once, at {np} ranks)")
    else:
        head = f"# cell {number}: %%hvd {rec.get('line') or ''}".rstrip()
        size = rec.get("size")
        if size and int(size) != np:
            head += f"\n# (the notebook ran it on a pool of {size} ranks; here on {np})"
            notes.append(f"cell {number} ran on {size} ranks in the notebook, on {np} here")
    if rec.get("ok") is False:
        head += "\n# (it failed in the notebook; kept as it ran)"
    ranks = None if rec.get("kind") == "scale" else _cell_ranks(str(rec.get("line") or ""))
    return head + "\n" + _guard(source.rstrip() or "pass", ranks) + "\n"


def cell_record(line: str, source: str, size: int, ok: bool,
                hosts: Optional[str] = None, hostfile: Optional[str] = None,
                slurm: Optional[Mapping[str, Any]] = None,
                ray: Optional[str] = None) -> Dict[str, Any]:
    """The record of one ``%%hvd`` cell (the magics call this); ``ray``: the Ray pool's
    address (``local``: a Ray started for it), None for an MPI pool."""
    return {"kind": "cell", "line": line, "source": source, "size": size, "ok": ok,
            "hosts": hosts, "hostfile": hostfile, "slurm": dict(slurm) if slurm else None,
            "ray": ray}


def push_record(names: Sequence[str], values: Mapping[str, Any],
                ranks: Optional[Sequence[int]] = None) -> Dict[str, Any]:
    """The record of one ``%hvd push``: each value serialised now (it may change later)."""
    carried: Dict[str, str] = {}
    not_carried: Dict[str, str] = {}
    for name in names:
        expr, why = carry_value(name, values[name])
        if expr is None:
            not_carried[name] = str(why)
        else:
            carried[name] = expr
    return {"kind": "push", "names": list(names), "ranks": list(ranks) if ranks else None,
            "carried": carried, "not_carried": not_carried}
