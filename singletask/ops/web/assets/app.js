// The singletask lock page. Every value from the store is put in the page as text
// (textContent), never as markup: lock keys are user data.
"use strict";
(function () {
  const $ = (id) => document.getElementById(id);
  const KINDS = ["follow_up", "window", "rate"];
  let refresh = 2.0;
  let timer = null;
  let sequence = 0;
  let countdowns = [];
  let armed = null; // the holder whose Release button was clicked once (survives a refresh)

  function el(tag, text, className) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    if (className) node.className = className;
    return node;
  }

  function shown(value) {
    return value === null || value === undefined || value === "" ? "-" : String(value);
  }

  function seconds(value) {
    if (value < 0) value = 0;
    if (value < 60) return value.toFixed(1) + " s";
    const m = Math.floor(value / 60), s = Math.floor(value % 60);
    if (m < 60) return m + "m " + String(s).padStart(2, "0") + "s";
    return Math.floor(m / 60) + "h " + String(m % 60).padStart(2, "0") + "m";
  }

  // A cell that counts: "down" (lease left, time left) or "up" (age), from a value read at
  // `at` (performance.now() when the answer came); a <td> unless `tag` says otherwise.
  function counting(className, value, way, at, tag) {
    const cell = el(tag || "td", value === null || value === undefined ? "-" : "", className);
    if (value !== null && value !== undefined) {
      countdowns.push({ cell: cell, value: value, way: way, at: at });
    }
    return cell;
  }

  function tick() {
    const now = performance.now();
    for (const c of countdowns) {
      const elapsed = (now - c.at) / 1000;
      const value = c.way === "down" ? c.value - elapsed : c.value + elapsed;
      c.cell.textContent = seconds(value);
      if (c.way === "down") c.cell.classList.toggle("low", value < 1);
    }
  }

  function age(record, data) {
    if (!record.acquired_at) return null;
    return (Date.parse(data.now) - Date.parse(record.acquired_at)) / 1000;
  }

  function keyLink(key) {
    const link = el("a", key);
    link.href = "#key=" + encodeURIComponent(key);
    return link;
  }

  function fill(tableId, rows) {
    const body = $(tableId).tBodies[0];
    body.replaceChildren(...rows);
    const count = $(tableId + "-count");
    if (count) count.textContent = "(" + rows.length + ")";
  }

  function lockRow(record, data, at, reserved) {
    const row = el("tr", null, reserved ? "reservation" : "lock");
    row.dataset.key = record.key;
    row.dataset.holder = record.holder || "";
    const key = el("td", null, "key");
    key.appendChild(keyLink(record.key));
    row.append(key, el("td", record.slot, "slot"), el("td", shown(record.task), "task"),
      el("td", shown(record.holder), "holder"));
    if (reserved) {
      row.append(el("td", shown(record.scope), "scope"));
    } else {
      row.append(el("td", shown(record.hostname), "host"), el("td", shown(record.pid), "pid"));
    }
    row.append(el("td", shown(record.fence), "fence"),
      counting("age", age(record, data), "up", at),
      counting("lease", record.lease_left, "down", at));
    return row;
  }

  function detailText(record) {
    const detail = record.detail || {};
    if (record.kind === "window") {
      if (!detail.open) return "closed: its latest send ran";
      return detail.age === null || detail.age === undefined
        ? "open" : "open, opened " + seconds(detail.age) + " before this read";
    }
    if (record.kind === "rate" && typeof detail.next_start_in === "number") {
      return "next start allowed " + seconds(detail.next_start_in) + " after this read";
    }
    const names = Object.keys(detail);
    return names.length ? names.map((k) => k + "=" + JSON.stringify(detail[k])).join(" ") : "-";
  }

  function stateRow(record, at, first) {
    const row = el("tr", null, "record " + record.kind);
    row.dataset.key = record.key;
    const cell = el("td", null, "key");
    if (first === "key") cell.appendChild(keyLink(record.key)); else cell.textContent = record.kind;
    row.append(cell, el("td", shown(record.task), "task"), el("td", shown(record.task_id), "holder"),
      counting("ttl", record.ttl, "down", at), el("td", detailText(record), "detail"));
    return row;
  }

  // A rate's window: "10 s", "1 min", "5 min", "1 h", "1 d" (whole units), else seconds.
  function period(value) {
    for (const [size, unit] of [[86400, "d"], [3600, "h"], [60, "min"]]) {
      if (value >= size && value % size === 0) return value / size + " " + unit;
    }
    return value + " s";
  }

  function units(count) {
    return count + (count === 1 ? " unit" : " units");
  }

  // One named limit: its name, kind, units in use of its size, and a line per hold (a rate:
  // per start still counted in its window): units, task id, task name, time left.
  function limitRow(record, at) {
    const row = el("tr", null, "limit " + record.kind);
    row.dataset.key = record.key;
    row.dataset.name = record.name;
    const kind = record.kind === "rate" && typeof record.period === "number"
      ? "rate per " + period(record.period) : shown(record.kind);
    const holders = el("td", null, "holders");
    let listed = 0;
    for (const hold of record.holds || []) {
      const line = el("div", null, "hold");
      line.dataset.holder = hold.task_id || "";
      line.append(el("span", units(hold.units), "units"), " ",
        el("span", shown(hold.task_id), "holder"), " ", el("span", shown(hold.task), "task"), " ",
        counting("ttl", hold.ttl, "down", at, "span"));
      holders.appendChild(line);
      listed += hold.units;
    }
    if (record.used > listed) {
      holders.appendChild(el("div", units(record.used - listed) + " in holds not shown", "hold more"));
    }
    row.append(el("td", record.name, "name"), el("td", kind, "kind"),
      el("td", shown(record.used), "used"), el("td", shown(record.size), "size"), holders,
      counting("ttl", record.ttl, "down", at));
    return row;
  }

  function note(id, text) {
    const p = $(id);
    p.hidden = !text;
    p.textContent = text || "";
  }

  function status(text, error) {
    const s = $("status");
    s.textContent = text;
    s.classList.toggle("error", !!error);
  }

  function renderList(data, at) {
    countdowns = [];
    const locks = data.locks || [];
    fill("running", locks.filter((r) => r.state !== "reserved").map((r) => lockRow(r, data, at, false)));
    fill("reserved", locks.filter((r) => r.state === "reserved").map((r) => lockRow(r, data, at, true)));
    note("locks-note", data.locks === null ? "Locks not listed: " + data.locks_note : data.locks_note);
    const state = data.state || [];
    for (const kind of KINDS) {
      fill(kind, state.filter((r) => r.kind === kind).map((r) => stateRow(r, at, "key")));
    }
    note("state-note", data.state === null ? "Not listed: " + data.state_note : data.state_note);
    $("state-lists").hidden = data.state === null;
    fill("limits", (data.limits || []).map((r) => limitRow(r, at)));
    note("limits-note", data.limits === null ? null : data.limits_note);
  }

  function holderBlock(record, data, at) {
    const block = el("dl", null, "holder");
    block.dataset.holder = record.holder || "";
    const fields = [
      ["State", record.state], ["Slot", record.slot], ["Task", record.task],
      ["Scope", record.scope], ["Holder task id", record.holder], ["Host", record.hostname],
      ["Pid", record.pid], ["Acquired", record.acquired_at], ["Fence", record.fence],
      ["Owner token", record.token],
    ];
    for (const [name, value] of fields) block.append(el("dt", name), el("dd", shown(value)));
    const ageCell = counting("age", age(record, data), "up", at);
    const leaseCell = counting("lease", record.lease_left, "down", at);
    block.append(el("dt", "Age"), swap(ageCell), el("dt", "Lease left"), swap(leaseCell));
    if (data.release && record.holder) {
      const button = el("button", "Release", "release");
      button.type = "button";
      if (armed === holderId(record)) button.textContent = "Confirm release of task " + record.holder;
      button.addEventListener("click", () => release(button, record));
      const dd = el("dd");
      dd.appendChild(button);
      block.append(el("dt", ""), dd);
    }
    return block;
  }

  // A counting <td> as a <dd>: same class, same countdown entry.
  function swap(cell) {
    const dd = el("dd", cell.textContent, cell.className);
    for (const c of countdowns) if (c.cell === cell) c.cell = dd;
    return dd;
  }

  function renderDetail(data, at) {
    countdowns = [];
    $("detail-key").textContent = data.key;
    $("holders").replaceChildren(...data.holders.map((r) => holderBlock(r, data, at)));
    $("detail-empty").hidden = data.holders.length > 0;
    $("release-form").hidden = !data.release;
    const state = data.state || [];
    $("detail-state").tBodies[0].replaceChildren(...state.map((r) => stateRow(r, at, "kind")));
    note("detail-state-note", data.state === null ? "Not listed: " + data.state_note : data.state_note);
    $("detail-state").hidden = data.state === null;
  }

  async function release(button, record) {
    if (armed !== holderId(record)) {
      armed = holderId(record);
      button.textContent = "Confirm release of task " + record.holder;
      return;
    }
    armed = null;
    button.disabled = true;
    const result = $("release-result");
    try {
      const response = await fetch("api/release", {
        method: "POST",
        credentials: "same-origin",
        cache: "no-store",
        headers: { "Content-Type": "application/json", "X-Singletask-Token": $("token").value },
        body: JSON.stringify({ key: record.key, holder: record.holder, slot: record.slot }),
      });
      const answer = await response.json();
      result.className = response.ok ? "ok" : "refused";
      result.textContent = response.ok
        ? "Released: task " + answer.released.holder + " no longer holds this lock."
        : "Not released: " + answer.error;
    } catch (error) {
      result.className = "refused";
      result.textContent = "Not released: " + error;
    }
    poll();
  }

  function holderId(record) {
    return JSON.stringify([record.key, record.holder, record.slot]);
  }

  function detailKey() {
    const hash = location.hash;
    if (!hash.startsWith("#key=")) return null;
    try {
      return decodeURIComponent(hash.slice(5));
    } catch (error) {
      return null;
    }
  }

  function url() {
    const key = detailKey();
    if (key !== null) return "api/lock?key=" + encodeURIComponent(key);
    const query = new URLSearchParams({ task: $("filter-task").value, key: $("filter-key").value });
    return "api/locks?" + query.toString();
  }

  async function poll() {
    clearTimeout(timer);
    if (document.hidden) return; // read again when the tab is shown (visibilitychange)
    const mine = ++sequence;
    const detail = detailKey() !== null;
    $("list-view").hidden = detail;
    $("detail-view").hidden = !detail;
    try {
      const response = await fetch(url(), { credentials: "same-origin", cache: "no-store" });
      const data = await response.json();
      if (mine !== sequence) return;
      const at = performance.now();
      refresh = data.refresh || refresh;
      $("store").textContent = data.store + ", keys under " + data.prefix;
      if (!response.ok) {
        status("the lock store failed: " + data.error, true);
      } else {
        status("read at " + new Date(data.now).toLocaleTimeString(), false);
        if (detail) renderDetail(data, at); else renderList(data, at);
        tick();
      }
    } catch (error) {
      if (mine === sequence) status("no answer from the page's server: " + error, true);
    }
    if (mine === sequence) timer = setTimeout(poll, refresh * 1000);
  }

  let typing = null;
  function filtersChanged() {
    clearTimeout(typing);
    typing = setTimeout(poll, 250);
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("filter-task").addEventListener("input", filtersChanged);
    $("filter-key").addEventListener("input", filtersChanged);
    $("filters").addEventListener("submit", (event) => { event.preventDefault(); poll(); });
    $("lookup").addEventListener("submit", (event) => {
      event.preventDefault();
      const key = $("lookup-key").value;
      if (key) location.hash = "#key=" + encodeURIComponent(key);
    });
    $("release-form").addEventListener("submit", (event) => event.preventDefault());
    window.addEventListener("hashchange", () => {
      $("release-result").textContent = "";
      poll();
    });
    document.addEventListener("visibilitychange", () => { if (!document.hidden) poll(); });
    setInterval(tick, 200);
    poll();
  });
})();
