"""``shard_model(model, plan=...)``: tensor parallelism from a sharding plan, checked as a whole, then applied in
place, with no tracing.

The plan maps ``fnmatch`` patterns over ``model.named_modules()`` names to styles (:mod:`.styles`: the style
objects, or their shorthand strings). Every check runs before any weight is touched, and depends only on the model,
the plan and the group size, so every rank raises the same error, naming the pattern or the module path. Then each
matched module is replaced by the tensor-parallel layer its style builds (:mod:`.layers`); the model's forward is
whatever it was, so any model works.
"""

import fnmatch
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Tuple, Union

import torch
from torch import nn

from ..digests import digest
from ..errors import CmapError
from ..integration.groups import resolve_group
from ..torch_internals import tree_flatten
from ..wire import comm
from ..wire.comm import default_timeout
from ..wire.exchange import JoinSpec, join
from ..wire.group import Group
from ..wire.link import link_for
from ..wire.roles import Rows, tensor_split_sizes
from .layers import CALL, PARALLEL_LAYERS, HeadGroupLinear, RegionInputs, RowParallelLinear
from .loss import CausalLMLoss
from .rng import RegionRandom
from .sequence import SequenceState
from .styles import (
    SHORTHANDS,
    TRANSFORMERS_STYLES,
    Colwise,
    ColwiseGather,
    ParallelStyle,
    Rowwise,
    Vocab,
    resolve_style,
)

__all__ = ["shard_model"]

# Attention modules with these integer attributes get this rank's head counts.
HEAD_COUNTS = ("num_heads", "num_attention_heads", "num_key_value_heads")


class Assignment(NamedTuple):
    """One module the plan shards: its path, the module, its style object, and the plan pattern that matched it;
    ``head_dim`` is set for a key/value projection with fewer heads than ranks, which is replicated."""

    path: str
    module: nn.Module
    style: ParallelStyle
    pattern: str
    head_dim: int = 0


def transformers_plan(model: nn.Module) -> Dict[str, str]:
    """transformers' own tensor-parallel plan of ``model``: ``config.base_model_tp_plan``, relative to the base
    model and prefixed with its attribute name (``base_model_prefix``, e.g. ``model.``), plus the class's
    ``_tp_plan`` (``{"lm_head": "colwise_rep"}`` on a CausalLM).

    Raises:
        ValueError: a model with no such plan, or a style string with no cmap style, naming it.
    """
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None) if config is not None else None
    if base is None and config is not None and hasattr(config, "get_text_config"):
        base = getattr(config.get_text_config(), "base_model_tp_plan", None)
    if not base:
        raise ValueError(
            f"{CALL}: plan='auto' reads transformers' tensor-parallel plan (config.base_model_tp_plan), but "
            f"{type(model).__name__} has none; pass plan={{module-name pattern: style}}."
        )
    prefix = getattr(model, "base_model_prefix", "")
    inner = prefix and getattr(model, prefix, None)
    lead = f"{prefix}." if isinstance(inner, nn.Module) else ""  # the model itself may be the base model
    plan = {f"{lead}{k}": v for k, v in base.items()}
    plan.update(getattr(type(model), "_tp_plan", None) or {})
    for pattern, style in plan.items():
        if style not in TRANSFORMERS_STYLES:
            raise ValueError(
                f"{CALL}: plan='auto': transformers' plan of {type(model).__name__} gives {pattern!r} style "
                f"{style!r}, which has no cmap style (known: {', '.join(sorted(TRANSFORMERS_STYLES))}); pass "
                f"plan={{...}} with that entry changed."
            )
    return plan


