"""Parallel styles: what ``shard_model(model, plan=...)`` makes of each module a plan names.

As ``ColwiseParallel`` and ``RowwiseParallel`` are in ``torch.distributed.tensor.parallel``, a style is an object that
a plan maps module-name patterns to. Each one owns its checks (the module type it shards, and what such a module must
not do) and ``_apply``, which builds the tensor-parallel layer of :mod:`.layers` that replaces the module. The strings
``"colwise"``, ``"rowwise"``, ``"colwise_gather"`` and ``"vocab"`` are shorthands for the four styles
(:data:`SHORTHANDS`); :func:`resolve_style` reads either.
"""

from typing import Any, ClassVar, Dict, Optional, Sequence, Tuple, Type, Union

from torch import nn

from ..wire.group import Group
from .layers import (
    CALL,
    ColumnParallelLinear,
    RegionInputs,
    RowParallelLinear,
    SequenceRows,
    VocabParallelEmbedding,
    sum_output,
)

__all__ = [
    "ParallelStyle",
    "Colwise",
    "Rowwise",
    "ColwiseGather",
    "RowwiseReplicated",
    "RowwisePartial",
    "Vocab",
    "Gather",
    "Local",
    "Sequence",
    "SHORTHANDS",
    "TRANSFORMERS_STYLES",
    "resolve_style",
]


class ParallelStyle:
    """How a plan shards one module: the base of the four styles.

    A style holds no state, so two instances of one class are equal (a module that two patterns give the same style
    is sharded once), whether they came from an object or from its shorthand string.

    Attributes:
        name: the style's shorthand in a plan; messages and layer reprs name the style by it.
        module_type: the plain module class the style replaces (a subclass with its own forward is refused).
        splits_heads: whether the layer leaves an attention module this rank's heads only, so that the module's
            integer head counts become this rank's.
    """

    name: ClassVar[str]
    module_type: ClassVar[Type[nn.Module]]
    splits_heads: ClassVar[bool] = False

    def _check(self, path: str, module: nn.Module, pattern: str) -> None:
        """Raise ``ValueError``, naming the plan pattern, the module path and the style, when the style cannot
        shard ``module``. Reads only the module, so every rank raises alike."""
        kind = self.module_type
        if not isinstance(module, kind):
            raise ValueError(
                f"{CALL}: plan pattern {pattern!r} gives style {self.name!r} to module {path!r}, a "
                f"{type(module).__name__}; {self.name!r} shards an nn.{kind.__name__}."
            )
        if type(module).forward is not kind.forward:  # a subclass that computes something else (LoRA, quantized, ...)
            raise ValueError(
                f"{CALL}: plan pattern {pattern!r} gives style {self.name!r} to module {path!r}, a "
                f"{type(module).__name__} with its own forward; {self.name!r} replaces a plain nn.{kind.__name__}."
            )

    def _head_features(self, module: nn.Module) -> Optional[Tuple[int, str]]:
        """The features that the split cuts and an attention module's heads span: their count and side
        (``"input"`` or ``"output"``); None when the style splits no such features."""
        return None

    def _apply(self, module: nn.Module, group: Group, path: str, entries: RegionInputs) -> nn.Module:
        """The tensor-parallel layer that replaces ``module`` (already checked), holding this rank's slices.

        Args:
            module: the module at ``path``, as the plan matched it.
            group: the resolved tensor-parallel group.
            path: the module's path in the model, which names the layer's exchanges and messages.
            entries: the model's shared record of inputs entered into the tensor-parallel region.
        """
        raise NotImplementedError

    def __eq__(self, other: Any) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted(vars(self).items()))))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Colwise(ParallelStyle):
    """An ``nn.Linear`` split by output features: Megatron's column-parallel linear (shorthand ``"colwise"``).

    Each rank holds its ``torch.tensor_split`` rows of the ``[out_features, in_features]`` weight and the matching
    slice of the bias. The input is replicated; the output is this rank's output features along the last dim, left
    sharded for a :class:`Rowwise` layer to take.

    Forward communicates nothing. Backward sums the input gradient over the group (Megatron's *f*), once for every
    column-parallel layer of the model that reads the same input tensor (q, k and v; gate and up). Inside an
    attention module, every rank must get whole heads.
    """

    name = "colwise"
    module_type = nn.Linear
    splits_heads = True
    gathers = False

    def __init__(self, parts: Union[None, int, Sequence[int]] = None) -> None:
        """Args:
        parts: a packed Linear's parts along its output features (a fused qkv: ``(q, k, v)`` lengths; a fused
            gate_up: ``2``, equal parts): each part is split alone, and a rank's output is its slice of each part,
            in order. None: one part."""
        self.parts = _checked_parts(self, parts)

    def part_lengths(self, features: int) -> Tuple[int, ...]:
        """The parts' lengths for ``features`` output features; () for one part."""
        return _part_lengths(self.parts, features)

    def _check(self, path: str, module: nn.Module, pattern: str) -> None:
        super()._check(path, module, pattern)
        _check_parts(self, path, module.out_features, "output", pattern)
        if self.parts is not None and self.gathers:
            raise ValueError(
                f"{CALL}: plan pattern {pattern!r}: {self!r} gathers its output; packed parts are colwise."
            )

    def _head_features(self, module: nn.Module) -> Optional[Tuple[int, str]]:
        if self.parts is not None:
            return None  # each part is split alone; a packed projection's heads are the model's to read
        return module.out_features, "output"

    def __repr__(self) -> str:
        return _parts_repr(self)

    def _apply(self, module: nn.Module, group: Group, path: str, entries: RegionInputs) -> nn.Module:
        return ColumnParallelLinear(module, group, path, entries, self)


