"""lm_eval's own command line with the `eqllm` model registered:
``python -m eqllm.harness run --model eqllm --model_args pretrained=PATH --tasks ...``."""

from lm_eval.__main__ import cli_evaluate

import eqllm.harness  # noqa: F401  (registers the model name "eqllm")

if __name__ == "__main__":
    cli_evaluate()
