"""Tiled ``all_to_all`` and ``psum_scatter`` along ``shard_map`` mesh axes whose size does not divide the dim.

Rank ``i``'s chunk is the ``i``-th ``torch.tensor_split`` piece (the first ``length % n`` one longer), as shard_map's
blocks are. The oracle is the global function written by hand in this (single) process: every rank's block, the
chunks taken with ``tensor_split``, concatenated or summed, and its gradients from plain autograd. Worlds of 3 and
4 ranks, on a 1-d mesh and on a 2x2 mesh with tuple axis names (in both orders: the first name is major).

In float64. ``all_to_all`` and its gradient only move values, and so does ``psum_scatter``'s gradient (each entry
of the summed cotangent has one nonzero term): bit for bit. ``psum_scatter``'s value sums n <= 4 terms in another
order than the oracle's: within ``sum_tolerance``.
"""

from typing import Any, Dict, List, Optional, Sequence, Tuple

import pytest
import torch
import torch.distributed as dist
from cases import assert_same, randn, sum_tolerance
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import colossalai_cmap as cm
from colossalai_cmap import P

DOUBLE = torch.float64
# One DeviceMesh per shape and names in each worker: creating one makes new groups, a collective step.
_MESHES: Dict[Tuple[Tuple[int, ...], Tuple[str, ...]], DeviceMesh] = {}


def _mesh(shape: Tuple[int, ...], names: Tuple[str, ...]) -> DeviceMesh:
    key = (shape, names)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[key]


def _op(op: str, x: torch.Tensor, axis: Any, kwargs: Dict[str, int]) -> torch.Tensor:
    if op == "all_to_all":
        return cm.all_to_all(x, axis, kwargs["split_axis"], kwargs["concat_axis"], tiled=True)
    return cm.psum_scatter(x, axis, scatter_dimension=kwargs["scatter_dimension"], tiled=True)


# ------------------------------------------------------------------------------------------ run on every rank
def per_rank(op: str, shape: Tuple[int, ...], kwargs: Dict[str, int], mesh_shape: Tuple[int, ...], axis: Any) -> Any:
    """This rank's block (its own, ``local=True``) through the op; its output, and its block's gradient of the sum
    over ranks of ``(output * cotangent).sum()``, each rank with its own cotangent."""
    names = ("i",) if len(mesh_shape) == 1 else ("x", "y")
    mesh, rank = _mesh(mesh_shape, names), dist.get_rank()
    block = randn(*shape, seed=100 + rank, dtype=DOUBLE).requires_grad_()
    out = cm.shard_map(lambda b: _op(op, b, axis, kwargs), mesh, P(axis), P(axis), local=True)(block)
    (out * randn(*out.shape, seed=200 + rank, dtype=DOUBLE)).sum().backward()
    return out.detach(), block.grad


