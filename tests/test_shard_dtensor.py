"""shard_map with DTensors in and out, in real gloo worlds of 4 ranks (``init_device_mesh("cpu", ...)``).

* A DTensor argument's placements give its spec when ``in_specs`` leaves it out (``in_specs=None`` or a None
  leaf): the values and gradients equal the plain shard_map's with the equivalent ``P`` on the global tensors,
  exactly (small integers in float64), the outputs are DTensors placed by ``out_specs``, and each DTensor leaf's
  ``.grad`` is a DTensor with the leaf's placements. Uneven DTensors (torch.chunk blocks) in and out.
* The mistakes are refused on every rank by name, with the fix: a ``Partial`` placement, a DTensor on another mesh,
  an ``in_specs`` entry that disagrees with the placements, a plain tensor with its spec left out, an out_specs
  tuple in an order DTensor cannot hold.
* Inside ``parallelize_module`` code: a ``ColwiseParallel`` linear, a shard_map region with a DTensor parameter, a
  ``RowwiseParallel`` linear, trained with SGD, equals the unsharded model trained in one process.
* Next to torch's ``local_map`` on the same regions (``benchmarks/shard_local_map.py`` prints the whole table):
  the values, and the gradients where local_map's are the reference's; shard_map's are the reference's everywhere,
  and its backward makes the one all-reduce jax's typed transposes make.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shard_cases import mesh as device_mesh

import colossalai_cmap as cm
from colossalai_cmap import P, shard_map

DEADLINE = 120


def _dtensor():
    from torch.distributed import tensor as dt

    return dt


def ints(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, shape, generator=g).to(torch.float64)


def _placements(names):
    """Placement names to torch placements: "S0" is Shard(0), "R" Replicate()."""
    dt = _dtensor()
    return [dt.Replicate() if n == "R" else dt.Shard(int(n[1:])) for n in names]


# (f, [(global shape, placements per mesh dim, the equivalent P)], out_specs, the output's placements)
def cases():
    return {
        "matmul": (
            lambda a, b: cm.psum(a @ b, "y"),
            [((8, 6), ("S0", "S1"), P("x", "y")), ((6, 4), ("R", "S0"), P("y"))],
            P("x", None),
            ("S0", "R"),
        ),
        "one dim over both axes": (
            lambda x: x * (2 * cm.axis_index("x") + cm.axis_index("y") + 1),
            [((8, 3), ("S0", "S0"), P(("x", "y")))],
            P(("x", "y")),
            ("S0", "S0"),
        ),
        "replicated and a negative dim": (
            lambda x, w: cm.psum(x * w, "y"),
            [((4, 6), ("S-1", "R"), P(None, "x")), ((4, 1), ("R", "R"), P())],
            P(None, "x"),
            ("S1", "R"),
        ),
        "a sum over both axes": (
            lambda x: cm.psum(x.sum(0), ("x", "y")),
            [((8, 2), ("S0", "S0"), P(("x", "y")))],
            P(),
            ("R", "R"),
        ),
    }


def run_case(name, check_vma, spelling):
    """This rank's values and gradients of one case, on DTensors (specs ``spelling``: "none", "leaves" or
    "explicit") and on the global tensors with the equivalent specs."""
    dt = _dtensor()
    mesh = device_mesh((2, 2), ("x", "y"))
    f, ins, outs, out_places = cases()[name]
    globals_ = [ints(*shape, seed=k) for k, (shape, _, _) in enumerate(ins)]
    specs = tuple(spec for _, _, spec in ins)
    dts = [dt.distribute_tensor(g, mesh, _placements(p)).requires_grad_() for g, (_, p, _) in zip(globals_, ins)]
    given = {"none": None, "leaves": (None,) * len(ins), "explicit": specs}[spelling]
    y = shard_map(f, mesh, given, outs, check_vma=check_vma)(*dts)
    assert isinstance(y, dt.DTensor) and y.device_mesh is mesh, type(y)
    assert tuple(y.placements) == tuple(_placements(out_places)), y.placements
    ct = ints(*y.shape, seed=9)
    (y * dt.DTensor.from_local(ct, mesh, [dt.Replicate()] * 2)).sum().backward()
    for d, (_, p, _) in zip(dts, ins):
        assert isinstance(d.grad, dt.DTensor) and tuple(d.grad.placements) == tuple(d.placements), d.grad
    plain = [g.clone().requires_grad_() for g in globals_]
    want = shard_map(f, mesh, specs, outs, check_vma=check_vma)(*plain)
    (want * ct).sum().backward()
    return (
        torch.equal(y.full_tensor(), want),
        [torch.equal(d.grad.full_tensor(), p.grad) for d, p in zip(dts, plain)],
        tuple(y.to_local().shape),
    )


def run_cases():
    keys = [(name, check, "none") for name in cases() for check in (True, False)]
    keys += [("matmul", True, "leaves"), ("matmul", True, "explicit")]
    return {key: run_case(*key) for key in keys}


def test_placements_give_the_specs(worlds):
    """Values and gradients on DTensors equal the plain shard_map's, exactly, on every rank."""
    for rank, got in enumerate(worlds(4).run(run_cases, deadline=DEADLINE)):
        for key, (values, grads, _) in got.items():
            assert values and all(grads), (rank, key, values, grads)


