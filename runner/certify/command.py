"""`runner certify`'s command line: the architecture x strategy matrices (matrix.py), the
joins' covering array (joins.py, --joins) and the shipped recipes as sweeps (recipes.py,
--recipes)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

from runner.certify import joins, matrix, recipes
from runner.certify.architectures import DEFAULT_ROWS, ROWS
from runner.config.errors import UserError


def parser() -> argparse.ArgumentParser:
    """`runner certify`'s arguments (the docs' commands are parsed by it in the tests)."""
    parser = argparse.ArgumentParser(
        prog="runner certify",
        description="Certify architectures: each strategy at 2 processes against one process, with a resume "
                    "and a from_pretrained check. Prints a row per architecture.")
    parser.add_argument("model_types", nargs="*", metavar="MODEL_TYPE",
                        help=f"transformers model types with a tiny config here, or a variant row ({', '.join(ROWS)}; "
                             f"default: {', '.join(DEFAULT_ROWS)})")
    parser.add_argument("--precision", default="fp32", help="fp32, bf16, or fp32,bf16 (default fp32)")
    parser.add_argument("--work-dir", type=Path, default=Path("outputs/certify"),
                        help="where the runs go (default outputs/certify); a run folder there is overwritten")
    parser.add_argument("--out", type=Path, default=None, help="also write the matrix to this Markdown file")
    parser.add_argument("--peft", default="none",
                        help="lora or dora: train adapters on the frozen initial weights instead of every weight, "
                             "and check adapter/ with peft; a list (none,lora) certifies each, in the same launches "
                             "(default none)")
    parser.add_argument("--objective", default="causal_lm", choices=tuple(matrix.OBJECTIVES),
                        help="dpo: optimise DPO's loss on the vendored preference pairs instead of the next-token "
                             "loss on text (default causal_lm)")
    parser.add_argument("--reshard", action="store_true",
                        help="resume each strategy's checkpoint of 2 processes on 1 process under ddp: a world-size "
                             "and strategy change, read across")
    parser.add_argument("--joins", action="store_true",
                        help="the features' joins instead: a pairwise covering array of objective, data, packing, "
                             "peft, reference, model, strategy and precision, each cell held to the invariants "
                             "(runner/certify/joins.py)")
    parser.add_argument("--recipes", action="store_true",
                        help="every shipped offline recipe as a two-step sweep over precision and strategy, as users "
                             "run it (runner/certify/recipes.py)")
    return parser


def main(argv: Sequence[str]) -> None:
    args = parser().parse_args(list(argv))
    if not (args.joins or args.recipes):
        matrix.main(args)
        return
    if args.model_types or args.reshard or (args.precision, args.peft, args.objective) != ("fp32", "none", "causal_lm"):
        raise UserError("--joins and --recipes choose their own models, precisions, adapters and objectives: give "
                        "them --work-dir and --out only")
    if args.joins:
        joins.main(args.work_dir / "joins", args.out)
    if args.recipes:
        out = args.out.with_name(f"{args.out.stem}_recipes{args.out.suffix}") if args.out and args.joins else args.out
        recipes.main(args.work_dir / "recipes", out)
