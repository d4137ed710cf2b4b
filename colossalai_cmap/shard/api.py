"""The public ``shard_map`` and ``P``: a thin function with the contract, then shard_map's kind of map call, the
steps the engine's eager driver runs (:func:`~colossalai_cmap.engine.driver.run_eager`): the mesh, the specs, the
blocks, ``f`` with its frames and types, the exit (:mod:`.conclude`) and the assembly (:mod:`.blocks`)."""

import contextlib
import dataclasses
import functools
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..axis import vma
from ..axis.frame import AxisFrame, axis_scope
from ..axis.lowering import index_table
from ..axis.modes import RANK
from ..digests import digest
from ..engine import closures
from ..engine.driver import EagerKind, eager_fallbacks, run_compiled, run_eager
from ..engine.module_params import reaches_trainable
from ..engine.part import walk_and_guard
from ..engine.records import Failed
from ..errors import CmapError
from ..integration.groups import collective_device
from ..nesting import gradients_tracked, nested_in_split, splitting
from ..torch_internals import current_level, tree_flatten, tree_map, tree_unflatten
from ..wire import comm, rounds
from ..wire.comm import default_timeout
from ..wire.exchange import CallTag, SplitSpec, split
from ..wire.link import Link, link_for
from ..wire.roles import EVEN, KEEP, Role, Rows, is_rows
from . import dtensor
from .blocks import Copies, Tiles, assemble, assemble_local, block_lengths, cut, cut_local
from .compiled import REASONS, TENSOR, Traced
from .conclude import Carried, Outcome, conclude
from .mesh import Mesh, MeshJoints, MeshView, manual_ranks, resolve_mesh, running
from .specs import Leaf, P, Placement, broadcast_specs, check_spec, placement

__all__ = ["shard_map", "P", "Mesh", "ShardMapped"]


