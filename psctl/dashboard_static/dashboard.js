// psctl dashboard: fetches /api/series and draws each chart with uPlot (served locally).
// Membership changes are drawn as dashed vertical lines on every chart's time axis.
"use strict";

const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
                "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];
const plots = {};
let events = [];
let refreshes = 0;

function eventMarks() {
  return {
    hooks: {
      draw: [(u) => {
        const ctx = u.ctx;
        ctx.save();
        ctx.strokeStyle = "#888";
        ctx.fillStyle = "#555";
        ctx.setLineDash([4, 4]);
        ctx.font = `${11 * devicePixelRatio}px sans-serif`;
        for (const e of events) {
          const x = u.valToPos(e.t, "x", true);
          if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) continue;
          ctx.beginPath();
          ctx.moveTo(x, u.bbox.top);
          ctx.lineTo(x, u.bbox.top + u.bbox.height);
          ctx.stroke();
          ctx.fillText(e.text, x + 3, u.bbox.top + 12 * devicePixelRatio);
        }
        ctx.restore();
      }],
    },
  };
}

function chartData(t, chart) {
  return [t, ...Object.values(chart.series)];
}

function makePlot(chart, t) {
  const box = document.createElement("div");
  box.className = "chart";
  box.id = "chart-" + chart.id;
  const title = document.createElement("h2");
  title.textContent = `${chart.title} (${chart.unit})`;
  box.appendChild(title);
  const note = document.createElement("p");
  note.className = "note";
  box.appendChild(note);
  document.getElementById("charts").appendChild(box);
  const names = Object.keys(chart.series);
  const opts = {
    width: 580,
    height: 220,
    scales: { x: { time: true } },
    series: [{}, ...names.map((name, i) => ({
      label: name, stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: false,
    }))],
    // Three significant digits: uPlot's default shows 0.0015 and 0.0012 both as 0.001.
    axes: [{}, { label: chart.unit, size: 60,
                 values: (u, vals) => vals.map((v) => (v == null ? "" : String(+v.toPrecision(3)))) }],
    plugins: [eventMarks()],
  };
  return {
    plot: new uPlot(opts, chartData(t, chart), box), names: names.join("|") + "#" + chart.unit,
    title, note,
  };
}

// What the steps count, in words: a DiLoCo job's shards count outer steps.
function jobLine(diloco) {
  if (!diloco) return "";
  const h = diloco.between;  // the inner steps between outer steps, in words (psctl status)
  const outer = diloco.outer_sync ? "synchronous" : "asynchronous";
  return `DiLoCo, ${outer} outer steps, each after ${h}: the shards' clocks, steps/s, ` +
    "staleness and membership steps count outer steps; the table's inner steps and bytes " +
    "per outer step come from the workers' reports.";
}

function cell(row, text, header) {
  const c = document.createElement(header ? "th" : "td");
  c.textContent = text;
  row.appendChild(c);
}

function size(bytes) {
  if (bytes == null) return "-";
  let value = bytes;
  for (const unit of ["B", "KiB", "MiB"]) {
    if (value < 1024) return unit === "B" ? `${value} B` : `${value.toFixed(1)} ${unit}`;
    value /= 1024;
  }
  return `${value.toFixed(1)} GiB`;
}

// One row per worker: its clock on the shards, its own steps and bytes from its reports.
function drawWorkers(data) {
  const table = document.getElementById("workers");
  table.replaceChildren();
  if (!data.workers.length) return;
  const diloco = data.diloco != null;
  const per = diloco ? "per outer step" : "per step";
  const head = table.insertRow();
  for (const h of ["worker", "live", diloco ? "outer steps" : "steps (shards)",
                   diloco ? "inner steps" : "steps (reported)",
                   diloco ? "inner steps/s" : "steps/s (reported)", `sent ${per}`,
                   `received ${per}`, "sent, total", "received, total", "loss"]) {
    cell(head, h, true);
  }
  for (const w of data.workers) {
    const row = table.insertRow();
    row.id = `worker-${w.worker}`;
    cell(row, String(w.worker));
    cell(row, w.live == null ? "-" : (w.live ? "yes" : "no"));
    cell(row, w.clock == null ? "-" : String(w.clock));
    cell(row, w.step == null ? "-" : String(w.step));
    cell(row, w.steps_per_s == null ? "-" : w.steps_per_s.toFixed(2));
    cell(row, size(w.bytes_sent));
    cell(row, size(w.bytes_received));
    cell(row, size(w.bytes_sent_total));
    cell(row, size(w.bytes_received_total));
    cell(row, w.loss == null ? "-" : String(+w.loss.toPrecision(4)));
  }
}

function draw(data) {
  events = data.events;
  for (const chart of data.charts) {
    // A new series, or a new unit (the job turned out to be DiLoCo): drawn afresh.
    const names = Object.keys(chart.series).join("|") + "#" + chart.unit;
    const have = plots[chart.id];
    if (have && have.names === names) {
      have.plot.setData(chartData(data.t, chart));
    } else {
      if (have) { have.plot.destroy(); document.getElementById("chart-" + chart.id).remove(); }
      plots[chart.id] = makePlot(chart, data.t);
    }
    plots[chart.id].title.textContent = `${chart.title} (${chart.unit})`;
    plots[chart.id].note.textContent = chart.note || "";
  }
  drawWorkers(data);
  document.getElementById("job").textContent = jobLine(data.diloco);
  document.getElementById("step-unit").textContent = data.step_unit;
  document.getElementById("steps").textContent = String(data.steps);
  document.getElementById("samples").textContent = String(data.samples);
  document.getElementById("errors").textContent = data.errors.join("; ");
  document.getElementById("events").textContent = data.events.length
    ? "membership: " + data.events.map((e) => e.text).join(", ") : "";
  refreshes += 1;
  const r = document.getElementById("refreshes");
  r.textContent = String(refreshes);
  r.dataset.refreshes = String(refreshes);
}

async function refresh() {
  try {
    const reply = await fetch("/api/series", { cache: "no-store" });
    if (reply.ok) draw(await reply.json());
    else document.getElementById("errors").textContent = `dashboard: HTTP ${reply.status}`;
  } catch (err) {
    document.getElementById("errors").textContent = `dashboard unreachable: ${err}`;
  }
  setTimeout(refresh, window.DASHBOARD_INTERVAL_MS || 1000);
}

refresh();
