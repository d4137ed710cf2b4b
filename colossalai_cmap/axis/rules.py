"""The record of one named-axis collective's rules, and the registry :class:`~.ops.AxisOp` looks them up in.

As jax registers a primitive's rules together (its transpose, its batcher, its lowering), each op here is one
:class:`AxisRule`: how its rows cross the wire eagerly and under ``torch.compile``, its value when every example holds
the same input, its batching rule at another map's vmap level, and its transpose. The table of the ops themselves sits
next to the public functions, in :mod:`.collectives` (``RULES``).
"""

import enum
import types
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, NamedTuple, Optional, Tuple

import torch

from .frame import AxisFrame

# An exchange of this run's rows (dim 0) over the axis: (frame, rows, rule, axis name, the op's argument) -> result
RowsRule = Callable[[AxisFrame, torch.Tensor, "AxisRule", str, Any], torch.Tensor]


class RuleKind(enum.Enum):
    """What each example gets: the reduction or the gather of every example's value (the same for all of them), or
    its own part (the result is batched over the axis)."""

    REDUCE = "reduce"
    GATHER = "gather"
    PER_EXAMPLE = "per-example"


def same(arg: Any) -> Any:
    return arg


def unchanged(result: torch.Tensor, arg: Any) -> torch.Tensor:
    return result


class Transpose(NamedTuple):
    """An op's transpose as another op of the table (jax's transpose rule): the cotangent goes through ``op`` with
    ``arg(this op's argument)``, and ``arrange(that result, this op's argument)`` is the input's cotangent."""

    op: str
    arg: Callable[[Any], Any] = same
    arrange: Callable[[torch.Tensor, Any], torch.Tensor] = unchanged


@dataclass(frozen=True)
class AxisRule:
    """One collective over a named axis, per example, as :class:`~.ops.AxisOp` runs it.

    Attributes:
        name: jax.lax's name, the op's key in the table and the name its errors and rounds carry.
        kind: a reduction, a gather, or per-example (each example gets its own part).
        rows: this run's rows (dim 0) over the axis on the wire, eagerly.
        traced: the same inside ``torch.compile`` (functional collectives); None: it is composed of other ops there.
        traced_vmap: the rows taken out of the vmap batch inside ``torch.compile`` (vmap mode), where functorch runs
            no autograd Function; None: composed of other ops there.
        unbatched: the result for an ``x`` every example holds alike, given the axis size: no communication.
        batching: at another map's vmap level, whose dim leads the rows: the op's argument for those rows, and the
            result's dim of the level.
        transpose: its transpose; None: not differentiable.
        collective: the wire collective it lowers to: a Join role for a reduction, else a ``wire.native`` Function.
        local: a reduction's rows reduced on this rank (None for the other kinds).
        reduce_op: torch's name of a reduction, for its functional collectives (None for the other kinds).
    """

    name: str
    kind: RuleKind
    rows: RowsRule
    traced: Optional[RowsRule]
    traced_vmap: Optional[RowsRule]
    unbatched: Callable[[torch.Tensor, int], torch.Tensor]
    batching: Callable[[Any], Tuple[Any, int]]
    transpose: Optional[Transpose]
    collective: Any
    local: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    reduce_op: Optional[str] = None

    @property
    def per_example(self) -> bool:
        """Each example gets its own part: the result is batched over the axis."""
        return self.kind is RuleKind.PER_EXAMPLE

    @property
    def differentiable(self) -> bool:
        return self.transpose is not None

    def label(self, axis_name: str) -> str:
        """The call as rounds and errors name it: ``psum('i')``."""
        return f"{self.name}({axis_name!r})"


_REGISTERED: Dict[str, AxisRule] = {}


def register(*rules: AxisRule) -> Mapping[str, AxisRule]:
    """Add ``rules`` to the registry, by name; returns a read-only view of it."""
    for rule in rules:
        _REGISTERED[rule.name] = rule
    return types.MappingProxyType(_REGISTERED)


def rule_of(op: str) -> AxisRule:
    """The registered rule of ``op``, a name of the table."""
    return _REGISTERED[op]
