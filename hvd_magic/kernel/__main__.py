"""Runs as a command, and as the Jupyter kernel it installs.

``python -m hvd_magic.kernel install [--np N] [--user | --prefix P | --sys-prefix]``
installs the Jupyter kernel "Python (hvd_magic, N ranks)": every cell runs on an N-rank pool.
``python -m hvd_magic.kernel launch --np N -f CONNECTION_FILE`` is what that kernel runs.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from typing import Dict, List, Optional


def kernel_spec(np: int, python: str = sys.executable) -> Dict[str, object]:
    """The ``kernel.json`` of the N-rank kernel."""
    return {"argv": [python, "-m", "hvd_magic.kernel", "launch", "--np", str(np),
                     "-f", "{connection_file}"],
            "display_name": f"Python (hvd_magic, {np} ranks)",
            "language": "python",
            "interrupt_mode": "signal",
            "metadata": {"debugger": False}}


def install(np: int = 2, name: Optional[str] = None, user: bool = False,
            prefix: Optional[str] = None) -> str:
    """Install the kernel spec; return the directory it went to."""
    from jupyter_client.kernelspec import KernelSpecManager
    if isinstance(np, bool) or not isinstance(np, int) or np < 1:
        raise ValueError(f"--np {np!r}: give a whole number of ranks >= 1, e.g. --np 2")
    name = name or f"hvd_magic_{np}"
    tmp = tempfile.mkdtemp(prefix="hvd_kernel_")
    try:
        with open(os.path.join(tmp, "kernel.json"), "w") as fh:
            json.dump(kernel_spec(np), fh, indent=1)
        return KernelSpecManager().install_kernel_spec(tmp, name, user=user, prefix=prefix)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def launch(np: int, argv: List[str]) -> None:
    """Run an ipykernel with the extension loaded and %autohvd on (``-np N``)."""
    os.environ["HVD_MAGIC_AUTOHVD"] = f"-np {np}"
    from ipykernel.kernelapp import IPKernelApp
    IPKernelApp.launch_instance(argv=argv + ["--IPKernelApp.extensions=['hvd_magic']"])


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point: ``install`` or ``launch``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m hvd_magic.kernel")
    sub = p.add_subparsers(dest="cmd", required=True)
    ins = sub.add_parser("install", help="install the Jupyter kernel")
    ins.add_argument("--np", type=int, default=2, help="ranks of the pool (default 2)")
    ins.add_argument("--name", default=None, help="kernel name (default hvd_magic_N)")
    where = ins.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="install for this user")
    where.add_argument("--prefix", default=None, help="install under PREFIX/share/jupyter")
    where.add_argument("--sys-prefix", action="store_true", help="install into sys.prefix")
    run = sub.add_parser("launch", help="run the kernel (Jupyter does this)")
    run.add_argument("--np", type=int, default=2)
    args, rest = p.parse_known_args(argv)
    if args.cmd == "launch":
        launch(args.np, rest)
        return 0
    if rest:
        p.error(f"unknown arguments {rest}")
    try:
        path = install(args.np, args.name, args.user,
                       sys.prefix if args.sys_prefix else args.prefix)
    except ValueError as exc:
        p.error(str(exc))
    print(f"installed kernel 'Python (hvd_magic, {args.np} ranks)' in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
