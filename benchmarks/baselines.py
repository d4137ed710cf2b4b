"""The hand-written ``torch.distributed`` code that cmap is measured against: narrow the shard, ``torch.vmap``, one
``all_gather_into_tensor``, with the variants the timing table names (``baseline+status``, ``fused_header``,
``baseline_ceil_plan``)."""

import math
import time
from typing import Any, Callable, List, Sequence, Tuple

import torch
import torch.distributed as dist

# The phases of a baseline call that the overhead profile times by hand (``Baseline.timed_phases``).
PHASES = ("narrow", "vmap", "alloc/pad", "all_gather", "cut")


def shard_sizes(batch: int, world: int) -> List[int]:
    """The split ``torch.tensor_split`` makes: the first ``B % P`` ranks get one extra row."""
    q, r = divmod(batch, world)
    return [q + (1 if i < r else 0) for i in range(world)]


class Baseline:
    """Hand-written torch.distributed code for ``dst=-1``: narrow, ``torch.vmap``, one ``all_gather_into_tensor``.

    Args:
        func: the per-example function.
        in_dims: vmap in_dims (a flat tuple of 0/None, or an int).
        batch: B.
        status: also exchange a small int64 header first, as cmap's status exchange does.
        ceil_plan: shard as ``ceil(B / P)`` rows per rank with the remainder on the last ranks, instead of
            ``tensor_split``'s plan; then only short ranks pad and the first B rows of the gathered buffer are the
            result, returned as a view with no copy.
        fused: the leanest one-collective design that still tells every rank every other rank's status: a 48-byte
            int64 header (the size of cmap's) and the padded rows packed into one byte buffer, one all_gather, the
            header table read back, the rows cut out of the gathered blocks with one ``torch.cat``.
    """

    def __init__(
        self,
        func: Callable,
        in_dims: Any,
        batch: int,
        status: bool = False,
        ceil_plan: bool = False,
        fused: bool = False,
    ) -> None:
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.sizes = shard_sizes(batch, self.world)
        self.ceil_plan = ceil_plan
        if ceil_plan:
            cap = -(-batch // self.world)
            self.sizes = [min(max(batch - i * cap, 0), cap) for i in range(self.world)]
        self.rows, self.offset, self.cap = self.sizes[self.rank], sum(self.sizes[: self.rank]), max(self.sizes)
        self.even = len(set(self.sizes)) == 1
        self.in_dims, self.status, self.batch, self.fused = in_dims, status, batch, fused
        self.vf = torch.vmap(func, in_dims)

    def shard(self, args: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """This rank's rows of the mapped arguments (views); the others as they are."""
        dims = self.in_dims if isinstance(self.in_dims, tuple) else (self.in_dims,) * len(args)
        return [a if d is None else a.narrow(d, self.offset, self.rows) for a, d in zip(args, dims)]

    def compute(self, args: Sequence[torch.Tensor]) -> torch.Tensor:
        """``torch.vmap(func)`` on this rank's shard."""
        return self.vf(*self.shard(args))

    def communicate(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's ``local`` rows, gathered into the whole batch's output on every rank."""
        if self.status:
            header = torch.tensor([0, self.rows, 1, 1, self.batch], dtype=torch.int64)
            table = torch.empty(self.world * 5, dtype=torch.int64)
            dist.all_gather_into_tensor(table, header)
            table.tolist()
        shape, dtype = local.shape[1:], local.dtype
        if self.fused:
            return self._fused(local)
        if self.even:
            out = torch.empty((self.world * self.rows, *shape), dtype=dtype)
            dist.all_gather_into_tensor(out, local.contiguous())
            return out
        send = local
        if self.rows < self.cap:
            send = torch.empty((self.cap, *shape), dtype=dtype)
            send.narrow(0, 0, self.rows).copy_(local)
        buf = torch.empty((self.world * self.cap, *shape), dtype=dtype)
        dist.all_gather_into_tensor(buf, send.contiguous())
        if self.ceil_plan:
            return buf.narrow(0, 0, self.batch)
        return torch.cat([buf.narrow(0, r * self.cap, n) for r, n in enumerate(self.sizes)])

    def _fused(self, local: torch.Tensor) -> torch.Tensor:
        shape, dtype = local.shape[1:], local.dtype
        row = local[0].numel() * local.element_size() if self.rows else math.prod(shape) * dtype.itemsize
        head = 48  # 6 x int64, the size of cmap's status header
        send = torch.empty(head + self.cap * row, dtype=torch.uint8)
        send.numpy()[:head].view("int64")[:] = (1 | (self.cap * row) << 10, self.rows, self.batch, 1, 1, 0)
        send.narrow(0, head, self.rows * row).view(dtype).view(local.shape).copy_(local)
        recv = torch.empty((self.world, send.numel()), dtype=torch.uint8)
        dist.all_gather_into_tensor(recv.view(-1), send)
        recv.numpy()[:, :head].view("int64").tolist()
        return torch.cat(
            [recv[r].narrow(0, head, n * row).view(dtype).view(n, *shape) for r, n in enumerate(self.sizes) if n]
        )

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        return self.communicate(self.compute(args))

    def timed_phases(self, args: Sequence[torch.Tensor]) -> Tuple[float, ...]:
        """One plain baseline call (no status, not fused, ``tensor_split``'s plan), timed by phase.

        Returns:
            seconds in each of :data:`PHASES`: narrow, vmap, alloc/pad, all_gather, cut.
        """
        ta = time.perf_counter()
        shard = self.shard(args)
        tb = time.perf_counter()
        local = self.vf(*shard)
        tc = time.perf_counter()
        shape = local.shape[1:]
        if self.even:
            out = torch.empty((self.world * self.rows, *shape), dtype=local.dtype)
            td = time.perf_counter()
            dist.all_gather_into_tensor(out, local.contiguous())
            te = time.perf_counter()
            tf = te
        else:
            send = local
            if self.rows < self.cap:
                send = torch.empty((self.cap, *shape), dtype=local.dtype)
                send.narrow(0, 0, self.rows).copy_(local)
            buf = torch.empty((self.world * self.cap, *shape), dtype=local.dtype)
            td = time.perf_counter()
            dist.all_gather_into_tensor(buf, send)
            te = time.perf_counter()
            out = torch.cat([buf.narrow(0, r * self.cap, n) for r, n in enumerate(self.sizes)])
            tf = time.perf_counter()
        del out
        return tb - ta, tc - tb, td - tc, te - td, tf - te
