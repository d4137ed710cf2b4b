"""Random numbers inside the tensor-parallel regions, as Megatron-LM's ``CudaRNGStatesTracker`` keeps them apart,
made so that activation recomputation replays them.

A module holding column-parallel layers (an attention, an MLP) is a sharded region: each rank computes its own
heads or features, so dropout there must draw a different mask on each rank. Each call of its forward runs under a
random state of its own: a seed derived from the process generator's state at entry and the group rank (with
Megatron's offset, 2718), hashed, so that no two ranks and no two calls share a stream. The process generator then
moves on to a state derived alike from the one at entry (a draw that every rank makes the same, and that no tensor
op makes, so it runs under ``torch.vmap`` too), and it is put back after the call.

Everything else (the replicated region) draws from the process's state, the same on every rank after the same
seed, and the same whatever the group size (the sharded regions move it on once per call, for any group size).

Since a region's state is a function of the process generator's state at entry, ``torch.utils.checkpoint`` (either
``use_reentrant``), which saves the process generator's state with ``preserve_rng_state`` and restores it to
recompute, replays every region's masks in the recomputation, as Megatron's own checkpoint does by saving its
tracker's states.
"""

import hashlib
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..wire.group import Group

__all__ = ["RegionRandom", "TP_SEED_OFFSET"]

TP_SEED_OFFSET = 2718  # Megatron-LM's: the tensor-parallel seed is the seed + 2718 + the rank
SEED_BITS = 63


def _device_module(device: torch.device) -> Optional[Any]:
    return None if device.type in ("cpu", "meta") else torch.get_device_module(device.type)


def _derived_seed(state: torch.Tensor, salt: str) -> int:
    """A seed that depends on every byte of a generator's state and on ``salt``."""
    digest = hashlib.blake2b(state.numpy().tobytes(), digest_size=8, person=salt.encode()[:16]).digest()
    return int.from_bytes(digest, "little") >> (64 - SEED_BITS)


class RegionRandom:
    """Forward pre- and post-hooks that run each call of a sharded region under a state of its own (per rank and
    per call), derived from the process generator's state at entry."""

    def __init__(self, group: Group, device: torch.device) -> None:
        self.device, self.rank = device, group.rank
        self.outside: List[Tuple[torch.Tensor, Optional[torch.Tensor]]] = []

    def _read(self) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        mod = _device_module(self.device)
        return torch.get_rng_state(), (mod.get_rng_state(self.device) if mod is not None else None)

    def _write(self, state: Tuple[torch.Tensor, Optional[torch.Tensor]]) -> None:
        torch.set_rng_state(state[0])
        mod = _device_module(self.device)
        if mod is not None and state[1] is not None:
            mod.set_rng_state(state[1], self.device)

    def seed_region(self, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        entry = torch.get_rng_state()
        region = _derived_seed(entry, f"tp{TP_SEED_OFFSET + self.rank}")
        # the process generator moves on (one draw, alike on every rank); a device's process state stays as it is
        torch.default_generator.manual_seed(_derived_seed(entry, "next"))
        self.outside.append(self._read())
        torch.default_generator.manual_seed(region)
        mod = _device_module(self.device)
        if mod is not None:
            with mod.device(self.device):
                mod.manual_seed(region)

    def restore_outside(self, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any) -> None:
        self._write(self.outside.pop())
