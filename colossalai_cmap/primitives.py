"""The two communication primitives, ``Scatter`` and ``Join``, as autograd Functions that compose with functorch.

Each is a ``torch.autograd.Function`` in the ``setup_context`` style, with ``backward``, ``jvp`` and ``vmap`` rules,
so that torch's autograd and torch.func handle everything around them: closures, higher-order gradients,
``grad``/``vjp``/``jvp``/``jacrev``/``jacfwd``/``hessian``, an outer ``torch.vmap`` and nesting. The backward of each
is the other (:mod:`roles` has the transpose of every role), built from ``apply`` calls, so double backward works.
``Join`` moves data in one round (:mod:`protocol`), and a second collective only for what does not fit.

When no tensor needs a derivative and no function transform is active, the plain :func:`join` and :func:`scatter`
run without the Function machinery.
"""

from typing import Any, Callable, NamedTuple, Optional, Sequence, Tuple

import torch

from . import faults, protocol, transfer
from .channel import channel
from .errors import RankFailure
from .protocol import Header, Kind, Link, Round, Status
from .roles import FIRST, KEEP, SAME, Role, Rows, is_rows, join_transpose, scatter_transpose, shifted
from .route import pack, unpack


class Exit(NamedTuple):
    """A call's exit: the status fields of this rank's header, and the checks every rank runs on the table."""

    status: int
    input_sig: int
    layout_sig: int
    batch: int
    graph_sig: int
    flags: int
    values: int
    early: bool  # data may be sent right behind the status round (no collective inside func can be pending)
    check: Callable[[Round], None]  # raises on ranks that disagree; also keeps the table for the caller


class JoinSpec(NamedTuple):
    """One Join: its tensors' roles, the round's kind and name, where the result goes, and a call's exit fields."""

    link: Link
    roles: Tuple[Role, ...]
    what: str = "a backward collective"
    kind: int = Kind.GRAD
    dst: int = -1  # -1: every rank gets the result; r: only group rank r (the others get None)
    exit: Optional[Exit] = None
    sync: bool = False  # a round even when nothing travels on this rank (its peers may have something)

    def settled(self) -> Tuple[Role, ...]:
        """The roles with the row counts an exit learned from its round (``src="local"``) filled in."""
        if self.exit is None or all(not is_rows(r) or r.sizes is not None for r in self.roles):
            return self.roles
        sizes = tuple(h.rows for h in self.exit.check.table)
        return tuple(Rows(r.dim, sizes) if is_rows(r) and r.sizes is None else r for r in self.roles)


class ScatterSpec(NamedTuple):
    link: Link
    roles: Tuple[Role, ...]
    owner: Any = None  # tags the autograd node: a call's entry, where the closure walk stops


