"""Run harness tasks on an eqllm model: `evaluate`, the results JSON and the metrics table."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from lm_eval import evaluator
from lm_eval import utils as lm_utils
from lm_eval.tasks import TaskManager

from eqllm.harness.backend import EqllmLM
from eqllm.harness.errors import HarnessError


def _task_names(tasks: str | list[str]) -> list[str]:
    names = [t.strip() for t in tasks.split(",")] if isinstance(tasks, str) else list(tasks)
    names = [t for t in names if t]
    if not names:
        raise HarnessError(f"tasks={tasks!r}: name at least one task, e.g. --tasks lambada_openai")
    return names


def evaluate(
    lm: EqllmLM,
    tasks: str | list[str],
    *,
    num_fewshot: int | None = None,
    limit: int | float | None = None,
    include_path: str | os.PathLike | None = None,
    log_samples: bool = False,
    apply_chat_template: bool = False,
    fewshot_as_multiturn: bool | None = None,
) -> dict:
    """lm_eval's `simple_evaluate` results for `tasks` (names or a comma-separated string).

    `include_path` adds a folder of task YAMLs; an unknown task name is a HarnessError that
    names the closest known ones. Few-shot examples and sampling use lm_eval's default seeds.
    `apply_chat_template` formats each request with the model's chat template (as instruct
    models' cards report their scores), `fewshot_as_multiturn` the few-shot examples as turns
    (None: lm_eval's default, turns when a template is applied).
    """
    if fewshot_as_multiturn and not apply_chat_template:
        raise HarnessError("fewshot_as_multiturn needs apply_chat_template (--apply-chat-template)")
    multiturn = {"fewshot_as_multiturn": fewshot_as_multiturn}
    if fewshot_as_multiturn is None:
        multiturn = {}
    if include_path is not None and not Path(include_path).is_dir():
        raise HarnessError(f"include_path={str(include_path)!r} is not a folder of task YAMLs")
    manager = TaskManager(include_path=None if include_path is None else os.fspath(include_path))
    names = _task_names(tasks)
    missing = [t for t in names if t not in manager.all_tasks]
    if missing:
        import difflib  # only on the error path

        close = {t: difflib.get_close_matches(t, manager.all_tasks, n=3) for t in missing}
        raise HarnessError(
            f"unknown task(s) {missing} (closest: {close}); list them with `lm_eval ls tasks`, "
            "or add a folder of task YAMLs with --include-path"
        )
    results = evaluator.simple_evaluate(
        model=lm,
        tasks=names,
        num_fewshot=num_fewshot,
        limit=limit,
        task_manager=manager,
        log_samples=log_samples,
        apply_chat_template=apply_chat_template,
        **multiturn,
    )  # lm_eval's default seeds, so a run equals one from its own command line
    if apply_chat_template:  # recorded as lm_eval's command line records it
        template = lm.chat_template(True)
        results["chat_template"] = template
        results["chat_template_sha"] = hashlib.sha256(template.encode()).hexdigest()
    return results


def results_table(results: dict) -> str:
    """The metrics as a Markdown table (lm_eval's own layout), groups below it if any."""
    table = lm_utils.make_table(results)
    if results.get("groups"):
        table += "\n" + lm_utils.make_table(results, "groups")
    return table


def write_results(results: dict, path: str | os.PathLike) -> Path:
    """Write the results JSON as lm_eval does (values it cannot serialise become strings)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(results, indent=2, default=lm_utils.handle_non_serializable)
    path.write_text(text + "\n")
    return path
