"""What ``randomness="per_example"`` costs against ``"different"``, timed in one run per group size on gloo worlds.

    python -m benchmarks.randomness [--worlds 1 2 4] [--batch 64] [--quick]

"per_example" runs every example alone, under its own generator state (seeded from one draw and its global index),
so that its draws do not depend on P; "different" runs the rank's share in one ``torch.vmap``. Cases:

* ``tiny op``: ``v + torch.rand(())`` on rows of 8 floats, forward only: the per-example overhead laid bare.
* ``noisy MLP``: 32 -> 64 -> 8 with dropout after the hidden layer, forward and backward (weights passed with
  ``in_dims=None``).

It prints, per group size and case, the median time per call (max over ranks) of each mode, and per_example's ratio
to "different" (of the medians, and the range of the repetitions' own ratios: the modes are interleaved).
``--quick`` is a smoke test (3 repetitions of 2 calls).
"""

import argparse
import statistics
from typing import Callable, Dict, List, Optional, Sequence

import torch

import colossalai_cmap as cm
from benchmarks import world
from benchmarks.compile import timed

MODES = ("different", "per_example")


def _cases(batch: int) -> Dict[str, Callable[[str], Callable[[], None]]]:
    """Each case: for a randomness mode, one call (the same inputs on every rank, seeded alike)."""
    g = torch.Generator().manual_seed(0)
    x8 = torch.randn(batch, 8, generator=g)
    x32 = torch.randn(batch, 32, generator=g)
    w1 = (torch.randn(32, 64, generator=g) / 6).requires_grad_()
    w2 = (torch.randn(64, 8, generator=g) / 8).requires_grad_()

    def mlp(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(torch.tanh(x @ a), 0.1) @ b

    def tiny(randomness: str) -> Callable[[], None]:
        f = cm.cmap(lambda v: v + torch.rand(()), randomness=randomness)
        return lambda: f(x8)

    def noisy_mlp(randomness: str) -> Callable[[], None]:
        f = cm.cmap(mlp, in_dims=(0, None, None), randomness=randomness)

        def step() -> None:
            f(x32, w1, w2).square().sum().backward()
            w1.grad = w2.grad = None

        return step

    return {"tiny op": tiny, "noisy MLP": noisy_mlp}


def measure(args: argparse.Namespace) -> Dict[str, Dict[str, List[float]]]:
    """Every rank: time both modes per case, interleaved; returns rank 0's times (seconds per call)."""
    torch.manual_seed(0)
    out: Dict[str, Dict[str, List[float]]] = {}
    for name, make in _cases(args.batch).items():
        steps = {mode: make(mode) for mode in MODES}
        for step in steps.values():
            step()  # warm up
        times: Dict[str, List[float]] = {mode: [] for mode in MODES}
        for rep in range(args.reps):
            for k in range(len(MODES)):  # the starting mode alternates
                mode = MODES[(rep + k) % len(MODES)]
                times[mode].append(timed(steps[mode], args.inner))
        out[name] = times
    return out


def report(size: int, batch: int, times: Dict[str, Dict[str, List[float]]]) -> None:
    print(f"world {size}, global batch {batch}")
    print(f"{'case':<12}{'different us':>14}{'per_example us':>16}{'ratio':>8}{'ratio range':>14}")
    for name, by_mode in times.items():
        base, mine = by_mode["different"], by_mode["per_example"]
        ratios = [m / b for m, b in zip(mine, base)]
        ratio = statistics.median(mine) / statistics.median(base)
        print(
            f"{name:<12}{statistics.median(base) * 1e6:>14.0f}{statistics.median(mine) * 1e6:>16.0f}"
            f"{ratio:>8.2f}{f'{min(ratios):.2f}-{max(ratios):.2f}':>14}"
        )


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Parse the command line and time each group size on a fresh gloo world."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.randomness", description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--inner", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="smoke test: 3 repetitions of 2 calls")
    args = parser.parse_args(argv)
    if args.quick:
        args.reps, args.inner = 3, 2
    print("randomness='per_example' against 'different' (median time per call, max over ranks)")
    for size in args.worlds:
        report(size, args.batch, world.spawn(measure, size, (args,))[0])


if __name__ == "__main__":
    main()
