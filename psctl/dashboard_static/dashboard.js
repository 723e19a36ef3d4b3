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
  return { plot: new uPlot(opts, chartData(t, chart), box), names: names.join("|") };
}

function draw(data) {
  events = data.events;
  for (const chart of data.charts) {
    const names = Object.keys(chart.series).join("|");
    const have = plots[chart.id];
    if (have && have.names === names) {
      have.plot.setData(chartData(data.t, chart));
    } else {
      if (have) { have.plot.destroy(); document.getElementById("chart-" + chart.id).remove(); }
      plots[chart.id] = makePlot(chart, data.t);
    }
  }
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
