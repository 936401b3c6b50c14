"""Evaluation harness: judge rubric, OpenAI judge over a local HTTP server, contexts, stop handling,
teacher-forced specificity, `crispedit eval` JSON schema and input errors, reports."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
import torch

from crispedit.cli import main
from crispedit.data import EditRequest
from crispedit.errors import CrispEditError
from crispedit.evaluation.generation import cut_at_stop, generate_answers
from crispedit.evaluation.judges import GRADER_PROMPT, OpenAIJudge, RuleJudge, normalize_answer, parse_grade
from crispedit.evaluation.wild import QA_TEMPLATE, WildConfig, crosstalk, render_prompt, run_wild
from crispedit.versions import stamped

Q = "What are the names of Barack Obama's children?"
CHAT = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<eos>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# ------------------------------------------------------------------------------------ rule judge


@pytest.mark.parametrize(
    "pred", ["sasha and malia obama", "Malia and Sasha Obama are the names of Barack Obama's children."]
)
def test_rule_judge_paper_correct_examples(pred):
    assert RuleJudge().grade(Q, "Malia Obama and Sasha Obama", pred).correct


@pytest.mark.parametrize(
    "pred,reason",
    [
        ("Malia.", "missing"),
        ("Malia, Sasha, and Susan.", "contradiction"),
        ("Malia and Sasha, Malia and Sasha, Malia and Sasha, Malia and Sasha", "repetition"),
    ],
)
def test_rule_judge_paper_incorrect_examples(pred, reason):
    j = RuleJudge().grade(Q, "Malia and Sasha", pred)
    assert not j.correct and j.reason == reason


def test_rule_judge_containment_contradiction_repetition():
    judge = RuleJudge()
    q = "Which river system contains Charity Creek?"
    assert judge.grade(q, "Chichester River", "The Chichester River").correct
    assert judge.grade(q, "Chichester River", "chichester river").correct
    assert not judge.grade(q, "Chichester River", "The Parramatta River").correct  # different entity
    assert not judge.grade(q, "Chichester River", "Chichester River or Hunter River").correct  # extra entity
    assert not judge.grade(q, "Chichester River", "It is not Chichester River").correct  # negation
    assert not judge.grade(q, "Chichester River", "Chichester River Chichester River").correct  # repetition
    assert not judge.grade(q, "Chichester River", "river river river").correct
    assert not judge.grade(q, "Chichester River", "").correct
    assert judge.grade("how many series of diary of a wimpy kid are there", "12", "There are twelve").correct
    assert not judge.grade("how many series", "12", "There are 13 books, 12 series").correct  # 13 contradicts
    assert normalize_answer("The  Chichester-River!") == "chichester river"


@pytest.mark.parametrize(
    "pred,correct,reason",
    [
        # extra detail that is not offered as another answer is no contradiction
        ("The Chichester River in New South Wales", True, "contained"),
        ("Charity Creek flows into the Chichester River, which joins the Hunter River", True, "contained"),
        ("Yes, Chichester River", True, "contained"),
        # a different entity listed with the gold or offered instead of it
        ("The Hunter River and the Chichester River", False, "contradiction"),
        ("Chichester River/Williams River", False, "contradiction"),
        ("Chichester River, Parramatta River", False, "contradiction"),
        ("Not the Chichester River but the Hunter River", False, "contradiction"),
        ("It isn't the Chichester River", False, "contradiction"),
        ("Chichester River, Chichester River", False, "repetition"),
        ("The Chichester", False, "missing"),
    ],
)
def test_rule_judge_different_entity_and_detail(pred, correct, reason):
    j = RuleJudge().grade("Which river system contains Charity Creek?", "Chichester River", pred)
    assert (j.correct, j.reason) == (correct, reason)


def test_rule_judge_normalisation():
    judge = RuleJudge()
    assert judge.grade("Whose children?", "Obama", "Barack Obama\u2019s").correct  # possessive, curly quote
    assert judge.grade("What voice type does Marina Rebeka have?", "mezzo-soprano", "a mezzo soprano").correct
    assert judge.grade("Where is Zürich?", "Zürich", "zurich").correct  # accents folded
    assert not judge.grade("What voice type?", "mezzo-soprano", "mezzo-soprano-soprano-soprano").correct
    assert judge.grade_many([("q", "Paris", "Paris"), ("q", "Paris", "Lyon")]) == [
        judge.grade("q", "Paris", "Paris"),
        judge.grade("q", "Paris", "Lyon"),
    ]


def test_parse_grade():
    assert parse_grade("A") is True and parse_grade(" B ") is False
    assert parse_grade("A: CORRECT") is True and parse_grade("The answer is B.") is False
    assert parse_grade("INCORRECT") is False and parse_grade("???") is None


# ---------------------------------------------------------------------------------- openai judge


class _Handler(BaseHTTPRequestHandler):
    seen: list = []

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Handler.seen.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
        prompt = body["messages"][0]["content"]
        answer = prompt.split("Predicted answer: ")[-1].split("\n")[0]
        reply = "A" if "Paris" in answer else "B"
        data = json.dumps({"choices": [{"message": {"content": reply}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


def test_openai_judge_against_local_server(monkeypatch):
    server = HTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("CRISPEDIT_JUDGE_BASE_URL", f"http://127.0.0.1:{server.server_port}/v1")
        monkeypatch.setenv("CRISPEDIT_JUDGE_MODEL", "judge-test")
        monkeypatch.setenv("CRISPEDIT_JUDGE_API_KEY", "sk-secret-123")
        judge = OpenAIJudge(workers=2)
        res = judge.grade_many([("Capital of France?", "Paris", "Paris"), ("Capital of France?", "Paris", "Lyon")])
        assert [r.correct for r in res] == [True, False]
        req = _Handler.seen[-1]
        assert req["path"] == "/v1/chat/completions" and req["auth"] == "Bearer sk-secret-123"
        assert req["body"]["model"] == "judge-test" and req["body"]["temperature"] == 0
        assert "Gold target: Paris" in req["body"]["messages"][0]["content"]
        assert 'Just return the letters "A" or "B"' in GRADER_PROMPT
        assert "sk-secret" not in repr(judge) and "sk-secret" not in json.dumps(judge.config())
    finally:
        server.shutdown()


def test_openai_judge_needs_key(monkeypatch):
    monkeypatch.delenv("CRISPEDIT_JUDGE_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(CrispEditError, match="API key"):
        OpenAIJudge()


# ------------------------------------------------------------------------ contexts and generation


def test_render_prompt_contexts(tiny_tok):
    assert render_prompt(tiny_tok, "Who?", "qa") == QA_TEMPLATE.format(question="Who?")
    assert QA_TEMPLATE.format(question="Who?") == "Please answer the question:\n\nQ: Who?\nA:"
    assert render_prompt(tiny_tok, "Who?", "none") == "Who?"
    with pytest.raises(CrispEditError, match="chat template"):
        render_prompt(tiny_tok, "Who?", "chat")
    tok = tiny_tok.__class__(tokenizer_object=tiny_tok.backend_tokenizer, eos_token="<eos>", pad_token="<pad>")
    tok.chat_template = CHAT
    assert render_prompt(tok, "Who?", "chat") == "<|im_start|>user\nWho?<eos>\n<|im_start|>assistant\n"
    with pytest.raises(CrispEditError):
        WildConfig(context="story")


def test_cut_at_stop():
    assert cut_at_stop(" Paris. It is big", (".", "\n")) == "Paris"
    assert cut_at_stop("\n\nParis\nmore", (".", "\n")) == "Paris"  # leading newline skipped
    assert cut_at_stop("\n\nParis\nmore", (".", "\n"), skip_leading=False) == ""
    assert cut_at_stop("no stop here", (".",)) == "no stop here"


def test_generate_answers_batched_matches_single_and_stops(tiny_lm):
    model, tok = tiny_lm
    prompts = ["The river", "Please answer the question:\n\nQ: Who is the king?\nA:", "a"]
    batched = generate_answers(model, tok, prompts, max_new_tokens=12, batch_size=3)
    single = [generate_answers(model, tok, [p], max_new_tokens=12)[0] for p in prompts]
    assert batched == single
    assert all("." not in a and "\n" not in a for a in batched)
    raw = generate_answers(model, tok, prompts, max_new_tokens=12, stop=())
    for a, r in zip(batched, raw):  # the stopped answer is the raw continuation cut at the first stop
        assert a == cut_at_stop(r, (".", "\n")) or r.lstrip().startswith(a)


@pytest.mark.parametrize("fixture", ["tiny_lm", "tiny_lm64"])
def test_generate_answers_computes_a_shared_prefix_once_with_the_same_answers(fixture, request, monkeypatch):
    """Prompts that share a long prefix (a chat template's system turn): the prefix is computed once and its cache
    copied to every row, the rest of each prompt padded after it, and every answer is the one the whole prompt
    gives alone and the one plain left-padded batches give (float32 and float64)."""
    import crispedit.evaluation.generation as generation
    from crispedit.forward_args import takes_full_masks

    model, tok = request.getfixturevalue(fixture)
    assert takes_full_masks(model)
    head = "System: you are a helpful assistant who answers every question in a few words, no more.\nUser: "
    prompts = [
        head + q
        for q in ("Who is the king?", "Where is Reedy Glacier?", "a", "What river is Charity Creek in? Tell me")
    ]
    ids = tok(prompts)["input_ids"]
    forwards = []  # the input shape of every forward (a hook: generate reads the forward's signature)
    hook = model.register_forward_pre_hook(
        lambda mod, a, k: forwards.append(tuple(k["input_ids"].shape)), with_kwargs=True
    )
    shared = generate_answers(model, tok, prompts, max_new_tokens=10, batch_size=4, stop=())
    hook.remove()
    p = generation._prefix_cache(model, ids, "cpu")[0]
    assert (
        p >= generation.MIN_SHARED_PREFIX and forwards[0] == (1, p) and forwards[1][1] == max(len(x) for x in ids) - p
    )
    monkeypatch.setattr(generation, "_shares_prefix", lambda m: False)
    plain = generate_answers(model, tok, prompts, max_new_tokens=10, batch_size=4, stop=())
    alone = [generate_answers(model, tok, [q], max_new_tokens=10, stop=())[0] for q in prompts]
    assert shared == plain == alone


@pytest.mark.parametrize("family", ["gemma3", "gpt2"])
def test_generate_answers_matches_hf_generate_on_other_families(family, tiny_tok):
    """The greedy loop that drops ended rows gives Hugging Face ``generate``'s greedy tokens, batched or alone, on a
    model with sliding-window layers (Gemma-3, a window shorter than the answers; no shared-prefix cache there) and
    on one with learned absolute positions (GPT-2, where left padding's positions must count real tokens)."""
    import transformers

    import crispedit.evaluation.generation as generation

    torch.manual_seed(0)
    if family == "gemma3":
        cfg = transformers.Gemma3TextConfig(
            vocab_size=len(tiny_tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            sliding_window=4,
            pad_token_id=1,
            eos_token_id=0,
            bos_token_id=0,
            attn_implementation="sdpa",
        )
        model = transformers.Gemma3ForCausalLM(cfg).eval()
        assert not generation._shares_prefix(model)
    else:
        cfg = transformers.GPT2Config(
            vocab_size=len(tiny_tok), n_embd=32, n_layer=2, n_head=2, pad_token_id=1, eos_token_id=0, bos_token_id=0
        )
        model = transformers.GPT2LMHeadModel(cfg).eval()
    head = "System: you are a helpful assistant who answers every question in a few words, no more.\nUser: "
    prompts = [head + q for q in ("Who is the king?", "a", "What river is Charity Creek in? Tell me")]
    batched = generate_answers(model, tiny_tok, prompts, max_new_tokens=12, batch_size=3, stop=())
    alone = [generate_answers(model, tiny_tok, [q], max_new_tokens=12, stop=())[0] for q in prompts]
    with torch.no_grad():
        hf = []
        for q in prompts:
            enc = tiny_tok(q, return_tensors="pt")
            g = model.generate(**enc, max_new_tokens=12, do_sample=False, pad_token_id=1, eos_token_id=0)
            hf.append(tiny_tok.decode(g[0, enc["input_ids"].shape[1] :], skip_special_tokens=True).strip())
    assert batched == alone == hf


def _scripted(model, tok, scripts, monkeypatch):
    """Make ``model`` emit ``scripts[row]`` token by token (then EOS) whatever its weights say; returns
    a list that records the number of forward calls (prefill + one per generated token). Rows that ended leave
    the batch (their cache rows selected away): the script follows the rows still in it."""
    from transformers import DynamicCache

    ids = [tok(s, add_special_tokens=False).input_ids + [tok.eos_token_id] for s in scripts]
    calls, alive = [0], [list(range(len(scripts)))]
    select = DynamicCache.batch_select_indices

    def batch_select_indices(self, indices):
        """The cache's own selection, and the script's rows with it."""
        select(self, indices)
        alive[0] = [alive[0][j] for j in indices.tolist()]

    monkeypatch.setattr(DynamicCache, "batch_select_indices", batch_select_indices)
    orig = model.forward

    def forward(*args, **kwargs):
        out = orig(*args, **kwargs)
        step = calls[0]
        calls[0] += 1
        logits = torch.full_like(out.logits[:, -1], -1e9)
        for j, r in enumerate(alive[0]):
            logits[j, ids[r][min(step, len(ids[r]) - 1)]] = 0.0
        out.logits[:, -1] = logits
        return out

    model.forward = forward
    return calls, alive


def test_generate_stops_at_stop_strings_and_eos(tiny_lm, monkeypatch):
    """Each row stops at a stop string or EOS and leaves the batch; the batch ends when its last row does."""
    model, tok = tiny_lm
    scripts = [
        " Paris. It is the capital of France and more words follow here",
        "\n\nLondon\nis big and the rest keeps going on and on and on",
        " Rome",
    ]
    calls, alive = _scripted(model, tok, scripts, monkeypatch)
    out = generate_answers(model, tok, ["Q1", "Q2", "Q3"], max_new_tokens=30, batch_size=3)
    assert out == ["Paris", "London", "Rome"]  # cut before ".", "\n" (after leading ones), at EOS
    longest_needed = len(tok("\n\nLondon\n", add_special_tokens=False).input_ids)
    assert calls[0] <= longest_needed + 2  # generation stopped early, not after 30 tokens
    assert alive[0] == [1]  # the longest answer's row decoded last, alone
    calls[0], alive[0] = 0, [0, 1, 2]
    raw = generate_answers(model, tok, ["Q1", "Q2", "Q3"], max_new_tokens=30, batch_size=3, stop=())
    assert raw[0].startswith("Paris. It is") and raw[2] == "Rome"  # no stop strings: only EOS / the cap


# ------------------------------------------------------------------------------ WILD + teacher forced

REQS = [
    EditRequest(
        "Which river system contains Charity Creek?",
        "Chichester River",
        rephrase_prompts=["What river is Charity Creek in?"],
        locality=[("how many series of diary of a wimpy kid are there?", "12")],
        ground_truth="Parramatta River",
        id="z0",
    ),
    EditRequest(
        "Reedy Glacier is in",
        "Asia",
        locality=[("Mount Erebus, in", "Antarctica")],
        ground_truth="Antarctica",
        id="cf0",
    ),
]


def test_run_wild_schema_and_base_agreement(tiny_lm):
    model, tok = tiny_lm
    res = run_wild(
        model, tok, REQS, RuleJudge(), config=WildConfig(max_new_tokens=6), base=(model, tok), progress=False
    )
    s = res["summary"]
    assert set(s) >= {"rel", "gen", "loc_vs_answer", "loc_vs_base", "cross"}
    assert s["loc_vs_base"] == 1.0  # the base model agrees with itself
    answers = [r["rel"]["answer"] for r in res["records"]]
    assert s["cross"] == crosstalk(answers, [r.target for r in REQS], [r["rel"]["correct"] for r in res["records"]])
    rec = res["records"][0]
    assert rec["rel"]["question"] == REQS[0].prompt and isinstance(rec["rel"]["answer"], str)
    assert len(rec["gen"]) == 1 and rec["loc"][0]["base_answer"] == rec["loc"][0]["answer"]
    assert res["records"][1]["gen"] == []
    no_base = run_wild(model, tok, REQS[:1], RuleJudge(), config=WildConfig(max_new_tokens=4), progress=False)
    assert no_base["summary"]["loc_vs_base"] is None


def test_crosstalk_counts_misses_that_give_another_edits_target():
    """A miss counts when its answer begins, word for word after normalisation, with another edit's target; a
    correct answer, the edit's own target, a longer word that merely starts with a target ("Paristown") and an
    unrelated miss do not."""
    targets = ["Paris", "the Thames", "Rome", "Paris", "Oz"]
    answers = ["Paris", "Thames, in London", "Paris.", "Rome", "Ozone layer"]
    correct = [True, True, False, False, False]
    # edit 2 answers another edit's "Paris", edit 3 another edit's "Rome"; "Ozone" is not the target "Oz"
    assert crosstalk(answers, targets, correct) == 0.4
    assert crosstalk(["Paristown"], ["Rome"], [False]) == 0.0 and crosstalk([], [], []) is None
    assert crosstalk(["the Thames river", "Thames"], ["Paris", "Thames"], [False, True]) == 0.5  # articles dropped
    assert crosstalk(["Paris"], ["Paris"], [False]) == 0.0  # its own target (a judge's miss): not another's
    # a truncation of its own target is a near miss, not another edit's answer
    assert crosstalk(["New York", "New York"], ["New York City", "New York"], [False, True]) == 0.0
    assert crosstalk(["New York", "New York"], ["Newark", "New York"], [False, True]) == 0.5
    with pytest.raises(ValueError, match="one answer, target and verdict per edit, got 1, 2 and 1"):
        crosstalk(["Paris"], ["Paris", "Rome"], [False])


def test_evaluate_edit_logs_each_phase(tiny_lm, tmp_path, caplog):
    """A long evaluation leaves a trail at info level: one line per finished phase (teacher-forced, drift, each WILD
    wrapper) with its figures and seconds."""
    import logging

    from crispedit.evaluation import evaluate_edit

    model, tok = tiny_lm
    text = tmp_path / "heldout.txt"
    text.write_text("The river runs to the sea.\n\nA second paragraph of held-out text.\n")
    with caplog.at_level(logging.INFO, logger="crispedit.evaluate"):
        out = evaluate_edit(model, tok, REQS, {}, kl_text=str(text), kl_texts=2, wild=("qa", "none"), progress=False)
    lines = [r.getMessage() for r in caplog.records if r.name == "crispedit.evaluate"]
    assert len(lines) == 4, lines
    assert lines[0].startswith(f"evaluate: teacher-forced rel {out['summary']['rel']}") and "2 edits" in lines[0]
    assert lines[1].startswith("evaluate: KL drift 0.00000") and f"{out['summary']['ppl']:.2f}" in lines[1]
    assert lines[2].startswith(f"evaluate: WILD qa rel {out['wild']['qa']['rel']} gen {out['wild']['qa']['gen']}")
    assert lines[3].startswith("evaluate: WILD none rel") and lines[3].endswith(" s)")


def test_teacher_forced_specificity_and_counterfact(tiny_lm):
    from crispedit.evaluation.teacher_forced import edit_scores, score_pairs, summarize_edit_scores

    model, tok = tiny_lm
    per = edit_scores(model, tok, REQS, specificity=True)
    assert per[0]["spec_cf"] is None  # ZsRE: unrelated locality question
    loc = score_pairs(model, tok, ["Mount Erebus, in"], ["Antarctica"])[0]
    new = score_pairs(model, tok, ["Mount Erebus, in"], ["Asia"])[0]
    assert per[1]["spec_cf"] == float(loc.mean_logprob > new.mean_logprob)
    assert per[1]["spec_token_acc"] == round(loc.token_acc, 4)
    s = summarize_edit_scores(per)
    assert 0.0 <= s["spec_token_acc"] <= 1.0 and "spec_cf" in s
    assert "spec" not in summarize_edit_scores(edit_scores(model, tok, REQS))  # old callers unchanged


# ------------------------------------------------------------------------------------ CLI + report


@pytest.fixture()
def edits_file(tmp_path):
    p = tmp_path / "edits.jsonl"
    p.write_text("".join(json.dumps(r.to_json()) + "\n" for r in REQS))
    return p


@pytest.mark.parametrize("protocol", ["wild", "teacher-forced"])
def test_cli_eval_json_schema(tiny_model_dir, edits_file, tmp_path, protocol, capsys):
    out = tmp_path / "run.json"
    rc = main(
        [
            "eval",
            "--model",
            str(tiny_model_dir),
            "--edits",
            str(edits_file),
            "--protocol",
            protocol,
            "--base",
            str(tiny_model_dir),
            "--kl-texts",
            "2",
            "--out",
            str(out),
            "--quiet",
        ]
    )
    assert rc == 0
    run = json.loads(out.read_text())
    assert set(run) >= {"edit", "capabilities", "config", "versions", "timings"}
    if protocol == "wild":
        assert set(run["edit"]) >= {"rel", "gen", "loc_vs_answer", "loc_vs_base"}
        assert run["edit"]["loc_vs_base"] == 1.0 and len(run["generations"]) == 2
        assert run["config"]["judge"] == {"judge": "rule"} and run["config"]["context"] == "qa"
    else:
        assert set(run["edit"]) >= {
            "rel_token_acc",
            "rel_exact",
            "gen_token_acc",
            "gen_exact",
            "spec_token_acc",
            "spec_exact",
            "spec_cf",
        }
    assert run["capabilities"]["kl_drift"] == pytest.approx(0.0, abs=1e-6) and run["capabilities"]["ppl"] > 1
    assert run["versions"]["torch"] and run["config"]["protocol"] == protocol


@pytest.mark.parametrize(
    "extra,msg",
    [
        (["--edits", "/nonexistent/edits.json"], "edit file not found"),
        (["--capabilities", "arc_challenge,hellaswag"], "unknown capability task 'hellaswag'"),
        (["--capabilities", "arc_challenge", "--limit", "-3"], "--limit must be a positive integer"),
        (["--capabilities", "arc_challenge", "--bench-dir", "/nonexistent/bench"], "benchmark directory not found"),
        (["--edits", "EDITS", "--judge", "openai"], "API key"),
        (["--edits", "EDITS", "--kl-texts", "0"], "--kl-texts must be a positive integer"),
        (["--edits", "EDITS", "--max-new-tokens", "0"], "--max-new-tokens must be a positive integer"),
        (["--edits", "EDITS", "--offset", "-1"], "offset must be non-negative"),
        (["--capabilities", "arc_challenge", "--num-fewshot", "x"], "--num-fewshot must be an integer"),
        (["--capabilities", "arc_challenge", "--num-fewshot", "=3"], "--num-fewshot: expected task=N"),
        (["--capabilities", "arc_challenge", "--limit", "arc_challenge=0"], "--limit arc_challenge must be a positive"),
        (["--capabilities", "arc_challenge", "--limit", "hellaswag=5"], "unknown capability task 'hellaswag'"),
        ([], "nothing to evaluate"),
    ],
)
def test_cli_eval_bad_input_writes_nothing(tiny_model_dir, edits_file, tmp_path, extra, msg, capsys, monkeypatch):
    monkeypatch.delenv("CRISPEDIT_JUDGE_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    out = tmp_path / "run.json"
    extra = [str(edits_file) if x == "EDITS" else x for x in extra]
    rc = main(["eval", "--model", str(tiny_model_dir), *extra, "--out", str(out), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert rc != 0 and msg in err and len(err.splitlines()) == 1
    assert not out.exists() and not list(tmp_path.glob(".run.json*"))


def test_parse_limit_and_fewshot():
    from crispedit.cli.evaluate import _parse_fewshot, _parse_limit

    assert _parse_limit("200") == 200 and _parse_limit("all") is None and _parse_limit(None) == 200
    assert _parse_limit("arc=100, ifeval=all") == {"arc_challenge": 100, "ifeval": None}
    assert _parse_fewshot(None) is None and _parse_fewshot("0") == 0
    assert _parse_fewshot("arc_challenge=5,mmlu=0") == {"arc_challenge": 5, "mmlu": 0}


def test_cli_eval_missing_bench_file(tiny_model_dir, tmp_path, capsys):
    (tmp_path / "bench").mkdir()
    rc = main(
        [
            "eval",
            "--model",
            str(tiny_model_dir),
            "--capabilities",
            "ifeval",
            "--bench-dir",
            str(tmp_path / "bench"),
            "--out",
            str(tmp_path / "r.json"),
        ]
    )
    assert rc == 2 and "ifeval/input_data.jsonl" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_report_table_and_figure(tmp_path, capsys):
    runs = []
    for name, rel, arc in (("smollm2", 0.01, 0.29), ("/tmp/edited", 0.9, 0.28)):
        p = tmp_path / f"{rel}.json"
        p.write_text(
            json.dumps(
                stamped(
                    {
                        "edit": {"rel": rel, "gen": rel / 2, "loc_vs_answer": 0.1, "loc_vs_base": None},
                        "capabilities": {"arc_challenge": arc, "kl_drift": 0.002, "ppl": 20.5},
                        "config": {"model": name, "protocol": "wild", "context": "qa"},
                    }
                )
            )
        )
        runs.append(str(p))
    md = tmp_path / "report.md"
    assert main(["report", *runs, "--out", str(md)]) == 0
    table = md.read_text()
    assert "| run | rel | gen | loc_vs_answer | arc_challenge | kl_drift | ppl |" in table
    assert "edited [wild/qa]" in table and "0.900" in table
    png = tmp_path / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["report", str(bad)]) == 2
    assert "not a `crispedit eval` result" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "missing.json")]) == 2
    assert "run file not found" in capsys.readouterr().err


def test_report_labels_disambiguate_same_model(tmp_path):
    from crispedit.evaluation.report import load_run, markdown_table

    paths = []
    for name in ("ft", "crisp"):
        p = tmp_path / f"{name}.json"
        p.write_text(
            json.dumps(
                stamped(
                    {
                        "edit": {"rel": 0.5},
                        "capabilities": {},
                        "config": {"model": "runs/edited", "protocol": "wild", "context": "qa"},
                    }
                )
            )
        )
        paths.append(p)
    table = markdown_table([load_run(p) for p in paths])
    assert "edited [wild/qa] (ft)" in table and "edited [wild/qa] (crisp)" in table
