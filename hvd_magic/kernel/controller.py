"""Runs in the pool's ipyparallel controller process.

Entry point of the pool's ipyparallel controller (``python -m hvd_magic.kernel.controller``).

Two changes to ``ipcontroller``: the umask is 077, so connection files and Unix sockets are
their owner's only from the moment they exist; and ipyparallel 9.2's ``ipc://`` addresses are
made consistent (its controller binds ``ipc://PATH-PORT`` while clients and engines connect to
``ipc://PATH:PORT``, so engines would never register).
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Any, Optional


def _construct_url(self: Any, kind: str, channel: str, index: Optional[int] = None) -> str:
    """``IPController.construct_url`` with ``:`` before the port for every transport."""
    info = {"engine": self.engine_info, "client": self.client_info,
            "internal": self.internal_info}.get(kind)
    if info is None:
        raise ValueError(f"kind must be 'engine', 'client', or 'internal', not {kind!r}")
    port = info[channel]
    if index is not None:
        port = port[index]
    return f"{info['interface']}:{port}"


class _QuietTelemetry(logging.Filter):
    """Drops the hub's warning about ``data_message`` on IOPub: the ranks' live telemetry
    (hvd_magic.kernel.ranks.telemetry) arrives as such messages several times a second while a
    cell runs, and each one wrote a warning line to controller.log (~8 lines a second on 2
    ranks, for as long as the pool lives)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "unhandled iopub msg_type: %r"
                    and record.args == ("data_message",))


def main() -> None:
    """Patch the controller class, then run ipyparallel's controller app."""
    os.umask(0o077)
    from ipyparallel.controller.app import IPController, main as controller_main

    logging.getLogger(IPController.__name__).addFilter(_QuietTelemetry())

    IPController.construct_url = _construct_url  # type: ignore[method-assign]
    controller_main()


if __name__ == "__main__":
    sys.exit(main())
