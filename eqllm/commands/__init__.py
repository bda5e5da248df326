"""One module per `eqllm` subcommand: its arguments and the function that runs it.

Each module has `add_parser(subparsers)`, which registers the subcommand with
`set_defaults(func=...)`; the function takes the parsed arguments and returns the exit status.
`eqllm.cli` builds the parser from them and dispatches. The library code the commands call
lives in the layers below (`eqllm.train`, `eqllm.eval`, `eqllm.loading`, ...).
"""
