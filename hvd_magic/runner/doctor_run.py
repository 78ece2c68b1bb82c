"""Doing, thinly: start the probe on the pool ``%hvd doctor`` was asked about, read its record,
hand it to :func:`.doctor.analyse`. Also a command line::

    python -m hvd_magic.runner.doctor_run -np 2 -H a:1,b:1 [--network-interface eth0]
        [--model-bytes 2e6 --step-time 0.05] [--json]
    python -m hvd_magic.runner.doctor_run --profile NAME | --slurm [--nodes 2 ...]
    python -m hvd_magic.runner.doctor_run --what-if --num-hosts 4 --ranks-per-host 8
        --link-gbit 25 --model ResNet50 --images-per-sec 400 --batch 64 [--json]

A Slurm pool or a profile's goes through ``hvdrun`` itself (allocation, set-up lines).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from .doctor import Report, analyse, failed_report, render_text
from .doctor_probe import PREFIX
from .options import DOCTOR_CLI, SLURM_OPTIONS, add_options, without_message
from .plan import Host, LaunchArgs, is_single_host, parse_hosts
from .whatif import WhatIfReport, as_dict, render as render_what_if, scenario_from, what_if

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


def hvdrun_options(np: Optional[int], slurm: Optional[Mapping[str, Any]] = None,
                   profile: Optional[str] = None,
                   network_interface: Optional[str] = None) -> List[str]:
    """``hvdrun`` options for a pool on Slurm (``slurm``: partition, time, nodes,
    gpus_per_node as ``%%hvd --slurm`` took them) or from a cluster profile."""
    out = [] if np is None else ["-np", str(np)]
    if profile is not None:
        out += ["--profile", profile]
    if slurm is not None:
        out.append("--slurm")
        for key, value in slurm.items():
            if value is not None:
                out += [f"--{key.replace('_', '-')}", str(value)]
    if network_interface:
        out += ["--network-interface", network_interface]
    return out


def probe_via_hvdrun(options: Sequence[str], env: Optional[Mapping[str, str]] = None,
                     timeout: float = TIMEOUT_S) -> Dict[str, Any]:
    """The probe started by ``hvdrun OPTIONS`` (a Slurm allocation, a profile's hosts and
    set-up lines: what ``hvdrun`` does for them, the pool does too)."""
    import subprocess
    argv = [sys.executable, "-m", "hvd_magic.runner.cli", *options, sys.executable, "-m",
            "hvd_magic.runner.doctor_probe"]
    try:
        proc = subprocess.run(argv, env=None if env is None else dict(env), capture_output=True,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        tail = exc.stdout if isinstance(exc.stdout, str) else (exc.stdout or b"").decode()
        raise RuntimeError(f"hvd doctor: `hvdrun {' '.join(options)}` did not finish within "
                           f"{timeout:g} s. Last output:\n{tail[-2000:]}") from None
    found = [ln[len(PREFIX):] for ln in proc.stdout.splitlines() if ln.startswith(PREFIX)]
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"hvd doctor: the probe failed (exit {proc.returncode}) under "
                           f"`hvdrun {' '.join(options)}`. Its output:\n"
                           + (proc.stdout + proc.stderr)[-3000:])
    return json.loads(found[-1])


def run_doctor(np: Optional[int], hosts: Optional[Sequence[Host]] = None,
               hostfile: Optional[str] = None, *, model_bytes: Optional[float] = None,
               step_time: Optional[float] = None, network_interface: Optional[str] = None,
               env: Optional[Mapping[str, str]] = None,
               slurm: Optional[Mapping[str, Any]] = None,
               profile: Optional[str] = None) -> Report:
    """Probe, then analyse: the :class:`.doctor.Report` of the pool these arguments start.
    ``np`` None: the profile's (with ``profile``), else 2."""
    try:
        if slurm is not None or profile is not None:
            record = probe_via_hvdrun(hvdrun_options(np, slurm, profile, network_interface),
                                      env)
        else:
            record = probe(np or 2, hosts, hostfile, network_interface, env)
    except RuntimeError as exc:
        return failed_report(np or 0, str(exc), str(exc))
    return analyse(record, model_bytes, step_time)


def named_model(name: str) -> Tuple[float, int]:
    """``--model NAME`` outside a notebook: (gradient bytes, tensors) of the torchvision or
    Keras applications model of that name, built without weights."""
    from .model_size import model_bytes
    nbytes, tensors, _lib = model_bytes(name)
    return nbytes, tensors


def run_what_if(options: Mapping[str, Any], model_bytes: Optional[float] = None,
                tensors: Optional[int] = None) -> WhatIfReport:
    """``--what-if``: the forecast of the cluster ``options`` describe. ``model_bytes``
    None: from ``options["model_bytes"]``, else built from ``options["model"]``'s name.
    Raises ValueError saying what is missing or wrong."""
    if model_bytes is None:
        model_bytes = options.get("model_bytes")
    if model_bytes is None and options.get("model"):
        model_bytes, tensors = named_model(options["model"])
    if model_bytes is None:
        raise ValueError("what-if: give the gradient bytes per step: --model-bytes B or "
                         "--model NAME")
    return what_if(scenario_from(options, model_bytes, tensors))


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog=DOCTOR_CLI,
                                description="pre-flight check of a pool (see docs/doctor.md)")
    add_options(p, DOCTOR_CLI)
    ns = p.parse_args(argv)
    if without_message(ns, DOCTOR_CLI):
        p.error(without_message(ns, DOCTOR_CLI))
    if ns.what_if:
        try:
            forecast = run_what_if(vars(ns))
        except ValueError as exc:
            p.error(str(exc))
        print(json.dumps(as_dict(forecast)) if ns.json else render_what_if(forecast))
        return 0
    for flag, dest in (("--fusion-threshold-mb", "fusion_threshold_mb"),
                       ("--cycle-time-ms", "cycle_time_ms")):
        if getattr(ns, dest) is not None:
            p.error(f"{flag} goes with --what-if (the probe runs with the pool's own settings)")
    model_bytes = ns.model_bytes
    if ns.model is not None:
        try:
            model_bytes = named_model(ns.model)[0]
        except ValueError as exc:
            p.error(str(exc))
    slurm = {k: getattr(ns, k) for k in SLURM_OPTIONS} if ns.slurm else None
    rep = run_doctor(ns.np, parse_hosts(ns.hosts) if ns.hosts else None, ns.hostfile,
                     model_bytes=model_bytes, step_time=ns.step_time,
                     network_interface=ns.network_interface, slurm=slurm,
                     profile=ns.profile)
    if ns.json:
        from dataclasses import asdict
        print(json.dumps(asdict(rep)))
    else:
        print(render_text(rep))
    return 1 if rep.problems else 0


if __name__ == "__main__":
    sys.exit(main())
