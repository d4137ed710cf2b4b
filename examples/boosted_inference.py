"""Evaluate a boosted model with cmap: every prediction reaches rank 0 exactly once, in dataset order.

Run it with the colossalai launcher (or torchrun)::

    colossalai run --nproc_per_node 2 examples/boosted_inference.py
    colossalai run --nproc_per_node 4 examples/boosted_inference.py --tp 2   # also try HybridParallelPlugin(tp_size=2)

The usual recipe shards the dataset with a ``DistributedSampler``, which pads the last round with repeated examples
so every rank gets the same count, and then needs ``accelerate.gather_for_metrics``-style trimming. Here every rank
iterates the same (cheap, synthetic) batches and ``cmap(model, mode="batched", dst=0)`` splits each batch over the
booster's data-parallel group, runs the forward once per shard and gathers the rows to rank 0: uneven shards are
handled inside cmap, so nothing is padded or duplicated and there is nothing to trim.
"""

import argparse
import copy
import math
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

# Examples, features and classes of the synthetic dataset; 37 makes the last batch and its shards uneven.
N_EXAMPLES, N_FEATURES, N_CLASSES, BATCH = 37, 16, 5, 8
# A plugin whose boost failed, kept until exit: torch 2.5.1's gloo group joins its worker threads in its destructor
# with the GIL held, and dropping the plugin's groups right after their last collective hung a rank once.
_FAILED_PLUGINS: List[Any] = []


class MLP(nn.Module):
    """A small classifier without buffers (DDP's forward would broadcast buffers: a collective per call)."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(N_FEATURES, hidden)
        self.fc2 = nn.Linear(hidden, N_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def forward_tolerance(model: MLP, x: torch.Tensor) -> float:
    """How far two float32 forwards of ``model`` on ``x`` can be apart when their matmuls add in other orders
    (another number of rows, a tensor-parallel split). A sum of n terms in any order is within
    gamma_n * sum|terms| of the exact one (gamma_n = n u / (1 - n u), u = eps / 2): fc1's outputs move by at most
    d = 2 gamma * (|x| |W1|^T + |b1|) (ReLU only shrinks that), the logits by d |W2|^T plus their own
    2 gamma * (|h| |W2|^T + |b2|)."""
    u = torch.finfo(torch.float32).eps / 2

    def two_gamma(n: int) -> float:
        return 2 * n * u / (1 - n * u)

    w1, b1 = model.fc1.weight.detach().double(), model.fc1.bias.detach().double()
    w2, b2 = model.fc2.weight.detach().double(), model.fc2.bias.detach().double()
    x = x.double()
    d = two_gamma(w1.shape[1] + 1) * (x.abs() @ w1.abs().T + b1.abs())
    h = torch.relu(x @ w1.T + b1)
    return float((d @ w2.abs().T + two_gamma(w2.shape[1] + 1) * (h @ w2.abs().T + b2.abs())).max())


def synthetic_dataset(n: int = N_EXAMPLES) -> torch.utils.data.TensorDataset:
    """The same features on every rank, from a fixed generator (no global RNG state involved)."""
    g = torch.Generator().manual_seed(2024)
    return torch.utils.data.TensorDataset(torch.randn(n, N_FEATURES, generator=g))


def evaluate(model: Any, booster: Any, dataset: torch.utils.data.Dataset) -> Optional[torch.Tensor]:
    """Logits for every example of ``dataset`` on rank 0 (None elsewhere), computed across the data-parallel group."""
    from colossalai import cmap

    predict = cmap(model, mode="batched", dst=0, group=booster)
    outputs: List[torch.Tensor] = []
    with torch.no_grad():
        for (x,) in torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=False):
            logits = predict(x)  # None on every rank but group rank 0
            if logits is not None:
                outputs.append(logits)
    return torch.cat(outputs) if outputs else None


def predictions_and_reference(
    model: Any, booster: Any, reference: nn.Module
) -> Optional[Tuple[torch.Tensor, torch.Tensor, int]]:
    """Rank 0: cmap's predictions, the one-process forward of ``reference``, and the dataset size (else None)."""
    model.eval()
    dataset = synthetic_dataset()
    preds = evaluate(model, booster, dataset)
    if preds is None:
        return None
    with torch.no_grad():
        expected = reference(dataset.tensors[0])
    return preds, expected, len(dataset)


def close_to(preds: torch.Tensor, expected: torch.Tensor, reference: nn.Module) -> bool:
    """Same shape, and within what other summation orders can change (cmap runs shards of each batch)."""
    atol = forward_tolerance(reference, synthetic_dataset().tensors[0])
    return preds.shape == expected.shape and torch.allclose(preds, expected, rtol=1.3e-6, atol=atol)


