"""Hugging Face format interop: configs, weights (both directions) and tokenizers.

    model = eqllm.hub.from_pretrained("path/or/org-name")      # HF folder or hub repo id
    eqllm.hub.save_pretrained(model, "out/", tokenizer=tok)     # transformers loads it
    model = eqllm.hub.from_pretrained("base/", adapter="adapter/")  # a PEFT LoRA adapter
    eqllm.hub.save_adapter(model, "adapter/")                   # peft loads it
    model = eqllm.hub.from_pretrained("model.gguf")             # llama.cpp's format, dequantized
    eqllm.hub.save_gguf(model, "out.gguf", tokenizer=tok, type="q8_0")
    model, tok = eqllm.hub.load_any("llama-nano" | "path" | "org/name")

Families: GPT-2, Llama (1/2/3 with the Llama 3 rope scaling), Mistral, Qwen2, Qwen3, Gemma,
Gemma 2, Gemma 3 (text), Phi-3, OLMo 2. The tensor names and the config translation come from
each family's file (`eqllm/families/`); the translation refuses any setting it does not
understand rather than build a different model.
"""

from eqllm.hub.adapters import load_adapter, save_adapter
from eqllm.hub.config import from_hf_config, to_hf_config
from eqllm.hub.files import CheckpointError
from eqllm.hub.folders import load_tokenizer, resolve, zoo_match
from eqllm.hub.model_folder import load_any, load_model, save_model, with_param_dtype
from eqllm.hub.pretrained import from_pretrained
from eqllm.hub.saving import save_gguf, save_pretrained

__all__ = [
    "CheckpointError",
    "from_hf_config",
    "from_pretrained",
    "load_adapter",
    "load_any",
    "load_model",
    "load_tokenizer",
    "resolve",
    "save_adapter",
    "save_gguf",
    "save_model",
    "save_pretrained",
    "to_hf_config",
    "with_param_dtype",
    "zoo_match",
]
