// goose playground: streams a chat answer from /v1/chat/completions with each token coloured by the draft
// source it was accepted from, live tokens/s and tau, and the same prompt with speculation off beside it.
"use strict";

const $ = (id) => document.getElementById(id);
let model = null;
let history = []; // [{role, content}] of the conversation so far

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("apikey").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function loadInfo() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    const j = await r.json();
    if (!r.ok) throw new Error(j.error ? j.error.message : r.statusText);
    model = j.data[0].id;
    $("model").textContent = model;
  } catch (e) {
    $("model").textContent = "? (" + e.message + ")";
  }
  try {
    const h = await (await fetch("/health")).json();
    $("health").textContent = `${h.running} running, ${h.waiting} waiting`;
  } catch (e) {
    $("health").textContent = "server unreachable";
  }
}

// One streamed chat completion into a pane. Returns {text, tokens, tau, tokS, ttft, method}.
async function run(pane, messages, speculative, maxTokens) {
  const out = $("out-" + pane), stats = $("stats-" + pane);
  out.textContent = "";
  stats.textContent = "waiting…";
  const body = { model, messages, max_tokens: maxTokens, temperature: 0, stream: true,
                 stream_options: { include_usage: true }, sources: true };
  if (speculative) body.speculative = speculative;
  const t0 = performance.now();
  let first = null, tokens = 0, calls = 0, text = "", final = null;
  const show = (done) => {
    const now = performance.now();
    const tokS = first !== null && now > first ? (tokens - 1) / ((now - first) / 1000) : 0;
    const tau = calls ? tokens / calls : 0;
    stats.textContent = `${tokens} tokens · ${tokS.toFixed(1)} tok/s · τ ${tau.toFixed(2)}` +
      (first !== null ? ` · TTFT ${Math.round(first - t0)} ms` : "") + (done ? " · done" : "");
    return tokS;
  };
  const resp = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body) });
  if (!resp.ok) {
    let msg = resp.statusText;
    try { msg = (await resp.json()).error.message; } catch (e) { /* not JSON */ }
    throw new Error(`${resp.status}: ${msg}`);
  }
  const reader = resp.body.getReader();
  const dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += dec.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      if (!event.startsWith("data: ")) continue;
      const data = event.slice(6);
      if (data === "[DONE]") continue;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      const g = chunk.goose;
      if (g && g.pieces) {
        if (first === null) first = performance.now();
        for (const [piece, source] of g.pieces) {
          const span = document.createElement("span");
          span.className = "tok src-" + source;
          span.dataset.source = source;
          span.textContent = piece;
          out.appendChild(span);
          text += piece;
        }
        tokens = g.tokens;
        calls = g.forward_calls;
        show(false);
      } else if (chunk.choices && chunk.choices.length && chunk.choices[0].delta && chunk.choices[0].delta.content) {
        text += chunk.choices[0].delta.content; // a tail piece without sources (held-back text)
        const span = document.createElement("span");
        span.className = "tok src-bonus";
        span.dataset.source = "bonus";
        span.textContent = chunk.choices[0].delta.content;
        out.appendChild(span);
      }
      if (chunk.usage && g) final = { usage: chunk.usage, goose: g };
    }
  }
  if (final) {
    tokens = final.usage.completion_tokens;
    calls = final.goose.forward_calls;
  }
  const tokS = show(true);
  return { text, tokens, tokS, tau: calls ? tokens / calls : 0, method: final ? final.goose.method : "?" };
}

function addTurn(role, content) {
  const div = document.createElement("div");
  div.className = "turn " + role;
  div.textContent = (role === "user" ? "you: " : "goose: ") + content;
  $("history").appendChild(div);
}

async function send(ev) {
  if (ev) ev.preventDefault();
  const prompt = $("prompt").value;
  if (!prompt.trim() || $("send").disabled) return;
  if (!model) await loadInfo();
  const maxTokens = parseInt($("maxtokens").value, 10) || 128;
  const compare = $("compare").checked;
  const messages = history.concat([{ role: "user", content: prompt }]);
  $("panes").classList.toggle("single", !compare);
  $("send").disabled = true;
  const verdict = $("verdict");
  verdict.className = "";
  verdict.dataset.state = "running";
  verdict.textContent = "generating…";
  $("out-off").textContent = "";
  $("stats-off").textContent = compare ? "queued after the speculative run" : "–";
  try {
    const spec = await run("goose", messages, $("method").value || null, maxTokens);
    $("name-goose").textContent = "(" + spec.method + ")";
    let msg = `speculative: ${spec.tokS.toFixed(1)} tok/s, τ ${spec.tau.toFixed(2)}`;
    if (compare) {
      const off = await run("off", messages, "off", maxTokens);
      const same = off.text === spec.text;
      msg += ` · off: ${off.tokS.toFixed(1)} tok/s · speed-up ${(spec.tokS / Math.max(off.tokS, 1e-9)).toFixed(2)}x · ` +
        (same ? "identical text ✓" : "texts differ ✗");
      if (!same) verdict.className = "bad";
    }
    history = messages.concat([{ role: "assistant", content: spec.text }]);
    addTurn("user", prompt);
    addTurn("assistant", spec.text);
    verdict.textContent = msg;
    verdict.dataset.state = "done";
  } catch (e) {
    verdict.className = "bad";
    verdict.textContent = "error: " + e.message;
    verdict.dataset.state = "error";
  } finally {
    $("send").disabled = false;
    loadInfo();
  }
}

$("form").addEventListener("submit", send);
$("prompt").addEventListener("keydown", (e) => { if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) send(e); });
$("clear").addEventListener("click", () => { history = []; $("history").textContent = ""; });
$("apikey").addEventListener("change", loadInfo);
loadInfo();
