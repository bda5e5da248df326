"""The `eqllm` subcommands: one module each, holding its argument parsing and its function."""
