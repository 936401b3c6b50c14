"""``crispedit export gguf MODEL_DIR --out FILE [--type f16|q8_0|f32]``: a llama-family model directory (an edited
one, typically) as one GGUF file for llama.cpp-based tools (:mod:`crispedit.export_gguf`).

Torch-free at import; the directory, its family, the destination and the type are checked before torch loads.
"""

from __future__ import annotations

__all__ = ["add_cli"]


def cmd_gguf(args) -> int:
    """``crispedit export gguf``: write the GGUF file and print what it holds, its name and where its tokenizer came
    from."""
    from ..export_gguf import check_export

    check_export(args.model_dir, args.out, args.type)
    from ..export_gguf import export_gguf

    info = export_gguf(args.model_dir, args.out, qtype=args.type, progress=False if args.quiet else None)
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(info["types"].items()))
    print(
        f"GGUF ({args.type}; {info['tensors']} tensors: {kinds}) written to {info['out']}: "
        f"{info['bytes'] / 2**20:.1f} MiB in {info['seconds']:.1f} s"
    )
    origin = (
        f"tokenizer and provenance carried from {info['source']}"
        if info["source"]
        else "tokenizer from the folder's tokenizer.json (no source GGUF found)"
    )
    print(f"  named {info['name']!r}; pre-tokenizer {info['pre']}; {origin}")
    return 0


def add_cli(sub) -> None:
    """Register ``crispedit export gguf`` on ``subparsers``."""
    from ..export_gguf import GGUF_TYPES

    p = sub.add_parser("export", help="write a model directory in another format: gguf (llama.cpp)")
    es = p.add_subparsers(dest="export_command", required=True)
    g = es.add_parser("gguf", help="a llama-family model directory (e.g. an edited SmolLM2) as one GGUF file")
    g.add_argument("model_dir", metavar="MODEL_DIR", help="Hugging Face model directory (config.json + safetensors)")
    g.add_argument("--out", required=True, help="the .gguf file to write (replaced atomically if it exists)")
    g.add_argument(
        "--type",
        default="f16",
        choices=GGUF_TYPES,
        help="tensor type of the matrices: f16 (default), q8_0 (8-bit blocks of 32; about half the size) "
        "or f32 (lossless); norm vectors stay f32",
    )
    g.add_argument("--quiet", action="store_true", help="no progress bars")
    g.set_defaults(func=cmd_gguf)
