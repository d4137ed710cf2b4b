"""Gradient checkpointing inside func at every group size, as users write it: ``torch.utils.checkpoint`` with
``use_reentrant`` True (the default of torch 2.5 and of transformers' ``gradient_checkpointing_enable()``) and False,
in cmap's batched and loop modes (vmap mode raises what ``torch.vmap`` raises), in ``shard_map`` and in
``shard_model``; and an exception raised in the recomputation on one rank, which every rank raises alike.

The oracle is the same code in one process without cmap: a model's own forward on the whole batch, or the
unsharded model; gradients and three AdamW steps of a tiny transformers Llama follow it.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from cases import F64, adam_drift_bound, assert_same, randn
from torch import nn
from torch.utils.checkpoint import checkpoint

import colossalai_cmap as cm
from colossalai_cmap import P, shard_map

WORLDS = [1, 2, 3]
REENTRANT = [True, False]
DEADLINE = 240
LR, STEPS = 1e-3, 3


def _blocks(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)).double()


def _grads(tensors):
    return [t.grad.clone() if t.grad is not None else None for t in tensors]


# ----------------------------------------------------------------------------------- torch.utils.checkpoint in f
def check_modes(reentrant: bool) -> bool:
    """A checkpointed block inside func (a module func names, and a tensor only the checkpointed function reads)
    in batched and loop modes, twice per cmap: outputs and every gradient are the model's own on the whole batch."""
    model, w = _blocks(), randn(4, seed=3, dtype=torch.float64).requires_grad_()
    x = randn(2 * dist.get_world_size() + 1, 4, seed=4, dtype=torch.float64)

    def inner(h):  # reads w itself: a reentrant checkpoint hides it from the graph until its recomputation
        return model[2](torch.tanh(h)) * w

    def f(v):
        return checkpoint(inner, model[0](v), use_reentrant=reentrant)

    xr = x.clone().requires_grad_()
    want = f(xr)
    want.square().sum().backward()
    expected = _grads([xr, w, *model.parameters()])
    for mode in ("batched", "loop"):
        mapped = cm.cmap(f, mode=mode)
        for call in range(2):  # the second call knows what the first found
            w.grad = None
            model.zero_grad()
            xc = x.clone().requires_grad_()
            out = mapped(xc)
            assert_same(out.detach(), want.detach(), F64, f"{mode} call {call}: values")
            out.square().sum().backward()
            assert_same(_grads([xc, w, *model.parameters()]), expected, F64, f"{mode} call {call}: gradients")
    return True


def check_collective_inside(reentrant: bool) -> bool:
    """A pmean inside the checkpointed block: its recomputation in backward runs it again over the group."""
    x, weight = randn(5, 4, seed=71, dtype=torch.float64), randn(4, 4, seed=72, dtype=torch.float64)

    def layer(rows, wt, mean):
        h = torch.tanh(rows @ wt)
        return h - mean(h)

    def per_rank(rows, wt):
        return checkpoint(layer, rows, wt, lambda h: cm.pmean(h, "i"), use_reentrant=reentrant)

    xr, wr = x.clone().requires_grad_(), weight.clone().requires_grad_()
    layer(xr, wr, lambda h: h.mean(0)).square().sum().backward()
    xc, wc = x.clone().requires_grad_(), weight.clone().requires_grad_()
    cm.cmap(per_rank, in_dims=(0, None), mode="batched", axis_name="i")(xc, wc).square().sum().backward()
    assert_same([xc.grad, wc.grad], [xr.grad, wr.grad], F64, "gradients")
    return True


def check_vmap_mode(reentrant: bool) -> str:
    """vmap mode: torch 2.5's vmap takes no checkpoint (its Functions have no vmap rule); cmap raises its error."""
    lin = nn.Linear(4, 4).double()

    def f(v):
        return checkpoint(lin, v, use_reentrant=reentrant)

    x = randn(3, 4, dtype=torch.float64).requires_grad_()
    with pytest.raises(RuntimeError) as expected:
        torch.vmap(f)(x)
    with pytest.raises(cm.CmapError) as got:
        cm.cmap(f)(x)
    message = str(expected.value).splitlines()[0]
    assert message in str(got.value), str(got.value)
    return message


