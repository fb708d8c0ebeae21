// echo-swarm per-volunteer page: search by name or client id, then one volunteer's standing and results.
"use strict";
const $ = (id) => document.getElementById(id);
window.echoVolunteer = { searches: 0, shown: null, errors: 0 };

function cell(tr, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  tr.appendChild(td);
}

async function getJson(url) {
  const resp = await fetch(url, { cache: "no-store" });
  if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
  return resp.json();
}

async function search(q) {
  const data = await getJson(`/v1/volunteers?q=${encodeURIComponent(q)}`);
  const rows = data.volunteers || [];
  $("matches").tBodies[0].replaceChildren(...rows.map((v) => {
    const tr = document.createElement("tr");
    tr.dataset.client = v.client_id;
    const td = document.createElement("td");
    const a = document.createElement("a");
    a.href = `/volunteer?id=${v.client_id}`;
    a.textContent = v.name;
    td.appendChild(a);
    tr.appendChild(td);
    cell(tr, v.client_id.slice(0, 16)); cell(tr, v.accepted, "num"); cell(tr, Math.round(v.credit).toLocaleString(), "num");
    return tr;
  }));
  $("matches-empty").textContent = rows.length ? "" : `No volunteer matches “${q}”.`;
  window.echoVolunteer.searches += 1;
  if (rows.length === 1) show(rows[0].client_id);
}

async function show(id) {
  const v = await getJson(`/v1/volunteers/${encodeURIComponent(id)}`);
  $("detail").hidden = false;
  $("who").textContent = `${v.name} — rank ${v.rank}`;
  const facts = [["client id", v.client_id], ["state", v.state], ["results accepted", v.accepted],
    ["refused", v.rejected], ["credit", Math.round(v.credit).toLocaleString()], ["backend", `${v.backend} on ${v.device}`],
    ["platform", v.platform], ["joined", new Date(v.registered_at * 1000).toLocaleString()],
    ["last seen", new Date(v.last_seen * 1000).toLocaleString()]];
  $("facts").replaceChildren(...facts.map(([k, val]) => {
    const n = document.createElement("span");
    n.textContent = `${k}: ${val}`;
    return n;
  }));
  const versions = (v.versions || []).slice().reverse();
  const host = $("by-version");
  echoCharts.lineChart(host, [{ points: versions.map((r) => [r.version, r.results]), color: "#3d8a5f", cls: "vol", dots: true, line: versions.length > 1 }],
    { x0: versions.length ? versions[0].version : 0, y0: 0, xlabel: "policy version", ylabel: "results accepted", xint: true, yint: true });
  host.dataset.points = String(versions.length);
  $("results").tBodies[0].replaceChildren(...(v.results || []).map((r) => {
    const tr = document.createElement("tr");
    cell(tr, new Date(r.received_at * 1000).toLocaleString()); cell(tr, r.job_id); cell(tr, r.version, "num");
    cell(tr, r.tokens, "num"); cell(tr, Number(r.mean_reward).toFixed(3), "num");
    return tr;
  }));
  const ref = Object.entries(v.refusals || {});
  $("refusals").replaceChildren(...(ref.length ? ref : [["none", ""]]).map(([k, n]) => {
    const s = document.createElement("span");
    s.textContent = n === "" ? k : `${k}: ${n}`;
    return s;
  }));
  window.echoVolunteer.shown = v.client_id;
}

function run(q) {
  search(q).catch((err) => { window.echoVolunteer.errors += 1; $("matches-empty").textContent = `Search failed: ${err.message}`; });
}

$("go").addEventListener("click", () => run($("q").value));
$("q").addEventListener("keydown", (e) => { if (e.key === "Enter") run($("q").value); });
const params = new URLSearchParams(location.search);
if (params.get("id")) show(params.get("id")).catch(() => { window.echoVolunteer.errors += 1; });
else if (params.get("q")) { $("q").value = params.get("q"); run(params.get("q")); }
