"""Every rank's Python stack, on demand and at a stall.

:mod:`.dump` is the doing (each rank registers a signal handler that writes every thread's
stack to a per-rank file without needing the GIL; a gatherer signals the ranks and reads
what they wrote, within a timeout); :mod:`.group` is pure (parse those dumps, group ranks
with the same stack, render them with the user's own frames first). Standard library only:
the launcher and the notebook side import it without MPI.
"""
