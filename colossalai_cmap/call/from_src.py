"""Sharing with ``src=r``: only group rank ``r`` holds the mapped inputs; it sends every other rank its share.

The first call: one small metadata broadcast (the arguments' structure, the mapped leaves' shapes and dtypes, or
the error found while checking them on ``r``), then one ``scatter`` of all mapped leaves packed together. Every rank
keeps that metadata, per call name and source, with the group's state. A call that follows one whose metadata every
rank kept is steady: the source says in an int64 whether this call's metadata is the same (its digest), changed,
or not to be had (a failure on the source), ahead of the shares in the same ``scatter`` where the data is CPU
tensors on gloo, else in an 8-byte broadcast on the round group before it (the host never reads device memory). A
changed call then takes the first call's path; a failure is every rank's exit's to report.

A rank with an empty share receives the first example in its block instead, to run as its stand-in. It returns the
same :class:`~.records.Inputs` record as sharing with the other placements, and the call goes on along the one path.
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
from ..wire.data_phase import Scattered, scatter_from_source
from ..wire.group import state_of
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


class Kept(NamedTuple):
    """The metadata of a call's last start, as every rank of the group holds it, and its digest."""

    meta: SourceMeta
    digest: int


SAME, CHANGED, FAILED = 0, 1, 2  # what the source says at a steady start


def shares_from_src(
    opts: Options, func: Callable, args: Tuple[Any, ...], kwargs: Dict[str, Any], link: Link
) -> Union[Inputs, Failed]:
    """The shares, and this rank's share scattered from ``src``: one metadata broadcast, then one scatter; or, where
    the source's metadata is the kept one, the scatter alone (with an 8-byte broadcast before it over a host
    group)."""
    group, src = link.group, opts.src
    is_src = group.rank == src
    kept_by_call = state_of(group.pg).sources
    kept: Optional[Kept] = kept_by_call.get((opts.call, src))
    meta, local, failure = SourceMeta(), None, None
    if is_src:
        try:
            faults.check("args", group)
            local = flatten_call(opts, func, args, kwargs)
            meta = _meta_of(local)
        except Exception as exc:  # sent to every rank in the broadcast; each one's exit reports it
            meta, failure = SourceMeta(failure=group.failure(exc)), Failed(group.failure(exc), exc)
    got = None
    if kept is not None:
        said = SAME  # elsewhere a placeholder: the source's word comes back in the start
        if is_src:
            said = FAILED if failure is not None else SAME if digest(meta) == kept.digest else CHANGED
        shares = split_batch(opts, kept.meta.spec, kept.meta.dims, kept.meta.batch, group, kept.digest)
        full = local.leaves if is_src and said == SAME else None
        said, got = _steady_start(link, src, said, kept.meta, shares, full)
        if said == FAILED:
            return failure or Failed(None, None)
        meta = kept.meta if said == SAME else meta
    if got is None:  # the first call, or a changed one
        meta = comm.broadcast_object(meta, src, link.round_group, opts.call, opts.timeout, link.round_device)
        if meta.failure is not None:
            return failure or Failed(None, None)
        kept = kept_by_call[(opts.call, src)] = Kept(meta, digest(meta))
        shares = split_batch(opts, meta.spec, meta.dims, meta.batch, group, kept.digest)
    try:
        leaves = list(local.leaves) if is_src else _merge(opts, func, meta, args)
    except Exception as exc:
        failure, leaves = Failed(group.failure(exc), exc), None
    if got is None:
        got = _scatter_shares(meta, shares, local.leaves if is_src else None, src, link)
    share, stand_in = _received(meta, got)
    if failure is None:
        try:
            faults.check("scatter", group)
        except Exception as exc:
            failure = Failed(group.failure(exc), exc)
    if failure is not None:
        return failure
    leaves = [share.get(i, v) for i, v in enumerate(leaves)]
    return Inputs(shares=shares, leaves=leaves, kwargs=kwargs, stand_in=stand_in, source_needs_grad=meta.needs_grad)


def _steady_start(
    link: Link, src: int, said: int, meta: SourceMeta, shares: Shares, full: Optional[List[Any]]
) -> Tuple[int, Optional[Scattered]]:
    """What the source said (``said``, there), and the shares where it said ``SAME`` (``full``: the source's leaves
    then): one scatter with the word ahead of the rows where the rounds take the data's own group, else an 8-byte
    broadcast on the round group, then the scatter where the word is ``SAME``. ``meta`` and ``shares``: the kept
    call's."""
    if link.host is None:
        got = _scatter_shares(meta, shares, full, src, link, prefix=said)
        return got.prefix, got if got.prefix == SAME else None
    word = torch.tensor([said], dtype=torch.int64, device=link.round_device)
    comm.broadcast(word, src, link.round_group, link.call, link.timeout)
    said = int(word[0])
    return said, _scatter_shares(meta, shares, full, src, link) if said == SAME else None


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


def _scatter_shares(
    meta: SourceMeta,
    shares: Shares,
    full: Optional[List[Any]],
    src: int,
    link: Link,
    prefix: Optional[int] = None,
) -> Scattered:
    """One scatter of every mapped leaf (:func:`~colossalai_cmap.wire.data_phase.scatter_from_source`), with
    ``prefix`` ahead of each rank's rows where given."""
    mapped = [i for i, (kind, _) in enumerate(meta.kinds) if kind == _MAPPED]
    sent = None if full is None else [full[i] for i in mapped]
    return scatter_from_source(link, src, shares.sizes, [meta.kinds[i][1] for i in mapped], sent, prefix)


def _received(meta: SourceMeta, got: Scattered) -> Tuple[Dict[int, torch.Tensor], Optional[List[Any]]]:
    """This rank's rows of each mapped leaf, by leaf; an empty share gets the first example in its block, as its
    stand-in."""
    mapped = [i for i, (kind, _) in enumerate(meta.kinds) if kind == _MAPPED]
    stand_in = None
    if got.stand_in is not None:
        stand_in = [None] * len(meta.kinds)
        for i, row in zip(mapped, got.stand_in):
            stand_in[i] = row
    return dict(zip(mapped, got.rows)), stand_in
