"""``hvd_magic.run(fn, ...)``: run a Python function on N ranks through the same launcher."""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections import deque
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from .launch import launch
from .plan import Host, LaunchArgs, parse_hosts

_LAUNCH_OPTIONS = ("hostfile", "timeline_filename", "fusion_threshold_mb", "cycle_time_ms",
                   "stall_check_seconds", "cache_capacity", "output_filename", "network_interface",
                   "verbose", "min_np", "max_np", "host_discovery_script")


class RankError(RuntimeError):
    """``fn`` raised on a rank: ``.rank`` is the rank, ``.traceback`` its traceback text."""

    def __init__(self, rank: int, message: str, traceback: str) -> None:
        super().__init__(f"rank {rank} failed: {message}\n\n"
                         f"--- traceback on rank {rank} ---\n{traceback.rstrip()}")
        self.rank = rank
        self.traceback = traceback


def _hosts(hosts: Union[None, str, Sequence[Any]]) -> Optional[List[Host]]:
    if hosts is None:
        return None
    if isinstance(hosts, str):
        return parse_hosts(hosts)
    out: List[Host] = []
    for h in hosts:
        if isinstance(h, Host):
            out.append(h)
        elif isinstance(h, str):
            out.extend(parse_hosts(h))
        elif isinstance(h, tuple) and len(h) == 2:
            out.extend(parse_hosts(f"{h[0]}:{h[1]}"))
        else:
            raise TypeError(f"hosts entries are 'host:slots' strings or (host, slots) tuples, "
                            f"not {h!r}")
    return out


def run(fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Optional[Dict[str, Any]] = None,
        np: int = 2, hosts: Union[None, str, Sequence[Any]] = None, *,
        timeout: Optional[float] = None, env: Optional[Dict[str, str]] = None,
        stream: bool = True, **launch_options: Any) -> List[Any]:
    """Run ``fn(*args, **kwargs)`` on ``np`` ranks; return their results in rank order.

    Each rank calls ``hvd_magic.collectives.init()`` before ``fn``. ``hosts`` is
    ``"node1:4,node2:4"`` or a list of such strings / ``(host, slots)`` tuples. ``timeout``
    (seconds, default no limit) stops the job and raises TimeoutError. ``env`` adds variables
    for the ranks. ``stream`` prints the ranks' output here as it comes. Other keywords are
    hvdrun's options: ``hostfile``, ``timeline_filename``, ``fusion_threshold_mb``,
    ``cycle_time_ms``, ``stall_check_seconds``, ``cache_capacity``, ``output_filename``,
    ``network_interface``, ``verbose``, and for elastic training (``fn`` uses
    ``hvd.elastic.run``) ``min_np``, ``max_np`` and ``host_discovery_script``: the results
    are then those of the ranks the job ended with. An exception on a rank is raised here as
    :class:`RankError`. Multi-host runs
    pass ``fn`` and the results through a temporary directory that every host must see:
    set ``TMPDIR`` to a shared directory (e.g. on NFS).
    """
    if not callable(fn):
        raise TypeError(f"run(fn, ...) needs a callable, not {type(fn).__name__}")
    unknown = sorted(set(launch_options) - set(_LAUNCH_OPTIONS))
    if unknown:
        raise TypeError(f"run() got unknown option(s) {unknown}; valid: "
                        f"timeout, env, stream, {', '.join(_LAUNCH_OPTIONS)}")
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout={timeout!r}: give seconds > 0, or None for no limit")
    import cloudpickle

    workdir = tempfile.mkdtemp(prefix="hvd_magic_run_")
    try:
        with open(os.path.join(workdir, "fn.pkl"), "wb") as fh:
            cloudpickle.dump((fn, tuple(args), dict(kwargs or {})), fh)
        command = [sys.executable, "-m", "hvd_magic.runner.worker", workdir]
        largs = LaunchArgs(np=np, command=command,
                           hosts=_hosts(hosts), extra_env=dict(env or {}), **launch_options)
        # functions pickled by reference must import on the ranks as they do here
        largs.extra_env.setdefault("HVD_MAGIC_SYS_PATH", os.pathsep.join(p for p in sys.path if p))
        tail: deque = deque(maxlen=40)

        def on_line(name: str, line: str) -> None:
            tail.append(line)
            if stream:
                (sys.stdout if name == "stdout" else sys.stderr).write(line)

        rc = launch(largs, timeout=timeout, on_line=on_line)
        return _collect(workdir, np, rc, "".join(tail), elastic=largs.min_np is not None)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _collect(workdir: str, np: int, rc: int, tail: str, elastic: bool = False) -> List[Any]:
    """The ranks' results; an elastic job's come from the ranks it ended with (a lost rank
    leaves no result and a non-zero exit code behind)."""
    import cloudpickle

    records: Dict[int, Any] = {}
    for name in os.listdir(workdir):
        if name.startswith("rank") and name.endswith(".pkl"):
            with open(os.path.join(workdir, name), "rb") as fh:
                records[int(name[4:-4])] = cloudpickle.load(fh)
    if elastic and records:
        np, rc = max(records) + 1, 0
    failed = sorted(r for r, rec in records.items() if rec[0] == "error")
    if failed:
        r = failed[0]
        _, type_name, message, tb, exc = records[r]
        others = f" (also failed: ranks {failed[1:]})" if len(failed) > 1 else ""
        err = RankError(r, f"{type_name}: {message}{others}", tb)
        if isinstance(exc, BaseException):
            raise err from exc
        raise err
    missing = [r for r in range(np) if r not in records]
    if missing or rc != 0:
        raise RuntimeError(f"the job exited with code {rc} and rank(s) {missing} returned no "
                           f"result; last output:\n{tail}")
    return [records[r][1] for r in range(np)]
