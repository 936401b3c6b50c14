"""``crispedit compare``: every method on the same edits from the same base, measured the same way.

For each method: restore the base (checked by weight fingerprint), edit with that method's config
(shared flags + its own defaults), evaluate with :func:`crispedit.evaluation.evaluate_edit` (WILD
qa / none / chat with the rule judge, teacher-forced rel / gen, KL drift on held-out text, optional
lm-eval capability tasks), and record edit time and peak memory. The unedited base model is
evaluated once as the first row. After every method ``DIR/compare.json`` (atomic), ``DIR/compare.md``
(shaped like the paper's Table 1) and ``DIR/compare.png`` (edit success vs KL drift with the KL Pareto
front; capability changes against the base with their paired standard errors; with ``-seq`` rows also
``DIR/retention.png``, :mod:`crispedit.experiments.retention`) are rewritten, so a killed
compare resumes: methods already in ``compare.json`` are not run again (their settings must match; other
settings need another ``--out``), and a batch row killed while training goes on from its last finished epoch
(``DIR/checkpoints/<method>.safetensors``, :mod:`crispedit.editing.checkpoint`; removed once its row is
written); a ``-seq`` row from its last finished round and, within the round in progress, its last epoch (the
same file, :func:`~crispedit.sessions.sequential.save_sequence_checkpoint`, and ``<method>.round.safetensors``). The command line is :mod:`crispedit.cli.compare` (it checks the arguments without importing this
module's torch).

Sequential rows: ``<method>-seq`` (e.g. ``crispedit-seq``, the paper's CrispEdit-Seq) runs ``<method>`` in
``ceil(n / chunk)`` rounds of ``chunk`` consecutive edits through the session machinery
(:func:`crispedit.sessions.sequential.run_sequence`, i.e. :func:`~crispedit.sessions.sequential.run_round`
with a :class:`~crispedit.editing.SeqConfig`), and the final model is evaluated on all edits exactly like a
batch row. Its row records ``rounds``, ``seq_chunk`` and ``round_seconds``; its stored ``config`` is the
``SeqConfig`` and, with ``seq_chunk``, what a resumed compare checks.

Pareto fronts (:func:`pareto_front`, :func:`pareto_points`): edit success is the WILD qa reliability (the
paper's wrapper, never trained). The primary front is against minus the KL drift on held-out text
(``pareto.kl_front``, column ``Pareto (KL)``, the front drawn in ``compare.png``): capability scores on a
``--limit`` of items carry a sampling error of several points, the KL drift hardly any. With
``--capabilities`` a second front against capability retention — the mean over the tasks of score / base
score — is kept too (``pareto.front``, column ``Pareto (capabilities)``). An edited row is on a front when
no other candidate is at least as good on both and better on one; the unedited base is the reference, and
a row that breaks the model — held-out perplexity more than :data:`BREAKING_PPL_RATIO` × the base's
(``pareto.breaking``, ✗ in both columns, a red ✕ in the picture) — is no candidate for either front. Under the
table, each task's change against the base on the same items (paired mean difference ± its standard error,
in points) says which capability differences are larger than that error; the picture's second panel draws
them. :func:`render_outputs` re-renders compare.md / compare.png from a stored compare.json.

Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` during the edit (reset before each method);
on CPU the process's peak resident set size during the edit (``VmHWM``, reset before each method
through ``/proc/self/clear_refs``; it includes the model and everything else in the process), with
its increase over the resident size at the start. Where the reset is impossible the increase of
``ru_maxrss`` is reported instead (process-lifetime peak; 0 when an earlier method peaked higher).
"""

from __future__ import annotations

import contextlib
import json
import logging
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch
from tqdm.auto import tqdm

from ..curvature.predicted import prediction_notes
from ..data.edits import EditRequest, requests_digest
from ..editing import EditConfig, SeqConfig, edit, get_editor, restore
from ..editing.api import snapshot
from ..editing.config import default_seq_chunk
from ..editing.contexts import DEFAULT_CONTEXTS
from ..editing.loop import training_brief
from ..editing.registry import seq_row
from ..atomic import atomic_write_bytes, atomic_write_figure, atomic_write_json
from ..checks import check_positive_int
from ..errors import CrispEditError
from ..paths import check_output_dir, read_text_file
from ..versions import check_written_by, stamped
from ..evaluation import EVAL_WRAPPERS, HELD_OUT_WRAPPER, evaluate_edit
from ..evaluation.capabilities import paired_change
from ..evaluation.edit_eval import round_map_probe
from .retention import RETENTION_MAP_PNG, RETENTION_PNG, plot_retention, plot_retention_map, retention_table
from ..layers import model_family
from ..weights import weight_fingerprint
from ..sessions.sequential import run_sequence

_log = logging.getLogger("crispedit.compare")

__all__ = ["run_compare", "compare_table", "plot_compare", "peak_memory", "pareto_front", "pareto_points",
           "capability_changes", "perplexity_ratios", "breaking_rows", "render_outputs",
           "BREAKING_PPL_RATIO", "COMPARE_FORMAT"]

COMPARE_FORMAT = 1
JSON_FILE, MD_FILE, PNG_FILE = "compare.json", "compare.md", "compare.png"
CHECKPOINTS = "checkpoints"  # DIR/checkpoints/<method>.safetensors: a row's training (or rounds), resumed after a kill


