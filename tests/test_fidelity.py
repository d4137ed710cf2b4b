"""cmap where third-party code looks: the cases found by running vmap's own behaviours, random calls and jax's
shard_map tutorial through cmap. The oracle is single-process ``torch.vmap`` / ``torch.func`` (or the math), on the
same inputs, at P = 1 to 4. Where a sum over examples is split over ranks and added in another order, the data are float64
and the comparison ``cases.F64``: reordering a float64 sum of at most a few dozen terms of size ~1 moves it by
under 1e-13, far inside 1e-7, on any CPU."""

import pytest
import torch
import torch.distributed as dist
from cases import F64, randn

import colossalai_cmap as cm

WORLDS = [1, 2, 3, 4]


def _rows(B: int) -> slice:
    """This rank's rows under dst="local" / src="local": ``torch.tensor_split``'s share."""
    rank, size = dist.get_rank(), dist.get_world_size()
    sizes = [len(c) for c in torch.arange(B).tensor_split(size)]
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


# ------------------------------------------------------------------------------- gradients taken inside func
def check_grad_inside_func():
    """``torch.autograd.grad`` inside func with respect to a captured tensor is per example, as in vmap (a vjp
    against each row of the identity is the Jacobian); only the gradient into the caller's graph sums over ranks."""
    x, y = randn(3, seed=1, dtype=torch.float64).requires_grad_(), randn(3, seed=2, dtype=torch.float64)

    def vjp_mul(v):
        return torch.autograd.grad([x * y], [x], grad_outputs=[v])[0]

    expected = torch.vmap(vjp_mul)(torch.eye(3))
    got = cm.cmap(vjp_mul)(torch.eye(3))
    assert torch.equal(expected, torch.diagflat(y)) and torch.equal(got, expected), got

    def vjp_square(v):  # a second-order use: the inner gradient is part of the outer graph
        return torch.autograd.grad([x * x * y], [x], grad_outputs=[v], create_graph=True)[0]

    for B in (2, 5, 7):
        v = randn(B, 3, seed=B, dtype=torch.float64)
        torch.vmap(vjp_square)(v).sum().backward()
        x_grad, x.grad = x.grad, None
        out = cm.cmap(vjp_square)(v)
        torch.testing.assert_close(out, 2 * x.detach() * y * v)
        out.sum().backward()
        # sum over B rows of 2*y*v: the same terms, summed in another order across ranks
        torch.testing.assert_close(x.grad, x_grad, **F64)
        x.grad = None
    return True


@pytest.mark.parametrize("P", WORLDS)
def test_grad_inside_func_is_per_example(worlds, P):
    assert worlds(P).run(check_grad_inside_func) == [True] * P


# ---------------------------------------------------------------------- replicated inputs under dst="local"
def check_data_parallel_local(B):
    """Data parallelism as in jax's shard_map tutorial: each rank maps its own examples (src="local",
    dst="local"), the weights are unmapped and the same on every rank, the loss is taken from the local outputs.
    After backward every rank holds the full gradient (the transpose of using a replicated value is a psum of the
    cotangents), equal to single-process autograd of the loss summed over every rank's examples."""
    x_all, t_all = randn(B, 6, seed=11, dtype=torch.float64), randn(B, 2, seed=12, dtype=torch.float64)
    w0, b0 = randn(6, 2, seed=13, dtype=torch.float64), randn(2, seed=14, dtype=torch.float64)
    rows = _rows(B)

    def predict(w, b, xi):
        return torch.tanh(xi @ w + b)

    w, b = w0.clone().requires_grad_(), b0.clone().requires_grad_()
    out = cm.cmap(predict, in_dims=(None, None, 0), src="local", dst="local")(w, b, x_all[rows])
    ((out - t_all[rows]) ** 2).sum().backward()
    wr, br = w0.clone().requires_grad_(), b0.clone().requires_grad_()
    ((torch.vmap(predict, in_dims=(None, None, 0))(wr, br, x_all) - t_all) ** 2).sum().backward()
    for got, exp in ((w.grad, wr.grad), (b.grad, br.grad)):
        torch.testing.assert_close(got, exp, **F64)
    # the same with an optimizer: every rank's model stays the same as the single-process one
    opt_w = torch.optim.SGD([w, b], lr=0.1)
    opt_w.step()
    torch.testing.assert_close(w, wr.detach() - 0.1 * wr.grad, **F64)
    return True


