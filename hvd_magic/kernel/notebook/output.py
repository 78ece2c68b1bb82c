"""Runs in the notebook kernel. Where a pool cell's output goes, and how failures read.

The pool never prints: it hands every piece of output to an :class:`OutputSink`. The magics
use :class:`TextSink` (rank-prefixed lines, ``[0] ...``); a widget renderer (one output area
per rank) implements the same protocol later.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Protocol, Sequence, TextIO, Tuple

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_CELL_NO = re.compile(r"In ?\[\d+\]")


def strip_ansi(text: str) -> str:
    """``text`` without terminal colour codes."""
    return _ANSI.sub("", text)


def is_progress(status: str) -> bool:
    """Whether a status line reports progress that its next line supersedes: the pool
    writes those with " ..." ("hvd: starting 2 ranks ... 1/2 ready (0.4 s)", "hvd: growing
    the pool from 2 to 3 ranks ..."); its other lines (where the ranks run, ready, notes)
    stay worth reading."""
    return " ..." in status


class OutputSink(Protocol):
    """Receives a pool cell's output as it happens (all calls from the kernel's main thread)."""

    def status(self, text: str) -> None:
        """A note about the pool: starting (progress, see :func:`is_progress`), ready,
        restarted, interrupted."""

    def stream(self, rank: int, name: str, text: str) -> None:
        """A piece of ``stdout``/``stderr`` (``name``) from ``rank``; not line-aligned."""

    def display(self, rank: int, data: Mapping[str, Any], metadata: Mapping[str, Any]) -> None:
        """A rich display (``display(...)`` on the rank): a MIME bundle."""

    def result(self, rank: int, data: Mapping[str, Any]) -> None:
        """The cell's value on ``rank`` (a MIME bundle; ``text/plain`` at least)."""

    def close(self) -> None:
        """The cell finished: flush what is buffered."""

    # Optional, for sinks that observe the whole cell (the live panel, the text summary):
    #   telemetry_interval: float   the ranks send a telemetry batch this often (s)
    #   begin(ranks, size, code)    before the cell is sent
    #   ingest(batches)             telemetry batches (dicts, see kernel.ranks.telemetry)
    #   poll()                      periodic work on the kernel's main thread while it runs
    #   failed(exc) / finalize()    after the cell: it raised a PoolCellError / otherwise


class TextSink:
    """Rank-prefixed text: each line a rank prints appears as ``[rank] line`` as soon as
    the line is complete; results as ``[rank] Out: value``."""

    def __init__(self, out: Optional[TextIO] = None, err: Optional[TextIO] = None,
                 stream_output: bool = True) -> None:
        self._out, self._err = out, err
        self.stream_output = stream_output
        self._partial: Dict[Tuple[int, str], str] = {}
        self._held: List[Tuple[int, str, str]] = []

    def _file(self, name: str) -> TextIO:
        if name == "stderr":
            return self._err or sys.stderr
        return self._out or sys.stdout

    def status(self, text: str) -> None:
        f = self._file("stderr")
        f.write(text if text.endswith(("\n", "\r")) else text + "\n")
        f.flush()

    def stream(self, rank: int, name: str, text: str) -> None:
        buf = self._partial.get((rank, name), "") + text
        lines = buf.split("\n")
        self._partial[(rank, name)] = lines.pop()
        if lines:
            block = "".join(f"[{rank}] {line}\n" for line in lines)
            if self.stream_output:
                f = self._file(name)
                f.write(block)
                f.flush()
            else:
                self._held.append((rank, name, block))

    def display(self, rank: int, data: Mapping[str, Any], metadata: Mapping[str, Any]) -> None:
        self._flush_held()
        if set(data) <= {"text/plain"}:
            self.stream(rank, "stdout", str(data.get("text/plain", "")) + "\n")
            return
        from IPython.display import display
        self._file("stdout").write(f"[{rank}]\n")
        display(dict(data), metadata=dict(metadata), raw=True)

    def result(self, rank: int, data: Mapping[str, Any]) -> None:
        self._flush_held()
        text = str(data.get("text/plain", ""))
        lines = text.split("\n")
        pad = " " * len(f"[{rank}] Out: ")
        body = f"[{rank}] Out: {lines[0]}\n" + "".join(f"{pad}{line}\n" for line in lines[1:])
        f = self._file("stdout")
        f.write(body)
        f.flush()

    def _flush_held(self) -> None:
        held, self._held = self._held, []
        for rank in sorted({r for r, _, _ in held}):     # --no-stream: grouped by rank
            for r, name, block in held:
                if r == rank:
                    self._file(name).write(block)

    def close(self) -> None:
        for (rank, name), rest in sorted(self._partial.items()):
            if rest:
                self._partial[(rank, name)] = ""
                self.stream(rank, name, rest + "\n")
        self._flush_held()
        for name in ("stdout", "stderr"):
            self._file(name).flush()


