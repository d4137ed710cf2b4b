"""``axis_index_groups=``: ``psum``, ``pmean``, ``pmax``, ``pmin`` and ``all_gather`` within groups of an axis's
members, as sub-group collectives.

The groups partition the axis's indices (its examples, or its ranks along a mesh axis) into groups of one size;
the order inside a group is the gather order. Each group's members live on some ranks of the axis's group: the
groups whose members live on the same ranks form a bucket, and each bucket is one collective over those ranks
alone: on a ``shard_map`` mesh, the mesh's group of them (an axis's, where they are one; the mesh's exits reach the
mesh's groups only), else a ``torch.distributed`` group made once for them (collectively, by its members) and
kept. A bucket on one rank needs no communication. Buckets run in one order on every rank, so no two ranks wait on
each other in different groups. Nothing travels to a rank outside a group: the bytes are the sub-group's, never a
full collective and a mask.
"""

import functools
import itertools
from typing import Any, Dict, List, NamedTuple, Sequence, Tuple

import torch

from ..wire.group import group_for
from ..wire.link import Link, link_for
from ..wire.roles import first_row
from .frame import AxisFrame
from .lowering import _real, gather_rows, index_table, reduce_rows
from .rules import AxisRule, rule_of

Groups = Tuple[Tuple[int, ...], ...]


def check_groups(op: str, axis_name: Any, groups: Any, size: int) -> Groups:
    """``groups`` as tuples, after checking that they cover every index of the axis exactly once, in groups of one
    size (jax checks only the cover, then fails in XLA on groups of different sizes)."""
    try:
        found = tuple(tuple(int(i) for i in g) for g in groups)
    except TypeError:
        raise TypeError(
            f"{op}(x, {axis_name!r}, axis_index_groups={groups!r}): axis_index_groups must be a list of lists of "
            f"axis indices."
        ) from None
    where = f"{op}(x, {axis_name!r}, axis_index_groups={[list(g) for g in found]})"
    if sorted(i for g in found for i in g) != list(range(size)):
        raise ValueError(
            f"{where}: axis_index_groups must cover all indices exactly once (jax's words): the axis has {size} "
            f"members, 0 to {size - 1}, and each must be in one group."
        )
    lengths = [len(g) for g in found]
    if len(set(lengths)) > 1:
        raise ValueError(
            f"{where}: the groups have sizes {lengths}; every group must have the same size (jax accepts these and "
            f"then fails in XLA). Split the axis into groups of one size."
        )
    return found


class Bucket(NamedTuple):
    """The groups whose members live on the same ranks: those ranks (group ranks of the axis's group, in order)
    and the groups (their numbers in ``groups``)."""

    ranks: Tuple[int, ...]
    groups: Tuple[int, ...]


class Layout(NamedTuple):
    """Where a grouping's members live: each index's rank, each index's group number and position in its group,
    each index's row among its rank's rows, each rank's indices in row order, and the buckets in the one order every
    rank runs them."""

    owner: Tuple[int, ...]
    group_of: Tuple[int, ...]
    position: Tuple[int, ...]
    slot: Tuple[int, ...]
    held: Tuple[Tuple[int, ...], ...]
    buckets: Tuple[Bucket, ...]


def owners(frame: AxisFrame) -> Tuple[int, ...]:
    """The group rank holding each index of the frame's axis: consecutive indices in rank order, or the frame's
    ``members`` (mesh axes of a tuple name)."""
    if frame.members is not None:
        return frame.members
    sizes = tuple(frame.sizes) if frame.link is not None else (frame.size,)
    return tuple(r for r, k in enumerate(sizes) for _ in range(k))


@functools.lru_cache(maxsize=256)
def layout(groups: Groups, owner: Tuple[int, ...]) -> Layout:
    """The layout of ``groups`` over ranks holding the indices ``owner`` gives them (each rank its own in order)."""
    group_of_index, position = [0] * len(owner), [0] * len(owner)
    held: List[List[int]] = [[] for _ in range(max(owner, default=-1) + 1)]
    for i, r in enumerate(owner):
        held[r].append(i)
    slot = tuple(held[r].index(i) for i, r in enumerate(owner))
    by_ranks: Dict[Tuple[int, ...], List[int]] = {}
    for k, g in enumerate(groups):
        for p, i in enumerate(g):
            group_of_index[i], position[i] = k, p
        by_ranks.setdefault(tuple(sorted({owner[i] for i in g})), []).append(k)
    buckets = tuple(Bucket(ranks, tuple(ks)) for ranks, ks in sorted(by_ranks.items()))
    return Layout(owner, tuple(group_of_index), tuple(position), slot, tuple(map(tuple, held)), buckets)


