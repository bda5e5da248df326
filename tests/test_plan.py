"""`eqllm plan`: TPU slice names, the TPU-HLO collective parser, and nano models compiled by the
real TPU compiler (libtpu, the `tpu` extra) for the smallest v5e and v5p slices."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

import eqllm
from eqllm.bench.collectives import collectives, count_collectives, tally
from eqllm.bench.hlo import Program
from eqllm.cli import main
from eqllm.plan import devices as plan_devices
from eqllm.plan.plan import plan_recipe, recipe_for, with_settings
from eqllm.plan.report import describe, search_table
from eqllm.plan.search import candidates, search
from eqllm.plan.step import planned_config
from eqllm.recipe import load_recipe
from eqllm.sharding import MeshConfig
from eqllm.sharding.memory import offloaded_bytes
from eqllm.sharding.tpu import CHIPS, TopologyError, parse_slice
from eqllm.tpu_runtime import libtpu_installed
from tests.reliability.harness import make_corpus, tiny_recipe

ROOT = Path(__file__).resolve().parent.parent


# Slice names --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, jax_name, chips",
    [
        # cloud names of v4 and v5p count TensorCores (two per chip); v5e and v6e count chips
        ("v5p-8", "v5p:2x2x1", 4),
        ("v5p-128", "v5p:4x4x4", 64),
        ("v5p-768", "v5p:4x8x12", 384),
        ("v5p-1024", "v5p:8x8x8", 512),
        ("v5p-2048", "v5p:8x8x16", 1024),
        ("v4-8", "v4:2x2x1", 4),
        ("v4-128", "v4:4x4x4", 64),
        ("v5e-1", "v5e:1x1", 1),
        ("v5litepod-16", "v5e:4x4", 16),
        ("v5e-256", "v5e:16x16", 256),
        ("v6e-64", "v6e:8x8", 64),
        ("v6e-256", "v6e:16x16", 256),
        ("v5p:4x4x4", "v5p:4x4x4", 64),
    ],
)
def test_cloud_names_translate_to_jax_topologies_and_chip_counts(name, jax_name, chips):
    """The layouts are those of the Cloud TPU pages and MaxText's accelerator_to_spec_map.py."""
    tpu = parse_slice(name)
    assert (tpu.jax_name, tpu.chips) == (jax_name, chips)
    assert str(chips) in tpu.describe()
    assert parse_slice(name, slices=2).chips == 2 * chips


@pytest.mark.parametrize(
    "name, message",
    [
        ("v9-8", "unknown TPU topology 'v9-8'"),
        ("v5p-7", "count TensorCores"),
        ("v5e-512", "v5e names count chips"),
        ("v5p:3x3x3", "3-D layouts"),
    ],
)
def test_bad_topology_names_say_what_is_allowed(name, message):
    with pytest.raises(TopologyError, match=message):
        parse_slice(name)


def test_every_chip_figure_names_its_source():
    for chip in CHIPS.values():
        assert chip.source.startswith("https://") and chip.peak_flops > 1e14


# The TPU-HLO parser ---------------------------------------------------------------------------

# The forms the TPU compiler writes (abridged from a v5p compile of a scanned llama): an async
# all-gather split into start/done fusions, another continued over two fusions (the same
# channel_id), an all-reduce-scatter fusion, all inside a while loop whose trip count is in its
# condition; one all-reduce outside it with iota replica groups.
TPU_HLO = (ROOT / "tests" / "data" / "hlo" / "tpu_collectives.hlo").read_text()


def test_tpu_hlo_collectives_are_counted_once_each_with_their_loop_trips():
    per_layer, per_step = count_collectives(TPU_HLO)
    # two all-gathers (the start/done pair, the continued one) and one reduce-scatter a trip
    assert (per_layer["all-gather"], per_layer["reduce-scatter"], per_layer["all-reduce"]) == (
        2,
        1,
        0,
    )
    assert (per_step["all-gather"], per_step["reduce-scatter"], per_step["all-reduce"]) == (
        24,
        12,
        1,
    )
    found = {c.kind: c for c in collectives(Program(TPU_HLO))}
    assert found["reduce-scatter"].result_bytes == 768 * 192 * 2  # each device's slice
    assert found["all-gather"].group == (0, 1, 2, 3)
    assert found["all-reduce"].group == (0, 1, 2, 3)  # [2,4]<=[8]: the first of two groups


