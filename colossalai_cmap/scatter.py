"""``src=r``: only group rank ``r`` holds the mapped inputs; it sends every other rank its shard.

One small metadata broadcast (the arguments' structure, the mapped leaves' shapes and dtypes, or the error found
while checking them on ``r``), then one ``scatter`` of all mapped leaves packed together. A rank with an empty shard
receives the first example in its block instead, to run as its stand-in. The output is not differentiable: the
inputs were copied from one rank.
"""

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.utils._pytree import tree_flatten, tree_map

from . import comm, exit, faults, stats
from .entry import Inputs
from .errors import CmapError, RankFailure
from .groups import Group, group_device
from .layout import digest
from .plan import CallPlan, split
from .primitives import not_differentiable
from .protocol import Link
from .rank import Failed, run_rank
from .roles import Rows
from .route import Item, offsets, typed
from .specs import describe_arg, flatten_args, leaf_paths
from .transfer import pack_padded

_MAPPED, _TENSOR, _CONST = "mapped", "tensor", "const"


def run_from_src(cm: Any, group: Group, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    opts = cm.options
    log, plan = stats.open_log(), None
    try:
        device = group_device(
            group, next((v.device for v in tree_flatten(args)[0] if isinstance(v, torch.Tensor)), None)
        )
        link = Link(group, device, opts.call, opts.timeout)
        plan, inputs, failure = _receive(cm, group, args, kwargs, link)
        grad = torch.is_grad_enabled() and any(v.requires_grad for v in tree_flatten(args)[0] if torch.is_tensor(v))
        with torch.no_grad():
            result = failure or run_rank(cm, plan, inputs, link, None)
            out = exit.finish(opts, plan, result, inputs, link)
        if not grad or out is None:
            return out
        message = (
            f"{opts.call}: the output of a cmap with src={opts.src!r} is not differentiable: its inputs were "
            f"scattered from one rank. Use src=None to backpropagate to the inputs."
        )
        return tree_map(lambda v: not_differentiable(v, message), out)
    finally:
        stats.close_log(log)
        cm._last = (log, group.size, False, False, plan)


def _meta_of(cm: Any, args: Tuple[Any, ...]) -> Dict[str, Any]:
    flat = flatten_args(cm.func, args, cm.options.in_dims, cm.options.call)
    kinds: List[Tuple[str, Any]] = []
    for leaf, d in zip(flat.leaves, flat.dims):
        if d is not None:
            shape = list(leaf.shape)
            del shape[d]
            kinds.append((_MAPPED, (tuple(shape), leaf.dtype, d)))
        else:
            kinds.append((_TENSOR, None) if isinstance(leaf, torch.Tensor) else (_CONST, leaf))
    return {"spec": flat.spec, "dims": tuple(flat.dims), "kinds": kinds, "batch": flat.batch_size, "flat": flat}


def _receive(
    cm: Any, group: Group, args: Tuple[Any, ...], kwargs: Dict[str, Any], link: Link
) -> Tuple[CallPlan, Inputs, Optional[Failed]]:
    """Broadcast the metadata and scatter the shards from ``src``; returns this rank's plan and leaves."""
    opts, src = cm.options, cm.options.src
    is_src = group.rank == src
    meta, error, local = None, None, None
    if is_src:
        try:
            faults.check("args", group)
            local = _meta_of(cm, args)
            meta = {k: v for k, v in local.items() if k != "flat"}
        except Exception as exc:  # sent to every rank in the broadcast, so all raise together
            meta, error = {"error": RankFailure.from_exception(exc, group.rank, group.global_rank)}, exc
    meta = comm.broadcast_object(meta, src, group, opts.call, opts.timeout, link.device)
    if "error" in meta:
        raise CmapError.from_failures(f"{opts.call}, src={src}", [meta["error"]], group.rank) from error
    sizes = split(meta["batch"], group.size, opts.gathers)
    mapped = tuple(i for i, d in enumerate(meta["dims"]) if d is not None)
    rows, offset = sizes[group.rank], sum(sizes[: group.rank])
    plan = CallPlan(meta["spec"], meta["dims"], meta["batch"], sizes, rows, offset, digest(meta), mapped)
    failure = None
    try:
        leaves = list(local["flat"].leaves) if is_src else _merge(cm, meta, args)
    except Exception as exc:
        failure, leaves = Failed(RankFailure.from_exception(exc, group.rank, group.global_rank), exc), None
    shard, stand_in = _scatter(meta, plan, local["flat"].leaves if is_src else None, src, link)
    if failure is None:
        try:
            faults.check("scatter", group)
        except Exception as exc:
            failure = Failed(RankFailure.from_exception(exc, group.rank, group.global_rank), exc)
    merged = [shard.get(i, v) for i, v in enumerate(leaves)] if leaves is not None else []
    return plan, Inputs(merged, kwargs, stand_in), failure


def _merge(cm: Any, meta: Dict[str, Any], args: Tuple[Any, ...]) -> List[Any]:
    """This rank's leaves under the source's structure: its own unmapped leaves, placeholders for mapped ones."""
    opts, spec, kinds = cm.options, meta["spec"], meta["kinds"]
    paths = leaf_paths(spec)
    if len(args) > len(spec.children_specs):
        raise ValueError(
            f"{opts.call}, src={opts.src}: {len(args)} positional arguments here but "
            f"{len(spec.children_specs)} on the source rank."
        )
    leaves: List[Any] = []
    start = 0
    for i, child in enumerate(spec.children_specs):
        count, mine = child.num_leaves, args[i] if i < len(args) else None
        span = range(start, start + count)
        if mine is None:
            for k in span:
                if kinds[k][0] == _TENSOR:
                    raise ValueError(
                        f"{opts.call}, src={opts.src}: {describe_arg(cm.func, paths[k])} is an unmapped Tensor on "
                        f"the source rank but None here; pass unmapped Tensor arguments on every rank."
                    )
                leaves.append(kinds[k][1] if kinds[k][0] == _CONST else None)
        else:
            own, own_spec = tree_flatten(mine)
            if own_spec != child:
                raise ValueError(
                    f"{opts.call}, src={opts.src}: argument {i} has structure {own_spec} here but {child} on the "
                    f"source rank; pass None or the same structure."
                )
            leaves += [None if kinds[k][0] == _MAPPED else v for k, v in zip(span, own)]
        start += count
    return leaves


def _scatter(
    meta: Dict[str, Any], plan: CallPlan, full: Optional[List[Any]], src: int, link: Link
) -> Tuple[Dict[int, torch.Tensor], Optional[List[Any]]]:
    """One scatter of every mapped leaf, packed per rank for the largest share; an empty share gets the first
    example in its block, as its stand-in."""
    group = link.group
    mapped = [i for i, (kind, _) in enumerate(meta["kinds"]) if kind == _MAPPED]
    items = [_item(k, meta["kinds"][i][1], plan) for k, i in enumerate(mapped)]
    cap = max(max(plan.sizes), 1)
    offs, block = offsets(items, cap)
    recv = torch.empty(block, dtype=torch.uint8, device=link.device)
    blocks = None
    if full is not None:
        rows = [[_rows_of(full[i], meta["kinds"][i][1][2], plan, r) for i in mapped] for r in range(group.size)]
        blocks = [torch.zeros(block, dtype=torch.uint8, device=link.device) for _ in range(group.size)]
        for r in range(group.size):
            pack_padded(items, rows[r], cap, blocks[r])
    if block:
        comm.scatter_from(recv, blocks, src, group, link.call, link.timeout)
    shard, stand_in = {}, None
    for it, i, off in zip(items, mapped, offs):
        shard[i] = typed(recv, off, it.dtype, (plan.rows, *it.shape)).movedim(0, meta["kinds"][i][1][2])
    if plan.rows == 0 and plan.batch > 0:
        stand_in = [None] * len(meta["kinds"])
        for it, i, off in zip(items, mapped, offs):
            stand_in[i] = typed(recv, off, it.dtype, (1, *it.shape)).movedim(0, meta["kinds"][i][1][2]).clone()
    return shard, stand_in


def _item(k: int, kind: Tuple[Any, ...], plan: CallPlan) -> Item:
    shape, dtype, _ = kind
    numel = 1
    for s in shape:
        numel *= s
    return Item(k, Rows(0, plan.sizes), dtype, shape, numel * dtype.itemsize)


def _rows_of(leaf: torch.Tensor, d: int, plan: CallPlan, r: int) -> torch.Tensor:
    """Rank r's rows, batch dim first; the first example for an empty share (its stand-in)."""
    n, start = plan.sizes[r], sum(plan.sizes[:r])
    rows = leaf.narrow(d, start, n) if n else leaf.narrow(d, 0, min(1, leaf.shape[d]))
    return rows.movedim(d, 0)
