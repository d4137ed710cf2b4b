"""The eager driver of a call, from the arguments to the result (``compiled`` is the driver inside
``torch.compile``; both run the steps of ``shares``, ``entry``, ``execute`` and ``conclude``).

The path (docs/design.md has the picture):

1. Resolve the group. A group of one, no ``torch.distributed``, a cmap nested in a cmap over the same group, or meta
   inputs: run as plain ``torch.vmap`` here (:func:`_run_local`), with no communication.
2. Shares: read the record of an earlier call with the same argument key (the fast path), or check the arguments and
   find the shares (:mod:`.shares`; with ``src=r`` the shares and this rank's rows come from rank r, :mod:`.from_src`).
   A rank whose sharing fails carries a :class:`~colossalai_cmap.call.records.Failed` outcome on to the exit.
3. This rank's part (:mod:`.rank`), then the exit (:mod:`.conclude`), which returns the result or raises on every rank.
4. Keep the shares and the outputs' layout for the next call with the same key, and what the call did.
"""

from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import torch
from torch.utils._pytree import tree_flatten

from .. import faults, stats
from ..axis.frame import AxisFrame, axis_scope
from ..errors import CmapError
from ..integration.groups import collective_device, resolve_group
from ..nesting import nested_in_split
from ..wire import comm
from ..wire.exchange import not_differentiable, requires_grad
from ..wire.group import Group
from ..wire.link import Link, link_for
from .batchnorm import batch_scope, whole_batch
from .conclude import conclude
from .dims import flatten, flatten_args, unflatten
from .execute import Share, per_example_seeds, rng_scope, run_share, with_remedy
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
        if local:
            return _run_local(site, group, args, kwargs)
        comm.check_usable(group, opts.call)
        leaves, spec = flatten(args)
        key = None if isinstance(opts.src, int) else key_of(leaves, kwargs, group)
        fast = site.fast_paths.get(key, spec) if key is not None else None
        if fast is not None:
            link, inputs = fast.link, Inputs(fast.shares, leaves, kwargs)
        else:
            link = link_for(group, collective_device(group, leaves), opts.call, opts.timeout)
            inputs = _make_inputs(site, group, args, kwargs, leaves, link)
        shares = None if isinstance(inputs, Failed) else inputs.shares
        result, out = _run_and_conclude(site, inputs, link, fast.layout if fast is not None else None, leaves)
        if result.captures is not None:  # what this call found decides whether the next one intercepts
            site.captures = result.captures
        if key is not None and (fast is None or fast.layout is not result.layout):
            site.fast_paths.put(key, FastPath(shares, link, result.layout))
        return out
    finally:
        stats.close_log(log)
        site.last = LastCall(log, group.size, local, fast is not None, shares)


def _make_inputs(
    site: CallSite, group: Group, args: Tuple[Any, ...], kwargs: Dict[str, Any], leaves: Sequence[Any], link: Link
) -> Union[Inputs, Failed]:
    """Check the arguments and find this rank's share; a failure here travels to the exit's status round."""
    opts = site.options
    try:
        check_placement(opts.call, "dst", opts.dst, group.size, (-1, "local"))
        if isinstance(opts.src, int):
            check_placement(opts.call, "src", opts.src, group.size, ())
            from .from_src import shares_from_src  # only src=r calls pay for its imports

            return shares_from_src(opts, site.func, args, kwargs, link)
        return Inputs(make_shares(opts, site.func, group, args, kwargs), list(leaves), kwargs)
    except CmapError:  # a wait failed (the source's broadcast or scatter): the group is out of step, no more rounds
        raise
    except Exception as exc:
        return Failed(group.failure(exc), exc)


