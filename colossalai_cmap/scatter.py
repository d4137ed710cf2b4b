"""``src=r``: only group rank ``r`` holds the mapped inputs; it sends every other rank its shard.

One small metadata broadcast (the argument structure, the mapped leaves' shapes and dtypes, and any error found
while checking the arguments on ``r``), then one ``scatter`` of all mapped leaves packed together.
"""

from typing import TYPE_CHECKING, Any, List, Optional, Tuple

import torch
from torch.utils._pytree import tree_flatten

from . import comm
from .errors import CmapError, RankFailure
from .gather import pack, typed_view
from .groups import Group, group_device
from .layout import BATCHED, LeafLayout, OutLayout
from .sharding import split_for
from .specs import FlatArgs, describe_arg, flatten_args, leaf_paths

if TYPE_CHECKING:
    from .pipeline import Cmapped

_MAPPED, _TENSOR, _CONST = "mapped", "tensor", "const"


def _meta_of(flat: FlatArgs) -> dict:
    kinds: List[Tuple[str, Any]] = []
    for leaf, d in zip(flat.leaves, flat.dims):
        if d is not None:
            shape = list(leaf.shape)
            del shape[d]
            kinds.append((_MAPPED, (tuple(shape), leaf.dtype, d)))
        elif isinstance(leaf, torch.Tensor):
            kinds.append((_TENSOR, None))
        else:
            kinds.append((_CONST, leaf))
    return {"spec": flat.spec, "dims": flat.dims, "kinds": kinds, "batch": flat.batch_size}


def _input_layout(meta: dict) -> OutLayout:
    leaves = [
        LeafLayout(BATCHED, shape, dtype, d)
        for kind, (shape, dtype, d) in ((k, v) for k, v in meta["kinds"] if k == _MAPPED)
    ]
    return OutLayout(meta["spec"], tuple(leaves))


def _merge(cm: "Cmapped", meta: dict, args: Tuple[Any, ...]) -> List[Any]:
    """This rank's leaves under the source's structure: its own unmapped leaves, placeholders for mapped ones."""
    spec, kinds = meta["spec"], meta["kinds"]
    paths = leaf_paths(spec)
    leaves: List[Any] = []
    start = 0
    for i, child in enumerate(spec.children_specs):
        count = child.num_leaves
        mine = args[i] if i < len(args) else None
        if mine is None:
            for (kind, value), path in zip(kinds[start : start + count], paths[start : start + count]):
                if kind == _TENSOR:
                    raise ValueError(
                        f"{cm.call}, src={cm.src}: {describe_arg(cm.func, path)} is an unmapped Tensor on the source "
                        f"rank but None here; pass unmapped Tensor arguments on every rank."
                    )
                leaves.append(value if kind == _CONST else None)
        else:
            own, own_spec = tree_flatten(mine)
            if own_spec != child:
                raise ValueError(
                    f"{cm.call}, src={cm.src}: argument {i} has structure {own_spec} here but {child} on the source "
                    f"rank; pass None or the same structure."
                )
            leaves += [None if kind == _MAPPED else v for (kind, _), v in zip(kinds[start : start + count], own)]
        start += count
    if len(args) > len(spec.children_specs):
        raise ValueError(
            f"{cm.call}, src={cm.src}: {len(args)} positional arguments here but "
            f"{len(spec.children_specs)} on the source rank."
        )
    return leaves


def receive_shards(
    cm: "Cmapped", group: Group, args: Tuple[Any, ...]
) -> Tuple[FlatArgs, List[Any], Tuple[int, ...], Optional[Tuple[RankFailure, BaseException]], torch.device]:
    """Broadcast metadata and scatter the shards from ``cm.src``; returns this rank's flat args and shard."""
    src, call = cm.src, cm.call
    is_src = group.rank == src
    flat: Optional[FlatArgs] = None
    meta: Any = None
    if is_src:
        try:
            flat = flatten_args(cm.func, args, cm.in_dims, call)
            meta = _meta_of(flat)
        except Exception as exc:  # sent to every rank in the broadcast, so all raise together
            meta = {"error": RankFailure.from_exception(exc, group.rank, group.global_rank)}
            error: Optional[BaseException] = exc
    own_device = next((x.device for x in tree_flatten(args)[0] if isinstance(x, torch.Tensor)), None)
    device = group_device(group, own_device)
    meta = comm.broadcast_object(meta, src, group, call, cm.timeout, device)
    if "error" in meta:
        raise CmapError.from_failures(f"{call}, src={src}", [meta["error"]], group.rank) from (
            error if is_src else None
        )
    sizes = split_for(cm.dst)(meta["batch"], group.size).sizes
    failure: Optional[Tuple[RankFailure, BaseException]] = None
    if is_src:
        leaves = list(flat.leaves)
    else:
        try:
            leaves = _merge(cm, meta, args)
        except Exception as exc:
            failure = (RankFailure.from_exception(exc, group.rank, group.global_rank), exc)
            leaves = [None] * len(meta["kinds"])
    layout = _input_layout(meta)
    mapped = [i for i, (kind, _) in enumerate(meta["kinds"]) if kind == _MAPPED]
    cap = max(sizes)
    _, block_size = layout.segments(cap)
    recv = torch.empty(block_size, dtype=torch.uint8, device=device)
    if block_size:
        blocks = None
        if is_src:
            offsets = [sum(sizes[:r]) for r in range(group.size)]
            blocks = [
                pack(
                    [flat.leaves[i].narrow(flat.dims[i], offsets[r], sizes[r]) for i in mapped],
                    layout,
                    sizes[r],
                    cap,
                    device,
                )
                for r in range(group.size)
            ]
        comm.scatter_from(recv, blocks, src, group, call, cm.timeout)
    rows = sizes[group.rank]
    seg_offsets, _ = layout.segments(cap)
    shard = list(leaves)
    for i, leaf, off in zip(mapped, layout.leaves, seg_offsets):
        shard[i] = typed_view(recv, off, leaf.dtype, (rows, *leaf.shape)).movedim(0, leaf.out_dim)
    placeholder = [x if x is not None or i not in mapped else shard[i] for i, x in enumerate(leaves)]
    flat_local = FlatArgs(placeholder, meta["dims"], meta["spec"], rows)
    return flat_local, shard, sizes, failure, device