@pytest.mark.parametrize("P", WORLDS)
def test_replicated_inputs_get_full_gradient_with_local_dst(worlds, P):
    assert worlds(P).run(check_data_parallel_local, 7) == [True] * P


def check_mapped_full_input_local_dst(B):
    """src=None, dst="local": the mapped input is one global value every rank holds whole, so its gradient is the
    total derivative of the per-rank losses summed: every row filled, on every rank, equal to vmap's."""
    x, w = randn(B, 4, seed=8, dtype=torch.float64), randn(4, seed=9, dtype=torch.float64)
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    cm.cmap(torch.mul, in_dims=(0, None), dst="local")(xl, wl).sin().sum().backward()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    torch.vmap(torch.mul, in_dims=(0, None))(xr, wr).sin().sum().backward()
    assert torch.equal(xl.grad, xr.grad)  # each row's gradient comes from exactly one rank: exact
    torch.testing.assert_close(wl.grad, wr.grad, **F64)
    return True


@pytest.mark.parametrize("P", WORLDS)
def test_mapped_input_gradient_with_local_dst(worlds, P):
    assert worlds(P).run(check_mapped_full_input_local_dst, 7) == [True] * P


# ----------------------------------------------------------------------------------- loop mode with an axis
def check_loop_mode_with_axis(B):
    """mode="loop" with axis_name: gradients are vmap's (never P times them), even after earlier autograd history
    on this thread and with uneven shares; randomness="same" gives every example the same draws; an out_dims=None
    output that depends on the example is refused as vmap refuses it."""
    (torch.ones(1, requires_grad=True) * 2).sum()  # any earlier autograd history on this thread
    x = randn(B, 3, seed=21, dtype=torch.float64).requires_grad_()
    cm.cmap(lambda v: v * 2 + cm.axis_index("i"), mode="loop", axis_name="i")(x).sum().backward()
    assert torch.equal(x.grad, torch.full((B, 3), 2.0, dtype=torch.float64)), x.grad
    w = randn(
        3, seed=22, dtype=torch.float64
    ).requires_grad_()  # a closure-captured weight: its gradient is the sum over every example
    with torch.no_grad():
        total = cm.cmap(lambda v: cm.psum(v, "i"), mode="loop", axis_name="i", out_dims=None)(x.detach())
    torch.testing.assert_close(total, x.detach().sum(0))
    cm.cmap(lambda v: (v * w).sum(), mode="loop", axis_name="i")(x.detach()).sum().backward()
    torch.testing.assert_close(w.grad, x.detach().sum(0), **F64)
    torch.manual_seed(0)
    same = cm.cmap(lambda v: torch.rand(2), mode="loop", randomness="same", axis_name="i")(x.detach())
    assert torch.unique(same, dim=0).shape[0] == 1, same
    different = cm.cmap(lambda v: torch.rand(2), mode="loop", randomness="different", axis_name="i")(x.detach())
    assert torch.unique(different, dim=0).shape[0] == B, different
    with pytest.raises(ValueError, match="can not return a BatchedTensor when out_dim is None"):
        cm.cmap(lambda v: v * 2, out_dims=None, mode="loop")(torch.arange(float(B)).view(B, 1))
    return True


@pytest.mark.parametrize("P", WORLDS)
def test_loop_mode_with_axis(worlds, P):
    assert worlds(P).run(check_loop_mode_with_axis, 2 * P + 1) == [True] * P


