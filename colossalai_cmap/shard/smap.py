"""jax's ``smap``: a ``shard_map`` over one mesh axis, with vmap-style ``in_axes`` and ``out_axes``.

``smap(f, in_axes=0, out_axes=0, axis_name="x")`` is ``shard_map(f, mesh, P("x"), P("x"), axis_names={"x"})`` on the
mesh in context: inside a ``shard_map`` (or another ``smap``) the mesh that map runs over, with the axes it made
manual still manual; outside any, the mesh of :class:`~.mesh.set_mesh`. An axis ``a`` of ``in_axes`` is the spec
``P(None, ..., None, axis_name)`` with ``a`` Nones (``None``: ``P()``), so ``f`` sees a block with the dimension
kept. Nested, the map runs over the group of its axis alone (:func:`~.mesh.axis_view`): the ranks along it hold
the same values, so its blocks are cut with no communication and assembled along that axis only; the types of the
map around it carry on inside (its axes stay typed), and its gradients are those of the flat ``shard_map``. Inside
a ``shard_map`` with ``check_vma=False`` the smap is typed over its own axis alone: the cotangents reaching it are
equal along that axis (the untyped map computes alike there, and splits a replicated output's cotangent evenly),
and the collectives over the untyped map's axes keep their untyped transposes (:func:`~..axis.vma.untyped`).
"""

import functools
from typing import Any, Callable, List, Optional

import torch

from ..axis import vma
from ..torch_internals import (
    broadcast_to_and_flatten,
    tree_flatten,
    tree_leaves,
    tree_map,
    tree_structure,
    tree_unflatten,
)
from ..wire.traced import out_of_graph
from .api import shard_map
from .mesh import axis_view, in_context, resolve_mesh
from .specs import P

__all__ = ["smap", "Infer"]


class _InferFromArgs:
    """jax's ``Infer``: ``in_axes`` left to the arguments' shardings (which jax reads only on Explicit axes)."""

    def __repr__(self) -> str:
        return "Infer"


Infer = _InferFromArgs()


def smap(f: Optional[Callable] = None, /, *, in_axes: Any = Infer, out_axes: Any, axis_name: Any) -> Any:
    """jax's ``smap``: ``f`` mapped over the mesh axis ``axis_name`` alone, one block per rank along it.

    Args:
        f: the per-block function; omit it to use ``smap`` as a decorator.
        in_axes: an int, None, or a tuple (a pytree prefix of the positional arguments) of them: the dim of each
            argument split along ``axis_name`` (``f`` sees its block, the dim kept), None for an argument every rank
            along the axis holds whole. Negative dims count from the end, as vmap's (jax 0.10 takes them as 0).
            Required: jax infers it only from Explicit mesh axes, and a torch mesh's axes are not.
        out_axes: an int, None, or a pytree prefix of ``f``'s output of them: the dim each output's blocks are
            concatenated along; None for an output invariant along the axis (checked from the types, as
            ``shard_map``'s ``check_vma=True``).
        axis_name: one axis of the mesh in context that is not manual there yet.

    Returns:
        A function of the arguments: inside a ``shard_map`` or ``smap`` its values (whole along ``axis_name``, which
        is not manual there), else the global values on the mesh of ``set_mesh``.

    Example:
        >>> @partial(shard_map, mesh=mesh, in_specs=P("y"), out_specs=P("y"), axis_names={"y"})
        ... def outer(b):  # b: whole along "x"
        ...     return cm.smap(lambda c: c * cm.axis_index("x"), in_axes=0, out_axes=0, axis_name="x")(b)
    """
    kwargs = dict(in_axes=in_axes, out_axes=out_axes, axis_name=axis_name)
    if f is None:
        return lambda g: smap(g, **kwargs)
    if isinstance(axis_name, (list, tuple)):
        raise TypeError(f"smap axis_name should be a `str` or a `Hashable`, but got {axis_name}")
    if in_axes is not None and in_axes is not Infer and not isinstance(in_axes, (int, tuple)):
        raise TypeError(
            "smap in_axes must be an int, None, jax.sharding.Infer, or a tuple of entries corresponding to the "
            f"positional arguments passed to the function, but got {in_axes}."
        )
    if in_axes is not Infer and not all(_axis_or_none(a) for a in tree_leaves(in_axes)):
        raise TypeError(
            f"smap in_axes must be an int, None, jax.sharding.Infer, or (nested) container with those types as "
            f"leaves, but got {in_axes}."
        )
    if not all(_axis_or_none(a) for a in tree_leaves(out_axes)):
        raise TypeError(
            f"smap out_axes must be an int, None, or (nested) container with those types as leaves, but got "
            f"{out_axes}."
        )
    return Smapped(f, in_axes, out_axes, axis_name)


