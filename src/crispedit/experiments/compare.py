"""``crispedit compare``: every method on the same edits from the same base, measured the same way.

For each method: restore the base (checked by weight fingerprint), edit with that method's config
(shared flags + its own defaults), evaluate with :func:`crispedit.evaluation.evaluate_edit` (WILD
qa / none / chat with the rule judge, teacher-forced rel / gen, KL drift on held-out text, optional
lm-eval capability tasks), and record edit time and peak memory. The unedited base model is
evaluated once as the first row. After every method ``DIR/compare.json`` (atomic), ``DIR/compare.md``
(shaped like the paper's Table 1, :mod:`crispedit.experiments.compare_table`) and ``DIR/compare.png`` (edit success
vs KL drift with the KL Pareto front; capability changes against the base with their paired standard errors,
:mod:`crispedit.experiments.compare_plot`; with ``-seq`` rows also ``DIR/retention.png``,
:mod:`crispedit.experiments.retention`) are rewritten (:mod:`crispedit.experiments.compare_outputs`), so a killed
compare resumes: methods already in ``compare.json`` are not run again (their settings must match; other
settings need another ``--out``; :mod:`crispedit.experiments.compare_resume`), and a batch row killed while training
goes on from its last finished epoch
(``DIR/checkpoints/<method>.safetensors``, :mod:`crispedit.editing.checkpoint`; removed once its row is
written); a ``-seq`` row from its last finished round and, within the round in progress, its last epoch (the
same file, :func:`~crispedit.sessions.in_memory.save_sequence_checkpoint`, and ``<method>.round.safetensors``). The
command line is :mod:`crispedit.cli.compare` (it checks the arguments without importing this
module's torch).

Sequential rows: ``<method>-seq`` (e.g. ``crispedit-seq``, the paper's CrispEdit-Seq) runs ``<method>`` in
``ceil(n / chunk)`` rounds of ``chunk`` consecutive edits through the session machinery
(:func:`crispedit.sessions.in_memory.run_sequence`, i.e. :func:`~crispedit.sessions.sequential.run_round`
with a :class:`~crispedit.editing.SeqConfig`), and the final model is evaluated on all edits exactly like a
batch row. Its row records ``rounds``, ``seq_chunk`` and ``round_seconds``; its stored ``config`` is the
``SeqConfig`` and, with ``seq_chunk``, what a resumed compare checks.

Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` during the edit (reset before each method);
on CPU the process's peak resident set size during the edit (``VmHWM``, reset before each method
through ``/proc/self/clear_refs``; it includes the model and everything else in the process), with
its increase over the resident size at the start. Where the reset is impossible the increase of
``ru_maxrss`` is reported instead (process-lifetime peak; 0 when an earlier method peaked higher).
"""

from __future__ import annotations

import contextlib
import logging
import resource
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..checks import check_positive_int
from ..data.edits import EditRequest, requests_digest
from ..editing import EditConfig, SeqConfig, get_editor, restore
from ..editing.api import snapshot
from ..editing.config import default_seq_chunk
from ..editing.contexts import DEFAULT_CONTEXTS
from ..editing.history import training_brief
from ..editing.registry import seq_row
from ..errors import CrispEditError
from ..evaluation import EVAL_WRAPPERS, HELD_OUT_WRAPPER
from ..evaluation.edit_eval import round_map_probe
from ..layers import model_family
from ..paths import check_output_dir
from ..pipeline import EditJob, Measures, drift_summary
from ..sessions.in_memory import run_sequence
from ..versions import environment, stamped
from ..weights import weight_fingerprint
from .compare_outputs import COMPARE_FORMAT, JSON_FILE, write_outputs
from .compare_resume import resume_payload

_log = logging.getLogger("crispedit.compare")

__all__ = ["run_compare", "peak_memory", "proc_status_kib", "CHECKPOINTS"]

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
        out.update(
            measure="torch.cuda.max_memory_allocated",
            peak_mib=round(peak / 2**20, 1),
            increase_mib=round((peak - start) / 2**20, 1),
        )
        return
    reset = False
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        reset = True
    rss0, max0 = proc_status_kib("VmRSS"), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    yield out
    hwm = proc_status_kib("VmHWM")
    if reset and hwm is not None and rss0 is not None:
        out.update(
            measure="peak RSS (VmHWM, reset before the method)",
            peak_mib=round(hwm / 1024, 1),
            increase_mib=round((hwm - rss0) / 1024, 1),
        )
    else:
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - max0
        out.update(
            measure="ru_maxrss increase (process-lifetime peak, not reset)",
            peak_mib=None,
            increase_mib=round(grown / 1024, 1),
        )


