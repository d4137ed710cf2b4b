"""Test support: what each rank sends, counted per collective under its ring algorithm, by wrapping
``torch.distributed`` (never replacing it).

The counter patches the module's collective functions for the duration of a ``with`` block (the code under test
calls them through ``torch.distributed``), so it sees cmap, shard_map, shard_model and hand-written code alike.
Per rank, a ring all-gather of n bytes sends (P - 1) n, an all-reduce 2 (P - 1) / P n, a reduce-scatter of an
n-byte input (P - 1) / P n, an all-to-all its input less its own part, and a point-to-point send its bytes.
:func:`native_bound` gives what each jax.lax collective costs natively, forward and backward.
"""

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Tuple

import torch
import torch.distributed as dist


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _size(group: Any) -> int:
    return dist.get_world_size(group)


def _rank(group: Any) -> int:
    return dist.get_rank(group)


def _all_to_all(
    out: Any, inp: Any, out_splits: Any = None, in_splits: Any = None, group: Any = None, **_: Any
) -> float:
    n = _nbytes(inp)
    if not in_splits:
        return n * (_size(group) - 1) / _size(group)
    row = n // max(sum(in_splits), 1)
    return row * (sum(in_splits) - in_splits[_rank(group)])


def _gather(t: Any, gather_list: Any = None, dst: int = 0, group: Any = None, **_: Any) -> float:
    return 0 if dist.get_rank() == dst else _nbytes(t)


def _scatter(t: Any, scatter_list: Any = None, src: int = 0, group: Any = None, **_: Any) -> float:
    return 0 if dist.get_rank() != src else _nbytes(t) * (_size(group) - 1)


def _p2p(ops: List[Any]) -> float:
    return sum(_nbytes(op.tensor) for op in ops if op.op in (dist.isend, dist.send))


# function name -> sent bytes per rank, from its arguments (positional as torch.distributed takes them)
RING: Dict[str, Callable[..., float]] = {
    "all_gather_into_tensor": lambda out, inp, group=None, **_: (_size(group) - 1) * _nbytes(inp),
    "all_gather": lambda outs, inp, group=None, **_: (_size(group) - 1) * _nbytes(inp),
    "all_reduce": lambda t, op=None, group=None, **_: 2 * (_size(group) - 1) / _size(group) * _nbytes(t),
    "reduce_scatter_tensor": lambda out, inp, op=None, group=None, **_: (_size(group) - 1)
    / _size(group)
    * _nbytes(inp),
    "all_to_all_single": _all_to_all,
    "broadcast": lambda t, src=0, group=None, **_: (_size(group) - 1) / _size(group) * _nbytes(t),
    "gather": _gather,
    "scatter": _scatter,
    "batch_isend_irecv": _p2p,
    "isend": lambda t, dst=0, **_: _nbytes(t),
    "send": lambda t, dst=0, **_: _nbytes(t),
}


@dataclass
class WireLog:
    """The collectives seen, as (function, bytes sent by this rank), in order; where each went, as (function,
    process group, dtype of the tensor sent); and the order in which they were issued and waited for, as ("issue" or
    "wait", function), so that a test sees which collectives were in flight together."""

    calls: List[Tuple[str, float]] = field(default_factory=list)
    where: List[Tuple[str, Any, Any]] = field(default_factory=list)
    events: List[Tuple[str, str]] = field(default_factory=list)

    @property
    def sent(self) -> float:
        return sum(b for _, b in self.calls)

    @property
    def count(self) -> int:
        return len(self.calls)

    def names(self) -> List[str]:
        return [name for name, _ in self.calls]


@contextlib.contextmanager
def counting() -> Iterator[WireLog]:
    """Count what this rank sends inside the block (every collective of ``torch.distributed``)."""
    log = WireLog()
    saved = {name: getattr(dist, name) for name in RING}

    def wrap(name: str, fn: Callable) -> Callable:
        def counted(*args: Any, **kwargs: Any) -> Any:
            log.calls.append((name, float(RING[name](*args, **kwargs))))
            sent = [a for a in args if isinstance(a, torch.Tensor)][-1:]
            log.where.append((name, kwargs.get("group") or dist.group.WORLD, sent[0].dtype if sent else None))
            log.events.append(("issue", name))
            work = fn(*args, **kwargs)
            if not kwargs.get("async_op") or work is None:
                log.events.append(("wait", name))
                return work
            return _Watched(work, name, log)

        return counted

    for name, fn in saved.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield log
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


class _Watched:
    """A collective's work left in flight, which logs its wait (the work's other methods pass through)."""

    def __init__(self, work: Any, name: str, log: WireLog) -> None:
        self._work, self._name, self._log = work, name, log

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self._log.events.append(("wait", self._name))
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._work, attr)