def check_loop_mode_follows_vmap():
    """Loop mode raises vmap's error for a random draw under randomness="error", and returns vmap's empty result at
    B=0 (func runs once on a zero example to learn the outputs)."""
    x = torch.arange(4.0).view(4, 1)
    with pytest.raises(RuntimeError, match="called random operation while in randomness error mode"):
        cm.cmap(lambda v: v + torch.rand(1), mode="loop")(x)
    empty = torch.empty(0, 3)
    for mode in ("vmap", "loop"):
        got = cm.cmap(lambda v: (v * 2, v.sum()), mode=mode)(empty)
        expected = torch.vmap(lambda v: (v * 2, v.sum()))(empty)
        assert [t.shape for t in got] == [t.shape for t in expected], (mode, got)
    return True


@pytest.mark.parametrize("P", WORLDS)
def test_loop_mode_follows_vmap(worlds, P):
    assert worlds(P).run(check_loop_mode_follows_vmap) == [True] * P


def check_requires_grad_as_vmap():
    """An output vmap returns with requires_grad=False comes back the same from cmap, when another output needs grad."""
    x, y = randn(5, 3, seed=31).requires_grad_(), randn(5, 3, seed=32)
    a, b = cm.cmap(lambda u, v: (u * 2, v * 2))(x, y)
    ea, eb = torch.vmap(lambda u, v: (u * 2, v * 2))(x, y)
    assert (a.requires_grad, b.requires_grad) == (ea.requires_grad, eb.requires_grad) == (True, False)
    b.numpy()  # raises if it requires grad
    return True


@pytest.mark.parametrize("P", WORLDS)
def test_requires_grad_as_vmap(worlds, P):
    assert worlds(P).run(check_requires_grad_as_vmap) == [True] * P


# ------------------------------------------------------------------------------- what backward may touch
def check_dst_rank_refuses_every_grad():
    """dst=r: the refusal is the same for every tensor that requires grad, however func reached it (an argument, a
    closure, a keyword); no rank writes a ``.grad`` alone."""
    rank = dist.get_rank()
    W, x = randn(3, 2, seed=41).requires_grad_(), randn(6, 3, seed=42)
    calls = [
        lambda: cm.cmap(lambda v: v @ W, dst=0)(x),
        lambda: cm.cmap(lambda v: (v @ W, W), dst=0, out_dims=(0, None))(x),
        lambda: cm.cmap(lambda v, w=None: v @ w, dst=0)(x, w=W),
    ]
    for call in calls:
        out = call()
        if rank != 0:
            assert out is None
            continue
        first = out[0] if isinstance(out, tuple) else out
        with pytest.raises(RuntimeError, match="is not differentiable; use dst=-1"):
            first.sum().backward()
        if isinstance(out, tuple):
            with pytest.raises(RuntimeError, match="is not differentiable"):
                out[1].sum().backward()
    assert W.grad is None
    return True


@pytest.mark.parametrize("P", WORLDS)
def test_dst_rank_refuses_every_grad(worlds, P):
    assert worlds(P).run(check_dst_rank_refuses_every_grad) == [True] * P


# ----------------------------------------------------------------------------------- vmap's own behaviours
def check_vmap_words():
    """Every argument error vmap raises, cmap raises with vmap's own sentence in it (plus cmap's context)."""
    x = torch.arange(4.0).view(4, 1)
    cases = [
        (lambda: cm.cmap(lambda v: v, chunk_size=0)(x), "vmap: chunk_size should be None or greater than 0."),
        (lambda: cm.cmap(lambda: 1)(), "got no inputs"),
        (
            lambda: cm.cmap(lambda a, b: a + b)(torch.ones(3, 2), torch.ones(4, 2)),
            "Expected all tensors to have the same size in the mapped dimension",
        ),
        (
            lambda: cm.cmap(lambda a: a, in_dims=2)(torch.ones(3, 2)),
            "Got in_dim=2 for some input, but that input is a Tensor of dimensionality 2",
        ),
        (
            lambda: cm.cmap(lambda a, b: a, in_dims=(0, 0))(torch.ones(3, 2), 3),
            "Got in_dim=0 for an input but the input is of type <class 'int'>",
        ),
    ]
    for call, sentence in cases:
        with pytest.raises(ValueError) as found:
            call()
        assert sentence in str(found.value), (sentence, str(found.value))
        with pytest.raises(ValueError) as theirs:  # the oracle: vmap's message holds the same sentence
            _vmap_twin(sentence)
        assert sentence in str(theirs.value)
    return True