def proc_status_kib(key: str) -> int | None:
    """A field of ``/proc/self/status`` in KiB (``"VmRSS"``, ``"VmHWM"``), or ``None`` where there is none
    (not Linux)."""
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
    rss0, max0 = proc_status_kib("VmRSS"), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    yield out
    hwm = proc_status_kib("VmHWM")
    if reset and hwm is not None and rss0 is not None:
        out.update(measure="peak RSS (VmHWM, reset before the method)", peak_mib=round(hwm / 1024, 1),
                   increase_mib=round((hwm - rss0) / 1024, 1))
    else:
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - max0
        out.update(measure="ru_maxrss increase (process-lifetime peak, not reset)", peak_mib=None,
                   increase_mib=round(grown / 1024, 1))


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


def _row(method: str, ev: dict, **extra) -> dict:
    """A compare row from :func:`~crispedit.evaluation.evaluate_edit`'s result: its summary, WILD, capabilities
    and, in edit order, every edit's teacher-forced ``tf.rel`` (0/1) and ``tf.gen`` (fraction of its rephrasings,
    ``None`` without any), so the retention of any subset — a sequential run's first round — reads off a row."""
    caps = {k: v["score"] for k, v in ev.get("capabilities", {}).items()}
    per_edit = ev.get("per_edit") or []
    tf = {"rel": [int(e["rel"]) for e in per_edit], "gen": [e["gen"] for e in per_edit]} if per_edit else {}
    return {"method": method, "summary": ev["summary"], "wild": ev.get("wild", {}), "capabilities": caps,
            "capability_details": ev.get("capabilities", {}), **({"tf": tf} if tf else {}),
            **({"assistant": ev["assistant"]} if ev.get("assistant") else {}), **extra}


def _retention_brief(r: dict | None) -> str:
    """`` round-1 edits: tf_rel=… qa=… chat=…`` for a round's ``after_round`` record (:func:`~crispedit.evaluation.edit_eval.round_map_probe`), or
    ``""`` without one."""
    if not r:
        return ""
    wild = " ".join(f"{c}={v}" for c, v in (r.get("wild") or {}).items() if v is not None)
    return f"; round-1 edits: tf_rel={r.get('tf_rel')} {wild}".rstrip()


