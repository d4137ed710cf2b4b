"""The torch.func tutorials' workloads, written as the tutorials write them, with ``torch.vmap`` swapped for
``cmap``: per-sample gradients, model ensembling, Jacobians and Hessians, the neural tangent kernel, MAML with
closure-captured parameters (the functorch example), and Lennard-Jones forces. Each compares against the same code
with ``torch.vmap`` in one process.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, hessian, jacrev, stack_module_state, vmap

import colossalai_cmap as cm


def _seeded(seed):
    return torch.Generator().manual_seed(seed)


class SimpleMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def per_sample_gradients(mapper):
    """The per-sample-gradients tutorial: grad of a loss over functional_call, vmapped over the batch."""
    torch.manual_seed(0)
    model = SimpleMLP().double()
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}
    data, targets = torch.randn(11, 8, generator=_seeded(1)).double(), torch.randint(4, (11,), generator=_seeded(2))

    def compute_loss(params, buffers, sample, target):
        predictions = functional_call(model, (params, buffers), (sample.unsqueeze(0),))
        return F.cross_entropy(predictions, target.unsqueeze(0))

    return mapper(grad(compute_loss), in_dims=(None, None, 0, 0))(params, buffers, data, targets)


def ensembling(mapper):
    """The model-ensembling tutorial: stack_module_state, a 'meta' base model, vmap over the models' parameters."""
    torch.manual_seed(0)
    models = [SimpleMLP().double() for _ in range(5)]
    params, buffers = stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")
    minibatch = torch.randn(64, 8, generator=_seeded(3)).double()

    def fmodel(params, buffers, x):
        return functional_call(base, (params, buffers), (x,))

    predictions = mapper(fmodel, in_dims=(0, 0, None))(params, buffers, minibatch)
    loss = predictions.square().mean()
    return predictions, torch.autograd.grad(loss, list(params.values()))


def jacobians_and_hessians(mapper):
    """The Jacobians/Hessians tutorial: a batch of Jacobians with vmap(jacrev), and Hessians with vmap(hessian)."""
    weight, bias = torch.randn(3, 3, generator=_seeded(4)).double(), torch.randn(3, generator=_seeded(5)).double()

    def predict(weight, bias, x):
        return F.linear(x, weight, bias).tanh()

    x = torch.randn(9, 3, generator=_seeded(6)).double()
    jac = mapper(jacrev(predict, argnums=2), in_dims=(None, None, 0))(weight, bias, x)
    hess = mapper(hessian(lambda v: predict(weight, bias, v).sum()))(x)
    return jac, hess


def neural_tangent_kernel(mapper):
    """The NTK tutorial: per-example Jacobians with vmap(jacrev) over functional_call, then their contraction."""
    torch.manual_seed(0)
    net = SimpleMLP().double()
    params = {k: v.detach() for k, v in net.named_parameters()}
    x1, x2 = torch.randn(6, 8, generator=_seeded(7)).double(), torch.randn(5, 8, generator=_seeded(8)).double()

    def fnet_single(params, x):
        return functional_call(net, params, (x.unsqueeze(0),)).squeeze(0)

    jac1 = mapper(jacrev(fnet_single), (None, 0))(params, x1)
    jac2 = mapper(jacrev(fnet_single), (None, 0))(params, x2)
    blocks = [
        torch.einsum("Naf,Mbf->NMab", j1.flatten(2), j2.flatten(2)) for j1, j2 in zip(jac1.values(), jac2.values())
    ]
    return torch.stack(blocks).sum(0)


def maml(mapper):
    """functorch's MAML regression example (evjang_transforms): the parameters are a closure-captured list that the
    inner loop both differentiates (``grad(inner_loss)(tuple(params), ...)``) and updates; the meta-gradient comes from
    ``loss.backward()`` on the mean of the per-task losses."""
    gen = _seeded(9)
    params = [
        torch.empty(40, 1).uniform_(-1.0, 1.0, generator=gen).double().requires_grad_(),
        torch.zeros(40).double().requires_grad_(),
        torch.empty(40, 40).uniform_(-0.15, 0.15, generator=gen).double().requires_grad_(),
        torch.zeros(40).double().requires_grad_(),
        torch.empty(1, 40).uniform_(-0.15, 0.15, generator=gen).double().requires_grad_(),
        torch.zeros(1).double().requires_grad_(),
    ]

    def net(params, x):
        x = F.relu(F.linear(x, params[0], params[1]))
        x = F.relu(F.linear(x, params[2], params[3]))
        return F.linear(x, params[4], params[5])

    def mse_loss(x, y):
        return torch.mean((x - y) ** 2)

    def get_loss_for_task(x1, y1, x2, y2):
        def inner_loss(params, x1, y1):
            return mse_loss(net(params, x1), y1)

        grads = grad(inner_loss)(tuple(params), x1, y1)
        new_params = [(params[i] - 0.1 * grads[i]) for i in range(len(params))]
        return mse_loss(net(new_params, x2), y2)

    tasks = [torch.randn(5, 10, 1, generator=gen).double() for _ in range(4)]
    inner_losses = mapper(get_loss_for_task)(*tasks)
    loss2 = sum(inner_losses) / len(inner_losses)
    loss2.backward()
    return loss2.detach(), [p.grad for p in params]


def lennard_jones(mapper):
    """functorch's Lennard-Jones example: a model read from a closure, forces from vmap(jacrev(model)), and the
    training loss on energies and forces backpropagated into the model's parameters."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
    r = torch.linspace(0.5, 2.0, 10, dtype=torch.float64)
    drs = torch.outer(r, torch.tensor([1.0, 0, 0], dtype=torch.float64))
    norms = torch.norm(drs, dim=1).reshape(-1, 1)
    energies = model(norms)
    network_derivs = mapper(jacrev(model))(norms).squeeze(-1)
    forces = -network_derivs * drs / norms
    loss = energies.square().mean() + 0.1 * forces.square().mean()
    loss.backward()
    return forces.detach(), [p.grad for p in model.parameters()]


WORKLOADS = [per_sample_gradients, ensembling, jacobians_and_hessians, neural_tangent_kernel, maml, lennard_jones]


def check_workloads():
    for workload in WORKLOADS:
        got, expected = workload(cm.cmap), workload(vmap)
        torch.testing.assert_close(got, expected, msg=lambda m: f"{workload.__name__}: {m}")
    return len(WORKLOADS)


def test_workloads_single_process():
    assert check_workloads() == len(WORKLOADS)


@pytest.mark.parametrize("P", [2, 3])
def test_workloads(worlds, P):
    assert worlds(P).run(check_workloads, deadline=180) == [len(WORKLOADS)] * P
