"""Run one rank's shard: ``torch.vmap``, one batched call, or a Python loop; plus randomness and ``chunk_size``."""

import contextlib
import threading
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from ..axis.frame import AxisFrame
from .loop import LoopBarrier
from .options import Options
from .specs import flatten_out_dims, normalise_out_dim, unflatten

# torch.vmap's own sentence, for a random draw under randomness="error" (loop mode checks the generator's state)
RANDOM_IN_ERROR_MODE = (
    "vmap: called random operation while in randomness error mode. Please either use the 'same' or 'different' "
    "randomness flags on vmap or perform the randomness operation out of vmap"
)


class Shard(NamedTuple):
    """This rank's arguments: the flat leaves (mapped ones cut to this rank's rows) and their in-dims."""

    leaves: List[Any]
    dims: Tuple[Optional[int], ...]
    spec: TreeSpec
    rows: int

    def args(self) -> Tuple[Any, ...]:
        return unflatten(self.leaves, self.spec)

    def take(self, start: int, count: int) -> "Shard":
        leaves = [v if d is None else v.narrow(d, start, count) for v, d in zip(self.leaves, self.dims)]
        return self._replace(leaves=leaves, rows=count)

    def example(self, i: int) -> Tuple[Any, ...]:
        return tree_unflatten([v if d is None else v.select(d, i) for v, d in zip(self.leaves, self.dims)], self.spec)


def run_shard(
    opts: Options,
    func: Callable,
    shard: Shard,
    kwargs: Dict[str, Any],
    frame: Optional[AxisFrame],
    *,
    vmapped: Optional[Callable] = None,
    thread_modes: Sequence[Any] = (),
) -> Any:
    """Apply ``func`` to the shard's examples; the batch dims come back at ``out_dims``.

    With an axis ``frame``, each example can see its global index (``axis_index``), and loop mode runs the examples
    in threads so that collectives can meet, each under ``thread_modes`` (torch function modes are per thread). Loop mode
    follows vmap's ``randomness``: "error" raises vmap's error if func drew random numbers, "same" gives every
    example the same draws.
    """
    indices = None
    if frame is not None:
        first = 0 if frame.dummy else frame.offset
        indices = torch.arange(first, first + shard.rows, dtype=torch.int64, device=frame.device)
    if opts.mode == "vmap":
        plain = shard.rows or opts.chunk_size is None
        if vmapped is not None and frame is None and plain and not opts.places_outputs:
            return vmapped(*shard.args(), **kwargs)  # the common case: the cmap's own torch.vmap wrapper
        return _vmap(opts, func, shard, kwargs, frame, indices)
    if opts.mode == "batched":
        if frame is not None:
            frame.index = indices
        if opts.chunk_size is None or shard.rows <= opts.chunk_size:
            return func(*shard.args(), **kwargs)
        chunks = [func(*part.args(), **kwargs) for part in _chunks(shard, opts.chunk_size)]
        return _combine(chunks, opts, torch.cat)
    before = torch.random.get_rng_state() if opts.randomness != "different" else None
    if shard.rows == 0:
        out = _empty_loop(opts, func, shard, kwargs)
    elif frame is not None:
        frame.index = indices
        out = _loop_threads(opts, func, shard, kwargs, frame, thread_modes=thread_modes)
    else:
        results = []
        for i in range(shard.rows):
            if opts.randomness == "same":
                torch.random.set_rng_state(before)
            results.append(func(*shard.example(i), **kwargs))
        out = _combine(results, opts, torch.stack)
    if opts.randomness == "error" and not torch.equal(before, torch.random.get_rng_state()):
        raise RuntimeError(RANDOM_IN_ERROR_MODE)
    return out


def _empty_loop(opts: Options, func: Callable, shard: Shard, kwargs: Dict[str, Any]) -> Any:
    """Loop mode on an empty batch, as vmap: func runs once on a zero example to learn the outputs' structure, and
    every mapped output comes back with zero rows."""
    example = [
        v if d is None else v.new_zeros(v.shape[:d] + v.shape[d + 1 :]) for v, d in zip(shard.leaves, shard.dims)
    ]
    with torch.no_grad():
        one = func(*tree_unflatten(example, shard.spec), **kwargs)
    return _combine([one], opts, lambda parts, dim: parts[0].unsqueeze(dim).narrow(dim, 0, 0))


