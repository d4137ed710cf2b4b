"""What one cmap keeps between its calls: the function, its options, the fast path's cache, where func's closures live,
and what the last call did. ``Cmapped`` (the public callable) owns one; the call path reads it and
:mod:`~colossalai_cmap.call.dispatch` is the only writer of what a call learned."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ..engine.module_params import References, reaches_sync_batchnorm, reaches_trainable, reaches_training_batchnorm
from ..torch_internals import TreeSpec
from .dims import KeywordCall
from .options import Options
from .records import FastPath, LastCall

_CACHE_SIZE = 64


class FastPathCache:
    """The fast path's records, least recently used first out."""

    def __init__(self) -> None:
        self._entries: "OrderedDict[Tuple[Any, ...], FastPath]" = OrderedDict()

    def get(self, key: Tuple[Any, ...], spec: TreeSpec) -> Optional[FastPath]:
        found = self._entries.get(key)
        if found is None or (found.shares.spec is not spec and found.shares.spec != spec):
            return None
        self._entries.move_to_end(key)
        return found

    def put(self, key: Tuple[Any, ...], record: FastPath) -> None:
        self._entries[key] = record
        self._entries.move_to_end(key)
        while len(self._entries) > _CACHE_SIZE:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


@dataclass(eq=False)
class CallSite:
    """One cmap's state across calls.

    Attributes:
        func: the per-example function.
        body: the function the map runs: ``func``, or in mode "vmap" the function ``torch.compile`` made it from.
        options: the cmap's options.
        fast_paths: the fast path's records.
        refs: where func's closures, globals and partial arguments live (modules found there enter with the args).
        captures_trainable: whether func may read a tensor that requires grad without being given it
            (:func:`~colossalai_cmap.engine.module_params.reaches_trainable`), read once per compiled graph.
        runs_training_batchnorm: whether func may run a BatchNorm in training mode
            (:func:`~colossalai_cmap.engine.module_params.reaches_training_batchnorm`), read once per compiled graph.
        sync_batchnorm: whether func may reach a ``torch.nn.SyncBatchNorm``
            (:func:`~colossalai_cmap.engine.module_params.reaches_sync_batchnorm`), found at the first call that asks (None before).
        captures: whether the last call that tracked gradients met closure-captured tensors (None: no such call).
        last: what the last call did.
    """

    func: Callable
    options: Options
    body: Callable = None  # type: ignore[assignment]
    fast_paths: FastPathCache = field(default_factory=FastPathCache)
    refs: References = None  # type: ignore[assignment]
    captures: Optional[bool] = None
    last: Optional[LastCall] = None
    captures_trainable: Callable[[], bool] = None  # type: ignore[assignment]
    runs_training_batchnorm: Callable[[], bool] = None  # type: ignore[assignment]
    sync_batchnorm: Optional[bool] = None
    _vmapped: Optional[Callable] = None

    _keyword_sites: Dict[str, "CallSite"] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.refs is not None:  # made by with_keywords: its parent's body, references and cache
            return
        original = uncompiled(self.func)
        # torch.vmap cannot run a compiled function (dynamo refuses it): vmap mode maps the original
        self.body = original if self.options.mode.under_vmap else self.func
        self.refs = References(original)

        def captures_trainable() -> bool:
            return reaches_trainable(original)

        # Read when dynamo traces a call (it cannot read closure cells itself), as a constant of that graph.
        self.captures_trainable = torch.compiler.assume_constant_result(captures_trainable)

        def runs_training_batchnorm() -> bool:
            return reaches_training_batchnorm(original)

        self.runs_training_batchnorm = torch.compiler.assume_constant_result(runs_training_batchnorm)

    def with_keywords(self, kwarg_dims: Any) -> "CallSite":
        """This cmap with its mapped keywords as one more positional argument (:class:`~.dims.KeywordCall`), the
        keywords' dims being ``kwarg_dims``: made once per ``kwarg_dims``, sharing this site's fast-path cache (its
        keys hold the keywords' structure) and func's references."""
        key = repr(kwarg_dims)
        site = self._keyword_sites.get(key)
        if site is None:
            options = dataclasses.replace(self.options, in_dims=(self.options.in_dims, kwarg_dims))
            site = CallSite(
                KeywordCall(self.func),
                options,
                body=KeywordCall(self.body),
                fast_paths=self.fast_paths,
                refs=self.refs,
                captures_trainable=self.captures_trainable,
                runs_training_batchnorm=self.runs_training_batchnorm,
                sync_batchnorm=self.may_reach_sync_batchnorm(),
            )
            self._keyword_sites[key] = site
        return site

    def may_reach_sync_batchnorm(self) -> bool:
        """Whether func may reach a ``torch.nn.SyncBatchNorm``: walked once, at the first call that asks (a model
        converted with ``convert_sync_batchnorm`` after that call is not seen)."""
        if self.sync_batchnorm is None:
            self.sync_batchnorm = reaches_sync_batchnorm(uncompiled(self.func))
        return self.sync_batchnorm

    def vmapped(self) -> Callable:
        """``torch.vmap(func, ...)`` with this cmap's options, built once (it costs a few microseconds)."""
        if self._vmapped is None:
            o = self.options
            self._vmapped = torch.vmap(
                self.body, o.in_dims, o.out_dims, randomness=o.randomness.name, chunk_size=o.chunk_size
            )
        return self._vmapped


def uncompiled(func: Callable) -> Any:
    """The function ``torch.compile`` made ``func`` from (itself if it is not compiled)."""
    if isinstance(func, torch.nn.Module) and hasattr(func, "_orig_mod"):
        return func._orig_mod
    return getattr(func, "_torchdynamo_orig_callable", func)