@dataclass
class RankFailure:
    """One rank's failure in a cell."""

    rank: int
    kind: str                       # "error" (raised), "died", "interrupted", "timeout"
    ename: str = ""
    evalue: str = ""
    traceback: List[str] = field(default_factory=list)

    def summary(self) -> str:
        if self.kind == "died":
            return f"died: {self.evalue}"
        return f"{self.ename}: {self.evalue}" if self.ename else self.kind


def _same(text: str) -> str:
    return _CELL_NO.sub("In[#]", strip_ansi(text))


def group_failures(failures: Sequence[RankFailure]) -> List[Tuple[List[int], RankFailure]]:
    """Failures with identical tracebacks merged: ``[(ranks, failure)]``. Colours and the
    cell number (``In [7]``, which differs between ranks after ``--ranks`` cells) are
    ignored in the comparison."""
    groups: Dict[Tuple[str, str, str, str], Tuple[List[int], RankFailure]] = {}
    for f in sorted(failures, key=lambda f: f.rank):
        key = (f.kind, f.ename, _same(f.evalue), _same("\n".join(f.traceback)))
        if key in groups:
            groups[key][0].append(f.rank)
        else:
            groups[key] = ([f.rank], f)
    return list(groups.values())


def ranks_text(ranks: Sequence[int]) -> str:
    """``rank 1`` / ``ranks 0, 2``."""
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def n_ranks(n: int) -> str:
    """``1 rank`` / ``2 ranks``."""
    return f"{n} rank" if n == 1 else f"{n} ranks"


def remote_error_text(exc: BaseException) -> str:
    """One line for an error the ranks raised in a push/pull/apply: ``NameError on ranks 0,
    1: name 'x' is not defined`` instead of ipyparallel's CompositeError listing."""
    elist = getattr(exc, "elist", None)
    if not elist:
        return f"{type(exc).__name__}: {exc}"
    groups: Dict[tuple, List[int]] = {}
    for ename, evalue, _tb, info in elist:
        groups.setdefault((ename, evalue), []).append((info or {}).get("engine_id", -1))
    return "; ".join(f"{ename} on {ranks_text(r)}: {evalue}" for (ename, evalue), r in groups.items())


class PoolCellError(Exception):
    """A pool cell failed on some ranks. ``.failures`` has one :class:`RankFailure` per rank.

    IPython shows it through ``_render_traceback_``: one headline naming the ranks, then each
    distinct traceback once.
    """

    def __init__(self, failures: Sequence[RankFailure], note: str = "") -> None:
        self.failures = list(failures)
        self.note = note
        ranks = sorted(f.rank for f in self.failures)
        kinds = sorted({f.summary() for f in self.failures})
        if all(f.kind == "died" for f in self.failures):
            head = "; ".join(f"rank {f.rank} {f.summary()}" for f in self.failures)
        else:
            head = f"{ranks_text(ranks)} failed" + (f": {kinds[0]}" if len(kinds) == 1 else "")
        super().__init__(head + (f" ({note})" if note else ""))

    @property
    def ranks(self) -> List[int]:
        return sorted(f.rank for f in self.failures)

    def _render_traceback_(self) -> List[str]:
        lines = [f"{type(self).__name__}: {self}"]
        for ranks, f in group_failures(self.failures):
            lines.append("")
            if f.kind == "died":
                lines.append(f"--- {ranks_text(ranks)}: {f.evalue}")
                lines.extend(f.traceback)
                continue
            lines.append(f"--- {ranks_text(ranks)}: {f.summary()}")
            lines.extend(f.traceback or [f.summary()])
        return lines


class RankDiedError(PoolCellError):
    """A rank of the pool ended (signal, os._exit, OOM): the cell failed and the pool is gone."""


class PoolCellTimeout(PoolCellError, TimeoutError):
    """The cell ran past ``--timeout``; its ranks were interrupted."""


class PoolCellInterrupted(KeyboardInterrupt):
    """The cell was interrupted; ``.note`` says how the ranks were stopped and whether the
    pool is still there. Shown by IPython without the magic's own frames."""

    def __init__(self, note: str) -> None:
        super().__init__(note)
        self.note = note

    def _render_traceback_(self) -> List[str]:
        return [f"KeyboardInterrupt: {self.note}"]


class PoolError(RuntimeError):
    """The pool could not start, or is gone. IPython shows the message (with the logs'
    tails), not this module's frames."""

    def _render_traceback_(self) -> List[str]:
        return [f"PoolError: {self}"]