def shard_map(
    f: Optional[Callable] = None,
    mesh: Any = None,
    in_specs: Any = None,
    out_specs: Any = None,
    *,
    check_vma: Optional[bool] = None,
    check_rep: Optional[bool] = None,
    axis_names: Optional[Any] = None,
    local: bool = False,
    out_dtensor: Optional[bool] = None,
    timeout: Optional[float] = None,
) -> Any:
    """jax's ``shard_map`` for PyTorch: ``f`` runs once per rank of ``mesh``, on this rank's blocks.

    ``shard_map(f, mesh, in_specs, out_specs)(*args)`` cuts each global argument into blocks as its partition spec
    says (``P``), runs ``f`` on this rank's blocks, plain tensors (not batched, not under vmap), and assembles the
    global outputs as ``out_specs`` says, on every rank. Inside ``f``, ``psum``, ``pmean``, ``pmax``, ``pmin``,
    ``all_gather``, ``psum_scatter``, ``all_to_all``, ``ppermute``, ``axis_index`` and ``axis_size`` work over the
    mesh's axis names with jax.lax's signatures: an axis's size is the mesh dim, ``axis_index`` this rank's
    coordinate. Where ``cmap`` is ``jax.pmap`` (``f`` sees one example), this is ``jax.shard_map`` (``f`` sees a
    block).

    Args:
        f: the per-block function. Omit it to use ``shard_map`` as a decorator: ``@partial(shard_map, mesh=...)``
            or ``@shard_map(mesh=..., in_specs=..., out_specs=...)``.
        mesh: a torch ``DeviceMesh`` with ``mesh_dim_names``, ``colossalai_cmap.Mesh(ProcessGroupMesh, names)``, or
            a colossalai ``Booster``/plugin with a mesh (HybridParallelPlugin: axes "dp", "pp", "tp", "sp"). A mesh
            may span part of the world: ranks off it return None without running ``f``.
        in_specs: a pytree prefix of the positional arguments tuple, with ``P`` leaves (a bare ``P`` for all). Each
            entry of a ``P`` is None, an axis name, or a tuple of names (the first major); mesh axes a spec leaves
            out are replicated. Dims need not divide by their axes' size: blocks are ``torch.tensor_split`` blocks
            (jax requires division). A DTensor argument is this rank's block already: its spec is its placements'
            (``Shard(d)`` on mesh dim ``"x"`` puts ``"x"`` at entry ``d``, ``Replicate()`` names nothing), taken
            where ``in_specs`` is None or has a None leaf for it, as jax infers ``in_specs`` from explicit
            shardings; its mesh must be this one.
        out_specs: a pytree prefix of ``f``'s output. Along a mesh axis a spec leaves out, the output must be
            invariant (with ``check_vma``, checked from the types: see below); without ``check_vma`` it is taken
            from the rank at coordinate 0 of that axis, and each rank along it gets an even share of its cotangent
            in backward (jax's).
        check_vma: jax's varying-axis types (default True): every tensor inside ``f`` carries the set of mesh axes
            it varies over (its block's in_specs axes; none for closures and constants; collectives change it,
            other ops join their inputs'), an out_specs entry that leaves out an axis its output varies over raises
            ``CmapError`` (also a ``ValueError``) on every rank, and collectives transpose as jax's do with
            ``check_vma=True``: ``psum`` of a varying value to nothing, ``pcast`` to ``psum``,
            ``all_gather_invariant`` to a slice. False: no types, and jax's ``check_vma=False`` transposes.
        check_rep: the old name of ``check_vma``.
        axis_names: the manual axes (jax's partial manual; default: every mesh axis). Along the others ``f`` sees
            whole values, computed alike on their ranks: specs may not name them, and a collective over one raises
            ``NameError`` (jax's "unbound axis name").
        local: the per-device style: the arguments are this rank's blocks already and the outputs stay blocks, so
            nothing is cut or assembled (the specs are still checked). The gradients are the global call's: a
            block's gradient is summed over the axes its spec leaves out, an output replicated over an axis counts
            once, and tensors ``f`` closes over are replicated values whose gradient is summed over the mesh.
        out_dtensor: return each tensor output as a DTensor on the mesh, placed by its out_specs entry (this rank's
            block, not assembled), as ``local_map``'s ``out_placements`` do. Default: when an argument is a DTensor.
            Needs a torch ``DeviceMesh`` (the mesh, or the DTensor arguments').
        timeout: seconds each collective may wait before every rank raises ``CmapError`` (default as ``cmap``'s).

    Returns:
        A function of the global arguments that returns the global outputs on every rank of the mesh.

    Gradients are jax's: ``loss(outputs).backward()`` on every rank (the same loss) leaves each global input's
    ``.grad`` equal to ``jax.grad`` of the same shard_map function, on every rank, and so for tensors ``f`` closes
    over (module parameters included). ``all_gather`` transposes to ``psum_scatter``, ``all_to_all`` to itself,
    ``ppermute`` to its inverse; with ``check_vma=False`` ``psum`` transposes to ``psum`` and the blocks of
    replicated inputs' gradients are summed over the axes they are replicated on, as jax's.

    Raises:
        CmapError: on every rank of the mesh, when ``f`` raised (or a spec did not fit an argument) on any rank;
            when the error was the same built-in type everywhere, it is also that type (``ValueError``, ...).

    Example:
        >>> mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "y"))
        >>> @partial(shard_map, mesh=mesh, in_specs=(P("x", "y"), P("y", None)), out_specs=P("x", None))
        ... def matmul(a_block, b_block):
        ...     return cm.psum(a_block @ b_block, "y")
        >>> c = matmul(a, b)  # a @ b, on every rank
    """
    options = dict(mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma, check_rep=check_rep)
    options.update(axis_names=axis_names, local=local, out_dtensor=out_dtensor, timeout=timeout)
    if f is None:
        return functools.partial(shard_map, **options)
    for name in ("mesh", "out_specs"):
        if options[name] is None:
            raise TypeError(f"shard_map() missing required argument {name!r}")
    check = bool(True if check_vma is None and check_rep is None else check_rep if check_vma is None else check_vma)
    timeout = timeout if timeout is not None else default_timeout()
    manual = None if axis_names is None else tuple(axis_names)
    return ShardMapped(f, Sharding(mesh, in_specs, out_specs, check, local, timeout, manual, out_dtensor))


class Sharding(NamedTuple):
    """The options of one ``shard_map`` (see :func:`shard_map`)."""

    mesh: Any
    in_specs: Any
    out_specs: Any
    check_vma: bool
    local: bool
    timeout: Optional[float]
    axis_names: Optional[Tuple[str, ...]] = None
    out_dtensor: Optional[bool] = None


class Where(NamedTuple):
    """Where a call communicates: the mesh as this rank sees it, each axis's link, the whole mesh's link, and the
    manual axes (the ones ``f``'s collectives and specs may name)."""

    view: MeshView
    links: Dict[str, Link]
    whole: Link
    manual: Tuple[str, ...]