def _round_line(method: str):
    """A :func:`run_sequence` ``on_round`` callback printing one line per finished round."""
    def report(rec: dict, n_rounds: int) -> None:
        """Print ``method``'s line for the round record ``rec``: edits, seconds, epochs and last epoch loss
        (a single-pass editor: its target NLL before -> after)."""
        tqdm.write(f"  {method} round {rec['round']}/{n_rounds}: {rec['n_edits']} edits, {rec['edit_seconds']:.1f}s, "
                   f"{training_brief(rec.get('train') or {})}" + _retention_brief(rec.get("after_round")))
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
    checking that this crispedit version wrote it (:func:`~crispedit.versions.check_written_by`), under the same
    settings, and that every row asked for again ran with the same configuration (the same files, the same round
    size); one-line errors otherwise. Nothing when there is none."""
    if not path.is_file():
        return
    try:
        old = json.loads(read_text_file(path, "compare file"))
    except json.JSONDecodeError:
        raise CrispEditError(f"{path} is corrupt; remove it or use another --out") from None
    if not isinstance(old, dict) or not isinstance(old.get("settings", {}), dict) \
            or not isinstance(old.get("results", {}), dict) or not isinstance(old.get("methods", []), list):
        raise CrispEditError(f"{path} is not a crispedit compare file; remove it or use another --out")
    check_written_by(old, path, "rerun it with another --out", format=COMPARE_FORMAT)
    settings, was = payload["settings"], old.get("settings", {})
    diff = [k for k in settings if was.get(k) != settings[k]]
    if diff:
        raise CrispEditError(f"{path} was written with other settings ({', '.join(diff)}); "
                             "use another --out to compare under new settings")
    payload["results"] = old.get("results", {})
    for m in methods:
        row, seq = payload["results"].get(m, {}), seq_row(m)[1]
        stored = row.get("config")
        if stored is None:  # not run yet (or the base row)
            continue
        stored_id = SeqConfig.from_dict(stored).identity() if seq else stored
        same = (_run_identity(stored_id, row.get("inputs"))
                == _run_identity(configs[m].identity() if seq else configs[m].to_json(), inputs[m]))
        if not same or (seq and row.get("seq_chunk") != chunk):
            other_chunk = seq and row.get("seq_chunk") != chunk
            was = row.get("inputs") if isinstance(row.get("inputs"), dict) else {}
            other_file = [o for o in inputs[m] if o in was and was[o] != inputs[m][o]]
            w = (seq and configs[m].uses_weighting and isinstance(stored, dict)
                 and stored.get("weighting") != configs[m].weighting and stored.get("weighting"))
            g_now = configs[m].identity().get("edit_gamma") if seq else None  # None where the rounds merge no factors
            g = not w and g_now is not None and stored_id.get("edit_gamma")
            g = g if g != g_now else None
            what = (f" (rounds of {row.get('seq_chunk')} edits, now {chunk})" if other_chunk else
                    f" (factor weighting {w}, now {configs[m].weighting}: --seq-weighting {w} resumes it)"
                    if w else
                    f" (edit-factor gamma {g}, now {g_now}: --seq-edit-gamma {g} resumes it)" if g else
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
    limit: int | dict | None
    max_gen_toks: int | None
    bench_dir: str | None
    progress: bool | None

    def evaluate(self, base_weights: dict, **kw) -> dict:
        """:func:`~crispedit.evaluation.evaluate_edit` of the model as it is now against ``base_weights``."""
        return evaluate_edit(self.model, self.tokenizer, self.requests, base_weights, kl_text=self.kl_text,
                             wild=tuple(EVAL_WRAPPERS), capabilities=self.capabilities, limit=self.limit,
                             max_gen_toks=self.max_gen_toks, bench_dir=self.bench_dir, assistant=True, progress=self.inner, **kw)

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
    _log.info("compare: %s: editing %d edits%s", method, len(b.requests), f" in rounds of {b.chunk}" if seq else "")
    try:
        with peak_memory(next(model.parameters()).device) as mem:
            if seq:
                res = run_sequence(model, b.tokenizer, b.requests, cfg, b.chunk, progress=b.inner, predict_drift=True,
                                   on_round=None if b.progress is False else _round_line(method),
                                   after_round=round_map_probe(b.tokenizer, b.requests, b.chunk),
                                   checkpoint=b.out / CHECKPOINTS / f"{method}.safetensors")
            else:
                res = edit(model, b.tokenizer, b.requests, cfg, progress=b.inner, predict_drift=True,
                           checkpoint=b.out / CHECKPOINTS / f"{method}.safetensors")
    except BaseException:
        restore(model, before)  # an interrupted edit leaves the base behind
        raise
    del before
    wall = time.perf_counter() - t0
    _log.info("compare: %s: edited in %.0f s; evaluating", method, res.edit_seconds)
    try:
        ev = b.evaluate(res.original_weights, max_len=ecfg.max_len)
    finally:
        restore(model, res.original_weights)
    b.check_base(f"restoring the base after {method} failed (fingerprint differs)")
    from ..pipeline import drift_summary

    ev["summary"].update(drift_summary(res))
    extra = (dict(rounds=len(res.rounds), seq_chunk=res.chunk, round_seconds=res.round_seconds,
                  round_records=res.rounds, retention=[rec.get("after_round") for rec in res.rounds])
             if seq else dict(training=res.history.to_json()))
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
                edits_info: dict | None = None, capabilities: Sequence[str] = (), limit: int | dict | None = None,
                max_gen_toks: int | None = None, bench_dir: str | None = None, kl_text: str | None = None, seq_chunk: int | None = None,
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
                               "limit": limit, "max_gen_toks": max_gen_toks,
                               "kl_text": kl_text or "bundled:wikitext_heldout.txt"}}
    payload = stamped({"format": COMPARE_FORMAT, "settings": settings, "methods": list(methods), "results": {}})
    _resume_payload(out / JSON_FILE, payload, methods, configs, inputs, chunk)
    bench = _Bench(model, tokenizer, requests, out, fp, chunk, kl_text, capabilities, limit, max_gen_toks, bench_dir,
                   progress)
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


def _limit_text(limit) -> str:
    """A stored capability item limit as words: ``"limit 250"``, ``"all items"`` or ``"ifeval 48, mmlu all"``."""
    if isinstance(limit, dict):
        return ", ".join(f"{t} {'all' if n is None else n}" for t, n in limit.items()) or "all items"
    return "all items" if limit is None else f"limit {limit}"


def _pct(v) -> str:
    return "–" if v is None else f"{100 * v:.1f}"


def _duration(s: float | None) -> str:
    if s is None:
        return ""
    m, sec = divmod(int(round(s)), 60)
    return f"{m}m {sec:02d}s" if m else f"{s:.1f}s"


BREAKING_PPL_RATIO = 2.0  # a row whose held-out perplexity is more than this many times the base's breaks the model
_TASK_LABELS = {"arc_challenge": "ARC-C", "truthfulqa_mc2": "TruthfulQA-MC2", "mmlu": "MMLU", "gsm8k_cot": "GSM8K",
                "ifeval": "IFEval"}


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


def perplexity_ratios(payload: dict) -> dict[str, float]:
    """``{row: ratio}`` for each edited row: its perplexity on the held-out drift text divided by the unedited
    base's on the same text (dimensionless; 1.0 = unchanged). The base perplexity is the one measured with the
    row (``summary.ppl_base``), else the base row's ``summary.ppl``; rows without both numbers are left out."""
    res = payload["results"]
    base_row = ((res.get("base") or {}).get("summary") or {}).get("ppl")
    out = {}
    for m in payload["methods"]:
        s = (res.get(m) or {}).get("summary") or {}
        ppl, base = s.get("ppl"), s.get("ppl_base") or base_row
        if m != "base" and ppl is not None and base:
            out[m] = ppl / base
    return out


def breaking_rows(payload: dict) -> dict[str, float]:
    """``{row: perplexity ratio}`` for the edited rows that break the model: held-out perplexity more than
    :data:`BREAKING_PPL_RATIO` times the base's (:func:`perplexity_ratios`). They are not candidates for
    either Pareto front (:func:`pareto_points`)."""
    return {m: r for m, r in perplexity_ratios(payload).items() if r > BREAKING_PPL_RATIO}