# shard_map's collectives all carry channel_id=1 (here the expert dispatch's forward exchange
# and its transpose in the backward pass); a continuation clone keeps its op's metadata too.
SHARD_MAP_HLO = """
%fwd_fusion (p: bf16[4,8,16]) -> bf16[4,8,16] {
  %p = bf16[4,8,16]{2,1,0} parameter(0)
  ROOT %a2a.9 = bf16[4,8,16]{2,1,0} all-to-all(%p), channel_id=1, replica_groups={{0,1,2,3}}, \
dimensions={0}, metadata={op_name="jit(step)/jvp()/shard_map/all_to_all" stack_frame_id=7}
}

ENTRY %main (x: bf16[4,8,16]) -> bf16[4,8,16] {
  %x = bf16[4,8,16]{2,1,0} parameter(0)
  %a2a.1 = bf16[4,8,16]{2,1,0} all-to-all(%x), channel_id=1, replica_groups={{0,1,2,3}}, \
dimensions={0}, metadata={op_name="jit(step)/jvp()/shard_map/all_to_all" stack_frame_id=7}
  %c = bf16[4,8,16]{2,1,0} fusion(%a2a.1), kind=kCustom, calls=%fwd_fusion
  ROOT %a2a.2 = bf16[4,8,16]{2,1,0} all-to-all(%c), channel_id=1, replica_groups={{0,1,2,3}}, \
dimensions={0}, metadata={op_name="jit(step)/transpose(jvp())/shard_map/all_to_all" \
stack_frame_id=7}
}
""".replace("\\\n", "")


def test_shard_map_collectives_sharing_a_channel_are_counted_each():
    _, per_step = count_collectives(SHARD_MAP_HLO)
    assert per_step["all-to-all"] == 2  # forward and backward; the clone is the forward's


def test_trip_count_reads_the_counters_start_and_step():
    hlo = TPU_HLO.replace("%step = s32[] constant(1)", "%step = s32[] constant(2)")
    hlo = hlo.replace("%zero = s32[] constant(0)\n  %z", "%zero = s32[] constant(2)\n  %z")
    _, per_step = count_collectives(hlo)
    assert per_step["reduce-scatter"] == 5  # 2, 4, 6, 8, 10


# Compiled by the TPU compiler -----------------------------------------------------------------

needs_libtpu = pytest.mark.skipif(
    not libtpu_installed(), reason="needs libtpu (pip install 'eqllm[tpu]')"
)
NANO = ["model.overrides.scan_layers=true", "data.seq_len=64", "train.batch_size=8"]
NANO += ['train.precision="bfloat16"']


def nano(variant="llama-nano", *sets):
    recipe, _ = recipe_for(f"zoo:{variant}")
    return load_or_set(recipe, [*NANO, *sets])


def load_or_set(recipe, sets):
    for item in sets:
        key, _, value = item.partition("=")
        recipe = recipe.replace(key, eqllm.recipe.parse_value(value))
    return recipe


def compiled(recipe, topology, mesh):
    tpu = parse_slice(topology)
    recipe = with_settings(recipe, mesh=MeshConfig.parse(mesh), topology=tpu.cloud_name)
    return plan_recipe(recipe, tpu, plan_devices.slice_devices(tpu))


DENSE_EXPERTS = 'model.overrides.moe.impl="dense"'
RAGGED_EXPERTS = 'model.overrides.moe.impl="ragged"'


@pytest.fixture(scope="module")
def plans():
    """The module's compiles, each once: a dense nano on the smallest v5e slice (one chip) and
    on the smallest v5p slice (four) with FSDP x tensor, and a mixture of experts there, with
    moe.impl "auto" (dispatch, as chosen for the TPU) and with dense experts asked for."""
    return {
        "v5e-1": compiled(nano(), "v5e-1", "data=1"),
        "fsdp,tensor": compiled(nano(), "v5p-8", "fsdp=2,tensor=2"),
        "experts": compiled(nano("mixtral-nano"), "v5p-8", "fsdp=4"),
        "dense experts": compiled(nano("mixtral-nano", DENSE_EXPERTS), "v5p-8", "fsdp=4"),
    }