class ColwiseGather(Colwise):
    """An ``nn.Linear`` split by output features, its output gathered (shorthand ``"colwise_gather"``).

    Each rank holds what :class:`Colwise` holds. The input is replicated, and so is the output: every rank's output
    features, gathered along the last dim (an LM head's logits).

    Forward makes one gather (``Join`` of the last dim's rows), whose backward takes this rank's slice with no
    exchange. Backward sums the input gradient over the group, as :class:`Colwise` does.
    """

    name = "colwise_gather"
    splits_heads = False
    gathers = True


class Rowwise(ParallelStyle):
    """An ``nn.Linear`` split by input features: Megatron's row-parallel linear (shorthand ``"rowwise"``).

    Each rank holds its ``torch.tensor_split`` columns of the ``[out_features, in_features]`` weight and the whole
    bias. The input is this rank's slice of the input features (the output a :class:`Colwise` layer left sharded);
    the output is replicated: the sum of every rank's partial product, then the bias, added once.

    Forward makes one sum over the group (Megatron's *g*, a round-free ``Join(COPY)``: one all-reduce, no round). Backward
    communicates nothing. Inside an attention module, every rank must get whole heads.

    ``Rowwise(parts=...)`` takes a packed weight whose input features are parts (the output of a
    ``Colwise(parts=...)`` layer, a rank's slice of each part in order): each part's columns are split alone.
    """

    name = "rowwise"
    module_type = nn.Linear
    splits_heads = True
    takes_replicated = False
    sums = True

    def __init__(self, parts: Union[None, int, Sequence[int]] = None) -> None:
        """Args:
        parts: a packed Linear's parts along its input features (the input a ``Colwise(parts=...)`` layer leaves:
            ``(a, b)`` lengths, or ``2``, equal parts): each part is split alone, and a rank takes its slice of each
            part, in order. None: one part."""
        self.parts = _checked_parts(self, parts)

    def part_lengths(self, features: int) -> Tuple[int, ...]:
        """The parts' lengths for ``features`` input features; () for one part."""
        return _part_lengths(self.parts, features)

    def _check(self, path: str, module: nn.Module, pattern: str) -> None:
        super()._check(path, module, pattern)
        _check_parts(self, path, module.in_features, "input", pattern)

    def _head_features(self, module: nn.Module) -> Optional[Tuple[int, str]]:
        if self.parts is not None:
            return None  # each part is split alone, as for Colwise(parts=...)
        return module.in_features, "input"

    def __repr__(self) -> str:
        return _parts_repr(self)

    def _apply(self, module: nn.Module, group: Group, path: str, entries: RegionInputs) -> nn.Module:
        return RowParallelLinear(module, group, path, self, entries)