def run_mixed_and_uneven():
    """A DTensor next to a plain global tensor (its spec given); an uneven DTensor (torch.chunk blocks) in and out;
    ``out_dtensor=False`` (global plain outputs from DTensors) and ``out_dtensor=True`` (DTensors from plain)."""
    dt = _dtensor()
    mesh = device_mesh((2, 2), ("x", "y"))
    a, b = ints(8, 6, seed=1), ints(6, 4, seed=2)
    ad = dt.distribute_tensor(a, mesh, _placements(("S0", "S1"))).requires_grad_()
    bp = b.clone().requires_grad_()
    y = shard_map(lambda u, v: cm.psum(u @ v, "y"), mesh, (None, P("y")), P("x"))(ad, bp)
    y.full_tensor().sum().backward()
    ref_a, ref_b = a.clone().requires_grad_(), b.clone().requires_grad_()
    (ref_a @ ref_b).sum().backward()
    mixed = torch.equal(y.full_tensor(), a @ b) and torch.equal(ad.grad.full_tensor(), ref_a.grad)
    mixed = mixed and torch.equal(bp.grad, ref_b.grad)

    x = ints(10, 3, seed=3)  # 10 rows over 2 x 2: torch.chunk gives 5, 5, then 3, 2 each: blocks 3, 2, 3, 2
    xd = dt.distribute_tensor(x, mesh, _placements(("S0", "S0"))).requires_grad_()
    z = shard_map(lambda u: u * 2 + cm.psum(u.sum(), ("x", "y")), mesh, out_specs=P(("x", "y")))(xd)
    (z.full_tensor() * torch.arange(10.0, dtype=torch.float64)[:, None]).sum().backward()
    ref = x.clone().requires_grad_()
    ((ref * 2 + ref.sum()) * torch.arange(10.0, dtype=torch.float64)[:, None]).sum().backward()
    uneven = (
        z.shape == (10, 3)
        and z.to_local().shape == xd.to_local().shape
        and torch.equal(z.full_tensor(), x * 2 + x.sum())
        and torch.equal(xd.grad.full_tensor(), ref.grad)
    )

    plain_out = shard_map(lambda u: u * 3, mesh, out_specs=P("x", "y"), out_dtensor=False)(ad.detach())
    as_dtensor = shard_map(lambda u: u * 3, mesh, P("x", "y"), P("x", "y"), out_dtensor=True)(a)
    flags = (
        type(plain_out) is torch.Tensor
        and torch.equal(plain_out, a * 3)
        and isinstance(as_dtensor, dt.DTensor)
        and torch.equal(as_dtensor.full_tensor(), a * 3)
        and tuple(as_dtensor.placements) == tuple(_placements(("S0", "S1")))
    )
    return mixed, uneven, flags