def _row(method: str, ev: dict, **extra) -> dict:
    """A compare row from :func:`~crispedit.evaluation.evaluate_edit`'s result: its summary, WILD, capabilities
    and, in edit order, every edit's teacher-forced ``tf.rel`` (0/1) and ``tf.gen`` (fraction of its rephrasings,
    ``None`` without any), so the retention of any subset — a sequential run's first round — reads off a row; and
    where it ran (:func:`~crispedit.versions.environment`, the crispedit source's commit among it: rows of one
    compare may be run by several processes, resumed across machines and commits)."""
    caps = {k: v["score"] for k, v in ev.get("capabilities", {}).items()}
    per_edit = ev.get("per_edit") or []
    tf = {"rel": [int(e["rel"]) for e in per_edit], "gen": [e["gen"] for e in per_edit]} if per_edit else {}
    return {
        "method": method,
        "summary": ev["summary"],
        "wild": ev.get("wild", {}),
        "capabilities": caps,
        "capability_details": ev.get("capabilities", {}),
        **({"tf": tf} if tf else {}),
        **({"assistant": ev["assistant"]} if ev.get("assistant") else {}),
        "environment": environment(),
        **extra,
    }


def _retention_brief(r: dict | None, k: int = 1) -> str:
    """`` round-1 edits: tf_rel=… qa=… chat=…`` for round ``k``'s ``after_round`` record
    (:func:`~crispedit.evaluation.edit_eval.round_map_probe`), then, for every round after the first, the same for
    the round's own edits (``newest``), or ``""`` without a record."""
    if not r:
        return ""

    def brief(who: str, rec: dict) -> str:
        """``; <who> edits: tf_rel=… <wrapper>=…`` for one probe record."""
        wild = " ".join(f"{c}={v}" for c, v in (rec.get("wild") or {}).items() if v is not None)
        return f"; {who} edits: tf_rel={rec.get('tf_rel')} {wild}".rstrip()

    own = r.get("newest") if k > 1 else None
    return brief("round-1", r) + (brief(f"round-{k}", own) if own else "")


def _round_line(method: str):
    """A :func:`run_sequence` ``on_round`` callback printing one line per finished round."""

    def report(rec: dict, n_rounds: int) -> None:
        """Print ``method``'s line for the round record ``rec``: edits, seconds, epochs and last epoch loss
        (a single-pass editor: its target NLL before -> after)."""
        tqdm.write(
            f"  {method} round {rec['round']}/{n_rounds}: {rec['n_edits']} edits, {rec['edit_seconds']:.1f}s, "
            f"{training_brief(rec.get('train') or {})}" + _retention_brief(rec.get("after_round"), rec["round"])
        )

    return report


def _checked_configs(
    model, requests: Sequence[EditRequest], methods: Sequence[str], configs: dict[str, EditConfig | SeqConfig]
) -> tuple[dict, dict[str, dict[str, str]]]:
    """Every row's config checked against its method (an :class:`EditConfig` for a ``-seq`` row wrapped into a
    :class:`SeqConfig`), with what the method needs of the requests and of the model checked before anything runs;
    returns the configs and, per row, option -> SHA-256 of the file it names (MEND's network)."""
    configs, inputs = dict(configs), {}
    for m in methods:
        base_method, seq = seq_row(m)
        cfg = configs[m]
        if seq and isinstance(cfg, EditConfig):
            cfg = configs[m] = SeqConfig(edit=cfg)
        ok = (
            (isinstance(cfg, SeqConfig) and cfg.mode == "sequential" and cfg.edit.method == base_method)
            if seq
            else (isinstance(cfg, EditConfig) and cfg.method == base_method)
        )
        if not ok:
            raise CrispEditError(
                f"the configuration given for {m} is not one of {base_method}" + (" in sequential mode" if seq else "")
            )
        # what each method needs of the requests (the closed forms' subjects) and of the model (MEND's trained
        # network), before anything
        get_editor(base_method).check_requests(requests)
        # a default lr scaled now, so that a resumed compare compares what ran
        ec = (cfg.edit if isinstance(cfg, SeqConfig) else cfg).for_family(model_family(model))
        configs[m] = replace(cfg, edit=ec) if isinstance(cfg, SeqConfig) else ec
        get_editor(base_method).check_ready(model, ec)
        inputs[m] = get_editor(base_method).input_digests(model, ec)
    return configs, inputs


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

    def job(self, config: EditConfig) -> EditJob:
        """The :class:`~crispedit.pipeline.EditJob` of one row: ``config`` on the requests, measured under every
        evaluation wrapper, with the assistant's measures and the capability tasks."""
        measures = Measures(
            kl_text=self.kl_text,
            capabilities=tuple(self.capabilities),
            limit=self.limit,
            max_gen_toks=self.max_gen_toks,
            bench_dir=self.bench_dir,
        )
        return EditJob(self.model, self.tokenizer, self.requests, config, measures, progress=self.inner)

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
    job = b.job(ecfg)
    ckpt = b.out / CHECKPOINTS / f"{method}.safetensors"
    _log.info("compare: %s: editing %d edits%s", method, len(b.requests), f" in rounds of {b.chunk}" if seq else "")
    with peak_memory(next(model.parameters()).device) as mem:
        if seq:
            editor = get_editor(ecfg.method)
            before = snapshot(editor.changes(model, editor.select_layers(model, ecfg), ecfg))
            try:
                res = run_sequence(
                    model,
                    b.tokenizer,
                    b.requests,
                    cfg,
                    b.chunk,
                    progress=b.inner,
                    predict_drift=True,
                    on_round=None if b.progress is False else _round_line(method),
                    after_round=round_map_probe(b.tokenizer, b.requests, b.chunk),
                    checkpoint=ckpt,
                )
            except BaseException:
                restore(model, before)  # an interrupted session leaves the base behind
                raise
            del before
        else:
            res = job.edit(predict_drift=True, checkpoint=ckpt)  # a failed edit leaves the base behind
    wall = time.perf_counter() - t0
    _log.info("compare: %s: edited in %.0f s; evaluating", method, res.edit_seconds)
    try:
        ev = job.evaluate(res.original_weights)
    finally:
        restore(model, res.original_weights)
    b.check_base(f"restoring the base after {method} failed (fingerprint differs)")
    ev["summary"].update(drift_summary(res))
    extra = (
        dict(
            rounds=len(res.rounds),
            seq_chunk=res.chunk,
            round_seconds=res.round_seconds,
            round_records=res.rounds,
            retention=[rec.get("after_round") for rec in res.rounds],
        )
        if seq
        else dict(training=res.history.to_json())
    )
    return _row(
        method,
        ev,
        config=cfg.to_json(),
        **({"inputs": inputs} if inputs else {}),
        layers=res.layers,
        changed=sorted(res.original_weights),
        changed_numel=sum(t.numel() for t in res.original_weights.values()),
        edit_seconds=round(res.edit_seconds, 2),
        cache_seconds=round(res.cache_seconds, 2),
        wall_seconds=round(wall, 2),
        cache_hit=res.cache_info.get("hit"),
        memory=mem,
        **extra,
    )