class Vocab(ParallelStyle):
    """An ``nn.Embedding`` split by vocabulary rows: Megatron's vocabulary-parallel embedding (shorthand
    ``"vocab"``).

    Each rank holds its ``torch.tensor_split`` rows of the table (token ids), and the padding row if it falls among
    them. The ids are replicated; ids outside this rank's rows look up zeros, and the output is replicated: the sum
    over the group. Embeddings with ``max_norm`` or ``scale_grad_by_freq`` are refused: both need the whole table.

    Forward makes one sum over the group (a round-free ``Join(COPY)``). Backward communicates nothing.
    """

    name = "vocab"
    module_type = nn.Embedding

    def _check(self, path: str, module: nn.Module, pattern: str) -> None:
        super()._check(path, module, pattern)
        if module.max_norm is not None or module.scale_grad_by_freq:
            raise ValueError(
                f"{CALL}: embedding {path!r} uses max_norm or scale_grad_by_freq, which look at every id of the "
                f"batch against the whole table; a vocabulary-split table cannot keep them."
            )

    def _apply(self, module: nn.Module, group: Group, path: str, entries: RegionInputs) -> nn.Module:
        return VocabParallelEmbedding(module, group, path, self, entries)


class RowwiseReplicated(Rowwise):
    """An ``nn.Linear`` split by input features whose input is replicated (shorthand ``"rowwise_rep"``, as
    transformers names it).

    Each rank holds what :class:`Rowwise` holds and takes its own slice of the replicated input's features; the
    output is the replicated sum, the bias added once. Forward makes one sum over the group; backward sums the input
    gradient (each rank's slice in zeros), so every rank holds all of it.
    """

    name = "rowwise_rep"
    takes_replicated = True


class RowwisePartial(Rowwise):
    """An ``nn.Linear`` split by input features whose output is left partial (shorthand ``"local_rowwise"``, as
    transformers names it): no sum, and no bias (a :class:`Gather` module around it sums the partial results; a
    bias would be added once per rank, so a Linear with one is refused).

    Forward and backward communicate nothing.
    """

    name = "local_rowwise"
    sums = False

    def _check(self, path: str, module: nn.Module, pattern: str) -> None:
        super()._check(path, module, pattern)
        if module.bias is not None:
            raise ValueError(
                f"{CALL}: plan pattern {pattern!r} gives style {self.name!r} to module {path!r}, which has a bias; a "
                f"partial output would add it once on every rank. Use 'rowwise' (the sum, then the bias once)."
            )


class Gather(ParallelStyle):
    """Any module whose output (the first one, if it returns a tuple) is summed over the group (shorthand
    ``"gather"``, transformers' ``GatherParallel``): the exit of a region of :class:`RowwisePartial` layers.

    The module stays as it is, with a forward hook. Forward makes one sum; backward communicates nothing.
    """

    name = "gather"
    module_type = nn.Module

    def _check(self, path: str, module: nn.Module, pattern: str) -> None:
        pass  # any module: only its output is touched

    def _apply(self, module: nn.Module, group: Group, path: str, entries: RegionInputs) -> nn.Module:
        module.register_forward_hook(sum_output(group, path))
        return module


class Local(ParallelStyle):
    """A module left as it is (shorthand ``"local"``, transformers' ``IsolatedParallel``): it computes on this
    rank's values; its children may be sharded by other entries of the plan. Communicates nothing."""

    name = "local"
    module_type = nn.Module

    def _check(self, path: str, module: nn.Module, pattern: str) -> None:
        pass

    def _apply(self, module: nn.Module, group: Group, path: str, entries: RegionInputs) -> nn.Module:
        return module


