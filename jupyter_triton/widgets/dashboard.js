// jupyter_triton dashboard view (anywidget ESM; no libraries, nothing from a CDN).
// Figures are deltas of two snapshots of Triton's statistics: keep in step with figures.py.
const SVG = "http://www.w3.org/2000/svg";
const HISTORY = 60;

function pageConfig() {
  const el = document.getElementById("jupyter-config-data");
  if (!el) return null;
  try { return JSON.parse(el.textContent || "{}"); } catch (e) { return null; }
}

function count(m, phase) {
  const d = ((m.inference_stats || {})[phase]) || {};
  return [d.count || 0, d.ns || 0];
}

function histogram(m) {
  const h = [];
  for (const row of m.batch_stats || []) {
    const n = ((row.compute_infer || {}).count) || 0;
    if (n) h.push([row.batch_size, n]);
  }
  return h.sort((a, b) => a[0] - b[0]);
}

// (responses sent, first responses, their ns) from response_stats (decoupled models)
// ragged_batching "pad": padded tokens / request tokens over the interval (since load where
// nothing ran in it); null where the model does not pad. figures.py's padding_waste.
function paddingWaste(p, m) {
  const now = m.padding;
  if (!now) return null;
  const before = (p && p.padding) || {};
  const sent = (now.request_tokens || 0) - (before.request_tokens || 0);
  if (sent > 0) return ((now.batch_tokens || 0) - (before.batch_tokens || 0)) / sent;
  return now.request_tokens > 0 ? (now.batch_tokens || 0) / now.request_tokens : null;
}

function responses(m) {
  let sent = 0, first = 0, firstNs = 0;
  for (const [index, row] of Object.entries(m.response_stats || {})) {
    for (const kind of ["success", "fail"]) {
      const d = row[kind] || {};
      sent += d.count || 0;
      if (index === "0") { first += d.count || 0; firstNs += d.ns || 0; }
    }
  }
  return [sent, first, firstNs];
}

// An ensemble's steps over the interval: mean time (every run's since load where none ran in
// the interval: meanWindow), rate, runs and failures (its ensemble_steps statistics), and the
// composing model's request p50/p99 over its window (its latency histograms: `composing`,
// "name/version" -> quantiles, when the server keeps them).
function steps(p, m, ok, dt, composing) {
  const earlier = new Map(((p && p.ensemble_steps) || []).map(s => [s.step, s]));
  return (m.ensemble_steps || []).map(s => {
    const okNow = s.success || {}, before = ((earlier.get(s.step) || {}).success) || {};
    const failNow = ((s.fail || {}).count) || 0, failBefore = (((earlier.get(s.step) || {}).fail || {}).count) || 0;
    const dr = ok ? (okNow.count || 0) - (before.count || 0) : 0;
    const dns = ok ? (okNow.ns || 0) - (before.ns || 0) : 0;
    const q = (composing && composing.get(s.model + "/" + s.version)) || null;
    const runs = okNow.count || 0;
    const meanUs = dr > 0 ? dns / dr / 1e3 : runs > 0 ? (okNow.ns || 0) / runs / 1e3 : null;
    return { step: s.step, model: s.model, version: String(s.version), meanUs,
             meanWindow: dr > 0 ? "interval" : "since load",
             perS: ok && dt > 0 ? Math.max(0, dr) / dt : 0,
             p50: q ? q.p50 : null, p99: q ? q.p99 : null, percentiles: !!q,
             runs: okNow.count || 0, failures: failNow, failing: ok && failNow > failBefore };
  });
}

// Prometheus' histogram_quantile over cumulative [[bound ms, count]] (Infinity last), as
// protocol/quantiles.py's quantile(); null when empty.
export function quantile(cumulative, q) {
  const total = cumulative.length ? cumulative[cumulative.length - 1][1] : 0;
  if (!total) return null;
  const rank = q * total;
  let lower = 0, below = 0;
  for (const [bound, n] of cumulative) {
    if (n >= rank) {
      if (bound === Infinity) return lower;
      if (n === below) return bound;
      return lower + (bound - lower) * (rank - below) / (n - below);
    }
    lower = bound; below = n;
  }
  return lower;
}

const LATENCY_SHOWN = ["request", "queue", "compute_infer"];
export const HISTOGRAMS_OFF = "enable histogram_latencies for percentiles";

