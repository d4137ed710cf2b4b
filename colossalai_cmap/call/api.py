"""The public ``cmap`` function: its arguments, docstring and decorator forms; and cmap's kind of map call, the steps
the engine's two drivers run (:mod:`~colossalai_cmap.engine.driver`): ``dispatch`` (the group, the shares, the fast
path), ``rank`` (this rank's part), ``conclude`` (the exit) and, inside ``torch.compile``, ``compiled``."""

import functools
from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch
import torch.distributed as dist

from ..engine.driver import EagerKind, TracedEntry, TracedKind, eager_fallbacks, run_compiled, run_eager
from ..engine.records import Failed
from ..integration.groups import resolve_group
from ..stats import CallStats, describe
from ..wire.comm import default_timeout
from ..wire.traced import out_of_graph
from . import compiled, dispatch, execute, rank
from .conclude import conclude, conclude_traced
from .dispatch import Call, Whole
from .keywords import as_positional
from .options import Choices, Options, make_options
from .randomness import CHOICES as RANDOMNESS_CHOICES
from .records import Inputs, Outputs
from .site import CallSite

__all__ = ["cmap", "Cmapped"]


class _Eager(EagerKind):
    """cmap's steps, as the engine's eager driver runs them: on any group, or alone (an unwired link)."""

    communicate, inputs = staticmethod(dispatch.communicate), staticmethod(dispatch.inputs)
    enter, finish = staticmethod(dispatch.enter), staticmethod(dispatch.finish)

    def run(self, site: CallSite, call: Call, inputs: Any, tag: Any, start: int) -> Any:
        if isinstance(inputs, Whole):  # alone, repeated, nothing around func: the cmap's own torch.vmap
            return site.vmapped()(*inputs.args, **inputs.kwargs)
        return rank.run_rank(site, inputs, call.link, call.fast.layout if call.fast is not None else None, tag, start)

    def failed(self, site: CallSite, call: Call, exc: BaseException) -> Failed:
        return rank.failed(site, call.link, exc)

    def conclude(self, site: CallSite, call: Call, inputs: Union[Inputs, Whole], result: Any) -> Any:
        if isinstance(result, Failed):
            dispatch.raise_failed(call, result)
        if isinstance(inputs, Whole):
            return result
        out: Outputs = result
        return dispatch.finished(site, call, inputs, out, conclude(site.options, inputs.shares, out, inputs, call.link))


class _Traced(TracedKind):
    """cmap's steps inside ``torch.compile``, as the engine's compiled driver runs them."""

    communicate, unsupported = staticmethod(compiled.communicate), staticmethod(compiled.unsupported)
    enter, run = staticmethod(compiled.enter), staticmethod(compiled.run)

    def conclude(self, site: CallSite, where: Any, entered: TracedEntry, out: Any) -> Any:
        traced = entered.inputs
        return conclude_traced(site.options, out, traced.sizes, traced.pg, traced.rank)


EAGER = _Eager()


