"""``crispedit compare``: every method on the same edits from the same base, measured the same way.

For each method: restore the base (checked by weight fingerprint), edit with that method's config
(shared flags + its own defaults), evaluate with :func:`crispedit.evaluation.evaluate_edit` (WILD
qa / none / chat with the rule judge, teacher-forced rel / gen, KL drift on held-out text, optional
lm-eval capability tasks), and record edit time and peak memory. The unedited base model is
evaluated once as the first row. After every method ``DIR/compare.json`` (atomic), ``DIR/compare.md``
(shaped like the paper's Table 1) and ``DIR/compare.png`` (edit success vs capability retention) are
rewritten, so a killed compare resumes: methods already in ``compare.json`` are not run again (their
settings must match; other settings need another ``--out``), and a batch row killed while training goes on
from its last finished epoch (``DIR/checkpoints/<method>.safetensors``, :mod:`crispedit.editing.checkpoint`;
removed once its row is written). The command line is
:mod:`crispedit.cli.compare` (it checks the arguments without importing this module's torch).

Sequential rows: ``<method>-seq`` (e.g. ``crispedit-seq``, the paper's CrispEdit-Seq) runs ``<method>`` in
``ceil(n / chunk)`` rounds of ``chunk`` consecutive edits through the session machinery
(:func:`crispedit.sessions.sequential.run_sequence`, i.e. :func:`~crispedit.sessions.sequential.run_round`
with a :class:`~crispedit.editing.SeqConfig`), and the final model is evaluated on all edits exactly like a
batch row. Its row records ``rounds``, ``seq_chunk`` and ``round_seconds``; its stored ``config`` is the
``SeqConfig`` and, with ``seq_chunk``, what a resumed compare checks.

Pareto front (:func:`pareto_front`, :func:`pareto_points`): edit success is the WILD qa reliability (the
paper's wrapper, never trained); capability retention is the mean over the capability tasks of
score / base score when ``--capabilities`` ran, else minus the KL drift on held-out text. An edited row is
on the front when no other edited row is at least as good on both and better on one; ``compare.json``
→ ``pareto`` and the ``Pareto`` column of ``compare.md`` say which (the unedited base is not a candidate).
With capability tasks a second front against minus the KL drift (``pareto.kl_front``, column ``Pareto
(KL)``) is kept as well: capability scores on a ``--limit`` of items carry a sampling error of several
points, the KL drift on the held-out text hardly any. Under the table, each task's change against the base
on the same items (paired mean difference ± its standard error, in points) says which capability
differences are larger than that error.

Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` during the edit (reset before each method);
on CPU the process's peak resident set size during the edit (``VmHWM``, reset before each method
through ``/proc/self/clear_refs``; it includes the model and everything else in the process), with
its increase over the resident size at the start. Where the reset is impossible the increase of
``ru_maxrss`` is reported instead (process-lifetime peak; 0 when an earlier method peaked higher).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch
from tqdm.auto import tqdm

from ..curvature.predicted import prediction_notes
from ..data.edits import EditRequest
from ..editing import EditConfig, SeqConfig, edit, get_editor, restore
from ..editing.api import snapshot
from ..editing.config import default_seq_chunk
from ..editing.contexts import DEFAULT_CONTEXTS
from ..editing.loop import training_brief
from ..editing.registry import seq_row
from ..errors import (CrispEditError, atomic_write_bytes, atomic_write_figure, atomic_write_json, check_output_dir,
                     check_positive_int, read_text_file)
from ..evaluation import EVAL_WRAPPERS, HELD_OUT_WRAPPER, evaluate_edit
from ..evaluation.capabilities import paired_change
from ..models import model_family, weight_fingerprint
from ..sessions.sequential import run_sequence

__all__ = ["run_compare", "compare_table", "plot_compare", "peak_memory", "pareto_front", "pareto_points",
           "capability_changes",
           "COMPARE_FORMAT"]

COMPARE_FORMAT = 1
JSON_FILE, MD_FILE, PNG_FILE = "compare.json", "compare.md", "compare.png"
CHECKPOINTS = "checkpoints"  # DIR/checkpoints/<method>.safetensors: a batch row's training, resumed after a kill


def _status_kib(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


@contextlib.contextmanager
def peak_memory(device: torch.device) -> Iterator[dict]:
    """Measure the peak memory of the ``with`` body; the yielded dict gets ``peak_mib``, ``increase_mib``
    (MiB) and ``measure`` (what was measured; see the module docstring) on exit."""
    out: dict = {}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        yield out
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        out.update(measure="torch.cuda.max_memory_allocated", peak_mib=round(peak / 2**20, 1),
                   increase_mib=round((peak - start) / 2**20, 1))
        return
    reset = False
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        reset = True
    rss0, max0 = _status_kib("VmRSS"), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    yield out
    hwm = _status_kib("VmHWM")
    if reset and hwm is not None and rss0 is not None:
        out.update(measure="peak RSS (VmHWM, reset before the method)", peak_mib=round(hwm / 1024, 1),
                   increase_mib=round((hwm - rss0) / 1024, 1))
    else:
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - max0
        out.update(measure="ru_maxrss increase (process-lifetime peak, not reset)", peak_mib=None,
                   increase_mib=round(grown / 1024, 1))


def requests_digest(requests: Sequence[EditRequest]) -> str:
    """Digest of the requests' content (prompts, targets, rephrasings, locality)."""
    blob = json.dumps([r.to_json() for r in requests], sort_keys=True).encode()
    return hashlib.blake2b(blob, digest_size=12).hexdigest()


