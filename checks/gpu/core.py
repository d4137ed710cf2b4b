"""The cmap checks on this rank's device: values against ``torch.vmap``, gradients, collectives inside func, and
failures. Each function takes the :class:`Ctx` and returns a detail line, or raises AssertionError.

Inputs are drawn on the CPU from a fixed seed and then moved to the device, so every rank holds the same values
(``src=None`` needs that), whatever GPU it runs on.
"""

import copy
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import nn

import colossalai_cmap as cm
from checks.gpu.report import Reporter, compare

# Checks compute in float64: a sum split over ranks adds in another order, and in float64 that moves it by far less
# than this at these sizes (n terms: about n * 1.1e-16 * sum|terms|), whereas no fixed float32 tolerance would hold.
F64 = dict(atol=1e-9, rtol=1e-9)


@dataclass
class Ctx:
    """What every check needs: this rank's device and place in the world, and the reporter."""

    device: torch.device
    rank: int
    size: int
    rep: Reporter

    def data(self, *shape: int, seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """The same tensor on every rank, on this rank's device."""
        return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype).to(self.device)

    def rows(self, batch: int) -> Tuple[int, int]:
        """This rank's (start, rows) of a batch split like ``torch.tensor_split`` (``src``/``dst="local"``)."""
        q, r = divmod(batch, self.size)
        return self.rank * q + min(self.rank, r), q + (1 if self.rank < r else 0)

    def batches(self) -> List[int]:
        """A batch that divides, an uneven one, and (with 2+ ranks) one smaller than the world."""
        return [8 * self.size, 4 * self.size + 1] + ([self.size - 1] if self.size > 1 else [])


def _on_device(ctx: Ctx, out: Any) -> None:
    for leaf in torch.utils._pytree.tree_leaves(out):
        if isinstance(leaf, torch.Tensor) and leaf.device != ctx.device:
            raise AssertionError(f"an output is on {leaf.device}, not on this rank's {ctx.device}")


def _pytree_f(a: torch.Tensor, b: torch.Tensor) -> Dict[str, Any]:
    return {"dot": torch.dot(a, b), "pair": (torch.sin(a) * b, a.amax())}


def dst_all(ctx: Ctx) -> str:
    """``dst=-1``: every rank gets vmap's result; a pytree output, ``in_dims``, an nn.Module, batched mode."""
    notes = []
    for B in ctx.batches():
        x, y = ctx.data(B, 128, seed=B), ctx.data(B, 128, seed=B + 1)
        out = cm.cmap(torch.dot)(x, y)
        _on_device(ctx, out)
        notes.append(f"B={B} {compare(f'dot B={B}', out, torch.vmap(torch.dot)(x, y))}")
        got = cm.cmap(_pytree_f, in_dims=(0, None))(x, y[0])
        compare(f"pytree B={B}", got, torch.vmap(_pytree_f, in_dims=(0, None))(x, y[0]))
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)).double().to(ctx.device)
    x = ctx.data(4 * ctx.size + 3, 32, seed=7)
    with torch.no_grad():
        compare("cmap(model)", cm.cmap(model)(x), torch.vmap(model)(x))
        compare("cmap(model, mode='batched')", cm.cmap(model, mode="batched")(x), model(x))
    return f"dot: {', '.join(notes)}; a pytree with in_dims=(0, None), an nn.Module (vmap and batched modes) match"


def dst_zero(ctx: Ctx) -> str:
    """``dst=0``: rank 0 gets vmap's result, every other rank None."""
    for B in ctx.batches():
        x, y = ctx.data(B, 64, seed=B), ctx.data(B, 64, seed=B + 1)
        out = cm.cmap(torch.dot, dst=0)(x, y)
        if ctx.rank == 0:
            _on_device(ctx, out)
            compare(f"dst=0 B={B}", out, torch.vmap(torch.dot)(x, y))
        elif out is not None:
            raise AssertionError(f"dst=0 B={B}: rank {ctx.rank} got {type(out).__name__}, not None")
    return f"rank 0 gets vmap's result, the others None (B in {ctx.batches()})"


def dst_local(ctx: Ctx) -> str:
    """``dst="local"``: each rank keeps its own rows' results (the batch split like ``torch.tensor_split``)."""
    for B in ctx.batches():
        x = ctx.data(B, 64, seed=B)
        out = cm.cmap(torch.sin, dst="local")(x)
        start, rows = ctx.rows(B)
        _on_device(ctx, out)
        compare(f"dst='local' B={B}", out, torch.vmap(torch.sin)(x.narrow(0, start, rows)), exact=True)
    return f"each rank holds vmap's result on its tensor_split rows (B in {ctx.batches()})"