def _sub_link(frame: AxisFrame, ranks: Tuple[int, ...]) -> Link:
    """The link over these group ranks of the frame's group: the group itself; on a ``shard_map`` mesh, the mesh's
    group over them (an axis's, where they are one: the collective is the axis's own, and the mesh's exits have no
    other group to reach); else a group made once for them (its members alone take part in making it) and kept."""
    link = frame.link
    if len(ranks) == link.group.size:
        return link
    members = tuple(link.group.ranks[r] for r in ranks)
    if frame.mesh is not None:
        return frame.mesh.group(members)._replace(call=link.call, timeout=link.timeout)
    return link_for(group_for(members), link.device, link.call, link.timeout)


def _sub_frame(frame: AxisFrame, bucket: Bucket, sizes: Sequence[int]) -> AxisFrame:
    """The frame of one bucket's collective: its ranks, each holding ``sizes`` rows."""
    me = bucket.ranks.index(_me(frame))
    link = None if len(bucket.ranks) == 1 else _sub_link(frame, bucket.ranks)
    return AxisFrame(link=link, size=sum(sizes), offset=first_row(sizes, me), sizes=tuple(sizes), mode=frame.mode)


def _me(frame: AxisFrame) -> int:
    return 0 if frame.link is None else frame.link.group.rank


def _mine(frame: AxisFrame, groups: Groups) -> Tuple[Layout, Tuple[int, ...], List[Bucket]]:
    """The layout, this rank's indices (one per row, in order), and the buckets it takes part in, in order."""
    found = layout(groups, owners(frame))
    me = _me(frame)
    held = found.held[me] if me < len(found.held) else ()
    return found, held, [b for b in found.buckets if me in b.ranks]


def _to_rows(
    frame: AxisFrame,
    rows: torch.Tensor,
    found: Layout,
    held: Tuple[int, ...],
    per_group: List[torch.Tensor],
    numbers: List[int],
    *,
    entry: Tuple[int, ...],
) -> torch.Tensor:
    """Each of this run's rows gets its group's entry (of shape ``entry``) of ``per_group`` (one tensor per bucket, a
    row per group of ``numbers``, in order). The stand-in example of an empty shard gets zeros made from it, so that
    its graph still reaches the call's entry and backward meets on every rank."""
    if frame.dummy or not numbers:
        return _zeros_like_entries(rows, entry)
    table = torch.cat(per_group) if len(per_group) > 1 else per_group[0]
    at = {k: n for n, k in enumerate(numbers)}
    picks = tuple(at[found.group_of[held[j]]] for j in range(rows.shape[0]))
    return table.index_select(0, index_table(picks, rows.device))


def _zeros_like_entries(rows: torch.Tensor, entry: Tuple[int, ...]) -> torch.Tensor:
    """Zeros of shape ``(rows, *entry)``, computed from ``rows`` (``entry`` is the rows' own shape, or a group's
    size before it)."""
    zeros = rows * 0
    if tuple(entry) == tuple(rows.shape[1:]):
        return zeros
    return zeros.unsqueeze(1).expand(rows.shape[0], entry[0], *rows.shape[1:]).clone()


# the reduction within each group of a grouped op (a grouped scatter's is the sum), and its partial on one rank
_WITHIN = {"pmax_grouped": ("pmax", "amax"), "pmin_grouped": ("pmin", "amin")}


