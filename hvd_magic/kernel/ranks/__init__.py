"""Runs in each rank (a pool engine, one MPI process per rank): the engine's entry point
(:mod:`.engine`), the calls the pool makes on every rank (:mod:`.calls`) and the live
telemetry of a running cell (:mod:`.telemetry`)."""
