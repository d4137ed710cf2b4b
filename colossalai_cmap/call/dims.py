"""The dims layer: ``in_dims``/``out_dims`` against pytrees, with the error messages.

Every check here is local and deterministic, so every rank raises the same error before any communication.
"""

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..torch_internals import (
    SUPPORTED_NODES,
    MappingKey,
    TreeSpec,
    broadcast_to_and_flatten,
    keystr,
    register_pytree_node,
    tree_flatten,
    tree_flatten_with_path,
    tree_unflatten,
)

Dim = Optional[int]

_LEAF = tree_flatten(0)[1]
_FLAT_TUPLES: List[TreeSpec] = []


def flatten(tree: Any) -> Tuple[List[Any], TreeSpec]:
    """``tree_flatten``, with shortcuts for the common shapes of a call: one tensor, or a tuple of tensors."""
    if type(tree) is torch.Tensor:
        return [tree], _LEAF
    if type(tree) is tuple and all(type(v) is torch.Tensor for v in tree):
        n = len(tree)
        while len(_FLAT_TUPLES) <= n:
            _FLAT_TUPLES.append(tree_flatten((0,) * len(_FLAT_TUPLES))[1])
        return list(tree), _FLAT_TUPLES[n]
    return tree_flatten(tree)


def unflatten(leaves: Sequence[Any], spec: TreeSpec) -> Any:
    """``tree_unflatten``, with the same shortcuts as :func:`flatten`."""
    if spec is _LEAF:
        return leaves[0]
    n = len(leaves)
    if n < len(_FLAT_TUPLES) and spec is _FLAT_TUPLES[n]:
        return tuple(leaves)
    return tree_unflatten(list(leaves), spec)


class MappingArg:
    """A mapping that is no pytree node of torch's (a ``UserDict`` such as transformers' ``BatchEncoding``, any other
    ``collections.abc.Mapping``), seen by cmap as a dict of its values, so that its tensors can be split; func gets
    it back as its own type (:func:`restore_mappings`). Registering the caller's types with torch's pytree would
    change them for every other library; this one type is cmap's own."""

    __slots__ = ("kind", "data")

    def __init__(self, kind: type, data: Dict[Any, Any]) -> None:
        self.kind, self.data = kind, data

    def rebuilt(self) -> Any:
        """The caller's type holding this (restored) data: ``kind(dict)`` where the type takes one, else a dict."""
        data = {k: restore_mappings(v) for k, v in self.data.items()}
        try:
            return self.kind(data)
        except Exception:  # a Mapping whose constructor takes no dict: func reads it as a dict
            return data


register_pytree_node(
    MappingArg,
    lambda m: (list(m.data.values()), (m.kind, tuple(m.data))),
    lambda values, context: MappingArg(context[0], dict(zip(context[1], values))),
    flatten_with_keys_fn=lambda m: ([(MappingKey(k), v) for k, v in m.data.items()], (m.kind, tuple(m.data))),
)


def wrap_mappings(value: Any) -> Any:
    """``value`` with every mapping torch's pytree would take as a leaf turned into a :class:`MappingArg`, through
    tuples, lists and dicts; ``value`` itself when there is none (a tensor costs one type check)."""
    kind = type(value)
    if kind is torch.Tensor:
        return value
    if kind in (tuple, list):
        items = [wrap_mappings(v) for v in value]
        return value if all(a is b for a, b in zip(items, value)) else kind(items)
    if isinstance(value, Mapping):
        items = {k: wrap_mappings(v) for k, v in value.items()}
        if kind in SUPPORTED_NODES:
            return value if all(items[k] is v for k, v in value.items()) else kind(items)
        return MappingArg(kind, items)
    return value


def restore_mappings(value: Any) -> Any:
    """:func:`wrap_mappings` undone: each :class:`MappingArg` rebuilt as the caller's type, with the values func is
    given (this rank's rows, or vmap's per-example tensors)."""
    kind = type(value)
    if kind is MappingArg:
        return value.rebuilt()
    if kind in (tuple, list):
        return kind(restore_mappings(v) for v in value)
    if kind is dict:
        return {k: restore_mappings(v) for k, v in value.items()}
    return value


