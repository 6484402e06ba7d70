"""`rljob model build NAME DIR`: the folder behind model.builtin tiny-qwen3 / tiny-llama (no download)."""

from __future__ import annotations

import argparse

from rljob.runtime.cli.console import Subparsers, console


def build_command(args: argparse.Namespace) -> int:
    """`rljob model build`: random weights and a locally trained tokenizer in DIR."""
    from rljob.runtime.models.tiny import TinyModelRecipe, build_tiny_model
    from rljob.runtime.tasks.policy import TINY_ARCHITECTURES

    family = TINY_ARCHITECTURES[args.name]  # a family name TinyModelRecipe knows (tests/unit/test_hf_models.py)
    folder = build_tiny_model(args.dir, TinyModelRecipe(family=family, seed=args.seed))  # type: ignore[arg-type]
    console.print(f"[green]built[/] {args.name} (random weights, locally trained tokenizer) at [bold]{folder}[/]; "
                  f"use it with spec.model.path: {folder}")
    return 0


def add_parser(sub: Subparsers) -> None:
    """The `model build` command: the tiny random architectures."""
    model = sub.add_parser("model", help="model folders: build the tiny random architectures")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    build = model_sub.add_parser(
        "build", help="write a tiny random Qwen3 / Llama 3 model folder (no download)",
        description="Write the folder behind model.builtin tiny-qwen3 / tiny-llama: random weights, a "
        "tokenizer trained locally with the tokenizers library, a chat template and generation config.",
    )
    build.add_argument("name", choices=["tiny-qwen3", "tiny-llama"])
    build.add_argument("dir", help="output folder")
    build.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    build.set_defaults(func=build_command)
