"""The eager driver of a call, from the arguments to the result (``compiled`` is the driver inside
``torch.compile``; both run the steps of ``shares``, ``entry``, ``execute`` and ``conclude``).

The path (docs/design.md has the picture):

1. Resolve the group. A group of one, no ``torch.distributed``, a cmap nested in a cmap over the same group, or meta
   inputs: run alone, the same steps on :func:`alone`'s group of one, whose link is not wired, so nothing moves
   (a repeated call whose steps around func are none calls the cmap's ``torch.vmap`` wrapper, :func:`_run_as_vmap`).
2. Shares: read the record of an earlier call with the same argument key (the fast path), or check the arguments and
   find the shares (:mod:`.shares`; with ``src=r`` the shares and this rank's rows come from rank r, :mod:`.from_src`).
   A rank whose sharing fails carries a :class:`~colossalai_cmap.call.records.Failed` outcome on to the exit.
3. This rank's part (:mod:`.rank`), then the exit (:mod:`.conclude`), which returns the result or raises on every rank.
4. Keep the shares and the outputs' layout for the next call with the same key, and what the call did.
"""

from typing import Any, Callable, Dict, Sequence, Tuple, Union

import torch

from .. import faults, stats
from ..errors import CmapError
from ..integration.groups import collective_device, resolve_group
from ..nesting import CONTROL_FLOW, nested_in_split
from ..torch_internals import tree_flatten
from ..wire import comm
from ..wire.exchange import not_differentiable, requires_grad
from ..wire.group import Group
from ..wire.link import Link, link_for
from .conclude import conclude
from .dims import KeywordCall, flatten, unflatten
from .execute import with_remedy
from .options import check_placement
from .rank import run_rank
from .records import Failed, FastPath, Inputs, LastCall, Outputs
from .shares import key_of, make_shares
from .site import CallSite


def dispatch(site: CallSite, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """Run one call of the cmap ``site``; returns its result on this rank, or raises what every rank raises."""
    opts = site.options
    group = resolve_group(opts.call, opts.group)
    local = group.size == 1 or nested_in_split(group.ranks) or _meta(args)
    log, fast, shares = stats.open_log(), None, None
    try:
        if not local:
            comm.check_usable(group, opts.call)
        on = alone(group) if local else group
        leaves, spec = flatten(args)
        key = None if isinstance(opts.src, int) else key_of(leaves, kwargs, on)
        fast = site.fast_paths.get(key, spec) if key is not None else None
        # alone with no process group (no torch.distributed), or nested in a call that reports it: raise as it is
        raw = local and (group.pg is None or group.size > 1)
        if fast is not None and fast.shares.rows and not fast.link.wired and opts.alone_as_vmap and not faults.ACTIVE:
            return _run_as_vmap(site, fast.link, args, kwargs, raw)
        if fast is not None:
            link, inputs = fast.link, Inputs(fast.shares, leaves, kwargs)
        else:
            link = link_for(on, collective_device(on, leaves), opts.call, opts.timeout)
            inputs = _make_inputs(site, group, args, kwargs, leaves, link)
        shares = None if isinstance(inputs, Failed) else inputs.shares
        result, out = _run_and_conclude(site, inputs, link, fast.layout if fast is not None else None, leaves, raw)
        if result.captures is not None:  # what this call found decides whether the next one intercepts
            site.captures = result.captures
        if key is not None and (fast is None or fast.layout is not result.layout):
            site.fast_paths.put(key, FastPath(shares, link, result.layout))
        return out
    finally:
        stats.close_log(log)
        site.last = LastCall(log, group.size, local, fast is not None, shares)


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
        shares = make_shares(opts, site.func, group if link.wired else link.group, args, kwargs)
        if isinstance(opts.src, int):  # alone, as the scatter gives every rank (the source too): copies of the rows
            leaves = [v if d is None else v.clone() for v, d in zip(leaves, shares.dims)]
        return Inputs(shares, list(leaves), kwargs)
    except CmapError:  # a wait failed (the source's broadcast or scatter): the group is out of step, no more rounds
        raise
    except Exception as exc:
        return Failed(group.failure(exc), exc)


def _run_and_conclude(
    site: CallSite, inputs: Union[Inputs, Failed], link: Link, hint: Any, leaves: Sequence[Any], raw: bool = False
) -> Tuple[Union[Outputs, Failed], Any]:
    """This rank's part and the exit; with ``raw``, a failure is raised as it is. With ``dst=r`` or ``src=r`` the
    output is not differentiable: every output that depends on a tensor that requires grad (an argument, a keyword,
    a parameter or a closure: however func reached it) is cut from its graph and raises a clear error in backward,
    where no collective is involved, so nothing hangs and no rank writes a ``.grad`` alone."""
    opts = site.options
    result = inputs if isinstance(inputs, Failed) else run_rank(site, inputs, link, hint)
    if isinstance(result, Failed):
        _raise_failed(opts, result, link, raw)
    out = conclude(opts, inputs.shares, result, inputs, link)
    if out is None or not opts.refuses_grad or not torch.is_grad_enabled():
        return result, out
    return result, _refuse_grad(site, out, result.flat, leaves, inputs.kwargs, inputs.source_needs_grad)


def _run_as_vmap(site: CallSite, link: Link, args: Tuple[Any, ...], kwargs: Dict[str, Any], raw: bool) -> Any:
    """A repeated call that runs alone, where the general path's steps around func are none (``opts.alone_as_vmap``)
    and this rank has rows: func under the cmap's own ``torch.vmap``, whose checks of the outputs are the layout's;
    a failure is raised as the exit raises it."""
    try:
        return site.vmapped()(*args, **kwargs)
    except CONTROL_FLOW:
        raise
    except Exception as exc:
        remedied = with_remedy(site.options, site.func, exc)
        failed = Failed(link.group.failure(remedied), remedied)
    _raise_failed(site.options, failed, link, raw)  # out of the except: the remedied error alone, as run_rank's


def _raise_failed(opts: Any, failed: Failed, link: Link, raw: bool) -> None:
    """This rank's failure, raised by the exit on every rank; with ``raw`` (alone, with no group to name) as it is."""
    if raw:
        raise failed.cause
    conclude(opts, None, failed, None, link)


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
