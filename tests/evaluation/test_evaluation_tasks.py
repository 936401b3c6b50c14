"""lm-eval capability tasks from local files, on a tiny random llama (a handful of items per task)."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import shared_path

pytest.importorskip("lm_eval")

from crispedit.errors import CrispEditError  # noqa: E402
from crispedit.evaluation import capabilities as C  # noqa: E402
from crispedit.evaluation.bench_data import MMLU_SUBJECTS, TASK_FILES  # noqa: E402
from crispedit.evaluation.harness_lm import MIN_SHARED_CONTEXT, prefix_sharing_lm_class  # noqa: E402


@pytest.fixture(scope="module")
def bench():
    env = os.environ.get("CRISPEDIT_BENCH_DIR")
    return env if env else str(shared_path("data", "benchmarks"))


@pytest.fixture(scope="module")
def lm(tiny_tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tiny_tok),
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=tiny_tok.eos_token_id,
        pad_token_id=tiny_tok.pad_token_id,
    )
    return LlamaForCausalLM(cfg).eval(), tiny_tok


def test_shipped_configs_cover_every_task():
    names = {p.stem for p in C.TASKS_DIR.glob("*.yaml")}
    for t in C.TASKS.values():
        assert t.local in names
    assert {f"crispedit_mmlu_{s}" for s in MMLU_SUBJECTS} <= names
    assert len(TASK_FILES["mmlu"]) == 2 * 57


def test_parse_tasks():
    assert C.parse_tasks("all") == list(C.TASKS)
    assert C.parse_tasks("arc,gsm8k,ifeval") == ["arc_challenge", "gsm8k_cot", "ifeval"]
    assert C.parse_tasks("none") == []
    with pytest.raises(CrispEditError, match="unknown capability task 'hellaswag'"):
        C.parse_tasks("hellaswag")


@pytest.mark.parametrize(
    "task,shots,key",
    [
        ("arc_challenge", 2, "acc_norm,none"),
        ("truthfulqa_mc2", 0, "acc,none"),
        ("gsm8k_cot", 1, "exact_match,strict-match"),
        ("ifeval", 0, "prompt_level_strict_acc,none"),
    ],
)
def test_local_task_runs(lm, bench, task, shots, key, iso_cache):
    model, tok = lm
    res = C.run_capabilities(
        model,
        tok,
        [task],
        limit=3,
        bench_dir=bench,
        num_fewshot={task: shots},
        max_gen_toks=8,
        batch_size=4,
        progress=False,
    )[task]
    assert res["n"] == 3 and res["metric"] == key and res["source"] == "local"
    assert 0.0 <= res["score"] <= 1.0 and res["num_fewshot"] == shots
    items = res["items"]  # per-item values of the headline metric: their mean is the score
    assert items is not None and len(items) == 3 and abs(sum(items) / 3 - res["score"]) < 1e-3
    assert res["stderr"] == pytest.approx(C.item_stderr(items), abs=1e-6)


def test_item_scores_pick_the_metric_and_filter_and_pair_in_doc_order():
    samples = {
        "t_b": [
            {"doc_id": 1, "filter": "strict", "exact_match": 1.0},
            {"doc_id": 0, "filter": "strict", "exact_match": 0.0},
            {"doc_id": 0, "filter": "flex", "exact_match": 1.0},
        ],
        "t_a": [{"doc_id": 0, "filter": "strict", "exact_match": True}],
    }
    assert C.item_scores(samples, "exact_match,strict") == [1.0, 0.0, 1.0]  # t_a first, then t_b by doc id
    assert C.item_scores(samples, "exact_match,flex") == [1.0]
    assert C.item_scores(samples, "acc,none") is None
    assert C.item_scores({"t": [{"doc_id": 0, "filter": "none", "inst_acc": [True, False]}]}, "inst_acc,none") is None
    assert C.item_stderr([1.0]) is None and C.item_stderr([0.0, 1.0]) == pytest.approx(0.5)
    assert C.paired_change([1.0, 1.0, 0.0], [0.0, 1.0, 0.0]) == pytest.approx((1 / 3, (1 / 3) ** 0.5 / 3**0.5))
    assert C.paired_change([1.0], [0.0]) is None and C.paired_change([1.0, 0.0], [0.0]) is None


def test_quiet_capabilities_draw_no_bars(lm, bench, iso_cache, capfd):
    """progress=False hides lm-eval's own request-building bar too, and puts it back afterwards."""
    import lm_eval.api.task as lm_task

    before = lm_task.tqdm
    model, tok = lm
    C.run_capabilities(
        model, tok, ["arc_challenge", "ifeval"], limit=2, bench_dir=bench, num_fewshot=0, max_gen_toks=4, progress=False
    )
    err = capfd.readouterr().err
    assert "it/s" not in err and "%|" not in err, err[-500:]
    assert lm_task.tqdm is before


