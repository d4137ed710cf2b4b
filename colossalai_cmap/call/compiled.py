"""A call inside ``torch.compile``: the cmap lowered to plain traceable ops, so that dynamo traces
``torch.compile(cmap(f), fullgraph=True)`` into one graph.

The pipeline (:func:`run_compiled`), with the eager path's split and roles but no round of its own:

1. Refuse what needs the eager orchestration (:func:`unsupported`): ``src``, ``dst=r``, loop mode, random draws,
   ``check_inputs``, a cmap nested in another's func, and closure-captured tensors that need a gradient.
2. Plan from static shapes: the eager plan's shares (:func:`~.plan.shares`), so each rank maps the same rows.
3. Enter: mapped inputs cut with ``narrow``; tensors that need a gradient go through a traced ``Split``
   (:mod:`~colossalai_cmap.wire.traced`): rows all-gathered in backward, other tensors' gradients summed.
4. Run func under ``torch.vmap`` (or batched) with the axis frame open, so the named-axis ops inside it lower to
   functional collectives (:mod:`~colossalai_cmap.axis.ops`). An empty share runs one stand-in example, as eagerly.
5. Exit: batched outputs all-gathered along their out-dim through a traced ``Join`` (``dst=-1``), or kept
   (``dst="local"``); ``out_dims=None`` outputs through a ``SAME`` or ``ONCE`` Join, counted once in backward.

What changes against eager cmap (docs/collectives.md, "torch.compile"): no status round, so an error on one rank is
not raised on the others (they wait in the next collective until the group's timeout); ranks are not checked to
pass the same inputs or to compute the same output layout; shapes are fixed per compiled graph (dynamo recompiles
for new ones).
"""

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch._functorch import vmap as functorch_vmap

from ..axis import frame as frames
from ..axis.frame import AxisFrame
from ..integration.groups import resolve_group
from ..nesting import start_splitting, stop_splitting
from ..wire.group import Group
from ..wire.roles import COPY, ONCE, SAME, Rows
from ..wire.rounds import Link
from ..wire.traced import rows_at, traced_join, traced_split
from .dispatch import dispatch
from .options import Options
from .plan import shares
from .site import CallSite
from .specs import flatten, flatten_args, flatten_out_dims, normalise_out_dim, unflatten


