"""Random numbers inside the tensor-parallel regions, as Megatron-LM's ``CudaRNGStatesTracker`` keeps them.

A module holding column-parallel layers (an attention, an MLP) is a sharded region: each rank computes its own
heads or features, so dropout there must draw a different mask on each rank. Its forward runs under a random state
of its own, seeded from the process's seed plus 2718 plus the group rank (Megatron's offset), saved between calls;
the process's own state is put back after it, untouched. Everything else (the replicated region) draws from the
process's state, the same on every rank after the same seed, and, since the sharded regions no longer consume it,
the same whatever the group size.
"""

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..wire.group import Group

__all__ = ["RegionRandom", "TP_SEED_OFFSET"]

TP_SEED_OFFSET = 2718  # Megatron-LM's: the tensor-parallel seed is the seed + 2718 + the rank


def _device_module(device: torch.device) -> Optional[Any]:
    return None if device.type in ("cpu", "meta") else torch.get_device_module(device.type)


class RegionRandom:
    """Forward pre- and post-hooks that run a sharded region under its own random state (per rank)."""

    def __init__(self, group: Group, seed: int, device: torch.device) -> None:
        self.device = device
        saved = self._read()
        torch.manual_seed(seed + TP_SEED_OFFSET + group.rank)
        self.region = self._read()
        self._write(saved)
        self.outside: List[Tuple[torch.Tensor, Optional[torch.Tensor]]] = []

    def _read(self) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        mod = _device_module(self.device)
        return torch.get_rng_state(), (mod.get_rng_state(self.device) if mod is not None else None)

    def _write(self, state: Tuple[torch.Tensor, Optional[torch.Tensor]]) -> None:
        torch.set_rng_state(state[0])
        mod = _device_module(self.device)
        if mod is not None and state[1] is not None:
            mod.set_rng_state(state[1], self.device)

    def enter(self, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        self.outside.append(self._read())
        self._write(self.region)

    def leave(self, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any) -> None:
        self.region = self._read()
        self._write(self.outside.pop())
