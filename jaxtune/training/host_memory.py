"""How much of the offloaded long-context state host memory can hold (remat "offload")."""

from __future__ import annotations

import os

from jaxtune.errors import JaxtuneError

# of the available host memory that offloaded layer inputs may take: the process needs more than XLA's plan
# (measured on a 125 GiB H100 host: 36.9 GiB for a 32 GiB plan, and host memory exhausted for 94-100 GiB plans)
FRACTION = 0.7


def offloads_to_host() -> bool:
    """Pinned-host offload moves data off a GPU; on CPU the device memory is the host memory already."""
    import jax

    return jax.default_backend() == "gpu"


def available_host_bytes() -> int:
    """Host memory available now (MemAvailable), capped by XLA's pinned-host limit."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    cap = os.environ.get("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB")
    return min(available, int(float(cap) * 1e9)) if cap else available


def offload_group(num_layers: int, bytes_per_layer_input: int, host_bytes: int) -> int:
    """The smallest group of layers such that one input per group fits in FRACTION of host_bytes.

    1 = every layer's input offloaded (no extra compute); g > 1 = the layers between are recomputed from their
    group's input. A clear error when even one input per whole stack does not fit.
    """
    budget = FRACTION * host_bytes
    for group in range(1, num_layers + 1):
        if num_layers % group == 0 and num_layers // group * bytes_per_layer_input <= budget:
            return group
    raise JaxtuneError(
        f"one layer input takes {bytes_per_layer_input / 2**30:.1f} GiB but only {budget / 2**30:.1f} GiB of host "
        "memory is available for offloading; shorten seq_len or free host memory")


def offload_layouts(num_layers: int, bytes_per_layer_input: int, host_bytes: int) -> list[tuple[int, int]]:
    """The (layers kept on device, offload group) layouts to try, best first.

    Every input on the host when it fits: [(0, 1)]. Otherwise the inputs that do not fit stay in device memory
    (no extra compute; the caller checks the compiled step still fits the device), and failing that, one input
    per group of layers goes to host and the layers between are recomputed (`offload_group`).
    """
    on_host = min(int(FRACTION * host_bytes // bytes_per_layer_input), num_layers)
    if on_host == num_layers:
        return [(0, 1)]
    fallback = [(0, offload_group(num_layers, bytes_per_layer_input, host_bytes))]
    return ([(num_layers - on_host, 1)] if on_host else []) + fallback
