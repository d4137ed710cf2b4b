"""DTensors in and out of a ``shard_map``: placements as specs, local tensors as blocks.

A DTensor argument is this rank's block already (its ``to_local()``), so it enters as a ``local=True`` block does,
with no communication; its spec comes from its placements when ``in_specs`` leaves it out, as jax infers
``in_specs`` from the shardings of explicitly sharded arrays: ``Shard(d)`` on mesh dim ``"x"`` puts ``"x"`` at
entry ``d`` of the ``P`` (several mesh dims on one tensor dim make a tuple, in mesh order), ``Replicate()`` names
no axis. A DTensor output is this rank's output block, placed by its ``out_specs`` entry (``DTensor.from_local``),
so no output is assembled. ``to_local`` and ``from_local`` are differentiable: a DTensor leaf's ``.grad`` is a
DTensor with the leaf's placements, holding this rank's block of the global gradient, as ``local=True`` gives it.
"""

import sys
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..errors import CmapError, RankFailure
from ..torch_internals import chunk_size, keystr, tree_flatten, tree_flatten_with_path, tree_unflatten, waited
from .specs import P, Placement, broadcast_specs


def dtensor_type() -> Optional[type]:
    """torch's ``DTensor`` class, or None when nothing has imported it (then no argument is one)."""
    module = sys.modules.get("torch.distributed.tensor._api")
    return None if module is None else module.DTensor


def has_dtensor(leaves: Sequence[Any]) -> bool:
    cls = dtensor_type()
    return cls is not None and any(isinstance(v, cls) for v in leaves)


class Unwrapped(NamedTuple):
    """The arguments with each DTensor as its local tensor, the ``in_specs`` with every DTensor's spec filled in
    (a full pytree, one ``P`` per leaf), which leaves were DTensors (those enter as blocks), and the DeviceMesh
    that DTensor outputs go on (None: no DTensor output)."""

    args: Tuple[Any, ...]
    specs: Any
    entered_local: Tuple[bool, ...]
    out_mesh: Any


def mesh_of(mesh: Any) -> Any:
    """``mesh`` when it is a torch DeviceMesh, else None."""
    return mesh if type(mesh).__name__ == "DeviceMesh" else None


def unwrap_inputs(call: str, args: Tuple[Any, ...], in_specs: Any, view: Any, mesh: Any, out_dtensor: Any) -> Unwrapped:
    """Each DTensor argument checked against the mesh and ``in_specs`` and replaced by its local tensor."""
    cls, leaves = dtensor_type(), tree_flatten(args)[0]
    if in_specs is not None and not out_dtensor and not has_dtensor(leaves):
        return Unwrapped(args, in_specs, (False,) * len(leaves), None)  # no DTensor: nothing to do
    flat, tree = _flatten(args)
    given = _given_specs(call, in_specs, args)
    specs, local, values, out_mesh = [], [], [], mesh_of(mesh)
    for (path, value), spec in zip(flat, given):
        where = f"args{path}"
        if cls is not None and isinstance(value, cls):
            check_mesh(call, where, value.device_mesh, view)
            inferred = spec_of(call, where, value)
            if spec is not None and tuple(spec) != tuple(inferred):
                raise ValueError(
                    f"{call}: in_specs{path} is {spec!r}, but {where} is a DTensor with placements "
                    f"{tuple(value.placements)}, which is {inferred!r}. Leave its in_specs entry out (None) to take "
                    f"its placements, or redistribute it first: {where}.redistribute(mesh, "
                    f"{placements_of(spec, value.dim(), view.names)})."
                )
            out_mesh = out_mesh if out_mesh is not None else value.device_mesh
            specs.append(inferred)
            local.append(True)
            values.append(ToLocal.apply(value))
        else:
            if spec is None:
                if isinstance(value, torch.Tensor):
                    raise ValueError(
                        f"{call}: in_specs{path} is left out (None), which takes the spec from a DTensor's "
                        f"placements, but {where} is a plain tensor. Give its spec (P() for a tensor that is the "
                        f"same on every rank), or pass a DTensor."
                    )
                spec = P()
            specs.append(spec)
            local.append(False)
            values.append(value)
    want = bool(any(local)) if out_dtensor is None else bool(out_dtensor)
    if want and out_mesh is None:
        raise TypeError(
            f"{call}: out_dtensor=True makes DTensors on a torch DeviceMesh, but the mesh is {mesh!r} and no argument "
            f"is a DTensor; pass mesh=init_device_mesh(...) or DTensor arguments."
        )
    return Unwrapped(
        tree_unflatten(values, tree),
        tree_unflatten(specs, tree),
        tuple(local),
        out_mesh if want else None,
    )


