"""This rank's part of a call, up to its exit: take its rows, run func on them, read the outputs.

It runs inside the engine's part (:func:`~colossalai_cmap.engine.part.run_part`): an exception becomes a
:class:`~colossalai_cmap.engine.records.Failed` outcome (:func:`failed`), which the exit reports in the status round, so
every rank raises together. The steps:

1. The entry. With ``dst=-1``, tensors that require grad enter through one ``Split`` tagged with the call (its
   backward sums their gradients over the group); the others are cut with ``narrow``. Both are views.
2. An empty share (B < P) runs one stand-in example instead, so that it knows the outputs' layout, takes part in
   collectives inside func (contributing nothing), and builds the same autograd graph as its peers.
3. func runs under ``torch.vmap`` (or batched, or in a loop), with this call's axis frame and randomness.
4. The outputs are read against ``out_dims``; closure-captured tensors are found in their graph (``engine.closures``);
   mapped inputs that func changed in place are noted, to be written back on every rank; outputs that are views of
   the caller's inputs are noted with their geometry (:mod:`views`), to be returned as views with no gather.
"""

import contextlib
import functools
from typing import Any, Callable, ContextManager, Dict, FrozenSet, Iterator, List, Optional, Sequence, Tuple

import torch

from .. import faults
from ..axis.frame import AxisFrame, axis_scope
from ..engine import closures, module_params
from ..engine.part import walk_and_guard
from ..engine.records import Failed
from ..nesting import gradients_tracked, start_splitting, stop_splitting
from ..torch_internals import TreeSpec, sequence_nr, version_counter
from ..wire.exchange import CallTag, requires_grad
from ..wire.link import Link
from ..wire.roles import first_row
from ..wire.rounds import agree_rows
from . import views
from .batchnorm import WholeBatch, batch_scope, whole_batch
from .dims import flatten, flatten_out_dims, normalise_out_dim
from .entry import Entered, enter, first_example
from .execute import Share, Task, check_rows, run_share, with_remedy
from .layout import BATCHED, REPLICATED, OutLayout, infer_layout
from .options import Options
from .randomness import ExampleSeeds, per_example_seeds, rng_scope
from .records import Inputs, Outputs, Shares
from .site import CallSite


def run_rank(
    site: CallSite, inputs: Inputs, link: Link, hint: Optional[OutLayout], tag: CallTag, start: int
) -> Outputs:
    """This rank's part of the call shared out in ``inputs``, for the cmap ``site``, inside the engine's part
    (:func:`~colossalai_cmap.engine.part.run_part`: the call's ``tag``, the sequence's ``start``, and an exception
    made a :func:`failed` outcome)."""
    opts, shares = site.options, inputs.shares
    group, wired = link.group, link.wired  # not wired: alone, where nothing crosses ranks
    entered = enter(opts, site.refs, shares, inputs, link, tag)
    leaves = entered.leaves
    empty, extra = shares.rows == 0 and shares.batch != 0, _extra_rows(opts, shares)
    if extra:
        leaves = _stand_in(opts, shares, inputs, leaves, extra)
    versions = _versions(opts, shares, inputs.leaves) if wired else None
    joined = _versions(opts, shares, leaves) if extra and versions is not None else None
    frame, seed, seeds = _frame_and_seed(opts, shares, link, empty)
    share = Share(leaves, shares.dims, shares.spec, shares.rows + extra)
    if faults.ACTIVE:
        faults.check("func", group)
    intercept = _interceptor(site, tag, start, link)
    coupled = whole_batch(opts, link, empty)
    modes = _thread_modes(opts, tag, intercept, coupled)
    run = dict(thread_modes=modes, seeds=seeds, coupled=coupled)
    if entered.aliases or intercept is not None:
        with module_params.substituted(entered.modules, entered.aliases), intercept or contextlib.nullcontext():
            out = _call_func(site, share, entered.kwargs, frame, seed, link, **run)
    else:
        out = _call_func(site, share, entered.kwargs, frame, seed, link, **run)
    tag.running = False
    if faults.ACTIVE:
        faults.check("layout", group)
    flat, spec = flatten(out)
    layout = layout_of(opts, flat, spec, hint, coupled)
    if opts.mode.holds_rows:
        _check_rows(opts, flat, layout, share.rows)
    found = views.find_views(flat, layout, leaves, shares, inputs.leaves) if wired and views.applies(opts) else ()
    if extra:
        flat = [
            v.narrow(leaf.out_dim, 0, shares.rows) if leaf.kind == BATCHED else v
            for v, leaf in zip(flat, layout.leaves)
        ]
    graph_sig = 0
    if wired:  # the closure walk, or this rank's backward through func, guarded
        walk = _walks(opts, flat, layout, start, link)
        flat, graph_sig = walk_and_guard(flat, tag, start, link, replay=_replay(entered, intercept, coupled), walk=walk)
    captures = None  # what this call found decides whether the next one intercepts
    if intercept is not None or graph_sig:
        captures = bool(graph_sig or (intercept is not None and intercept.met()))
    if joined is not None:
        _keep_changes(shares, inputs.leaves, leaves, joined)
    mutated = _mutated(versions, inputs.leaves, shares)
    return Outputs(
        flat=flat,
        spec=spec,
        layout=layout,
        empty=empty,
        graph_sig=graph_sig,
        mutated=mutated,
        captures=captures,
        views=found,
    )


