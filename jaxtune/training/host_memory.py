"""How much of the offloaded long-context state host memory can hold (remat "offload").

XLA keeps offloaded buffers in a pinned-host pool: a best-fit allocator capped by XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB
that grows by regions of the next power of two at or above the request, clipped to what the cap has left, and
never gives a region back. So a plan of P bytes pins min(next power of two >= P, cap): measured on a 125 GiB H100
host, a 100 GiB plan under a 112 GiB cap made the process hold 119.4 GiB (112 pinned + 7.4 of its own). A layout
fits when that region fits the memory available, not just the plan.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

from jaxtune.errors import JaxtuneError
from jaxtune.platform.host_info import GIB, available_ram_bytes, meminfo_bytes, physical_ram_bytes, pinned_cap_bytes

PLAN_SHARE_OF_CAP = 0.9  # the rest of the pool: staging regions left from loading weights, which it keeps
MARGIN_GIB, MARGIN_SHARE = 6, 0.05  # of host memory left for the process's own growth during a step
MIN_REGION = 2 * 2**20  # the pool's first region


def offloads_to_host() -> bool:
    """Pinned-host offload moves data off a GPU; on CPU the device memory is the host memory already."""
    import jax

    return jax.default_backend() == "gpu"


@dataclass(frozen=True)
class HostBudget:
    """Host memory for offloaded layer inputs: available now, XLA's pinned cap, and a margin kept free."""

    available: int
    cap: int
    margin: int

    @classmethod
    def now(cls) -> HostBudget:
        """This host's figures, or in a multi-process run the tightest of every process's (least available, lowest
        cap, largest margin), so that every process plans the same layout and compiles the same step."""
        from jaxtune.parallel.distributed import agree_min

        mib = 2**20  # agreed in MiB: bytes overflow the int32 the processes exchange
        margin = max(MARGIN_GIB * GIB, int(MARGIN_SHARE * physical_ram_bytes()))
        return cls(available=agree_min(available_ram_bytes() // mib) * mib,
                   cap=agree_min(pinned_cap_bytes() // mib) * mib, margin=-agree_min(-(margin // mib)) * mib)

    def pinned(self, plan: int) -> int:
        """The pinned memory an offload plan of this many bytes makes the pool take (its new region)."""
        region = MIN_REGION
        while region < plan:
            region *= 2
        return min(region, self.cap)

    def fits(self, plan: int) -> bool:
        return plan <= PLAN_SHARE_OF_CAP * self.cap and self.pinned(plan) <= self.available - self.margin

    def describe(self) -> str:
        return (f"{self.available / GIB:.1f} GiB of host memory available, {self.margin / GIB:.1f} GiB kept free, "
                f"XLA's pinned pool capped at {self.cap / GIB:.0f} GiB")


HOST_EXHAUSTED_EXIT = 3  # the exit status of a run the guard below stopped
GUARD_FLOOR = 0.02  # of physical RAM (at least 1 GiB): less available than this stops an offloading run


def _stop_host_exhausted(available: int) -> None:
    sys.stderr.write(
        f"\njaxtune: host memory nearly exhausted ({available / GIB:.1f} GiB available) while layer inputs are "
        "offloaded to it; stopping before the machine runs out. Shorten seq_len, or set "
        "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB lower so that fewer inputs are planned on the host\n")
    sys.stderr.flush()
    os._exit(HOST_EXHAUSTED_EXIT)


class HostMemoryGuard:
    """Watches available host memory while offloaded steps run, and stops the process with a clear message when it
    is nearly gone: pinned buffers cannot be swapped out, so a step that outgrows host memory otherwise ends in the
    kernel's OOM killer or a machine that stops answering, with no word about why (an unwatched 430,080-token step
    on a 125 GiB host did that)."""

    def __init__(self, floor_bytes: int | None = None, *,
                 available: Callable[[], int | None] = lambda: meminfo_bytes("MemAvailable"), on_exhausted: Callable[[int], None] = _stop_host_exhausted, interval_s: float = 0.5):
        self.floor = max(int(GUARD_FLOOR * physical_ram_bytes()), GIB) if floor_bytes is None else floor_bytes
        self._available, self._on_exhausted, self._interval = available, on_exhausted, interval_s
        self.lowest: int | None = None  # the least available memory seen (what a step took, for benchmarks)
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> bool:
        """False (after calling on_exhausted) when less than the floor is available."""
        available = self._available()
        if available is not None:
            self.lowest = available if self.lowest is None else min(self.lowest, available)
        if available is not None and available < self.floor:
            self._on_exhausted(available)
            return False
        return True

    def _watch(self) -> None:
        while not self._done.wait(self._interval) and self.check():
            pass

    def start(self) -> HostMemoryGuard:
        self._thread = threading.Thread(target=self._watch, name="jaxtune-host-memory-guard", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> HostMemoryGuard:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def offload_group(num_layers: int, bytes_per_layer_input: int, host: HostBudget) -> int:
    """The smallest group of layers such that one input per group fits the host.

    1 = every layer's input offloaded (no extra compute); g > 1 = the layers between are recomputed from their
    group's input. A clear error when even one input per whole stack does not fit.
    """
    for group in range(1, num_layers + 1):
        if num_layers % group == 0 and host.fits(num_layers // group * bytes_per_layer_input):
            return group
    raise JaxtuneError(
        f"one layer input takes {bytes_per_layer_input / GIB:.1f} GiB, more than host memory can hold pinned "
        f"({host.describe()}); shorten seq_len or free host memory")


def offload_layouts(num_layers: int, bytes_per_layer_input: int, host: HostBudget) -> list[tuple[int, int]]:
    """The (layers kept on device, offload group) layouts to try, best first.

    Every input on the host when it fits: [(0, 1)]. Otherwise the inputs that do not fit stay in device memory
    (no extra compute; the caller checks the compiled step still fits the device), and failing that, one input
    per group of layers goes to host and the layers between are recomputed (`offload_group`).
    """
    on_host = num_layers
    while on_host and not host.fits(on_host * bytes_per_layer_input):
        on_host -= 1
    if on_host == num_layers:
        return [(0, 1)]
    fallback = [(0, offload_group(num_layers, bytes_per_layer_input, host))]
    return ([(num_layers - on_host, 1)] if on_host else []) + fallback


def offload_plan(model, rows: int, seq_len: int) -> tuple[HostBudget, list[tuple[int, int]]]:
    """The host budget now and the offload layouts to try for `rows` x `seq_len` tokens of `model`'s layer inputs."""
    host = HostBudget.now()
    per_layer = rows * seq_len * model.config.hidden_size * model.dtype.itemsize
    return host, offload_layouts(model.config.num_layers, per_layer, host)