class Sequence(ParallelStyle):
    """A module (a norm) run on this rank's rows of the sequence (dim 1), its output gathered (shorthand
    ``"sequence_parallel"``, transformers' ``SequenceParallel``).

    The parameters are replicated; their gradients are summed over the group (each rank's rows contribute a part).
    The input is replicated; each rank computes its ``torch.tensor_split`` rows of the sequence, and the output is
    every rank's rows, gathered (one exchange forward; backward takes this rank's rows of the output gradient,
    gathers the input gradient, and sums the parameters' gradients).
    """

    name = "sequence_parallel"
    module_type = nn.Module

    def _check(self, path: str, module: nn.Module, pattern: str) -> None:
        if any(True for _ in module.buffers()):
            raise ValueError(
                f"{CALL}: plan pattern {pattern!r} gives style {self.name!r} to module {path!r}, which has buffers "
                f"(running statistics would differ per rank); it takes a module computing each position alone (a "
                f"norm, dropout)."
            )

    def _apply(self, module: nn.Module, group: Group, path: str, entries: RegionInputs) -> nn.Module:
        SequenceRows(module, group, path, self)  # its hooks, on the module
        return module


def _checked_parts(style: ParallelStyle, parts: Any) -> Union[None, int, Tuple[int, ...]]:
    """A packed Linear's parts as a style keeps them: None, a positive count, or a tuple of positive lengths."""
    if parts is not None and not isinstance(parts, int):
        parts = tuple(int(n) for n in parts)
    if parts is not None and (parts <= 0 if isinstance(parts, int) else not parts or min(parts) <= 0):
        raise ValueError(
            f"{CALL}: {type(style).__name__}(parts={parts!r}): parts is a positive count or positive lengths."
        )
    return parts


def _part_lengths(parts: Union[None, int, Tuple[int, ...]], features: int) -> Tuple[int, ...]:
    if parts is None:
        return ()
    if isinstance(parts, int):
        return (features // parts,) * parts
    return parts


def _check_parts(style: Any, path: str, n: int, side: str, pattern: str) -> None:
    parts = style.parts
    if parts is not None and (n % parts if isinstance(parts, int) else sum(parts) != n):
        raise ValueError(
            f"{CALL}: plan pattern {pattern!r} gives {path!r} ({n} {side} features) {style!r}, whose parts do not "
            f"add up to its features; give parts lengths that sum to {n}, or a count that divides it."
        )


def _parts_repr(style: Any) -> str:
    return f"{type(style).__name__}()" if style.parts is None else f"{type(style).__name__}(parts={style.parts!r})"


SHORTHANDS: Dict[str, ParallelStyle] = {
    s.name: s
    for s in (
        Colwise(),
        Rowwise(),
        ColwiseGather(),
        Vocab(),
        RowwiseReplicated(),
        RowwisePartial(),
        Gather(),
        Local(),
        Sequence(),
    )
}
"""The strings a plan may give instead of a style object, each naming one style."""

TRANSFORMERS_STYLES: Dict[str, ParallelStyle] = {
    "colwise": Colwise(),
    "rowwise": Rowwise(),
    "colwise_rep": ColwiseGather(),
    "rowwise_rep": RowwiseReplicated(),
    "local_colwise": Colwise(),  # transformers' local tensors instead of DTensors: cmap has only local tensors
    "local_rowwise": RowwisePartial(),
    "local": Local(),
    "gather": Gather(),
    "sequence_parallel": Sequence(),
}
"""transformers' style strings (``transformers.integrations.tensor_parallel.SUPPORTED_TP_STYLES``), each the cmap
style that shards alike. ``"local_packed_rowwise"`` (packed expert parameters, not modules) has none."""


def resolve_style(style: Any, pattern: str) -> ParallelStyle:
    """The style object a plan gives ``pattern``: a :class:`ParallelStyle`, or its shorthand string.

    Raises:
        ValueError: anything else, naming the pattern.
    """
    if isinstance(style, ParallelStyle):
        return style
    if isinstance(style, str) and style in SHORTHANDS:
        return SHORTHANDS[style]
    if isinstance(style, str) and style in TRANSFORMERS_STYLES:
        return TRANSFORMERS_STYLES[style]
    objects = ", ".join(map(repr, SHORTHANDS.values()))
    raise ValueError(
        f"{CALL}: plan pattern {pattern!r} has unknown style {style!r}; expected one of {', '.join(SHORTHANDS)}, "
        f"transformers' {', '.join(sorted(set(TRANSFORMERS_STYLES) - set(SHORTHANDS)))}, "
        f"or a style object: {objects}."
    )
