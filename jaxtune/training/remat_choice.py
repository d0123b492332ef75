"""remat="auto": the fastest activation-memory policy whose compiled step fits the device (no trial runs).

The candidates, fastest first: "selective" (keeps every projection output; measured faster and leaner than "none"
at every batch, so "none" is never the better pick), for a mixture of experts "recompute-experts" (as "selective",
but the MoE blocks' routed rows are recomputed rather than kept: their largest residual), "per-layer" (keeps each
layer's input), "offload" (layer
inputs in host memory; GPU only: on CPU the host is the device). Each is compiled and its memory plan compared
with what the device has (with autobatch's margin) or, on CPU, with the host memory available; the first that
fits is taken, and the last is taken when none does (its own refusal then says what to change).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax

from jaxtune.parallel.distributed import agree_min, memory_stats
from jaxtune.platform.host_info import GIB, available_ram_bytes
from jaxtune.training.autobatch import MARGIN, step_bytes_or_none
from jaxtune.training.config import TrainConfig

AUTO_ORDER = ("selective", "recompute-experts", "per-layer", "offload")


@dataclass(frozen=True)
class RematChoice:
    policy: str
    reason: str  # one line: what each tried candidate needs and what there is
    fits: bool = True  # False: none fits, `policy` is the last resort


def candidates(offloads_to_host: bool, experts: bool = False) -> tuple[str, ...]:
    """The policies auto tries, fastest first: "recompute-experts" only for a mixture of experts (elsewhere it is
    "selective"), "offload" only where host memory is not the device's."""
    order = AUTO_ORDER if offloads_to_host else AUTO_ORDER[:-1]
    return order if experts else tuple(p for p in order if p != "recompute-experts")


def choose_remat(build_step: Callable[[str], Callable], lora, opt_state, frozen, micro: int, cfg: TrainConfig,
                 offloads_to_host: bool, bytes_limit: int | None = None, experts: bool = False) -> RematChoice:
    """`build_step(policy)` is the train step under that policy; each is planned with these arguments at `micro`
    rows (`experts`: the model has sparse MoE layers). The same choice on every process."""
    if bytes_limit is None:
        bytes_limit = memory_stats().get("bytes_limit")
    resident = 0 if bytes_limit is not None else sum(x.nbytes for x in jax.tree.leaves((lora, opt_state, frozen)))
    # GPU: the device with autobatch's margin; CPU: the host memory available now, besides the arrays it holds
    budget = MARGIN * bytes_limit if bytes_limit is not None else available_ram_bytes() + resident
    where = "the device" if bytes_limit is not None else "host memory"
    tried = []
    for policy in candidates(offloads_to_host, experts):
        need = step_bytes_or_none(build_step(policy), lora, opt_state, frozen, micro, cfg)
        tried.append(f"{policy} needs {'more' if need is None else f'{need / GIB:,.1f} GiB'}")
        fits = bool(agree_min(int(need is not None and need <= budget)))
        if fits:
            break
    verdict = f"{policy} fits" if fits else f"none fits, {policy} is the last resort"
    return RematChoice(policy, f"remat auto: {policy} ({'; '.join(tried)}; {where} has {budget / GIB:,.1f} GiB "
                               f"to use: {verdict})", fits)
