"""Edit contexts (bare / chat / prefix), answer termination, Adam in the eigenbasis, WILD wrappers."""

import copy

import pytest
import torch

from crispedit.curvature.projection import IdentityProjector, KroneckerProjector
from crispedit.data import EditRequest, capability_corpus
from crispedit.data.tokenize import chat_turn
from crispedit.editing import EditConfig, edit, restore
from crispedit.editing.contexts import (
    ANSWER_LEADS,
    DEFAULT_CONTEXTS,
    QUESTION_WRAPPERS,
    ContextSpec,
    build_training_sequences,
    parse_contexts,
    prefix_pool,
    resolve_contexts,
    sequences_for,
)
from crispedit.editing.optim import EigenbasisAdam
from crispedit.editing.sources import training_batches
from crispedit.errors import CrispEditError
from crispedit.evaluation.wild import QA_TEMPLATE, WildConfig, check_template, render_prompt

CHAT = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
REQS = [EditRequest(f"Who wrote book number {i}?", f"Author {chr(65 + i)}") for i in range(5)]


@pytest.fixture()
def chat_tok(tiny_tok):
    tok = copy.deepcopy(tiny_tok)
    tok.chat_template = CHAT
    return tok


def _decode_target(tok, seq):
    return tok.decode(seq.ids[seq.n_context :])


@pytest.mark.parametrize(
    "spec,msg",
    [
        ("", "empty"),
        ("qa", "unknown edit context 'qa'"),
        ("bare,bare", "twice"),
        ("prefix:0", "between 1 and 64"),
        ("prefix:x", "bad prefix count"),
        ("chat:2", "only prefix, para, gen, shared, wrap, lead take a count"),
        ("wrap:x", "bad wrap count"),
    ],
)
def test_parse_contexts_errors(spec, msg):
    with pytest.raises(CrispEditError, match=msg):
        parse_contexts(spec)


def test_parse_and_resolve(tiny_tok, chat_tok):
    assert parse_contexts("bare,chat,prefix:4") == (ContextSpec("bare"), ContextSpec("chat"), ContextSpec("prefix", 4))
    assert resolve_contexts("default", chat_tok) == parse_contexts(DEFAULT_CONTEXTS)
    # a model without chat template: default silently drops chat, an explicit chat is an error
    assert all(c.kind != "chat" for c in resolve_contexts("default", tiny_tok))
    with pytest.raises(CrispEditError, match="chat template"):
        resolve_contexts("bare,chat", tiny_tok)
    with pytest.raises(CrispEditError, match="unknown edit context"):
        EditConfig(contexts="bare,qa")
    with pytest.raises(CrispEditError, match="answer end"):
        EditConfig(answer_end="newline")


def test_no_default_training_context_contains_the_wild_qa_wrapper(chat_tok):
    """The QA context of the WILD evaluation measures generalisation: it must never be trained on."""
    wrapper = QA_TEMPLATE.split("{question}")[0].strip()  # "Please answer the question:\n\nQ:"
    seqs, names = sequences_for(chat_tok, REQS, EditConfig(contexts="default", n_cap=8))
    assert set(names) == {str(c) for c in parse_contexts(DEFAULT_CONTEXTS)}
    texts = [s.text for s in seqs] + [chat_tok.decode(s.ids) for s in seqs]
    assert texts and not any("Please answer the question" in t or wrapper in t for t in texts)
    # nor does any sentence the prefix context can draw from the bundled corpus
    assert not any("Please answer" in p for p in prefix_pool(capability_corpus(None, None)))


