"""One call, from the arguments to the result: where it runs, its plan, this rank's part, and the exit.

The path (docs/design.md has the picture):

1. Resolve the group. A group of one, no ``torch.distributed``, or a cmap nested in a cmap over the same group: run
   as plain ``torch.vmap`` here (:func:`run_local`), with no communication.
2. Plan: read the plan of an earlier call with the same argument key (the fast path), or check the arguments and
   make one (:mod:`plan`). With ``src=r``, the shards come from rank r first (:mod:`scatter`).
3. This rank's part (:mod:`rank`), then the exit (:mod:`exit`), which returns the result or raises on every rank.
4. Keep the plan and the outputs' layout for the next call with the same key.
"""

import functools
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch.utils._pytree import tree_flatten, tree_map

from . import bucket, comm, context, exit, faults, stats
from .entry import Inputs
from .errors import CmapError, RankFailure
from .exchange import JoinSpec, join_failed
from .groups import Group, group_device, resolve_group
from .options import Options, check_placement
from .plan import FastPath, PlanCache, key_of, make_plan
from .primitives import not_differentiable, requires_grad
from .protocol import Kind, Link
from .rank import run_rank
from .specs import flatten, flatten_args


class Cmapped:
    """The callable ``cmap(func, ...)`` returns: same call signature as ``func``, runs the batch across the group.

    Attributes:
        func: the per-example function.
        body: the function the map runs: ``func``, or in mode "vmap" the function ``torch.compile`` made it from.
        options: the cmap's options.
    """

    def __init__(self, func: Callable, options: Options) -> None:
        functools.update_wrapper(self, func, updated=())
        self.func = func
        self.options = options
        # torch.vmap cannot run a compiled function (dynamo refuses it): vmap mode maps the original
        self.body = uncompiled(func) if options.mode == "vmap" else func
        self.plans = PlanCache()
        self.refs = bucket.References(uncompiled(func))  # where func's closures and globals live (closures)
        self._vmapped: Optional[Callable] = None
        # Whether the last call that tracked gradients met closure-captured tensors (None: no such call yet).
        self.captures: Optional[bool] = None
        self._last: Optional[Tuple[Any, ...]] = None  # what stats describes, kept raw: it is rarely read

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return _outside_graph(self, args, kwargs)
        return dispatch(self, args, kwargs)

    def __repr__(self) -> str:
        return f"<{self.options.call}, dst={self.options.dst!r}, src={self.options.src!r}, mode={self.options.mode!r}>"

    @property
    def stats(self) -> Optional[stats.CallStats]:
        """What the last call did on this rank (:class:`~colossalai_cmap.stats.CallStats`); None before the first."""
        return None if self._last is None else stats.describe(*self._last)

    @property
    def cached_plans(self) -> int:
        """How many argument signatures' plans this cmap keeps for repeated calls (at most 64)."""
        return len(self.plans)

    def vmapped(self) -> Callable:
        """``torch.vmap(func, ...)`` with this cmap's options, built once (it costs a few microseconds)."""
        if self._vmapped is None:
            o = self.options
            self._vmapped = torch.vmap(
                self.body, o.in_dims, o.out_dims, randomness=o.randomness, chunk_size=o.chunk_size
            )
        return self._vmapped


def uncompiled(func: Callable) -> Callable:
    """The function ``torch.compile`` made ``func`` from (itself if it is not compiled)."""
    if isinstance(func, torch.nn.Module) and hasattr(func, "_orig_mod"):
        return func._orig_mod
    return getattr(func, "_torchdynamo_orig_callable", func)


