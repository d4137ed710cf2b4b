"""The two collectives every named-axis op is made of: a reduction (sum, max, min) and a gather over the axis.

A mapped axis runs over every example of the global batch: the ones this rank maps and those on the other ranks.
Under ``torch.vmap`` an op is :class:`AxisOp`, an autograd Function whose vmap rule, at the vmap level of the
axis's own cmap, turns the batch of local examples into one exchange (:func:`reduce_rows`, :func:`gather_rows`). At
any other vmap level (a cmap nested inside, an outer ``torch.vmap``, or the axis of an outer cmap seen from an
inner one) the level's dim rides along as a leading data dim, and the op goes on to the level of its axis. Its
backward and forward-mode rules are jax's transposes, written with the same ops, so ``torch.func.grad`` inside
func, double backward and function transforms compose. In "batched" mode func sees the batch as dim 0, and in
"loop" mode the examples run in threads that meet at a barrier (:class:`LoopBarrier`). Along a ``shard_map`` mesh
axis ("rank" mode) each rank is one member of the axis, and func's plain tensor is its one row.

Under ``torch.compile`` the exchange is a functional collective instead (traceable with ``fullgraph=True``), whose
backward is made of functional collectives too: differentiable once inside a compiled function.
"""

import functools
import itertools
import threading
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from ..wire import native as wire_native
from ..wire.exchange import JoinSpec, SplitSpec
from ..wire.native import AllGather, AllToAll, NativeSpec, ReduceScatter
from ..wire.primitives import join, split
from ..wire.protocol import Kind
from ..wire.roles import COPY, MAX, MIN
from ..wire.traced import gather_under_vmap
from .frame import AxisFrame, lookup

_ROLES = {"sum": COPY, "max": MAX, "min": MIN}
_NAMES = {
    "sum": "psum",
    "max": "pmax",
    "min": "pmin",
    "gather": "all_gather",
    "scatter": "psum_scatter",
    "a2a": "all_to_all",
    "permute": "ppermute",
}
PER_EXAMPLE = ("scatter", "a2a", "permute")  # each example gets its own part: the result is batched


def _identity(op: str, like: torch.Tensor) -> torch.Tensor:
    if like.dtype == torch.bool:
        return torch.full_like(like, op == "min")
    info = torch.finfo(like.dtype) if like.is_floating_point() else torch.iinfo(like.dtype)
    return torch.full_like(like, info.min if op == "max" else info.max)


def _local_reduce(op: str, rows: torch.Tensor) -> torch.Tensor:
    if op == "sum":
        return rows.sum(0)
    if rows.shape[0] == 0:
        return _identity(op, rows.new_empty(rows.shape[1:]))
    if rows.dtype == torch.bool:
        return rows.any(0) if op == "max" else rows.all(0)
    return rows.amax(0) if op == "max" else rows.amin(0)


