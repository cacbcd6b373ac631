"""sdpa.transformers: tiny random-weight transformers models with
``attn_implementation=sdpa.transformers.register()`` against the same models on
transformers' ``"eager"`` attention, and the decomposition of transformers' masks."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
masking_utils = pytest.importorskip("transformers.masking_utils")

import sdpa  # noqa: E402
import sdpa.transformers as st  # noqa: E402

VOCAB = 97
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)

# name: (config class, model class, config arguments, decoder-only)
MODELS = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=2)),
    "llama-gqa": ("LlamaConfig", "LlamaForCausalLM", dict(SMALL, num_key_value_heads=2)),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(SMALL, num_key_value_heads=2, sliding_window=5)),
    "gemma2-softcap-window": ("Gemma2Config", "Gemma2ForCausalLM",
                              dict(SMALL, num_key_value_heads=2, head_dim=8, sliding_window=5,
                                   attn_logit_softcapping=1.5, final_logit_softcapping=None,
                                   query_pre_attn_scalar=12)),
    "gpt-oss-sinks": ("GptOssConfig", "GptOssForCausalLM",
                      dict(SMALL, intermediate_size=32, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                           num_experts_per_tok=2, sliding_window=4,
                           layer_types=["sliding_attention", "full_attention"])),
}


@pytest.fixture(scope="module")
def name():
    return st.register()


def build(kind, dtype=torch.float32, **overrides):
    config_class, model_class, arguments = MODELS[kind]
    config = getattr(transformers, config_class)(**dict(arguments, **overrides))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = getattr(transformers, model_class)(config)
        if kind.startswith("gpt-oss"):  # sinks large enough to matter
            for layer in model.model.layers:
                layer.self_attn.sinks.data.normal_(0.0, 1.0)
    return model.to(dtype).eval()


def prompt(batch=3, length=11, left_padding=(0, 4, 7)):
    ids = torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    for b, pad in enumerate(left_padding[:batch]):
        mask[b, :pad] = 0
        ids[b, :pad] = 0
    return ids, mask


@pytest.fixture
def calls(monkeypatch):
    """The arguments of every sdpa call of sdpa.transformers; torch's own SDPA
    raises if anything reaches it."""
    seen = []
    attention = st._attention

    def spy(query, key, value, attn_mask=None, **kwargs):
        seen.append(dict(kwargs, query=query, key=key, attn_mask=attn_mask))
        return attention(query, key, value, attn_mask, **kwargs)

    def refuse(*args, **kwargs):
        raise AssertionError("torch's scaled_dot_product_attention was called")

    monkeypatch.setattr(st, "_attention", spy)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", refuse)
    return seen


def close(got, expected, tol):
    scale = max(1.0, expected.abs().max().item())
    assert (got - expected).abs().max().item() <= tol * scale


def generate(model, ids, mask, tokens=6):
    return model.generate(ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                          do_sample=False, pad_token_id=0)


# --------------------------------------------------------------------------- registration


def test_register_returns_the_name_and_refuses_transformers_own(name):
    from transformers import AttentionInterface

    assert name == st.DEFAULT_NAME == "cpu_attention"
    assert "sdpa" not in name
    assert AttentionInterface._global_mapping[name] is st.attention_forward
    assert masking_utils.AttentionMaskInterface._global_mapping[name] is masking_utils.sdpa_mask
    assert st.register() == name  # again: harmless
    assert st.register("cpu_attention_2") == "cpu_attention_2"
    for reserved in ("sdpa", "sdpa_cpu", "my_flash", "flex_attention", "paged|x", "org/kernel", "eager"):
        with pytest.raises(ValueError, match="name"):
            st.register(reserved)
    with pytest.raises(TypeError):
        st.register("")


def test_a_name_transformers_or_another_library_uses_is_refused(name, monkeypatch):
    from transformers import AttentionInterface

    monkeypatch.setitem(AttentionInterface._global_mapping, "someone_else", lambda *a, **k: None)
    with pytest.raises(ValueError, match="already"):
        st.register("someone_else")


def test_a_mask_function_another_library_registered_is_left_alone(name, monkeypatch):
    """Only AttentionInterface was checked: register() replaced another
    library's AttentionMaskInterface entry of the same name."""
    from transformers import AttentionInterface

    def their_mask(*args, **kwargs):
        return None

    masks = masking_utils.AttentionMaskInterface._global_mapping
    monkeypatch.setitem(masks, "other_lib", their_mask)
    with pytest.raises(ValueError, match="already names another attention mask function"):
        st.register("other_lib")
    assert masks["other_lib"] is their_mask
    assert "other_lib" not in AttentionInterface._global_mapping  # neither registry written


