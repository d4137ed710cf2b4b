"""Sharing with ``src=r``: only group rank ``r`` holds the mapped inputs; it sends every other rank its share.

One small metadata broadcast (the arguments' structure, the mapped leaves' shapes and dtypes, or the error found
while checking them on ``r``), then one ``scatter`` of all mapped leaves packed together. A rank with an empty share
receives the first example in its block instead, to run as its stand-in. It returns the same :class:`~.records.Inputs`
record as sharing with the other placements, and the call goes on along the one path.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple, Union

import torch

from .. import faults
from ..digests import digest
from ..engine.records import Failed
from ..errors import RankFailure
from ..torch_internals import tree_flatten
from ..wire import comm
from ..wire.data_phase import scatter_from_source
from ..wire.link import Link
from .dims import KeywordCall, describe_arg, leaf_paths
from .keywords import flatten_call
from .options import Options
from .records import Inputs, Shares
from .shares import split_batch

_MAPPED, _TENSOR, _CONST = "mapped", "tensor", "const"


class SourceMeta(NamedTuple):
    """What the source rank broadcasts first: the arguments' structure, each leaf's kind, and the global batch; or
    the failure it met while checking them (then every rank's exit reports it)."""

    spec: Any = None
    dims: Tuple[Optional[int], ...] = ()
    kinds: Tuple[Tuple[str, Any], ...] = ()  # (_MAPPED, (shape, dtype, dim)) | (_TENSOR, None) | (_CONST, value)
    batch: int = 0
    failure: Optional[RankFailure] = None
    needs_grad: bool = False  # a leaf required grad on the source: every rank's output refuses backward


def shares_from_src(
    opts: Options, func: Callable, args: Tuple[Any, ...], kwargs: Dict[str, Any], link: Link
) -> Union[Inputs, Failed]:
    """The shares, and this rank's share scattered from ``src``: one metadata broadcast, then one scatter."""
    group, src = link.group, opts.src
    is_src = group.rank == src
    meta, local, failure = SourceMeta(), None, None
    if is_src:
        try:
            faults.check("args", group)
            local = flatten_call(opts, func, args, kwargs)
            meta = _meta_of(local)
        except Exception as exc:  # sent to every rank in the broadcast; each one's exit reports it
            meta, failure = SourceMeta(failure=group.failure(exc)), Failed(group.failure(exc), exc)
    meta = comm.broadcast_object(meta, src, link.round_group, opts.call, opts.timeout, link.round_device)
    if meta.failure is not None:
        return failure or Failed(None, None)
    shares = split_batch(opts, meta.spec, meta.dims, meta.batch, group, digest(meta))
    try:
        leaves = list(local.leaves) if is_src else _merge(opts, func, meta, args)
    except Exception as exc:
        failure, leaves = Failed(group.failure(exc), exc), None
    share, stand_in = _send_shares(meta, shares, local.leaves if is_src else None, src, link)
    if failure is None:
        try:
            faults.check("scatter", group)
        except Exception as exc:
            failure = Failed(group.failure(exc), exc)
    if failure is not None:
        return failure
    leaves = [share.get(i, v) for i, v in enumerate(leaves)]
    return Inputs(shares=shares, leaves=leaves, kwargs=kwargs, stand_in=stand_in, source_needs_grad=meta.needs_grad)


def _meta_of(flat: Any) -> SourceMeta:
    kinds: List[Tuple[str, Any]] = []
    for leaf, d in zip(flat.leaves, flat.dims):
        if d is not None:
            shape = list(leaf.shape)
            del shape[d]
            kinds.append((_MAPPED, (tuple(shape), leaf.dtype, d)))
        else:
            kinds.append((_TENSOR, None) if isinstance(leaf, torch.Tensor) else (_CONST, leaf))
    needs_grad = any(isinstance(v, torch.Tensor) and v.requires_grad for v in flat.leaves)
    return SourceMeta(flat.spec, tuple(flat.dims), tuple(kinds), flat.batch_size, needs_grad=needs_grad)


def _merge(opts: Options, func: Callable, meta: SourceMeta, args: Tuple[Any, ...]) -> List[Any]:
    """This rank's leaves under the source's structure: its own unmapped leaves, placeholders for mapped ones."""
    spec, kinds = meta.spec, meta.kinds
    paths = leaf_paths(spec)
    positional, children = args, spec.children_specs
    if isinstance(func, KeywordCall):  # the positional arguments, then the mapped keywords ({} or None: the source's)
        positional, children = args[0], spec.children_specs[0].children_specs
    if len(positional) > len(children):
        raise ValueError(
            f"{opts.call}, src={opts.src}: {len(positional)} positional arguments here but {len(children)} on the "
            f"source rank."
        )
    slots = list(positional) + [None] * (len(children) - len(positional))
    if isinstance(func, KeywordCall):
        slots.append(args[1] or None)
        children = children + [spec.children_specs[1]]
    leaves: List[Any] = []
    start = 0
    for i, (child, mine) in enumerate(zip(children, slots)):
        count = child.num_leaves
        span = range(start, start + count)
        if mine is None:
            for k in span:
                if kinds[k][0] == _TENSOR:
                    raise ValueError(
                        f"{opts.call}, src={opts.src}: {describe_arg(func, paths[k])} is an unmapped Tensor on "
                        f"the source rank but None here; pass unmapped Tensor arguments on every rank."
                    )
                leaves.append(kinds[k][1] if kinds[k][0] == _CONST else None)
        else:
            own, own_spec = tree_flatten(mine)
            if own_spec != child:
                raise ValueError(
                    f"{opts.call}, src={opts.src}: {_slot_name(func, i, len(slots))} has structure {own_spec} here "
                    f"but {child} on the source rank; pass None or the same structure."
                )
            leaves += [None if kinds[k][0] == _MAPPED else v for k, v in zip(span, own)]
        start += count
    return leaves


def _slot_name(func: Callable, i: int, count: int) -> str:
    return "the mapped keyword arguments" if isinstance(func, KeywordCall) and i == count - 1 else f"argument {i}"


def _send_shares(
    meta: SourceMeta, shares: Shares, full: Optional[List[Any]], src: int, link: Link
) -> Tuple[Dict[int, torch.Tensor], Optional[List[Any]]]:
    """One scatter of every mapped leaf (:func:`~colossalai_cmap.wire.data_phase.scatter_from_source`); an empty share gets
    the first example in its block, as its stand-in."""
    mapped = [i for i, (kind, _) in enumerate(meta.kinds) if kind == _MAPPED]
    sent = None if full is None else [full[i] for i in mapped]
    got = scatter_from_source(link, src, shares.sizes, [meta.kinds[i][1] for i in mapped], sent)
    stand_in = None
    if got.stand_in is not None:
        stand_in = [None] * len(meta.kinds)
        for i, row in zip(mapped, got.stand_in):
            stand_in[i] = row
    return dict(zip(mapped, got.rows)), stand_in
