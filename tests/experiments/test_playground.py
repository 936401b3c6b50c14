"""``crispedit playground``: the model side (ask, edit on curvature fetched once, undo bit for bit, one request
at a time, bad input refused with the weights untouched), its HTTP API (FastAPI's TestClient: no browser), the
command line, and the page itself in a real browser (playwright driving the system's chromium; skipped, saying
why, where none is installed). All on the tiny random-weight llama: its answers are gibberish, the flow is what
is checked. The last test, on SmolLM2, is ``slow``."""

from __future__ import annotations

import os
import re
import shutil
import threading
import time

import pytest
import torch

from conftest import build_llama
from crispedit.cli import main
from crispedit.editing import EditConfig
from crispedit.errors import CrispEditError
from crispedit.playground.engine import Playground, PlaygroundBusy
from crispedit.playground.server import (
    STATIC_FILES,
    bind,
    create_app,
    host_allowed,
    require_web_packages,
    running_server,
    url_of,
)

LAYERS = "model.layers.{1-2}.mlp.down_proj"
SETTINGS = dict(layers=LAYERS, n_cap=4, max_len=32, epochs=2, lr=1e-2)
Q1, A1 = "Who wrote the book Blue Harbour?", "Mara Lind"
Q2, A2 = "Which river runs through Castor?", "the Velm"


