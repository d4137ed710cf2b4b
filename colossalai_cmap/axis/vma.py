"""Varying-axis types inside ``shard_map`` (jax's ``check_vma=True``): the mesh axes each tensor varies over.

While ``f`` runs, :class:`Tracker`, a ``TorchFunctionMode``, gives every tensor an op makes the union of its
inputs' types; the entry gives each block the axes its ``in_specs`` names, a tensor made before the call (a
closure, a parameter) and a constant vary over none, and the collectives set their own result's type
(:mod:`.collectives`). Where an op mixes a value invariant over an axis that requires grad with one that varies
over it, the invariant one goes through :func:`vary` first, as jax inserts ``pcast(..., to="varying")``: its
transpose is the psum that makes the invariant value's gradient whole, so the entry of an invariant block, and the
exit of an invariant output, need no communication, and ``psum`` of a varying value transposes to nothing.

A tensor from outside ``f`` that requires grad enters ``f``'s graph through the call's boundary
(:meth:`Tracker.route`, an identity node the guarded backward stops at), at its first use.

A type is stored on the tensor object with the tracker's serial number, so a tensor kept from an earlier call reads
as invariant in a later one; no tensor subclass, no table that keeps tensors alive.
"""

import contextlib
import itertools
from typing import Any, Callable, Dict, FrozenSet, Iterable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch.overrides import TorchFunctionMode

from ..torch_internals import current_level, is_wrapped, next_sequence_nr, node_metadata, sequence_nr, transform_levels
from ..wire.exchange import CallTag, JoinSpec, SplitSpec, join, requires_grad, split
from ..wire.guard import as_is
from ..wire.link import Link
from ..wire.roles import COPY, Role, Rows
from ..wire.rounds import Kind
from .frame import Joint, MeshAxes, lookup

Axes = FrozenSet[str]
NONE: Axes = frozenset()
_ATTR = "_cmap_vma"
_SERIAL = itertools.count(1)
_ACTIVE: List["Tracker"] = []
# calls that return no tensor: nothing to type, and the getters among them are the most frequent calls
_PLAIN = {
    torch.Tensor.dim,
    torch.Tensor.size,
    torch.Tensor.numel,
    torch.Tensor.is_floating_point,
    torch.Tensor.is_complex,
    torch.Tensor.__len__,
    torch.Tensor.__repr__,
    torch.Tensor.__format__,
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.stride,
    torch.Tensor.is_contiguous,
    torch.Tensor.data_ptr,
    torch.Tensor.element_size,
    torch.Tensor.backward,
    torch.Tensor.register_hook,
    torch.autograd.grad,
    torch.autograd.backward,
    *(getattr(torch.Tensor, name).__get__ for name in ("shape", "dtype", "device", "requires_grad", "ndim", "layout")),
    *(getattr(torch.Tensor, name).__get__ for name in ("is_cuda", "is_sparse", "is_meta", "grad_fn", "is_leaf")),
}


