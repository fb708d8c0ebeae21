// echo-swarm's local control page: polls /api/state every second; buttons POST JSON to /api/<action>.
// The page's cookie (set by /?token=…) authorises every request; no inline script or style (strict CSP).
"use strict";
const POLL_MS = 1000;
const $ = (id) => document.getElementById(id);
window.echoControl = { polls: 0, errors: 0, last: null, actions: 0 };

function mb(n) { return n >= 1e9 ? `${(n / 1e9).toFixed(2)} GB` : `${((n || 0) / 1e6).toFixed(1)} MB`; }
function clock(t) { return new Date(t * 1000).toLocaleTimeString(); }

function cell(tr, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  tr.appendChild(td);
}

const SVG = "http://www.w3.org/2000/svg";
function svgEl(name, attrs) {
  const el = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, String(v));
  return el;
}
function day(t) { return new Date(t * 1000).toLocaleDateString(); }

// lifetime credit over time: a step line from the ledger's points, axes labelled with the first and last day and
// the total (swarm_client/lifetime.py)
function drawPlot(points) {
  const svg = $("credit-plot");
  svg.dataset.points = String(points.length);
  const W = 900, H = 180, L = 60, R = 10, T = 10, B = 24;
  const kids = [svgEl("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis" }),
    svgEl("line", { x1: L, y1: T, x2: L, y2: H - B, class: "axis" })];
  if (points.length) {
    const t0 = points[0][0], t1 = Math.max(points[points.length - 1][0], t0 + 1);
    const top = Math.max(...points.map((p) => p[1]), 1);
    // within two days the ends are times (within an hour, to the second), beyond that days
    const span = t1 - t0;
    const when = span < 2 * 86400 ? (t) => new Date(t * 1000).toLocaleString([], {
      month: "short", day: "numeric", hour: "2-digit", minute: "2-digit",
      ...(span < 3600 ? { second: "2-digit" } : {}) }) : day;
    const x = (t) => L + ((t - t0) / (t1 - t0)) * (W - L - R), y = (c) => H - B - (c / top) * (H - B - T);
    let d = `M ${x(points[0][0]).toFixed(1)} ${y(0).toFixed(1)}`;
    for (const [t, c] of points) d += ` H ${x(t).toFixed(1)} V ${y(c).toFixed(1)}`;
    kids.push(svgEl("path", { d, class: "credit" }));
    const label = (text, attrs) => { const el = svgEl("text", attrs); el.textContent = text; return el; };
    kids.push(label(Math.round(top).toLocaleString(), { x: L - 4, y: T + 8, "text-anchor": "end" }),
      label("0", { x: L - 4, y: H - B, "text-anchor": "end" }),
      label(when(t0), { x: L, y: H - 6, "text-anchor": "start" }),
      label(when(t1), { x: W - R, y: H - 6, "text-anchor": "end" }));
  }
  svg.replaceChildren(...kids);
}

function drawLifetime(life) {
  const total = life.total || {};
  $("lifetime-total").textContent = total.runs
    ? `${Math.round(total.credit).toLocaleString()} credit, ${total.accepted} results accepted over ${total.runs} ` +
      `run${total.runs === 1 ? "" : "s"} since ${day(total.since)}`
    : "Nothing yet: the first accepted result starts the record.";
  drawPlot(life.points || []);
  $("runs").tBodies[0].replaceChildren(...(life.runs || []).map((r) => {
    const tr = document.createElement("tr");
    tr.dataset.run = r.run_id;
    cell(tr, r.run_id); cell(tr, r.url); cell(tr, day(r.first_at)); cell(tr, clock(r.last_at));
    cell(tr, r.accepted, "num"); cell(tr, r.rejected, "num"); cell(tr, Math.round(r.credit).toLocaleString(), "num");
    return tr;
  }));
}