def ddp_inference() -> Optional[Dict[str, Any]]:
    """TorchDDPPlugin: boost, evaluate with cmap, and check rank 0's predictions against a one-process forward."""
    from colossalai.booster import Booster
    from colossalai.booster.plugin import TorchDDPPlugin

    torch.manual_seed(0)  # the same initial weights on every rank
    reference = MLP()
    booster = Booster(plugin=TorchDDPPlugin())
    model, *_ = booster.boost(copy.deepcopy(reference))
    found = predictions_and_reference(model, booster, reference)
    if found is None:
        return None
    preds, expected, examples = found
    world = dist.get_world_size()
    padded = math.ceil(examples / world) * world  # what DistributedSampler + gather would return
    result = {
        "plugin": "TorchDDPPlugin",
        "world": world,
        "examples": examples,
        "predictions": int(preds.shape[0]),
        "sampler_rows": padded,
        "max_abs_diff": float((preds - expected).abs().max()) if len(preds) else 0.0,
        "ok": close_to(preds, expected, reference),
    }
    print(
        f"[TorchDDPPlugin] rank 0 has {result['predictions']} predictions for {result['examples']} examples "
        f"(a DistributedSampler would give {padded} rows); max |diff| vs one-process forward = "
        f"{result['max_abs_diff']:.2e}: {'OK' if result['ok'] else 'MISMATCH'}",
        flush=True,
    )
    return result


def _mlp_policy() -> Any:
    """A shardformer policy for MLP: fc1 column-parallel, fc2 row-parallel (Megatron-style)."""
    from colossalai.shardformer.layer import Linear1D_Col, Linear1D_Row
    from colossalai.shardformer.policies.base_policy import (
        ModulePolicyDescription,
        Policy,
        SubModuleReplacementDescription,
    )

    class MLPPolicy(Policy):
        def config_sanity_check(self) -> None:
            pass

        def preprocess(self) -> nn.Module:
            return self.model

        def postprocess(self) -> nn.Module:
            return self.model

        def module_policy(self) -> Dict[Any, ModulePolicyDescription]:
            return {
                MLP: ModulePolicyDescription(
                    sub_module_replacement=[
                        SubModuleReplacementDescription("fc1", Linear1D_Col),
                        SubModuleReplacementDescription("fc2", Linear1D_Row),
                    ]
                )
            }

        def get_held_layers(self) -> List[nn.Module]:
            return [self.model]

        def get_shared_params(self) -> List[Dict[int, torch.Tensor]]:
            return []

    return MLPPolicy()


def hybrid_inference(tp_size: int = 2) -> Optional[Dict[str, Any]]:
    """HybridParallelPlugin(tp_size): cmap splits over dp_group; both tp ranks of a replica run the same shard.

    On CPU colossalai 0.5.0 cannot build the tensor-parallel layers (its CpuAccelerator.get_rng_state passes a
    device to ``torch.get_rng_state``); that error is reported instead of raised, so the example still runs there.
    """
    from colossalai.accelerator import get_accelerator
    from colossalai.booster import Booster
    from colossalai.booster.plugin import HybridParallelPlugin

    torch.manual_seed(0)
    reference = MLP()
    plugin = HybridParallelPlugin(tp_size=tp_size, pp_size=1, precision="fp32", custom_policy=_mlp_policy())
    booster = Booster(plugin=plugin)
    result: Dict[str, Any] = {"plugin": f"HybridParallelPlugin(tp_size={tp_size})", "world": dist.get_world_size()}
    try:
        model, *_ = booster.boost(copy.deepcopy(reference))
    except RuntimeError as exc:
        if get_accelerator().name != "cpu":
            raise
        result.update(ok=None, error=str(exc))
        _FAILED_PLUGINS.append(plugin)
        if dist.get_rank() == 0:
            print(f"[{result['plugin']}] did not run on CPU: {exc}", flush=True)
        return result
    found = predictions_and_reference(model, booster, reference)
    if found is None:
        return None
    preds, expected, _ = found
    result.update(
        predictions=int(preds.shape[0]),
        ok=close_to(preds, expected, reference),
    )
    if dist.get_rank() == 0:
        print(f"[{result['plugin']}] {result['predictions']} predictions: {'OK' if result['ok'] else 'MISMATCH'}")
    return result


def main(argv: Optional[List[str]] = None) -> Optional[Dict[str, Any]]:
    """Run the example; returns rank 0's results (None on the other ranks).

    Args:
        argv: command-line arguments (default: ``sys.argv``). ``--tp N`` also tries HybridParallelPlugin(tp_size=N).
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=0, help="also try HybridParallelPlugin with this tp_size")
    args = parser.parse_args(argv)
    if not dist.is_initialized():  # under `colossalai run` / torchrun; tests call main() in a running world
        import colossalai

        colossalai.launch_from_torch(verbose=False)
    results = {"ddp": ddp_inference()}
    if args.tp > 1:
        results["hybrid"] = hybrid_inference(args.tp)
    if dist.get_rank() != 0:
        return None
    ok = results["ddp"]["ok"] and (args.tp <= 1 or results["hybrid"]["ok"] is not False)
    print(f"boosted_inference: {'PASSED' if ok else 'FAILED'}", flush=True)
    return results


if __name__ == "__main__":
    main()
