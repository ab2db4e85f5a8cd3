// corral console: polls the gateway's admin endpoints and draws rates, latency and replica state.
// Data: /corral/console/data (cumulative counters and histogram buckets per model), /admin/routing
// (replicas, policies, queues, latest decisions), /admin/keys and /admin/usage?by=tenant (tenants, this month).
// Rates and percentiles come from the difference of two polls, as Prometheus's rate() does.
// Who sees what is the gateway's to decide (the admin key, or a person signed in through the identity
// provider, whose session cookie goes with every request and whose changes send its CSRF token); the
// console only hides the panels a role cannot read (the permissions of gateway/access.py). A panel the
// gateway refuses all the same (403: an admin key box given a viewer's key) is left out, and the others go
// on; a 401 means no one (or a session that ended), and asks for the key or a new sign-in.
"use strict";

const READ = ["status:read", "routing:read", "metrics:read", "usage:read", "rollouts:read", "cache:read"];
const ROLES = {
  admin: [...READ, "spec:apply", "keys:read", "keys:write", "audit:read"],
  operator: [...READ, "spec:apply", "audit:read"],
  viewer: READ,
  "tenant-admin": ["keys:read", "keys:write", "usage:read"],
  user: [],
};

const POLL_MS = 2000;
const TENANTS_EVERY = 15; // polls: the tenants' usage is a GROUP BY over the usage table, every 30 s is plenty
const HISTORY = 150; // points kept per chart (5 minutes at 2 s)
const state = {
  key: sessionStorage.getItem("corral-admin-key") || "",
  me: null, // the person signed in (GET /console/me), with the CSRF token
  previous: null,
  charts: {},
  series: {},
  polls: 0,
  keys: null, // the latest /admin/keys answer (the Tenants table counts their keys and limits)
  refused: new Set(), // panels the gateway refused (403): not asked again until another key is given
};

// What each panel of poll() shows, and what the page calls it when the gateway refuses it.
const PANELS = {
  traffic: {
    name: "traffic and replicas",
    sections: ["traffic-section", "charts-section", "replicas-section", "routing-section", "changes-section"],
  },
  keys: { name: "API keys", sections: ["keys-section"] },
  usage: { name: "usage", sections: ["my-usage"] }, // a tenant-admin's own tenant's
  tenants: { name: "tenants", sections: ["tenants-section"] },
  audit: { name: "audit trail", sections: ["audit-section"] },
};

function signedIn() {
  return Boolean(state.me && state.me.signed_in && !state.key);
}

function may(permission) {
  if (signedIn()) return ROLES[state.me.role].includes(permission);
  return true; // the admin key (or a laptop's open gateway): the gateway says otherwise if not
}

function failure(status, message) {
  const error = new Error(message);
  error.status = status;
  return error;
}

