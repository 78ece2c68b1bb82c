"""The launcher: ``hvdrun`` (:mod:`.cli`) and :func:`hvd_magic.run` (:mod:`.api`).

:mod:`.plan` decides the ``mpiexec`` command line and environment (pure, unit-tested);
:mod:`.launch` finds and runs ``mpiexec``; :mod:`.netns` keeps single-host jobs in a
loopback-only network namespace; :mod:`.worker` is one rank of :func:`hvd_magic.run`.
"""
from .api import RankError, run
from .plan import Host, LaunchArgs, parse_hostfile, parse_hosts, plan_launch

__all__ = ["Host", "LaunchArgs", "RankError", "parse_hostfile", "parse_hosts", "plan_launch", "run"]