def shard_model(
    model: nn.Module,
    group: Any = None,
    *,
    plan: Optional[Union[Mapping[str, Union[ParallelStyle, str]], str]] = None,
    check_inputs: bool = False,
    loss_parallel: bool = False,
    sequence_parallel: bool = False,
) -> nn.Module:
    """Tensor parallelism as Megatron-LM does it: shard the modules a plan names, in place, and return ``model``.

    ``plan`` maps ``fnmatch`` patterns over ``model.named_modules()`` names to parallel styles: ``Colwise()`` (an
    ``nn.Linear`` split by output features; replicated input, output left sharded along the last dim),
    ``Rowwise()`` (split by input features; takes that sharded activation, returns the replicated sum, bias added
    once), ``ColwiseGather()`` (colwise, output gathered to full) and ``Vocab()`` (an ``nn.Embedding`` split by
    vocabulary rows), or their shorthand strings ``"colwise"``, ``"rowwise"``, ``"colwise_gather"``, ``"vocab"``.
    The whole plan is checked first (patterns that match nothing, styles on the wrong module type, partial attention
    heads, tied weights); then the matched modules are replaced, with no tracing, so any model's forward works.
    See ``docs/shard_model.md``.

    Every rank of the group must call this with the same model (same architecture and weights, as after
    ``colossalai.launch``'s shared seed) and later pass the same inputs to it.

    Args:
        model: the module to shard, changed in place.
        group: the tensor-parallel group, as for ``cmap``: None (the world, or this process alone when
            ``torch.distributed`` is not initialised), a ``ProcessGroup``, ``(ProcessGroupMesh, axis)``, or a
            colossalai ``Booster``/plugin.
        plan: module-name patterns to styles, as above, or ``"auto"``: transformers' own plan of the model
            (``config.base_model_tp_plan`` under the base model's attribute name, plus the class's ``_tp_plan``),
            its style strings mapped to cmap's (:data:`~colossalai_cmap.tp.styles.TRANSFORMERS_STYLES`). Required
            (keyword only); the torch.fx form, which shards every linear layer with no plan, is
            :func:`~colossalai_cmap.tp.fx.shard_linears_fx`.
        check_inputs: check on every forward that every rank passed the same inputs (a checksum per rank in one
            exchange); ranks that differ raise ``CmapError`` on every rank.
        loss_parallel: keep the LM head (``model.get_output_embeddings()``, colwise in the plan) split by
            vocabulary: ``out.logits`` on each rank is its slice of the last dim, and ``out.loss`` is the
            vocabulary-parallel cross entropy of those slices (:mod:`~colossalai_cmap.tp.loss`; transformers'
            label shifting and ``ignore_index``), equal to the unsharded loss. A transformers model only.
        sequence_parallel: Megatron's sequence parallelism (:mod:`~colossalai_cmap.tp.sequence`): between the
            tensor-parallel regions each rank holds its rows of the sequence; colwise layers all-gather it on
            entry, rowwise layers and the vocab embedding reduce-scatter it on exit; the norms' gradients are summed
            over the group. The decoder layers are the classes ``_no_split_modules`` names, else the modules above
            the ones holding colwise layers; the plan has only colwise, colwise_gather, rowwise and vocab styles,
            and a colwise LM head; for training (the model's hidden states come out sharded; ``generate`` is not
            supported).

    Returns:
        ``model`` itself, its matched modules replaced by tensor-parallel layers that hold this rank's slices.

    Raises:
        TypeError: no ``plan``.
        ValueError: a plan that does not fit the model; every rank raises it before any weight is touched.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 24))
        >>> full = copy.deepcopy(model)
        >>> model = shard_model(model, plan={"0": Colwise(), "2": Rowwise()})  # Megatron's MLP, on every rank
        >>> torch.testing.assert_close(model(x), full(x))
    """
    if plan is None:
        styles = ", ".join(map(repr, SHORTHANDS.values()))
        misplaced = " (the second positional argument is the group)" if isinstance(group, Mapping) else ""
        raise TypeError(
            f"{CALL}: pass the plan as plan={{module-name pattern: style}}{misplaced}, with the styles {styles} or "
            f"their shorthands {', '.join(map(repr, SHORTHANDS))}; to shard every linear layer with no plan, use the "
            f"torch.fx form, shard_linears_fx(model, group, layers=..., style=...)."
        )
    if isinstance(plan, str):
        if plan != "auto":
            raise ValueError(
                f"{CALL}: plan={plan!r}: a plan is a mapping of module-name patterns to styles, or 'auto'."
            )
        plan = transformers_plan(model)
    group_ = resolve_group(CALL, group)
    assignments = resolve_plan(model, plan, group_.size)
    if loss_parallel:
        assignments = _vocab_head(model, assignments)
    sequence = None
    if sequence_parallel:
        layers = _check_sequence(model, assignments)
        sequence = SequenceState(group_)
        sequence.replicated_input = not any(isinstance(a.style, Vocab) for a in assignments)
    entries = RegionInputs(sequence)
    heads = _head_counts(model, assignments, group_)
    for a in assignments:
        if a.head_dim:
            layer = HeadGroupLinear(a.module, group_, a.path, entries, a.style, a.head_dim)
        else:
            layer = a.style._apply(a.module, group_, a.path, entries)
        _replace(model, a.path, layer)
    if loss_parallel:
        model.loss_function = CausalLMLoss(group_)
    _fork_region_random(model, assignments, group_)
    if sequence is not None and group_.size > 1:
        _hook_sequence_parallel(model, sequence, layers, assignments, entries)
    for owner, counts in heads.items():
        for attr, value in counts.items():
            setattr(owner, attr, value)
    model.register_forward_pre_hook(entries.clear)
    model.register_forward_hook(entries.clear)
    if check_inputs and group_.size > 1:
        model.register_forward_pre_hook(InputCheck(group_), with_kwargs=True)
    return model


