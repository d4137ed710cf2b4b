"""What each tensor of a :class:`~colossalai_cmap.wire.exchange.Split` or ``Join`` is, and the transpose of each.

Every rank holds its own copy of each value. A *global* value (a caller's tensor under ``src=None``, a closure, a
result on every rank) is the same on every rank; a *per-rank* value is this rank's own (its rows, its partial sums).
``Split`` turns global values into per-rank ones, with no communication; ``Join`` turns per-rank values into
global ones, with one exchange. Role by role, each is the other's transpose, so backward of one is the other:

=========  =====================================  ==========================================
role       Split (global -> per rank)           Join (per rank -> global)
=========  =====================================  ==========================================
Rows       this rank's rows (``narrow``)          every rank's rows, in order (all-gather)
COPY       the value itself                       the sum over ranks
KEEP       the value itself                       the value itself (no sum: a per-rank value)
FIRST      the value on rank 0, zeros elsewhere   rank 0's value
SAME       (as FIRST)                             this rank's value, equal on every rank
FRACTION   the value over P, on every rank        (as ONCE)
ONCE       (as FRACTION)                          this rank's value, equal on every rank (the mean)
MAX, MIN   (none: not differentiable)             the elementwise extremum over ranks
=========  =====================================  ==========================================

``SAME`` is ``FIRST`` where the values are known to be equal already (an ``out_dims=None`` output gathered for
every rank): nothing moves forward, and backward still gives the gradient to one rank only, so it is never counted
P times. ``ONCE`` is the same value left on each rank (an ``out_dims=None`` output with ``dst="local"``, a
replicated ``shard_map`` output with ``local=True``): every rank backpropagates its own cotangent, and backward
gives each rank its cotangent over P, so the ranks' parts add up to the mean cotangent, counted once. It is the
mean over ranks of values that are equal; ``FRACTION`` is its transpose, with no communication either way.
"""

import itertools
from typing import List, NamedTuple, Optional, Sequence, Tuple, Union


class Rows(NamedTuple):
    """Rows along ``dim``; rank r holds ``sizes[r]`` of them, starting at ``first_row(sizes, r)``.

    ``sizes`` is None at a call's exit with ``src="local"``: the round's table gives each rank's row count.
    """

    dim: int
    sizes: Optional[Tuple[int, ...]]

    def shifted(self) -> "Rows":
        """The same rows of a tensor with a new leading (vmap) dim."""
        return Rows(self.dim + 1, self.sizes)


def tensor_split_sizes(n: int, parts: int) -> Tuple[int, ...]:
    """The sizes ``torch.tensor_split`` gives ``n`` items in ``parts``: the first ``n % parts`` one larger."""
    return tuple(n // parts + (1 if r < n % parts else 0) for r in range(parts))


def first_row(sizes: Sequence[int], rank: int) -> int:
    """Where rank ``rank``'s rows start, when rank r holds ``sizes[r]`` of them in rank order."""
    return sum(sizes[:rank])


def first_rows(sizes: Sequence[int]) -> List[int]:
    """Every rank's :func:`first_row`."""
    return [0, *itertools.accumulate(sizes)][:-1]


COPY, KEEP, FIRST, SAME, MAX, MIN = "copy", "keep", "first", "same", "max", "min"
FRACTION, ONCE = "fraction", "once"
Role = Union[Rows, str]

_JOIN_TO_SPLIT = {COPY: COPY, KEEP: KEEP, FIRST: FIRST, SAME: FIRST, ONCE: FRACTION}
_SPLIT_TO_JOIN = {COPY: COPY, KEEP: KEEP, FIRST: FIRST, FRACTION: ONCE}
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