// The recent past of each version's latency histograms (the statistics' latency_histograms),
// over the dashboard's readings, as figures.py's LatencyWindows: from the version's load until
// the first reading is `seconds` old, then the last `seconds`; an emptied window keeps its last
// requests' figures; `window` says which in words.
export function latencyWindows(seconds = 60) { return { seconds, kept: new Map() }; }

function recentQuantiles(windows, key, m, now) {
  const kept = m.latency_histograms;
  if (!kept) return null;
  const out = {};
  for (const kind of LATENCY_SHOWN) {
    const h = kept[kind];
    if (!h) continue;
    const cum = h.cumulative.map((n, i) => [i < h.bounds_ms.length ? h.bounds_ms[i] : Infinity, n]);
    const total = cum.length ? cum[cum.length - 1][1] : 0;
    let w = windows.kept.get(key + "|" + kind);
    if (!w || total < w.total) {       // from the load on: zero counts first (a reload: again)
      w = { snaps: [[now, cum.map(([b]) => [b, 0])]], total: 0, started: now, last: null };
    }
    w.total = total;
    windows.kept.set(key + "|" + kind, w);
    const snaps = w.snaps;
    snaps.push([now, cum]);
    // keep exactly one snapshot at or before the window's start
    while (snaps.length > 2 && snaps[1][0] <= now - windows.seconds) snaps.shift();
    let base = snaps.length > 1 ? snaps[0][1] : cum.map(([b]) => [b, 0]);
    if (base.length !== cum.length || base.some(([b], i) => b !== cum[i][0])) {   // buckets changed
      snaps.splice(0, snaps.length, [now, cum]);
      base = cum.map(([b]) => [b, 0]);
    }
    const win = cum.map(([b, n], i) => [b, n - base[i][1]]);
    let q = { p50: quantile(win, 0.5), p95: quantile(win, 0.95), p99: quantile(win, 0.99),
              count: win.length ? win[win.length - 1][1] : 0 };
    const span = windows.seconds === 60 ? "minute" : `${windows.seconds} s`;
    if (q.count) {
      q.window = now - w.started < windows.seconds ? `${q.count} since load` : `${q.count} in the last ${span}`;
      w.last = q;
    } else if (w.last) q = { ...w.last, window: `the last ${w.last.count}, none in the last ${span}` };
    else q.window = "no requests yet";
    out[kind] = q;
  }
  return out;
}

// `windows` (latencyWindows()): the dashboard's, kept across readings; without it the
// percentiles are since the first reading.
export function figures(prev, cur, windows) {
  windows = windows || latencyWindows();
  const earlier = new Map(((prev && prev.model_stats) || []).map(m => [m.name + "/" + m.version, m]));
  const dt = prev ? cur.t - prev.t : 0;
  // the request percentiles of every model an ensemble step runs on (a window of their own)
  const composing = new Map();
  const needed = new Set([
    ...(cur.model_stats || []).flatMap(m => (m.ensemble_steps || []).map(s => s.model)),
    ...Object.values(cur.graphs || {}).flatMap(g => g.steps.map(s => s.model))]);
  for (const m of [...(cur.model_stats || []), ...(cur.composing || [])]) {
    const key = m.name + "/" + m.version;
    if (!needed.has(m.name) || composing.has(key)) continue;
    const q = recentQuantiles(windows, "step|" + key, m, cur.t);
    if (q && q.request) composing.set(key, q.request);
  }
  const graphs = cur.graphs || {};
  return (cur.model_stats || []).map(m => {
    const key = m.name + "/" + m.version, p = earlier.get(key);
    const ok = !!p && dt > 0 && (m.inference_count || 0) >= (p.inference_count || 0);
    const d = (phase) => ok ? [count(m, phase)[0] - count(p, phase)[0], count(m, phase)[1] - count(p, phase)[1]] : [0, 0];
    const [dq, dqns] = d("queue");
    const dc = d("compute_infer")[0];
    const dcns = d("compute_input")[1] + d("compute_infer")[1] + d("compute_output")[1];
    const decoupled = Object.keys(m.response_stats || {}).length > 0;
    let perRequest = null, firstUs = null;
    if (decoupled && ok) {
      const [s1, f1, n1] = responses(m), [s0, f0, n0] = responses(p);
      const dr = d("success")[0] + d("fail")[0];
      if (dr > 0) perRequest = (s1 - s0) / dr;
      if (f1 > f0) firstUs = (n1 - n0) / (f1 - f0) / 1e3 + (dq > 0 ? dqns / dq / 1e3 : 0);
    }
    return {
      key, name: m.name, version: String(m.version),
      infPerS: ok ? ((m.inference_count || 0) - (p.inference_count || 0)) / dt : 0,
      reqPerS: ok ? d("success")[0] / dt : 0,
      queueUs: dq > 0 ? dqns / dq / 1e3 : null,
      computeUs: dc > 0 ? dcns / dc / 1e3 : null,
      failures: count(m, "fail")[0],
      inferences: m.inference_count || 0,
      executions: m.execution_count || 0,
      batches: histogram(m),
      pending: cur.pending ? (cur.pending[key] ?? null) : null,
      decoupled, responsesPerRequest: perRequest, firstResponseUs: firstUs,
      steps: steps(p, m, ok, dt, composing),
      graph: graphs[m.name] || null,
      latency: recentQuantiles(windows, key, m, cur.t),
      lastRequestS: m.last_inference > 0 ? Math.max(0, cur.t - m.last_inference / 1e3) : null,
      paddingWaste: paddingWaste(ok ? p : null, m),
    };
  });
}