def index_table(values: Tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``, made once: a table copied to an accelerator at every call would
    wait for the device each time (inside torch.compile, a constant of the graph). Only ever read."""
    if torch.compiler.is_compiling():
        return torch.tensor(values, dtype=torch.int64, device=device)
    return _kept_table(values, device)


@functools.lru_cache(maxsize=512)
def _kept_table(values: Tuple[int, ...], device: torch.device) -> torch.Tensor:
    # plain, whatever mode or function transform the first call ran under
    with torch.inference_mode(False), torch._C._DisableFuncTorch():
        return torch.tensor(values, dtype=torch.int64, device=device)


def _alone(frame: AxisFrame) -> bool:
    """The axis's members are all on this rank: no communication."""
    return frame.link is None or frame.link.group.size == 1


def _starts(sizes: Sequence[int]) -> List[int]:
    """Each rank's first row, from every rank's row count."""
    return [0, *itertools.accumulate(sizes)][:-1]


def reduce_rows(frame: AxisFrame, rows: torch.Tensor, name: str, op: str) -> torch.Tensor:
    """This run's rows (dim 0) reduced over every example of the axis.

    A sum is ``Split(Join(.))``: per-rank partial sums joined into the global sum, which every rank then uses as its
    own value, so its backward sums the cotangents over the group too. An empty shard's stand-in contributes nothing,
    through its graph (zero rows), so that backward still meets on every rank.
    """
    local = _local_reduce(op, rows[:0] if frame.dummy else rows)
    if _alone(frame):
        return local
    if torch.compiler.is_compiling():
        return _Compiled.apply(local, frame.link.group.pg, op, None)
    (total,) = join(JoinSpec(frame.link, (_ROLES[op],), f"{_NAMES[op]}({name!r})", Kind.OP), [local])
    if op != "sum":
        return total
    return split(SplitSpec(frame.link, (COPY,)), [total])[0]


def gather_rows(frame: AxisFrame, rows: torch.Tensor, name: str) -> torch.Tensor:
    """Every example's row (dim 0) in global order (shares may be uneven), an all-gather; backward is its
    transpose, a reduce-scatter: each rank gets its rows of the cotangents' sum."""
    real = rows[:0] if frame.dummy else rows
    if _alone(frame):
        return real
    if torch.compiler.is_compiling():
        return _Compiled.apply(real, frame.link.group.pg, "gather", tuple(frame.sizes))
    return wire_native.run(AllGather, _spec(frame, name, "gather", 0, tuple(frame.sizes)), real)


def physical(frame: AxisFrame, rows: torch.Tensor, name: str, op: str, arg: Any = None) -> torch.Tensor:
    if op in PER_EXAMPLE:
        return per_example_rows(frame, rows, name, op, arg)
    return gather_rows(frame, rows, name) if op == "gather" else reduce_rows(frame, rows, name, op)


def per_example_rows(frame: AxisFrame, rows: torch.Tensor, name: str, op: str, arg: Any) -> torch.Tensor:
    """An op where each example gets its own part, on this run's rows (dim 0), with the native collective: only the
    rows each example needs cross the wire. ``arg`` is the example dim the op splits (``scatter``: chunks of the
    sum; ``a2a``: chunks to each example), or for ``permute`` each example's source (-1: none)."""
    real = rows[:0] if frame.dummy else rows
    sizes = tuple(frame.sizes)
    if _alone(frame):
        sizes = (real.shape[0],)
    if op == "scatter":
        out = _scatter_rows(frame, real, name, arg, sizes)
    elif op == "a2a":
        out = _a2a_rows(frame, real, name, arg, sizes)
    else:
        out = _permute_rows(frame, real, name, arg, sizes)
    if frame.dummy:  # the stand-in example's row: it contributes nothing, and gets zeros
        out = torch.cat([out, out.new_zeros((rows.shape[0] - out.shape[0], *out.shape[1:]))])
    return out


def _spec(frame: AxisFrame, name: str, op: str, dim: int, sizes: Tuple[int, ...], recv: Tuple[int, ...] = ()) -> Any:
    return NativeSpec(frame.link, dim, sizes, f"{_NAMES[op]}({name!r})", Kind.OP, recv)


def _scatter_rows(frame: AxisFrame, rows: torch.Tensor, name: str, d: int, sizes: Tuple[int, ...]) -> torch.Tensor:
    """Chunk i (of B along example dim ``d``) of the sum over every example, for each of this run's examples i."""
    partial = rows.sum(0)
    chunk = partial.shape[d] // sum(sizes)
    if _alone(frame):
        mine = partial
    else:
        spec = _spec(frame, name, "scatter", d, tuple(n * chunk for n in sizes))
        mine = wire_native.run(ReduceScatter, spec, partial)
    return mine.unflatten(d, (rows.shape[0], chunk)).movedim(d, 0)


def _a2a_rows(frame: AxisFrame, rows: torch.Tensor, name: str, d: int, sizes: Tuple[int, ...]) -> torch.Tensor:
    """For each of this run's examples j, chunk j of every example's value along ``d`` (of B chunks), concatenated
    in global order along ``d``."""
    n, B = rows.shape[0], sum(sizes)
    moved = rows.movedim(d + 1, 1)  # (n, B * chunk, rest...)
    chunk = moved.shape[1] // B
    four = moved.unflatten(1, (B, chunk))  # (n, B, chunk, rest...): [my example, its destination example]
    if _alone(frame):
        got = four  # one rank: its examples are every source
    else:
        offsets = _starts(sizes)
        send = torch.cat([four.narrow(1, o, k).flatten(0, 1) for o, k in zip(offsets, sizes)])
        spec = _spec(frame, name, "a2a", 0, tuple(n * k for k in sizes), tuple(k * n for k in sizes))
        got = wire_native.run(AllToAll, spec, send).unflatten(0, (B, n))  # [source example, my example]
    return got.transpose(0, 1).flatten(1, 2).movedim(1, d + 1)  # (n, B * chunk along d, ...)


def _permute_rows(
    frame: AxisFrame, rows: torch.Tensor, name: str, sources: Tuple[int, ...], sizes: Tuple[int, ...]
) -> torch.Tensor:
    """Each of this run's examples j gets example ``sources[j]``'s row (zeros for -1): each row travels once, from
    the rank that holds its source to the rank that holds its destination."""
    owner = [r for r, k in enumerate(sizes) for _ in range(k)]
    offsets = _starts(sizes)
    me = 0 if frame.link is None else frame.link.group.rank
    pairs = [(s, j) for j, s in enumerate(sources) if s >= 0]  # (source, destination), in destination order
    sent = [[s - offsets[me] for s, j in pairs if owner[s] == me and owner[j] == r] for r in range(len(sizes))]
    got = [[j - offsets[me] for s, j in pairs if owner[s] == r and owner[j] == me] for r in range(len(sizes))]
    flat_sent = [i for part in sent for i in part]
    send = rows.index_select(0, index_table(tuple(flat_sent), rows.device))
    if _alone(frame):
        received = send
    else:
        spec = _spec(frame, name, "permute", 0, tuple(len(p) for p in sent), tuple(len(p) for p in got))
        received = wire_native.run(AllToAll, spec, send)
    where = index_table(tuple(j for part in got for j in part), rows.device)
    return rows.new_zeros(rows.shape).index_copy(0, where, received)


def processed_level() -> int:
    """Inside a vmap rule: the vmap level being lowered (functorch runs the rule one level below it)."""
    return (torch._C._functorch.maybe_current_level() or 0) + 1


class AxisOp(torch.autograd.Function):
    """One collective as func sees it, per example; see the module docstring. ``arg`` parametrises the per-example
    ops (:func:`per_example_rows`)."""

    @staticmethod
    def forward(x: torch.Tensor, name: str, op: str, arg: Any = None) -> torch.Tensor:
        # Not batched at the axis's level: every example holds the same x, so the result needs no communication.
        # (The per-example ops are always given a value batched at the axis's level: see batched_at_axis.)
        size = lookup(name, _NAMES[op]).size
        if op == "gather":
            return x.unsqueeze(0).expand(size, *x.shape).clone()
        return x * size if op == "sum" else x.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
        ctx.name, ctx.op = inputs[1], inputs[2]
        ctx.arg = inputs[3] if len(inputs) > 3 else None

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], None, None, None]:
        return transpose(grad, ctx.name, ctx.op, ctx.arg), None, None, None

    @staticmethod
    def jvp(ctx: Any, tangent: torch.Tensor, *_: Any) -> torch.Tensor:
        if ctx.op in ("max", "min"):
            raise RuntimeError(f"{_NAMES[ctx.op]}({ctx.name!r}) is not differentiable.")
        if ctx.op in PER_EXAMPLE:
            return apply(tangent, ctx.name, ctx.op, ctx.arg)
        return AxisOp.apply(tangent, ctx.name, ctx.op, ctx.arg)

    @staticmethod
    def vmap(
        info: Any, in_dims: Tuple[Optional[int], ...], x: torch.Tensor, name: str, op: str, arg: Any = None
    ) -> Tuple[Any, Any]:
        dim = in_dims[0]
        if dim is None:
            return AxisOp.apply(x, name, op, arg), None
        rows = x.movedim(dim, 0)
        frame = lookup(name, _NAMES[op])
        if frame.level is not None and processed_level() != frame.level:
            # another map's vmap level: its dim rides along while the op goes on to its own axis's level
            if op in PER_EXAMPLE:
                return AxisOp.apply(rows, name, op, arg if op == "permute" else arg + 1), 0
            return AxisOp.apply(rows, name, op, arg), (1 if op == "gather" else 0)
        out = physical(frame, rows, name, op, arg)
        return out, (0 if op in PER_EXAMPLE else None)