def pareto_points(payload: dict) -> dict:
    """The Pareto picture of a compare payload, over the edited rows (not the unedited base)::

        {"success": label, "kl": label, "kl_front": [rows], "retention": label, "front": [rows],
         "points": {row: [success, retention]}, "breaking": {row: perplexity ratio}, "breaking_rule": text}

    Success = WILD qa rel (fraction). ``kl_front``: the front of success against minus the KL drift on
    held-out text (nats/token; 0 = unchanged), the primary one. ``front``: the front against retention = the
    mean over capability tasks of score / base score when capability tasks ran (1.0 = unchanged), else minus
    the KL drift (then the same as ``kl_front``). ``breaking``: the rows whose held-out perplexity rose more
    than :data:`BREAKING_PPL_RATIO` × the base's (:func:`breaking_rows`); they stay in ``points`` but are
    excluded from both fronts, so a model that no longer works can neither sit on a front nor push a working
    row off it. :func:`pareto_front` picks each front."""
    res = payload["results"]
    caps = payload["settings"]["evaluation"]["capabilities"]
    rows = [m for m in payload["methods"] if m in res and m != "base"]
    breaking = breaking_rows(payload)
    candidates = [m for m in rows if m not in breaking]
    success = {m: (res[m]["wild"].get(HELD_OUT_WRAPPER) or {}).get("rel") for m in rows}
    points = {m: [success[m], _retention(payload, res[m])] for m in rows}
    kl = {m: (success[m], -res[m]["summary"]["kl_drift"]) for m in candidates}
    return {"success": f"WILD {HELD_OUT_WRAPPER} rel",
            "kl": "KL drift on held-out text (nats/token, lower is better)",
            "kl_front": pareto_front(kl),
            "retention": ("mean capability score / base score over " + ", ".join(caps)) if caps
            else "-KL drift on held-out text (nats/token)",
            "front": pareto_front({m: tuple(points[m]) for m in candidates}),
            "points": points,
            "breaking": {m: round(r, 4) for m, r in breaking.items()},
            "breaking_rule": f"held-out perplexity more than {BREAKING_PPL_RATIO:g}x the base's: breaks the model, "
                             "not a candidate for either front"}


def capability_changes(payload: dict) -> dict:
    """``{row: {task: [change, stderr]}}``: each edited row's change of each capability score against the
    unedited base on the same items (:func:`~crispedit.evaluation.capabilities.paired_change`), in
    percentage points; rows or tasks without per-item scores are left out."""
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


def _ppl_cell(r: dict, ratio: float | None, breaks: bool) -> str:
    ppl = r["summary"].get("ppl")
    if ppl is None:
        return "–"
    text = f"{ppl:.1f}" if ppl < 1e4 else f"{ppl:.2e}"
    if ratio is None:
        return text
    return f"{text} ({_ratio(ratio)})" + (" ✗" if breaks else "")


def _ratio(r: float) -> str:
    return f"×{r:.2f}" if r < 10 else f"×{r:.3g}"


def _assistant(r: dict, part: str, key: str):
    """One figure of a row's ``assistant`` section (:mod:`~crispedit.evaluation.assistant`), or None."""
    return ((r.get("assistant") or {}).get(part) or {}).get(key)


def _table_columns(payload: dict) -> list[tuple]:
    """The table's value columns before the drift ones, as ``(header, getter, higher_is_better)``: WILD rel and
    gen per context (the held-out wrapper's name upper-cased), teacher-forced rel and gen, one column per
    capability task, then the chat measures (``higher_is_better`` None: never bold): the style drift's answer
    length over the base's (a ratio) and the share of long answers turned bare, and the subject bleed (the share
    of other questions about an edited subject answered with its new target). Each getter maps a result row to
    its stored score (a fraction in [0, 1], shown in percent; the ratio as ×) or None where the row has none."""
    caps = payload["settings"]["evaluation"]["capabilities"]
    wrappers = payload["settings"]["evaluation"].get("wild") or list(EVAL_WRAPPERS)
    cols = [(f"{w.upper() if w == HELD_OUT_WRAPPER else w} {k}",
             (lambda w, k: lambda r: (r["wild"].get(w) or {}).get(k))(w, k), True) for w in wrappers for k in ("rel", "gen")]
    cols += [("TF rel", lambda r: r["summary"].get("rel"), True),
            ("TF gen", lambda r: r["summary"].get("gen"), True)]
    cols += [(c, (lambda c: lambda r: r["capabilities"].get(c))(c), True) for c in caps]
    cols += [("chat len", lambda r: _assistant(r, "style", "length_ratio"), None),
             ("chat bare", lambda r: _assistant(r, "style", "bare_share"), None),
             ("bleed", lambda r: _assistant(r, "bleed", "target"), None)]
    return cols


def _pareto_mark(m: str, front: list[str], breaking: dict) -> str:
    """The Pareto cell of row ``m`` for ``front``: – for the base, ✗ for a breaking row, ★ on the front."""
    return "–" if m == "base" else "✗" if m in breaking else "★" if m in front else ""


