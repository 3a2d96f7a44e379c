"""The fleet page's static text: two HTML shells, one stylesheet, one script. Self-contained (no
asset from anywhere else) and fixed: nothing from a node is ever spliced into them, except the
escaped name and API path ``fleet_page.node_html`` puts into the node shell.

The script builds every element with ``createElement`` and ``textContent`` (via ``el``): no
``innerHTML``, no string-built markup, no ``eval``; the CSP the server sends forbids inline script,
so even a successful injection would not run.
"""

from __future__ import annotations

from typing import Final

# Polled by the page: a killed agent's row must turn "disconnected" within a few seconds.
POLL_MS: Final = 1000

_HEAD: Final = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="referrer" content="no-referrer">
<link rel="stylesheet" href="/static/fleet.css">
<link rel="icon" href="/static/favicon.svg" type="image/svg+xml">
<script src="/static/fleet.js" defer></script>
"""

FLEET_HTML: Final = _HEAD + """<title>memtopo fleet</title>
</head>
<body data-page="fleet">
<header><a class="brand" href="/">memtopo fleet</a><span id="live" class="live">loading…</span></header>
<main>
<div class="summary" id="summary"></div>
<table class="fleet">
<thead><tr>
<th>Node</th><th>Link</th><th class="num">Generation</th><th class="num">Updated</th>
<th class="num">CPUs</th><th class="num">Memory</th><th>Accelerators</th><th>HCCS / XPU</th><th>Degraded</th>
</tr></thead>
<tbody id="nodes"></tbody>
</table>
<p class="empty" id="empty" hidden>No agent has connected to this controller yet.</p>
<noscript><p>This page needs JavaScript; the same data is at <a href="/api/fleet">/api/fleet</a>.</p></noscript>
</main>
</body>
</html>
"""

# str.format template: {name} and {api} are escaped by fleet_page.node_html; no other braces here.
NODE_HTML: Final = _HEAD + """<title>{name} · memtopo fleet</title>
</head>
<body data-page="node" data-api="{api}">
<header><a class="brand" href="/">memtopo fleet</a><span class="crumb">/</span>
<span class="crumb" id="crumb">{name}</span><span id="live" class="live">loading…</span></header>
<main>
<h1><span id="name">{name}</span> <span id="link" class="pill"></span></h1>
<dl class="facts" id="facts"></dl>
<section id="degraded-section" hidden><h2>Degraded sources</h2><div id="degraded"></div></section>
<h2>Topology</h2>
<figure id="figure"><img id="drawing" alt="topology drawing">
<figcaption id="drawing-note" class="muted"></figcaption></figure>
<h2>Plans awaiting a result</h2><div id="pending"></div>
<h2>Plan results <span class="muted small">(newest first)</span></h2><div id="results"></div>
<h2>Memory domains</h2><div id="domains"></div>
<h2>Accelerators</h2><div id="accelerators"></div>
<noscript><p>This page needs JavaScript; the same data is at <a href="{api}">{api}</a>.</p></noscript>
</main>
</body>
</html>
"""

CSS: Final = """
:root {
  --bg: #f5f6f8; --fg: #1c2230; --muted: #667085; --line: #d9dee6; --head: #1c2230;
  --ok: #12703a; --okbg: #dff3e6; --bad: #b42318; --badbg: #fde6e4; --warn: #7a4d00; --warnbg: #fff1cc;
  --accent: #1f5bb8;
}
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "Noto Sans", "DejaVu Sans", sans-serif;
       color: var(--fg); background: var(--bg); }
