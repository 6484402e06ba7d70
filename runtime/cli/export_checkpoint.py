"""`rljob export CHECKPOINT DIR`: a training checkpoint as a Hugging Face model folder (runtime/export.py)."""

from __future__ import annotations

import argparse

from rljob.runtime.cli.console import Subparsers, console


def export_command(args: argparse.Namespace) -> int:
    """`rljob export`: write the folder and say what it holds."""
    from rljob.runtime.export import export_checkpoint

    result = export_checkpoint(args.checkpoint, args.dir, dtype=args.dtype, force=args.force, model=args.model)
    console.print(
        f"[green]exported[/] {result.checkpoint} (step {result.step}, policy version {result.policy_version}) "
        f"to [bold]{result.directory}[/] as {result.dtype} safetensors with config and tokenizer"
    )
    if not result.hf_tokenizer:
        console.print("[yellow]note[/]: the builtin character tokenizer is rljob's own; transformers and SGLang "
                      "load the weights and config, not that tokenizer")
    return 0


def add_parser(sub: Subparsers) -> None:
    """The `export` command: a checkpoint as a Hugging Face folder."""
    export = sub.add_parser(
        "export", help="write a training checkpoint as a Hugging Face model folder (transformers, SGLang)",
        description="Write the policy of an rljob checkpoint as a Hugging Face model folder: safetensors "
        "weights, config.json, generation_config.json and the tokenizer of the job's model.",
    )
    export.add_argument("checkpoint", help="a checkpoint folder (step-N), its state.pt, a checkpoint dir (newest), or an "
                        "s3://bucket/prefix[/step-N] URI (store from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...)")
    export.add_argument("dir", help="output folder (must be empty or absent unless --force)")
    export.add_argument("--dtype", choices=["float32", "bfloat16"], help="weight precision (default: as trained)")
    export.add_argument("--force", action="store_true", help="replace a non-empty output folder")
    export.add_argument("--model", metavar="DIR",
                        help="base model folder (config, tokenizer) instead of the job's model source: needed for a "
                        "cluster checkpoint, whose job names the model's path inside the trainer pod")
    export.set_defaults(func=export_command)
