"""The motivating example on cmap: a ``Linear(64, 24)`` sharded by its input features across the group.

    colossalai run --nproc_per_node 4 examples/sharded_linear.py
    colossalai run --nproc_per_node 3 examples/sharded_linear.py    # 64 features do not divide by 3

A Linear is a sum over its input features, so sharding its weight by input features makes it a cmap over that
axis. Part 1 writes the cmap out: each rank holds its ``torch.tensor_split`` slice of the weight's columns, cmap
runs in "batched" mode over those features, each rank multiplies the same columns of the input by its slice, and
``psum`` adds the partial products over the whole axis: one value every rank shares, returned once
(``out_dims=None``). Part 2 lets ``shard_linears_fx`` find the layer with torch.fx and do the same rewrite.

Part 3 gives every rank its own model and its own input (one example per rank: each rank seeds its generator
differently), and splits the work by input features. One ``all_to_all`` shards the weights once; in each forward,
an ``all_to_all`` hands rank r feature chunk r of every rank's input, each rank multiplies that chunk by the same
chunk of every rank's weight, and ``psum`` adds the chunks: rank q's row of the sum is rank q's whole product (an
``all_reduce``, then a ``narrow`` to this rank's row; ``psum_scatter`` does both at once). Features that do not
divide by the world size are padded with zero features, which add nothing.

Part 4 writes the same layer with ``shard_map``, jax's per-rank style: the function runs once per rank on its
blocks of the global input, weight and bias, and its result is the global output. The input comes in sharded by
rows (the batch), an ``all_to_all`` reshards it by input features, each rank multiplies its features by its
columns of the weight, and ``psum`` adds the partial products. The features need not divide by the world size:
the all_to_all's chunks are the weight's ``torch.tensor_split`` blocks (jax requires division). The rows must make
equal blocks (96 rows do at 3 and 4 ranks): every rank's input to an all_to_all has the same shape, as in jax.

Written with cmap, nothing needs ``batch_size``, the features need not divide by the world size, and each rank
holds only its slice of the weight. Parts 1, 2 and 4 build the same model and input on every rank (a
tensor-parallel layer computes one model's output together); part 3 gives each rank its own.
"""

from functools import partial
from typing import NamedTuple

import colossalai
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import colossalai_cmap as cm
from colossalai_cmap import P

AXIS = "in_features"


def print_with_rank(rank: int, msg: str) -> None:
    print("[RANK {}] {}".format(rank, msg))


def sum_tolerance(n: int, scale: torch.Tensor) -> float:
    """How far two float32 evaluations of sums of ``n`` terms can be apart when they add the terms in other orders
    (per-rank partial sums, another BLAS blocking): each is within n u / (1 - n u) * sum|terms| of the exact sum
    (u = eps / 2), so they differ by at most twice that. ``scale`` holds sum|terms| per result."""
    u = torch.finfo(torch.float32).eps / 2
    return 2 * n * u / (1 - n * u) * float(scale.max())


class Tolerances(NamedTuple):
    """Absolute tolerances for a sharded Linear's output y and for the gradients of y.square().sum()."""

    out: float
    weight: float
    bias: float
    input: float


def linear_tolerances(model: torch.nn.Linear, input: torch.Tensor) -> Tolerances:
    """Tolerances for the sharded Linear's output and for the gradients of output.square().sum().

    An output is a sum of in_features + 1 terms (the bias too). The weight's gradient 2 y^T x sums the batch's rows,
    and each term moves with y; the bias's gradient 2 y.sum(0) likewise; the input's gradient 2 y W sums the
    output features."""
    x, w, b = input.detach().abs(), model.weight.detach().abs(), model.bias.detach().abs()
    y = model(input).detach().abs()
    out = sum_tolerance(w.shape[1] + 1, x @ w.T + b)
    weight = sum_tolerance(len(x), 2 * y.T @ x) + 2 * out * float(x.sum(0).max())
    bias = sum_tolerance(len(x), 2 * y.sum(0)) + 2 * out * len(x)
    input_grad = sum_tolerance(w.shape[0], 2 * y @ w) + 2 * out * float(w.sum(0).max())
    return Tolerances(out, weight, bias, input_grad)