def native_bound(op: str, n: int, P: int) -> Tuple[float, float]:
    """(forward, backward) bytes one rank sends in the native algorithm of jax.lax's ``op`` on an n-byte value per
    rank (``psum_scatter`` and ``all_to_all`` tiled; ``ppermute`` a ring)."""
    reduce, gather, scatter = 2 * (P - 1) / P * n, (P - 1) * n, (P - 1) / P * n
    return {
        "psum": (reduce, reduce),
        "all_gather": (gather, gather),  # backward: a reduce-scatter of the P n gathered bytes
        "psum_scatter": (scatter, scatter),  # backward: an all-gather of n / P bytes per rank
        "all_to_all": (scatter, scatter),
        "ppermute": (n, n),
    }[op]


# ------------------------------------------------------------------------------------------ the measured workload
OPS = ("psum", "all_gather", "psum_scatter", "all_to_all", "ppermute")
# The workloads: jax.pmap's shape over one axis; shard_map over a tuple of two mesh axes (a 2 x P/2 mesh, in both
# orders of the names: the group's ranks are in index order for the first, not for the second); and tiled chunks
# that the axis size does not divide (one element fewer than a multiple of it).
KINDS = ("cmap", "shard_map", "shard_map ('x', 'y')", "shard_map ('y', 'x')", "shard_map uneven")
UNEVEN_OPS = ("psum_scatter", "all_to_all")
ROUND_CAP = 48 + 1024  # a round's header and its largest payload, per rank (wire/rounds.py)
_MESHES: Dict[Tuple[int, ...], Any] = {}


def body(op: str, size: int, axis: Any = "i") -> Callable[[torch.Tensor], torch.Tensor]:
    """``op`` over the axis ``axis`` (a name or a tuple of names) of ``size`` members, tiled where jax.lax has the
    choice."""
    import colossalai_cmap as cm

    if op == "psum":
        return lambda v: cm.psum(v, axis)
    if op == "all_gather":
        return lambda v: cm.all_gather(v, axis, tiled=True)
    if op == "psum_scatter":
        return lambda v: cm.psum_scatter(v, axis, tiled=True)
    if op == "all_to_all":
        return lambda v: cm.all_to_all(v, axis, 0, 0, tiled=True)
    return lambda v: cm.ppermute(v, axis, [(j, (j + 1) % size) for j in range(size)])


def _mesh(shape: Tuple[int, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    if shape not in _MESHES:
        _MESHES[shape] = init_device_mesh("cpu", shape, mesh_dim_names=("i",) if len(shape) == 1 else ("x", "y"))
    return _MESHES[shape]


def mapped(kind: str, op: str, n: int) -> Tuple[Callable[[torch.Tensor], torch.Tensor], Tuple[int, ...]]:
    """The call ``kind`` makes of ``op``, and the shape of this rank's value (n bytes of float32, but for "uneven":
    one element fewer)."""
    import colossalai_cmap as cm

    size = dist.get_world_size()
    if kind == "cmap":
        return cm.cmap(body(op, size), axis_name="i", src="local", dst="local"), (1, n // 4)
    if kind == "shard_map":
        return cm.shard_map(body(op, size), _mesh((size,)), cm.P("i"), cm.P("i"), local=True), (n // 4,)
    if kind == "shard_map uneven":
        return cm.shard_map(body(op, size), _mesh((size,)), cm.P("i"), cm.P("i"), local=True), (n // 4 - 1,)
    axis = ("x", "y") if kind == "shard_map ('x', 'y')" else ("y", "x")
    f = cm.shard_map(body(op, size, axis), _mesh((2, size // 2)), cm.P(axis), cm.P(axis), local=True)
    return f, (n // 4,)


def measure(kind: str, sizes: Tuple[int, ...]) -> List[Tuple[str, int, float, float, int, int]]:
    """On this rank, for each op and value size n (bytes per rank): (op, n, forward bytes, backward bytes, forward
    collectives, backward collectives), the third call of jax.pmap's shape (one example of n bytes per rank):
    ``cmap(f, axis_name="i", src="local", dst="local")``, or ``shard_map(f, mesh, P(axis), P(axis), local=True)``
    over one axis, a tuple of axes, or with uneven tiled chunks (see :data:`KINDS`)."""
    rows = []
    for op in UNEVEN_OPS if kind == "shard_map uneven" else OPS:
        for n in sizes:
            f, shape = mapped(kind, op, n)
            for _ in range(3):
                x = torch.randn(shape).requires_grad_()
                with counting() as fwd:
                    y = f(x)
                with counting() as bwd:
                    y.sum().backward()
            rows.append((op, x.numel() * 4, fwd.sent, bwd.sent, fwd.count, bwd.count))
    return rows