def _table_row(m: str, r: dict, cols: list[tuple], edited: list[dict], ratio: float | None, pareto: dict,
               caps: list[str]) -> str:
    """The markdown table line of row ``m`` (result ``r``): its name, each of ``cols`` in percent (bold, for an
    edited row, where within 5 % (relative) of the best of the ``edited`` rows), KL drift and its prediction
    (nats/token), perplexity with its ``ratio`` to the base's, edit and curvature time, peak memory (MiB, with
    its rise) and the Pareto marks (the capability one only with ``caps``)."""
    cells = [m if m != "base" else "base (unedited)"]
    for head, get, higher in cols:
        v = get(r)
        if higher is None:
            cells.append("–" if v is None else f"×{v:.2f}" if head == "chat len" else _pct(v))
            continue
        best = max((x for x in (get(e) for e in edited) if x is not None), default=None)
        text = _pct(v)
        if m != "base" and v is not None and best is not None and best > 0 and v >= 0.95 * best:
            text = f"**{text}**"
        cells.append(text)
    mem = r.get("memory") or {}
    peak = "" if not mem else (f"{mem['peak_mib']:.0f} (+{mem['increase_mib']:.0f})" if mem.get("peak_mib")
                               else f"+{mem['increase_mib']:.0f}")
    pred = r["summary"].get("kl_predicted")
    cells += [f"{r['summary']['kl_drift']:.5f}", "–" if pred is None else f"{pred:.5f}",
              _ppl_cell(r, ratio, m in pareto["breaking"]), _duration(r.get("edit_seconds")),
              _duration(r.get("cache_seconds")) if r.get("cache_seconds") else "", peak,
              _pareto_mark(m, pareto["kl_front"], pareto["breaking"])]
    if caps:
        cells.append(_pareto_mark(m, pareto["front"], pareto["breaking"]))
    return "| " + " | ".join(cells) + " |"


def _fronts_line(pareto: dict, caps: list[str]) -> str:
    """The paragraph under the table naming the rows on the KL front, on the capability front (only with
    ``caps``) and the breaking rows with their perplexity ratios to the base's."""
    breaking = pareto["breaking"]
    return ("\nPareto front against KL drift (Pareto (KL) ★): " + (", ".join(pareto["kl_front"]) or "none")
            + (". Pareto front against capability retention (Pareto (capabilities) ★): "
               + (", ".join(pareto["front"]) or "none") if caps else "")
            + ". Breaking the model (✗: held-out perplexity more than "
            f"{BREAKING_PPL_RATIO:g}× the base's; on neither front): "
            + (", ".join(f"{m} ({_ratio(v)})" for m, v in breaking.items()) or "none") + ".\n")


def _settings_note(payload: dict, edited: list[dict], pareto: dict) -> str:
    """The note under the fronts: model, number of edits and their sources, what each column measures (and
    in which unit), the capability tasks' item limit, how peak memory was measured (from the first of the
    ``edited`` rows that recorded it) and what each Pareto column means."""
    s = payload["settings"]
    caps = s["evaluation"]["capabilities"]
    return (f"\n{s['model']} · {s['n_edits']} edits {json.dumps(s['edits'])} · WILD rule judge (qa = the paper's "
            "wrapper, never trained) · TF = teacher-forced · KL drift = mean per-token KL(base‖edited) on held-out "
            "text (nats) · KL pred = the K-FAC prediction ½·Σ tr(ΔWᵀSΔWA) from the capability factors"
            " · ppl = perplexity on the same held-out text (×base: over the unedited model's)"
            + (f" · capabilities: lm-eval, {_limit_text(s['evaluation'].get('limit'))}" if caps else "")
            + f" · peak memory: {next((r['memory']['measure'] for r in edited if r.get('memory')), '–')}"
            + f" · Pareto (KL) ★: on the front of edit success ({pareto['success']}) vs KL drift on held-out text "
            "among the edited rows that do not break the model"
            + (f" · Pareto (capabilities) ★: the same against capability retention ({pareto['retention']})"
               if caps else "") + "\n")


def _crosstalk_note(res: dict, rows: list[str]) -> str:
    """The note on the ``rows`` whose WILD wrappers carry ``cross`` (:func:`~crispedit.evaluation.wild.crosstalk`):
    per row, the percent of edits answered with another edit's target, wrapper by wrapper — the base row's is the
    level common answers reach by chance; empty when no row has it."""
    cells = []
    for m in rows:
        wild = res[m].get("wild") or {}
        got = [(c, w["cross"]) for c, w in wild.items() if isinstance(w, dict) and w.get("cross") is not None]
        if got:
            cells.append(f"{m}: " + " / ".join(f"{v * 100:.1f}" for _, v in got)
                         + " (" + " / ".join(c for c, _ in got) + ")")
    if not cells:
        return ""
    return ("\nCrosstalk (WILD reliability answers that miss their own target and give another edit's, percent of "
            "edits; the base row's is chance): " + "; ".join(cells) + "\n")


