"""Training FLOPs per token of a ModelConfig (`ModelConfig.flops_per_token`): 6 x the matmul
parameters a token uses, plus attention's scores and weighted sums (PaLM, appendix B)."""

from __future__ import annotations

from eqllm.config.per_layer import extra_matmul_params


def attention_params(cfg, global_layer: bool = False, keys: bool = True) -> int:
    """The matmul parameters of one attention layer of `cfg` (a ModelConfig): q, k, v and o (and
    the output gate), or latent attention's projections; `global_layer`: a layer of the global
    layers' own stack (Gemma 4: their head size and kv heads, no v where keys are values);
    not `keys`: a kv-shared layer (Gemma 4 E2B/E4B), with no k or v of its own."""
    a, d = cfg.attention, cfg.d_model
    h, kv, q = a.n_heads, a.n_kv_heads, a.head_dim
    values = kv
    if global_layer:
        q, kv = a.global_head_dim or q, a.global_kv_heads or kv
        values = 0 if a.k_eq_v else kv
    if not keys:
        kv = values = 0
    attn = d * q * (h + kv + values) + h * q * d
    if a.kind == "mla":
        rank = a.q_lora_rank
        query = d * h * q if rank is None else d * rank + rank * h * q
        latent = d * (a.kv_lora_rank + a.qk_rope_head_dim)
        expand = a.kv_lora_rank * h * (a.qk_nope_head_dim + a.v_head_dim)
        attn = query + latent + expand + h * a.v_head_dim * d
    return attn + (d * h * q if a.output_gate else 0)


def flops_per_token(cfg, seq_len: int | None = None) -> float:
    """See `ModelConfig.flops_per_token`."""
    d = cfg.d_model
    attn = attention_params(cfg)
    mlp = dense = (3 if cfg.mlp.kind in ("swiglu", "geglu") else 2) * d * cfg.mlp.d_ff
    dense_layers = (kinds := cfg.layer_kinds()).count("dense")
    if (moe := cfg.moe) is not None:
        gate = d if moe.shared_gated else 0
        per = 3 if moe.gated else 2  # projections of an expert: gate (if any), up, down
        shared = per * d * moe.shared_d_ff + gate if moe.shared_d_ff else 0
        mlp = d * moe.n_experts + per * d * cfg.expert_d_ff * moe.experts_per_token + shared
    head = d * cfg.vocab_size
    sparse_layers = cfg.n_layers - dense_layers
    linears, full = kinds.count("linear"), sum(k in ("full", "dense") for k in kinds)
    matmul_params = full * attn + sparse_layers * mlp + dense_layers * dense + head
    if "global" in kinds:  # Gemma 4's global layers, of their own shape
        matmul_params += kinds.count("global") * attention_params(cfg, global_layer=True)
    for kind, wide in (("shared", False), ("shared_global", True)):  # Gemma 4 E2B/E4B
        matmul_params += kinds.count(kind) * attention_params(cfg, wide, keys=False)
    matmul_params += extra_matmul_params(cfg)  # per-layer inputs, the shared layers' wider MLP
    if (lin := cfg.linear) is not None:  # q, k, v, z, b, a and out of each linear layer
        keys, values = (
            lin.n_key_heads * lin.key_head_dim,
            lin.n_value_heads * lin.value_head_dim,
        )
        linear = d * (2 * keys + 3 * values + 2 * lin.n_value_heads)
        if lin.kind == "mamba2":  # z, x, B, C, dt and out
            linear = d * (2 * keys + 3 * values + lin.n_value_heads)
        matmul_params += (cfg.n_layers if lin.parallel else linears) * linear
        if not lin.mlp:  # linear layers without an MLP
            matmul_params -= linears * mlp
        matmul_params -= 0 if lin.full_mlp else full * mlp  # attention alone: Nemotron-H
    return 6.0 * matmul_params + attention_flops_per_token(cfg, seq_len)


def attention_flops_per_token(cfg, seq_len: int | None = None) -> float:
    """See `ModelConfig.attention_flops_per_token`."""
    a, full = cfg.attention, seq_len or cfg.max_seq_len
    window = a.sliding_window or a.chunk_size
    spans = [min(full, window) if w else full for w in cfg.local_layers()]
    kinds = cfg.layer_kinds()
    if "global" in kinds:  # Gemma 4: the global layers' heads have a size of their own
        wide = a.global_head_dim or cfg.head_dim
        local = cfg.head_dim
        width = {"full": local, "dense": local, "shared": local, "global": wide}
        width["shared_global"] = wide
        scores = sum(2 * width.get(k, 0) * t for k, t in zip(kinds, spans, strict=True))
        return 6.0 * a.n_heads * scores
    t = sum(spans) / cfg.n_layers
    values = a.v_head_dim if a.kind == "mla" else cfg.head_dim
    layers = sum(k not in ("linear", "ffn") for k in kinds)  # T-long scores
    return 6.0 * layers * a.n_heads * (cfg.head_dim + values) * t