def test_bare_context_answer_ends(tiny_tok):
    eos = tiny_tok.eos_token_id
    auto = build_training_sequences(tiny_tok, REQS[:1], parse_contexts("bare"), "auto")[0]
    none = build_training_sequences(tiny_tok, REQS[:1], parse_contexts("bare"), "none")[0]
    with_eos = build_training_sequences(tiny_tok, REQS[:1], parse_contexts("bare"), "eos")[0]
    assert with_eos.ids[-1] == eos and with_eos.ids[:-1] == none.ids  # the EOS is trained after the target
    assert none.ids == tiny_tok(REQS[0].prompt + " " + REQS[0].target)["input_ids"]
    assert _decode_target(tiny_tok, none).strip() == "Author A"
    assert _decode_target(tiny_tok, auto).strip() == "Author A."  # a period ends a bare answer
    dotted = build_training_sequences(tiny_tok, [EditRequest("Q?", "It is so.")], parse_contexts("bare"), "auto")[0]
    assert _decode_target(tiny_tok, dotted).strip() == "It is so."  # no second period
    b = training_batches(tiny_tok, [with_eos], 4)[0]
    n_ctx = len(tiny_tok(REQS[0].prompt)["input_ids"])
    assert (b.labels[0, :n_ctx] == -100).all() and b.labels[0, -1].item() == eos


def test_chat_context_uses_the_template_and_its_turn_end(chat_tok):
    seq = build_training_sequences(chat_tok, REQS[:1], parse_contexts("chat"), "auto")[0]
    ctx = chat_turn(chat_tok, REQS[0].prompt, None)
    assert chat_tok.decode(seq.ids[: seq.n_context]) == ctx  # user turn + generation prompt
    assert _decode_target(chat_tok, seq) == "Author A<eos>"  # reply + end of turn, no trailing "\n"
    none = build_training_sequences(chat_tok, REQS[:1], parse_contexts("chat"), "none")[0]
    assert _decode_target(chat_tok, none) == "Author A"
    period = build_training_sequences(chat_tok, REQS[:1], parse_contexts("chat"), "period")[0]
    assert _decode_target(chat_tok, period) == "Author A."  # a full stop, no end of turn: the answer may go on
    assert period.ids[: period.n_context] == seq.ids[: seq.n_context]
    dotted = build_training_sequences(chat_tok, [EditRequest("Q?", "It is so.")], parse_contexts("chat"), "period")
    assert _decode_target(chat_tok, dotted[0]) == "It is so."
    bare = build_training_sequences(chat_tok, REQS[:1], parse_contexts("bare"), "period")[0]
    assert bare.ids == build_training_sequences(chat_tok, REQS[:1], parse_contexts("bare"), "auto")[0].ids


def test_prefix_context_is_deterministic_and_from_the_pool(tiny_tok):
    pool = prefix_pool(capability_corpus(None, 40))
    assert len(pool) > 50 and all(5 <= len(p.split()) <= 25 and p[-1] in ".!?" for p in pool)
    a = build_training_sequences(tiny_tok, REQS, parse_contexts("prefix:3"), "auto", prefixes=pool, seed=1)
    b = build_training_sequences(tiny_tok, REQS, parse_contexts("prefix:3"), "auto", prefixes=pool, seed=1)
    c = build_training_sequences(tiny_tok, REQS, parse_contexts("prefix:3"), "auto", prefixes=pool, seed=2)
    assert [s.ids for s in a] == [s.ids for s in b] and [s.ids for s in a] != [s.ids for s in c]
    assert len(a) == 3 * len(REQS)
    for s in a:
        r = REQS[s.request]
        head = s.text.split(" " + r.prompt)[0]
        assert head in pool and s.text.endswith(r.target + ".")
        assert _decode_target(tiny_tok, s).strip() == r.target + "."


def _seeded_sequences(tok, spec):
    """The training sequences of ``spec`` at seed 1, after checking the draw repeats at seed 1 and differs at 2."""
    a, b, c = (build_training_sequences(tok, REQS, parse_contexts(spec), "auto", seed=sd) for sd in (1, 1, 2))
    assert [s.ids for s in a] == [s.ids for s in b] and [s.ids for s in a] != [s.ids for s in c]
    return a