header { background: var(--head); color: #fff; padding: 10px 24px; display: flex; align-items: baseline; gap: 10px; }
header a.brand { color: #fff; font-weight: 650; font-size: 16px; text-decoration: none; }
header .crumb { color: #c9d1dc; overflow-wrap: anywhere; }
.live { margin-left: auto; font-size: 12px; color: #b9e4c9; white-space: nowrap; }
.live.down { color: #ffb4ab; font-weight: 600; }
main { padding: 16px 24px 40px; }
h1 { font-size: 22px; margin: 4px 0 12px; overflow-wrap: anywhere; }
h2 { font-size: 15px; margin: 22px 0 8px; }
.small { font-size: 12px; font-weight: normal; }
.summary { margin: 4px 0 12px; display: flex; gap: 8px; flex-wrap: wrap; }
.summary .stat { background: #fff; border: 1px solid var(--line); border-radius: 6px; padding: 6px 12px; }
.summary .stat b { font-size: 18px; margin-right: 4px; }
table { border-collapse: collapse; width: 100%; background: #fff; border: 1px solid var(--line); }
th, td { text-align: left; padding: 7px 10px; border-bottom: 1px solid var(--line); vertical-align: top; }
th { background: #eceff4; font-size: 12px; font-weight: 600; color: #3a4354; white-space: nowrap; }
th.num, td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
tbody tr:hover td { background: #f7f9fc; }
tr.disconnected td { background: #fcf3f2; color: #555d6b; }
td.name a { color: var(--accent); font-weight: 600; text-decoration: none; overflow-wrap: anywhere; }
td.name a:hover { text-decoration: underline; }
.pill { display: inline-block; padding: 1px 9px; border-radius: 999px; font-size: 12px; font-weight: 600;
        white-space: nowrap; vertical-align: middle; }
.pill.ok { color: var(--ok); background: var(--okbg); }
.pill.bad { color: var(--bad); background: var(--badbg); }
.pill.warn { color: var(--warn); background: var(--warnbg); }
.pill:empty { display: none; }
.muted { color: var(--muted); }
.sub { display: block; color: var(--muted); font-size: 12px; }
.empty { color: var(--muted); padding: 12px 0; }
dl.facts { display: grid; grid-template-columns: max-content minmax(0, 1fr) max-content minmax(0, 1fr); gap: 5px 18px;
           background: #fff; border: 1px solid var(--line); padding: 12px 16px; margin: 0; }
dl.facts dt { color: var(--muted); }
dl.facts dd { margin: 0; overflow-wrap: anywhere; }
figure { margin: 0; background: #fff; border: 1px solid var(--line); padding: 8px; overflow: auto; }
/* A vector drawing: scaled to the page's width, larger than drawn where the page is wide. */
figure img { display: block; width: 100%; max-width: 1800px; height: auto; }
figcaption:empty { display: none; }
.reasons { margin: 2px 0 8px; padding-left: 20px; font: 12px/1.4 ui-monospace, "DejaVu Sans Mono", monospace;
           white-space: pre-wrap; overflow-wrap: anywhere; }
.mono { font-family: ui-monospace, "DejaVu Sans Mono", monospace; font-size: 12px; }
"""

JS: Final = """"use strict";
(() => {
  const POLL_MS = __POLL_MS__;
  const $ = (id) => document.getElementById(id);

  // Every element the page shows is built here; text is only ever a text node.
  function el(tag, cls, ...kids) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    for (const k of kids) {
      if (k === null || k === undefined || k === false) continue;
      e.append(k instanceof Node ? k : document.createTextNode(String(k)));
    }
    return e;
  }
  function link(href, text) { const a = el("a", null, text); a.href = href; return a; }
  // As fleet_page.node_path: "." and ".." would be dot segments of the path.
  function nodeHref(name) {
    if (name === "." || name === "..") return "/nodes/?name=" + encodeURIComponent(name);
    return "/nodes/" + encodeURIComponent(name);
  }

  function bytes(n) {
    if (!n) return "—";
    const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return (n < 10 && i > 0 ? n.toFixed(1) : Math.round(n)) + " " + units[i];
  }
  function age(s) {
    if (s === null || s === undefined) return "—";
    if (s < 60) return Math.round(s) + " s ago";
    if (s < 3600) return Math.round(s / 60) + " min ago";
    if (s < 86400) return (s / 3600).toFixed(1) + " h ago";
    return (s / 86400).toFixed(1) + " d ago";
  }
  function pill(connected) {
    return el("span", "pill " + (connected ? "ok" : "bad"), connected ? "connected" : "disconnected");
  }
  function table(headers, rows, numeric) {
    const t = el("table");
    const hr = el("tr");
    headers.forEach((h, i) => hr.append(el("th", numeric && numeric.includes(i) ? "num" : null, h)));
    t.append(el("thead", null, hr));
    const body = el("tbody");
    for (const r of rows) {
      const tr = el("tr");
      r.forEach((c, i) => tr.append(el("td", numeric && numeric.includes(i) ? "num" : null, c)));
      body.append(tr);
    }
    t.append(body);
    return t;
  }
  function none(text) { return el("p", "muted", text); }
  function setLive(ok, text) {
    const live = $("live");
    live.className = ok ? "live" : "live down";
    live.textContent = text;
  }
  function clock() { return new Date().toLocaleTimeString([], {hour12: false}); }

  function memoryText(t) {
    const kinds = Object.entries(t.memory_by_type || {});
    const detail = kinds.length > 1 || (kinds.length === 1 && kinds[0][0] !== "DRAM")
      ? kinds.map(([k, v]) => k + " " + bytes(v)).join(" · ") : null;
    return [bytes(t.memory_bytes), detail];
  }
  function acceleratorText(t) {
    if (!t.accelerators) return [el("span", "muted", "none"), null];
    const models = t.accelerator_models.map((m) => m.count + " × " + m.model).join(", ");
    return [models, t.accelerator_memory_bytes ? bytes(t.accelerator_memory_bytes) + " device memory" : null];
  }
  function groupsText(groups) {
    return Object.entries(groups).map(([size, g]) => size + "→" + (g === null ? "—" : g)).join("  ");
  }
  function devicesText(d) {
    if (!d) return [el("span", "muted", "—"), null];
    const policy = d.policy.toUpperCase();
    if (d.unusable) return [el("span", "muted", policy + ": not usable"), d.unusable];
    if (d.policy === "hccs") {
      return ["HCCS rings free " + d.ring_free[0] + " + " + d.ring_free[1] + " of " + d.capacity + " healthy",
              d.free_rings + " whole ring" + (d.free_rings === 1 ? "" : "s") + " free · group per pod size "
                + groupsText(d.groups)];
    }
    return ["XPU MTF " + d.mtf, d.used.length ? "allocated: " + d.used.join(", ") : "none allocated"];
  }
  function devicesTitle(d) {
    if (!d || d.unusable) return null;
    if (d.policy === "hccs") {
      return "Free NPUs per HCCS ring (0-3, 4-7) as the hccs policy derives them; group per pod size: "
        + "the priority group (A best, D last) the node falls into for a pod of 1, 2, 4 or 8 NPUs (— = no fit)";
    }
    return "MTF: the fewest 1/2/4/8-card tasks that fill the node's free XPUs (1 = an empty node)";
  }
  function cell(main, sub, cls) {
    const td = el("td", cls, main);
    if (sub) td.append(el("span", "sub", sub));
    return td;
  }
  function titled(node, title) {
    if (title) node.title = title;
    return node;
  }
  function degradedCell(list) {
    if (!list || !list.length) return el("td", "muted", "—");
    const td = el("td");
    for (const s of list) {
      const p = el("span", "pill warn", s.source);
      p.title = s.reasons.join("\\n") + (s.more ? "\\n… " + s.more + " more" : "");
      td.append(p, " ");
    }
    return td;
  }

  // ---- the fleet ----------------------------------------------------------------------------
  function seenText(n) { return n.connected ? n.peer : "last seen " + age(n.last_seen_age_s); }
  function fleetRow(n) {
    const tr = el("tr", n.connected ? "connected" : "disconnected");
    tr.dataset.node = n.name;
    tr.dataset.state = n.connected ? "connected" : "disconnected";
    tr.append(el("td", "name", link(nodeHref(n.name), n.name)));
    const linkCell = cell(pill(n.connected), seenText(n), "link");
    tr.append(linkCell);
    tr.append(cell(n.generation === null ? "—" : String(n.generation), n.fingerprint || null, "num"));
    const updated = cell(age(n.updated_age_s), null, "num");
    tr.append(updated);
    // The cells that change every poll, updated in place (see renderFleet).
    tr.ages = {seen: linkCell.querySelector(".sub"), updated: updated};
    const t = n.topology;
    if (!t) {
      const td = el("td", "muted", "no topology yet");
      td.colSpan = 5;
      tr.append(td);
      return tr;
    }
    tr.append(cell(String(t.cpus), t.numa_nodes + " NUMA node" + (t.numa_nodes === 1 ? "" : "s"), "num"));
    const [mem, memSub] = memoryText(t);
    tr.append(cell(mem, memSub, "num"));
    const [acc, accSub] = acceleratorText(t);
    tr.append(cell(acc, accSub));
    const [dev, devSub] = devicesText(t.devices);
    tr.append(titled(cell(dev, devSub), devicesTitle(t.devices)));
    tr.append(degradedCell(t.degraded));
    return tr;
  }
  function stat(value, text) { return el("span", "stat", el("b", null, String(value)), text); }
  // A row is rebuilt only when something but its ages changed, and the table only when rows come,
  // go or move: a tooltip being read or text being selected survives the next poll.
  const fleetRows = new Map();
  function renderFleet(doc) {
    const wanted = [];
    const names = new Set();
    for (const n of doc.nodes) {
      const key = JSON.stringify({...n, updated_age_s: null, last_seen_age_s: null});
      let r = fleetRows.get(n.name);
      if (!r || r.key !== key) {
        r = {key: key, tr: fleetRow(n)};
        fleetRows.set(n.name, r);
      } else {
        if (r.tr.ages.seen) r.tr.ages.seen.textContent = seenText(n);
        r.tr.ages.updated.textContent = age(n.updated_age_s);
      }
      names.add(n.name);
      wanted.push(r.tr);
    }
    for (const name of [...fleetRows.keys()]) if (!names.has(name)) fleetRows.delete(name);
    const body = $("nodes");
    const shown = [...body.children];
    if (shown.length !== wanted.length || shown.some((tr, i) => tr !== wanted[i])) body.replaceChildren(...wanted);
    $("empty").hidden = doc.nodes.length > 0;
    const degraded = doc.nodes.filter((n) => n.topology && n.topology.degraded.length).length;
    $("summary").replaceChildren(stat(doc.total, "nodes"), stat(doc.connected, "connected"),
                                 stat(doc.total - doc.connected, "disconnected"), stat(degraded, "degraded"));
    document.title = "memtopo fleet (" + doc.connected + "/" + doc.total + " connected)";
  }

  // ---- one node -----------------------------------------------------------------------------
  // Rebuild the part ``id`` of the node page only when its data changed since the last poll.
  const drawn = new Map();
  function section(id, data, build) {
    const key = JSON.stringify(data);
    if (drawn.get(id) === key) return;
    drawn.set(id, key);
    build();
  }
  function fact(dl, term, value, sub) {
    const dd = el("dd", null, value);
    if (sub) dd.append(el("span", "sub", sub));
    dl.append(el("dt", null, term), dd);
  }
  function renderNode(n) {
    $("name").textContent = n.name;
    $("crumb").textContent = n.name;
    const lk = $("link");
    lk.className = "pill " + (n.connected ? "ok" : "bad");
    lk.textContent = n.connected ? "connected" : "disconnected";
    document.title = n.name + " · memtopo fleet";
    const dl = el("dl", "facts");
    dl.id = "facts";
    fact(dl, "Generation", n.generation === null ? "—" : String(n.generation), n.fingerprint || null);
    fact(dl, "Updated", age(n.updated_age_s));
    fact(dl, "Last seen", age(n.last_seen_age_s), n.peer || null);
    fact(dl, "Agent", n.agent_version || "—");
    const t = n.topology;
    if (t) {
      fact(dl, "CPUs", String(t.cpus), t.numa_nodes + " NUMA nodes");
      const [mem, memSub] = memoryText(t);
      fact(dl, "Memory", mem, memSub);
      const [acc, accSub] = acceleratorText(t);
      fact(dl, "Accelerators", acc, accSub);
      const [dev, devSub] = devicesText(t.devices);
      fact(dl, "HCCS / XPU", dev, devSub);
    }
    $("facts").replaceWith(dl);

    const d = n.detail;
    const deg = d ? d.degraded : [];
    section("degraded", deg, () => {
      $("degraded-section").hidden = !deg.length;
      $("degraded").replaceChildren(...deg.map((s) => el("div", null, el("span", "pill warn", s.source),
        el("ul", "reasons", ...s.reasons.map((r) => el("li", null, r)),
           s.more ? el("li", "muted", "… " + s.more + " more") : null))));
    });

    const src = n.drawing ? n.drawing + "&v=" + encodeURIComponent(n.generation + "-" + n.fingerprint) : null;
    section("drawing", src, () => {
      const img = $("drawing");
      img.hidden = !src;
      if (src) {
        img.src = src;
        img.alt = "topology drawing of " + n.name;
        $("drawing-note").replaceChildren(link(src, "open the drawing on its own"));
      } else {
        $("drawing-note").textContent = "no topology yet";
      }
    });

    section("pending", n.pending, () => $("pending").replaceChildren(n.pending.length
      ? table(["Plan", "Dry run"], n.pending.map((p) => [p.plan_id, p.dry_run ? "yes" : "no"]))
      : none("none")));
    section("results", n.results, () => $("results").replaceChildren(n.results.length
      ? table(["Plan", "State", "Actions", "Message", "Finished"], n.results.map((r) => [
          el("span", "mono", r.plan_id),
          el("span", "pill " + (["APPLIED", "UNCHANGED", "DRY_RUN"].includes(r.state) ? "ok" : "bad"), r.state),
          Object.entries(r.actions).map(([k, v]) => v + " " + k.toLowerCase()).join(", ") || "—",
          [r.message, ...r.rejections].filter((x) => x).join("\\n") || "—",
          r.finished ? new Date(r.finished * 1000).toLocaleString() : "—"]))
      : none("none received yet")));
    if (d) section("detail", [d.domains, d.accelerators], () => {
      $("domains").replaceChildren(table(["Domain", "Type", "Capacity", "Free", "CPUs", "NUMA nodes", "Tier", "Note"],
        d.domains.map((m) => [String(m.id), m.type + (m.subtype ? " (" + m.subtype + ")" : ""),
                              bytes(m.capacity_bytes), bytes(m.free_bytes), m.cpus || "none", m.numa_nodes,
                              m.kernel_tier >= 0 ? String(m.kernel_tier) : "—", m.note || ""]), [0, 2, 3]));
      $("accelerators").replaceChildren(d.accelerators.length
        ? table(["Id", "Model", "Health", "NUMA node", "Domain", "Memory", "PCI"],
            d.accelerators.map((a) => [a.id, a.model || a.kind, a.health || "—", String(a.numa_node),
                                       a.domain < 0 ? "—" : String(a.domain), bytes(a.memory_bytes), a.bdf]), [3, 4, 5])
        : none("none"));
    });
  }

  // ---- polling ------------------------------------------------------------------------------
  async function poll(url, render) {
    try {
      const r = await fetch(url, {cache: "no-store", headers: {"Accept": "application/json"}});
      if (r.status === 404) { setLive(false, "unknown to the controller · " + clock()); return; }
      if (!r.ok) throw new Error("HTTP " + r.status);
      render(await r.json());
      setLive(true, "live · " + clock());
    } catch (e) {
      setLive(false, "controller unreachable · retrying · " + clock());
    } finally {
      setTimeout(() => poll(url, render), POLL_MS);
    }
  }
  const page = document.body.dataset.page;
  if (page === "fleet") poll("/api/fleet", renderFleet);
  else if (page === "node") poll(document.body.dataset.api, renderNode);
})();
""".replace("__POLL_MS__", str(POLL_MS))

FAVICON: Final = ('<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 16 16">'
                   '<rect width="16" height="16" rx="3" fill="#1c2230"/>'
                   '<rect x="3" y="3" width="4" height="4" fill="#7fb3ff"/>'
                   '<rect x="9" y="3" width="4" height="4" fill="#7fb3ff"/>'
                   '<rect x="3" y="9" width="10" height="4" fill="#b9e4c9"/></svg>')

# path → (content type, text)
STATIC: Final = {
    "/static/fleet.css": ("text/css; charset=utf-8", CSS),
    "/static/fleet.js": ("text/javascript; charset=utf-8", JS),
    "/static/favicon.svg": ("image/svg+xml", FAVICON),
}
