"""Keyword batches: ``kwarg_dims`` maps keyword arguments (``model(**batch)``), a ``BatchEncoding`` (any Mapping)
splits like a dict, and ``mode="batched"`` refuses a batch-sized keyword passed whole, at every P.

The oracle is the model on the whole batch in one process (float64, so that the tolerances are those of rows
computed in another blocking), or ``torch.vmap`` of a function taking the keywords positionally."""

import pytest
import torch
import torch.distributed as dist
from cases import assert_same
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_real_models import VOCAB, tiny  # BERT, GPT-2, Llama, Qwen2 from configs: float64, eager attention
from torch.utils._pytree import tree_map

import colossalai_cmap as cm

CLOSE = {"rtol": 1e-10, "atol": 1e-10}  # float64: rows computed in another blocking, a few roundings apart
B, T = 5, 7


def _rank_size():
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def bert():
    """A tiny ``BertModel`` (BertForMaskedLM's encoder, no pooler): float64, eager attention, dropout off."""
    return tiny("bert").bert


def padded_batch(rows=B, seed=3):
    """Token ids and an attention mask whose rows are padded at the end by different amounts."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (rows, T), generator=gen)
    mask = torch.ones(rows, T, dtype=torch.long)
    for r in range(rows):
        pad = r % 4
        if pad:
            mask[r, T - pad :] = 0
            ids[r, T - pad :] = 0
    return ids, mask


def tokenizer():
    """A real fast tokenizer, built offline: word level, whitespace pre-tokenizer, [PAD] and [UNK]."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    words = "the a cat dog sat on mat ran far away and then slept quietly".split()
    vocab = {"[PAD]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")


TEXTS = ["the cat sat on the mat", "a dog ran", "the dog ran far away and then slept", "cat", "a cat slept quietly"]


def _rows(tree, start, count):
    return tree_map(lambda v: v.narrow(0, start, count) if isinstance(v, torch.Tensor) and v.dim() else v, tree)


def _share(B_, size, rank):
    """(start, rows) of this rank's rows with dst="local": torch.tensor_split's."""
    sizes = [p.shape[0] for p in torch.empty(B_, 0).tensor_split(size)]
    return sum(sizes[:rank]), sizes[rank]


