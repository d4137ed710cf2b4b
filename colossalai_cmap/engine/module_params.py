"""The parameters of the modules func uses, entered with the arguments so that backward sums them in one collective.

A module's parameters are closure-captured tensors like any other, and :mod:`closures` would sum their gradients
one autograd node at a time. A module that func names directly (func itself, the instance of a bound method, a
closure cell, a ``functools.partial`` argument, or a global that func's code reads) is found here instead: its
parameters that require grad go through the call's entry ``Split`` with the arguments, and func runs with the
module reparametrized to those values (as ``torch.func.functional_call`` does), so one ``Join`` in backward sums
every parameter's gradient. Anything not found here is still caught by the closure walk.
"""

import contextlib
import functools
import types
from typing import Any, Callable, Dict, Iterator, List, Sequence, Tuple

import torch
from torch import nn

from ..torch_internals import can_reparametrize, reparametrized


class References:
    """Where the values func names directly live: itself, a bound method's instance, partial arguments, closure
    cells, and the globals its code reads. Found once, when the cmap is made; read at each call, so a rebound cell or
    global is seen. Only slots that held a tensor, a module or a container when the cmap was made are kept (others,
    such as the ``torch`` module, cost nothing per call); anything else reaches the closure walk."""

    def __init__(self, func: Callable) -> None:
        self.fixed: List[Any] = []
        self.cells: List[Any] = []
        self.names: List[str] = []
        self.namespace: Dict[str, Any] = {}
        self._find(func)

    def _find(self, func: Any) -> None:
        self.fixed += [v for v in (func, getattr(func, "__self__", None)) if isinstance(v, nn.Module)]
        if isinstance(func, functools.partial):
            self.fixed += [v for v in (*func.args, *func.keywords.values()) if _kept(v)]
            self._find(func.func)
            return
        self.cells += [c for c in getattr(func, "__closure__", None) or () if _kept(_contents(c))]
        code, namespace = getattr(func, "__code__", None), getattr(func, "__globals__", None)
        if code is not None and namespace is not None:
            self.namespace = namespace
            self.names = [n for n in code.co_names if _kept(namespace.get(n))]

    def __bool__(self) -> bool:
        return bool(self.fixed or self.cells or self.names)

    def values(self) -> Iterator[Any]:
        yield from self.fixed
        yield from (_contents(c) for c in self.cells)
        yield from (self.namespace.get(n) for n in self.names)


_PLAIN = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device, types.BuiltinFunctionType)
_LIBRARIES = {"torch", "numpy", "math", "functools", "builtins", "typing", "collections", "colossalai_cmap"}


def _library(v: Any) -> bool:
    """Code of torch and the standard library holds no tensor of the caller's."""
    name = v.__name__ if isinstance(v, types.ModuleType) else getattr(v, "__module__", None)
    return isinstance(name, str) and name.split(".")[0] in _LIBRARIES


def reaches_trainable(func: Callable, depth: int = 3) -> bool:
    """Whether func may read a tensor that requires grad without being given it: one found through its closure
    cells, partial arguments, bound instance, the globals its code names (and the attributes it names of a Python
    module among them), the functions it names in turn (``depth`` levels), and the attributes of other objects. On
    doubt (a level too deep) it says yes: a compiled call refuses what it cannot see."""
    return _reaches(func, depth, lambda t: t.requires_grad, lambda m: any(p.requires_grad for p in m.parameters()))


def reaches_training_batchnorm(func: Callable, depth: int = 3) -> bool:
    """Whether func may run a BatchNorm in training mode (func itself, or a module found as
    :func:`reaches_trainable` finds tensors), whose statistics couple the rows; says yes on doubt."""
    return _reaches(
        func,
        depth,
        lambda t: False,
        lambda m: any(isinstance(x, nn.modules.batchnorm._BatchNorm) and x.training for x in m.modules()),
    )