def _stored_config(stored: dict, sequential: bool = False) -> dict:
    """A config stored in an existing compare.json as this crispedit writes it (fields added since, e.g.
    ``max_drift``, at their defaults; a ``SeqConfig`` for a ``-seq`` row), or as stored when it no longer
    validates."""
    try:
        return (SeqConfig if sequential else EditConfig).from_dict(stored).to_json()
    except (CrispEditError, TypeError):
        return stored


def _run_identity(config: dict, inputs: dict[str, str] | None) -> dict:
    """What makes a stored row the same run as a requested one: ``config`` (an ``EditConfig`` or ``SeqConfig``
    JSON) with each method option in ``inputs`` (option -> SHA-256 of the file it named, as a row stores it)
    replaced by that digest, so a network moved or copied elsewhere is the same run and a retrained one at
    the same path is not. ``inputs`` ``None`` (a row stored before rows recorded them): ``config`` as is."""
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


def _row(method: str, ev: dict, **extra) -> dict:
    caps = {k: v["score"] for k, v in ev.get("capabilities", {}).items()}
    return {"method": method, "summary": ev["summary"], "wild": ev.get("wild", {}), "capabilities": caps,
            "capability_details": ev.get("capabilities", {}), **extra}


def _round_line(method: str):
    """A :func:`run_sequence` ``on_round`` callback printing one line per finished round."""
    def report(rec: dict, n_rounds: int) -> None:
        """Print ``method``'s line for the round record ``rec``: edits, seconds, epochs and last epoch loss
        (a single-pass editor: its target NLL before -> after)."""
        tqdm.write(f"  {method} round {rec['round']}/{n_rounds}: {rec['n_edits']} edits, {rec['edit_seconds']:.1f}s, "
                   f"{training_brief(rec.get('train') or {})}")
    return report


def _checked_configs(model, requests: Sequence[EditRequest], methods: Sequence[str],
                     configs: dict[str, EditConfig | SeqConfig]) -> tuple[dict, dict[str, dict[str, str]]]:
    """Every row's config checked against its method (an :class:`EditConfig` for a ``-seq`` row wrapped into a
    :class:`SeqConfig`), with what the method needs of the requests and of the model checked before anything runs;
    returns the configs and, per row, option -> SHA-256 of the file it names (MEND's network)."""
    configs, inputs = dict(configs), {}
    for m in methods:
        base_method, seq = seq_row(m)
        cfg = configs[m]
        if seq and isinstance(cfg, EditConfig):
            cfg = configs[m] = SeqConfig(edit=cfg)
        ok = (isinstance(cfg, SeqConfig) and cfg.mode == "sequential" and cfg.edit.method == base_method) if seq \
            else (isinstance(cfg, EditConfig) and cfg.method == base_method)
        if not ok:
            raise CrispEditError(f"the configuration given for {m} is not one of {base_method}"
                                 + (" in sequential mode" if seq else ""))
        # what each method needs of the requests (the closed forms' subjects) and of the model (MEND's trained
        # network), before anything
        get_editor(base_method).check_requests(requests)
        ec = cfg.edit if isinstance(cfg, SeqConfig) else cfg
        ec.for_family(model_family(model))  # a default lr scaled now, so that a resumed compare compares what ran
        get_editor(base_method).check_ready(model, ec)
        inputs[m] = get_editor(base_method).input_digests(model, ec)
    return configs, inputs


