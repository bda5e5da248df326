"""The tensors llama.cpp's loaders create for the architectures eqllm writes as GGUF with
DeepSeek-style experts (restated from llama.cpp's src/models: `llama_model_deepseek2` and
`llama_model_glm4_moe`'s `load_arch_tensors`), the reference tests/test_gguf_moe.py checks a
file's tensor names and shapes against."""


def loader_tensors(hf: dict) -> dict[str, tuple[int, ...]]:
    """The tensors llama.cpp's loader creates (`llama_model_deepseek2::load_arch_tensors`,
    `llama_model_glm4_moe::load_arch_tensors`), with their shapes in ggml's order (fastest
    dimension first) as the file lists them."""
    d = hf["hidden_size"]
    n_exp, ff, ff_exp = hf["n_routed_experts"], hf["intermediate_size"], hf["moe_intermediate_size"]
    shared = hf["n_shared_experts"] * ff_exp
    out = {"token_embd.weight": (d, hf["vocab_size"]), "output_norm.weight": (d,)}
    if not hf.get("tie_word_embeddings", False):
        out["output.weight"] = (d, hf["vocab_size"])
    for i in range(hf["num_hidden_layers"]):
        b = f"blk.{i}."
        out[b + "attn_norm.weight"] = (d,)
        if hf["model_type"] == "glm4_moe":
            out |= glm4moe_attention(hf, b)
            out[b + "post_attention_norm.weight"] = (d,)
        else:
            out |= deepseek2_attention(hf, b)
            out[b + "ffn_norm.weight"] = (d,)
        if i < hf["first_k_dense_replace"]:
            out |= {b + "ffn_gate.weight": (d, ff), b + "ffn_down.weight": (ff, d)}
            out[b + "ffn_up.weight"] = (d, ff)
            continue
        out[b + "ffn_gate_inp.weight"] = (d, n_exp)
        if hf["model_type"] != "deepseek_v2":
            out[b + "exp_probs_b.bias"] = (n_exp,)
        out[b + "ffn_down_exps.weight"] = (ff_exp, d, n_exp)
        out[b + "ffn_gate_exps.weight"] = (d, ff_exp, n_exp)
        out[b + "ffn_up_exps.weight"] = (d, ff_exp, n_exp)
        out[b + "ffn_gate_shexp.weight"] = (d, shared)
        out[b + "ffn_down_shexp.weight"] = (shared, d)
        out[b + "ffn_up_shexp.weight"] = (d, shared)
    return out


def glm4moe_attention(hf, b):
    heads, kv, hd, d = (
        hf[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size")
    )
    out = {b + "attn_q.weight": (d, heads * hd), b + "attn_output.weight": (heads * hd, d)}
    out |= {b + "attn_k.weight": (d, kv * hd), b + "attn_v.weight": (d, kv * hd)}
    if hf["attention_bias"]:
        out[b + "attn_q.bias"] = (heads * hd,)
        out |= {b + "attn_k.bias": (kv * hd,), b + "attn_v.bias": (kv * hd,)}
    if hf["use_qk_norm"]:
        out |= {b + "attn_q_norm.weight": (hd,), b + "attn_k_norm.weight": (hd,)}
    return out


def deepseek2_attention(hf, b):
    d, heads, latent, q = (
        hf[k] for k in ("hidden_size", "num_attention_heads", "kv_lora_rank", "q_lora_rank")
    )
    nope, rope, v = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"]
    out = {}
    if q:
        out[b + "attn_q_a_norm.weight"] = (q,)
        out[b + "attn_q_a.weight"] = (d, q)
        out[b + "attn_q_b.weight"] = (q, heads * (nope + rope))
    else:
        out[b + "attn_q.weight"] = (d, heads * (nope + rope))
    out[b + "attn_kv_a_norm.weight"] = (latent,)
    out[b + "attn_kv_a_mqa.weight"] = (d, latent + rope)
    out[b + "attn_k_b.weight"] = (nope, latent, heads)
    out[b + "attn_v_b.weight"] = (latent, v, heads)
    out[b + "attn_output.weight"] = (heads * v, d)
    return out