def sources(ctx: Ctx) -> str:
    """``src=None``, ``src=0`` (others pass None) and ``src="local"`` (each passes its rows), into ``dst=-1``."""
    for B in ctx.batches():
        x, w, mat = ctx.data(B, 48, seed=B), ctx.data(48, seed=3), ctx.data(6, 48, seed=4)
        want = torch.vmap(torch.mv, in_dims=(None, 0))(mat, x)
        for src in (None, 0, "local"):
            if src == "local":
                start, rows = ctx.rows(B)
                arg = x.narrow(0, start, rows)
            else:
                arg = x if (src is None or ctx.rank == 0) else None
            got = cm.cmap(torch.mv, in_dims=(None, 0), src=src)(mat, arg)
            _on_device(ctx, got)
            compare(f"src={src!r} B={B}", got, want)
        compare(f"src='local', dst='local' B={B}", cm.cmap(torch.sin, src="local", dst="local")(w[None]), w[None].sin())
    return f"src=None, 0 and 'local' give vmap's result on every rank (B in {ctx.batches()})"


def gradients(ctx: Ctx) -> str:
    """Backward through cmap: mapped and unmapped arguments, a closure tensor, float64 (summed across ranks)."""
    B = 4 * ctx.size + 1
    x0, w0, c0 = (ctx.data(*shape, seed=s) for s, shape in enumerate([(B, 16), (16,), (3,)]))
    grads = []
    for mapper in (torch.vmap, cm.cmap):
        x, w, c = (t.clone().requires_grad_() for t in (x0, w0, c0))
        out = mapper(lambda a, v: torch.tanh(a @ v + c.sum()) * a, in_dims=(0, None))(x, w)
        (out.sin() * x0).sum().backward()
        grads.append((x.grad, w.grad, c.grad))
    note = compare("gradients of (x, w, closure)", grads[1], grads[0], **F64)
    return f"x.grad, w.grad and a closure's grad equal vmap's ({note}, B={B})"