class Tracker(TorchFunctionMode):
    """The types of the tensors ``f`` makes, over the manual axes ``links`` names (each axis's group).

    A tracker nested in another (``parent``: a ``smap`` inside a map over other axes of its mesh) types the parent's
    axes too, and reads the types the parent gave; the parent rests while the nested one runs. With ``tag`` (the
    call's :class:`CallTag`), each tensor from outside ``f`` enters through the guard's identity node at its first use.
    """

    def __init__(
        self,
        links: Dict[str, Link],
        tag: Optional[CallTag] = None,
        parent: Optional["Tracker"] = None,
        mesh: Optional[MeshAxes] = None,
    ) -> None:
        super().__init__()
        self.parent, self.tag, self.serial, self.paused = parent, tag, next(_SERIAL), 0
        self.mesh = mesh if parent is None else None  # the mesh whose axes taken together make one group
        self.links = links if parent is None else {**parent.links, **links}
        self.serials = frozenset({self.serial}) | (parent.serials if parent is not None else frozenset())
        self.axes: Axes = frozenset(self.links)
        self.start = next_sequence_nr()  # autograd nodes numbered from here were made in f
        self.cast: Dict[Tuple[int, Axes], Tuple[torch.Tensor, torch.Tensor]] = {}  # one cast per tensor and axes
        self.entered: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}  # one alias per tensor from outside f

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.paused or func in _PLAIN or getattr(func, "__name__", "") == "__set__":
            return func(*args, **kwargs)
        found = [t for t in _tensors(args, kwargs)]
        if not found:
            return func(*args, **kwargs)
        if self.tag is not None:
            swap = {id(t): a for t in found if (a := self.route(t)) is not t}
            if swap and args and _in_place(func):  # the mutated tensor keeps its identity
                swap.pop(id(args[0]), None)
            if swap and _enters(func):
                args = _replaced(args, swap)
                if kwargs:
                    kwargs = {n: _replaced_one(v, swap) for n, v in kwargs.items()}
                found = [swap.get(id(t), t) for t in found]
        kinds = [self.of(t) for t in found]
        joined = kinds[0]
        for k in kinds[1:]:
            if k is not joined and k != joined:
                joined = joined | k
        if torch.is_grad_enabled() and any(k != joined for k in kinds):
            mutated = args[0] if args and _in_place(func) else None
            swap = {}
            for t, k in zip(found, kinds):
                if k == joined or not requires_grad(t):
                    continue
                if t is mutated:  # it keeps its identity: its history goes through the cast instead
                    t.copy_(self.vary(t.clone(), joined - k))
                else:
                    swap[id(t)] = self._cast(t, joined - k)
            if swap:
                args = _replaced(args, swap)
                if kwargs:
                    kwargs = {n: _replaced_one(v, swap) for n, v in kwargs.items()}
        return self.mark(func(*args, **kwargs), joined)

    def of(self, t: Any) -> Axes:
        """The axes ``t`` varies over (none for a tensor this call did not type)."""
        if not isinstance(t, torch.Tensor):
            return NONE
        found = t.__dict__.get(_ATTR)
        if found is not None and found[0] in self.serials:
            return found[1]
        # a function transform's wrapper made outside any op this mode saw (torch.vmap's inputs): its tensor's type
        for inner in transform_levels(t)[1:]:
            found = inner.__dict__.get(_ATTR)
            if found is not None and found[0] in self.serials:
                return found[1]
        node = t.grad_fn
        if node is None or sequence_nr(node) < self.start:
            return self.parent.of(t) if self.parent is not None and node is not None else NONE
        # made in f by no op this mode saw (torch.vmap's unwrapped outputs): the types its graph's nodes recorded
        axes = _recorded(node, self.serials, self.start)
        t.__dict__[_ATTR] = (self.serial, axes)
        return axes

    def mark(self, out: Any, axes: Iterable[str]) -> Any:
        """``out`` (a tensor, or a tuple or list of them) typed as varying over ``axes``; returns ``out``."""
        axes = frozenset(axes)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                t.__dict__[_ATTR] = (self.serial, axes)
                # and the tensors under a function transform's wrappers (torch.vmap returns its outputs' own, or views of
                # them whose graph leads to the nodes recorded here)
                for inner in transform_levels(t)[1:]:
                    inner.__dict__[_ATTR] = (self.serial, axes)
                    if inner.grad_fn is not None:
                        node_metadata(inner.grad_fn)[_ATTR] = (self.serial, axes)
        return out

    def _cast(self, t: torch.Tensor, axes: Axes) -> torch.Tensor:
        """:meth:`vary` made once per tensor and axes in a call (a weight used by many ops is cast once, so its
        gradient is summed once)."""
        key = (id(t), axes)
        found = self.cast.get(key)
        if found is None or found[0] is not t:
            found = self.cast[key] = (t, self.vary(t, axes))
        return found[1]

    def route(self, t: Any) -> Any:
        """``t``, or where it is a tensor from outside ``f`` that requires grad (a replicated block, a closure, a
        parameter), its alias through the call's boundary (:func:`~..wire.guard.as_is`), once per tensor: the guarded
        backward through ``f`` stops there, as at the entry's Splits."""
        if self.tag is None or not isinstance(t, torch.Tensor):
            return t
        found = t.__dict__.get(_ATTR)
        if found is not None and found[0] == self.serial:  # typed in this call: made in f (the most frequent case)
            return t
        found = self.entered.get(id(t))
        if found is not None and found[0] is t:
            return found[1]
        if not requires_grad(t) or not torch.is_grad_enabled():
            return t
        node = t.grad_fn
        if node is not None and sequence_nr(node) >= self.start:  # made in f by no op this mode saw
            return t
        if current_level() is not None or is_wrapped(t):
            return t  # under a transform inside f: the graph walk finds the edge, and the call runs unguarded
        self.paused += 1
        try:
            alias = self.mark(as_is(self.tag, t), NONE)
        finally:
            self.paused -= 1
        self.entered[id(t)] = (t, alias)
        return alias

    def vary(self, t: torch.Tensor, axes: Iterable[str]) -> torch.Tensor:
        """``pcast(t, axes, to="varying")``: the value itself, whose transpose sums the cotangents over ``axes``."""
        axes = frozenset(axes)
        t = self.route(t)
        base = self.of(t)
        out = t
        self.paused += 1
        try:
            names = [n for n, link in self.links.items() if n in axes and link is not None and link.group.size > 1]
            # several axes of the call's mesh: one sum over their group in backward
            joint = self.mesh.joint(tuple(names)) if self.mesh is not None and len(names) > 1 else None
            for link in [joint.link] if joint is not None else [self.links[n] for n in names]:
                out = split(SplitSpec(link, (COPY,)), [out])[0]
            if out is t:  # a new tensor object, so that ``t`` itself keeps its type
                out = t.view_as(t)
        finally:
            self.paused -= 1
        return self.mark(out, base | axes)

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Ops that run inside a collective are not typed (the collective types its result)."""
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1


def _recorded(node: Any, serials: FrozenSet[int], start: int) -> Axes:
    """The union of the types recorded on the nodes nearest to ``node`` in its graph, among those made in f."""
    axes, seen, todo = NONE, set(), [node]
    while todo:
        n = todo.pop()
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        found = node_metadata(n).get(_ATTR)
        if found is not None and found[0] in serials:
            axes = axes | found[1]
        elif type(n).__name__ != "AccumulateGrad" and sequence_nr(n) >= start:
            todo.extend(f for f, _ in n.next_functions)
    return axes


# torch functions that read a tensor without taking its value into the graph; and the views read as attributes
_NOT_ENTERING = {torch.Tensor.retain_grad, torch.Tensor.requires_grad_, torch.Tensor.detach, torch.Tensor.detach_}
_VIEW_ATTRIBUTES = {"T", "mT", "H", "mH", "real", "imag"}


def _enters(func: Any) -> bool:
    """Whether ``func`` may take its tensor arguments into the graph (an attribute read only for the views)."""
    if func in _NOT_ENTERING:
        return False
    if getattr(func, "__name__", "") == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", None) in _VIEW_ATTRIBUTES
    return True


_IN_PLACE_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ipow__", "__imatmul__"}


def _in_place(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    return name in _IN_PLACE_DUNDERS or (name.endswith("_") and not name.startswith("_"))


def _tensors(args: Sequence[Any], kwargs: Dict[str, Any]) -> Iterator[torch.Tensor]:
    for a in itertools.chain(args, kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    yield b


def _replaced_one(a: Any, swap: Dict[int, torch.Tensor]) -> Any:
    if isinstance(a, torch.Tensor):
        return swap.get(id(a), a)
    if type(a) in (list, tuple):
        return type(a)(swap.get(id(b), b) if isinstance(b, torch.Tensor) else b for b in a)
    return a


def _replaced(args: Sequence[Any], swap: Dict[int, torch.Tensor]) -> tuple:
    return tuple(_replaced_one(a, swap) for a in args)


def current() -> Optional[Tracker]:
    """The tracker of the innermost ``shard_map`` with ``check_vma=True`` now running ``f`` (None: untyped)."""
    return _ACTIVE[-1] if _ACTIVE else None


def typed_axes(names: Sequence[str]) -> Optional[Tracker]:
    """The tracker that types these axes (every one of them manual), else None: the ops run untyped."""
    tracker = current()
    if tracker is None or tracker.paused or not all(n in tracker.axes for n in names):
        return None
    return tracker


@contextlib.contextmanager
def tracking(tracker: Tracker) -> Iterator[Tracker]:
    """Type every op inside the block (a nested tracker's parent rests meanwhile: one mode types each op)."""
    if tracker.parent is not None:
        tracker.parent.paused += 1
    _ACTIVE.append(tracker)
    try:
        with tracker:
            yield tracker
    finally:
        _ACTIVE.pop()
        if tracker.parent is not None:
            tracker.parent.paused -= 1


def joined(
    tracker: Tracker,
    x: torch.Tensor,
    names: Tuple[str, ...],
    op: str,
    role: Optional[Role],
    joint: Optional[Joint] = None,
) -> Any:
    """``x`` cast to varying over the axes, then a Join over each, innermost first: the sum (``role`` COPY, jax's
    ``psum_invariant``) or every member's value stacked along a new dim 0 (``role`` None, ``all_gather_invariant``).
    A Join's transpose is a Split: nothing (COPY) or this rank's slice (rows), with no communication. A sum over
    axes taken together (``joint``) is one Join on their group."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"{op}(x, {names if len(names) > 1 else names[0]!r}): x must be a Tensor, got {type(x).__name__}."
        )
    before = tracker.of(x)
    with tracker.pause():
        if not set(names) <= before:
            x = tracker.vary(x, set(names) - before)
        if joint is not None and role is COPY:
            if joint.link.group.size > 1:
                x = join(JoinSpec(joint.link, (COPY,), f"{op}({names!r})", Kind.OP), [x])[0]
            return tracker.mark(x, before - set(names))
        for name in reversed(names):
            frame = lookup(name, op)
            if role is None:
                x = x.unsqueeze(0)
            if frame.link is not None and frame.link.group.size > 1:
                step = role if role is not None else Rows(0, (1,) * frame.size)
                x = join(JoinSpec(frame.link, (step,), f"{op}({name!r})", Kind.OP), [x])[0]
            if role is None and len(names) > 1 and name != names[-1]:
                x = x.flatten(0, 1)  # (outer members, inner members, ...) to one dim, the outer major
    return tracker.mark(x, before - set(names))


def untyped(names: Tuple[str, ...], x: Any, run: Callable[[Any], Any]) -> Any:
    """``run(x)`` over axes no tracker types. Inside a typed map, these are the mesh axes of an untyped map around
    it (an ``smap`` in a ``shard_map`` with ``check_vma=False``): the collective's own ops are not ``f``'s (no cast
    goes into them) and its result keeps ``x``'s type, as the types do not name those axes."""
    tracker = current()
    if tracker is None or tracker.paused or not isinstance(x, torch.Tensor):
        return run(x)
    if not all(lookup(n, "a collective").mode.per_rank for n in names):  # a cmap's axis inside f: its ops are typed
        return run(x)
    x = tracker.route(x)
    with tracker.pause():
        out = run(x)
    return tracker.mark(out, tracker.of(x))


def typed(names: Tuple[str, ...], x: torch.Tensor, varying: bool, run: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``run(x)``, typed when a ``shard_map`` with ``check_vma=True`` types the axes: ``x`` first cast to varying
    over the axes it is invariant over (jax inserts that ``pcast``), and the result varying over them (``varying``)
    or invariant (a reduction that carries no gradient)."""
    tracker = typed_axes(names)
    if tracker is None:
        return untyped(names, x, run)
    before = tracker.of(x)
    with tracker.pause():
        if varying and isinstance(x, torch.Tensor) and not set(names) <= before:
            x = tracker.vary(x, set(names) - before)
        out = run(x)
    return tracker.mark(out, before | set(names) if varying else before - set(names))


def cast_to_varying(x: torch.Tensor, names: Tuple[str, ...], call: str) -> torch.Tensor:
    """``pcast``'s cast where the axes are typed: ``x`` must be invariant over them (jax 0.10 refuses a cast from
    varying); where they are not typed, ``x`` as it is."""
    tracker = typed_axes(names)
    if tracker is None or not names:
        return x
    already = sorted(tracker.of(x) & set(names))
    if already:
        raise ValueError(
            f"{call}: Unsupported pcast from=varying, to='varying': x already varies over {already}. Cast only the "
            f"axes it is invariant over."
        )
    return tracker.vary(x, names)


class ManualAxisType(NamedTuple):
    """jax 0.10's ``ManualAxisType``: the manual mesh axes a value varies over (``varying``); ``unreduced`` and
    ``reduced`` are always empty here (cmap has no unreduced values)."""

    varying: Axes
    unreduced: Axes = NONE
    reduced: Axes = NONE


class Typeof(NamedTuple):
    """What :func:`typeof` returns: jax's ``ShapedArray`` as far as the types go."""

    shape: Tuple[int, ...]
    dtype: torch.dtype
    manual_axis_type: ManualAxisType
    order: Tuple[str, ...] = ()  # the mesh's axis order, for the printed form

    @property
    def vma(self) -> Axes:
        """The axes the value varies over (jax 0.8 and 0.9's ``typeof(x).vma``; jax 0.10's
        ``typeof(x).manual_axis_type.varying``)."""
        return self.manual_axis_type.varying

    def __str__(self) -> str:
        base = f"{str(self.dtype).replace('torch.', '')}[{','.join(map(str, self.shape))}]"
        names = [a for a in self.order if a in self.vma] + sorted(a for a in self.vma if a not in self.order)
        if not names:
            return base
        return base + "{V:" + (names[0] if len(names) == 1 else "(" + ",".join(names) + ")") + "}"


def typeof(x: torch.Tensor) -> Typeof:
    """jax's ``jax.typeof(x)``: the shape, dtype and varying manual axes of ``x`` (``typeof(x).vma``, jax 0.10's
    ``typeof(x).manual_axis_type.varying``, a frozenset of axis names).

    Inside a ``shard_map`` with ``check_vma=True`` (or an ``smap``), the mesh axes ``x`` varies over; elsewhere (outside
    any map, with ``check_vma=False``, in cmap's example axes) no axes: nothing is typed there.

    Example:
        >>> @partial(shard_map, mesh=mesh, in_specs=(P("i"), P()), out_specs=P())
        ... def f(x, w):
        ...     assert cm.typeof(x).vma == {"i"} and cm.typeof(w).vma == frozenset()
        ...     return cm.psum(x * w, "i")  # cm.typeof(...).vma: frozenset()
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"typeof(x): x must be a Tensor, got {type(x).__name__}.")
    tracker = current()
    axes = tracker.of(x) if tracker is not None else NONE
    order = tuple(tracker.links) if tracker is not None else ()
    return Typeof(tuple(x.shape), x.dtype, ManualAxisType(axes), order)