def param_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def partial_linear(weight_cols: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Batched over this rank's input features: ``weight_cols`` holds their weight columns, ``axis_index`` their
    global indices. Summing its own features first (one matmul) gives psum the same total, as a single row."""
    partial = F.linear(x.index_select(-1, cm.axis_index(AXIS)), weight_cols)
    return cm.psum(partial.unsqueeze(0), AXIS)[0]


def feature_chunks(t: torch.Tensor, world_size: int) -> torch.Tensor:
    """(..., features) as (..., world_size, chunk): zero features pad to a multiple of the world size."""
    chunk = -(-t.shape[-1] // world_size)
    return F.pad(t, (0, chunk * world_size - t.shape[-1])).unflatten(-1, (world_size, chunk))


def own_model_forward(weight_chunks: torch.Tensor, input: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """One rank's example: ``weight_chunks`` (out, P, chunk) holds feature chunk r of every rank's weight."""
    P = cm.axis_size("rank")
    mine = cm.all_to_all(feature_chunks(input, P), "rank", 1, 1)  # (batch, P, chunk): chunk r of each rank's input
    partial = torch.einsum("bqc,oqc->qbo", mine, weight_chunks)  # chunk r's share of every rank's product
    total = cm.psum(partial, "rank")  # the sum over chunks: every rank's product
    return total.index_select(0, cm.axis_index("rank").reshape(1))[0] + bias  # this rank's own row


def each_rank_its_own_model(rank: int, world_size: int) -> None:
    torch.manual_seed(rank)  # different weights and inputs on each rank
    model = torch.nn.Linear(64, 24)
    input = torch.rand(100, 64)
    result_without_sharding = model(input)
    atol, atol_weight, _, _ = linear_tolerances(model, input)

    # One example per rank (src="local", dst="local"): its leading dim of 1 is this rank's share of the axis.
    per_rank = dict(axis_name="rank", src="local", dst="local")
    weight = model.weight.detach().requires_grad_()
    shard = cm.cmap(lambda w: cm.all_to_all(feature_chunks(w, cm.axis_size("rank")), "rank", 1, 1), **per_rank)
    weight_chunks = shard(weight.unsqueeze(0))  # (1, out, P, chunk): feature chunk `rank` of every rank's weight
    forward = cm.cmap(own_model_forward, **per_rank)
    result = forward(weight_chunks, input.unsqueeze(0), model.bias.unsqueeze(0))[0]
    assert torch.allclose(result, result_without_sharding, atol=atol)

    # Gradients flow back through both all_to_alls and the psum to each rank's own weight.
    result.square().sum().backward()
    result_without_sharding.square().sum().backward()
    assert torch.allclose(weight.grad, model.weight.grad, atol=atol_weight)

    # psum_scatter: the sum and this rank's row of it in one collective (a reduce-scatter).
    def scattered(weight_chunks: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
        mine = cm.all_to_all(feature_chunks(input, cm.axis_size("rank")), "rank", 1, 1)
        return cm.psum_scatter(torch.einsum("bqc,oqc->qbo", mine, weight_chunks), "rank")

    result = cm.cmap(scattered, **per_rank)(weight_chunks.detach(), input.unsqueeze(0))[0] + model.bias
    assert torch.allclose(result, result_without_sharding, atol=atol)
    print_with_rank(rank, "each rank's own Linear, split by input features with all_to_all + psum: PASSED")


def linear_with_shard_map(rank: int, world_size: int) -> None:
    """Part 4: the Linear as one ``shard_map`` over a 1-d mesh of every rank."""
    torch.manual_seed(0)  # the same model and input on every rank
    model = torch.nn.Linear(64, 24)  # 64 input features: 16 per rank at 4 ranks, 22, 21, 21 at 3
    input = torch.rand(96, 64, requires_grad=True)  # 96 rows: equal row blocks at 3 and 4 ranks, as all_to_all needs
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))

    # in_specs: the input by rows, the weight (out, in) by input-feature columns, the bias whole; out_specs: whole.
    @partial(cm.shard_map, mesh=mesh, in_specs=(P("tp", None), P(None, "tp"), P()), out_specs=P())
    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = cm.all_to_all(x, "tp", split_axis=1, concat_axis=0, tiled=True)  # every row, this rank's features
        return cm.psum(x @ weight.T, "tp") + bias  # the partial products summed over the features' ranks

    result = linear(input, model.weight, model.bias)
    result_without_sharding = model(input)
    tol = linear_tolerances(model, input)
    assert torch.allclose(result, result_without_sharding, atol=tol.out)

    # Gradients flow back through the psum and the all_to_all to the global input, weight and bias, on every rank.
    wrt = (input, model.weight, model.bias)
    grads = torch.autograd.grad(result.square().sum(), wrt)
    expected = torch.autograd.grad(result_without_sharding.square().sum(), wrt)
    for got, want, atol in zip(grads, expected, (tol.input, tol.weight, tol.bias)):
        assert torch.allclose(got, want, atol=atol)
    print_with_rank(rank, "Linear as one shard_map (all_to_all + psum): PASSED")


def main() -> bool:
    if not dist.is_initialized():
        colossalai.launch_from_torch(verbose=False)
    rank, world_size = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # the same model and input on every rank
    batch_size = 100
    model = torch.nn.Linear(64, 24)
    input = torch.rand(batch_size, 64)
    result_without_sharding = model(input)
    # The ranks add the input features' products in partial sums: not bit for bit, within these bounds.
    atol, atol_weight, atol_bias, _ = linear_tolerances(model, input)

    # Part 1: the cmap itself. in_dims=(1, None): the weight's dim 1 (input features) is the mapped axis, passed
    # per rank (src="local"); the input is whole on every rank. out_dims=None: the psum is the same everywhere.
    weight_cols = model.weight.detach().tensor_split(world_size, dim=1)[rank].clone()
    sharded_matmul = cm.cmap(
        partial_linear, in_dims=(1, None), out_dims=None, src="local", mode="batched", axis_name=AXIS
    )
    result_by_hand = sharded_matmul(weight_cols, input) + model.bias  # the bias once, after the sum
    assert torch.allclose(result_by_hand, result_without_sharding, atol=atol)

    # Part 2: shard_linears_fx traces the model, keeps this rank's weight slice and rewrites F.linear into that cmap.
    traced_model = cm.shard_linears_fx(model)
    if rank == 0:
        print_with_rank(rank, "Trace After: {}".format(traced_model.code.strip()))
    result_with_sharding = traced_model(input)
    assert torch.allclose(result_with_sharding, result_without_sharding, atol=atol)

    # Gradients: the weight slice gets its slice of the full gradient; the (whole) bias gets the full one.
    result_with_sharding.square().sum().backward()
    result_without_sharding.square().sum().backward()
    layer = traced_model.weight_shard
    assert torch.allclose(layer.weight.grad, model.weight.grad.tensor_split(world_size, dim=1)[rank], atol=atol_weight)
    assert torch.allclose(layer.bias.grad, model.bias.grad, atol=atol_bias)

    print_with_rank(
        rank,
        "parameter bytes {} (weight slice {} + bias {}), unsharded {}".format(
            param_bytes(traced_model), tuple(layer.weight.shape), tuple(layer.bias.shape), param_bytes(model)
        ),
    )
    print_with_rank(rank, "PASSED")

    each_rank_its_own_model(rank, world_size)
    linear_with_shard_map(rank, world_size)
    return True


if __name__ == "__main__":
    main()
