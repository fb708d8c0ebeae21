// echo-swarm status page: polls /v1/status and redraws in place. No libraries: charts are plain SVG.
"use strict";
const POLL_MS = 2000;
const MEANS_COLORS = ["#7b4fa0", "#2a9d8f", "#d4a017", "#8a5a44", "#e76f51", "#5a7d2a"];
const $ = (id) => document.getElementById(id);
window.echoSwarm = { polls: 0, errors: 0, last: null };

const lineChart = window.echoCharts.lineChart;  // charts.js, loaded first

function fmt(x, digits = 3) { return x === null || x === undefined ? "–" : Number(x).toFixed(digits); }
function ago(t, now) {
  const s = Math.max(0, now - t);
  return s < 120 ? `${s.toFixed(0)} s ago` : s < 7200 ? `${(s / 60).toFixed(0)} min ago` : `${(s / 3600).toFixed(1)} h ago`;
}

function css(name) { return getComputedStyle(document.documentElement).getPropertyValue(name).trim(); }

function drawReward(s) {
  const curve = s.reward_curve || [];
  const pts = curve.map((r, i) => [i + 1, r]);
  const win = 10, smooth = [];
  for (let i = win; i <= curve.length; i++) smooth.push([i, curve.slice(i - win, i).reduce((a, b) => a + b, 0) / win]);
  const evals = (s.evals || []).map((e) => [e.version, e.accuracy]);
  // each reward's own mean per step, when the task combines several (a 10-step mean, like the total's)
  const means = Object.entries(s.reward_means || {}).map(([name, series], k) => {
    const ys = series.map((p) => p[1]);
    const pts10 = series.map((p, i) => [p[0], ys.slice(Math.max(0, i - 9), i + 1).reduce((a, b) => a + b, 0) / Math.min(i + 1, 10)]);
    return { name, points: pts10, color: MEANS_COLORS[k % MEANS_COLORS.length], cls: "reward-mean", width: 1.5 };
  });
  const top = Math.max(1, ...means.flatMap((m) => m.points.map((p) => p[1])));
  const host = $("reward-chart");
  lineChart(host, [
    { points: pts, color: css("--reward"), cls: "reward", width: 1 },
    { points: smooth, color: css("--smooth"), cls: "smooth", width: 2 },
    ...means,
    { points: evals, color: css("--acc"), cls: "acc", dots: true },
  ], { x0: 0, y0: Math.min(0, ...means.flatMap((m) => m.points.map((p) => p[1]))), y1: top, xint: true,
       xlabel: "learner step (policy version)", ylabel: "reward / accuracy" });
  host.dataset.points = String(pts.length);
  host.dataset.evals = String(evals.length);
  const legend = $("reward-means");
  legend.replaceChildren(...means.flatMap((m) => {
    const sw = document.createElement("span");
    sw.className = "sw";
    sw.style.background = m.color;  // a style property set from script, not an inline attribute (CSP)
    const label = document.createElement("span");
    label.textContent = `${m.name} (mean)`;
    return [sw, label];
  }));
  legend.dataset.series = String(means.length);
}

function drawThroughput(s) {
  const t = s.throughput || [];
  const start = t.length ? t[0].t - (t.length > 1 ? t[1].t - t[0].t : 0) : 0;
  const pts = t.map((b) => [b.t - start, b.tokens_per_s]);
  const host = $("throughput-chart");
  lineChart(host, [{ points: pts, color: css("--tput"), cls: "tput", width: 2 }],
    { x0: 0, y0: 0, xtime: true, xlabel: "time since the run started", ylabel: "tokens per second" });
  host.dataset.points = String(pts.filter((p) => p[1] > 0).length);
  const tot = s.totals || {};
  $("totals").textContent = ` · ${tot.accepted ?? 0} results accepted, ${tot.rejected ?? 0} refused, ${tot.reissued_jobs ?? 0} jobs reissued`;
}

function bars(host, counts) {
  const entries = Object.entries(counts || {});
  const max = Math.max(1, ...entries.map((e) => e[1]));
  host.replaceChildren(...entries.map(([k, v]) => {
    const row = document.createElement("div");
    row.className = "bar";
    // built node by node (no markup, no inline style attribute: the page runs under a strict CSP)
    const label = document.createElement("span");
    label.textContent = k;
    const fill = document.createElement("div");
    fill.className = "fill";
    fill.style.width = `${(100 * v) / max}%`;
    const num = document.createElement("span");
    num.className = "num";
    num.textContent = String(v);
    row.replaceChildren(label, fill, num);
    return row;
  }));
  if (!entries.length) host.textContent = "none active";
}

