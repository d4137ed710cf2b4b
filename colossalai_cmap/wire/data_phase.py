"""The data phase behind a round: the exchange's tensors that did not fit the round's payload.

One all-gather carries every gathered tensor, padded to the largest share because gloo aborts on unequal sizes (a
single one travels in its own dtype, and the receive buffer's first rows are the result); one all-reduce per
reduction and dtype carries the sums. :func:`prepare` packs and allocates everything before the round, so that a
failure there travels in the round; :func:`run_data_phase` only runs the collectives and copies into those buffers.
An exchange whose data phase has the shape that the exchange after the same round sent the last time sends it right
behind its round (:func:`early`): one gather of a rows tensor (an exit's all-gather, or with ``dst=r`` its gather
to that rank; a backward's gather of an input's gradient), or one all-reduce (a backward's summed gradients, a
``psum`` in f). ``src=r``'s scatter of the shares (:func:`scatter_from_source`) packs its rows the same way.
"""

from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import comm
from .group import Group
from .link import Link
from .payload import Item, numel, offsets, rows_first, typed_view
from .roles import COPY, MAX, MIN, Role, Rows, cut_padded, cut_target, first_row, is_rows, padded_rows

_REDUCE_OPS = {COPY: "SUM", MAX: "MAX", MIN: "MIN"}


class Prepared(NamedTuple):
    """This rank's side of a data phase, made ready before the round."""

    items: Tuple[Item, ...]
    sizes: Tuple[int, ...]
    results: Dict[int, torch.Tensor]  # rows first for rows items; filled by run_data_phase()
    send: Optional[torch.Tensor]  # the gathered items' send buffer
    recv: Optional[torch.Tensor]  # their receive buffer; None off dst
    flats: Dict[Tuple[Role, torch.dtype], torch.Tensor]  # one buffer per reduction and dtype, reduced in place


def resolved(t: torch.Tensor) -> torch.Tensor:
    """``t`` without a lazy conjugate or negative bit: collectives send the raw memory."""
    return t.resolve_conj().resolve_neg() if t.is_complex() or t.is_neg() else t


def prepare(
    items: Sequence[Item], tensors: Sequence[torch.Tensor], sizes: Sequence[int], group: Group, dst: int
) -> Prepared:
    receives = dst == -1 or dst == group.rank
    device = tensors[items[0].index].device
    gathered = [it for it in items if not it.reduced]
    results: Dict[int, torch.Tensor] = {}
    send = recv = None
    if len(gathered) == 1 and is_rows(gathered[0].role):
        send, recv = _direct_buffers(gathered[0], tensors, sizes, group, receives)
        if recv is not None:
            results[gathered[0].index] = cut_target(recv, sizes)
    elif gathered:
        cap = max(sizes)
        send = torch.zeros(offsets(gathered, cap)[1], dtype=torch.uint8, device=device)
        pack_padded(gathered, tensors, cap, send)
        recv = torch.empty((group.size, send.numel()), dtype=torch.uint8, device=device) if receives else None
        if receives:
            total = sum(sizes)
            results.update(
                {it.index: torch.empty(it.rows_shape(total), dtype=it.dtype, device=device) for it in gathered}
            )
    flats = {key: _flat(found, tensors) for key, found in _by_op(items).items()}
    return Prepared(items=tuple(items), sizes=tuple(sizes), results=results, send=send, recv=recv, flats=flats)


def pack_padded(items: Sequence[Item], tensors: Sequence[torch.Tensor], cap: int, out: torch.Tensor) -> None:
    offs, _ = offsets(items, cap)
    for it, off in zip(items, offs):
        t = tensors[it.index]
        if is_rows(it.role):
            rows = rows_first(t, it.role.dim)
            typed_view(out, off, it.dtype, (rows.shape[0], *it.shape)).copy_(rows)
        else:
            typed_view(out, off, it.dtype, it.shape).copy_(t)