def _row_notes(payload: dict, rows: list[str]) -> str:
    """The notes on single ``rows`` after the settings note, each a paragraph present only where it applies:
    the paired capability change against the base (points ± standard error, with the items per task;
    :func:`capability_changes`), the crosstalk of each row's WILD wrappers (:func:`_crosstalk_note`), the ``-seq``
    rows' rounds, chunk size and mean seconds per round, and the drift prediction's notes (:func:`~crispedit.curvature.predicted.prediction_notes`). Empty when none apply."""
    res = payload["results"]
    caps = payload["settings"]["evaluation"]["capabilities"]
    note = ""
    changes = capability_changes(payload)
    if changes:
        n_items = {c: len(((res["base"].get("capability_details") or {}).get(c) or {}).get("items") or [])
                   for c in caps}
        note += ("\nCapability change against the base on the same items (paired mean difference ± standard "
                 "error, points; " + ", ".join(f"{c}: {n_items[c]} items" for c in caps if n_items[c]) + "): "
                 + "; ".join(f"{m}: " + ", ".join(f"{c} {d:+.1f} ± {e:.1f}" for c, (d, e) in ch.items())
                             for m, ch in changes.items()) + "\n")
    note += _crosstalk_note(res, rows)
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
    return note


def compare_table(payload: dict) -> str:
    """The markdown table (the paper's Table 1 shape): WILD rel / gen per context, teacher-forced
    rel / gen, capability scores (all in percent), KL drift and its K-FAC prediction (nats/token), held-out
    perplexity with its ratio to the base's (✗: more than :data:`BREAKING_PPL_RATIO` ×, the row breaks the
    model), edit time (+ curvature time), peak memory (MiB), then ``Pareto (KL)`` (★ for the rows on the front
    of edit success against KL drift, :func:`pareto_points` ``kl_front``) and, with capability tasks,
    ``Pareto (capabilities)`` (the front against capability retention); a breaking row shows ✗ in both, as
    it is no candidate. Per column the best edited method and those within 5 % (relative) of it are in bold.
    A line under the table names the rows on each front, the KL front first, and the breaking rows; notes
    give each row's paired capability change against the base (:func:`capability_changes`, where per-item
    scores were kept), the ``-seq`` rows' rounds, chunk size and mean time per round, and the drift
    prediction's notes per row (:func:`~crispedit.curvature.predicted.prediction_notes`: steep layers,
    attention q/k/v layers), and the ``-seq`` rows' round-1 retention after every round and every round's edits
    on the final model (:func:`~crispedit.experiments.retention.retention_table`)."""
    res = payload["results"]
    caps = payload["settings"]["evaluation"]["capabilities"]
    rows = [m for m in ["base"] + list(payload["methods"]) if m in res]
    cols = _table_columns(payload)
    edited = [res[m] for m in rows if m != "base"]
    head = ["method"] + [c[0] for c in cols] + ["KL drift", "KL pred", "ppl (×base)", "edit time", "curvature",
                                                "peak mem MiB (+rise)", "Pareto (KL)"] \
        + (["Pareto (capabilities)"] if caps else [])
    pareto = pareto_points(payload)
    ratios = perplexity_ratios(payload)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += [_table_row(m, res[m], cols, edited, ratios.get(m), pareto, caps) for m in rows]
    return ("\n".join(lines) + "\n" + _fronts_line(pareto, caps) + _settings_note(payload, edited, pareto)
            + _row_notes(payload, rows) + retention_table(payload))


def _place_labels(ax, anchors: list[tuple[float, float]], names: list[str], fontsize: int = 8,
                  avoid: list | None = None) -> None:
    """Annotate each anchor (data coordinates) with its name where the text overlaps no other label, no
    marker and no box of ``avoid`` (display-coordinate bboxes, e.g. the legend's), trying offsets near the
    point first, then farther ones with a leader line; where none fits, the least-overlapping offset. Call
    once the axes' limits and layout are final."""
    renderer = ax.figure.canvas.get_renderer()
    box = ax.get_window_extent(renderer)
    pts = [ax.transData.transform(a) for a in anchors]
    near = [(6, 3, "left", "bottom"), (6, -3, "left", "top"), (-6, 3, "right", "bottom"), (-6, -3, "right", "top"),
            (0, 8, "center", "bottom"), (0, -8, "center", "top")]
    far = [(dx * k, dy * k, ha, va) for k in (2.5, 4, 6) for dx, dy, ha, va in
           [(6, 6, "left", "bottom"), (6, -6, "left", "top"), (-6, 6, "right", "bottom"), (-6, -6, "right", "top"),
            (0, 8, "center", "bottom"), (0, -8, "center", "top"), (8, 0, "left", "center"), (-8, 0, "right", "center")]]
    placed = list(avoid or [])

    def overlap(b, own):
        """Overlap area (pixels²) of bbox ``b`` with the placed labels and the other markers, plus the part
        outside the axes."""
        area = 0.0
        for o in placed:
            area += max(0, min(b.x1, o.x1) - max(b.x0, o.x0)) * max(0, min(b.y1, o.y1) - max(b.y0, o.y0))
        for i, (px, py) in enumerate(pts):
            if i != own:
                area += max(0, min(b.x1, px + 5) - max(b.x0, px - 5)) * max(0, min(b.y1, py + 5) - max(b.y0, py - 5))
        inside = max(0, min(b.x1, box.x1) - max(b.x0, box.x0)) * max(0, min(b.y1, box.y1) - max(b.y0, box.y0))
        return area + (b.width * b.height - inside) * 4

    for i, (anchor, name) in enumerate(zip(anchors, names)):
        ann = ax.annotate(name, anchor, textcoords="offset points", xytext=(0, 0), fontsize=fontsize)
        best = None
        for dx, dy, ha, va in near + far:
            ann.set_position((dx, dy))
            ann.set_ha(ha)
            ann.set_va(va)
            b = ann.get_window_extent(renderer)
            cost = overlap(b, i)
            if best is None or cost < best[0]:
                best = (cost, (dx, dy, ha, va), b)
            if cost == 0:
                break
        dx, dy, ha, va = best[1]
        ann.set_position((dx, dy))
        ann.set_ha(ha)
        ann.set_va(va)
        if abs(dx) > 8 or abs(dy) > 8:
            ax.annotate("", anchor, xytext=(dx, dy), textcoords="offset points",
                        arrowprops=dict(arrowstyle="-", color="0.6", lw=0.6, shrinkA=0, shrinkB=3))
        placed.append(best[2])