def _resume_payload(path: Path, payload: dict, methods: Sequence[str], configs: dict, inputs: dict, chunk: int) -> None:
    """Take the rows of an existing compare file at ``path`` into ``payload`` (its ``results`` and ``methods``), after
    checking that it was written under the same settings and that every row asked for again ran with the same
    configuration (the same files, the same round size); one-line errors otherwise. Nothing when there is none."""
    if not path.is_file():
        return
    try:
        old = json.loads(read_text_file(path, "compare file"))
    except json.JSONDecodeError:
        raise CrispEditError(f"{path} is corrupt; remove it or use another --out") from None
    if not isinstance(old, dict) or not isinstance(old.get("settings", {}), dict) \
            or not isinstance(old.get("results", {}), dict) or not isinstance(old.get("methods", []), list):
        raise CrispEditError(f"{path} is not a crispedit compare file; remove it or use another --out")
    settings = payload["settings"]
    diff = [k for k in settings if old.get("settings", {}).get(k) != settings[k]]
    if old.get("format") != COMPARE_FORMAT or diff:
        raise CrispEditError(f"{path} was written with other settings ({', '.join(diff) or 'format'}); "
                             "use another --out to compare under new settings")
    payload["results"] = old.get("results", {})
    for m in methods:
        row, seq = payload["results"].get(m, {}), seq_row(m)[1]
        stored = row.get("config")
        if stored is not None and (_run_identity(_stored_config(stored, seq), row.get("inputs"))
                                   != _run_identity(configs[m].to_json(), inputs[m] if "inputs" in row else None)
                                   or (seq and row.get("seq_chunk") != chunk)):
            other_chunk = seq and row.get("seq_chunk") != chunk
            was = row.get("inputs") if isinstance(row.get("inputs"), dict) else {}
            other_file = [o for o in inputs[m] if o in was and was[o] != inputs[m][o]]
            what = (f" (rounds of {row.get('seq_chunk')} edits, now {chunk})" if other_chunk else
                    f" (another {other_file[0]} file: sha256 {str(was[other_file[0]])[:12]}…, now "
                    f"{inputs[m][other_file[0]][:12]}…)" if other_file else "")
            raise CrispEditError(f"{path} holds {m} run with another configuration{what}; use another --out")
    payload["methods"] = list(dict.fromkeys(list(old.get("methods", [])) + list(methods)))


@dataclass
class _Bench:
    """What every row of one compare shares: the model (the base between rows: ``fingerprint``), the requests, the
    round size of ``-seq`` rows, the output directory (its row checkpoints) and how each row is evaluated (WILD
    under every evaluation wrapper, the KL text, the capability tasks on ``limit`` items)."""

    model: object
    tokenizer: object
    requests: Sequence[EditRequest]
    out: Path
    fingerprint: str
    chunk: int
    kl_text: str | None
    capabilities: Sequence[str]
    limit: int | None
    bench_dir: str | None
    progress: bool | None

    def evaluate(self, base_weights: dict, **kw) -> dict:
        """:func:`~crispedit.evaluation.evaluate_edit` of the model as it is now against ``base_weights``."""
        return evaluate_edit(self.model, self.tokenizer, self.requests, base_weights, kl_text=self.kl_text,
                             wild=tuple(EVAL_WRAPPERS), capabilities=self.capabilities, limit=self.limit,
                             bench_dir=self.bench_dir, progress=self.inner, **kw)

    @property
    def inner(self) -> bool:
        """The progress setting of one row's own work: one bar per row, the inner ones quiet unless asked for."""
        return False if self.progress is None else self.progress

    def check_base(self, when: str) -> None:
        """One-line error unless the model holds the base weights (its fingerprint) ``when``."""
        if weight_fingerprint(self.model) != self.fingerprint:
            raise CrispEditError(when)


