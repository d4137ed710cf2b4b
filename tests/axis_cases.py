"""The collectives' cases, shared by the composition matrix and the jax parity check.

Each case is one jax.lax collective with its arguments, the shape of one example for a global batch of B, and an
oracle written with plain torch ops on the whole batch (so its gradients are torch's own, not cmap's).
"""

import functools
from typing import Any, Callable, Dict, List, NamedTuple, Tuple

import torch

import colossalai_cmap as cm


class Case(NamedTuple):
    """One collective call: ``getattr(cm, op)(v, "i", **kwargs(B))`` on an example of shape ``shape(B)``."""

    name: str
    op: str
    shape: Callable[[int], Tuple[int, ...]]
    kwargs: Callable[[int], Dict[str, Any]] = lambda B: {}
    differentiable: bool = True

    def f(self, B: int, axis: Any = "i") -> Callable[[torch.Tensor], torch.Tensor]:
        """The per-example function (a shard's, in batched mode: the ops take its rows)."""
        if self.op == "axis_index":
            return lambda v: v * cm.axis_index(axis)[..., None]
        kw = self.kwargs(B)
        return lambda v: getattr(cm, self.op)(v, axis, **kw)

    def ref(self, X: torch.Tensor) -> torch.Tensor:
        """The results of every example, from the whole batch ``X`` (B, *shape)."""
        return ORACLES[self.op](X, **self.kwargs(X.shape[0]))


def ring(B: int) -> List[Tuple[int, int]]:
    return [(i, (i + 1) % B) for i in range(B)]


CASES = [
    Case("psum", "psum", lambda B: (3,)),
    Case("pmean", "pmean", lambda B: (2, 3)),
    Case("pmax", "pmax", lambda B: (3,), differentiable=False),
    Case("pmin", "pmin", lambda B: (3,), differentiable=False),
    Case("all_gather", "all_gather", lambda B: (3,)),
    Case("all_gather axis=1", "all_gather", lambda B: (2, 3), lambda B: {"axis": 1}),
    Case("all_gather tiled", "all_gather", lambda B: (2, 3), lambda B: {"axis": 1, "tiled": True}),
    Case("psum_scatter", "psum_scatter", lambda B: (B, 3)),
    Case("psum_scatter dim=1", "psum_scatter", lambda B: (2, B), lambda B: {"scatter_dimension": 1}),
    Case("psum_scatter tiled", "psum_scatter", lambda B: (2 * B, 3), lambda B: {"tiled": True}),
    Case("all_to_all 0,0", "all_to_all", lambda B: (B, 3), lambda B: {"split_axis": 0, "concat_axis": 0}),
    Case("all_to_all 0,1", "all_to_all", lambda B: (B, 3), lambda B: {"split_axis": 0, "concat_axis": 1}),
    Case("all_to_all 1,0", "all_to_all", lambda B: (2, B), lambda B: {"split_axis": 1, "concat_axis": 0}),
    Case(
        "all_to_all tiled 0,1",
        "all_to_all",
        lambda B: (2 * B, 3),
        lambda B: {"split_axis": 0, "concat_axis": 1, "tiled": True},
    ),
    Case(
        "all_to_all tiled 1,0",
        "all_to_all",
        lambda B: (3, 2 * B),
        lambda B: {"split_axis": 1, "concat_axis": 0, "tiled": True},
    ),
    Case("ppermute ring", "ppermute", lambda B: (3,), lambda B: {"perm": ring(B)}),
    Case("ppermute partial", "ppermute", lambda B: (2, 3), lambda B: {"perm": [(0, B - 1)]}),
    Case("axis_index", "axis_index", lambda B: (3,)),
]

# axis_index_groups: one group of every example, in reverse order (B=2 and 3 split no other way into equal groups).
# Not in CASES: loop mode refuses them (its examples meet at one stacked value); test_axis_rules runs them.
GROUPED_CASES = [
    Case("psum grouped", "psum", lambda B: (3,), lambda B: {"axis_index_groups": [list(range(B))[::-1]]}),
    Case(
        "all_gather grouped",
        "all_gather",
        lambda B: (2, 3),
        lambda B: {"axis_index_groups": [list(range(B))[::-1]], "axis": 1},
    ),
    Case("pmax grouped", "pmax", lambda B: (3,), lambda B: {"axis_index_groups": [list(range(B))[::-1]]}, False),
    Case("pmin grouped", "pmin", lambda B: (3,), lambda B: {"axis_index_groups": [list(range(B))[::-1]]}, False),
]


# -------------------------------------------------------------------------------------------------- the oracles
def _each(B: int, fn: Callable[[int], torch.Tensor]) -> torch.Tensor:
    return torch.stack([fn(i) for i in range(B)])


def _psum(X: torch.Tensor, axis_index_groups: Any = None) -> torch.Tensor:
    if axis_index_groups is not None:  # each example, its group's sum
        sums = {i: torch.stack([X[j] for j in g]).sum(0) for g in axis_index_groups for i in g}
        return _each(X.shape[0], lambda i: sums[i])
    return X.sum(0, keepdim=True).expand_as(X)


