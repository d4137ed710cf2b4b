"""The gather strategy layer: all-gather (``dst=-1``), gather to one rank (``dst=r``), or none (``dst="local"``).

All output leaves travel in one collective. Leaves are packed, each rank's block padded to the largest shard (gloo
aborts on unequal sizes), and unpacked into one preallocated buffer per leaf. A single batched leaf with even shards
skips the packing: the gather buffer already is the result.
"""

from typing import Any, List, Optional, Sequence, Union

import torch

from . import comm
from .groups import Group
from .layout import BATCHED, CONSTANT, REPLICATED, OutLayout
from .sharding import is_prefix, rows_first


def typed_view(buf: torch.Tensor, offset: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * dtype.itemsize
    if nbytes == 0:  # a zero-size row of a [P, 0] buffer may sit at an odd storage offset: view() refuses it
        return buf.new_empty(shape, dtype=dtype)
    return buf.narrow(0, offset, nbytes).view(dtype).view(tuple(shape))


def pack(
    flat_local: Sequence[Any],
    layout: OutLayout,
    rows: int,
    cap: int,
    device: torch.device,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One rank's outputs as a byte block sized for ``cap`` rows (into ``out`` if given); rows past ``rows`` are
    padding."""
    offsets, block = layout.segments(cap)
    buf = torch.empty(block, dtype=torch.uint8, device=device) if out is None else out
    for value, leaf, offset in zip(flat_local, layout.leaves, offsets):
        if leaf.kind == BATCHED and rows:
            typed_view(buf, offset, leaf.dtype, (rows, *leaf.shape)).copy_(rows_first(value, leaf.out_dim))
        elif leaf.kind == REPLICATED and value is not None:
            typed_view(buf, offset, leaf.dtype, leaf.shape).copy_(value)
    return buf


def unpack(blocks: torch.Tensor, layout: OutLayout, sizes: Sequence[int], caps: Sequence[int]) -> List[Any]:
    """Per-leaf global outputs from the gathered ``[P, block]`` bytes (rank r's block packed for ``caps[r]``
    rows), each written into one new buffer."""
    offsets_by_cap = {cap: layout.segments(cap)[0] for cap in set(caps)}
    first = next((r for r, n in enumerate(sizes) if n), 0)
    total = sum(sizes)
    even = len(set(sizes)) == 1 and len(set(caps)) == 1
    out: List[Any] = []
    for k, leaf in enumerate(layout.leaves):
        if leaf.kind == CONSTANT:
            out.append(leaf.value)
        elif leaf.kind == REPLICATED:
            offset = offsets_by_cap[caps[first]][k]
            out.append(typed_view(blocks[first], offset, leaf.dtype, leaf.shape).clone())
        elif even:  # one strided read of every rank's rows, copied once into the result
            n, offset = sizes[0], offsets_by_cap[caps[0]][k]
            nbytes = n * leaf.row_bytes
            rows = blocks.narrow(1, offset, nbytes).view(leaf.dtype)
            out.append(rows.reshape(total, *leaf.shape).movedim(0, leaf.out_dim))
        else:
            result = torch.empty((total, *leaf.shape), dtype=leaf.dtype, device=blocks.device)
            start = 0
            for r, n in enumerate(sizes):
                if n:
                    offset = offsets_by_cap[caps[r]][k]
                    result.narrow(0, start, n).copy_(typed_view(blocks[r], offset, leaf.dtype, (n, *leaf.shape)))
                start += n
            out.append(result.movedim(0, leaf.out_dim))
    return out


def cut_rows(recv: torch.Tensor, sizes: Sequence[int], cap: int) -> torch.Tensor:
    """The rows of ``[P * cap, ...]`` gathered blocks without their padding: a view of the first ``sum(sizes)`` rows
    when they form a prefix (the block split), else one copy."""
    if is_prefix(sizes):
        return recv.narrow(0, 0, sum(sizes))
    return torch.cat([recv.narrow(0, r * cap, k) for r, k in enumerate(sizes) if k])


def _direct_leaf(layout: OutLayout, sizes: Sequence[int]) -> Optional[int]:
    """The index of the only tensor leaf when it can be gathered in its own dtype (no packing)."""
    tensors = [i for i, leaf in enumerate(layout.leaves) if leaf.kind != CONSTANT]
    if len(tensors) != 1 or layout.leaves[tensors[0]].kind != BATCHED or not max(sizes):
        return None
    return tensors[0]


def gather(
    flat_local: Sequence[Any],
    layout: OutLayout,
    sizes: Sequence[int],
    dst: Union[int, str],
    group: Group,
    device: torch.device,
    call: str,
    timeout: Optional[float],
) -> Optional[List[Any]]:
    """Gather every rank's outputs in group-rank order; returns the flat global outputs, or None off ``dst``."""
    rank, world = group.rank, group.size
    all_ranks = dst == -1
    receives = all_ranks or dst == rank
    direct = _direct_leaf(layout, sizes)
    if direct is not None:
        # One leaf: gather it in its own dtype. Even shards land straight in the result; uneven ones are padded to
        # the largest shard (gloo needs equal sizes) and the padding is cut out with one copy.
        leaf = layout.leaves[direct]
        cap, n = max(sizes), sizes[rank]
        send = rows_first(flat_local[direct], leaf.out_dim)
        if n < cap:
            padded = torch.empty((cap, *leaf.shape), dtype=leaf.dtype, device=device)
            padded.narrow(0, 0, n).copy_(send)
            send = padded
        else:
            send = send.contiguous()
        recv = torch.empty((world * cap, *leaf.shape), dtype=leaf.dtype, device=device) if receives else None
        if all_ranks:
            comm.all_gather_into(recv, send, group, call, timeout)
        else:
            comm.gather_to(send, list(recv.chunk(world)) if receives else None, dst, group, call, timeout)
        if not receives:
            return None
        recv = cut_rows(recv, sizes, cap)
        out = list(flat_local)
        out[direct] = recv.movedim(0, leaf.out_dim)
        return out
    cap = max(sizes)
    block = pack(flat_local, layout, sizes[rank], cap, device)
    blocks = torch.empty((world, block.numel()), dtype=torch.uint8, device=device) if receives else None
    if all_ranks:
        comm.all_gather_into(blocks.view(-1), block, group, call, timeout)
    else:
        comm.gather_to(block, list(blocks.unbind(0)) if receives else None, dst, group, call, timeout)
    return unpack(blocks, layout, sizes, [cap] * world) if receives else None


def share_replicated(
    flat_local: List[Any],
    layout: OutLayout,
    sizes: Sequence[int],
    group: Group,
    device: torch.device,
    call: str,
    timeout: Optional[float],
) -> List[Any]:
    """For ``dst="local"``: ranks with empty shards receive the replicated leaves from the first rank with data."""
    if not any(leaf.kind == REPLICATED for leaf in layout.leaves) or all(sizes):
        return flat_local
    first = next(r for r, n in enumerate(sizes) if n)
    block = pack(flat_local, layout, 0, 0, device)
    comm.broadcast(block, first, group, call, timeout)
    offsets, _ = layout.segments(0)
    out = list(flat_local)
    for i, (leaf, offset) in enumerate(zip(layout.leaves, offsets)):
        if leaf.kind == REPLICATED and out[i] is None:
            out[i] = typed_view(block, offset, leaf.dtype, leaf.shape).clone()
    return out


def is_batched(t: Any) -> bool:
    """Whether ``t`` is a functorch-batched tensor (this cmap runs inside an outer ``torch.vmap``)."""
    return isinstance(t, torch.Tensor) and torch._C._functorch.is_batchedtensor(t)


def _all_gather_rows(x: torch.Tensor, sizes: Sequence[int], group: Group, call: str, timeout: Optional[float]):
    cap = max(sizes)
    send = x if x.shape[0] == cap else torch.cat([x, x.new_zeros((cap - x.shape[0], *x.shape[1:]))])
    recv = torch.empty((group.size * cap, *x.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather_into(recv, send.contiguous(), group, call, timeout)
    return cut_rows(recv, sizes, cap)


class _GatherRows(torch.autograd.Function):
    """All-gather rows (dim 0) with a vmap rule, so a cmap can run inside an outer ``torch.vmap`` (nesting)."""

    @staticmethod
    def forward(x: torch.Tensor, sizes: Any, group: Group, call: str, timeout: Optional[float]) -> torch.Tensor:
        return _all_gather_rows(x, sizes, group, call, timeout)

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        pass

    @staticmethod
    def vmap(info: Any, in_dims: Any, x: torch.Tensor, sizes: Any, group: Group, call: str, timeout: Any):
        dim = in_dims[0]
        if dim is None:
            return _GatherRows.apply(x, sizes, group, call, timeout), None
        # the outer batch dim rides along as dim 1 of every row: still one collective
        return _GatherRows.apply(x.movedim(dim, 1), sizes, group, call, timeout), 1


def gather_batched(
    flat_local: Sequence[Any],
    layout: OutLayout,
    sizes: Sequence[int],
    group: Group,
    call: str,
    timeout: Optional[float],
) -> List[Any]:
    """``dst=-1`` for outputs batched by an outer ``torch.vmap``: one collective per output leaf."""
    out = list(flat_local)
    for i, (value, leaf) in enumerate(zip(flat_local, layout.leaves)):
        if leaf.kind == REPLICATED:
            raise NotImplementedError(f"{call}: out_dims=None outputs are not supported inside an outer vmap.")
        if leaf.kind == BATCHED:
            rows = rows_first(value, leaf.out_dim)
            out[i] = _GatherRows.apply(rows, tuple(sizes), group, call, timeout).movedim(0, leaf.out_dim)
    return out


def batched_empty_like(ref: torch.Tensor, shape: Sequence[int], dtype: torch.dtype, out_dim: int) -> torch.Tensor:
    """An empty output batched at the same vmap level as ``ref`` (an input shard), for a rank with no rows."""
    z = torch.zeros_like(ref.reshape(-1)[:0], dtype=dtype)  # batched, logical shape (0,)
    z = z.reshape(0, *([1] * len(shape))).expand(0, *shape)
    return z.movedim(0, out_dim)
