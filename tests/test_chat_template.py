"""Chat templates: found in transformers' order, rendered and saved as transformers does, so
transformers' apply_chat_template on an eqllm export gives the tokens eqllm trained on."""

import json
import logging

import jax
import pytest
import transformers

import eqllm
from eqllm.data import Tokenizer
from eqllm.data import chat as chat_module
from eqllm.data.chat import DEFAULT_TEMPLATE, read_chat_template
from eqllm.data.instruct import ChatFormat

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
OTHER = "{% for m in messages %}{{ bos_token }}[{{ m.role }}] {{ m.content }}{% endfor %}"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Add 2 and 3, café-style.\n  Thanks!"},
    {"role": "assistant", "content": "5, naïvely."},
    {"role": "user", "content": "And <|im_end|> twice?"},
    {"role": "assistant", "content": "10"},
]


@pytest.fixture(scope="module")
def tokenizer():
    docs = ["Add two numbers and say the sum, tersely. Café naïve thanks!"] * 20
    tok = Tokenizer.train_bpe(docs, 300, min_frequency=1)
    tok.hf.add_special_tokens(["<|im_start|>", "<|im_end|>", "<s>"])
    return Tokenizer(
        tok.hf, "<|im_end|>", "bpe", chat_template=CHATML, special_tokens={"bos_token": "<s>"}
    )


def _hf_tokenizer(folder):
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def test_jinja_file_comes_before_tokenizer_config(tokenizer, tmp_path):
    tokenizer.save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": OTHER}))
    assert read_chat_template(tmp_path) == CHATML  # chat_template.jinja wins
    assert Tokenizer.load(tmp_path).chat_template == _hf_tokenizer(tmp_path).chat_template == CHATML
    (tmp_path / "chat_template.jinja").unlink()
    assert read_chat_template(tmp_path) == OTHER
    assert Tokenizer.load(tmp_path).chat_template == _hf_tokenizer(tmp_path).chat_template


def test_named_templates_use_the_default_one(tokenizer, tmp_path):
    tokenizer.with_chat_template(None).save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    named = [{"name": "tool_use", "template": OTHER}, {"name": "default", "template": CHATML}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": named}))
    assert read_chat_template(tmp_path) == CHATML
    hf = _hf_tokenizer(tmp_path)
    assert hf.get_chat_template() == CHATML
    assert Tokenizer.load(tmp_path).apply_chat_template(MESSAGES) == hf.apply_chat_template(
        MESSAGES, tokenize=True, return_dict=False
    )


def test_saved_as_transformers_saves_it(tokenizer, tmp_path):
    tokenizer.save(tmp_path / "ours")
    _hf_tokenizer(tmp_path / "ours").save_pretrained(tmp_path / "theirs")
    for folder in ("ours", "theirs"):
        assert (tmp_path / folder / "chat_template.jinja").read_text() == CHATML
        config = json.loads((tmp_path / folder / "tokenizer_config.json").read_text())
        assert "chat_template" not in config


def test_rendering_equals_transformers_with_special_tokens(tokenizer, tmp_path):
    tokenizer.with_chat_template(OTHER).save(tmp_path)
    hf = _hf_tokenizer(tmp_path)
    ours = Tokenizer.load(tmp_path).apply_chat_template(MESSAGES, tokenize=False)
    assert ours == hf.apply_chat_template(MESSAGES, tokenize=False)
    assert ours.startswith("<s>[system]")


def test_export_gives_the_tokens_eqllm_trained_on(tokenizer, tmp_path):
    """transformers' apply_chat_template on a save_pretrained export equals ChatFormat.encode."""
    model = eqllm.zoo.create("llama-nano", key=jax.random.key(0), vocab_size=tokenizer.vocab_size)
    eqllm.hub.save_pretrained(model, tmp_path, tokenizer=tokenizer)
    hf = _hf_tokenizer(tmp_path)
    ids, mask = ChatFormat(Tokenizer.load(tmp_path)).encode(MESSAGES)
    theirs = hf.apply_chat_template(MESSAGES, tokenize=True, return_dict=False)
    assert list(ids[: len(theirs)]) == theirs
    assert list(ids[len(theirs) :]) in ([], [tokenizer.eot_id])
    prompt = Tokenizer.load(tmp_path).apply_chat_template(MESSAGES[:2], add_generation_prompt=True)
    assert prompt == hf.apply_chat_template(
        MESSAGES[:2], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert tokenizer.decode(ids[mask]) == "5, naïvely.<|im_end|>10<|im_end|>"


def test_default_template_is_said_once(tokenizer, monkeypatch, caplog):
    monkeypatch.setattr(chat_module, "_said_default", False)
    plain = tokenizer.with_chat_template(None)
    with caplog.at_level(logging.WARNING, logger="eqllm.data.chat"):
        assert ChatFormat(plain).template == DEFAULT_TEMPLATE
        ChatFormat(plain)
        plain.apply_chat_template(MESSAGES)
    said = [r for r in caplog.records if "default template" in r.getMessage()]
    assert len(said) == 1
    assert ChatFormat(tokenizer).template == CHATML


def test_generate_chat_uses_the_folder_template(tokenizer, tmp_path):
    from eqllm.commands.generate import Chat

    tokenizer.save(tmp_path)
    chat = Chat(str(tmp_path), Tokenizer.load(tmp_path))
    expected = _hf_tokenizer(tmp_path).apply_chat_template(
        [{"role": "user", "content": "hi"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert chat.prompt("hi") == expected