class KeywordCall:
    """func called with its mapped keyword arguments as one more positional argument, as jax flattens
    ``(args, kwargs)`` together: ``KeywordCall(func)(args, mapped, **whole)`` is ``func(*args, **mapped, **whole)``.
    So mapped keywords take the one path of the positional arguments (shares, entry, vmap, gather), with the in-dims
    ``(in_dims, kwarg dims)``. A mapped value wins over a whole one of the same name (with ``src=r``, other ranks
    may pass None for it)."""

    def __init__(self, func: Callable) -> None:
        self.func = func
        self.__name__ = getattr(func, "__name__", type(func).__name__)

    def __call__(self, args: Tuple[Any, ...], mapped: Dict[str, Any], **whole: Any) -> Any:
        args = restore_mappings(args)
        if mapped:
            whole.update(restore_mappings(mapped))
        return self.func(*args, **whole)


def _param_names(func: Callable) -> List[str]:
    try:
        target = func.forward if isinstance(func, torch.nn.Module) else func
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def describe_arg(func: Callable, path: str) -> str:
    """``argument 1 ('y')`` or ``argument 0 ('x')['a'][2]`` for a leaf path under the args tuple; ``keyword
    argument 'attention_mask'`` for a mapped keyword's."""
    # Paths under the args tuple start with "[i]".
    index_str, _, rest = path[1:].partition("]")
    if isinstance(func, KeywordCall):
        if index_str == "1":  # the mapped keywords: "[1]['name']..."
            name, _, rest = rest[1:].partition("]")
            return f"keyword argument {name}{rest}"
        return describe_arg(func.func, rest)
    try:
        index = int(index_str)
    except ValueError:
        return f"argument {path}"
    names = _param_names(func)
    label = f"argument {index}"
    if index < len(names):
        label += f" ({names[index]!r})"
    return label + rest


@dataclass
class FlatArgs:
    """The positional args flattened to leaves, with each leaf's normalised (non-negative) in-dim."""

    leaves: List[Any]
    dims: List[Dim]
    spec: TreeSpec
    batch_size: int


def leaf_paths(spec: TreeSpec) -> List[str]:
    from ..torch_internals import tree_unflatten

    skeleton = tree_unflatten([None] * spec.num_leaves, spec)
    with_path, _ = tree_flatten_with_path(skeleton, is_leaf=lambda x: x is None)
    return [keystr(p) for p, _ in with_path]


def _leaf_dims(call: str, in_dims: Any, count: int, spec: TreeSpec) -> List[Any]:
    """``in_dims`` broadcast to the ``count`` leaves of the args (it may be a pytree prefix, as vmap takes)."""
    if in_dims is None or isinstance(in_dims, int):
        return [in_dims] * count
    dims = broadcast_to_and_flatten(in_dims, spec)
    if dims is None:
        raise ValueError(
            f"{call}: in_dims is not compatible with the structure of `inputs`. in_dims has structure "
            f"{tree_flatten(in_dims)[1]} but inputs has structure {spec}."
        )
    return dims


def _keyword_dims(call: str, kwarg_dims: Any, spec: TreeSpec) -> List[Any]:
    """The mapped keywords' dims: ``kwarg_dims`` (one dims prefix per keyword) against their values."""
    if not isinstance(kwarg_dims, dict):
        return [kwarg_dims] * spec.num_leaves
    dims: List[Any] = []
    for name, child in zip(spec.context, spec.children_specs):
        found = broadcast_to_and_flatten(kwarg_dims[name], child)
        if found is None:
            raise ValueError(
                f"{call}: kwarg_dims[{name!r}] is not compatible with the structure of keyword argument {name!r}. "
                f"kwarg_dims[{name!r}] has structure {tree_flatten(kwarg_dims[name])[1]} but the keyword has "
                f"structure {child}."
            )
        dims += found
    return dims


def _unsplit_hint(leaf: Any) -> str:
    """For an object that may hold tensors: how to have them split instead of passing it whole."""
    if isinstance(leaf, (int, float, complex, bool, str, bytes, type(None))):
        return ""
    return (
        f" (to pass it whole); to split the tensors it holds, pass them in a tuple, list, dict or other Mapping, "
        f"which cmap splits, or register {type(leaf).__name__} with torch.utils._pytree.register_pytree_node"
    )