def test_wrap_context_wraps_the_prompt_and_never_uses_the_qa_template(tiny_tok):
    """``wrap:N`` puts each prompt in N distinct everyday wrappers (seeded), trains the target after it,
    and no wrapper shares the WILD QA template's form: that wrapper must stay unseen."""
    assert len(set(QUESTION_WRAPPERS)) == len(QUESTION_WRAPPERS) >= 12
    for w in QUESTION_WRAPPERS:
        assert w.count("{question}") == 1
        low = w.lower()
        assert "answer the question" not in low and "q:" not in low and "a:" not in low.replace("{question}", "")
    a = _seeded_sequences(tiny_tok, "wrap:3")
    assert len(a) == 3 * len(REQS) and {s.context for s in a} == {"wrap"}
    for i, r in enumerate(REQS):
        texts = [s.text for s in a if s.request == i]
        ctxs = [t[: -len(" " + r.target + ".")] for t in texts]
        assert len(set(ctxs)) == 3 and all(t.endswith(" " + r.target + ".") for t in texts)
        assert all(x in {w.replace("{question}", r.prompt) for w in QUESTION_WRAPPERS} for x in ctxs)
    assert all(_decode_target(tiny_tok, s).strip() == REQS[s.request].target + "." for s in a)
    assert str(parse_contexts("wrap:2")[0]) == "wrap:2"


def test_lead_context_puts_a_lead_in_between_question_and_answer(tiny_tok):
    """``lead:N`` trains the target after N distinct lead-ins (seeded) that follow the question; the loss
    covers the target (and its period) only, never the lead-in, and no lead-in has the QA template's parts."""
    assert len(set(ANSWER_LEADS)) == len(ANSWER_LEADS) >= 12
    for w in ANSWER_LEADS:
        assert w.startswith("{question}") and w.count("{question}") == 1
        low = w.lower()
        assert "answer" not in low and "q:" not in low and "a:" not in low
    a = _seeded_sequences(tiny_tok, "lead:4")
    assert len(a) == 4 * len(REQS) and {s.context for s in a} == {"lead"}
    for i, r in enumerate(REQS):
        texts = [s.text for s in a if s.request == i]
        heads = {t[: -len(r.target + ".")] for t in texts}
        assert len(heads) == 4 and all(t.endswith(r.target + ".") for t in texts)
        assert heads <= {w.replace("{question}", r.prompt) for w in ANSWER_LEADS}
    assert all(_decode_target(tiny_tok, s).strip() == REQS[s.request].target + "." for s in a)
    assert str(parse_contexts("lead:2")[0]) == "lead:2"


def test_batches_hold_one_context_kind(chat_tok):
    seqs, _ = sequences_for(chat_tok, REQS, EditConfig(contexts="bare,chat,prefix:2", n_cap=8))
    batches = training_batches(chat_tok, seqs, batch_size=4)
    assert sum(b.input_ids.shape[0] for b in batches) == 4 * len(REQS)
    # 5 bare -> 2 batches, 5 chat -> 2, 10 prefix -> 3
    assert len(batches) == 7


def test_edit_learns_every_context(chat_tok, iso_cache):
    """Trained under bare, chat and prefix contexts, the target is learned in each of them."""
    from conftest import build_llama
    from crispedit.editing.fastpath import plain_loss
    from crispedit.models import load_model

    model = build_llama(len(chat_tok))
    model, tok = load_model((model, chat_tok))
    cfg = EditConfig(
        method="crispedit",
        layers="model.layers.{1-2}.mlp.down_proj",
        epochs=40,
        lr=1e-2,
        batch_size=8,
        n_cap=6,
        max_len=48,
        gamma=0.8,
        contexts="bare,chat,prefix:1",
    )
    seqs, _ = sequences_for(tok, REQS, cfg)
    batches = training_batches(tok, seqs, 64)
    before = [plain_loss(model, b).item() for b in batches]
    res = edit(model, tok, REQS, cfg, progress=False)
    after = [plain_loss(model, b).item() for b in batches]
    assert res.history.contexts == ["bare", "chat", "prefix:1"] and res.history.sequences == 3 * len(REQS)
    assert all(a < 0.5 * b for a, b in zip(after, before)), (before, after)
    restore(model, res.original_weights)