def reduce_rows_grouped(
    frame: AxisFrame, rows: torch.Tensor, rule: AxisRule, name: str, groups: Groups
) -> torch.Tensor:
    """For each of this run's rows, the sum (or max, min) over its group: per bucket, this rank's partial of each
    group, one all-reduce over the bucket's ranks (for the sum a Join and a Split, so backward is the same grouped
    sum). Every rank of a bucket holds a member of each of its groups, so no partial is empty."""
    op, partial_op = _WITHIN.get(rule.name, ("psum", "sum"))
    real = _real(frame, rows)
    found, held, mine = _mine(frame, groups)
    per_group, numbers = [], []
    for bucket in mine:
        where = {k: n for n, k in enumerate(bucket.groups)}
        own = tuple(j for j in range(real.shape[0]) if found.group_of[held[j]] in where)
        slots = tuple(where[found.group_of[held[j]]] for j in own)
        partial = real.new_zeros((len(bucket.groups), *real.shape[1:]))
        if own:
            picked, at = real.index_select(0, index_table(own, real.device)), index_table(slots, real.device)
            if partial_op == "sum":
                partial = partial.index_add(0, at, picked)
            else:
                at = at.reshape(-1, *([1] * (picked.dim() - 1))).expand_as(picked)
                partial = partial.scatter_reduce(0, at, picked, partial_op, include_self=False)
        sizes = [1] * len(bucket.ranks)
        per_group.append(reduce_rows(_sub_frame(frame, bucket, sizes), partial.unsqueeze(0), rule_of(op), name))
        numbers.extend(bucket.groups)
    return _to_rows(frame, rows, found, held, per_group, numbers, entry=tuple(rows.shape[1:]))


def gather_rows_grouped(
    frame: AxisFrame, rows: torch.Tensor, rule: AxisRule, name: str, groups: Groups
) -> torch.Tensor:
    """For each of this run's rows, its group's members' rows stacked in the group's order: per bucket, one
    all-gather over the bucket's ranks of each rank's members of its groups (backward: a grouped reduce-scatter)."""
    real = _real(frame, rows)
    found, held, mine = _mine(frame, groups)
    size = len(groups[0])
    per_group, numbers = [], []
    for bucket in mine:
        # each rank's part: its members of the bucket's groups, group by group, each group in its order
        parts = [[i for k in bucket.groups for i in groups[k] if found.owner[i] == r] for r in bucket.ranks]
        me = bucket.ranks.index(_me(frame))
        own = real.index_select(0, index_table(tuple(found.slot[i] for i in parts[me]), real.device))
        sub = _sub_frame(frame, bucket, [len(p) for p in parts])
        full = gather_rows(sub, own, rule_of("all_gather"), name) if sub.link is not None else own
        at = {i: n for n, i in enumerate(itertools.chain.from_iterable(parts))}
        order = tuple(at[i] for k in bucket.groups for i in groups[k])
        per_group.append(full.index_select(0, index_table(order, real.device)).unflatten(0, (-1, size)))
        numbers.extend(bucket.groups)
    return _to_rows(frame, rows, found, held, per_group, numbers, entry=(size, *rows.shape[1:]))


def scatter_rows_grouped(
    frame: AxisFrame, rows: torch.Tensor, rule: AxisRule, name: str, arg: Tuple[Groups, int]
) -> torch.Tensor:
    """The transpose of :func:`gather_rows_grouped`: for each row, the sum over its group of every member's slice
    at this row's position along example dim ``d`` (a grouped sum, then each row's own slice)."""
    groups, d = arg
    total = reduce_rows_grouped(frame, rows, rule, name, groups).movedim(d + 1, 1)
    found, held, _ = _mine(frame, groups)
    if frame.dummy:
        return total[:, 0]
    spots = tuple(found.position[held[j]] for j in range(rows.shape[0]))
    pick = index_table(spots, rows.device).reshape(-1, 1, *([1] * (total.dim() - 2)))
    return total.gather(1, pick.expand(-1, 1, *total.shape[2:])).squeeze(1)


# ---------------------------------------------------------------- the grouped rules' batching and transpose args
def groups_at_dim_0(groups: Any) -> Tuple[Any, int]:
    return (groups, 0)


def groups_of(arg: Tuple[Any, int]) -> Any:
    return arg[0]


def gathered_to_dim(full: torch.Tensor, arg: Tuple[Any, int]) -> torch.Tensor:
    return full.movedim(0, arg[1])


def lead_before_grouped_dim(arg: Tuple[Any, int]) -> Tuple[Tuple[Any, int], int]:
    """Another map's dim leads the rows, so the gathered dim a grouped scatter sums moves one on."""
    return (arg[0], arg[1] + 1), 0
