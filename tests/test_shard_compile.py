"""``torch.compile(shard_map(f), fullgraph=True)``: one graph with no break, eager shard_map's values and gradients.

Real gloo worlds of 4 ranks on a 2 x 2 mesh ("x", "y"), in float64, against the eager shard_map (``check_vma=True``,
the default, and ``check_vma=False``) and the unsharded computation on the same numbers. The compiled call runs the
same block ops; what may differ is the order of a sum over ranks (gloo's all-reduce against the eager protocol's)
and aot_eager's decompositions of a matmul: every value is a sum of at most 8 products of three inputs drawn from
a normal distribution (|x| < 6), so the difference is at most 2 * gamma_8(float64) * 8 * 6^3 < 1e-11, far under
the float64 tolerance (cases.F64). Each compile costs seconds here, so the cases share compiles: one compile per
case, counted by dynamo's ``CompileCounterWithBackend`` (a recompile or a graph break would count two frames).
"""

from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch._dynamo.testing
from cases import F64, randn
from shard_cases import mesh

import colossalai_cmap as cm
from colossalai_cmap import P

DOUBLE = torch.float64


def _close(got: Any, want: Any, what: str) -> None:
    torch.testing.assert_close(got, want, **F64, msg=lambda m: f"{what}: {m}")


