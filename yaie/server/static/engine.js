// The engine view: redraws the page from each snapshot that /engine/events pushes.
// The snapshot's schema is documented in yaie/engine/snapshot.py.
"use strict";

const CHART_SECONDS = 120; // as many as the step log keeps (HISTORY_S, yaie/engine/step_log.py)
const MAX_EVENTS = 30;
const $ = (id) => document.getElementById(id);

// A stable colour per request, so that its rows and its blocks match.
function ownerColour(requestId) {
  let hash = 0;
  for (const c of requestId) hash = (hash * 31 + c.charCodeAt(0)) >>> 0;
  return `hsl(${hash % 360} 65% 52%)`;
}

function shortId(requestId) {
  return requestId.length > 18 ? `${requestId.slice(0, 9)}…${requestId.slice(-6)}` : requestId;
}

// -- counters ------------------------------------------------------------------------------

function renderCounters(s) {
  const running = s.sequences.filter((seq) => seq.phase === "prefill" || seq.phase === "decode").length;
  const sum = (values) => values.reduce((total, value) => total + value, 0);
  const steps = sum(s.history.seconds.steps.slice(-10));
  const meanStepMs = steps ? (1000 * sum(s.history.seconds.busy_s.slice(-10))) / steps : null;
  const cost = meanStepMs ? ` (${((100 * s.cost_ms) / meanStepMs).toFixed(2)}% of a step)` : "";
  const counters = [
    ["running", running],
    ["waiting", s.sequences.length - running],
    ["KV blocks in use", `${s.kv.num_used} / ${s.kv.num_blocks}`],
    ["cached only", s.kv.num_cached],
    ["free", s.kv.num_free],
    ["preemptions", s.counters.preemptions],
    ["evicted blocks", s.counters.evicted_blocks],
    ["prompt tokens computed", s.counters.computed_prompt_tokens],
    ["snapshot cost", `${s.cost_ms.toFixed(2)} ms${cost}`],
  ];
  $("counters").replaceChildren(
    ...counters.map(([name, value]) => h("div", { class: "counter" }, h("b", {}, String(value)), name))
  );
}

// -- requests ------------------------------------------------------------------------------

function renderRequests(s) {
  const rows = s.sequences.map((seq) => {
    const computed = (100 * seq.num_computed_tokens) / seq.num_tokens;
    const prompt = (100 * seq.num_prompt_tokens) / seq.num_tokens;
    const bar = h("div", { class: "progress", title: `prompt: ${seq.num_prompt_tokens} tokens` },
      h("div", { class: "computed", style: `width:${computed}%; background:${ownerColour(seq.request_id)}` }),
      h("div", { class: "prompt-end", style: `left:${prompt}%` }));
    const name = seq.index ? `${shortId(seq.request_id)} #${seq.index}` : shortId(seq.request_id);
    return h("tr", { "data-request-id": seq.request_id, "data-phase": seq.phase },
      h("td", { title: seq.request_id }, h("span", { class: "dot", style: `background:${ownerColour(seq.request_id)}` }), name),
      h("td", {}, h("span", { class: `phase ${seq.phase}` }, seq.phase)),
      h("td", {}, bar, `${seq.num_computed_tokens} / ${seq.num_tokens}`),
      h("td", {}, String(seq.num_cached_tokens)),
      h("td", {}, String(seq.blocks.length)),
      h("td", {}, String(seq.num_preemptions)));
  });
  document.querySelector("#requests tbody").replaceChildren(...rows);
  $("no-requests").hidden = rows.length > 0;
}

// -- KV blocks -----------------------------------------------------------------------------

const STATE_NAMES = { f: "free", u: "in use", s: "in use and cached", c: "cached only" };
let blockCells = [];

