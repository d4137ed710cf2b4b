"""The first errors users meet with real models say the fix, in the same words at every P (in one process without
``torch.distributed``, and in worlds of 1, 2 and 3), torch's own sentence kept first:

- ``cmap(model)(x)`` (mode "vmap") on a model written for a batch (BERT, Llama, a CNN) fails deep inside the model,
  as ``torch.vmap(model)(x)`` does; cmap adds that each example arrives without its batch dim and that
  ``mode="batched"`` runs the model on its rows as they are (which then works);
- vmap's refusal of data-dependent control flow under ``torch.func.grad`` (its "either (1) ... or (2)" wording) gets
  the ``mode="loop"`` advice its other two wordings get (loop mode then works);
- greedy generation where one rank's rows meet eos early returns outputs of different lengths on different ranks:
  the error names each rank's output shape and says how to pad; padded, the result equals ``model.generate`` on the
  whole batch in one process.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import colossalai_cmap as cm

MAX_NEW = 8
PROMPT = 5


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
    )
    return LlamaForCausalLM(config).double().eval()  # float64: greedy choices do not flip with the batch's size


def _bert():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=100
    )
    return BertModel(config).eval()


def _cnn():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(144, 2)
    ).eval()


def _models():
    """Each model, its batch, and what one process's batched call returns (the tensor compared)."""
    ids = torch.randint(0, 100, (5, 7), generator=torch.Generator().manual_seed(1))
    images = torch.randn(5, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    return [
        ("bert", _bert(), ids, lambda out: out.last_hidden_state),
        ("llama", _llama(), ids, lambda out: out.logits),
        ("cnn", _cnn(), images, lambda out: out),
    ]


def _failure(call, *args):
    """The exception ``call(*args)`` raises (the test fails if it returns)."""
    try:
        call(*args)
    except Exception as exc:  # noqa: BLE001  (what is raised is the subject)
        return exc
    raise AssertionError(f"{call} returned instead of raising")


def check_module_under_vmap():
    """Per model: torch.vmap's own sentence, cmap's whole message without torch.distributed (the sentence and the
    remedy), this run's message and exception types; then mode="batched" against the model on the whole batch."""
    found = {}
    for name, model, x, main in _models():
        torch_says = str(_failure(torch.vmap(model), x))
        got = _failure(cm.cmap(model), x)
        with torch.no_grad():
            batched = main(cm.cmap(model, mode="batched")(x))
            # a rank's rows are a smaller batch, whose matmuls may sum in another order: the dtype's tolerance
            torch.testing.assert_close(batched, main(model(x)))
        found[name] = (torch_says, str(got), [t.__name__ for t in type(got).__mro__], type(model).__name__)
    # vmap's and cmap's own argument errors, for a module that works per example: no remedy
    linear, x = torch.nn.Linear(3, 2), torch.zeros(4, 3)
    for options in (dict(in_dims=2), dict(out_dims=3)):
        message = str(_failure(cm.cmap(linear, **options), x))
        assert "dimension" in message.lower() and "mode='batched'" not in message, message
    return found


def _check_module_messages(found, alone, distributed):
    remedy = "func is a module, and in mode='vmap' (the default) cmap calls it as torch.vmap does"
    for name, (torch_says, message, types, model) in found.items():
        expected = alone[name][1]  # one process without torch.distributed: torch's sentence, then the remedy
        assert expected.startswith(torch_says + "\n"), (name, expected)
        assert remedy in expected and "use mode='batched'" in expected and "WITHOUT its batch dim" in expected
        assert expected in message, (name, message)  # the same words at every P
        torch_type = alone[name][2][0]  # as torch.vmap raises it; at every P a CmapError that is one too
        if distributed:  # CmapError is a RuntimeError itself
            assert types[0] == ("CmapError" if torch_type == "RuntimeError" else f"CmapError[{torch_type}]"), types
            assert message.startswith(f"cmap({model}, in_dims=0) failed on"), message
        else:
            assert types[0] == torch_type


def test_module_under_vmap_alone():
    found = check_module_under_vmap()
    _check_module_messages(found, found, distributed=False)
    assert found["bert"][2][0] == "IndexError" and found["cnn"][2][0] == "ValueError"  # as torch.vmap raises them


@pytest.mark.parametrize("P", [1, 2, 3])
def test_module_under_vmap(worlds, P):
    alone = check_module_under_vmap()
    for found in worlds(P).run(check_module_under_vmap, deadline=240):
        _check_module_messages(found, alone, distributed=True)


# ------------------------------------------------------------------------------ control flow under torch.func.grad
def _branches(x):
    return x.sin().sum() if x.sum() > 0 else x.cos().sum()


def _reads_item(x):
    return x.sin().sum() * x.sum().item()


def check_control_flow_under_grad():
    """For each function: vmap's sentence (its "either" wording, under grad), cmap's message, and loop mode's result
    against a Python loop of grad."""
    x = torch.randn(6, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    found = []
    for f in (_branches, _reads_item):
        torch_says = str(_failure(torch.vmap(torch.func.grad(f)), x))
        message = str(_failure(cm.cmap(torch.func.grad(f)), x))
        looped = cm.cmap(torch.func.grad(f), mode="loop")(x)
        torch.testing.assert_close(looped, torch.stack([torch.func.grad(f)(row) for row in x]), rtol=0, atol=0)
        found.append((torch_says, message))
    return found


def _check_control_flow(found, alone):
    for (torch_says, message), (_, expected) in zip(found, alone):
        assert torch_says.startswith("vmap: It looks like you're either (1) calling .item() on a Tensor or")
        assert expected.startswith(torch_says + "\n"), expected
        assert "Use mode='loop' to call func once per example" in expected, expected
        assert expected in message, message


def test_control_flow_under_grad_alone():
    found = check_control_flow_under_grad()
    _check_control_flow(found, found)


@pytest.mark.parametrize("P", [1, 2, 3])
def test_control_flow_under_grad(worlds, P):
    alone = check_control_flow_under_grad()
    for found in worlds(P).run(check_control_flow_under_grad, deadline=120):
        _check_control_flow(found, alone)


# ----------------------------------------------------------------------------------------------------- generation
def _prompts(model, P):
    """Prompts and an eos token such that greedy generation's first token is eos for the first two rows (group rank
    0's share at every P) and never eos for the others; two rows per rank (four at P = 1)."""
    candidates = torch.randint(3, 100, (400, PROMPT), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        new = model.generate(candidates, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)[:, PROMPT:]
    eos = int(torch.mode(new[:, 0]).values)
    early, late = candidates[new[:, 0] == eos][:2], candidates[(new != eos).all(1)][: 2 * max(P - 1, 1)]
    assert len(early) == 2 and len(late) == 2 * max(P - 1, 1)
    return torch.cat([early, late]), eos


def check_generation():
    """Greedy generation, mode="batched": as it is (an error where ranks stop at different lengths), padded to the
    fixed length, and with min_new_tokens=max_new_tokens; each against model.generate on the whole batch here."""
    P = dist.get_world_size() if dist.is_initialized() else 1
    model = _llama()
    ids, eos = _prompts(model, P)
    options = dict(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos, pad_token_id=0)

    def generate(prompts):
        return model.generate(prompts, **options)

    def padded(prompts):
        out = model.generate(prompts, **options)
        return F.pad(out, (0, prompts.shape[1] + MAX_NEW - out.shape[1]), value=0)

    def fixed(prompts):
        return model.generate(prompts, min_new_tokens=MAX_NEW, **options)

    whole = generate(ids)
    assert whole.shape == (len(ids), PROMPT + MAX_NEW) and (whole[:2, PROMPT + 1 :] == 0).all()  # rows 0, 1 stopped
    try:
        as_is = cm.cmap(generate, mode="batched")(ids)
    except cm.CmapError as exc:
        as_is = str(exc)
    else:
        assert torch.equal(as_is, whole)
        as_is = None
    assert torch.equal(cm.cmap(padded, mode="batched")(ids), whole)
    assert torch.equal(cm.cmap(fixed, mode="batched")(ids), fixed(ids))
    return as_is


def test_generation_alone():
    assert check_generation() is None  # one process generates the whole batch: one length


@pytest.mark.parametrize("P", [1, 2, 3])
def test_generation(worlds, P):
    found = worlds(P).run(check_generation, deadline=240)
    if P == 1:
        assert found == [None]
        return
    others = "group ranks 1, 2" if P == 3 else "group rank 1"
    shapes = f"(the output: group rank 0: int64 (2, {PROMPT + 1}), {others}: int64 (2, {PROMPT + MAX_NEW}))"
    for message in found:
        assert message == found[0]  # every rank raises the same error
        assert message.startswith(
            "cmap(generate, in_dims=0): ranks returned outputs of different per-example shapes, dtypes or structures "
            + shapes
        ), message
        assert "pad it to a fixed length" in message and "model.generate" in message, message
        assert "value=pad_token_id" in message and "min_new_tokens=max_new_tokens" in message, message


# -------------------------------------------------------------------------- outputs that differ in dtype or structure
def _rank_dependent():
    """A dtype, then a structure, that differ on group rank 1."""
    rank = dist.get_rank()
    return (
        lambda v: {"a": v, "b": v.double() if rank == 1 else v},
        lambda v: {"a": v, "b": v} if rank == 1 else {"a": v},
    )


def check_other_layouts():
    """func returns a different dtype, then a different structure, on group rank 1: cmap's error and shard_map's
    name each rank's outputs."""
    from torch.distributed.device_mesh import init_device_mesh

    x = torch.zeros(4, 3)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("x",))
    messages = []
    for f in _rank_dependent():
        messages.append(str(_failure(cm.cmap(f, mode="batched"), x)))
        messages.append(str(_failure(cm.shard_map(f, mesh, cm.P("x"), cm.P("x")), x)))
    return messages


def test_other_layouts(worlds):
    dtypes, dtypes_shard, structures, structures_shard = worlds(2).run(check_other_layouts, deadline=60)[0]
    assert "(output ['b']: group rank 0: float32 (2, 3), group rank 1: float64 (2, 3))" in dtypes, dtypes
    assert (
        "(group rank 0: output ['a'] float32 (2, 3); group rank 1: output ['a'] float32 (2, 3), output ['b'] "
        "float32 (2, 3))" in structures
    ), structures
    for message in (dtypes, structures):
        assert "Make every rank's output the same shape, dtype and structure" in message, message
        assert "model.generate" not in message, message  # the padding advice is for lengths only
    assert (
        "(output ['b']: group rank 0: float32 (*, 3), out_specs P('x'), group rank 1: float64 (*, 3), out_specs P('x'))"
        in dtypes_shard
    ), dtypes_shard
    assert (
        "(group rank 0: output ['a'] float32 (*, 3), out_specs P('x'); group rank 1: output ['a'] float32 (*, 3), "
        "out_specs P('x'), output ['b'] float32 (*, 3), out_specs P('x'))" in structures_shard
    ), structures_shard