def failed(site: CallSite, link: Link, exc: BaseException) -> Failed:
    """This rank's exception as the outcome every rank learns of in the status round: where cmap can tell its cause,
    torch's sentence with the remedy (:func:`~.execute.with_remedy`)."""
    exc = with_remedy(site.options, site.func, exc)
    return Failed(link.group.failure(exc), exc)


def _replay(
    entered: Entered, intercept: Optional[closures.Interceptor], coupled: Optional[WholeBatch]
) -> Callable[[], ContextManager[Any]]:
    """The context func ran in, for a recomputation of part of it in its backward (reentrant checkpointing): its
    modules' parameters replaced by their aliases again, and the tensors it read made before the call routed
    through theirs, so that their gradients reach the call's entry, as the first run's do, instead of accumulating
    this rank's share alone into ``.grad``; and a BatchNorm recomputed over the whole batch again. (A partial of one
    module-level context manager: most calls never replay, so none is built per call.)"""
    return functools.partial(_replaying, entered, intercept, coupled)


@contextlib.contextmanager
def _replaying(
    entered: Entered, intercept: Optional[closures.Interceptor], coupled: Optional[WholeBatch]
) -> Iterator[None]:
    with module_params.substituted(entered.modules, entered.aliases), coupled or contextlib.nullcontext():
        with intercept.replaying() if intercept is not None else contextlib.nullcontext():
            yield


def _thread_modes(
    opts: Options, tag: CallTag, intercept: Optional[closures.Interceptor], coupled: Optional[WholeBatch]
) -> Tuple[Any, ...]:
    """What loop mode's example threads (a loop with collectives) run under, since modes are per thread: the
    interceptor, the marker of the autograd nodes they make, and the BatchNorm mode (its refusal)."""
    if not opts.mode.in_turns or opts.axis_name is None:
        return ()
    found = (closures.MadeHere(tag),) + ((intercept,) if intercept is not None else ()) if gradients_tracked() else ()
    return found + ((coupled,) if coupled is not None else ())


def _interceptor(site: CallSite, tag: CallTag, start: int, link: Link) -> Optional[closures.Interceptor]:
    """The closure interceptor, where it can matter (``engine.closures``): unless the last call with gradients found
    no closure-captured tensor at all, and func's closures hold none now."""
    if not (link.wired and site.options.differentiable and gradients_tracked()):
        return None
    if site.captures is False and not closures.may_capture(site.refs):
        return None
    return closures.Interceptor(tag, start, link)


def _call_func(
    site: CallSite,
    share: Share,
    kwargs: Dict[str, Any],
    frame: Any,
    seed: Optional[int],
    link: Link,
    *,
    thread_modes: Tuple[Any, ...],
    seeds: Optional[ExampleSeeds] = None,
    coupled: Optional[WholeBatch] = None,
) -> Any:
    opts = site.options
    # under vmap no BatchNorm mode or SyncBatchNorm refusal applies: no batch scope (a generator) is made
    scope = _NO_SCOPE if opts.mode.under_vmap else batch_scope(opts, coupled, site.may_reach_sync_batchnorm())
    start_splitting(link.group.ranks)  # a cmap nested in func on these ranks runs locally
    try:
        with scope:  # BatchNorm sees the whole batch (batchnorm.py)
            if frame is None and seed is None:
                return run_share(Task(opts, site.body, kwargs), share, vmapped=site.vmapped())
            with axis_scope(opts.axis_name, frame), rng_scope(seed, [link.device]):
                return run_share(Task(opts, site.body, kwargs, frame, thread_modes, seeds), share)
    finally:
        stop_splitting()


