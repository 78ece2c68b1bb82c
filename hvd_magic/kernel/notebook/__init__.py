"""Runs in the notebook kernel: the pool's side that starts, watches and stops the ranks.

:mod:`.plan` decides the command lines (pure), :mod:`.pool` runs them, :mod:`.liveness`
declares a rank lost, paused or survived, :mod:`.manager` keeps one pool per kernel,
:mod:`.output` turns what the ranks send into what the user reads.
"""
