"""cmap's steps before and after this rank's part, as the engine's eager driver runs them
(:func:`~colossalai_cmap.engine.driver.run_eager`; ``api`` holds cmap's kind, whose body is :mod:`.rank` and whose exit
is :mod:`.conclude`).

The path (docs/design.md has the picture):

1. Resolve the group (:func:`communicate`). A group of one, no ``torch.distributed``, a cmap nested in a cmap over the
   same group, or meta inputs: run alone, the same steps on :func:`alone`'s group of one, whose link is not wired, so
   nothing moves (a repeated call whose steps around func are none calls the cmap's ``torch.vmap`` wrapper: its
   inputs are the arguments as given, :class:`Whole`).
2. Shares (:func:`inputs`): read the record of an earlier call with the same argument key (the fast path), or check
   the arguments and find the shares (:mod:`.shares`; with ``src=r`` the shares and this rank's rows come from rank r,
   :mod:`.from_src`). A rank whose sharing fails carries a :class:`~colossalai_cmap.engine.records.Failed` outcome on
   to the exit.
3. This rank's part (:mod:`.rank`), then the exit (:mod:`.conclude`), which returns the result or raises on every rank
   (:func:`raise_failed`); the output refuses backward where the call is not differentiable (:func:`finished`).
4. Keep the shares and the outputs' layout for the next call with the same key, and what the call did
   (:func:`finished`, :func:`finish`).
"""

from dataclasses import dataclass
from typing import Any, Callable, Dict, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from .. import faults, stats
from ..engine.exit import raise_failed as report
from ..engine.records import Failed
from ..errors import CmapError
from ..integration.groups import collective_device, resolve_group
from ..nesting import nested_in_split
from ..stats import CollectiveLog
from ..torch_internals import tree_flatten
from ..wire import comm
from ..wire.exchange import not_differentiable, requires_grad
from ..wire.group import Group
from ..wire.link import Link, link_for
from .dims import KeywordCall, flatten, unflatten
from .keywords import flatten_call
from .options import check_placement
from .records import FastPath, Inputs, LastCall, Outputs, Shares
from .shares import key_of, make_shares
from .site import CallSite


@dataclass
class Call:
    """Where one call communicates, and what it found on the way, kept to its end: the group, whether it runs alone
    (and ``raw``: alone with no group to name, a failure raised as it is), its collective log, the link, the fast
    path's key and record, and the shares (None where it failed, or where it read the fast path as plain vmap)."""

    group: Group
    local: bool
    log: CollectiveLog
    raw: bool = False
    link: Optional[Link] = None
    key: Any = None
    fast: Optional[FastPath] = None
    shares: Optional[Shares] = None
    leaves: Sequence[Any] = ()


class Whole(NamedTuple):
    """A repeated call that runs alone, where the general path's steps around func are none
    (``opts.alone_as_vmap``) and this rank has rows: its arguments as given, for func under the cmap's own
    ``torch.vmap``, whose checks of the outputs are the layout's; a failure is raised as the exit raises it."""

    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]


