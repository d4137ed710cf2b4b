"""``torch.compile(cmap(f), fullgraph=True)``: one graph with no break, eager cmap's values and gradients, no round.

Every case runs on real gloo worlds of 1, 2 and 3 ranks, with B = 7 (uneven shares at 2 and 3 ranks) and B = 2 (an
empty share at 3 ranks), in float64, against eager ``cmap(f)`` and one-process ``torch.vmap(f)``. The compiled call
runs the same per-example ops on the same rows; what may differ is the order of a sum over ranks (gloo's all-reduce
against the eager protocol's) and aot_eager's decompositions of a matmul. Every value is a sum of at most 7 products
of two or three inputs drawn from a normal distribution (|x| < 6), so the difference is at most
2 * gamma_7(float64) * 7 * 6^3 < 3e-12, far under the float64 tolerance (cases.F64).
"""

from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
from cases import F64, randn

import colossalai_cmap as cm

DOUBLE = torch.float64
W = randn(3, 4, seed=9, dtype=DOUBLE)  # a closure constant (no gradient)


def _close(got: Any, want: Any, what: str) -> None:
    torch.testing.assert_close(got, want, **F64, msg=lambda m: f"{what}: {m}")


# ------------------------------------------------------------------------------------------------------- the cases
def plain(x: torch.Tensor) -> torch.Tensor:
    return x.sin() @ W


def normalised(x: torch.Tensor) -> torch.Tensor:
    return (x - cm.pmean(x, "i")) * cm.psum(x.square().sum(), "i") + cm.axis_index("i")