function parsePending(text) {
  const out = {};
  const re = /^nv_inference_pending_request_count\{([^}]*)\}\s+([0-9.eE+-]+)/gm;
  for (const m of text.matchAll(re)) {
    const labels = Object.fromEntries([...m[1].matchAll(/(\w+)="([^"]*)"/g)].map(x => [x[1], x[2]]));
    out[labels.model + "/" + labels.version] = Math.round(Number(m[2]));
  }
  return out;
}

const fmt = (v, unit = "") => v === null || v === undefined ? "–"
  : (v < 100 ? v.toFixed(1) : Math.round(v).toLocaleString("en-US")) + unit;

const SVG_TAGS = new Set(["svg", "rect", "polyline", "text", "g", "path", "defs", "marker", "tspan"]);

function el(tag, attrs = {}, text) {
  const e = SVG_TAGS.has(tag) ? document.createElementNS(SVG, tag) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
  if (text !== undefined) e.textContent = text;
  return e;
}

function bars(hist) {
  const w = 220, h = 70, n = Math.max(hist.length, 1), bw = Math.min(28, Math.max(6, Math.floor((w - 4) / n) - 4));
  const max = Math.max(1, ...hist.map(x => x[1]));
  const svg = el("svg", { class: "jt-hist", width: w, height: h + 16, viewBox: `0 0 ${w} ${h + 16}` });
  hist.forEach(([size, c], i) => {
    const bh = Math.max(1, Math.round((c / max) * (h - 12)));
    const x = 2 + i * (bw + 4);
    const r = el("rect", { x, y: h - bh, width: bw, height: bh, class: "jt-bar" });
    r.appendChild(el("title", {}, `batch size ${size}: ${c} executions`));
    svg.appendChild(r);
    svg.appendChild(el("text", { x: x + bw / 2, y: h + 12, class: "jt-axis" }, String(size)));
    svg.appendChild(el("text", { x: x + bw / 2, y: h - bh - 2, class: "jt-count" }, String(c)));
  });
  if (!hist.length) svg.appendChild(el("text", { x: w / 2, y: h / 2, class: "jt-axis" }, "no batches yet"));
  return svg;
}

// When the last request ended, as figures.py's last_request_text() says it.
export function lastRequestText(seconds) {
  if (seconds === null || seconds === undefined) return "";
  const ago = seconds < 1 ? "just now" : seconds < 120 ? `${Math.round(seconds)} s ago`
    : seconds < 7200 ? `${Math.round(seconds / 60)} min ago` : `${Math.round(seconds / 3600)} h ago`;
  return `last request ${ago}`;
}

// The readings' inferences/s; with no traffic in them, says so and when the last request was
// (a flat line at zero, or one point, reads as an empty plot).
export function spark(values, lastRequestS) {
  const w = 220, h = 40, max = Math.max(1e-9, ...values);
  const pts = values.map((v, i) => `${(i / Math.max(1, HISTORY - 1)) * w},${h - 2 - (v / max) * (h - 4)}`);
  const svg = el("svg", { class: "jt-spark", width: w, height: h, viewBox: `0 0 ${w} ${h}` });
  svg.appendChild(el("polyline", { points: pts.join(" "), class: "jt-line" }));
  if (!values.some(v => v > 0)) {
    const last = lastRequestText(lastRequestS);
    svg.appendChild(el("text", { x: w / 2, y: h / 2, class: "jt-axis jt-idle" },
                       last ? `idle since the dashboard opened · ${last}` : "no requests yet"));
  }
  return svg;
}