class ToLocal(torch.autograd.Function):
    """``DTensor.to_local()`` whose backward places the gradient with the DTensor's own global shape and stride.
    torch 2.5.1's derives them from the local gradient, which is wrong for uneven blocks: autograd then copies the
    gradient to the leaf's layout, and the copy is a replicated DTensor (an all-gather) instead of a placed one."""

    @staticmethod
    def forward(ctx: Any, value: Any) -> torch.Tensor:
        ctx.layout = (value.device_mesh, tuple(value.placements), value.shape, value.stride())
        with torch.no_grad():
            local = value.to_local()
        local = waited(local)  # a redistribute's result may still be in flight
        return local.view_as(local)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        from torch.distributed.tensor import DTensor

        mesh, placements, shape, stride = ctx.layout
        return DTensor.from_local(grad, mesh, placements, run_check=False, shape=shape, stride=stride)


def _flatten(args: Any) -> Tuple[List[Tuple[str, Any]], Any]:
    pairs, tree = tree_flatten_with_path(args)
    return [(keystr(path), value) for path, value in pairs], tree


def _given_specs(call: str, in_specs: Any, args: Tuple[Any, ...]) -> List[Optional[P]]:
    """Each leaf's ``in_specs`` entry; None where it is left out (``in_specs=None``, or a None entry)."""
    n = len(tree_flatten_with_path(args)[0])
    if in_specs is None:
        return [None] * n
    return [spec for _, _, spec in broadcast_specs(call, "in", in_specs, args, "the positional arguments tuple", True)]


def check_mesh(call: str, where: str, device_mesh: Any, view: Any) -> None:
    """A DTensor's mesh must be the shard_map's: the same axis names, sizes and ranks."""
    names = tuple(device_mesh.mesh_dim_names or ())
    sizes = tuple(device_mesh.mesh.shape)
    grid = tuple(int(r) for r in device_mesh.mesh.flatten().tolist())
    if names == view.names and sizes == tuple(view.sizes[n] for n in view.names) and grid == tuple(view.grid):
        return
    raise ValueError(
        f"{call}: {where} is a DTensor on a DeviceMesh of shape {sizes} with mesh_dim_names {names} over ranks "
        f"{list(grid)}, but shard_map runs over {view.describe()} over ranks {list(view.grid)}; a DTensor's mesh must "
        f"be the shard_map's. Pass mesh={where}.device_mesh, or redistribute the DTensor onto the shard_map's mesh "
        f"(or pass {where}.full_tensor() with an in_specs entry)."
    )


def spec_of(call: str, where: str, value: Any) -> P:
    """The ``P`` of a DTensor's placements: ``Shard(d)`` on mesh dim ``a`` puts ``a`` at entry ``d``."""
    names = tuple(value.device_mesh.mesh_dim_names or ())
    if not names:
        raise ValueError(
            f"{call}: {where} is a DTensor on a DeviceMesh without mesh_dim_names; shard_map's specs name the mesh "
            f"axes, so create the mesh with init_device_mesh(device_type, shape, mesh_dim_names=(...))."
        )
    entries: List[List[str]] = [[] for _ in range(value.dim())]
    for name, p in zip(names, value.placements):
        if p.is_replicate():
            continue
        if p.is_partial():
            raise ValueError(
                f"{call}: {where} is a DTensor with placement {p!r} on mesh dim {name!r}: a pending sum, which a "
                f"shard_map block cannot hold (jax's in_specs have no partial values either). Reduce it first: "
                f"{where}.redistribute(mesh, [Replicate()]) (or Shard(d)), or pass {where}.to_local() with "
                f"local=True and psum it over {name!r} inside f."
            )
        if type(p).__name__ != "Shard":  # _StridedShard (FSDP2 over TP) and others: not one block per rank
            raise ValueError(
                f"{call}: {where} is a DTensor with placement {p!r} on mesh dim {name!r}, which is not one contiguous "
                f"block per rank; redistribute it to Shard(d) or Replicate() first."
            )
        entries[p.dim % value.dim()].append(name)
    while entries and not entries[-1]:
        entries.pop()
    return P(*(None if not e else e[0] if len(e) == 1 else tuple(e) for e in entries))


