"""What each tensor of a :class:`~colossalai_cmap.wire.exchange.Split` or ``Join`` is, and the transpose of each.

Every rank holds its own copy of each value. A *global* value (a caller's tensor under ``src=None``, a closure, a
result on every rank) is the same on every rank; a *per-rank* value is this rank's own (its rows, its partial sums).
``Split`` turns global values into per-rank ones, with no communication; ``Join`` turns per-rank values into
global ones, with one exchange. Role by role, each is the other's transpose, so backward of one is the other:

=========  =====================================  ==========================================
role       Split (global -> per rank)           Join (per rank -> global)
=========  =====================================  ==========================================
Rows       this rank's rows (``narrow``)          every rank's rows, in order (all-gather); of
                                                  copies (``source``), one copy of each block
COPY       the value itself                       the sum over ranks
KEEP       the value itself                       the value itself (no sum: a per-rank value)
FIRST      the value on rank 0, zeros elsewhere   rank 0's value
SAME       (as FIRST)                             this rank's value, equal on every rank
FRACTION   the value over P, on every rank        (as ONCE)
ONCE       (as FRACTION)                          this rank's value, equal on every rank (the mean)
SHARE      the value over P, on every rank        the mean over ranks
EVEN       (as SHARE)                             rank 0's value
MAX, MIN   (none: not differentiable)             the elementwise extremum over ranks
=========  =====================================  ==========================================

``SAME`` is ``FIRST`` where the values are known to be equal already (an ``out_dims=None`` output gathered for
every rank): nothing moves forward, and backward still gives the gradient to one rank only, so it is never counted
P times. ``ONCE`` is the same value left on each rank (an ``out_dims=None`` output with ``dst="local"``, a
replicated ``shard_map`` output with ``local=True``): every rank backpropagates its own cotangent, and backward
gives each rank its cotangent over P, so the ranks' parts add up to the mean cotangent, counted once. It is the
mean over ranks of values that are equal; ``FRACTION`` is its transpose, with no communication either way.

``EVEN`` is a replicated ``shard_map`` output (``P()``): rank 0's value, as ``FIRST``, but its cotangent split evenly
over the ranks (``SHARE``), as jax transposes one with ``check_vma=False``. ``SHARE`` is ``FRACTION`` for cotangents
that may differ between ranks (in double backward): its transpose is the real mean over ranks, one exchange.
"""

import itertools
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch


class Rows(NamedTuple):
    """Rows along ``dim``; rank r holds ``sizes[r]`` of them, starting at ``first_row(sizes, r)``.

    ``sizes`` is None at a call's exit with ``src="local"``: the round's table gives each rank's row count.
    ``source``: where several ranks hold copies of one block (a typed block invariant along a mesh axis), for each
    rank the rank whose rows it holds; only a rank holding its own sends them in a Join (the others none: ``sizes``
    counts what each sends), so a Join of copies is the gather of one copy of each block.
    """

    dim: int
    sizes: Optional[Tuple[int, ...]]
    source: Optional[Tuple[int, ...]] = None

    def shifted(self) -> "Rows":
        """The same rows of a tensor with a new leading (vmap) dim."""
        return self._replace(dim=self.dim + 1)

    def held(self, rank: int) -> Tuple[int, int]:
        """Where the rows rank ``rank`` holds start in the whole, and how many there are."""
        owner = rank if self.source is None else self.source[rank]
        return first_row(self.sizes, owner), self.sizes[owner]

    def sends(self, rank: int) -> bool:
        """Whether rank ``rank``'s rows travel in a Join: they are its own, not a copy of another rank's."""
        return self.source is None or self.source[rank] == rank