// An ensemble's config (GET v2/models/{name}/config) as the graph draws it: steps with
// their input and output maps, the ensemble's inputs and outputs.
export function ensembleGraph(config) {
  const sched = (config && config.ensemble_scheduling) || {};
  return {
    inputs: (config.input || []).map(t => t.name),
    outputs: (config.output || []).map(t => t.name),
    steps: (sched.step || []).map((s, i) => ({ step: i + 1, model: s.model_name,
                                               inputs: s.input_map || {}, outputs: s.output_map || {} })),
  };
}

// Steps as boxes in columns by depth, tensors as arrows (named) from the step that produces
// them to those that read them; the ensemble's inputs and outputs as the first and last box.
// Each box: the step's rate, its model's p50/p99 and failures; a step that failed is marked.
export function graphSvg(graph, stepRows) {
  const BW = 168, BH = 70, GX = 86, GY = 18, PAD = 8;
  const byStep = new Map((stepRows || []).map(s => [s.step, s]));
  const producer = new Map(graph.inputs.map(t => [t, "in"]));
  const depth = new Map([["in", 0]]);
  const left = [...graph.steps];
  for (let guard = 0; left.length && guard < 1000; guard++) {
    const i = left.findIndex(s => Object.values(s.inputs).every(t => producer.has(t)));
    if (i < 0) break;                 // a cycle or a missing tensor: the rest is drawn last
    const s = left.splice(i, 1)[0];
    depth.set(s.step, 1 + Math.max(0, ...Object.values(s.inputs).map(t => depth.get(producer.get(t)) || 0)));
    for (const t of Object.values(s.outputs)) producer.set(t, s.step);
  }
  for (const s of left) depth.set(s.step, 1);
  const last = 1 + Math.max(0, ...graph.steps.map(s => depth.get(s.step)));
  depth.set("out", last);
  const columns = new Map();
  for (const [node, d] of depth) { if (!columns.has(d)) columns.set(d, []); columns.get(d).push(node); }
  const rows = Math.max(...[...columns.values()].map(c => c.length));
  const w = PAD * 2 + (last + 1) * BW + last * GX, h = PAD * 2 + rows * BH + (rows - 1) * GY;
  const pos = new Map();
  for (const [d, nodes] of columns) {
    const top = PAD + (h - PAD * 2 - (nodes.length * BH + (nodes.length - 1) * GY)) / 2;
    nodes.forEach((node, i) => pos.set(node, { x: PAD + d * (BW + GX), y: top + i * (BH + GY) }));
  }
  const svg = el("svg", { class: "jt-graph", width: w, height: h, viewBox: `0 0 ${w} ${h}` });
  const defs = el("defs");
  const marker = el("marker", { id: "jt-arrow", viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 7,
                                markerHeight: 7, orient: "auto-start-reverse" });
  marker.appendChild(el("path", { d: "M 0 0 L 10 5 L 0 10 z", class: "jt-arrow-head" }));
  defs.appendChild(marker);
  svg.appendChild(defs);
  // edges: (from, to) -> tensor names
  const edges = new Map();
  const edge = (from, to, t) => {
    const k = `${from}>${to}`;
    if (!edges.has(k)) edges.set(k, { from, to, tensors: [] });
    edges.get(k).tensors.push(t);
  };
  for (const s of graph.steps)
    for (const t of Object.values(s.inputs)) if (producer.has(t)) edge(producer.get(t), s.step, t);
  for (const t of graph.outputs) if (producer.has(t)) edge(producer.get(t), "out", t);
  for (const e of edges.values()) {
    const a = pos.get(e.from), b = pos.get(e.to);
    const x1 = a.x + BW, y1 = a.y + BH / 2, x2 = b.x, y2 = b.y + BH / 2, mx = (x1 + x2) / 2;
    const g = el("g", { class: "jt-edge", "data-tensor": e.tensors.join(","), "data-from": e.from, "data-to": e.to });
    g.appendChild(el("path", { d: `M ${x1} ${y1} C ${mx} ${y1}, ${mx} ${y2}, ${x2 - 2} ${y2}`,
                               class: "jt-edge-line", "marker-end": "url(#jt-arrow)" }));
    g.appendChild(el("text", { x: mx, y: (y1 + y2) / 2 - 5, class: "jt-edge-label" }, e.tensors.join(", ")));
    svg.appendChild(g);
  }
  const box = (node, title, lines, cls, attrs) => {
    const p = pos.get(node);
    const g = el("g", { class: "jt-node " + cls, transform: `translate(${p.x},${p.y})`, ...attrs });
    g.appendChild(el("rect", { width: BW, height: BH, rx: 6, class: "jt-node-box" }));
    g.appendChild(el("text", { x: BW / 2, y: 16, class: "jt-node-title" }, title));
    lines.forEach(([c, text], i) => g.appendChild(el("text", { x: BW / 2, y: 32 + i * 14, class: c }, text)));
    svg.appendChild(g);
  };
  box("in", "inputs", [["jt-node-tensors", graph.inputs.join(", ")]], "jt-node-io", { "data-io": "inputs" });
  box("out", "outputs", [["jt-node-tensors", graph.outputs.join(", ")]], "jt-node-io", { "data-io": "outputs" });
  for (const s of graph.steps) {
    const r = byStep.get(s.step);
    const failed = !!r && r.failures > 0;
    const lines = r ? [
      ["jt-node-rate", r.meanWindow === "since load" && r.meanUs !== null
        ? `idle · ${fmt(r.meanUs, " µs")} mean of ${r.runs}` : `${fmt(r.perS)} req/s · ${fmt(r.meanUs, " µs")}`],
      ["jt-node-pct", r.percentiles ? `p50 ${fmt(r.p50, " ms")} · p99 ${fmt(r.p99, " ms")}` : "p50/p99: no histograms"],
      ["jt-node-failed", `${r.failures} failed`],
    ] : [["jt-node-rate", "no runs yet"]];
    box(s.step, `${s.step}. ${s.model}${r ? " v" + r.version : ""}`, lines,
        failed ? "jt-node-step jt-step-failed" + (r.failing ? " jt-step-failing" : "") : "jt-node-step",
        { "data-step": s.step, "data-model": s.model, "data-failures": r ? r.failures : 0 });
  }
  return svg;
}

