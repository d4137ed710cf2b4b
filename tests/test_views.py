"""Views and in-place results, as torch.vmap returns them: with src=None a view op's result, an in-place op's result
and the input itself come back as views of the caller's tensor (same base, data pointer, strides and offset), with no
gather, so later in-place writes to the input show through. The oracle is torch.vmap in the same process."""

import pytest
import torch
import torch.distributed as dist
from wire_tap import counting

from colossalai_cmap import cmap


def _real(B):
    return torch.arange(B * 4 * 6, dtype=torch.float32).reshape(B, 4, 6)


def _complex(B):
    return torch.complex(_real(B), -_real(B))


def _pairs(B):
    return torch.arange(B * 3 * 2, dtype=torch.float64).reshape(B, 3, 2)


# name, func, input maker, in_dims, out_dims
VIEW_OPS = [
    ("t", lambda t: t.t(), _real, 0, 0),
    ("T", lambda t: t.T, _real, 0, 0),
    ("transpose", lambda t: t.transpose(0, 1), _real, 1, 0),
    ("movedim", lambda t: t.movedim(1, 0), _real, 0, 1),
    ("select", lambda t: t.select(1, 2), _real, 0, 0),
    ("narrow", lambda t: t.narrow(1, 1, 3), _real, 2, 0),
    ("slice", lambda t: t[1:, ::2], _real, 0, -1),
    ("split", lambda t: t.split(2, 1), _real, 0, 0),
    ("tensor_split", lambda t: t.tensor_split(3, 1), _real, 0, 0),
    ("chunk", lambda t: t.chunk(2, 0), _real, 1, 0),
    ("unbind", lambda t: t.unbind(0), _real, 0, 0),
    ("unfold", lambda t: t.unfold(1, 2, 2), _real, 0, 0),
    ("diagonal", lambda t: t.diagonal(), _real, 0, 0),
    ("view", lambda t: t.view(24), _real, 0, 0),
    ("view_as", lambda t: t.view_as(t), _real, 0, 0),
    ("reshape", lambda t: t.reshape(2, 12), _real, 0, 0),
    ("reshape_as", lambda t: t.reshape_as(t), _real, 0, 1),
    ("squeeze", lambda t: t.unsqueeze(0).squeeze(0), _real, 0, 0),
    ("unsqueeze", lambda t: t.unsqueeze(1), _real, 2, 0),
    ("expand_as", lambda t: t[:1].expand_as(t), _real, 0, 0),
    ("real", lambda t: t.real, _complex, 0, 0),
    ("imag", lambda t: t.imag, _complex, 1, 0),
    ("view_as_real", torch.view_as_real, _complex, 0, 0),
    ("conj", torch.conj, _complex, 2, 0),
    ("view_as_complex", torch.view_as_complex, _pairs, 0, 0),
    ("view_as_complex_last", torch.view_as_complex, lambda B: _pairs(B).movedim(0, 1).contiguous(), 1, 0),
    ("expand_unmapped", lambda t, u: u.expand_as(t), lambda B: (_real(B), torch.randn(1, 6)), (0, None), 0),
    ("identity", lambda t: t, _real, 0, 0),
    ("identity_moved", lambda t: t, _real, 0, 2),
    ("contiguous", lambda t: t.contiguous(), _real, 0, 0),
    ("several", lambda t: (t[0], t.t(), t * 2), _real, 0, 0),
]


def _same_view(got, want, x, what):
    """``got`` is what vmap's ``want`` is: equal values, and the same view of ``x`` (or ``x`` itself)."""
    if isinstance(want, (tuple, list)):
        assert isinstance(got, type(want)) and len(got) == len(want), what
        for k, (g, w) in enumerate(zip(got, want)):
            _same_view(g, w, x, f"{what}[{k}]")
        return
    assert torch.equal(got, want), what
    assert (got is x) == (want is x), f"{what}: the input itself: cmap {got is x}, vmap {want is x}"
    if want._base is not None or want is x:  # a view of x (a computed output's buffer is cmap's own business)
        assert got._base is want._base, f"{what}: base"
        geometry = (got.data_ptr(), got.stride(), got.storage_offset(), got.dtype)
        assert geometry == (want.data_ptr(), want.stride(), want.storage_offset(), want.dtype), what


def check_view_ops(batch_sizes):
    """Every view op of the table, for each batch size (B < P too: empty shards), against vmap; then a write to the
    input shows through the result."""
    done = 0
    for B in batch_sizes:
        for name, func, make, in_dims, out_dims in VIEW_OPS:
            made = make(B)
            args = made if isinstance(made, tuple) else (made,)
            if B == 0 and name == "expand_unmapped":
                continue  # vmap refuses it (expand to a size-0 batch)
            want = torch.vmap(func, in_dims, out_dims)(*args)
            got = cmap(func, in_dims, out_dims)(*args)
            x = args[-1] if name == "expand_unmapped" else args[0]
            _same_view(got, want, x, f"{name} B={B}")
            x.mul_(2)
            first = got[0] if isinstance(got, (tuple, list)) else got
            again = torch.vmap(func, in_dims, out_dims)(*args)
            assert torch.equal(first, again[0] if isinstance(again, (tuple, list)) else again), f"{name} shows"
            done += 1
    return done


