"""Parallel styles: what ``shard_model(model, plan=...)`` makes of each module a plan names.

As ``ColwiseParallel`` and ``RowwiseParallel`` are in ``torch.distributed.tensor.parallel``, a style is an object that
a plan maps module-name patterns to. Each one owns its checks (the module type it shards, and what such a module must
not do) and ``_apply``, which builds the tensor-parallel layer of :mod:`.layers` that replaces the module. The strings
``"colwise"``, ``"rowwise"``, ``"colwise_gather"`` and ``"vocab"`` are shorthands for the four styles
(:data:`SHORTHANDS`); :func:`resolve_style` reads either.
"""

from typing import Any, ClassVar, Dict, Optional, Tuple, Type

from torch import nn

from ..wire.group import Group
from .layers import CALL, ColumnParallelLinear, Entries, RowParallelLinear, VocabParallelEmbedding

__all__ = ["ParallelStyle", "Colwise", "Rowwise", "ColwiseGather", "Vocab", "SHORTHANDS", "resolve_style"]


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

    def _apply(self, module: nn.Module, group: Group, path: str, entries: Entries) -> nn.Module:
        """The tensor-parallel layer that replaces ``module`` (already checked), holding this rank's slices.

        Args:
            module: the module at ``path``, as the plan matched it.
            group: the resolved tensor-parallel group.
            path: the module's path in the model, which names the layer's exchanges and messages.
            entries: the model's shared record of inputs entered into the tensor-parallel region.
        """
        raise NotImplementedError

    def __eq__(self, other: Any) -> bool:
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(type(self))

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

    def _head_features(self, module: nn.Module) -> Optional[Tuple[int, str]]:
        return module.out_features, "output"

    def _apply(self, module: nn.Module, group: Group, path: str, entries: Entries) -> nn.Module:
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

    Forward makes one sum over the group (Megatron's *g*, ``Join(COPY)``). Backward communicates nothing. Inside an
    attention module, every rank must get whole heads.
    """

    name = "rowwise"
    module_type = nn.Linear
    splits_heads = True

    def _head_features(self, module: nn.Module) -> Optional[Tuple[int, str]]:
        return module.in_features, "input"

    def _apply(self, module: nn.Module, group: Group, path: str, entries: Entries) -> nn.Module:
        return RowParallelLinear(module, group, path, self)


class Vocab(ParallelStyle):
    """An ``nn.Embedding`` split by vocabulary rows: Megatron's vocabulary-parallel embedding (shorthand
    ``"vocab"``).

    Each rank holds its ``torch.tensor_split`` rows of the table (token ids), and the padding row if it falls among
    them. The ids are replicated; ids outside this rank's rows look up zeros, and the output is replicated: the sum
    over the group. Embeddings with ``max_norm`` or ``scale_grad_by_freq`` are refused: both need the whole table.

    Forward makes one sum over the group (``Join(COPY)``). Backward communicates nothing.
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

    def _apply(self, module: nn.Module, group: Group, path: str, entries: Entries) -> nn.Module:
        return VocabParallelEmbedding(module, group, path, self)


SHORTHANDS: Dict[str, ParallelStyle] = {s.name: s for s in (Colwise(), Rowwise(), ColwiseGather(), Vocab())}
"""The strings a plan may give instead of a style object, each naming one style."""


def resolve_style(style: Any, pattern: str) -> ParallelStyle:
    """The style object a plan gives ``pattern``: a :class:`ParallelStyle`, or its shorthand string.

    Raises:
        ValueError: anything else, naming the pattern.
    """
    if isinstance(style, ParallelStyle):
        return style
    if isinstance(style, str) and style in SHORTHANDS:
        return SHORTHANDS[style]
    objects = ", ".join(map(repr, SHORTHANDS.values()))
    raise ValueError(
        f"{CALL}: plan pattern {pattern!r} has unknown style {style!r}; expected one of {', '.join(SHORTHANDS)}, "
        f"or a style object: {objects}."
    )