# ------------------------------------------------------------------------------------------------------- the cases
def megatron(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Megatron's MLP: batch over "x", columns of w1 and rows of w2 over "y", one psum."""
    return cm.psum(torch.tanh(x @ w1) @ w2, "y")


def fsdp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """FSDP: batch and weights over both axes, each weight all-gathered (tiled) before use."""
    full1 = cm.all_gather(w1, ("x", "y"), tiled=True)
    return torch.tanh(x @ full1) @ cm.all_gather(w2, ("x", "y"), tiled=True)


def scattered(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Megatron's MLP with its psum scattered over the batch (sequence parallelism's reduce-scatter)."""
    return cm.psum_scatter(torch.tanh(x @ w1) @ w2, "y", scatter_dimension=0, tiled=True)


def many(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """The other collectives, each on a varying block: ppermute, all_to_all, axis_index, pcast, all_gather_invariant,
    pmean, pmax (no gradient), pbroadcast."""
    h = torch.tanh(x @ w1)  # (2, 4) per rank
    shifted = cm.ppermute(h, "x", [(0, 1), (1, 0)])
    swapped = cm.all_to_all(h, "y", 0, 0, tiled=True)
    ranked = h * (1 + cm.axis_index("y")) + cm.pmax(h.detach(), "x")
    cast = cm.pcast(w2.sum(), "y", to="varying") * h
    whole = cm.all_gather_invariant(h, "y", tiled=True)  # invariant over "y"
    return shifted + ranked + cast, swapped, cm.pmean(whole, "x"), cm.pbroadcast(h, "x", 1)


def _mlp_args() -> Tuple[torch.Tensor, ...]:
    return (
        randn(4, 8, seed=1, dtype=DOUBLE),
        randn(8, 8, seed=2, dtype=DOUBLE) / 3,
        randn(8, 8, seed=3, dtype=DOUBLE) / 3,
    )


def _unsharded(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w1) @ w2


# name: (f, in_specs, out_specs, the unsharded reference or None)
CASES: Dict[str, Tuple[Callable, Any, Any, Any]] = {
    "megatron": (megatron, (P("x"), P(None, "y"), P("y", None)), P("x"), _unsharded),
    "fsdp": (fsdp, (P(("x", "y")), P(("x", "y")), P(("x", "y"))), P(("x", "y")), _unsharded),
    "psum_scatter": (scattered, (P(), P(None, "y"), P("y", None)), P("y"), _unsharded),
    "collectives": (
        many,
        (P("x"), P(None, "y"), P()),
        (P("x", "y"), P("x", "y"), P(None, None), P("x", "y")),
        None,
    ),
}


# more shard_map options per case: the reduce-scatter runs with "y" the only manual axis (partial manual: f sees whole
# values along "x", computed alike on its ranks)
OPTIONS: Dict[str, Dict[str, Any]] = {"psum_scatter": dict(axis_names={"y"})}


def _loss(out: Any) -> torch.Tensor:
    """A loss that weighs every output leaf differently, so a gradient routed to the wrong leaf shows."""
    flat = torch.utils._pytree.tree_leaves(out)
    return sum(((v.sin() * (k + 1)).sum() for k, v in enumerate(flat)), torch.zeros((), dtype=DOUBLE))


def _grads(fn: Callable, args: Tuple[torch.Tensor, ...]) -> Tuple[Any, List[torch.Tensor]]:
    leaves = [a.clone().requires_grad_() for a in args]
    out = fn(*leaves)
    _loss(out).backward()
    return torch.utils._pytree.tree_map(torch.Tensor.detach, out), [a.grad for a in leaves]


def check_case(name: str, check_vma: bool, backend: str) -> int:
    """Compiled = eager shard_map = the unsharded computation, values and every input's gradient, on every rank; one
    frame compiled with fullgraph=True; returns dynamo's frame count."""
    f, in_specs, out_specs, ref = CASES[name]
    args = _mlp_args()
    grid = mesh((2, 2), ("x", "y"))
    options = OPTIONS.get(name, {})
    sm = cm.shard_map(f, mesh=grid, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma, **options)
    eager, eager_grads = _grads(sm, args)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(sm, fullgraph=True, backend=counter)
    with cm.record_collectives() as log:  # tracing runs the eager call once, for check_vma's check of out_specs
        got, got_grads = _grads(compiled, args)
    assert (log.count > 0) == check_vma, log
    with cm.record_collectives() as log:  # the same graph again (no recompile): none of the eager protocol's
        again, _ = _grads(compiled, args)
    assert log.count == 0, log
    what = f"{name} check_vma={check_vma} {backend}"
    _close(got, eager, f"{what}: compiled vs eager")
    _close(again, eager, f"{what}: second compiled call vs eager")
    _close(got_grads, eager_grads, f"{what}: gradients, compiled vs eager")
    if ref is not None:
        want, want_grads = _grads(ref, args)
        _close(got, want, f"{what}: compiled vs unsharded")
        _close(got_grads, want_grads, f"{what}: gradients, compiled vs unsharded")
    if name == "megatron":  # dynamo's own account: one graph, no break
        explained = torch._dynamo.explain(sm)(*args)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained
    return counter.frame_count


# (case, check_vma, backend): each compile costs seconds, so the matrix is a cover, not a product
MATRIX = [
    ("megatron", True, "aot_eager"),
    ("fsdp", True, "aot_eager"),
    ("psum_scatter", True, "eager"),  # partial manual (OPTIONS)
    ("collectives", True, "aot_eager"),
    ("collectives", False, "eager"),
]


@pytest.mark.parametrize("name,check_vma,backend", MATRIX, ids=[f"{m[0]}-vma{int(m[1])}-{m[2]}" for m in MATRIX])
def test_compiled_shard_map(worlds, name, check_vma, backend):
    assert worlds(4).run(check_case, name, check_vma, backend, deadline=300) == [1] * 4


# ---------------------------------------------------------------------------------------------- what runs eagerly
def check_refusals() -> List[str]:
    """What the compiled call cannot lower runs eagerly, out of the graph: without fullgraph, a graph break with the
    eager values and gradients; with fullgraph=True, dynamo's error, whose text names what and the fix."""
    line = mesh((2,), ("x",))
    w = randn(3, 3, seed=5, dtype=DOUBLE).requires_grad_()
    smapped = cm.smap(lambda v: cm.psum(v, "x"), in_axes=0, out_axes=None, axis_name="x")
    cases = [
        (lambda v: cm.psum(v @ w, "x"), randn(4, 3, seed=6, dtype=DOUBLE)),  # a closure that requires grad
        (lambda v: v.sin(), randn(5, 3, seed=7, dtype=DOUBLE)),  # 5 rows over 2 ranks
        (lambda v: cm.psum(v, "x", axis_index_groups=[[0], [1]]), randn(4, 3, seed=8, dtype=DOUBLE)),
    ]
    messages = []
    for f, x in cases:
        sm = cm.shard_map(f, mesh=line, in_specs=P("x"), out_specs=P("x"))
        want, want_grads = _grads(sm, (x,))
        w.grad = None
        torch._dynamo.reset()
        got, got_grads = _grads(torch.compile(sm, backend="aot_eager"), (x,))
        _close((got, got_grads), (want, want_grads), "a graph break")
        w.grad = None
        torch._dynamo.reset()
        with pytest.raises(torch._dynamo.exc.Unsupported, match="runs eagerly") as caught:
            torch.compile(sm, fullgraph=True, backend="eager")(x)
        messages.append(str(caught.value).split("skip function ", 1)[1].split(" in file")[0])
    with cm.set_mesh(line):  # smap makes its shard_map at each call, from the mesh in context
        x = randn(2, 3, seed=10, dtype=DOUBLE)
        want = _grads(smapped, (x,))
        torch._dynamo.reset()
        _close(_grads(torch.compile(smapped, backend="aot_eager"), (x,)), want, "smap, a graph break")
        torch._dynamo.reset()
        with pytest.raises(torch._dynamo.exc.Unsupported, match="runs eagerly") as caught:
            torch.compile(smapped, fullgraph=True, backend="eager")(x)
        messages.append(str(caught.value).split("skip function ", 1)[1].split(" in file")[0])
    return messages


def check_wrong_out_specs() -> List[str]:
    """check_vma's check of out_specs runs while dynamo traces (an eager call without gradients): a wrong entry is
    jax's error on every rank, compiled as eagerly, and with fullgraph=True dynamo's error says why; the inputs, which
    f changes in place, and the random stream are as they were."""
    line = mesh((2,), ("x",))

    def f(v: torch.Tensor, scale: Dict[str, Any]) -> torch.Tensor:
        v.mul_(scale["by"])  # in place, on the caller's rows
        return v * torch.rand(()).to(v.dtype)  # varies over "x", but out_specs says P()

    sm = cm.shard_map(f, mesh=line, in_specs=(P("x"), P()), out_specs=P())
    x, scale = randn(4, 3, seed=9, dtype=DOUBLE), {"by": 2.0, "name": "kept"}
    messages = []
    for fullgraph in (True, False):
        torch._dynamo.reset()
        given, state = x.clone(), torch.get_rng_state()
        with pytest.raises(Exception) as caught:
            torch.compile(sm, fullgraph=fullgraph, backend="eager")(given, scale)
        messages.append(f"{type(caught.value).__name__}: {caught.value}")
        if fullgraph:  # refused before anything ran: the trace-time call changed copies, and drew on a fork
            _close(given, x, "the inputs after the trace-time check")
            assert torch.equal(torch.get_rng_state(), state), "the random stream moved"
    torch._dynamo.reset()
    right = cm.shard_map(f, mesh=line, in_specs=(P("x"), P()), out_specs=P("x"))
    torch.manual_seed(3)
    given = x.clone()
    want = right(given, scale)
    torch.manual_seed(3)
    again = x.clone()
    got = torch.compile(right, fullgraph=True, backend="eager")(again, scale)
    _close((got, again), (want, given), "the right out_specs, compiled (values, the inputs changed in place)")
    return messages


def test_what_cannot_compile_runs_eagerly_and_says_why(worlds):
    got = worlds(2).run(check_refusals, deadline=240)
    assert got[0] == got[1] and len(got[0]) == 4, got
    for words, message in zip(
        [("closure", "in_specs entry"), ("do not divide", "pad"), ("axis_index_groups",), ("smap", "axis_names=")],
        got[0],
    ):
        assert all(w in message for w in words), message
    refused, raised = worlds(2).run(check_wrong_out_specs, deadline=240)[1]
    assert "Unsupported" in refused and "check_vma" in refused and "fix that entry" in refused, refused
    assert raised.startswith("CmapError") and "out_specs which require replication" in raised, raised
    assert "out_specs is P() which implies" in raised and "{x}" in raised, raised


# -------------------------------------------------------------------------------------- the training step's form
def check_training_step(local: bool) -> Tuple[Any, ...]:
    """A compiled training step whose loss is a Megatron MLP under shard_map, with a graph break inside f (a print's)
    in the second form: three SGD steps against eager ones, the same losses and weights; the first form one frame.
    With ``local``, the per-device style: each rank passes its own blocks and gets its blocks back."""
    grid = mesh((2, 2), ("x", "y"))
    x, w1, w2 = _mlp_args()
    specs = (P("x"), P(None, "y"), P("y", None))
    if local:  # this rank's blocks of the same global arguments
        coords = dict(zip(("x", "y"), grid.get_coordinate()))
        x = x.tensor_split(2)[coords["x"]]
        w1, w2 = w1.tensor_split(2, 1)[coords["y"]], w2.tensor_split(2)[coords["y"]]

    def broken(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ w1)
        torch._dynamo.graph_break()
        return cm.psum(h @ w2, "y")

    def train(f: Callable, compiled: bool) -> Tuple[List[float], List[torch.Tensor], int]:
        sm = cm.shard_map(f, mesh=grid, in_specs=specs, out_specs=P("x"), local=local)
        counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")

        def step(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return sm(x, a, b).square().mean()

        torch._dynamo.reset()
        run = torch.compile(step, fullgraph=f is megatron, backend=counter) if compiled else step
        weights = [w1.clone().requires_grad_(), w2.clone().requires_grad_()]
        opt = torch.optim.SGD(weights, lr=0.5)
        losses = []
        for _ in range(3):
            opt.zero_grad()
            loss = run(x, *weights)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, [v.detach() for v in weights], counter.frame_count

    want_losses, want_weights, _ = train(megatron, False)
    got_losses, got_weights, frames = train(megatron, True)
    _close(got_losses, want_losses, "compiled losses")
    _close(got_weights, want_weights, "the weights after three compiled steps")
    broken_losses, broken_weights, broken_frames = train(broken, True)
    _close(broken_losses, want_losses, "losses with a graph break in f")
    _close(broken_weights, want_weights, "the weights with a graph break in f")
    return frames, broken_frames > 1


@pytest.mark.parametrize("local", [False, True], ids=["global", "local"])
def test_compiled_training_step(worlds, local):
    assert worlds(4).run(check_training_step, local, deadline=300) == [(1, True)] * 4