function drawClients(s) {
  const c = s.clients_summary || { by_state: {} };
  $("clients-state").replaceChildren(...Object.entries(c.by_state).map(([k, v]) => {
    const n = document.createElement("span");
    n.textContent = `${k}: ${v}`;
    return n;
  }));
  bars($("by-backend"), c.active_by_backend);
  bars($("by-platform"), c.active_by_platform);
}

function cell(tr, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  tr.appendChild(td);
}

function drawLeaderboard(s) {
  const rows = s.leaderboard || [];
  $("leaderboard").tBodies[0].replaceChildren(...rows.map((r) => {
    const tr = document.createElement("tr");
    tr.dataset.client = r.client_id;
    tr.dataset.credit = String(r.credit);
    cell(tr, r.rank);
    const who = document.createElement("td");
    const link = document.createElement("a");
    link.href = `/volunteer?id=${encodeURIComponent(r.client_id)}`;  // their own page
    link.textContent = r.name;
    who.appendChild(link);
    tr.appendChild(who);
    cell(tr, r.team || "–"); cell(tr, r.backend); cell(tr, r.platform);
    cell(tr, r.accepted, "num"); cell(tr, Math.round(r.credit).toLocaleString(), "num");
    return tr;
  }));
  $("leaderboard-empty").style.display = rows.length ? "none" : "";
}

function drawTeams(s) {
  const rows = s.teams || [];
  $("teams").tBodies[0].replaceChildren(...rows.map((t) => {
    const tr = document.createElement("tr");
    tr.dataset.team = t.team;
    tr.dataset.credit = String(t.credit);
    cell(tr, t.rank); cell(tr, t.team); cell(tr, t.members, "num"); cell(tr, t.accepted, "num");
    cell(tr, Math.round(t.credit).toLocaleString(), "num");
    return tr;
  }));
  $("teams-empty").style.display = rows.length ? "none" : "";
}

function drawVersions(s) {
  $("versions").tBodies[0].replaceChildren(...(s.recent_versions || []).map((v) => {
    const tr = document.createElement("tr");
    cell(tr, v.version); cell(tr, ago(v.created_at, s.server_time)); cell(tr, fmt(v.mean_reward), "num");
    cell(tr, fmt(v.heldout_accuracy), "num"); cell(tr, v.step_s === null ? "–" : `${fmt(v.step_s, 2)} s`, "num");
    cell(tr, v.manifest_sha256.slice(0, 16));
    return tr;
  }));
}

function drawSummary(s) {
  $("version").textContent = s.version;
  $("max-steps").textContent = ` / ${s.max_steps}`;
  $("sync-mode").textContent = s.sync_mode + (s.sync_mode === "async-push-pull" ? ` (S=${s.max_staleness})` : "");
  $("task").textContent = s.task;
  const st = $("run-state");
  const [text, cls] = s.finished ? ["finished", "finished"] : s.issuing_paused ? ["paused by operator", "paused"] : ["training", "running"];
  st.textContent = text;
  st.className = "pill " + cls;
  const eg = s.snapshot_egress || {};
  const mb = (n) => `${((n || 0) / 1e6).toFixed(0)} MB`;
  $("egress").textContent = `${mb(eg.coordinator_bytes)} from coordinator` + (eg.p2p ? ` · ${mb(eg.peer_bytes)} by peers` : "");
  $("updated").textContent = new Date().toLocaleTimeString();
}

async function poll() {
  try {
    const resp = await fetch("/v1/status?view=page", { cache: "no-store" });
    if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
    const s = await resp.json();
    drawSummary(s); drawReward(s); drawThroughput(s); drawClients(s); drawLeaderboard(s); drawTeams(s); drawVersions(s);
    window.echoSwarm.polls += 1;
    window.echoSwarm.last = { version: s.version, points: (s.reward_curve || []).length };
  } catch (err) {
    window.echoSwarm.errors += 1;
    const st = $("run-state");
    st.textContent = "coordinator unreachable — retrying";
    st.className = "pill offline";
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

poll();