def _edited_row(b: _Bench, method: str, cfg: EditConfig | SeqConfig, inputs: dict[str, str]) -> dict:
    """Edit the base with ``method`` under ``cfg`` (a ``-seq`` row in rounds), measure its time and peak memory,
    evaluate it and restore the base (also when the edit fails); returns the row for ``compare.json``."""
    model, seq = b.model, isinstance(cfg, SeqConfig)
    ecfg = cfg.edit if seq else cfg
    t0 = time.perf_counter()
    editor = get_editor(ecfg.method)
    before = snapshot(editor.changes(model, editor.select_layers(model, ecfg), ecfg))
    try:
        with peak_memory(next(model.parameters()).device) as mem:
            if seq:
                res = run_sequence(model, b.tokenizer, b.requests, cfg, b.chunk, progress=b.inner, predict_drift=True,
                                   on_round=None if b.progress is False else _round_line(method))
            else:
                res = edit(model, b.tokenizer, b.requests, cfg, progress=b.inner, predict_drift=True,
                           checkpoint=b.out / CHECKPOINTS / f"{method}.safetensors")
    except BaseException:
        restore(model, before)  # an interrupted edit leaves the base behind
        raise
    del before
    wall = time.perf_counter() - t0
    try:
        ev = b.evaluate(res.original_weights, max_len=ecfg.max_len)
    finally:
        restore(model, res.original_weights)
    b.check_base(f"restoring the base after {method} failed (fingerprint differs)")
    from ..pipeline import drift_summary

    ev["summary"].update(drift_summary(res))
    extra = (dict(rounds=len(res.rounds), seq_chunk=res.chunk, round_seconds=res.round_seconds,
                  round_records=res.rounds) if seq else dict(training=res.history.to_json()))
    return _row(method, ev, config=cfg.to_json(), **({"inputs": inputs} if inputs else {}),
                layers=res.layers, changed=sorted(res.original_weights),
                changed_numel=sum(t.numel() for t in res.original_weights.values()),
                edit_seconds=round(res.edit_seconds, 2), cache_seconds=round(res.cache_seconds, 2),
                wall_seconds=round(wall, 2), cache_hit=res.cache_info.get("hit"), memory=mem, **extra)


def _row_line(method: str, r: dict) -> str:
    """The line printed once ``method``'s row ``r`` is written: the held-out wrapper's WILD rel / gen, teacher-forced
    rel, the KL drift measured and predicted, the edit time, a ``-seq`` row's rounds."""
    qa = r["wild"].get(HELD_OUT_WRAPPER) or {}
    return (f"{method}: WILD {HELD_OUT_WRAPPER} rel={qa.get('rel')} gen={qa.get('gen')} tf rel={r['summary']['rel']} "
            f"kl_drift={r['summary']['kl_drift']:.5f} kl_predicted={r['summary'].get('kl_predicted')}"
            + (f" edit={r['edit_seconds']:.1f}s" if "edit_seconds" in r else "")
            + (f" ({r['rounds']} rounds of {r['seq_chunk']})" if "rounds" in r else ""))


def run_compare(model, tokenizer, requests: Sequence[EditRequest], methods: Sequence[str], out: str | Path, *,
                configs: dict[str, EditConfig | SeqConfig], model_spec: str = "<in-memory>",
                edits_info: dict | None = None, capabilities: Sequence[str] = (), limit: int | None = None,
                bench_dir: str | None = None, kl_text: str | None = None, seq_chunk: int | None = None,
                progress: bool | None = None) -> dict:
    """Run ``methods`` (each with ``configs[method]``) on ``requests`` from ``model``'s current weights
    and write ``out``/compare.json, .md, .png; returns the compare.json payload. Methods already in an
    existing compare.json with the same settings are kept and not rerun.

    A ``<method>-seq`` row (module docstring) takes a :class:`SeqConfig` in ``mode="sequential"`` (an
    :class:`EditConfig` is wrapped into one with the session defaults) and runs in rounds of ``seq_chunk``
    edits (default :func:`~crispedit.editing.config.default_seq_chunk` of the number of edits)."""
    if not requests:
        raise CrispEditError("no edit requests given")
    configs, inputs = _checked_configs(model, requests, methods, configs)
    if seq_chunk is not None and not any(seq_row(m)[1] for m in methods):
        raise CrispEditError("--seq-chunk sets the round size of the -seq rows, and none is being run")
    chunk = default_seq_chunk(len(requests)) if seq_chunk is None else check_positive_int("--seq-chunk", seq_chunk)
    out = Path(out)
    check_output_dir(out)
    out.mkdir(parents=True, exist_ok=True)
    fp = weight_fingerprint(model)
    settings = {"model": model_spec, "fingerprint": fp, "edits": edits_info or {}, "n_edits": len(requests),
                "requests_digest": requests_digest(requests),
                # what --contexts 'default' meant when the rows ran: a row stored as 'default' under another
                # default is another configuration
                "default_contexts": DEFAULT_CONTEXTS,
                "evaluation": {"wild": list(EVAL_WRAPPERS), "judge": "rule", "capabilities": list(capabilities),
                               "limit": limit, "kl_text": kl_text or "bundled:wikitext_heldout.txt"}}
    payload = {"format": COMPARE_FORMAT, "settings": settings, "methods": list(methods), "results": {}}
    _resume_payload(out / JSON_FILE, payload, methods, configs, inputs, chunk)
    bench = _Bench(model, tokenizer, requests, out, fp, chunk, kl_text, capabilities, limit, bench_dir, progress)
    todo = ([] if "base" in payload["results"] else ["base"]) + [m for m in methods if m not in payload["results"]]
    bar = tqdm(todo, desc="compare", unit="method", disable=(None if progress is None else not progress))
    for method in bar:
        bar.set_postfix_str(method)
        bench.check_base(f"the model is no longer the base before {method} (fingerprint changed)")
        payload["results"][method] = (_row("base", bench.evaluate({})) if method == "base"
                                      else _edited_row(bench, method, configs[method], inputs[method]))
        write_outputs(out, payload)
        (out / CHECKPOINTS / f"{method}.safetensors").unlink(missing_ok=True)  # the row holds what it was for
        if progress is not False:
            tqdm.write(_row_line(method, payload["results"][method]))
    bar.close()
    write_outputs(out, payload)
    return payload


