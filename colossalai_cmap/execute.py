"""Run one rank's shard: ``torch.vmap``, one batched call, or a Python loop; plus randomness and ``chunk_size``."""

import contextlib
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .context import AxisFrame
from .sharding import take_local
from .specs import FlatArgs, flatten_out_dims, normalise_out_dim

MODES = ("vmap", "batched", "loop")
RANDOMNESS = ("error", "different", "same")


def run_shard(
    func: Callable,
    flat: FlatArgs,
    shard: List[Any],
    rows: int,
    kwargs: Dict[str, Any],
    in_dims: Any,
    out_dims: Any,
    mode: str,
    randomness: str,
    chunk_size: Optional[int],
    call: str,
    frame: Optional[AxisFrame] = None,
) -> Any:
    """Apply ``func`` to ``rows`` examples whose mapped leaves are ``shard``; batch dims come back at ``out_dims``.

    With an axis ``frame`` (``axis_name`` was given), each example can see its global index (``axis_index``) and
    loop mode runs the examples in threads so that collectives can meet.
    """
    args = flat.unflatten(shard)
    if frame is not None:
        first = 0 if frame.dummy else frame.offset
        indices = torch.arange(first, first + rows, dtype=torch.int64, device=frame.device)
    if mode == "vmap":
        chunk_size = chunk_size if rows else None  # torch.vmap's chunking fails on an empty batch
        if frame is None:
            return torch.vmap(func, in_dims, out_dims, randomness=randomness, chunk_size=chunk_size)(*args, **kwargs)

        def indexed(index: torch.Tensor, *a: Any, **k: Any) -> Any:
            frame.index = index
            return func(*a, **k)

        dims = (0, *(in_dims if isinstance(in_dims, tuple) else (in_dims,) * len(args)))
        return torch.vmap(indexed, dims, out_dims, randomness=randomness, chunk_size=chunk_size)(
            indices, *args, **kwargs
        )
    if frame is not None and mode == "batched":
        frame.index = indices
    if mode == "batched":
        if chunk_size is None or rows <= chunk_size:
            return func(*args, **kwargs)
        chunks = [func(*flat.unflatten(part), **kwargs) for part in _chunks(shard, flat.dims, rows, chunk_size)]
        return _concat(chunks, out_dims, call)
    if frame is not None:
        return _loop_threads(func, flat, shard, rows, kwargs, out_dims, call, frame, indices)
    return _loop(func, flat, shard, rows, kwargs, out_dims, randomness, call)


def _chunks(shard: List[Any], dims: Sequence[Any], rows: int, size: int) -> Iterator[List[Any]]:
    for start in range(0, rows, size):
        yield take_local(shard, dims, start, min(size, rows - start))


def _example(shard: List[Any], dims: Sequence[Any], i: int) -> List[Any]:
    """Example ``i`` of the shard: mapped leaves indexed along their dim, the others as they are."""
    return [leaf if d is None else leaf.select(d, i) for leaf, d in zip(shard, dims)]


def _concat(chunks: List[Any], out_dims: Any, call: str) -> Any:
    flats, spec = [], None
    for chunk in chunks:
        leaves, spec = tree_flatten(chunk)
        flats.append(leaves)
    dims = flatten_out_dims(call, out_dims, spec, len(flats[0]))
    out = []
    for i, dim in enumerate(dims):
        first = flats[0][i]
        if dim is None or not isinstance(first, torch.Tensor):
            out.append(first)
        else:
            out.append(torch.cat([f[i] for f in flats], dim=dim))
    return tree_unflatten(out, spec)


def _loop(
    func: Callable,
    flat: FlatArgs,
    shard: List[Any],
    rows: int,
    kwargs: Dict[str, Any],
    out_dims: Any,
    randomness: str,
    call: str,
) -> Any:
    if rows == 0:
        raise ValueError(f"{call}: mode='loop' cannot infer the outputs of an empty batch (B=0).")
    state = torch.random.get_rng_state() if randomness == "same" else None
    results = []
    for i in range(rows):
        if state is not None:
            torch.random.set_rng_state(state)
        results.append(func(*flat.unflatten(_example(shard, flat.dims, i)), **kwargs))
    return _stack(results, out_dims, call)


def _loop_threads(
    func: Callable,
    flat: FlatArgs,
    shard: List[Any],
    rows: int,
    kwargs: Dict[str, Any],
    out_dims: Any,
    call: str,
    frame: AxisFrame,
    indices: torch.Tensor,
) -> Any:
    """Loop mode with collectives: one thread per example, so a collective can wait for every example."""
    from .collectives import LoopBarrier

    if rows == 0:
        raise ValueError(f"{call}: mode='loop' cannot infer the outputs of an empty batch (B=0).")
    barrier = frame.loop = LoopBarrier(rows)
    frame.index = indices
    results: List[Any] = [None] * rows
    errors: List[BaseException] = []
    grad = torch.is_grad_enabled()

    def work(i: int) -> None:
        barrier.set_index(i, indices[i])
        try:
            with torch.set_grad_enabled(grad):
                results[i] = func(*flat.unflatten(_example(shard, flat.dims, i)), **kwargs)
        except BaseException as exc:  # the first real error wins; the others are broken-barrier fallout
            errors.append(exc)
            barrier.abort()

    if rows == 1:
        work(0)
    else:
        threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(rows)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
        raise (real or errors)[0]
    return _stack(results, out_dims, call)


def _stack(results: List[Any], out_dims: Any, call: str) -> Any:
    flats, spec = [], None
    for r in results:
        leaves, spec = tree_flatten(r)
        flats.append(leaves)
    results = flats
    dims = flatten_out_dims(call, out_dims, spec, len(results[0]))
    out = []
    for i, dim in enumerate(dims):
        first = results[0][i]
        if dim is None:
            out.append(first)
            continue
        if not isinstance(first, torch.Tensor):
            raise ValueError(f"{call}: output {i} must be a Tensor to be mapped, got {type(first).__name__}.")
        dim = normalise_out_dim(call, dim, first.dim(), i)
        out.append(torch.stack([r[i] for r in results], dim=dim))
    return tree_unflatten(out, spec)


@contextlib.contextmanager
def rng_scope(randomness: str, seed: Optional[int], devices: Sequence[torch.device]) -> Iterator[None]:
    """Run under a forked RNG seeded with ``seed`` (``None``: leave the generators alone)."""
    if seed is None:
        yield
        return
    indices = sorted({d.index or 0 for d in devices if d.type == "cuda"})
    with torch.random.fork_rng(devices=indices):
        torch.manual_seed(seed)
        yield
