"""How func runs on one rank's share: one object per mode (``"vmap"``, ``"batched"``, ``"loop"``), each owning its
eager run, its traced run inside ``torch.compile``, its empty share, and its checks; plus ``chunk_size``.

:func:`run_share` runs a :class:`Task` (func, its options, its axis frame) on a :class:`Share`: each example alone
where the randomness is ``"per_example"``, else as the mode runs it. The generators func draws from are
:mod:`.randomness`'s.
"""

import contextlib
import dataclasses
import re
import threading
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..axis.frame import AxisFrame
from ..axis.modes import AxisMode
from ..torch_internals import (
    TreeSpec,
    add_batch_dim,
    batched_inputs,
    current_level,
    level_of,
    remove_batch_dim,
    tree_flatten,
    tree_unflatten,
    vmap_level,
)
from .dims import KeywordCall, flatten, flatten_out_dims, normalise_out_dim, unflatten
from .loop import LoopBarrier
from .options import Options
from .randomness import DIFFERENT, ExampleSeeds, seed_generators


class Share(NamedTuple):
    """This rank's arguments: the flat leaves (mapped ones cut to this rank's rows) and their in-dims."""

    leaves: List[Any]
    dims: Tuple[Optional[int], ...]
    spec: TreeSpec
    rows: int

    def args(self) -> Tuple[Any, ...]:
        return unflatten(self.leaves, self.spec)

    def take(self, start: int, count: int) -> "Share":
        leaves = [v if d is None else v.narrow(d, start, count) for v, d in zip(self.leaves, self.dims)]
        return self._replace(leaves=leaves, rows=count)

    def device(self) -> torch.device:
        """The first tensor's device (the CPU without one): the generator that draws besides the CPU's. A plain loop:
        dynamo traces no ``next`` with a default."""
        for v in self.leaves:
            if isinstance(v, torch.Tensor):
                return v.device
        return torch.device("cpu")

    def example(self, i: int) -> Tuple[Any, ...]:
        return tree_unflatten([v if d is None else v.select(d, i) for v, d in zip(self.leaves, self.dims)], self.spec)


class Task(NamedTuple):
    """What func runs with besides its share's rows.

    Attributes:
        opts: the call's options (its mode, randomness, dims and name).
        func: what runs on the rows (the site's body).
        kwargs: the keyword arguments, passed whole.
        frame: the call's axis frame (with an ``axis_name``), where each example finds its global index.
        thread_modes: what loop mode's example threads enter (torch function modes are per thread).
        seeds: ``randomness="per_example"``'s seeds for the share's examples.
    """

    opts: Options
    func: Callable
    kwargs: Dict[str, Any]
    frame: Optional[AxisFrame] = None
    thread_modes: Sequence[Any] = ()
    seeds: Optional[ExampleSeeds] = None

    def apply(self, args: Sequence[Any]) -> Any:
        """func on ``args``, with the keywords."""
        return self.func(*args, **self.kwargs)


def share_indices(frame: AxisFrame, rows: int, device: torch.device) -> torch.Tensor:
    """The global index of each of the share's ``rows`` examples (a stand-in's: from 0), for ``axis_index``."""
    first = 0 if frame.dummy else frame.offset
    return torch.arange(first, first + rows, dtype=torch.int64, device=device)


def run_share(task: Task, share: Share, vmapped: Optional[Callable] = None) -> Any:
    """Apply func to the share's examples; the batch dims come back at ``out_dims``.

    With an axis frame, each example can see its global index (``axis_index``), and loop mode runs the examples in
    threads so that collectives can meet. With ``randomness="per_example"`` every example runs alone, under its own
    generator state (:func:`_run_per_example`). ``vmapped``: the cmap's own ``torch.vmap`` wrapper, for vmap mode.
    """
    frame = task.frame
    indices = None if frame is None else share_indices(frame, share.rows, frame.device)
    if task.opts.randomness.per_example:
        return _run_per_example(task, share, indices)
    return task.opts.mode.run(task, share, indices, vmapped)


def run_share_traced(task: Task, share: Share) -> Any:
    """:func:`run_share` inside ``torch.compile``: func over the share's examples, by ``torch.vmap``'s own steps,
    with the vmap level kept in the axis frame (the named-axis ops lower at that level), or one batched call."""
    return task.opts.mode.run_traced(task, share)


def with_remedy(opts: Options, func: Callable, exc: Exception) -> Exception:
    """``exc`` with cmap's way out added, where the mode can tell what went wrong (:meth:`RunMode.remedied`)."""
    return opts.mode.remedied(opts, func, exc)


