"""GGUF both ways: eqllm's export read by transformers' GGUF loader, and eqllm's import of
files the gguf package writes (every listed tensor type) equal to transformers' loader."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import eqllm
from eqllm.data import Tokenizer

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    docs = ["def add(a, b):\n    return a + b  # café, naïve"] * 30
    tok = Tokenizer.train_bpe(docs, 300, min_frequency=1)
    tok.hf.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    return Tokenizer(tok.hf, "<|im_end|>", "bpe", chat_template=CHATML)


def _model(model_type, vocab, d=32, ff=64, heads=4, kv=2):
    config = transformers.AutoConfig.for_model(
        model_type,
        vocab_size=vocab,
        hidden_size=d,
        intermediate_size=ff,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return hf


def _eqllm(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path / "hf")
    return eqllm.hub.from_pretrained(tmp_path / "hf")


def _theirs(file, tokens, float64=False):
    """transformers' logits for `file` as its GGUF loader reads it (the weights in fp32, then
    in float64 with `float64`: the same values, a forward without fp32's rounding)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(file.parent), gguf_file=file.name, dtype=torch.float32
    ).eval()
    if float64:
        hf = hf.double()
    with torch.no_grad():
        return hf(torch.tensor(tokens)[None]).logits[0].numpy()


def _ours(model, tokens):
    with jax.default_matmul_precision("highest"):
        return np.asarray(model(jnp.asarray(tokens)))


TOKENS = np.random.default_rng(0).integers(0, 250, 200)
# Of the largest logit; the figures measured on this model are in docs/hub.md (`-s` prints them).
TOLERANCE = {"f32": 1e-5, "f16": 5e-3, "bf16": 2e-2, "q8_0": 5e-2}


# Every family eqllm writes is checked in f32 by tests/test_families.py; here the Llama, with
# its tokenizer, at each type.
@pytest.mark.parametrize("kind", ["f32", "f16", "bf16", "q8_0"])
def test_exports_within_tolerance_and_carry_the_tokenizer(kind, tokenizer, tmp_path):
    model = _eqllm(_model("llama", tokenizer.vocab_size), tmp_path)
    file = tmp_path / "m.gguf"
    eqllm.hub.save_gguf(model, file, tokenizer=tokenizer, type=kind)
    ours, theirs = _ours(model, TOKENS), _theirs(file, TOKENS)
    error = np.abs(theirs - ours).max() / np.abs(ours).max()
    print(f"{kind}: largest logit difference {error:.2g} of the largest logit")  # docs/hub.md
    assert error <= TOLERANCE[kind]
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=file.name)
    text = "def add(a, b):\n    return a + b  # naïve <|im_end|>"
    assert hf_tok.encode(text, add_special_tokens=False) == tokenizer.encode_with_specials(text)
    assert hf_tok.chat_template == CHATML


def test_convert_command_writes_gguf(tokenizer, tmp_path, capsys):
    from eqllm.cli import main

    model = _eqllm(_model("llama", tokenizer.vocab_size), tmp_path)
    eqllm.hub.save_pretrained(model, tmp_path / "src", tokenizer=tokenizer)
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "o.gguf"), "--type", "q8_0"]) == 0
    assert "wrote GGUF" in capsys.readouterr().out
    back, tok = eqllm.hub.load_any(str(tmp_path / "o.gguf"))
    assert tok.chat_template == CHATML and tok.encode("a + b") == tokenizer.encode("a + b")
    assert back.config.d_model == 32


