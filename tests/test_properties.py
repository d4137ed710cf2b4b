"""Property test: for random P, B, in_dims, out_dims, src, dst and mode, every example comes back exactly once,
in global order, equal to single-process torch.vmap."""

import torch
import torch.distributed as dist
from cases import assert_same
from hypothesis import HealthCheck, given, settings
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
