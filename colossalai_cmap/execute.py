"""Run one rank's shard: ``torch.vmap``, one batched call, or a Python loop; plus randomness and ``chunk_size``."""

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

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
) -> Any:
    """Apply ``func`` to ``rows`` examples whose mapped leaves are ``shard``; batch dims come back at ``out_dims``."""
    args = flat.unflatten(shard)
    if mode == "vmap":
        chunk_size = chunk_size if rows else None  # torch.vmap's chunking fails on an empty batch
        return torch.vmap(func, in_dims, out_dims, randomness=randomness, chunk_size=chunk_size)(*args, **kwargs)
    if mode == "batched":
        if chunk_size is None or rows <= chunk_size:
            return func(*args, **kwargs)
        chunks = [func(*flat.unflatten(part), **kwargs) for part in _chunks(shard, flat.dims, rows, chunk_size)]
        return _concat(chunks, out_dims, call)
    return _loop(func, flat, shard, rows, kwargs, out_dims, randomness, call)


def _chunks(shard: List[Any], dims: Sequence[Any], rows: int, size: int) -> Iterator[List[Any]]:
    for start in range(0, rows, size):
        n = min(size, rows - start)
        yield [leaf if d is None else leaf.narrow(d, start, n) for leaf, d in zip(shard, dims)]


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
    results, spec = [], None
    for i in range(rows):
        if state is not None:
            torch.random.set_rng_state(state)
        example = [leaf if d is None else leaf.select(d, i) for leaf, d in zip(shard, flat.dims)]
        leaves, spec = tree_flatten(func(*flat.unflatten(example), **kwargs))
        results.append(leaves)
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