# ---------------------------------------------------------------------------------------------- plain versions
def scatter(spec: ScatterSpec, tensors: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
    """Global values to this rank's per-rank values: no communication."""
    rank = spec.link.group.rank
    out = []
    for role, t in zip(spec.roles, tensors):
        if is_rows(role):
            out.append(t.narrow(role.dim, sum(role.sizes[:rank]), role.sizes[rank]))
        elif role == FIRST and rank != 0:
            out.append(torch.zeros_like(t))
        else:
            out.append(t)
    return tuple(out)


def join(spec: JoinSpec, tensors: Sequence[torch.Tensor]) -> Tuple[Optional[torch.Tensor], ...]:
    """Per-rank values to global ones: one round, and a data phase for what does not fit its payload."""
    link = spec.link
    group = link.group
    sizes = next((r.sizes for r in spec.roles if is_rows(r)), None)
    rt = protocol.route(link, (spec.what, spec.roles, sizes), tensors)
    if not rt.items and spec.exit is None and not spec.sync:
        return tuple(tensors)  # nothing moves, nothing to agree on
    prep, results, failure, cause = None, {}, None, None
    try:  # everything that can fail on one rank, before the round that tells every rank
        if faults.ACTIVE:
            faults.check("backward" if spec.kind == Kind.GRAD else "pack", group)
        if rt.fits:
            pack(rt, tensors)
        if rt.inline is False and rt.items:
            if faults.ACTIVE:
                faults.check("gather", group)
            prep = transfer.prepare(rt.items, tensors, rt.sizes, group, spec.dst)
    except Exception as exc:
        failure, cause = RankFailure.from_exception(exc, group.rank, group.global_rank), exc
    ch = channel(group, link.device)
    if spec.kind == Kind.GRAD and torch._C._current_graph_task_id() >= 0:
        _unsettle(ch)
    early = transfer.early(prep, ch, group) if spec.exit is not None and spec.exit.early and spec.dst == -1 else None
    rnd = _round(spec, _header(spec, rt, failure, early is not None), early)
    if spec.exit is not None:
        transfer.meet_early(rnd, ch, link)
    if rnd.failed:
        protocol.raise_failures(rnd, failure, cause, link._replace(call=_name(spec)))
    if spec.exit is not None:
        spec.exit.check(rnd)
    if rt.items:
        results = _settle(spec, rt, rnd, tensors, prep)
    if spec.exit is not None:  # a clean exit: every rank is in step, and agrees on the data phase's shape
        ch.unsettled, ch.last_data = False, transfer.early_shape(prep) if prep is not None else None
    return tuple(_output(role, t, results.get(i)) for i, (role, t) in enumerate(zip(spec.roles, tensors)))


def _unsettle(ch: Any) -> None:
    """Inside a backward: until it finishes, a peer may be left waiting in one of its exchanges if this rank's
    backward raises, so this rank must not send data ahead of its next round."""
    ch.unsettled = True

    def settled() -> None:
        ch.unsettled = False

    torch.autograd.Variable._execution_engine.queue_callback(settled)


def _settle(spec: JoinSpec, rt: Any, rnd: Round, tensors: Sequence[torch.Tensor], prep: Any) -> dict:
    """After the round: the payloads into the results, or the data phase (the row counts come from the round
    when only it knew them, with ``src="local"``)."""
    link = spec.link
    if rt.sizes is None:
        sizes = tuple(h.rows for h in rnd.table)
        rt = protocol.route(link, (spec.what, spec.roles, sizes), tensors, rnd)
        if not rnd.inline:
            prep = transfer.prepare(rt.items, tensors, sizes, link.group, spec.dst)
    if rnd.inline:
        return unpack(rt, spec.dst in (-1, link.group.rank))
    if all(h.early for h in rnd.table):
        return transfer.taken_early(prep)
    return transfer.finish(prep, link.group, spec.dst, link.call, link.timeout)


def _output(role: Role, mine: torch.Tensor, found: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if found is not None:
        return found.movedim(0, role.dim) if is_rows(role) and role.dim else found
    return mine if role in (SAME, KEEP) else None  # a travelling tensor off dst


def join_failed(spec: JoinSpec, failure: RankFailure, cause: BaseException) -> None:
    """This rank's side of a call's exit when func raised here: the same round, then every rank raises."""
    link = spec.link
    header = Header(Kind.STATUS, Status.FAILED, inline=1)
    rnd = protocol.status_round(link, header)
    transfer.meet_early(rnd, channel(link.group, link.device), link)
    protocol.raise_failures(rnd, failure, cause, link)
    raise AssertionError("unreachable: this rank reported a failure")  # pragma: no cover


def _header(spec: JoinSpec, rt: Any, failure: Any, early: bool = False) -> Header:
    status = Status.FAILED if failure is not None else Status.OK
    ex = spec.exit
    if ex is None:
        return Header(spec.kind, status, rt.rows, digest=rt.digest, block=rt.block, inline=int(rt.fits))
    status = status if status == Status.FAILED else ex.status
    return Header(
        Kind.STATUS,
        status,
        rt.rows,
        ex.input_sig,
        ex.layout_sig,
        ex.batch,
        rt.block,
        int(rt.fits),
        ex.graph_sig,
        ex.flags,
        ex.values,
        int(early),
    )


def _round(spec: JoinSpec, header: Header, early: Optional[Callable[[], Any]] = None) -> Round:
    link = spec.link
    if spec.kind == Kind.STATUS:
        return protocol.status_round(link, header, early)
    return protocol.checked_round(link, header, spec.what)


def _name(spec: JoinSpec) -> str:
    return spec.link.call if spec.kind == Kind.STATUS else f"{spec.link.call}: {spec.what}"


# --------------------------------------------------------------------------------------- differentiable versions
def requires_grad(t: Any) -> bool:
    """Whether ``t`` requires grad at any autograd level (a vmap wrapper hides its inner tensor's flag)."""
    if not isinstance(t, torch.Tensor):
        return False
    while not t.requires_grad:
        if not torch._C._functorch.is_functorch_wrapped_tensor(t):
            return False
        t = torch._C._functorch.get_unwrapped(t)
    return True


def needs_function(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether the Function machinery is needed: a derivative to track, or a function transform to obey."""
    if torch._C._functorch.maybe_current_level() is not None:
        return True
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def joined(spec: JoinSpec, tensors: Sequence[torch.Tensor]) -> Tuple[Optional[torch.Tensor], ...]:
    return Join.apply(spec, *tensors) if needs_function(tensors) else join(spec, tensors)


def scattered(spec: ScatterSpec, tensors: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
    return Scatter.apply(spec, *tensors) if needs_function(tensors) else scatter(spec, tensors)


def _non_differentiable(ctx: Any, outputs: Sequence[Any]) -> None:
    fixed = [o for o in outputs if isinstance(o, torch.Tensor) and not (o.is_floating_point() or o.is_complex())]
    if fixed:
        ctx.mark_non_differentiable(*fixed)


def _wanted(ctx: Any, grads: Sequence[Any]) -> list:
    return [i for i, g in enumerate(grads) if ctx.needs_input_grad[i + 1] and g is not None]


def _spread(picked: Sequence[int], values: Sequence[Any], count: int) -> Tuple[Any, ...]:
    out: list = [None] * count
    for i, v in zip(picked, values):
        out[i] = v
    return (None, *out)


def _vmapped(apply: Callable, spec: Any, in_dims: Sequence[Optional[int]], xs: Sequence[Any]) -> Tuple[Any, Any]:
    """Both vmap rules: each batched tensor's vmap dim goes to the front, row dims shift by one; one collective."""
    batched = [d is not None for d in in_dims[1:]]
    moved = [x.movedim(d, 0) if d is not None else x for x, d in zip(xs, in_dims[1:])]
    out = apply(spec._replace(roles=shifted(spec.roles, batched)), *moved)
    return out, tuple(0 if b else None for b in batched)


class Join(torch.autograd.Function):
    """Per-rank values to global ones (see :mod:`roles`); backward is :class:`Scatter`."""

    @staticmethod
    def forward(spec: JoinSpec, *xs: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        return tuple(o if o is not x else x.view_as(x) for o, x in zip(join(spec, xs), xs))

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
        ctx.spec = inputs[0]
        ctx.like = [(x.shape, x.dtype, x.device) for x in inputs[1:]]  # zeros for a missing tangent
        _non_differentiable(ctx, output)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        spec, picked = ctx.spec, _wanted(ctx, grads)
        settled = spec.settled()
        roles = [join_transpose(settled[i]) for i in picked]
        out = Scatter.apply(ScatterSpec(spec.link, tuple(roles)), *[grads[i] for i in picked]) if picked else ()
        return _spread(picked, out, len(grads))

    @staticmethod
    def jvp(ctx: Any, _: Any, *tangents: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], ...]:
        # Every rank joins every tangent (zeros where one has none): a peer's may be set where this one's is not.
        full = [t if t is not None else torch.zeros(s, dtype=d, device=v) for t, (s, d, v) in zip(tangents, ctx.like)]
        sub = JoinSpec(ctx.spec.link, ctx.spec.settled(), f"the tangents of {ctx.spec.what}", sync=True)
        return tuple(Join.apply(sub, *full))

    @staticmethod
    def vmap(info: Any, in_dims: Tuple[Optional[int], ...], spec: JoinSpec, *xs: torch.Tensor) -> Tuple[Any, Any]:
        return _vmapped(Join.apply, spec, in_dims, xs)


class Scatter(torch.autograd.Function):
    """Global values to this rank's per-rank values (see :mod:`roles`); backward is :class:`Join`."""

    @staticmethod
    def forward(spec: ScatterSpec, *xs: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        return tuple(o if o is not x else x.view_as(x) for o, x in zip(scatter(spec, xs), xs))

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
        ctx.spec = inputs[0]
        if inputs[0].owner is not None:
            ctx._cmap_owner = inputs[0].owner
        ctx.set_materialize_grads(False)  # an unused value gets no gradient (None), as without cmap
        _non_differentiable(ctx, output)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        spec, picked = ctx.spec, _wanted(ctx, grads)
        roles = tuple(scatter_transpose(spec.roles[i]) for i in picked)
        out = Join.apply(JoinSpec(spec.link, roles), *[grads[i] for i in picked]) if picked else ()
        return _spread(picked, out, len(grads))

    @staticmethod
    def jvp(ctx: Any, _: Any, *tangents: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], ...]:
        spec = ctx.spec
        picked = [i for i, t in enumerate(tangents) if t is not None]
        sub = ScatterSpec(spec.link, tuple(spec.roles[i] for i in picked))
        out = Scatter.apply(sub, *[tangents[i] for i in picked]) if picked else ()
        return _spread(picked, out, len(tangents))[1:]

    @staticmethod
    def vmap(info: Any, in_dims: Tuple[Optional[int], ...], spec: ScatterSpec, *xs: torch.Tensor) -> Tuple[Any, Any]:
        return _vmapped(Scatter.apply, spec, in_dims, xs)


class _Refused(torch.autograd.Function):
    """Identity forward; backward raises the message (no collective is involved, so nothing can hang)."""

    @staticmethod
    def forward(message: str, value: torch.Tensor) -> torch.Tensor:
        return value.view_as(value)

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
        ctx.message = inputs[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[None, ...]:
        raise RuntimeError(ctx.message)


def not_differentiable(value: Any, message: str) -> Any:
    """``value`` marked so that backpropagating through it raises ``message``."""
    if not isinstance(value, torch.Tensor) or not (value.is_floating_point() or value.is_complex()):
        return value
    return _Refused.apply(message, value.detach().requires_grad_())


__all__ = ["Join", "JoinSpec", "Link", "Exit", "Scatter", "ScatterSpec", "Rows", "join", "joined", "scatter"]