function card(f, hist) {
  const c = el("div", { class: "jt-card", "data-model": f.name });
  c.appendChild(el("div", { class: "jt-card-title" }, `${f.name} v${f.version}`));
  const stats = el("div", { class: "jt-stats" });
  const stat = (cls, label, value) => {
    const s = el("div", { class: "jt-stat " + cls });
    s.appendChild(el("span", { class: "jt-value" }, value));
    s.appendChild(el("span", { class: "jt-label" }, label));
    stats.appendChild(s);
  };
  stat("jt-throughput", "inferences/s", fmt(f.infPerS));
  stat("jt-requests", "requests/s", fmt(f.reqPerS));
  stat("jt-queue", "queue µs/req", fmt(f.queueUs));
  stat("jt-compute", "compute µs/req", fmt(f.computeUs));
  stat("jt-pending", "pending", f.pending === null ? "–" : String(f.pending));
  stat("jt-failures", "failed", String(f.failures));
  stat("jt-inferences", "inferences", f.inferences.toLocaleString("en-US"));
  if (f.paddingWaste !== null && f.paddingWaste !== undefined)
    stat("jt-padding", "padding waste (padded / sent tokens)", f.paddingWaste.toFixed(2));
  if (f.decoupled) {
    stat("jt-responses", "responses/req", fmt(f.responsesPerRequest));
    stat("jt-first-response", "1st response µs", fmt(f.firstResponseUs));
  }
  c.appendChild(stats);
  const lat = el("div", { class: "jt-latency" + (f.latency ? "" : " jt-latency-off") });
  if (!f.latency) lat.textContent = HISTOGRAMS_OFF;
  else for (const [kind, q] of Object.entries(f.latency)) {
    const row = el("div", { class: "jt-latency-row", "data-kind": kind });
    row.appendChild(el("span", { class: "jt-label" }, `${kind} (${q.window})`));
    for (const p of ["p50", "p95", "p99"])
      row.appendChild(el("span", { class: "jt-pct", "data-q": p }, `${p} ${fmt(q[p], " ms")}`));
    lat.appendChild(row);
  }
  c.appendChild(lat);
  if (f.graph) c.appendChild(graphSvg(f.graph, f.steps));
  if (f.steps.length) {
    const list = el("ol", { class: "jt-steps" });
    for (const s of f.steps)
      list.appendChild(el("li", { "data-step": s.step },
        `${s.model} v${s.version}: ${fmt(s.meanUs, " µs")}${s.meanWindow === "since load" && s.meanUs !== null
          ? ` (mean of ${s.runs} runs since load)` : ""}, ${s.runs} runs, ${s.failures} failed`));
    c.appendChild(list);
  }
  const plots = el("div", { class: "jt-plots" });
  const left = el("div"), right = el("div");
  left.appendChild(el("div", { class: "jt-label" }, "inferences/s (since the dashboard opened, last minute)"));
  left.appendChild(spark(hist, f.lastRequestS));
  right.appendChild(el("div", { class: "jt-label" }, "executions per batch size"));
  right.appendChild(bars(f.batches));
  plots.append(left, right);
  c.appendChild(plots);
  return c;
}