class ShardMapped:
    """``f`` under ``shard_map``: call it with the global arguments (see :func:`shard_map`)."""

    def __init__(self, f: Callable, opts: Sharding) -> None:
        self.f, self.opts = f, opts
        self.name = getattr(f, "__name__", type(f).__name__)
        self.call = f"shard_map({self.name})"
        functools.update_wrapper(self, f, updated=())
        call, mesh = self.call, opts.mesh

        # Run when dynamo traces a call (it can read neither closure cells nor the mesh's cache), their results
        # constants of that graph, on every rank alike. Dynamo also stores each result among the globals of the
        # compiled function's module, by the function's name: the names are the package's own.
        def cmap_shard_map_mesh_view() -> MeshView:
            return resolve_mesh(call, mesh)

        def cmap_shard_map_captures_trainable() -> bool:
            return reaches_trainable(f)

        def cmap_shard_map_out_specs_failure(skeleton: Any, *tensors: torch.Tensor) -> Optional[str]:
            return _out_specs_failure(self, skeleton, tensors)

        self.view = torch.compiler.assume_constant_result(cmap_shard_map_mesh_view)
        self.captures_trainable = torch.compiler.assume_constant_result(cmap_shard_map_captures_trainable)
        self.out_specs_failure = torch.compiler.assume_constant_result(cmap_shard_map_out_specs_failure)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # the call lowered to traceable ops: one graph (shard/compiled.py)
            return run_compiled(TRACED, self, args, kwargs)
        return _run(self, args, kwargs)


def _out_specs_failure(site: ShardMapped, skeleton: Any, tensors: Sequence[torch.Tensor]) -> Optional[str]:
    """``check_vma``'s error for the call whose arguments are ``skeleton`` (``(args, kwargs)`` with
    :data:`~.compiled.TENSOR` for each tensor) and ``tensors``, or None: the eager call, without gradients, run while
    dynamo traces the compiled one (the types cannot be tracked inside the graph), on every rank alike."""
    flat, tree = tree_flatten(skeleton)
    given = iter([t.detach().clone() for t in tensors])  # f may change its blocks in place
    args, kwargs = tree_unflatten([next(given) if isinstance(v, str) and v == TENSOR else v for v in flat], tree)
    accelerators = sorted({t.device for t in tensors if t.device.type != "cpu"}, key=str)
    kind = accelerators[0].type if accelerators else "cuda"
    try:  # f's random draws here are not the compiled call's
        with torch.no_grad(), torch.random.fork_rng([d.index for d in accelerators], device_type=kind):
            _run(site, args, kwargs)
    except ValueError as exc:  # a CmapError that is also a ValueError, on every rank
        if "out_specs which require replication" in str(exc):
            return str(exc)
    except Exception:  # any other error is the compiled call's own, when it runs
        pass
    return None


# ------------------------------------------------------------------------------------------------ one call
class Arguments(NamedTuple):
    """The call's global arguments, as given."""

    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]


class Ran(NamedTuple):
    """What this rank's part brings to the exit: its :class:`Outcome`, its outputs, their placements (typed, where
    the types say a block is the value), and the mesh DTensor outputs are placed on (None: none)."""

    outcome: Outcome
    out: Any
    places: List[Placement]
    out_mesh: Any