def transpose(grad: torch.Tensor, name: str, op: str, arg: Any) -> torch.Tensor:
    """jax's transpose of each op, per example, written with the ops themselves (so it is differentiable again)."""
    if op == "sum":  # psum's transpose is psum
        return apply(grad, name, "sum")
    if op == "gather":  # all_gather's transpose: this example's row of the sum of the cotangents (psum_scatter)
        return apply(grad, name, "scatter", 0).squeeze(0)
    if op == "scatter":  # psum_scatter's transpose: every example's chunk, gathered in order along the dim
        full = apply(grad, name, "gather")  # (B, ..., chunk at arg + 1, ...)
        return full.movedim(0, arg).flatten(arg, arg + 1)
    if op == "a2a":  # its own transpose
        return apply(grad, name, "a2a", arg)
    if op == "permute":  # the inverse permutation
        inverse = [-1] * len(arg)
        for j, s in enumerate(arg):
            if s >= 0:
                inverse[s] = j
        return apply(grad, name, "permute", tuple(inverse))
    raise RuntimeError(f"{_NAMES[op]}({name!r}) is not differentiable; use psum, pmean or all_gather.")


def index(name: str) -> torch.Tensor:
    """The global index of the current example along the axis ``name`` (an int64 scalar tensor per example)."""
    frame = lookup(name, "axis_index")
    if frame.index is None:
        raise RuntimeError(f"axis_index({name!r}) is only available inside the mapped function.")
    return frame.loop.index() if frame.mode == "loop" and frame.loop is not None else frame.index