def test_mixed_uneven_and_out_dtensor(worlds):
    for rank, got in enumerate(worlds(4).run(run_mixed_and_uneven, deadline=DEADLINE)):
        assert got == (True, True, True), (rank, got)


def run_mistakes():
    """Each mistake's exception type and message, on this rank."""
    dt = _dtensor()
    mesh = device_mesh((2, 2), ("x", "y"))
    line = device_mesh((4,), ("i",))
    a = ints(8, 4)
    ad = dt.distribute_tensor(a, mesh, _placements(("S0", "R")))
    partial = dt.DTensor.from_local(a, mesh, [dt.Partial(), dt.Replicate()])
    calls = {
        "partial": lambda: shard_map(lambda u: u, mesh, out_specs=P())(partial),
        "another mesh": lambda: shard_map(lambda u: u, mesh, out_specs=P("x"))(
            dt.distribute_tensor(a, line, [dt.Shard(0)])
        ),
        "disagreeing spec": lambda: shard_map(lambda u: u, mesh, P("y"), P("y"))(ad),
        "plain tensor, spec left out": lambda: shard_map(lambda u, v: u, mesh, out_specs=P("x"))(ad, a),
        "order DTensor cannot hold": lambda: shard_map(
            lambda u: u, mesh, P(("y", "x")), P(("y", "x")), out_dtensor=True
        )(a),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = None
        except Exception as exc:
            out[name] = (isinstance(exc, cm.CmapError), isinstance(exc, ValueError), str(exc))
    return out


def test_mistakes_are_refused_by_name(worlds):
    expect = {
        "partial": ["args[0] is a DTensor with placement Partial", "redistribute(mesh, [Replicate()])"],
        "another mesh": ["args[0] is a DTensor on a DeviceMesh of shape (4,)", "mesh=args[0].device_mesh"],
        "disagreeing spec": [
            "in_specs[0] is P('y')",
            "which is P('x')",
            "args[0].redistribute(mesh, [Replicate(), Shard",
        ],
        "plain tensor, spec left out": ["args[1] is a plain tensor", "P() for a tensor that is the same"],
        "order DTensor cannot hold": ["'y' major", "out_dtensor=False"],
    }
    for rank, got in enumerate(worlds(4).run(run_mistakes, deadline=DEADLINE)):
        for name, words in expect.items():
            assert got[name] is not None, (rank, name, "no error")
            is_cmap, is_value, message = got[name]
            assert is_cmap and is_value, (rank, name, message)
            for w in words:
                assert w in message, (rank, name, w, message)


def run_placement_property(shape, names):
    """A DTensor of ``shape`` with placements ``names`` on the 2 x 2 mesh, even or not, through
    ``f(b) = 2 b + psum(b.sum())`` (over the axes it is split on) with its own placements out: values and
    gradients against the global function's, exactly."""
    dt = _dtensor()
    mesh = device_mesh((2, 2), ("x", "y"))
    x, ct = ints(*shape, seed=11), ints(*shape, seed=12)
    xd = dt.distribute_tensor(x, mesh, _placements(names)).requires_grad_()
    split = tuple(a for a, n in zip(("x", "y"), names) if n != "R")

    def f(b):
        return b * 2 + (cm.psum(b.sum(), split) if split else b.sum())

    entries = [[a for a, n in zip(("x", "y"), names) if n == f"S{d}"] for d in range(len(shape))]  # its own spec
    spec = P(*(None if not e else e[0] if len(e) == 1 else tuple(e) for e in entries))
    y = shard_map(f, mesh, out_specs=spec)(xd)
    (y * dt.DTensor.from_local(ct, mesh, [dt.Replicate()] * 2)).sum().backward()
    ref = x.clone().requires_grad_()
    ((ref * 2 + ref.sum()) * ct).sum().backward()
    return (
        tuple(y.placements) == tuple(xd.placements)
        and torch.equal(y.full_tensor(), x * 2 + x.sum())
        and tuple(xd.grad.placements) == tuple(xd.placements)
        and torch.equal(xd.grad.full_tensor(), ref.grad)
    )


@st.composite
def shapes_and_placements(draw):
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)))
    names = tuple(draw(st.sampled_from(["R"] + [f"S{d}" for d in range(len(shape))])) for _ in range(2))
    return shape, names


@settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(shapes_and_placements())
def test_any_shape_and_placements(worlds, case):
    assert worlds(4).run(run_placement_property, *case, deadline=DEADLINE) == [True] * 4, case


# ---------------------------------------------------------------------------- inside parallelize_module code
D, H, STEPS = 8, 16, 3


class Region(torch.nn.Module):
    """A shard_map region with a DTensor parameter: an RMS norm over features sharded on "tp", then a gain."""

    def __init__(self, gain, mesh=None):
        super().__init__()
        self.mesh = mesh
        if mesh is not None:
            gain = _dtensor().distribute_tensor(gain, mesh, [_dtensor().Shard(0)])
        self.gain = torch.nn.Parameter(gain)

    def forward(self, h):
        if self.mesh is None:
            return norm(h, self.gain, lambda v: v)
        return shard_map(lambda b, g: norm(b, g, lambda v: cm.psum(v, "tp")), self.mesh, out_specs=P(None, "tp"))(
            h, self.gain
        )


def norm(h, g, total):
    return torch.relu(h) * torch.rsqrt(total((h * h).sum(-1, keepdim=True)) / H + 1e-6) * g


def model(mesh=None):
    torch.manual_seed(0)
    up, down = torch.nn.Linear(D, H, dtype=torch.float64), torch.nn.Linear(H, D, dtype=torch.float64)
    gain = 1 + torch.rand(H, dtype=torch.float64)
    return torch.nn.Sequential(up, Region(gain, mesh), down)