def test_the_plan_chooses_moe_impl_for_the_tpu_and_its_mesh_not_for_this_host():
    """On this CPU host "auto" alone would choose dense experts on one device; the plan asks
    for what `eqllm run` on the slice would choose, and keeps an explicit choice."""
    recipe = nano("mixtral-nano")  # 4 experts
    assert recipe.model_config().moe.impl == "auto"
    # megablox where nothing partitions it: inside the dispatch, or on one chip
    for fsdp, impl, kernel in [
        (4, "dispatch", "megablox"),
        (2, "dispatch", "megablox"),
        (1, "ragged", "megablox"),
        (3, "ragged", "megablox"),  # each chip's own rows, the experts gathered whole
    ]:
        config, experts = planned_config(recipe, {"fsdp": fsdp})
        assert config.moe.impl == experts["impl"] == impl, fsdp
        assert config.moe.kernel == experts["kernel"] == kernel, fsdp
        assert experts["requested"] == "auto" and "auto on tpu" in experts["why"]
    assert "over 4 devices" in planned_config(recipe, {"fsdp": 4})[1]["why"]
    config, experts = planned_config(nano("mixtral-nano", DENSE_EXPERTS), {"fsdp": 4})
    assert config.moe.impl == "dense" and experts["why"] == "set by moe.impl"
    assert planned_config(nano(), {"fsdp": 4}) == (nano().model_config(), None)


@needs_libtpu
def test_nano_compiles_on_the_smallest_v5e_and_v5p_slices(plans):
    for name, plan in plans.items():
        assert plan.fits and plan.headroom > 0.9
        assert plan.step.compile_s > 0 and plan.roofline.mfu > 0
        # the FLOPs run (loops at their trip counts, the dispatch's grouped kernels over their
        # routed rows: below) are those of the model's step
        assert 0.8 < plan.step.run_flops * plan.tpu.chips / plan.step.model_flops < 1.5
        if name != "experts":  # no grouped kernel pads a block: the static count is the run
            assert plan.step.flops == plan.step.run_flops
    assert plans["v5e-1"].tpu.chip.name == "v5e" and plans["fsdp,tensor"].tpu.chips == 4


@needs_libtpu
def test_the_dispatchs_grouped_kernels_are_counted_static_and_run(plans):
    """The dropless dispatch's grouped matmuls are megablox kernels whose cost estimates count
    every row of their blocks: 4 peers x 128 tokens a chip x min(k, 1 local expert) = 512 rows,
    of which the chip's 2 x 128 routed copies fill half on the mean chip. Per layer loop pass
    (remat none) gate, up and down run forward (3 gmm) and backward (3 gmm for the rows'
    gradients, 3 tgmm for the weights'), each 2 x 512 x d_model x d_ff by its estimate. The
    plan counts them at the layer loop's trips (the compiled count scaled them by the other
    matrix products' loop factor), reports the static bound and what runs, and what runs is
    the model's FLOPs (the first test) where the static count is not."""
    plan = plans["experts"]
    config, s = plan.recipe.model_config(), plan.step
    rows = plan.recipe.train.batch_size * plan.recipe.data.seq_len // 4
    k = config.moe.experts_per_token
    assert (s.grouped.block, s.grouped.routed) == (4 * rows, k * rows)
    per_call = 2 * s.grouped.block * config.d_model * config.expert_d_ff
    assert s.grouped.static == 9 * config.n_layers * per_call
    assert s.grouped.once == 9 * per_call  # what XLA's cost analysis holds of them
    assert s.xla_flops > s.grouped.once
    assert s.grouped.run == s.grouped.static * k / 4
    assert s.run_flops == pytest.approx(s.flops - s.grouped.static + s.grouped.run)
    # their bytes too: the estimates' at the layer loop's trips, the routed share run
    assert s.grouped.static_bytes == config.n_layers * s.grouped.once_bytes > 0
    assert s.grouped.run_bytes == s.grouped.static_bytes * k / 4
    assert s.run_bytes == pytest.approx(
        s.bytes_accessed - s.grouped.static_bytes + s.grouped.run_bytes
    )
    assert s.flops * plan.tpu.chips / s.model_flops > 1.3  # the padding, counted
    text = describe(plan)
    assert "run, " in text and "a static bound" in text and f"{4 * rows:,} rows" in text
    assert plan.to_dict()["run_flops_per_chip"] == s.run_flops
    assert plan.to_dict()["run_bytes_accessed_per_chip"] == s.run_bytes


