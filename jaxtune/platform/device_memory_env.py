"""The share of GPU memory XLA may use, set before JAX starts (kept free of JAX imports)."""

from __future__ import annotations

import os

# XLA preallocates 75% of the GPU unless told otherwise: on an 80 GB card that leaves 20 GB a QLoRA step could use
# (a 70B step at 134k tokens needs 69 GiB). 0.94 keeps ~5 GB of an 80 GB card (0.5 GB of an 8 GB one) for the
# CUDA context and libraries outside XLA's pool.
DEVICE_MEMORY_FRACTION = 0.94
USER_SETTINGS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE",
                 "XLA_PYTHON_CLIENT_ALLOCATOR")


def set_device_memory_fraction() -> None:
    """Unless the user set how XLA allocates GPU memory, let it use most of the device."""
    if not any(name in os.environ for name in USER_SETTINGS):
        os.environ["XLA_CLIENT_MEM_FRACTION"] = str(DEVICE_MEMORY_FRACTION)
