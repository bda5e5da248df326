"""Preference optimisation: data, the DPO/IPO/SimPO losses against TRL, the LoRA reference."""

import json
import math
from types import SimpleNamespace

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqllm
from eqllm import lora
from eqllm.data import DataError, Tokenizer
from eqllm.data.instruct import ChatFormat
from eqllm.data.preference import encode_response, prepare_preferences, read_pairs
from eqllm.train.objectives import Preference, reference_logps

PAIRS = [
    {
        "prompt": "Return the square of x.",
        "chosen": "def f(x):\n    return x * x\n",
        "rejected": "def f(x):\n    return x + x\n",
    },
    {
        "prompt": [{"role": "user", "content": "Add a and b."}],
        "chosen": [
            {"role": "user", "content": "Add a and b."},
            {"role": "assistant", "content": "def add(a, b):\n    return a + b\n"},
        ],
        "rejected": [
            {"role": "user", "content": "Add a and b."},
            {"role": "assistant", "content": "def add(a, b):\n    return a - b\n"},
        ],
    },
    {
        "prompt": "Is 7 prime?",
        "chosen": [{"role": "assistant", "content": "Yes."}],
        "rejected": "No, 7 is even.",
    },
]


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("pref") / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in PAIRS) + "\n")
    return path


def test_pairs_read_strings_and_binarized_messages(pairs_file):
    pairs = read_pairs(pairs_file)
    prompt, chosen, rejected = pairs[1]
    assert prompt == [{"role": "user", "content": "Add a and b."}]
    assert chosen == [{"role": "assistant", "content": "def add(a, b):\n    return a + b\n"}]
    assert rejected[0]["content"].endswith("a - b\n")
    assert pairs[2][2] == [{"role": "assistant", "content": "No, 7 is even."}]


def test_response_mask_covers_the_response_and_eos_only():
    tok = Tokenizer.bytes()
    chat = ChatFormat(tok)
    prompt = [{"role": "user", "content": "Hi"}]
    ids, mask, n_prompt = encode_response(chat, prompt, [{"role": "assistant", "content": "Yo"}])
    assert tok.decode(ids[:n_prompt]) == "<|user|>\nHi\n<|assistant|>\n"
    assert tok.decode(ids[mask]) == "Yo" + tok.eot_token and not mask[:n_prompt].any()


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({"prompt": "p", "chosen": "a"}, r"line 2: missing field\(s\) \['rejected'\]"),
        ({"prompt": "p", "chosen": "  ", "rejected": "b"}, r"line 2: 'chosen' is empty"),
        ({"prompt": "p", "chosen": "a", "rejected": "a"}, r"line 2: 'chosen' and 'rejected' are"),
        (
            {"prompt": [{"role": "user", "content": "p"}], "chosen": "a", "rejected": [{"x": 1}]},
            r"line 2: rejected\[0\] needs 'role'",
        ),
    ],
)
def test_bad_pairs_name_the_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(PAIRS[0]) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(DataError, match=message):
        read_pairs(path)


def test_prompt_filling_the_window_is_refused_naming_the_line(pairs_file):
    with pytest.raises(DataError, match=r"pairs.jsonl line 1: the prompt has \d+ tokens"):
        prepare_preferences(pairs_file, Tokenizer.bytes(), seq_len=20)


def test_long_pairs_keep_their_start(pairs_file):
    data = prepare_preferences(pairs_file, Tokenizer.bytes(), seq_len=48)
    assert data.truncated > 0 and data.rows.shape == (3, 49) and data.mask[:, -1].any()


def _tiny_model():
    return eqllm.zoo.create(
        "llama-nano", d_model=32, n_layers=2, attention={"n_heads": 2, "n_kv_heads": 1},
        mlp={"d_ff": 64},
        key=jax.random.key(0),
    )  # fmt: skip


def _lora(model, seed=1):
    return lora.apply(
        model, rank=2, alpha=4, targets=["q_proj", "v_proj", "up_proj"], key=jax.random.key(seed)
    )


