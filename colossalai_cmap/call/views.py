"""Outputs that are views of the caller's mapped inputs: a view op's result (``x.t()``, ``x[0]``, ``x.view(...)``,
``x.real``), an in-place op's result, the input itself.

torch.vmap returns such an output as a view of the caller's tensor (``out._base is x``, same data pointer and
strides; the input itself where func returned what it was given), so later in-place writes to ``x`` show through.
With ``src=None`` every rank holds the whole input, so cmap returns the same view with no gather at all:

1. After func, each rank looks for outputs that share a mapped input's storage (:func:`find_views`) and reads their
   geometry over the whole batch: sizes, strides and storage offset, this rank's rows shifted back to row 0. An empty
   share's stand-in example is the input's first row (a view too), so every rank finds the same geometry.
2. The geometry's digest rides in the call's status round, folded into the layout digest (:func:`signature`): ranks
   that disagree raise together, as for any layout difference. View outputs skip the data phase.
3. After the round, each view output is the caller's tensor seen through that geometry (:func:`place`).

Outputs that require grad are left to the gather (their graph runs through the call's entry), and so are outputs
of ``chunk_size`` or loop mode, which vmap itself returns as copies (stacked or concatenated).
"""

from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..digests import digest
from ..torch_internals import is_wrapped, neg_view
from .layout import BATCHED, OutLayout
from .options import Options
from .records import Shares

# the input seen as another dtype: through view_as_real, view_as_complex (of its storage as pairs), or view(dtype)
REAL, COMPLEX, CAST = "real", "complex", "cast"


class View(NamedTuple):
    """One output leaf that is a view of an input leaf (mapped, or unmapped and expanded along the batch), with its
    geometry over the whole batch, in elements of the input seen as the output's dtype (``as_dtype``: None where they
    are the same)."""

    leaf: int
    source: int
    as_dtype: Optional[str]
    sizes: Tuple[int, ...]
    strides: Tuple[int, ...]
    offset: int
    itself: bool  # func returned the tensor it was given, unchanged in geometry: the result is the caller's tensor
    conj: bool = False  # the view's lazy conjugate bit differs from the input's (``torch.conj``)
    neg: bool = False  # likewise its lazy negation bit (the conjugate of a conjugate view's imaginary part)


def applies(opts: Options) -> bool:
    """Whether this call's outputs may be views of the caller's inputs: every rank holds them (``src=None``), the
    result is gathered (not ``dst="local"``, where each rank's output already is a view of its own rows), and vmap
    returns views (no ``chunk_size``, no loop mode: there its results are concatenated or stacked copies)."""
    return opts.src is None and opts.dst != "local" and opts.chunk_size is None and opts.mode.returns_views


def find_views(
    flat: Sequence[Any], layout: OutLayout, given: Sequence[Any], shares: Shares, inputs: Sequence[Any]
) -> Tuple[View, ...]:
    """The batched output leaves that view an input. ``given`` are the leaves func was given (this rank's rows, or
    on an empty share the first row), ``inputs`` the caller's."""
    found = []
    sources = [j for j, x in enumerate(inputs) if plain(x) and not x.requires_grad]
    if not sources:
        return ()
    storages: Dict[int, Optional[int]] = {}  # the inputs' storages, read once an output may view one
    for i, (v, leaf) in enumerate(zip(flat, layout.leaves)):
        if leaf.kind != BATCHED or not plain(v) or v.requires_grad:
            continue
        where = _storage(v)
        if where is None:
            continue
        if not storages:
            storages = {j: _storage(inputs[j]) for j in sources}
        for j in sources:
            if where == storages[j]:
                view = _geometry(i, j, v, leaf.out_dim, given[j], shares=shares, x=inputs[j])
                if view is not None:  # else another input over the same storage may fit
                    found.append(view)
                    break
    return tuple(found)


def _geometry(
    i: int, j: int, v: torch.Tensor, out_dim: int, given: Any, *, shares: Shares, x: torch.Tensor
) -> Optional[View]:
    as_dtype = _as_dtype(x, v.dtype)
    if as_dtype is False:
        return None
    unit, d = v.element_size(), shares.dims[j]
    # one example along the batch, in v's units: an unmapped input's view is expanded along it (stride 0)
    step, rest = divmod(x.stride(d) * x.element_size(), unit) if d is not None else (0, 0)
    if rest or (v.shape[out_dim] > 1 and v.stride(out_dim) != step):
        return None  # not the input's batch dim (func mixed the examples): gathered instead
    start = shares.offset if shares.rows and d is not None else 0  # an empty share's stand-in is the first row
    offset = v.storage_offset() - start * step
    if offset < 0:
        return None
    sizes, strides = list(v.shape), list(v.stride())
    if shares.batch != 1:  # a batch of one keeps the stride vmap gave its size-one dim (every rank sees that row)
        sizes[out_dim], strides[out_dim] = shares.batch, step
    itself = (
        as_dtype is None
        and d is not None
        and v is given
        and tuple(sizes) == tuple(x.shape)
        and tuple(strides) == x.stride()
        and offset == x.storage_offset()
    )
    conj, neg = v.is_conj() != x.is_conj(), v.is_neg() != x.is_neg()
    itself = itself and not (conj or neg)
    return View(i, j, as_dtype, tuple(sizes), tuple(strides), offset, itself, conj, neg)


def _as_dtype(x: torch.Tensor, dtype: torch.dtype) -> Any:
    """How ``x`` is seen as ``dtype`` (None: as it is), or False where no view does it."""
    if x.dtype == dtype:
        return None
    try:
        if x.is_complex() and torch.view_as_real(x).dtype == dtype:
            return REAL
        if dtype.is_complex and not x.is_complex() and torch.view_as_complex(x.new_empty(0, 2)).dtype == dtype:
            return COMPLEX
        if x.element_size() == torch.empty((), dtype=dtype).element_size():
            return CAST
    except RuntimeError:  # e.g. view_as_complex of a tensor whose last dim is not (2, stride 1)
        return False
    return False


def signature(layout_digest: int, views: Tuple[View, ...]) -> int:
    """The layout digest every rank compares, with the views' geometry folded in (unchanged when there are none)."""
    return digest((layout_digest, views)) if views else layout_digest


def place(views: Tuple[View, ...], inputs: Sequence[Any], flat: List[Any]) -> None:
    """Each view output in ``flat`` becomes the caller's tensor seen through its geometry."""
    for view in views:
        x = inputs[view.source]
        if view.itself:
            flat[view.leaf] = x
            continue
        base = x
        if view.as_dtype == REAL:
            base = torch.view_as_real(x)
        elif view.as_dtype == COMPLEX:  # the whole storage as pairs: the view's offset counts pairs
            pairs = x.untyped_storage().nbytes() // (2 * x.element_size())
            base = torch.view_as_complex(x.as_strided((pairs, 2), (2, 1), 0))
        elif view.as_dtype == CAST:
            base = x.view(flat[view.leaf].dtype)
        if view.conj:
            base = base.conj()
        if view.neg:
            base = neg_view(base)
        flat[view.leaf] = base.as_strided(view.sizes, view.strides, view.offset)


def plain(v: Any) -> bool:
    """A tensor of the caller's own (not functorch-wrapped). Inference tensors keep no version counter: an in-place
    change to one stays on the rank that made it, so it is not one either."""
    return isinstance(v, torch.Tensor) and not is_wrapped(v) and not v.is_inference()


def _storage(v: torch.Tensor) -> Optional[int]:
    try:  # the storage object itself: empty storages share data pointer 0
        return v.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # a tensor without storage (a subclass, sparse): no alias to return
        return None
