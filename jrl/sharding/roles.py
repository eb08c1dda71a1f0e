"""Devices per role: the learner's mesh and, where wanted, a rollout mesh of its own (a role-to-mesh map).

By default the sampler generates on the learner's mesh and the two take turns on the same devices. With
``rollout.devices = N`` the last ``N / process_count`` local devices of every process form the rollout mesh and
the learner keeps the rest, so generation and training run on different devices at the same time (the weights
are copied to the rollout mesh at each sync, :func:`jrl.sharding.reshard`). Every process gives the same number of
devices to each role, so each process takes part in both meshes' programs, as multi-controller JAX requires.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax


def split_devices(rollout_devices: int, devices: Sequence[Any] | None = None) -> tuple[list[Any], list[Any]]:
    """``(learner devices, rollout devices)``: the last ``rollout_devices / process_count`` devices of each process
    for the rollout (none when ``rollout_devices`` is 0), the others for the learner, each list process-major."""
    devices = list(jax.devices() if devices is None else devices)
    if rollout_devices == 0:
        return devices, []
    processes = sorted({d.process_index for d in devices})
    per_process = {p: [d for d in devices if d.process_index == p] for p in processes}
    local = len(per_process[processes[0]])
    fix = (f"use a multiple of {len(processes)} (the process count) below {len(devices)} "
           f"(the device count), or 0 to sample on the learner's devices")
    if rollout_devices % len(processes) or not 0 < rollout_devices < len(devices):
        raise ValueError(f"RolloutConfig.devices={rollout_devices}: each of the {len(processes)} process(es) gives the "
                         f"rollout the same share of its {local} device(s) and keeps some for the learner; {fix}")
    take = rollout_devices // len(processes)
    learner = [d for p in processes for d in per_process[p][:-take]]
    rollout = [d for p in processes for d in per_process[p][-take:]]
    return learner, rollout