@needs_libtpu
def test_compiled_memory_agrees_with_the_analytic_estimate_within_a_factor_of_two(plans):
    for plan in plans.values():
        assert 0.5 < plan.estimated_bytes / plan.peak < 2.0, plan.to_dict()["memory"]
    one = plans["v5e-1"].step.memory
    # AdamW's two fp32 moments are twice the fp32 parameters
    assert abs(one.optimizer - 2 * one.params) <= 64


@needs_libtpu
def test_fsdp_gathers_and_reduce_scatters_tensor_all_reduces_in_tpu_hlo(plans):
    per_layer, per_step = tally(plans["fsdp,tensor"].step.collectives, lambda c: 1)
    assert per_layer["all-gather"] > 0 and per_layer["reduce-scatter"] > 0  # FSDP, per layer
    # tensor parallelism: the row-parallel products' partial sums, summed over the tensor pair
    assert per_layer["all-reduce"] + per_layer["reduce-scatter"] > 0
    assert "tensor" in plans["fsdp,tensor"].roofline.comm_by_axes
    assert "fsdp" in plans["fsdp,tensor"].roofline.comm_by_axes
    assert per_step["all-gather"] >= plans["fsdp,tensor"].recipe.model_config().n_layers


def expert_gathers(plan) -> set:
    """The shapes of the plan's all-gathers that gather one layer's expert weights whole."""
    config = plan.recipe.model_config()
    e, f, d = config.moe.n_experts, config.expert_d_ff, config.d_model
    gathers = [c for c in plan.step.collectives if c.kind == "all-gather"]
    gathered = {dims for c in gathers for _, dims in c.shapes}
    return gathered & {(e, f, d), (e, d, f), (1, e, f, d), (1, e, d, f)}


@needs_libtpu
def test_the_plan_dispatches_tokens_with_all_to_alls_in_tpu_hlo(plans):
    """moe.impl "auto" planned for 4 TPU chips with fsdp=4 (the 4 experts split over them) is
    the token dispatch: per layer, two all-to-alls of token copies forward and their two
    transposes backward, each of (fsdp, slot, d_model) with a dropless slot of the most a chip
    can send another (tokens per chip x min(k, local experts)); the expert weights are never
    gathered whole; the grouped matmuls are TPU's megablox kernels, whose weight gradient is a
    grouped kernel too (tgmm), where XLA's ragged_dot has a dense product over every local
    expert (a convolution in TPU HLO, docs/moe.md). The plan says
    so in its text and --json, as a run's report does."""
    plan = plans["experts"]
    config = plan.recipe.model_config()
    assert plan.step.experts["impl"] == plan.to_dict()["experts"]["impl"] == "dispatch"
    assert "experts: moe.impl dispatch (auto on tpu: the mesh splits the experts over 4" in (
        describe(plan)
    )
    assert not expert_gathers(plan)
    rows = plan.recipe.train.batch_size * plan.recipe.data.seq_len // 4  # tokens per chip
    # a token's k copies reach at most min(k, local experts) experts of one chip: 1 here
    local = config.moe.n_experts // 4
    block = (4, rows * min(config.moe.experts_per_token, local), config.d_model)
    exchanges = [c for c in plan.step.collectives if c.kind == "all-to-all" and c.calls]
    tokens = [c for c in exchanges if c.shapes == (("bf16", block),)]
    assert len(tokens) == 4 and all(c.runs == config.n_layers for c in tokens)
    per_layer, _ = tally(plan.step.collectives, lambda c: c.result_bytes)
    assert per_layer["all-to-all"] >= 4 * 4 * block[1] * block[2] * 2  # bf16 copies
    assert plan.step.experts["kernel"] == "megablox"
    kernels = [line for line in plan.step.hlo.splitlines() if "tpu_custom_call" in line]
    assert not [line for line in kernels if "ragged-dot" in line]  # XLA's own ragged_dot
    assert sum("tgmm" in line for line in kernels) == 3  # gate, up and down's weight gradients