class RunMode(AxisMode):
    """How func runs on a rank's share in one of cmap's modes (``mode=``), with the mode's checks. The named-axis ops
    read the flags of :class:`~colossalai_cmap.axis.modes.AxisMode`.

    Attributes:
        under_vmap: func runs under ``torch.vmap``: vmap's own rules and refusals apply (cmap puts no BatchNorm or
            loss mode around func), and a compiled func runs as its original (vmap cannot run a compiled one).
        returns_views: func's outputs may be views of its inputs, as ``torch.vmap`` returns them (not in a loop,
            whose results are stacked copies).
        compiles: the mode has a traced form (:meth:`run_traced`) for a call inside ``torch.compile``.
        join: how results of parts of the share are joined along each output's out-dim: examples stacked
            (``torch.stack``), or batches of rows concatenated (``torch.cat``).
    """

    under_vmap: bool = False
    returns_views: bool = True
    compiles: bool = True
    join: Callable = staticmethod(torch.stack)

    def run(self, task: Task, share: Share, indices: Any, vmapped: Optional[Callable]) -> Any:
        """func on the share, eagerly; ``indices``: the examples' global indices, with an axis frame."""
        raise NotImplementedError

    def run_traced(self, task: Task, share: Share) -> Any:
        """func on the share inside ``torch.compile`` (where :attr:`compiles`)."""
        raise NotImplementedError(f"mode={self.name!r} has no traced form")

    def run_example(self, task: Task, share: Share, i: int) -> Any:
        """func on the share's example ``i`` alone (``randomness="per_example"``): what vmap computes for it."""
        return task.apply(share.example(i))

    def run_empty(self, task: Task, share: Share) -> Any:
        """func on an empty share under ``randomness="per_example"``: as the mode runs it without (nothing is drawn
        for no example)."""
        raise NotImplementedError

    def check_alone_with_axis(self, opts: Options) -> None:
        """Refuse what cannot run one example at a time with collectives (``randomness="per_example"``)."""

    def remedied(self, opts: Options, func: Callable, exc: Exception) -> Exception:
        """``exc`` with cmap's way out added, torch's sentence kept first (users search for it), where the mode can
        tell what went wrong; any other exception as it is."""
        return exc


class VmapMode(RunMode):
    """``mode="vmap"``: ``torch.vmap(func)`` on the share, func seeing one example at a time."""

    name, under_vmap = "vmap", True

    def run(self, task: Task, share: Share, indices: Any, vmapped: Optional[Callable]) -> Any:
        opts = task.opts
        plain = share.rows or opts.chunk_size is None
        if vmapped is not None and task.frame is None and plain and not opts.places_outputs:
            return vmapped(*share.args(), **task.kwargs)  # the common case: the cmap's own torch.vmap wrapper
        return _vmap(task, share, indices)

    def run_traced(self, task: Task, share: Share) -> Any:
        opts, func, kwargs, frame = task.opts, task.func, task.kwargs, task.frame
        leaves, dims, spec, rows = share
        if frame is None:
            chunk = opts.chunk_size if rows else None
            return torch.vmap(func, opts.in_dims, opts.out_dims, chunk_size=chunk)(*unflatten(leaves, spec), **kwargs)
        with vmap_level(rows, opts.randomness.name) as level:
            frame.level = level
            frame.index = add_batch_dim(share_indices(frame, rows, share.device()), 0, level)
            args = batched_inputs(dims, leaves, level, spec)
            return _place_traced(opts, func(*args, **kwargs), level, rows)

    def run_empty(self, task: Task, share: Share) -> Any:
        opts = dataclasses.replace(task.opts, randomness=DIFFERENT, chunk_size=None)
        return _vmap(task._replace(opts=opts, frame=None), share, None)

    def remedied(self, opts: Options, func: Callable, exc: Exception) -> Exception:
        """vmap's refusal of a mapped tensor's Python value (``.item()``, ``range(n)``, ``if x > 0``) or of a
        BatchNorm in training mode, or a shape, dim or index error from an ``nn.Module`` func, which vmap calls on one
        example without its batch dim."""
        if getattr(exc, "_cmap_remedy", False) or type(exc) not in _REWORDED:
            return exc
        text = str(exc)
        func = func.func if isinstance(func, KeywordCall) else func  # the caller's func, its keywords mapped
        if type(exc) is RuntimeError and text.startswith(VMAP_REFUSAL):
            remedy = vmap_remedy(opts.call)
        elif type(exc) is RuntimeError and text.startswith(_VALUE_UNDER_VMAP):
            remedy = (
                f"{opts.call}: func reads a mapped tensor's value in Python (a loop bound, a branch, .item()), which "
                f"torch.vmap cannot do per example. Use mode='loop' to call func once per example (per-example "
                f"control flow), or pass the value with in_dims=None if every example shares it (one loop bound for "
                f"the batch)."
            )
        elif isinstance(func, torch.nn.Module) and not text.startswith(_OWN) and _shape_error(exc, text):
            remedy = (
                f"{opts.call}: func is a module, and in mode='vmap' (the default) cmap calls it as torch.vmap does: "
                f"once per example, each example WITHOUT its batch dim (input_ids of shape (T,), an image of shape "
                f"(C, H, W)). If the model expects a batch, use mode='batched': it runs the model on each rank's rows "
                f"as they are, batch dim kept, as you would call it on the whole batch."
            )
        else:
            return exc
        remedied = type(exc)(f"{text}\n{remedy}")
        remedied._cmap_remedy = True  # a nested cmap's remedy is not added again by the outer one
        return remedied.with_traceback(exc.__traceback__)