def _vmap_twin(sentence: str) -> None:
    """The same mistake made with torch.vmap."""
    x = torch.arange(4.0).view(4, 1)
    if "chunk_size" in sentence:
        torch.vmap(lambda v: v, chunk_size=0)(x)
    elif "no inputs" in sentence:
        torch.vmap(lambda: 1)()
    elif "same size" in sentence:
        torch.vmap(lambda a, b: a + b)(torch.ones(3, 2), torch.ones(4, 2))
    elif "for some input" in sentence:
        torch.vmap(lambda a: a, in_dims=2)(torch.ones(3, 2))
    else:
        torch.vmap(lambda a, b: a, in_dims=(0, 0))(torch.ones(3, 2), 3)


@pytest.mark.parametrize("P", WORLDS)
def test_vmap_words(worlds, P):
    assert worlds(P).run(check_vmap_words) == [True] * P


def check_in_place_result_is_the_input(B):
    """func changes its mapped input in place and returns it: as vmap, the result is the caller's tensor itself,
    every row updated, on every rank that receives output."""
    x = randn(B, 3, seed=51)
    expected = x.sin()
    for dst in (-1, 0):
        y = x.clone()
        out = cm.cmap(lambda t: t.sin_(), dst=dst)(y)
        assert torch.equal(y, expected)
        if dst == -1 or dist.get_rank() == 0:
            assert out is y
        else:
            assert out is None
    ref = x.clone()
    assert torch.vmap(lambda t: t.sin_())(ref) is ref
    return True


@pytest.mark.parametrize("P", WORLDS)
def test_in_place_result_is_the_input(worlds, P):
    assert worlds(P).run(check_in_place_result_is_the_input, P + 1) == [True] * P


def check_dst_out_of_range():
    """dst and src are checked against the group size at every P, a world of one included."""
    size = dist.get_world_size()
    with pytest.raises(ValueError, match=f"dst={size} is not valid for a group of size {size}"):
        cm.cmap(torch.sin, dst=size)(torch.ones(3))
    with pytest.raises(ValueError, match=f"src={size} is not valid for a group of size {size}"):
        cm.cmap(torch.sin, src=size)(torch.ones(3))
    return True


@pytest.mark.parametrize("P", WORLDS)
def test_dst_out_of_range(worlds, P):
    assert worlds(P).run(check_dst_out_of_range) == [True] * P


# ------------------------------------------------------------------------------------------ checkpointing
def check_checkpoint_around_cmap(B):
    """A cmap call inside a torch.utils.checkpoint region (non-reentrant): checkpoint's early-stop signal passes
    through cmap as through vmap, on every rank, and the gradients are vmap's."""
    from torch.utils.checkpoint import checkpoint

    x, w = randn(B, 4, seed=61, dtype=torch.float64), randn(4, seed=62, dtype=torch.float64)

    def region(xx, ww, fn):
        return fn(lambda r, u: (r * u).sin().cos(), in_dims=(0, None))(xx, ww).exp()

    grads = []
    for fn in (torch.vmap, cm.cmap):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        checkpoint(region, xx, ww, fn, use_reentrant=False).sum().backward()
        grads.append((xx.grad, ww.grad))
    assert torch.equal(grads[0][0], grads[1][0])
    torch.testing.assert_close(grads[1][1], grads[0][1], **F64)
    again = cm.cmap(torch.sin)(x)  # the group is still in step
    assert torch.equal(again, x.sin())
    return True


@pytest.mark.parametrize("P", WORLDS)
def test_checkpoint_around_cmap(worlds, P):
    assert worlds(P).run(check_checkpoint_around_cmap, 5) == [True] * P