def run_compiled(site: CallSite, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """One call of the cmap ``site`` as traceable ops; returns what eager cmap returns on this rank."""
    opts = site.options
    reason = unsupported(site)
    if reason is not None:
        return EAGER_ONLY[reason](site, args, kwargs)
    pg = process_group(opts)
    rank, size = (0, 1) if pg is None else (dist.get_rank(pg), dist.get_world_size(pg))
    flat = flatten_args(site.func, args, opts.in_dims, opts.call)
    sizes = shares(flat.batch_size, size, opts.gathers)
    offset, rows = rows_at(sizes, rank)
    grads = size > 1 and torch.is_grad_enabled()
    leaves = enter(flat.leaves, flat.dims, sizes, pg if grads else None, rank)
    kwargs = enter_kwargs(kwargs, pg if grads else None, rank)
    stand_in = rows == 0 and flat.batch_size > 0
    if stand_in:  # one example that takes part in func's collectives, contributing nothing, and is cut off
        leaves = [
            v if d is None else torch.cat([v, _first(a, d)], d) for v, a, d in zip(leaves, flat.leaves, flat.dims)
        ]
    frame = None
    if opts.axis_name is not None:
        link = None if pg is None else Link(Group(pg, rank, size, ()), _device(leaves), opts.call, opts.timeout)
        frame = AxisFrame(link, flat.batch_size, offset, sizes, opts.mode, stand_in)
        frames.push(opts.axis_name, frame)
    # A cmap nested in func runs eagerly (a graph break) and, seeing this, as plain torch.vmap here. Every rank is
    # marked: this rank's group members are not known inside the graph, and a plain vmap gives the same values.
    start_splitting(tuple(range(dist.get_world_size())) if size > 1 else ())
    try:
        out = map_share(
            opts, site.body, (leaves, flat.dims, flat.spec), kwargs, frame, max(rows, 1) if stand_in else rows
        )
    finally:
        stop_splitting()
        if frame is not None:
            frames.pop(opts.axis_name, finished=False)
    return leave(opts, out, sizes, pg if size > 1 else None, rank)


def unsupported(site: CallSite) -> Optional[str]:
    """What of this call only the eager orchestration does (a key of :data:`EAGER_ONLY`), or None."""
    opts = site.options
    if opts.src is not None:
        return "src"
    if opts.dst != -1 and opts.dst != "local":
        return "dst"
    if opts.mode == "loop":
        return "loop"
    if opts.randomness != "error":
        return "randomness"
    if opts.check_inputs:
        return "check_inputs"
    if frames.active():  # its traced collectives would run under the outer map's vmap, which has no rule for them
        return "nested"
    if torch.is_grad_enabled() and site.captures_trainable():
        return "captured"
    return None


_REASONS = {
    "src": "src=r or src='local' moves the inputs in the status protocol",
    "dst": "dst=r gives one rank the result",
    "loop": "mode='loop' runs its examples in threads",
    "randomness": "randomness other than 'error' sets up the generators per rank or per example",
    "check_inputs": "check_inputs=True compares checksums in the status round",
    "nested": "a cmap inside the func of another cmap or shard_map maps over that call's examples",
    "captured": (
        "a closure-captured tensor or module parameter requires grad and its gradient is summed over the ranks; "
        "pass it as an argument with in_dims=None"
    ),
}


def _eager(reason: str, text: str) -> Callable[[CallSite, Tuple[Any, ...], Dict[str, Any]], Any]:
    """The eager call, out of the graph: a graph break, or with ``fullgraph=True`` dynamo's error, which shows this
    function's name, so the name says why."""

    def run(site: CallSite, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        return dispatch(site, args, kwargs)

    run.__name__ = run.__qualname__ = f"cmap runs eagerly, not inside torch.compile: {text}"
    return torch._disable_dynamo(run)


# Made once, outside any graph: dynamo only calls them.
EAGER_ONLY = {reason: _eager(reason, text) for reason, text in _REASONS.items()}


def _needs_grad(v: Any) -> bool:
    # a compiled call sees plain tensors: no functorch wrapper to look under (dynamo traces no such look)
    return isinstance(v, torch.Tensor) and v.requires_grad


def process_group(opts: Options) -> Optional[Any]:
    """The call's process group, or None in one process (torch.distributed not initialised)."""
    if opts.group is None:
        return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    if isinstance(opts.group, dist.ProcessGroup):
        return opts.group
    return resolve_group(opts.call, opts.group).pg


def _first(leaf: torch.Tensor, dim: int) -> torch.Tensor:
    """The global first example, detached: the stand-in of an empty share."""
    return leaf.narrow(dim, 0, 1).detach().clone()


def enter(
    leaves: Sequence[Any], dims: Sequence[Optional[int]], sizes: Tuple[int, ...], pg: Any, rank: int
) -> List[Any]:
    """This rank's share of the flat arguments. With ``pg`` (gradients crossing ranks), tensors that require grad
    pass a traced Split: mapped rows (their gradient rows all-gathered in backward), others whole (summed)."""
    out = []
    for v, d in zip(leaves, dims):
        if d is not None and pg is not None and _needs_grad(v):
            out.append(traced_split(v, Rows(d, sizes), pg, rank))
        elif d is not None:
            out.append(v.narrow(d, *rows_at(sizes, rank)))
        elif pg is not None and _needs_grad(v):
            out.append(traced_split(v, COPY, pg, rank))
        else:
            out.append(v)
    return out


def enter_kwargs(kwargs: Dict[str, Any], pg: Any, rank: int) -> Dict[str, Any]:
    """Keyword tensors are not mapped: those that require grad get their gradient summed over the ranks."""
    if not kwargs or pg is None:
        return kwargs
    leaves, spec = flatten(kwargs)
    return unflatten([traced_split(v, COPY, pg, rank) if _needs_grad(v) else v for v in leaves], spec)


def map_share(
    opts: Options,
    func: Callable,
    shard: Tuple[List[Any], Sequence[Optional[int]], Any],
    kwargs: Dict[str, Any],
    frame: Optional[AxisFrame],
    rows: int,
) -> Any:
    """func over the ``rows`` examples of ``shard`` (its leaves, in-dims and spec): ``torch.vmap``'s own steps, with
    the vmap level kept in the axis frame (the named-axis ops lower at that level), or one batched call."""
    leaves, dims, spec = shard
    if opts.mode == "batched":
        if frame is not None:
            frame.index = _indices(frame, rows, leaves)
        return func(*unflatten(leaves, spec), **kwargs)
    if frame is None:
        chunk = opts.chunk_size if rows else None
        return torch.vmap(func, opts.in_dims, opts.out_dims, chunk_size=chunk)(*unflatten(leaves, spec), **kwargs)
    with functorch_vmap.vmap_increment_nesting(rows, opts.randomness) as level:
        frame.level = level
        frame.index = torch._C._functorch._add_batch_dim(_indices(frame, rows, leaves), 0, level)
        args = functorch_vmap._create_batched_inputs(list(dims), list(leaves), level, spec)
        return _unbatch(opts, func(*args, **kwargs), level, rows)


def _unbatch(opts: Options, out: Any, level: int, rows: int) -> Any:
    """vmap's outputs at ``out_dims``, as ``torch.vmap`` returns them. An ``out_dims=None`` output must not depend on
    the example: dynamo cannot ask whether a tensor is batched, so its rows are read as a view, which is a broadcast
    (stride 0) exactly when every example holds the same value."""
    flat, spec = flatten(out)
    dims = flatten_out_dims(opts.call, opts.out_dims, spec, len(flat))
    placed = []
    for i, (v, d) in enumerate(zip(flat, dims)):
        if not isinstance(v, torch.Tensor):
            if d is not None:
                raise ValueError(f"{opts.call}: output {i} must be a Tensor to be mapped, got {type(v).__name__}.")
            placed.append(v)
        elif d is None:
            if rows > 1 and torch._C._functorch._remove_batch_dim(v, level, rows, 0).stride(0) != 0:
                raise ValueError(
                    f"{opts.call}: output {i} depends on the example but its out_dim is None; give it an int "
                    f"out_dim, or reduce it over the axis first, e.g. with psum."
                )
            placed.append(v)
        else:
            d = normalise_out_dim(opts.call, d, v.dim(), i)
            placed.append(torch._C._functorch._remove_batch_dim(v, level, rows, d))
    return unflatten(placed, spec)


def _indices(frame: AxisFrame, rows: int, leaves: Sequence[Any]) -> torch.Tensor:
    first = 0 if frame.dummy else frame.offset
    return torch.arange(first, first + rows, dtype=torch.int64, device=_device(leaves))


def _device(leaves: Sequence[Any]) -> torch.device:
    """The first tensor's device (a plain loop: dynamo traces no ``next`` with a default)."""
    for v in leaves:
        if isinstance(v, torch.Tensor):
            return v.device
    return torch.device("cpu")


def leave(opts: Options, out: Any, sizes: Tuple[int, ...], pg: Any, rank: int) -> Any:
    """The result on this rank: batched outputs cut to this rank's rows (a stand-in's cut off), then all-gathered
    along their out-dim (``dst=-1``) or kept (``dst="local"``); an ``out_dims=None`` output passes a ``SAME`` Join
    (``dst=-1``: its backward gives its gradient to one rank only) or a ``ONCE`` Join (``dst="local"``: each rank
    its cotangent over P), so that the sum over ranks counts it once."""
    flat, spec = flatten(out)
    dims = flatten_out_dims(opts.call, opts.out_dims, spec, len(flat))
    mine = sizes[rank]
    result = []
    for i, (v, d) in enumerate(zip(flat, dims)):
        if not isinstance(v, torch.Tensor):
            result.append(v)
            continue
        if d is not None:
            d = normalise_out_dim(opts.call, d, v.dim() - 1, i)
            v = v.narrow(d, 0, mine) if v.shape[d] != mine else v
        if pg is None or (opts.dst == "local" and d is not None):  # nothing moves: every rank keeps its own
            result.append(v)
        elif d is not None:
            result.append(traced_join(v, Rows(d, sizes), pg, rank))
        elif torch.is_grad_enabled() and _needs_grad(v):
            result.append(traced_join(v, ONCE if opts.dst == "local" else SAME, pg, rank))
        else:
            result.append(v)
    return unflatten(result, spec)