function overview(rows) {
  const t = el("table", { class: "jt-overview" });
  const head = el("tr");
  const streams = rows.some(f => f.decoupled);
  for (const h of ["model", "ver", "inf/s", "req/s", "queue µs", "compute µs", "pending", "failed", "inferences",
                   ...(streams ? ["resp/req", "1st resp µs"] : [])])
    head.appendChild(el("th", {}, h));
  t.appendChild(head);
  for (const f of rows) {
    const r = el("tr", { "data-model": f.name });
    for (const v of [f.name, f.version, fmt(f.infPerS), fmt(f.reqPerS), fmt(f.queueUs), fmt(f.computeUs),
                     f.pending === null ? "–" : String(f.pending), String(f.failures), f.inferences.toLocaleString("en-US"),
                     ...(streams ? [fmt(f.responsesPerRequest), fmt(f.firstResponseUs)] : [])])
      r.appendChild(el("td", {}, v));
    t.appendChild(r);
  }
  return t;
}

// A model's shadow report (GET v2/models/{m}/shadow): how its staged version's answers to a
// copy of the live requests compare with the served ones, per output, and both latencies.
export function shadowTable(report) {
  const box = el("div", { class: "jt-shadow", "data-version": report.version });
  const state = report.enabled ? "" : " (stopped)";
  box.appendChild(el("div", { class: "jt-card-title" },
    `shadow of v${report.version}${state} · ${report.requests_compared} compared · ` +
    `${report.requests_dropped} dropped · ${report.errors} failed`));
  const lat = report.latency_ms || {};
  const side = (name) => lat[name] ? `${name} p50 ${fmt(lat[name].p50, " ms")} · p99 ${fmt(lat[name].p99, " ms")}` : "";
  box.appendChild(el("div", { class: "jt-shadow-latency" }, [side("served"), side("shadow")].filter(Boolean).join(" | ")));
  const t = el("table", { class: "jt-overview" });
  const head = el("tr");
  for (const h of ["output", "compared", "max |diff|", "agreement", "cosine distance"]) head.appendChild(el("th", {}, h));
  t.appendChild(head);
  for (const [name, d] of Object.entries(report.outputs || {})) {
    const r = el("tr", { "data-output": name });
    const agreement = d.agreement === null ? "–" : `${(100 * d.agreement).toFixed(1)} %`;
    const cosine = d.cosine_distance ? d.cosine_distance.mean.toPrecision(3) : "–";
    for (const v of [name, String(d.compared), d.max_abs_diff.toPrecision(3), agreement, cosine])
      r.appendChild(el("td", {}, v));
    t.appendChild(r);
  }
  box.appendChild(t);
  if (report.last_error) box.appendChild(el("div", { class: "jt-label" }, `last error: ${report.last_error}`));
  return box;
}

const LOG_TAIL = 200;

// One line of the logs tab, as figures.py's log_line() (and handle.logs()) writes it.
export function logLine(e) {
  const version = e.version ? `v${e.version} ` : "";
  return `${e.time || ""} ${version}${String(e.level || "").padEnd(7)} [${e.source || ""}] ${e.message || ""}`;
}

