"""Multi-host start-up and the few things every process must agree on.

Launch one process per host (or per GPU) with the same command and
    JAX_COORDINATOR_ADDRESS=host0:1234 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=<0|1> jaxtune train ...
or under SLURM / Open MPI, whose variables JAX reads itself (set JAXTUNE_DISTRIBUTED=1 there).

Per-device reads (memory, device kind) use this process's own devices: another process's devices are not
addressable. A failing process must not wait for its peers (they may be blocked in a collective that will
never complete): it prints its error and exits at once, and JAX's heartbeat check ends the others.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback

import jax
import numpy as np

from jaxtune.errors import JaxtuneError

HEARTBEAT_TIMEOUT_S = 60  # a process silent this long is taken as dead and the job ends (JAX default: 100)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_stop = threading.Event()


def catch_stop_signals() -> dict:
    """SIGINT/SIGTERM set the stop request instead of ending the process; returns the handlers replaced
    ({} off the main thread, where Python cannot install handlers)."""
    previous = {}
    for sig in STOP_SIGNALS:
        try:
            previous[sig] = signal.signal(sig, lambda *_: _stop.set())
        except ValueError:
            return {}
    return previous


def stop_requested() -> bool:
    return _stop.is_set()


def clear_stop_request() -> None:
    _stop.clear()


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
    heartbeat = int(os.environ.get("JAXTUNE_HEARTBEAT_TIMEOUT", HEARTBEAT_TIMEOUT_S))
    # the training loop agrees on SIGTERM/SIGINT itself (a flag inside the step); JAX's preemption service would
    # install a native SIGTERM handler over it that ends with the default action (the process dies mid-step)
    jax.config.update("jax_enable_preemption_service", False)
    catch_stop_signals()  # before the GPU runtime starts: a stop asked for during start-up is kept, not fatal
    jax.distributed.initialize(coordinator_address=address, heartbeat_timeout_seconds=heartbeat,
                               shutdown_timeout_seconds=max(heartbeat, 30), **kwargs)
    previous = sys.excepthook

    def fail_fast(kind, error, tb):  # an uncaught error ends this process without the shutdown barrier
        if not is_multiprocess() or isinstance(error, KeyboardInterrupt):
            return previous(kind, error, tb)
        exit_now(error.with_traceback(tb))

    sys.excepthook = fail_fast
    return True


def local_device() -> jax.Device:
    """This process's first device: the one whose memory and kind this process can read."""
    return jax.local_devices()[0]


def memory_stats() -> dict:
    """Memory statistics of this process's first device ({} where the platform keeps none, e.g. CPU)."""
    return local_device().memory_stats() or {}


def peak_memory_gib() -> float | None:
    """The highest peak memory over this process's devices, in GiB (None on platforms without statistics)."""
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices()]
    peaks = [p for p in peaks if p is not None]
    return max(peaks) / 2**30 if peaks else None


def agree_min(value: int) -> int:
    """The smallest of every process's `value` (the value itself in a single-process run)."""
    if jax.process_count() == 1:
        return int(value)
    from jax.experimental import multihost_utils

    return int(np.min(multihost_utils.process_allgather(np.int32(value))))


CHECKS_TIMEOUT_S = 60  # how long a process waits for its peers' start-up checks before it gives up on them


def agree_on_checks(error: BaseException | None, timeout_s: float = CHECKS_TIMEOUT_S, stage: str = "checks",
                    failed: str = "refused the run") -> None:
    """Every process of a multi-process run learns whether any process's checks failed, and all end together,
    non-zero, each within `timeout_s`: the failing process with its own line, the others with one naming the
    failing process (it `failed`) and its line. Run after joining the distributed runtime (a peer that never joins
    cannot hear of a failure); `stage` names this agreement, once per run (the start-up checks) or per step (a
    step's rewards, which each process computes for its own share). In a single process the error, if any, is
    raised."""
    if not is_multiprocess():
        if error is not None:
            raise error
        return
    from jax._src import distributed as _distributed  # the coordinator's key-value store: waits with a deadline

    client, me, count = _distributed.global_state.client, jax.process_index(), jax.process_count()
    client.key_value_set(f"jaxtune/{stage}/{me}", "ok" if error is None else "error: " + _first_line(error))
    failure = error
    for peer in range(count):
        if failure is not None:
            break
        if peer == me:
            continue
        try:
            said = client.blocking_key_value_get(f"jaxtune/{stage}/{peer}", int(timeout_s * 1000))
        except Exception:  # noqa: BLE001 (a deadline passed or the coordinator is gone: the peer is not coming)
            said = f"error: no answer from its {stage} within {timeout_s:.0f} s (see its log)"
        if said != "ok":
            failure = JaxtuneError(f"process {peer} of {count} {failed}: {said.removeprefix('error: ')}")
    _wait_quietly(lambda: client.wait_at_barrier(f"jaxtune/{stage}/read", int(timeout_s * 1000)))
    if failure is not None:
        exit_now(failure, then=lambda: _leave_in_order(client, me, count))


def _wait_quietly(wait) -> None:
    try:
        wait()
    except Exception:  # noqa: BLE001 (a peer already gone only shortens the wait)
        pass


def _leave_in_order(client, me: int, count: int, timeout_s: float = 10) -> None:
    """Process 0 hosts the coordinator: it leaves after the others, whose runtime would abort on losing it."""
    if me:
        _wait_quietly(lambda: client.key_value_set(f"jaxtune/left/{me}", "1"))
        return
    for peer in range(1, count):
        _wait_quietly(lambda: client.blocking_key_value_get(f"jaxtune/left/{peer}", int(timeout_s * 1000)))
    time.sleep(0.5)  # their exits, already under way


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def exit_now(error: BaseException, code: int = 1, then=None) -> None:
    """Ends a multi-process run's failing process at once: its one-line error to stderr, then exit without the
    shutdown barrier (peers blocked in a collective would never reach it; the heartbeat check ends them).
    `then()` runs after the line is printed, just before the exit."""
    line = _first_line(error)
    if not isinstance(error, JaxtuneError):
        traceback.print_exception(error, file=sys.stderr)
    if isinstance(error, jax.errors.JaxRuntimeError):  # a collective or the coordinator lost a peer, most often
        line += ("; if another process of the job failed or was stopped, this is the consequence (see its log): "
                 "restart every process with --resume")
    print(f"jaxtune: error in process {jax.process_index()} of {jax.process_count()}: {line}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    if then is not None:
        then()
    os._exit(code)


def is_multiprocess() -> bool:
    return jax.distributed.is_initialized() and jax.process_count() > 1