def tensor_split_sizes(n: int, parts: int) -> Tuple[int, ...]:
    """The sizes ``torch.tensor_split`` gives ``n`` items in ``parts``: the first ``n % parts`` one larger."""
    return tuple(n // parts + (1 if r < n % parts else 0) for r in range(parts))


def first_row(sizes: Sequence[int], rank: int) -> int:
    """Where rank ``rank``'s rows start, when rank r holds ``sizes[r]`` of them in rank order."""
    return sum(sizes[:rank])


def first_rows(sizes: Sequence[int]) -> List[int]:
    """Every rank's :func:`first_row`."""
    return [0, *itertools.accumulate(sizes)][:-1]


def gather_padded(
    rows: torch.Tensor, sizes: Sequence[int], all_gather: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """Every rank's rows (dim 0), in rank order, when rank r holds ``sizes[r]``: this rank's padded to the largest
    share (collectives take equal sizes), ``all_gather`` of them (``[P * largest, ...]``), the padding cut."""
    return cut_padded(all_gather(padded_rows(rows, max(sizes))), sizes)


def padded_rows(rows: torch.Tensor, cap: int) -> torch.Tensor:
    """``rows`` (dim 0) with zero rows after them up to ``cap``, contiguous: this rank's share of a gather."""
    if rows.shape[0] < cap:
        rows = torch.cat([rows, rows.new_zeros((cap - rows.shape[0], *rows.shape[1:]))])
    return rows.contiguous()


def cut_padded(gathered: torch.Tensor, sizes: Sequence[int], out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The rows of ``[P * max(sizes), ...]`` gathered blocks without their padding: a view of the first
    ``sum(sizes)`` rows when they form a prefix (full blocks, then one short, then empty ones), else a copy, into
    ``out`` where given (:func:`cut_target`, allocated before the collective)."""
    if _is_prefix(sizes):
        return gathered.narrow(0, 0, sum(sizes))
    if out is None:
        return torch.cat([gathered.narrow(0, r * max(sizes), n) for r, n in enumerate(sizes) if n])
    for r, (start, n) in enumerate(zip(first_rows(sizes), sizes)):
        if n:
            out.narrow(0, start, n).copy_(gathered.narrow(0, r * max(sizes), n))
    return out


def cut_target(gathered: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """Where :func:`cut_padded` puts the rows: the prefix view of ``gathered``, or a tensor allocated now, so that
    whatever can fail on one rank happens before the collective (the data phase's rule)."""
    if _is_prefix(sizes):
        return gathered.narrow(0, 0, sum(sizes))
    return gathered.new_empty((sum(sizes), *gathered.shape[1:]))


def _is_prefix(sizes: Sequence[int]) -> bool:
    cap = max(sizes)
    last = max((r for r, n in enumerate(sizes) if n), default=-1)
    return all(n == cap for n in sizes[:last])


def padded_shares(rows: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """``rows`` (dim 0, every rank's share in order) with each share padded to the largest, contiguous: a
    reduce-scatter's input (gloo needs equal shares); this rank's rows are the first ``sizes[rank]`` of its result."""
    cap = max(sizes)
    if any(n != cap for n in sizes):
        padded = rows.new_zeros((cap * len(sizes), *rows.shape[1:]))
        for r, (start, n) in enumerate(zip(first_rows(sizes), sizes)):
            padded.narrow(0, r * cap, n).copy_(rows.narrow(0, start, n))
        rows = padded
    return rows.contiguous()


COPY, KEEP, FIRST, SAME, MAX, MIN = "copy", "keep", "first", "same", "max", "min"
FRACTION, ONCE, SHARE, EVEN = "fraction", "once", "share", "even"
Role = Union[Rows, str]

_JOIN_TO_SPLIT = {COPY: COPY, KEEP: KEEP, FIRST: FIRST, SAME: FIRST, ONCE: FRACTION, SHARE: SHARE, EVEN: SHARE}
_SPLIT_TO_JOIN = {COPY: COPY, KEEP: KEEP, FIRST: FIRST, FRACTION: ONCE, SHARE: SHARE}
IN_PLACE = (KEEP, SAME, ONCE)  # Join roles whose result is this rank's own value: nothing travels


def is_rows(role: Role) -> bool:
    return isinstance(role, Rows)


def join_transpose(role: Role) -> Role:
    """The Split role whose result is this Join role's transpose (its backward)."""
    if is_rows(role):
        return role
    if role not in _JOIN_TO_SPLIT:
        raise RuntimeError(f"a {role} over ranks is not differentiable; detach its input or use a sum.")
    return _JOIN_TO_SPLIT[role]


def split_transpose(role: Role) -> Role:
    return role if is_rows(role) else _SPLIT_TO_JOIN[role]


def shifted(roles: Sequence[Role], batched: Sequence[bool]) -> Tuple[Role, ...]:
    """Roles for tensors whose vmap dim was moved to the front (only where ``batched``)."""
    return tuple(r.shifted() if b and is_rows(r) else r for r, b in zip(roles, batched))
