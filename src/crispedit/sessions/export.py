"""A session's edited model written out: the base model with the committed round's weights as a loadable Hugging
Face folder with its model card, or only the change from the base as a reversible delta file
(:mod:`crispedit.delta`; ``crispedit delta apply`` puts it on the base). What ``crispedit session export`` and
:meth:`~crispedit.sessions.session.Session.export` run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from ..atomic import atomic_directory, atomic_write_json
from ..checks import check_finite_tensors
from ..model_card import build_card, card_may_replace, revert_lines, write_card
from ..models import save_model_dir
from ..paths import check_output_dir
from ..versions import stamped
from ..weights import parameter

__all__ = ["export_session", "session_card", "EXPORT_MARKER"]

EXPORT_MARKER = "crispedit_session.json"  # what an export folder holds beside the model: which session, which round


class SessionView(Protocol):
    """What an export reads of a :class:`~crispedit.sessions.session.Session`."""

    path: Path
    meta: dict
    config: Any

    def model_at_commit(self) -> tuple[Any, Any, dict]:
        """``(model, tokenizer, committed state)``, the committed weights in the model."""

    def edits(self) -> list:
        """The applied edit log, one list per committed round."""

    @property
    def base_weights(self) -> dict:
        """The base values of the parameters the rounds change."""


def export_session(
    session: SessionView, out: str | Path, *, overwrite: bool = False, progress: bool | None = None, delta: bool = False
) -> Path:
    """Write ``session``'s edited model (base + committed weights) to ``out`` as a Hugging Face directory with its
    model card, or with ``delta`` only ``delta.safetensors`` (the change from the base, reversible). A non-empty
    ``out`` is refused unless ``overwrite`` and it holds an earlier export; then only the files that export wrote
    are replaced, other files kept. Returns ``out``."""
    out = Path(out)
    previous = check_output_dir(out, overwrite=overwrite, marker=EXPORT_MARKER)
    model, tok, st = session.model_at_commit()
    meta, config = session.meta, session.config
    with atomic_directory(out, previous=previous) as tmp:
        if delta:
            from ..delta import DELTA_FILE, delta_info, write_delta

            base = session.base_weights
            check_finite_tensors({n: parameter(model, n) for n in base}, f"session {session.path}")
            info = delta_info(
                config.edit.method,
                config.edit.to_json(),
                [r for reqs in session.edits() for r in reqs],
                st["rounds"][-1] if st["rounds"] else {},
                model=meta["base"]["spec"],
                layers=meta["layers"],
                session=meta["name"],
                round=st["round"],
                session_config=meta["config"],
            )
            write_delta(tmp / DELTA_FILE, model, base, info)
            files = [DELTA_FILE]
        else:
            files = save_model_dir(model, tok, tmp, progress=progress, what=f"session {session.path}")
            if card_may_replace(out, previous):
                files.append(write_card(tmp, session_card(session, st)))
        atomic_write_json(
            tmp / EXPORT_MARKER,
            stamped(
                {
                    "session": str(session.path.resolve()),
                    "name": meta["name"],
                    "base": meta["base"],
                    "round": st["round"],
                    "n_edits": sum(r["n_edits"] for r in st["rounds"]),
                    "layers": meta["layers"],
                    "files": sorted(files + [EXPORT_MARKER]),
                }
            ),
        )
    return out


def session_card(session: SessionView, st: dict) -> str:
    """The model card of an export of ``session`` at committed state ``st``: the last round's measurements
    (teacher-forced rel / gen over every edit so far, KL drift, perplexity, predicted drift); WILD is not run by
    sessions."""
    last = st["rounds"][-1] if st["rounds"] else {}
    summary = {k: last.get(k) for k in ("kl_drift", "kl_predicted", "ppl", "ppl_base")}
    summary.update(rel=last.get("rel_all"), gen=last.get("gen_all"))
    requests = [r.to_json() for reqs in session.edits() for r in reqs]
    report = {
        "method": session.config.edit.method,
        "config": session.meta["config"],
        "model": session.meta["base"]["spec"],
        "n_edits": len(requests),
        "requests": requests,
        "summary": summary,
        "layers": session.meta["layers"],
    }
    name = session.meta["name"]
    return build_card(
        report,
        made_by=f"`crispedit session export` of session `{name}` at round {st['round']}",
        revert=[
            "# MODEL_DIR is this folder; SESSION the session directory it was exported from",
            "crispedit session export SESSION --delta --out DELTA_DIR   # the change as a delta",
            *revert_lines("DELTA_DIR/delta.safetensors", where=None),
        ],
        note=f"Session `{name}` ({session.config.mode} mode): {st['round']} round(s) of edits applied "
        "one after another; the figures are those measured after the last round, over all "
        "edits so far.",
    )
