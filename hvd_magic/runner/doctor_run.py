"""Doing, thinly: start the probe on the pool ``%hvd doctor`` was asked about, read its record,
hand it to :func:`.doctor.analyse`. Also a command line::

    python -m hvd_magic.runner.doctor_run -np 2 -H a:1,b:1 [--network-interface eth0]
        [--model-bytes 2e6 --step-time 0.05] [--json]
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, List, Mapping, Optional, Sequence

from .doctor import Report, analyse, failed_report, render_text
from .doctor_probe import PREFIX
from .plan import Host, LaunchArgs, is_single_host, parse_hosts

#: Seconds the probe may take before the doctor gives up (unreachable hosts hang ssh).
TIMEOUT_S = 90.0


def probe(np: int, hosts: Optional[Sequence[Host]] = None, hostfile: Optional[str] = None,
          network_interface: Optional[str] = None, env: Optional[Mapping[str, str]] = None,
          timeout: float = TIMEOUT_S) -> Dict[str, Any]:
    """Run the probe on ``np`` ranks placed as a pool with these arguments would be; return
    its record. Raises RuntimeError naming what failed (a host not reached, a rank's error)."""
    from . import launch
    args = LaunchArgs(np=np, command=[sys.executable, "-m", "hvd_magic.runner.doctor_probe"],
                      hosts=list(hosts) if hosts else None, hostfile=hostfile,
                      network_interface=network_interface)
    argv, out = launch.prepare(args, env)
    if not is_single_host(args, launch.local_names()):
        # one rank per host first, so each pair of hosts has ranks to ping-pong
        out.setdefault("PRTE_MCA_rmaps_default_mapping_policy", "node")
    lines: List[str] = []
    try:
        rc = launch.execute(argv, out, timeout=timeout,
                            on_line=lambda _name, line: lines.append(line))
    except TimeoutError:
        raise RuntimeError(f"hvd doctor: the probe did not finish within {timeout:g} s; a host "
                           "is probably unreachable (check ssh to each host and its "
                           "firewall). Last output:\n" + "".join(lines[-20:])) from None
    found = [ln[len(PREFIX):] for ln in lines if ln.startswith(PREFIX)]
    if rc != 0 or not found:
        raise RuntimeError(f"hvd doctor: the probe failed (exit {rc}); a host may be "
                           "unreachable or lack this Python environment. Its output:\n"
                           + "".join(lines[-30:]))
    return json.loads(found[-1])


def run_doctor(np: int, hosts: Optional[Sequence[Host]] = None, hostfile: Optional[str] = None,
               *, model_bytes: Optional[float] = None, step_time: Optional[float] = None,
               network_interface: Optional[str] = None,
               env: Optional[Mapping[str, str]] = None) -> Report:
    """Probe, then analyse: the :class:`.doctor.Report` of the pool these arguments start."""
    try:
        record = probe(np, hosts, hostfile, network_interface, env)
    except RuntimeError as exc:
        return failed_report(np, str(exc), str(exc))
    return analyse(record, model_bytes, step_time)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hvd_magic.runner.doctor_run",
                                description="pre-flight check of a pool (see docs/doctor.md)")
    p.add_argument("-np", "--np", type=int, default=2)
    where = p.add_mutually_exclusive_group()
    where.add_argument("-H", "--hosts", default=None)
    where.add_argument("--hostfile", default=None)
    p.add_argument("--network-interface", default=None)
    p.add_argument("--model-bytes", type=float, default=None)
    p.add_argument("--step-time", type=float, default=None)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    ns = p.parse_args(argv)
    rep = run_doctor(ns.np, parse_hosts(ns.hosts) if ns.hosts else None, ns.hostfile,
                     model_bytes=ns.model_bytes, step_time=ns.step_time,
                     network_interface=ns.network_interface)
    if ns.json:
        from dataclasses import asdict
        print(json.dumps(asdict(rep)))
    else:
        print(render_text(rep))
    return 1 if rep.problems else 0


if __name__ == "__main__":
    sys.exit(main())
