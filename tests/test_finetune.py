"""Fine-tuning: instruction data and loss masks, and LoRA training that leaves the base alone."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqllm
from eqllm import lora
from eqllm.data import DataError, Tokenizer
from eqllm.data.instruct import ChatFormat, prepare_instructions, read_examples
from eqllm.eval.loss import mean_loss
from eqllm.recipe import OptimSpec
from eqllm.train import TrainStep, init_opt_state, make_optimizer, schedule

EXAMPLES = [
    {"instruction": "Add two numbers.", "input": "2 and 3", "output": "5"},
    {"instruction": "Name a colour.", "output": "Blue."},
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye"},
            {"role": "assistant", "content": "Goodbye."},
        ]
    },
]


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
    path = tmp_path_factory.mktemp("instruct") / "data.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in EXAMPLES) + "\n")
    return path


def test_mask_covers_exactly_the_responses_and_eos(jsonl):
    tok = Tokenizer.bytes()
    chat = ChatFormat(tok)
    for messages in read_examples(jsonl):
        ids, mask = chat.encode(messages)
        trained = tok.decode(ids[mask])
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        assert trained == tok.eot_token.join(answers) + tok.eot_token  # each turn ends with EOS
        assert ids[mask][-1] == tok.eot_id and (ids == tok.eot_id).sum() == len(answers)
    assert "<|user|>\nAdd two numbers.\n\n2 and 3\n<|assistant|>\n" in chat.render(
        read_examples(jsonl)[0]
    )


def test_chat_template_of_the_tokenizer_is_used():
    template = (
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% if m.role == 'assistant' %}"
        "{{ eos_token }}{% endif %}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    chat = ChatFormat(Tokenizer.bytes(), template)
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert chat.render(messages[:1], add_generation_prompt=True) == "[user]q[assistant]"
    ids, mask = chat.encode(messages)
    assert chat.tokenizer.decode(ids[mask]).startswith("a")


def test_missing_field_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(EXAMPLES[0]) + "\n\n" + json.dumps({"instruction": "x"}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl line 3: missing field\(s\) \['output'\]"):
        read_examples(path)


def test_bad_files_and_messages_are_named(tmp_path):
    """The one record reader behind instruction, preference and prompt files names the file,
    the line (JSONL) or index (JSON) and the problem."""
    from eqllm.data import DataNotFound
    from eqllm.data.preference import read_pairs

    with pytest.raises(DataNotFound, match="instruction data file .*nope.jsonl' does not exist"):
        read_examples(tmp_path / "nope.jsonl")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="blank.jsonl holds no preference pairs"):
        read_pairs(tmp_path / "blank.jsonl")
    (tmp_path / "broken.jsonl").write_text(json.dumps(EXAMPLES[0]) + "\n{not json\n")
    with pytest.raises(DataError, match="broken.jsonl line 2: not valid JSON"):
        read_examples(tmp_path / "broken.jsonl")
    (tmp_path / "one.json").write_text(json.dumps(EXAMPLES[0]))
    with pytest.raises(DataError, match="a .json file must hold a list of examples"):
        read_examples(tmp_path / "one.json")
    bad = {"messages": [{"role": "user", "content": "q"}, {"role": "bot", "content": "a"}]}
    (tmp_path / "roles.json").write_text(json.dumps([EXAMPLES[1], bad]))
    with pytest.raises(DataError, match=r"roles.json example 1: messages\[1\] needs 'role'"):
        read_examples(tmp_path / "roles.json")
    (tmp_path / "text.json").write_text(json.dumps([{"messages": "hi"}]))
    with pytest.raises(DataError, match="'messages' must be a non-empty list of chat messages"):
        read_examples(tmp_path / "text.json")


def test_masked_loss_equals_transformers_with_ignored_prompt(jsonl, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=260,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)
    model = eqllm.hub.from_pretrained(tmp_path)
    data = prepare_instructions(jsonl, Tokenizer.bytes(), seq_len=64)
    assert data.truncated == 1  # the chat example is longer than 65 tokens
    labels = data.rows.copy()
    labels[:, 1:][~data.mask] = -100
    labels[:, 0] = -100
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(data.rows), labels=torch.tensor(labels)).loss.item()
    ours = float(mean_loss(model, jnp.asarray(data.rows), jnp.asarray(data.mask)))
    assert abs(ours - ref) < 1e-5


def test_lora_steps_keep_the_base_bit_identical(jsonl):
    base = eqllm.zoo.create(
        "llama-nano",
        d_model=32,
        n_layers=2,
        attention={"n_heads": 2, "n_kv_heads": 1},
        mlp={"d_ff": 64},
        key=jax.random.key(0),
    )
    model = lora.apply(base, rank=2, alpha=4, targets=["q_proj", "v_proj"], key=jax.random.key(1))
    frozen_before = [np.array(x) for x in jax.tree.leaves(eqx.filter(base, eqx.is_array))]
    optimizer = make_optimizer(OptimSpec(lr=1e-2, warmup_steps=0), 5, model)
    opt_state = init_opt_state(optimizer, model)
    n_adapter = sum(
        a.lora_a.weight.size + a.lora_b.weight.size for a in lora.adapters(model).values()
    )
    moments = [x for x in jax.tree.leaves(opt_state) if x.ndim > 0]
    assert sum(x.size for x in moments) == 2 * n_adapter  # AdamW's mu and nu, adapters only
    step = TrainStep(optimizer, schedule(OptimSpec(), 5))
    data = prepare_instructions(jsonl, Tokenizer.bytes(), seq_len=64)
    for i in range(3):
        model, opt_state, metrics = step(model, opt_state, data.batch_at(i, seed=0, batch_size=2))
        assert bool(metrics["finite"])
    assert step.n_traces == 1
    assert np.any(np.asarray(model.blocks.attn.q_proj.lora_b.weight))  # the adapters learned
    merged_base = eqx.tree_at(
        lambda m: [m.blocks.attn.q_proj, m.blocks.attn.v_proj],
        model,
        [model.blocks.attn.q_proj.base, model.blocks.attn.v_proj.base],
    )
    after = [np.asarray(x) for x in jax.tree.leaves(eqx.filter(merged_base, eqx.is_array))]
    for b, a in zip(frozen_before, after, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def lora_run(jsonl, tmp_path_factory):
    """A tiny LoRA run from a Hugging Face base folder (with a byte tokenizer) on `jsonl`."""
    from eqllm.hub.folders import save_tokenizer
    from eqllm.recipe import Recipe
    from eqllm.train import loop

    root = tmp_path_factory.mktemp("lora-run")
    base = eqllm.zoo.create(
        "llama-nano",
        vocab_size=257,
        d_model=32,
        n_layers=2,
        attention={"n_heads": 2, "n_kv_heads": 1},
        mlp={"d_ff": 64},
        max_seq_len=128,
        key=jax.random.key(0),
    )
    eqllm.hub.save_pretrained(base, root / "base", tokenizer=Tokenizer.bytes())
    save_tokenizer(Tokenizer.bytes(), root / "base")
    recipe = Recipe.from_dict(
        {
            "model": {"variant": "llama-nano", "init_from": str(root / "base")},
            "finetune": {
                "method": "lora",
                "rank": 2,
                "alpha": 4.0,
                "data": str(jsonl),
                "targets": ["q_proj", "v_proj", "down_proj"],
            },
            "data": {"seq_len": 64, "val_fraction": 0.0},
            "optim": {"lr": 1e-2, "warmup_steps": 0},
            "train": {"batch_size": 2, "steps": 4, "eval_every": 0, "checkpoint_every": 0},
            "eval": {"sample_prompts": ["Name a colour."], "sample_tokens": 4, "batches": 1},
        }
    )
    loop.run(recipe, root / "run", progress=False, echo=lambda *a: None)
    return root


@pytest.mark.slow
def test_lora_run_reports_before_and_after_and_converts(lora_run, capsys):
    from eqllm import cli, loading

    report = (lora_run / "run" / "report.md").read_text()
    assert "## Samples before and after fine-tuning" in report and "<|user|>" in report
    model, tokenizer = loading.load(lora_run / "run")
    assert len(lora.adapters(model)) == 3
    base = eqllm.hub.from_pretrained(lora_run / "base")
    np.testing.assert_array_equal(  # the base weights are untouched
        model.blocks.attn.q_proj.base.weight, base.blocks.attn.q_proj.weight
    )
    tokens = jnp.arange(40) % 200
    ours = np.asarray(model(tokens))
    assert cli.main(["convert", str(lora_run / "run"), str(lora_run / "adapter")]) == 0
    assert "PEFT LoRA adapter" in capsys.readouterr().out
    with_adapter = eqllm.hub.from_pretrained(lora_run / "base", adapter=lora_run / "adapter")
    np.testing.assert_allclose(np.asarray(with_adapter(tokens)), ours, atol=1e-5, rtol=0)
    assert cli.main(["convert", str(lora_run / "run"), str(lora_run / "merged"), "--merge"]) == 0
    merged = eqllm.hub.from_pretrained(lora_run / "merged")
    np.testing.assert_allclose(np.asarray(merged(tokens)), ours, atol=1e-5, rtol=0)
    assert cli.main(["convert", str(lora_run / "base"), str(lora_run / "x"), "--merge"]) == 2
    argv = ["generate", str(lora_run / "run"), "--chat", "--prompt", "Hi", "--max-new-tokens", "3"]
    assert cli.main(argv) == 0


@pytest.mark.slow
def test_lora_dropout_acts_in_training_steps_only(jsonl):
    base = eqllm.zoo.create(
        "llama-nano",
        d_model=32,
        n_layers=2,
        attention={"n_heads": 2, "n_kv_heads": 1},
        mlp={"d_ff": 64},
        key=jax.random.key(0),
    )
    plain = lora.apply(base, rank=2, alpha=4, targets=["q_proj"], key=jax.random.key(1))
    dropped = lora.apply(
        base, rank=2, alpha=4, targets=["q_proj"], dropout=0.5, key=jax.random.key(1)
    )
    nonzero = lambda m: eqx.tree_at(  # noqa: E731
        lambda m: m.blocks.attn.q_proj.lora_b.weight, m, replace_fn=lambda w: w + 0.1
    )
    plain, dropped = nonzero(plain), nonzero(dropped)
    tokens = jnp.arange(20)
    np.testing.assert_array_equal(dropped(tokens), plain(tokens))  # no key: no dropout
    keyed = lora.with_dropout_keys(dropped, jax.random.key(2))
    assert keyed.blocks.attn.q_proj.key.shape == (2,)  # one key per stacked layer
    assert np.abs(np.asarray(keyed(tokens) - plain(tokens))).max() > 1e-4
    optimizer = make_optimizer(OptimSpec(warmup_steps=0), 5, dropped)
    opt_state = init_opt_state(optimizer, dropped)
    step = TrainStep(optimizer, schedule(OptimSpec(), 5))
    data = prepare_instructions(jsonl, Tokenizer.bytes(), seq_len=64)
    for i in range(2):
        dropped, opt_state, _ = step(dropped, opt_state, data.batch_at(i, seed=0, batch_size=2))
    assert step.n_traces == 1 and dropped.blocks.attn.q_proj.key is None


@pytest.mark.slow  # the LoRA run of `lora_run`
def test_a_lora_run_folder_records_its_adapters_and_an_older_one_reads_the_recipe(
    lora_run, tmp_path
):
    """run.json holds the adapters' settings; a folder written before it (no run.json) gets
    them from its recipe's [finetune]: both load the same model, without the training data."""
    import shutil

    from eqllm.runs import Adapters, RunFolder

    run = RunFolder(lora_run / "run")
    assert run.adapters() == Adapters(2, 4.0, ("q_proj", "v_proj", "down_proj"))
    assert run.prompts_in_chat() and run.objective() == "sft"
    older = RunFolder(shutil.copytree(run.path, tmp_path / "older"))
    (older.path / "run.json").unlink()
    assert older.format_version == 0 and older.adapters() == run.adapters()
    assert older.prompts_in_chat() and older.objective() == "sft"
    a, _ = run.load_model()
    b, _ = older.load_model()
    tokens = jnp.arange(20) % 200
    np.testing.assert_array_equal(np.asarray(a(tokens)), np.asarray(b(tokens)))


def test_init_from_takes_the_overrides_that_keep_its_weights(tmp_path):
    """model.overrides apply to init_from's weights (DeepSeek-V3's and GLM's recipes set
    moe.bias_update_speed there); an override that changes a weight's shape is refused."""
    from eqllm.recipe import Recipe, RecipeError
    from eqllm.train.setup import build_model

    base = eqllm.zoo.create("llama-nano", n_layers=2, d_model=32, key=jax.random.key(0))
    eqllm.hub.save_pretrained(base, tmp_path / "base")

    def built(overrides):
        model = {"variant": "llama-nano", "init_from": str(tmp_path / "base")}
        recipe = {"model": {**model, "overrides": overrides}, "train": {"steps": 1}}
        return build_model(Recipe.from_dict(recipe), 257)

    model = built({"norms": {"eps": 1e-3}, "positions": {"theta": 5e4}})
    assert (model.config.norms.eps, model.config.positions.theta) == (1e-3, 5e4)
    for ours, theirs in zip(jax.tree.leaves(model), jax.tree.leaves(base), strict=True):
        np.testing.assert_array_equal(ours, theirs)
    with pytest.raises(RecipeError, match=r"\['n_layers'\] change the shapes"):
        built({"n_layers": 3})
