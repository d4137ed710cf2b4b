"""A ``shard_map`` call inside ``torch.compile``: the call lowered to plain traceable ops and functional collectives,
so that dynamo traces ``torch.compile(shard_map(f, ...), fullgraph=True)`` into one graph.

shard_map's steps as the engine's compiled driver runs them (:class:`Traced`;
:func:`~colossalai_cmap.engine.driver.run_compiled`), with the eager call's specs, blocks and transposes but no round
of its own:

1. Refuse what needs the eager orchestration (:func:`unsupported`): a map nested in another's ``f``, uneven blocks
   (the exit's round learns other ranks' block lengths; jax requires even ones), tensors ``f`` reads from its
   closures or module parameters that require grad (their gradient is summed over the mesh by interception), and
   with ``check_vma=True`` an ``out_specs`` entry the trace-time check finds wrong (below).
2. The mesh, resolved once, out of the graph (a constant of it), and the specs checked as eagerly.
3. Cut: each global argument's block, a traced ``Split`` per mesh axis (:mod:`~colossalai_cmap.wire.traced`) where
   it needs a gradient (rows gathered in backward, replicated axes' gradients summed), else a ``narrow``.
4. Run ``f`` with a frame per manual axis (rank mode), so the collectives inside it lower to functional
   collectives (:mod:`~colossalai_cmap.axis.lowering`).
5. Assemble: each block a traced ``Join`` per axis: gathered along the split axes; along an axis its spec leaves out,
   with ``check_vma=False`` the value at coordinate 0 (a broadcast, as eagerly), with ``check_vma=True`` this
   rank's own (the types say it is the same on every rank, so nothing moves); backward gives the cotangent to
   coordinate 0 of that axis, zeros elsewhere, as eager ``check_vma=False``.

Varying-axis types are not tracked inside the graph: their tracker is a ``TorchFunctionMode`` that stores types on
tensor objects and reads autograd nodes, which dynamo cannot trace. So ``check_vma=True`` compiles with
``check_vma=False``'s transposes (the same values and gradients; backward may all-reduce where jax's types would
not). Its check of ``out_specs`` runs while dynamo traces instead (:func:`_checked`): the eager call, without
gradients, on copies of the arguments and a forked random stream, out of the graph (a
``torch.compiler.assume_constant_result`` function of the call site, so every rank runs it at the same point); a
wrong entry makes the call run eagerly, where it raises jax's error on every rank. No status round either: an error
on one rank is not raised on the others (they wait in the next collective until the group's timeout), as with a
compiled cmap.
"""

from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..axis import frame as frames
from ..axis.frame import AxisFrame
from ..axis.modes import RANK
from ..engine.driver import TracedEntry, TracedKind
from ..torch_internals import tree_flatten, tree_map, tree_unflatten
from ..wire.group import Group
from ..wire.link import Link
from ..wire.roles import COPY, FIRST, ONCE, SAME, Role, first_row, is_rows
from ..wire.traced import traced_join, traced_split
from .mesh import MeshView, manual_ranks
from .specs import Placement


class Where(NamedTuple):
    """Where a compiled call runs: the mesh as this rank sees it, the manual axes and the arguments' placements."""

    view: MeshView
    manual: Tuple[str, ...]
    places: List[Placement]


