"""The public ``shard_map`` and ``P``: a thin function with the contract, then the pipeline of one call."""

import contextlib
import functools
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..axis.frame import AxisFrame, axis_scope
from ..axis.lowering import index_table
from ..call import closures
from ..digests import digest
from ..errors import CmapError
from ..integration.groups import collective_device
from ..nesting import CONTROL_FLOW, nested_in_split, splitting, tracking
from ..wire import comm
from ..wire.comm import default_timeout
from ..wire.exchange import CallTag, SplitSpec
from ..wire.primitives import split
from ..wire.protocol import Link, link_for
from ..wire.roles import KEEP
from .blocks import assemble, block_lengths, cut
from .exit import Outcome, conclude
from .mesh import Mesh, MeshView, resolve_mesh
from .specs import Leaf, P, Placement, broadcast_specs, check_spec, placement

__all__ = ["shard_map", "P", "Mesh", "ShardMapped"]


def shard_map(
    f: Optional[Callable] = None,
    mesh: Any = None,
    in_specs: Any = None,
    out_specs: Any = None,
    *,
    check_rep: bool = False,
    check_vma: Optional[bool] = None,
    local: bool = False,
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
            (jax requires division).
        out_specs: a pytree prefix of ``f``'s output. Along a mesh axis a spec leaves out, the output is taken from
            the rank at coordinate 0 of that axis (``f`` should return the same value on every rank along it).
        check_rep: also check, at the exit, that the outputs declared replicated over an axis are equal across it
            (a checksum per axis, like jax's ``check_rep``/``check_vma`` but at run time). ``check_vma`` is an alias.
        local: the per-device style: the arguments are this rank's blocks already and the outputs stay blocks, so
            nothing is cut or assembled (the specs are still checked). Tensors ``f`` closes over are still
            replicated values whose gradient is summed over the mesh.
        timeout: seconds each collective may wait before every rank raises ``CmapError`` (default as ``cmap``'s).

    Returns:
        A function of the global arguments that returns the global outputs on every rank of the mesh.

    Gradients are jax's: ``loss(outputs).backward()`` on every rank (the same loss) leaves each global input's
    ``.grad`` equal to ``jax.grad`` of the same shard_map function, on every rank, and so for tensors ``f`` closes
    over (module parameters included). Collectives transpose as in shard_map with ``check_vma=False``: ``psum`` to
    ``psum``, ``all_gather`` to ``psum_scatter``, ``all_to_all`` to itself, ``ppermute`` to its inverse.

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
    options = dict(mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=check_rep, check_vma=check_vma)
    options.update(local=local, timeout=timeout)
    if f is None:
        return functools.partial(shard_map, **options)
    for name in ("mesh", "in_specs", "out_specs"):
        if options[name] is None:
            raise TypeError(f"shard_map() missing required argument {name!r}")
    check = bool(check_rep if check_vma is None else check_vma)
    timeout = timeout if timeout is not None else default_timeout()
    return ShardMapped(f, Sharding(mesh, in_specs, out_specs, check, local, timeout))


class Sharding(NamedTuple):
    """The options of one ``shard_map`` (see :func:`shard_map`)."""

    mesh: Any
    in_specs: Any
    out_specs: Any
    check: bool
    local: bool
    timeout: Optional[float]


class Where(NamedTuple):
    """Where a call communicates: the mesh as this rank sees it, each axis's link, and the whole mesh's link."""

    view: MeshView
    links: Dict[str, Link]
    whole: Link


class ShardMapped:
    """``f`` under ``shard_map``: call it with the global arguments (see :func:`shard_map`)."""

    def __init__(self, f: Callable, opts: Sharding) -> None:
        self.f, self.opts = f, opts
        self.name = getattr(f, "__name__", type(f).__name__)
        self.call = f"shard_map({self.name})"
        functools.update_wrapper(self, f, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return _outside_graph(self, args, kwargs)
        return _run(self, args, kwargs)


@torch._disable_dynamo
def _outside_graph(site: ShardMapped, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``torch.compile(shard_map(f))``: the orchestration runs eagerly, as a graph break, as a cmap's does."""
    return _run(site, args, kwargs)


# ------------------------------------------------------------------------------------------------ one call
def _run(site: ShardMapped, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
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
    where = Where(view, {n: link_for(view.axes[n], device, site.call, opts.timeout) for n in view.names}, whole)
    outcome, out, out_places = _run_f(site, where, args, kwargs)
    table = conclude(site.call, view, where.links, whole, outcome)
    flat, out_tree = tree_flatten(out)
    if not opts.local:
        flat = assemble(flat, out_places, where.links, view, table, f"the outputs of {site.call}")
    return tree_unflatten(flat, out_tree)


def _run_f(
    site: ShardMapped, where: Where, args: Tuple[Any, ...], kwargs: Dict[str, Any]
) -> Tuple[Outcome, Any, List[Placement]]:
    """This rank's part: check the specs, cut the blocks, run ``f``, read its outputs; never raises (but for
    torch's own control flow), so that every rank reaches the exit."""
    opts, view, whole = site.opts, where.view, where.whole
    owner, start = CallTag(), torch._C._autograd._get_sequence_nr()
    try:
        places = _placements(site, "in", opts.in_specs, args, view)
        leaves, tree = tree_flatten(args)
        blocks = _enter_blocks(leaves, places, where, owner, opts.local)
        intercept = closures.Interceptor(owner, start, whole) if tracking() else None
        with _frames(where), splitting(view.whole.ranks), intercept or contextlib.nullcontext():
            out = site.f(*tree_unflatten(blocks, tree), **kwargs)
        if intercept is not None:  # a closed-over tensor returned as it is: replicated, its gradient summed too
            out = tree_map(intercept.route, out)
        owner.running = False
        out_places = _placements(site, "out", opts.out_specs, out, view)
        flat = tree_flatten(out)[0]
        graph_sig = closures.watch(flat, owner, start, whole) if tracking() else 0
        lengths = None if opts.local else block_lengths(flat, out_places)
        outcome = Outcome(None, _layout_sig(flat, out_places), graph_sig, lengths=lengths)
        if opts.check:
            outcome.checksums, outcome.replicated = _checksums(flat, out_places, view)
        return outcome, out, out_places
    except Exception as exc:  # every rank learns of it at the exit
        owner.running = False
        if isinstance(exc, CONTROL_FLOW):  # torch's own signal, raised alike on every rank
            raise
        return Outcome((view.whole.failure(exc), exc)), None, []


def _placements(site: ShardMapped, kind: str, specs: Any, tree: Any, view: MeshView) -> List[Placement]:
    """Each leaf's placement: its spec from the prefix ``specs``, checked against the mesh and the value."""
    what = "the positional arguments tuple" if kind == "in" else f"{site.name}(*args)"
    out = []
    for path, value, spec in broadcast_specs(site.call, kind, specs, tree, what):
        spec = check_spec(site.call, kind, path, spec, view.names)
        leaf = Leaf(site.call, kind, path, f"args{path}" if kind == "in" else f"{what}{path}")
        out.append(placement(leaf, spec, value, view.names))
    return out


def _enter_blocks(
    leaves: List[Any], places: Sequence[Placement], where: Where, owner: CallTag, local: bool
) -> List[Any]:
    """The global arguments cut into this rank's blocks; or, with ``local``, the blocks as given, entered through
    the call's entry (no communication either way; their gradients stay this rank's own)."""
    if not local:
        return cut(leaves, places, where.links, where.view, owner)
    picked = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
    spec = SplitSpec(where.whole, (KEEP,) * len(picked), owner)
    entered = split(spec, [leaves[i] for i in picked]) if picked else ()
    out = list(leaves)
    for i, v in zip(picked, entered):
        out[i] = v
    return out


@contextlib.contextmanager
def _frames(where: Where) -> Iterator[None]:
    """Every mesh axis as a named axis of rank mode: this rank is one member of each."""
    view = where.view
    with contextlib.ExitStack() as stack:
        for n in view.names:
            size, coord = view.sizes[n], view.coords[n]
            index = index_table((coord,), where.whole.device)[0].clone()  # a copy made on the device, not the host
            frame = AxisFrame(where.links[n], size, coord, (1,) * size, "rank", index=index)
            stack.enter_context(axis_scope(n, frame))
        yield


def _layout_sig(flat: Sequence[Any], places: Sequence[Placement]) -> int:
    return digest(
        [
            (p.path, tuple(p.spec), (v.dtype, v.dim()) if isinstance(v, torch.Tensor) else type(v).__name__)
            for v, p in zip(flat, places)
        ]
    )


def _checksums(flat: Sequence[Any], places: Sequence[Placement], view: MeshView) -> Tuple[dict, dict]:
    """Per mesh axis: a checksum of the outputs declared replicated over it, and their paths."""
    sums, paths = {}, {}
    for n in view.names:
        picked = [(v, p) for v, p in zip(flat, places) if n in p.replicated]
        if picked:
            sums[n] = comm.checksum([v for v, _ in picked]) or 1
            paths[n] = [p.path for _, p in picked]
    return sums, paths