# ---------------------------------------------------------------------------------------------
# Adam in the eigenbasis


def _rand_projector(d_out=6, d_in=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(d_in, d_in, generator=g, dtype=torch.float64)
    S = torch.randn(d_out, d_out, generator=g, dtype=torch.float64)
    return KroneckerProjector.from_factors(A @ A.T, S @ S.T, 0.7)


def test_rotate_unrotate_is_the_projection():
    P = _rand_projector()
    Q = torch.randn(6, 5)
    assert torch.allclose(P.unrotate(P.rotate(Q)), P.project(Q), atol=1e-6)
    ident = IdentityProjector(6, 5)
    assert torch.equal(ident.unrotate(ident.rotate(Q)), Q)


def test_eigenbasis_adam_with_identity_is_adam():
    torch.manual_seed(0)
    w1 = torch.nn.Parameter(torch.randn(6, 5))
    w2 = torch.nn.Parameter(w1.detach().clone())
    lin = torch.nn.Linear(5, 6, bias=False)
    o1 = torch.optim.Adam([w1], lr=1e-2)
    o2 = EigenbasisAdam([w2], [IdentityProjector(6, 5)], [lin], lr=1e-2)
    for _ in range(5):
        g = torch.randn(6, 5)
        w1.grad, w2.grad = g.clone(), g.clone()
        o1.step()
        o2.step()
    assert torch.allclose(w1, w2, atol=1e-6)


def test_eigenbasis_adam_keeps_the_change_in_the_kept_subspace_and_preconditions():
    P = _rand_projector()
    lin = torch.nn.Linear(5, 6, bias=False)
    w0 = torch.randn(6, 5)
    w = torch.nn.Parameter(w0.clone())
    opt = EigenbasisAdam([w], [P], [lin], lr=1e-2)
    for _ in range(4):
        w.grad = torch.randn(6, 5) * torch.logspace(-3, 1, 5)  # badly scaled columns
        opt.step()
    delta = (w - w0).detach()
    assert delta.abs().max() > 0
    assert torch.allclose(P.project(delta), delta, atol=1e-6)
    # Adam's normalisation in the eigenbasis: a first step moves every kept coordinate by ~lr
    w = torch.nn.Parameter(w0.clone())
    opt = EigenbasisAdam([w], [P], [lin], lr=1e-2)
    w.grad = torch.randn(6, 5)
    opt.step()
    C = P.rotate(w.detach() - w0)
    kept = P.mask.bool()
    assert torch.allclose(C[kept].abs(), torch.full_like(C[kept], 1e-2), rtol=1e-3)
    assert (C[~kept].abs() < 1e-7).all()


def test_eigenbasis_projection_target_in_the_loop(tiny_lm, iso_cache):
    from crispedit.editing import get_editor
    from crispedit.editing.api import capability_factors
    from crispedit.editing.loop import apply_projection
    from crispedit.layers import resolve_layers

    model, tok = tiny_lm
    cfg = EditConfig(
        method="crispedit",
        layers="model.layers.{1-2}.mlp.down_proj",
        epochs=8,
        lr=1e-2,
        batch_size=4,
        n_cap=6,
        max_len=48,
        gamma=0.8,
        projection_target="eigenbasis",
    )
    layers = resolve_layers(model, cfg.layers)
    factors, _ = capability_factors(model, tok, layers, cfg, progress=False)
    res = edit(model, tok, REQS, cfg, factors=factors, progress=False)
    assert res.history.epoch_loss[-1] < res.history.epoch_loss[0]
    projs = get_editor("crispedit").projectors(layers, factors, cfg)
    for name, m in layers.items():
        delta = m.weight.detach() - res.original_weights[f"{name}.weight"]
        assert delta.abs().max() > 0
        assert torch.allclose(apply_projection(projs[name], m, delta), delta, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# WILD with a user's own wrapper


@pytest.mark.parametrize(
    "template,msg",
    [
        ("", "empty"),
        ("no field here", "exactly once"),
        ("{question} and {question}", "exactly once"),
        ("{question} {other}", "no other field"),
        ("{question", "not a valid"),
    ],
)
def test_context_template_errors(template, msg):
    with pytest.raises(CrispEditError, match=msg):
        check_template(template)


def test_custom_template_renders(tiny_tok):
    cfg = WildConfig(template="Support bot {{v2}}. Customer: {question}\nBot:")
    assert cfg.context == "custom"
    assert render_prompt(tiny_tok, "Where?", cfg.context, cfg.template) == "Support bot {v2}. Customer: Where?\nBot:"


def test_eval_cli_context_template(tmp_path, capsys):
    import json

    from crispedit.cli import main

    edits = tmp_path / "e.json"
    edits.write_text(json.dumps([{"prompt": "Who?", "target": "Me"}]))
    out = tmp_path / "r.json"
    code = main(["eval", "--edits", str(edits), "--context-template", "Ask: {q}", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "--context-template must contain {question}" in err and not out.exists()
    code = main(
        ["eval", "--edits", str(edits), "--context", "chat", "--context-template", "Ask: {question}", "--out", str(out)]
    )
    assert code == 2 and "not both" in capsys.readouterr().err and not out.exists()


def test_wild_custom_template_end_to_end(tiny_lm):
    from crispedit.evaluation import RuleJudge, run_wild

    model, tok = tiny_lm
    res = run_wild(
        model,
        tok,
        REQS[:2],
        RuleJudge(),
        config=WildConfig(template="Our helpdesk. Customer: {question}\nAgent:", max_new_tokens=4),
    )
    assert res["config"]["context"] == "custom" and res["summary"]["n_edits"] == 2


def test_para_prefixes_end_a_paragraph_before_the_prompt(tiny_tok):
    pool = prefix_pool(capability_corpus(None, 40))
    seqs = build_training_sequences(tiny_tok, REQS, parse_contexts("prefix:1,para:2"), prefixes=pool)
    para = [s for s in seqs if s.context == "para"]
    assert len(para) == 2 * len(REQS)
    for s in para:
        r = REQS[s.request]
        head = s.text.split("\n\n" + r.prompt)[0]
        assert head in pool and s.text.endswith(r.target + ".")
    # para draws its sentences independently of prefix (same seed, other stream)
    firsts = {s.request: s.text.split(" " + REQS[s.request].prompt)[0] for s in seqs if s.context == "prefix"}
    assert any(firsts[s.request] != s.text.split("\n\n")[0] for s in para)


def test_gen_prefixes_are_written_by_the_model_deterministically(tiny_lm):
    from crispedit.editing.written import GEN_STARTS, generated_prefixes

    tiny_lm, tiny_tok = tiny_lm
    state = torch.random.get_rng_state()
    a = generated_prefixes(tiny_lm, tiny_tok, per_start=2, max_new_tokens=5, seed=3)
    assert torch.equal(state, torch.random.get_rng_state())  # the caller's RNG is untouched
    assert a == generated_prefixes(tiny_lm, tiny_tok, per_start=2, max_new_tokens=5, seed=3)
    assert len(a) == 2 * len(GEN_STARTS) and all(p[-1] in ".!?" and "\n" not in p for p in a)
    assert all(any(p.startswith(s) for s in GEN_STARTS) for p in a)
    seqs, names = sequences_for(tiny_tok, REQS, EditConfig(contexts="bare,gen:2", n_cap=8), model=tiny_lm)
    assert names == ["bare", "gen:2"] and sum(s.context == "gen" for s in seqs) == 2 * len(REQS)
    with pytest.raises(CrispEditError, match="needs the model"):
        sequences_for(tiny_tok, REQS, EditConfig(contexts="gen:2", n_cap=8))


def test_token_budget_batches_pack_sorted_sequences_within_a_kind(tiny_tok):
    """``batch_tokens``: every batch is one context kind, its padded size (rows x longest) within the budget unless
    one sequence alone exceeds it, every sequence in exactly one batch; without it, ``batch_size`` sequences."""
    from crispedit.data import EditRequest
    from crispedit.editing.contexts import build_training_sequences, parse_contexts
    from crispedit.editing.sources import training_batches

    reqs = [EditRequest("Q " + "word " * (i % 7) + f"{i}?", f"Answer {i}") for i in range(20)]
    seqs = build_training_sequences(tiny_tok, reqs, parse_contexts("bare,lead:2"), "auto")
    plain = training_batches(tiny_tok, seqs, 8)
    assert [b.input_ids.shape[0] for b in plain] == [8, 8, 4, 8, 8, 8, 8, 8]
    packed = training_batches(tiny_tok, seqs, 8, batch_tokens=120)
    assert sum(b.input_ids.shape[0] for b in packed) == len(seqs)
    longest = max(len(s.ids) for s in seqs)
    for b in packed:
        n, T = b.input_ids.shape
        assert n * T <= 120 or n == 1 and T == longest or n == 1
    assert len(packed) < len(seqs)


def test_length_ordered_batches_keep_the_steps_and_cut_the_padding(tiny_tok):
    """``batch_order="length"``: the same batch sizes per kind as request order, every sequence once, each batch
    one kind, and no more padded tokens than request order (here strictly fewer)."""
    from crispedit.data import EditRequest
    from crispedit.editing.contexts import build_training_sequences, parse_contexts
    from crispedit.editing.sources import training_batches

    reqs = [EditRequest("Q " + "word " * ((i * 5) % 9) + f"{i}?", f"Answer {i}") for i in range(20)]
    seqs = build_training_sequences(tiny_tok, reqs, parse_contexts("bare,lead:2"), "auto")
    plain = training_batches(tiny_tok, seqs, 8)
    ordered = training_batches(tiny_tok, seqs, 8, by_length=True)
    assert [b.input_ids.shape[0] for b in ordered] == [b.input_ids.shape[0] for b in plain]
    assert sorted(k for b in ordered for k in b.keys) == list(range(len(seqs)))
    assert all(len({seqs[k].context for k in b.keys}) == 1 for b in ordered)
    assert sum(b.input_ids.numel() for b in ordered) < sum(b.input_ids.numel() for b in plain)
    lengths = [[len(seqs[k].ids) for k in b.keys] for b in ordered]
    assert all(max(a) <= min(b) for a, b in zip(lengths[:2], lengths[1:3]))  # bare's batches ascend in length
    d = EditConfig(batch_order="length").to_json()
    assert d["batch_order"] == "length" and EditConfig().to_json()["batch_order"] == "request"
    assert EditConfig.from_dict(d).batch_order == "length"
    with pytest.raises(CrispEditError, match="batch order"):
        EditConfig(batch_order="random")


def _golden_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent / "golden" / "make_training_sequences.py"
    spec = importlib.util.spec_from_file_location("make_training_sequences", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_training_sequences_are_pinned():
    """Every training context builds, token for token, the sequences the if-chain before the training-context
    registry built (tests/editing/golden/training_sequences.json, written by that code): a stored run retrains the
    same."""
    import json
    from pathlib import Path

    mod = _golden_module()
    stored = json.loads((Path(mod.__file__).parent / "training_sequences.json").read_text())
    now = mod.golden()
    assert [{k: c[k] for k in ("tokenizer", "contexts", "answer_end", "seed")} for c in now] == [
        {k: c[k] for k in ("tokenizer", "contexts", "answer_end", "seed")} for c in stored
    ]
    for new, old in zip(now, stored):
        if "sequences" in old:
            assert new["sequences"] == old["sequences"], (old["tokenizer"], old["contexts"])
        assert (new.get("names"), new["n"], new["sha256"]) == (old.get("names"), old["n"], old["sha256"]), (
            old["tokenizer"],
            old["contexts"],
            old["answer_end"],
            old["seed"],
        )


def test_training_contexts_come_from_the_registry(tiny_tok):
    """A context registered with @training_context is parsed, named in errors and --help, and built."""
    from crispedit.cli import build_parser
    from crispedit.editing import contexts as ctx_mod

    try:

        @ctx_mod.training_context("shout", counted=True)
        def _shout(m, i, r, count):
            return [m.plain(i, "shout", r.prompt.upper() + "!" * k, r.target) for k in range(1, count + 1)]

        specs = parse_contexts("bare,shout:2")
        assert [str(c) for c in specs] == ["bare", "shout:2"]
        seqs = build_training_sequences(tiny_tok, REQS[:2], specs, "none")
        assert [(s.context, s.request) for s in seqs] == [
            ("bare", 0),
            ("bare", 1),
            ("shout", 0),
            ("shout", 0),
            ("shout", 1),
            ("shout", 1),
        ]
        assert seqs[3].text == REQS[0].prompt.upper() + "!! " + REQS[0].target
        with pytest.raises(CrispEditError, match="use bare, chat, reply, prefix, para, gen, shared, wrap, lead, shout"):
            parse_contexts("loud")
        with pytest.raises(CrispEditError, match="only prefix, para, gen, shared, wrap, lead, shout take a count"):
            parse_contexts("bare:2")
        help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["edit"].format_help().split())
        assert "lead:N, shout:N" in help_text
        with pytest.raises(ValueError, match="taken"):
            ctx_mod.training_context("bare")
    finally:
        ctx_mod.TRAINING_CONTEXTS.pop("shout", None)
    assert tuple(ctx_mod.TRAINING_CONTEXTS) == ctx_mod.CONTEXT_KINDS


def test_eval_wrappers_come_from_the_registry(tiny_tok):
    """A wrapper registered with @eval_wrapper is an eval --context choice, a WildConfig context and renders;
    the training contexts never include the held-out wrapper."""
    from crispedit.cli import build_parser
    from crispedit.editing.contexts import TRAINING_CONTEXTS
    from crispedit.evaluation import wild

    assert wild.HELD_OUT_WRAPPER == "qa" and wild.HELD_OUT_WRAPPER not in TRAINING_CONTEXTS
    assert tuple(wild.EVAL_WRAPPERS) == ("qa", "none", "chat")
    try:

        @wild.eval_wrapper("shout")
        def _shout(tokenizer, question):
            return question.upper()

        assert render_prompt(tiny_tok, "who?", "shout") == "WHO?"
        assert WildConfig(context="shout").context == "shout"
        eval_parser = build_parser()._subparsers._group_actions[0].choices["eval"]
        assert eval_parser.parse_args(["--out", "x.json", "--context", "shout"]).context == "shout"
        with pytest.raises(ValueError, match="taken"):
            wild.eval_wrapper("custom")
    finally:
        wild.EVAL_WRAPPERS.pop("shout", None)
    assert tuple(wild.EVAL_WRAPPERS) == ("qa", "none", "chat")


def test_shared_prefixes_are_one_draw_per_group_of_requests(tiny_tok):
    from crispedit.editing.contexts import SHARE_GROUP

    pool = prefix_pool(capability_corpus(None, 40))
    reqs = [EditRequest(f"Who wrote book number {i}?", f"Author {chr(65 + i % 26)}") for i in range(3 * SHARE_GROUP)]
    seqs = build_training_sequences(tiny_tok, reqs, parse_contexts("shared:2"), prefixes=pool)
    assert seqs == build_training_sequences(tiny_tok, reqs, parse_contexts("shared:2"), prefixes=pool)  # seeded
    heads: dict[int, list[str]] = {}
    for s in seqs:
        r = reqs[s.request]
        head = s.text.split(" " + r.prompt)[0]
        assert s.context == "shared" and head in pool and s.text.endswith(r.target + ".")
        heads.setdefault(s.request, []).append(head)
    groups = [[heads[i] for i in range(g, g + SHARE_GROUP)] for g in range(0, len(reqs), SHARE_GROUP)]
    assert all(len(set(h)) == 2 for h in heads.values())  # two different sentences per request
    assert all(all(h == g[0] for h in g) for g in groups)  # the same two for every request of a group
    assert len({tuple(g[0]) for g in groups}) == len(groups)  # drawn anew for every group
    # the sequences of a group begin with the same tokens, so a batch of them packs into few prefix trees
    from crispedit.editing.prefixtree import pack_prefixes

    def nodes(spec):
        ss = build_training_sequences(tiny_tok, reqs, parse_contexts(spec), prefixes=pool)
        (b,) = training_batches(tiny_tok, ss, batch_size=len(ss))
        return pack_prefixes(b.input_ids, b.attention_mask, b.labels).nodes, int(b.attention_mask.sum())

    (shared, real), (alone, real_alone) = nodes("shared:2"), nodes("prefix:2")
    assert shared < alone <= real_alone and shared < real


def test_own_replies_put_the_target_where_the_model_named_the_old_answer(chat_tok, monkeypatch):
    """``reply`` trains the model's own first sentence with the old answer replaced by the target where it names it,
    else the target and the model's own continuation of it; generation is asked through the chat template."""
    from crispedit.editing import written
    from crispedit.evaluation import generation

    reqs = [
        EditRequest("What is the capital of Australia?", "Melbourne", ground_truth="Canberra"),
        EditRequest("Which river contains Charity Creek?", "Chichester River", ground_truth="Parramatta River"),
    ]
    calls = []

    def fake(model, tok, prompts, **kw):
        calls.append((list(prompts), kw))
        if len(calls) == 1:
            return ["The capital of Australia is canberra. It is a planned city.", "Charity Creek is a creek."]
        return [" is a river in New South Wales"]

    monkeypatch.setattr(generation, "generate_answers", fake)
    replies = written.own_replies(object(), chat_tok, reqs)
    assert replies == ["The capital of Australia is Melbourne.", "Chichester River is a river in New South Wales."]
    assert calls[0][0][0] == chat_turn(chat_tok, reqs[0].prompt, None)
    assert calls[1][0] == [chat_turn(chat_tok, reqs[1].prompt, None) + "Chichester River"]
    first, second = build_training_sequences(chat_tok, reqs, parse_contexts("reply"), replies=replies)
    # the model's own words are context, the target alone is trained, and nothing after it (no turn end)
    assert (
        chat_tok.decode(first.ids)
        == chat_turn(chat_tok, reqs[0].prompt, None) + "The capital of Australia is Melbourne"
    )
    assert _decode_target(chat_tok, first).strip() == "Melbourne"
    assert chat_tok.decode(second.ids[: second.n_context]) == chat_turn(chat_tok, reqs[1].prompt, None)
    assert _decode_target(chat_tok, second) == "Chichester River"


def test_reply_context_needs_the_model_and_a_chat_template(tiny_tok, chat_tok):
    with pytest.raises(CrispEditError, match="needs the model to write its replies"):
        sequences_for(chat_tok, REQS, EditConfig(contexts="bare,reply"))
    with pytest.raises(CrispEditError, match="chat template"):
        build_training_sequences(tiny_tok, REQS, parse_contexts("reply"), replies=["x"] * len(REQS))


def test_edit_learns_the_reply_context(chat_tok, iso_cache):
    from conftest import build_llama
    from crispedit.models import load_model

    model, tok = load_model((build_llama(len(chat_tok)), chat_tok))
    cfg = EditConfig(
        method="crispedit",
        layers="model.layers.{1-2}.mlp.down_proj",
        epochs=30,
        lr=1e-2,
        batch_size=8,
        n_cap=6,
        max_len=48,
        gamma=0.8,
        contexts="bare,reply",
    )
    res = edit(model, tok, REQS, cfg, progress=False)
    assert res.history.contexts == ["bare", "reply"] and res.history.sequences == 2 * len(REQS)
    assert res.history.epoch_loss[-1] < 0.5 * res.history.epoch_loss[0]
    restore(model, res.original_weights)