class BatchedMode(RunMode):
    """``mode="batched"``: func called once on the share's rows as they are, batch dim kept (or once per chunk);
    it must return one row per example (:func:`check_rows`)."""

    name, holds_rows = "batched", True
    join = staticmethod(torch.cat)

    def run(self, task: Task, share: Share, indices: Any, vmapped: Optional[Callable]) -> Any:
        opts = task.opts
        if task.frame is not None:
            task.frame.index = indices
        if opts.chunk_size is None or share.rows <= opts.chunk_size:
            return task.apply(share.args())
        chunks = [_rows_checked(opts, task.apply(part.args()), part.rows) for part in _chunks(share, opts.chunk_size)]
        return _combine(chunks, opts, self.join)

    def run_traced(self, task: Task, share: Share) -> Any:
        if task.frame is not None:
            task.frame.index = share_indices(task.frame, share.rows, share.device())
        return task.apply(share.args())

    def run_example(self, task: Task, share: Share, i: int) -> Any:
        return task.apply(share.take(i, 1).args())  # a batch of one

    def run_empty(self, task: Task, share: Share) -> Any:
        return task.apply(share.args())

    def check_alone_with_axis(self, opts: Options) -> None:
        raise ValueError(
            f"{opts.call}: randomness='per_example' with mode='batched' and axis_name={opts.axis_name!r}: func "
            f"takes its rows at once, so its collectives cannot run one example at a time; use mode='vmap' or "
            f"'loop'."
        )


class LoopMode(RunMode):
    """``mode="loop"``: func called once per example, in a Python loop (in a thread per example, taking turns,
    where there are collectives). It follows vmap's ``randomness``: "error" raises vmap's error if func drew random
    numbers, "same" gives every example the same draws."""

    name, in_turns, returns_views, compiles = "loop", True, False, False

    def run(self, task: Task, share: Share, indices: Any, vmapped: Optional[Callable]) -> Any:
        randomness = task.opts.randomness
        with randomness.checked():
            if share.rows == 0:
                return self.run_empty(task, share)
            if task.frame is not None:
                task.frame.index = indices
                return _loop_threads(task, share)
            generators = randomness.example_generators(share.rows, share.device())
            results = []
            for i in range(share.rows):
                if generators is not None:  # every example starts from the call's state, as vmap's "same" draws once
                    generators.restore(i)
                results.append(self.run_example(task, share, i))
            return _combine(results, task.opts, self.join)

    def run_empty(self, task: Task, share: Share) -> Any:
        """As vmap on an empty batch: func runs once on a zero example to learn the outputs' structure, and every
        mapped output comes back with zero rows. It runs with the caller's grad mode, as vmap runs func on the empty
        batch: an ``out_dims=None`` output keeps its graph (its gradient reaches the tensors it was computed from),
        and the zero rows of a mapped output theirs, whose backward carries zeros (as a stand-in example's). The zero
        example is joined to the empty input, so that its graph reaches the caller's tensor (an empty gradient)."""
        example = [v if d is None else _zero_example(v, d) for v, d in zip(share.leaves, share.dims)]
        one = task.apply(tree_unflatten(example, share.spec))
        return _combine([one], task.opts, lambda parts, dim: parts[0].unsqueeze(dim).narrow(dim, 0, 0))