# ---------------------------------------------------------------------------------------------
# outputs


def _pct(v) -> str:
    return "–" if v is None else f"{100 * v:.1f}"


def _duration(s: float | None) -> str:
    if s is None:
        return ""
    m, sec = divmod(int(round(s)), 60)
    return f"{m}m {sec:02d}s" if m else f"{s:.1f}s"


def pareto_front(points: dict[str, tuple[float | None, float | None]]) -> list[str]:
    """The names (in ``points`` order) on the Pareto front of two objectives, both to be maximised:
    ``points`` maps a name to ``(success, retention)``. A point is on the front unless another point is
    at least as high on both and strictly higher on one (equal points are all on it); a point with a
    ``None`` or NaN coordinate is never on it and dominates nothing."""
    def ok(p):
        """Whether both coordinates of ``p`` are set (not ``None``) and not NaN."""
        return all(v is not None and v == v for v in p)

    valid = {n: (float(p[0]), float(p[1])) for n, p in points.items() if ok(p)}
    return [n for n, (a, b) in valid.items()
            if not any(x >= a and y >= b and (x > a or y > b) for m, (x, y) in valid.items() if m != n)]


def _retention(payload: dict, r: dict) -> float | None:
    caps = payload["settings"]["evaluation"]["capabilities"]
    if not caps:
        return -r["summary"]["kl_drift"]
    base = payload["results"].get("base", {}).get("capabilities", {})
    ratios = [r["capabilities"][c] / base[c] for c in caps if r["capabilities"].get(c) is not None and base.get(c)]
    return sum(ratios) / len(ratios) if ratios else None


def pareto_points(payload: dict) -> dict:
    """The Pareto picture of a compare payload: ``{"success": label, "retention": label, "points": {row:
    [success, retention]}, "front": [rows], "kl_front": [rows]}`` over the edited rows (not the unedited
    base). Success = WILD qa rel (fraction); retention = the mean over capability tasks of score / base
    score when capability tasks ran (1.0 = unchanged), else minus the KL drift on held-out text
    (nats/token; 0 = unchanged). :func:`pareto_front` picks the front; ``kl_front`` is always the front
    against minus the KL drift (the same as ``front`` without capability tasks)."""
    res = payload["results"]
    caps = payload["settings"]["evaluation"]["capabilities"]
    rows = [m for m in payload["methods"] if m in res and m != "base"]
    success = {m: (res[m]["wild"].get(HELD_OUT_WRAPPER) or {}).get("rel") for m in rows}
    points = {m: [success[m], _retention(payload, res[m])] for m in rows}
    kl = {m: (success[m], -res[m]["summary"]["kl_drift"]) for m in rows}
    return {"success": f"WILD {HELD_OUT_WRAPPER} rel",
            "retention": ("mean capability score / base score over " + ", ".join(caps)) if caps
            else "-KL drift on held-out text (nats/token)",
            "points": points, "front": pareto_front({m: tuple(p) for m, p in points.items()}),
            "kl_front": pareto_front(kl)}