_NO_SCOPE = contextlib.nullcontext()


def _extra_rows(opts: Options, shares: Shares) -> int:
    """Stand-in examples to run besides this rank's own: one on an empty share; and where func runs once per example
    or per chunk, enough to reach the largest share, so that every rank builds the same autograd graph."""
    if shares.batch == 0:
        return 0
    per_row = opts.mode.in_turns or opts.chunk_size is not None
    if per_row and opts.axis_name is None and opts.differentiable and shares.sizes and gradients_tracked():
        return max(shares.sizes) - shares.rows
    return 1 if shares.rows == 0 else 0


def _stand_in(opts: Options, shares: Shares, inputs: Inputs, leaves: List[Any], extra: int) -> List[Any]:
    """``extra`` stand-in examples after this rank's rows: copies of the global first example when this rank has it,
    else zeros. Their outputs are cut off; they are joined to the real rows, so that backward reaches the entry."""
    out = list(leaves)
    for i in shares.mapped:
        d, mine = shares.dims[i], leaves[i]
        if inputs.stand_in is not None:
            row = inputs.stand_in[i]
        elif extra == 1 and shares.rows == 0 and views.applies(opts) and _unwatched(inputs.leaves[i], mine):
            out[i] = inputs.leaves[i].narrow(d, 0, 1)  # a view, as rank 0's rows are: its outputs' views match
            continue
        elif opts.src is None and shares.batch > 0:
            row = first_example(inputs.leaves[i], d)
        else:
            shape = list(mine.shape)
            shape[d] = 1
            row = mine.new_zeros(shape)
        rows = row if extra == 1 else torch.cat([row] * extra, dim=d)
        out[i] = torch.cat([mine, rows], dim=d)  # mine carries the graph and the tangents, even with no rows
    return out


def _unwatched(x: Any, mine: Any) -> bool:
    """A caller's tensor whose first row can stand in as a view: no graph or tangent rides on this rank's rows."""
    return views.plain(x) and not x.requires_grad and mine is not None and views.plain(mine)


def _frame_and_seed(
    opts: Options, shares: Shares, link: Link, empty: bool
) -> Tuple[Optional[AxisFrame], Optional[int], Optional[ExampleSeeds]]:
    """The axis frame, the seed of the call's forked generator, and ``"per_example"``'s seeds; one ``OP`` round
    when the ranks' shares are not known yet (``src="local"``) and the axis or the examples' global indices need them.

    "same" draws from the caller's generator as ``torch.vmap`` does (no seed); "different" forks it, seeded from one
    draw plus the group rank; "per_example" forks it, and seeds each example from one draw and its global index.
    Each rank draws from its own generator: the ranks' generators are in step when seeded alike (colossalai's launch).
    """
    per_example = opts.randomness.per_example
    if opts.axis_name is None and not per_example and not opts.randomness.seeded_per_rank:
        return None, None, None  # the common case: no frame, no fork
    need_sizes = (opts.axis_name is not None or per_example) and shares.sizes is None
    seed, seeds = None, None
    sizes = shares.sizes
    if opts.randomness.seeded_per_rank:
        seed = int(torch.randint(0, 2**31, (), dtype=torch.int64).item())
    if need_sizes:
        sizes = agree_rows(link, shares.rows)
    if opts.randomness.seeded_per_rank:
        seed = (seed + 1_000_003 * link.group.rank) % (2**63)
    offset = first_row(sizes, link.group.rank) if sizes is not None else 0
    if per_example:
        seeds = per_example_seeds(offset)
        seed = seeds.base
    if opts.axis_name is None:
        return None, seed, seeds
    frame = AxisFrame(link=link, size=sum(sizes), offset=offset, sizes=sizes, mode=opts.axis_mode, dummy=empty)
    return frame, seed, seeds


_NONE: FrozenSet[int] = frozenset()