// `request(path)` (optional, a Response promise): how a host other than anywidget, the lab
// extension's model view, reaches the server (JupyterLab's ServerConnection); it implies canFetch.
function render({ model, el: host, request }) {
  const root = el("div", { class: "jt-dash" });
  const status = el("div", { class: "jt-status" });
  const body = el("div", { class: "jt-body" });
  const only = model.get("model");
  // one model's dashboard has a second tab: what the model said (its log lines)
  const tabs = el("div", { class: "jt-tabs" });
  const logsPane = el("div", { class: "jt-logs" });
  logsPane.hidden = true;
  let tab = "stats";
  if (only) {
    for (const [name, label] of [["stats", "statistics"], ["logs", "logs"]]) {
      const b = el("button", { class: "jt-tab", "data-tab": name, type: "button" }, label);
      b.addEventListener("click", () => showTab(name));
      tabs.appendChild(b);
    }
    root.append(status, tabs, body, logsPane);
  } else root.append(status, body);
  host.appendChild(root);

  const history = new Map();          // model key -> inferences/s, last HISTORY readings
  const windows = latencyWindows();   // percentiles over the last minute of readings
  let prev = null, source = null, timer = null, stopped = false, failures = 0, ticks = 0;

  function draw(snap, from) {
    if (source !== from) prev = null;  // never take deltas across sources (different clocks)
    source = from;
    const rows = figures(prev, snap, windows);
    prev = snap;
    for (const f of rows) {
      const h = history.get(f.key) || [];
      h.push(f.infPerS);
      if (h.length > HISTORY) h.shift();
      history.set(f.key, h);
    }
    ticks += 1;
    body.replaceChildren();
    const only = model.get("model");
    if (!only) body.appendChild(overview(rows));
    const shown = only ? rows : rows.filter(f => f.inferences > 0).slice(0, 8);
    for (const f of shown) body.appendChild(card(f, history.get(f.key)));
    if (only && snap.shadow) body.appendChild(shadowTable(snap.shadow));
    const when = new Date(snap.t * 1000).toLocaleTimeString();
    const err = model.get("error");
    status.textContent = `${only || "all models"} · ${from === "browser" ? "live from the browser" : "from the kernel"} · ${when}` + (err && from === "kernel" ? ` · ${err}` : "");
    root.setAttribute("data-source", from);
    root.setAttribute("data-ticks", String(ticks));
  }

  let logsDrawn = null;
  function drawLogs(lines) {
    const shown = (lines || []).slice(-LOG_TAIL);
    // redraw only when a line came or went: a reader scrolled up keeps their place
    const last = shown.length ? shown[shown.length - 1] : null;
    const stamp = `${shown.length}|${last ? last.timestamp ?? last.time : ""}|${last ? last.message : ""}`;
    if (stamp === logsDrawn) return;
    logsDrawn = stamp;
    const atBottom = logsPane.scrollHeight - logsPane.scrollTop - logsPane.clientHeight < 20;
    logsPane.replaceChildren(...shown.map(e =>
      el("div", { class: "jt-log-line", "data-level": e.level || "" }, logLine(e))));
    if (!shown.length) logsPane.appendChild(el("div", { class: "jt-log-empty" },
      "no log lines yet (the model's pb_utils.Logger calls, print and stderr show here)"));
    root.setAttribute("data-log-lines", String(shown.length));
    if (tab === "logs" && atBottom) logsPane.scrollTop = logsPane.scrollHeight;
  }

  function showTab(name) {
    tab = name;
    for (const b of tabs.querySelectorAll(".jt-tab")) b.classList.toggle("jt-tab-active", b.dataset.tab === name);
    body.hidden = name !== "stats";
    logsPane.hidden = name !== "logs";
    root.setAttribute("data-tab", name);
    if (model.get("tab") !== name) {      // the kernel poller reads the lines while the tab shows
      model.set("tab", name);
      model.save_changes();
    }
    if (name === "logs") {
      if (canFetch && !stopped) readLogs(); else drawLogs(model.get("logs"));
    }
  }

  // The browser polls when its page is served by the Jupyter server that hosts the models.
  const cfg = pageConfig();
  const base = cfg && cfg.baseUrl;
  const canFetch = !!request || (!!base && model.get("server_path") !== "" && base === model.get("server_path"));
  const logsPath = only ? `v2/models/${encodeURIComponent(only)}/logs` : null;
  const statsPath = only ? `v2/models/${encodeURIComponent(only)}/stats` : "v2/models/stats";
  const headers = cfg && cfg.token ? { Authorization: `token ${cfg.token}` } : {};
  let metricsOk = true, shadowOk = !!only;
  const configs = new Map();          // "model/version" -> its graph (null: not an ensemble)

  async function fetchOnce() {
    const opts = { credentials: "same-origin", headers, cache: "no-store" };
    const get = request || ((path) => fetch(base + path, opts));
    const r = await get(statsPath);
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    const body = await r.json();
    const stats = body.model_stats || [];
    const graphs = {}, composing = [];
    const have = new Set(stats.map(m => m.name));
    for (const m of stats) {
      const key = m.name + "/" + m.version;
      if (!configs.has(key)) {          // is it an ensemble? its config says, once a version
        try {
          const c = await get(`v2/models/${encodeURIComponent(m.name)}/versions/${m.version}/config`);
          if (c.ok) {
            const config = await c.json();
            configs.set(key, config.platform === "ensemble" ? ensembleGraph(config) : null);
          }
        } catch (e) { /* drawn as a list until the config can be read */ }
      }
      const graph = configs.get(key);
      if (!graph) continue;
      graphs[m.name] = graph;
      for (const s of graph.steps) {    // a one-model dashboard: its steps' own statistics
        if (have.has(s.model)) continue;
        have.add(s.model);
        try {
          const c = await get(`v2/models/${encodeURIComponent(s.model)}/stats`);
          if (c.ok) composing.push(...((await c.json()).model_stats || []));
        } catch (e) { /* no percentiles for this step this time */ }
      }
    }
    let pending = null;
    if (metricsOk) {
      try {
        const m = await get("metrics");
        if (m.ok) pending = parsePending(await m.text()); else metricsOk = false;
      } catch (e) { metricsOk = false; }
    }
    let shadow = null;
    if (shadowOk) {
      try {
        const s = await get(`v2/models/${encodeURIComponent(only)}/shadow`);
        if (s.ok) shadow = (await s.json()).shadow; else shadowOk = false;
      } catch (e) { shadowOk = false; }
    }
    return { t: Date.now() / 1000, model_stats: stats, pending, graphs, composing, shadow };
  }

  async function readLogs() {
    const opts = { credentials: "same-origin", headers, cache: "no-store" };
    const get = request || ((path) => fetch(base + path, opts));
    try {
      const r = await get(logsPath);
      if (r.ok) drawLogs((await r.json()).lines);
      else drawLogs([{ level: "ERROR", source: "dashboard", message: `logs request failed: HTTP ${r.status}` }]);
    } catch (e) {
      drawLogs([{ level: "ERROR", source: "dashboard", message: `logs request failed: ${e}` }]);
    }
  }

  function setPolling(on) {
    if (model.get("browser_polling") === on) return;
    model.set("browser_polling", on);
    model.save_changes();
  }

  async function loop() {
    if (stopped) return;
    try {
      const snap = await fetchOnce();
      if (stopped) return;
      failures = 0;
      setPolling(true);
      draw(snap, "browser");
      if (tab === "logs") await readLogs();
    } catch (e) {
      failures += 1;
      if (failures >= 3) {
        // hand over to the kernel poller and stop trying
        setPolling(false);
        stopped = true;
        const snap = model.get("snapshot");
        if (snap && snap.t) draw(snap, "kernel");
        return;
      }
    }
    timer = setTimeout(loop, Math.max(200, 1000 * model.get("interval")));
  }

  const onKernel = () => {
    const snap = model.get("snapshot");
    if (snap && snap.t && (source !== "browser" || stopped)) draw(snap, "kernel");
  };
  model.on("change:snapshot", onKernel);
  const onKernelLogs = () => { if (source !== "browser" || stopped || !canFetch) drawLogs(model.get("logs")); };
  if (only) {
    model.on("change:logs", onKernelLogs);
    showTab(model.get("tab") === "logs" ? "logs" : "stats");
  }
  onKernel();
  if (canFetch) loop(); else status.textContent += " (statistics from the kernel)";

  return () => {
    stopped = true;
    clearTimeout(timer);
    model.off("change:snapshot", onKernel);
    if (only) model.off("change:logs", onKernelLogs);
    if (source === "browser") setPolling(false);
  };
}

export default { render };
