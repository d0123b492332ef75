"""How much of the offloaded long-context state host memory can hold (remat "offload")."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable

from jaxtune.errors import JaxtuneError

# of the available host memory that offloaded layer inputs may take: the process needs more than XLA's plan
# (measured on a 125 GiB H100 host: 36.9 GiB for a 32 GiB plan, and host memory exhausted for 94-100 GiB plans)
FRACTION = 0.7


def offloads_to_host() -> bool:
    """Pinned-host offload moves data off a GPU; on CPU the device memory is the host memory already."""
    import jax

    return jax.default_backend() == "gpu"


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_host_bytes() -> int:
    """Host memory available now (MemAvailable), capped by XLA's pinned-host limit."""
    available = _meminfo_available()
    if available is None:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    cap = os.environ.get("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB")
    return min(available, int(float(cap) * 1e9)) if cap else available


HOST_EXHAUSTED_EXIT = 3  # the exit status of a run the guard below stopped
GUARD_FLOOR = 0.02  # of physical RAM (at least 1 GiB): less available than this stops an offloading run


def _stop_host_exhausted(available: int) -> None:
    sys.stderr.write(
        f"\njaxtune: host memory nearly exhausted ({available / 2**30:.1f} GiB available) while layer inputs are "
        "offloaded to it; stopping before the machine runs out. Shorten seq_len, or set "
        "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB lower so that fewer inputs are planned on the host\n")
    sys.stderr.flush()
    os._exit(HOST_EXHAUSTED_EXIT)


class HostMemoryGuard:
    """Watches available host memory while offloaded steps run, and stops the process with a clear message when it
    is nearly gone: pinned buffers cannot be swapped out, so a step that outgrows host memory otherwise ends in the
    kernel's OOM killer or a machine that stops answering, with no word about why. (Measured at ~400k tokens of an
    8B model on a 125 GiB host: the process needed 20-35 GiB more than XLA's offload plan.)"""

    def __init__(self, floor_bytes: int | None = None, *, available: Callable[[], int | None] = _meminfo_available,
                 on_exhausted: Callable[[int], None] = _stop_host_exhausted, interval_s: float = 0.5):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        self.floor = max(int(GUARD_FLOOR * total), 2**30) if floor_bytes is None else floor_bytes
        self._available, self._on_exhausted, self._interval = available, on_exhausted, interval_s
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> bool:
        """False (after calling on_exhausted) when less than the floor is available."""
        available = self._available()
        if available is not None and available < self.floor:
            self._on_exhausted(available)
            return False
        return True

    def _watch(self) -> None:
        while not self._done.wait(self._interval) and self.check():
            pass

    def __enter__(self) -> HostMemoryGuard:
        self._thread = threading.Thread(target=self._watch, name="jaxtune-host-memory-guard", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()


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
