"""`eqllm.plan.kernels`: the grouped-matmul kernels read from TPU HLO, their static cost and
what their routed rows run."""

from eqllm.bench.hlo import Program
from eqllm.config import ModelConfig
from eqllm.plan.kernels import dispatch_block, grouped_cost, grouped_kernels


def _kernel(name, result, flops, op="jit(step)/while/body/eqllm.MoE/shard_map"):
    """A Mosaic custom call as the TPU compiler writes it (abridged from a v5p compile of
    qwen3-235b-a22b: the body, a base64 module, left short)."""
    return (
        f'  %{name}.1 = {result} custom-call(%x), custom_call_target="tpu_custom_call", '
        f'metadata={{op_name="{op}/jit({name})/pallas_call"}}, backend_config={{'
        '"flag_configs":[],"custom_call_config":{"body":"TUxJUg==","cost_estimate":'
        f'{{"flops":"{flops}","transcendentals":"0","bytes_accessed":"{flops // 64}"}},'
        '"needs_layout_passes":true}}'
    )


# A layer loop of 3 trips holding one gmm (rows x d_in 128 -> d_out 64) and one tgmm (the weight
# gradient of 2 experts, (2, 128, 64)) over a block of 512 rows, and a flash-attention kernel
# (not a grouped matmul); outside the loop one gmm over 256 rows.
GMM = 2 * 512 * 128 * 64
HLO = "\n".join(
    [
        "%body (p: (s32[], bf16[512,128])) -> (s32[], bf16[512,128]) {",
        "  %p = (s32[], bf16[512,128]{1,0}) parameter(0)",
        "  %i = s32[] get-tuple-element(%p), index=0",
        "  %x = bf16[512,128]{1,0} get-tuple-element(%p), index=1",
        _kernel("gmm", "bf16[512,64]{1,0:T(8,128)(2,1)}", GMM),
        _kernel("tgmm", "bf16[2,128,64]{2,1,0}", GMM, "jit(step)/transpose(jvp())/while/body"),
        _kernel("flash_attention", "bf16[512,128]{1,0}", 999),
        "  ROOT %t = (s32[], bf16[512,128]{1,0}) tuple(%i, %x)",
        "}",
        "",
        "%cond (q: (s32[], bf16[512,128])) -> pred[] {",
        "  %q = (s32[], bf16[512,128]{1,0}) parameter(0)",
        "  ROOT %c = pred[] constant(true)",
        "}",
        "",
        "ENTRY %main (a: bf16[512,128]) -> (s32[], bf16[512,128]) {",
        "  %a = bf16[512,128]{1,0} parameter(0)",
        "  %x = bf16[256,128]{1,0} slice(%a), slice={[0:256], [0:128]}",
        _kernel("gmm", "bf16[256,64]{1,0}", 2 * 256 * 128 * 64, "jit(step)"),
        "  %zero = s32[] constant(0)",
        "  %init = (s32[], bf16[512,128]{1,0}) tuple(%zero, %a)",
        "  ROOT %loop = (s32[], bf16[512,128]{1,0}) while(%init), condition=%cond, body=%body, "
        'backend_config={"known_trip_count":{"n":"3"}}',
        "}",
    ]
)


def test_grouped_kernels_are_read_with_their_rows_and_loop_trips():
    found = sorted(grouped_kernels(Program(HLO)), key=lambda k: (k.name, k.rows))
    # gmm's rows are its result's; tgmm's, its estimate over 2 x d_in x d_out
    assert [(k.name, k.rows, k.flops, k.runs, k.once) for k in found] == [
        ("gmm", 256, 2 * 256 * 128 * 64, 1, 1),
        ("gmm", 512, GMM, 3, 1),
        ("tgmm", 512, GMM, 3, 1),
    ]


def test_only_the_kernels_over_the_padded_block_run_their_routed_rows():
    outside = 2 * 256 * 128 * 64
    g = grouped_cost(Program(HLO), (512, 128))  # a block of 512 rows, 128 of them routed
    assert g.static == 2 * 3 * GMM + outside and g.once == 2 * GMM + outside
    assert g.run == 2 * 3 * GMM / 4 + outside  # the 256-row kernel is not the block's
    assert grouped_cost(Program(HLO), None).run == g.static  # no padded block: all of it runs
    # their bytes are read from the same estimates and scale the same way (here FLOPs / 64)
    assert (g.static_bytes, g.once_bytes, g.run_bytes) == (g.static / 64, g.once / 64, g.run / 64)


def test_the_dispatch_block_is_the_dropless_or_capacity_slot_times_the_shards():
    config = ModelConfig.from_dict(
        {"vocab_size": 64, "d_model": 16, "n_layers": 1, "max_seq_len": 32,
         "attention": {"n_heads": 2},
         "mlp": {"d_ff": 32}, "moe": {"n_experts": 8, "experts_per_token": 2,
                                      "impl": "dispatch"}}
    )  # fmt: skip
    sizes = {"pipeline": 1, "data": 2, "fsdp": 4, "tensor": 1}
    # 2 local experts a chip: a token sends at most min(k, 2) = 2 copies to one chip
    assert dispatch_block(config, sizes, 100) == (4 * 100 * 2, 100 * 2)
    capped = config.replace(**{"moe.capacity_factor": 1.0})
    assert dispatch_block(capped, sizes, 100) == (4 * 50, 200)  # ceil(1.0 x 200 / 4) a peer
    assert dispatch_block(config, {**sizes, "fsdp": 1}, 100) is None  # own rows: no padding
    assert dispatch_block(config.replace(**{"moe.impl": "ragged"}), sizes, 100) is None