def _expected_view_ops(sizes):
    return len(sizes) * len(VIEW_OPS) - (0 in sizes)


@pytest.mark.parametrize("P", [1, 2, 3])
def test_view_ops_are_views_of_the_input(worlds, P):
    sizes = [0, 1, 2, 5] if P > 1 else [0, 3]
    assert worlds(P).run(check_view_ops, sizes) == [_expected_view_ops(sizes)] * P


def check_in_place():
    """In-place ops with in_dims != out_dims return the moved input (a view of it); with equal dims the input
    itself; the values are vmap's, on every rank; later writes show through."""
    x = torch.rand(4, 3, 5)
    want_x = x.clone()
    want = torch.vmap(torch.Tensor.acos_, in_dims=2)(want_x)
    got = cmap(torch.Tensor.acos_, in_dims=2)(x)
    assert torch.equal(x, want_x) and torch.equal(got, want)
    assert got._base is x and got.stride() == want.stride() and got.data_ptr() == x.data_ptr()
    x.add_(1)
    assert torch.equal(got, x.movedim(2, 0))
    y = torch.rand(5, 3)
    same = cmap(lambda t: t.mul_(3))(y)
    assert same is y
    z = torch.rand(3, 5)
    moved = cmap(lambda t: t.sub_(1), in_dims=1, out_dims=1)(z)
    assert moved is z
    # fewer examples than ranks: the empty shards' stand-in is the first row itself, which they change too
    one = torch.rand(1, 4)
    one_ref = torch.vmap(lambda t: t.mul_(2).add_(1))(one.clone())
    changed = cmap(lambda t: t.mul_(2).add_(1))(one)
    assert changed is one and torch.equal(one, one_ref)
    moved_one = cmap(lambda t: t.mul_(2), in_dims=1)(torch.ones(4, 1))
    assert torch.equal(moved_one, torch.full((1, 4), 2.0)) and moved_one._base is not None
    # torch's in-place fallback (an op with no batching rule): its result is a view of the input too
    w = torch.rand(5, 2, 3)
    w_ref = w.clone()
    out = cmap(lambda t: t.index_fill_(0, torch.tensor([1]), 7.0), in_dims=1)(w)
    ref = torch.vmap(lambda t: t.index_fill_(0, torch.tensor([1]), 7.0), in_dims=1)(w_ref)
    assert torch.equal(out, ref) and out._base is w and out.stride() == ref.stride()
    return True


@pytest.mark.parametrize("P", [1, 2, 3])
def test_in_place_results_are_the_input(worlds, P):
    assert worlds(P).run(check_in_place) == [True] * P


def check_placements_and_grad():
    """dst=r: the receiver gets the view, the others None; dst='local': each rank's view of its own rows; an input
    that requires grad still gets vmap's values and gradients (such outputs are gathered)."""
    rank = dist.get_rank()
    x = torch.randn(5, 4, 6)
    got = cmap(lambda t: t.t(), dst=0)(x)
    if rank == 0:
        assert got._base is x and torch.equal(got, x.transpose(1, 2))
    else:
        assert got is None
    mine = cmap(lambda t: t.t(), dst="local")(x)
    assert mine._base is x
    w = torch.randn(5, 3, requires_grad=True)
    out = cmap(lambda t: t.t())(w)
    (g,) = torch.autograd.grad((out * torch.arange(3.0)).sum(), w)
    (g_ref,) = torch.autograd.grad((torch.vmap(lambda t: t.t())(w) * torch.arange(3.0)).sum(), w)
    assert torch.equal(out, w) and torch.equal(g, g_ref)
    return True


def test_placements_and_gradients(worlds):
    assert worlds(3).run(check_placements_and_grad) == [True] * 3


def check_no_gather():
    """A view output moves no data: only the status round, against the gather a copy costs."""
    x = torch.randn(64, 256)
    f_view = cmap(lambda t: t[::2])
    f_copy = cmap(lambda t: t[::2].clone())
    f_view(x), f_copy(x)  # planned once
    with counting() as view_log:
        f_view(x)
    with counting() as copy_log:
        f_copy(x)
    return view_log.sent, copy_log.sent


def test_view_outputs_move_no_data(worlds):
    for view_sent, copy_sent in worlds(2).run(check_no_gather):
        assert view_sent < 4096 < 32 * 128 * 4 <= copy_sent, (view_sent, copy_sent)


def check_out_dims_errors():
    """vmap's sentences (and types) for out_dims out of range or of the wrong type."""
    x = torch.randn(2, 3, 5)
    for bad in (3, -4):
        with pytest.raises(IndexError, match="Dimension out of range"):
            cmap(lambda t: t, out_dims=bad)(x)
    for bad in ("lol", ("lol",)):
        with pytest.raises(ValueError, match="must be an int, None or a python collection of ints"):
            cmap(lambda t: t, out_dims=bad)(x)
    return True


@pytest.mark.parametrize("P", [1, 2])
def test_out_dims_errors_say_what_vmap_says(worlds, P):
    assert worlds(P).run(check_out_dims_errors) == [True] * P
