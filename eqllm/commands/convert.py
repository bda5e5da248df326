"""`eqllm convert SRC DST`: Hugging Face folder/repo <-> eqllm model folder (or a run folder);
`eqllm convert SRC out.gguf --type q8_0`: a GGUF file for llama.cpp and ollama."""

from __future__ import annotations

import argparse
from typing import get_args

from eqllm.config import DType
from eqllm.loading import convert


def convert_command(args: argparse.Namespace) -> int:
    print(
        convert(
            args.src,
            args.dst,
            to=args.to,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            local_files_only=args.local_files_only,
            merge=args.merge,
            gguf_type=args.type,
        )
    )
    return 0


def add_parser(commands) -> None:
    """Register `eqllm convert` on the CLI's subparsers."""
    parser = commands.add_parser(
        "convert",
        help="convert a Hugging Face checkpoint to an eqllm model folder or back",
        description=(
            "Convert a model and its tokenizer. SRC is a Hugging Face folder or hub repo id, "
            "or an eqllm model folder; DST gets the other format unless --to says otherwise "
            "(--to hf from an HF source re-exports it). A LoRA run gives its adapter in PEFT's "
            "format, or with --merge a Hugging Face folder with the adapter folded in. A DST "
            "ending in .gguf is a GGUF file (llama.cpp, ollama) of --type weights, with the "
            "tokenizer and chat template in its metadata and any adapter folded in."
        ),
    )
    parser.add_argument("src", help="HF folder or hub repo id ('org/name'), or an eqllm folder")
    parser.add_argument("dst", help="output folder, or a .gguf file")
    parser.add_argument(
        "--type",
        choices=["f32", "f16", "bf16", "q8_0"],
        default="f16",
        help="GGUF weight type (default f16; vectors stay f32)",
    )
    parser.add_argument("--to", choices=["hf", "eqllm"], help="output format (default: the other)")
    parser.add_argument("--dtype", choices=get_args(DType), help="cast the weights")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA run: write the merged model (default: the adapter alone, in PEFT's format)",
    )
    parser.add_argument("--max-shard-size", default="5GB", help="HF shard size (default 5GB)")
    parser.add_argument(
        "--local-files-only", action="store_true", help="use the hub cache, no download"
    )
    parser.set_defaults(func=convert_command)
