"""Property test: for random P, B, in_dims, out_dims, src, dst and mode, every example comes back exactly once,
in global order, equal to single-process torch.vmap."""

import pytest
import torch
import torch.distributed as dist
from cases import assert_same
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import colossalai_cmap as cm

EXAMPLES = 60


def _inputs(B, in_dim):
    # Row i holds i in every entry, so order and duplication are visible in the output.
    rows = torch.arange(B, dtype=torch.float64).view(B, 1, 1).expand(B, 2, 3).contiguous()
    x = rows.movedim(0, in_dim % 3)
    w = torch.linspace(-1, 1, 3, dtype=torch.float64)
    return x, w


def _f(x, w):
    return x * w + 0.5, x.sum()


def check_property(B, in_dim, out_dims, src, dst, mode):
    rank, size = dist.get_rank(), dist.get_world_size()
    x, w = _inputs(B, in_dim)
    in_dims = (in_dim, None)
    expected = torch.vmap(_f, in_dims=in_dims, out_dims=out_dims)(x, w)
    q, r = divmod(B, size)
    start, rows = rank * q + min(rank, r), q + (1 if rank < r else 0)
    if src == "local":
        args = (x.narrow(in_dim % 3, start, rows), w)
    elif src is not None and rank != src:
        args = (None, w)
    else:
        args = (x, w)
    if mode == "batched":
        func = torch.vmap(_f, in_dims=in_dims, out_dims=out_dims)
    else:
        func = _f
    if mode == "loop" and B == 0:
        return "skipped: loop mode cannot infer outputs of an empty batch"
    out = cm.cmap(func, in_dims=in_dims, out_dims=out_dims, src=src, dst=dst, mode=mode)(*args)
    if dst == "local":
        xs = x.narrow(in_dim % 3, start, rows)
        assert_same(out, torch.vmap(_f, in_dims=in_dims, out_dims=out_dims)(xs, w), True, "local")
        return "local"
    if dst not in (-1, rank):
        assert out is None
        return "none"
    assert_same(out, expected, True, f"B={B} in_dim={in_dim} out_dims={out_dims} src={src} dst={dst} mode={mode}")
    # every example exactly once, in global order
    ids = out[1].movedim(out_dims[1], 0) / 6 if isinstance(out_dims, tuple) else out[1] / 6
    assert torch.equal(ids, torch.arange(B, dtype=torch.float64)), ids
    return "full"


@st.composite
def scenarios(draw):
    P = draw(st.integers(1, 4))
    B = draw(st.integers(0, 40))
    in_dim = draw(st.sampled_from([0, 1, 2, -1, -3]))
    out_dims = draw(st.sampled_from([0, (0, 0), (1, 0), (-1, 0), (2, 0)]))
    src = draw(st.sampled_from([None, "local"] + list(range(P))))
    dst = draw(st.sampled_from([-1, "local"] + list(range(P))))
    mode = draw(st.sampled_from(["vmap", "batched", "loop"]))
    return P, B, in_dim, out_dims, src, dst, mode


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(scenarios())
def test_every_example_exactly_once_in_order(worlds, scenario):
    P, B, in_dim, out_dims, src, dst, mode = scenario
    results = worlds(P).run(check_property, B, in_dim, out_dims, src, dst, mode)
    receivers = [r for r in results if r == "full"]
    if not (mode == "loop" and B == 0) and dst != "local":
        assert len(receivers) == (P if dst == -1 else 1), results


# ------------------------------------------------------------------------------------- composed transforms
TRANSFORMS = ("grad", "vjp", "jvp", "vmap", "jacrev")


def _composed(mapper, transforms, nested, B):
    """A scalar-per-example function of ``w`` through ``mapper`` (closing over ``c``, which requires grad), then each
    transform in turn around it; returns the final value and the gradient of its sum with respect to ``c``."""
    gen = torch.Generator().manual_seed(B)
    x = torch.randn(B, 2, 3, generator=gen, dtype=torch.float64)
    c = torch.linspace(-1, 1, 3, dtype=torch.float64).requires_grad_()
    w0 = torch.linspace(0.5, 1.5, 3, dtype=torch.float64)

    def per_example(e, w):
        return ((e * w).sin() * c).sum()

    if nested:
        g = lambda w: mapper(mapper(per_example, in_dims=(0, None)), in_dims=(0, None))(x, w).sum(-1)  # noqa: E731
    else:
        g = lambda w: mapper(lambda e, w: per_example(e.sum(0), w), in_dims=(0, None))(x, w)  # noqa: E731
    for name in transforms:
        g = _wrap(name, g)
    out = g(w0)
    (dc,) = torch.autograd.grad(out.sum(), c, allow_unused=True)
    return out, dc


