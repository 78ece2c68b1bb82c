"""Data movers. The engine decides what to run; a backend moves the bytes.

``mpi``: mpi4py on numpy buffers, for CPU tensors (the default).
``torch_dist``: torch.distributed (NCCL for CUDA tensors, gloo for CPU tensors when
``HOROVOD_CPU_OPERATIONS=gloo``), on torch buffers.
Both expose the same methods, each taking the engine's local requests (``None`` on a
rank that has joined) with the agreed metadata, and setting each request's result.
"""
