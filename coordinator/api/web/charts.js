// echo-swarm's charts: plain SVG line charts with labelled axes and round-number ticks, shared by the status
// page and the per-volunteer page. No libraries; nothing inline (the pages run under a strict CSP).
"use strict";
(function () {
  const NS = "http://www.w3.org/2000/svg";
  const TIME_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400];

  function el(tag, attrs, parent) {
    const n = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) n.setAttribute(k, v);
    if (parent) parent.appendChild(n);
    return n;
  }

  // Round-number ticks over [lo, hi]: a step of 1, 2 or 5 × 10^k giving at most `most` intervals.
  function niceTicks(lo, hi, most, integer) {
    const span = Math.max(hi - lo, 1e-12);
    const raw = span / most;
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    let step = [1, 2, 5, 10].map((f) => f * mag).find((s) => s >= raw - 1e-12);
    if (integer) step = Math.max(1, Math.round(step));
    const digits = Math.max(0, -Math.floor(Math.log10(step) + 1e-9));
    const ticks = [];
    for (let v = Math.ceil(lo / step - 1e-9) * step; v <= hi + step * 1e-9; v += step) {
      ticks.push({ v, label: (Math.abs(v) < step * 1e-9 ? 0 : v).toFixed(digits) });
    }
    return ticks;
  }

  function duration(s, step) {
    s = Math.round(s);
    if (s === 0) return "0";
    if (step < 60) return s < 60 ? `${s}s` : `${Math.floor(s / 60)}m${s % 60 ? String(s % 60).padStart(2, "0") + "s" : ""}`;
    if (step < 3600) return s < 3600 ? `${Math.round(s / 60)}m` : `${Math.floor(s / 3600)}h${String(Math.round((s % 3600) / 60)).padStart(2, "0")}`;
    return `${Math.round(s / 3600)}h`;
  }

  // Ticks for seconds over [lo, hi], on steps a clock reads (15 s, 1 min, 5 min, 1 h …): labels never repeat.
  function timeTicks(lo, hi, most) {
    const span = Math.max(hi - lo, 1);
    const step = TIME_STEPS.find((s) => span / s <= most) || Math.ceil(span / most / 86400) * 86400;
    const ticks = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + 1e-9; v += step) ticks.push({ v, label: duration(v, step) });
    return ticks;
  }

  // series = [{points: [[x, y]...], color, cls, width, dots, line}]; opts: x0, y0, y1, xlabel, ylabel, xtime,
  // xint, yint, yfmt.
  function lineChart(host, series, opts) {
    const w = host.clientWidth || 800, h = host.clientHeight || 240;
    const m = { l: 62, r: 14, t: 10, b: 44 };
    const all = series.flatMap((s) => s.points);
    const xs = all.map((p) => p[0]);
    const x0 = opts.x0 ?? Math.min(...xs, 0), x1 = Math.max(...xs, x0 + 1);
    const y0 = opts.y0 ?? 0, y1 = opts.y1 ?? Math.max(1e-9, ...all.map((p) => p[1])) * 1.1;
    const X = (x) => m.l + ((x - x0) / (x1 - x0)) * (w - m.l - m.r);
    const Y = (y) => h - m.b - ((y - y0) / (y1 - y0)) * (h - m.t - m.b);
    const svg = el("svg", { viewBox: `0 0 ${w} ${h}`, preserveAspectRatio: "none", role: "img" });
    for (const t of niceTicks(y0, y1, 5, opts.yint)) {
      el("line", { x1: m.l, x2: w - m.r, y1: Y(t.v), y2: Y(t.v), class: "axis" }, svg);
      el("text", { x: m.l - 6, y: Y(t.v) + 4, "text-anchor": "end", class: "tick y" }, svg).textContent = opts.yfmt ? opts.yfmt(t.v) : t.label;
    }
    const xt = opts.xtime ? timeTicks(x0, x1, 6) : niceTicks(x0, x1, 6, opts.xint);
    for (const t of xt) {
      el("line", { x1: X(t.v), x2: X(t.v), y1: h - m.b, y2: h - m.b + 4, class: "axis" }, svg);
      el("text", { x: X(t.v), y: h - m.b + 16, "text-anchor": "middle", class: "tick x" }, svg).textContent = t.label;
    }
    el("line", { x1: m.l, x2: w - m.r, y1: h - m.b, y2: h - m.b, class: "axis base" }, svg);
    if (opts.xlabel) el("text", { x: (m.l + w - m.r) / 2, y: h - 6, "text-anchor": "middle", class: "axis-label x" }, svg).textContent = opts.xlabel;
    if (opts.ylabel) {
      const cy = (m.t + h - m.b) / 2;
      el("text", { x: 14, y: cy, "text-anchor": "middle", transform: `rotate(-90 14 ${cy})`, class: "axis-label y" }, svg).textContent = opts.ylabel;
    }
    for (const s of series) {
      if (!s.points.length) continue;
      if (s.line !== false) {
        const d = s.points.map((p, i) => `${i ? "L" : "M"}${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`).join("");
        el("path", { d, fill: "none", stroke: s.color, "stroke-width": s.width || 1.5, class: s.cls }, svg);
      }
      if (s.dots) for (const p of s.points) el("circle", { cx: X(p[0]), cy: Y(p[1]), r: 3.5, fill: s.color, class: s.cls + "-dot" }, svg);
    }
    host.replaceChildren(svg);
  }

  window.echoCharts = { lineChart, niceTicks, timeTicks };
})();