def check_checkpoint_inside_func(B):
    """torch.utils.checkpoint inside func, as jax's remat in the shard_map tutorial's FSDP network (batched mode):
    the recomputation runs in backward, after the call returned, and its psum still finds its axis."""
    from torch.utils.checkpoint import checkpoint

    x, w = randn(B, 4, seed=71), randn(4, 4, seed=72)

    def layer(rows, weight):
        h = torch.tanh(rows @ weight)
        return h - cm.pmean(h, "i")

    def per_rank(rows, weight):
        return checkpoint(layer, rows, weight, use_reentrant=False)

    def reference(rows, weight):
        h = torch.tanh(rows @ weight)
        return h - h.mean(0)

    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    reference(xr, wr).pow(2).sum().backward()
    xc, wc = x.double().requires_grad_(), w.double().requires_grad_()
    out = cm.cmap(per_rank, in_dims=(0, None), mode="batched", axis_name="i")(xc, wc)
    torch.testing.assert_close(out, reference(xr, wr).detach())
    out.pow(2).sum().backward()
    torch.testing.assert_close(xc.grad, xr.grad)  # float64: a batch mean in another order is far inside the default
    torch.testing.assert_close(wc.grad, wr.grad)
    return True


@pytest.mark.parametrize("P", WORLDS)
def test_checkpoint_inside_func(worlds, P):
    assert worlds(P).run(check_checkpoint_inside_func, 5) == [True] * P


# ---------------------------------------------------------------------------------------- placing outputs
def check_batch_independent_out_dim(B):
    """A batch-independent output at an int out_dim other than 0 (torch 2.5.1's vmap misplaces it): cmap returns
    it expanded along that dim, as the math says (the same value for every example)."""
    x, r = randn(B, 2, seed=81), randn(2, 3, seed=82)
    got = cm.cmap(lambda v: (r * 1, v * 2), out_dims=(1, 0))(x)
    assert torch.equal(got[0], r.unsqueeze(1).expand(2, B, 3))
    assert torch.equal(got[1], x * 2)
    return True


@pytest.mark.parametrize("P", WORLDS)
def test_batch_independent_out_dim(worlds, P):
    assert worlds(P).run(check_batch_independent_out_dim, 3 * P) == [True] * P


def check_inner_out_dims_none():
    """The shard_map tutorial's out_specs=P('x', None), written as nested cmaps on a 2x2 mesh: the inner map's
    output is reduced over its own axis (psum over "j") but varies over the outer one; out_dims=None returns its one
    copy, as jax does. An inner output that depends on the inner example is refused in cmap's words."""
    from colossalai.cluster import ProcessGroupMesh

    mesh = ProcessGroupMesh(2, 2)
    X = randn(4, 6, 3, seed=91, dtype=torch.float64)  # outer axis "i" over dim 0, inner axis "j" over dim 1
    inner = cm.cmap(lambda v: cm.psum(v, "j"), axis_name="j", group=(mesh, 1), out_dims=None)
    got = cm.cmap(inner, axis_name="i", group=(mesh, 0))(X)
    assert got.shape == (4, 3)
    torch.testing.assert_close(got, X.sum(1), **F64)
    bad = cm.cmap(cm.cmap(lambda v: v * 2, axis_name="j", group=(mesh, 1), out_dims=None), group=(mesh, 0))
    with pytest.raises(ValueError, match="can not return a BatchedTensor when out_dim is None"):
        bad(X)
    return True


def test_inner_out_dims_none(worlds):
    assert worlds(4).run(check_inner_out_dims_none) == [True] * 4