def _run_and_conclude(
    site: CallSite, inputs: Union[Inputs, Failed], link: Link, hint: Any, leaves: Sequence[Any]
) -> Tuple[Union[Outputs, Failed], Any]:
    """This rank's part and the exit. With ``dst=r`` or ``src=r`` the output is not differentiable: every output
    that depends on a tensor that requires grad (an argument, a keyword, a parameter or a closure: however func
    reached it) is cut from its graph and raises a clear error in backward, where no collective is involved, so
    nothing hangs and no rank writes a ``.grad`` alone."""
    opts = site.options
    if isinstance(inputs, Failed):
        return inputs, conclude(opts, None, inputs, None, link)
    result = run_rank(site, inputs, link, hint)
    out = conclude(opts, inputs.shares, result, inputs, link)
    if out is None or not opts.refuses_grad or not torch.is_grad_enabled():
        return result, out
    return result, _refuse_grad(site, out, result.flat, leaves, inputs.kwargs, inputs.source_needs_grad)


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
    return isinstance(func, torch.nn.Module) and any(p.requires_grad for p in func.parameters())


def _meta(args: Tuple[Any, ...]) -> bool:
    """Meta inputs carry shapes only: every rank computes the same shapes, so the call runs here, with no
    communication (the shapes are vmap's)."""
    first = next((v for v in args if isinstance(v, torch.Tensor)), None)
    return first is not None and first.is_meta


# ---------------------------------------------------------------------------------------------------- local run
def _run_local(site: CallSite, group: Group, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """The whole batch here, as ``torch.vmap``: a group of one, no ``torch.distributed``, or nested on one group.

    With ``torch.distributed`` initialised and a group of one, an exception becomes ``CmapError`` as on any group;
    otherwise it is ``torch.vmap``'s own, with the remedy a group would add to it (:func:`.execute.with_remedy`).
    """
    opts = site.options
    try:
        check_placement(opts.call, "dst", opts.dst, group.size, (-1, "local"))  # as at every P
        if isinstance(opts.src, int):
            check_placement(opts.call, "src", opts.src, group.size, ())
        if faults.ACTIVE:
            faults.check("args", group)
            faults.check("func", group)
        plain = opts.axis_name is None and opts.chunk_size is None and opts.randomness != "per_example"
        if opts.mode == "vmap" and plain and not opts.places_outputs:
            out = site.vmapped()(*args, **kwargs)
        else:
            out = _local_share(site, args, kwargs)
        if opts.refuses_grad and torch.is_grad_enabled():  # as on a group of any size
            return _refuse_grad(site, out, flatten(out)[0], tree_flatten(args)[0], kwargs)
        return out
    except Exception as exc:
        if group.pg is None or group.size > 1:
            remedied = with_remedy(opts, site.func, exc)
            if remedied is exc:
                raise
            raise remedied from None  # the same type, torch's sentence and traceback, the remedy added
        _raise_alone(site, group, args, exc)


def _local_share(site: CallSite, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    opts = site.options
    flat = flatten_args(site.func, args, opts.in_dims, opts.call)
    share = Share(flat.leaves, tuple(flat.dims), flat.spec, flat.batch_size)
    frame: Optional[AxisFrame] = None
    seeds = per_example_seeds(0) if opts.randomness == "per_example" else None
    if opts.axis_name is not None:
        B = flat.batch_size
        frame = AxisFrame(None, B, 0, (B,), "loop" if seeds is not None else opts.mode)
    coupled = whole_batch(opts, None, False)  # the refusals of a batch that is not one call, as at every P
    with axis_scope(opts.axis_name, frame), rng_scope(None if seeds is None else seeds.base, [share.device()]):
        with batch_scope(opts, coupled):
            return run_share(opts, site.body, share, kwargs, frame, seeds=seeds)


def _raise_alone(site: CallSite, group: Group, args: Tuple[Any, ...], exc: Exception) -> None:
    """A group of one: the error every rank of a larger group would raise (an argument error names the argument)."""
    try:
        flatten_args(site.func, args, site.options.in_dims, site.options.call)
    except Exception as arg_exc:
        exc = arg_exc
    exc = with_remedy(site.options, site.func, exc)
    raise CmapError.from_failures(site.options.call, [group.failure(exc)], group.rank) from exc
