"""Tensor-parallel layers for ``shard_model(model, plan=...)``: Megatron's column- and row-parallel ``Linear`` and
its vocabulary-parallel ``Embedding``, built on cmap's two primitives. The styles of :mod:`.styles` build them; each
layer keeps the style object that built it, and reads its ``name`` for messages and ``gathers`` for a gathered
output.

Megatron's two conjugate operators are cmap's primitives of role ``COPY`` with ``checked=False``
(:mod:`~colossalai_cmap.wire.exchange`):

- *f*, entering the tensor-parallel region: ``Split(COPY)``, the identity forward, the sum over the group
  backward. A column-parallel layer applies it to its replicated input.
- *g*, leaving it: ``Join(COPY)``, the sum over the group forward (one ``all_reduce``), the identity backward. A
  row-parallel layer and the vocabulary-parallel embedding apply it to their partial results.

Neither takes a status round, so a layer costs what Megatron's costs; a rank that fails between layers leaves its
peers waiting until the timeout, which then names it. A gathered column-parallel output is ``Join(Rows)`` along the
last dim, whose backward takes this rank's slice: that exchange is a round of the status protocol.

Layers that read the same input tensor (q, k and v; gate and up) enter it once: they share one :class:`RegionInputs`
per sharded model, so autograd adds their input gradients before the single backward sum.
"""

from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..torch_internals import current_level, version_counter
from ..wire.comm import default_timeout
from ..wire.exchange import JoinSpec, SplitSpec, join, needs_function, split
from ..wire.group import Group
from ..wire.link import Link, link_for
from ..wire.native import AllGather, ReduceScatter, run
from ..wire.roles import COPY, Rows, first_row, tensor_split_sizes
from .sequence import GradSums, LinearOnGathered, Regather, SequenceState, pad_to_sequence

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "HeadGroupLinear",
    "SequenceRows",
    "sum_output",
    "Slice",
]

CALL = "shard_model"


def copy_to_region(x: torch.Tensor, link: Link) -> torch.Tensor:
    """Megatron's *f*: a round-free ``Split(COPY)``, the identity forward, the sum over the group backward."""
    if link.group.size == 1:
        return x
    return split(SplitSpec(link, (COPY,), checked=False), [x])[0]


def reduce_from_region(x: torch.Tensor, link: Link) -> torch.Tensor:
    """Megatron's *g*: a round-free ``Join(COPY)``, the sum over the group forward, the identity backward."""
    if link.group.size == 1:
        return x
    return join(JoinSpec(link, (COPY,), "a sum of partial results", checked=False), [x])[0]


class Slice(NamedTuple):
    """How one parameter of a sharded module is split: group rank ``r`` holds ``sizes[r]`` entries along ``dim``
    of the full ``full_shape``, starting at ``first_row(sizes, r)``; this rank is group rank ``rank``. With ``parts``
    (the lengths of packed parts along ``dim``: a fused qkv or gate_up), each part is split alone and a rank holds
    its slice of every part, in order."""

    dim: int
    sizes: Tuple[int, ...]
    rank: int
    full_shape: Tuple[int, ...]
    parts: Tuple[int, ...] = ()

    @property
    def offset(self) -> int:
        return first_row(self.sizes, self.rank)

    def _pieces(self, rank: int) -> List[Tuple[int, int]]:
        """(start, length) along ``dim`` of each piece rank ``rank`` holds."""
        found, start = [], 0
        for n in self.parts:
            split = tensor_split_sizes(n, len(self.sizes))
            found.append((start + first_row(split, rank), split[rank]))
            start += n
        return found

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full tensor (a parameter, its gradient, a checkpoint entry): a view (a copy of
        the pieces, with ``parts``)."""
        if not self.parts:
            return full.narrow(self.dim, self.offset, self.sizes[self.rank])
        return torch.cat([full.narrow(self.dim, a, n) for a, n in self._pieces(self.rank)], self.dim)

    def assemble(self, gathered: torch.Tensor) -> torch.Tensor:
        """The full tensor from every rank's slice concatenated in rank order along ``dim``."""
        if not self.parts:
            return gathered
        out = torch.empty_like(gathered)
        at = 0
        for r in range(len(self.sizes)):
            for a, n in self._pieces(r):
                out.narrow(self.dim, a, n).copy_(gathered.narrow(self.dim, at, n))
                at += n
        return out