class Traced(TracedKind):
    """shard_map's steps inside ``torch.compile``, as the engine's compiled driver runs them. It takes from the
    public call (``shard.api``) the manual axes and the leaves' placements, checked as eagerly, and the eager call
    out of the graph, per reason of :func:`unsupported`."""

    def __init__(
        self,
        eager: Dict[str, Callable[..., Any]],
        manual: Callable[[Any, MeshView], Tuple[str, ...]],
        placements: Callable[..., List[Placement]],
    ) -> None:
        super().__init__(eager)
        self.manual, self.placements = manual, placements

    def communicate(self, site: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[Where]:
        """The mesh, resolved out of the graph (a constant of it), None off it; the specs checked as eagerly."""
        view = site.view()
        if not view.member:
            return None
        manual = self.manual(site, view)
        return Where(view, manual, self.placements(site, "in", site.opts.in_specs, args, view, manual))

    def unsupported(self, site: Any, where: Where, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[str]:
        reason = unsupported(site, where.view, tree_flatten(args)[0], where.places)
        if reason is None and site.opts.check_vma:
            reason = _checked(site, args, kwargs)
        return reason

    def enter(self, site: Any, where: Where, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> TracedEntry:
        """Each argument's block (or a local one as given), the keywords whole, and a frame per manual axis."""
        opts, view = site.opts, where.view
        leaves, tree = tree_flatten(args)
        grads = torch.is_grad_enabled()
        if opts.local:
            blocks = [_local_block(v, p, view, grads) for v, p in zip(leaves, where.places)]
        else:
            blocks = [_cut(v, p, view, grads) for v, p in zip(leaves, where.places)]
        kwargs = _whole_kwargs(kwargs, view, grads)
        tensors = [v for v in leaves if isinstance(v, torch.Tensor)]
        device = tensors[0].device if tensors else torch.device("cpu")
        opened = []
        for n in where.manual:
            coord, size = view.coords[n], view.sizes[n]
            link = Link(view.axes[n], device, site.call, opts.timeout)
            index = torch.tensor(coord, dtype=torch.int64, device=device)  # a constant of the graph
            opened.append((n, AxisFrame(link=link, size=size, offset=coord, sizes=(1,) * size, mode=RANK, index=index)))
        # a cmap nested in f runs eagerly and, seeing the marker, as plain torch.vmap over this rank's examples
        return TracedEntry((tree_unflatten(blocks, tree), kwargs), tuple(opened), manual_ranks(view, where.manual))

    def run(self, site: Any, where: Where, entered: TracedEntry) -> Any:
        args, kwargs = entered.inputs
        return site.f(*args, **kwargs)

    def conclude(self, site: Any, where: Where, entered: TracedEntry, out: Any) -> Any:
        """Every output assembled (or with ``local=True`` left a block) as traced ``Join``s."""
        opts, view = site.opts, where.view
        out_places = self.placements(site, "out", opts.out_specs, out, view, where.manual)
        flat, out_tree = tree_flatten(out)
        if opts.local:
            flat = [_local_output(v, p, view) for v, p in zip(flat, out_places)]
        else:
            flat = [_assemble(v, p, view, opts.check_vma) for v, p in zip(flat, out_places)]
        return tree_unflatten(flat, out_tree)


def unsupported(site: Any, view: MeshView, leaves: Sequence[Any], places: Sequence[Placement]) -> Optional[str]:
    """What of this call only the eager orchestration does (a key of :data:`REASONS`), or None."""
    if frames.active() or view.within is not None:  # its ops would run under the outer map's frames and types
        return "nested"
    if not site.opts.local:
        for v, p in zip(leaves, places):
            if isinstance(v, torch.Tensor) and any(v.shape[d] % _blocks(axes, view) for d, axes in p.split):
                return "uneven"
    if torch.is_grad_enabled() and site.captures_trainable():
        return "captured"
    return None


# What stands for a tensor in the structure of the arguments that the trace-time check is given (a constant).
TENSOR = "<colossalai_cmap: a tensor>"
_CONSTANTS = (int, float, bool, str, type(None), torch.dtype, torch.device)


def _checked(site: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[str]:
    """``check_vma``'s check of ``out_specs``, by the eager call run while dynamo traces (out of the graph, without
    gradients): "out_specs" where it fails (the eager call then raises jax's error on every rank), else None. Skipped
    when an argument is neither a tensor nor a constant (a custom pytree node, an object): dynamo cannot pass it."""
    leaves, _ = tree_flatten((args, kwargs))
    if not all(isinstance(v, (torch.Tensor,) + _CONSTANTS) for v in leaves):
        return None
    skeleton = tree_map(lambda v: TENSOR if isinstance(v, torch.Tensor) else v, (args, kwargs))
    tensors = [v for v in leaves if isinstance(v, torch.Tensor)]
    return None if site.out_specs_failure(skeleton, *tensors) is None else "out_specs"


REASONS = {
    "out_specs": (
        "check_vma's check of out_specs failed when dynamo traced the call (an entry leaves out an axis its output "
        "varies over; the eager call raises jax's error naming it): fix that entry, or pass check_vma=False"
    ),
    "nested": "a shard_map inside the f of another shard_map, smap or cmap runs over that call's frames",
    "uneven": (
        "an in_specs entry splits a dim its mesh axes do not divide, and the exit learns the other ranks' uneven "
        "block lengths in its status round; pad the dim to a multiple of the axes' size (jax requires it)"
    ),
    "captured": (
        "f reads a tensor that requires grad from a closure or a module parameter, whose gradient is summed over "
        "the mesh; pass it as an argument with an in_specs entry (P() for a replicated weight)"
    ),
}


def _blocks(axes: Sequence[str], view: MeshView) -> int:
    size = 1
    for a in axes:
        size *= view.sizes[a]
    return size


def _on(view: MeshView, axis: str) -> Group:
    return view.axes[axis]


def _split(v: torch.Tensor, role: Role, group: Group, grads: bool) -> torch.Tensor:
    """One Split step: through the traced Split where ``v`` needs a gradient (its transpose, the Join, in
    backward), else plain (a ``narrow`` of this rank's rows, or the value itself)."""
    if grads and v.requires_grad and group.size > 1:
        return traced_split(v, role, group.pg, group.rank)
    return v.narrow(role.dim, first_row(role.sizes, group.rank), role.sizes[group.rank]) if is_rows(role) else v


def _cut(v: Any, p: Placement, view: MeshView, grads: bool) -> Any:
    """A global value's block on this rank: the eager cut's steps (split axes major first, then the replicated)."""
    if not isinstance(v, torch.Tensor):
        return v
    for step in p.cut_steps(v.shape, view.sizes, view.coords):
        v = _split(v, step.role, _on(view, step.axis), grads)
    return v


def _local_block(v: Any, p: Placement, view: MeshView, grads: bool) -> Any:
    """``local=True``: the block as given, its gradient summed over the axes its spec leaves out."""
    if not isinstance(v, torch.Tensor):
        return v
    for a in p.replicated:
        v = _split(v, COPY, _on(view, a), grads)
    return v


def _whole_kwargs(kwargs: Dict[str, Any], view: MeshView, grads: bool) -> Dict[str, Any]:
    """Keyword tensors are passed whole, as replicated values: those that need a gradient get it summed over the
    mesh, as a closure's eagerly."""
    if not kwargs or not grads:
        return kwargs
    leaves, spec = tree_flatten(kwargs)
    return tree_unflatten(
        [_split(v, COPY, view.whole, grads) if isinstance(v, torch.Tensor) else v for v in leaves], spec
    )


def _assemble(v: Any, p: Placement, view: MeshView, check_vma: bool) -> Any:
    """A block's global value on every rank: the eager assembly's steps, every rank's blocks taken as one length (the
    calls with uneven input blocks run eagerly)."""
    if not isinstance(v, torch.Tensor):
        return v
    length = v.shape
    for step in p.assemble_steps(view.sizes, view.coords, lambda coords, d: length[d]):
        group = _on(view, step.axis)
        if group.size == 1:
            continue
        role = SAME if step.role == FIRST and check_vma else step.role
        v = traced_join(v, role, group.pg, group.rank)
    return v


def _local_output(v: Any, p: Placement, view: MeshView) -> Any:
    """``local=True``: the output block as it is; along an axis its spec leaves out, each rank's cotangent counts
    over the axis size (a Join ONCE), so the ranks' copies of one replicated value count once."""
    if not isinstance(v, torch.Tensor):
        return v
    for a in p.replicated:
        group = _on(view, a)
        if group.size > 1:
            v = traced_join(v, ONCE, group.pg, group.rank)
    return v
