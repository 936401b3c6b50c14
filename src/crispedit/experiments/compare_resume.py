"""Resuming a compare: the rows of an existing ``DIR/compare.json`` are kept when this crispedit version wrote it
under the same settings and each row asked for again ran with the same configuration (the same files, the same
round size); anything else is a one-line :class:`~crispedit.errors.CrispEditError` that says what differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..editing import SeqConfig
from ..editing.registry import seq_row
from ..errors import CrispEditError
from .compare_outputs import read_compare

__all__ = ["resume_payload"]


def _run_identity(config: dict, inputs: dict[str, str] | None) -> dict:
    """What makes a stored row the same run as a requested one: ``config`` (an ``EditConfig`` or ``SeqConfig``
    JSON) with each method option in ``inputs`` (option -> SHA-256 of the file it named, as a row stores it)
    replaced by that digest, so a network moved or copied elsewhere is the same run and a retrained one at
    the same path is not. Without ``inputs`` (a method that reads no file): ``config`` as is."""
    if not inputs or not isinstance(inputs, dict):
        return config
    edit_json = config.get("edit") if isinstance(config.get("edit"), dict) else config
    options = edit_json.get("options")
    if not isinstance(options, dict):
        return config
    keyed = {**options, **{opt: f"sha256:{digest}" for opt, digest in inputs.items()}}
    if edit_json is config:
        return {**config, "options": keyed}
    return {**config, "edit": {**edit_json, "options": keyed}}


#: The sequential rows' settings a resumed row names when they differ: (identity key, what it is, its flag).
_SEQ_KNOBS = (
    ("weighting", "factor weighting {was}, now {now}", "--seq-weighting"),
    ("mix", "the edit factors' share of the mix {was}, now {now}", "--seq-mix"),
    ("edit_gamma", "edit-factor gamma {was}, now {now}", "--seq-edit-gamma"),
    ("edit_factors", "edit factors at {was} positions, now {now}", "--seq-edit-factors"),
    ("replay", "replay of {was} earlier edits, now {now}", "--seq-replay"),
    ("drift_from", "drift penalty from the {was}, now from the {now}", "--seq-drift-from"),
    ("carry_optimizer", "Adam's state carried across rounds: {was}, now {now}", "--seq-no-carry-optimizer"),
)


def _seq_hint(stored: dict, now: dict) -> str:
    """The first of :data:`_SEQ_KNOBS` that differs between a stored row's and this run's
    :meth:`~crispedit.editing.SeqConfig.identity` (absent where the rounds merge no factors), as the error's
    parenthesis naming the flag that resumes it; ``""`` when none differs."""
    for key, what, flag in _SEQ_KNOBS:
        was, is_now = stored.get(key), now.get(key)
        if was is not None and is_now is not None and was != is_now:
            # a switch resumes by being given (the stored row ran with it) or left out
            resume = (flag if not was else f"leaving out {flag}") if isinstance(was, bool) else f"{flag} {was}"
            return f" ({what.format(was=was, now=is_now)}: {resume} resumes it)"
    return ""


def resume_payload(path: Path, payload: dict, methods: Sequence[str], configs: dict, inputs: dict, chunk: int) -> None:
    """Take the rows of an existing compare file at ``path`` into ``payload`` (its ``results`` and ``methods``), after
    checking that this crispedit version wrote it (:func:`~crispedit.versions.check_written_by`), under the same
    settings, and that every row asked for again ran with the same configuration (the same files, the same round
    size); one-line errors otherwise. Nothing when there is none."""
    if not path.is_file():
        return
    old = read_compare(path, "remove it or use another --out")
    settings, was = payload["settings"], old.get("settings", {})
    diff = [k for k in settings if was.get(k) != settings[k]]
    if diff:
        raise CrispEditError(
            f"{path} was written with other settings ({', '.join(diff)}); "
            "use another --out to compare under new settings"
        )
    payload["results"] = old.get("results", {})
    for m in methods:
        row, seq = payload["results"].get(m, {}), seq_row(m)[1]
        stored = row.get("config")
        if stored is None:  # not run yet (or the base row)
            continue
        stored_id = SeqConfig.from_dict(stored).identity() if seq else stored
        same = _run_identity(stored_id, row.get("inputs")) == _run_identity(
            configs[m].identity() if seq else configs[m].to_json(), inputs[m]
        )
        if not same or (seq and row.get("seq_chunk") != chunk):
            other_chunk = seq and row.get("seq_chunk") != chunk
            was = row.get("inputs") if isinstance(row.get("inputs"), dict) else {}
            other_file = [o for o in inputs[m] if o in was and was[o] != inputs[m][o]]
            what = _seq_hint(stored_id, configs[m].identity()) if seq else ""
            if other_chunk:
                what = f" (rounds of {row.get('seq_chunk')} edits, now {chunk})"
            elif not what and other_file:
                what = (
                    f" (another {other_file[0]} file: sha256 {str(was[other_file[0]])[:12]}…, now "
                    f"{inputs[m][other_file[0]][:12]}…)"
                )
            raise CrispEditError(f"{path} holds {m} run with another configuration{what}; use another --out")
    payload["methods"] = list(dict.fromkeys(list(old.get("methods", [])) + list(methods)))