def _plot_success_panel(ax, payload: dict, pareto: dict, rows: list[str], xy: dict):
    """Draw the left panel of the compare picture on ``ax``: edit success (fraction) against KL drift
    (nats/token, log x axis) at ``xy[m]`` for each of ``rows``, rows that do not break the model as dots and
    breaking rows as red ✕, the KL Pareto front ringed and joined by a dashed line, with axis labels, limits,
    grid, legend and title (no point labels yet). Returns the legend, whose box the labels must avoid."""
    from matplotlib.lines import Line2D

    breaking = pareto["breaking"]
    s = payload["settings"]
    ok = [m for m in rows if m not in breaking]
    bad = [m for m in rows if m in breaking]
    handles = []
    if ok:
        ax.scatter([xy[m][0] for m in ok], [xy[m][1] for m in ok], color="C0", s=36, zorder=3)
        handles.append(Line2D([], [], ls="", marker="o", color="C0", label="edited row"))
    if bad:
        ax.scatter([xy[m][0] for m in bad], [xy[m][1] for m in bad], color="C3", marker="X", s=70, zorder=3)
        handles.append(Line2D([], [], ls="", marker="X", color="C3", markersize=8,
                              label=f"breaks the model (perplexity > {BREAKING_PPL_RATIO:g}× base)"))
    front = sorted((xy[m] for m in pareto["kl_front"] if m in xy), key=lambda p: p[0])
    if front:
        ax.plot([p[0] for p in front], [p[1] for p in front], "--", color="0.4", lw=1, zorder=2)
        ax.scatter([p[0] for p in front], [p[1] for p in front], s=170, facecolors="none", edgecolors="k",
                   linewidths=1.1, zorder=4)
        handles.append(Line2D([], [], ls="--", marker="o", color="0.4", markerfacecolor="none", markeredgecolor="k",
                              markersize=11, label="Pareto front (success vs KL drift)"))
    ax.set_xscale("log")
    ax.set_xlabel("KL drift on held-out text (nats/token, log scale; left = less drift)")
    ax.set_ylabel("edit success (WILD QA rel)")
    ax.set_ylim(-0.04, 1.06)
    if rows:
        lo, hi = min(p[0] for p in xy.values()), max(p[0] for p in xy.values())
        ax.set_xlim(lo / 2.5, hi * 2.5)
    ax.grid(alpha=0.3, lw=0.5)
    legend = ax.legend(handles=handles, fontsize=8, loc="best", framealpha=0.9)
    ax.set_title(f"{s['model']}, {s['n_edits']} edits: edit success against drift", fontsize=10)
    return legend


def _plot_capability_panel(axc, payload: dict, pareto: dict) -> None:
    """Draw the right panel of the compare picture on ``axc``: one line per row with capability scores (the
    first at the top), per task a marker offset within the line at the score change against the base
    (percentage points), with ± 1 (thick) and ± 2 (thin) paired standard-error bars where per-item scores
    were kept (:func:`capability_changes`), else the unpaired difference as a hollow marker without a bar;
    a zero line, legend and title, breaking rows' names marked and in red."""
    from matplotlib.lines import Line2D

    res = payload["results"]
    caps = payload["settings"]["evaluation"]["capabilities"]
    breaking = pareto["breaking"]
    changes = capability_changes(payload)
    base_caps = (res.get("base") or {}).get("capabilities") or {}
    crow = [m for m in pareto["points"] if res[m].get("capabilities")]
    n = len(crow)
    markers, chandles, drawn = "osD^v<>", [], set()
    for j, c in enumerate(caps):
        off = (j - (len(caps) - 1) / 2) * 0.28
        color = f"C{j + 1}" if j + 1 != 3 else "C9"
        for i, m in enumerate(crow):
            y = n - 1 - i + off
            if c in changes.get(m, {}):
                d, e = changes[m][c]
                axc.plot([d - 2 * e, d + 2 * e], [y, y], color=color, lw=0.9, zorder=2)
                axc.plot([d - e, d + e], [y, y], color=color, lw=3, alpha=0.8, zorder=2)
                axc.plot([d], [y], marker=markers[j % len(markers)], color=color, ms=5, zorder=3)
                drawn.add("paired")
            elif res[m]["capabilities"].get(c) is not None and base_caps.get(c) is not None:
                d = 100 * (res[m]["capabilities"][c] - base_caps[c])
                axc.plot([d], [y], marker=markers[j % len(markers)], color=color, ms=5, mfc="none", zorder=3)
                drawn.add("unpaired")
        chandles.append(Line2D([], [], color=color, marker=markers[j % len(markers)], ls="",
                               label=_TASK_LABELS.get(c, c)))
    if "paired" in drawn:
        chandles.append(Line2D([], [], color="0.3", lw=3, label="± 1 paired SE"))
        chandles.append(Line2D([], [], color="0.3", lw=0.9, label="± 2 paired SE"))
    if "unpaired" in drawn:
        chandles.append(Line2D([], [], color="0.3", marker="o", mfc="none", ls="",
                               label="no per-item scores for this row or the base:\nscore difference only, no SE"))
    axc.axvline(0, color="0.3", lw=0.8, zorder=1)
    axc.set_yticks(range(n))
    axc.set_yticklabels([m + (" (breaks)" if m in breaking else "") for m in reversed(crow)], fontsize=8)
    for label, m in zip(axc.get_yticklabels(), reversed(crow)):
        if m in breaking:
            label.set_color("C3")
    axc.set_ylim(-0.7, n - 0.3)
    axc.set_xlabel("capability score change against the base (percentage points)")
    axc.grid(alpha=0.3, axis="x", lw=0.5)
    axc.legend(handles=chandles, fontsize=8, loc="best", framealpha=0.9)
    axc.set_title(f"capabilities ({_limit_text(payload['settings']['evaluation'].get('limit'))}): change against the "
                  "base", fontsize=10)


