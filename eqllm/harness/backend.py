"""The lm_eval model `eqllm`: lm-evaluation-harness requests on any model eqllm loads.

It follows lm_eval's `hf` backend request by request, so scores match it: contexts and
continuations are encoded by `TemplateLM` (trailing spaces move to the continuation, an empty
context becomes `prefix_token_id`), a too-long request keeps its last `max_length + 1` tokens,
`loglikelihood_rolling` scores lm_eval's disjoint rolling windows, and `generate_until` left-cuts
the context to `max_length - max_gen_toks`, decodes until the end-of-text token or `max_gen_toks`
and cuts the text at the first stop sequence. The work itself is `eqllm.harness.scoring`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os

import jax
import jinja2
import tokenizers
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from tqdm import tqdm

from eqllm.data import Tokenizer
from eqllm.data.chat import template_or_default
from eqllm.errors import EqllmError
from eqllm.harness import scoring
from eqllm.harness.errors import HarnessError
from eqllm.hub.folders import resolve
from eqllm.loading import load, run_folder_of
from eqllm.model import CausalLM

DEFAULT_BATCH_SIZE = 16
_SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


def _bos_token(spec) -> str | None:
    """The bos_token of the tokenizer_config.json beside the model (a local folder or the hub
    snapshot `load` fetched), if any; run folders and zoo names have none."""
    if spec is None or run_folder_of(spec) is not None:
        return None
    try:
        folder = resolve(spec, local_files_only=True)
    except EqllmError:  # a zoo name
        return None
    file = folder / "tokenizer_config.json"
    config = json.loads(file.read_text()) if file.is_file() else {}
    bos = config.get("bos_token")
    return bos.get("content") if isinstance(bos, dict) else bos


def _batch_size(value) -> int:
    if value in (None, "auto") or str(value).startswith("auto:"):
        return DEFAULT_BATCH_SIZE  # lengths are bucketed, so a fixed size is what compiles once
    if isinstance(value, bool) or not str(value).isdigit() or int(value) < 1:
        raise HarnessError(f"batch_size={value!r}: give a positive integer (or 'auto')")
    return int(value)


@register_model("eqllm")
class EqllmLM(TemplateLM):
    """lm_eval's model interface over an eqllm `CausalLM` and its tokenizer.

    `pretrained` is anything `eqllm.loading.load` accepts (run folder, checkpoint, eqllm or
    Hugging Face folder, hub id, zoo name); or pass `model` and `tokenizer` objects directly.
    `tokenizer` may also name a tokenizer (`Tokenizer.from_spec`), needed for a zoo name.
    `device` is accepted for lm_eval's sake and ignored: JAX places the model.
    """

    def __init__(
        self,
        pretrained: str | os.PathLike | None = None,
        *,
        model: CausalLM | None = None,
        tokenizer: Tokenizer | str | None = None,
        step: int | None = None,
        dtype: str | None = None,
        batch_size: int | str | None = None,
        max_batch_size: int | None = None,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        add_bos_token: bool | None = None,
        prefix_token_id: int | None = None,
        seed: int = 0,
        device: str | None = None,
    ):
        super().__init__()
        if (pretrained is None) == (model is None):
            raise HarnessError(
                "give the eqllm backend either pretrained=PATH_OR_NAME or a model object "
                f"(got pretrained={pretrained!r}, model={'set' if model is not None else None})"
            )
        loaded_tok = None
        if model is None:
            dtype = None if dtype in (None, "auto") else dtype  # "auto": the saved dtype
            model, loaded_tok = load(pretrained, step=step, dtype=dtype)
        if isinstance(tokenizer, str | os.PathLike):
            tokenizer = Tokenizer.from_spec(tokenizer)
        tokenizer = tokenizer or loaded_tok
        if tokenizer is None:
            raise HarnessError(
                f"model {pretrained!r} comes without a tokenizer; pass tokenizer=PATH_OR_REPO "
                "(model_args 'tokenizer=...', or --tokenizer on `eqllm eval`)"
            )
        if tokenizer.vocab_size > model.config.vocab_size:
            raise HarnessError(
                f"the tokenizer has {tokenizer.vocab_size} ids, the model only "
                f"{model.config.vocab_size}; use the model's own tokenizer (or one that fits)"
            )
        self.model = model
        self.eqllm_tokenizer = tokenizer
        # A copy that reads special-token strings as special tokens and applies the
        # tokenizer's post-processor (its BOS), as transformers' tokenizers do for the hf backend.
        self.tokenizer = tokenizers.Tokenizer.from_str(tokenizer.to_str())
        bos = _bos_token(pretrained)
        self.bos_token = bos if bos and self.tokenizer.token_to_id(bos) is not None else None
        self._max_length = int(max_length or model.config.max_seq_len)
        if self._max_length > model.config.max_seq_len:
            raise HarnessError(
                f"max_length={max_length} exceeds the model's context max_seq_len="
                f"{model.config.max_seq_len}; lower it"
            )
        self._max_gen_toks = int(max_gen_toks)
        self._batch_size = _batch_size(batch_size)
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id
        self.key = jax.random.key(seed)

    # Tokens ----------------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.eqllm_tokenizer.eot_id

    @property
    def prefix_token_id(self) -> int:
        if self.custom_prefix_token_id is not None:
            return int(self.custom_prefix_token_id)
        if self.bos_token is not None:
            return self.tokenizer.token_to_id(self.bos_token)
        return self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs):
        special = add_special_tokens
        if special is None:  # the hf backend's rule: the tokenizer's default, unless told
            special = self.add_bos_token if self.add_bos_token is not None else True
            if self.bos_token is not None and string.startswith(self.bos_token):
                special = False  # the text carries its BOS already
        ids = self.tokenizer.encode(string, add_special_tokens=special).ids
        left = kwargs.get("left_truncate_len")
        return ids[-left:] if left else ids

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode([int(t) for t in tokens], skip_special_tokens)

    # Requests --------------------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        rows = []
        for _, context_enc, continuation_enc in requests:
            if not context_enc or not continuation_enc:
                raise HarnessError("a loglikelihood request has an empty context or continuation")
            whole = (context_enc + continuation_enc)[-(self.max_length + 1) :]
            rows.append((whole, min(len(continuation_enc), len(whole) - 1)))
        results = scoring.score(
            self.model, rows, batch_size=self.batch_size, max_length=self.max_length
        )
        for (pair, _, _), answer in zip(requests, results, strict=True):
            if pair is not None:
                self.cache_hook.add_partial("loglikelihood", pair, answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for i, (string,) in enumerate(tqdm([r.args for r in requests], disable=disable_tqdm)):
            rolling = lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for context, continuation in map(lm_utils.make_disjoint_window, rolling):
                windows.append((None, context, continuation))
                owners.append(i)
        scores = self._loglikelihood_tokens(windows) if windows else []
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, scores, strict=True):
            totals[owner] += logprob
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(
                i
            )
        out: list[str] = [""] * len(requests)
        for indices in groups.values():
            kwargs = normalize_gen_kwargs(requests[indices[0]].args[1], self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen_toks = int(kwargs.pop("max_gen_toks"))
            settings = self._sampling(kwargs)
            room = self.max_length - max_gen_toks
            if room < 1:
                raise HarnessError(
                    f"max_gen_toks={max_gen_toks} leaves no room for a context in max_length="
                    f"{self.max_length}; lower max_gen_toks"
                )
            prompts = [self.tok_encode(requests[i].args[0])[-room:] for i in indices]
            new = scoring.generate(
                self.model,
                prompts,
                max_new_tokens=max_gen_toks,
                batch_size=self.batch_size,
                stop_tokens=[self.eot_token_id],
                key=self.key,
                **settings,
            )
            for i, tokens in zip(indices, new, strict=True):
                text = postprocess_generated_text(self.tok_decode(tokens), until, None)
                out[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out

    @staticmethod
    def _sampling(kwargs: dict) -> dict:
        """eqllm sampling settings from the request's remaining generation kwargs."""
        do_sample = kwargs.pop("do_sample", False)
        unknown = sorted(set(kwargs) - set(_SAMPLING_KEYS))
        if unknown:
            raise HarnessError(
                f"generation_kwargs {unknown} are not supported by the eqllm backend; "
                f"it takes until, max_gen_toks, do_sample and {', '.join(_SAMPLING_KEYS)}"
            )
        settings = {k: kwargs[k] for k in _SAMPLING_KEYS if kwargs.get(k) is not None}
        if not do_sample:
            settings["temperature"] = 0.0
        return settings

    # Chat templates (lm_eval's --apply_chat_template, --fewshot_as_multiturn) ------------------

    @property
    def tokenizer_name(self) -> str:
        return "eqllm-" + hashlib.sha256(self.eqllm_tokenizer.to_str().encode()).hexdigest()[:16]

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The model's chat template (its folder's, else eqllm's default, said once) when asked
        for one; a string other than True names a template and is refused (eqllm keeps one)."""
        if not chat_template:
            return None
        if isinstance(chat_template, str):
            raise HarnessError(
                f"apply_chat_template={chat_template!r}: the eqllm backend uses the model's one "
                "template; pass --apply_chat_template without a name"
            )
        return template_or_default(self.eqllm_tokenizer.chat_template)

    def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
        """The conversation as text, as the hf backend renders it: a generation prompt, or (to
        score a continuation) the text ending inside the last message; a template that refuses
        the system role is retried without it."""
        render = functools.partial(
            self.eqllm_tokenizer.apply_chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
            tokenize=False,
        )
        try:
            return render(chat_history)
        except jinja2.exceptions.TemplateError:
            return render([m for m in chat_history if m["role"] != "system"])

    def get_model_info(self) -> dict:
        cfg = self.model.config
        return {"eqllm_family": cfg.family, "eqllm_param_dtype": cfg.param_dtype}