def communicate(site: CallSite, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Call:
    """Where the call runs: its group, resolved, or this rank alone (see :func:`alone`)."""
    opts = site.options
    group = resolve_group(opts.call, opts.group)
    local = group.size == 1 or nested_in_split(group.ranks) or _meta(args)
    return Call(group, local, stats.open_log())


def inputs(site: CallSite, call: Call, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Union[Inputs, Whole, Failed]:
    """The call's link and this rank's inputs: the fast path's shares, or the arguments checked and shared."""
    opts, group, local = site.options, call.group, call.local
    if not local:
        comm.check_usable(group, opts.call)
    on = alone(group) if local else group
    call.leaves, spec = flatten(args)
    call.key = None if isinstance(opts.src, int) else key_of(call.leaves, kwargs, on)
    fast = call.fast = site.fast_paths.get(call.key, spec) if call.key is not None else None
    # alone with no process group (no torch.distributed), or nested in a call that reports it: raise as it is
    call.raw = local and (group.pg is None or group.size > 1)
    if fast is not None and fast.shares.rows and not fast.link.wired and opts.alone_as_vmap and not faults.ACTIVE:
        call.link = fast.link
        return Whole(args, kwargs)
    if fast is not None:
        call.link, found = fast.link, Inputs(shares=fast.shares, leaves=call.leaves, kwargs=kwargs)
    else:
        call.link = link_for(on, collective_device(on, call.leaves), opts.call, opts.timeout)
        found = _make_inputs(site, group, args, kwargs, call.leaves, call.link)
    call.shares = None if isinstance(found, Failed) else found.shares
    return found


def enter(site: CallSite, call: Call, inputs: Any) -> Any:
    """Before the call's autograd sequence starts: the fault injection's first point."""
    if faults.ACTIVE:
        faults.check("args", call.link.group)
    return inputs


def raise_failed(call: Call, failed: Failed) -> None:
    """This rank's failure, raised by the exit on every rank; with ``raw`` (alone, with no group to name) as it is."""
    if call.raw:
        raise failed.cause
    report(call.link, failed)


def finished(site: CallSite, call: Call, inputs: Inputs, result: Outputs, out: Any) -> Any:
    """The call's result, after its exit: with ``dst=r`` or ``src=r`` not differentiable (every output that depends
    on a tensor that requires grad, an argument, a keyword, a parameter or a closure, however func reached it, is cut
    from its graph and raises a clear error in backward, where no collective is involved, so nothing hangs and no rank
    writes a ``.grad`` alone); and what it found kept for the next call."""
    opts = site.options
    if out is not None and opts.refuses_grad and torch.is_grad_enabled():
        out = _refuse_grad(site, out, result.flat, call.leaves, inputs.kwargs, inputs.source_needs_grad)
    if result.captures is not None:  # what this call found decides whether the next one intercepts
        site.captures = result.captures
    if call.key is not None and (call.fast is None or call.fast.layout is not result.layout):
        site.fast_paths.put(call.key, FastPath(shares=call.shares, link=call.link, layout=result.layout))
    return out


def finish(site: CallSite, call: Call) -> None:
    """What the call did, returned or raised (``Cmapped.stats``)."""
    stats.close_log(call.log)
    site.last = LastCall(
        log=call.log,
        group_size=call.group.size,
        local=call.local,
        fast_path=call.fast is not None,
        shares=call.shares,
    )


_ALONE: Dict[int, Group] = {}


def alone(group: Group) -> Group:
    """This rank of ``group`` as a group of one with no process group. A call runs alone on a group of one, without
    ``torch.distributed``, nested in a call over the same ranks, or on meta inputs: every step as on any group, with
    nothing to communicate (its link is not wired)."""
    found = _ALONE.get(group.global_rank)
    if found is None:
        found = _ALONE[group.global_rank] = Group(None, 0, 1, (group.global_rank,))
    return found


def _make_inputs(
    site: CallSite, group: Group, args: Tuple[Any, ...], kwargs: Dict[str, Any], leaves: Sequence[Any], link: Link
) -> Union[Inputs, Failed]:
    """Check the arguments and find this rank's share; a failure here travels to the exit's status round. ``dst`` and
    ``src`` are checked against ``group``; the shares are made on the link's group (this rank, where it runs alone)."""
    opts = site.options
    try:
        check_placement(opts.call, "dst", opts.dst, group.size, (-1, "local"))
        if isinstance(opts.src, int):
            check_placement(opts.call, "src", opts.src, group.size, ())
            if link.wired:
                from .from_src import shares_from_src  # only src=r calls pay for its imports

                return shares_from_src(opts, site.func, args, kwargs, link)
        flat = flatten_call(opts, site.func, args, kwargs)
        shares = make_shares(opts, flat, group if link.wired else link.group, kwargs)
        if isinstance(opts.src, int):  # alone, as the scatter gives every rank (the source too): copies of the rows
            leaves = [v if d is None else v.clone() for v, d in zip(leaves, shares.dims)]
        return Inputs(shares=shares, leaves=list(leaves), kwargs=kwargs)
    except CmapError:  # a wait failed (the source's broadcast or scatter): the group is out of step, no more rounds
        raise
    except Exception as exc:
        return Failed(group.failure(exc), exc)


def _refuse_grad(
    site: CallSite, out: Any, mine: Sequence[Any], leaves: Sequence[Any], kwargs: Dict[str, Any], source: bool = False
) -> Any:
    """``out`` with every leaf whose value on this rank (``mine``) required grad, or every leaf if an argument
    does here or (``source``, with ``src=r``) on the source rank, marked to raise the not-differentiable error in
    backward."""
    message = _not_differentiable(site.options)
    every = source or _any_requires_grad(leaves, kwargs, site.func)
    flat, spec = flatten(out)
    marked = [not_differentiable(v, message) if every or requires_grad(m) else v for v, m in zip(flat, mine)]
    return unflatten(marked, spec)


def _not_differentiable(opts: Any) -> str:
    if isinstance(opts.src, int):
        also = f" and dst={opts.dst!r}" if isinstance(opts.dst, int) and opts.dst != -1 else ""
        fix = " and dst=-1" if also else ""
        return (
            f"{opts.call}: the output of a cmap with src={opts.src!r}{also} is not differentiable: its inputs were "
            f"scattered from one rank. Use src=None{fix} to backpropagate to the inputs."
        )
    return (
        f"{opts.call}: the output of a cmap with dst={opts.dst!r} is not differentiable; use dst=-1 (every rank gets "
        f"the result and the gradients) or dst='local' (per-shard gradients)."
    )


def _any_requires_grad(leaves: Sequence[Any], kwargs: Dict[str, Any], func: Callable) -> bool:
    if any(requires_grad(v) for v in list(leaves) + (tree_flatten(kwargs)[0] if kwargs else [])):
        return True
    func = func.func if isinstance(func, KeywordCall) else func
    return isinstance(func, torch.nn.Module) and any(p.requires_grad for p in func.parameters())


def _meta(args: Tuple[Any, ...]) -> bool:
    """Meta inputs carry shapes only: every rank computes the same shapes, so the call runs here, with no
    communication (the shapes are vmap's)."""
    first = next((v for v in args if isinstance(v, torch.Tensor)), None)
    if first is None and args:  # tensors inside containers (mapped keywords come as a dict)
        first = next((v for v in tree_flatten(args)[0] if isinstance(v, torch.Tensor)), None)
    return first is not None and first.is_meta