def capability_changes(payload: dict) -> dict:
    """``{row: {task: [change, stderr]}}``: each edited row's change of each capability score against the
    unedited base on the same items (:func:`~crispedit.evaluation.capabilities.paired_change`), in
    percentage points; rows or tasks without per-item scores (results stored before they were kept) are
    left out."""
    res = payload["results"]
    caps = payload["settings"]["evaluation"]["capabilities"]
    base = (res.get("base") or {}).get("capability_details") or {}
    out: dict = {}
    for m in payload["methods"]:
        details = (res.get(m) or {}).get("capability_details") or {}
        for c in caps:
            pc = paired_change((details.get(c) or {}).get("items"), (base.get(c) or {}).get("items"))
            if pc is not None:
                out.setdefault(m, {})[c] = [round(100 * pc[0], 2), round(100 * pc[1], 2)]
    return out


def compare_table(payload: dict) -> str:
    """The markdown table (the paper's Table 1 shape): WILD rel / gen per context, teacher-forced
    rel / gen, KL drift, capability scores (percent), edit time (+ curvature time), peak memory and
    ``Pareto`` (★ for the rows on the front of :func:`pareto_points`; with capability tasks also ``Pareto
    (KL)``, its front against -KL drift). Per column the best edited method and those within 5 % (relative)
    of it are in bold. Notes under the table give each row's paired capability change against the base
    (:func:`capability_changes`, where per-item scores were kept), the ``-seq`` rows' rounds, chunk size and
    mean time per round, and the drift prediction's notes per row
    (:func:`~crispedit.curvature.predicted.prediction_notes`: steep layers, attention q/k/v layers)."""
    res = payload["results"]
    caps = payload["settings"]["evaluation"]["capabilities"]
    rows = [m for m in ["base"] + list(payload["methods"]) if m in res]
    wrappers = payload["settings"]["evaluation"].get("wild") or list(EVAL_WRAPPERS)
    cols = [(f"{w.upper() if w == HELD_OUT_WRAPPER else w} {k}",
             (lambda w, k: lambda r: (r["wild"].get(w) or {}).get(k))(w, k), True) for w in wrappers for k in ("rel", "gen")]
    cols += [("TF rel", lambda r: r["summary"].get("rel"), True),
            ("TF gen", lambda r: r["summary"].get("gen"), True)]
    cols += [(c, (lambda c: lambda r: r["capabilities"].get(c))(c), True) for c in caps]
    edited = [res[m] for m in rows if m != "base"]
    head = ["method"] + [c[0] for c in cols] + ["KL drift", "KL pred", "edit time", "curvature", "peak mem MiB (+rise)",
                                                "Pareto"] + (["Pareto (KL)"] if caps else [])
    pareto = pareto_points(payload)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in rows:
        r = res[m]
        cells = [m if m != "base" else "base (unedited)"]
        for _, get, _higher in cols:
            v = get(r)
            best = max((x for x in (get(e) for e in edited) if x is not None), default=None)
            text = _pct(v)
            if m != "base" and v is not None and best is not None and best > 0 and v >= 0.95 * best:
                text = f"**{text}**"
            cells.append(text)
        mem = r.get("memory") or {}
        peak = "" if not mem else (f"{mem['peak_mib']:.0f} (+{mem['increase_mib']:.0f})" if mem.get("peak_mib")
                                   else f"+{mem['increase_mib']:.0f}")
        pred = r["summary"].get("kl_predicted")
        cells += [f"{r['summary']['kl_drift']:.5f}", "–" if pred is None else f"{pred:.5f}", _duration(r.get("edit_seconds")),
                  _duration(r.get("cache_seconds")) if r.get("cache_seconds") else "", peak,
                  "–" if m == "base" else ("★" if m in pareto["front"] else "")]
        if caps:
            cells.append("–" if m == "base" else ("★" if m in pareto["kl_front"] else ""))
        lines.append("| " + " | ".join(cells) + " |")
    s = payload["settings"]
    note = (f"\n{s['model']} · {s['n_edits']} edits {json.dumps(s['edits'])} · WILD rule judge (qa = the paper's "
            "wrapper, never trained) · TF = teacher-forced · KL drift = mean per-token KL(base‖edited) on held-out "
            "text (nats) · KL pred = the K-FAC prediction ½·Σ tr(ΔWᵀSΔWA) from the capability factors"
            + (f" · capabilities: lm-eval, limit {s['evaluation']['limit']}" if caps else "")
            + f" · peak memory: {next((r['memory']['measure'] for r in edited if r.get('memory')), '–')}"
            + f" · Pareto ★: on the front of edit success ({pareto['success']}) vs capability retention "
            f"({pareto['retention']}) among the edited rows"
            + (" · Pareto (KL) ★: the same against -KL drift" if caps else "") + "\n")
    changes = capability_changes(payload)
    if changes:
        n_items = {c: len(((res["base"].get("capability_details") or {}).get(c) or {}).get("items") or [])
                   for c in caps}
        note += ("\nCapability change against the base on the same items (paired mean difference ± standard "
                 "error, points; " + ", ".join(f"{c}: {n_items[c]} items" for c in caps if n_items[c]) + "): "
                 + "; ".join(f"{m}: " + ", ".join(f"{c} {d:+.1f} ± {e:.1f}" for c, (d, e) in ch.items())
                             for m, ch in changes.items()) + "\n")
    seq = [(m, res[m]) for m in rows if "rounds" in res[m]]
    if seq:
        note += ("\nSequential rows (the method in rounds of consecutive edits, each round from the previous "
                 "round's weights; the final model evaluated on all edits): "
                 + "; ".join(f"{m}: {r['rounds']} rounds of {r['seq_chunk']}, "
                             f"{sum(r['round_seconds']) / len(r['round_seconds']):.1f}s per round" for m, r in seq)
                 + "\n")
    pred_notes = [(m, line) for m in rows for line in prediction_notes(res[m]["summary"])]
    if pred_notes:
        note += "\nDrift prediction notes (a steep layer dominates it, or attention mixes what it models): " + "; ".join(
            f"{m}: {line}" for m, line in pred_notes) + "\n"
    return "\n".join(lines) + "\n" + note