class _Eager(EagerKind):
    """shard_map's steps, as the engine's eager driver runs them: the mesh, the specs, the blocks, ``f`` typed (or
    with the closure interceptor), the exit over every axis, then the assembly."""

    def communicate(self, site: ShardMapped, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[Where]:
        """The mesh as this rank sees it (None off the mesh), each axis's link and the whole mesh's."""
        opts = site.opts
        view = resolve_mesh(site.call, opts.mesh)
        if not view.member:
            return None
        comm.check_usable(view.whole, site.call)
        if nested_in_split(view.whole.ranks):
            raise CmapError(
                f"{site.call}: called inside a cmap that splits its batch over ranks of this mesh, so the ranks hold "
                f"different examples, not the same global arguments. Map the cmap over another mesh axis (group=...)."
            )
        leaves, tree = tree_flatten(args)
        device = collective_device(view.whole, leaves + tree_flatten(kwargs)[0])
        whole = link_for(view.whole, device, site.call, opts.timeout)
        links = {n: link_for(view.axes[n], device, site.call, opts.timeout) for n in view.names}
        return Where(view, links, whole, _manual(site, view))

    def inputs(self, site: ShardMapped, where: Where, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Arguments:
        return Arguments(args, kwargs)  # every rank holds the global arguments: cut inside this rank's part

    def enter(self, site: ShardMapped, where: Where, given: Arguments) -> Tuple[dtensor.Unwrapped, Dict[str, Any]]:
        """DTensor arguments checked against the mesh and made local tensors, before the call's sequence starts
        (their nodes are outside ``f``)."""
        opts = site.opts
        found = dtensor.unwrap_inputs(site.call, given.args, opts.in_specs, where.view, opts.mesh, opts.out_dtensor)
        return found, given.kwargs

    def run(self, site: ShardMapped, where: Where, entered: Any, tag: CallTag, start: int) -> Ran:
        axes = [where.links[n] for n in where.view.names]
        with rounds.within_mesh(where.whole, axes):  # a round on part of the mesh is announced: the exit must know
            return _run_f(site, where, *entered, tag, start)

    def failed(self, site: ShardMapped, where: Where, exc: BaseException) -> Failed:
        return Failed(where.view.whole.failure(exc), exc)

    def conclude(self, site: ShardMapped, where: Where, given: Arguments, ran: Any) -> Any:
        """The exit over every axis, then the outputs assembled (or left as blocks, or placed as DTensors)."""
        outcome = Outcome(ran) if isinstance(ran, Failed) else ran.outcome
        carried = None if isinstance(ran, Failed) else _carried(site, where, ran)
        table, gathered, rows = conclude(site.call, where.view, where.links, where.whole, outcome, carried)
        flat, out_tree = tree_flatten(ran.out)
        what = f"the outputs of {site.call}"
        if gathered is not None:  # the exit's round gathered the outputs that needed it
            for i, value, tiles, copies in zip(carried.leaves, gathered, carried.tiles, carried.copies):
                if tiles is not None:
                    flat[i] = tiles.assemble(value)
                elif copies is not None:
                    flat[i] = copies.assemble(flat[i], value, rows, links=where.links, view=where.view, what=what)
                else:
                    flat[i] = value
        elif site.opts.local or ran.out_mesh is not None:  # blocks: left as they are, or placed as DTensors
            flat = assemble_local(flat, ran.places, where.links, what)
            if ran.out_mesh is not None:
                flat = dtensor.wrap_outputs(site.call, flat, ran.places, ran.out_mesh, where.view, table)
        else:
            flat = assemble(flat, ran.places, where.links, where.view, table, what)
        return tree_unflatten(flat, out_tree)


EAGER = _Eager()


def _carried(site: ShardMapped, where: Where, ran: Ran) -> Optional[Carried]:
    """The outputs the exit can gather itself: every output whose assembly needs communication, where each one's is
    a single gather over the whole mesh's group: split along one dim over every mesh axis, whose rows the group's
    rank order holds in the spec's order; split over every mesh axis otherwise (:class:`~.blocks.Tiles`: a flat run
    per rank, rearranged after), where no other output is split; replicated over every axis (the value at
    whole-group rank 0); or, on a mesh of two axes outside function transforms, split over one axis and equal along
    the other (:class:`~.blocks.Copies`: sent by the ranks at coordinate 0 of the other), where every split output is
    of that kind. The rounds are on the data's own group (CPU data on gloo). Every rank decides alike from its specs
    and its outputs' structure (which the exit's round checks before any data moves)."""
    view = where.view
    if site.opts.local or ran.out_mesh is not None or not view.row_major():
        return None
    flat = tree_flatten(ran.out)[0]
    found: Dict[int, Role] = {}
    tiled: Dict[int, Tiles] = {}
    copied: Dict[int, Copies] = {}
    for i, (value, place) in enumerate(zip(flat, ran.places)):
        if not isinstance(value, torch.Tensor) or not (place.split or place.replicated):
            continue  # the block is the value: nothing to assemble
        dim = place.dim_over(view.names)
        tiles = Tiles.of(place, view, tuple(value.shape)) if dim is None else None
        copies = Copies.of(place, view) if dim is None and tiles is None and current_level() is None else None
        if dim is not None:
            found[i] = Rows(dim, None)
        elif tiles is not None:
            found[i], tiled[i] = Rows(0, None), tiles
        elif copies is not None:
            found[i], copied[i] = Rows(copies.dim, None), copies
        elif place.replicated == view.names and not place.split:
            found[i] = EVEN
        else:
            return None
    rows = sum(map(is_rows, found.values()))
    if not found or (tiled and rows > 1) or (copied and (len(set(copied.values())) > 1 or len(copied) < rows)):
        return None  # one row count per rank: a tile's entries and another output's rows would make two, and so
        # would copies that send no rows beside blocks that do
    values = tuple(_sent(flat[i], tiled.get(i), copied.get(i), view) for i in found)
    leaves = tuple(found)
    return Carried(
        leaves=leaves,
        roles=tuple(found.values()),
        values=values,
        tiles=tuple(map(tiled.get, leaves)),
        copies=tuple(map(copied.get, leaves)),
        copied_rows=tuple(flat[i].shape[c.dim] for i, c in copied.items()),
    )


def _sent(value: torch.Tensor, tiles: Optional[Tiles], copies: Optional[Copies], view: MeshView) -> torch.Tensor:
    """What this rank sends of a carried output: its block (as one run, for tiles); for copies, detached (the Joins
    of :meth:`Copies.assemble` carry its gradient), and no rows off coordinate 0."""
    if tiles is not None:
        return value.reshape(-1)
    if copies is not None:
        return value.detach().narrow(copies.dim, 0, value.shape[copies.dim] if copies.sends(view) else 0)
    return value


def _run(site: ShardMapped, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """One eager call of ``site``: the engine's eager driver on shard_map's steps."""
    return run_eager(EAGER, site, args, kwargs)


def _refuse_untyped_recomputation(site: ShardMapped, flat: List[Any], tag: CallTag, start: int) -> None:
    """A reentrant checkpoint inside a typed f recomputes it in backward on detached inputs, which carry no
    varying-axis types: refused, on every rank (the exit carries the error)."""
    if gradients_tracked() and closures.recomputes(flat, tag, start):
        raise ValueError(
            f"{site.call}: torch.utils.checkpoint(..., use_reentrant=True) inside f recomputes it in backward "
            f"on detached inputs, which carry no varying-axis types; use use_reentrant=False (as jax's "
            f"checkpoint does), or check_vma=False."
        )


def _run_f(
    site: ShardMapped, where: Where, inputs: dtensor.Unwrapped, kwargs: Dict[str, Any], tag: CallTag, start: int
) -> Ran:
    """This rank's part, inside the engine's (an exception becomes a ``Failed`` outcome): check the specs, cut the
    blocks, run ``f``, read its outputs."""
    opts, view, whole = site.opts, where.view, where.whole
    args, out_mesh = inputs.args, inputs.out_mesh
    entered_local = tuple(e or opts.local for e in inputs.entered_local)
    places = _placements(site, "in", inputs.specs, args, view, where.manual)
    leaves, tree = tree_flatten(args)
    parent = vma.current() if view.within is not None else None  # a nested smap: the outer map's types hold
    # a nested smap's tensors from the outer map keep the outer map's graph: no entry node, and the guard steps
    # aside (the outer map's guard, if any, covers its backward)
    routing = tag if parent is None else None
    joints = MeshJoints(view.within or view, whole.device, whole.call, whole.timeout)
    typer = vma.Tracker({n: where.links[n] for n in where.manual}, routing, parent, joints) if opts.check_vma else None
    blocks = _cut_blocks(leaves, _typed(places, typer), where, tag, entered_local)
    intercept = closures.Interceptor(tag, start, whole) if gradients_tracked() and typer is None else None
    split_over = manual_ranks(view, where.manual)
    frames = _frames(where, joints)
    with frames, splitting(split_over), running(view, where.manual), intercept or contextlib.nullcontext():
        if typer is None:
            out = site.f(*tree_unflatten(blocks, tree), **kwargs)
        else:
            with vma.tracking(typer):
                for block, given, p in zip(blocks, leaves, places):  # a nested smap's: the outer type too
                    if isinstance(block, torch.Tensor) and p.spec.axes():
                        typer.mark(block, typer.of(given) | set(p.spec.axes()))
                out = site.f(*tree_unflatten(blocks, tree), **kwargs)
    if intercept is not None:  # a closed-over tensor returned as it is: replicated, its gradient summed too
        out = tree_map(intercept.route, out)
    if typer is not None:  # a tensor from outside f returned as it is: through the boundary too
        out = tree_map(typer.route, out)
    tag.running = False
    out_places = _placements(site, "out", opts.out_specs, out, view, where.manual)
    flat, out_tree = tree_flatten(out)
    if typer is not None:
        _check_vma(site, typer, flat, out_places, view)
        _refuse_untyped_recomputation(site, flat, tag, start)
        flat = _varied(typer, flat, out_places)
    replay = intercept.replaying if intercept is not None else None  # a recomputation in backward
    # the outputs, through the guard of this rank's backward where the graph leaves f only through its entry, and
    # the signature of the closure edges it holds otherwise (untyped: hooked; typed: nothing hooks, only found)
    flat, graph_sig = walk_and_guard(
        flat,
        tag,
        start,
        whole,
        replay=replay,
        walk=gradients_tracked(),
        hooks=typer is None,
        axes=[where.links[n] for n in view.names],
    )
    out = tree_unflatten(flat, out_tree)
    if out_mesh is not None:
        dtensor.check_outputs(site.call, flat, out_places, view)
    # assembled outputs and DTensors (their global shapes) need every rank's block lengths
    assembled = not opts.local or out_mesh is not None
    lengths = block_lengths(flat, out_places) if assembled else None
    layout = _layout(flat, out_places, assembled)
    outcome = Outcome(None, digest(layout), graph_sig, lengths=lengths, layout=layout)
    return Ran(outcome, out, _typed(out_places, typer), out_mesh)


def _manual(site: ShardMapped, view: MeshView) -> Tuple[str, ...]:
    """The manual axes, in mesh order, after checking ``axis_names`` against the mesh."""
    if site.opts.axis_names is None:
        return view.names
    unknown = [a for a in site.opts.axis_names if a not in view.names]
    if unknown:
        raise ValueError(
            f"{site.call}: axis_names={site.opts.axis_names!r} names {unknown}, not axes of the mesh ({view.describe()})."
        )
    return tuple(a for a in view.names if a in site.opts.axis_names)


def _placements(
    site: ShardMapped, kind: str, specs: Any, tree: Any, view: MeshView, manual: Sequence[str]
) -> List[Placement]:
    """Each leaf's placement: its spec from the prefix ``specs``, checked against the mesh and the value."""
    what = "the positional arguments tuple" if kind == "in" else f"{site.name}(*args)"
    out = []
    for path, value, spec in broadcast_specs(site.call, kind, specs, tree, what):
        spec = check_spec(site.call, kind, path, spec, view.names)
        auto = [a for a in spec.axes() if a not in manual]
        if auto:
            raise ValueError(
                f"{site.call}: {kind}_specs{path} is {spec!r}, which refers to mesh axis {auto[0]!r}, not one of the "
                f"manual axes axis_names={tuple(manual)}; shard_map's specs may name only manual axes (as in jax). "
                f"Add {auto[0]!r} to axis_names, or leave it out of the spec."
            )
        leaf = Leaf(site.call, kind, path, f"args{path}" if kind == "in" else f"{what}{path}")
        out.append(placement(leaf, spec, value, view.names))
    return out


def _cut_blocks(
    leaves: List[Any], places: Sequence[Placement], where: Where, tag: CallTag, local: Sequence[bool]
) -> List[Any]:
    """The global arguments cut into this rank's blocks; the ``local`` ones (``local=True``, DTensors' local
    tensors) are blocks as given, entered through the call's entry (no communication either way). A local block's
    gradient is this rank's block of the global gradient: its own along the split axes, summed over the axes its
    spec leaves out."""
    out = list(leaves)
    whole = [i for i in range(len(leaves)) if not local[i]]
    if whole:
        for i, v in zip(
            whole,
            cut([leaves[i] for i in whole], [places[i] for i in whole], where.links, where.view, tag, where.whole),
        ):
            out[i] = v
    mine = [i for i in range(len(leaves)) if local[i]]
    if not mine:
        return out
    entered = cut_local([leaves[i] for i in mine], [places[i] for i in mine], where.links, tag)
    picked = [i for i, v in zip(mine, entered) if isinstance(v, torch.Tensor)]
    for i, v in zip(mine, entered):
        out[i] = v
    spec = SplitSpec(where.whole, (KEEP,) * len(picked), tag)
    for i, v in zip(picked, split(spec, [out[i] for i in picked]) if picked else ()):
        out[i] = v
    return out


@contextlib.contextmanager
def _frames(where: Where, joints: MeshJoints) -> Iterator[None]:
    """Every manual mesh axis as a named axis of rank mode: this rank is one member of each (and ``joints`` gives
    the group of several taken together)."""
    view = where.view
    with contextlib.ExitStack() as stack:
        for n in where.manual:
            size, coord = view.sizes[n], view.coords[n]
            index = index_table((coord,), where.whole.device)[0].clone()  # a copy made on the device, not the host
            frame = AxisFrame(
                link=where.links[n], size=size, offset=coord, sizes=(1,) * size, mode=RANK, index=index, mesh=joints
            )
            stack.enter_context(axis_scope(n, frame))
        yield


def _typed(places: List[Placement], typer: Optional[vma.Tracker]) -> List[Placement]:
    """With types, a block is its value itself along the axes its spec leaves out (it is invariant there): no
    ``Split`` in, no ``Join`` out, and no communication in their transposes."""
    if typer is None:
        return places
    return [dataclasses.replace(p, replicated=()) for p in places]


def _varied(typer: vma.Tracker, flat: List[Any], places: Sequence[Placement]) -> List[Any]:
    """Each output cast to varying over the axes its out_specs entry splits it along but it is invariant over (jax
    inserts that pcast): each rank's block is its own output, so its cotangent is per rank, summed in backward."""
    out = []
    for v, p in zip(flat, places):
        missing = set(p.spec.axes()) - typer.of(v) if isinstance(v, torch.Tensor) else set()
        out.append(typer.vary(v, missing) if missing else v)
    return out


def _check_vma(
    site: ShardMapped, typer: vma.Tracker, flat: Sequence[Any], places: Sequence[Placement], view: MeshView
) -> None:
    """jax's check: an output may vary only over the axes its out_specs entry names. Decided from the types, so it
    is the same on every rank: each raises, and the exit makes it one ``CmapError`` (a ``ValueError``) everywhere."""
    found = []
    for v, p in zip(flat, places):
        varying = typer.of(v) & set(p.replicated) if isinstance(v, torch.Tensor) else set()
        if varying:
            named = [a for a in view.names if a in p.spec.axes()]
            found.append(
                f"out_specs{p.path} is {p.spec!r} which implies that the corresponding output value is only varying "
                f"across mesh axes {_axes(named)} and not {_axes(a for a in view.names if a in varying)}, but it "
                f"was inferred to be possibly varying over {_axes(a for a in view.names if a in typer.of(v))}"
            )
    if found:
        shape = tuple(view.sizes.values())
        raise ValueError(
            f"{site.call}: shard_map applied to the function {site.name!r} was given out_specs which require "
            f"replication which can't be statically inferred given the mesh:\n\nThe mesh given has shape {shape} "
            f"with corresponding axis names {view.names}.\n\n" + "\n\n".join(found) + "\n\nCheck if these output "
            "values are meant to be replicated over those mesh axes. If not, consider revising the corresponding "
            "out_specs entries. If so, consider disabling the check by passing the check_vma=False argument to "
            "shard_map. A value made by all_gather, psum_scatter, all_to_all, ppermute or axis_index varies, and so "
            "does anything computed from it (zeros_like and full_like included); psum, pmax, pmin or "
            "all_gather_invariant make a value invariant over their axes."
        )


# shard_map's kind inside torch.compile: the same checks, and the eager call out of the graph, per reason.
TRACED = Traced(eager_fallbacks(_run, "shard_map", REASONS), manual=_manual, placements=_placements)


def _axes(names: Any) -> str:
    return "{" + ", ".join(names) + "}"


def _layout(flat: Sequence[Any], places: Sequence[Placement], assembled: bool) -> Tuple[Any, ...]:
    """What every rank's outputs must agree on, leaf by leaf: the path, the spec, and a tensor's dtype and sizes, its
    split dims' left out (blocks may be uneven there), or another leaf's type. Blocks that stay as they are
    (``local=True``) agree on their number of dims only: nothing joins them."""
    return tuple((p.path, tuple(p.spec), _leaf_layout(v, p, assembled)) for v, p in zip(flat, places))


def _leaf_layout(value: Any, place: Placement, assembled: bool) -> Any:
    if not isinstance(value, torch.Tensor):
        return type(value).__name__
    if not assembled:
        return value.dtype, value.dim()
    split = {d for d, _ in place.split}
    return value.dtype, tuple(None if d in split else n for d, n in enumerate(value.shape))