def run_training():
    """SGD steps of the parallelized model and of the unsharded one, in this process: losses and parameters."""
    dt = _dtensor()
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = device_mesh((4,), ("tp",))
    sharded = parallelize_module(
        model(mesh),
        mesh,
        {
            "0": ColwiseParallel(output_layouts=dt.Shard(1), use_local_output=False),
            "2": RowwiseParallel(input_layouts=dt.Shard(1)),
        },
    )
    whole = model()
    losses = []
    for m in (sharded, whole):
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(5)
        run = []
        for _ in range(STEPS):
            x, target = torch.randn(4, D, generator=g, dtype=torch.float64), torch.randn(4, D, generator=g)
            loss = ((m(x) - target.double()) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            run.append(loss.item())
        losses.append(run)
    params = [
        (p.full_tensor() if isinstance(p, dt.DTensor) else p) - q
        for p, q in zip(sharded.parameters(), whole.parameters())
    ]
    placed = isinstance(sharded[1].gain.grad, dt.DTensor) and tuple(sharded[1].gain.grad.placements) == (dt.Shard(0),)
    return losses, max(d.abs().max().item() for d in params), placed


def test_training_inside_parallelize_module(worlds):
    for rank, (losses, param_diff, placed) in enumerate(worlds(4).run(run_training, deadline=DEADLINE)):
        assert placed, rank
        assert losses[0] == pytest.approx(losses[1], rel=1e-12, abs=1e-12), (rank, losses)
        assert param_diff < 1e-12, (rank, param_diff)


# ------------------------------------------------------------------------------------------ next to local_map
def run_next_to_local_map():
    """The Megatron MLP (x replicated, w1 Shard(1), w2 Shard(0)) and a sharded RMS norm, with shard_map on DTensors
    and with local_map (the sum left to DTensor as a Partial output, or a differentiable all-reduce inside)."""
    dt = _dtensor()
    import torch.distributed.nn.functional as dist_nn
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.experimental import local_map

    mesh = device_mesh((4,), ("tp",))
    x, w1, w2 = ints(8, 32, seed=1), ints(32, 16, seed=2), ints(16, 32, seed=3)  # 2 KiB sums: real all-reduces
    places = ([dt.Replicate()], [dt.Shard(1)], [dt.Shard(0)])
    ct = ints(8, 32, seed=4)

    def run(fn):
        args = [dt.distribute_tensor(t, mesh, p).requires_grad_() for t, p in zip((x, w1, w2), places)]
        fwd, bwd = CommDebugMode(), CommDebugMode()
        with fwd:
            y = fn(*args)
        with bwd:
            (y * dt.DTensor.from_local(ct, mesh, [dt.Replicate()])).sum().backward()
        data = lambda m: {str(k): v for k, v in m.get_comm_counts().items() if "allreduce" in str(k)}  # noqa: E731
        return y.full_tensor(), [a.grad.full_tensor() for a in args], data(fwd), data(bwd)

    mlp = lambda total: lambda a, b, c: total(torch.relu(a @ b) @ c)  # noqa: E731
    sm = run(shard_map(mlp(lambda v: cm.psum(v, "tp")), mesh, out_specs=P()))
    partial = local_map(mlp(lambda v: v), [dt.Partial()], places, mesh)
    lm = run(lambda *a: partial(*a).redistribute(mesh, [dt.Replicate()]))
    refs = [t.clone().requires_grad_() for t in (x, w1, w2)]
    want = torch.relu(refs[0] @ refs[1]) @ refs[2]
    (want * ct).sum().backward()
    mlp_ok = (
        torch.equal(sm[0], want)
        and all(torch.equal(g, r.grad) for g, r in zip(sm[1], refs))
        and torch.equal(lm[0], want)
        and all(torch.equal(g, r.grad) for g, r in zip(lm[1][1:], refs[1:]))  # local_map's x.grad is not placed
    )
    counts = (sm[2], sm[3])

    h, g = ints(8, 32, seed=5), 1 + ints(32, seed=6).abs()

    def norm_of(total):
        return lambda a, b: a * (total((a * a).sum(-1, keepdim=True)) + 1) * b  # a polynomial: exact in float64

    def run_norm(fn):
        args = [
            dt.distribute_tensor(t, mesh, p).requires_grad_() for t, p in zip((h, g), ([dt.Shard(1)], [dt.Shard(0)]))
        ]
        y = fn(*args)
        (y * dt.DTensor.from_local(ct, mesh, [dt.Replicate()])).sum().backward()
        return y.full_tensor(), [a.grad.full_tensor() for a in args]

    group = mesh.get_group("tp")
    sm_n = run_norm(shard_map(norm_of(lambda v: cm.psum(v, "tp")), mesh, out_specs=P(None, "tp")))
    lm_n = run_norm(
        local_map(
            norm_of(lambda v: dist_nn.all_reduce(v, group=group)), [dt.Shard(1)], ([dt.Shard(1)], [dt.Shard(0)]), mesh
        )
    )
    refs = [h.clone().requires_grad_(), g.clone().requires_grad_()]
    want = norm_of(lambda v: v)(*refs)
    (want * ct).sum().backward()
    norm_ok = all(torch.equal(a, b) for a, b in [(sm_n[0], want), (lm_n[0], want)])
    norm_ok = norm_ok and all(
        torch.equal(a, r.grad) and torch.equal(b, r.grad) for a, b, r in zip(sm_n[1], lm_n[1], refs)
    )
    return mlp_ok, norm_ok, counts


def test_next_to_local_map(worlds):
    """Where local_map's gradients are right, shard_map's equal them; shard_map's equal the reference's always. The
    MLP's backward makes one all-reduce (jax's typed transposes make one: the replicated x's gradient)."""
    for rank, (mlp_ok, norm_ok, (fwd, bwd)) in enumerate(worlds(4).run(run_next_to_local_map, deadline=DEADLINE)):
        assert mlp_ok and norm_ok, (rank, mlp_ok, norm_ok)
        assert sum(fwd.values()) == 1 and sum(bwd.values()) == 1, (rank, fwd, bwd)