def plot_compare(payload: dict, path: str | Path) -> None:
    """Edit success (WILD QA rel) against capability retention (mean of capability score / base score;
    without capability tasks: KL drift, log scale, lower is better), one labelled point per method; the
    Pareto front (:func:`pareto_points`) ringed and joined by a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    caps = payload["settings"]["evaluation"]["capabilities"]
    pareto = pareto_points(payload)

    def xy(m):
        """Plot position ``(x, y)`` of row ``m``: retention (NaN if unset; without capability tasks the KL drift,
        floored at 1e-6) and success (0 if unset)."""
        y, ret = pareto["points"][m]
        x = (float("nan") if ret is None else ret) if caps else max(-ret, 1e-6)
        return x, y or 0.0

    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    for i, m in enumerate(pareto["points"]):
        x, y = xy(m)
        ax.scatter([x], [y], color=f"C{i % 10}", s=40)
        ax.annotate(m, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=9)
    front = sorted((xy(m) for m in pareto["front"]), key=lambda p: p[1])
    if front:
        ax.plot([p[0] for p in front], [p[1] for p in front], "--", color="0.5", lw=1, zorder=0)
        ax.scatter([p[0] for p in front], [p[1] for p in front], s=140, facecolors="none", edgecolors="k",
                   linewidths=1, label="Pareto front")
        ax.legend(fontsize=8, loc="lower left")
    if caps:
        ax.set_xlabel("capability retention (mean score / base score)")
    else:
        ax.set_xscale("log")
        ax.invert_xaxis()
        ax.set_xlabel("KL drift on held-out text (nats/token, log; right = less drift)")
    ax.set_ylabel("edit success (WILD QA rel)")
    ax.set_ylim(-0.03, 1.03)
    ax.grid(alpha=0.3)
    ax.set_title(f"{payload['settings']['model']}: {payload['settings']['n_edits']} edits", fontsize=9)
    fig.tight_layout()
    atomic_write_figure(path, fig, dpi=120)


def write_outputs(out: Path, payload: dict) -> None:
    """Rewrite compare.json (atomic; its ``pareto`` section recomputed, :func:`pareto_points`), compare.md and
    compare.png (derived; a plot failure is not fatal)."""
    payload["pareto"] = pareto_points(payload)
    atomic_write_json(out / JSON_FILE, payload)
    atomic_write_bytes(out / MD_FILE, compare_table(payload).encode())
    with contextlib.suppress(ImportError):
        plot_compare(payload, out / PNG_FILE)
