"""A cmap's options, checked once when the cmap is made; the checks that need a group run per call.

``mode`` and ``randomness`` are parsed here, once, from the strings users write into their objects (the run modes of
:mod:`.execute` and the choices of :mod:`.randomness`, which ``cmap()`` hands in), which everything after asks what
they do. The record imports neither: it sits below every step that reads it, :mod:`.execute` included.
"""

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, NamedTuple, Optional, Sequence, Tuple, Union

from ..axis.modes import AxisMode

Endpoint = Union[int, str, None]  # dst or src: a group rank, "local", or None (src only)


@dataclass(frozen=True, eq=False)
class Options:
    """Everything ``cmap(func, ...)`` was given besides ``func``, plus the call's name for error messages."""

    in_dims: Any
    out_dims: Any
    group: Any
    dst: Endpoint
    src: Endpoint
    randomness: Any  # a randomness.Randomness
    chunk_size: Optional[int]
    mode: Any  # an execute.RunMode
    axis_name: Optional[str]
    timeout: Optional[float]
    check_inputs: bool
    kwarg_dims: Any
    call: str
    axis_mode: AxisMode  # the mode of the call's axis frame: ``randomness="per_example"`` runs collectives one
    # example at a time, as loop mode

    @property
    def gathers(self) -> bool:
        """Whether the results are gathered (so shares follow ``torch.chunk``'s split, which gathers without a copy)."""
        return self.dst != "local"

    @cached_property
    def places_outputs(self) -> bool:
        """Whether ``out_dims`` holds a None or an int other than 0 (then cmap places vmap's outputs itself)."""
        return _places(self.out_dims)

    @cached_property
    def alone_as_vmap(self) -> bool:
        """Whether a call that runs alone (no rank to exchange with) takes no step around func but its ``torch.vmap``:
        no axis frame, forked generator, placed outputs, refused gradient or per-call checks of the mode."""
        return (
            self.mode.under_vmap
            and self.axis_name is None
            and not self.randomness.forks
            and not self.places_outputs
            and not self.refuses_grad
        )

    @cached_property  # read several times per call: the options are frozen
    def refuses_grad(self) -> bool:
        """Whether the output is not differentiable: with ``dst=r`` only one rank holds it (no backward could meet on
        every rank), and with ``src=r`` the inputs were copied from one rank."""
        return isinstance(self.src, int) or (isinstance(self.dst, int) and self.dst != -1)

    @cached_property  # read several times per call: the options are frozen
    def differentiable(self) -> bool:
        """Whether gradients cross ranks: every rank holds its result (the whole one, or its share's with
        ``dst="local"``), so backward meets on every rank, and a value every rank holds whole gets its total
        derivative on every rank."""
        return not self.refuses_grad


def _places(out_dims: Any) -> bool:
    if isinstance(out_dims, (tuple, list)):
        return any(_places(d) for d in out_dims)
    if isinstance(out_dims, dict):
        return any(_places(d) for d in out_dims.values())
    return out_dims != 0


class Choices(NamedTuple):
    """What ``mode`` and ``randomness`` may name: :data:`.execute.CHOICES` and :data:`.randomness.CHOICES`."""

    modes: Tuple[AxisMode, ...]
    randomness: Tuple[Any, ...]


def make_options(func: Callable, choices: Choices, **kwargs: Any) -> Options:
    """Check the options that need no group, identically on every rank; raises ValueError or TypeError."""
    call = call_name(func, kwargs["in_dims"])
    check_in_dims_type(call, kwargs["in_dims"])
    check_kwarg_dims(call, kwargs["kwarg_dims"])
    mode = _parse(call, "mode", kwargs["mode"], choices.modes)
    chosen = _parse(call, "randomness", kwargs["randomness"], choices.randomness)
    in_turns = next(m for m in choices.modes if m.in_turns)
    axis_mode = in_turns if chosen.per_example else mode
    opts = Options(call=call, axis_mode=axis_mode, **{**kwargs, "mode": mode, "randomness": chosen})
    size = opts.chunk_size
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
        raise ValueError(f"{call}: vmap: chunk_size should be None or greater than 0. (got {size!r})")
    check_placement(call, "dst", opts.dst, None, (-1, "local"))
    check_placement(call, "src", opts.src, None, (None, "local"))
    if opts.axis_name is not None and not isinstance(opts.axis_name, str):
        raise TypeError(f"{call}: axis_name must be a str or None, got {type(opts.axis_name).__name__}.")
    if opts.axis_name is not None and size is not None:
        raise ValueError(
            f"{call}: chunk_size cannot be combined with axis_name: a collective such as psum needs every example of "
            f"the shard at once, but chunks run one after another."
        )
    if opts.timeout is not None and not (isinstance(opts.timeout, (int, float)) and opts.timeout > 0):
        raise ValueError(f"{call}: timeout must be a positive number of seconds, got {opts.timeout!r}.")
    return opts


def _parse(call: str, option: str, value: Any, choices: Tuple[Any, ...]) -> Any:
    """The choice named ``value`` (a string users write, as ``mode="batched"``); a ValueError naming the choices."""
    names = tuple(c.name for c in choices)
    if value not in names:
        raise ValueError(f"{call}: unknown {option}={value!r}; expected one of {', '.join(map(repr, names))}.")
    return choices[names.index(value)]


def call_name(func: Callable, in_dims: Any) -> str:
    """The ``cmap(f, in_dims=...)`` prefix every error message starts with."""
    name = getattr(func, "__name__", None) or type(func).__name__
    return f"cmap({name}, in_dims={in_dims!r})"


def check_in_dims_type(call: str, in_dims: Any) -> None:
    if in_dims is None or isinstance(in_dims, (int, tuple)):
        return
    raise ValueError(
        f"{call}: expected `in_dims` to be int or a (potentially nested) tuple matching the structure of inputs, got: {type(in_dims)}."
    )


def check_kwarg_dims(call: str, kwarg_dims: Any) -> None:
    """``kwarg_dims``: None (keywords passed whole, as vmap), an int, or a dict from keyword names to dims."""
    if kwarg_dims is None or (isinstance(kwarg_dims, int) and not isinstance(kwarg_dims, bool)):
        return
    if isinstance(kwarg_dims, dict) and all(isinstance(k, str) for k in kwarg_dims):
        return
    raise ValueError(
        f"{call}: expected `kwarg_dims` to be None (keyword arguments passed whole, as in torch.vmap), an int (every "
        f"keyword's tensors mapped at that dim, as jax.vmap maps keyword arguments at 0) or a dict from keyword "
        f"names to an in_dims-like prefix of the keyword's value, or None; got {kwarg_dims!r}."
    )


def check_placement(call: str, name: str, value: Any, size: Optional[int], allowed: Sequence[Any]) -> None:
    """``dst``/``src``: one of ``allowed`` or a group rank in ``[0, size)`` (any rank >= 0 when size is unknown)."""
    if value in allowed and not isinstance(value, bool):
        return
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value and (size is None or value < size):
        return
    choices = ", ".join(repr(a) for a in allowed)
    where = "" if size is None else f" for a group of size {size}"
    ranks = "a group rank >= 0" if size is None else f"a group rank in [0, {size})"
    raise ValueError(f"{call}: {name}={value!r} is not valid{where}; expected {choices} or {ranks}.")
