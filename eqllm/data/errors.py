"""The data pipeline's bad-input errors (see `eqllm.errors`)."""

from eqllm.errors import EqllmError


class DataError(EqllmError):
    """Bad data input: a source, a tokenizer, a token file or a batch of token ids."""


class DataNotFound(DataError, FileNotFoundError):
    """A data file, folder or tokenizer that does not exist (also a FileNotFoundError)."""