def _direct_buffers(
    it: Item, tensors: Sequence[torch.Tensor], sizes: Sequence[int], group: Group, receives: bool
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One rows tensor, in its own dtype, padded to the largest share."""
    t = tensors[it.index]
    cap = max(sizes)
    send = padded_rows(resolved(rows_first(t, it.role.dim)), cap)
    recv = torch.empty((group.size * cap, *it.shape), dtype=it.dtype, device=t.device) if receives else None
    return send, recv


def _by_op(items: Sequence[Item]) -> Dict[Tuple[Role, torch.dtype], List[Item]]:
    found: Dict[Tuple[Role, torch.dtype], List[Item]] = {}
    for it in items:
        if it.reduced:
            found.setdefault((it.role, it.dtype), []).append(it)
    return found


def _flat(items: Sequence[Item], tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Same-dtype items in one buffer for one all-reduce (gloo reduces no bool; complex goes as real pairs)."""
    flat = torch.cat([resolved(tensors[it.index]).reshape(-1) for it in items])
    return flat.to(torch.uint8) if flat.dtype == torch.bool else torch.view_as_real(flat) if flat.is_complex() else flat


# ------------------------------------------------------------------------------------------------ data sent early
def gather_shape(prep: Prepared, link: Link, dst: int) -> Optional[comm.GatherShape]:
    """What a data phase sends, when it is one rows tensor in its own dtype gathered to every rank or to ``dst``."""
    gathered = [it for it in prep.items if not it.reduced]
    if prep.flats or len(gathered) != 1 or not is_rows(gathered[0].role):
        return None
    return comm.GatherShape(max(prep.sizes), gathered[0].shape, gathered[0].dtype, link.group, link.device, dst)


def sum_shape(prep: Prepared, link: Link) -> Optional[comm.SumShape]:
    """What a data phase sends, when it is one all-reduce and nothing else."""
    if prep.send is not None or len(prep.flats) != 1:
        return None
    (((role, _), flat),) = prep.flats.items()
    return comm.SumShape(flat.numel(), flat.dtype, _REDUCE_OPS[role], link.group, link.device)


def shape_of(prep: Optional[Prepared], link: Link, dst: int) -> Optional[Any]:
    """What a data phase sends, where it is one collective that may go right behind its round: a gather of one rows
    tensor or one all-reduce (None: another data phase, or none)."""
    if prep is None:
        return None
    return gather_shape(prep, link, dst) or sum_shape(prep, link)


def early(prep: Optional[Prepared], expected: Optional[Any], link: Link, dst: int) -> Optional[Callable[[], Any]]:
    """The data phase, to issue right behind the round, when its shape is the one every rank at this point of the
    group's rounds expects (:meth:`~.link.Channel.expected_data`), so every rank in step sends the same shape. Ranks
    that do not send early learn from the round who did, and send a stand-in of that shape
    (:func:`~.rounds.run_round`). A sum is reduced in place: where the round says a peer did not send it early, the
    exchange makes its buffer again before its own all-reduce."""
    if not comm.matches(shape_of(prep, link, dst), expected):
        return None
    if isinstance(expected, comm.SumShape):
        ((_, flat),) = prep.flats.items()
        return lambda: expected.issue(flat, link.call)
    return lambda: expected.issue(prep.recv, prep.send, link.call)


def taken_early(prep: Prepared) -> Dict[int, torch.Tensor]:
    """The results of a data phase every rank sent early: only the cut remains (off ``dst``, nothing)."""
    if prep.recv is not None:
        it = next(it for it in prep.items if not it.reduced)
        cut_padded(prep.recv, prep.sizes, out=prep.results[it.index])
    for (role, dtype), flat in prep.flats.items():
        _split_flat(prep, role, dtype, flat)
    return prep.results


def run_data_phase(
    prep: Prepared, group: Group, dst: int, call: str, timeout: Optional[float]
) -> Dict[int, torch.Tensor]:
    """Run the data phase's collectives and fill the results (rows first)."""
    gathered = [it for it in prep.items if not it.reduced]
    if prep.send is not None:
        _gather(prep.recv, prep.send, group, dst, call, timeout)
    if prep.recv is not None and len(gathered) == 1 and is_rows(gathered[0].role):
        cut_padded(prep.recv, prep.sizes, out=prep.results[gathered[0].index])
    elif prep.recv is not None:
        _from_padded(prep, gathered)
    for (role, dtype), flat in prep.flats.items():
        comm.all_reduce(flat, group, call, timeout, op=getattr(dist.ReduceOp, _REDUCE_OPS[role]))
        _split_flat(prep, role, dtype, flat)
    return prep.results


def _gather(
    recv: Optional[torch.Tensor], send: torch.Tensor, group: Group, dst: int, call: str, timeout: Optional[float]
) -> None:
    """``recv`` holds every rank's ``send`` in group-rank order along dim 0 (None off ``dst``)."""
    name = "all_gather" if dst == -1 else "gather"
    comm.wait_for(comm.issue_stacked(recv, send, dst, group, call, name), group, call, timeout, name)


def _from_padded(prep: Prepared, items: Sequence[Item]) -> None:
    cap = max(prep.sizes)
    offs, _ = offsets(items, cap)
    for it, off in zip(items, offs):
        out = prep.results[it.index]
        if is_rows(it.role):
            start = 0
            for r, n in enumerate(prep.sizes):
                if n:
                    out.narrow(0, start, n).copy_(typed_view(prep.recv[r], off, it.dtype, (n, *it.shape)))
                start += n
        else:  # FIRST: rank 0's value
            out.copy_(typed_view(prep.recv[0], off, it.dtype, it.shape))


def _split_flat(prep: Prepared, role: Role, dtype: torch.dtype, flat: torch.Tensor) -> None:
    values = flat.to(torch.bool) if dtype == torch.bool else torch.view_as_complex(flat) if dtype.is_complex else flat
    start = 0
    for it in prep.items:
        if it.role == role and it.dtype == dtype:
            n = it.nbytes // dtype.itemsize
            prep.results[it.index] = values.narrow(0, start, n).view(it.shape)
            start += n


class Scattered(NamedTuple):
    """What :func:`scatter_from_source` gives this rank: its rows of each tensor, and on an empty share each tensor's first
    example in its block instead (the share's stand-in), else None; and the int64 the source put before the rows
    (None: it put none)."""

    rows: List[torch.Tensor]
    stand_in: Optional[List[torch.Tensor]]
    prefix: Optional[int] = None


PREFIX_BYTES = 16  # an int64 before the rows of each rank's block (aligned as the rows), where the source puts one


def scatter_from_source(
    link: Link,
    src: int,
    sizes: Sequence[int],
    kinds: Sequence[Tuple[Tuple[int, ...], torch.dtype, int]],
    full: Optional[Sequence[torch.Tensor]],
    prefix: Optional[int] = None,
) -> Scattered:
    """Group rank ``src``'s tensors (``full``, there only) cut into every rank's rows and sent in one ``scatter``,
    all packed together per rank for the largest share. ``kinds`` gives each tensor's example shape, dtype and
    batch dim on every rank, and ``sizes`` each rank's row count. With ``prefix`` (given on every rank; its value is
    the source's), each block starts with that int64, and the source may send no rows (``full`` None there too):
    the prefix says so."""
    group = link.group
    items = [
        Item(index=k, role=Rows(0, tuple(sizes)), dtype=dtype, shape=shape, nbytes=numel(shape) * dtype.itemsize)
        for k, (shape, dtype, _) in enumerate(kinds)
    ]
    cap = max(max(sizes), 1)
    offs, block = offsets(items, cap)
    ahead = PREFIX_BYTES if prefix is not None else 0
    recv = torch.empty(ahead + block, dtype=torch.uint8, device=link.device)
    blocks = None
    if group.rank == src and (full is not None or prefix is not None):
        blocks = [torch.zeros(ahead + block, dtype=torch.uint8, device=link.device) for _ in range(group.size)]
        for r in range(group.size):
            if prefix is not None:
                blocks[r][:8].view(torch.int64).fill_(prefix)
            if full is not None:
                rows = [_rows_of(t, d, sizes, r) for t, (_, _, d) in zip(full, kinds)]
                pack_padded(items, rows, cap, blocks[r][ahead:])
    if ahead + block:
        comm.scatter_from(recv, blocks, src, group, link.call, link.timeout)
    said = int(recv[:8].view(torch.int64)[0]) if prefix is not None else None
    data, mine = recv[ahead:], sizes[group.rank]
    rows = [
        typed_view(data, off, it.dtype, (mine, *it.shape)).movedim(0, d)
        for it, off, (_, _, d) in zip(items, offs, kinds)
    ]
    stand_in = None
    if mine == 0 and sum(sizes) > 0:
        stand_in = [
            typed_view(data, off, it.dtype, (1, *it.shape)).movedim(0, d).clone()
            for it, off, (_, _, d) in zip(items, offs, kinds)
        ]
    return Scattered(rows=rows, stand_in=stand_in, prefix=said)


def _rows_of(t: torch.Tensor, dim: int, sizes: Sequence[int], r: int) -> torch.Tensor:
    """Rank r's rows, batch dim first; the first example for an empty share (its stand-in)."""
    n, start = sizes[r], first_row(sizes, r)
    rows = t.narrow(dim, start, n) if n else t.narrow(dim, 0, min(1, t.shape[dim]))
    return rows.movedim(dim, 0)
