"""From engine events to OpenAI's choices: incremental text, stop strings and log-probabilities.

`Choice` follows one request: it decodes the tokens generated so far, hands out only text that
is final (not a partial UTF-8 character, not the start of what may become a stop string), cuts
the text at the first stop string (and then asks the engine to stop), and records the tokens'
log-probabilities in the completions (`tokens`, `token_logprobs`, `top_logprobs`,
`text_offset`) or chat (`content`) layout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from eqllm.generation import Finished, PromptScores, Token

Decode = Callable[[Sequence[int]], str]


class Choice:
    """One choice of a response, built from the engine's events.

    Arguments:
        index: the choice's index in the response.
        prompt: the prompt's token ids (echoed in front of the text with `echo`).
        decode: token ids to text.
        stops: stop strings; the text ends before the first one.
        hidden: token ids that end the output without text (the end-of-text token).
        echo: the prompt text (and its log-probabilities) come first.
        logprobs: alternatives per token to report (None: no log-probabilities).
    """

    def __init__(
        self,
        index: int,
        prompt: Sequence[int],
        decode: Decode,
        *,
        stops: Sequence[str] = (),
        hidden: Sequence[int] = (),
        echo: bool = False,
        logprobs: int | None = None,
    ):
        self.index, self.prompt, self.decode = index, list(prompt), decode
        self.stops, self.hidden, self.echo, self.top_n = list(stops), set(hidden), echo, logprobs
        self.ids: list[int] = []
        self.text = ""  # the output text so far (cut at a stop string)
        self.sent = 0  # characters of `text` already handed out
        self.stopped = False  # a stop string was found
        self.finish_reason: str | None = None
        self.usage = (len(self.prompt), 0)
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []
        self.chat_logprobs: list[dict] = []
        self.prefix = self.decode(self.prompt) if echo else ""
        self.constraint = None  # the grammar state of a constrained answer (None: free text)

    def _token_text(self, token: int) -> str:
        return self.decode([token])

    def _record(self, token: int, logprob: float | None, top, offset: int) -> None:
        if self.top_n is None:
            return
        text = self._token_text(token)
        alternatives = None
        if top is not None:
            alternatives = {self._token_text(t): lp for t, lp in top[: self.top_n]}
        self.tokens.append(text)
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(alternatives)
        self.text_offset.append(offset)
        self.chat_logprobs.append(
            {
                "token": text,
                "logprob": logprob,
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": self._token_text(t), "logprob": lp, "bytes": None}
                    for t, lp in (top or ())[: self.top_n]
                ],
            }
        )

    def on(self, event) -> str:
        """Take one engine event; returns the text that became final with it."""
        if isinstance(event, PromptScores):
            offset = 0
            for i, token in enumerate(self.prompt):
                self._record(token, event.logprobs[i], event.top[i], offset)
                offset += len(self._token_text(token))
            return ""
        if isinstance(event, Finished):
            self.finish_reason = event.reason if not self.stopped else "stop"
            self.usage = (event.prompt_tokens, event.completion_tokens)
            return self.flush()
        assert isinstance(event, Token)
        if self.stopped:
            return ""  # a token the engine made before it saw the cancel
        offset = len(self.prefix) + len(self.text)
        if event.id in self.hidden:
            self._record(event.id, event.logprob, event.top, offset)
            return ""
        self.ids.append(event.id)
        text = self.decode(self.ids)
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            text, self.stopped, self.finish_reason = text[:cut], True, "stop"
            self.usage = (len(self.prompt), len(self.ids))
        self.text = text
        self._record(event.id, event.logprob, event.top, offset)
        if self.stopped:
            return self.flush()
        safe = len(text) - max((len(s) - 1 for s in self.stops), default=0)
        if text.endswith("\ufffd"):  # a character whose bytes are not all generated yet
            safe = min(safe, len(text) - 1)
        return self._hand_out(safe)

    def flush(self) -> str:
        """Everything not handed out yet (at the end)."""
        return self._hand_out(len(self.text))

    def _hand_out(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : upto], upto
        return out

    def full_text(self) -> str:
        return self.prefix + self.text

    def completion_logprobs(self) -> dict | None:
        if self.top_n is None:
            return None
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


def usage(choices: Sequence[Choice]) -> dict:
    prompt = sum(c.usage[0] for c in choices)
    completion = sum(c.usage[1] for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
