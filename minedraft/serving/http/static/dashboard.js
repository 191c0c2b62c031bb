// minedraft dashboard: streams a completion, and redraws three canvas charts from /metrics and
// /dashboard/timeline every REFRESH_MS. No libraries: everything is fetched from this server.
"use strict";
const REFRESH_MS = 500;
const COLORS = ["#4C72B0", "#DD8452"];
const state = { acceptance: [], throughput: [], lastTokens: null, lastT: null, metrics: {} };
window.minedraftDashboard = state;  // read by the tests

function parseMetrics(text) {
  // Prometheus text format: "name{label="v",...} value" per line; "#" lines are help/type.
  const out = {};
  for (const line of text.split("\n")) {
    if (!line || line[0] === "#") continue;
    const m = line.match(/^([a-zA-Z_:][\w:]*)(?:\{([^}]*)\})?\s+(\S+)/);
    if (!m) continue;
    const labels = {};
    for (const kv of (m[2] || "").matchAll(/(\w+)="([^"]*)"/g)) labels[kv[1]] = kv[2];
    (out[m[1]] = out[m[1]] || []).push({ labels, value: parseFloat(m[3]) });
  }
  return out;
}

function one(metrics, name) {
  const s = metrics[name];
  return s && s.length ? s[0].value : 0;
}

function setupCanvas(id) {
  const c = document.getElementById(id);
  const g = c.getContext("2d");
  g.clearRect(0, 0, c.width, c.height);
  g.font = "11px system-ui, sans-serif";
  return [c, g];
}

function drawAcceptance() {
  const [c, g] = setupCanvas("acceptance");
  const vals = state.acceptance;
  const left = 34, bottom = c.height - 22, top = 10, h = bottom - top;
  g.strokeStyle = "#ccc"; g.fillStyle = "#555";
  for (const y of [0, 0.25, 0.5, 0.75, 1]) {
    const py = bottom - y * h;
    g.beginPath(); g.moveTo(left, py); g.lineTo(c.width - 6, py); g.stroke();
    g.fillText(y.toFixed(2), 2, py + 4);
  }
  if (!vals.length) { g.fillText("no drafts yet", left + 10, top + 20); return; }
  const w = (c.width - left - 10) / vals.length;
  vals.forEach((v, i) => {
    g.fillStyle = COLORS[0];
    g.fillRect(left + i * w + 4, bottom - v * h, w - 8, v * h);
    g.fillStyle = "#222";
    g.fillText((100 * v).toFixed(0) + "%", left + i * w + w / 2 - 10, bottom - v * h - 3);
    g.fillText("pos " + i, left + i * w + w / 2 - 14, c.height - 6);
  });
  c.dataset.values = JSON.stringify(vals);
}

function drawThroughput() {
  const [c, g] = setupCanvas("throughput");
  const pts = state.throughput, left = 40, bottom = c.height - 20, top = 10, h = bottom - top;
  const max = Math.max(10, ...pts.map(p => p.v));
  g.strokeStyle = "#ccc"; g.fillStyle = "#555";
  for (const f of [0, 0.5, 1]) {
    const py = bottom - f * h;
    g.beginPath(); g.moveTo(left, py); g.lineTo(c.width - 6, py); g.stroke();
    g.fillText((f * max).toFixed(0), 2, py + 4);
  }
  g.fillText("-60 s", left, c.height - 5); g.fillText("now", c.width - 30, c.height - 5);
  if (pts.length < 2) return;
  const now = pts[pts.length - 1].t, x = t => left + (1 - (now - t) / 60) * (c.width - left - 6);
  g.strokeStyle = COLORS[1]; g.lineWidth = 2; g.beginPath();
  pts.forEach((p, i) => { const px = x(p.t), py = bottom - (p.v / max) * h; i ? g.lineTo(px, py) : g.moveTo(px, py); });
  g.stroke(); g.lineWidth = 1;
  c.dataset.last = String(pts[pts.length - 1].v);
}

function drawTimeline(tl) {
  const [c, g] = setupCanvas("timeline");
  const left = 60, right = c.width - 8, lanes = { verifier: 24, drafter: 62 }, win = tl.window_s;
  const x = t => left + (1 + t / win) * (right - left);
  g.fillStyle = "#555";
  for (const [lane, y] of Object.entries(lanes)) g.fillText(lane, 2, y + 14);
  COLORS.forEach((col, b) => {  // legend
    g.fillStyle = col; g.fillRect(right - 150 + 75 * b, 2, 10, 10);
    g.fillStyle = "#555"; g.fillText("batch " + b, right - 136 + 75 * b, 11);
  });
  for (let i = 0; i <= 4; i++) {
    const t = -win + (i * win) / 4;
    g.fillText((t * 1000).toFixed(0) + " ms", x(t) - 18, c.height - 4);
  }
  for (const [lane, batch, t0, t1] of tl.intervals) {
    if (t1 < -win) continue;
    const x0 = x(Math.max(t0, -win)), x1 = x(t1);
    g.fillStyle = COLORS[batch % 2];
    g.fillRect(x0, lanes[lane], Math.max(1, x1 - x0), 24);
  }
  c.dataset.intervals = String(tl.intervals.length);
  c.dataset.batches = String(new Set(tl.intervals.map(iv => iv[1])).size);
}