@pytest.mark.parametrize("P", [1, 2])
@pytest.mark.parametrize("reentrant", REENTRANT)
def test_vmap_mode_raises_what_vmap_raises(worlds, P, reentrant):
    assert len(set(worlds(P).run(check_vmap_mode, reentrant, deadline=DEADLINE))) == 1


# ------------------------------------------------------------------------------------------- a tiny Llama
def llama(hidden: int = 32, heads: int = 4, kv_heads: int = 2) -> nn.Module:
    """A tiny transformers Llama from a config (no download), in float64."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=100,
        hidden_size=hidden,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(torch.float64)


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, 100, (2 * dist.get_world_size() + 1, 6), generator=torch.Generator().manual_seed(step))


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _train(models, forwards, take, what: str) -> None:
    """STEPS AdamW steps of each model; each step's loss and gradients, and the weights after, against the first
    (``take`` maps a full tensor of the first to the second's share of it)."""
    opts = [torch.optim.AdamW(m.parameters(), lr=LR) for m in models]
    for step in range(STEPS):
        ids = _tokens(step)
        losses = []
        for model, forward, opt in zip(models, forwards, opts):
            opt.zero_grad()
            loss = forward(ids)
            loss.backward()
            losses.append(loss.detach())
        assert_same(losses[1], losses[0], F64, f"{what}: loss at step {step}")
        for (name, p), q in zip(models[1].named_parameters(), models[0].parameters()):
            assert p.grad is not None, f"{what}: no gradient for {name} at step {step}"
            assert_same(p.grad, take(name, q.grad), F64, f"{what}: gradient of {name} at step {step}")
        for opt in opts:
            opt.step()
    drift = dict(rtol=F64["rtol"], atol=F64["atol"] + adam_drift_bound(LR, (0.9, 0.999), STEPS))
    for (name, p), q in zip(models[1].named_parameters(), models[0].parameters()):
        assert_same(p.detach(), take(name, q.detach()), drift, f"{what}: {name} after {STEPS} steps")


def check_llama_cmap(kwargs) -> bool:
    """transformers' ``gradient_checkpointing_enable(**kwargs)`` on a Llama trained through
    ``cmap(model, mode="batched")``: the unsharded model's losses, gradients and weights."""
    ref = llama()
    model = copy.deepcopy(ref)
    model.gradient_checkpointing_enable(**kwargs)
    model.config.use_cache = False  # as with checkpointing in training (transformers says so, and sets it)
    ref.train(), model.train()
    mapped = cm.cmap(model, mode="batched")
    forwards = (lambda ids: _loss(ref(ids).logits, ids), lambda ids: _loss(mapped(ids).logits, ids))
    _train((ref, model), forwards, lambda name, t: t, f"cmap(Llama), {kwargs}")
    return True


CHECKPOINTING = [{}, {"gradient_checkpointing_kwargs": {"use_reentrant": False}}]


@pytest.mark.parametrize("P", WORLDS)
@pytest.mark.parametrize("kwargs", CHECKPOINTING, ids=["default", "non_reentrant"])
def test_llama_gradient_checkpointing_through_cmap(worlds, P, kwargs):
    assert worlds(P).run(check_llama_cmap, kwargs, deadline=DEADLINE) == [True] * P


def check_llama_shard_model(kwargs) -> bool:
    """The same on ``shard_model(model, plan="auto")``: tensor-parallel layers inside every checkpointed layer (6
    heads, whole on every rank at P = 1, 2, 3)."""
    ref = llama(hidden=48, heads=6, kv_heads=6)
    tp = cm.shard_model(copy.deepcopy(ref), plan="auto")
    tp.gradient_checkpointing_enable(**kwargs)
    tp.config.use_cache = False
    ref.train(), tp.train()
    slices = cm.sharded_parameters(tp)

    def take(name, t):
        return slices[name].take(t) if name in slices else t

    forwards = tuple(lambda ids, m=m: _loss(m(ids).logits, ids) for m in (ref, tp))
    _train((ref, tp), forwards, take, f"shard_model(Llama), {kwargs}")
    return True


@pytest.mark.parametrize("P", WORLDS)
@pytest.mark.parametrize("kwargs", CHECKPOINTING, ids=["default", "non_reentrant"])
def test_llama_gradient_checkpointing_in_shard_model(worlds, P, kwargs):
    assert worlds(P).run(check_llama_shard_model, kwargs, deadline=DEADLINE) == [True] * P


# ----------------------------------------------------------------------------------------------- shard_map
def check_shard_map(reentrant: bool) -> bool:
    """jax's FSDP example with its layer checkpointed: the weight all-gathered inside the checkpointed block, whose
    recomputation gathers it again. Typed (``check_vma=True``), a reentrant checkpoint is refused on every rank: its
    recomputation's detached inputs carry no types."""
    from torch.distributed.device_mesh import init_device_mesh

    size = dist.get_world_size()
    mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("i",))
    w, x = randn(2 * size, 3, seed=11, dtype=torch.float64), randn(5, 3, seed=12, dtype=torch.float64)
    wr, xr = w.clone().requires_grad_(), x.clone().requires_grad_()
    torch.tanh(xr @ wr.T).sin().sum().backward()
    for check_vma in (False, True):
        gather = cm.all_gather_invariant if check_vma else cm.all_gather

        def layer(wb, xb):
            return torch.tanh(xb @ gather(wb, "i", tiled=True).T)

        def f(wb, xb):
            return checkpoint(layer, wb, xb, use_reentrant=reentrant)

        mapped = shard_map(f, mesh=mesh, in_specs=(P("i"), P()), out_specs=P(), check_vma=check_vma)
        wc, xc = w.clone().requires_grad_(), x.clone().requires_grad_()
        if check_vma and reentrant:
            with pytest.raises(cm.CmapError, match="use_reentrant=False"):
                mapped(wc, xc)
            continue
        mapped(wc, xc).sin().sum().backward()
        assert_same([wc.grad, xc.grad], [wr.grad, xr.grad], F64, f"check_vma={check_vma}: gradients")
    return True


