"""`eqllm generate`: continue a prompt with streamed output, or hold an interactive session.

The decode loop runs compiled in chunks of `--chunk` tokens (see `eqllm.generation.stream`);
the text printed between chunks is the decoded continuation. A model without a tokenizer reads
and writes token ids. `--chat` formats each prompt as a user turn with the model's chat template
(chat_template.jinja, else tokenizer_config.json's, else eqllm's default: `eqllm.data.chat`);
interactively, the conversation is kept (`/clear` starts a new one).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import jax
import numpy as np

from eqllm import loading
from eqllm.commands.timings import Timings
from eqllm.data import Tokenizer
from eqllm.errors import EqllmError
from eqllm.generation import GenerationError, sampling, stream
from eqllm.model import CausalLM
from eqllm.nn import quantize
from eqllm.resources import setup_compile_cache

HELP = """commands:
  /temp T      temperature (0: greedy)      /topk K   top-k (0: off)
  /topp P      top-p (1: off)               /minp M   min-p (0: off)
  /rep R       repetition penalty (1: off)  /max N    max new tokens
  /seed S      restart the sampling keys    /stop IDS stop token ids (none: clear)
  /settings    show the settings            /quit     leave (or Ctrl-D)
  /clear       forget the conversation (--chat)
Ctrl-C stops the current generation and keeps the session."""
OPTIONAL = ("top_k", "top_p", "min_p", "repetition_penalty")


@dataclasses.dataclass
class Settings:
    """What `eqllm generate` passes to `stream`; the interactive commands change it."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_tokens: tuple[int, ...] = ()
    seed: int = 0

    def describe(self) -> str:
        return (
            f"max={self.max_new_tokens} temp={self.temperature} top_k={self.top_k} "
            f"top_p={self.top_p} min_p={self.min_p} rep={self.repetition_penalty} "
            f"stop={list(self.stop_tokens)} seed={self.seed}"
        )


def _prompt_ids(text: str, tokenizer: Tokenizer | None) -> list[int]:
    if tokenizer is not None:
        return tokenizer.encode(text)
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise GenerationError(
            f"this model has no tokenizer, so the prompt must be token ids such as '1 2 3', "
            f"got {text!r} (or give --tokenizer to type text)"
        ) from None


class _Printer:
    """Writes a growing continuation: ids as they come, or text decoded from all ids so far."""

    def __init__(self, tokenizer: Tokenizer | None, out):
        self.tokenizer, self.out = tokenizer, out
        self.ids: list[int] = []
        self.shown = ""

    def add(self, ids: np.ndarray) -> None:
        if ids.size == 0:
            return
        self.ids.extend(int(i) for i in ids)
        if self.tokenizer is None:
            self.out.write(("" if len(self.ids) == ids.size else " ") + " ".join(map(str, ids)))
        else:
            # Hold back a trailing replacement char: it may be half of a multi-byte character.
            text = self.tokenizer.decode(self.ids).rstrip("\ufffd")
            self.out.write(text[len(self.shown) :])
            self.shown = text
        self.out.flush()


def _run_once(
    model, tokenizer, prompt: list[int], settings: Settings, key, chunk: int, out, timings=None
):
    """Stream one continuation to `out`; returns (tokens, seconds). With `timings`, the first
    token and the rest are marked as two phases."""
    printer = _Printer(tokenizer, out)
    start = time.perf_counter()
    try:
        for ids in stream(
            model,
            prompt,
            max_new_tokens=settings.max_new_tokens,
            key=key,
            temperature=settings.temperature,
            top_k=settings.top_k,
            top_p=settings.top_p,
            min_p=settings.min_p,
            repetition_penalty=settings.repetition_penalty,
            stop_tokens=settings.stop_tokens,
            chunk=chunk,
        ):
            printer.add(ids)
            if timings is not None and len(printer.ids) == len(ids) > 0:
                timings.mark("prefill and first token")
    finally:
        out.write("\n")
        out.flush()
    return len(printer.ids), time.perf_counter() - start, printer.ids


class Chat:
    """A conversation rendered with a chat template: each prompt is a user turn."""

    def __init__(self, spec: str, tokenizer: Tokenizer | None):
        if tokenizer is None:
            raise GenerationError("--chat needs a tokenizer: give --tokenizer or a model with one")
        self.format = loading.chat_format_of(spec, tokenizer)
        self.messages: list[dict[str, str]] = []

    def prompt(self, text: str) -> list[int]:
        self.messages.append({"role": "user", "content": text})
        return self.format.encode_text(
            self.format.render(self.messages, add_generation_prompt=True)
        )

    def answered(self, ids: list[int]) -> None:
        tokenizer = self.format.tokenizer
        text = tokenizer.decode([i for i in ids if i != tokenizer.eot_id])
        self.messages.append({"role": "assistant", "content": text})


def _default_stops(tokenizer: Tokenizer | None, model: CausalLM) -> tuple[int, ...]:
    if tokenizer is not None and tokenizer.eot_id < model.config.vocab_size:
        return (tokenizer.eot_id,)
    return ()