def layout_of(
    opts: Options, flat: Sequence[Any], spec: TreeSpec, hint: Optional[OutLayout], coupled: Optional[WholeBatch] = None
) -> OutLayout:
    """The outputs' layout, checked against ``out_dims``; a repeated call's hint saves the digest. A loss over the
    whole batch that ``coupled`` returned (:mod:`.losses`), output as it is, is equal on every rank: replicated."""
    whole = frozenset(i for i, v in enumerate(flat) if coupled.made_here(v)) if coupled and coupled.losses else _NONE
    if hint is not None and hint.matches(flat, spec) and hint.whole == whole:
        return hint
    dims = flatten_out_dims(opts.call, opts.out_dims, spec, len(flat))
    for i in whole:
        dims[i] = None
    if opts.mode.holds_rows:
        _check_scalars(opts, flat, dims)
    for i, (v, d) in enumerate(zip(flat, dims)):
        if isinstance(v, torch.Tensor):
            dims[i] = normalise_out_dim(opts.call, d, v.dim() - 1, i)
        elif d is not None:  # as vmap and loop mode refuse it, in every mode (batched too)
            raise ValueError(f"{opts.call}: output {i} must be a Tensor to be mapped, got {type(v).__name__}.")
    return infer_layout(flat, dims, spec, whole)


def _check_scalars(opts: Options, flat: Sequence[Any], dims: Sequence[Any]) -> None:
    """In batched mode a 0-dim output with an int out_dim was computed over the share's rows (a loss averaged over
    them, then changed): not one row per example, and not what func gives on the whole batch. vmap's IndexError,
    saying so. (A mean loss returned as torch gave it is over the whole batch: :mod:`.losses`.)"""
    for i, (v, d) in enumerate(zip(flat, dims)):
        if d is not None and isinstance(v, torch.Tensor) and v.dim() == 0:
            raise IndexError(
                f"{opts.call}: mode='batched': output {i} is a scalar (out_dim={d}): Dimension out of range for a "
                f"per-example output. func computed it over its share's rows, which is not what it gives on the "
                f"whole batch, at any group size. A loss that F.cross_entropy, nll_loss, mse_loss, l1_loss or "
                f"binary_cross_entropy(_with_logits) averages (reduction='mean'), returned as it is (say a model's "
                f"labels= loss), is taken over the whole batch; for any other, return per-example values and reduce "
                f"them after the call: e.g. the logits, then model.loss_function(logits, labels, ...) or "
                f"cross_entropy on the gathered logits."
            )


def _check_rows(opts: Options, flat: Sequence[Any], layout: OutLayout, rows: int) -> None:
    for i, (v, leaf) in enumerate(zip(flat, layout.leaves)):
        if leaf.kind == BATCHED:
            check_rows(opts, i, v, leaf.out_dim, rows)


def _walks(opts: Options, flat: List[Any], layout: OutLayout, start: int, link: Link) -> bool:
    """Whether gradients cross ranks, so that the outputs' graph is walked for closure-captured tensors
    (:mod:`~colossalai_cmap.engine.closures`); a replicated output that is itself one gets a node of this call."""
    if not (link.wired and opts.differentiable and torch.is_grad_enabled() and any(requires_grad(v) for v in flat)):
        return False
    if faults.ACTIVE:
        faults.check("record", link.group)
    for i, (v, leaf) in enumerate(zip(flat, layout.leaves)):
        # A replicated output that is itself a closure-captured tensor needs a node of this call to hook.
        if leaf.kind == REPLICATED and requires_grad(v) and (v.grad_fn is None or sequence_nr(v.grad_fn) < start):
            flat[i] = v.view_as(v)
    return True


def _versions(opts: Options, shares: Shares, leaves: Sequence[Any]) -> Optional[List[int]]:
    if opts.src is not None:
        return None
    return [version_counter(leaves[i]) if views.plain(leaves[i]) else -1 for i in shares.mapped]


def _keep_changes(shares: Shares, leaves: Sequence[Any], given: Sequence[Any], versions: List[int]) -> None:
    """func changed in place the rows it was given joined to stand-ins (a copy): into the caller's rows with them."""
    for i, before in zip(shares.mapped, versions):
        if before >= 0 and version_counter(given[i]) != before:
            d = shares.dims[i]
            with torch.no_grad():
                leaves[i].narrow(d, shares.offset, shares.rows).copy_(given[i].narrow(d, 0, shares.rows))


def _mutated(versions: Optional[List[int]], leaves: Sequence[Any], shares: Shares) -> int:
    if versions is None:
        return 0
    mask = 0
    for k, (i, before) in enumerate(zip(shares.mapped, versions)):
        if before >= 0 and version_counter(leaves[i]) != before:
            mask |= 1 << k
    return mask