def bits(model) -> dict[str, torch.Tensor]:
    """Every parameter as integers (bitwise comparison)."""
    return {n: p.detach().clone().view(torch.int32) for n, p in model.named_parameters()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def changed(a: dict, b: dict) -> set[str]:
    return {k for k in a if not torch.equal(a[k], b[k])}


def make_playground(model, tok, **kw) -> Playground:
    return Playground(model, tok, EditConfig(**SETTINGS), kl_texts=2, name="tiny", **kw)


def api_client(pg: Playground):
    """FastAPI's TestClient on the playground's app, as from this machine (the app's default allowed hosts)."""
    from fastapi.testclient import TestClient

    return TestClient(create_app(pg), base_url="http://127.0.0.1")


@pytest.fixture()
def pg(tiny_lm, iso_cache):
    return make_playground(*tiny_lm)


@pytest.fixture()
def client(pg):
    pytest.importorskip("fastapi")
    with api_client(pg) as c:
        yield c


@pytest.fixture(scope="module")
def edited(tiny_tok, tmp_path_factory):
    """``(playground, client)`` with one edit applied, shared by the tests whose requests must change nothing."""
    pytest.importorskip("fastapi")
    pg = make_playground(build_llama(len(tiny_tok)), tiny_tok, cache_root=tmp_path_factory.mktemp("cache"))
    pg.edit(Q1, A1)
    with api_client(pg) as c:
        yield pg, c


def test_ask_edit_undo_through_the_api(pg, client):
    state = client.get("/api/state").json()
    assert (state["model"], state["method"], state["edits"], state["busy"]) == ("tiny", "crispedit", [], None)
    assert state["layers"] == ["model.layers.1.mlp.down_proj", "model.layers.2.mlp.down_proj"]
    r = client.post("/api/ask", json={"question": Q1})
    assert r.status_code == 200 and isinstance(r.json()["answer"], str) and r.json()["question"] == Q1
    base = bits(pg.model)

    r1 = client.post("/api/edit", json={"question": f"  {Q1} ", "answer": A1}).json()
    after1 = bits(pg.model)
    assert changed(base, after1) == set(pg.params)  # the edit layers' weights, nothing else
    assert r1["question"] == Q1 and r1["target"] == A1 and isinstance(r1["answer"], str)
    assert r1["wild_qa"]["prompt"] == f"Please answer the question:\n\nQ: {Q1}\nA:" and r1["wild_qa"]["judge"] == "rule"
    assert isinstance(r1["wild_qa"]["correct"], bool) and isinstance(r1["wild_qa"]["answer"], str)
    d = r1["drift"]
    assert d["measured"] > 0 and d["predicted"] > 0 and d["edit_predicted"] == pytest.approx(d["predicted"])
    assert d["texts"] == 2 and r1["edit_seconds"] > 0
    assert r1["seconds"] >= r1["edit_seconds"] + r1["eval_seconds"] - 0.01
    assert r1["epochs"] >= 1 and r1["state"]["edits"] == [{"question": Q1, "answer": A1, "undoable": True}]

    r2 = client.post("/api/edit", json={"question": Q2, "answer": A2}).json()
    assert len(r2["state"]["edits"]) == 2 and r2["drift"]["edit_predicted"] != r2["drift"]["predicted"]
    u = client.post("/api/undo", json={}).json()
    assert u["undone"] == {"question": Q2, "answer": A2} and len(u["state"]["edits"]) == 1
    assert same(bits(pg.model), after1)  # bit for bit the model after edit 1
    client.post("/api/undo", json={})
    assert same(bits(pg.model), base)  # and then the model at start-up
    r = client.post("/api/undo", json={})
    assert r.status_code == 400 and r.json()["error"].startswith("nothing to undo")


def test_curvature_is_fetched_once_at_start_up(pg, tiny_tok, monkeypatch):
    """Edits only train: no factor lookup, no collection after start-up; a second playground on the same weights
    finds the factors in the cache."""
    import crispedit.curvature.cache as cache
    import crispedit.editing.api as api

    assert pg.cache["hit"] is False and pg.factors is not None
    with monkeypatch.context() as m:  # (monkeypatch.undo() would also drop iso_cache's CRISPEDIT_CACHE)
        for module, name in ((api, "capability_factors"), (cache, "collect_lm_kfac")):
            m.setattr(module, name, lambda *a, **k: pytest.fail("curvature fetched again by an edit"))
        pg.edit(Q1, A1)
        pg.edit(Q2, A2)
    again = make_playground(build_llama(len(tiny_tok)), tiny_tok)
    assert again.cache["hit"] is True


JSON = {"content-type": "application/json"}
BAD = [  # (id, path, request keyword arguments, status, text of the error)
    ("empty-answer", "/api/edit", {"json": {"question": Q1, "answer": ""}}, 400, "the new answer is empty"),
    ("blank-question", "/api/edit", {"json": {"question": " \n ", "answer": A1}}, 400, "the question is empty"),
    (
        "long-answer",
        "/api/edit",
        {"json": {"question": Q1, "answer": "x" * 301}},
        400,
        "the new answer is 301 characters long; the playground takes at most 300",
    ),
    ("long-question", "/api/ask", {"json": {"question": "y" * 400}}, 400, "the question is 400 characters long"),
    ("no-answer", "/api/edit", {"json": {"question": Q1}}, 400, "the new answer must be text, got nothing"),
    (
        "number-answer",
        "/api/edit",
        {"json": {"question": Q1, "answer": 5}},
        400,
        "the new answer must be text, got int",
    ),
    ("empty-question", "/api/ask", {"json": {"question": ""}}, 400, "the question is empty"),
    ("not-an-object", "/api/edit", {"json": [Q1, A1]}, 400, "the request body must be a JSON object, got list"),
    (
        "not-json",
        "/api/edit",
        {"content": "{question", "headers": {"content-type": "application/json"}},
        400,
        "the request body is not valid JSON",
    ),
    (
        "form-post",
        "/api/edit",
        {"content": "question=a&answer=b", "headers": {"content-type": "application/x-www-form-urlencoded"}},
        415,
        "send the request as JSON",
    ),
    ("undo-not-json", "/api/undo", {}, 415, "send the request as JSON"),  # a cross-site form cannot undo either
    # valid JSON the decoder cannot take (it recurses once per level) and text no tokenizer takes
    (
        "nested-100000-deep",
        "/api/edit",
        {"content": "[" * 100_000 + "]" * 100_000, "headers": JSON},
        400,
        "the request body is nested too deeply",
    ),
    (
        "nested-object",
        "/api/ask",
        {"content": '{"a":' * 100_000 + "1" + "}" * 100_000, "headers": JSON},
        400,
        "the request body is nested too deeply",
    ),
    (
        "lone-surrogate-ask",
        "/api/ask",
        {"content": '{"question": "\\ud800"}', "headers": JSON},
        400,
        "the question holds a lone surrogate (character 1), which is not text",
    ),
    (
        "lone-surrogate-edit",
        "/api/edit",
        {"content": '{"question": "Who?", "answer": "Ma\\udfffra"}', "headers": JSON},
        400,
        "the new answer holds a lone surrogate (character 3), which is not text",
    ),
]


@pytest.mark.parametrize("case,path,kwargs,status,msg", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_refused_and_changes_nothing(case, path, kwargs, status, msg, edited):
    pg, client = edited
    before, edits = bits(pg.model), pg.state()["edits"]
    assert len(edits) == 1
    r = client.post(path, **kwargs)
    assert r.status_code == status and msg in r.json()["error"] and "\n" not in r.json()["error"], r.text
    assert same(bits(pg.model), before) and pg.state()["edits"] == edits


def test_another_host_is_refused(edited):
    r = edited[1].get("/api/state", headers={"host": "attacker.example"})
    assert r.status_code == 400 and "Invalid host" in r.json()["error"]


LOOPBACK_SPELLINGS = [
    "127.0.0.1",
    "127.0.0.1:8000",
    "localhost",
    "localhost:8000",
    "LocalHost:1",
    "[::1]",
    "[::1]:8000",
    "::1",
    "[0:0:0:0:0:0:0:1]:80",
    "localhost:",
]
OTHER_HOSTS = [
    "attacker.example",
    "attacker.example:8000",
    "127.0.0.1.attacker.example",
    "[::2]:8000",
    "[::1",
    "[::1]x",
    "localhost:8000:1",
    "localhost:http",
    "::1]",
    "",
    " ",
]


@pytest.mark.parametrize("header", LOOPBACK_SPELLINGS)
def test_every_loopback_spelling_is_served(header, edited):
    """The Host header of every spelling of this machine's names a browser sends (with a port or not, an IPv6
    address in brackets) is answered; the allowed list holds ``::1`` while the header carries ``[::1]``."""
    r = edited[1].get("/api/state", headers={"host": header})
    assert r.status_code == 200 and r.json()["model"] == "tiny", r.text


@pytest.mark.parametrize("header", OTHER_HOSTS)
def test_other_and_malformed_hosts_are_refused(header, edited):
    r = edited[1].get("/api/state", headers={"host": header})
    assert r.status_code == 400 and r.json()["error"].startswith("Invalid host header"), r.text
    assert not host_allowed(header, ["127.0.0.1", "localhost", "::1"])


def test_host_allowed_compares_names_and_addresses():
    assert host_allowed("[::1]:8000", ["::1"]) and host_allowed("[::1]", ["[::1]"]) and host_allowed("::1", ["[0::1]"])
    assert host_allowed("127.0.0.2:80", ["127.0.0.2"]) and not host_allowed("127.0.0.2:80", ["127.0.0.1"])
    assert not host_allowed(None, ["localhost"]) and not host_allowed("localhost", [])


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_a_real_client_reaches_the_url_a_loopback_server_prints(host, edited):
    """uvicorn on the address, a real HTTP client on the URL it prints: the Host header it sends is served."""
    import json
    import urllib.request

    try:
        bind(host, 0).close()
    except CrispEditError as exc:
        pytest.skip(f"no {host} here: {exc}")
    app = create_app(edited[0])
    with running_server(app, host, 0) as url:
        with urllib.request.urlopen(url + "api/state", timeout=30) as r:
            assert r.status == 200 and json.loads(r.read())["model"] == "tiny"


def hold_edits(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Make every edit wait, once it holds the model, until the second event is set (the first says it waits)."""
    import crispedit.pipeline as api  # the playground edits through pipeline.EditJob

    started, release, real = threading.Event(), threading.Event(), api.edit

    def held_edit(*args, **kwargs):
        started.set()
        assert release.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "edit", held_edit)
    return started, release


def test_a_request_while_an_edit_runs_is_told_busy(pg, client, monkeypatch):
    started, release = hold_edits(monkeypatch)
    out: dict = {}
    worker = threading.Thread(target=lambda: out.setdefault("r", pg.edit(Q1, A1)))
    worker.start()
    try:
        assert started.wait(30)
        for path, body in (
            ("/api/edit", {"question": Q2, "answer": A2}),
            ("/api/ask", {"question": Q2}),
            ("/api/undo", {}),
        ):
            r = client.post(path, json=body)
            assert r.status_code == 409 and r.json()["busy"] is True, r.text
            assert r.json()["error"].startswith("busy: an edit is running (")
        assert client.get("/api/state").json()["busy"] == "an edit"  # the page can still look
    finally:
        release.set()
        worker.join(60)
    assert [e["question"] for e in out["r"]["state"]["edits"]] == [Q1]  # only the first edit happened
    with pytest.raises(PlaygroundBusy, match="another request is running|busy"):
        with pg._hold("x"), pg._hold("y"):
            pass


def test_a_failed_edit_is_rolled_back(pg, client, monkeypatch):
    """An edit that leaves non-finite weights is taken back before the error reaches the page."""
    import crispedit.pipeline as api  # the playground edits through pipeline.EditJob

    real = api.edit

    def poisoned(model, *args, **kwargs):
        result = real(model, *args, **kwargs)
        with torch.no_grad():
            model.get_parameter("model.layers.2.mlp.down_proj.weight")[0, 0] = float("nan")
        return result

    before = bits(pg.model)
    monkeypatch.setattr(api, "edit", poisoned)
    r = client.post("/api/edit", json={"question": Q1, "answer": A1})
    assert r.status_code == 400 and "non-finite" in r.json()["error"] and "rolled back" in r.json()["error"]
    assert same(bits(pg.model), before) and pg.edits == []


def test_undo_depth_keeps_the_latest_deltas_only(tiny_lm, iso_cache):
    pg = make_playground(*tiny_lm, undo_depth=1)
    pg.edit(Q1, A1)
    after1 = bits(pg.model)
    pg.edit(Q2, A2)
    assert [e["undoable"] for e in pg.state()["edits"]] == [False, True]
    pg.undo()
    assert same(bits(pg.model), after1)
    with pytest.raises(CrispEditError, match=r"the 1 edit\(s\) left are older than the undo depth \(1\)"):
        pg.undo()
    assert same(bits(pg.model), after1)


def test_the_page_needs_no_network(edited):
    client = edited[1]
    r = client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in r.headers["content-security-policy"]
    for path in STATIC_FILES:
        text = client.get(path).text
        assert 'id="question"' in text or path != "/"
        assert "http://" not in text and "https://" not in text, path  # no CDN, no remote font


def test_missing_fastapi_is_one_line(monkeypatch, tiny_model_dir, capsys):
    import crispedit.playground.server as server

    real = server.importlib.util.find_spec
    monkeypatch.setattr(
        server.importlib.util, "find_spec", lambda name, *a: None if name == "fastapi" else real(name, *a)
    )
    with pytest.raises(CrispEditError, match=r"needs fastapi, which is not installed: pip install fastapi \(or"):
        require_web_packages()
    assert main(["playground", "--model", str(tiny_model_dir)]) == 2
    err = capsys.readouterr().err
    assert err.count("crispedit: error:") == 1 and "needs fastapi" in err


@pytest.mark.parametrize(
    "flag,value,msg",
    [
        ("--port", 70000, "--port must be"),
        ("--kl-texts", 0, "--kl-texts must be"),
        ("--max-chars", -1, "--max-chars must be"),
        ("--gamma", 1.5, "gamma must"),
    ],
)
def test_cli_refuses_bad_flags_before_loading(flag, value, msg, tiny_model_dir, monkeypatch, capsys):
    import crispedit.models

    monkeypatch.setattr(crispedit.models, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["playground", "--model", str(tiny_model_dir), flag, str(value)]) == 2
    err = capsys.readouterr().err
    assert err.count("crispedit: error:") == 1 and msg in err, err


def test_cli_refuses_a_taken_port_before_loading(tiny_model_dir, monkeypatch, capsys):
    import crispedit.models

    monkeypatch.setattr(crispedit.models, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    taken = bind("127.0.0.1", 0)
    taken.listen()
    try:
        port = taken.getsockname()[1]
        assert main(["playground", "--model", str(tiny_model_dir), "--port", str(port)]) == 2
    finally:
        taken.close()
    err = capsys.readouterr().err
    assert err.count("crispedit: error:") == 1 and f"cannot listen on 127.0.0.1:{port}" in err, err


@pytest.mark.parametrize("host", ["::1", "[::1]", "127.0.0.2"])
def test_cli_on_a_loopback_address_answers_at_the_url_it_prints(host, tiny_model_dir, iso_cache, monkeypatch, capsys):
    """``--host`` in another loopback spelling: the URL the command prints is one its server answers (the Host
    header a browser sends for it is allowed), and it still refuses other hosts."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    import crispedit.playground.server as server

    try:
        bind(host, 0).close()
    except CrispEditError as exc:
        pytest.skip(f"no {host} here: {exc}")
    seen = {}

    def serve(app, sock):
        seen["url"] = url_of(sock)
        with TestClient(app, base_url=seen["url"].rstrip("/")) as c:
            seen["state"] = c.get("/api/state")
            seen["other"] = c.get("/api/state", headers={"host": "attacker.example"})

    monkeypatch.setattr(server, "serve", serve)
    assert (
        main(
            [
                "playground",
                "--model",
                str(tiny_model_dir),
                "--host",
                host,
                "--port",
                "0",
                "--layers",
                LAYERS,
                "--n-cap",
                "4",
                "--max-len",
                "32",
                "--kl-texts",
                "1",
                "--quiet",
            ]
        )
        == 0
    )
    assert f"crispedit playground: {seen['url']}" in capsys.readouterr().out
    assert seen["state"].status_code == 200, seen["state"].text
    assert seen["other"].status_code == 400


def test_cli_serves_the_playground(tiny_model_dir, iso_cache, monkeypatch, capsys):
    """The command's wiring: flags -> model -> playground -> app on a free port (the serving loop replaced by
    a few requests)."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    import crispedit.playground.server as server

    seen = {}

    def serve(app, sock):
        seen["port"] = sock.getsockname()[1]
        with TestClient(app, base_url="http://127.0.0.1") as c:
            seen["state"] = c.get("/api/state").json()
            seen["edit"] = c.post("/api/edit", json={"question": Q1, "answer": A1}).json()

    monkeypatch.setattr(server, "serve", serve)
    argv = [
        "playground",
        "--model",
        str(tiny_model_dir),
        "--port",
        "0",
        "--layers",
        LAYERS,
        "--n-cap",
        "4",
        "--max-len",
        "32",
        "--epochs",
        "2",
        "--kl-texts",
        "1",
        "--gamma",
        "0.7",
        "--quiet",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert seen["port"] > 0 and f"crispedit playground: http://127.0.0.1:{seen['port']}/" in out
    assert "curvature of 2 edit layer(s) from a new collection" in out
    assert seen["state"]["model"] == str(tiny_model_dir) and seen["state"]["gamma"] == 0.7
    assert seen["edit"]["epochs"] <= 2 and seen["edit"]["drift"]["texts"] == 1


def chromium() -> str | None:
    """The chromium the browser test drives: ``$CRISPEDIT_CHROMIUM``, else one on the PATH."""
    given = os.environ.get("CRISPEDIT_CHROMIUM")
    if given:
        return given if os.access(given, os.X_OK) else None
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


def test_the_page_in_a_browser(pg, monkeypatch):
    """Ask -> answer shown; edit -> new answer, WILD qa check, drift and time shown, weights changed; a second
    edit while one runs -> busy; undo -> weights bit for bit as before; empty answer -> error shown, nothing
    changed."""
    exe = chromium()
    if exe is None:
        pytest.skip(
            "no chromium executable found (apt-get install chromium, or set CRISPEDIT_CHROMIUM); "
            "the API tests above cover the server without a browser"
        )
    pytest.importorskip("playwright", reason="playwright is not installed (pip install playwright)")
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=20_000)  # a shared 2-core machine
    base = bits(pg.model)
    with running_server(create_app(pg)) as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, headless=True)
        try:
            page = browser.new_page()
            page.goto(url)
            expect(page.locator("#info")).to_contain_text("tiny · crispedit, γ 0.8 · 2 edit layer(s)")
            page.fill("#question", Q1)
            page.click("#ask")
            expect(page.locator("#answer")).to_have_attribute("data-state", "done")
            assert page.locator("#answer").inner_text().strip()

            started, release = hold_edits(monkeypatch)
            page.fill("#target", A1)
            page.click("#edit")
            assert started.wait(30)
            expect(page.locator("#status")).to_contain_text("editing")
            page.click("#edit")  # a second Edit while the first trains
            expect(page.locator("#error")).to_contain_text("busy: an edit is running (")
            release.set()
            expect(page.locator("#result")).to_have_attribute("data-edits", "1", timeout=60_000)
            expect(page.locator("#error")).to_be_hidden()
            expect(page.locator("#wild")).to_contain_text("answered")
            expect(page.locator("#wild-prompt")).to_contain_text(f"Q: {Q1}")
            expect(page.locator("#drift")).to_contain_text("nats/token on 2 held-out paragraph(s) (predicted")
            timing = re.compile(r"^edit [0-9.e-]+ s \(\d+ epochs?\), measuring [0-9.e-]+ s, [0-9.e-]+ s in all$")
            expect(page.locator("#edit-time")).to_have_text(timing)
            expect(page.locator("#edits li")).to_have_text([f"{Q1} → {A1}"])
            assert changed(base, bits(pg.model)) == set(pg.params)

            page.click("#undo")
            expect(page.locator("#undo-result")).to_contain_text(f"undone “{Q1} → {A1}”")
            expect(page.locator("#edits li")).to_have_count(0)
            expect(page.locator("#undo")).to_be_disabled()
            assert same(bits(pg.model), base)

            page.fill("#target", "")
            page.click("#edit")
            expect(page.locator("#error")).to_have_text("the new answer is empty")
            expect(page.locator("#status")).to_have_text("ready")
            assert same(bits(pg.model), base) and pg.edits == []
        finally:
            browser.close()


@pytest.mark.slow
def test_one_smollm2_edit_in_the_playground_answers_and_undoes(iso_cache):
    """The real model behind the real server: one edit (curvature fetched before the clock starts) answers, and undo
    gives the start-up weights back bit for bit. Its time is printed (docs/cli.md); the bound is a guard against
    gross slowdowns (bf16 emulated on an AVX2 CPU took 292 s), not a speed target: about a minute is usual."""
    pytest.importorskip("fastapi")
    import httpx

    from crispedit.models import load_model

    model, tok = load_model("smollm2")
    pg = Playground(model, tok, name="smollm2")
    base = {n: p.detach().clone() for n, p in pg.params.items()}
    with running_server(create_app(pg)) as url, httpx.Client(base_url=url.rstrip("/"), timeout=300) as http:
        assert http.post("/api/ask", json={"question": "What is the capital of France?"}).status_code == 200
        t0 = time.perf_counter()
        r = http.post(
            "/api/edit", json={"question": "Which river system contains Charity Creek?", "answer": "Chichester River"}
        )
        seconds = time.perf_counter() - t0
        assert r.status_code == 200, r.text
        print(
            f"\none SmolLM2 edit in the playground: {seconds:.1f} s ({r.json()['edit_seconds']} s training, "
            f"{r.json()['epochs']} epochs, {r.json()['eval_seconds']} s measuring)"
        )
        assert seconds <= 150, f"one edit took {seconds:.1f} s ({r.json()['edit_seconds']} s training)"
        assert r.json()["drift"]["measured"] >= 0 and "Charity Creek" in r.json()["wild_qa"]["prompt"]
        assert http.post("/api/undo", json={}).status_code == 200
    assert all(torch.equal(p.detach(), base[n]) for n, p in pg.params.items())


def test_playground_config_doubles_only_a_default_learning_rate_per_family():
    """The playground's edit: bf16 forward where native (auto), twice the family's default lr (Gemma-3's scaling kept);
    a given lr kept."""
    from crispedit.editing.config import EditConfig
    from crispedit.playground.engine import playground_config

    c = playground_config(None, "llama")
    assert (c.precision, c.lr) == ("auto", pytest.approx(1e-3))
    assert playground_config(None, "gemma3_text").lr == pytest.approx(1e-4)
    assert playground_config(EditConfig(lr=3e-4), "llama").lr == pytest.approx(3e-4)
    assert playground_config(EditConfig(precision="fp32").validate(), "llama").lr == pytest.approx(1e-3)
