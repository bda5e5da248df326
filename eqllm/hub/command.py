"""`eqllm convert SRC DST`: Hugging Face folder/repo <-> eqllm model folder."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import get_args

from eqllm.config import DType
from eqllm.hub.folders import resolve, zoo_match
from eqllm.hub.model_folder import is_model_folder, load_any, save_model
from eqllm.hub.pretrained import save_pretrained
from eqllm.model import param_count


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    to: str | None = None,
    dtype: DType | None = None,
    max_shard_size: int | str = "5GB",
    local_files_only: bool = False,
) -> str:
    """Convert the model (and tokenizer) at `src` into the folder `dst`; returns a summary.

    `to` is 'hf' or 'eqllm'; by default the other format than the source's (an HF folder or
    repo id becomes an eqllm model folder, an eqllm folder becomes an HF folder).
    """
    from eqllm.loading import load, run_folder_of  # a run folder needs the training code

    run = run_folder_of(src)
    folder = run[0] if run else resolve(src, local_files_only=local_files_only)
    source_format = "eqllm" if run or is_model_folder(folder) else "hf"
    to = to or ("hf" if source_format == "eqllm" else "eqllm")
    if to not in ("hf", "eqllm"):
        raise ValueError(f"to={to!r}: choose 'hf' or 'eqllm'")
    if Path(dst).resolve() == folder.resolve():
        raise ValueError(f"destination {dst} is the source folder; write to another folder")
    model, tokenizer = load(src, dtype=dtype) if run else load_any(folder, dtype=dtype)
    if to == "hf":
        save_pretrained(model, dst, tokenizer=tokenizer, max_shard_size=max_shard_size)
    else:
        save_model(model, dst, tokenizer=tokenizer)
    cfg = model.config
    match = zoo_match(cfg)
    return (
        f"wrote {'Hugging Face' if to == 'hf' else 'eqllm'} folder {dst}: {cfg.family}, "
        f"{param_count(model):,} parameters, {cfg.param_dtype}"
        + (f", architecture of zoo variant {match}" if match else "")
        + (", with tokenizer" if tokenizer is not None else "")
    )


def _run(args: argparse.Namespace) -> int:
    print(
        convert(
            args.src,
            args.dst,
            to=args.to,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            local_files_only=args.local_files_only,
        )
    )
    return 0


def add_convert_command(commands) -> None:
    """Register `eqllm convert` on the CLI's subparsers."""
    parser = commands.add_parser(
        "convert",
        help="convert a Hugging Face checkpoint to an eqllm model folder or back",
        description=(
            "Convert a model and its tokenizer. SRC is a Hugging Face folder or hub repo id, "
            "or an eqllm model folder; DST gets the other format unless --to says otherwise "
            "(--to hf from an HF source re-exports it)."
        ),
    )
    parser.add_argument("src", help="HF folder or hub repo id ('org/name'), or an eqllm folder")
    parser.add_argument("dst", help="output folder")
    parser.add_argument("--to", choices=["hf", "eqllm"], help="output format (default: the other)")
    parser.add_argument("--dtype", choices=get_args(DType), help="cast the weights")
    parser.add_argument("--max-shard-size", default="5GB", help="HF shard size (default 5GB)")
    parser.add_argument(
        "--local-files-only", action="store_true", help="use the hub cache, no download"
    )
    parser.set_defaults(func=_run)