def test_per_task_limits(lm, bench, iso_cache):
    model, tok = lm
    res = C.run_capabilities(
        model,
        tok,
        ["arc_challenge", "truthfulqa_mc2"],
        bench_dir=bench,
        num_fewshot=0,
        limit={"arc_challenge": 2, "truthfulqa_mc2": 4},
        progress=False,
    )
    assert (res["arc_challenge"]["n"], res["truthfulqa_mc2"]["n"]) == (2, 4)
    assert res["arc_challenge"]["limit"] == 2


def test_mmlu_group_runs(lm, bench, iso_cache):
    model, tok = lm
    res = C.run_capabilities(model, tok, ["mmlu"], limit=1, bench_dir=bench, num_fewshot=1, progress=False)["mmlu"]
    assert res["n"] == 57 and 0.0 <= res["score"] <= 1.0


def test_chat_template_multiturn_runs(lm, bench, iso_cache):
    model, tok = lm
    tok = tok.__class__(tokenizer_object=tok.backend_tokenizer, eos_token="<eos>", pad_token="<pad>")
    tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    res = C.run_capabilities(
        model,
        tok,
        ["arc_challenge"],
        limit=2,
        bench_dir=bench,
        num_fewshot=2,
        apply_chat_template=True,
        fewshot_as_multiturn=True,
        progress=False,
    )
    assert 0.0 <= res["arc_challenge"]["score"] <= 1.0


def test_prefix_sharing_matches_stock_loglikelihood(lm):
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    model, tok = lm
    ctx = "Question: Which gas do plants absorb?\nAnswer:"
    reqs = [
        Instance("loglikelihood", {}, (ctx, c), i)
        for i, c in enumerate([" Carbon dioxide", " Oxygen", " Nitrogen gas in the air", " Helium"])
    ]
    reqs.append(Instance("loglikelihood", {}, ("Another context", " x"), 4))
    # contexts behind one long preamble (TruthfulQA's, an MMLU subject's): built on the preamble's cache, one
    # of them the preamble alone plus its last token, one the same as another item's
    preamble = "Q: What is the capital of France?\nA: Paris.\n\nQ: How many legs has a spider?\nA: Eight.\n\n"
    assert len(tok(preamble)["input_ids"]) > MIN_SHARED_CONTEXT
    for q in ["Q: Which gas do plants absorb?\nA:", "Q: Who wrote Hamlet?\nA:", "Q:", "Q: Who wrote Hamlet?\nA:"]:
        reqs += [
            Instance("loglikelihood", {}, (preamble + q, c), len(reqs) + j) for j, c in enumerate([" Yes", " No idea"])
        ]
    stock = HFLM(pretrained=model, tokenizer=tok, batch_size=2, device="cpu").loglikelihood(reqs, disable_tqdm=True)
    lm = prefix_sharing_lm_class()(pretrained=model, tokenizer=tok, batch_size=2, device="cpu")
    calls = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: calls.append(kw["input_ids"].shape[1]), with_kwargs=True)
    try:
        shared = lm.loglikelihood(reqs, disable_tqdm=True)
    finally:
        hook.remove()
    for (a, ga), (b, gb) in zip(stock, shared):
        assert a == pytest.approx(b, abs=1e-4) and ga == gb
    n_pre = len(tok(preamble)["input_ids"])
    assert sum(1 for n in calls if n >= n_pre) == 1  # the preamble ran once, not once per item


def test_punkt_offline(tmp_path, monkeypatch):
    import nltk

    monkeypatch.setattr(nltk, "download", lambda *a, **k: pytest.fail("nltk tried to download"))
    d = C.ensure_punkt_offline(tmp_path / "nltk_data")
    try:
        from nltk.tokenize import PunktTokenizer

        text = "Dr. Smith went to Washington. He arrived at 5 p.m. on Monday! Did he stay?"
        sents = PunktTokenizer("english").tokenize(text)
        assert sents == ["Dr. Smith went to Washington.", "He arrived at 5 p.m. on Monday!", "Did he stay?"]
        assert nltk.word_tokenize("Hello, world.") == ["Hello", ",", "world", "."]
    finally:
        nltk.data.path.remove(str(d))


def test_missing_bench_file_is_one_line(tmp_path, lm):
    model, tok = lm
    with pytest.raises(CrispEditError, match="arc_challenge/ARC-Challenge-Test.jsonl"):
        C.run_capabilities(model, tok, ["arc_challenge"], bench_dir=tmp_path)