def _apply_command(line: str, settings: Settings) -> bool:
    """Change `settings` by one /command; False means leave the session."""
    name, _, value = line[1:].partition(" ")
    value = value.strip()
    off = value.lower() in ("", "off", "none")
    fields = {
        "temp": ("temperature", float),
        "topk": ("top_k", int),
        "topp": ("top_p", float),
        "minp": ("min_p", float),
        "rep": ("repetition_penalty", float),
        "max": ("max_new_tokens", int),
        "seed": ("seed", int),
    }
    if name in ("quit", "exit", "q"):
        return False
    if name in ("help", "h", "?"):
        print(HELP)
    elif name == "settings":
        print(settings.describe())
    elif name == "stop":
        try:
            stops = () if off else tuple(int(v) for v in value.replace(",", " ").split())
        except ValueError:
            raise GenerationError(f"/stop takes token ids such as '2 7', got {value!r}") from None
        settings.stop_tokens = stops
        print(settings.describe())
    elif name in fields:
        field, kind = fields[name]
        try:
            number = None if off and field in OPTIONAL else kind(value)
        except ValueError:
            raise GenerationError(f"/{name} takes a number, got {value!r}") from None
        if field == "top_k" and number == 0:
            number = None
        if field == "max_new_tokens" and number < 1:
            raise GenerationError(f"/max must be at least 1, got {number}")
        changed = dataclasses.replace(settings, **{field: number})
        sampling(  # validate now rather than at the next prompt
            changed.temperature,
            changed.top_k,
            changed.top_p,
            changed.min_p,
            changed.repetition_penalty,
        )
        setattr(settings, field, number)
        print(settings.describe())
    else:
        print(f"unknown command /{name}; /help lists them")
    return True


def interactive(
    model: CausalLM,
    tokenizer: Tokenizer | None,
    settings: Settings,
    *,
    chunk: int = 16,
    chat: Chat | None = None,
) -> int:
    """Read prompts and /commands from stdin until /quit or end of input."""
    out = sys.stdout
    print(f"eqllm generate: {model.config.family} model, {settings.describe()}")
    print("compiling...", end="", flush=True)
    _run_once(model, tokenizer, [0], Settings(max_new_tokens=2), jax.random.key(0), chunk, out)
    print("type a prompt, /help for commands")
    turn = 0
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print("\n(/quit or Ctrl-D leaves)")
            continue
        line = line.strip()
        if not line:
            continue
        try:
            if line.startswith("/"):
                if line == "/clear" and chat is not None:
                    chat.messages.clear()
                elif not _apply_command(line, settings):
                    return 0
                continue
            prompt = chat.prompt(line) if chat else _prompt_ids(line, tokenizer)
            key = jax.random.fold_in(jax.random.key(settings.seed), turn)
            turn += 1
            n, seconds, ids = _run_once(model, tokenizer, prompt, settings, key, chunk, out)
            if chat is not None:
                chat.answered(ids)
            print(f"[{n} tokens, {n / seconds:.1f} tokens/s]")
        except KeyboardInterrupt:
            print("[stopped]")
        except EqllmError as e:  # bad input keeps the session; anything else is a bug
            print(f"error: {e}")


def run(args: argparse.Namespace) -> int:
    """The `eqllm generate` command."""
    timings = Timings() if args.timings and not args.interactive else None
    setup_compile_cache(args.compile_cache)
    model, tokenizer = loading.load(args.model, seed=args.seed, dtype=args.dtype)
    if args.quantize is not None:
        model = quantize(model, args.quantize)
    if args.tokenizer is not None:
        tokenizer = Tokenizer.from_spec(args.tokenizer)
    if timings is not None:
        timings.mark("load (weights, tokenizer)")
    settings = Settings(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        stop_tokens=tuple(args.stop) if args.stop is not None else _default_stops(tokenizer, model),
        seed=args.seed,
    )
    chat = Chat(args.model, tokenizer) if args.chat else None
    if args.interactive:
        return interactive(model, tokenizer, settings, chunk=args.chunk, chat=chat)
    prompt = chat.prompt(args.prompt) if chat else _prompt_ids(args.prompt, tokenizer)
    if timings is not None:
        timings.mark(f"tokenize prompt ({len(prompt)} tokens)")
    n, seconds, _ = _run_once(
        model,
        tokenizer,
        prompt,
        settings,
        jax.random.key(args.seed),
        args.chunk,
        sys.stdout,
        timings,
    )
    print(f"[{n} tokens in {seconds:.2f} s, compilation included]", file=sys.stderr)
    if timings is not None:
        timings.mark(f"the other {n - 1} tokens")
        timings.close()
        print(f"timings:\n{timings.report()}", file=sys.stderr)
        first = timings.time_to_first_token()
        if first is not None:
            print(f"time to first token: {first:.2f} s after the process started", file=sys.stderr)
    return 0


def add_parser(commands) -> None:
    """Register `eqllm generate` on the CLI's subcommands."""
    p = commands.add_parser(
        "generate",
        help="continue a prompt (streamed) or hold an interactive session",
        description=__doc__,
    )
    p.add_argument("model", help="a zoo name (random weights)")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--prompt", help="text, or token ids ('1 2 3') for a model without tokenizer")
    mode.add_argument("--interactive", action="store_true", help="read prompts from the terminal")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument(
        "--stop", type=int, nargs="*", default=None, help="stop token ids (default: end-of-text)"
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer spec: bytes, a path or org/name")
    p.add_argument("--chunk", type=int, default=16, help="tokens per compiled decode call")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    p.add_argument("--quantize", choices=["int8"], default=None, help="int8 weights")
    p.add_argument(
        "--chat", action="store_true", help="format prompts with the model's chat template"
    )
    p.add_argument(
        "--timings",
        action="store_true",
        help="with --prompt: print where the time to the first token went (load, tokenize, "
        "trace, compile, run)",
    )
    p.add_argument(
        "--compile-cache",
        default="",
        help="JAX's persistent compilation cache folder (default: $EQLLM_CACHE/jax or "
        "~/.cache/eqllm/jax; 'off' disables it): a second run skips compilation",
    )
    p.set_defaults(func=run)