def _hook_sequence_parallel(
    model: nn.Module, sequence: Any, layers: Any, assignments: List[Assignment], entries: RegionInputs
) -> None:
    """Sequence parallelism's hooks: the sequence length read on entry, each decoder layer entered with its rows, the
    colwise layers' parents gathering their input once, and the replicated parameters' gradients summed."""
    model.register_forward_pre_hook(sequence.read_length, with_kwargs=True)
    for layer in layers:
        layer.register_forward_pre_hook(sequence.enter_layer, with_kwargs=True)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        head.keeps_gathered = True
    modules = dict(model.named_modules())
    parents = {a.path.rpartition(".")[0] for a in assignments if isinstance(a.style, Colwise) and a.module is not head}
    for path in sorted(parents - {""}):
        modules[path].register_forward_pre_hook(entries.gather_input, with_kwargs=True)
    _sum_replicated_grads(model, sequence)


def resolve_plan(model: nn.Module, plan: Mapping[str, Any], size: int) -> List[Assignment]:
    """Every module ``plan`` shards, after every check; raises ``ValueError`` naming the pattern or the path."""
    if not isinstance(plan, Mapping) or not plan:
        raise ValueError(f"{CALL}: plan must be a non-empty mapping of module-name patterns to styles, got {plan!r}.")
    modules = dict(model.named_modules())
    found: Dict[str, Assignment] = {}
    for pattern, given in plan.items():
        style = resolve_style(given, pattern)
        paths = [path for path in modules if fnmatch.fnmatchcase(path, pattern)]
        if not paths:
            raise ValueError(f"{CALL}: plan pattern {pattern!r} matches no module of {type(model).__name__}.")
        for path in paths:
            style._check(path, modules[path], pattern)
            other = found.get(path)
            if other is not None and other.style != style:
                raise ValueError(
                    f"{CALL}: module {path!r} is matched by plan pattern {other.pattern!r} as {other.style.name!r} "
                    f"and by {pattern!r} as {style.name!r}; a module takes one style."
                )
            found.setdefault(path, Assignment(path, modules[path], style, pattern))
    assignments = list(found.values())
    _check_tied(model, assignments)
    return _check_heads(modules, assignments, size)


