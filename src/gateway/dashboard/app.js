// Tollgate's dashboard: polls /admin/api/overview once a second and redraws. Every value from
// the gateway goes into the page as text, never as markup.
"use strict";

const charts = new Map();

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function row(cells) {
  const tr = document.createElement("tr");
  for (const c of cells) {
    const td = el("td", c.text ?? c, c.cls);
    tr.appendChild(td);
  }
  return tr;
}

function fill(id, rows) {
  const body = document.getElementById(id);
  body.replaceChildren(...rows);
}

function fmtMs(v) {
  return v === null || v === undefined ? "–" : (v < 1 ? v.toFixed(3) : v.toFixed(1)) + " ms";
}

function fmtAgo(ms) {
  return (ms / 1000).toFixed(ms < 10000 ? 1 : 0) + " s ago";
}

// An ejected target says when it is tried again: the state alone can't tell an operator
// whether to wait or act.
function targetState(t) {
  return t.state === "ejected" && t.ejected_for_ms > 0
    ? "ejected, " + Math.ceil(t.ejected_for_ms / 1000) + " s left"
    : t.state;
}

function fmtTime(ms) {
  return new Date(ms).toLocaleTimeString();
}

function chartFor(name, width) {
  let c = charts.get(name);
  if (c) return c;
  const box = el("div", null, "chart");
  box.id = "chart-" + name;
  box.appendChild(el("h3", name));
  document.getElementById("chart-list").appendChild(box);
  const opts = {
    width: width,
    height: 160,
    scales: { x: { time: true } },
    series: [
      {},
      { label: "admitted", stroke: "#12805c", width: 1.5, points: { show: false } },
      { label: "refused", stroke: "#c4320a", width: 1.5, points: { show: false } },
      { label: "shadow would refuse", stroke: "#b54708", dash: [4, 3], width: 1, points: { show: false } },
    ],
    axes: [{}, { label: "per second", size: 56 }],
  };
  const plot = new uPlot(opts, [[], [], [], []], box);
  c = { box, plot };
  charts.set(name, c);
  return c;
}

function renderCharts(history) {
  const list = document.getElementById("chart-list");
  const width = Math.max(320, Math.min(640, list.clientWidth / Math.max(1, Math.floor(list.clientWidth / 440)) - 20));
  const seen = new Set();
  for (const l of history.limits) {
    seen.add(l.name);
    const c = chartFor(l.name, width);
    const n = l.admitted.length;
    const xs = [];
    for (let i = 0; i < n; i++) xs.push((history.newest_unix_ms - (n - 1 - i) * 1000) / 1000);
    c.plot.setData([xs, l.admitted, l.limited, l.shadow]);
  }
  for (const [name, c] of charts) {
    if (!seen.has(name)) {
      c.plot.destroy();
      c.box.remove();
      charts.delete(name);
    }
  }
}

function render(o) {
  document.getElementById("rules-version").textContent = o.rules.version;
  document.getElementById("rules-loaded").textContent = "loaded " + fmtTime(o.rules.loaded_at_unix_ms);
  document.getElementById("rules-source").textContent = o.rules.source + " · " + o.rules.digest.slice(0, 19);
  const rej = o.rules.last_rejected;
  document.getElementById("rules-rejected").textContent = rej
    ? "last reload rejected at " + fmtTime(rej.at_unix_ms) + ": " + rej.error
    : "";
  document.getElementById("updated").textContent = "updated " + fmtTime(o.now_unix_ms);

  renderCharts(o.history);

  const s = o.store;
  const bypass = Object.entries(s.bypass).map(([p, n]) => p + " " + n).join(", ");
  fill("store", [
    row(["kind", s.kind]),
    row(["check p50 / p99", fmtMs(s.check_p50_ms) + " / " + fmtMs(s.check_p99_ms)]),
    row(["breaker", { text: s.breaker, cls: "state-" + s.breaker }]),
    row(["decided without the store", bypass]),
  ]);

  const admitted = o.keys.admitted || [];
  const refused = o.keys.refused || [];
  const rows = [];
  for (let i = 0; i < Math.max(admitted.length, refused.length, 1); i++) {
    const a = admitted[i], r = refused[i];
    rows.push(row([
      a ? a.key : (i === 0 && o.keys.admitted === null ? "metering off" : ""),
      { text: a ? a.count : "", cls: "n" },
      r ? r.key : "",
      { text: r ? r.count : "", cls: "n" },
    ]));
  }
  fill("keys", rows);

  fill("upstreams", o.upstreams.map((u) => row([
    u.name,
    { text: u.in_flight ?? "–", cls: "n" },
    { text: u.limit === null ? "–" : u.limit + (u.adaptive ? " (adaptive)" : ""), cls: "n" },
    { text: u.bad_gateway, cls: "n" },
    { text: u.gateway_timeout, cls: "n" },
  ])));

  const trows = [];
  for (const u of o.upstreams) {
    for (const t of u.targets || []) {
      const tr = row([
        u.name,
        t.target,
        { text: targetState(t), cls: "target-" + t.state },
        { text: t.weight, cls: "n" },
        { text: t.in_flight, cls: "n" },
        { text: t.ejections, cls: "n" },
        t.last_failure ? t.last_failure.why + " (" + fmtAgo(t.last_failure.ms_ago) + ")" : "–",
      ]);
      // The row's identity for tests and for anyone scripting the page; dataset is text.
      tr.dataset.upstream = u.name;
      tr.dataset.target = t.target;
      tr.dataset.state = t.state;
      trows.push(tr);
    }
  }
  fill("targets", trows);

  fill("leases", [
    row(["tokens held", o.leases.tokens_held]),
    row(["blocks granted", o.leases.grants]),
    row(["blocks denied", o.leases.denials]),
  ]);

  const section = document.getElementById("regions-section");
  if (o.regions) {
    section.hidden = false;
    const rrows = [];
    for (const [name, r] of Object.entries(o.regions.regions || {})) {
      for (const [bucket, rec] of Object.entries(r.limits || {})) {
        rrows.push(row([
          name + (name === o.regions.region ? " (here)" : ""),
          bucket,
          { text: rec.share.toFixed(1), cls: "n" },
          { text: rec.demand.toFixed(1), cls: "n" },
          { text: (r.age_ms / 1000).toFixed(1) + " s", cls: "n" },
        ]));
      }
    }
    fill("regions", rrows);
  } else {
    section.hidden = true;
  }
}

async function poll() {
  const banner = document.getElementById("banner");
  try {
    const r = await fetch("/admin/api/overview", { cache: "no-store" });
    if (!r.ok) throw new Error("the gateway answered " + r.status);
    render(await r.json());
    banner.style.display = "none";
  } catch (e) {
    banner.textContent = "Cannot read the gateway: " + e.message + " (retrying every second)";
    banner.style.display = "block";
  }
}

poll();
setInterval(poll, 1000);