# --------------------------------------------------------------- jax's shard_map tutorial, written with cmap
def check_shard_map_tutorial_networks():
    """The data-parallel, FSDP and tensor-parallel networks of jax's shard_map tutorial, written with cmap in the
    per-device style (each rank maps one example: its own block, ``src="local"``; the loss is replicated,
    ``out_dims=None``): values and gradients equal a single-process computation of the global network."""
    P, rank = dist.get_world_size(), dist.get_rank()
    X, T = randn(4 * P, 12, seed=101, dtype=torch.float64), randn(4 * P, 2, seed=102, dtype=torch.float64)
    W1, W2 = randn(12, 4 * P, seed=103, dtype=torch.float64), randn(4 * P, 2, seed=104, dtype=torch.float64)
    xb, tb = X.tensor_split(P)[rank], T.tensor_split(P)[rank]
    per_device = dict(src="local", out_dims=None, axis_name="d")

    def global_loss(w1, w2):
        return ((torch.relu(X @ w1) @ w2 - T) ** 2).mean()

    w1r, w2r = W1.clone().requires_grad_(), W2.clone().requires_grad_()
    expected = global_loss(w1r, w2r)
    expected.backward()

    # data parallel: params replicated (unmapped), batch sharded, loss = pmean of the local means
    def dp_loss(w1, w2, x, t):
        return cm.pmean(((torch.relu(x @ w1) @ w2 - t) ** 2).mean(), "d")

    w1, w2 = W1.clone().requires_grad_(), W2.clone().requires_grad_()
    loss = cm.cmap(dp_loss, in_dims=(None, None, 0, 0), **per_device)(w1, w2, xb[None], tb[None])
    torch.testing.assert_close(loss, expected.detach())
    loss.backward()
    torch.testing.assert_close(w1.grad, w1r.grad)
    torch.testing.assert_close(w2.grad, w2r.grad)

    # FSDP: each rank holds a block of rows of W1 and W2, all-gathered (tiled) before use; batch sharded
    def fsdp_loss(w1_block, w2_block, x, t):
        w1_full = cm.all_gather(w1_block, "d", axis=0, tiled=True)
        w2_full = cm.all_gather(w2_block, "d", axis=0, tiled=True)
        return cm.pmean(((torch.relu(x @ w1_full) @ w2_full - t) ** 2).mean(), "d")

    w1b, w2b = W1.tensor_split(P)[rank].clone().requires_grad_(), W2.tensor_split(P)[rank].clone().requires_grad_()
    loss = cm.cmap(fsdp_loss, **per_device)(w1b[None], w2b[None], xb[None], tb[None])
    torch.testing.assert_close(loss, expected.detach())
    loss.backward()
    torch.testing.assert_close(w1b.grad, w1r.grad.tensor_split(P)[rank])
    torch.testing.assert_close(w2b.grad, w2r.grad.tensor_split(P)[rank])

    # tensor parallel: W1 split by columns, W2 by rows, the input replicated; the partial products psum'd
    def tp_loss(w1_cols, w2_rows, x, t):
        return ((cm.psum(torch.relu(x @ w1_cols) @ w2_rows, "d") - t) ** 2).mean()

    w1c = W1.tensor_split(P, dim=1)[rank].clone().requires_grad_()
    w2r_ = W2.tensor_split(P)[rank].clone().requires_grad_()
    x_all = X.clone().requires_grad_()
    loss = cm.cmap(tp_loss, in_dims=(0, 0, None, None), **per_device)(w1c[None], w2r_[None], x_all, T)
    torch.testing.assert_close(loss, expected.detach())
    loss.backward()
    torch.testing.assert_close(w1c.grad, w1r.grad.tensor_split(P, dim=1)[rank])
    torch.testing.assert_close(w2r_.grad, w2r.grad.tensor_split(P)[rank])
    xr = X.clone().requires_grad_()
    global_loss_x = ((torch.relu(xr @ W1) @ W2 - T) ** 2).mean()
    global_loss_x.backward()
    torch.testing.assert_close(x_all.grad, xr.grad)  # the replicated input: the sum over every rank's block
    return True


@pytest.mark.parametrize("P", WORLDS)
def test_shard_map_tutorial_networks(worlds, P):
    assert worlds(P).run(check_shard_map_tutorial_networks) == [True] * P