def flatten_args(func: Callable, args: Tuple[Any, ...], in_dims: Any, call: str) -> FlatArgs:
    """Flatten ``args`` and match ``in_dims`` to its leaves, raising vmap's errors with pytree paths. For a
    :class:`KeywordCall`, ``args`` is ``(positional args, mapped keywords)`` and ``in_dims`` their dims."""
    keywords = isinstance(func, KeywordCall)
    positional, positional_dims = (args[0], in_dims[0]) if keywords else (args, in_dims)
    if isinstance(positional_dims, tuple) and len(positional_dims) != len(positional):
        raise ValueError(
            f"{call}: in_dims is not compatible with the structure of `inputs`. in_dims has length "
            f"{len(positional_dims)} but the function was called with {len(positional)} positional argument(s)."
        )
    if not positional and not (keywords and any(v is not None for v in args[1].values())):
        raise ValueError(
            f"{call}: got no inputs. Maybe you forgot to add inputs, or you are trying to vmap over a function with "
            f"no inputs. The latter is unsupported. (cmap, like vmap, maps over at least one positional Tensor; "
            f"keyword arguments are passed whole unless kwarg_dims maps them.)"
        )
    leaves, spec = flatten(args)
    if keywords:
        dims = _leaf_dims(call, in_dims[0], spec.children_specs[0].num_leaves, spec.children_specs[0])
        kw_dims = _keyword_dims(call, in_dims[1], spec.children_specs[1])
        # a None keyword (with src=r, a rank's placeholder for the source's tensor) is not mapped
        dims += [None if v is None else d for v, d in zip(leaves[len(dims) :], kw_dims)]
    else:
        dims = _leaf_dims(call, in_dims, len(leaves), spec)
    normalised: List[Dim] = []
    sizes: List[Tuple[int, int]] = []
    paths: List[str] = []

    def where(i: int) -> str:  # the leaf's name, built only for an error message
        if not paths:
            paths.extend(leaf_paths(spec))
        return describe_arg(func, paths[i])

    for i, (leaf, dim) in enumerate(zip(leaves, dims)):
        if dim is None:
            normalised.append(None)
            continue
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise ValueError(f"{call}: {where(i)}: in_dim must be an int or None, got {dim!r} ({type(dim).__name__}).")
        if not isinstance(leaf, torch.Tensor):
            raise ValueError(
                f"{call}: {where(i)}: Got in_dim={dim} for an input but the input is of type {type(leaf)}. We cannot "
                f"vmap over non-Tensor arguments, please use None as the respective in_dim{_unsplit_hint(leaf)}"
            )
        ndim = leaf.dim()
        if not -ndim <= dim < ndim:
            raise ValueError(
                f"{call}: {where(i)}: Got in_dim={dim} for some input, but that input is a Tensor of dimensionality "
                f"{ndim} so expected in_dim to satisfy -{ndim} <= in_dim < {ndim} (shape {tuple(leaf.shape)})."
            )
        dim = dim % ndim
        normalised.append(dim)
        sizes.append((leaf.shape[dim], i))
    if not sizes:
        raise ValueError(f"{call}: at least one Tensor argument must be mapped over; all in_dims are None.")
    if len({s for s, _ in sizes}) != 1:
        listing = ", ".join(f"{where(i)}: {size}" for size, i in sizes)
        raise ValueError(
            f"{call}: Expected all tensors to have the same size in the mapped dimension, got sizes "
            f"{[size for size, _ in sizes]} for the mapped dimension ({listing})."
        )
    return FlatArgs(leaves, normalised, spec, sizes[0][0])


def flatten_out_dims(call: str, out_dims: Any, out_spec: TreeSpec, num_leaves: int) -> List[Dim]:
    """Match ``out_dims`` (an int, None, or a pytree prefix of the outputs, as vmap takes) to the flattened
    outputs."""
    if out_dims is None or isinstance(out_dims, int):
        return [out_dims] * num_leaves
    if out_spec.is_leaf() and isinstance(out_dims, tuple) and len(out_dims) == 1:
        return [out_dims[0]]  # vmap's edge case: a single output with out_dims=(d,)
    dims = broadcast_to_and_flatten(out_dims, out_spec)
    if dims is None or len(dims) != num_leaves:
        raise ValueError(
            f"{call}: out_dims is not compatible with the structure of `outputs`. out_dims has structure "
            f"{tree_flatten(out_dims)[1]} but outputs has structure {out_spec}."
        )
    return list(dims)


def normalise_out_dim(call: str, dim: Dim, example_ndim: int, index: int) -> Dim:
    """An out-dim may address any position in the output's per-example shape plus one (vmap's rule)."""
    if dim is None:
        return None
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise ValueError(
            f"{call}: output {index}: `out_dims` must be an int, None or a python collection of ints representing "
            f"where in the outputs the vmapped dimension should appear; got {dim!r}."
        )
    if not -(example_ndim + 1) <= dim <= example_ndim:
        raise IndexError(  # torch.vmap's type and sentence (its maybe_wrap_dim)
            f"{call}: output {index}: Dimension out of range (expected to be in range of [{-(example_ndim + 1)}, "
            f"{example_ndim}], but got {dim}): out_dim={dim} for a per-example output of dimension {example_ndim}."
        )
    return dim % (example_ndim + 1)