def _eager(site: CallSite, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """The eager call: mapped keywords made positional (:mod:`.keywords`), on a site of their own, then the eager
    driver."""
    batch = as_positional(site.options, args, kwargs)
    if batch is None:
        return run_eager(EAGER, site, args, kwargs)
    keyed = site.with_keywords(batch.dims)
    try:
        return run_eager(EAGER, keyed, batch.args, batch.kwargs)
    finally:
        site.last = keyed.last


# The eager call, out of the graph, for what only it does (made once, outside any graph: dynamo only calls it).
TRACED = _Traced(eager_fallbacks(_eager, "cmap", compiled.REASONS))


_CHOICES = Choices(modes=execute.CHOICES, randomness=RANDOMNESS_CHOICES)  # what mode= and randomness= may name


def cmap(
    func: Optional[Callable] = None,
    in_dims: Any = 0,
    out_dims: Any = 0,
    *,
    group: Any = None,
    dst: Union[int, str] = -1,
    src: Union[int, str, None] = None,
    randomness: str = "error",
    chunk_size: Optional[int] = None,
    mode: str = "vmap",
    axis_name: Optional[str] = None,
    timeout: Optional[float] = None,
    check_inputs: bool = False,
    kwarg_dims: Any = None,
) -> Any:
    """``torch.vmap`` across the processes of a ``torch.distributed`` group, like ``jax.pmap``.

    ``cmap(f)(*args)`` splits the batch (the dims given by ``in_dims``) across the group, runs ``torch.vmap(f)``
    on each rank's share, and gathers the results. On every rank that receives output it returns exactly what
    ``torch.vmap(f, in_dims, out_dims)(*args)`` returns in one process: same values, pytree structure, shapes,
    dtypes and device, with every example computed once and returned in order, for any group size and any batch
    size (including 0 and sizes that do not divide by the group size).

    Args:
        func: the per-example function (any callable or ``nn.Module``). Omit it to use ``cmap`` as a decorator
            with options: ``@cmap(in_dims=(0, None))``.
        in_dims: as in ``torch.vmap``: an int, None, or a pytree prefix of the positional args saying which dim
            of each input is the batch dim. Negative dims count from the end. Keyword arguments are not mapped.
        out_dims: as in ``torch.vmap``: where the batch dim goes in each output. ``None`` marks an output that is
            the same for every example (it is returned once, not stacked).
        group: where the work runs. None: the default (world) group, or this process alone when
            ``torch.distributed`` is not initialised. A ``ProcessGroup``. ``(ProcessGroupMesh, axis)`` with an int
            or a tuple of ints: map over those mesh axes; the other axes run independent cmaps. A colossalai
            ``Booster`` or booster ``Plugin``: its data-parallel group.
        dst: where results go. -1: every rank gets the full result. A group rank r: only r gets it, the others
            return None and never allocate the full output. "local": no gather; each rank gets its own share's
            result (concatenated along ``out_dims``).
        src: where inputs are. None: every rank passes the same full inputs and slices its share (no
            communication). A group rank r: only r holds the mapped inputs, others may pass None for them, and r
            scatters the shares. "local": each rank passes its own share; the global batch is the shares
            concatenated in group-rank order, and share sizes may differ.
        randomness: "error" (as in vmap), "different" (no two examples draw the same numbers, across ranks too;
            reproducible for a fixed seed and group size), "same" (what ``torch.vmap(randomness="same")`` draws in
            one process from the same generator state) or "per_example" (each example draws from a generator seeded
            from one draw of the caller's and the example's global index: the same numbers at every P).
        chunk_size: vmap's ``chunk_size``, per rank: bounds the peak memory of each rank's share.
        mode: "vmap" (default) runs ``torch.vmap(func)`` on the share; "batched" calls ``func`` once on the share
            (it already takes a batch, like a model's forward); "loop" calls it once per example and stacks.
        axis_name: names the mapped axis for ``psum``, ``pmean``, ``pmax``, ``pmin``, ``all_gather``,
            ``axis_index`` and ``axis_size`` inside ``func``.
        timeout: seconds each collective of the call may wait before every rank raises ``CmapError``. Default: the
            ``COLOSSALAI_CMAP_TIMEOUT`` environment variable, else the process group's own timeout.
        check_inputs: with ``src=None``, also check that every rank passed the same input *values* (a checksum in
            the status exchange). Shapes, dtypes and batch sizes are always checked.
        kwarg_dims: how keyword arguments are mapped. None (default): passed whole, as in ``torch.vmap``. An int:
            every keyword's tensors mapped at that dim, as ``jax.vmap`` maps keyword arguments at 0 (keywords that
            hold no tensor, such as flags or None, are passed whole). A dict from keyword names to an
            ``in_dims``-like prefix of that keyword's value, or None to pass it whole; keywords it does not name are
            passed whole. So ``cmap(model, mode="batched", kwarg_dims=0)(**tokenizer(texts, return_tensors="pt"))``
            splits the batch. Without it, ``mode="batched"`` refuses a keyword tensor as long as the batch.

    Returns:
        A function with the same call signature as ``func`` that runs the batch across the group.

    Raises:
        ValueError, TypeError: for bad arguments, on every rank, before any communication.
        CmapError: on every rank of the group, when ``func`` raised on any rank, ranks passed different inputs,
            or a peer died or timed out. The message names the failing rank(s).

    Examples:
        >>> import torch
        >>> from colossalai import cmap
        >>> x, y = torch.randn(64, 128), torch.randn(64, 128)
        >>> cmap(torch.dot)(x, y).shape
        torch.Size([64])
        >>> @cmap(in_dims=(0, None), dst=0)
        ... def batch_dot(a, b):
        ...     return torch.dot(a, b)
        >>> batch_dot(x, y[0]).shape  # None on every rank but group rank 0
        torch.Size([64])
    """
    options = dict(
        in_dims=in_dims,
        out_dims=out_dims,
        group=group,
        dst=dst,
        src=src,
        randomness=randomness,
        chunk_size=chunk_size,
        mode=mode,
        axis_name=axis_name,
        timeout=timeout,
        check_inputs=check_inputs,
        kwarg_dims=kwarg_dims,
    )
    if torch.compiler.is_compiling():  # dynamo cannot see func's closures (nor make a cmap): made out of the graph
        return MADE_INSIDE_COMPILE(func, **options)
    if func is None:
        return functools.partial(cmap, **options)
    if not callable(func):
        raise TypeError(f"cmap: expected a callable or nn.Module as func, got {type(func).__name__}.")
    opts = make_options(
        func,
        _CHOICES,
        **{**options, "timeout": timeout if timeout is not None else default_timeout()},
    )
    if isinstance(group, tuple) and dist.is_available() and dist.is_initialized():
        # Creating a mesh's groups is a collective over the whole world: do it now, when every rank creates this
        # cmap, not at a first call that some ranks may never make (e.g. an inner cmap on an empty outer share).
        resolve_group(opts.call, group)
    return Cmapped(func, opts)


# cmap out of the graph, as one graph break; under ``fullgraph=True`` dynamo's error shows the name, which says why.
MADE_INSIDE_COMPILE = out_of_graph(
    lambda *args, **kwargs: cmap(*args, **kwargs),
    "cmap(...) is made inside the compiled function, where dynamo cannot read the closures of func (a tensor "
    "func closes over that requires grad needs its gradient summed over the ranks): make the cmap outside "
    "torch.compile, and pass such a tensor as an argument with in_dims=None, e.g. "
    "f = cmap(lambda v, w: ..., in_dims=(0, None)) and f(x, w) inside the compiled step",
)


class Cmapped:
    """The callable ``cmap(func, ...)`` returns: same call signature as ``func``, runs the batch across the group.

    Attributes:
        func: the per-example function.
        options: the cmap's options.
    """

    def __init__(self, func: Callable, options: Options) -> None:
        functools.update_wrapper(self, func, updated=())
        self.func = func
        self.options = options
        self._site = CallSite(func, options)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return run_compiled(TRACED, self._site, args, kwargs)
        return _eager(self._site, args, kwargs)

    def __repr__(self) -> str:
        return f"<{self.options.call}, dst={self.options.dst!r}, src={self.options.src!r}, mode={self.options.mode.name!r}>"

    @property
    def stats(self) -> Optional[CallStats]:
        """What the last call did on this rank (:class:`~colossalai_cmap.stats.CallStats`); None before the first."""
        last = self._site.last
        return None if last is None else describe(last.log, last.group_size, last.local, last.fast_path, last.shares)

    @property
    def cached_plans(self) -> int:
        """How many argument signatures' plans this cmap keeps for repeated calls (at most 64)."""
        return len(self._site.fast_paths)
