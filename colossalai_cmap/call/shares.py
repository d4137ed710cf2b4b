"""The shares: how B examples split over the group, and the record a repeated call reuses.

The shares depend only on the arguments' structure, shapes, dtypes and devices, and on the group. The general path
makes them (checking ``in_dims`` against the arguments on the way) and returns them; a later call whose arguments
have the same key reads them back instead of checking and sharing again. That cache is the whole fast path: the call
itself runs the same steps either way.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..digests import digest
from ..torch_internals import TreeSpec, tree_flatten
from ..wire.group import Group
from ..wire.roles import first_row, tensor_split_sizes
from .dims import FlatArgs
from .options import Options
from .records import Shares


@lru_cache(maxsize=1024)
def share_sizes(batch: int, world: int, gathered: bool) -> Tuple[int, ...]:
    """Rows per rank: ``torch.chunk``'s blocks of ``ceil(B / P)`` when the results are gathered (the padded gather
    buffer then holds the result as its first B rows), else ``torch.tensor_split``'s."""
    if not (gathered and batch):
        return tensor_split_sizes(batch, world)
    parts = torch.empty(batch, 0).chunk(world)
    return tuple(p.shape[0] for p in parts) + (0,) * (world - len(parts))


def make_shares(opts: Options, flat: FlatArgs, group: Group, kwargs: Dict[str, Any]) -> Shares:
    """The shares of the arguments ``flat`` (checked against ``in_dims``: :func:`~.keywords.flatten_call`)."""
    local = opts.src == "local"
    sig = _input_sig(opts, flat.spec, flat.leaves, flat.dims, kwargs, keep_batch=not local)
    if local:  # only the round knows the other ranks' rows
        mapped = tuple(i for i, d in enumerate(flat.dims) if d is not None)
        return Shares(
            spec=flat.spec,
            dims=tuple(flat.dims),
            batch=-1,
            sizes=None,
            rows=flat.batch_size,
            offset=0,
            input_sig=sig,
            mapped=mapped,
        )
    return split_batch(opts, flat.spec, tuple(flat.dims), flat.batch_size, group, sig)


def split_batch(
    opts: Options, spec: TreeSpec, dims: Tuple[Optional[int], ...], batch: int, group: Group, input_sig: int
) -> Shares:
    """A batch of ``batch`` examples split over ``group`` (:func:`share_sizes`): every rank's rows, and this one's."""
    sizes = share_sizes(batch, group.size, opts.gathers)
    return Shares(
        spec=spec,
        dims=dims,
        batch=batch,
        sizes=sizes,
        rows=sizes[group.rank],
        offset=first_row(sizes, group.rank),
        input_sig=input_sig,
        mapped=tuple(i for i, d in enumerate(dims) if d is not None),
    )


def _input_sig(
    opts: Options,
    spec: TreeSpec,
    leaves: Sequence[Any],
    dims: Sequence[Optional[int]],
    kwargs: Dict[str, Any],
    keep_batch: bool,
) -> int:
    parts: List[Any] = [spec, opts.mode.name]
    for leaf, d in zip(leaves, dims):
        if d is not None:
            shape = list(leaf.shape)
            if not keep_batch:
                del shape[d]
            parts.append((tuple(shape), leaf.dtype, d))
        elif isinstance(leaf, torch.Tensor):
            parts.append((tuple(leaf.shape), leaf.dtype))
        else:
            parts.append(const_key(leaf))
    if kwargs:
        kw_leaves, kw_spec = tree_flatten(kwargs)
        parts.append(kw_spec)
        parts += [(tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else const_key(v) for v in kw_leaves]
    return digest(parts)


def const_key(value: Any) -> Any:
    return value if isinstance(value, (int, float, bool, str, type(None))) else type(value).__name__


def key_of(leaves: Sequence[Any], kwargs: Dict[str, Any], group: Group) -> Tuple[Any, ...]:
    """The fast path's key: what the shares depend on, cheap to build (the tree spec is compared on a hit)."""
    parts = tuple(
        (v.shape, v.dtype, v.device) if isinstance(v, torch.Tensor) else (type(v), const_key(v)) for v in leaves
    )
    if kwargs:
        kw_leaves, _ = tree_flatten(kwargs)
        parts += (tuple(kwargs),) + tuple(
            (v.shape, v.dtype) if isinstance(v, torch.Tensor) else const_key(v) for v in kw_leaves
        )
    return (id(group.pg), group.rank) + parts
