"""The text a recipe's [data] section names, tokenized: data.source, or data.sources' mixture.

One home for it: training (the "lm" and "distill" objectives), `eqllm analyze` and evaluation
of a model on a recipe's data all prepare it here.
"""

from __future__ import annotations

from eqllm.data import MixtureData, TokenData, prepare, prepare_mixture
from eqllm.recipe.inputs import source_label
from eqllm.recipe.spec import Recipe


def prepare_corpus(recipe: Recipe, *, progress: bool = True) -> TokenData | MixtureData:
    """data.source's tokens, or data.sources' weighted mixture (each source tokenized into its
    own cache with the run's tokenizer), split into training and validation documents."""
    d = recipe.data
    common = dict(
        cache_dir=d.cache_dir or None,
        val_fraction=d.val_fraction,
        seed=d.split_seed,
        bpe_vocab_size=recipe.bpe_vocab_size(),
        progress=progress,
        workers=d.workers,
    )
    if not d.sources:
        return prepare(d.source.to_source(), d.tokenizer, **common)
    sources = [(source_label(s, i), s.to_source(), s.weight) for i, s in enumerate(d.sources)]
    return prepare_mixture(
        sources,
        d.tokenizer,
        seq_len=d.seq_len,
        stages=tuple((stage.step, stage.weights) for stage in d.weight_schedule),
        **common,
    )