class Smapped:
    """``f`` under ``smap``: call it with the arguments (see :func:`smap`)."""

    def __init__(self, f: Callable, in_axes: Any, out_axes: Any, axis_name: Any) -> None:
        self.f, self.in_axes, self.out_axes, self.axis_name = f, in_axes, out_axes, axis_name
        self.name = getattr(f, "__name__", type(f).__name__)
        self.call = f"smap({self.name})"
        functools.update_wrapper(self, f, updated=())

    def __call__(self, *args: Any) -> Any:
        if torch.compiler.is_compiling():
            return _EAGER(self, *args)
        return self._run(*args)

    def _run(self, *args: Any) -> Any:
        where, view = self._checked_context()
        name = self.axis_name
        in_specs = self._in_specs(args)
        out_axes: List[Any] = []  # each output leaf's axis, as f returned it (for the negative ones)
        output_types: List[Any] = []  # each output leaf's type inside f (a nested smap's outputs keep the others' axes)

        @functools.wraps(self.f)
        def block_fn(*blocks: Any) -> Any:
            out = self.f(*blocks)
            leaves, tree = tree_flatten(out)
            axes = broadcast_to_and_flatten(self.out_axes, tree, is_leaf=lambda a: a is None)
            if axes is None:  # shard_map says so, with its message
                return out
            inner = vma.current()
            output_types[:] = [inner.of(v) if inner is not None else frozenset() for v in leaves]
            out_axes[:] = axes
            moved = [_to_front(v, a) for v, a in zip(leaves, axes)]
            return tree_unflatten(moved, tree)

        out_specs = tree_map(_out_spec(name), self.out_axes, is_leaf=lambda a: a is None)
        outer = vma.current() if where.view is not None else None
        mesh = axis_view(view, name) if where.view is not None else where.mesh
        mapped = shard_map(block_fn, mesh, in_specs, out_specs, axis_names={name} if where.view is None else None)
        mapped.call = self.call
        if outer is None:
            out = mapped(*args)
        else:
            with outer.pause():  # the map around this one types nothing in it: its types carry on inside
                out = mapped(*args)
        leaves, tree = tree_flatten(out)
        leaves = [_from_front(v, a) for v, a in zip(leaves, out_axes)]
        if outer is not None:
            for v, t in zip(leaves, output_types):
                if isinstance(v, torch.Tensor):
                    outer.mark(v, t - {name})
        return tree_unflatten(leaves, tree)

    def _checked_context(self) -> Any:
        """The running map's context and the mesh view this smap maps over, after checking it can run here (jax's
        errors, in jax's words)."""
        where = in_context()
        if where is None:
            raise ValueError(
                f"{self.call}: The context mesh cannot be empty. Use `cm.set_mesh(mesh)` to enter into a mesh "
                f"context, or call it inside a shard_map (as jax's smap)."
            )
        if self.in_axes is Infer:
            raise TypeError(
                f"{self.call}: in_axes was not specified when axis_name={frozenset({self.axis_name})} was of type "
                f"AxisType.Auto (jax's words: a torch mesh's axes are not Explicit, so nothing to infer it from); "
                f"pass in_axes=0, None, or a tuple with one per positional argument."
            )
        name = self.axis_name
        view = where.view if where.view is not None else resolve_mesh(self.call, where.mesh)
        if name not in view.names:
            raise ValueError(
                f"{self.call}: requires axis_names={frozenset({name})} to be a subset of "
                f"mesh.axis_names={frozenset(view.names)} (jax's words): axis_name={name!r} is not an axis of "
                f"{view.describe()}."
            )
        if name in where.manual:
            raise ValueError(
                f"{self.call}: axis_name={name!r} is already manual here: the shard_map or smap around this call "
                f"maps over it (jax: DuplicateSpecError). Map over another axis, or call it outside that map."
            )
        return where, view

    def _in_specs(self, args: tuple) -> Any:
        """Each positional argument's spec, from ``in_axes`` (negative dims counted from the end)."""
        axes = broadcast_to_and_flatten(self.in_axes, tree_structure(args), is_leaf=lambda a: a is None)
        if axes is None:
            raise ValueError(
                f"{self.call}: in_axes={self.in_axes!r} must be an int, None, or a tree prefix of the positional "
                f"arguments tuple, with {len(args)} entries (smap in_axes specification must be a tree prefix of "
                f"the corresponding value)."
            )
        leaves, tree = tree_flatten(args)
        specs = []
        for v, a in zip(leaves, axes):
            if a is not None and a < 0 and isinstance(v, torch.Tensor):
                if a < -v.dim():
                    raise ValueError(
                        f"{self.call}: in_axes {a} is out of range for an argument of {v.dim()} dims "
                        f"(it must be in [-{v.dim()}, {v.dim()}))."
                    )
                a %= v.dim()
            specs.append(_spec(self.axis_name, a))
        return tree_unflatten(specs, tree)


def _axis_or_none(a: Any) -> bool:
    return a is None or isinstance(a, int)


def _spec(name: Any, axis: Optional[int]) -> P:
    return P() if axis is None else P(*([None] * max(axis, 0)), name)


def _out_spec(name: Any) -> Callable[[Optional[int]], P]:
    """An out_axes entry's spec; a negative one is dim 0, where the block function moved it."""
    return lambda axis: _spec(name, None if axis is None else max(axis, 0))


def _to_front(v: Any, axis: Optional[int]) -> Any:
    """An output block whose out axis counts from the end, with that dim moved to the front (the spec's dim 0)."""
    if axis is None or axis >= 0 or not isinstance(v, torch.Tensor):
        return v
    return v.movedim(axis % v.dim(), 0)


def _from_front(v: Any, axis: Optional[int]) -> Any:
    if axis is None or axis >= 0 or not isinstance(v, torch.Tensor):
        return v
    return v.movedim(0, axis % v.dim())


# smap under torch.compile runs out of the graph
_EAGER = out_of_graph(
    lambda site, *args: site._run(*args),
    "smap runs eagerly, not inside torch.compile: it makes its shard_map at each call, from the mesh in context; "
    "to keep one graph, use shard_map(f, mesh, in_specs=P(axis_name), out_specs=..., axis_names={axis_name}), "
    "made outside the compiled function",
)
