"""A chat model folder as one is published, without a download: Qwen3's real tokenizer and chat
template (tests/data/qwen3-tokenizer) beside a small random-weight Qwen3 of that vocabulary.

Scores of such a model are those of random weights; what the tests compare is that two ways of
evaluating it (through `eqllm serve`, in process) give the same numbers.
"""

from __future__ import annotations

import lzma
import shutil
from pathlib import Path

FIXTURE = Path(__file__).resolve().parent / "data" / "qwen3-tokenizer"
VOCAB = 151_936  # Qwen3's embedding rows (the tokenizer's 151,669 ids, padded)
IM_END = 151_645  # <|im_end|>: the chat models' end of turn and eos_token
ENDOFTEXT = 151_643  # <|endoftext|>


def unpack_tokenizer(folder: Path) -> Path:
    """tokenizer.json and tokenizer_config.json (with the chat template) into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    with (
        lzma.open(FIXTURE / "tokenizer.json.xz") as src,
        open(folder / "tokenizer.json", "wb") as dst,
    ):
        shutil.copyfileobj(src, dst)
    shutil.copy(FIXTURE / "tokenizer_config.json", folder / "tokenizer_config.json")
    return folder


def qwen3_chat_folder(folder: Path, *, context: int = 128, seed: int = 0) -> Path:
    """A 2-layer Qwen3 of d_model 32 with Qwen3's vocabulary, saved by transformers with the
    tokenizer files. The embedding and the (untied) head are drawn with unit scale so the
    logits are spread out: a near-tie between two tokens would make the greedy choice depend
    on the order of floating-point sums, which two correct paths may differ in; an untied head
    keeps greedy text from repeating the last token."""
    import torch
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=context,
        tie_word_embeddings=False,
        bos_token_id=ENDOFTEXT,
        eos_token_id=IM_END,
        pad_token_id=ENDOFTEXT,
        initializer_range=0.2,  # projections of O(1) gain: the output depends on the context
    )
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
        model.lm_head.weight.normal_(0.0, 1.0)
    model.save_pretrained(folder)
    return unpack_tokenizer(folder)
