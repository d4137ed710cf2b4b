"""The route of an exchange through its round's payload: which tensors travel, and where each sits in every rank's
payload area.

What moves depends on each tensor's role (:mod:`.roles`): rows are concatenated in group-rank order, sums and
extrema are reduced, a first-rank value is taken from group rank 0; the other roles stay where they are. Each rank
packs its own rows into its payload area; when every rank's fit, the round carries them and the call needs no
other collective.

A route depends only on the roles, the tensors' dtypes and shapes, and the group, so it is worked out once and kept
with the group's round buffers (:class:`~.link.Channel`, :func:`~.exchange.join_values` picks it): a repeated exchange copies into ready-made views of the
payload area and reads out of ready-made views of the gathered payloads.
"""

from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..digests import digest
from .roles import COPY, FIRST, MAX, MIN, Role, is_rows

_ALIGN = 16
REDUCED = (COPY, MAX, MIN)


class Item(NamedTuple):
    """One tensor that travels: its position among the exchanged tensors, its role, and its per-row shape."""

    index: int
    role: Role
    dtype: torch.dtype
    shape: Tuple[int, ...]  # per row for rows, the whole tensor otherwise
    nbytes: int  # per row for rows, the whole tensor otherwise

    @property
    def reduced(self) -> bool:
        return self.role in REDUCED

    def rows_shape(self, rows: int) -> Tuple[int, ...]:
        return (rows, *self.shape) if is_rows(self.role) else self.shape


class Route(NamedTuple):
    """One exchange's items, this rank's block, and the payload views to pack into and read from."""

    items: Tuple[Item, ...]
    sizes: Optional[Tuple[int, ...]]  # rows per rank (None: only the round knows, with src="local")
    rows: int
    block: int  # the payload bytes this rank asks the round for (0: it does not ask; the data phase moves it)
    fits: bool  # this rank's block fits its payload area
    inline: Optional[bool]  # every rank's does (None: only the round knows)
    digest: int  # names the exchange in OP and SYNC headers
    send: Tuple[torch.Tensor, ...]  # per item, its view in this rank's payload area (empty unless fits)
    recv: Tuple[Tuple[torch.Tensor, ...], ...]  # per item, every rank's view in the gathered payloads (if inline)


def rows_first(t: torch.Tensor, dim: int) -> torch.Tensor:
    return t if dim == 0 else t.movedim(dim, 0)


def travelling(roles: Sequence[Role], tensors: Sequence[torch.Tensor]) -> Tuple[Item, ...]:
    items = []
    for i, (role, t) in enumerate(zip(roles, tensors)):
        if is_rows(role):
            shape = tuple(rows_first(t, role.dim).shape[1:])
        elif role in REDUCED or role == FIRST:
            shape = tuple(t.shape)
        else:
            continue
        items.append(Item(index=i, role=role, dtype=t.dtype, shape=shape, nbytes=numel(shape) * t.element_size()))
    return tuple(items)


def numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def offsets(items: Sequence[Item], rows: int) -> Tuple[List[int], int]:
    """Byte offset of each item in a block packed for ``rows`` rows, and the block's size."""
    found, acc = [], 0
    for it in items:
        found.append(acc)
        acc += -(-it.nbytes * (rows if is_rows(it.role) else 1) // _ALIGN) * _ALIGN
    return found, acc


def typed_view(buf: torch.Tensor, offset: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    nbytes = numel(shape) * dtype.itemsize
    if nbytes == 0:  # a zero-size slice may sit at an odd storage offset: view() refuses it
        return buf.new_empty(tuple(shape), dtype=dtype)
    return buf.narrow(0, offset, nbytes).view(dtype).view(tuple(shape))


class Room(NamedTuple):
    """The payload area of a round on this rank, and how large a block may ask it to be."""

    payload: torch.Tensor  # this rank's payload area
    payloads: torch.Tensor  # everyone's, as gathered: [P, bytes]
    small: int  # any block up to this size may ask for room
    most: int  # a block up to this size may, if riding costs about what its own collective would (may_grow)


def cached_route(
    cache: Dict[Any, Route],
    rank: int,
    room: Room,
    key: Tuple[Any, ...],
    tensors: Sequence[torch.Tensor],
    inline: bool = True,
) -> Route:
    """The route for ``key = (what, roles, sizes, dst)`` and these tensors, from ``cache`` or worked out now.

    The route keeps views of the ``room``'s buffers. Without ``inline`` nothing rides in the round (its buffers are
    not where the tensors live): the data phase moves everything.
    """
    full = key + (inline,) + tuple((t.dtype, t.shape) for t in tensors)
    found = cache.get(full)
    if found is None:
        with torch.inference_mode(False):  # views kept for later calls under any mode are never inference tensors
            found = cache[full] = _work_out(rank, room, key, tensors, inline)
    return found


_SLACK_BYTES = 16 << 10  # what riding in the round may cost a rank over the data's own collective, 10% aside


def may_grow(items: Sequence[Item], p: int, largest: int, dst: int) -> bool:
    """Whether carrying ``items`` (rows: ``largest`` per rank at most) in the all-gather of a round on ``p`` ranks
    costs each rank at most 1.1 times the bytes of their own collective (ring algorithms) plus 16 KiB: always for rows
    gathered to every rank, for sums only while they are small (or P = 2, where an all-reduce sends what an
    all-gather does), for rows to one rank only while small (that rank sends none in a gather)."""
    fused = own = 0.0
    for it in items:
        n = it.nbytes * (largest if is_rows(it.role) else 1)
        fused += (p - 1) * n
        if is_rows(it.role):
            own += (p - 1) * n if dst == -1 else 0
        elif it.reduced:
            own += 2 * (p - 1) / p * n
        else:  # rank 0's value, from the gather
            own += (p - 1) * n
    return costs_little(fused, own)


def costs_little(fused: float, own: float) -> bool:
    """Whether sending ``fused`` bytes per rank instead of ``own`` (the data's own collective's) is within the budget:
    1.1 times ``own`` plus 16 KiB."""
    return fused <= 1.1 * own + _SLACK_BYTES


def _work_out(
    rank: int,
    room: Room,
    key: Tuple[Any, ...],
    tensors: Sequence[torch.Tensor],
    inline_ok: bool,
) -> Route:
    what, roles, sizes, dst = key
    payload, payloads = room.payload, room.payloads
    space = payload.numel() if inline_ok else -1
    items = travelling(roles, tensors)
    rows = next((t.shape[r.dim] for r, t in zip(roles, tensors) if is_rows(r)), 0)
    mine, block = offsets(items, rows)
    fits = block <= space
    send = (
        tuple(typed_view(payload, off, it.dtype, it.rows_shape(rows)) for it, off in zip(items, mine)) if fits else ()
    )
    inline = None if sizes is None else all(offsets(items, n)[1] <= space for n in sizes)
    recv: Tuple[Tuple[torch.Tensor, ...], ...] = ()
    if inline:
        layouts = [offsets(items, n)[0] for n in sizes]
        recv = tuple(
            tuple(typed_view(payloads[r], layouts[r][k], it.dtype, it.rows_shape(n)) for r, n in enumerate(sizes))
            for k, it in enumerate(items)
        )
    sig = digest((what, [(it.role, it.dtype, it.shape) for it in items]))
    # room is asked for only where every rank's block fits in it (row counts known: the largest share's; else each
    # rank asks for its own, and the round is the largest any asked for)
    largest = max(sizes) if sizes is not None else rows
    asks = inline_ok and (
        block <= room.small
        or (
            largest is not None
            and offsets(items, largest)[1] <= room.most
            and may_grow(items, payloads.shape[0], largest, dst)
        )
    )
    return Route(
        items=items,
        sizes=sizes,
        rows=rows,
        block=block if asks else 0,
        fits=fits,
        inline=inline,
        digest=sig,
        send=send,
        recv=recv,
    )


def pack_payload(rt: Route, tensors: Sequence[torch.Tensor]) -> None:
    """This rank's items into its payload area."""
    for it, view in zip(rt.items, rt.send):
        t = tensors[it.index]
        if is_rows(it.role):
            if rt.rows:
                view.copy_(rows_first(t, it.role.dim))
        else:
            view.copy_(t)


def unpack_payload(rt: Route, receives: bool) -> Dict[int, torch.Tensor]:
    """The results (rows first) from the gathered payloads: rows in group-rank order, reductions in group-rank order.

    They are at most P payload areas in all, so they are allocated here, after the round.
    """
    results: Dict[int, torch.Tensor] = {}
    if not receives:
        return results
    for it, parts in zip(rt.items, rt.recv):
        if is_rows(it.role):
            filled = [p for p, n in zip(parts, rt.sizes) if n] or [parts[0]]
            results[it.index] = filled[0].clone() if len(filled) == 1 else torch.cat(filled)
        elif it.role == FIRST:
            results[it.index] = parts[0].clone()
        else:
            results[it.index] = out = torch.empty_like(parts[0])
            reduce_into(out, it.role, parts)
    return results


def reduce_into(out: torch.Tensor, role: Role, parts: Sequence[torch.Tensor]) -> None:
    """Sum (or max, min) in group-rank order, so that every rank computes the very same bits."""
    out.copy_(parts[0])
    for p in parts[1:]:
        if role == COPY:
            out.add_(p)
        elif out.dtype == torch.bool:
            torch.logical_or(out, p, out=out) if role == MAX else torch.logical_and(out, p, out=out)
        else:
            torch.maximum(out, p, out=out) if role == MAX else torch.minimum(out, p, out=out)