async function send(method, path, body) {
  const extra = state.me && state.me.csrf ? { "X-CSRF-Token": state.me.csrf } : {};
  const response = await fetch(path, {
    method,
    headers: { ...headers(), ...extra, "Content-Type": "application/json" },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const answer = await response.json().catch(() => ({}));
  if (!response.ok) {
    throw failure(response.status, (answer.error && answer.error.message) || method + " " + path + ": " + response.status);
  }
  return answer;
}

function headers() {
  return state.key ? { Authorization: "Bearer " + state.key } : {};
}

async function getJSON(path) {
  const response = await fetch(path, { headers: headers(), cache: "no-store" });
  if (response.status === 401) throw failure(401, "the console needs the admin key");
  if (!response.ok) throw failure(response.status, path + " answered " + response.status);
  return response.json();
}

function sum(values) {
  return Object.values(values || {}).reduce((a, b) => a + b, 0);
}

function total(models, kind, match) {
  let out = 0;
  for (const model of Object.values(models)) {
    for (const [key, value] of Object.entries(model[kind] || {})) {
      if (!match || match(key)) out += value;
    }
  }
  return out;
}

function buckets(models, kind) {
  const merged = {};
  for (const model of Object.values(models)) {
    for (const [le, count] of Object.entries(model[kind] || {})) merged[le] = (merged[le] || 0) + count;
  }
  return merged;
}

// histogram_quantile over the observations between two polls.
function quantile(now, before, q) {
  const rows = Object.keys(now)
    .map((le) => [le === "+Inf" ? Infinity : parseFloat(le), now[le] - ((before || {})[le] || 0)])
    .sort((a, b) => a[0] - b[0]);
  if (!rows.length || rows[rows.length - 1][1] <= 0) return null;
  const rank = q * rows[rows.length - 1][1];
  let lower = 0, below = 0;
  for (const [le, count] of rows) {
    if (count >= rank) {
      if (le === Infinity) return lower;
      return lower + (le - lower) * (count > below ? (rank - below) / (count - below) : 1);
    }
    lower = le; below = count;
  }
  return lower;
}

function fmt(value, digits = 1, unit = "") {
  return value === null || value === undefined || Number.isNaN(value) ? "–" : value.toFixed(digits) + unit;
}

function chart(id, labels) {
  if (state.charts[id]) return state.charts[id];
  const element = document.getElementById(id);
  const colors = ["#5eb1ff", "#4cc38a", "#f2b84b", "#e86f6f"];
  const options = {
    width: element.clientWidth || 500,
    height: 180,
    axes: [{ stroke: "#8b93a3", grid: { stroke: "#232733" } }, { stroke: "#8b93a3", grid: { stroke: "#232733" } }],
    series: [{}, ...labels.map((label, i) => ({ label, stroke: colors[i % colors.length], width: 2 }))],
  };
  state.series[id] = [[], ...labels.map(() => [])];
  state.charts[id] = new uPlot(options, state.series[id], element);
  return state.charts[id];
}

function push(id, labels, values) {
  const plot = chart(id, labels);
  const data = state.series[id];
  data[0].push(Date.now() / 1000);
  values.forEach((value, i) => data[i + 1].push(value));
  if (data[0].length > HISTORY) data.forEach((column) => column.shift());
  plot.setData(data);
}

function cell(text, className) {
  const td = document.createElement("td");
  td.textContent = text === null || text === undefined ? "–" : String(text);
  if (className) td.className = className;
  return td;
}

function fill(tableId, rows) {
  const body = document.querySelector("#" + tableId + " tbody");
  body.replaceChildren(
    ...rows.map((cells) => {
      const tr = document.createElement("tr");
      cells.forEach((c) => tr.appendChild(Array.isArray(c) ? cell(c[0], c[1]) : cell(c)));
      return tr;
    }),
  );
}

function percent(value) {
  return value === null || value === undefined ? null : Math.round(value * 100) + "%";
}

function drawTraffic(data, routing) {
  const now = { at: data.time, models: data.models };
  const before = state.previous;
  state.previous = now;
  const queued = sum(routing.queues);
  const kv = routing.replicas.map((r) => r.kv_usage).filter((v) => v !== null && v !== undefined);
  const kvMean = kv.length ? (100 * kv.reduce((a, b) => a + b, 0)) / kv.length : null;
  document.getElementById("queued").textContent = String(queued);
  if (!before || now.at <= before.at) return;
  const seconds = now.at - before.at;
  const rate = (kind, match) => Math.max(0, total(now.models, kind, match) - total(before.models, kind, match)) / seconds;
  const rps = rate("requests");
  const tokensIn = rate("tokens", (k) => k === "input");
  const tokensOut = rate("tokens", (k) => k === "output");
  const refused = rate("rejections");
  const ttft = buckets(now.models, "ttft"), ttftBefore = buckets(before.models, "ttft");
  const itl = buckets(now.models, "itl"), itlBefore = buckets(before.models, "itl");
  const ms = (v) => (v === null ? null : 1000 * v);
  const ttft50 = ms(quantile(ttft, ttftBefore, 0.5)), ttft95 = ms(quantile(ttft, ttftBefore, 0.95));
  const itl50 = ms(quantile(itl, itlBefore, 0.5));
  document.getElementById("rps").textContent = fmt(rps);
  document.getElementById("tps").textContent = fmt(tokensOut, 0);
  document.getElementById("ttft").textContent = fmt(ttft50, 0) + " / " + fmt(ttft95, 0, " ms");
  document.getElementById("itl").textContent = fmt(itl50, 1, " ms");
  document.getElementById("refused").textContent = fmt(refused);
  push("chart-rps", ["requests/s", "refused/s"], [rps, refused]);
  push("chart-tokens", ["in", "out"], [tokensIn, tokensOut]);
  push("chart-latency", ["TTFT p50", "TTFT p95", "ITL p50"], [ttft50, ttft95, itl50]);
  push("chart-queue", ["queued", "KV %"], [queued, kvMean]);
}

function drawReplicas(routing) {
  fill(
    "replicas",
    routing.replicas.map((r) => [
      r.model, r.id, r.engine, [r.state, r.state === "ready" ? "ready" : "notready"], r.outstanding,
      r.running, r.waiting, percent(r.kv_usage), percent(r.prefix_cache_hit_rate), r.circuit, r.restarts, r.served,
    ]),
  );
  const cache = routing.cache;
  document.getElementById("policies").textContent =
    "policies: " + Object.entries(routing.policies).map(([m, p]) => m + " → " + p).join(", ") +
    (cache && cache.entries !== undefined
      ? " · response cache: " + cache.entries + " answers, " + (cache.bytes / 1048576).toFixed(1) + " MiB"
      : cache ? " · response cache: " + cache.backend : "");
  fill(
    "decisions",
    routing.decisions.slice(-12).reverse().map((d) => [
      new Date(d.at * 1000).toLocaleTimeString(), d.model, d.replica, d.policy, d.reason + (d.retry ? " (retry)" : ""),
    ]),
  );
}

function drawChanges(routing) {
  const rollouts = Object.values(routing.rollouts || {});
  document.getElementById("rollouts").textContent = rollouts.length
    ? rollouts
        .map((r) => {
          const share = typeof r.share === "number" ? ", " + Math.round(r.share * 100) + "% of traffic" : "";
          return "rollout " + r.model + " revision " + r.revision + ": " + r.phase + (r.paused ? " (paused)" : "") + share;
        })
        .join(" · ")
    : "no rollout has run";
  fill(
    "events",
    (routing.events || []).slice(-12).reverse().map((e) => [
      new Date(e.at * 1000).toLocaleTimeString(), e.kind, e.model, e.message,
    ]),
  );
}

// keys: null where the role may not read them (a viewer, an operator): the tenants' usage alone.
function drawTenants(keys, usage) {
  const tenants = {};
  for (const key of keys ? keys.keys : []) {
    const t = (tenants[key.tenant] = tenants[key.tenant] || { keys: 0, rpm: [], tpm: [], budget: [] });
    t.keys += 1;
    if (key.rpm) t.rpm.push(key.rpm);
    if (key.tpm) t.tpm.push(key.tpm);
    // what the key used of its budget this month, as "used / budget (share)"
    if (key.monthly_token_budget) {
      const share = Math.round((100 * (key.month_tokens || 0)) / key.monthly_token_budget);
      t.budget.push(`${(key.month_tokens || 0).toLocaleString()} / ${key.monthly_token_budget.toLocaleString()} (${share}%)`);
    }
  }
  const used = Object.fromEntries(usage.rows.map((row) => [row.tenant, row]));
  const names = [...new Set([...Object.keys(tenants), ...Object.keys(used)])].sort();
  fill(
    "tenants",
    names.map((name) => {
      const t = tenants[name] || { keys: keys ? 0 : null, rpm: [], tpm: [], budget: [] };
      const u = used[name] || {};
      const list = (values) => (values.length ? values.join(", ") : "–");
      return [name, t.keys, list(t.rpm), list(t.tpm), list(t.budget), u.requests, u.input_tokens, u.output_tokens, u.refused, u.errors];
    }),
  );
}

function drawKeys(keys) {
  const body = document.querySelector("#keys tbody");
  body.replaceChildren(
    ...keys.keys.map((k) => {
      const tr = document.createElement("tr");
      const budget = k.monthly_token_budget ? k.monthly_token_budget : "–";
      [k.id, k.name || "–", k.tenant, k.role, k.rpm || "–", k.tpm || "–", budget, k.month_tokens, k.expires_at || "never"].forEach(
        (text) => tr.appendChild(cell(text)),
      );
      const revoke = document.createElement("button");
      revoke.textContent = "revoke";
      revoke.addEventListener("click", async () => {
        try {
          await send("DELETE", "/admin/keys/" + k.id);
          drawKeys(await getJSON("/admin/keys"));
        } catch (error) {
          changeFailed(error);
        }
      });
      const td = document.createElement("td");
      td.appendChild(revoke);
      tr.appendChild(td);
      return tr;
    }),
  );
}

function drawAudit(trail) {
  fill(
    "audit",
    trail.entries.map((e) => [e.at.slice(0, 19).replace("T", " "), e.actor, e.role, e.action, e.target || "–", e.status, e.source || "–"]),
  );
}

function drawMyUsage(usage) {
  const rows = usage.rows.map(
    (r) => r.tenant + ": " + r.requests + " requests, " + r.input_tokens + " tokens in, " + r.output_tokens + " out, " + r.refused + " refused",
  );
  document.getElementById("my-usage").textContent = rows.length ? "this month (UTC): " + rows.join("; ") : "";
}

// Shows the panels the role may read and the gateway has not refused, and names those it refused.
function layout() {
  const traffic = may("status:read");
  const allowed = {
    traffic,
    keys: may("keys:read"),
    usage: may("usage:read") && !traffic,
    tenants: may("usage:read") && traffic,
    audit: may("audit:read"),
  };
  for (const [panel, { sections }] of Object.entries(PANELS)) {
    for (const id of sections) document.getElementById(id).hidden = !allowed[panel] || state.refused.has(panel);
  }
  const refused = [...state.refused].map((panel) => PANELS[panel].name);
  const note = document.getElementById("not-for-role");
  note.textContent = "not for this role (the gateway refused): " + refused.join(", ");
  note.hidden = !refused.length;
  return allowed;
}

// One panel's figures: "read", or "refused" where the gateway answers 403 (that panel is left out, the
// others go on), or "skipped" once refused. Any other failure ends this poll; a 401 ends the polling.
async function read(panel, load) {
  if (state.refused.has(panel)) return "skipped";
  try {
    await load();
    document.getElementById("login").hidden = true; // the key (or session) reads it: no other is asked
    return "read";
  } catch (error) {
    if (error.status !== 403) throw error;
    state.refused.add(panel);
    return "refused";
  }
}

// The usage of this calendar month (UTC, as budgets count it): the report reads only the rows it spans.
function monthUsage() {
  const now = new Date();
  const since = new Date(Date.UTC(now.getUTCFullYear(), now.getUTCMonth(), 1)).toISOString();
  return "/admin/usage?by=tenant&since=" + encodeURIComponent(since);
}

// The panels refreshed every TENANTS_EVERY polls, in this order (Tenants counts the keys just read).
async function readSlowPanels(allowed) {
  const keys = () => (allowed.keys && !state.refused.has("keys") ? state.keys : null); // else usage alone
  const loads = {
    keys: async () => drawKeys((state.keys = await getJSON("/admin/keys"))),
    usage: async () => drawMyUsage(await getJSON(monthUsage())),
    tenants: async () => drawTenants(keys(), await getJSON(monthUsage())),
    audit: async () => drawAudit(await getJSON("/admin/audit?limit=50")),
  };
  const outcomes = [];
  for (const [panel, load] of Object.entries(loads)) {
    if (allowed[panel]) outcomes.push(await read(panel, load));
  }
  return outcomes;
}

async function poll() {
  try {
    const allowed = layout();
    const outcomes = [];
    if (allowed.traffic) {
      outcomes.push(
        await read("traffic", async () => {
          const [data, routing] = await Promise.all([getJSON("/corral/console/data"), getJSON("/admin/routing")]);
          drawTraffic(data, routing);
          drawReplicas(routing);
          drawChanges(routing);
        }),
      );
    }
    if (state.polls % TENANTS_EVERY === 0) outcomes.push(...(await readSlowPanels(allowed)));
    layout();
    if (state.key && outcomes.includes("refused") && !outcomes.includes("read")) {
      throw failure(403, "this key may read nothing the console shows");
    }
    state.polls += 1;
    document.getElementById("status").textContent = "live · " + new Date().toLocaleTimeString();
  } catch (error) {
    document.getElementById("status").textContent = error.message;
    if (error.status === 401 && signedIn()) {
      sessionEnded();
      return;
    }
    if (error.status === 401 || error.status === 403) {
      document.getElementById("login").hidden = false;
      return; // wait for the key
    }
  }
  setTimeout(poll, POLL_MS);
}

// A session ends with the person's ID token (minutes, with some identity providers): the page says so and
// offers the sign-in again, not the admin key, and shows no figures of that session's any more.
function sessionEnded() {
  state.me = null;
  document.querySelectorAll("main > section, #not-for-role").forEach((element) => (element.hidden = true));
  start("your session ended: sign in again");
}

// A change the gateway refused: a session that ended asks for a new sign-in, anything else is said.
function changeFailed(error) {
  if (error.status === 401 && signedIn()) sessionEnded();
  else document.getElementById("keys-error").textContent = error.message;
}

document.getElementById("login").addEventListener("submit", (event) => {
  event.preventDefault();
  state.key = document.getElementById("key").value.trim();
  sessionStorage.setItem("corral-admin-key", state.key);
  state.refused.clear(); // another key: another role
  state.keys = null;
  state.polls = 0;
  poll();
});

document.getElementById("new-key").addEventListener("submit", async (event) => {
  event.preventDefault();
  const value = (id) => document.getElementById(id).value.trim();
  const body = { tenant: value("new-key-tenant") || (state.me && state.me.tenant) || "", name: value("new-key-name") };
  for (const [id, field] of [["new-key-rpm", "rpm"], ["new-key-tpm", "tpm"], ["new-key-budget", "monthly_token_budget"]]) {
    if (value(id)) body[field] = parseInt(value(id), 10);
  }
  try {
    const made = await send("POST", "/admin/keys", body);
    document.getElementById("secret").textContent = made.key;
    document.getElementById("new-key-secret").hidden = false;
    document.getElementById("keys-error").textContent = "";
    drawKeys(await getJSON("/admin/keys"));
  } catch (error) {
    changeFailed(error);
  }
});

document.getElementById("signout").addEventListener("click", async () => {
  try {
    const answer = await send("POST", "/console/signout");
    state.me = null;
    window.location.href = answer.end_session || "/console";
  } catch (error) {
    if (error.status === 401) window.location.href = "/console"; // the session had ended already
    else document.getElementById("status").textContent = error.message;
  }
});

// ended: why a session that was open is no more (the page offers the sign-in again, not the admin key).
async function start(ended) {
  const response = await fetch("/console/me", { cache: "no-store" });
  state.me = response.ok ? await response.json() : null;
  const someone = Boolean(state.me && state.me.signed_in);
  document.getElementById("signin").hidden = !(state.me && state.me.oidc) || someone;
  document.getElementById("signout").hidden = !someone;
  if (someone) {
    document.getElementById("who").textContent = state.me.who + " (" + state.me.role + ", " + state.me.tenant + ")";
    document.getElementById("new-key-tenant").value = state.me.tenant;
  } else if (ended) {
    document.getElementById("who").textContent = "";
    document.getElementById("status").textContent = ended;
    document.getElementById("login").hidden = Boolean(state.me && state.me.oidc); // (no sign-in: the key)
    return;
  } else if (state.me && state.me.oidc && !state.key) {
    // no one yet: sign in through the identity provider, or give the admin key (break-glass)
    document.getElementById("status").textContent = "sign in, or give the admin key";
    document.getElementById("login").hidden = false;
    return;
  }
  poll();
}

start();