def test_disabled_adapters_are_the_base_bit_for_bit(pairs_file):
    base = _tiny_model()
    adapted = _lora(base)
    adapted = jax.tree.map(  # trained-looking adapters: B non-zero
        lambda x: x + 0.05 if x.ndim == 3 and x.shape[-1] == 2 else x,
        adapted,
        is_leaf=eqx.is_array,
    )
    tokens = jnp.asarray(prepare_preferences(pairs_file, Tokenizer.bytes(), seq_len=96).rows)
    assert not np.array_equal(np.asarray(adapted(tokens)), np.asarray(base(tokens)))
    off = lora.disabled(adapted)(tokens)
    np.testing.assert_array_equal(np.asarray(off), np.asarray(base(tokens)))


@pytest.mark.parametrize("kind", ["dpo", "ipo"])
def test_step_zero_loss_under_lora(pairs_file, kind):
    model = _lora(_tiny_model())
    data = prepare_preferences(pairs_file, Tokenizer.bytes(), seq_len=96)
    batch = jax.tree.map(jnp.asarray, data.batch_at(0, seed=0, batch_size=2))
    objective = Preference(kind, beta=0.1)
    loss, parts = objective(model, batch)
    expected = math.log(2) if kind == "dpo" else (1 / (2 * 0.1)) ** 2
    assert float(loss) == pytest.approx(expected, abs=0, rel=1e-7)
    assert float(parts["reward_margin"]) == 0.0


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    """A tiny transformers Llama as reference and a perturbed copy as policy, saved; eqllm's
    copies of both; and a batch of pairs tokenized by eqllm (equal prompt lengths, so TRL's
    right padding and eqllm's rows hold the same tokens at the same positions)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=260, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(config).eval()
    policy = transformers.LlamaForCausalLM(config).eval()
    policy.load_state_dict(ref.state_dict())
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.02 * torch.randn_like(p))
    root = tmp_path_factory.mktemp("hf")
    ref.save_pretrained(root / "ref")
    policy.save_pretrained(root / "policy")
    tok = Tokenizer.bytes()
    chat = ChatFormat(tok)
    rows = []
    for p, c, r in (("aaa", "bb", "cdcd"), ("bcd", "effe", "g"), ("xyz", "x", "yy")):
        prompt = [{"role": "user", "content": p}]
        enc = [encode_response(chat, prompt, [{"role": "assistant", "content": s}]) for s in (c, r)]
        n = enc[0][2]
        rows.append({"prompt_ids": enc[0][0][:n].tolist(), "chosen_ids": enc[0][0][n:].tolist(),
                     "rejected_ids": enc[1][0][n:].tolist()})  # fmt: skip
    # The reference's log-probabilities from transformers, before any trainer exists (TRL's
    # trainers change what the reference computes in place), handed to TRL as precomputed.
    for r in rows:
        for side in ("chosen", "rejected"):
            ids = torch.tensor([r["prompt_ids"] + r[f"{side}_ids"]])
            with torch.no_grad():
                logp = torch.log_softmax(ref(ids).logits[0, :-1], -1)
            scored = logp.gather(-1, ids[0, 1:, None])[len(r["prompt_ids"]) - 1 :]
            r[f"ref_{side}_logps"] = scored.sum().item()
    return SimpleNamespace(
        torch=torch,
        ref=ref,
        policy=policy,
        ours=eqllm.hub.from_pretrained(root / "policy"),
        ours_ref=eqllm.hub.from_pretrained(root / "ref"),
        rows=rows,
    )


def _our_batch(rows, width):
    """eqllm's [pairs, 2, width + 1] tokens and [pairs, 2, width] target masks."""
    tokens = np.zeros((len(rows), 2, width + 1), np.int64)
    mask = np.zeros((len(rows), 2, width), bool)
    for i, r in enumerate(rows):
        for j, side in enumerate((r["chosen_ids"], r["rejected_ids"])):
            ids = r["prompt_ids"] + side
            tokens[i, j, : len(ids)] = ids
            mask[i, j, len(r["prompt_ids"]) - 1 : len(ids) - 1] = True
    return {"tokens": jnp.asarray(tokens), "mask": jnp.asarray(mask)}


def _our_loss_and_grads(hf_pair, objective):
    batch = _our_batch(hf_pair.rows, 40)
    if objective.kind != "simpo":
        flat = batch["tokens"].reshape(-1, 41), batch["mask"].reshape(-1, 40)
        batch["ref"] = reference_logps(hf_pair.ours_ref, *flat).reshape(-1, 2)
    (loss, parts), grads = eqx.filter_value_and_grad(objective, has_aux=True)(hf_pair.ours, batch)
    return float(loss), grads