def _placed_call(model, kwargs, src, dst, **opts):
    """``cmap(model, mode="batched", kwarg_dims=0)(**kwargs)`` with ``src`` and ``dst``: each rank passes what that
    placement asks of it. Returns (result, the rows of the whole batch this rank should hold, or None)."""
    rank, size = _rank_size()
    mapped = cm.cmap(model, mode="batched", kwarg_dims=0, src=src, dst=dst, **opts)
    n = next(v for v in kwargs.values() if isinstance(v, torch.Tensor)).shape[0]
    if src == "local":
        start, rows = _share(n, size, rank)
        call = {k: _rows(v, start, rows) for k, v in kwargs.items()}
    elif isinstance(src, int) and rank != src:
        call = {k: (None if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    else:
        call = kwargs
    out = mapped(**call)
    if dst == "local":  # this rank's rows: its own shard, or torch.tensor_split's
        return out, _share(n, size, rank)
    if dst != -1 and rank != dst:
        return out, None
    return out, (0, n)


PLACEMENTS = [(src, dst) for src in (None, "local", "last") for dst in (-1, "local", 0)]


def check_models_every_placement():
    """BERT, GPT-2, Llama and Qwen2 with a padded attention mask, called with keywords only: what the model gives on
    the whole batch, for every src and dst."""
    rank, size = _rank_size()
    ids, mask = padded_batch()
    cases = [
        ("bert", bert(), dict(input_ids=ids, attention_mask=mask)),
        ("gpt2", tiny("gpt2"), dict(input_ids=ids, attention_mask=mask, use_cache=False)),
        ("llama", tiny("llama"), dict(input_ids=ids, attention_mask=mask, use_cache=False)),
        ("qwen2", tiny("qwen2"), dict(input_ids=ids, attention_mask=mask, use_cache=False)),
    ]
    done = 0
    for name, model, kwargs in cases:
        with torch.no_grad():
            whole = model(**kwargs)
        for src, dst in PLACEMENTS:
            src = size - 1 if src == "last" else src
            with torch.no_grad():
                out, rows = _placed_call(model, kwargs, src, dst)
            what = f"{name} src={src!r} dst={dst!r}"
            if rows is None:
                assert out is None, what
            else:
                assert_same(out, _rows(whole, *rows), CLOSE, what)
            done += 1
    return done


def check_gradients():
    """dst=-1: the model's parameter gradients and a mapped keyword tensor's (``inputs_embeds``) are those of the
    whole batch; the loss of GPT-2 computed from the gathered logits is the model's own ``labels=`` loss."""
    ids, mask = padded_batch()
    weights = torch.linspace(-1, 1, 32, dtype=torch.float64)
    got_model, want_model = bert(), bert()
    embeds = want_model.embeddings.word_embeddings(ids).detach()
    e_got, e_want = embeds.clone().requires_grad_(), embeds.clone().requires_grad_()
    out = cm.cmap(got_model, mode="batched", kwarg_dims=0)(inputs_embeds=e_got, attention_mask=mask)
    (out.last_hidden_state * weights).sum().backward()
    (want_model(inputs_embeds=e_want, attention_mask=mask).last_hidden_state * weights).sum().backward()
    torch.testing.assert_close(e_got.grad, e_want.grad, **CLOSE)
    for (n, p), q in zip(got_model.named_parameters(), want_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **CLOSE, msg=lambda m: f"bert {n}: {m}")
    # GPT-2: the logits through cmap, the loss after the call (or labels=: test_whole_batch_loss.py)
    got_model, want_model = tiny("gpt2"), tiny("gpt2")
    labels = ids.masked_fill(mask == 0, -100)
    logits = cm.cmap(got_model, mode="batched", kwarg_dims=0)(input_ids=ids, attention_mask=mask, use_cache=False)
    loss = got_model.loss_function(logits.logits, labels, vocab_size=got_model.config.vocab_size)
    want = want_model(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(loss, want.loss, **CLOSE)
    loss.backward()
    want.loss.backward()
    for (n, p), q in zip(got_model.named_parameters(), want_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **CLOSE, msg=lambda m: f"gpt2 {n}: {m}")
    return True


def check_scaled_loss_refused():
    """A scalar func computed from the model's loss (``labels=``) after the model: not per example, and not known to
    be the whole batch's; refused alike at every P, saying what to do. The message, for comparing across P. (The
    model's loss itself is the whole batch's: test_whole_batch_loss.py.)"""
    ids, mask = padded_batch()
    model = tiny("gpt2")
    with pytest.raises(cm.CmapError, match=r"output 0 is a scalar") as info:
        cm.cmap(lambda **kw: model(**kw).loss / 2, mode="batched", kwarg_dims=0)(
            input_ids=ids, attention_mask=mask, labels=ids
        )
    assert "model.loss_function(logits, labels" in str(info.value)
    return str(info.value).split("raised IndexError: ")[1].splitlines()[0]


def check_batch_encoding():
    """A tokenizer's BatchEncoding: via ``**`` with kwarg_dims=0, and positionally (split like a dict; func gets a
    BatchEncoding); the second call takes the fast path."""
    from transformers import BatchEncoding

    rank, size = _rank_size()
    batch = tokenizer()(TEXTS, padding=True, return_tensors="pt")
    assert isinstance(batch, BatchEncoding) and batch["attention_mask"].eq(0).any()
    model = bert()
    with torch.no_grad():
        whole = model(**batch)
        mapped = cm.cmap(model, mode="batched", kwarg_dims=0)
        for call in range(2):
            assert_same(mapped(**batch), whole, CLOSE, f"**batch, call {call}")
        if size > 1:
            assert mapped.stats.fast_path, "the second call with the same keyword shapes takes the fast path"
        seen = []

        def positional(encoding):
            seen.append(type(encoding))
            return model(**encoding).last_hidden_state

        got = cm.cmap(positional, mode="batched")(batch)
        assert_same(got, whole.last_hidden_state, CLOSE, "positional BatchEncoding")
        assert seen == [BatchEncoding], seen
        # vmap mode: per example, a BatchEncoding of one row's tensors
        lengths = cm.cmap(lambda enc: enc["attention_mask"].sum())(batch)
        assert_same(lengths, batch["attention_mask"].sum(1), True, "vmap over a BatchEncoding")
        # src=r: the other ranks pass None for the encoding's tensors
        src = size - 1
        call = batch if rank == src else {k: None for k in batch}
        got = cm.cmap(model, mode="batched", kwarg_dims=0, src=src)(**call)
        assert_same(got, whole, CLOSE, "src=r with **batch")
    return True


def check_whole_keyword_refused():
    """Without kwarg_dims, mode='batched' refuses a batch-sized keyword passed whole (the same message at every P);
    ``kwarg_dims={name: None}`` keeps it whole on request; vmap and loop modes keep vmap's semantics."""
    ids, mask = padded_batch()
    model = bert()
    with pytest.raises(cm.CmapError, match="keyword argument 'attention_mask'") as info:
        cm.cmap(model, mode="batched")(ids, attention_mask=mask)
    text = str(info.value).split("raised ValueError: ")[1].splitlines()[0]
    assert "as in torch.vmap" in text and "kwarg_dims=0" in text, text
    assert "kwarg_dims={'attention_mask': None}" in text and "in_dims=None" not in text, text
    # whole by request: each rank's rows see the whole mask's first rows only if shapes fit; here a per-column mask
    col = torch.ones(T, dtype=torch.long)
    with torch.no_grad():
        whole = model(ids, attention_mask=col.expand(B, T))
        kept = cm.cmap(
            lambda i, attention_mask: model(i, attention_mask=attention_mask.expand(i.shape[0], T)),
            mode="batched",
            kwarg_dims={"attention_mask": None},
        )(ids, attention_mask=col)
    assert_same(kept, whole, CLOSE, "a keyword kept whole on request")
    # the dict form maps the names it gives, and refuses the batch-sized ones it does not name
    with pytest.raises(cm.CmapError, match="keyword argument 'attention_mask'"):
        cm.cmap(model, mode="batched", kwarg_dims={"input_ids": 0})(input_ids=ids, attention_mask=mask)
    # vmap and loop modes: keywords whole, as in torch.vmap (no error)
    x, w = torch.randn(B, 3, dtype=torch.float64), torch.randn(B, 3, dtype=torch.float64)
    expected = torch.vmap(lambda v, w: v @ w.sum(0))(x, w=w)
    for mode in ("vmap", "loop"):
        assert_same(cm.cmap(lambda v, w: v @ w.sum(0), mode=mode)(x, w=w), expected, CLOSE, mode)
    # all inputs as keywords and no kwarg_dims: vmap's "no inputs", saying how to map them
    with pytest.raises(cm.CmapError, match="unless kwarg_dims maps them"):
        cm.cmap(model, mode="batched")(input_ids=ids, attention_mask=mask)
    return text


def check_transforms_and_compile():
    """Mapped keywords under torch.func transforms, as positional args; under torch.compile, an eager call (a graph
    break) with the same values, and fullgraph=True names kwarg_dims."""
    x = torch.randn(B, 3, dtype=torch.float64)
    w = torch.randn(B, 3, dtype=torch.float64)

    def f(v, *, w):
        return (v * w).sin().sum()

    def g(v, w):
        return (v * w).sin().sum()

    got = torch.func.grad(lambda w_: cm.cmap(f, kwarg_dims=0)(x, w=w_).sum())(w)
    want = torch.func.grad(lambda w_: torch.vmap(g)(x, w_).sum())(w)
    torch.testing.assert_close(got, want, **CLOSE)
    jac = torch.func.jacrev(lambda w_: cm.cmap(f, kwarg_dims={"w": 0})(x, w=w_))(w)
    torch.testing.assert_close(jac, torch.func.jacrev(lambda w_: torch.vmap(g)(x, w_))(w), **CLOSE)
    # src=r in vmap mode: the other ranks pass None for the mapped positional and keyword tensors
    rank, size = _rank_size()
    src = size - 1
    for kwarg_dims in (0, {"w": 0}):
        got = cm.cmap(f, kwarg_dims=kwarg_dims, src=src)(x if rank == src else None, w=w if rank == src else None)
        assert_same(got, torch.vmap(g)(x, w), CLOSE, f"src={src} kwarg_dims={kwarg_dims}")
    # with an int, the other ranks may leave the mapped keywords out
    got = cm.cmap(f, kwarg_dims=0, src=src)(x if rank == src else None, **({"w": w} if rank == src else {}))
    assert_same(got, torch.vmap(g)(x, w), CLOSE, f"src={src}, w left out on the other ranks")
    mapped = cm.cmap(f, kwarg_dims=0)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(mapped, backend="aot_eager")(x, w=w), torch.vmap(g)(x, w), **CLOSE)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match="kwarg_dims maps keyword arguments"):
        torch.compile(mapped, fullgraph=True, backend="aot_eager")(x, w=w)
    torch._dynamo.reset()
    return True


@pytest.mark.parametrize("P", [1, 2, 3])
def test_models_every_placement(worlds, P):
    assert worlds(P).run(check_models_every_placement, deadline=600) == [4 * len(PLACEMENTS)] * P


@pytest.mark.parametrize("P", [1, 2, 3])
def test_gradients(worlds, P):
    assert worlds(P).run(check_gradients, deadline=300) == [True] * P


@pytest.mark.parametrize("P", [1, 2, 3])
def test_batch_encoding(worlds, P):
    assert worlds(P).run(check_batch_encoding, deadline=300) == [True] * P


def test_errors_do_not_depend_on_P(worlds):
    """The same message at P=1, 2 and 3, on every rank: a batch-sized keyword passed whole, and a scalar loss."""
    texts = {P: worlds(P).run(check_whole_keyword_refused, deadline=300) for P in (1, 2, 3)}
    assert len({t for ranks in texts.values() for t in ranks}) == 1, texts
    losses = {P: worlds(P).run(check_scaled_loss_refused, deadline=300) for P in (1, 2, 3)}
    assert len({t for ranks in losses.values() for t in ranks}) == 1, losses


@pytest.mark.parametrize("P", [1, 2])
def test_transforms_and_compile(worlds, P):
    assert worlds(P).run(check_transforms_and_compile, deadline=300) == [True] * P


def test_options_checked():
    with pytest.raises(ValueError, match="expected `kwarg_dims` to be None"):
        cm.cmap(torch.sin, kwarg_dims="0")
    with pytest.raises(ValueError, match="expected `kwarg_dims`"):
        cm.cmap(torch.sin, kwarg_dims=True)


# ------------------------------------------------------------------------------------- the property
def check_kwarg_property(B_, shapes, dims, dict_form, mode):
    """cmap(f, kwarg_dims=...)(x, a=A, b=C) against torch.vmap of f taking the keywords positionally."""
    gen = torch.Generator().manual_seed(B_ * 31 + len(shapes))
    x = torch.randn(B_, 2, generator=gen, dtype=torch.float64)
    values = {}
    for name, shape, d in zip("ab", shapes, dims):
        full = list(shape)
        if d is not None:
            full.insert(d % (len(shape) + 1), B_)
        values[name] = torch.randn(*full, generator=gen, dtype=torch.float64)

    def per_example(v, a, b):
        return v.sum() * a.sin() + b.cos().sum()

    def keyworded(v, *, a, b):
        if mode == "batched":  # a batch of examples: the per-example function vmapped here
            return torch.vmap(per_example, in_dims=(0, *oracle_dims[1:]))(v, a, b)
        return per_example(v, a, b)

    oracle_dims = (0, dims[0], dims[1])
    expected = torch.vmap(per_example, in_dims=oracle_dims)(x, values["a"], values["b"])
    kwarg_dims = dict(zip("ab", dims)) if dict_form else dims[0]
    got = cm.cmap(keyworded, kwarg_dims=kwarg_dims, mode=mode)(x, **values)
    assert_same(got, expected, CLOSE, f"B={B_} shapes={shapes} dims={dims} dict={dict_form} mode={mode}")
    return True


@st.composite
def kwarg_cases(draw):
    P = draw(st.integers(1, 3))
    B_ = draw(st.integers(1, 7))
    shapes = [tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=2))) for _ in range(2)]
    dict_form = draw(st.booleans())
    if dict_form:  # each keyword its own dim (negative ones too), or None: passed whole
        dims = [draw(st.sampled_from(list(range(-len(s) - 1, len(s) + 1)) + [None])) for s in shapes]
    else:  # one int for every keyword: valid for the one with fewer dims
        n = min(len(s) for s in shapes)
        dims = [draw(st.sampled_from(range(-n - 1, n + 1)))] * 2
    mode = draw(st.sampled_from(["vmap", "loop", "batched"]))
    return P, B_, shapes, dims, dict_form, mode


@settings(max_examples=24, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(kwarg_cases())
def test_kwarg_dims_property(worlds, case):
    P, B_, shapes, dims, dict_form, mode = case
    assert worlds(P).run(check_kwarg_property, B_, shapes, dims, dict_form, mode, deadline=120) == [True] * P
