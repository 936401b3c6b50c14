"""Sharded memory: the calculator's table for the docs' sharding page and what was measured."""

from __future__ import annotations

from .common import HERE, load_json

SHARD_MEMORY = HERE / "shard_memory"


GPU_GIB = (24, 40, 80, 141)  # the device memories the table marks as fitting


def shard_table() -> str:
    """From ``shard_memory/table.json``: what one process holds (GiB, activations aside) for the Llama-3 shapes
    per N, and the smallest of :data:`GPU_GIB` it fits, for the docs' sharding page."""
    t = load_json(SHARD_MEMORY / "table.json")
    ns = list(next(iter(t[s]["per_process"] for s in ("llama3-8b", "llama3-70b"))))
    lines = ["| shape, edited layers | " + " | ".join(f"N = {n}" for n in ns) + " |", "|---|" + "---|" * len(ns)]
    for shape, name in (("llama3-8b", "Llama-3-8B"), ("llama3-70b", "Llama-3-70B")):
        cells = []
        for n in ns:
            gib = t[shape]["per_process"][n]["total"] / 2**30
            fit = next((f"{g} GB" for g in GPU_GIB if gib < g), "none")
            cells.append(f"{gib:.1f} GiB ({fit})")
        lines.append(f"| {name}, `{t[shape]['layers']}` | " + " | ".join(cells) + " |")
    return (
        "\n".join(lines) + f"\n\nPer process, {t['dtype']} weights, activations not counted; in brackets the "
        "smallest of 24, 40, 80 and 141 GB devices it fits before activations. From "
        "[`table.json`](../results/shard_memory/table.json).\n"
    )


def shard_measured() -> str:
    """From ``shard_memory/measure_*.json``: per run, the weights a process stores and its peak resident memory during
    the edit above the process's own (interpreter and libraries, before the model), against the calculator (MiB)."""
    runs = (("measure_2proc.json", "2 processes, not split"), ("measure_2proc_shard.json", "2 processes, `--shard`"))
    lines = [
        "| run | weights stored | calculator | peak during the edit, above the bare process | calculator total |",
        "|---|---|---|---|---|",
    ]
    mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    for f, what in runs:
        r = load_json(SHARD_MEMORY / f)
        p = max(r["processes"], key=lambda x: x["peak_bytes"] - x["rss_base"])
        pred = p["predicted"]
        lines.append(
            f"| {what} ([json](../results/shard_memory/{f})) | {mib(p['held_weights'])} | "
            f"{mib(pred['blocks'] + pred['whole'])} | {mib(p['peak_bytes'] - p['rss_base'])} | "
            f"{mib(pred['total'])} |"
        )
    return (
        "\n".join(lines) + "\n\nThe process with the higher peak of each run; the bare process is its resident "
        "memory before the model was built.\n"
    )
