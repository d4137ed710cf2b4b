"""The exchanges the collectives' rules lower to: this run's rows (dim 0) over every example of the axis.

Eagerly a reduction is the primitives' Join (an ``OP`` round), and a gather or a per-example op a native collective
of ``wire.native``, through which only the rows each example needs travel. Under ``torch.compile`` the same rows go
through functional collectives instead (traceable with ``fullgraph=True``), whose backward is made of functional
collectives too: differentiable once inside a compiled function. No status round runs there: see
docs/collectives.md.
"""

import functools
from typing import Any, Callable, List, Tuple

import torch

from ..torch_internals import functional_all_reduce, outside_transforms, remove_batch_dim
from ..wire import native as wire_native
from ..wire.exchange import JoinSpec, SplitSpec, join, split
from ..wire.native import NativeSpec
from ..wire.roles import COPY, first_rows, gather_padded
from ..wire.rounds import Kind
from ..wire.traced import gather_under_vmap, out_of_graph, traced_join, traced_split
from .frame import AxisFrame, Joint
from .rules import AxisRule


def index_table(values: Tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``, made once: a table copied to an accelerator at every call would
    wait for the device each time (inside torch.compile, a constant of the graph). Only ever read."""
    if torch.compiler.is_compiling():
        return torch.tensor(values, dtype=torch.int64, device=device)
    return _kept_table(values, device)


@functools.lru_cache(maxsize=512)
def _kept_table(values: Tuple[int, ...], device: torch.device) -> torch.Tensor:
    # plain, whatever mode or function transform the first call ran under
    with torch.inference_mode(False), outside_transforms():
        return torch.tensor(values, dtype=torch.int64, device=device)


def lower_rows(frame: AxisFrame, rows: torch.Tensor, rule: AxisRule, name: str, arg: Any = None) -> torch.Tensor:
    """``rule``'s exchange of this run's rows: its traced form inside ``torch.compile``, else its eager one."""
    if not torch.compiler.is_compiling():
        return rule.rows(frame, rows, rule, name, arg)
    if rule.traced is None:
        return _EAGER_EXCHANGE(frame, rows, rule, name, arg)
    return rule.traced(frame, rows, rule, name, arg)


# an op with no traced form runs out of the graph
_EAGER_EXCHANGE = out_of_graph(
    lambda frame, rows, rule, name, arg: rule.rows(frame, rows, rule, name, arg),
    "a collective with axis_index_groups has no traced form and runs eagerly, not inside torch.compile (a graph "
    "break); to keep one graph, write each group's sum as a psum over the whole axis of the value masked to that "
    "group (torch.where on axis_index)",
)


def traced_vmap(frame: AxisFrame, x: torch.Tensor, rule: AxisRule, name: str, arg: Any) -> torch.Tensor:
    """Mode "vmap" inside ``torch.compile``, where dynamo follows no vmap rule of an autograd Function and functorch
    runs no autograd Function of a compiled graph: this run's rows come out of the batch at the axis's vmap level (a
    value every example shares is expanded to them), go through ``rule.traced_vmap``, and the result, the same for
    every example, goes back as a plain tensor. The per-example ops never reach here (they are made of psum and
    all_gather under compile); a vmap that func itself opens between them and the axis is not followed."""
    if rule.traced_vmap is None:
        raise NotImplementedError(f"{rule.label(name)} has no traced vmap rule.")
    count = 1 if frame.dummy else frame.sizes[0 if frame.link is None else frame.link.group.rank]
    rows = remove_batch_dim(x, frame.level, count, 0)
    return rule.traced_vmap(frame, rows, rule, name, arg)


def _alone(frame: AxisFrame) -> bool:
    """The axis's members are all on this rank: no communication."""
    return frame.link is None or frame.link.group.size == 1


def _real(frame: AxisFrame, rows: torch.Tensor) -> torch.Tensor:
    """The rows that take part: none for an empty shard's stand-in, which contributes nothing (through its graph,
    zero rows, so that backward still meets on every rank)."""
    return rows[:0] if frame.dummy else rows


# --------------------------------------------------------------------------------------- a reduction's own rows
def _filled(rows: torch.Tensor, boolean: bool, pick: Callable[[Any], Any]) -> torch.Tensor:
    """A reduction's identity, for no rows: ``boolean`` for bools, else ``pick`` of the dtype's finfo/iinfo."""
    like = rows.new_empty(rows.shape[1:])
    if like.dtype == torch.bool:
        return torch.full_like(like, boolean)
    info = torch.finfo(like.dtype) if like.is_floating_point() else torch.iinfo(like.dtype)
    return torch.full_like(like, pick(info))


def _kept(rows: torch.Tensor, identity: torch.Tensor) -> torch.Tensor:
    """The identity, joined to the graph of the (zero) rows: an empty shard's stand-in builds the same autograd graph
    as its peers, so a backward that refuses (max, min) refuses on every rank, in step."""
    return identity + rows.sum(0) if rows.is_floating_point() or rows.is_complex() else identity


def local_sum(rows: torch.Tensor) -> torch.Tensor:
    return rows.sum(0)


def local_max(rows: torch.Tensor) -> torch.Tensor:
    if rows.shape[0] == 0:
        return _kept(rows, _filled(rows, False, lambda info: info.min))
    return rows.any(0) if rows.dtype == torch.bool else rows.amax(0)


def local_min(rows: torch.Tensor) -> torch.Tensor:
    if rows.shape[0] == 0:
        return _kept(rows, _filled(rows, True, lambda info: info.max))
    return rows.all(0) if rows.dtype == torch.bool else rows.amin(0)


# ---------------------------------------------------------------------------------------- eager: reduce, gather
def reduce_rows(frame: AxisFrame, rows: torch.Tensor, rule: AxisRule, name: str, arg: Any = None) -> torch.Tensor:
    """This run's rows reduced over every example of the axis.

    A sum is ``Split(Join(.))``: per-rank partial sums joined into the global sum, which every rank then uses as its
    own value, so its backward sums the cotangents over the group too. A reduction with no transpose (max, min) is
    the Join alone.
    """
    local = rule.local(_real(frame, rows))
    if _alone(frame):
        return local
    (total,) = join(JoinSpec(frame.link, (rule.collective,), rule.label(name), Kind.OP), [local])
    if not rule.differentiable:
        return total
    return split(SplitSpec(frame.link, (COPY,)), [total])[0]


def gather_rows(frame: AxisFrame, rows: torch.Tensor, rule: AxisRule, name: str, arg: Any = None) -> torch.Tensor:
    """Every example's row in global order (shares may be uneven), an all-gather; backward is its transpose, a
    reduce-scatter: each rank gets its rows of the cotangents' sum."""
    real = _real(frame, rows)
    if _alone(frame):
        return real
    return wire_native.run(rule.collective, _spec(frame, rule, name, 0, tuple(frame.sizes)), real)


def _spec(
    frame: AxisFrame,
    rule: AxisRule,
    name: str,
    dim: int,
    sizes: Tuple[int, ...],
    *,
    recv: Tuple[int, ...] = (),
    sent: Tuple[Tuple[int, ...], ...] = (),
) -> Any:
    return NativeSpec(frame.link, dim, sizes, rule.label(name), Kind.OP, recv, sent=sent)


def _rows(table: List[List[int]]) -> Tuple[Tuple[int, ...], ...]:
    return tuple(tuple(r) for r in table)


# ------------------------------------------------------------------------------------ eager: per-example parts
PartsRule = Callable[[AxisFrame, torch.Tensor, AxisRule, str, Any, Tuple[int, ...]], torch.Tensor]


def _per_example(parts: PartsRule) -> Callable[..., torch.Tensor]:
    """An op where each example gets its own part, on this run's rows, with the native collective: only the rows
    each example needs cross the wire. ``parts`` gets the real rows and every rank's row count; the stand-in
    example of an empty shard contributes nothing and gets zeros."""

    @functools.wraps(parts)
    def rows_rule(frame: AxisFrame, rows: torch.Tensor, rule: AxisRule, name: str, arg: Any) -> torch.Tensor:
        real = _real(frame, rows)
        sizes = (real.shape[0],) if _alone(frame) else tuple(frame.sizes)
        out = parts(frame, real, rule, name, arg, sizes)
        if frame.dummy:
            out = torch.cat([out, out.new_zeros((rows.shape[0] - out.shape[0], *out.shape[1:]))])
        return out

    return rows_rule


@_per_example
def scatter_rows(
    frame: AxisFrame, rows: torch.Tensor, rule: AxisRule, name: str, d: int, sizes: Tuple[int, ...]
) -> torch.Tensor:
    """Chunk i (of B along example dim ``d``) of the sum over every example, for each of this run's examples i."""
    partial = rows.sum(0)
    chunk = partial.shape[d] // sum(sizes)
    if _alone(frame):
        mine = partial
    else:
        spec = _spec(frame, rule, name, d, tuple(n * chunk for n in sizes))
        mine = wire_native.run(rule.collective, spec, partial)
    return mine.unflatten(d, (rows.shape[0], chunk)).movedim(d, 0)


@_per_example
def a2a_rows(
    frame: AxisFrame, rows: torch.Tensor, rule: AxisRule, name: str, d: int, sizes: Tuple[int, ...]
) -> torch.Tensor:
    """For each of this run's examples j, chunk j of every example's value along ``d`` (of B chunks), concatenated
    in global order along ``d``."""
    n, B = rows.shape[0], sum(sizes)
    moved = rows.movedim(d + 1, 1)  # (n, B * chunk, rest...)
    chunk = moved.shape[1] // B
    four = moved.unflatten(1, (B, chunk))  # (n, B, chunk, rest...): [my example, its destination example]
    if _alone(frame):
        got = four  # one rank: its examples are every source
    else:
        offsets = first_rows(sizes)
        send = torch.cat([four.narrow(1, o, k).flatten(0, 1) for o, k in zip(offsets, sizes)])
        every = tuple(tuple(a * k for k in sizes) for a in sizes)  # rank r sends each rank its examples' chunks
        spec = _spec(frame, rule, name, 0, tuple(n * k for k in sizes), recv=tuple(k * n for k in sizes), sent=every)
        got = wire_native.run(rule.collective, spec, send).unflatten(0, (B, n))  # [source example, my example]
    return got.transpose(0, 1).flatten(1, 2).movedim(1, d + 1)  # (n, B * chunk along d, ...)


@_per_example
def permute_rows(
    frame: AxisFrame, rows: torch.Tensor, rule: AxisRule, name: str, sources: Tuple[int, ...], sizes: Tuple[int, ...]
) -> torch.Tensor:
    """Each of this run's examples j gets example ``sources[j]``'s row (zeros for -1): each row travels once, from
    the rank that holds its source to the rank that holds its destination."""
    owner = [r for r, k in enumerate(sizes) for _ in range(k)]
    offsets = first_rows(sizes)
    me = 0 if frame.link is None else frame.link.group.rank
    pairs = [(s, j) for j, s in enumerate(sources) if s >= 0]  # (source, destination), in destination order
    sent = [[s - offsets[me] for s, j in pairs if owner[s] == me and owner[j] == r] for r in range(len(sizes))]
    got = [[j - offsets[me] for s, j in pairs if owner[s] == r and owner[j] == me] for r in range(len(sizes))]
    flat_sent = [i for part in sent for i in part]
    send = rows.index_select(0, index_table(tuple(flat_sent), rows.device))
    if _alone(frame):
        received = send
    else:
        every = [[0] * len(sizes) for _ in sizes]  # rows from each rank to each, alike on every rank
        for s, j in pairs:
            every[owner[s]][owner[j]] += 1
        recv = tuple(len(p) for p in got)
        spec = _spec(frame, rule, name, 0, tuple(len(p) for p in sent), recv=recv, sent=_rows(every))
        received = wire_native.run(rule.collective, spec, send)
    where = index_table(tuple(j for part in got for j in part), rows.device)
    return rows.new_zeros(rows.shape).index_copy(0, where, received)


# ------------------------------------------------- eager: mesh axes taken together, and uneven tiled chunks
# Along ``shard_map`` mesh axes each rank is one member and holds its own value, so an op over a tuple of axes is
# one native collective on the group of those axes (a Joint), and uneven chunks travel at their own lengths. The
# group's ranks are in global-rank order, which need not be the index order: chunks are put in group-rank order
# before the collective, and what arrives back in index order after it.


def split_lengths(length: int, size: int) -> Tuple[int, ...]:
    """Each member's ``torch.tensor_split`` chunk of ``length`` (the first ``length % size`` one longer)."""
    base, extra = divmod(length, size)
    return tuple(base + (1 if i < extra else 0) for i in range(size))


def _by_rank(joint: Joint) -> Tuple[int, ...]:
    """The index of the member at each group rank."""
    index = [0] * len(joint.ranks)
    for i, r in enumerate(joint.ranks):
        index[r] = i
    return tuple(index)


def _in_order(joint: Joint) -> bool:
    return joint.ranks == tuple(range(len(joint.ranks)))


def scatter_on_ranks(joint: Joint, x: torch.Tensor, d: int, lengths: Tuple[int, ...], what: str) -> torch.Tensor:
    """This member's chunk (``lengths[index]`` along ``d``) of the sum over the members of every member's ``x``: a
    reduce-scatter on the joint group (backward: an all-gather)."""
    if joint.link.group.size == 1:
        return x.clone()
    by_rank = _by_rank(joint)
    sizes = tuple(lengths[i] for i in by_rank)
    if not _in_order(joint):
        starts = first_rows(lengths)
        picks = tuple(k for i in by_rank for k in range(starts[i], starts[i] + lengths[i]))
        x = x.index_select(d, index_table(picks, x.device))
    return wire_native.run(wire_native.ReduceScatter, NativeSpec(joint.link, d, sizes, what, Kind.OP), x)


def a2a_on_ranks(
    joint: Joint, x: torch.Tensor, s: int, c: int, lengths: Tuple[int, ...], *, tiled: bool, what: str
) -> torch.Tensor:
    """From every member, in index order, its chunk for this member (``lengths[index]`` of ``x``'s dim ``s``),
    concatenated along ``c`` (or, untiled, stacked along a new dim ``c``, dim ``s`` gone): an all-to-all on the joint
    group with each chunk's own length (backward: the same, the lengths swapped)."""
    size, mine = len(lengths), lengths[joint.index]
    rows = x.movedim(s, 0)  # the chunks to send, along dim 0
    if joint.link.group.size == 1:
        got = rows
    else:
        by_rank = _by_rank(joint)
        if not _in_order(joint):
            starts = first_rows(lengths)
            picks = tuple(k for i in by_rank for k in range(starts[i], starts[i] + lengths[i]))
            rows = rows.index_select(0, index_table(picks, rows.device))
        sizes = tuple(lengths[i] for i in by_rank)  # every member sends the same lengths
        spec = NativeSpec(joint.link, 0, sizes, what, Kind.OP, (mine,) * size, sent=(sizes,) * size)
        got = wire_native.run(wire_native.AllToAll, spec, rows)  # from each group rank, its chunk for this member
    parts = got.unflatten(0, (size, mine))  # [source, chunk, the other dims]
    if not _in_order(joint):
        parts = parts.index_select(0, index_table(joint.ranks, parts.device))  # sources in index order
    if not tiled:
        return parts.squeeze(1).movedim(0, c)
    return parts.movedim(1, s + 1).movedim(0, c).flatten(c, c + 1)


def permute_on_ranks(joint: Joint, x: torch.Tensor, sources: Tuple[int, ...], what: str) -> torch.Tensor:
    """The value of member ``sources[index]`` (zeros for -1): an all-to-all on the joint group in which this member
    sends its value to its destination alone and receives from its source alone (backward: the inverse)."""
    me, size = joint.index, len(sources)
    dst = next((j for j, src in enumerate(sources) if src == me), -1)
    send_to = [0] * size
    came_from = [0] * size
    if dst >= 0:
        send_to[joint.ranks[dst]] = 1
    if sources[me] >= 0:
        came_from[joint.ranks[sources[me]]] = 1
    rows = x.unsqueeze(0)
    send = rows if dst >= 0 else rows.narrow(0, 0, 0)
    if joint.link.group.size == 1:
        received = send
    else:
        every = [[0] * size for _ in range(size)]  # rows from each group rank to each, alike on every rank
        for j, src in enumerate(sources):
            if src >= 0:
                every[joint.ranks[src]][joint.ranks[j]] = 1
        spec = NativeSpec(joint.link, 0, tuple(send_to), what, Kind.OP, tuple(came_from), sent=_rows(every))
        received = wire_native.run(wire_native.AllToAll, spec, send)
    # zeros with the received row copied in: this rank's graph reaches the all-to-all even with no source, so that
    # its backward meets every peer's
    where = index_table((0,) if sources[me] >= 0 else (), x.device)
    return rows.new_zeros(rows.shape).index_copy(0, where, received).squeeze(0)


# ------------------------------------------------------------------------ traced: inside torch.compile (batched)
# The eager rules' primitives in their traced form (``wire.traced``), with the same transposes.
def reduce_rows_traced(
    frame: AxisFrame, rows: torch.Tensor, rule: AxisRule, name: str, arg: Any = None
) -> torch.Tensor:
    """As :func:`reduce_rows`: ``Split(Join(.))`` for a sum, the Join alone for max and min."""
    local = rule.local(_real(frame, rows))
    if _alone(frame):
        return local
    group = frame.link.group
    total = traced_join(local, rule.collective, group.pg, group.rank)
    return traced_split(total, COPY, group.pg, group.rank) if rule.differentiable else total


def gather_rows_traced(
    frame: AxisFrame, rows: torch.Tensor, rule: AxisRule, name: str, arg: Any = None
) -> torch.Tensor:
    """As :func:`gather_rows`, the collective's traced form."""
    real = _real(frame, rows)
    if _alone(frame):
        return real
    return rule.collective.traced(real, tuple(frame.sizes), frame.link.group.pg, frame.link.group.rank)


# ----------------------------------------------------------------------- traced: inside torch.compile, vmap mode
def sum_rows_traced_vmap(
    frame: AxisFrame, rows: torch.Tensor, rule: AxisRule, name: str, arg: Any = None
) -> torch.Tensor:
    """Every rank's partial sum, added up: the gather's backward sums the cotangents over the ranks."""
    local = rule.local(_real(frame, rows))
    if _alone(frame):
        return local
    return gather_under_vmap(local.unsqueeze(0), frame.link.group.pg).sum(0)


def extreme_rows_traced_vmap(
    frame: AxisFrame, rows: torch.Tensor, rule: AxisRule, name: str, arg: Any = None
) -> torch.Tensor:
    """A reduction with no gradient (max, min): a functional all-reduce of the detached partial results."""
    local = rule.local(_real(frame, rows))
    if _alone(frame):
        return local
    return functional_all_reduce(local.detach().contiguous(), rule.reduce_op, frame.link.group.pg)


def gather_rows_traced_vmap(
    frame: AxisFrame, rows: torch.Tensor, rule: AxisRule, name: str, arg: Any = None
) -> torch.Tensor:
    """The all-gather op with its own autograd kernel, padded to the largest share."""
    real = _real(frame, rows)
    if _alone(frame):
        return real
    return gather_padded(real, frame.sizes, lambda padded: gather_under_vmap(padded, frame.link.group.pg))