class RegionInputs:
    """The replicated inputs that entered the tensor-parallel region (*f*), shared by the column-
    parallel layers of one sharded model, so that layers reading the same tensor make one backward sum.

    An entry is reused only for the very same tensor object, unchanged (its version counter), under the same grad
    mode and function-transform level. The model's forward hooks clear it before and after each forward, and it
    keeps at most :attr:`LIMIT` entries when layers are called outside the model's forward.
    """

    LIMIT = 8

    def __init__(self, sequence: Optional[SequenceState] = None) -> None:
        self.found: Dict[int, Tuple[torch.Tensor, Tuple[Any, ...], Any]] = {}
        self.sequence = sequence  # sequence parallelism: the column-parallel inputs are this rank's rows
        self.gathered: Dict[int, Tuple[torch.Tensor, torch.Tensor, Regather]] = {}

    def gather(self, x: torch.Tensor, path: str) -> Tuple[torch.Tensor, Regather]:
        """Sequence parallelism's entry: the whole sequence of this rank's rows ``x`` (one all-gather for every
        layer reading ``x``; backward, one reduce-scatter of their summed gradients) and its :class:`Regather`."""
        seq = self.sequence
        start, count = seq.mine(seq.length)
        if x.shape[1] != count:
            raise ValueError(
                f"{CALL}: sequence_parallel=True: layer {path!r} takes this rank's {count} of the {seq.length} "
                f"positions (dim 1), but got an input of shape {tuple(x.shape)}."
            )
        state = (version_counter(x), torch.is_grad_enabled(), current_level())
        hit = self.found.get(id(x))
        if hit is not None and hit[0] is x and hit[1] == state:
            return hit[2]
        spec = seq.spec(x, seq.length, f"the sequence gather of layer {path!r}")
        full = run(AllGather, spec, x)
        entered = (full, Regather(spec))
        self._remember(x, state, entered)
        self.gathered[id(full)] = (full, x, entered[1])
        return entered

    def gather_input(self, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        """Sequence parallelism: a forward pre-hook on a module holding column-parallel layers (an attention, an
        MLP), which gathers its input's sequence on entry, so that the module sees the whole length (attention
        reshapes by it); its column-parallel layers keep only the rows for backward."""
        positional = bool(args)
        x = args[0] if positional else kwargs.get("hidden_states")
        if not isinstance(x, torch.Tensor) or self.sequence.length is None:
            return None
        if x.shape[1] == self.sequence.length and x.shape[1] != self.sequence.mine(x.shape[1])[1]:
            return None  # already whole
        full = self.gather(x, type(module).__name__)[0]
        if positional:
            return (full, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": full}

    def of_gather(self, full: torch.Tensor) -> Optional[Tuple[torch.Tensor, Regather]]:
        """The rows and :class:`Regather` of a sequence :meth:`gather` made, or None."""
        hit = self.gathered.get(id(full))
        return (hit[1], hit[2]) if hit is not None and hit[0] is full else None

    def _remember(self, x: torch.Tensor, state: Tuple[Any, ...], entered: Any) -> None:
        self.found[id(x)] = (x, state, entered)
        if len(self.found) > self.LIMIT:
            del self.found[next(iter(self.found))]

    def copy_to_region(self, x: torch.Tensor, link: Link) -> torch.Tensor:
        if link.group.size == 1 or not needs_function([x]):
            return x  # no gradient to sum, or no one to sum it with: f is the identity
        state = (version_counter(x), torch.is_grad_enabled(), current_level())
        hit = self.found.get(id(x))
        if hit is not None and hit[0] is x and hit[1] == state:
            return hit[2]
        entered = copy_to_region(x, link)
        self._remember(x, state, entered)
        return entered

    def clear(self, *_: Any) -> None:
        """Forget every entry (a forward hook: the model's forward starts or ended)."""
        self.found.clear()
        self.gathered.clear()


class _Sharded(nn.Module):
    """What the tensor-parallel layers share: the group, the module path and style in messages, and the exchanges.

    ``style`` is the :class:`~colossalai_cmap.tp.styles.ParallelStyle` that built the layer (typed ``Any``: the
    styles import the layers).
    """

    keeps_gathered = False  # sequence parallelism: keep the gathered input for backward (the LM head)

    def __init__(self, group: Group, path: str, style: Any) -> None:
        super().__init__()
        self.group, self.path, self.style = group, path, style
        self.timeout = default_timeout()

    def link(self, t: torch.Tensor) -> Link:
        return link_for(self.group, t.device, CALL, self.timeout)

    def sum_partials(self, partial: torch.Tensor) -> torch.Tensor:
        """Megatron's g: the sum over the group of every rank's partial result; backward is the identity."""
        return reduce_from_region(partial, self.link(partial))

    def slices(self) -> Dict[str, Slice]:
        """The split of each sharded parameter, by parameter name (a replicated bias is not listed)."""
        raise NotImplementedError

    def column(
        self, entries: RegionInputs, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """A column-parallel product: the replicated input entered through f, or under sequence parallelism
        this rank's rows gathered (kept sharded for backward, gathered again there)."""
        if entries.sequence is None or self.group.size == 1:
            return F.linear(entries.copy_to_region(x, self.link(x)), weight, bias)
        hit = entries.of_gather(x)
        if hit is None:
            full, regather = entries.gather(x, self.path)
        else:
            full, (x, regather) = x, hit
        if self.keeps_gathered or not needs_function([x, weight] + ([] if bias is None else [bias])):
            return F.linear(full, weight, bias)
        return LinearOnGathered.apply(full, x.detach(), regather, weight, bias)

    def scatter_sum(self, partial: torch.Tensor, sequence: Optional[SequenceState]) -> torch.Tensor:
        """Megatron's g, or under sequence parallelism the reduce-scatter to this rank's rows of the sequence."""
        if self.group.size == 1:
            return partial
        if sequence is None:
            return reduce_from_region(partial, self.link(partial))
        spec = sequence.spec(partial, partial.shape[1], f"the sequence reduce-scatter of layer {self.path!r}")
        return run(ReduceScatter, spec, partial)

    def _keep(self, name: str, full: Optional[torch.Tensor], dim: Optional[int]) -> None:
        """Register this rank's slice of ``full`` along ``dim`` (the whole of it when ``dim`` is None), a copy."""
        if full is None:
            self.register_parameter(name, None)
            return
        value = full.detach() if dim is None else self._slice(full, dim).take(full.detach())
        setattr(self, name, nn.Parameter(value.clone(), requires_grad=full.requires_grad))

    def _slice(self, full: torch.Tensor, dim: int) -> Slice:
        return Slice(dim, tensor_split_sizes(full.shape[dim], self.group.size), self.group.rank, tuple(full.shape))


class ColumnParallelLinear(_Sharded):
    """An ``nn.Linear`` split by output features (``Colwise``, or ``ColwiseGather``, whose ``gathers`` is True).

    The input is replicated; it enters through f, so its gradient is summed over the group in backward (one sum for
    every layer that reads the same tensor). The output is this rank's slice of the output features, last dim, or
    with ``gather`` every rank's slices concatenated (the full output on every rank).

    Attributes:
        weight: this rank's rows of the full ``[out_features, in_features]`` weight (``torch.tensor_split`` sizes).
        bias: this rank's slice of the full bias, or None.
    """

    def __init__(self, linear: nn.Linear, group: Group, path: str, entries: RegionInputs, style: Any) -> None:
        super().__init__(group, path, style)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.parts = style.part_lengths(linear.out_features)
        split = [tensor_split_sizes(n, group.size) for n in self.parts or (linear.out_features,)]
        self.sizes = tuple(sum(s[r] for s in split) for r in range(group.size))
        self.entries = entries
        self._keep("weight", linear.weight, 0)
        self._keep("bias", linear.bias, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.column(self.entries, x, self.weight, self.bias)
        if not self.style.gathers or self.group.size == 1:
            return out
        spec = JoinSpec(self.link(out), (Rows(out.dim() - 1, self.sizes),), f"the gather of layer {self.path!r}")
        return join(spec, [out])[0]

    def slices(self) -> Dict[str, Slice]:
        full = (self.out_features, self.in_features)
        found = {"weight": Slice(0, self.sizes, self.group.rank, full, self.parts)}
        if self.bias is not None:
            found["bias"] = Slice(0, self.sizes, self.group.rank, (self.out_features,), self.parts)
        return found

    def _slice(self, full: torch.Tensor, dim: int) -> Slice:
        return Slice(dim, self.sizes, self.group.rank, tuple(full.shape), self.parts)

    def extra_repr(self) -> str:
        return _describe(self, f"in_features={self.in_features}, out_features={self.out_features}")


class RowParallelLinear(_Sharded):
    """An ``nn.Linear`` split by input features (``Rowwise``).

    Its input is the activation a column-parallel layer left sharded: this rank's slice of the input features. The
    partial products are summed over the group by g (one exchange forward, none backward), then the whole bias is
    added once.

    Attributes:
        weight: this rank's columns of the full ``[out_features, in_features]`` weight.
        bias: the full bias (every rank holds it; added after the sum), or None.
    """

    def __init__(self, linear: nn.Linear, group: Group, path: str, style: Any, entries: RegionInputs) -> None:
        super().__init__(group, path, style)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.parts = style.part_lengths(linear.in_features)
        split = [tensor_split_sizes(n, group.size) for n in self.parts or (linear.in_features,)]
        self.sizes = tuple(sum(s[r] for s in split) for r in range(group.size))
        self.entries = entries
        self._keep("weight", linear.weight, 1)
        self._keep("bias", linear.bias, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mine = self.sizes[self.group.rank]
        if self.style.takes_replicated and x.shape[-1] == self.in_features:
            entered = self.entries.copy_to_region(x, self.link(x))
            x = Slice(x.dim() - 1, self.sizes, self.group.rank, tuple(x.shape), self.parts).take(entered)
        if x.shape[-1] != mine:
            raise ValueError(
                f"{CALL}: {self.style.name} layer {self.path!r} takes this rank's {mine} of its {self.in_features} input "
                f"features (the sharded output of a colwise layer), but got an input of shape {tuple(x.shape)}."
            )
        if not self.style.sums:
            return F.linear(x, self.weight)  # partial: a Gather module around it sums (no bias: checked)
        out = self.scatter_sum(F.linear(x, self.weight), self.entries.sequence)
        return out if self.bias is None else out + self.bias

    def slices(self) -> Dict[str, Slice]:
        return {"weight": Slice(1, self.sizes, self.group.rank, (self.out_features, self.in_features), self.parts)}

    def _slice(self, full: torch.Tensor, dim: int) -> Slice:
        return Slice(dim, self.sizes, self.group.rank, tuple(full.shape), self.parts)

    def extra_repr(self) -> str:
        return _describe(self, f"in_features={self.in_features}, out_features={self.out_features}")


class VocabParallelEmbedding(_Sharded):
    """An ``nn.Embedding`` split by vocabulary rows (``Vocab``).

    Ids outside this rank's rows contribute zero; the output is the sum over the group (g), so every rank holds the
    full embedding. The ids must be the same on every rank.

    Attributes:
        weight: this rank's rows of the full ``[num_embeddings, embedding_dim]`` weight.
    """

    def __init__(self, embedding: nn.Embedding, group: Group, path: str, style: Any, entries: RegionInputs) -> None:
        super().__init__(group, path, style)
        self.sequence = entries.sequence
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.sizes = tensor_split_sizes(embedding.num_embeddings, group.size)
        self.sparse = embedding.sparse
        self._keep("weight", embedding.weight, 0)
        start, pad = self.slices()["weight"].offset, embedding.padding_idx
        inside = pad is not None and start <= pad < start + self.sizes[group.rank]
        self.padding_idx = pad - start if inside else None  # this rank's row index of the padding row, if it holds it

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        start, count = self.slices()["weight"].offset, self.sizes[self.group.rank]
        inside = (ids >= start) & (ids < start + count)
        if count:
            local = torch.where(inside, ids - start, torch.zeros_like(ids))
            rows = F.embedding(local, self.weight, self.padding_idx, sparse=self.sparse)
            rows = rows.masked_fill(~inside.unsqueeze(-1), 0)
        else:  # more ranks than vocabulary rows: this rank holds none
            rows = self.weight.new_zeros((*ids.shape, self.embedding_dim))
        if self.sequence is None or self.group.size == 1 or ids.dim() < 2:
            return self.sum_partials(rows)
        # sequence parallelism: this rank's rows of the sum, in zeros of the whole length (see tp/sequence.py)
        return pad_to_sequence(self.sequence, self.scatter_sum(rows, self.sequence), ids.shape[1])

    def slices(self) -> Dict[str, Slice]:
        full = (self.num_embeddings, self.embedding_dim)
        return {"weight": Slice(0, self.sizes, self.group.rank, full)}

    def extra_repr(self) -> str:
        return _describe(self, f"{self.num_embeddings}, {self.embedding_dim}")


class HeadGroupLinear(_Sharded):
    """A key or value projection of grouped-query attention with fewer heads than ranks (``Colwise`` where the
    group size is a multiple of the key/value heads), replicated as in Megatron-LM and vLLM.

    Every rank holds the whole weight and computes the one head its query heads read: group rank ``r`` of ``t``
    takes head ``r * heads // t``. The weight enters through f, so its gradient (this rank's head, zeros elsewhere)
    is summed over the group in backward: each head's gradient is the sum over the ranks that used it, the same full
    gradient on every rank. The input enters through f too, shared with the query projection.

    Attributes:
        weight: the full ``[out_features, in_features]`` weight (replicated).
        bias: the full bias (replicated), or None.
    """

    def __init__(
        self, linear: nn.Linear, group: Group, path: str, entries: RegionInputs, style: Any, head_dim: int
    ) -> None:
        super().__init__(group, path, style)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.heads, self.head_dim, self.entries = linear.out_features // head_dim, head_dim, entries
        self.head = group.rank * self.heads // group.size
        self._keep("weight", linear.weight, None)
        self._keep("bias", linear.bias, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        start, link = self.head * self.head_dim, self.link(x)
        weight, bias = (self._copy_to_region(p, link) for p in (self.weight, self.bias))
        bias = None if bias is None else bias.narrow(0, start, self.head_dim)
        return self.column(self.entries, x, weight.narrow(0, start, self.head_dim), bias)

    def _copy_to_region(self, p: Optional[torch.Tensor], link: Link) -> Optional[torch.Tensor]:
        return p if p is None else copy_to_region(p, link)

    def slices(self) -> Dict[str, Slice]:
        return {}  # replicated

    def extra_repr(self) -> str:
        sizes = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{sizes}, style={self.style!r}, head {self.head} of {self.heads} on rank {self.group.rank}"


class SequenceRows:
    """Hooks that run a module (a norm) on this rank's rows of the sequence (dim 1) and gather its output
    (``Sequence``); the module stays in place, so its parameters keep their names.

    The input enters through ``Split`` of rows (this rank's rows; backward gathers the input gradient), the output
    leaves through ``Join`` of rows (every rank's rows; backward takes this rank's rows), and the parameters'
    gradients are summed over the group (each rank's rows contribute a part), in one all-reduce after each backward
    (:class:`~.sequence.GradSums`).
    """

    def __init__(self, module: nn.Module, group: Group, path: str, style: Any) -> None:
        self.group, self.path, self.style, self.timeout = group, path, style, default_timeout()
        self.sizes: Optional[Tuple[int, ...]] = None
        if group.size > 1:
            module.register_forward_pre_hook(self.split_rows)
            module.register_forward_hook(self.gather_sequence)
            sums = GradSums(group, self.timeout)
            for p in module.parameters():
                if p.requires_grad:
                    sums.add(p)

    def link(self, t: torch.Tensor) -> Link:
        return link_for(self.group, t.device, CALL, self.timeout)

    def split_rows(self, module: nn.Module, args: Tuple[Any, ...]) -> Tuple[Any, ...]:
        x = args[0]
        self.sizes = tensor_split_sizes(x.shape[1], self.group.size)
        mine = split(SplitSpec(self.link(x), (Rows(1, self.sizes),)), [x])[0]
        return (mine, *args[1:])

    def gather_sequence(self, module: nn.Module, args: Tuple[Any, ...], out: Any) -> Any:
        first = out[0] if isinstance(out, tuple) else out
        spec = JoinSpec(self.link(first), (Rows(1, self.sizes),), f"the gather of sequence-parallel {self.path!r}")
        whole = join(spec, [first])[0]
        return (whole, *out[1:]) if isinstance(out, tuple) else whole


def sum_output(group: Group, path: str) -> Any:
    """A forward hook that sums a module's output (its first, if a tuple) over ``group`` (Megatron's g)."""
    timeout = default_timeout()

    def hook(module: nn.Module, args: Tuple[Any, ...], out: Any) -> Any:
        if group.size == 1:
            return out
        first = out[0] if isinstance(out, tuple) else out
        whole = reduce_from_region(first, link_for(group, first.device, CALL, timeout))
        return (whole, *out[1:]) if isinstance(out, tuple) else whole

    return hook


def _describe(layer: _Sharded, sizes: str) -> str:
    shape = tuple(layer.weight.shape)
    return f"{sizes}, style={layer.style!r}, shard={shape} on rank {layer.group.rank} of {layer.group.size}"


PARALLEL_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, HeadGroupLinear)