VMAP, BATCHED, LOOP = VmapMode(), BatchedMode(), LoopMode()
CHOICES = (VMAP, BATCHED, LOOP)


def _run_per_example(task: Task, share: Share, indices: Any) -> Any:
    """``randomness="per_example"``: each example alone, its generators seeded from the task's seeds and its global
    index, so that chunks, shares and modes draw alike. In modes "vmap" and "loop" func is called on the example
    (what vmap computes for it; a batch of one under ``torch.vmap`` draws the same numbers at ten times the cost), in
    mode "batched" on a batch of one. Collectives need every example at once: the examples then run in loop mode's
    threads, each with its own generator states."""
    opts, mode, frame = task.opts, task.opts.mode, task.frame
    if frame is not None:
        mode.check_alone_with_axis(opts)
        frame.index = indices
        return _loop_threads(task, share)
    if share.rows == 0:
        return mode.run_empty(task, share)
    results, device = [], share.device()
    for i in range(share.rows):
        seed_generators(task.seeds.seed(i), device)
        results.append(mode.run_example(task, share, i))
    return _combine(results, opts, mode.join)


def _loop_threads(task: Task, share: Share) -> Any:
    """Loop mode with collectives: one thread per example, taking turns, so that a collective can wait for every
    example. Each thread enters the task's ``thread_modes``: the call's (the closure interceptor, and the marker of
    the nodes it makes, whose sequence numbers are the thread's own and so cannot tell that they were made during the
    call). Where the randomness gives each example its own generators, they are swapped in at its turns."""
    rng = task.opts.randomness.example_generators(share.rows, share.device(), task.seeds)
    barrier = task.frame.loop = LoopBarrier(share.rows, rng=rng)
    indices = task.frame.index
    results: List[Any] = [None] * share.rows
    errors: List[BaseException] = []
    grad = torch.is_grad_enabled()

    def work(i: int) -> None:
        try:
            barrier.start_example(i, indices[i])
            with torch.set_grad_enabled(grad), contextlib.ExitStack() as modes:
                if threading.current_thread() is not threading.main_thread():
                    for mode in task.thread_modes:
                        modes.enter_context(mode)
                results[i] = task.apply(share.example(i))
        except BaseException as exc:  # the first error reaches every example through the barrier
            errors.append(exc)
            barrier.abort(exc)
        finally:
            barrier.end_example()

    if share.rows == 1:
        work(0)
    else:
        threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(share.rows)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    return _combine(results, task.opts, torch.stack)


def _zero_example(empty: torch.Tensor, dim: int) -> torch.Tensor:
    """One example of zeros, taken from ``empty`` (no rows along ``dim``) with a zero row after it."""
    shape = list(empty.shape)
    shape[dim] = 1
    return torch.cat([empty, empty.new_zeros(shape)], dim).select(dim, 0)


# ------------------------------------------------------------------------------------------ vmap mode's own steps
# torch.vmap's refusal of a BatchNorm that updates its running statistics (functorch's batch rule)
VMAP_REFUSAL = "Batch norm got a batched tensor as input while the running_mean or running_var"


def vmap_remedy(call: str) -> str:
    """What to do where torch.vmap refuses a training BatchNorm (the sentence after vmap's own)."""
    return (
        f"{call}: func runs a BatchNorm in training mode, which torch.vmap cannot map per example. Use "
        f"mode='batched' to call func on the batch as it is written (cmap then takes the statistics over the whole "
        f"batch across the group, as the model in one process), or torch.func.replace_all_batch_norm_modules_(model) "
        f"to stop tracking running statistics (each example is then normalised alone, as vmap does)."
    )


# torch.vmap's sentences for a mapped tensor used as a Python number or in Python control flow (functorch's three
# wordings in torch 2.5.1: .item(), control flow, and either, which it gives under a transform such as grad)
_VALUE_UNDER_VMAP = (
    "vmap: It looks like you're calling .item() on a Tensor",
    "vmap: It looks like you're attempting to use a Tensor in some data-dependent control flow",
    "vmap: It looks like you're either (1) calling .item() on a Tensor or",
)

# What a model written for a batch raises when it gets one example: the words of torch's shape, dim and index errors
_SHAPE_WORDS = re.compile(
    r"\b(dim|dims|dimension|dimensions|dimensionality|shape|shapes|size|sizes|index|indices|\d+D)\b|unpack", re.I
)