function renderBlocks(s) {
  const grid = $("blocks");
  if (blockCells.length !== s.kv.num_blocks) {
    blockCells = Array.from({ length: s.kv.num_blocks }, (_, i) => h("div", { class: "block", "data-block": i }));
    grid.replaceChildren(...blockCells);
  }
  const owners = new Map(); // block id -> the requests whose sequences hold it
  for (const seq of s.sequences) {
    for (const block of seq.blocks) {
      if (!owners.has(block)) owners.set(block, new Set());
      owners.get(block).add(seq.request_id);
    }
  }
  for (let i = 0; i < blockCells.length; i++) {
    const state = s.kv.states[i];
    const held = [...(owners.get(i) ?? [])];
    const key = state + held.join(",");
    const cell = blockCells[i];
    if (cell.dataset.key === key) continue; // unchanged: leave the DOM alone
    cell.dataset.key = key;
    cell.dataset.state = state;
    cell.dataset.owners = held.join(" ");
    cell.className = `block ${state}`;
    cell.style.background = held.length ? ownerColour(held[0]) : "";
    cell.title = `block ${i}: ${STATE_NAMES[state]}${held.length ? ` · ${held.join(", ")}` : ""}`;
  }
  $("kv-summary").textContent =
    `${s.kv.num_blocks} blocks of ${s.config.block_size} tokens · ${s.kv.num_used} in use · ${s.kv.num_cached} cached only`;
}

// -- prefix tree ---------------------------------------------------------------------------

function blockSpan(blocks) {
  if (blocks.length <= 4) return blocks.map((b) => `#${b}`).join(" ");
  return `#${blocks[0]} … #${blocks[blocks.length - 1]} (${blocks.length})`;
}

function renderTree(s) {
  const nodes = s.tree ?? [];
  const items = nodes.map((node) =>
    h("li", { class: "node", "data-hits": node.hits, "data-depth": node.depth },
      h("span", { class: "label" }, JSON.stringify(node.text)),
      h("span", { class: "span muted" }, ` tokens ${node.start}–${node.start + node.num_tokens}`),
      h("span", { class: "blocks" }, blockSpan(node.blocks)),
      h("span", { class: "hits", title: "prefix matches that reused this node" }, `${node.hits} hits`)));
  const lists = new Map(); // node index -> the <ul> of its children
  const childList = (i) => {
    if (!lists.has(i)) {
      lists.set(i, h("ul"));
      items[i].append(lists.get(i));
    }
    return lists.get(i);
  };
  const shown = nodes.map(() => 0);
  const top = [];
  nodes.forEach((node, i) => {
    if (node.parent < 0) top.push(items[i]);
    else {
      childList(node.parent).append(items[i]);
      shown[node.parent]++;
    }
  });
  nodes.forEach((node, i) => {
    const hidden = node.num_children - shown[i];
    if (hidden > 0) childList(i).append(h("li", { class: "more muted" }, `+ ${hidden} more`));
  });
  $("tree").replaceChildren(...top);
  $("no-tree").hidden = nodes.length > 0;
  $("no-tree").textContent = s.tree === null ? "Prefix caching is off." : "Empty.";
}

// -- charts --------------------------------------------------------------------------------

// Lines over the last CHART_SECONDS seconds; a null value leaves a gap.
function drawLines(canvas, seconds, series, unit) {
  const context = fitCanvas(canvas);
  const { width, height } = canvas;
  const pad = 4 * devicePixelRatio;
  const max = Math.max(1e-9, ...series.flatMap((line) => line.values.filter((v) => v !== null)));
  const end = seconds.length ? seconds[seconds.length - 1] : 0;
  const x = (second) => width - ((end - second) / CHART_SECONDS) * width;
  const y = (value) => height - pad - (value / max) * (height - 2 * pad);
  for (const line of series) {
    context.strokeStyle = line.colour;
    context.lineWidth = 1.5 * devicePixelRatio;
    context.beginPath();
    let drawing = false;
    line.values.forEach((value, i) => {
      if (value === null) { drawing = false; return; }
      if (drawing) context.lineTo(x(seconds[i]), y(value));
      else context.moveTo(x(seconds[i]), y(value));
      drawing = true;
    });
    context.stroke();
  }
  label(context, `max ${max < 10 ? max.toFixed(1) : Math.round(max)} ${unit}`);
}

// `steps`: the snapshot's recent_steps, one list per field.
function drawBars(canvas, steps) {
  const context = fitCanvas(canvas);
  const { width, height } = canvas;
  const maxPrefill = Math.max(1, ...steps.prefill_tokens);
  const maxDecode = Math.max(1, ...steps.decode_tokens);
  const slot = width / Math.max(steps.time.length, 50);
  steps.time.forEach((_, i) => {
    const prefill = (steps.prefill_tokens[i] / maxPrefill) * (height - 14);
    const decode = (steps.decode_tokens[i] / maxDecode) * (height - 14);
    context.fillStyle = "#e4a33b";
    context.fillRect(i * slot, height - prefill, slot / 2, prefill);
    context.fillStyle = "#3b82c4";
    context.fillRect(i * slot + slot / 2, height - decode, slot / 2, decode);
  });
  label(context, `max ${maxPrefill} prefill tokens, ${maxDecode} decoding`);
}