@needs_libtpu
def test_grouped_experts_run_on_each_chips_own_rows_or_with_xla_ragged_dot():
    """Chips that do not split the experts: with fsdp (fsdp=4, moe.impl "ragged" asked for)
    each chip runs megablox on its own rows against the experts gathered whole, as FSDP gathers
    every weight, and moves no tokens; without fsdp (data=4) the grouped matmul is left to the
    partitioner, which cannot split a Pallas kernel, so it is XLA's ragged_dot (megablox there
    failed to lower: "Mosaic kernels cannot be automatically partitioned")."""
    own = compiled(nano("mixtral-nano", RAGGED_EXPERTS), "v5p-8", "fsdp=4")
    assert own.fits and own.step.experts["kernel"] == "megablox"
    kernels = [line for line in own.step.hlo.splitlines() if "tpu_custom_call" in line]
    assert sum("tgmm" in line for line in kernels) == 3
    assert not [c for c in own.step.collectives if c.kind == "all-to-all" and c.calls]
    assert expert_gathers(own)  # every expert gathered whole, layer by layer
    plain = compiled(nano("mixtral-nano"), "v5p-8", "data=4")
    assert plain.fits
    assert plain.step.experts["impl"] == "ragged" and plain.step.experts["kernel"] == "xla"
    kernels = [line for line in plain.step.hlo.splitlines() if "tpu_custom_call" in line]
    assert any("ragged-dot" in line for line in kernels)  # XLA's own, on TPU
    assert not any("gmm" in line for line in kernels)  # megablox's gmm and tgmm


@needs_libtpu
def test_expert_parallelism_moves_tokens_not_expert_weights_in_tpu_hlo(plans):
    """moe.impl "dense", asked for, is kept: eqllm's dense expert parallelism (experts split
    over fsdp, computed densely) all-gathers each layer's tokens over the fsdp group and
    reduce-scatters the combined outputs, and never gathers the expert weights. It dispatches
    no tokens with all-to-alls: the layer's one all-to-all moves an array of the router's size
    (experts x d_model), not tokens."""
    plan = plans["dense experts"]
    assert plan.step.experts == {"impl": "dense", "why": "set by moe.impl", "requested": "dense"}
    assert "experts: moe.impl dense (set by moe.impl)" in describe(plan)
    config = plan.recipe.model_config()
    e, d = config.moe.n_experts, config.d_model
    assert not expert_gathers(plan)
    gathers = [c for c in plan.step.collectives if c.kind == "all-gather"]
    gathered = {dims for c in gathers for _, dims in c.shapes}
    tokens = plan.recipe.train.batch_size * plan.recipe.data.seq_len
    assert any(dims[-1] == d and tokens in dims for dims in gathered)
    per_layer, _ = tally(plan.step.collectives, lambda c: 1)
    assert per_layer["reduce-scatter"] > 0
    in_layers = [c for c in plan.step.collectives if c.kind == "all-to-all" and c.calls]
    assert all(c.result_bytes <= 2 * e * d for c in in_layers)