# How vmap's and cmap's own messages start (their argument checks, their refusals): not a model's shape error
_OWN = ("vmap", "cmap(")


def _shape_error(exc: Exception, text: str) -> bool:
    return isinstance(exc, IndexError) or _SHAPE_WORDS.search(text) is not None


# The plain exception types the remedies re-raise with their text added (torch's shape and vmap errors are these)
_REWORDED = (RuntimeError, IndexError, ValueError)


def _vmap(task: Task, share: Share, indices: Any) -> Any:
    """``torch.vmap`` on the share. Where ``out_dims`` holds a None or an int other than 0, vmap returns every tensor
    output at dim 0 and the outputs are placed here: torch 2.5.1's vmap misplaces a batch-independent output at
    another int out_dim, and refuses an out_dims=None output that is batched at an outer level only (a psum over an
    inner cmap's axis that varies over an outer one). An output batched at this level stays refused, in vmap's
    words."""
    opts, func, kwargs, frame = task.opts, task.func, task.kwargs, task.frame
    randomness = opts.randomness.name
    chunk = opts.chunk_size if share.rows else None  # torch.vmap's chunking fails on an empty batch
    place = opts.places_outputs and share.rows > 0
    if frame is None and not place:
        mapped = torch.vmap(func, opts.in_dims, opts.out_dims, randomness=randomness, chunk_size=chunk)
        return mapped(*share.args(), **kwargs)
    seen: Dict[str, Any] = {}  # with placing: the outputs' structure and their non-tensor leaves

    def indexed(index: Optional[torch.Tensor], *a: Any, **k: Any) -> Any:
        if frame is not None:
            frame.index, frame.level = index, current_level()
        out = func(*a, **k)
        if not place:
            return out
        flat, seen["spec"] = tree_flatten(out)
        seen["dims"] = flatten_out_dims(opts.call, opts.out_dims, seen["spec"], len(flat))
        seen["flat"] = flat
        given = tree_flatten(a)[0]  # an output that is a batched input itself: vmap returns the input unmoved
        seen["inputs"] = [next((k for k, g in enumerate(given) if v is g), None) for v in flat]
        _refuse_batched_none(opts, flat, seen["dims"])
        return [v for v in flat if isinstance(v, torch.Tensor)]

    args = share.args()
    in_dims = opts.in_dims if isinstance(opts.in_dims, tuple) else (opts.in_dims,) * len(args)
    dims = (0 if frame is not None else None, *in_dims)
    mapped = torch.vmap(indexed, dims, 0 if place else opts.out_dims, randomness=randomness, chunk_size=chunk)
    out = mapped(indices, *args, **kwargs)
    return _place(opts, out, seen, share) if place else out


def _refuse_batched_none(opts: Options, flat: Sequence[Any], dims: Sequence[Any]) -> None:
    """Inside vmap: an out_dims=None output must not depend on this map's examples."""
    level = current_level()
    for i, (v, dim) in enumerate(zip(flat, dims)):
        if dim is None and isinstance(v, torch.Tensor) and level_of(v) == level:
            raise ValueError(
                f"{opts.call}: `{_name(opts)}` can not return a BatchedTensor when out_dim is None (output {i} "
                f"depends on the example; give it an int out_dim, or reduce it over the axis first, e.g. with psum)."
            )
        if dim is not None and not isinstance(v, torch.Tensor):
            raise ValueError(
                f"{opts.call}: `{_name(opts)}` must only return Tensors, got type {type(v)}. Did you mean to set "
                f"out_dims= to None for output {i}?"
            )


def _place(opts: Options, tensors: List[torch.Tensor], seen: Dict[str, Any], share: Share) -> Any:
    """The outputs, from the tensors vmap returned at dim 0: each at its out_dim, or for out_dims=None its one copy;
    non-tensor leaves as func returned them. An output that is func's mapped input itself, placed where that input
    has its batch dim, is the input itself (an in-place op), as vmap returns it."""
    found = iter(tensors)
    placed = []
    for i, (v, dim, source) in enumerate(zip(seen["flat"], seen["dims"], seen["inputs"])):
        if not isinstance(v, torch.Tensor):
            placed.append(v)
            continue
        t = next(found)
        if dim is None:
            placed.append(t.select(0, 0))
            continue
        dim = normalise_out_dim(opts.call, dim, t.dim() - 1, i)
        itself = source is not None and share.dims[source] == dim and opts.chunk_size is None  # chunks: vmap copies
        placed.append(share.leaves[source] if itself else t.movedim(0, dim))
    return tree_unflatten(placed, seen["spec"])


