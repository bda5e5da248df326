"""`eqllm serve BASE --adapter name=path`: many LoRA adapters over one base, through `openai`.

Two PEFT adapters with different targets, ranks and alphas are made with peft on a tiny random
transformers Llama. One server holds both over one copy of the base; requests for each adapter
and for the base run concurrently, and each request's greedy tokens and log-probabilities
equal those of its adapter's model merged by peft (`merge_and_unload`), loaded into eqllm as an
independent reference and run alone.
"""

from __future__ import annotations

import concurrent.futures
import json

import jax
import numpy as np
import pytest

openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from eqllm import cli, loading  # noqa: E402
from eqllm.commands.serve import chat_format_of  # noqa: E402
from eqllm.errors import EqllmError  # noqa: E402
from eqllm.generation import Engine, Params, Token  # noqa: E402
from eqllm.generation.adapters import MultiLoraLinear  # noqa: E402
from eqllm.serve.adapters import load_adapters, parse_specs  # noqa: E402
from eqllm.serve.app import Service, create_app  # noqa: E402
from tests.serve_helpers import ServerThread, post, tiny_folder  # noqa: E402

BASE = "tiny"
# name -> (rank, alpha, targets): different targets, ranks and scales in one server.
ADAPTERS = {
    "alpha": (4, 8, ["q_proj", "v_proj"]),
    "beta": (2, 3, ["k_proj", "o_proj", "up_proj", "down_proj"]),
}
PROMPTS = [
    "the cat sat on the mat and the dog sat on the log, a quick brown fox jumps over",
    "hello world, this is",
]
NEW = 10


def _peft_adapter(folder, out, rank: int, alpha: int, targets: list[str], seed: int):
    """A PEFT adapter on the model in `folder`, with non-zero B, saved to `out / 'adapter'`;
    the model merged by peft saved to `out / 'merged'`."""
    model = transformers.LlamaForCausalLM.from_pretrained(folder)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0)
    adapted = peft.get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_" in name:  # B starts at zero: make both factors matter
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    adapted.save_pretrained(out / "adapter")
    adapted.merge_and_unload().save_pretrained(out / "merged")
    return out / "adapter", out / "merged"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-adapters")
    folder = tiny_folder(root / "base")
    made = {
        name: _peft_adapter(folder, root / name, *spec, seed=i)
        for i, (name, spec) in enumerate(ADAPTERS.items())
    }
    base, tokenizer = loading.load(folder)
    model = load_adapters(base, [(name, str(a)) for name, (a, _) in made.items()])
    engine = Engine(model, max_batch=8, max_len=128, prefill_chunk=32, max_queue=64)
    chat = chat_format_of(str(folder), tokenizer)
    service = Service(engine, tokenizer, model_name=BASE, chat_format=chat, adapters=list(ADAPTERS))
    with ServerThread(create_app(service)) as server:
        yield server, service, folder, made, tokenizer