def _wrap(name, g):
    scale = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    if name == "grad":
        return lambda w: torch.func.grad(lambda v: g(v).sum())(w)
    if name == "vjp":
        return lambda w: (lambda out, pull: pull(torch.ones_like(out))[0])(*torch.func.vjp(g, w))
    if name == "jvp":
        return lambda w: torch.func.jvp(g, (w,), (scale,))[1]
    if name == "jacrev":
        return lambda w: torch.func.jacrev(lambda v: g(v).sum())(w)
    return lambda w: torch.vmap(g)(torch.stack([w, w * scale])).sum(0)  # "vmap"


def check_composition(B, transforms, nested):
    got = _composed(cm.cmap, transforms, nested, B)
    expected = _composed(torch.vmap, transforms, nested, B)
    torch.testing.assert_close(got, expected, msg=lambda m: f"B={B} {transforms} nested={nested}: {m}")
    return True


@st.composite
def compositions(draw):
    P = draw(st.integers(1, 4))
    B = draw(st.integers(1, 9))
    transforms = tuple(draw(st.lists(st.sampled_from(TRANSFORMS), max_size=2)))
    nested = draw(st.booleans())
    return P, B, transforms, nested


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(compositions())
def test_random_transforms_around_cmap(worlds, scenario):
    """Random stacks of grad, vjp, jvp, jacrev and vmap around cmap (itself nested or not) equal the same stacks
    around torch.vmap, values and the gradient of a closure-captured tensor."""
    P, B, transforms, nested = scenario
    assert worlds(P).run(check_composition, B, transforms, nested) == [True] * P


# ------------------------------------------------------------------------------------------- whole calls
C = torch.linspace(-1, 1, 3, dtype=torch.float64)  # captured by "closure"; a copy that requires grad per call


def _library(c: torch.Tensor) -> dict:
    """Per-example functions, each (x: [2, 3] example, w: [3]) -> outputs."""
    return {
        "affine": lambda x, w: (x * w).sin() + 1,
        "two": lambda x, w: ((x * w).sum(-1), x.cos()),
        "closure": lambda x, w: (x * c).tanh() * w,
        "matmul": lambda x, w: x @ w,
        "shared": lambda x, w: ((x * w).sin(), (w * c).cos()),  # a batched output and a replicated one
    }


# each function's out_dims to draw from: every output at dim 0, 1 or -1; the replicated one at None
OUT_DIMS = {
    "affine": [0, 1, -1],
    "two": [0, (1, 0), (0, -1)],
    "closure": [0, 1, -1],
    "matmul": [0, -1],
    "shared": [(0, None), (1, None), (-1, None)],
}


def _along(t, d, part):
    """``part`` (a slice of examples) of ``t`` along its out-dim ``d``; all of it for an out_dims=None leaf."""
    return t if d is None else t.movedim(d, 0)[part].movedim(0, d)


def check_whole_call(name, B, src, dst, mode, chunk, grads, out_dims=0):
    """One drawn call on every rank against single-process torch.vmap: values, and with ``grads`` the gradients of
    the inputs, the unmapped weight and a closure-captured tensor. With ``dst="local"`` each rank's loss is of its
    own rows and of the replicated (out_dims=None) outputs, which count once: the gradients are vmap's of the one
    loss. With ``src=r`` or ``dst=r`` backward is refused on every rank that gets an output."""
    rank, size = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(B * 31 + len(name))
    x0, w0 = torch.randn(B, 2, 3, generator=gen, dtype=torch.float64), torch.randn(
        3, generator=gen, dtype=torch.float64
    )
    refused = grads and not (src in (None, "local") and dst in (-1, "local"))
    grads = grads and not refused
    rows = [len(t) for t in torch.arange(B).tensor_split(size)] if "local" in (src, dst) else None

    def run(mapper, x, w, c, **opts):
        f = _library(c)[name]
        batched = mapper is cm.cmap and opts.get("mode") == "batched"
        func = torch.vmap(f, in_dims=(0, None), out_dims=out_dims) if batched else f
        return mapper(func, in_dims=(0, None), out_dims=out_dims, **opts)(x, w)

    def leaves(out):
        return [out] if isinstance(out, torch.Tensor) else list(out)

    def loss(out):
        return sum((t * t.new_tensor(1.5)).sin().sum() for t in leaves(out))

    track = grads or refused
    xr, wr, cr = x0.clone().requires_grad_(track), w0.clone().requires_grad_(track), C.clone().requires_grad_(track)
    expected = run(torch.vmap, xr, wr, cr)
    start = sum(rows[:rank]) if rows else 0
    mine = slice(start, start + rows[rank]) if rows else slice(0, B)
    x = x0[mine] if src == "local" else x0
    xc, wc, cc = x.clone().requires_grad_(track), w0.clone().requires_grad_(track), C.clone().requires_grad_(track)
    args_x = xc if not (isinstance(src, int) and rank != src) else None
    out = run(cm.cmap, args_x, wc, cc, src=src, dst=dst, mode=mode, chunk_size=chunk)
    if dst not in (-1, "local", rank):
        assert out is None
        return "none"
    dims = [out_dims] * len(leaves(expected)) if not isinstance(out_dims, tuple) else list(out_dims)
    want = [_along(t, d, mine) if dst == "local" else t for t, d in zip(leaves(expected), dims)]
    for got, exp in zip(leaves(out), want):
        torch.testing.assert_close(got, exp.detach())  # float64: at most a dot of 3 in another kernel, far inside
    if refused:
        with pytest.raises(RuntimeError, match="is not differentiable"):
            loss(out).backward()
        return "refused"
    if not grads:
        return "values"
    loss(expected).backward()
    loss(out).backward()
    x_grad = xr.grad[mine] if src == "local" else xr.grad
    torch.testing.assert_close(xc.grad, x_grad)
    torch.testing.assert_close(wc.grad, wr.grad)  # float64 sums over at most 40 examples in another order
    if name in ("closure", "shared"):
        torch.testing.assert_close(cc.grad, cr.grad)
    return "grads"


