"""Multi-host start-up: `jax.distributed.initialize` from the environment, before any other JAX call.

Launch one process per host (all GPUs of a host belong to its process) with the same command and
    JAX_COORDINATOR_ADDRESS=host0:1234 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=<0|1> jaxtune train ...
or under SLURM / Open MPI, whose variables JAX reads itself (set JAXTUNE_DISTRIBUTED=1 there).
"""

from __future__ import annotations

import os

import jax

from jaxtune.errors import JaxtuneError


def initialize_from_env() -> bool:
    """Joins the multi-process run the environment describes; False (and nothing done) for a single process."""
    address = os.environ.get("JAX_COORDINATOR_ADDRESS")
    if not address and os.environ.get("JAXTUNE_DISTRIBUTED") != "1":
        return False
    if jax.distributed.is_initialized():
        return True
    kwargs = {}
    for name, key in (("JAX_NUM_PROCESSES", "num_processes"), ("JAX_PROCESS_ID", "process_id")):
        if name in os.environ:
            try:
                kwargs[key] = int(os.environ[name])
            except ValueError:
                raise JaxtuneError(f"{name}={os.environ[name]!r} is not an integer; set it to e.g. 0") from None
    if address and len(kwargs) < 2 and not os.environ.get("SLURM_JOB_ID") and not os.environ.get("OMPI_COMM_WORLD_SIZE"):
        raise JaxtuneError("JAX_COORDINATOR_ADDRESS is set but JAX_NUM_PROCESSES / JAX_PROCESS_ID are not; "
                           "set both on every host (process ids 0..N-1)")
    jax.distributed.initialize(coordinator_address=address, **kwargs)
    return True