function showStats(m) {
  const drafted = one(m, "minedraft_draft_tokens_total"), acc = one(m, "minedraft_accepted_tokens_total");
  const items = [["running", one(m, "minedraft_requests_running")], ["waiting", one(m, "minedraft_requests_waiting")],
    ["KV blocks free", one(m, "minedraft_kv_blocks_free") + " / " + one(m, "minedraft_kv_blocks_total")],
    ["tokens", one(m, "minedraft_output_tokens_total")],
    ["acceptance", drafted ? (100 * acc / drafted).toFixed(1) + "%" : "–"],
    ["prefix cache", (100 * one(m, "minedraft_prefix_cache_hit_rate")).toFixed(1) + "% of prompt tokens hit, " +
      one(m, "minedraft_prefix_cache_blocks") + " blocks, " + one(m, "minedraft_prefix_cache_evictions_total") +
      " evicted"],
    ["requests", (m.minedraft_requests_total || []).map(s => s.labels.outcome + " " + s.value).join(", ")]];
  const el = document.getElementById("stats");
  el.replaceChildren(...items.map(([k, v]) => { const s = document.createElement("span"); s.textContent = k + ": " + v; return s; }));
}

async function refresh() {
  try {
    const [mr, tr, hr] = await Promise.all([fetch("/metrics"), fetch("/dashboard/timeline"), fetch("/health")]);
    const m = parseMetrics(await mr.text()), tl = await tr.json(), h = await hr.json();
    if (state.chatDefault === undefined) chatDefaults(tl.chat);
    state.metrics = m;
    const pos = (m.minedraft_acceptance_by_position || []).slice()
      .sort((a, b) => a.labels.position - b.labels.position);
    state.acceptance = pos.map(s => s.value);
    const t = performance.now() / 1000, tokens = one(m, "minedraft_output_tokens_total");
    if (state.lastT !== null) {
      state.throughput.push({ t, v: Math.max(0, tokens - state.lastTokens) / (t - state.lastT) });
      state.throughput = state.throughput.filter(p => p.t > t - 60);
    }
    state.lastTokens = tokens; state.lastT = t;
    document.getElementById("info").textContent = `${tl.model} · mode ${tl.mode} · k ${tl.k}`;
    const badge = document.getElementById("health");
    badge.textContent = h.ok ? "healthy" : "dead"; badge.className = "badge " + (h.ok ? "ok" : "dead");
    drawAcceptance(); drawThroughput(); drawTimeline(tl); showStats(m);
  } catch (e) {
    document.getElementById("health").textContent = "unreachable";
  }
}

const TEXT_PROMPT = "The while statement is used for", CHAT_PROMPT = "What is a lighthouse?";

function chatDefaults(chat) {
  // a chat model (its template ends a turn with its eos) gets a question through /v1/chat/completions by default
  state.chatDefault = !!chat;
  document.getElementById("chat").checked = !!chat;
  const p = document.getElementById("prompt");
  if (chat && p.value === TEXT_PROMPT) p.value = CHAT_PROMPT;
}

async function generate() {
  const out = document.getElementById("output"), status = document.getElementById("status");
  const key = document.getElementById("api-key").value;
  out.textContent = ""; status.textContent = "streaming…";
  const chat = document.getElementById("chat").checked, text = document.getElementById("prompt").value;
  const body = { ...(chat ? { messages: [{ role: "user", content: text }] } : { prompt: text }), stream: true,
    max_tokens: parseInt(document.getElementById("max-tokens").value, 10),
    temperature: parseFloat(document.getElementById("temperature").value) };
  const headers = { "Content-Type": "application/json" };
  if (key) headers.Authorization = "Bearer " + key;
  const r = await fetch(chat ? "/v1/chat/completions" : "/v1/completions",
    { method: "POST", headers, body: JSON.stringify(body) });
  if (!r.ok) { status.textContent = "error " + r.status + ": " + (await r.json()).error.message; return; }
  const reader = r.body.getReader(), dec = new TextDecoder();
  let buf = "", finish = null;
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    buf += dec.decode(value, { stream: true }).replace(/\r\n/g, "\n");
    let i;
    while ((i = buf.indexOf("\n\n")) >= 0) {  // one server-sent event per blank-line-terminated block
      const ev = buf.slice(0, i); buf = buf.slice(i + 2);
      for (const line of ev.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") continue;
        const j = JSON.parse(data);
        if (j.error) { status.textContent = "error: " + j.error.message; continue; }
        if (!j.choices.length) continue;  // a usage chunk
        out.textContent += chat ? (j.choices[0].delta.content || "") : j.choices[0].text;
        if (j.choices[0].finish_reason) finish = j.choices[0].finish_reason;
      }
    }
  }
  status.textContent = "done (" + finish + ")";
}

document.getElementById("send").addEventListener("click", () => generate().catch(e => {
  document.getElementById("status").textContent = "failed: " + e;
}));
refresh();
setInterval(refresh, REFRESH_MS);
