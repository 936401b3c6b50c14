// crispedit playground: ask, edit, undo. Every text the server returns is put in with textContent.
"use strict";

const $ = (id) => document.getElementById(id);
let pending = 0;
let ticker = null;

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = false;
}

function clearError() {
  $("error").hidden = true;
  $("error").textContent = "";
}

function working(label) {
  pending += 1;
  const t0 = Date.now();
  const status = $("status");
  status.dataset.state = "working";
  const tick = () => { status.textContent = `${label}… ${Math.round((Date.now() - t0) / 1000)} s`; };
  tick();
  clearInterval(ticker);
  ticker = setInterval(tick, 500);
  return () => {
    pending -= 1;
    if (pending === 0) {
      clearInterval(ticker);
      status.dataset.state = "idle";
      status.textContent = "ready";
    }
  };
}

async function call(path, body) {
  const init = body === undefined ? {} : {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
  };
  const response = await fetch(path, init);
  let data;
  try {
    data = await response.json();
  } catch (e) {
    throw new Error(`the server answered ${response.status} without JSON`);
  }
  if (!response.ok) {
    throw new Error(data.error || `the server answered ${response.status}`);
  }
  return data;
}

function fmt(x) {
  if (x === null || x === undefined) return "–";
  if (Math.abs(x) >= 1000) return String(Math.round(x));
  return Math.abs(x) < 1e-3 && x !== 0 ? x.toExponential(2) : x.toPrecision(3);
}

function renderState(state) {
  const layers = state.layers.length > 2 ? `${state.layers[0]} … ${state.layers[state.layers.length - 1]}`
    : state.layers.join(", ");
  const curv = state.curvature.hit ? "loaded from the cache" : "collected at start-up";
  $("info").textContent = `${state.model} · ${state.method}, γ ${state.gamma} · `
    + `${state.layers.length} edit layer(s): `
    + `${layers} · curvature ${curv} (${fmt(state.curvature.seconds)} s) · questions asked through the ${state.via}`;
  const list = $("edits");
  list.replaceChildren(...state.edits.map((e) => {
    const li = document.createElement("li");
    li.textContent = `${e.question} → ${e.answer}${e.undoable ? "" : " (past the undo depth)"}`;
    return li;
  }));
  const last = state.edits[state.edits.length - 1];
  $("undo").disabled = !(last && last.undoable);
}

function shown(answer) {
  return answer ? answer : "(empty: the model ended its reply at once)";
}

async function run(label, action) {
  clearError();
  const done = working(label);
  try {
    await action();
    clearError(); // a "busy" refusal shown while this request ran is out of date now
  } catch (e) {
    showError(e.message);
  } finally {
    done();
  }
}

function ask() {
  return run("asking", async () => {
    const r = await call("/api/ask", { question: $("question").value });
    $("answer").textContent = shown(r.answer);
    $("answer").dataset.state = "done";
  });
}

function edit() {
  return run("editing (training, then measuring)", async () => {
    const r = await call("/api/edit", { question: $("question").value, answer: $("target").value,
                                        subject: $("subject").value });
    $("new-answer").textContent = shown(r.answer);
    const wild = $("wild");
    const verdict = r.wild_qa.correct ? "✓ correct" : "✗ not the new answer";
    wild.textContent = `${verdict} — answered “${r.wild_qa.answer}”`;
    wild.className = r.wild_qa.correct ? "ok" : "no";
    $("wild-prompt").textContent = r.wild_qa.prompt;
    const d = r.drift;
    $("drift").textContent = `measured ${fmt(d.measured)} nats/token on ${d.texts} held-out paragraph(s) `
      + `(predicted ${fmt(d.predicted)}; this edit alone predicted ${fmt(d.edit_predicted)}); `
      + `perplexity ${fmt(d.ppl)} (start-up ${fmt(d.ppl_base)})`;
    const st = r.style;
    $("style").textContent = `length ×${fmt(st.length_ratio)} of the start-up model's, ${st.n} prompts; `
      + `${Math.round(100 * st.bare_share)} % turned into a bare phrase, ${Math.round(100 * st.changed)} % changed `
      + `(e.g. “${st.examples[0].prompt}” → “${st.examples[0].edited}”)`;
    const b = r.bleed;
    $("bleed").textContent = !b ? "give a subject to check"
      : `${Math.round(100 * b.target)} % of ${b.n} now name the new answer, ${Math.round(100 * b.changed)} % changed`;
    const epochs = `${r.epochs} epoch${r.epochs === 1 ? "" : "s"}`;
    $("edit-time").textContent = `edit ${fmt(r.edit_seconds)} s (${epochs}), measuring `
      + `${fmt(r.eval_seconds)} s, ${fmt(r.seconds)} s in all`;
    $("result").hidden = false;
    $("result").dataset.edits = String(r.state.edits.length);
    $("undo-result").textContent = "";
    renderState(r.state);
  });
}

function undo() {
  return run("undoing", async () => {
    const r = await call("/api/undo", {});
    $("undo-result").textContent = `undone “${r.undone.question} → ${r.undone.answer}”; `
      + `the model now answers: ${shown(r.answer)}`;
    renderState(r.state);
  });
}

document.addEventListener("DOMContentLoaded", () => {
  $("ask").addEventListener("click", ask);
  $("edit").addEventListener("click", edit);
  $("undo").addEventListener("click", undo);
  $("question").addEventListener("keydown", (e) => { if (e.key === "Enter") ask(); });
  $("target").addEventListener("keydown", (e) => { if (e.key === "Enter") edit(); });
  call("/api/state").then(renderState).catch((e) => showError(e.message));
});