def _requantize(src, dst, qtype):
    """A copy of GGUF file `src` whose 2-D tensors are of `qtype`, written by the gguf package
    (random valid blocks for the K-quants, which the package cannot quantize)."""
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    rng = np.random.default_rng(1)
    for t in reader.tensors:
        array = gguf.quants.dequantize(t.data, t.tensor_type).reshape(
            tuple(int(n) for n in reversed(t.shape))
        )
        if array.ndim < 2:
            writer.add_tensor(t.name, array.astype(np.float32))
        elif qtype in (T.Q4_K, T.Q6_K):
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            blocks = rng.integers(0, 256, (array.size // block, size), dtype=np.uint8)
            scale = np.full(len(blocks), 0.002, np.float16).view(np.uint8).reshape(-1, 2)
            if qtype == T.Q4_K:  # d, dmin (f16) first
                blocks[:, 0:2], blocks[:, 2:4] = scale, scale
            else:  # d (f16) last
                blocks[:, -2:] = scale
            data = blocks.reshape(array.shape[0], -1)
            writer.add_tensor(t.name, data, raw_dtype=qtype)
        else:
            writer.add_tensor(t.name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# F32 runs by default, the other tensor types in the slow set.
@pytest.mark.parametrize(
    "qtype",
    [
        T.F32,
        *(
            pytest.param(q, marks=pytest.mark.slow)
            for q in (T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q6_K)
        ),
    ],
    ids=lambda q: q.name,
)
def test_import_equals_transformers_loader(qtype, tokenizer, tmp_path):
    k_quant = qtype in (T.Q4_K, T.Q6_K)  # rows of 256
    hf = _model(
        "llama",
        256 if k_quant else tokenizer.vocab_size,
        d=256 if k_quant else 32,
        ff=256 if k_quant else 64,
    )
    model = _eqllm(hf, tmp_path)
    eqllm.hub.save_gguf(model, tmp_path / "f32.gguf", type="f32")
    file = tmp_path / f"{qtype.name}.gguf"
    _requantize(tmp_path / "f32.gguf", file, qtype)
    ours = _ours(eqllm.hub.from_pretrained(file), TOKENS % 256)
    # The random k-quant blocks make logits near 200, where torch's own fp32 forward is 0.026
    # from float64 (eqllm's 0.011): eqllm is held to transformers' weights in float64.
    theirs = _theirs(file, TOKENS % 256, float64=True)
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4 * np.abs(theirs).max())


SMALL = dict(
    vocab_size=64,
    d_model=32,
    n_layers=2,
    max_seq_len=256,
    attention={"n_heads": 4, "n_kv_heads": 2, "head_dim": 8, "sliding_window": None},
    mlp={"d_ff": 64},
)


def test_a_family_says_which_architecture_it_is_written_as(tmp_path):
    """Mistral without a sliding window is written as llama.cpp's "llama" and reads back as the
    same model; with a window, or a family with no GGUF architecture, it is refused in words."""
    windowless = eqllm.zoo.config("mistral-7b", **SMALL)
    model = eqllm.CausalLM(windowless, key=jax.random.key(0))
    eqllm.hub.save_gguf(model, tmp_path / "m.gguf", type="f32")
    reader = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    assert reader.fields["general.architecture"].contents() == "llama"
    back = eqllm.hub.from_pretrained(tmp_path / "m.gguf")
    assert back.config.family == "llama"
    tokens = TOKENS[:64] % 64
    np.testing.assert_allclose(_ours(back, tokens), _ours(model, tokens), atol=1e-5)

    # Refused before anything is written or computed: shapes are enough.
    windowed = windowless.replace(attention={"sliding_window": 16})
    windowed = eqx.filter_eval_shape(eqllm.CausalLM, windowed, key=jax.random.key(0))
    with pytest.raises(eqllm.ConfigError, match="attention.sliding_window=16: GGUF architecture"):
        eqllm.hub.save_gguf(windowed, tmp_path / "w.gguf")
    biased = eqllm.zoo.config("llama-nano", attention={"qkv_bias": True, "out_bias": True})
    biased = eqx.filter_eval_shape(eqllm.CausalLM, biased, key=jax.random.key(0))
    with pytest.raises(eqllm.ConfigError, match="attention.out_bias=True: GGUF architecture"):
        eqllm.hub.save_gguf(biased, tmp_path / "b.gguf")
    gpt2 = eqx.filter_eval_shape(eqllm.zoo.create, "gpt2-nano", key=jax.random.key(0))
    with pytest.raises(eqllm.ConfigError, match="gpt2 model has no GGUF architecture.*llama"):
        eqllm.hub.save_gguf(gpt2, tmp_path / "g.gguf")
