"""BatchNorm in training mode sees the whole batch: in ``mode="batched"`` its statistics are taken over every
rank's rows, as ``model(x)`` takes them over the whole batch in one process.

func runs under :class:`WholeBatch`, which catches ``torch.nn.functional.batch_norm`` with ``training=True``
(``nn.BatchNorm1d/2d/3d`` call it, and so does any func that calls it as ``F.batch_norm``; a name imported from
``torch.nn.functional`` before the call is torch's own, not caught). Each rank sums its
values and their squares per channel; one ``Join(COPY)`` sums them over the group, its round carrying each rank's
count of values on the host (no read of device data); a ``Split(COPY)`` makes the sums this rank's own, so backward
sums their cotangents over the group (one collective), as ``SyncBatchNorm``'s backward does. Every rank then
normalises its rows and updates the running statistics alike, with the unbiased variance over the global count, so
they equal the single-process model's. An empty share's stand-in contributes nothing. The variance is the mean of
squares less the squared mean (flax's ``use_fast_variance``): one collective, at the cost of cancellation where a
channel's mean is large against its spread.

Where a function's rows cannot be one batch, training BatchNorm is refused alike at every P: in ``mode="loop"``
(func is called per example, and the running statistics would be updated per example, by each rank with its own:
vmap refuses it too) and when func may run on part of the rows (``chunk_size``, or ``randomness="per_example"``).
In a world of one with neither, BatchNorm needs nothing: func sees the whole batch. A ``torch.nn.SyncBatchNorm`` in
training mode is refused at every P (:func:`batch_scope`).

The same mode takes a loss's mean over the whole batch in ``mode="batched"`` (:mod:`.losses`), at every P: in a
world of one it only notes the losses it returned, which the exit returns alike at every P.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import threading
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook

from ..torch_internals import current_level
from ..wire.exchange import JoinSpec, Learned, SplitSpec, join, split
from ..wire.link import Link
from ..wire.roles import COPY
from ..wire.rounds import Kind
from . import losses
from .options import Options

WHAT = "BatchNorm's statistics over the whole batch"
_SIGNATURE = inspect.signature(F.batch_norm)
_LOSS_SIGNATURES = {f: inspect.signature(f) for f in losses.MEAN_LOSSES}

# The functions the mode catches, by their names in torch.nn.functional, as torch defines them
_CAUGHT = {name: getattr(F, name) for name in ("batch_norm",) + tuple(f.__name__ for f in losses.MEAN_LOSSES)}
_BATCH_NORM = _CAUGHT["batch_norm"]


def whole_batch(opts: Options, link: Optional[Link], empty: bool) -> Optional["WholeBatch"]:
    """The mode func runs under, where it changes anything: ``mode="batched"`` (at every P: its losses are returned
    alike, :mod:`.losses`), and the refusals of ``mode="loop"`` (``link``: None in a world of one)."""
    if opts.mode.under_vmap:
        return None
    across = link if link is not None and link.group.size > 1 else None
    parted = opts.randomness.per_example or opts.chunk_size is not None
    return WholeBatch(opts, across, empty, parted)


@contextlib.contextmanager
def batch_scope(opts: Options, coupled: Optional["WholeBatch"], sync_reachable: bool) -> Iterator[None]:
    """Where func runs in ``mode="batched"`` or ``"loop"``, at every P: under ``coupled`` (:func:`whole_batch`), and,
    where func may reach a ``torch.nn.SyncBatchNorm`` (``sync_reachable``), refusing it in training mode: it would
    synchronise over its own process group, outside cmap. The refusal is a global forward pre-hook while func runs
    (the module may be anywhere func reaches), which puts every module call on torch's slower hook path, so it is
    registered only where such a module was found."""
    if opts.mode.under_vmap or not (coupled or sync_reachable):
        yield
        return
    hook = register_module_forward_pre_hook(functools.partial(_refuse_sync, opts.call)) if sync_reachable else None
    try:
        with coupled or contextlib.nullcontext():
            yield
    finally:
        if hook is not None:
            hook.remove()


def _refuse_sync(call: str, module: nn.Module, args: Any) -> None:
    if isinstance(module, nn.SyncBatchNorm) and module.training:
        raise ValueError(
            f"{call}: func runs torch.nn.SyncBatchNorm in training mode, which synchronises over its own process "
            f"group, outside cmap (an empty share's stand-in example would count, and its collectives would pair "
            f"with nothing on the other ranks). Use torch.nn.BatchNorm1d/2d/3d: with mode='batched', cmap takes "
            f"their statistics over the whole batch across its group."
        )


class WholeBatch:
    """While func runs: ``F.batch_norm(training=True)`` over the whole batch across the group (see the module), and
    in ``mode="batched"`` a loss's mean too (:mod:`.losses`), the losses it made noted for the exit.

    Attributes:
        opts: the call's options (its name and mode, for the refusals).
        link: where the statistics are summed; None in a world of one.
        empty: this rank's share is empty: its stand-in example contributes nothing.
        parted: func runs on part of the rows at a time (``chunk_size``, ``randomness="per_example"``).
    """

    def __init__(self, opts: Options, link: Optional[Link], empty: bool, parted: bool) -> None:
        self.opts, self.link, self.empty, self.parted = opts, link, empty, parted
        self.level = current_level()  # a transform func opens itself keeps torch's rules
        # the whole batch's losses it returned, weakly: a checkpoint's replay holds the mode from the graph
        self.losses: List[weakref.ref] = []

    def made_here(self, value: Any) -> bool:
        """Whether ``value`` is a loss over the whole batch this mode returned: equal on every rank."""
        return any(r() is value for r in self.losses)

    def __enter__(self) -> "WholeBatch":
        _catch(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _release()

    def handle(self, func: Callable, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
        """A call of one of the caught functions (torch's own ``func``) while func runs under this mode."""
        if func in losses.MEAN_LOSSES:
            return self._loss(func, args, kwargs)
        bound = _SIGNATURE.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        x = a["input"]
        if not a["training"] or current_level() != self.level:
            return func(*args, **kwargs)
        tracked = a["running_mean"] is not None or a["running_var"] is not None
        if self.opts.mode.in_turns:
            if tracked:
                raise RuntimeError(_loop_refusal(self.opts.call))
            return func(*args, **kwargs)  # a per-example call's own statistics, as in one process
        if self.parted:
            raise ValueError(_parted_refusal(self.opts))
        if self.link is None or x.dim() < 2 or not x.is_floating_point():
            return func(*args, **kwargs)
        return self._normalise(func, args, kwargs, a)

    def _loss(self, func: Callable, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
        if not self.opts.mode.holds_rows or self.parted or current_level() != self.level:
            return func(*args, **kwargs)
        a = losses.arguments(_LOSS_SIGNATURES[func], args, kwargs)
        if losses.reduction_of(a) != "mean" or not losses.batched(func, a["input"]):
            return func(*args, **kwargs)
        loss = losses.whole_mean(func, a, self.link, self.empty)
        self.losses.append(weakref.ref(loss))
        return loss

    def _normalise(self, func: Callable, args: Sequence[Any], kwargs: Dict[str, Any], a: Dict[str, Any]) -> Any:
        x, eps, momentum = a["input"], a["eps"], a["momentum"]
        channels = x.shape[1]
        dims = [0, *range(2, x.dim())]
        shape = (1, channels) + (1,) * (x.dim() - 2)
        acc = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
        mine = acc.narrow(0, 0, 0) if self.empty else acc  # a stand-in's rows: through the graph, no values
        count = mine.numel() // channels if channels else 0
        local = torch.cat([mine.sum(dims), mine.square().sum(dims)])
        learned = Learned()
        spec = JoinSpec(self.link, (COPY,), WHAT, Kind.OP, count=count, learned=learned)
        (total,) = join(spec, [local])
        (total,) = split(SplitSpec(self.link, (COPY,)), [total])  # backward: the cotangents summed over the group
        n = sum(h.rows for h in learned.table)
        if n == 0:  # every rank's input is empty: what one process does with it
            return func(*args, **kwargs)
        if n == 1:
            size = torch.Size([n // (math.prod(x.shape[2:]) or 1), channels, *x.shape[2:]])  # the whole input's
            raise ValueError(f"Expected more than 1 value per channel when training, got input size {size}")
        mean = total[:channels] / n
        var = (total[channels:] / n - mean.square()).clamp_min(0)
        out = (acc - mean.view(shape)) * torch.rsqrt(var + eps).view(shape)
        if a["weight"] is not None:
            out = out * a["weight"].view(shape)
        if a["bias"] is not None:
            out = out + a["bias"].view(shape)
        _update(a["running_mean"], mean, momentum)
        _update(a["running_var"], var * (n / (n - 1)), momentum)  # unbiased over the global count, as torch's
        return out.to(x.dtype)


# Where a mode is active: each thread's modes (loop mode's example threads enter it too), and whether a caught call
# is being handled (what the handling calls is torch's own).
_here = threading.local()
_installed = 0
_install_lock = threading.Lock()


def _catch(mode: WholeBatch) -> None:
    """Enter ``mode`` in this thread; the first mode anywhere puts the catching functions in torch.nn.functional.

    Catching the few functions by name, rather than every torch call through a ``TorchFunctionMode``, keeps every
    other op on torch's fast path (a mode costs a Python call per op: about 1.6x a small model's forward). What is
    caught is what ``nn.BatchNorm*``, ``nn.*Loss`` and transformers call: ``F.batch_norm``, ``F.cross_entropy``,
    ... looked up on the module when called."""
    global _installed
    _here.__dict__.setdefault("modes", []).append(mode)
    with _install_lock:
        if _installed == 0:
            for name, original in _CAUGHT.items():
                setattr(F, name, _catching(original))
        _installed += 1


def _release() -> None:
    global _installed
    _here.modes.pop()
    with _install_lock:
        _installed -= 1
        if _installed == 0:
            for name, original in _CAUGHT.items():
                setattr(F, name, original)


def _catching(original: Callable) -> Callable:
    @functools.wraps(original)
    def caught(*args: Any, **kwargs: Any) -> Any:
        modes = getattr(_here, "modes", None)
        if not modes or getattr(_here, "handling", False):  # another thread's call, or the handling's own
            return original(*args, **kwargs)
        _here.handling = True
        try:
            return modes[-1].handle(original, args, kwargs)
        finally:
            _here.handling = False

    return caught


def _update(running: Optional[torch.Tensor], value: torch.Tensor, momentum: float) -> None:
    """The running statistic moved towards ``value`` by ``momentum`` (the module gives 1/n for a cumulative one)."""
    if running is None:
        return
    with torch.no_grad():
        running.mul_(1 - momentum).add_(value.detach().to(running.dtype), alpha=momentum)


def _loop_refusal(call: str) -> str:
    return (
        f"{call}: mode='loop' calls func once per example, and a BatchNorm in training mode there would update its "
        f"running statistics once per example, each rank with its own examples (torch.vmap refuses it too). Use "
        f"mode='batched' to call func on the batch (cmap takes the statistics over the whole batch across the "
        f"group), or stop tracking running statistics (track_running_stats=False, or "
        f"torch.func.replace_all_batch_norm_modules_(model)) to normalise each call alone."
    )


def _parted_refusal(opts: Options) -> str:
    if opts.randomness.per_example:
        part, fix = "randomness='per_example' calls func on each example alone", "another randomness"
    else:
        part, fix = f"chunk_size={opts.chunk_size} calls func on chunks of the batch", "chunk_size=None"
    return (
        f"{opts.call}: mode='batched' with a BatchNorm in training mode: {part}, but BatchNorm's statistics are "
        f"over the whole batch. Use {fix} (the rows are then one call of func, as at any group size), or put the "
        f"BatchNorm in eval mode."
    )
