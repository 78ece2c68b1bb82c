"""Pure: parse ``faulthandler`` dumps, group ranks whose stacks are the same, render text.

A dump is what :func:`faulthandler.dump_traceback` writes for every thread::

    Thread 0x00007f... (most recent call first):
      File "/path/train.py", line 12 in step

Frames are the user's own unless they lie in hvd_magic, in site-packages (installed
libraries) or in Python's standard library. Ranks are grouped by the frames of their threads
that run user code; threads with library frames only (hvd_magic's engine and telemetry
threads, the pool's event loop) are counted, not compared: their exact lines differ from
rank to rank without saying anything about the user's program.
"""
from __future__ import annotations

import os
import re
import sysconfig
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

_HEAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+) \(most recent call first\):")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _library_roots() -> Tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {_PACKAGE + os.sep}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        if paths.get(key):
            roots.add(os.path.abspath(paths[key]) + os.sep)
    return tuple(sorted(roots))


_ROOTS = _library_roots()


def is_user_file(path: str) -> bool:
    """The user's own code: not hvd_magic, not an installed library, not the stdlib."""
    if path.startswith("<frozen ") or "/site-packages/" in path or "/dist-packages/" in path:
        return False
    return not path.startswith(_ROOTS)


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str

    @property
    def user(self) -> bool:
        return is_user_file(self.file)

    def where(self) -> str:
        return f"{self.file}:{self.line}"

    def text(self) -> str:
        return f'File "{self.file}", line {self.line}, in {self.func}'


@dataclass
class Thread:
    ident: int
    frames: List[Frame] = field(default_factory=list)   # most recent call first
    current: bool = False                               # the thread the dump ran on

    @property
    def user(self) -> bool:
        return any(f.user for f in self.frames)

    def waiting_line(self) -> Optional[Frame]:
        """The innermost frame of the user's code (where this thread is in it)."""
        return next((f for f in self.frames if f.user), None)

    def in_hvd(self) -> bool:
        """The thread is inside hvd_magic, called from the user's code (it waits on a
        collective): some hvd_magic frame lies inside the innermost user frame."""
        for f in self.frames:
            if f.user:
                return False
            if f.file.startswith(_PACKAGE + os.sep):
                return True
        return False


#: The module whose signal handler writes a dump: its frames are left out.
_ANSWERING = os.path.join("stacks", "dump.py")


def parse(text: str) -> List[Thread]:
    """The threads of one dump (several dumps in one text: the last one), without the
    frames of the handler that wrote it."""
    threads: List[Thread] = []
    for line in text.splitlines():
        m = _HEAD.match(line)
        if m:
            ident = int(m.group(2), 16)
            if any(t.ident == ident for t in threads):   # a later dump starts
                threads = []
            threads.append(Thread(ident, current=m.group(1) == "Current thread"))
            continue
        m = _FRAME.match(line)
        if m and threads and not m.group(1).endswith(_ANSWERING):
            threads[-1].frames.append(Frame(m.group(1), int(m.group(2)), m.group(3)))
    return threads


@dataclass
class RankStack:
    """One rank's answer: its threads, or why there is none."""
    rank: int
    threads: Optional[List[Thread]] = None
    main_ident: int = 0                      # the main thread's ident (0: unknown)
    missing: str = ""                        # why no stack came (when threads is None)
    submitted: List[str] = field(default_factory=list)   # "allreduce 'x' at f.py:3", waiting

    def user_threads(self) -> List[Thread]:
        """Threads running user code, the main thread first."""
        ts = [t for t in self.threads or () if t.user]
        return sorted(ts, key=lambda t: (t.ident != self.main_ident,
                                        [(f.file, f.line) for f in t.frames]))

    def key(self) -> tuple:
        return tuple((t.ident == self.main_ident, tuple(t.frames)) for t in self.user_threads())

    def summary(self) -> str:
        """Where this rank is in the user's code, in one line, then where it submitted the
        collectives it waits for (when it said so)."""
        line = self._where()
        if self.submitted:
            line += "; it submitted " + ", ".join(self.submitted)
        return line

    def _where(self) -> str:
        if self.threads is None:
            return f"rank {self.rank}: {self.missing}"
        for t in self.user_threads():
            f = t.waiting_line()
            if t.in_hvd():
                return f"rank {self.rank}: waits in hvd_magic, called at {f.where()} (in {f.func})"
        ts = self.user_threads()
        if ts:
            f = ts[0].waiting_line()
            return f"rank {self.rank}: runs {f.where()} (in {f.func}), not in a collective"
        return f"rank {self.rank}: runs no code of yours (library code only)"


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))


def _origin(t: Thread) -> str:
    """A library-only thread, named by its outermost frame outside threading.py."""
    frames = [f for f in t.frames if not f.file.endswith(os.sep + "threading.py")]
    f = (frames or t.frames or [Frame("?", 0, "?")])[-1]
    return f"{os.path.basename(f.file)}:{f.func}"


def group(stacks: Iterable[RankStack]) -> List[List[RankStack]]:
    """Ranks with the same user-code stacks together; groups in rank order."""
    groups: Dict[tuple, List[RankStack]] = {}
    for s in sorted(stacks, key=lambda s: s.rank):
        if s.threads is None:
            continue
        groups.setdefault(s.key(), []).append(s)
    return sorted(groups.values(), key=lambda g: g[0].rank)


def render(stacks: Sequence[RankStack], title: str = "stacks", indent: str = "  ") -> str:
    """Text: one line per rank (where it is in the user's code), then each group of ranks
    with the same stack once: its user frames first (innermost first), then how many
    hvd_magic/library frames lie inside, then the threads in library code only."""
    out = [f"{title} of {len(stacks)} rank(s), the user's own code first:"]
    out += [indent + s.summary() for s in sorted(stacks, key=lambda s: s.rank)]
    for g in group(stacks):
        first = g[0]
        out.append(f"{indent}--- {_ranks([s.rank for s in g])}"
                   + (" (the same stack)" if len(g) > 1 else "") + " ---")
        for t in first.user_threads():
            name = "main thread" if t.ident == first.main_ident else f"thread 0x{t.ident:x}"
            out.append(f"{indent}{name} (most recent call first):")
            user = [f for f in t.frames if f.user]
            out += [f"{indent}  {f.text()}" for f in user]
            inner = []
            for f in t.frames:
                if f.user:
                    break
                inner.append(f)
            if inner:
                f = inner[0]
                out.append(f"{indent}  inside it: {len(inner)} frame(s) of hvd_magic/libraries, "
                           f"innermost {os.path.basename(f.file)}:{f.line} in {f.func}")
            outer = len(t.frames) - len(inner) - len(user)
            if outer:
                out.append(f"{indent}  (called from {outer} library frame(s))")
        lib = [t for t in first.threads or () if not t.user]
        if lib:
            names = sorted({_origin(t) for t in lib})
            out.append(f"{indent}{len(lib)} thread(s) in library code only: {', '.join(names)}")
    return "\n".join(out)
