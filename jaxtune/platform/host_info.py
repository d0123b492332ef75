"""Host memory figures read before JAX starts: what /proc/meminfo says, and XLA's pinned-host cap.

Kept free of JAX imports, because the cap must be in the environment before the first JAX backend starts.
"""

from __future__ import annotations

import os

GIB = 2**30
PINNED_CAP_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"  # read by XLA in GiB (whole numbers), default 64
XLA_DEFAULT_PINNED_CAP_GIB = 64
# what the process and the system keep besides the pinned pool (measured on a 125 GiB H100 host at 409,600 tokens:
# the training process itself held 7.4 GiB next to its pinned pool, the system ~4 GiB)
RESERVE_GIB, RESERVE_SHARE = 16, 0.10


def meminfo_bytes(field: str) -> int | None:
    """A /proc/meminfo field in bytes, or None where there is no /proc (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def physical_ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_ram_bytes() -> int:
    """MemAvailable (what can be allocated without swapping), or the free pages where /proc is missing."""
    available = meminfo_bytes("MemAvailable")
    return available if available is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def pinned_cap_bytes() -> int:
    """XLA's pinned-host pool cap as XLA reads it (GiB), its default where unset or unreadable."""
    try:
        return int(os.environ.get(PINNED_CAP_ENV, XLA_DEFAULT_PINNED_CAP_GIB)) * GIB
    except ValueError:
        return XLA_DEFAULT_PINNED_CAP_GIB * GIB


def set_pinned_host_cap() -> None:
    """Unless the user chose a cap, let XLA's pinned pool grow to what this host can give in full.

    Long-context training offloads layer inputs to that pool (409,600 tokens of Llama-3-8B: 100 GiB), above XLA's
    64 GiB default. The pool grows in power-of-two regions clipped to the cap, so a large offload pins the whole cap:
    the cap has to be memory the host can spare entirely, i.e. what is available now minus a reserve for the process
    and the system. Never below XLA's default.
    """
    if PINNED_CAP_ENV in os.environ:
        return
    try:
        available, total = available_ram_bytes(), physical_ram_bytes()
    except (ValueError, OSError, AttributeError):
        return
    reserve = max(RESERVE_GIB * GIB, RESERVE_SHARE * total)
    os.environ[PINNED_CAP_ENV] = str(max(XLA_DEFAULT_PINNED_CAP_GIB, int((available - reserve) // GIB)))
