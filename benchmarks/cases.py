"""The benchmark cases: each one declared once, as a named record in :data:`CASES` (adding a case is one edit).

The per-example functions live here too; the overhead profile counts time in this file as time inside
``torch.vmap(func)`` (see ``attribution.py``).
"""

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from benchmarks.goals import GOAL_SMALL

Inputs = Tuple[torch.Tensor, ...]


def elementwise(x: torch.Tensor) -> torch.Tensor:
    """An elementwise per-example function."""
    return torch.sin(x) + x


def mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """A per-example 2-layer MLP (weights shared by every example, ``in_dims=(0, None, None)``)."""
    return torch.relu(x @ w1) @ w2


@dataclass(frozen=True)
class Case:
    """One benchmark case: its function and in_dims, how to build its full inputs (the same on every rank), and what
    the suite measures for it.

    Attributes:
        name: case name in the tables.
        description: what the case computes, for the report.
        batch: B, the mapped batch size.
        func: the per-example function.
        in_dims: vmap in_dims.
        make_inputs: builds the full inputs from a seeded generator, drawing in a fixed order.
        inner: calls per timed block.
        reps: timed repetitions (blocks per variant), before ``--reps-scale``.
        small_goal: the goal (cmap / baseline) below 1 MiB of output; from 1 MiB every case has the goal of its size
            (``goals.goal_for``: 1.1x, from 4 MiB 1.05x).
        in_p1: also run in a world of one process, where cmap's own software overhead shows.
        memory: measure peak memory for the ``dst`` choices.
        profile_calls: profile where cmap's overhead goes, over this many calls (full run, ``--quick``); None: not
            profiled.
        extras: extra variants timed for this case only (see ``timing.py``).
    """

    name: str
    description: str
    batch: int
    func: Callable
    in_dims: Any
    make_inputs: Callable[[torch.Generator], Inputs]
    inner: int
    reps: int
    small_goal: Optional[float] = None
    in_p1: bool = False
    memory: bool = False
    profile_calls: Optional[Tuple[int, int]] = None
    extras: Tuple[str, ...] = ()

    def inputs(self) -> Inputs:
        """The full inputs, seeded so that every rank builds the same tensors."""
        return self.make_inputs(torch.Generator().manual_seed(1234))


def _mlp_inputs(g: torch.Generator) -> Inputs:
    x = torch.randn(4096, 512, generator=g)
    return x, torch.randn(512, 512, generator=g) / 512**0.5, torch.randn(512, 512, generator=g) / 512**0.5


CASES: Tuple[Case, ...] = (
    Case(
        "tiny", "torch.dot, B=8, D=4", 8, torch.dot, 0,
        lambda g: (torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)),
        inner=20, reps=40, small_goal=GOAL_SMALL, in_p1=True, profile_calls=(200, 20),
    ),
    Case(
        "medium", "sin(x)+x, B=256, D=256", 256, elementwise, 0,
        lambda g: (torch.randn(256, 256, generator=g),),
        inner=8, reps=30, small_goal=GOAL_SMALL, in_p1=True,
    ),
    Case(
        "1mib", "sin(x)+x, B=1024, D=256 (1 MiB out)", 1024, elementwise, 0,
        lambda g: (torch.randn(1024, 256, generator=g),),
        inner=8, reps=30,
    ),
    Case(
        "large", "sin(x)+x, B=4096, D=4096 (64 MiB out)", 4096, elementwise, 0,
        lambda g: (torch.randn(4096, 4096, generator=g),),
        inner=1, reps=15, memory=True, profile_calls=(2, 2),
    ),
    Case(
        "mlp", "relu(x@W1)@W2, 512 wide, B=4096", 4096, mlp, (0, None, None),
        _mlp_inputs,
        inner=2, reps=20, memory=True,
    ),
    Case(
        "uneven", "sin(x)+x, B=4097, D=256", 4097, elementwise, 0,
        lambda g: (torch.randn(4097, 256, generator=g),),
        inner=4, reps=30, in_p1=True, memory=True, profile_calls=(10, 3), extras=("baseline_ceil_plan",),
    ),
)  # fmt: skip
BY_NAME: Dict[str, Case] = {case.name: case for case in CASES}