def _tasks_module():
    """The hook module lm-eval loads by path from the shipped task folder."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("crispedit_tasks_under_test", C.TASKS_DIR / "crispedit_tasks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_ifeval_scoring_offline(bench, iso_cache, monkeypatch):
    """IFEval's checker (commas, sentence count through Punkt, highlights) scores known answers, no download."""
    import nltk

    monkeypatch.setattr(nltk, "download", lambda *a, **k: pytest.fail("nltk tried to download"))
    hooks = _tasks_module()
    docs = {d["key"]: d for d in hooks.load_ifeval(bench)["train"]}
    try:
        no_comma = docs[1001]
        assert hooks.ifeval_process_results(no_comma, ["Day one: Tokyo and Kyoto"])["prompt_level_strict_acc"]
        assert not hooks.ifeval_process_results(no_comma, ["Day one, Tokyo"])["prompt_level_strict_acc"]
        three = docs[1174]  # letter o < 6 times, fewer than 6 sentences, at least 2 *highlights*
        assert three["instruction_id_list"][1] == "length_constraints:number_sentences"
        ok = hooks.ifeval_process_results(three, ["Hi there. *first* *second*."])
        assert ok["prompt_level_strict_acc"] and ok["inst_level_strict_acc"] == [True, True, True]
        long = " ".join(["Hi."] * 7) + " *a* *b*"
        assert hooks.ifeval_process_results(three, [long])["inst_level_strict_acc"] == [True, False, True]
        from lm_eval.tasks.ifeval.utils import agg_inst_level_acc

        items = [[True, False, True], [False], [True, True]]
        assert hooks.agg_inst_level_acc(items) == agg_inst_level_acc(items)
    finally:
        for p in list(nltk.data.path):
            if str(iso_cache) in p:
                nltk.data.path.remove(p)


def test_local_loaders_match_stock_schema(bench):
    hooks = _tasks_module()
    arc = hooks.load_arc(bench)
    doc = arc["test"][0]
    assert set(doc) == {"id", "question", "choices", "answerKey"} and doc["answerKey"] in doc["choices"]["label"]
    assert len(arc["train"]) == len(arc["test"]) == 1172  # no train file: few-shot drawn from the other test items
    tqa = hooks.load_truthfulqa_mc(bench)["validation"]
    assert len(tqa) == 790
    for d in tqa.select(range(20)):  # mc2: true answers first (the stock scorer splits at the first 0)
        labels = d["mc2_targets"]["labels"]
        assert labels == sorted(labels, reverse=True) and labels[0] == 1 and d["mc1_targets"]["labels"][0] == 1
    mmlu = hooks.load_mmlu(bench, subject="anatomy")
    assert len(mmlu["dev"]) == 5 and set(mmlu["test"][0]) == {"question", "choices", "answer"}
    assert len(hooks.load_gsm8k(bench)["test"]) == 1319


def _stock_dir():
    import lm_eval.tasks

    return C.Path(lm_eval.tasks.__file__).parent


@pytest.mark.parametrize(
    "local,stock",
    [
        ("crispedit_arc_challenge.yaml", "arc/arc_challenge.yaml"),
        ("crispedit_gsm8k_cot.yaml", "gsm8k/gsm8k-cot.yaml"),
        ("crispedit_truthfulqa_mc2.yaml", "truthfulqa/truthfulqa_mc2.yaml"),
        ("crispedit_ifeval.yaml", "ifeval/ifeval.yaml"),
    ]
    + [(f"crispedit_mmlu_{s}.yaml", f"mmlu/default/mmlu_{s}.yaml") for s in MMLU_SUBJECTS],
)
def test_local_configs_equal_stock_prompts_and_metrics(local, stock):
    """Only the data source differs from lm-eval's stock task: same prompt, choices, target, shots,
    filters, generation settings and metrics."""
    from lm_eval.tasks._yaml_loader import load_yaml

    ours = load_yaml(C.TASKS_DIR / local, resolve_func=False)
    theirs = load_yaml(_stock_dir() / stock, resolve_func=False)
    for key in (
        "output_type",
        "doc_to_text",
        "doc_to_target",
        "doc_to_choice",
        "description",
        "filter_list",
        "generation_kwargs",
        "fewshot_config",
        "fewshot_split",
        "test_split",
    ):
        if key in theirs or key in ours:
            if key == "test_split" and "custom_dataset" in ours:
                continue  # split names of our loaders (checked by test_local_loaders_match_stock_schema)
            assert ours.get(key) == theirs.get(key), key

    def metrics(cfg):  # aggregation functions live in different modules: compare names and flags
        return [
            {k: (str(v).split(".")[-1] if k == "aggregation" else v) for k, v in m.items()} for m in cfg["metric_list"]
        ]

    assert metrics(ours) == metrics(theirs)