def _place_traced(opts: Options, out: Any, level: int, rows: int) -> Any:
    """:func:`_place` inside ``torch.compile``: vmap's outputs at ``out_dims``, as ``torch.vmap`` returns them. An
    ``out_dims=None`` output must not depend on the example: dynamo cannot ask whether a tensor is batched, so its rows
    are read as a view, which is a broadcast (stride 0) exactly when every example holds the same value."""
    flat, spec = flatten(out)
    dims = flatten_out_dims(opts.call, opts.out_dims, spec, len(flat))
    placed = []
    for i, (v, d) in enumerate(zip(flat, dims)):
        if not isinstance(v, torch.Tensor):
            if d is not None:
                raise ValueError(f"{opts.call}: output {i} must be a Tensor to be mapped, got {type(v).__name__}.")
            placed.append(v)
        elif d is None:
            if rows > 1 and remove_batch_dim(v, level, rows, 0).stride(0) != 0:
                raise ValueError(
                    f"{opts.call}: output {i} depends on the example but its out_dim is None; give it an int "
                    f"out_dim, or reduce it over the axis first, e.g. with psum."
                )
            placed.append(v)
        else:
            d = normalise_out_dim(opts.call, d, v.dim(), i)
            placed.append(remove_batch_dim(v, level, rows, d))
    return unflatten(placed, spec)


def _name(opts: Options) -> str:
    """func's name as the call's name shows it."""
    return opts.call.split("(", 1)[-1].split(",", 1)[0]


def check_rows(opts: Options, i: int, v: torch.Tensor, out_dim: int, rows: int) -> None:
    """In batched mode func must return one row per example it was given, along each mapped output's out_dim."""
    if v.shape[out_dim] != rows:
        raise ValueError(
            f"{opts.call}: mode='batched': output {i} has {v.shape[out_dim]} rows along its out_dim {out_dim} (shape "
            f"{tuple(v.shape)}), but func was given {rows} examples; it must return one row per example (or use "
            f"out_dims=None for an output that is not per example)."
        )


def _rows_checked(opts: Options, out: Any, rows: int) -> Any:
    """A chunk's outputs, checked as the share's are (:func:`check_rows`) before the chunks are joined, so that the
    error does not depend on how the rows fell into chunks."""
    flat, spec = tree_flatten(out)
    for i, (v, d) in enumerate(zip(flat, flatten_out_dims(opts.call, opts.out_dims, spec, len(flat)))):
        if isinstance(v, torch.Tensor) and d is not None:
            check_rows(opts, i, v, normalise_out_dim(opts.call, d, v.dim() - 1, i), rows)
    return out


def _chunks(share: Share, size: int) -> Iterator[Share]:
    for start in range(0, share.rows, size):
        yield share.take(start, min(size, share.rows - start))


def _combine(results: List[Any], opts: Options, how: Callable) -> Any:
    """Chunks concatenated (``torch.cat``) or examples stacked (``torch.stack``) along each output's out-dim."""
    flats, spec = [], None
    for r in results:
        leaves, spec = tree_flatten(r)
        flats.append(leaves)
    dims = flatten_out_dims(opts.call, opts.out_dims, spec, len(flats[0]))
    out = []
    for i, dim in enumerate(dims):
        first = flats[0][i]
        if dim is None:
            _check_same(opts, i, first, [f[i] for f in flats[1:]])
            out.append(first)
            continue
        if not isinstance(first, torch.Tensor):
            raise ValueError(f"{opts.call}: output {i} must be a Tensor to be mapped, got {type(first).__name__}.")
        example_ndim = first.dim() - (1 if how is torch.cat else 0)
        dim = normalise_out_dim(opts.call, dim, example_ndim, i)
        out.append(how([f[i] for f in flats], dim=dim))
    return tree_unflatten(out, spec)


def _check_same(opts: Options, i: int, first: Any, others: List[Any]) -> None:
    """An ``out_dims=None`` output must not depend on the example: vmap refuses it, so a loop or chunks must too."""
    for other in others:
        same = torch.equal(first, other) if isinstance(first, torch.Tensor) else first == other
        if not same:
            raise ValueError(
                f"{opts.call}: `{_name(opts)}` can not return a BatchedTensor when out_dim is None (output {i} differs "
                f"between examples; mode={opts.mode.name!r}). Give it an int out_dim, or make it the same for every example."
            )
