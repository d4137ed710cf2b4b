"""Keyword batches: ``kwarg_dims`` maps keyword arguments, and mappings torch's pytree takes as leaves split.

torch.vmap passes keyword arguments whole; jax.vmap maps them at axis 0, and transformers' users call models with
``**batch``. With ``kwarg_dims``, the mapped keywords become one more positional argument of the call, as jax
flattens ``(args, kwargs)`` together: ``(args, mapped)`` with the in-dims ``(in_dims, kwarg dims)``, and func wrapped
in :class:`~.dims.KeywordCall`. From there on they take the one path of positional arguments (the shares, the fast
path's key, ``src=r``'s scatter, the entry and its gradients, vmap). A mapping torch's pytree does not know (a
``UserDict`` such as ``BatchEncoding``) passed positionally takes the same way, wrapped in a
:class:`~.dims.MappingArg`, so its tensors split like a dict's.

Without ``kwarg_dims``, in ``mode="batched"``, a keyword tensor as long as the batch along a mapped dim is almost
certainly a batch the caller meant to split: :func:`check_whole_keywords` refuses it at every group size.
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple, Optional, Tuple

import torch

from ..torch_internals import keystr, tree_flatten, tree_flatten_with_path
from .dims import FlatArgs, flatten_args, wrap_mappings
from .options import Options


class KeywordBatch(NamedTuple):
    """A call with its mapped keywords as one more positional argument: the keyword dims of the site that runs it
    (``CallSite.with_keywords``), the positional arguments ``(args, mapped keywords or None)``, and the keywords
    passed whole."""

    dims: Any
    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]


def as_positional(opts: Options, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[KeywordBatch]:
    """The call with its mapped keywords (and mappings torch's pytree does not know) made positional, or None when
    there are none: a plain call costs a type check per argument."""
    wrapped = args if all(type(a) is torch.Tensor for a in args) else wrap_mappings(args)
    if not _maps_keywords(opts, kwargs) and wrapped is args:
        return None
    # with src=r a None stands for the source's tensor (other ranks pass None for mapped inputs): kept in place
    placeholders = isinstance(opts.src, int)
    mapped: Dict[str, Any] = {}
    whole: Dict[str, Any] = {}
    dims: Dict[str, Any] = {}
    for name, value in kwargs.items():
        dim = _kwarg_dim(opts.kwarg_dims, name, value, placeholders)
        if dim is None:
            whole[name] = value
        else:
            mapped[name], dims[name] = wrap_mappings(value), dim
    # an int: one site for every such call, whichever keywords it maps
    prefix = opts.kwarg_dims if isinstance(opts.kwarg_dims, int) else dims
    return KeywordBatch(prefix, (wrapped, mapped), whole)


def keyword_batch(opts: Options, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
    """Whether the call maps keywords or splits a mapping torch's pytree does not know (then it runs eagerly under
    ``torch.compile``: a graph break)."""
    if _maps_keywords(opts, kwargs):
        return True
    return any(type(a) is not torch.Tensor and wrap_mappings(a) is not a for a in args)


def _maps_keywords(opts: Options, kwargs: Dict[str, Any]) -> bool:
    # with src=r every rank takes the keyword form, also one that passes no keywords (the source's come to it)
    return opts.kwarg_dims is not None and (len(kwargs) > 0 or isinstance(opts.src, int))  # dynamo: no bool(dict)


def _kwarg_dim(kwarg_dims: Any, name: str, value: Any, placeholders: bool) -> Any:
    """The dims prefix of one keyword's value, or None to pass it whole: with an int, that dim if it holds a tensor
    (a flag, or None, is passed whole); with a dict, the entry for its name."""
    if kwarg_dims is None or (value is None and not placeholders):
        return None
    if isinstance(kwarg_dims, dict):
        return kwarg_dims.get(name)
    if value is None or type(value) is torch.Tensor:
        return kwarg_dims
    return kwarg_dims if any(isinstance(v, torch.Tensor) for v in tree_flatten(wrap_mappings(value))[0]) else None


def flatten_call(opts: Options, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> FlatArgs:
    """:func:`~.dims.flatten_args`, then (``mode="batched"``) the check of the keywords passed whole."""
    flat = flatten_args(func, args, opts.in_dims, opts.call)
    if kwargs and opts.mode.holds_rows and opts.src != "local":
        check_whole_keywords(opts, flat, kwargs)
    return flat


def check_whole_keywords(opts: Options, flat: FlatArgs, kwargs: Dict[str, Any]) -> None:
    """In ``mode="batched"``, refuse a keyword passed whole whose tensor is as long as the batch along dim 0 or a
    mapped dim: func would get its whole batch beside the share's rows of the positional arguments. Its shape, not
    the group size, decides, so the same call raises at P=1 as at P=2, where the rows would not line up. A keyword
    that ``kwarg_dims`` names with None is whole by request."""
    B = flat.batch_size
    if B < 2:
        return
    along = {0} | {d for d in flat.dims if d is not None}
    explicit = opts.kwarg_dims if isinstance(opts.kwarg_dims, dict) else {}
    for name, value in kwargs.items():
        if name in explicit:
            continue
        for path, leaf in tree_flatten_with_path(wrap_mappings(value))[0]:
            if not isinstance(leaf, torch.Tensor):
                continue
            dim = next((d for d in sorted(along) if d < leaf.dim() and leaf.shape[d] == B), None)
            if dim is not None:
                raise ValueError(_batch_like(opts, name + keystr(path), name, tuple(leaf.shape), dim, B))


def _batch_like(opts: Options, where: str, name: str, shape: Tuple[int, ...], dim: int, B: int) -> str:
    return (
        f"{opts.call}: mode='batched': keyword argument {where!r} has shape {shape}, as long as the batch ({B}) "
        f"along dim {dim}, but keyword arguments are passed whole to every rank's share, as in torch.vmap (which "
        f"does not map keyword arguments): func would get all {B} rows of it beside its share of the positional "
        f"arguments. To split it with them, pass kwarg_dims=0 (every keyword's tensors mapped at dim 0, as jax.vmap "
        f"maps keyword arguments) or kwarg_dims={{{name!r}: {dim}}}; to keep it whole, kwarg_dims={{{name!r}: None}}."
    )