def _compare_grads(torch_model, grads):
    q = torch_model.model.layers[1].self_attn.q_proj.weight.grad.numpy()
    embed = torch_model.model.embed_tokens.weight.grad.numpy()
    head = torch_model.lm_head.weight.grad.numpy()
    ours_q = np.asarray(grads.blocks.attn.q_proj.weight[1])
    np.testing.assert_allclose(ours_q, q, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grads.embed.weight), embed, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grads.lm_head.weight), head, rtol=1e-4, atol=1e-6)
    assert np.abs(q).max() > 1e-4  # a gradient worth comparing


@pytest.mark.parametrize("kind", ["dpo", pytest.param("ipo", marks=pytest.mark.slow)])
def test_dpo_and_ipo_loss_and_gradient_equal_trl(hf_pair, kind, tmp_path):
    trl = pytest.importorskip("trl")
    import datasets
    import tokenizers
    import transformers

    rows = hf_pair.rows
    vocab = {chr(97 + i): i for i in range(26)} | {"<eos>": 26}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<eos>"))
    processing = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<eos>", pad_token="<eos>"
    )
    args = trl.DPOConfig(
        output_dir=str(tmp_path), loss_type=["sigmoid" if kind == "dpo" else "ipo"], beta=0.3,
        report_to=[], use_cpu=True, per_device_train_batch_size=3, precompute_ref_log_probs=True,
    )  # fmt: skip
    dataset = datasets.Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}])
    trainer = trl.DPOTrainer(
        model=hf_pair.policy, ref_model=hf_pair.ref, args=args, train_dataset=dataset,
        processing_class=processing,
    )  # fmt: skip
    inputs = trainer.data_collator(rows)
    trainer.model.train()
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, inputs, False)
    loss.backward()
    ours, grads = _our_loss_and_grads(hf_pair, Preference(kind, beta=0.3))
    assert abs(ours - loss.item()) < 1e-5
    assert abs(ours - (math.log(2) if kind == "dpo" else 1 / 0.6**2)) > 1e-3  # not at step 0
    _compare_grads(trainer.accelerator.unwrap_model(trainer.model), grads)


@pytest.mark.parametrize(("kind", "smoothing"), [("simpo", 0.0), ("simpo", 0.1), ("dpo", 0.1)])
def test_simpo_and_conservative_dpo_equal_trl_cpo(hf_pair, kind, smoothing):
    """TRL's CPO trainer holds SimPO (loss_type "simpo") and the label-smoothed sigmoid loss;
    fed the log-ratios, its sigmoid loss is conservative DPO."""
    pytest.importorskip("trl")
    from trl.experimental.cpo import CPOTrainer

    torch = hf_pair.torch
    policy = hf_pair.policy
    policy.zero_grad()
    batch = _our_batch(hf_pair.rows, 40)
    tokens = torch.tensor(np.asarray(batch["tokens"]).reshape(-1, 41))
    labels = tokens.clone()
    labels[:, 1:][~torch.tensor(np.asarray(batch["mask"]).reshape(-1, 40))] = -100
    labels[:, 0] = -100
    simpo = kind == "simpo"
    logps = CPOTrainer.get_batch_logps(policy(tokens).logits, labels, average_log_prob=simpo)
    if not simpo:
        ref = [[r["ref_chosen_logps"], r["ref_rejected_logps"]] for r in hf_pair.rows]
        logps = logps - torch.tensor(ref).reshape(-1)
    cpo = SimpleNamespace(
        alpha=0.0, loss_type="simpo" if simpo else "sigmoid", beta=2.0, simpo_gamma=0.7,
        label_smoothing=smoothing, accelerator=SimpleNamespace(device="cpu"),
    )  # fmt: skip
    losses, _, _ = CPOTrainer.cpo_loss(cpo, logps[0::2], logps[1::2])
    losses.mean().backward()
    objective = Preference(kind, beta=2.0, label_smoothing=smoothing, gamma=0.7)
    ours, grads = _our_loss_and_grads(hf_pair, objective)
    assert abs(ours - losses.mean().item()) < 1e-5
    _compare_grads(policy, grads)


