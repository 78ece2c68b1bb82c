"""The pool behind ``%%hvd``: ipyparallel engines started by ``mpiexec`` (engine i = rank i).

:mod:`.plan` decides (pure), :mod:`.pool` does, :mod:`.manager` keeps one pool per kernel,
:mod:`.output` defines the :class:`~.output.OutputSink` protocol the renderers implement.
``python -m hvd_magic.kernel install`` installs a Jupyter kernel in which every cell runs on
the pool. ipyparallel is imported only when a pool starts.
"""
from .notebook.manager import PoolManager, make_config
from .notebook.output import OutputSink, PoolCellError, PoolCellInterrupted, PoolCellTimeout, \
    RankDiedError, RankFailure, TextSink
from .notebook.plan import PoolConfig, PoolPlan, plan_pool
from .notebook.cells import CellOutcome
from .notebook.output import PoolError, remote_error_text
from .notebook.pool import Pool

__all__ = ["CellOutcome", "OutputSink", "Pool", "PoolCellError", "PoolCellInterrupted",
           "PoolCellTimeout", "PoolConfig", "PoolError", "PoolManager", "PoolPlan",
           "RankDiedError", "RankFailure", "TextSink", "make_config", "plan_pool",
           "remote_error_text"]