def _extreme(X: torch.Tensor, reduce: Callable[..., torch.Tensor], axis_index_groups: Any = None) -> torch.Tensor:
    """Each example, the max or min over every example (or over its group)."""
    if axis_index_groups is None:
        return reduce(X, 0, keepdim=True).expand_as(X)
    found = {i: reduce(torch.stack([X[j] for j in g]), 0) for g in axis_index_groups for i in g}
    return _each(X.shape[0], lambda i: found[i])


def _all_gather(X: torch.Tensor, axis: int = 0, tiled: bool = False, axis_index_groups: Any = None) -> torch.Tensor:
    if axis_index_groups is not None:  # each example, its group's values in the group's order
        rows = {i: torch.stack([X[j] for j in g]) for g in axis_index_groups for i in g}
        return _each(X.shape[0], lambda i: _all_gather(rows[i], axis, tiled)[0])
    g = X.movedim(0, axis)
    g = g.flatten(axis, axis + 1) if tiled else g
    return g.unsqueeze(0).expand(X.shape[0], *g.shape)


def _psum_scatter(X: torch.Tensor, scatter_dimension: int = 0, tiled: bool = False) -> torch.Tensor:
    B, S, d = X.shape[0], X.sum(0), scatter_dimension
    if not tiled:
        return _each(B, lambda i: S.select(d, i))
    chunk = S.shape[d] // B
    return _each(B, lambda i: S.narrow(d, i * chunk, chunk))


def _all_to_all(X: torch.Tensor, split_axis: int, concat_axis: int, tiled: bool = False) -> torch.Tensor:
    B, s, c = X.shape[0], split_axis, concat_axis
    if not tiled:
        return _each(B, lambda i: torch.stack([X[j].select(s, i) for j in range(B)], c))
    chunk = X.shape[1 + s] // B
    return _each(B, lambda i: torch.cat([X[j].narrow(s, i * chunk, chunk) for j in range(B)], c))


def _ppermute(X: torch.Tensor, perm: List[Tuple[int, int]]) -> torch.Tensor:
    source = {dst: src for src, dst in perm}
    return _each(X.shape[0], lambda i: X[source[i]] if i in source else torch.zeros_like(X[i]))


ORACLES: Dict[str, Callable[..., torch.Tensor]] = {
    "psum": _psum,
    "pmean": lambda X: X.mean(0, keepdim=True).expand_as(X),
    "pmax": functools.partial(_extreme, reduce=torch.amax),
    "pmin": functools.partial(_extreme, reduce=torch.amin),
    "all_gather": _all_gather,
    "psum_scatter": _psum_scatter,
    "all_to_all": _all_to_all,
    "ppermute": _ppermute,
    "axis_index": lambda X: X * torch.arange(X.shape[0], dtype=X.dtype).reshape(-1, *[1] * (X.dim() - 1)),
}


# ------------------------------------------------------------------------------------ run on every rank of a world
BY_NAME = {case.name: case for case in CASES + GROUPED_CASES}

# (axis as the inner func names it, case): the inner map is "j" (mesh axis 1), the outer "i" (mesh axis 0)
NESTED = [
    ("j", "psum"),
    ("i", "psum"),
    (("i", "j"), "psum"),
    (("i", "j"), "all_gather"),
    (("i", "j"), "psum_scatter"),
    ("i", "all_to_all 0,1"),
    ("j", "all_to_all tiled 1,0"),
    ("i", "ppermute ring"),
    (("i", "j"), "ppermute ring"),
    (("i", "j"), "axis_index"),
    ("j", "pmax"),
]


def axis_size_of(axis: Any, B0: int, B1: int) -> int:
    return {"i": B0, "j": B1}[axis] if isinstance(axis, str) else B0 * B1


@functools.lru_cache(maxsize=None)
def _mesh() -> Any:
    from colossalai.cluster import ProcessGroupMesh

    return ProcessGroupMesh(2, 2)  # its groups are made once per world


def nested_cmap(case: Case, axis: Any, B0: int, B1: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """``cmap(cmap(f, "j"), "i")`` on a 2x2 ``ProcessGroupMesh``, f calling the collective over ``axis``."""
    mesh = _mesh()
    inner = cm.cmap(case.f(axis_size_of(axis, B0, B1), axis), axis_name="j", group=(mesh, 1))
    return cm.cmap(inner, axis_name="i", group=(mesh, 0))


def values_and_grads(name: str, X: Any, W: Any, nested_axis: Any = None) -> Tuple[Any, Any]:
    """cmap's values, and the gradient of ``(values.sin() * W).sum()`` (None if not differentiable), as numpy."""
    case = BY_NAME[name]
    x = torch.as_tensor(X).clone().requires_grad_(case.differentiable)
    if nested_axis is None:
        f = cm.cmap(case.f(x.shape[0]), axis_name="i")
    else:
        f = nested_cmap(case, nested_axis, x.shape[0], x.shape[1])
    y = f(x)
    if not case.differentiable:
        return y.detach().numpy(), None
    (g,) = torch.autograd.grad((y.sin() * torch.as_tensor(W)).sum(), x)
    return y.detach().numpy(), g.numpy()