def _vmap(
    opts: Options, func: Callable, shard: Shard, kwargs: Dict[str, Any], frame: Optional[AxisFrame], indices: Any
) -> Any:
    """``torch.vmap`` on the shard. Where ``out_dims`` holds a None or an int other than 0, vmap returns every tensor
    output at dim 0 and the outputs are placed here: torch 2.5.1's vmap misplaces a batch-independent output at
    another int out_dim, and refuses an out_dims=None output that is batched at an outer level only (a psum over an
    inner cmap's axis that varies over an outer one). An output batched at this level stays refused, in vmap's
    words."""
    chunk = opts.chunk_size if shard.rows else None  # torch.vmap's chunking fails on an empty batch
    place = opts.places_outputs and shard.rows > 0
    if frame is None and not place:
        mapped = torch.vmap(func, opts.in_dims, opts.out_dims, randomness=opts.randomness, chunk_size=chunk)
        return mapped(*shard.args(), **kwargs)
    seen: Dict[str, Any] = {}  # with placing: the outputs' structure and their non-tensor leaves

    def indexed(index: Optional[torch.Tensor], *a: Any, **k: Any) -> Any:
        if frame is not None:
            frame.index, frame.level = index, torch._C._functorch.maybe_current_level()
        out = func(*a, **k)
        if not place:
            return out
        flat, seen["spec"] = tree_flatten(out)
        seen["dims"] = flatten_out_dims(opts.call, opts.out_dims, seen["spec"], len(flat))
        seen["flat"] = flat
        _refuse_batched_none(opts, flat, seen["dims"])
        return [v for v in flat if isinstance(v, torch.Tensor)]

    args = shard.args()
    in_dims = opts.in_dims if isinstance(opts.in_dims, tuple) else (opts.in_dims,) * len(args)
    dims = (0 if frame is not None else None, *in_dims)
    mapped = torch.vmap(indexed, dims, 0 if place else opts.out_dims, randomness=opts.randomness, chunk_size=chunk)
    out = mapped(indices, *args, **kwargs)
    return _place(opts, out, seen) if place else out


def _refuse_batched_none(opts: Options, flat: Sequence[Any], dims: Sequence[Any]) -> None:
    """Inside vmap: an out_dims=None output must not depend on this map's examples."""
    level = torch._C._functorch.maybe_current_level()
    for i, (v, dim) in enumerate(zip(flat, dims)):
        if dim is None and isinstance(v, torch.Tensor) and torch._C._functorch.maybe_get_level(v) == level:
            raise ValueError(
                f"{opts.call}: `{_name(opts)}` can not return a BatchedTensor when out_dim is None (output {i} "
                f"depends on the example; give it an int out_dim, or reduce it over the axis first, e.g. with psum)."
            )
        if dim is not None and not isinstance(v, torch.Tensor):
            raise ValueError(
                f"{opts.call}: `{_name(opts)}` must only return Tensors, got type {type(v)}. Did you mean to set "
                f"out_dims= to None for output {i}?"
            )


def _place(opts: Options, tensors: List[torch.Tensor], seen: Dict[str, Any]) -> Any:
    """The outputs, from the tensors vmap returned at dim 0: each at its out_dim, or for out_dims=None its one copy;
    non-tensor leaves as func returned them."""
    found = iter(tensors)
    placed = []
    for i, (v, dim) in enumerate(zip(seen["flat"], seen["dims"])):
        if not isinstance(v, torch.Tensor):
            placed.append(v)
            continue
        t = next(found)
        placed.append(
            t.select(0, 0) if dim is None else t.movedim(0, normalise_out_dim(opts.call, dim, t.dim() - 1, i))
        )
    return tree_unflatten(placed, seen["spec"])


def _name(opts: Options) -> str:
    """func's name as the call's name shows it."""
    return opts.call.split("(", 1)[-1].split(",", 1)[0]


def _chunks(shard: Shard, size: int) -> Iterator[Shard]:
    for start in range(0, shard.rows, size):
        yield shard.take(start, min(size, shard.rows - start))


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
                f"between examples; mode={opts.mode!r}). Give it an int out_dim, or make it the same for every example."
            )


def _loop_threads(
    opts: Options,
    func: Callable,
    shard: Shard,
    kwargs: Dict[str, Any],
    frame: AxisFrame,
    *,
    thread_modes: Sequence[Any],
) -> Any:
    """Loop mode with collectives: one thread per example, taking turns, so that a collective can wait for every
    example. Each thread enters ``thread_modes``: the call's (the closure interceptor, and the marker of the nodes
    it makes, whose sequence numbers are the thread's own and so cannot tell that they were made during the call)."""
    barrier = frame.loop = LoopBarrier(shard.rows, same_rng=opts.randomness == "same")
    indices = frame.index
    results: List[Any] = [None] * shard.rows
    errors: List[BaseException] = []
    grad = torch.is_grad_enabled()

    def work(i: int) -> None:
        try:
            barrier.enter(i, indices[i])
            with torch.set_grad_enabled(grad), contextlib.ExitStack() as modes:
                if threading.current_thread() is not threading.main_thread():
                    for mode in thread_modes:
                        modes.enter_context(mode)
                results[i] = func(*shard.example(i), **kwargs)
        except BaseException as exc:  # the first error reaches every example through the barrier
            errors.append(exc)
            barrier.abort(exc)
        finally:
            barrier.leave()

    if shard.rows == 1:
        work(0)
    else:
        threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(shard.rows)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    return _combine(results, opts, torch.stack)


@contextlib.contextmanager
def rng_scope(seed: Optional[int], devices: Sequence[torch.device]) -> Iterator[None]:
    """Run under a forked RNG seeded with ``seed`` (``None``: leave the generators alone)."""
    if seed is None:
        yield
        return
    indices = sorted({d.index or 0 for d in devices if d.type == "cuda"})
    with torch.random.fork_rng(devices=indices):
        torch.manual_seed(seed)
        yield