def test_imports_have_no_side_effects():
    code = (
        "import sys, sdpa\n"
        "print('torch' in sys.modules, 'transformers' in sys.modules)\n"
        "import sdpa.transformers\n"
        "print('transformers' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "False", "False"]


# --------------------------------------------------------------------------- decoder models


@pytest.mark.parametrize("kind", list(MODELS))
def test_decoder_model_matches_eager(kind, name, calls):
    """Logits of a left-padded batch and greedy generation match "eager"; every
    attention call goes to sdpa, with the model's variants as sdpa arguments and
    no (L, S) mask."""
    model = build(kind)
    ids, mask = prompt()
    with torch.no_grad():
        model.set_attn_implementation("eager")
        expected = model(ids, attention_mask=mask).logits
        expected_ids = generate(model, ids, mask)
        model.set_attn_implementation(name)
        calls.clear()
        got = model(ids, attention_mask=mask).logits
        got_ids = generate(model, ids, mask)
        unpadded = model(ids[:1]).logits  # transformers builds no mask at all here

    valid = mask.bool()  # padding positions differ: "eager" averages there, sdpa gives zeros
    close(got[valid], expected[valid], 1e-5)
    close(unpadded[0], expected[0], 1e-5)
    assert torch.equal(got_ids, expected_ids)
    assert got_ids.shape == (3, 11 + 6)

    layers = model.config.num_hidden_layers
    assert len(calls) == layers * (1 + 6 + 1)  # the batch, 6 forward passes of generate(), the unpadded prompt
    for call in calls:
        m = call["attn_mask"]
        assert m is None or m.shape[-2] == 1, "a dense (L, S) mask went to sdpa"
        assert call["query"].dtype == np.float32
        assert call.get("enable_gqa") == (kind != "gpt2")
        assert call["scale"] == pytest.approx(model.model.layers[0].self_attn.scaling if kind != "gpt2"
                                              else 8 ** -0.5)
    prefill = calls[:layers]
    assert all(c["is_causal"] in (True, "top_left", "bottom_right") for c in prefill)
    if kind.startswith("gemma2"):
        assert all(c["softcap"] == 1.5 for c in calls)
    if kind.startswith("gpt-oss"):
        sinks = model.model.layers[0].self_attn.sinks.detach().numpy()
        np.testing.assert_array_equal(calls[0]["sinks"], sinks)
    if kind in ("mistral-window", "gemma2-softcap-window", "gpt-oss-sinks"):
        window = model.config.sliding_window
        assert any(c.get("window") == (window - 1, 0) for c in calls)


def test_static_cache_generation_reads_only_the_filled_keys(name, calls):
    """A static cache hands attention all its slots, the empty ones masked: they
    are cut off (no mask), and generation matches "eager"."""
    model = build("llama-gqa")
    ids, mask = prompt()
    with torch.no_grad():
        model.set_attn_implementation("eager")
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
                                  cache_implementation="static")
        model.set_attn_implementation(name)
        got = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
                             cache_implementation="static")
    assert torch.equal(got, expected)
    decode = [c for c in calls if c["query"].shape[-2] == 1]
    assert decode and all(c["key"].shape[-2] <= 11 + 4 for c in decode)
    assert [c["key"].shape[-2] for c in decode[::2]] == [12, 13, 14]  # the filled slots, per step


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_16bit_model_runs_natively(dtype, name, calls):
    if dtype == torch.bfloat16:
        pytest.importorskip("ml_dtypes")
    model = build("llama-gqa", dtype)
    ids, mask = prompt()
    with torch.no_grad():
        model.set_attn_implementation("eager")
        expected = model(ids, attention_mask=mask).logits.float()
        model.set_attn_implementation(name)
        calls.clear()
        got = model(ids, attention_mask=mask).logits.float()
        generated = generate(model, ids, mask, tokens=3)
    assert calls and all(c["query"].dtype.itemsize == 2 and c["out"].dtype.itemsize == 2 for c in calls)
    valid = mask.bool()
    close(got[valid], expected[valid], 0.05 if dtype == torch.bfloat16 else 0.01)
    assert generated.shape == (3, 14)


