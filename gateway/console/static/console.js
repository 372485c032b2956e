// kvscope console: plain JavaScript served by the gateway (no build step, nothing from another origin).
// Pages: /console (overview), /console/requests, /console/requests/<event id>, /console/health; data from
// /console/api/* (gateway/console/routes.py). Charts: the vendored uPlot (static/vendor/). Every value from
// the gateway is written as text (textContent), never as HTML.
"use strict";

(function () {
  const POLL_MS = 1000; // the overview asks for new points once a second (the gateway ticks every 2 s)
  const LIST_MS = 2000;
  const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#4b5563"];
  const RANGES = [["5 min", 300], ["15 min", 900], ["1 hour", 3600]];

  const main = document.getElementById("main");
  const statusEl = document.getElementById("status");
  const app = { timers: [], charts: {}, data: null, range: 900, session: null, page: null };
  window.kvscopeConsole = app; // tests and the curious read the charts' data here

  // --- helpers -------------------------------------------------------------------------------------------
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") node.className = v;
      else if (k === "text") node.textContent = v;
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, v === true ? "" : String(v));
    }
    for (const c of children.flat()) {
      if (c === null || c === undefined || c === false) continue;
      node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return node;
  }
  const isNum = (v) => typeof v === "number" && Number.isFinite(v);
  function fmtNum(v, digits) {
    if (!isNum(v)) return "–";
    return v.toLocaleString("en-US", { maximumFractionDigits: digits === undefined ? 1 : digits });
  }
  function fmtSec(v) {
    if (!isNum(v)) return "–";
    if (v === 0) return "0 ms";
    if (Math.abs(v) < 0.001) return `${Math.round(v * 1e6)} µs`;
    if (Math.abs(v) < 1) return `${(v * 1000).toLocaleString("en-US", { maximumFractionDigits: 1 })} ms`;
    return `${v.toLocaleString("en-US", { maximumFractionDigits: 2 })} s`;
  }
  const fmtPct = (v, d) => (isNum(v) ? `${(v * 100).toFixed(d === undefined ? 1 : d)} %` : "–");
  function fmtTime(epochS) {
    return new Date(epochS * 1000).toLocaleTimeString("en-GB", { hour12: false });
  }
  const fmtClock = (epochS) => fmtTime(epochS).slice(0, 5);
  function fmtValue(v, unit) {
    if (!isNum(v)) return "–";
    if (unit === "ratio") return fmtPct(v);
    if (unit === "s") return fmtSec(v);
    if (unit === "bytes") return `${fmtNum(v, 0)} B`;
    if (unit === "per_s") return `${fmtNum(v, 3)}/s`;
    if (unit === "up") return v ? "up" : "down";
    return fmtNum(v, 2);
  }
  function fmtDur(s) {
    if (!isNum(s)) return "–";
    if (s >= 3600 && s % 3600 === 0) return `${s / 3600} h`;
    if (s >= 60 && s % 60 === 0) return `${s / 60} min`;
    return `${Math.round(s)} s`;
  }
  function every(ms, fn) {
    fn();
    app.timers.push(setInterval(fn, ms));
  }
  function put(...children) {
    main.append(...children.flat().filter((c) => c !== null && c !== undefined && c !== false));
  }
  function clearPage() {
    app.timers.forEach(clearInterval);
    app.timers = [];
    for (const c of Object.values(app.charts)) c.plot && c.plot.destroy();
    app.charts = {};
    main.replaceChildren();
  }
  function setStatus(text, bad) {
    statusEl.textContent = text;
    statusEl.classList.toggle("bad", !!bad);
  }

  // --- API and login -------------------------------------------------------------------------------------
  class LoginNeeded extends Error {}
  async function api(path, options) {
    const resp = await fetch(path, { credentials: "same-origin", ...(options || {}) });
    let body = null;
    try {
      body = await resp.json();
    } catch (e) {
      body = null;
    }
    if (resp.status === 401 || resp.status === 403) {
      showLogin(body && body.error ? body.error.message : "");
      throw new LoginNeeded();
    }
    if (!resp.ok) throw new Error(body && body.error ? body.error.message : `HTTP ${resp.status}`);
    return body;
  }
  function showLogin(message) {
    document.getElementById("login").hidden = false;
    document.getElementById("login-error").textContent = message || "";
    document.getElementById("login-key").focus();
    setStatus("login needed", true);
  }
  document.getElementById("login-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    const input = document.getElementById("login-key");
    try {
      app.session = await api("/console/api/session", {
        method: "POST",
        headers: { "content-type": "application/json" },
        body: JSON.stringify({ key: input.value }),
      });
      input.value = "";
      document.getElementById("login").hidden = true;
      document.getElementById("logout").hidden = !app.session.auth;
      route();
    } catch (e) {
      if (!(e instanceof LoginNeeded)) document.getElementById("login-error").textContent = e.message;
      input.value = "";
    }
  });
  document.getElementById("logout").addEventListener("click", async () => {
    await fetch("/console/api/session", { method: "DELETE", credentials: "same-origin" });
    app.session = null;
    clearPage();
    showLogin("Logged out.");
  });

  // --- routing -------------------------------------------------------------------------------------------
  document.addEventListener("click", (event) => {
    const a = event.target.closest("a[href^='/console']");
    if (!a || event.ctrlKey || event.metaKey || event.shiftKey || a.target) return;
    event.preventDefault();
    history.pushState(null, "", a.getAttribute("href"));
    route();
  });
  window.addEventListener("popstate", route);

  async function route() {
    clearPage();
    const path = location.pathname.replace(/\/+$/, "") || "/console";
    const detail = path.match(/^\/console\/requests\/(.+)$/);
    app.page = detail ? "request" : path === "/console/requests" ? "requests" : path === "/console/health" ? "health" : "overview";
    for (const a of document.querySelectorAll("nav a")) {
      a.classList.toggle("active", a.dataset.page === (app.page === "request" ? "requests" : app.page));
    }
    try {
      if (!app.session) {
        app.session = await api("/console/api/session");
        document.getElementById("logout").hidden = !app.session.auth;
      }
      if (app.page === "overview") overviewPage();
      else if (app.page === "requests") requestsPage();
      else if (app.page === "health") healthPage();
      else requestPage(decodeURIComponent(detail[1]));
    } catch (e) {
      if (!(e instanceof LoginNeeded)) setStatus(e.message, true);
    }
  }

  // --- overview ------------------------------------------------------------------------------------------
  // axis: the y axis' title (and axis2 the right one's) where its numbers carry no unit of their own
  const CHARTS = [
    { id: "traffic", title: "Traffic", sub: "requests/s and output tokens/s at the gateway (per 2 s tick)",
      series: [["requests_per_s", "requests"], ["output_tokens_per_s", "output tokens (right axis)", "y2"]], unit: "rate",
      axis: "requests/s", axis2: "output tokens/s" },
    { id: "ttft", title: "Time to first token", sub: "p50 and p99 over the last minute (streams)",
      series: [["ttft_p50_s", "p50"], ["ttft_p99_s", "p99"]], unit: "s",
      empty: "No streamed request has had its first token yet." },
    { id: "tpot", title: "Time per output token", sub: "p50 and p99 over the last minute (streams)",
      series: [["tpot_p50_s", "p50"], ["tpot_p99_s", "p99"]], unit: "s",
      empty: "No streamed request has produced two tokens yet." },
    { id: "errors", title: "Errors by type", sub: "per second: HTTP status ≥ 400, and streams broken after their 200",
      group: "errors_per_s", unit: "rate", axis: "errors/s", empty: "No errors since the gateway started." },
    { id: "ratelimited", title: "Rate-limit refusals", sub: "per second, by the limit that refused",
      group: "rate_limited_per_s", unit: "rate", axis: "refusals/s", empty: "No request refused by a rate limit since start." },
    { id: "kv", title: "KV-cache usage", sub: "per replica, from its /metrics (0–100 %)", group: "kv_usage", unit: "pct",
      empty: "No replica exports its KV-cache usage." },
    { id: "waiting", title: "Queue depth", sub: "requests waiting at each replica (its /metrics)", group: "waiting",
      unit: "count", axis: "requests waiting", empty: "No replica exports its queue." },
    { id: "running", title: "Running batch", sub: "requests in each replica's running batch (its /metrics)",
      group: "running", unit: "count", axis: "requests running", empty: "No replica exports its running batch." },
    { id: "prefix", title: "Prefix-cache hit rate", sub: "cached / prompt tokens over the last minute (upstreams' usage)",
      series: [["prefix_cache_hit_ratio", "hit rate"]], unit: "pct",
      empty: "No prompt tokens reported in the last minute." },
    { id: "spec", title: "Speculative acceptance", sub: "accepted / draft tokens over the last minute (kvscope engine)",
      series: [["spec_acceptance_ratio", "acceptance"]], unit: "pct",
      empty: "No draft tokens reported: the kvscope engine reports them when it runs with --speculative ngram." },
  ];

  function tile(id, label, sub) {
    return el("div", { class: "tile", id: `tile-${id}` }, el("div", { class: "label", text: label }),
      el("div", { class: "value", text: "–" }), el("div", { class: "sub", text: sub || "" }));
  }
  function setTile(id, value, sub, tone) {
    const t = document.getElementById(`tile-${id}`);
    if (!t) return;
    t.querySelector(".value").textContent = value;
    if (sub !== undefined) t.querySelector(".sub").textContent = sub;
    t.classList.remove("good", "warn", "bad");
    if (tone) t.classList.add(tone);
  }

  function overviewPage() {
    const ranges = el("div", { class: "ranges" }, el("span", { text: "Show the last" }),
      RANGES.map(([label, s]) => el("button", { type: "button", class: s === app.range ? "on" : "",
        onclick: () => { app.range = s; ranges.querySelectorAll("button").forEach((b) => b.classList.toggle("on", b.textContent === label)); drawCharts(); }, text: label })));
    put(
      el("section", { class: "tiles" },
        tile("requests", "Requests", "since start"), tile("rps", "Requests/s", "last tick"),
        tile("tokens", "Output tokens", "since start"), tile("tps", "Output tok/s", "last tick"),
        tile("ttft", "TTFT p99 · 1 min", ""), tile("tpot", "TPOT p99 · 1 min", ""),
        tile("errors", "Errors", "since start"), tile("replicas", "Replicas healthy", ""),
        tile("alerts", "Alerts", "shipped rules")),
      ranges,
      el("section", { class: "charts" }, CHARTS.map((c) => el("article", { class: "card", id: `card-${c.id}` },
        el("h3", { text: c.title }), el("p", { class: "sub", text: c.sub }), el("div", { class: "now" }),
        el("div", { class: "plot" })))));
    app.data = null;
    every(POLL_MS, pollOverview);
  }

  async function pollOverview() {
    const since = app.data && app.data.t.length ? app.data.t[app.data.t.length - 1] : null;
    let body;
    try {
      body = await api(`/console/api/overview${since === null ? "" : `?since=${since}`}`);
    } catch (e) {
      if (!(e instanceof LoginNeeded)) setStatus(`gateway unreachable: ${e.message}`, true);
      return;
    }
    if (app.page !== "overview") return;
    mergeColumns(body);
    app.overview = body;
    updateTiles(body);
    drawCharts();
    const viewer = app.session && app.session.auth ? ` · ${app.session.viewer}` : "";
    setStatus(`live · updated ${fmtTime(Date.now() / 1000)}${viewer}`);
  }

  function mergeColumns(body) {
    if (!app.data) {
      app.data = { t: body.t, dt: body.dt, series: body.series };
      return;
    }
    const d = app.data;
    const n = d.t.length;
    d.t.push(...body.t);
    d.dt.push(...body.dt);
    for (const [key, col] of Object.entries(body.series)) {
      if (Array.isArray(col)) {
        d.series[key] = (d.series[key] || new Array(n).fill(null)).concat(col);
        continue;
      }
      // a rate's member first seen in this answer read 0 at every earlier point that has a rate (dt set), as
      // the gateway's own columns say (series.py ConsoleSeries.columns); a gauge's member read nothing
      const rates = key.endsWith("_per_s");
      const group = d.series[key] || (d.series[key] = {});
      const members = new Set([...Object.keys(group), ...Object.keys(col)]);
      for (const m of members) {
        const old = group[m] || d.dt.slice(0, n).map((dt) => (rates && dt !== null ? 0 : null));
        group[m] = old.concat(col[m] || body.dt.map((dt) => (rates && dt !== null ? 0 : null)));
      }
    }
    // keep the gateway's history (one hour) only
    const cutoff = d.t.length ? d.t[d.t.length - 1] - body.history_s : 0;
    let drop = 0;
    while (drop < d.t.length && d.t[drop] < cutoff) drop++;
    if (drop) {
      d.t.splice(0, drop);
      d.dt.splice(0, drop);
      for (const col of Object.values(d.series)) {
        if (Array.isArray(col)) col.splice(0, drop);
        else Object.values(col).forEach((c) => c.splice(0, drop));
      }
    }
  }

  function lastTick(col) {
    return col.length ? col[col.length - 1] : null;
  }
  function last(col) {
    for (let i = col.length - 1; i >= 0; i--) if (col[i] !== null) return col[i];
    return null;
  }

  function updateTiles(body) {
    const tot = body.totals || {};
    const s = app.data.series;
    setTile("requests", fmtNum(tot.requests, 0));
    setTile("rps", fmtNum(last(s.requests_per_s), 2));
    setTile("tokens", fmtNum(tot.output_tokens, 0));
    setTile("tps", fmtNum(last(s.output_tokens_per_s), 1));
    const latestOf = (k) => s[k][s[k].length - 1];
    setTile("ttft", fmtSec(latestOf("ttft_p99_s")), `p50 ${fmtSec(latestOf("ttft_p50_s"))}`);
    setTile("tpot", fmtSec(latestOf("tpot_p99_s")), `p50 ${fmtSec(latestOf("tpot_p50_s"))}`);
    const errorShare = tot.requests ? tot.errors / tot.requests : 0;
    setTile("errors", fmtNum(tot.errors, 0), tot.requests ? `${fmtPct(errorShare)} of requests` : "since start",
      tot.errors ? "warn" : "good");
    const healthy = body.replicas.filter((r) => r.healthy).length;
    setTile("replicas", `${healthy} / ${body.replicas.length}`, body.replicas.map((r) => r.label).join(", "),
      healthy === body.replicas.length && healthy ? "good" : "bad");
    const a = body.alerts || {};
    setTile("alerts", a.firing ? `${a.firing} firing` : a.pending ? `${a.pending} pending` : "none firing",
      "shipped rules", a.firing ? "bad" : a.pending ? "warn" : "good");
  }

  function chartSeries(cfg) {
    // [[key, label, scale]] of this chart now (a group's members appear as they are seen)
    if (cfg.series) return cfg.series.map(([k, label, scale]) => [k, label, scale || "y"]);
    const group = app.data.series[cfg.group] || {};
    const label = (m) => (cfg.group !== "errors_per_s" ? m : /^\d+$/.test(m) ? `HTTP ${m}` : m.replace("stream:", "stream broken: "));
    return Object.keys(group).sort().map((m) => [`${cfg.group}/${m}`, label(m), "y"]);
  }
  function column(key) {
    const slash = key.indexOf("/");
    if (slash < 0) return app.data.series[key];
    return app.data.series[key.slice(0, slash)][key.slice(slash + 1)];
  }
  function axisValues(unit) {
    if (unit === "s") return (u, vals) => vals.map((v) => (v === null ? "" : v < 1 ? `${+(v * 1000).toFixed(1)} ms` : `${+v.toFixed(2)} s`));
    if (unit === "pct") return (u, vals) => vals.map((v) => (v === null ? "" : `${+(v * 100).toFixed(1)} %`));
    return (u, vals) => vals.map((v) => (v === null ? "" : `${+v.toFixed(2)}`));
  }
  const COUNT_STEPS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000];
  function yAxis(cfg, title, extra) {
    // a y axis: its numbers in the chart's unit, whole numbers only for counts, its title where the numbers
    // carry no unit (rates, counts)
    return { stroke: "#475569", values: axisValues(cfg.unit), size: 64,
      ...(cfg.unit === "count" ? { incrs: COUNT_STEPS } : {}),
      ...(title ? { label: title, labelSize: 18, labelFont: "12px system-ui, sans-serif", labelGap: 2 } : {}),
      ...extra };
  }
  function valueFmt(unit) {
    if (unit === "s") return (u, v) => fmtSec(v);
    if (unit === "pct") return (u, v) => fmtPct(v);
    if (unit === "rate") return (u, v) => (isNum(v) ? `${fmtNum(v, 2)}/s` : "–");
    return (u, v) => fmtNum(v, 2);
  }

  function drawCharts() {
    if (!app.data || typeof uPlot === "undefined") return;
    const t = app.data.t;
    const end = t.length ? t[t.length - 1] : Date.now() / 1000;
    let start = 0;
    while (start < t.length && t[start] < end - app.range) start++;
    for (const cfg of CHARTS) {
      const card = document.getElementById(`card-${cfg.id}`);
      if (!card) continue;
      const holder = card.querySelector(".plot");
      const series = chartSeries(cfg);
      const keys = series.map((s) => s[0]);
      const data = [t.slice(start), ...keys.map((k) => column(k).slice(start))];
      const fmt = valueFmt(cfg.unit);
      card.querySelector(".now").replaceChildren(...series.map(([k, label], i) => el("span", { class: "now-item" },
        el("i", { class: `swatch c${i % COLORS.length}` }), `${label} `, el("b", { "data-key": k, text: fmt(null, lastTick(column(k))) }))));
      let chart = app.charts[cfg.id];
      // nothing to draw in the range shown (no member yet, or only gaps): say why instead of empty axes
      if (!keys.length || data.slice(1).every((col) => col.every((v) => v === null))) {
        if (chart && chart.plot) chart.plot.destroy();
        app.charts[cfg.id] = { plot: null, keys: [] };
        holder.replaceChildren(el("p", { class: "empty", text: cfg.empty || "No data yet." }));
        continue;
      }
      if (!chart || !chart.plot || chart.keys.join("\n") !== keys.join("\n")) {
        if (chart && chart.plot) chart.plot.destroy();
        holder.replaceChildren();
        const y2 = series.some((s) => s[2] === "y2");
        const opts = {
          width: Math.max(holder.clientWidth, 240),
          height: 190,
          legend: { show: false },
          cursor: { drag: { x: false, y: false } },
          scales: { x: { time: true }, y: { range: (u, min, max) => [0, max > 0 ? max * 1.1 : 1] },
            ...(y2 ? { y2: { range: (u, min, max) => [0, max > 0 ? max * 1.1 : 1] } } : {}) },
          axes: [
            { stroke: "#475569", grid: { stroke: "#e2e8f0" }, space: 70, values: (u, vals, axis, space, incr) => vals.map((v) => (incr < 60 ? fmtTime(v) : fmtClock(v))) },
            yAxis(cfg, cfg.axis, { grid: { stroke: "#e2e8f0" } }),
            ...(y2 ? [yAxis(cfg, cfg.axis2, { scale: "y2", side: 1, grid: { show: false } })] : []),
          ],
          series: [{ value: (u, v) => (v === null ? "–" : fmtTime(v)) },
            ...series.map(([k, label, scale], i) => ({ label, scale, stroke: COLORS[i % COLORS.length], width: 2,
              spanGaps: false, points: { show: false }, value: valueFmt(cfg.unit) }))],
        };
        chart = { plot: new uPlot(opts, data, holder), keys };
        app.charts[cfg.id] = chart;
      } else {
        chart.plot.setData(data);
      }
    }
  }
  window.addEventListener("resize", () => {
    for (const [id, c] of Object.entries(app.charts)) {
      const holder = document.querySelector(`#card-${id} .plot`);
      if (c.plot && holder) c.plot.setSize({ width: Math.max(holder.clientWidth, 240), height: 190 });
    }
  });

  // --- requests ------------------------------------------------------------------------------------------
  // the columns whose cells are numbers (right-aligned, their headers too)
  const NUMERIC = new Set(["In", "Out", "TTFT", "TPOT", "E2E", "In flight", "Running", "Waiting", "KV usage", "Sample age", "Now"]);
  const FILTERS = [["model", "model"], ["key", "API key"], ["status", "status"], ["finish_reason", "finish reason"]];
  function requestsPage() {
    const q = new URLSearchParams(location.search);
    const controls = FILTERS.map(([name, label]) => el("label", {}, label,
      el("select", { name, "data-value": q.get(name) || "", onchange: () => applyFilters() }, el("option", { value: "", text: "any" }))));
    const slower = el("input", { type: "number", name: "slower_than", min: "0", step: "0.1", placeholder: "seconds",
      value: q.get("slower_than") || "", onchange: () => applyFilters() });
    const pause = el("label", { class: "pause" }, el("input", { type: "checkbox", name: "pause" }), "pause");
    put(
      el("h2", { text: "Requests" }),
      el("p", { class: "sub", text: "The newest request-log records (the lines the log writer emits), newest first. Click a row for where its time went." }),
      el("form", { class: "filters", onsubmit: (e) => { e.preventDefault(); applyFilters(); } },
        controls, el("label", {}, "slower than (e2e, s)", slower), pause),
      el("p", { class: "count", id: "count" }),
      el("table", { class: "rows", id: "rows" },
        el("thead", {}, el("tr", {}, ["Time (UTC)", "Request id", "Model", "Key", "Status", "Finish", "In", "Out", "TTFT", "TPOT", "E2E", "Replica"]
          .map((h) => el("th", { text: h, class: NUMERIC.has(h) ? "num" : null })))),
        el("tbody")));
    every(LIST_MS, () => { if (!main.querySelector("input[name=pause]").checked) loadRequests(); });
  }
  function applyFilters() {
    const q = new URLSearchParams();
    for (const s of main.querySelectorAll(".filters select")) if (s.value) q.set(s.name, s.value);
    const slower = main.querySelector("input[name=slower_than]").value;
    if (slower) q.set("slower_than", slower);
    history.replaceState(null, "", `/console/requests${q.toString() ? `?${q}` : ""}`);
    for (const s of main.querySelectorAll(".filters select")) s.dataset.value = s.value;
    loadRequests();
  }
  function fillSelect(select, values) {
    const wanted = select.dataset.value || "";
    const have = [...select.options].slice(1).map((o) => o.value).join("\n");
    if (select.name === "status") values = ["error", "2xx", "4xx", "5xx", ...values];
    if (wanted && !values.includes(wanted)) values = [...values, wanted];
    if (have !== values.join("\n")) {
      select.replaceChildren(el("option", { value: "", text: "any" }), ...values.map((v) => el("option", { value: v, text: v })));
    }
    select.value = wanted;
  }
  async function loadRequests() {
    const q = new URLSearchParams(location.search);
    let body;
    try {
      body = await api(`/console/api/requests?${q}`);
    } catch (e) {
      if (!(e instanceof LoginNeeded)) setStatus(e.message, true);
      return;
    }
    if (app.page !== "requests") return;
    const f = body.facets;
    for (const s of main.querySelectorAll(".filters select")) {
      fillSelect(s, { model: f.models, key: f.keys, status: f.statuses, finish_reason: f.finish_reasons }[s.name]);
    }
    document.getElementById("count").textContent =
      `${body.rows.length} shown · ${body.kept} kept of the newest ${body.capacity} · refreshed ${fmtTime(Date.now() / 1000)}`;
    const tbody = document.querySelector("#rows tbody");
    tbody.replaceChildren(...body.rows.map((r) => {
      const href = `/console/requests/${encodeURIComponent(r.event_id)}`;
      const bad = r.status >= 400 || r.stream_error;
      return el("tr", { "data-event-id": r.event_id, "data-request-id": r.request_id, class: bad ? "bad" : "",
        onclick: (e) => { if (!e.target.closest("a")) { history.pushState(null, "", href); route(); } } },
        el("td", { text: r.timestamp ? r.timestamp.slice(11, 23) : "–" }),
        el("td", {}, el("a", { href, text: r.request_id })),
        el("td", { text: r.model || "–" }), el("td", { text: r.key || "–" }),
        el("td", { title: r.error_type || null }, el("span", { class: `badge s${String(r.status)[0]}`, text: r.stream_error ? `${r.status} ✕ ${r.stream_error}` : r.status })),
        el("td", { text: (r.finish_reasons || []).join(", ") || "–" }),
        el("td", { class: "num", text: fmtNum(r.input_tokens, 0) }), el("td", { class: "num", text: fmtNum(r.output_tokens, 0) }),
        el("td", { class: "num", text: fmtSec(r.ttft_s) }), el("td", { class: "num", text: fmtSec(r.tpot_s) }),
        el("td", { class: "num", text: fmtSec(r.e2e_s) }), el("td", { text: r.replica || "–" }));
    }));
    setStatus(`live · ${body.kept} requests kept`);
  }

  // --- one request ---------------------------------------------------------------------------------------
  function kvTable(rows) {
    return el("table", { class: "kv" }, el("tbody", {}, rows.filter(Boolean).map(([k, v, field]) =>
      el("tr", {}, el("th", { text: k }), el("td", { "data-field": field || null, text: v })))));
  }
  async function requestPage(eventId) {
    const body = await api(`/console/api/requests/${encodeURIComponent(eventId)}`);
    const r = body.record, s = body.summary, kv = r.kvscope || {}, usage = (r.gen_ai || {}).usage || {};
    const e2e = kv.e2e_s || 0;
    const rows = body.waterfall.map((w) => {
      const left = e2e > 0 ? (100 * w.start_s) / e2e : 0;
      const width = e2e > 0 ? Math.max((100 * w.seconds) / e2e, 0.3) : 0;
      const kind = w.field.startsWith("kvscope.engine") ? "engine" : w.field === "kvscope.e2e_s" ? "total" : w.field.includes("upstream") ? "upstream" : "gateway";
      return el("div", { class: `wf-row ${kind}`, "data-field": w.field, "data-seconds": String(w.seconds) },
        el("div", { class: "wf-name", text: w.name }),
        el("div", { class: "wf-track" }, el("div", { class: "wf-bar", style: null, "data-left": left, "data-width": width })),
        el("div", { class: "wf-value", text: fmtSec(w.seconds) }));
    });
    const routing = kv.routing || {};
    const trace = body.trace.id
      ? body.trace.url ? el("a", { id: "trace-link", href: body.trace.url, target: "_blank", rel: "noopener", text: body.trace.id }) : el("code", { id: "trace-id", text: body.trace.id })
      : el("span", { text: "– (not traced)" });
    const content = (r.gen_ai || {}).input ? el("section", { class: "card" }, el("h3", { text: "Content (logs.log_content is on)" }),
      el("pre", { class: "content", text: JSON.stringify({ input: r.gen_ai.input, output: r.gen_ai.output }, null, 2) })) : null;
    put(
      el("p", {}, el("a", { href: "/console/requests", text: "← all requests" })),
      el("h2", {}, "Request ", el("code", { id: "request-id", text: s.request_id }), " ",
        el("span", { class: `badge s${String(s.status)[0]}`, text: s.status })),
      el("p", { class: "sub", text: `${s.timestamp} · ${s.method} ${s.path} · model ${s.model || "–"} · key ${s.key || "–"} · replica ${s.replica || "–"}` }),
      el("section", { class: "card" }, el("h3", { text: "Where the time went" }),
        el("p", { class: "sub", text: "From its log line: the gateway's phases add up to end to end; the engine's queue, prefill and decode lie inside the upstream's answer." }),
        el("div", { class: "waterfall", id: "waterfall" }, rows)),
      el("section", { class: "card" }, el("h3", { text: "Why (kvscope logs why)" }),
        el("pre", { class: "why", id: "why", text: body.why.text || body.why.error })),
      el("div", { class: "two" },
        el("section", { class: "card" }, el("h3", { text: "Tokens and latency" }), kvTable([
          ["input tokens", fmtNum(usage.input_tokens, 0), "gen_ai.usage.input_tokens"],
          ["output tokens", fmtNum(usage.output_tokens, 0), "gen_ai.usage.output_tokens"],
          ["cached (prefix cache)", fmtNum((usage.cache_read || {}).input_tokens, 0), "gen_ai.usage.cache_read.input_tokens"],
          ["TTFT", fmtSec(kv.ttft_s), "kvscope.ttft_s"], ["TPOT", fmtSec(kv.tpot_s), "kvscope.tpot_s"],
          ["end to end", fmtSec(kv.e2e_s), "kvscope.e2e_s"],
          ["finish", (s.finish_reasons || []).join(", ") || "–"], ["stream", String(s.stream)],
        ])),
        el("section", { class: "card" }, el("h3", { text: "Routing and trace" }), kvTable([
          ["policy", routing.policy || "–"], ["reason", routing.reason || "–"], ["replica", routing.replica || "–"],
          ["predicted cached tokens", fmtNum(routing.predicted_cached_tokens, 0)],
          ["reported cached tokens", fmtNum(routing.cached_tokens, 0)], ["attempts", fmtNum(kv.attempts, 0)],
          ["upstream kind", ((kv.upstream || {}).kind) || "–"],
        ]), el("p", {}, "trace id: ", trace),
        r.error && r.error.type ? el("p", { class: "error", text: `error ${r.error.type}: ${r.error.message || ""}` }) : null)),
      content,
      el("details", { class: "card" }, el("summary", { text: "The log line (JSON)" }),
        el("pre", { class: "line", text: JSON.stringify(r, null, 2) })));
    // bar geometry from data attributes (no inline style in the markup: the page's CSP allows none)
    for (const bar of main.querySelectorAll(".wf-bar")) {
      bar.style.marginLeft = `${bar.dataset.left}%`;
      bar.style.width = `${bar.dataset.width}%`;
    }
    setStatus(`request ${s.request_id}`);
  }

  // --- health --------------------------------------------------------------------------------------------
  const ORDER = { firing: 0, pending: 1, ok: 2, no_data: 3, not_evaluated: 4 };
  const STATE_TEXT = { firing: "FIRING", pending: "pending", ok: "ok", no_data: "no data", not_evaluated: "not here" };
  function healthPage() {
    put(el("h2", { text: "Health" }),
      el("p", { class: "sub", id: "health-summary" }),
      el("section", { class: "card" }, el("h3", { text: "Replicas" }),
        el("table", { class: "rows", id: "replicas" }, el("thead", {}, el("tr", {},
          ["Replica", "Kind", "Health", "In flight", "Running", "Waiting", "KV usage", "Sample age"].map((h) => el("th", { text: h, class: NUMERIC.has(h) ? "num" : null })))), el("tbody"))),
      el("section", { class: "card" }, el("h3", { text: "Alert conditions now" }),
        el("p", { class: "sub", text: "The shipped alert rules (alerts/kvscope.rules.yaml), evaluated in the gateway from its own series with the rules' thresholds, windows and ‘for’. Pending: holds, not yet for long enough to fire." }),
        el("table", { class: "rows", id: "alerts" }, el("thead", {}, el("tr", {},
          ["State", "Alert", "Severity", "For whom", "Now", "Holds when", "For", "What it means"].map((h) => el("th", { text: h, class: NUMERIC.has(h) ? "num" : null })))), el("tbody"))));
    every(LIST_MS, loadHealth);
  }
  async function loadHealth() {
    let body;
    try {
      body = await api("/console/api/health");
    } catch (e) {
      if (!(e instanceof LoginNeeded)) setStatus(e.message, true);
      return;
    }
    if (app.page !== "health") return;
    const alerts = body.alerts.slice().sort((a, b) => ORDER[a.state] - ORDER[b.state]);
    const firing = alerts.filter((a) => a.state === "firing").length, pending = alerts.filter((a) => a.state === "pending").length;
    const summary = document.getElementById("health-summary");
    summary.textContent = firing ? `${firing} alert condition(s) firing, ${pending} pending.` : pending ? `Nothing firing; ${pending} pending.` : "Nothing firing, nothing pending.";
    summary.className = `sub big ${firing ? "bad" : pending ? "warn" : "good"}`;
    document.querySelector("#alerts tbody").replaceChildren(...alerts.map((a) => {
      const name = a.alert + (a.labels.long_window ? ` (${a.labels.long_window})` : "");
      return el("tr", { class: `state-${a.state}`, "data-alert": a.alert, "data-state": a.state },
        el("td", {}, el("span", { class: `badge ${a.state}`, text: STATE_TEXT[a.state] })),
        el("td", {}, a.runbook_url ? el("a", { href: a.runbook_url, target: "_blank", rel: "noopener", text: name }) : name),
        el("td", { text: a.severity }), el("td", { text: a.subject }),
        el("td", { class: "num", text: fmtValue(a.value, a.unit) }), el("td", { text: a.condition || a.threshold || "–" }),
        el("td", { text: a.state === "pending" || a.state === "firing" ? `${fmtDur(a.holding_s)} of ${fmtDur(a.for_s)}` : fmtDur(a.for_s) }),
        el("td", { text: a.state === "not_evaluated" || a.state === "no_data" ? a.detail : `${a.summary} ${a.detail ? `(${a.detail})` : ""}` }));
    }));
    document.querySelector("#replicas tbody").replaceChildren(...body.replicas.map((r) =>
      el("tr", { class: r.healthy ? "" : "bad" },
        el("td", {}, el("b", { text: r.label }), el("div", { class: "sub", text: r.url })), el("td", { text: r.kind }),
        el("td", {}, el("span", { class: `badge ${r.healthy ? "ok" : "firing"}`, text: r.healthy ? (r.draining ? "draining" : "healthy") : "down" })),
        el("td", { class: "num", text: fmtNum(r.outstanding, 0) }), el("td", { class: "num", text: fmtNum(r.running, 0) }),
        el("td", { class: "num", text: fmtNum(r.waiting, 0) }), el("td", { class: "num", text: fmtPct(r.kv_usage) }),
        el("td", { class: "num", text: isNum(r.sample_age_s) ? `${r.sample_age_s.toFixed(1)} s` : "never scraped" }))));
    setStatus(`live · evaluated ${fmtTime(Date.now() / 1000)}`);
  }

  route();
})();
