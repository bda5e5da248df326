"""lm-evaluation-harness on eqllm models. Importing this module registers the lm_eval model
name ``eqllm``, so ``lm_eval.simple_evaluate(model="eqllm", model_args="pretrained=PATH")`` and
lm_eval's command line (``python -m eqllm.harness run --model eqllm ...``) use eqllm's batched
forward and generation engine. Needs the optional extra: ``pip install "eqllm[eval]"``.
"""

from eqllm.harness.errors import INSTALL_HINT, HarnessError

try:
    import lm_eval.models  # noqa: F401  (lm_eval's own names first: its registry loads lazily)
except ImportError as e:
    raise HarnessError(
        f"lm-evaluation-harness is not installed ({e}); install it with {INSTALL_HINT}"
    ) from None

from eqllm.harness.backend import EqllmLM  # noqa: E402  (registers "eqllm")
from eqllm.harness.tasks import evaluate, results_table, write_results  # noqa: E402

__all__ = ["EqllmLM", "HarnessError", "evaluate", "results_table", "write_results"]