def _row_line(method: str, r: dict) -> str:
    """The line printed once ``method``'s row ``r`` is written: the held-out wrapper's WILD rel / gen, teacher-forced
    rel, the KL drift measured and predicted, the edit time, a ``-seq`` row's rounds."""
    qa = r["wild"].get(HELD_OUT_WRAPPER) or {}
    return (
        f"{method}: WILD {HELD_OUT_WRAPPER} rel={qa.get('rel')} gen={qa.get('gen')} tf rel={r['summary']['rel']} "
        f"kl_drift={r['summary']['kl_drift']:.5f} kl_predicted={r['summary'].get('kl_predicted')}"
        + (f" edit={r['edit_seconds']:.1f}s" if "edit_seconds" in r else "")
        + (f" ({r['rounds']} rounds of {r['seq_chunk']})" if "rounds" in r else "")
    )


def run_compare(
    model,
    tokenizer,
    requests: Sequence[EditRequest],
    methods: Sequence[str],
    out: str | Path,
    *,
    configs: dict[str, EditConfig | SeqConfig],
    model_spec: str = "<in-memory>",
    edits_info: dict | None = None,
    capabilities: Sequence[str] = (),
    limit: int | dict | None = None,
    max_gen_toks: int | None = None,
    bench_dir: str | None = None,
    kl_text: str | None = None,
    seq_chunk: int | None = None,
    progress: bool | None = None,
) -> dict:
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
    settings = {
        "model": model_spec,
        "fingerprint": fp,
        "edits": edits_info or {},
        "n_edits": len(requests),
        "requests_digest": requests_digest(requests),
        # what --contexts 'default' meant when the rows ran: a row stored as 'default' under another
        # default is another configuration
        "default_contexts": DEFAULT_CONTEXTS,
        "evaluation": {
            "wild": list(EVAL_WRAPPERS),
            "judge": "rule",
            "capabilities": list(capabilities),
            "limit": limit,
            "max_gen_toks": max_gen_toks,
            "kl_text": kl_text or "bundled:wikitext_heldout.txt",
        },
    }
    payload = stamped({"format": COMPARE_FORMAT, "settings": settings, "methods": list(methods), "results": {}})
    resume_payload(out / JSON_FILE, payload, methods, configs, inputs, chunk)
    bench = _Bench(
        model, tokenizer, requests, out, fp, chunk, kl_text, capabilities, limit, max_gen_toks, bench_dir, progress
    )
    todo = ([] if "base" in payload["results"] else ["base"]) + [m for m in methods if m not in payload["results"]]
    bar = tqdm(todo, desc="compare", unit="method", disable=(None if progress is None else not progress))
    for method in bar:
        bar.set_postfix_str(method)
        bench.check_base(f"the model is no longer the base before {method} (fingerprint changed)")
        payload["results"][method] = (
            _row("base", bench.job(EditConfig()).evaluate({}))
            if method == "base"
            else _edited_row(bench, method, configs[method], inputs[method])
        )
        write_outputs(out, payload)
        (out / CHECKPOINTS / f"{method}.safetensors").unlink(missing_ok=True)  # the row holds what it was for
        if progress is not False:
            tqdm.write(_row_line(method, payload["results"][method]))
    bar.close()
    write_outputs(out, payload)
    return payload