@pytest.fixture(scope="module")
def client(setup):
    server, *_ = setup
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _alone(folder, tokenizer) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their log-probabilities for each prompt (after its prompt tokens'
    log-probabilities), by an engine over the model in `folder` alone."""
    model, _ = loading.load(folder)
    engine = Engine(model, max_batch=1, max_len=128, prefill_chunk=32)
    out = []
    for prompt in PROMPTS:
        events: list = []
        params = Params(max_tokens=NEW, temperature=0, prompt_logprobs=True)
        engine.submit(tokenizer.encode(prompt), params, events.append)
        engine.run(max_rounds=100)
        tokens = [e for e in events if isinstance(e, Token)]
        scores = list(events[0].logprobs[1:])  # PromptScores first
        out.append(([t.id for t in tokens], scores + [t.logprob for t in tokens]))
    return out


def test_adapters_share_a_batch_and_each_equals_its_merged_model(setup, client):
    _, service, folder, made, tokenizer = setup
    # The first prompt is cached under the base first (several full blocks): the adapters'
    # requests for it must not reuse those blocks.
    client.completions.create(model=BASE, prompt=PROMPTS[0], max_tokens=1, temperature=0)
    hits = service.engine.stats()["prefix_hit_tokens"]
    jobs = [(m, p) for m in [BASE, *ADAPTERS] for p in range(len(PROMPTS))]

    def ask(job):
        name, p = job
        kwargs = dict(model=name, prompt=PROMPTS[p], max_tokens=NEW, temperature=0, logprobs=1)
        kwargs["echo"] = True  # the prompt's log-probabilities too
        return client.completions.create(**kwargs, extra_body={"ignore_eos": True})

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        answers = dict(zip(jobs, pool.map(ask, jobs), strict=True))
    assert service.engine.stats()["prefix_hit_tokens"] > hits  # the base request reused them
    wanted = {BASE: _alone(folder, tokenizer)}
    wanted |= {name: _alone(merged, tokenizer) for name, (_, merged) in made.items()}
    for (name, p), answer in answers.items():
        tokens, logprobs = wanted[name][p]
        choice = answer.choices[0]
        assert answer.model == name
        echoed = tokenizer.decode(tokenizer.encode(PROMPTS[p]))
        assert choice.text == echoed + tokenizer.decode(tokens), (name, p)
        np.testing.assert_allclose(choice.logprobs.token_logprobs[1:], logprobs, atol=1e-4)
    for p in range(len(PROMPTS)):  # each adapter changes what the model says
        assert len({wanted[name][p][0].__repr__() for name in wanted}) == len(wanted)


def test_models_lists_the_base_and_every_adapter_and_chat_picks_one(client):
    listed = {m.id: m for m in client.models.list().data}
    assert list(listed) == [BASE, *ADAPTERS]
    assert all(listed[name].model_extra["parent"] == BASE for name in ADAPTERS)
    messages = [{"role": "user", "content": "hello"}]
    chat = client.chat.completions.create(model="beta", messages=messages, max_tokens=3)
    assert chat.model == "beta" and chat.usage.completion_tokens >= 1


def test_unknown_model_gets_404_naming_the_known_ids(setup, client):
    server, *_ = setup
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gamma", prompt="hello", max_tokens=2)
    status, body = post(f"{server.url}/v1/completions", {"model": "gamma", "prompt": "hi"})
    assert status == 404
    error = body["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert all(repr(name) in error["message"] for name in [BASE, *ADAPTERS])


def test_engine_holds_stacked_adapters_and_refuses_unknown_indices(setup):
    _, service, *_ = setup
    model = service.engine.runner.weights  # sliced; the stacked layers hold the adapters
    assert any(isinstance(x, MultiLoraLinear) for x in _layers(model))
    with pytest.raises(EqllmError, match="adapter=3"):
        service.engine.check([1, 2], Params(max_tokens=2, adapter=3))


def _layers(tree):
    return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, MultiLoraLinear))


def test_bad_adapter_specs_fail_at_start_up_in_one_line(setup, tmp_path, capsys):
    _, _, folder, made, _ = setup
    base, _ = loading.load(folder)
    with pytest.raises(EqllmError, match="give name=path"):
        parse_specs(["alpha"], BASE)
    with pytest.raises(EqllmError, match="already taken"):
        parse_specs([f"{BASE}=x"], BASE)
    with pytest.raises(EqllmError, match="--adapter gone=.*no such file"):
        load_adapters(base, [("gone", str(tmp_path / "missing"))])
    # An adapter made for a wider Llama: its A and B do not fit this base.
    wide = tmp_path / "wide"
    config = transformers.LlamaConfig.from_pretrained(folder)
    config.hidden_size, config.intermediate_size = 48, 96
    transformers.LlamaForCausalLM(config).save_pretrained(wide)
    adapter, _ = _peft_adapter(wide, tmp_path, 2, 4, ["q_proj"], seed=5)
    with pytest.raises(EqllmError, match="--adapter wide=.*do not fit the base weight") as e:
        load_adapters(base, [("wide", str(adapter))])
    assert "\n" not in str(e.value)
    # A PEFT type eqllm does not read (DoRA).
    dora = tmp_path / "dora"
    dora.mkdir()
    alpha_adapter = made["alpha"][0]
    for file in alpha_adapter.iterdir():
        (dora / file.name).write_bytes(file.read_bytes())
    settings = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**settings, "use_dora": True}))
    with pytest.raises(EqllmError, match="--adapter dora=.*use_dora"):
        load_adapters(base, [("dora", str(dora))])
    # Speculative decoding with adapters is no longer refused (tests/test_generation_adapters.py
    # checks its output).
    model = load_adapters(base, [("alpha", str(alpha_adapter))])
    assert Engine(model, max_batch=2, max_len=64, speculate=2).speculator is not None
    # The command line: one line on stderr, exit 2.
    capsys.readouterr()
    assert cli.main(["serve", str(folder), "--adapter", "nopath", "--compile-cache", "off"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("eqllm: error: --adapter 'nopath'")
