"""Runs in the notebook kernel.

Reading a running cell from ipyparallel, for :class:`.pool.Pool`: each rank's future,
the pump that moves output and telemetry to the sink, and what a finished cell left behind.
Also the clean-up of pool directories that a killed kernel left."""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List

from .output import OutputSink

IPP_HINT = ("the pool needs ipyparallel: `pip install ipyparallel` "
            "(or `pip install hvd_magic[notebook]`)")


def ipyparallel() -> Any:
    """The ipyparallel module, imported when a pool first needs it."""
    try:
        import ipyparallel as ipp
    except ImportError as exc:
        raise ImportError(IPP_HINT) from exc
    return ipp


def short_tmp() -> str:
    base = tempfile.gettempdir()
    return base if len(base) < 40 else "/tmp"


def clean_stale_dirs(base: str, min_age_s: float = 60.0) -> List[str]:
    """Remove pool directories (``hvdm-*`` in ``base``) of this user that no running
    controller names and that are older than ``min_age_s``: what a kernel killed with
    SIGKILL left behind. Returns the removed paths."""
    import glob

    import psutil
    candidates = []
    for path in glob.glob(os.path.join(base, "hvdm-*")):
        try:
            st = os.stat(path)
        except OSError:
            continue
        if st.st_uid == os.getuid() and time.time() - st.st_mtime > min_age_s:
            candidates.append(path)
    if not candidates:
        return []
    in_use = set()
    for proc in psutil.process_iter(["cmdline"]):
        line = " ".join(proc.info["cmdline"] or [])
        if "--profile-dir=" in line:
            in_use.update(p for p in candidates if f"--profile-dir={p}" in line)
    removed = [p for p in candidates if p not in in_use]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


@dataclass
class CellOutcome:
    """What a cell left behind: per-rank result bundles and execution counts."""

    ranks: List[int]
    results: Dict[int, Dict[str, Any]] = field(default_factory=dict)
    counts: Dict[int, int] = field(default_factory=dict)


def rank_futures(ar: Any) -> List[Any]:
    """The per-rank futures of a cell's AsyncResult (completion, exception, output
    callbacks). ipyparallel 9.2 offers no public per-engine future, so ``_children`` is the
    one private attribute the pool reads; tests/test_pool.py pins its shape."""
    return ar._children


def rank_done(ar: Any, i: int) -> bool:
    return rank_futures(ar)[i].done()


def rank_error(ar: Any, i: int, md: Dict[str, Any]) -> Any:
    """The exception rank ``i``'s part of the cell ended with (None: none, or not done).
    A task stranded on an engine the controller dropped ends with that error as its
    *result*, not as an exception or an ``error`` output."""
    err = md.get("error")
    fut = rank_futures(ar)[i]
    if err is None and fut.done():
        try:
            err = fut.exception()
            if err is None:
                res = fut.result()
                err = res if isinstance(res, BaseException) else None
        except Exception:  # noqa: BLE001 - a cancelled (aborted) task: no error of its own
            err = None
    return err


def engine_lost(err: Any) -> bool:
    """Whether ``err`` is ipyparallel saying the rank's engine went away: an EngineError,
    or the RemoteError of that name it gives a task stranded on a dropped engine."""
    return (isinstance(err, ipyparallel().error.EngineError)
            or getattr(err, "ename", None) == "EngineError")


def notify(sink: Any, name: str, *args: Any) -> None:
    """Call ``sink.name(*args)`` when the sink has that optional method."""
    fn = getattr(sink, name, None)
    if fn is not None:
        fn(*args)


class Pump:
    """Moves new output and telemetry from ipyparallel's per-engine metadata to a sink (main
    thread only).

    ipyparallel's IO thread appends each message to the metadata before running callbacks;
    reading the metadata (not the messages) means nothing is lost or doubled even for output
    that arrived before the callbacks were attached. Telemetry batches are the ranks'
    ``data_message`` entries, keyed ``hvdm.<rank>.<seq>`` (:mod:`..ranks.telemetry`).
    """

    def __init__(self, ar: Any, targets: List[int], sink: OutputSink) -> None:
        self.ar, self.targets, self.sink = ar, targets, sink
        self.offsets: Dict[tuple, int] = {}
        self.seen: set = set()
        self.ingest = getattr(sink, "ingest", None)
        self.poll = getattr(sink, "poll", None)     # the sink's own periodic work, if any

    def flush(self) -> None:
        batches: List[Any] = []
        mds = self.ar.metadata          # (the property parses every rank's dates: once)
        for i, r in enumerate(self.targets):
            md = mds[i]
            for name in ("stdout", "stderr"):
                text = md.get(name) or ""
                off = self.offsets.get((r, name), 0)
                if len(text) > off:
                    self.sink.stream(r, name, text[off:])
                self.offsets[(r, name)] = len(text)
            outputs = md.get("outputs") or []
            seen = self.offsets.get((r, "outputs"), 0)
            for item in outputs[seen:]:
                self.sink.display(r, item.get("data", {}), item.get("metadata", {}))
            self.offsets[(r, "outputs")] = len(outputs)
            data = md.get("data")
            # ipyparallel's IO thread adds each data message's keys to this dict, in arrival
            # order, and every batch has a key of its own: only keys past those read before
            # are new (a long cell has thousands; each is looked at once). ``list`` first: the
            # dict may grow meanwhile.
            n = self.offsets.get((r, "data"), 0)
            if data and self.ingest is not None and len(data) > n:
                for key in list(data)[n:]:
                    if key.startswith("hvdm.") and key not in self.seen:
                        self.seen.add(key)
                        batches.append(data[key])
                self.offsets[(r, "data")] = len(data)
        if batches:
            batches.sort(key=lambda b: (b.get("rank", 0), b.get("seq", 0)))
            self.ingest(batches)
        if self.poll is not None:
            self.poll()