def two_args(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.sin() @ w


def pytree(x: torch.Tensor) -> Dict[str, Any]:
    return {"row": x.cos(), "pair": (x.sin() @ W, cm.psum(x, "i"))}


def batched(x: torch.Tensor) -> torch.Tensor:
    return x * cm.psum(x.sum(0), "i") + cm.pmax(x.detach(), "i")  # pmax has no gradient


def _column(B: int) -> torch.Tensor:
    return randn(3, B, seed=B + 1, dtype=DOUBLE)


# name: (func, cmap options, the arguments for B examples, the one-process reference)
CASES: Dict[str, Tuple[Callable, Dict[str, Any], Callable[[int], Tuple[Any, ...]], Callable]] = {
    "plain": (plain, {}, lambda B: (randn(B, 3, seed=B, dtype=DOUBLE),), torch.vmap(plain)),
    "pmean/psum": (
        normalised,
        dict(axis_name="i"),
        lambda B: (randn(B, 3, seed=B, dtype=DOUBLE),),
        lambda x: (x - x.mean(0)) * x.square().sum() + torch.arange(x.shape[0], dtype=DOUBLE)[:, None],
    ),
    "in_dims=(1, None)": (
        two_args,
        dict(in_dims=(1, None)),
        lambda B: (_column(B), W.clone()),
        torch.vmap(two_args, in_dims=(1, None)),
    ),
    "pytree out_dims": (
        pytree,
        dict(axis_name="i", out_dims={"row": 1, "pair": (0, None)}),
        lambda B: (randn(B, 3, seed=B, dtype=DOUBLE),),
        lambda x: {"row": x.cos().T, "pair": (x.sin() @ W, x.sum(0))},
    ),
    "batched": (
        batched,
        dict(axis_name="i", mode="batched"),
        lambda B: (randn(B, 3, seed=B, dtype=DOUBLE),),
        lambda x: x * x.sum() + x.detach().amax(0),
    ),
}


def _counted() -> Tuple[List[str], Callable[[], None]]:
    """Count the torch.distributed calls the eager protocol makes (a status round is one); returns the undo."""
    calls: List[str] = []
    names = ("all_gather_into_tensor", "all_reduce", "broadcast", "gather", "scatter", "all_to_all_single")
    saved = {n: getattr(dist, n) for n in names}

    def wrap(name: str, fn: Callable) -> Callable:
        def counted(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return fn(*args, **kwargs)

        return counted

    for n, fn in saved.items():
        setattr(dist, n, wrap(n, fn))
    return calls, lambda: [setattr(dist, n, fn) for n, fn in saved.items()]


def _local(out: Any, name: str) -> Any:
    """This rank's share of a reference output, as dst="local" returns it (the chunk shares of a gathered call are
    not the local ones: dst="local" splits like torch.tensor_split)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    if name == "pytree out_dims":
        return {
            "row": out["row"].tensor_split(size, 1)[rank],
            "pair": (out["pair"][0].tensor_split(size)[rank], out["pair"][1]),
        }
    return out.tensor_split(size)[rank]


def _loss(out: Any) -> torch.Tensor:
    """A loss that weighs every output leaf differently, so a gradient routed to the wrong leaf shows."""
    flat = torch.utils._pytree.tree_leaves(out)
    return sum(((v.sin() * (k + 1)).sum() for k, v in enumerate(flat)), torch.zeros((), dtype=DOUBLE))


def _grads(fn: Callable, args: Tuple[Any, ...]) -> Tuple[Any, List[torch.Tensor]]:
    """``fn``'s output and the gradients of every argument (a mapped one, and an unmapped one whose gradient is
    summed over the ranks)."""
    leaves = [a.clone().requires_grad_() for a in args]
    out = fn(*leaves)
    _loss(out).backward()
    return out, [a.grad for a in leaves]


def check_case(name: str, B: int, dsts: Tuple[Any, ...], explain: bool) -> int:
    """Compiled cmap = eager cmap = vmap, values and gradients, for each ``dst`` (-1 or "local"); no torch.distributed
    call of the eager protocol (no status round); with ``explain``, dynamo's count: one graph, no break."""
    func, options, make, ref = CASES[name]
    args = make(B)
    want, want_grads = _grads(ref, args)
    for dst in dsts:
        torch._dynamo.reset()
        mapped = cm.cmap(func, dst=dst, **options)
        compiled = torch.compile(mapped, fullgraph=True, backend="aot_eager")
        calls, undo = _counted()
        try:
            with cm.record_collectives() as log:
                got, got_grads = _grads(compiled, args)
        finally:
            undo()
        assert (calls, log.count) == ([], 0), f"{name} dst={dst}: the compiled call ran {calls}, {log.count}"
        eager, eager_grads = _grads(mapped, args)
        what = f"{name} B={B} dst={dst}"
        _close(got, eager, f"{what}: compiled vs eager")
        _close(got_grads, eager_grads, f"{what}: gradients, compiled vs eager")
        if dst == -1:
            _close(got, want, f"{what}: compiled vs vmap")
            _close(got_grads, want_grads, f"{what}: gradients, compiled vs vmap")
        else:  # each rank's loss of its own share, out_dims=None outputs counted once: vmap's gradients
            _close(got, _local(want, name), f"{what}: compiled vs this rank's share of vmap")
            _close(got_grads, want_grads, f"{what}: gradients, compiled vs vmap")
        if explain:
            explained = torch._dynamo.explain(mapped)(*args)
            assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained
    return 1


# (world size, batch, cases, dsts, explain): the collectives, in_dims and pytrees at 3 ranks with uneven shares
# (7 = 3 + 3 + 1, or 3 + 2 + 2 with dst="local"); an empty share (B = 2 < 3: one stand-in example); 4 ranks (2 + 2
# + 2 + 1); 2 ranks; one process. Each compile costs seconds on a loaded machine, so the matrix is a cover, not a product.
MATRIX = [
    (3, 7, ("pmean/psum", "in_dims=(1, None)", "pytree out_dims"), (-1,), False),
    (3, 7, ("pytree out_dims",), ("local",), False),
    (3, 2, ("pmean/psum",), ("local",), False),
    (2, 7, ("plain", "batched"), (-1,), False),
    (4, 7, ("pmean/psum",), (-1,), False),
    (2, 7, ("pmean/psum",), (-1,), True),
    (1, 7, ("pmean/psum",), (-1,), True),
]


@pytest.mark.parametrize(
    "P,B,names,dsts,explain", MATRIX, ids=[f"P{m[0]}-B{m[1]}-{'-'.join(map(str, m[3]))}" for m in MATRIX]
)
def test_compiled_cmap(worlds, P, B, names, dsts, explain):
    for name in names:
        assert worlds(P).run(check_case, name, B, dsts, explain, deadline=240) == [1] * P, name


# ---------------------------------------------------------------------------------------------- what runs eagerly
def check_eager_options() -> List[str]:
    """Options only the eager orchestration has: a graph break (the eager call, same values), and with
    fullgraph=True dynamo's error, naming the option."""
    x = randn(5, 3, seed=1, dtype=DOUBLE)
    w = W.clone().requires_grad_()
    messages = []
    for options, func in [
        (dict(dst=0), plain),
        (dict(src=0), plain),
        (dict(mode="loop"), plain),
        (dict(randomness="different"), plain),
        (dict(check_inputs=True), plain),
        ({}, lambda v: v.sin() @ w),  # a closure-captured tensor that requires grad
    ]:
        torch._dynamo.reset()
        mapped = cm.cmap(func, **options)
        eager = mapped(x)
        got = torch.compile(mapped, backend="aot_eager")(x)
        if eager is not None:
            _close(got, eager, f"{options} graph break")
        torch._dynamo.reset()
        with pytest.raises(torch._dynamo.exc.Unsupported, match="cmap runs eagerly") as caught:
            torch.compile(mapped, fullgraph=True, backend="aot_eager")(x)
        messages.append(str(caught.value).split(": ", 1)[1].split(" in file")[0])
    return messages


class _Holder:
    """A plain object holding a trainable tensor (no module, no closure cell)."""

    def __init__(self) -> None:
        self.w = W.clone().requires_grad_()


HOLDER = _Holder()


def _through_helper(v: torch.Tensor) -> torch.Tensor:
    return v.sin() @ HOLDER.w


def check_reached_trainable() -> List[bool]:
    """A trainable tensor func reaches through a helper function and a plain object's attribute: the compiled call
    runs eagerly, so its gradient is summed over the ranks as eager cmap's is (compiled, it would be this rank's)."""
    x = randn(5, 3, seed=2, dtype=DOUBLE)
    found = []
    for func in (_through_helper, lambda v: _through_helper(v) + 1):
        mapped = cm.cmap(func)
        HOLDER.w.grad = None
        mapped(x).sum().backward()
        eager = HOLDER.w.grad.clone()
        HOLDER.w.grad = None
        torch._dynamo.reset()
        torch.compile(mapped, backend="aot_eager")(x).sum().backward()
        _close(HOLDER.w.grad, eager, "the reached tensor's gradient")
        _close(eager, (torch.sin(x).T @ torch.ones(5, 4, dtype=DOUBLE)), "the gradient over the whole batch")
        found.append(True)
    return found


def test_a_trainable_tensor_reached_through_helpers_runs_eagerly(worlds):
    assert worlds(2).run(check_reached_trainable, deadline=180) == [[True, True]] * 2


def _with_nested(v: torch.Tensor) -> torch.Tensor:
    return cm.cmap(lambda r: r.sin() * cm.psum(r, "j"), axis_name="j")(v.unsqueeze(0).expand(2, 3)) + cm.psum(v, "i")


def _with_break(v: torch.Tensor) -> torch.Tensor:
    y = v.sin()
    torch._dynamo.graph_break()  # what print() or data-dependent Python control flow in func does
    return y * cm.psum(v, "i")


def check_breaks_inside_func() -> List[str]:
    """A cmap nested in func (it runs eagerly, as plain torch.vmap over this rank's examples) and a graph break in
    func itself: the compiled call gives eager cmap's values and gradients."""
    x = randn(7, 3, seed=4, dtype=DOUBLE)
    for func in (_with_nested, _with_break):
        mapped = cm.cmap(func, axis_name="i")
        want, want_grad = _value_and_grad(mapped, x)
        torch._dynamo.reset()
        got, got_grad = _value_and_grad(torch.compile(mapped, backend="aot_eager"), x)
        _close(got, want, f"{func.__name__} value")
        _close(got_grad, want_grad, f"{func.__name__} gradient")
    return [f.__name__ for f in (_with_nested, _with_break)]


def _value_and_grad(fn: Callable, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_()
    out = fn(x)
    out.square().sum().backward()
    return out.detach(), x.grad


def test_a_nested_cmap_and_a_graph_break_in_func(worlds):
    assert worlds(3).run(check_breaks_inside_func, deadline=180) == [["_with_nested", "_with_break"]] * 3


def test_eager_options_break_the_graph(worlds):
    got = worlds(2).run(check_eager_options, deadline=180)
    assert got[0] == got[1]
    for word, message in zip(["dst=r", "src=r", "loop", "randomness", "check_inputs", "closure-captured"], got[0]):
        assert word in message, message


# -------------------------------------------------------------------------------------- the training step's form
def check_training_step() -> List[Any]:
    """A compiled training step whose loss is a cmap over a trainable weight, two SGD steps against eager ones.

    With the cmap made outside the compiled step and the weight passed with ``in_dims=None``, the step is one graph
    with no break and gives eager's values and gradients (summed over the ranks). Made inside the step, closing
    over the weight, the cmap is made out of the graph: a graph break whose text (dynamo's error under
    ``fullgraph=True``) names the closure and that remedy; without ``fullgraph`` the step still gives eager's values.
    """
    x = randn(5, 3, seed=2, dtype=DOUBLE)
    mapped = cm.cmap(
        lambda v, w: torch.tanh(v @ w) / cm.psum(torch.ones((), dtype=DOUBLE), "i"), (0, None), axis_name="i"
    )

    def argument_step(w: torch.Tensor) -> torch.Tensor:
        return mapped(x, w).sum()

    def closure_step(w: torch.Tensor) -> torch.Tensor:
        return cm.cmap(lambda v: torch.tanh(v @ w) / cm.psum(torch.ones((), dtype=DOUBLE), "i"), axis_name="i")(x).sum()

    def train(step: Callable[[torch.Tensor], torch.Tensor]) -> Tuple[List[float], torch.Tensor]:
        w = W[:, :3].clone().requires_grad_()
        opt = torch.optim.SGD([w], lr=0.5)
        losses = []
        for _ in range(2):
            opt.zero_grad()
            loss = step(w)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, w.detach()

    torch._dynamo.reset()
    want_losses, want_w = train(argument_step)
    explained = torch._dynamo.explain(argument_step)(W[:, :3].clone().requires_grad_())
    counts = (explained.graph_count, explained.graph_break_count)
    torch._dynamo.reset()
    got_losses, got_w = train(torch.compile(argument_step, fullgraph=True, backend="aot_eager"))
    _close(got_losses, want_losses, "compiled step's losses")
    _close(got_w, want_w, "the weight after two compiled steps")
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported) as refused:
        train(torch.compile(closure_step, fullgraph=True, backend="aot_eager"))
    torch._dynamo.reset()
    broken_losses, broken_w = train(torch.compile(closure_step, backend="aot_eager"))
    _close(broken_losses, want_losses, "closure step's losses (graph breaks)")
    _close(broken_w, want_w, "the weight after two closure steps (graph breaks)")
    return [counts, str(refused.value)]


@pytest.mark.parametrize("P", [1, 2])
def test_compiled_training_step(worlds, P):
    for counts, message in worlds(P).run(check_training_step, deadline=240):
        assert counts == (1, 0), counts
        assert "closes over" in message and "in_dims=None" in message and "outside torch.compile" in message, message