def apply(x: torch.Tensor, name: str, op: str, arg: Any = None) -> torch.Tensor:
    """The op on ``x`` in the axis's mode."""
    frame = lookup(name, _NAMES[op])
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{_NAMES[op]}(x, {name!r}): x must be a Tensor, got {type(x).__name__}.")
    if frame.mode == "rank":  # a shard_map axis: this rank is one member of it, and func holds its own value
        out = physical(frame, x.unsqueeze(0), name, op, arg)
        return out.squeeze(0) if op in PER_EXAMPLE else out
    if frame.mode == "batched":
        out = physical(frame, x, name, op, arg)
        return out if op in PER_EXAMPLE else out.unsqueeze(0).expand(x.shape[0], *out.shape)
    if frame.mode == "loop" and not torch._C._functorch.is_batchedtensor(x):
        return frame.loop.run(x, lambda stacked: physical(frame, stacked, name, op))
    if torch.compiler.is_compiling():
        return _traced_vmap(frame, x, name, op, arg)
    if op in PER_EXAMPLE:
        x = batched_at_axis(frame, x)
    return AxisOp.apply(x, name, op, arg)


def _traced_vmap(frame: AxisFrame, x: torch.Tensor, name: str, op: str, arg: Any) -> torch.Tensor:
    """Mode "vmap" inside ``torch.compile``, where dynamo follows no vmap rule of an autograd Function and functorch
    runs no autograd Function of a compiled graph: this run's rows come out of the batch at the axis's vmap level (a
    value every example shares is expanded to them), go through the all-gather op with its own autograd kernel
    (:func:`~colossalai_cmap.wire.traced.gather_under_vmap`; a psum adds up the gathered partial sums), and the
    result, the same for every example, goes back as a plain tensor. The per-example ops never reach here (they are
    made of psum and all_gather under compile); a vmap that func itself opens between them and the axis is not
    followed."""
    if op in PER_EXAMPLE:
        raise NotImplementedError(f"{_NAMES[op]}({name!r}) has no traced vmap rule.")
    count = 1 if frame.dummy else frame.sizes[0 if frame.link is None else frame.link.group.rank]
    rows = torch._C._functorch._remove_batch_dim(x, frame.level, count, 0)
    real = rows[:0] if frame.dummy else rows
    if op == "gather":
        if _alone(frame):
            return real
        cap = max(frame.sizes)
        padded = torch.cat([real, real.new_zeros((cap - real.shape[0], *real.shape[1:]))])
        full = gather_under_vmap(padded, frame.link.group.pg)
        return torch.cat([full.narrow(0, r * cap, k) for r, k in enumerate(frame.sizes) if k])
    local = _local_reduce(op, real)
    if _alone(frame):
        return local
    if op == "sum":  # every rank's partial sum, added up: the gather's backward sums the cotangents over the ranks
        return gather_under_vmap(local.unsqueeze(0), frame.link.group.pg).sum(0)
    import torch.distributed._functional_collectives as fc

    return fc.all_reduce(local.detach().contiguous(), op, frame.link.group.pg)  # pmax and pmin carry no gradient


def batched_at_axis(frame: AxisFrame, x: torch.Tensor) -> torch.Tensor:
    """``x`` batched at the axis's own vmap level: a per-example op gives each example its own part, so its vmap rule
    must run there even when every example holds the same ``x`` (adding the zero of a batched index makes it so)."""
    t = x
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        if torch._C._functorch.is_batchedtensor(t) and torch._C._functorch.maybe_get_level(t) == frame.level:
            return x
        t = torch._C._functorch.get_unwrapped(t)
    return x + (frame.index * 0).to(x.dtype)