# --------------------------------------------------------------------------- encoder models


def test_bert_right_padding_goes_to_key_lengths(name, calls):
    config = transformers.BertConfig(**SMALL)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.BertModel(config).eval()
    ids = torch.randint(3, VOCAB, (3, 10), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[2, 3:] = 0
    with torch.no_grad():
        model.set_attn_implementation("eager")
        expected = model(ids, attention_mask=mask).last_hidden_state
        model.set_attn_implementation(name)
        calls.clear()
        got = model(ids, attention_mask=mask).last_hidden_state
    close(got[mask.bool()], expected[mask.bool()], 1e-5)
    assert len(calls) == 2
    for call in calls:
        assert call["attn_mask"] is None and call["is_causal"] is False
        assert call["key_lengths"].tolist() == [10, 7, 3]


def test_t5_position_bias_and_padding(name, calls):
    """T5 passes its relative position bias to the attention function: it goes
    to sdpa as the float mask, the padding as key_lengths, the decoder's
    causality as is_causal."""
    config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.T5ForConditionalGeneration(config).eval()
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    decoder_ids = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        model.set_attn_implementation("eager")
        expected = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
        expected_ids = model.generate(ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False)
        model.set_attn_implementation(name)
        calls.clear()
        got = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
        got_ids = model.generate(ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    close(got, expected, 1e-5)
    assert torch.equal(got_ids, expected_ids)
    forward = calls[:2 + 2 * 2]  # encoder self-attention, then decoder self- and cross-attention
    assert all(c["scale"] == 1.0 and c["attn_mask"].dtype == np.float32 for c in forward)
    assert [c["key_lengths"].tolist() for c in forward[:2]] == [[9, 6]] * 2
    assert [c["is_causal"] for c in forward[2:]] == [True, False, True, False]


# --------------------------------------------------------------------------- what is refused


def test_other_devices_and_dtypes_are_refused():
    q = torch.zeros(1, 2, 3, 4, device="meta")
    with pytest.raises(ValueError, match="CPU"):
        st.attention_forward(torch.nn.Module(), q, q, q, None)
    q = torch.zeros(1, 2, 3, 4, dtype=torch.int32)
    with pytest.raises(TypeError, match="query: expected float32"):
        st.attention_forward(torch.nn.Module(), q, q, q, None)


def test_output_attentions_gives_the_weights(name):
    model = build("llama-gqa")
    ids, mask = prompt()
    with torch.no_grad():
        model.set_attn_implementation("eager")
        expected = model(ids, attention_mask=mask, output_attentions=True).attentions
        model.set_attn_implementation(name)
        got = model(ids, attention_mask=mask, output_attentions=True).attentions
    assert len(got) == len(expected) == 2
    rows = mask.bool()[:, None, :, None]  # query rows that are not padding
    for g, e in zip(got, expected):
        assert g.shape == e.shape
        close(g * rows, e * rows, 1e-5)


# --------------------------------------------------------------------------- the attention function itself


def reference(q, k, v, mask=None, scale=None, bias=None):
    """float64 attention with a bool or float mask; rows seeing no key give zeros."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    scores = q.double() @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if bias is not None:
        scores = scores + bias.double()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.double()
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return (weights @ v).transpose(1, 2)


class Layer(torch.nn.Module):
    is_causal = False


def test_a_mask_of_another_form_goes_to_sdpa_as_it_is(calls):
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=g) for _ in range(3))
    k, v = k[:, :2, :5], v[:, :2, :5]
    for mask in (torch.rand(2, 1, 6, 5, generator=g) < 0.6, torch.randn(2, 1, 6, 5, generator=g),
                 torch.rand(2, 4, 6, 5, generator=g) < 0.6):
        calls.clear()
        out, weights = st.attention_forward(Layer(), q, k, v, mask, scaling=0.3)
        assert weights is None and out.shape == (2, 6, 4, 8) and out.is_contiguous()
        assert calls[0]["attn_mask"].shape == mask.shape
        torch.testing.assert_close(out, reference(q, k, v, mask, 0.3).float(), rtol=2e-5, atol=2e-5)


def test_sinks_of_a_float64_model_keep_their_precision():
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 4, 6, 8, generator=g, dtype=torch.float64) for _ in range(3))
    k, v = k[:, :2], v[:, :2]
    sinks = torch.randn(4, generator=g, dtype=torch.float64) * 3
    out, _ = st.attention_forward(Layer(), q, k, v, None, scaling=0.3, s_aux=sinks)
    want = sdpa.reference.scaled_dot_product_attention(
        q.numpy(), k.numpy(), v.numpy(), scale=0.3, enable_gqa=True, sinks=sinks.numpy()
    )
    np.testing.assert_allclose(out.transpose(1, 2).numpy(), want, rtol=1e-12, atol=1e-12)


def test_position_bias_with_a_mask_of_another_form():
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=g) for _ in range(3))
    bias = torch.randn(1, 4, 6, 6, generator=g)
    mask = torch.rand(2, 1, 6, 6, generator=g) < 0.6
    out, _ = st.attention_forward(Layer(), q, k, v, mask, scaling=1.0, position_bias=bias)
    torch.testing.assert_close(out, reference(q, k, v, mask, 1.0, bias).float(), rtol=2e-5, atol=2e-5)


def test_without_a_mask_a_causal_layer_is_causal_for_a_prompt_only():
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g) for _ in range(3))
    layer = Layer()
    layer.is_causal = True
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    torch.testing.assert_close(st.attention_forward(layer, q, k, v, None)[0], reference(q, k, v, causal).float())
    last = q[:, :, -1:]  # one new token sees every key
    torch.testing.assert_close(st.attention_forward(layer, last, k, v, None)[0], reference(last, k, v).float())
    # is_causal given by the call wins over the layer's
    torch.testing.assert_close(st.attention_forward(layer, q, k, v, None, is_causal=False)[0],
                               reference(q, k, v).float())
    # a window of 2: the query's own position and the one before
    band = causal & torch.ones(5, 5, dtype=torch.bool).triu(-1)
    torch.testing.assert_close(st.attention_forward(layer, q, k, v, None, sliding_window=2)[0],
                               reference(q, k, v, band).float())
    torch.testing.assert_close(st.attention_forward(layer, last, k, v, None, sliding_window=2)[0],
                               reference(last, k[:, :, -2:], v[:, :, -2:]).float())


# --------------------------------------------------------------------------- taking masks apart


def rebuild(layout, batch, L, S):
    """The bool mask (batch, 1, L, S) a layout stands for, by sdpa's definitions."""
    keys = layout.keys
    o = 0 if layout.is_causal in (True, "top_left") else keys - L
    i = torch.arange(L)[:, None] + o
    j = torch.arange(keys)[None, :]
    band = torch.ones(L, keys, dtype=torch.bool)
    if layout.is_causal:
        band &= j <= i
    if layout.window is not None:
        band &= j >= i - layout.window[0]
    padding = torch.ones(batch, keys, dtype=torch.bool)
    if layout.key_lengths is not None:
        padding = j < torch.from_numpy(layout.key_lengths)[:, None]
    if layout.key_mask is not None:
        padding = layout.key_mask[:, 0, 0]
    mask = torch.zeros(batch, 1, L, S, dtype=torch.bool)
    mask[:, 0, :, :keys] = padding[:, None, :] & band
    return mask


def hf_mask(L, S, q_offset, kv_offset, padding, window=None, causal=True):
    if causal:
        function = masking_utils.causal_mask_function if window is None else \
            masking_utils.sliding_window_causal_mask_function(window)
    else:
        function = masking_utils.bidirectional_mask_function
    return masking_utils.sdpa_mask(
        batch_size=padding.shape[0], q_length=L, kv_length=S, q_offset=q_offset, kv_offset=kv_offset,
        mask_function=function, attention_mask=padding, allow_is_causal_skip=False, local_size=window)


CASES = {
    # name: (L, S, q_offset, kv_offset, window, expected padding form)
    "prompt": (7, 7, 0, 0, None, None),
    "prompt-window": (9, 9, 0, 0, 3, None),
    "decode": (1, 9, 8, 0, None, None),
    "decode-window": (1, 9, 8, 0, 4, None),
    "chunk-after-cache": (3, 10, 7, 0, None, None),
    "static-cache": (3, 16, 7, 0, None, None),
    "sliding-cache": (1, 4, 12, 9, 4, None),
}


@pytest.mark.parametrize("padding", ["none", "right", "left", "holes"])
@pytest.mark.parametrize("case", list(CASES))
def test_transformers_masks_are_taken_apart_exactly(case, padding):
    L, S, q_offset, kv_offset, window, _ = CASES[case]
    total = kv_offset + S
    pad = torch.ones(3, total, dtype=torch.bool)
    filled = q_offset + L  # tokens so far; a static cache has empty slots after them
    if padding == "right":
        pad[1, filled - 2:] = False
        pad[2, filled - 4:] = False
    elif padding == "left":
        pad[1, :2] = False
        pad[2, :4] = False
    elif padding == "holes":
        pad[1, 1::3] = False
    if case == "static-cache":
        pad[:, filled:] = False
    mask = hf_mask(L, S, q_offset, kv_offset, pad, window)
    layout = st._take_apart(mask, L, S, True, None if window is None else window - 1)
    assert layout is not None
    assert torch.equal(rebuild(layout, 3, L, S), mask)
    assert layout.is_causal in ("bottom_right", "top_left")
    assert layout.keys == (filled if case == "static-cache" else S)
    assert (layout.window is not None) == (window is not None)
    if padding == "right" and case not in ("decode-window", "sliding-cache"):
        assert layout.key_lengths is not None and layout.key_mask is None
    if padding == "none":
        assert layout.key_lengths is None and layout.key_mask is None


@pytest.mark.parametrize("padding", ["none", "right", "left"])
def test_bidirectional_masks_are_taken_apart_exactly(padding):
    pad = torch.ones(2, 6, dtype=torch.bool)
    if padding == "right":
        pad[1, 4:] = False
    elif padding == "left":
        pad[1, :2] = False
    mask = hf_mask(6, 6, 0, 0, pad, causal=False)
    layout = st._take_apart(mask, 6, 6, False, None)
    assert layout is not None and layout.is_causal is False and layout.window is None
    assert torch.equal(rebuild(layout, 2, 6, 6), mask)
    assert (layout.key_lengths is not None) == (padding == "right")


def test_masks_of_other_forms_are_not_taken_apart():
    g = torch.Generator().manual_seed(8)
    chunked = masking_utils.sdpa_mask(
        batch_size=1, q_length=8, kv_length=8, mask_function=masking_utils.chunked_causal_mask_function(
            3, torch.zeros(1, dtype=torch.long)), allow_is_causal_skip=False)
    for mask in (
        torch.rand(2, 1, 5, 5, generator=g) < 0.5,  # random
        chunked,
        torch.ones(1, 2, 5, 5, dtype=torch.bool),  # per head
        torch.zeros(1, 1, 5, 5, dtype=torch.bool),  # nothing visible
        torch.ones(1, 1, 5, 5, dtype=torch.bool).triu(),  # anti-causal
    ):
        layout = st._take_apart(mask, mask.shape[-2], mask.shape[-1], True, 2)
        assert layout is None or torch.equal(rebuild(layout, mask.shape[0], 5 if mask.shape[-2] == 5 else 8,
                                                     mask.shape[-1]), mask)
    assert st._take_apart(chunked, 8, 8, True, None) is None
    assert st._take_apart(torch.rand(2, 1, 5, 5, generator=g) < 0.5, 5, 5, True, None) is None


def test_a_mask_changed_in_place_is_taken_apart_again():
    mask = hf_mask(4, 4, 0, 0, torch.ones(2, 4, dtype=torch.bool))
    assert st._layout(mask, 4, 4, True, None).key_lengths is None
    mask[1, :, :, 3] = False
    assert st._layout(mask, 4, 4, True, None).key_lengths.tolist() == [4, 3]
