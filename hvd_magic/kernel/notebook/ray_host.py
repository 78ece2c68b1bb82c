"""Runs beside the notebook kernel: the driver of a local Ray pool's Ray, inside a
loopback-only network namespace.

``python -m hvd_magic.kernel.notebook.ray_host`` moves itself into a new network namespace
with only ``lo`` up (:func:`hvd_magic.runner.netns.enter_loopback_namespace`), so the Ray it
starts there (GCS, raylet, workers, which listen on every address they see) and the ranks'
engines are reachable from nowhere else; the engines reach the pool's controller over Unix
sockets, which cross network namespaces. It answers :class:`~.ray_pool.HostedRanks`'s
requests, one JSON line each on stdin, with one JSON line on stdout: ``connect`` (start
Ray), ``place`` (the actors and engines), ``poll`` (what ended), ``stop``. When its stdin
closes (the kernel ended) it stops its Ray and exits.
"""
from __future__ import annotations

import json
import sys
from typing import Any, Dict


def main() -> None:
    from ...runner.netns import enter_loopback_namespace
    enter_loopback_namespace()
    from ...runner.options import RAY_LOCAL
    from .ray_pool import RayRanks
    ranks = RayRanks()
    out = sys.stdout

    def reply(msg: Dict[str, Any]) -> None:
        out.write(json.dumps(msg) + "\n")
        out.flush()

    try:
        for line in sys.stdin:
            req = json.loads(line)
            cmd = req.get("cmd")
            try:
                if cmd == "connect":
                    reply({"gcs": ranks.connect(RAY_LOCAL, int(req["np"]))})
                elif cmd == "place":
                    reply(ranks.place(int(req["np"]), dict(req["env"]), float(req["limit"])))
                elif cmd == "poll":
                    reply({"exits": ranks.poll(float(req.get("wait", 0.0)))})
                elif cmd == "stop":
                    break
            except Exception as exc:  # noqa: BLE001 - the kernel shows it
                reply({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        ranks.stop()
        reply({"stopped": True})


if __name__ == "__main__":
    main()
