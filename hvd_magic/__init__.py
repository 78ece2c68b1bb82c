"""hvd_magic: Horovod-style data-parallel training from a Jupyter notebook.

``%load_ext hvd_magic`` then ``%%hvd -np 4`` runs a cell on 4 MPI ranks; on each rank
``import hvd_magic.torch as hvd`` gives Horovod's API. Outside Jupyter, ``hvdrun -np 4
python train.py`` or :func:`hvd_magic.run` start the same ranks.
"""
__version__ = "0.1.0"


def run(fn, args=(), kwargs=None, np=2, hosts=None, **launch):
    """Run ``fn(*args, **kwargs)`` on ``np`` ranks; return the list of their results."""
    from .runner.api import run as _run
    return _run(fn, args=args, kwargs=kwargs, np=np, hosts=hosts, **launch)


def report(samples: int) -> None:
    """Count ``samples`` processed on this rank (throughput and scaling efficiency in the
    live ``%%hvd`` panel). Cheap; does nothing outside a live cell."""
    from .collectives.progress import report as _report
    _report(samples)


def load_ipython_extension(ip):
    """``%load_ext hvd_magic``: register ``%%hvd``, ``%hvd`` and ``%autohvd``."""
    from .magics import load_ipython_extension as _load
    _load(ip)


def unload_ipython_extension(ip):
    """``%unload_ext hvd_magic``: turn %autohvd off and stop the pool."""
    from .magics import unload_ipython_extension as _unload
    _unload(ip)