def _fork_region_random(model: nn.Module, assignments: List[Assignment], group: Group) -> None:
    """Random ops where the activation is sharded (from a colwise layer whose output stays split to the rowwise
    layer that takes it) draw from a state of their own per rank (:mod:`.rng`), so dropout there differs across
    ranks and leaves the replicated region's draws alike on every rank and for any group size. The model's entry and
    exit close a region left open (a vocabulary-split LM head's)."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    region = RegionRandom(group, device)
    for a in assignments:
        layer = model.get_submodule(a.path)
        if isinstance(a.style, Colwise) and not a.style.gathers:
            layer.register_forward_pre_hook(region.open)
        elif isinstance(a.style, Rowwise) and not a.style.takes_replicated:
            layer.register_forward_pre_hook(region.close)
    model.register_forward_pre_hook(region.close)
    model.register_forward_hook(region.close)


def _check_sequence(model: nn.Module, assignments: List[Assignment]) -> List[nn.Module]:
    """sequence_parallel=True: the plan's styles, the LM head and the decoder layers (read before any weight is
    touched); returns the decoder layers, whose inputs each rank takes its rows of."""
    allowed = (Colwise, ColwiseGather, Rowwise, Vocab)
    for a in assignments:
        if type(a.style) not in allowed:
            raise ValueError(
                f"{CALL}: sequence_parallel=True: plan pattern {a.pattern!r} gives {a.path!r} style {a.style.name!r}; "
                f"sequence parallelism takes the styles colwise, colwise_gather, rowwise and vocab."
            )
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and not any(a.module is head and isinstance(a.style, Colwise) for a in assignments):
        raise ValueError(
            f"{CALL}: sequence_parallel=True: the LM head of {type(model).__name__} must be in the plan as colwise "
            f"or colwise_gather (it gathers the sequence on entry)."
        )
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    return layers or _layers_above_regions(model, assignments, head)


def _layers_above_regions(
    model: nn.Module, assignments: List[Assignment], head: Optional[nn.Module]
) -> List[nn.Module]:
    """The decoder layers of a model that names none in ``_no_split_modules``: the module above each module
    holding colwise layers (an attention, an MLP), which takes the hidden state of the residual stream; refused by
    name where that is the model itself or a container that no forward calls."""
    modules, found = dict(model.named_modules()), {}
    for a in assignments:
        if not isinstance(a.style, Colwise) or a.module is head:
            continue
        region = a.path.rpartition(".")[0]
        if not region:
            continue  # a top-level colwise layer (an LM head) gathers the sequence itself
        layer = region.rpartition(".")[0]
        above = modules[layer] if layer else None
        if not layer or isinstance(above, (nn.ModuleList, nn.ModuleDict)):
            raise ValueError(
                f"{CALL}: sequence_parallel=True: {type(model).__name__} names no decoder layers in "
                f"_no_split_modules, and colwise layer {a.path!r} sits in module {region!r}, with no decoder layer "
                f"above it "
                f"(a module called with the hidden state, holding the attention and MLP modules); set "
                f"{type(model).__name__}._no_split_modules to the decoder layers' class names, or put the colwise "
                f"layers in modules of their own inside each layer."
            )
        found.setdefault(layer, above)
    if not found:
        raise ValueError(
            f"{CALL}: sequence_parallel=True: {type(model).__name__} names no decoder layers in _no_split_modules, "
            f"and its colwise layers are all top-level modules; set {type(model).__name__}._no_split_modules to "
            f"the decoder layers' class names."
        )
    return list(found.values())


def _sum_replicated_grads(model: nn.Module, sequence: SequenceState) -> None:
    """Sequence parallelism: each rank's rows give a part of a replicated parameter's gradient (the norms, a
    rowwise bias): their sums over the group make one all-reduce after each backward (``GradSums``). The input
    embedding (a hand-written model's embeddings) is left out: its output's gradient is gathered whole before it
    (or it is vocabulary-parallel)."""
    if hasattr(model, "get_input_embeddings"):
        inputs = [model.get_input_embeddings()]
    else:  # a hand-written model: its embeddings run before the first decoder layer, on the whole sequence
        inputs = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    held = {id(p) for m in inputs if m is not None for p in m.parameters()}  # whole gradients (see above)
    for module in model.modules():
        if isinstance(module, PARALLEL_LAYERS):
            keep_bias = isinstance(module, RowParallelLinear) and module.bias is not None
            held.update(id(p) for n, p in module.named_parameters() if not (keep_bias and n == "bias"))
    for name, p in model.named_parameters():
        if id(p) not in held and p.requires_grad:
            sequence.grad_sums.add(p)


def _vocab_head(model: nn.Module, assignments: List[Assignment]) -> List[Assignment]:
    """loss_parallel=True: the LM head's assignment made ``Colwise`` (its output left split by vocabulary), after
    checking the model computes its loss through transformers' ``loss_function``."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or not hasattr(type(model), "loss_function"):
        raise ValueError(
            f"{CALL}: loss_parallel=True takes a transformers model with an LM head (get_output_embeddings()) and a "
            f"loss_function; {type(model).__name__} has not both. For other models, compute the loss of the "
            f"vocabulary-split logits with colossalai_cmap.tp.loss.vocab_parallel_cross_entropy."
        )
    found = [a for a in assignments if a.module is head]
    if not found or not isinstance(found[0].style, Colwise):
        raise ValueError(
            f"{CALL}: loss_parallel=True keeps the LM head split by vocabulary, but the plan gives it "
            f"{found[0].style.name!r} if found else 'no style'; give it 'colwise' or 'colwise_gather' "
            f"(transformers' 'colwise_rep')."
        )
    return [a._replace(style=Colwise()) if a.module is head else a for a in assignments]


def _check_tied(model: nn.Module, assignments: List[Assignment]) -> None:
    """A sharded parameter that another module also holds (tied weights) would be split under one name only."""
    owners: Dict[int, List[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)
    for a in assignments:
        for name, p in a.module.named_parameters(prefix=a.path):
            if len(owners[id(p)]) > 1:
                raise ValueError(
                    f"{CALL}: parameter {name!r} of module {a.path!r} is tied to {owners[id(p)]}; untie it (for "
                    f"transformers models, tie_word_embeddings=False) or leave the module out of the plan."
                )


def _check_heads(modules: Dict[str, nn.Module], assignments: List[Assignment], size: int) -> List[Assignment]:
    """A Linear inside an attention module (one with an int ``head_dim``) must leave every rank whole heads.

    ``torch.tensor_split`` sizes of ``heads * head_dim`` features are all multiples of ``head_dim`` only when the
    split is even, so the heads divide evenly too, and the ratio of query to key/value heads is kept on every rank.
    A colwise key/value projection with fewer heads than ranks, where the group size is a multiple of its heads, is
    replicated instead (each rank computes the one head its query heads read): its assignment gets ``head_dim``.
    """
    out = []
    for a in assignments:
        out.append(a)
        split = a.style._head_features(a.module)
        if split is None:
            continue
        parent = modules[a.path.rpartition(".")[0]]
        head_dim = getattr(parent, "head_dim", None)
        if not isinstance(head_dim, int) or head_dim <= 0:
            continue
        features, side = split
        sizes = tensor_split_sizes(features, size)
        heads = features // head_dim
        kv = getattr(parent, "num_key_value_groups", None)
        if (
            type(a.style) is Colwise
            and features % head_dim == 0
            and heads < size
            and size % heads == 0
            and isinstance(kv, int)
            and kv > 1
        ):
            out[-1] = a._replace(head_dim=head_dim)  # fewer key/value heads than ranks: replicated
            continue
        if features % head_dim == 0 and any(s % head_dim for s in sizes):
            raise ValueError(
                f"{CALL}: plan pattern {a.pattern!r} splits attention projection {a.path!r} ({features} "
                f"{side} features = {features // head_dim} heads of "
                f"{head_dim}) over {size} ranks as {list(sizes)} features, leaving a rank a partial head; use a group "
                f"size that divides the number of heads (or, for key/value heads fewer than the ranks, a group size "
                f"that is a multiple of them)."
            )
    return out


def _head_counts(model: nn.Module, assignments: List[Assignment], group: Group) -> Dict[nn.Module, Dict[str, int]]:
    """This rank's head counts for attention modules that keep them as attributes (read before any replacement).

    transformers' ``LlamaAttention`` keeps none: it reshapes with ``-1`` and reads only ``head_dim`` and
    ``num_key_value_groups``, which an even split by whole heads leaves unchanged.
    """
    counts: Dict[nn.Module, Dict[str, int]] = {}
    sharded = {a.path for a in assignments if a.style.splits_heads}
    replicated = {a.path: a.module.out_features // a.head_dim for a in assignments if a.head_dim}
    for path, module in model.named_modules():
        head_dim = getattr(module, "head_dim", None)
        children = {f"{path}.{name}" if path else name for name, _ in module.named_children()}
        if not isinstance(head_dim, int) or not children & sharded:
            continue
        found = {a: getattr(module, a) for a in HEAD_COUNTS if isinstance(getattr(module, a, None), int)}
        counts[module] = {a: n // group.size for a, n in found.items()}  # whole heads split evenly (checked)
        kv_heads = [replicated[c] for c in children if c in replicated]
        if kv_heads:  # one key/value head per rank, read by all of this rank's query heads
            counts[module]["num_key_value_groups"] = module.num_key_value_groups * kv_heads[0] // group.size
            if "num_key_value_heads" in found:
                counts[module]["num_key_value_heads"] = 1
    return counts


def _replace(model: nn.Module, path: str, layer: nn.Module) -> None:
    owner, _, name = path.rpartition(".")
    setattr(model.get_submodule(owner), name, layer)


class InputCheck:
    """A forward pre-hook: every rank passed the model the same tensors (a crc32 of each rank's, in one round)."""

    def __init__(self, group: Group) -> None:
        self.group = group

    def __call__(self, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        # the checksum is host-side metadata, wherever the inputs are: it rides in the round, over the host group
        mine = torch.tensor([_checksum(leaves)], dtype=torch.int64)
        link = link_for(self.group, mine.device, CALL, default_timeout())
        spec = JoinSpec(
            link, (Rows(0, (1,) * self.group.size),), "the input check (check_inputs=True)", host_metadata=True
        )
        sums = join(spec, [mine])[0].tolist()
        if len(set(sums)) > 1:
            seen = ", ".join(f"group rank {r}: crc32 {s:#010x}" for r, s in enumerate(sums))
            raise CmapError(
                f"{CALL}: check_inputs=True: the inputs of {type(module).__name__} differ across the ranks of its "
                f"tensor-parallel group ({seen}); every rank of the group must pass the same inputs."
            )


def _checksum(leaves: List[torch.Tensor]) -> int:
    return comm.checksum(leaves, digest([(tuple(t.shape), t.dtype) for t in leaves]))