function fitCanvas(canvas) {
  canvas.width = canvas.clientWidth * devicePixelRatio;
  canvas.height = canvas.clientHeight * devicePixelRatio;
  const context = canvas.getContext("2d");
  context.clearRect(0, 0, canvas.width, canvas.height);
  return context;
}

function label(context, text) {
  context.fillStyle = "#667";
  context.font = `${11 * devicePixelRatio}px sans-serif`;
  context.fillText(text, 4 * devicePixelRatio, 12 * devicePixelRatio);
}

function renderCharts(s) {
  // One point per second, the seconds without steps included (no steps: no tokens).
  const now = Math.floor(s.time);
  const columns = s.history.seconds; // one list per field of a bin
  const bin = (i) => Object.fromEntries(Object.entries(columns).map(([field, values]) => [field, values[i]]));
  const bins = new Map(columns.second.map((second, i) => [second, bin(i)]));
  const seconds = [];
  for (let second = now - CHART_SECONDS; second <= now; second++) seconds.push(second);
  const pick = (f) => seconds.map((second) => (bins.has(second) ? f(bins.get(second)) : null));
  const watched = seconds.map((second) => (second >= (columns.second[0] ?? now) ? 0 : null));
  drawLines($("chart-throughput"), seconds, [
    { values: pick((bin) => bin.sampled_tokens).map((v, i) => v ?? watched[i]), colour: "#3b82c4" },
  ], "tok/s");
  drawLines($("chart-ttft"), seconds, [
    { values: pick((bin) => (bin.num_ttft ? (1000 * bin.ttft_sum_s) / bin.num_ttft : null)), colour: "#8a5cc4" },
  ], "ms");
  drawLines($("chart-steps"), seconds, [
    { values: pick((bin) => (bin.steps ? (1000 * bin.max_step_s) : null)), colour: "#e4a33b" },
    { values: pick((bin) => (bin.steps ? (1000 * bin.busy_s) / bin.steps : null)), colour: "#2f9e6e" },
  ], "ms");
  drawBars($("chart-batch"), s.history.recent_steps);
}

// -- events --------------------------------------------------------------------------------

function renderEvents(s) {
  const events = s.history.events.slice(-MAX_EVENTS).reverse();
  $("events").replaceChildren(...events.map((event) => {
    const time = new Date(event.time * 1000).toLocaleTimeString();
    const text = event.kind === "preemption"
      ? `preempted ${shortId(event.request_id)}${event.index ? ` #${event.index}` : ""} at ${event.num_tokens} tokens`
      : `evicted ${event.num_blocks} cached block${event.num_blocks === 1 ? "" : "s"}`;
    return h("li", { class: event.kind }, h("span", { class: "muted" }, time), ` ${text}`);
  }));
  if (!events.length) $("events").append(h("li", { class: "muted" }, "None yet."));
}

// -- the feed ------------------------------------------------------------------------------

function render(snapshot) {
  $("model").textContent = `${snapshot.model.name} · ${snapshot.model.architecture} · context ${snapshot.model.max_model_len}`;
  renderCounters(snapshot);
  renderRequests(snapshot);
  renderBlocks(snapshot);
  renderTree(snapshot);
  renderCharts(snapshot);
  renderEvents(snapshot);
}

function setConnection(text, live) {
  $("connection").textContent = text;
  $("connection").classList.toggle("live", live);
}

async function follow() {
  for (;;) {
    try {
      const response = await apiFetch("/engine/events");
      if (!response.ok) throw new Error(await errorMessage(response));
      setConnection("live", true);
      for await (const data of readEvents(response)) {
        const snapshot = JSON.parse(data);
        if (snapshot.error) setConnection(snapshot.error, false);
        else render(snapshot);
      }
      setConnection("disconnected; reconnecting…", false);
    } catch (error) {
      setConnection(`${error.message}; reconnecting…`, false);
    }
    await new Promise((resolve) => setTimeout(resolve, 1000));
  }
}

setUpKeyForm();
follow();