@pytest.mark.parametrize("P", WORLDS)
@pytest.mark.parametrize("reentrant", REENTRANT)
@pytest.mark.parametrize("check", [check_modes, check_collective_inside, check_shard_map], ids=lambda c: c.__name__)
def test_checkpoint_inside(worlds, P, reentrant, check):
    assert worlds(P).run(check, reentrant, deadline=DEADLINE) == [True] * P


# --------------------------------------------------------------------------------- a failure in recomputation
def check_recomputation_failure(mode: str) -> bool:
    """The checkpointed block raises on the last rank only in its recomputation (grad enabled, in backward): every
    rank raises the same CmapError naming that rank and the exception, the failing rank with it as ``__cause__``;
    the user's own collective and the next call work."""
    rank, size = dist.get_rank(), dist.get_world_size()
    model, x = _blocks(), randn(2 * size, 4, seed=5, dtype=torch.float64)

    def inner(h):
        if torch.is_grad_enabled() and rank == size - 1:
            raise ValueError("the recomputation failed")
        return model[2](torch.tanh(h))

    out = cm.cmap(lambda v: checkpoint(inner, model[0](v), use_reentrant=True), mode=mode)(x)
    with pytest.raises(ValueError) as info:
        out.sum().backward()
    err = info.value
    assert isinstance(err, cm.CmapError) and [f.group_rank for f in err.failures] == [size - 1], str(err)
    assert "(backward) failed on 1 rank(s)" in str(err) and "the recomputation failed" in str(err), str(err)
    assert (type(err.__cause__).__name__ == "ValueError") == (rank == size - 1)
    total = torch.ones(1)
    dist.all_reduce(total)  # pairs with the peers' own
    assert total.item() == size
    assert torch.equal(cm.cmap(torch.sin)(x), x.sin())
    return True


@pytest.mark.parametrize("P", [2, 3])
@pytest.mark.parametrize("mode", ["batched", "loop"])
def test_failure_in_recomputation(worlds, P, mode):
    assert worlds(P).run(check_recomputation_failure, mode, deadline=DEADLINE) == [True] * P
