"""The parameters of the modules func uses, entered with the arguments so that backward sums them in one collective.

A module's parameters are closure-captured tensors like any other, and :mod:`closures` would sum their gradients
one autograd node at a time. A module that func names directly (func itself, the instance of a bound method, a
closure cell, a ``functools.partial`` argument, or a global that func's code reads) is found here instead: its
parameters that require grad go through the call's entry ``Scatter`` with the arguments, and func runs with the
module reparametrized to those values (as ``torch.func.functional_call`` does), so one ``Join`` in backward sums
every parameter's gradient. Anything not found here is still caught by the closure walk.
"""

import contextlib
import functools
from typing import Any, Callable, Dict, Iterator, List

import torch
from torch import nn

try:  # the context manager behind torch.func.functional_call
    from torch.nn.utils.stateless import _reparametrize_module
except ImportError:  # pragma: no cover - other torch versions: the closure walk covers the parameters
    _reparametrize_module = None


def modules_of(func: Callable) -> List[nn.Module]:
    """The modules ``func`` names directly, each once."""
    if _reparametrize_module is None:
        return []
    found: Dict[int, nn.Module] = {}
    for value in referenced(func):
        if isinstance(value, nn.Module):
            found.setdefault(id(value), value)
    return list(found.values())


def referenced(func: Any) -> Iterator[Any]:
    """What func names directly: itself, a bound method's instance, closure cells, partial arguments, globals."""
    yield func
    if isinstance(func, functools.partial):
        yield from referenced(func.func)
        yield from func.args
        yield from func.keywords.values()
        return
    yield getattr(func, "__self__", None)
    code = getattr(func, "__code__", None)
    for cell in getattr(func, "__closure__", None) or ():
        try:
            yield cell.cell_contents
        except ValueError:  # an empty cell
            continue
    if code is not None:
        names = getattr(func, "__globals__", {})
        yield from (names[n] for n in code.co_names if n in names)


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
                stack.enter_context(_reparametrize_module(m, mapping))
        yield
