// llmq dashboard: polls /dashboard/api/pool every 2 s, appends new chart samples, and follows one
// request's events over server-sent events. No framework, no build step; every value from the
// server is put into the page as text (never as HTML), since payloads are user content.
"use strict";
(() => {
  const POLL_MS = 2000;
  const HOUR_MS = 3600 * 1000;
  const csrf = document.querySelector('meta[name="llmq-csrf"]').content;
  const $ = (selector) => document.querySelector(selector);

  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(props || {})) {
      if (name === "dataset") Object.assign(node.dataset, value);
      else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
      else node[name] = value;
    }
    for (const child of children) node.append(child === null || child === undefined ? "" : child);
    return node;
  }

  async function api(path, options = {}) {
    const response = await fetch(path, {
      credentials: "same-origin", ...options,
      headers: { "X-CSRF-Token": csrf, ...(options.headers || {}) },
    });
    if (response.status === 401) { location.reload(); throw new Error("signed out"); }
    const body = await response.json().catch(() => ({}));
    if (!response.ok) throw new Error(body.error ? body.error.message : response.statusText);
    return body;
  }

  const fmt = {
    num: (x, digits = 1) => (x === null || x === undefined ? "–" : Number(x).toLocaleString(
      undefined, { maximumFractionDigits: digits })),
    pct: (x) => (x === null || x === undefined ? "–" : `${Math.round(x * 100)}%`),
    ms: (x) => (x === null || x === undefined ? "–" : x >= 1000 ? `${(x / 1000).toFixed(2)} s`
      : `${Math.round(x)} ms`),
    age: (seconds) => (seconds < 60 ? `${seconds.toFixed(1)} s ago`
      : `${Math.floor(seconds / 60)} min ago`),
    when: (ms) => new Date(ms).toLocaleTimeString(),
  };

  function cell(value, className = "num") { return el("td", { className }, String(value)); }

  function emptyRow(table, text) {
    const columns = $(`${table} thead tr`).children.length;
    return el("tr", {}, el("td", { className: "empty", colSpan: columns }, text));
  }

  // -- queues, workers, dead letters ------------------------------------------------------------

  function renderQueues(queues) {
    const rows = queues.map((q) => el("tr", { dataset: { queue: q.queue } },
      cell(q.queue, "queue"), cell(q.lag ?? "?", "num lag"), cell(q.pending, "num pending"),
      cell(q.length, "num length"), cell(q.dead_letters, "num dead"),
      cell(q.consumers, "num consumers"), cell(fmt.num(q.tokens_per_s), "num tps"),
      cell(fmt.num(q.requests_per_s, 2), "num rps"),
      cell(fmt.pct(q.prefix_hit_rate), "num prefix")));
    $("#queues tbody").replaceChildren(...(rows.length ? rows : [emptyRow("#queues", "no queues")]));
  }

  // Done per second between two polls, per lane (the server sends counts, not rates).
  let lastLanes = { at: 0, done: new Map() };

  function renderLanes(lanes, nowMs) {
    const seconds = (nowMs - lastLanes.at) / 1000;
    const done = new Map(lanes.map((l) => [`${l.queue} ${l.lane}`, l.done]));
    const rows = lanes.map((l) => {
      const before = lastLanes.done.get(`${l.queue} ${l.lane}`);
      const rate = before == null || l.done == null || seconds <= 0 ? "?"
        : fmt.num(Math.max(0, l.done - before) / seconds, 2);
      return el("tr", { dataset: { queue: l.queue, lane: l.lane } },
        cell(l.queue, "queue"), cell(l.lane, "lane"), cell(l.backlog, "num lag"),
        cell(l.pending, "num pending"), cell(l.done ?? "?", "num done"), cell(rate, "num rps"));
    });
    lastLanes = { at: nowMs, done };
    $("#lanes tbody").replaceChildren(...(rows.length ? rows : [emptyRow("#lanes", "no lanes")]));
  }

  function workerState(w, staleAfter) {
    if (w.heartbeat_age_s > staleAfter) return ["stale", "no heartbeat"];
    if (w.draining) return ["draining", "draining"];
    if (w.sleeping) return ["sleeping", `sleeping (level ${w.sleeping})`];
    return ["serving", "serving"];
  }

  // the LoRA adapters in memory, of those the worker's --lora-dir holds (heartbeat fields)
  function loras(w) {
    const loaded = (w.loras_loaded || "").split(",").filter(Boolean);
    const available = (w.loras_available || "").split(",").filter(Boolean);
    if (!loaded.length && !available.length) return "–";
    return `${loaded.join(", ") || "none"} (${loaded.length} of ${available.length})`;
  }

  function renderWorkers(workers, staleAfter) {
    const rows = workers.map((w) => {
      const [kind, label] = workerState(w, staleAfter);
      return el("tr", { dataset: { worker: w.worker_id } },
        cell(w.worker_id, "worker"), cell(w.queue, "queue"), cell(w.model || "–", "model"),
        el("td", { className: "state" }, el("span", { className: `badge ${kind}` }, label)),
        cell(w.running, "num running"), cell(w.waiting, "num waiting"),
        cell(fmt.pct(w.kv_usage), "num kv"), cell(fmt.pct(w.prefix_cache_hit_rate), "num prefix"),
        cell(fmt.num(w.tokens_per_s), "num tps"), cell(loras(w), "loras"),
        cell(fmt.age(w.heartbeat_age_s), "num age"));
    });
    $("#workers tbody").replaceChildren(
      ...(rows.length ? rows : [emptyRow("#workers", "no live workers")]));
  }

  function renderDeadLetters(letters, viewer) {
    const rows = letters.map((d) => el("tr", { dataset: { entry: d.dlq_entry_id, queue: d.queue } },
      cell(d.queue, "queue"), cell(d.request_id || "–", "request"), cell(d.code, "code"),
      cell(d.message, "message"), cell(d.deliveries, "num deliveries"),
      cell(fmt.when(d.at_ms), "when"), cell(d.payload || "(not kept)", "payload"),
      el("td", {}, el("button", {
        className: "retry", type: "button", disabled: !d.payload,
        onclick: (event) => act(event.target,
          `/dashboard/api/dead-letters/${enc(d.queue)}/${enc(d.dlq_entry_id)}/retry`),
      }, "Retry"))));
    $("#dead-letters tbody").replaceChildren(
      ...(rows.length ? rows : [emptyRow("#dead-letters", viewer.admin ? "no dead letters"
        : "none of your requests is a dead letter")]));
    $("#dead-scope").textContent = viewer.admin ? "(every tenant's)" : "(your requests only)";
    const queues = [...new Set(letters.map((d) => d.queue))].sort();
    $("#purge-buttons").replaceChildren(...queues.map((queue) => el("button", {
      className: "purge danger", type: "button", dataset: { queue },
      onclick: (event) => {
        const whose = viewer.admin ? "every dead letter" : "your dead letters";
        if (confirm(`Delete ${whose} of queue ${queue}?`)) {
          act(event.target, `/dashboard/api/dead-letters/${enc(queue)}/purge`);
        }
      },
    }, viewer.admin ? `Purge ${queue}` : `Purge my ${queue} letters`)));
  }

  const enc = encodeURIComponent;

  async function act(button, path) {
    button.disabled = true;
    try {
      await api(path, { method: "POST" });
    } catch (error) {
      alert(error.message);
    }
    deadLettersSeen = null;
    refresh();
  }

  // NOTE: dead letters keep their payloads (up to 1 MiB each): fetched when a queue's count
  // changes, after a button, and every 30 s, not on every poll.
  let deadLettersSeen = null;
  let deadLettersAt = 0;

  async function refreshDeadLetters(queues, viewer) {
    const counts = JSON.stringify(queues.map((q) => [q.queue, q.dead_letters]));
    if (counts === deadLettersSeen && Date.now() - deadLettersAt < 30000) return;
    const body = await api("/dashboard/api/dead-letters");
    deadLettersSeen = counts;
    deadLettersAt = Date.now();
    renderDeadLetters(body.dead_letters, viewer);
  }

  // -- charts: hand-drawn SVG over the last hour ------------------------------------------------

  // NOTE: rates (tokens, requests, preemptions) are the gateway's, over its stated window
  // (rate_window_s), the same function the queue table reads: the table and the chart agree.
  const CHARTS = [
    { title: "Tokens/s", rate: true, lines: [["tokens_per_s", ""]], format: (x) => fmt.num(x, 1) },
    { title: "Requests/s", rate: true, lines: [["requests_per_s", ""]],
      format: (x) => fmt.num(x, 2) },
    { title: "Queue lag (requests)", lines: [["lag", ""]], format: (x) => fmt.num(x, 1) },
    { title: "Queue time", lines: [["queue_p50_ms", "p50"], ["queue_p95_ms", "p95"]],
      format: fmt.ms },
    { title: "TTFT after admission", lines: [["ttft_p50_ms", "p50"], ["ttft_p95_ms", "p95"]],
      format: fmt.ms },
    { title: "Inter-token latency", lines: [["itl_p50_ms", "p50"], ["itl_p95_ms", "p95"]],
      format: fmt.ms },
    { title: "End-to-end latency", lines: [["e2e_p50_ms", "p50"], ["e2e_p95_ms", "p95"]],
      format: fmt.ms },
    { title: "KV cache use", lines: [["kv_usage", "mean"], ["kv_usage_max", "max"]],
      format: fmt.pct, max: 1 },
    { title: "Preemptions/s", rate: true, lines: [["preemptions_per_s", ""]],
      format: (x) => fmt.num(x, 2) },
  ];
  const SVG = "http://www.w3.org/2000/svg";
  const W = 320, H = 150, LEFT = 48, RIGHT = 8, TOP = 8, BOTTOM = 20;
  let samples = [];
  let intervalMs = 10000;
  let rateWindowS = 60;

  function svg(tag, attrs, text) {
    const node = document.createElementNS(SVG, tag);
    for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function niceStep(raw) {
    const power = 10 ** Math.floor(Math.log10(raw));
    return [1, 2, 2.5, 5, 10].map((m) => m * power).find((step) => step >= raw);
  }

  function windowLabel() {
    return rateWindowS % 60 ? `${rateWindowS} s` : `${rateWindowS / 60} min`;
  }

  function drawChart(chart, start, now) {
    const x = (t) => LEFT + ((t - start) / (now - start)) * (W - LEFT - RIGHT);
    const values = samples.flatMap((s) => chart.lines.map(([key]) => s[key]))
      .filter((v) => v !== null && v !== undefined);
    // NOTE: a chart of zeros still gets a scale (0 to 1), not a collapsed one.
    const peak = Math.max(0, ...values);
    const step = chart.max ? chart.max / 4 : niceStep(peak > 0 ? peak / 4 : 0.25);
    const top = chart.max || step * Math.max(1, Math.ceil(peak / step));
    const y = (v) => TOP + (H - TOP - BOTTOM) * (1 - v / top);
    const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img",
      "aria-label": `${chart.title} over the last ${Math.round((now - start) / 60000)} min` });
    // y: gridlines at round values, labelled with the unit
    for (let v = 0; v <= top + step / 2; v += step) {
      root.append(svg("line", { class: v ? "grid" : "axis", x1: LEFT, x2: W - RIGHT,
        y1: y(v), y2: y(v) }));
      root.append(svg("text", { x: LEFT - 4, y: y(v) + 3, "text-anchor": "end" },
        chart.format(v)));
    }
    // x: four clock times, with gridlines
    const short = now - start <= 5 * 60 * 1000;
    for (let i = 0; i <= 3; i += 1) {
      const t = start + ((now - start) * i) / 3;
      root.append(svg("line", { class: "grid", x1: x(t), x2: x(t), y1: TOP, y2: H - BOTTOM }));
      const label = new Date(t).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit",
        hourCycle: "h23", ...(short ? { second: "2-digit" } : {}) });
      root.append(svg("text", { x: x(t), y: H - 6,
        "text-anchor": i === 0 ? "start" : i === 3 ? "end" : "middle" }, label));
    }
    // the lines: a missing sample or a null value is a gap, never bridged
    chart.lines.forEach(([key], index) => {
      let d = "";
      let run = [];
      const flush = () => {
        if (run.length === 1) {
          root.append(svg("circle", { class: `dot${index}`, cx: run[0][0], cy: run[0][1], r: 1.8 }));
        }
        run = [];
      };
      let previous = null;
      for (const s of samples) {
        const v = s[key];
        if (v === null || v === undefined) { flush(); previous = null; continue; }
        const gap = previous === null || s.t - previous > intervalMs * 2.5;
        if (gap) flush();
        const point = [x(s.t).toFixed(1), y(v).toFixed(1)];
        d += `${gap ? "M" : "L"}${point[0]},${point[1]}`;
        run.push(point);
        previous = s.t;
      }
      flush();
      if (d) root.append(svg("path", { class: `line${index}`, d }));
    });
    const last = samples.length ? samples[samples.length - 1] : {};
    const title = chart.rate ? `${chart.title} (${windowLabel()} window)` : chart.title;
    const heading = el("h3", {}, title, ...chart.lines.filter(([, label]) => label)
      .map(([, label], index) => el("span", { className: `key${index}` }, label)),
    el("span", { className: "now" }, chart.lines.map(([key]) => chart.format(last[key]))
      .join(" / ")));
    return el("div", { className: "chart", dataset: { chart: chart.lines[0][0] } }, heading, root);
  }

  function drawCharts() {
    // NOTE: the hour, or less while the series is younger (at least a minute), so a pool
    // started a moment ago fills the chart rather than its last pixel.
    const now = Date.now();
    const first = samples.length ? samples[0].t : now;
    const start = Math.max(now - HOUR_MS, Math.min(first, now - 60 * 1000));
    $("#charts").replaceChildren(...CHARTS.map((chart) => drawChart(chart, start, now)));
  }

  async function refreshSeries() {
    const since = samples.length ? samples[samples.length - 1].t : 0;
    const series = await api(`/dashboard/api/series?since=${since}`);
    intervalMs = series.interval_s * 1000;
    rateWindowS = series.rate_window_s || rateWindowS;
    const cutoff = Date.now() - HOUR_MS;
    samples = samples.concat(series.samples).filter((s) => s.t >= cutoff);
    drawCharts();
  }

  // -- jobs: batches and dataset jobs ----------------------------------------------------------

  const JOBS_EVERY_MS = 4000; // rq's jobs are read in a thread: every other poll is plenty
  let jobsReadAt = 0;

  function duration(seconds) {
    if (seconds === null || seconds === undefined) return "–";
    const s = Math.round(seconds);
    if (s < 60) return `${s} s`;
    if (s < 3600) return `${Math.floor(s / 60)} min ${s % 60} s`;
    return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
  }

  function jobRow(job) {
    const finished = job.completed + job.failed;
    const progress = el("progress", { max: job.total || 1, value: job.total ? finished : 0 });
    const label = `${finished} / ${job.total ?? "?"}`;
    let status = job.status;
    if (job.kind === "dataset" && job.status === "running" && job.updated_s_ago > 60) {
      status = `running? (no news for ${duration(job.updated_s_ago)})`;
    }
    const name = job.tenant ? `${job.id} (${job.tenant})` : job.id;
    return el("tr", { dataset: { job: job.id, kind: job.kind } },
      cell(job.kind === "batch" ? "batch" : "dataset", "kind"), cell(name, "job"),
      el("td", { className: "status" }, el("span", { className: `badge ${job.status}` }, status)),
      el("td", { className: "progress" }, progress, " ", label),
      cell(job.completed, "num completed"), cell(job.failed, "num failed"),
      cell(job.total ?? "?", "num total"),
      cell(job.created_at ? fmt.when(job.created_at * 1000) : "–", "created"),
      cell(duration(job.elapsed_s), "num elapsed"));
  }

  async function refreshJobs(viewer) {
    if (Date.now() - jobsReadAt < JOBS_EVERY_MS) return;
    jobsReadAt = Date.now();
    const jobs = await api("/dashboard/api/jobs");
    const rows = jobs.batches.concat(jobs.datasets).map(jobRow);
    $("#jobs tbody").replaceChildren(...(rows.length ? rows : [emptyRow("#jobs", "no jobs")]));
    $("#jobs-scope").textContent = jobs.scope === "pool" ? "(every tenant's, and dataset jobs)"
      : `(tenant ${viewer.tenant}'s batches only)`;
    $("#jobs-note").textContent = jobs.note || (jobs.scope === "pool" ? ""
      : "Only the batches you created are listed; other tenants' batches and the operators' "
        + "dataset jobs (llmq run) are not shown to you.");
  }

  // -- polling ----------------------------------------------------------------------------------

  async function refresh() {
    try {
      const pool = await api("/dashboard/api/pool");
      const viewer = pool.viewer;
      $("#viewer").textContent = viewer.admin ? `admin (${viewer.tenant})` : `tenant ${viewer.tenant}`;
      rateWindowS = pool.rate_window_s || rateWindowS;
      for (const node of document.querySelectorAll(".rate-window")) {
        node.textContent = `(${windowLabel()})`;
      }
      $("#scope").textContent = viewer.admin ? ""
        : `Signed in as tenant ${viewer.tenant}: queues, workers, rates and charts cover the whole `
          + "pool (every tenant's requests); dead letters, the request inspector and purges cover "
          + "only your own requests, so a queue's dead-letter count can exceed the letters you see; "
          + "jobs are your own batches.";
      renderQueues(pool.queues);
      renderLanes(pool.lanes || [], pool.now_ms);
      renderWorkers(pool.workers, pool.stale_after_s);
      await refreshDeadLetters(pool.queues, viewer);
      await refreshJobs(viewer);
      await refreshSeries();
      $("#updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
    } catch (error) {
      $("#updated").textContent = `update failed: ${error.message}`;
    }
  }

  // -- the request inspector --------------------------------------------------------------------

  let source = null;
  let watched = null;

  function inspect(requestId) {
    if (source) source.close();
    watched = requestId;
    let text = "";
    let deltas = 0;
    const status = $("#inspect-status");
    const log = $("#inspect-events");
    const cancel = $("#inspect-cancel");
    $("#inspect-text").textContent = "";
    log.replaceChildren();
    status.textContent = "waiting for events…";
    cancel.disabled = false;
    source = new EventSource(`/dashboard/api/requests/${enc(requestId)}/events`);
    const finish = (message) => {
      status.textContent = message;
      cancel.disabled = true;
      source.close();
    };
    source.onmessage = (message) => {
      const event = JSON.parse(message.data);
      if (event.type === "delta") {
        text += event.text;
        deltas += 1;
        $("#inspect-text").textContent = text;
        status.textContent = `streaming: ${deltas} delta${deltas === 1 ? "" : "s"}`;
        return;
      }
      log.append(el("li", {}, describe(event)));
      if (event.type === "start") {
        if (event.restarted) text = "";
        status.textContent = `running on ${event.worker} (attempt ${event.attempt})`;
      } else if (event.type === "done") {
        $("#inspect-text").textContent = event.text;
        finish(`done: ${event.finish_reason}`);
      } else if (event.type === "error") {
        finish(`error ${event.code}: ${event.message}`);
      } else if (event.type === "unknown") {
        status.textContent = "no events yet (unknown id, not started, or expired): waiting…";
      } else if (event.type === "gone") {
        finish(event.message);
      }
    };
    source.onerror = () => {
      if (source.readyState !== EventSource.CLOSED) status.textContent = "reconnecting…";
    };
  }

  function describe(event) {
    const parts = [event.type];
    if (event.attempt) parts.push(`attempt ${event.attempt}`);
    if (event.worker) parts.push(`worker ${event.worker}`);
    if (event.finish_reason) parts.push(event.finish_reason);
    if (event.code) parts.push(event.code);
    if (event.message) parts.push(event.message);
    return parts.join(" · ");
  }

  $("#inspect-form").addEventListener("submit", (event) => {
    event.preventDefault();
    inspect($("#inspect-id").value.trim());
  });
  $("#inspect-cancel").addEventListener("click", async () => {
    if (!watched) return;
    try {
      await api(`/dashboard/api/requests/${enc(watched)}/cancel`, { method: "POST" });
      $("#inspect-status").textContent = "cancel sent…";
    } catch (error) {
      $("#inspect-status").textContent = `cancel failed: ${error.message}`;
    }
  });
  $("#logout-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    await fetch("/dashboard/logout", { method: "POST", headers: { "X-CSRF-Token": csrf } });
    location.reload();
  });

  refresh();
  setInterval(refresh, POLL_MS);
})();