@st.composite
def whole_calls(draw):
    P = draw(st.integers(1, 4))
    B = draw(st.integers(0, 12))
    name = draw(st.sampled_from(sorted(OUT_DIMS)))
    out_dims = draw(st.sampled_from(OUT_DIMS[name]))
    src = draw(st.sampled_from([None, "local", 0]))
    dst = draw(st.sampled_from([-1, "local", 0]))
    mode = draw(st.sampled_from(["vmap", "batched", "loop"]))
    chunk = draw(st.sampled_from([None, 1, 3]))
    grads = draw(st.booleans())
    return P, name, B, src, dst, mode, chunk, grads, out_dims


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(whole_calls())
@example((2, "shared", 5, "local", "local", "vmap", None, True, (0, None)))  # jax's out_specs=P() under dst="local"
@example((3, "shared", 7, None, "local", "loop", 3, True, (1, None)))
@example((4, "shared", 3, "local", "local", "batched", None, True, (-1, None)))  # B < P: a stand-in on one rank
@example((2, "two", 5, 0, 1, "vmap", None, True, 0))  # src=r, dst=r': the receiving rank refuses backward
def test_random_whole_calls(worlds, scenario):
    """Random whole calls (function, B, src, dst, mode, chunk_size, out_dims, gradients) equal single-process
    torch.vmap on every rank: values, and the gradients of mapped, unmapped and closure-captured tensors, on every
    out_dims/src/dst combination (out_dims=None leaves under dst="local" counted once)."""
    P, name, B, src, dst, mode, chunk, grads, out_dims = scenario
    results = worlds(P).run(check_whole_call, name, B, src, dst, mode, chunk, grads, out_dims)
    assert sum(r != "none" for r in results) == (1 if isinstance(dst, int) and dst >= 0 else P), results


def check_random_call(B, randomness, mode, dst):
    """randomness="same": every example on every rank draws the same numbers; "different" and "per_example": no two
    examples do."""
    x = torch.zeros(B, 3, dtype=torch.float64)
    f = lambda v: v + torch.rand(3, dtype=torch.float64)  # noqa: E731
    inner = "different" if randomness == "per_example" else randomness  # per_example gives func one row at a time
    func = torch.vmap(f, randomness=inner) if mode == "batched" else f
    torch.manual_seed(B)  # the ranks' generators in step, as colossalai's launch seeds them ("same" needs it)
    out = cm.cmap(func, randomness=randomness, mode=mode, dst=dst)(x)
    if out is None:
        return "none"
    if dst == "local":  # compare across ranks: every rank's rows, gathered by hand
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, out)
        out = torch.cat(parts)
    distinct = torch.unique(out, dim=0).shape[0] if B else 0
    assert distinct == (min(B, 1) if randomness == "same" else B), (randomness, mode, out)
    return "checked"


@st.composite
def random_calls(draw):
    return (
        draw(st.integers(1, 4)),
        draw(st.integers(0, 9)),
        draw(st.sampled_from(["same", "different", "per_example"])),
        draw(st.sampled_from(["vmap", "batched", "loop"])),
        draw(st.sampled_from([-1, "local", 0])),
    )


@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(random_calls())
def test_random_draws_follow_randomness(worlds, scenario):
    P, B, randomness, mode, dst = scenario
    assert "checked" in worlds(P).run(check_random_call, B, randomness, mode, dst)
