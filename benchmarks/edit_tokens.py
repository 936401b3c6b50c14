"""What an edit set asks of the training loop, before any training: per slice of an edit file, the training
sequences, steps, padded and real tokens of one epoch under an :class:`~crispedit.editing.EditConfig`, and the
memory of the fast path's cached hidden states (one float32 row of ``d_model`` per padded position, kept for the
whole edit: :mod:`crispedit.editing.fastpath`) — the part of an edit's memory that grows with the edit set.

    python benchmarks/edit_tokens.py --edits ../shared/data/edits/zsre_dev.json:100:100 \\
        --edits ../shared/data/edits/zsre_dev.json:1000:1000 \\
        --edits ../shared/data/edits/counterfact_10k_dev.json:0:3000

Each ``--edits`` is ``PATH[:OFFSET[:N]]``. The model is loaded because the default contexts' ``lead`` prefixes are
written by it (no training, no gradients). Prints a Markdown table; ``--json FILE`` writes the rows.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def slice_arg(text: str) -> tuple[str, int, int | None]:
    """``PATH[:OFFSET[:N]]`` as ``(path, offset, n or None)``."""
    path, *rest = text.split(":")
    offset = int(rest[0]) if rest else 0
    n = int(rest[1]) if len(rest) > 1 else None
    return path, offset, n


def count(tokenizer, requests, config, model, d_model: int) -> dict:
    """One epoch of ``requests`` under ``config``: sequences, steps, padded / real tokens and the cached prefix
    states' megabytes (``padded × d_model × 4`` bytes)."""
    from crispedit.editing.loop import edit_batches

    batches, _ = edit_batches(tokenizer, requests, config, model)
    padded = sum(b.input_ids.numel() for b in batches)
    return {
        "edits": len(requests),
        "sequences": sum(b.input_ids.shape[0] for b in batches),
        "steps": len(batches),
        "padded_tokens": padded,
        "real_tokens": sum(int(b.attention_mask.sum()) for b in batches),
        "prefix_states_mb": round(padded * d_model * 4 / 1e6),
    }


def main(argv=None) -> list[dict]:
    """Count every ``--edits`` slice (arguments as the command line's); returns the rows."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--edits", action="append", required=True, type=slice_arg, metavar="PATH[:OFFSET[:N]]")
    ap.add_argument("--contexts", default="default")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args(argv)

    from crispedit.atomic import atomic_write_json
    from crispedit.data import load_edits
    from crispedit.editing import EditConfig
    from crispedit.models import load_model

    model, tok = load_model(args.model)
    config = EditConfig(contexts=args.contexts, batch_size=args.batch_size)
    d_model = model.get_input_embeddings().weight.shape[1]
    rows = []
    print("| edit set | sequences | steps / epoch | padded tokens / epoch | real tokens | cached prefix states |")
    print("|---|---|---|---|---|---|")
    for path, offset, n in args.edits:
        requests = load_edits(path)[offset : None if n is None else offset + n]
        row = {"edits_file": Path(path).name, "offset": offset, **count(tok, requests, config, model, d_model)}
        rows.append(row)
        print(
            f"| {row['edits_file']} {offset}–{offset + row['edits'] - 1} | {row['sequences']:,} | {row['steps']} | "
            f"{row['padded_tokens']:,} | {row['real_tokens']:,} | {row['prefix_states_mb']:,} MB |".replace(",", " ")
        )
    if args.json:
        atomic_write_json(
            args.json, {"model": args.model, "contexts": args.contexts, "batch_size": args.batch_size, "rows": rows}
        )
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