def placements_of(spec: P, ndim: int, names: Sequence[str]) -> List[Any]:
    """The DTensor placements of a spec over mesh axes ``names`` (one per axis, in mesh order)."""
    from torch.distributed.tensor import Replicate, Shard

    out: List[Any] = [Replicate() for _ in names]
    for d, entry in enumerate(spec):
        axes = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
        for a in axes:
            out[list(names).index(a)] = Shard(d)
    return out


def check_outputs(call: str, flat: Sequence[Any], places: Sequence[Placement], view: Any) -> None:
    """Each DTensor output's spec must be one DTensor can hold: a dim split over mesh dims in mesh order."""
    for v, p in zip(flat, places):
        for d, axes in p.split if isinstance(v, torch.Tensor) else ():
            ordered = tuple(a for a in view.names if a in axes)
            if tuple(axes) != ordered:
                raise ValueError(
                    f"{call}: out_specs{p.path} is {p.spec!r}, which splits dim {d} over {axes} with {axes[0]!r} "
                    f"major; a DTensor splits a dim over mesh dims in mesh order ({ordered}). Reorder the entry, "
                    f"or pass out_dtensor=False."
                )


def wrap_outputs(
    call: str, flat: Sequence[Any], places: Sequence[Placement], out_mesh: Any, view: Any, table: Any
) -> List[Any]:
    """Each output block as a DTensor on ``out_mesh`` with its ``out_specs`` placements. Its global shape is read
    from every rank's block lengths (``table``, a column per split dim of each output, as ``block_lengths``), and
    the blocks must be DTensor's, ``torch.chunk`` blocks along each mesh dim in turn: else the same ``CmapError``
    (a ``ValueError``) on every rank, decided from the table they all hold."""
    from torch.distributed.tensor import DTensor

    out, column = [], 0
    for v, p in zip(flat, places):
        if not isinstance(v, torch.Tensor):
            out.append(v)
            continue
        shape = list(v.shape)
        try:
            for d, axes in p.split:
                shape[d] = _global_length(call, p, d, axes, view, table=table, col=column)
                column += 1
        except ValueError as exc:
            failures = [RankFailure(r, g, "ValueError", str(exc)) for r, g in enumerate(view.whole.ranks)]
            raise CmapError.from_failures(call, failures, view.whole.rank) from None
        placements = placements_of(p.spec, v.dim(), view.names)
        stride = torch.empty(shape, device="meta").stride()
        out.append(DTensor.from_local(v, out_mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride))
    return out


def _global_length(call: str, p: Placement, d: int, axes: Sequence[str], view: Any, *, table: Any, col: int) -> int:
    """The global length of dim ``d``: the blocks along ``axes`` summed, after checking, for every rank of the
    mesh, that its block is the one DTensor's layout gives it (so every rank decides alike)."""
    everyone = [_coords_of(k, view) for k in range(len(view.grid))]
    rows = {tuple(c.values()): int(table[view.whole_rank(c)][col]) for c in everyone}
    others = [n for n in view.names if n not in axes]

    def total_at(c: dict) -> int:  # the blocks of c's slice: the ranks that differ from c along ``axes`` only
        return sum(rows[tuple(o.values())] for o in everyone if all(o[n] == c[n] for n in others))

    total = total_at(view.coords)
    for c in everyone:
        size = total_at(c)
        for a in axes:  # DTensor: torch.chunk over each mesh dim in turn
            size = chunk_size(size, view.sizes[a], c[a])
        if total_at(c) != total or size != rows[tuple(c.values())]:
            raise ValueError(
                f"{call}: out_specs{p.path} is {p.spec!r}, and the blocks along dim {d} are not a DTensor's: "
                f"torch.chunk blocks of the global length {total_at(c)} give {size} rows at {c}, not "
                f"{rows[tuple(c.values())]}. Make the blocks even, or pass out_dtensor=False."
            )
    return total


def _coords_of(flat: int, view: Any) -> dict:
    """The coordinates of the ``flat``-th rank of the grid (row-major), in mesh order."""
    coords = {}
    for n in reversed(view.names):
        flat, coords[n] = divmod(flat, view.sizes[n])
    return {n: coords[n] for n in view.names}
