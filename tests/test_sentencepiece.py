"""A folder with only a SentencePiece tokenizer.model loads with transformers' ids."""

import io
import json

import pytest
import sentencepiece as spm
import transformers

from eqllm.data import Tokenizer
from eqllm.errors import EqllmError

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Le café est très bon, naïve façade à Zürich.",
    "Numbers 12345 and 67890, tabs\tand  double  spaces.",
] * 40
TEXTS = [
    "Hello world",
    " leading space and trailing ",
    "multi\nline\n\ntext\twith tabs",
    "unicode: café, naïve, Zürich, 東京, emoji 🙂",
    "special <s> and </s> inside, and <|im_start|>user",
    "   ",
    "",
]


def _train(folder, **options):
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_writer=model,
        model_type="bpe",
        vocab_size=400,
        byte_fallback=True,
        character_coverage=1.0,
        user_defined_symbols=["<|im_start|>"],
        **options,
    )
    folder.mkdir(exist_ok=True)
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = _train(tmp_path_factory.mktemp("spm"))
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "added_tokens_decoder": {
            "400": {"content": "<|im_end|>", "special": True, "normalized": False},
        },
        "chat_template": "{% for m in messages %}{{ bos_token }}{{ m.content }}<|im_end|>"
        "{% endfor %}",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_ids_equal_transformers(folder):
    ours = Tokenizer.load(folder)
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert ours.vocab_size == len(theirs) == 401
    for text in TEXTS + ["an added <|im_end|> token"]:
        expected = theirs.encode(text, add_special_tokens=False)
        assert ours.encode_with_specials(text) == expected, text
        assert ours.decode(expected) == theirs.decode(expected), text


def test_special_tokens_and_template_are_honoured(folder):
    ours = Tokenizer.load(folder)
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert ours.eot_token == "</s>" and ours.eot_id == theirs.eos_token_id == 2
    assert ours.special_tokens["bos_token"] == "<s>"
    messages = [{"role": "user", "content": "café <|im_start|> ok"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(
        messages, tokenize=True, return_dict=False
    )


def test_a_unigram_model_is_refused_naming_it(tmp_path):
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_writer=model,
        model_type="unigram",
        vocab_size=400,
        hard_vocab_limit=False,
    )
    (tmp_path / "tokenizer.model").write_bytes(model.getvalue())
    with pytest.raises(EqllmError, match="model_type 1 is not supported"):
        Tokenizer.load(tmp_path)
