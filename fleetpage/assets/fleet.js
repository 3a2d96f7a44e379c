"use strict";
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
  // A node name, breakable only after its separators (a line never ends inside "910-01").
  function nameLink(name) {
    const a = el("a", "nodename");
    for (const part of name.split(/(?<=[-._/:])/)) {
      if (a.firstChild) a.append(document.createElement("wbr"));
      a.append(document.createTextNode(part));
    }
    a.href = nodeHref(name);
    return a;
  }
  function plural(n, word) { return n + " " + word + (n === 1 ? "" : "s"); }
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
  // One time format everywhere, whatever the browser's locale: 24-hour, local time.
  const two = (n) => String(n).padStart(2, "0");
  function timeOfDay(d) { return two(d.getHours()) + ":" + two(d.getMinutes()) + ":" + two(d.getSeconds()); }
  function dateTime(d) {
    return d.getFullYear() + "-" + two(d.getMonth() + 1) + "-" + two(d.getDate()) + " " + timeOfDay(d);
  }
  function clock() { return timeOfDay(new Date()); }

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
              plural(d.free_rings, "whole ring") + " free · group per pod size "
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
      p.title = s.reasons.join("\n") + (s.more ? "\n… " + s.more + " more" : "");
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
    tr.append(el("td", "name", nameLink(n.name)));
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
    tr.append(cell(String(t.cpus), plural(t.numa_nodes, "NUMA node"), "num"));
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
    $("summary").replaceChildren(stat(doc.total, doc.total === 1 ? "node" : "nodes"), stat(doc.connected, "connected"),
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
    if (n.detail && n.detail.source_root) fact(dl, "Source", n.detail.source_root);
    const t = n.topology;
    if (t) {
      fact(dl, "CPUs", String(t.cpus), plural(t.numa_nodes, "NUMA node"));
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
          el("span", "pill " + (r.ok ? "ok" : "bad"), r.state),
          Object.entries(r.actions).map(([k, v]) => v + " " + k).join(", ") || "—",
          [r.message, ...r.rejections].filter((x) => x).join("\n") || "—",
          r.finished ? dateTime(new Date(r.finished * 1000)) : "—"]))
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
