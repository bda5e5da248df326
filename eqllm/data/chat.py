"""Chat templates, found, rendered and saved the way transformers does it.

A model folder's template is, in transformers' order of precedence:

1. ``chat_template.jinja`` (what transformers 5 writes), else
2. the ``chat_template`` of ``tokenizer_config.json``: a string, or a list of named templates
   (``[{"name": "default", "template": ...}, ...]``), of which the ``"default"`` one is used.

`Tokenizer.load` reads it into `Tokenizer.chat_template`; `Tokenizer.save` writes it back as
``chat_template.jinja``. A tokenizer without one formats conversations with `DEFAULT_TEMPLATE`,
and eqllm says so once (a logging warning). Rendering uses the sandboxed Jinja environment of
transformers' `apply_chat_template` (trimmed blocks, `raise_exception`, `strftime_now`, a
`tojson` that keeps non-ASCII, the `{% generation %}` tag) with the tokenizer's special tokens
(`bos_token`, `eos_token`, ...) as variables; the text is then tokenized with special tokens
recognised and none added. `Tokenizer.apply_chat_template` (`eqllm.data.tokenizer`), built on
`render`, is the one function every caller uses (fine-tuning data, `eqllm generate --chat`,
evaluation, serving). This module knows templates and files, not tokenizers.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from eqllm.data.errors import DataError

log = logging.getLogger("eqllm.data.chat")

TEMPLATE_FILE = "chat_template.jinja"
DEFAULT_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}"
    "{% if m.role == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
Messages = list[dict[str, Any]]
_said_default = False


def read_chat_template(folder: str | os.PathLike | None) -> str | None:
    """The chat template of a model or tokenizer folder (see the module docstring), or None."""
    if folder is None:
        return None
    folder = Path(folder)
    jinja_file = folder / TEMPLATE_FILE
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    config_file = folder / "tokenizer_config.json"
    if not config_file.is_file():
        return None
    template = json.loads(config_file.read_text(encoding="utf-8")).get("chat_template")
    if isinstance(template, list):  # named templates: transformers uses "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise DataError(
                f"{config_file}: chat_template lists templates {sorted(named)} but none named "
                "'default'; name the one to use 'default'"
            )
        template = named["default"]
    if template is not None and not isinstance(template, str):
        raise DataError(f"{config_file}: chat_template must be a string or a list of templates")
    return template


def template_or_default(template: str | None) -> str:
    """`template`, or `DEFAULT_TEMPLATE` (saying so once per process) when it is None."""
    global _said_default
    if template is not None:
        return template
    if not _said_default:
        log.warning(
            "the tokenizer has no chat template (chat_template.jinja or tokenizer_config.json's "
            "chat_template); formatting chats with eqllm's default template (<|user|> turns)"
        )
        _said_default = True
    return DEFAULT_TEMPLATE


class _Generation(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` tag (it marks assistant text)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@functools.lru_cache(maxsize=16)
def compile_template(template: str) -> jinja2.Template:
    """A Jinja template in transformers' chat-template environment."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise DataError(f"chat template line {e.lineno}: {e.message}") from None


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def render(
    template: str,
    messages: Messages,
    *,
    special_tokens: dict[str, str] | None = None,
    add_generation_prompt: bool = False,
    continue_final_message: bool = False,
    **variables: Any,
) -> str:
    """`messages` as text: `template` rendered with the special tokens as variables (and any
    `variables`, e.g. `tools`: function schemas, as transformers passes them).

    `continue_final_message` ends the text inside the last message (as transformers does: the
    message is tagged, rendered and cut at the tag), for a continuation to be scored.
    """
    if continue_final_message:
        messages = [dict(m) for m in messages]
        messages[-1]["content"] = messages[-1]["content"] + _CONTINUE_TAG
    text = compile_template(template).render(
        messages=messages,
        add_generation_prompt=add_generation_prompt,
        **{"tools": None, "documents": None, **(special_tokens or {}), **variables},
    )
    if continue_final_message:
        if _CONTINUE_TAG.strip() not in text:
            raise DataError(
                "continue_final_message: the chat template drops part of the final message, "
                "so the text cannot end inside it"
            )
        at = text.rindex(_CONTINUE_TAG.strip())
        keep_spacing = text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG
        text = text[:at] if keep_spacing else text[:at].rstrip()
    return text


def write_chat_template(template: str | None, folder: str | os.PathLike) -> None:
    """Save `template` as transformers 5 does: chat_template.jinja, and no `chat_template` key
    left in tokenizer_config.json."""
    folder = Path(folder)
    config_file = folder / "tokenizer_config.json"
    if config_file.is_file():
        config = json.loads(config_file.read_text(encoding="utf-8"))
        if config.pop("chat_template", None) is not None:
            config_file.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    if template is None:
        (folder / TEMPLATE_FILE).unlink(missing_ok=True)
    else:
        (folder / TEMPLATE_FILE).write_text(template, encoding="utf-8")