def reaches_sync_batchnorm(func: Callable, depth: int = 3) -> bool:
    """Whether func may run a ``torch.nn.SyncBatchNorm`` (found as :func:`reaches_trainable` finds modules), in any
    mode; says yes on doubt."""
    return _reaches(func, depth, lambda t: False, lambda m: any(isinstance(x, nn.SyncBatchNorm) for x in m.modules()))


def _reaches(
    func: Callable, depth: int, tensor_hit: Callable[[torch.Tensor], bool], module_hit: Callable[[nn.Module], bool]
) -> bool:
    seen: set = set()

    def of_value(v: Any, names: Sequence[str], level: int) -> bool:
        if id(v) in seen or isinstance(v, _PLAIN):
            return False
        seen.add(id(v))
        if isinstance(v, torch.Tensor):
            return tensor_hit(v)
        if isinstance(v, nn.Module):
            return module_hit(v)
        if isinstance(v, (list, tuple, dict, set, frozenset)):
            return any(of_value(x, names, level) for x in (v.values() if isinstance(v, dict) else v))
        if isinstance(v, (functools.partial, types.MethodType)):  # their parts are the caller's, whoever made them
            return level <= 0 or of_func(v, level - 1)
        if _library(v):
            return False
        if isinstance(v, (types.ModuleType, type)):  # ``pkg.W``, ``Config.W``: the attributes func's code names
            return any(of_value(getattr(v, n, None), (), level) for n in names)
        if callable(v) and hasattr(v, "__code__"):
            return level <= 0 or of_func(v, level - 1)
        attrs = getattr(v, "__dict__", None)
        if not isinstance(attrs, dict) or not attrs:
            return False
        return level <= 0 or any(of_value(x, names, level - 1) for x in attrs.values())

    def of_func(f: Any, level: int) -> bool:
        if isinstance(f, functools.partial):
            parts = (*f.args, *f.keywords.values())
            return any(of_value(x, (), level) for x in parts) or of_value(f.func, (), level)
        if isinstance(f, types.MethodType) and of_value(f.__self__, (), level):
            return True
        code, namespace = getattr(f, "__code__", None), getattr(f, "__globals__", None) or {}
        names = _names(code) if code is not None else ()
        cells = [_contents(c) for c in getattr(f, "__closure__", None) or ()]
        found = [namespace[n] for n in names if n in namespace] + cells
        return any(of_value(x, names, level) for x in found)

    return of_value(func, (), depth + 1)


def _names(code: types.CodeType) -> Tuple[str, ...]:
    """The names a function's code reads, its nested functions' (lambdas, comprehensions) included."""
    found = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found += _names(const)
    return tuple(found)


def _contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _kept(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, nn.Module, list, tuple, dict))


def modules_of(refs: References) -> List[nn.Module]:
    """The modules func names directly, each once."""
    if not can_reparametrize():  # other torch versions: the closure walk covers the parameters
        return []
    found: Dict[int, nn.Module] = {}
    for value in refs.values():
        if isinstance(value, nn.Module):
            found.setdefault(id(value), value)
    return list(found.values())


def trainable(modules: List[nn.Module]) -> List[torch.Tensor]:
    """Their parameters that require grad, each once."""
    seen: Dict[int, torch.Tensor] = {}
    for m in modules:
        for p in m.parameters():
            if p.requires_grad and not p.is_meta:  # a meta module is a skeleton for functional_call
                seen.setdefault(id(p), p)
    return list(seen.values())


@contextlib.contextmanager
def substituted(modules: List[nn.Module], aliases: Dict[int, torch.Tensor]) -> Iterator[None]:
    """Run with each module's parameters replaced by their aliases (keyed by the parameter's ``id``)."""
    with contextlib.ExitStack() as stack:
        for m in modules:
            mapping = {n: aliases[id(p)] for n, p in m.named_parameters(remove_duplicate=False) if id(p) in aliases}
            if mapping:
                stack.enter_context(reparametrized(m, mapping))
        yield
