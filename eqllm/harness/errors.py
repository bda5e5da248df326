"""The harness's error type (importable without lm_eval, so its absence can be reported)."""

from eqllm.errors import EqllmError

INSTALL_HINT = 'pip install "eqllm[eval]"'


class HarnessError(EqllmError):
    """Bad input to a harness run: a task, a model argument, a generation setting, a path."""