function draw(s) {
  const c = s.controls || {};
  const st = $("state");
  st.textContent = s.state + (c.finishing ? " (finishing)" : "");
  st.className = "pill " + (s.state === "generating" || s.state === "fetching" || s.state === "waiting" ? "working"
    : s.state === "stopped" || s.state.startsWith("coordinator unreachable") ? "off" : "held");
  st.dataset.state = s.state;
  st.dataset.paused = String(!!c.paused);
  // only the buttons that would change something: Resume while paused or snoozed, Pause otherwise; none once
  // the client is finishing or stopped
  // why the client stopped (a ban, a changed key): stays on the page after the client is gone
  $("alert").hidden = !s.stop_reason;
  $("stop-reason").textContent = s.stop_reason || "";
  // the coordinator's notices in force, newest first; text only (never markup)
  const notices = (s.notices || []).slice().reverse();
  $("notices").hidden = !notices.length;
  $("notice-list").replaceChildren(...notices.map((n) => {
    const li = document.createElement("li");
    li.textContent = `${clock(n.at)}: ${String(n.line || "").replace(/^notice from the coordinator:? ?/, "")}`;
    li.dataset.id = String(n.notice_id);
    return li;
  }));
  const held = !!c.paused || !!c.snoozed_until, over = !!c.finishing || s.state === "stopped";
  $("pause").disabled = held || over;
  $("resume").disabled = !held || over;
  $("finish").disabled = over;
  $("url").textContent = `${s.url} (run ${s.run_id || "–"})`;
  $("version").textContent = s.version >= 0 ? String(s.version) : "–";
  $("job").textContent = s.last_job || "–";
  const pct = s.state === "generating" && s.job_expected_steps ? Math.min(99, (100 * s.job_steps) / s.job_expected_steps) : 0;
  $("progress").style.width = `${pct.toFixed(0)}%`;  // a style property set from script (CSP allows it)
  // steps over the most a job can take: a lower bound of the progress (stop tokens end rollouts early)
  $("progress-text").textContent = s.state === "generating" ? `${s.job_steps} decoding steps (at least ${pct.toFixed(0)} % done)` : "–";
  $("download").textContent = s.download || "–";
  $("speed").textContent = `${Number(s.tokens_per_s || 0).toFixed(1)} tokens/s (last job)`;
  $("results").textContent = `${s.accepted} accepted, ${s.rejected} refused`;
  $("credit").textContent = Math.round(s.credit).toLocaleString();
  $("data").textContent = s.bandwidth || "–";
  $("machine").textContent = `${s.machine || "–"} · ${s.backend}`;
  const input = $("bandwidth");
  if (document.activeElement !== input) input.value = s.max_mbps === null || s.max_mbps === undefined ? "" : String(s.max_mbps);
  input.dataset.current = String(s.max_mbps);
  drawLifetime(s.lifetime || {});
  const runs = s.runs || [];
  $("shares").hidden = !runs.length;
  $("share-runs").tBodies[0].replaceChildren(...runs.map((r) => {
    const tr = document.createElement("tr");
    tr.dataset.url = r.url;
    tr.dataset.accepted = String(r.accepted);
    cell(tr, r.url); cell(tr, r.state);
    cell(tr, `${r.share} (${Math.round(100 * (r.share_fraction || 0))} %)`, "num");
    cell(tr, `${Math.round(100 * (r.work_fraction || 0))} %`, "num");
    cell(tr, r.accepted, "num"); cell(tr, Math.round(r.credit).toLocaleString(), "num");
    return tr;
  }));
  const rows = (s.history || []).slice().reverse();
  $("history").tBodies[0].replaceChildren(...rows.map((h) => {
    const tr = document.createElement("tr");
    tr.dataset.outcome = h.outcome;
    cell(tr, clock(h.at)); cell(tr, h.job); cell(tr, h.version, "num"); cell(tr, h.tokens, "num");
    cell(tr, Number(h.seconds).toFixed(1), "num"); cell(tr, h.outcome); cell(tr, Math.round(h.credit), "num");
    return tr;
  }));
  $("history-empty").style.display = rows.length ? "none" : "";
}

async function poll() {
  try {
    const resp = await fetch("/api/state", { cache: "no-store", credentials: "same-origin" });
    if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
    const s = await resp.json();
    draw(s);
    window.echoControl.polls += 1;
    window.echoControl.last = { state: s.state, paused: !!(s.controls || {}).paused };
  } catch (err) {
    window.echoControl.errors += 1;
    const st = $("state");
    const last = window.echoControl.last;
    st.textContent = last && last.state === "stopped" ? "client stopped — start it again with `echo-swarm join`"
      : "client not running — retrying";
    st.className = "pill off";
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

async function act(action, body) {
  const msg = $("message");
  try {
    const resp = await fetch(`/api/${action}`, {
      method: "POST", credentials: "same-origin", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body || {}),
    });
    const data = await resp.json();
    if (!resp.ok) throw new Error(data.error || `HTTP ${resp.status}`);
    window.echoControl.actions += 1;
    msg.className = "message";
    msg.textContent = { pause: "Paused: the job in hand is finished, then no new work.", resume: "Resumed.",
      finish: "Finishing: the job in hand is submitted, then the client stops.", snooze: "Snoozed.",
      bandwidth: "Download cap set." }[action];
  } catch (err) {
    msg.className = "message bad";
    msg.textContent = `Could not ${action}: ${err.message}`;
  }
}

$("pause").addEventListener("click", () => act("pause"));
$("resume").addEventListener("click", () => act("resume"));
$("finish").addEventListener("click", () => act("finish"));
for (const id of ["snooze-30", "snooze-120"]) {
  $(id).addEventListener("click", (e) => act("snooze", { minutes: Number(e.currentTarget.dataset.minutes) }));
}
function setBandwidth() {
  const v = Number($("bandwidth").value);
  act("bandwidth", { mbps: v > 0 ? v : null });
}
$("bandwidth-set").addEventListener("click", setBandwidth);
$("bandwidth").addEventListener("keydown", (e) => { if (e.key === "Enter") setBandwidth(); });
$("bandwidth-clear").addEventListener("click", () => { $("bandwidth").value = ""; act("bandwidth", { mbps: null }); });
poll();
