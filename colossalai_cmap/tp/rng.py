"""Random numbers inside the tensor-parallel regions, as Megatron-LM's ``CudaRNGStatesTracker`` keeps them apart,
made so that activation recomputation replays them.

A sharded region is where the activation is sharded: from a column-parallel layer whose output stays split (a
colwise projection) to the row-parallel layer that takes it, whatever the modules' nesting (an attention's q/k/v to
its o, an MLP's up to its down, or ``[0]`` to ``[3]`` of a flat ``nn.Sequential``). Each rank holds different
columns there, so dropout must draw a different mask on each rank. A region runs under a random state of its own: a
seed derived from the process generator's state where it opens and the group rank (with Megatron's offset, 2718),
hashed, so that no two ranks and no two regions share a stream. The process generator then moves on to a state
derived alike from the one at the opening (a draw that every rank makes the same, and that no tensor op makes, so it
runs under ``torch.vmap`` too), which is put back where the region closes.

Everything else (the replicated region, including a dropout after the row-parallel layer in the same module) draws
from the process's state, the same on every rank after the same seed, and the same whatever the group size (each
region moves it on once, for any group size).

Since a region's state is a function of the process generator's state where it opens, ``torch.utils.checkpoint``
(either ``use_reentrant``), which saves the process generator's state with ``preserve_rng_state`` and restores it to
recompute, replays every region's masks in the recomputation, as Megatron's own checkpoint does by saving its
tracker's states, also where a checkpoint's boundary falls inside a region (``checkpoint_sequential``). A
recomputation that opens a region and ends before its row-parallel layer leaves it open here; the checkpoint then
puts the generator back, which closes it: a region is open only while the process generator still runs from its
seed.
"""

import hashlib
from typing import Any, NamedTuple, Optional, Tuple

import torch
from torch import nn

from ..wire.group import Group

__all__ = ["RegionRandom", "TP_SEED_OFFSET"]

TP_SEED_OFFSET = 2718  # Megatron-LM's: the tensor-parallel seed is the seed + 2718 + the rank
SEED_BITS = 63

RngState = Tuple[torch.Tensor, Optional[torch.Tensor]]


def _device_module(device: torch.device) -> Optional[Any]:
    return None if device.type in ("cpu", "meta") else torch.get_device_module(device.type)


def _derived_seed(state: torch.Tensor, salt: str) -> int:
    """A seed that depends on every byte of a generator's state and on ``salt``."""
    digest = hashlib.blake2b(state.numpy().tobytes(), digest_size=8, person=salt.encode()[:16]).digest()
    return int.from_bytes(digest, "little") >> (64 - SEED_BITS)


class OpenRegion(NamedTuple):
    """A sharded region now running: the process state to put back where it closes, and its stream's seed."""

    outside: RngState
    seed: int


class RegionRandom:
    """Forward pre-hooks that open a sharded region (on the layers whose output is sharded) and close it (on the
    layers that take a sharded input, and on the model's entry and exit), running it under a state of its own per
    rank and per region, derived from the process generator's state where it opens."""

    def __init__(self, group: Group, device: torch.device) -> None:
        self.device, self.rank = device, group.rank
        self.region: Optional[OpenRegion] = None

    def _read(self) -> RngState:
        mod = _device_module(self.device)
        return torch.get_rng_state(), (mod.get_rng_state(self.device) if mod is not None else None)

    def _write(self, state: RngState) -> None:
        torch.set_rng_state(state[0])
        mod = _device_module(self.device)
        if mod is not None and state[1] is not None:
            mod.set_rng_state(state[1], self.device)

    def _is_open(self) -> bool:
        # ``set_rng_state`` puts a generator's seed back with its state: a checkpoint that restored the state after
        # a recomputation (or the user's own seeding) ended the region
        return self.region is not None and torch.default_generator.initial_seed() == self.region.seed

    def open(self, module: nn.Module, args: Tuple[Any, ...]) -> None:
        """Enter the sharded region, unless one is open (k and v after q, up after gate)."""
        if self._is_open():
            return
        entry = torch.get_rng_state()
        seed = _derived_seed(entry, f"tp{TP_SEED_OFFSET + self.rank}")
        # the process generator moves on (one draw, alike on every rank); a device's process state stays as it is
        torch.default_generator.manual_seed(_derived_seed(entry, "next"))
        self.region = OpenRegion(self._read(), seed)
        torch.default_generator.manual_seed(seed)
        mod = _device_module(self.device)
        if mod is not None:
            with mod.device(self.device):
                mod.manual_seed(seed)

    def close(self, module: nn.Module, args: Tuple[Any, ...], *out: Any) -> None:
        """Leave the sharded region, if one is open: the replicated stream resumes."""
        if self._is_open():
            self._write(self.region.outside)
        self.region = None
