"""The steady-state plan cache: what a repeated call with the same argument shapes can skip.

After a call completes cleanly (every rank finished, with the same inputs and the same output layout), its shard
plan is kept here under a key of the argument leaves' shapes, dtypes and devices. The next call with that key skips
checking ``in_dims`` against the arguments, hashing the input signature and planning the shards: all of those are
functions of the key, so their results are the same as last time. Everything that depends on values (running
``func``, the status exchange, the checks on the gathered status table) still happens on every call, so a call
that goes differently on any rank takes the general path from there, on every rank alike.
"""

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy
import torch
import torch.distributed as dist
from torch.utils._pytree import TreeSpec

from . import comm
from .gather import typed_view
from .layout import BATCHED, REPLICATED, OutLayout
from .sharding import rows_first

_SIZE = 64
# Reusable round buffers kept by one cmap's plans together, at most (older plans drop theirs first and rebuild them
# when called again): (P + 1) round-sized buffers per plan would otherwise add up over many argument shapes.
BUFFER_BUDGET = 16 << 20


class RoundBuffers:
    """Reusable CPU buffers for a steady call's one status round: this rank's header and payload are written in
    place and the gathered header table is read through a numpy view, instead of building both anew per call."""

    def __init__(self, plan: "SteadyPlan", round_bytes: int) -> None:
        head = comm.HEADER_LEN * 8
        self.send = torch.empty(head + round_bytes, dtype=torch.uint8)
        self.recv = torch.empty((len(plan.sizes), head + round_bytes), dtype=torch.uint8)
        self.recv_flat = self.recv.view(-1)
        self.nbytes = self.send.numel() + self.recv.numel()
        self.head = self.send.numpy()[:head].view(numpy.int64)
        self.head[:] = 0
        self.table = self.recv.numpy()[:, :head].view(numpy.int64)
        self.payloads = self.recv.narrow(1, head, round_bytes)
        payload = self.send.narrow(0, head, round_bytes)
        offsets, self.block = plan.layout.segments(plan.rows)
        # every rank packs its block for its own row count, so each rank's leaf offsets are its own
        by_rank = [plan.layout.segments(n) for n in plan.sizes]
        self.fits = max(block for _, block in by_rank) <= round_bytes  # else this round carries headers only
        self.writers: List[Tuple[int, torch.Tensor, Optional[int]]] = []
        self.readers: List[Any] = []
        if not self.fits:
            return
        for i, (leaf, offset) in enumerate(zip(plan.layout.leaves, offsets)):
            if leaf.kind == BATCHED and plan.rows:
                self.writers.append(
                    (i, typed_view(payload, offset, leaf.dtype, (plan.rows, *leaf.shape)), leaf.out_dim)
                )
            elif leaf.kind == REPLICATED:
                self.writers.append((i, typed_view(payload, offset, leaf.dtype, leaf.shape), None))

        self.readers = [
            _reader(self.payloads, plan, leaf, [offsets[i] for offsets, _ in by_rank])
            for i, leaf in enumerate(plan.layout.leaves)
        ]

    def write(self, header: Sequence[int], flat_out: Sequence[Any]) -> None:
        """The header, and this rank's outputs when it has any (an empty shard sends the header alone)."""
        self.head[: len(header)] = header
        if not flat_out:
            return
        for i, view, dim in self.writers:
            view.copy_(flat_out[i] if dim is None else rows_first(flat_out[i], dim))

    def read(self) -> List[Any]:
        """The global outputs from the gathered payloads, as new tensors (the buffers are reused)."""
        return [read() for read in self.readers]


def _reader(payloads: torch.Tensor, plan: "SteadyPlan", leaf: Any, offsets: List[int]) -> Any:
    """A function that makes one output leaf from the gathered payloads: one copy for a tensor leaf."""
    if leaf.kind == REPLICATED:
        first = next(r for r, n in enumerate(plan.sizes) if n)
        return typed_view(payloads[first], offsets[first], leaf.dtype, leaf.shape).clone
    if leaf.kind != BATCHED:
        return lambda: leaf.value
    parts = [typed_view(payloads[r], offsets[r], leaf.dtype, (n, *leaf.shape)) for r, n in enumerate(plan.sizes) if n]
    dim = leaf.out_dim
    if len(parts) == 1:
        return lambda: parts[0].clone().movedim(0, dim) if dim else parts[0].clone()
    return lambda: torch.cat(parts).movedim(0, dim) if dim else torch.cat(parts)


@dataclass
class SteadyPlan:
    """One argument signature's plan: the checked in-dims, the shard sizes and this rank's rows."""

    pg: dist.ProcessGroup
    spec: TreeSpec
    dims: Tuple[Optional[int], ...]
    batch: int
    sig: int
    sizes: Tuple[int, ...]
    rows: int
    offset: int
    device: torch.device
    layout: OutLayout
    rounds: Dict[int, RoundBuffers] = field(default_factory=dict)


def plan_key(leaves: Sequence[Any]) -> Tuple[Any, ...]:
    """The argument leaves' shapes, dtypes and devices (tensors) or values (other leaves)."""
    return tuple(
        (leaf.shape, leaf.dtype, leaf.device) if isinstance(leaf, torch.Tensor) else (type(leaf), _hashable(leaf))
        for leaf in leaves
    )


def _hashable(value: Any) -> Any:
    return value if isinstance(value, (int, float, bool, str, type(None))) else id(value)


class SteadyPlans:
    """A small LRU cache of :class:`SteadyPlan` by :func:`plan_key`."""

    def __init__(self) -> None:
        self._plans: "OrderedDict[Tuple[Any, ...], SteadyPlan]" = OrderedDict()

    def get(self, key: Tuple[Any, ...], pg: Any, spec: TreeSpec) -> Optional[SteadyPlan]:
        plan = self._plans.get(key)
        if plan is None or plan.pg is not pg or plan.spec != spec:
            return None
        self._plans.move_to_end(key)
        return plan

    def put(self, key: Tuple[Any, ...], plan: SteadyPlan) -> None:
        self._plans[key] = plan
        self._plans.move_to_end(key)
        while len(self._plans) > _SIZE:
            self._plans.popitem(last=False)

    def buffers(self, plan: SteadyPlan, round_bytes: int) -> RoundBuffers:
        """``plan``'s round buffers for this round size, within :data:`BUFFER_BUDGET` over all plans."""
        found = plan.rounds.get(round_bytes)
        if found is None:
            plan.rounds.clear()  # only the current round size is ever used
            found = plan.rounds[round_bytes] = RoundBuffers(plan, round_bytes)
            total = self.buffer_bytes()
            for other in list(self._plans.values()):  # least recently used first
                if total <= BUFFER_BUDGET:
                    break
                if other is not plan:
                    total -= sum(b.nbytes for b in other.rounds.values())
                    other.rounds.clear()
        return found

    def buffer_bytes(self) -> int:
        return sum(b.nbytes for plan in self._plans.values() for b in plan.rounds.values())
