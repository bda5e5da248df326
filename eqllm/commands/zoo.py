"""`eqllm zoo list | show NAME [--mesh ...]`: the model zoo's variants and their configs."""

from __future__ import annotations

import argparse

from eqllm import zoo
from eqllm.config import dotted
from eqllm.sharding import MeshConfig, MeshError, sharding_table


def zoo_list(args: argparse.Namespace) -> int:
    header = [
        "name",
        "family",
        "params",
        "active",
        "exact",
        "layers",
        "d_model",
        "heads/kv",
        "context",
        "vocab",
        "source",
    ]
    rows = []
    for name in zoo.names():
        entry = zoo.entry(name)
        cfg = entry.config
        count = zoo.param_count(cfg)
        rows.append(
            [
                name,
                cfg.family,
                zoo.human_count(count),
                zoo.human_count(zoo.active_param_count(cfg)),
                f"{count:,}",
                str(cfg.n_layers),
                str(cfg.d_model),
                f"{cfg.attention.n_heads}/{cfg.attention.n_kv_heads}",
                str(cfg.max_seq_len),
                str(cfg.vocab_size),
                entry.source or "-",
            ]
        )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    right = {2, 3, 4, 5, 6, 7, 8, 9}
    for row in [header, *rows]:
        cells = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        print("  ".join(cells).rstrip())
    return 0


def zoo_show(args: argparse.Namespace) -> int:
    entry = zoo.entry(args.name)
    count = zoo.param_count(entry.config)
    active = zoo.active_param_count(entry.config)
    print(f"{entry.name}: {zoo.human_count(count)} parameters ({count:,})")
    if active != count:
        print(f"active per token: {zoo.human_count(active)} ({active:,})")
    if entry.source:
        print(f"mirrors: {entry.source}")
    for key, value in dotted(entry.config.to_dict()).items():
        print(f"  {key} = {value!r}")
    if args.mesh:
        mesh = MeshConfig.parse(args.mesh)
        if -1 in mesh.sizes():
            raise MeshError(f"--mesh {args.mesh}: give every axis a size (no -1) to size it")
        sizes = mesh.axis_sizes()
        print(f"\nsharding on mesh {mesh.describe()}:")
        for line in sharding_table(entry.config, sizes):
            print(f"  {line}")
    return 0


def add_parser(commands) -> None:
    """Register `eqllm zoo` on the CLI's subparsers."""
    zoo_parser = commands.add_parser("zoo", help="list or inspect the model zoo")
    zoo_commands = zoo_parser.add_subparsers(dest="zoo_command", required=True)
    zoo_commands.add_parser("list", help="table of every variant").set_defaults(func=zoo_list)
    show = zoo_commands.add_parser("show", help="the full config of one variant")
    show.add_argument("name")
    show.add_argument(
        "--mesh", help="also show each parameter's sharding, e.g. pipeline=2,data=2,fsdp=2"
    )
    show.set_defaults(func=zoo_show)