@torch._disable_dynamo
def _outside_graph(cm: Cmapped, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``torch.compile(cmap(f))``: the orchestration runs eagerly, as a graph break (compile f itself instead)."""
    return dispatch(cm, args, kwargs)


def dispatch(cm: Cmapped, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    group = resolve_group(cm.options.call, cm.options.group)
    if group.size == 1 or context.inside(group) or _meta(args):
        return run_local(cm, group, args, kwargs)
    comm.check_usable(group, cm.options.call)
    if isinstance(cm.options.src, int):
        _checked(cm, group, args, lambda: check_placement(cm.options.call, "src", cm.options.src, group.size, ()))
        from .scatter import run_from_src

        return run_from_src(cm, group, args, kwargs)
    log = stats.open_log()
    fast = plan = None
    try:
        leaves, spec = flatten(args)
        key = key_of(leaves, kwargs, group)
        fast = cm.plans.get(key, spec)
        if fast is None:
            link = Link(group, group_device(group, _first_device(leaves)), cm.options.call, cm.options.timeout)
            plan = _plan(cm, group, args, kwargs, link)
        else:
            link, plan = fast.link, fast.plan
        result, out = _run(cm, plan, Inputs(leaves, kwargs), link, fast.layout if fast is not None else None)
        if fast is None or fast.layout is not result.layout:
            cm.plans.put(key, FastPath(plan, link, result.layout))
        return out
    finally:
        stats.close_log(log)
        cm._last = (log, group.size, False, fast is not None, plan)


def _plan(cm: Cmapped, group: Group, args: Tuple[Any, ...], kwargs: Dict[str, Any], link: Link) -> Any:
    """Check the arguments and plan; a rank whose check fails tells every rank in the status round."""

    def plan() -> Any:
        check_placement(cm.options.call, "dst", cm.options.dst, group.size, (-1, "local"))
        return make_plan(cm.options, cm.func, group, args, kwargs)

    return _checked(cm, group, args, plan, link)


def _checked(cm: Cmapped, group: Group, args: Tuple[Any, ...], check: Callable, link: Optional[Link] = None) -> Any:
    """``check()``, or if it raises here, the status round in which every rank learns of it, and raise."""
    try:
        return check()
    except Exception as exc:
        if link is None:
            device = group_device(group, _first_device(tree_flatten(args)[0]))
            link = Link(group, device, cm.options.call, cm.options.timeout)
        failure = RankFailure.from_exception(exc, group.rank, group.global_rank)
        join_failed(JoinSpec(link, (), kind=Kind.STATUS), failure, exc)


def _run(cm: Cmapped, plan: Any, inputs: Inputs, link: Link, hint: Any) -> Any:
    """This rank's part and the exit. With dst=r the output is not differentiable: no graph, and backward says so."""
    opts = cm.options
    if not isinstance(opts.dst, int) or opts.dst == -1 or not torch.is_grad_enabled():
        result = run_rank(cm, plan, inputs, link, hint)
        return result, exit.finish(opts, plan, result, inputs, link)
    with torch.no_grad():
        result = run_rank(cm, plan, inputs, link, hint)
        out = exit.finish(opts, plan, result, inputs, link)
    if out is None or not _any_requires_grad(inputs, cm.func):
        return result, out
    message = (
        f"{opts.call}: the output of a cmap with dst={opts.dst!r} is not differentiable; use dst=-1 (every rank gets "
        f"the result and the gradients) or dst='local' (per-shard gradients)."
    )
    return result, tree_map(lambda v: not_differentiable(v, message), out)


def _any_requires_grad(inputs: Inputs, func: Callable) -> bool:
    if not torch.is_grad_enabled():
        return False
    leaves = inputs.leaves + (tree_flatten(inputs.kwargs)[0] if inputs.kwargs else [])
    if any(requires_grad(v) for v in leaves):
        return True
    return isinstance(func, torch.nn.Module) and any(p.requires_grad for p in func.parameters())


def _meta(args: Tuple[Any, ...]) -> bool:
    """Meta inputs carry shapes only: every rank computes the same shapes, so the call runs here, with no
    communication (the shapes are vmap's)."""
    first = next((v for v in args if isinstance(v, torch.Tensor)), None)
    return first is not None and first.is_meta


def _first_device(leaves: Any) -> Optional[torch.device]:
    return next((v.device for v in leaves if isinstance(v, torch.Tensor)), None)


# ---------------------------------------------------------------------------------------------------- local run
def run_local(cm: Cmapped, group: Group, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """The whole batch here, as ``torch.vmap``: a group of one, no ``torch.distributed``, or nested on one group.

    With ``torch.distributed`` initialised and a group of one, an exception becomes ``CmapError`` as on any group;
    otherwise it is ``torch.vmap``'s own.
    """
    log = stats.open_log()
    try:
        opts = cm.options
        if faults.ACTIVE:
            faults.check("args", group)
            faults.check("func", group)
        if opts.mode == "vmap" and opts.axis_name is None and opts.chunk_size is None:
            return cm.vmapped()(*args, **kwargs)
        return _local_shard(cm, args, kwargs)
    except Exception as exc:
        if group.pg is None or group.size > 1:
            raise
        _raise_alone(cm, group, args, exc)
    finally:
        stats.close_log(log)
        cm._last = (log, group.size, True, False, None)


def _local_shard(cm: Cmapped, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    from .context import AxisFrame, axis_scope
    from .execute import Shard, run_shard

    opts = cm.options
    flat = flatten_args(cm.func, args, opts.in_dims, opts.call)
    shard = Shard(flat.leaves, tuple(flat.dims), flat.spec, flat.batch_size)
    frame = None
    if opts.axis_name is not None:
        B = flat.batch_size
        frame = AxisFrame(None, B, 0, B, (B,), opts.mode)
    with axis_scope(opts.axis_name, frame):
        return run_shard(opts, cm.body, shard, kwargs, frame)


def _raise_alone(cm: Cmapped, group: Group, args: Tuple[Any, ...], exc: Exception) -> None:
    """A group of one: the error every rank of a larger group would raise (an argument error names the argument)."""
    try:
        flatten_args(cm.func, args, cm.options.in_dims, cm.options.call)
    except Exception as arg_exc:
        exc = arg_exc
    failure = RankFailure.from_exception(exc, group.rank, group.global_rank)
    raise CmapError.from_failures(cm.options.call, [failure], group.rank) from exc