def plot_compare(payload: dict, path: str | Path) -> None:
    """Write the compare picture to ``path`` (PNG). Left panel: edit success (WILD QA rel, fraction) against
    KL drift on held-out text (nats/token, log x axis; left = less drift), one labelled point per edited row;
    the KL Pareto front (:func:`pareto_points` ``kl_front``) ringed and joined by a dashed line; a row that
    breaks the model (held-out perplexity more than :data:`BREAKING_PPL_RATIO` × the base's,
    :func:`breaking_rows`) drawn as a red ✕ with its own legend entry (it is never on the front). A drift of 0 is
    drawn at 1e-6; rows without a QA result are left out. Right panel, when capability tasks ran: each
    task's score change against the base (percentage points) per edited row, with the paired standard error
    (:func:`capability_changes`; thick bar ± 1 SE, thin bar ± 2 SE); a row stored without per-item scores shows
    its unpaired difference as a hollow marker without a bar; breaking rows' names in red."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = payload["results"]
    caps = payload["settings"]["evaluation"]["capabilities"]
    pareto = pareto_points(payload)
    rows = [m for m in pareto["points"] if pareto["points"][m][0] is not None]
    xy = {m: (max(res[m]["summary"]["kl_drift"], 1e-6), pareto["points"][m][0]) for m in rows}

    if caps:
        fig, (ax, axc) = plt.subplots(1, 2, figsize=(13, 5.6), gridspec_kw={"width_ratios": [1.35, 1]})
    else:
        fig, ax = plt.subplots(figsize=(7.4, 5.2))
        axc = None
    legend = _plot_success_panel(ax, payload, pareto, rows, xy)
    if axc is not None:
        _plot_capability_panel(axc, payload, pareto)
    fig.tight_layout()
    fig.canvas.draw()
    _place_labels(ax, [xy[m] for m in rows], rows, avoid=[legend.get_window_extent(fig.canvas.get_renderer())])
    atomic_write_figure(path, fig, dpi=120)


def write_outputs(out: Path, payload: dict) -> None:
    """Rewrite compare.json (atomic; its ``pareto`` section recomputed, :func:`pareto_points`), compare.md
    (:func:`compare_table`), compare.png (:func:`plot_compare`) and, when ``-seq`` rows carry round-1 retention,
    retention.png (:func:`~crispedit.experiments.retention.plot_retention`) and the retention map,
    retention_map.png (:func:`~crispedit.experiments.retention.plot_retention_map`); the pictures are derived,
    so a missing matplotlib is not fatal."""
    payload["pareto"] = pareto_points(payload)
    atomic_write_json(out / JSON_FILE, payload)
    atomic_write_bytes(out / MD_FILE, compare_table(payload).encode())
    with contextlib.suppress(ImportError):
        plot_compare(payload, out / PNG_FILE)
        plot_retention(payload, out / RETENTION_PNG)
        plot_retention_map(payload, out / RETENTION_MAP_PNG)


def render_outputs(out: str | Path) -> dict:
    """Re-render ``DIR/compare.md``, ``DIR/compare.png`` and ``compare.json``'s ``pareto`` section from a stored
    ``DIR/compare.json`` (:func:`write_outputs`) without running or loading anything else; the measured
    results are left as they are. Returns the payload; a missing file, or one another crispedit version wrote or of
    another ``format`` (:func:`~crispedit.versions.check_written_by`), is a :class:`~crispedit.errors.CrispEditError`."""
    out = Path(out)
    path = out / JSON_FILE
    if not path.is_file():
        raise CrispEditError(f"{path} does not exist: nothing to render")
    payload = json.loads(read_text_file(path, what="compare results"))
    check_written_by(payload, path, "rerun the compare", format=COMPARE_FORMAT)
    write_outputs(out, payload)
    return payload