class _Compiled(torch.autograd.Function):
    """Inside ``torch.compile``: a functional collective, and a backward made of functional collectives (dynamo
    traces neither a ``setup_context`` Function nor ``Function.apply`` in a backward). No status round: see
    docs/collectives.md."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, pg: Any, op: str, sizes: Optional[Tuple[int, ...]]) -> torch.Tensor:
        import torch.distributed._functional_collectives as fc

        ctx.pg, ctx.op, ctx.sizes = pg, op, sizes
        if op != "gather":
            return fc.all_reduce(local, op, pg)
        cap, n = max(sizes), local.shape[0]
        padded = torch.cat([local, local.new_zeros((cap - n, *local.shape[1:]))]) if n < cap else local
        full = fc.all_gather_tensor(padded.contiguous(), 0, pg)
        return torch.cat([full.narrow(0, r * cap, k) for r, k in enumerate(sizes) if k])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], None, None, None]:
        import torch.distributed._functional_collectives as fc

        if ctx.op not in ("sum", "gather"):
            raise RuntimeError(f"{_NAMES[ctx.op]} is not differentiable.")
        total = fc.all_reduce(grad.contiguous(), "sum", ctx.pg)
        if ctx.op == "sum":
            return total, None, None, None
        rank = torch.distributed.get_rank(ctx.pg)
        return total.narrow(0, sum(ctx.sizes[:rank]), ctx.sizes[rank]), None, None, None


class LoopBarrier:
    """Loop mode with collectives: one thread per example, taking turns in example order.

    Each example runs until it reaches a collective (or ends), then hands the turn to the next one; when every example
    has reached the collective, it runs once on their stacked values and the examples go on, in order again. So the
    examples' random draws happen in a fixed order, and an error in one example reaches all of them. With ``rng``
    (an object with ``restore(i)`` and ``save(i)``), each example keeps its own generator state, swapped in at its
    turns (``randomness="same"``: all starting alike; ``"per_example"``: each from its own seed).
    """

    def __init__(self, count: int, rng: Any = None) -> None:
        self.count = count
        self._local = threading.local()
        self._slots: List[Any] = [None] * count
        self._cond = threading.Condition()
        self._turn, self._arrived, self._done, self._round = 0, 0, 0, 0
        self._result: Any = None
        self._error: Optional[BaseException] = None
        self._rng = rng

    def index(self) -> torch.Tensor:
        return self._local.index

    def enter(self, i: int, index: torch.Tensor) -> None:
        """Example ``i``'s thread starts: wait for its first turn."""
        self._local.i, self._local.index = i, index
        with self._cond:
            self._wait_for_turn(i, self._round)

    def leave(self) -> None:
        """Example ``i`` ended (returned or raised): the next one takes the turn."""
        i = self._local.i
        with self._cond:
            self._done += 1
            if self._arrived and self._error is None:  # peers wait in a collective this example never made
                self._error = RuntimeError(
                    "mode='loop': the examples made different collective calls (one returned while others waited in "
                    "a collective); every example must make the same collective calls, as under vmap."
                )
            self._pass_turn(i)

    def abort(self, exc: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = exc
            self._cond.notify_all()

    def run(self, x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """A collective: every example's ``x`` stacked, ``fn`` once on the stack, each example gets the result."""
        if self.count == 1:
            return fn(x.unsqueeze(0))
        i = self._local.i
        with self._cond:
            self._slots[i] = x
            self._arrived += 1
            round_ = self._round
            if self._arrived + self._done == self.count:
                self._act(fn)
                self._arrived, self._round, self._turn = 0, self._round + 1, 0
                self._save_rng(i)
                self._cond.notify_all()
            else:
                self._pass_turn(i)
            self._wait_for_turn(i, round_ + 1)
            return self._result

    def _act(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self._error is not None or self._done:
            self._error = self._error or RuntimeError(
                "mode='loop': the examples made different collective calls; every example must make the same "
                "collective calls, as under vmap."
            )
            return
        try:
            if any(s.requires_grad for s in self._slots) and torch.is_grad_enabled():
                raise RuntimeError(
                    "collectives in mode='loop' are not differentiable; use mode='vmap' or "
                    "'batched', or run under torch.no_grad()."
                )
            with torch.no_grad():
                self._result = fn(torch.stack(self._slots))
        except BaseException as exc:  # re-raised in every example thread
            self._result, self._error = None, exc

    def _pass_turn(self, i: int) -> None:
        self._save_rng(i)
        self._turn = i + 1
        self._cond.notify_all()

    def _wait_for_turn(self, i: int, round_: int) -> None:
        self._cond.wait_for(lambda: self._error is not None or (self._round >= round_ and self._turn == i))
        if self._error is not None:
            raise self._error
        if self._rng is not None:
            self._rng.restore(i)

    def _save_rng(self, i: int) -> None:
        if self._rng is not None:
            self._rng.save(i)