BINARIZED = [  # the columns of UltraFeedback-binarized: the responses repeat the prompt turn
    {
        "question": q,
        "good": [{"role": "user", "content": q}, {"role": "assistant", "content": good}],
        "bad": [{"role": "user", "content": q}, {"role": "assistant", "content": bad}],
        "score": i,
    }
    for i, (q, good, bad) in enumerate(
        [
            ("Square x.", "return x * x\n", "return x + x\n"),
            ("Add a and b.", "return a + b\n", "return a - b\n"),
            ("Negate y.", "return -y\n", "return y\n"),
            ("Halve z.", "return z / 2\n", "return z * 2\n"),
        ]
    )
]


@pytest.fixture(scope="module")
def binarized(tmp_path_factory):
    """The same pairs as JSONL and as Hugging Face datasets the test writes with `datasets`:
    a DatasetDict saved to disk (train/test), a parquet file, a folder of data files."""
    import datasets

    root = tmp_path_factory.mktemp("hf")
    (root / "pairs.jsonl").write_text("\n".join(json.dumps(r) for r in BINARIZED) + "\n")
    ds = datasets.Dataset.from_list(BINARIZED)
    datasets.DatasetDict({"train_prefs": ds, "test_prefs": ds.select([0])}).save_to_disk(
        root / "saved"
    )
    ds.to_parquet(str(root / "pairs.parquet"))
    (root / "files" / "data").mkdir(parents=True)  # the hub's layout of a split's shards
    ds.to_parquet(str(root / "files" / "data" / "train_prefs-00000-of-00001.parquet"))
    return root


@pytest.mark.parametrize("source", ["saved", "pairs.parquet", "hf:files"])
def test_pairs_from_a_hugging_face_dataset_equal_the_jsonl_ones(binarized, source):
    tok = Tokenizer.bytes()
    fields = ("question", "good", "bad")
    args = dict(seq_len=64, val_fraction=0.25, seed=3, fields=fields)
    expected = prepare_preferences(binarized / "pairs.jsonl", tok, **args)
    spec = "hf:" + str(binarized / "files") if source == "hf:files" else binarized / source
    data = prepare_preferences(spec, tok, **args, split="train_prefs")
    for name in ("rows", "mask", "rejected", "rejected_mask", "val_rows", "val_rejected"):
        np.testing.assert_array_equal(getattr(data, name), getattr(expected, name))
    assert data.meta["train_pairs"] == 3 and data.meta["val_pairs"] == 1
    prompt, chosen, _ = read_pairs(binarized / "saved", split="test_prefs", fields=fields)[0]
    assert prompt == [{"role": "user", "content": "Square x."}]  # the repeated turn dropped
    assert chosen == [{"role": "assistant", "content": "return x * x\n"}]


def test_bad_dataset_splits_and_columns_are_named(binarized):
    with pytest.raises(DataError, match=r"has splits \['test_prefs', 'train_prefs'\], not 'train'"):
        read_pairs(binarized / "saved")
    with pytest.raises(DataError, match=r"saved \(train_prefs\) row 0: missing field.*"
                       r"preference.prompt_field.*the record has \['bad', 'good'"):  # fmt: skip
        read_pairs(binarized / "saved", split="train_prefs")


def test_recipe_reads_preference_data_from_a_dataset(binarized):
    from eqllm.recipe import Recipe, RecipeError
    from eqllm.train.objectives import Preference

    values = {
        "model": {"variant": "llama-nano", "init_from": str(binarized)},
        "finetune": {"method": "lora"},
        "preference": {"data": str(binarized / "saved"), "split": "train_prefs",
                       "prompt_field": "question", "chosen_field": "good",
                       "rejected_field": "bad"},
        "data": {"seq_len": 64, "val_fraction": 0.25, "tokenizer": "bytes"},
        "train": {"steps": 1, "batch_size": 2},
    }  # fmt: skip
    data = Preference.prepare(Recipe.from_dict(values))  # the base has no tokenizer: bytes
    assert data.meta["train_pairs"] == 3
    values["preference"]["data"] = str(binarized / "missing")
    with pytest.raises(RecipeError, match="preference.data=.*missing' does not exist"):
        Recipe.from_dict(values)
    values["preference"]["data"] = "hf:someone/prefs"  # not checked before loading: no network
    assert Recipe.from_dict(values).preference.data == "hf:someone/prefs"