def module_gradients(ctx: Ctx) -> str:
    """An nn.Module's parameter gradients through ``cmap(model)``, and per-example ``torch.func.grad``."""
    torch.manual_seed(0)  # the same weights on every rank
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).double().to(ctx.device)
    twin = copy.deepcopy(model)
    x, y = ctx.data(4 * ctx.size + 2, 16, seed=4), ctx.data(4 * ctx.size + 2, 4, seed=5)
    cm.cmap(model)(x).sub(y).pow(2).sum().backward()
    torch.vmap(twin)(x).sub(y).pow(2).sum().backward()
    note = compare("module grads", [p.grad for p in model.parameters()], [p.grad for p in twin.parameters()], **F64)
    params = {k: v.detach() for k, v in twin.named_parameters()}

    def loss(p: Dict[str, torch.Tensor], a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (torch.func.functional_call(twin, p, (a,)) - b).pow(2).sum()

    per_example = torch.func.grad(loss)
    got = cm.cmap(per_example, in_dims=(None, 0, 0))(params, x, y)
    compare("per-example grads", got, torch.vmap(per_example, in_dims=(None, 0, 0))(params, x, y), **F64)
    return f"parameter grads equal vmap's ({note}); cmap(torch.func.grad(loss)) per-example grads match"


# ------------------------------------------------------------------------------- collectives inside func
def _each(B: int, fn: Callable[[int], torch.Tensor]) -> torch.Tensor:
    return torch.stack([fn(i) for i in range(B)])


def _ring(B: int) -> List[Tuple[int, int]]:
    return [(i, (i + 1) % B) for i in range(B)]


# (name, per-example shape for a batch B, the op on one example, the oracle on the whole batch X of shape (B, ...))
COLLECTIVES: List[Tuple[str, Callable, Callable, Callable]] = [
    ("psum", lambda B: (3,), lambda B: lambda v: cm.psum(v, "i"), lambda X: X.sum(0, keepdim=True).expand_as(X)),
    (
        "all_gather",
        lambda B: (3,),
        lambda B: lambda v: cm.all_gather(v, "i"),
        lambda X: X.unsqueeze(0).expand(X.shape[0], *X.shape),
    ),
    (
        "psum_scatter",
        lambda B: (B, 3),
        lambda B: lambda v: cm.psum_scatter(v, "i"),
        lambda X: _each(X.shape[0], lambda i: X.sum(0)[i]),
    ),
    (
        "all_to_all",
        lambda B: (B, 3),
        lambda B: lambda v: cm.all_to_all(v, "i", 0, 1),
        lambda X: _each(X.shape[0], lambda i: torch.stack([X[j][i] for j in range(X.shape[0])], 1)),
    ),
    (
        "ppermute",
        lambda B: (2, 3),
        lambda B: lambda v: cm.ppermute(v, "i", _ring(B)),
        lambda X: torch.roll(X, 1, 0),
    ),
]


def collective(ctx: Ctx, name: str) -> str:
    """One collective inside ``cmap(f, axis_name="i")``: values and the gradient of a loss, against the oracle."""
    _, shape, op, oracle = next(c for c in COLLECTIVES if c[0] == name)
    notes = []
    for B in (2 * ctx.size, 2 * ctx.size + 1):
        X0 = ctx.data(B, *shape(B), seed=B)
        W = ctx.data(*oracle(X0).shape, seed=B + 1)
        results = []
        for fn in (cm.cmap(op(B), axis_name="i"), oracle):
            X = X0.clone().requires_grad_()
            out = fn(X)
            (out.sin() * W).sum().backward()
            results.append((out.detach(), X.grad))
        notes.append(f"B={B} {compare(name, results[0], results[1], **F64)}")
    return f"values and gradients equal the oracle's ({', '.join(notes)})"


# ------------------------------------------------------------------------------------------------ failures
def _fails_on_last(size: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def f(v: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == size - 1:
            raise ValueError("injected failure")
        return v * 2

    return f


def _fails_before_psum(size: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def f(v: torch.Tensor) -> torch.Tensor:  # the others wait in psum while the last rank has failed
        if dist.get_rank() == size - 1:
            raise ValueError("injected failure")
        return cm.psum(v, "i")

    return f


def failure(ctx: Ctx) -> str:
    """A ValueError on the last rank is a CmapError (also a ValueError) on every rank; the group still works."""
    last = ctx.size - 1
    x = ctx.data(4 * ctx.size, 8, seed=9)
    for what, fn in (
        ("in func", cm.cmap(_fails_on_last(ctx.size))),
        ("before a psum the others wait in", cm.cmap(_fails_before_psum(ctx.size), axis_name="i")),
    ):
        try:
            fn(x)
        except cm.CmapError as exc:
            if not isinstance(exc, ValueError) or f"global rank {last}) raised ValueError" not in str(exc):
                raise AssertionError(f"{what}: the CmapError does not name rank {last}'s ValueError: {exc}") from exc
        else:
            raise AssertionError(f"{what}: no CmapError on rank {ctx.rank}")
    compare("a call after the failures", cm.cmap(torch.sin)(x), torch.sin(x), exact=True)
    return (
        f"rank {last}'s ValueError (in func, and before a psum) arrives as CmapError on every rank; the next call works"
    )


def cpu_tensors(ctx: Ctx) -> str:
    """CPU tensors in this world (nccl on GPUs): cmap, a psum inside func and a row-parallel layer run over the host
    gloo group, and give vmap's values."""
    cpu = Ctx(torch.device("cpu"), ctx.rank, ctx.size, ctx.rep)
    B = 4 * ctx.size + 1
    x, w = cpu.data(B, 5, seed=31), cpu.data(5, 3, seed=32)
    compare("cmap on CPU tensors", cm.cmap(lambda v: torch.tanh(v @ w))(x), torch.tanh(x @ w))
    got = cm.cmap(lambda v: v - cm.pmean(v, "i"), axis_name="i")(x)
    compare("pmean on CPU tensors", got, x - x.mean(0))
    torch.manual_seed(5)
    mlp = nn.Sequential(nn.Linear(5, 8 * ctx.size), nn.Tanh(), nn.Linear(8 * ctx.size, 5)).double()
    want = mlp(x)
    tp = cm.shard_model(copy.deepcopy(mlp), plan={"0": "colwise", "2": "rowwise"})
    compare("shard_model on CPU tensors", tp(x), want)
    _on_device(cpu, got)
    return f"B={B} on the CPU: cmap, pmean inside func, shard_model colwise/rowwise == one process"


def run(ctx: Ctx) -> None:
    """Every cmap check, in order."""
    rep = ctx.rep
    rep.check("core", "cmap dst=-1 == torch.vmap", lambda: dst_all(ctx))
    rep.check("core", "cmap dst=0 == torch.vmap", lambda: dst_zero(ctx))
    rep.check("core", "cmap dst='local' == torch.vmap on own rows", lambda: dst_local(ctx))
    rep.check("core", "cmap src=None / 0 / 'local'", lambda: sources(ctx))
    rep.check("core", "CPU tensors in this world (the host group)", lambda: cpu_tensors(ctx))
    rep.check("gradients", "backward through cmap", lambda: gradients(ctx))
    rep.check("gradients", "nn.Module parameters and torch.func.grad", lambda: module_gradients(ctx))
    for name, *_ in COLLECTIVES:
        rep.check("collectives", f"{name} inside cmap", lambda name=name: collective(ctx, name))
    rep.check("failures", "one rank fails -> CmapError on every rank", lambda: failure(ctx))