def reshard_rows_to_columns(rows: int, cols: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A global (rows, cols) matrix, batch-sharded in and feature-sharded out by one all_to_all: the same matrix,
    as long as all_to_all's chunks are shard_map's blocks. Its gradient is the cotangent itself."""
    mesh = _mesh((dist.get_world_size(),), ("i",))
    x = randn(rows, cols, seed=1, dtype=DOUBLE).requires_grad_()
    f = cm.shard_map(lambda b: cm.all_to_all(b, "i", 1, 0, tiled=True), mesh, P("i"), P(None, "i"))
    out = f(x)
    cotangent = randn(rows, cols, seed=2, dtype=DOUBLE)
    (out * cotangent).sum().backward()
    return x.detach(), out.detach(), x.grad


def blocks_of_two_lengths(n: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """A batch split by rows (2 per rank) and a weight by its 10 columns, along one axis, with a replicated bias:
    blocks of different lengths cut and assembled together. Each (value, gradient) should be (k * x, k * cotangent).
    """
    mesh = _mesh((n,), ("i",))
    xs = [
        randn(*shape, seed=3 + k, dtype=DOUBLE).requires_grad_() for k, shape in enumerate([(2 * n, 3), (3, 10), (3,)])
    ]
    f = cm.shard_map(
        lambda a, w, b: (a * 2, w * 3, b * 4), mesh, (P("i"), P(None, "i"), P()), (P("i"), P(None, "i"), P())
    )
    outs = f(*xs)
    cotangents = [randn(*x.shape, seed=13 + k, dtype=DOUBLE) for k, x in enumerate(xs)]
    sum((o * c).sum() for o, c in zip(outs, cotangents)).backward()
    return [(o.detach(), x.grad) for o, x in zip(outs, xs)]


# ---------------------------------------------------------------------------------------- the global oracle
def reference(op: str, blocks: List[torch.Tensor], kwargs: Dict[str, int], member: Sequence[int]) -> Any:
    """Each rank's output and its block's gradient, in one process; ``member[q]`` is rank q's index in the axis."""
    n = len(blocks)
    blocks = [b.clone().requires_grad_() for b in blocks]
    ordered = [blocks[q] for q in sorted(range(n), key=lambda q: member[q])]  # in the axis's order
    if op == "all_to_all":
        s, c = kwargs["split_axis"], kwargs["concat_axis"]
        outs = [torch.cat([b.tensor_split(n, dim=s)[member[q]] for b in ordered], dim=c) for q in range(n)]
    else:
        d = kwargs["scatter_dimension"]
        total = torch.stack(ordered).sum(0)
        outs = [total.tensor_split(n, dim=d)[member[q]] for q in range(n)]
    loss = sum((o * randn(*o.shape, seed=200 + q, dtype=DOUBLE)).sum() for q, o in enumerate(outs))
    grads = torch.autograd.grad(loss, blocks)
    return [o.detach() for o in outs], list(grads)


def check(op: str, results: List[Any], shape: Tuple[int, ...], kwargs: Dict[str, int], member: Sequence[int]):
    n = len(results)
    blocks = [randn(*shape, seed=100 + q, dtype=DOUBLE) for q in range(n)]
    outs, grads = reference(op, blocks, kwargs, member)
    tol: Optional[Dict[str, float]] = None
    if op == "psum_scatter":
        tol = sum_tolerance(n, torch.stack(blocks).abs().sum(0), DOUBLE)
    for q, (out, grad) in enumerate(results):
        assert_same(out, outs[q], exact=tol or True, what=f"{op} {shape} {kwargs} rank {q} value")
        assert_same(grad, grads[q], what=f"{op} {shape} {kwargs} rank {q} gradient")


# (op, block shape, arguments): the tiled dim has length 7 or 5 (no world here divides them) or 12 (every one).
CASES = [
    ("all_to_all", (2, 7, 3), dict(split_axis=1, concat_axis=2)),
    ("all_to_all", (7, 2), dict(split_axis=0, concat_axis=1)),
    ("all_to_all", (3, 5), dict(split_axis=-1, concat_axis=0)),
    ("all_to_all", (2, 12), dict(split_axis=1, concat_axis=0)),  # divides: jax's equal chunks
    ("psum_scatter", (3, 7), dict(scatter_dimension=1)),
    ("psum_scatter", (5, 2), dict(scatter_dimension=0)),
    ("psum_scatter", (12, 2), dict(scatter_dimension=0)),  # divides
]


@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("op, shape, kwargs", CASES, ids=[f"{c[0]}-{'x'.join(map(str, c[1]))}" for c in CASES])
def test_uneven_chunks_on_a_line(worlds, n, op, shape, kwargs):
    results = worlds(n).run(per_rank, op, shape, kwargs, (n,), "i")
    check(op, results, shape, kwargs, member=range(n))


@pytest.mark.parametrize("axis", [("x", "y"), ("y", "x")])
@pytest.mark.parametrize("op, shape, kwargs", [CASES[0], CASES[4]], ids=["all_to_all", "psum_scatter"])
def test_uneven_chunks_over_tuple_axes(worlds, axis, op, shape, kwargs):
    """A 2x2 mesh: rank q sits at (q // 2, q % 2); over ("y", "x") its index is y * 2 + x."""
    results = worlds(4).run(per_rank, op, shape, kwargs, (2, 2), axis)
    member = range(4) if axis == ("x", "y") else [(q % 2) * 2 + q // 2 for q in range(4)]
    check(op, results, shape, kwargs, member)


@pytest.mark.parametrize("n", [3, 4])
def test_all_to_all_chunks_are_shard_map_blocks(worlds, n):
    """Rows to columns with 10 columns (uneven over 3 and 4): the global value and its gradient are unchanged."""
    for x, out, grad in worlds(n).run(reshard_rows_to_columns, 2 * n, 10):
        assert_same(out, x, what="resharded value")
        assert_same(grad, randn(2 * n, 10, seed=2, dtype=DOUBLE), what="resharded gradient")


@pytest.mark.parametrize("n", [3, 4])
def test_blocks_of_different_lengths_along_one_axis(worlds, n):
    """A batch's row blocks and a weight's column blocks ride one axis (the example's shard_map Linear): each
    exchange carries one length per rank, so they travel apart, forward and backward."""
    for rank_result in worlds(n).run(blocks_of_two_lengths, n):
        for k, (out, grad) in enumerate(rank_result):
            shape = [(2 * n, 3), (3, 10), (3,)][k]
            assert_same(out, (k + 2) * randn(*shape, seed=3 + k, dtype=DOUBLE), what=f"leaf {k} value")
            assert_same(grad, (k + 2) * randn(*shape, seed=13 + k, dtype=DOUBLE), what=f"leaf {k} gradient")


def test_cmap_axes_keep_jax_division():
    """Along a cmap axis the examples share one vmapped shape: a tiled dim the batch does not divide still raises."""
    x = torch.zeros(3, 5)
    for f in (
        lambda v: cm.all_to_all(v, "i", 0, 0, tiled=True),
        lambda v: cm.psum_scatter(v, "i", tiled=True),
    ):
        with pytest.raises(ValueError, match="do not divide"):
            cm.cmap(f, axis_name="i")(x)
