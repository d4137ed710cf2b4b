"""A call inside ``torch.compile``: the cmap lowered to plain traceable ops, so that dynamo traces
``torch.compile(cmap(f), fullgraph=True)`` into one graph.

cmap's steps as the engine's compiled driver runs them (:func:`~colossalai_cmap.engine.driver.run_compiled`; ``api``
holds cmap's kind), with the eager path's split and roles but no round of its own:

1. Refuse what needs the eager orchestration (:func:`unsupported`): ``src``, ``dst=r``, loop mode, random draws,
   ``check_inputs``, a cmap nested in another's func, closure-captured tensors that need a gradient, and in batched
   mode across ranks a BatchNorm in training mode (its statistics over the whole batch, ``batchnorm.py``).
2. Share from static shapes: the eager call's shares (:func:`~.shares.share_sizes`), so each rank maps the same rows.
3. Enter: mapped inputs cut with ``narrow``; tensors that need a gradient go through a traced ``Split``
   (:mod:`~colossalai_cmap.wire.traced`): rows all-gathered in backward, other tensors' gradients summed.
4. Run func under ``torch.vmap`` (or batched) with the axis frame open, so the named-axis ops inside it lower to
   functional collectives (:mod:`~colossalai_cmap.axis.ops`). An empty share runs one stand-in example, as eagerly.
5. Exit (``conclude.conclude_traced``): batched outputs all-gathered along their out-dim through a traced ``Join`` (``dst=-1``), or kept
   (``dst="local"``); ``out_dims=None`` outputs through a ``SAME`` or ``ONCE`` Join, counted once in backward.

What changes against eager cmap (docs/collectives.md, "torch.compile"): no status round, so an error on one rank is
not raised on the others (they wait in the next collective until the group's timeout); ranks are not checked to
pass the same inputs or to compute the same output layout; shapes are fixed per compiled graph (dynamo recompiles
for new ones).
"""

from typing import Any, Dict, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from ..axis import frame as frames
from ..axis.frame import AxisFrame
from ..engine.driver import TracedEntry
from ..integration.groups import resolve_group
from ..wire.group import Group
from ..wire.link import Link
from ..wire.roles import first_row
from .entry import enter_kwargs_traced, enter_traced, first_example
from .execute import Share, Task, run_share_traced
from .keywords import flatten_call, keyword_batch
from .options import Options
from .shares import share_sizes
from .site import CallSite


class Traced(NamedTuple):
    """This rank's part of a compiled call: its share (mapped inputs entered, a stand-in example after an empty
    share's), the keywords entered, the axis frame (or None), and what the exit needs: every rank's rows, the process
    group the outputs are joined over (None where nothing moves) and this rank's place in it."""

    share: Share
    kwargs: Dict[str, Any]
    frame: Optional[AxisFrame]
    sizes: Tuple[int, ...]
    pg: Any
    rank: int


def communicate(site: CallSite, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> CallSite:
    """Every rank of the group takes part; the group is resolved after the checks, in :func:`enter`."""
    return site


def enter(site: CallSite, where: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> TracedEntry:
    """The eager call's shares, from static shapes (each rank maps the same rows), entered as traceable ops; the
    axis frame func runs in; every rank marked as splitting (this rank's group members are not known inside the
    graph, and a plain vmap, which a cmap nested in func runs as, eagerly, gives the same values)."""
    opts = site.options
    pg = process_group(opts)
    rank, size = (0, 1) if pg is None else (dist.get_rank(pg), dist.get_world_size(pg))
    flat = flatten_call(opts, site.func, args, kwargs)
    sizes = share_sizes(flat.batch_size, size, opts.gathers)
    offset, rows = first_row(sizes, rank), sizes[rank]
    grads = size > 1 and torch.is_grad_enabled()
    leaves = enter_traced(flat.leaves, flat.dims, sizes, pg if grads else None, rank)
    kwargs = enter_kwargs_traced(kwargs, pg if grads else None, rank)
    stand_in = rows == 0 and flat.batch_size > 0
    if stand_in:  # one example that takes part in func's collectives, contributing nothing, and is cut off
        leaves = [
            v if d is None else torch.cat([v, first_example(a, d)], d)
            for v, a, d in zip(leaves, flat.leaves, flat.dims)
        ]
    share = Share(leaves, tuple(flat.dims), flat.spec, max(rows, 1) if stand_in else rows)
    frame, opened = None, ()
    if opts.axis_name is not None:
        link = None if pg is None else Link(Group(pg, rank, size, ()), share.device(), opts.call, opts.timeout)
        frame = AxisFrame(link=link, size=flat.batch_size, offset=offset, sizes=sizes, mode=opts.mode, dummy=stand_in)
        opened = ((opts.axis_name, frame),)
    splitting = tuple(range(dist.get_world_size())) if size > 1 else ()
    traced = Traced(share, kwargs, frame, sizes, pg if size > 1 else None, rank)
    return TracedEntry(traced, opened, splitting)


def run(site: CallSite, where: Any, entered: TracedEntry) -> Any:
    """func on the share, under ``torch.vmap``'s own steps (or batched), with the frame open."""
    traced = entered.inputs
    return run_share_traced(Task(site.options, site.body, traced.kwargs, traced.frame), traced.share)


def unsupported(site: CallSite, where: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[str]:
    """What of this call only the eager orchestration does (a key of :data:`REASONS`), or None."""
    opts = site.options
    if keyword_batch(opts, args, kwargs):
        return "keywords"
    if opts.src is not None:
        return "src"
    if opts.dst != -1 and opts.dst != "local":
        return "dst"
    if not opts.mode.compiles:
        return "loop"
    if not opts.randomness.compiles:
        return "randomness"
    if opts.check_inputs:
        return "check_inputs"
    if frames.active():  # its traced collectives would run under the outer map's vmap, which has no rule for them
        return "nested"
    if torch.is_grad_enabled() and site.captures_trainable():
        return "captured"
    if opts.mode.holds_rows and _across(opts) and site.runs_training_batchnorm():
        return "batchnorm"
    return None


def _across(opts: Options) -> bool:
    pg = process_group(opts)
    return pg is not None and dist.get_world_size(pg) > 1


REASONS = {
    "src": "src=r or src='local' moves the inputs in the status protocol",
    "dst": "dst=r gives one rank the result",
    "loop": "mode='loop' runs its examples in threads",
    "randomness": "randomness other than 'error' sets up the generators per rank or per example",
    "check_inputs": "check_inputs=True compares checksums in the status round",
    "keywords": "kwarg_dims maps keyword arguments, and a Mapping argument is split, in the eager call only",
    "nested": "a cmap inside the func of another cmap or shard_map maps over that call's examples",
    "captured": (
        "a closure-captured tensor or module parameter requires grad and its gradient is summed over the ranks; "
        "pass it as an argument with in_dims=None"
    ),
    "batchnorm": "a BatchNorm in training mode takes its statistics over the whole batch, across the group",
}


def process_group(opts: Options) -> Optional[Any]:
    """The call's process group, or None in one process (torch.distributed not initialised)."""
    if opts.group is None:
        return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    if isinstance(opts.group, dist.ProcessGroup):
        return opts.group
    return resolve_group(opts.call, opts.group).pg
