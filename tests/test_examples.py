"""Every script in ``examples/`` runs its ``main()`` on a real gloo world and reports success on every rank.

Each example checks itself against single-process ``torch.vmap`` (the tensor-parallel one against the unsharded
model) and raises on a mismatch, so these tests only need every rank to return True. The examples are the ones
``colossalai run --nproc_per_node 2`` runs by hand.
"""

import importlib
import sys
from pathlib import Path

import pytest

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"
EXAMPLES = [
    "quickstart",
    "batch_dot",
    "model",
    "dot_dst0",
    "vjp_jacobian",
    "per_sample_grads",
    "train_step",
    "maml",
    "tensor_parallel_llama",
    "tp_sequence_parallel",
]


def run_example(name: str) -> bool:
    """Runs in every worker: import ``examples/<name>.py`` and call its ``main()`` (dist is already initialised)."""
    if str(EXAMPLES_DIR) not in sys.path:
        sys.path.insert(0, str(EXAMPLES_DIR))
    return importlib.import_module(name).main()


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_on_two_ranks(worlds, name):
    assert worlds(2).run(run_example, name) == [True, True]


def test_quickstart_on_three_ranks(worlds):
    assert worlds(3).run(run_example, "quickstart") == [True, True, True]