@needs_libtpu
def test_auto_finds_a_plan_that_fits_and_eqllm_run_takes_it(tmp_path):
    corpus = make_corpus(tmp_path)
    recipe = tiny_recipe(tmp_path, corpus, steps=2, eval_every=0, checkpoint_every=0)
    tpu = parse_slice("v5e-4")
    found = search(recipe, tpu, plan_devices.slice_devices(tpu), max_compiles=1)
    assert found.best is not None and found.best.fits and found.best.headroom >= 0.1
    assert len(found.plans) == 1 and found.considered >= len(found.candidates) > 1
    # the table shows the compiled plan, then what the estimate would compile next
    table = search_table(found).splitlines()
    assert table[2].startswith("| 1 | ") and "not compiled" in table[3]
    assert found.candidates[1].describe().split()[0] in table[3].replace(" ", "")
    path = tmp_path / "planned.toml"
    path.write_text(found.best.recipe.to_toml())
    planned = load_recipe(path)
    assert planned.plan.topology == "v5e-4" and planned.mesh.resolve(4)
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
        "EQLLM_CACHE": str(tmp_path / "cache"),
    }
    run = subprocess.run(
        [sys.executable, "-m", "eqllm.cli", "run", str(path), "--out", str(tmp_path / "run")],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert any(json.loads(r).get("step") == 2 for r in rows)


# Deep and narrow, so that the layer inputs (2 GiB) outweigh a layer's working set
OFFLOAD = ["data.seq_len=256", "train.batch_size=256", "model.overrides.n_layers=128"]
OFFLOAD += ["model.overrides.vocab_size=256"]


@needs_libtpu
def test_remat_offload_keeps_each_layer_input_in_the_hosts_memory():
    """remat "offload" recomputes as "full" does, but the one value "full" keeps of each layer,
    its input, lives in the host's memory: the compiler's host bytes are exactly the layer
    inputs (bf16), the program moves them to the host's memory space (S(5) in TPU HLO), HBM's
    peak falls by them, the roofline charges their trip out and back over PCIe and the
    analytic estimate leaves them out of HBM. The compiler's own peak here is the arguments
    plus the host bytes (`_hbm_peak`): HBM's is the device's bound, well below it."""
    full, offload = (
        compiled(nano("llama-nano", f'train.remat="{r}"', *OFFLOAD), "v5e-1", "data=1")
        for r in ("full", "offload")
    )
    recipe, config = offload.recipe, offload.recipe.model_config()
    batch, seq = recipe.train.batch_size, recipe.data.seq_len
    layer_inputs = config.n_layers * batch * seq * config.d_model * 2
    m = offload.step.memory
    assert full.step.memory.host == 0 and m.host == layer_inputs
    assert offload.peak == m.arguments + m.temporaries + m.outputs - m.aliased
    assert offload.peak < m.arguments + m.host
    assert full.peak - offload.peak >= 0.9 * layer_inputs
    assert "S(5)" in offload.step.hlo and "S(5)" not in full.step.hlo
    chip = offload.tpu.chip
    assert full.roofline.host_s == 0
    assert offload.roofline.host_s == pytest.approx(2 * layer_inputs / chip.host_link)
    assert full.estimated_bytes - offload.estimated_bytes == layer_inputs
    sizes = {"data": 1}
    assert offloaded_bytes(config, sizes, batch_size=batch, seq_len=seq) == 2 * layer_inputs
    assert offloaded_bytes(full.recipe.model_config(), sizes, batch_size=batch, seq_len=seq) == 0
    text = describe(offload)
    assert "offloaded to the host's memory" in text and "host link" in text
    assert offload.to_dict()["memory"]["host"] == layer_inputs


def test_the_search_offloads_layer_inputs_where_nothing_else_fits():
    """MaxText's llama3.1-405b configuration (2 x v6e-256, 512 x 8,192 tokens): every plan the
    estimate lets fit keeps the layer inputs in the host's memory, since with them in HBM
    (126 x 8,192 x 16,384 x 2 bytes per sequence a chip holds) none does."""
    recipe, _ = recipe_for("zoo:llama3.1-405b")
    tpu = parse_slice("v6e-256", slices=2)
    recipe = with_settings(recipe, batch=512, seq=8192, topology=tpu.cloud_name, slices=2)
    tried, found = candidates(recipe, tpu)
    assert tried > 500 and found and {c.remat for c in found} == {"offload"}


@needs_libtpu
def test_what_crosses_slices_is_counted_over_the_data_center_network():
    """On two slices the TPU compiler gathers FSDP's weights within each slice (ICI) and sends
    the rest to the other slice through the megascale runtime: those sends are counted as
    all-gathers between slices, and the roofline charges their bytes to the chip's DCN share."""
    tpu = parse_slice("v5e-4", slices=2)
    recipe = with_settings(
        nano(), mesh=MeshConfig.parse("fsdp=8"), topology=tpu.cloud_name, slices=2
    )
    plan = plan_recipe(recipe, tpu, plan_devices.slice_devices(tpu))
    between = [c for c in plan.step.collectives if c.dcn]
    assert between and {c.kind for c in between} >= {"all-gather"}
    assert all(len(c.group) == 4 for c in plan.step.collectives if not c.dcn)  # in a slice
    sent = sum(c.result_bytes * c.runs for c in between)
    assert plan.roofline.dcn_s == pytest.approx(sent / tpu.chip.dcn_per_chip)
    assert plan.roofline.comm_by_axes["between slices"] == pytest.approx(plan.roofline.dcn_s)
    assert "between slices (sent over DCN)" in describe(plan)


def test_several_slices_are_described_slice_by_slice():
    devices = plan_devices.slice_devices(parse_slice("v5p-8", slices=2))
    assert len(devices) == 8 and {d.slice_index for d in devices} == {0, 1}
    assert [d.slice_index for d in devices] == sorted(d.slice_index for d in devices)


# The command line -----------------------------------------------------------------------------


@needs_libtpu
def test_a_model_too_large_for_the_slice_gets_the_nothing_fits_message(capsys):
    assert main(["plan", "zoo:llama3-8b", "--topology", "v5e-4", "--mesh", "auto"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("eqllm: error: nothing fits: no plan of llama3-8b") and "\n" not in err
    assert "v5e-4 (v5e:2x2, 4 chips)" in err and "the estimate says v5e-" in err


@needs_libtpu
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--topology", "v5e-3"], "v5e names count chips"),
        (["--topology", "v5p-8", "--mesh", "fsdp=3"], "needs 3 devices but 4"),
        (["--topology", "v5p-8", "--mesh", "tensor=4"], "tensor=4 does not divide"),
        (["--topology", "v5p-8", "--mesh", "fsdp=4", "--batch", "6"], "do not split over"),
        (["--topology", "v5p-8", "--mesh", "expert=4"], "no expert axis"),
        (
            ["--topology", "v5e-1", "--set", 'model.overrides.attention.kernel="cudnn"'],
            "cannot compile for TPU",
        ),
    ],
)
def test_bad_input_is_one_line(capsys, argv, message):
    assert main(["plan", "zoo:llama-nano", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after "compiling ..."
    assert err.startswith("eqllm: error:") and message in err


def test_without_libtpu_plan_prints_the_install_command(capsys, monkeypatch):
    monkeypatch.setattr(plan_devices, "libtpu_installed", lambda: False)
    assert main(["plan", "zoo:llama-nano", "--topology", "v5e-1"]) == 2
    err = capsys.readouterr().err
    assert f'pip install "jax[tpu]=={jax.__version__}"' in err


def test_tpu_probe_is_quiet_and_tests_see_the_cpu():
    """With libtpu installed on this machine, starting JAX prints nothing and gives the CPU."""
    code = "import eqllm; eqllm.configure_process(); import jax; print(jax.devices()[0].platform)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPU_")}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.strip() == "cpu" and out.stderr == ""


# At real size, on the recipes' own slices ------------------------------------------------------


# DeepSeek-V3's dropless dispatch on its 512 chips is refused (202.61G of temporaries: the
# all-to-all blocks hold fsdp x each chip's copies); with a capacity factor of 1.0 it fits with
# 60% of HBM free (docs/moe.md, "At scale, compiled for TPU").
CAPACITY = ['model.overrides.moe.impl="dispatch"', "model.overrides.moe.capacity_factor=1.0"]


@pytest.mark.slow
@needs_libtpu
@pytest.mark.parametrize(
    "name, sets", [("llama3-8b", []), ("mixtral-8x7b", []), ("deepseek-v3", CAPACITY)]
)
def test_large_recipes_compile_and_fit_on_their_slices(name, sets):
    """A dense model, a mixture of experts and DeepSeek-V3 (latent attention, 256 experts) at
    their published sizes, compiled by the TPU compiler on the slice their [plan] names (minutes
    each; DeepSeek-V3 on 512 chips the longest: docs/experiments/at_scale.md); the mixtures of
    experts with the token dispatch, as "auto" chooses for the TPU."""
    recipe = load_or_set(load_recipe(name), sets)
    tpu = parse_slice(recipe.plan.topology, recipe.plan.slices)
    plan = plan_recipe(recipe, tpu, plan_devices.slice_devices(tpu))
    assert plan.fits and plan.headroom >= 0.1, plan.to_dict()
    per_layer, _ = tally(plan.step.collectives, lambda c: 1)
    assert per_layer["all-gather"] > 0  # FSDP gathers each layer's weights in the layer loop
