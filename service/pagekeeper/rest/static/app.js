/* pagekeeper dashboard: plain browser JavaScript, no build step, no network beyond this
 * service. Reads /v1/pool, /v1/clients, /v1/dashboard/page-map, /v1/dashboard/requests and
 * /v1/requests/{id} every couple of seconds, and the time series from the server-sent event
 * stream /v1/dashboard/stream (charts move without reloading). Charts: uPlot (vendor/).
 *
 * The DOM carries what the page shows as data attributes (legend counts, lane totals, the
 * number of samples received) so a headless browser test can check them.
 */
(() => {
  "use strict";

  const STATES = ["free", "cached", "used", "shared", "null", "other"];
  const STATE_LABEL = {
    free: "free",
    cached: "free · cached",
    used: "used",
    shared: "shared",
    null: "null",
    other: "other group",
  };
  const STATE_HINT = {
    free: "in the free queue, no cached hash",
    cached: "free, still in the prefix cache (a hit can revive it)",
    used: "held by one request",
    shared: "held by several requests (ref count > 1)",
    null: "page 0: padding, never handed out",
    other: "held or cached by another KV-cache group",
  };
  // A binned cell is drawn as a stack of its states, bottom to top.
  const STACK = ["null", "shared", "used", "cached", "other", "free"];
  const REFRESH_MS = 2000;
  const MAX_POINTS = 600;
  const MAX_DETAIL_PAGES = 128;

  const rootStyle = getComputedStyle(document.documentElement);
  const cssVar = (name) => rootStyle.getPropertyValue(name).trim();
  const COLOR = Object.fromEntries(STATES.map((s) => [s, cssVar(`--st-${s}`)]));

  const $ = (id) => document.getElementById(id);
  const h = (tag, attrs = {}, ...children) => {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs)) {
      if (v === undefined || v === null) continue;
      if (k === "class") node.className = v;
      else if (k === "text") node.textContent = v;
      else if (k.startsWith("data-")) node.setAttribute(k, String(v));
      else if (k === "title") node.title = v;
      else node.setAttribute(k, v);
    }
    for (const c of children) node.append(c);
    return node;
  };

  const fmtInt = (n) => (n === null || n === undefined ? "–" : Math.round(n).toLocaleString("en-US"));
  // KPI cards: 578,224 does not fit, 578.2k does.
  function fmtCompact(n) {
    if (n === null || n === undefined) return "–";
    const a = Math.abs(n);
    if (a >= 1e6) return `${(n / 1e6).toFixed(a >= 1e7 ? 1 : 2)}M`;
    if (a >= 1e5) return `${(n / 1e3).toFixed(0)}k`;
    if (a >= 1e4) return `${(n / 1e3).toFixed(1)}k`;
    return fmtInt(n);
  }
  const fmtPct = (x, digits = 1) => (x === null || x === undefined ? "–" : `${(x * 100).toFixed(digits)}%`);
  function fmtNum(x) {
    if (x === null || x === undefined || !Number.isFinite(x)) return "–";
    const a = Math.abs(x);
    if (a >= 1000) return Math.round(x).toLocaleString("en-US");
    if (a >= 100) return x.toFixed(0);
    if (a >= 10) return x.toFixed(1);
    if (a === 0) return "0";
    return x.toFixed(2);
  }
  function fmtMs(x) {
    if (x === null || x === undefined) return "–";
    if (x < 0.1) return x.toFixed(3);
    if (x < 10) return x.toFixed(2);
    return x.toFixed(1);
  }

  function fmtDuration(seconds) {
    if (seconds < 0) return "expired";
    if (seconds < 60) return `${seconds.toFixed(1)} s`;
    if (seconds < 3600) return `${Math.floor(seconds / 60)} m ${Math.floor(seconds % 60)} s`;
    return `${Math.floor(seconds / 3600)} h ${Math.floor((seconds % 3600) / 60)} m`;
  }

  // A service started with http_read_auth wants a bearer token on its data: asked once
  // (on the first 401), kept for this tab only.
  const TOKEN_KEY = "pagekeeper-token";
  let token = sessionStorage.getItem(TOKEN_KEY);

  async function getJSON(url) {
    for (let asked = false; ; asked = true) {
      const used = token;
      const headers = { Accept: "application/json" };
      if (used) headers.Authorization = `Bearer ${used}`;
      const response = await fetch(url, { headers });
      if (response.status === 401 && !asked) {
        if (token === used) {
          const given = window.prompt("This pagekeeper needs a token to show its data:");
          if (!given) throw Object.assign(new Error(`${url}: HTTP 401`), { status: 401 });
          token = given.trim();
          sessionStorage.setItem(TOKEN_KEY, token);
        }
        continue; // with the new token (another call's, or this one's)
      }
      if (!response.ok) {
        const error = new Error(`${url}: HTTP ${response.status}`);
        error.status = response.status;
        throw error;
      }
      return response.json();
    }
  }

  // -- shared state ----------------------------------------------------------------------
  const app = {
    pool: null, // /v1/pool
    clients: [],
    map: null, // /v1/dashboard/page-map
    geometry: null,
    selected: null, // request id shown in the detail panel
    detail: null, // /v1/requests/{id}?kernel_block_size=...
    kernelBlockSize: null,
    kbsTouched: false, // the operator picked a size: keep it
    samples: [],
    samplesReceived: 0,
    charts: [],
  };

  function setConn(state, label) {
    const node = $("conn");
    node.dataset.state = state;
    node.querySelector(".label").textContent = label || state;
  }

  // -- header ----------------------------------------------------------------------------
  function renderPoolMeta() {
    const pool = app.pool;
    if (!pool) return;
    const groups = pool.groups
      .map((g) => {
        const extra = g.window ? ` w=${g.window}` : g.chunk ? ` chunk=${g.chunk}` : "";
        return `${g.name || g.kind}${extra} · ${g.page_size} tok/page`;
      })
      .join(" | ");
    const cfg = pool.config;
    const node = $("pool-meta");
    node.replaceChildren(
      h("b", { text: `${fmtInt(cfg.num_pages)} pages` }),
      ` · ${pool.groups.length} group${pool.groups.length > 1 ? "s" : ""}: ${groups}`,
      ` · prefix caching ${cfg.enable_prefix_caching ? "on" : "off"}`,
      ` · max ${fmtInt(cfg.max_model_len)} tokens/request`,
    );
    node.title = node.textContent;
  }

  // The journal and the listeners' security, beside the pool: what an operator checks first
  // after a restart or before a certificate runs out.
  const CERT_WARN_DAYS = 14;

  function setChip(node, text, tone, title) {
    node.textContent = text;
    node.dataset.tone = tone;
    node.title = title;
  }

  function fmtDays(seconds) {
    const days = seconds / 86400;
    return days >= 2 ? `${Math.floor(days)} d` : fmtDuration(seconds);
  }

  function renderOps() {
    const pool = app.pool;
    if (!pool) return;
    const d = pool.durability;
    const journal = $("ops-journal");
    journal.dataset.level = d.level;
    if (d.failure) {
      setChip(journal, "journal failed", "bad", `the durable log stopped taking writes: ${d.failure}`);
    } else if (d.level === "none") {
      setChip(journal, "no journal", "muted", "durability none: a restart starts empty");
    } else {
      setChip(
        journal,
        `journal: ${d.level}`,
        "ok",
        `${d.data_dir} · record ${fmtInt(d.last_seq)}, ${fmtInt(d.records_since_snapshot)} since ` +
          `the last snapshot · ${fmtInt(d.journal_segments)} segment file(s), ${fmtCompact(d.journal_bytes)} B`,
      );
    }
    renderAuth(pool.auth);
    renderKvEvents(pool.kv_events);
    const t = pool.tls;
    const tls = $("ops-tls");
    tls.dataset.tls = !t.enabled ? "off" : t.client_certificates ? "mutual" : "on";
    tls.dataset.expiresAt = t.expires_at === null ? "" : String(t.expires_at);
    if (!t.enabled) {
      setChip(tls, "plaintext", "muted", "gRPC and HTTP without TLS (loopback or a private network)");
      return;
    }
    const name = t.client_certificates ? "mutual TLS" : "TLS";
    if (t.expires_at === null) {
      setChip(tls, name, "ok", `${t.cert_file} · ${fmtInt(t.num_reloads)} reload(s)`);
      return;
    }
    const left = t.expires_at - Date.now() / 1000;
    const until = new Date(t.expires_at * 1000).toISOString().replace(".000Z", "Z");
    setChip(
      tls,
      left <= 0 ? `${name} · certificate expired` : `${name} · cert ${fmtDays(left)} left`,
      left <= 0 ? "bad" : left < CERT_WARN_DAYS * 86400 ? "warn" : "ok",
      `${t.cert_file} · valid until ${until} · ${fmtInt(t.num_reloads)} reload(s) since start-up`,
    );
  }

  // Which bearer tokens calls must present: none, one given inline, or a file's (rotated
  // without a restart). Never the tokens themselves: the API does not have them.
  function describeTokens(a) {
    if (a.source === "none") return "none";
    if (a.source === "inline") return "an inline token";
    return `${fmtInt(a.num_tokens)} token(s) from ${a.file}, ${fmtInt(a.num_reloads)} reload(s)`;
  }

  function renderAuth(auth) {
    const chip = $("ops-auth");
    const calls = auth.calls;
    chip.dataset.auth = calls.source;
    chip.dataset.reads = auth.http_read_auth ? "token" : "open";
    const reads = auth.http_read_auth ? "HTTP reads need a token" : "HTTP reads are open";
    const title = `calls: ${describeTokens(calls)} · admin: ${describeTokens(auth.admin)} · ${reads}`;
    const also = auth.http_read_auth ? " · reads too" : "";
    if (calls.source === "none") {
      setChip(chip, "no token", "muted", `${title} (gRPC calls need no bearer token)`);
    } else if (calls.source === "inline") {
      setChip(chip, `token${also}`, "ok", title);
    } else {
      setChip(chip, `token file · ${fmtInt(calls.num_tokens)}${also}`, "ok", title);
    }
  }

  // The ZeroMQ publisher for routers, when one is configured.
  function renderKvEvents(kv) {
    const chip = $("ops-kv");
    chip.hidden = kv.endpoint === null;
    chip.dataset.kv = kv.endpoint === null ? "off" : "on";
    if (kv.endpoint === null) return;
    const replay = kv.replay_endpoint === null ? "no replay" : `replay on ${kv.replay_endpoint}`;
    setChip(
      chip,
      `KV events → ${kv.endpoint}`,
      kv.num_lost_events > 0 ? "warn" : "ok",
      `ZeroMQ, vLLM's format (hashes as ${kv.hash_format}) · ${replay} · ` +
        `${fmtInt(kv.num_batches)} batch(es), ${fmtInt(kv.num_events)} event(s), ` +
        `${fmtInt(kv.num_lost_events)} lost, ${fmtInt(kv.num_replays)} replay(s)`,
    );
  }

  // -- KPIs ------------------------------------------------------------------------------
  function setKpi(name, value, sub, barFraction) {
    const card = document.querySelector(`.kpi[data-kpi="${name}"]`);
    card.querySelector(".k-value").textContent = value;
    const subNode = card.querySelector(".k-sub");
    subNode.replaceChildren();
    if (barFraction !== undefined) {
      const bar = h("div", { class: "k-bar" }, h("i"));
      bar.firstChild.style.width = `${Math.max(0, Math.min(1, barFraction)) * 100}%`;
      subNode.append(bar);
    } else {
      subNode.textContent = sub || "";
    }
  }

  function renderKpis(s) {
    if (!s) return;
    setKpi("usage", fmtPct(s.usage), "", s.usage);
    setKpi("pages", `${fmtCompact(s.num_used_pages)} / ${fmtCompact(s.num_free_pages)}`, "used / free");
    setKpi("cached", fmtCompact(s.num_free_cached_pages), "revivable by a hit");
    setKpi("requests", `${fmtCompact(s.num_requests)} · ${fmtInt(s.num_clients)}`, "running · registered");
    setKpi("hit", s.hit_rate === null ? "–" : fmtPct(s.hit_rate), `${fmtPct(s.hit_rate_total)} since start`);
    setKpi("evictions", fmtNum(s.evictions_per_s), "cached pages reused");
    setKpi("steps", fmtNum(s.steps_per_s), "Step calls applied");
    setKpi(
      "latency",
      s.step_p50_ms === null ? "–" : `${fmtMs(s.step_p50_ms)} · ${fmtMs(s.step_p99_ms)}`,
      "ms, last interval",
    );
  }

  // -- page map --------------------------------------------------------------------------
  // Cells are as large as the pool allows; past one page per 4-pixel cell, pages are binned.
  function mapGeometry(numPages, width, numGroups) {
    const maxRows = numGroups > 1 ? 36 : 60;
    for (const cell of [18, 16, 14, 12, 10, 8, 7, 6, 5]) {
      const cols = Math.max(1, Math.floor(width / cell));
      const rows = Math.ceil(numPages / cols);
      if (rows <= maxRows) return { cell, cols, rows, bins: numPages };
    }
    // Binned: 6-pixel cells (5 drawn + a gap) still read as cells, each a little stacked bar.
    const cell = 6;
    const cols = Math.max(1, Math.floor(width / cell));
    return { cell, cols, rows: maxRows, bins: cols * maxRows };
  }

  // First page of bin b (the server bins page p into p * bins // pages).
  const binStart = (b, numPages, numBins) => Math.ceil((b * numPages) / numBins);

  function renderLegend(totals) {
    const legend = $("legend");
    const hasOther = app.map && app.map.groups.some((g) => g.totals.other > 0);
    // "other" is a lane's view of another group's pages: a colour key, not a pool count.
    const items = STATES.filter((s) => s !== "other" || hasOther).map((s) =>
      h(
        "li",
        { "data-state": s, "data-count": s === "other" ? null : totals[s] ?? 0, title: STATE_HINT[s] },
        h("span", { class: "sw" }),
        h("span", { text: STATE_LABEL[s] }),
        s === "other" ? "" : h("span", { class: "cnt", text: fmtInt(totals[s] ?? 0) }),
      ),
    );
    for (const li of items) li.querySelector(".sw").style.background = COLOR[li.dataset.state];
    legend.replaceChildren(...items);
  }

  function drawLane(canvas, lane, geometry, numPages, numBins, highlight) {
    const dpr = window.devicePixelRatio || 1;
    const { cell, cols } = geometry;
    const rows = Math.ceil(numBins / cols);
    const cssW = cols * cell;
    const cssH = rows * cell;
    canvas.style.width = `${cssW}px`;
    canvas.style.height = `${cssH}px`;
    canvas.width = Math.round(cssW * dpr);
    canvas.height = Math.round(cssH * dpr);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(1, 0, 0, 1, 0, 0);
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    const px = Math.max(1, Math.round(cell * dpr));
    const gap = cell >= 5 ? Math.max(1, Math.round(dpr)) : 0;
    const inner = px - gap;
    const series = STACK.map((s) => [s, lane.bins[s]]).filter(([, v]) => v);
    // One path per state: a handful of fills however many cells there are.
    const paths = Object.fromEntries(series.map(([s]) => [s, new Path2D()]));
    for (let b = 0; b < numBins; b++) {
      const x = (b % cols) * px;
      const y = Math.floor(b / cols) * px;
      let total = 0;
      for (const [, v] of series) total += v[b];
      if (total === 0) continue;
      let acc = 0;
      for (const [s, v] of series) {
        const n = v[b];
        if (!n) continue;
        // Integer device-pixel edges: crisp stacks, no seams between states.
        const top = Math.round((inner * (acc + n)) / total);
        const bottom = Math.round((inner * acc) / total);
        acc += n;
        if (top > bottom) paths[s].rect(x, y + inner - top, inner, top - bottom);
      }
    }
    for (const [s] of series) {
      ctx.fillStyle = COLOR[s];
      ctx.fill(paths[s]);
    }
    if (highlight && highlight.length) {
      ctx.strokeStyle = "#f97316";
      ctx.lineWidth = Math.max(1.5, 2 * dpr);
      const seen = new Set();
      for (const page of highlight) {
        if (page <= 0 || page >= numPages) continue;
        const b = Math.floor((page * numBins) / numPages);
        if (seen.has(b)) continue;
        seen.add(b);
        const x = (b % cols) * px;
        const y = Math.floor(b / cols) * px;
        ctx.strokeRect(x + ctx.lineWidth / 2, y + ctx.lineWidth / 2, inner - ctx.lineWidth, inner - ctx.lineWidth);
      }
    }
    canvas.dataset.cell = String(cell);
    canvas.dataset.cols = String(cols);
    canvas.dataset.rows = String(rows);
  }

  function renderMap() {
    const map = app.map;
    const geometry = app.geometry;
    if (!map || !geometry || !app.pool) return;
    const container = $("page-map");
    const { num_pages: numPages, num_bins: numBins } = map;
    const perBin = numPages / numBins;
    $("map-scale").textContent =
      numBins === numPages
        ? `${fmtInt(numPages)} pages · 1 cell = 1 page`
        : `${fmtInt(numPages)} pages · 1 cell ≈ ${fmtNum(perBin)} pages (stacked by state)`;
    renderLegend(map.pool_totals);

    // Keep lanes (and their canvases) across refreshes: no flicker.
    const lanes = new Map([...container.querySelectorAll(".lane")].map((n) => [n.dataset.group, n]));
    const wanted = [];
    const detailPages = app.detail ? app.detail.page_ids : null;
    for (const lane of map.groups) {
      const key = String(lane.group_id);
      let node = lanes.get(key);
      if (!node) {
        node = h(
          "div",
          { class: "lane", "data-group": key },
          h("div", { class: "lane-head" }),
          h("canvas", { role: "img" }),
        );
        const canvas = node.querySelector("canvas");
        canvas.addEventListener("mousemove", (ev) => showTip(ev, Number(key)));
        canvas.addEventListener("mouseleave", hideTip);
      }
      wanted.push(node);
      const group = app.pool.groups[lane.group_id] || {};
      const t = lane.totals;
      const head = node.querySelector(".lane-head");
      head.replaceChildren(
        h("span", { class: "g", text: `group ${lane.group_id}` }),
        h("span", {
          text: `${lane.kind}${group.window ? ` (window ${group.window})` : ""}${
            group.chunk ? ` (chunk ${group.chunk})` : ""
          } · ${lane.page_size} tokens/page${lane.name ? ` · ${lane.name}` : ""}`,
        }),
        h("span", {
          class: "stats",
          text: `${fmtInt(t.used + t.shared)} held (${fmtInt(t.shared)} shared) · ${fmtInt(t.cached)} cached`,
        }),
      );
      for (const s of STATES) node.dataset[s] = String(t[s] ?? 0);
      node.dataset.numBins = String(numBins);
      const canvas = node.querySelector("canvas");
      canvas.setAttribute(
        "aria-label",
        `group ${lane.group_id}: ${STATES.map((s) => `${t[s]} ${s}`).join(", ")}`,
      );
      const highlight = detailPages ? detailPages[lane.group_id] : null;
      drawLane(canvas, lane, geometry, numPages, numBins, highlight);
    }
    container.replaceChildren(...wanted);
    container.dataset.numPages = String(numPages);
    container.dataset.numBins = String(numBins);
    container.dataset.version = String(map.version);
    container.dataset.ready = "true";
  }

  function showTip(ev, groupId) {
    const map = app.map;
    const geometry = app.geometry;
    if (!map || !geometry) return;
    const canvas = ev.currentTarget;
    const rect = canvas.getBoundingClientRect();
    const col = Math.floor((ev.clientX - rect.left) / geometry.cell);
    const row = Math.floor((ev.clientY - rect.top) / geometry.cell);
    const b = row * geometry.cols + col;
    const lane = map.groups.find((g) => g.group_id === groupId);
    if (!lane || col < 0 || col >= geometry.cols || b < 0 || b >= map.num_bins) return hideTip();
    const first = binStart(b, map.num_pages, map.num_bins);
    const last = binStart(b + 1, map.num_pages, map.num_bins) - 1;
    const tip = $("map-tip");
    const lines = [];
    for (const s of STATES) {
      const v = lane.bins[s];
      if (v && v[b]) {
        const sw = h("span", { class: "sw" });
        sw.style.background = COLOR[s];
        lines.push(h("div", {}, sw, `${STATE_LABEL[s]}: ${fmtInt(v[b])}`));
      }
    }
    const title = first === last ? `page ${fmtInt(first)}` : `pages ${fmtInt(first)}–${fmtInt(last)}`;
    tip.replaceChildren(h("b", { text: `${title} · group ${groupId}` }), ...lines);
    tip.hidden = false;
    const x = Math.min(ev.clientX + 14, window.innerWidth - tip.offsetWidth - 8);
    tip.style.left = `${x}px`;
    tip.style.top = `${ev.clientY + 14}px`;
  }

  function hideTip() {
    $("map-tip").hidden = true;
  }

  async function refreshMap() {
    if (!app.pool) return;
    const container = $("page-map");
    const width = Math.max(200, container.clientWidth);
    const geometry = mapGeometry(app.pool.config.num_pages, width, app.pool.groups.length);
    const map = await getJSON(`/v1/dashboard/page-map?bins=${geometry.bins}`);
    app.geometry = geometry;
    app.map = map;
    renderMap();
  }

  // -- tables ----------------------------------------------------------------------------
  function renderClients() {
    const body = $("clients").querySelector("tbody");
    const clients = app.clients;
    $("clients-count").textContent = clients.length ? `${clients.length} registered` : "";
    if (!clients.length) {
      body.replaceChildren(h("tr", { class: "empty" }, h("td", { colspan: 8, text: "no client registered" })));
      return;
    }
    body.replaceChildren(
      ...clients.map((c) => {
        const low = c.lease_remaining_s < Math.max(1, 0.2 * c.lease_ttl_s);
        const kernels = c.kernel_block_sizes.length
          ? c.kernel_block_sizes.map((k, g) => `g${g}: ${k}`).join(" · ")
          : "–";
        return h(
          "tr",
          { "data-client": c.client_id, "data-identity": c.identity },
          h(
            "td",
            { class: "id", title: (c.name ? `${c.client_id} (${c.name})` : c.client_id) + (c.identity ? ` · bound to certificate ${c.identity}` : "") },
            c.client_id,
            c.name ? h("span", { class: "muted", text: ` ${c.name}` }) : "",
            c.identity ? h("span", { class: "ident", text: c.identity }) : "",
          ),
          h("td", {}, h("span", { class: `badge ${c.role}`, text: c.role })),
          h("td", { text: c.device || "–" }),
          h("td", { class: "num", text: String(c.generation) }),
          h("td", {
            class: `num${low ? " lease-low" : ""}`,
            text: fmtDuration(c.lease_remaining_s),
            title: `lease TTL ${fmtDuration(c.lease_ttl_s)}`,
          }),
          h("td", { text: kernels, "data-kernel-block-sizes": c.kernel_block_sizes.join(",") }),
          h("td", { class: "num", text: fmtInt(c.num_requests) }),
          h("td", { class: "num", text: fmtInt(c.num_steps) }),
        );
      }),
    );
  }

  function renderRequests(data) {
    const body = $("requests").querySelector("tbody");
    $("requests-count").textContent = data.num_requests
      ? `top ${data.items.length} of ${fmtInt(data.num_requests)} running`
      : "";
    if (!data.items.length) {
      body.replaceChildren(h("tr", { class: "empty" }, h("td", { colspan: 5, text: "no running request" })));
      return;
    }
    const largest = Math.max(1, data.items[0].num_pages_total);
    const multi = data.items[0].num_pages.length > 1;
    body.replaceChildren(
      ...data.items.map((r) => {
        const bar = h("span", { class: "bar" }, h("i"));
        bar.firstChild.style.width = `${(100 * r.num_pages_total) / largest}%`;
        const row = h(
          "tr",
          {
            "data-request": r.request_id,
            "data-pages": r.num_pages_total,
            class: r.request_id === app.selected ? "selected" : "",
            title: "show its page and kernel block tables",
          },
          h("td", { class: "id", text: r.request_id }),
          h("td", { class: "id", text: r.owner }),
          h("td", { class: "num", text: fmtInt(r.num_tokens) }),
          h("td", { class: "num", text: fmtInt(r.num_cached_tokens) }),
          h(
            "td",
            { class: "num" },
            h(
              "span",
              { class: "pagesbar" },
              bar,
              multi ? `${fmtInt(r.num_pages_total)} (${r.num_pages.join(" + ")})` : fmtInt(r.num_pages_total),
            ),
          ),
        );
        row.addEventListener("click", () => selectRequest(r.request_id));
        return row;
      }),
    );
  }

  // -- request detail --------------------------------------------------------------------
  function commonDivisors(sizes) {
    const gcd = (a, b) => (b ? gcd(b, a % b) : a);
    const g = sizes.reduce(gcd);
    const out = [];
    for (let d = g; d >= 1; d--) if (g % d === 0) out.push(d);
    return out;
  }

  function defaultKernelBlockSize(options) {
    // What a registered worker chose for group 0, when it works for every group.
    for (const c of app.clients) {
      const k = c.kernel_block_sizes[0];
      if (k && options.includes(k)) return k;
    }
    return options.find((d) => d <= 16) ?? options[options.length - 1];
  }

  function fillKernelSelect() {
    if (!app.pool) return;
    const select = $("kbs-select");
    // Mamba state pages are never split: the sizes divide the attention groups' pages.
    const attention = app.pool.groups.filter((g) => g.kind !== "mamba");
    const options = commonDivisors((attention.length ? attention : app.pool.groups).map((g) => g.page_size));
    if (!app.kbsTouched || !options.includes(app.kernelBlockSize)) {
      app.kernelBlockSize = defaultKernelBlockSize(options);
    }
    const current = [...select.options].map((o) => Number(o.value));
    if (current.join() !== options.join()) {
      select.replaceChildren(...options.map((d) => h("option", { value: d, text: `${d} tokens` })));
    }
    select.value = String(app.kernelBlockSize);
  }

  function selectRequest(id) {
    app.selected = id;
    app.detail = null;
    for (const tr of $("requests").querySelectorAll("tbody tr")) {
      tr.classList.toggle("selected", tr.dataset.request === id);
    }
    $("detail").hidden = false;
    refreshDetail().catch(reportError);
  }

  async function refreshDetail() {
    const id = app.selected;
    if (!id) return;
    fillKernelSelect();
    const kbs = app.kernelBlockSize;
    let detail;
    try {
      detail = await getJSON(`/v1/requests/${encodeURIComponent(id)}?kernel_block_size=${kbs}`);
    } catch (error) {
      if (error.status === 404) {
        app.detail = null;
        renderDetailGone(id);
        return;
      }
      throw error;
    }
    if (app.selected !== id) return; // another row was clicked meanwhile
    app.detail = detail;
    renderDetail(detail);
    renderMap(); // outline its pages on the map
  }

  // A request's table as boxes: runs of 3+ null slots collapse into one; a long table
  // shows its head and its tail (the newest pages) around a gap.
  function detailItems(pages) {
    const items = [];
    for (let i = 0; i < pages.length; ) {
      if (pages[i] === 0) {
        let j = i;
        while (j < pages.length && pages[j] === 0) j++;
        if (j - i >= 3) {
          items.push({ kind: "nulls", start: i, count: j - i });
          i = j;
          continue;
        }
      }
      items.push({ kind: "page", i, page: pages[i] });
      i++;
    }
    if (items.length <= MAX_DETAIL_PAGES) return items;
    const head = items.slice(0, MAX_DETAIL_PAGES - 32);
    const tail = items.slice(items.length - 32);
    const hidden = items.length - head.length - tail.length;
    return [...head, { kind: "gap", count: hidden }, ...tail];
  }

  function tableSize(pages) {
    const held = pages.filter((p) => p !== 0).length;
    const plural = (n, word) => `${fmtInt(n)} ${word}${n === 1 ? "" : "s"}`;
    return held === pages.length ? plural(held, "page") : `${plural(pages.length, "slot")}, ${plural(held, "page")} held`;
  }

  // A page's state from the map, when the map has one cell per page (else unknown: null).
  function pageState(groupId, page) {
    const map = app.map;
    if (!map || map.num_bins !== map.num_pages) return null;
    const lane = map.groups.find((g) => g.group_id === groupId);
    if (!lane) return null;
    return STATES.find((s) => lane.bins[s] && lane.bins[s][page]) || null;
  }

  function renderDetailGone(id) {
    $("detail-title").textContent = `Request ${id}`;
    $("detail-meta").textContent = "";
    $("detail").dataset.request = id;
    $("detail-body").replaceChildren(
      h("p", { class: "muted", text: "This request is no longer running (freed or preempted)." }),
    );
  }

  function renderDetail(d) {
    const panel = $("detail");
    panel.dataset.request = d.request_id;
    panel.dataset.kernelBlockSize = String(d.kernel_block_size);
    $("detail-title").textContent = `Request ${d.request_id}`;
    $("detail-meta").textContent =
      `owner ${d.owner} · ${fmtInt(d.num_tokens)} tokens (${fmtInt(d.num_computed_tokens)} computed, ` +
      `${fmtInt(d.num_cached_tokens)} from the prefix cache) · outlined on the page map`;
    const groups = app.pool.groups;
    const body = d.page_ids.map((pages, g) => {
      const group = groups[g];
      const isState = group.kind === "mamba"; // shown whole: workers get it unsplit
      const ratio = isState ? 1 : group.page_size / d.kernel_block_size;
      const kernel = d.kernel_block_ids ? d.kernel_block_ids[g] : [];
      const cells = detailItems(pages).map((item) => {
        if (item.kind === "gap") {
          return h("div", { class: "more", text: `… ${fmtInt(item.count)} more pages …` });
        }
        if (item.kind === "nulls") {
          // Slots that fell out of a window / chunk: one box for the run.
          return h(
            "div",
            {
              class: "pg run",
              "data-state": "null",
              "data-null-run": item.count,
              title: `table slots ${item.start}–${item.start + item.count - 1}: the null page ` +
                "(out of the window: no memory held)",
            },
            h("div", { class: "pid", text: `null ×${fmtInt(item.count)}` }),
            h("div", { class: "pos", text: `slots ${fmtInt(item.start)}–${fmtInt(item.start + item.count - 1)}` }),
          );
        }
        const { i, page } = item;
        const ids = kernel.slice(i * ratio, (i + 1) * ratio);
        const state = page === 0 ? "null" : pageState(g, page);
        const spans =
          ids.length <= 8
            ? ids.map((k) => h("span", { text: String(k) }))
            : [h("span", { text: String(ids[0]) }), h("span", { text: "…" }), h("span", { text: String(ids[ids.length - 1]) })];
        return h(
          "div",
          {
            class: "pg",
            "data-page": page,
            "data-state": state,
            "data-kernel-blocks": ids.join(","),
            title: `table slot ${i}: tokens ${fmtInt(i * group.page_size)}–${fmtInt((i + 1) * group.page_size - 1)}` +
              ` → kernel blocks ${ids[0]}…${ids[ids.length - 1]}${state ? ` · ${STATE_LABEL[state]}` : ""}`,
          },
          h("div", { class: "pid", text: page === 0 ? "null" : String(page) }),
          h("div", { class: "kb" }, ...spans),
        );
      });
      return h(
        "div",
        { class: "gtable", "data-group": g, "data-num-pages": pages.length, "data-ratio": ratio },
        h(
          "h3",
          {},
          `group ${g} · ${group.kind} · ${tableSize(pages)} `,
          h("span", {
            class: "muted",
            text: isState
              ? `(${group.page_size}-token state pages, never split)`
              : `(${group.page_size}-token pages → ${d.kernel_block_size}-token kernel blocks, ×${ratio}: ` +
                `page p → blocks p·${ratio} … p·${ratio}+${ratio - 1})`,
          }),
        ),
        h("div", { class: "pages" }, ...cells),
      );
    });
    $("detail-body").replaceChildren(...body);
  }

  // -- charts ----------------------------------------------------------------------------
  const CHARTS = [
    { key: "usage", series: [{ label: "usage", color: "#2563eb", fill: "rgba(37,99,235,.10)", get: (s) => s.usage * 100 }], range: [0, 100], fmt: (v) => `${v}%` },
    { key: "hit", series: [{ label: "hit rate", color: "#059669", fill: "rgba(5,150,105,.10)", get: (s) => (s.hit_rate === null ? null : s.hit_rate * 100) }], range: [0, 100], fmt: (v) => `${v}%` },
    { key: "evictions", series: [{ label: "evictions/s", color: "#d97706", fill: "rgba(217,119,6,.10)", get: (s) => s.evictions_per_s }] },
    { key: "steps", series: [{ label: "steps/s", color: "#7c3aed", fill: "rgba(124,58,237,.10)", get: (s) => s.steps_per_s }] },
    {
      key: "latency",
      series: [
        { label: "p50", color: "#0ea5e9", get: (s) => s.step_p50_ms },
        { label: "p99", color: "#e11d48", get: (s) => s.step_p99_ms },
      ],
      legend: true,
    },
  ];

  function makeCharts() {
    const grid = cssVar("--line");
    const muted = cssVar("--muted");
    for (const spec of CHARTS) {
      const figure = document.querySelector(`.chart[data-series="${spec.key}"]`);
      const target = figure.querySelector(".plot");
      const width = Math.max(160, target.clientWidth);
      const axisFont = "11px system-ui, sans-serif";
      const fmt = spec.fmt || ((v) => fmtNum(v));
      const opts = {
        width,
        height: 150,
        padding: [10, 10, 0, 0],
        legend: { show: false },
        cursor: { drag: { x: false, y: false }, points: { size: 6 } },
        scales: {
          x: { time: true },
          y: spec.range
            ? { range: spec.range }
            : { range: (u, min, max) => [0, max > 0 ? max * 1.15 : 1] },
        },
        axes: [
          { stroke: muted, font: axisFont, grid: { stroke: grid, width: 1 }, ticks: { stroke: grid, width: 1 }, size: 26 },
          {
            stroke: muted,
            font: axisFont,
            grid: { stroke: grid, width: 1 },
            ticks: { show: false },
            size: 44,
            values: (u, vals) => vals.map(fmt),
          },
        ],
        series: [
          {},
          ...spec.series.map((s) => ({
            label: s.label,
            stroke: s.color,
            width: 1.75,
            fill: s.fill,
            points: { show: false },
            value: (u, v) => (v === null || v === undefined ? "–" : fmtNum(v)),
          })),
        ],
      };
      const data = [[], ...spec.series.map(() => [])];
      if (spec.legend) {
        // A static key in the caption: the values are in the KPI cards.
        const key = h("span", { class: "key" });
        for (const s of spec.series) {
          const sw = h("i");
          sw.style.background = s.color;
          key.append(sw, s.label);
        }
        figure.querySelector("figcaption").append(key);
      }
      const plot = new uPlot(opts, data, target);
      app.charts.push({ spec, plot, figure, target });
    }
    const resize = () => {
      for (const c of app.charts) c.plot.setSize({ width: Math.max(160, c.target.clientWidth), height: c.plot.height });
    };
    new ResizeObserver(resize).observe($("charts"));
  }

  function redrawCharts() {
    const xs = app.samples.map((s) => s.t);
    for (const c of app.charts) {
      const data = [xs, ...c.spec.series.map((s) => app.samples.map(s.get))];
      c.plot.setData(data);
      c.figure.dataset.points = String(xs.length);
    }
    const box = $("charts");
    box.dataset.samples = String(app.samplesReceived);
    const last = app.samples[app.samples.length - 1];
    box.dataset.lastSeq = String(last ? last.seq : 0);
    if (last) {
      const minutes = (last.t - app.samples[0].t) / 60;
      $("series-info").textContent =
        `${app.samples.length} samples · last ${minutes >= 1 ? `${minutes.toFixed(1)} min` : `${Math.round(minutes * 60)} s`}` +
        ` · updated ${new Date(last.t * 1000).toLocaleTimeString()}`;
    }
    renderKpis(last);
  }

  function addSamples(rows) {
    for (const row of rows) {
      const last = app.samples[app.samples.length - 1];
      if (last && row.seq <= last.seq) continue; // already have it (a resumed stream)
      app.samples.push(row);
      app.samplesReceived += 1;
    }
    if (app.samples.length > MAX_POINTS) app.samples.splice(0, app.samples.length - MAX_POINTS);
  }

  function connectStream() {
    const source = new EventSource("/v1/dashboard/stream");
    source.addEventListener("history", (ev) => {
      const history = JSON.parse(ev.data);
      if (history.replace) app.samples = [];
      addSamples(history.samples);
      redrawCharts();
      setConn("live");
    });
    source.addEventListener("sample", (ev) => {
      addSamples([JSON.parse(ev.data)]);
      redrawCharts();
      setConn("live");
    });
    source.addEventListener("open", () => setConn("live"));
    source.addEventListener("error", () => {
      // EventSource reconnects by itself (retry: 2 s) and resumes with Last-Event-ID.
      setConn(source.readyState === EventSource.CLOSED ? "down" : "connecting", "reconnecting");
    });
  }

  // -- polling ---------------------------------------------------------------------------
  let inFlight = false;
  async function refresh() {
    if (inFlight || document.hidden) return;
    inFlight = true;
    try {
      const [pool, clients, requests] = await Promise.all([
        getJSON("/v1/pool"),
        getJSON("/v1/clients"),
        getJSON("/v1/dashboard/requests?limit=15"),
      ]);
      app.pool = pool;
      app.clients = clients;
      renderPoolMeta();
      renderOps();
      renderClients();
      renderRequests(requests);
      if (app.selected) await refreshDetail();
      await refreshMap();
    } catch (error) {
      reportError(error);
    } finally {
      inFlight = false;
    }
  }

  function reportError(error) {
    // A stopped or restarting service: say so in the header, keep trying.
    setConn("down", "unreachable");
    console.warn("pagekeeper dashboard:", error && error.message ? error.message : error);
  }

  function init() {
    makeCharts();
    $("kbs-select").addEventListener("change", (ev) => {
      app.kbsTouched = true;
      app.kernelBlockSize = Number(ev.target.value);
      refreshDetail().catch(reportError);
    });
    $("detail-close").addEventListener("click", () => {
      app.selected = null;
      app.detail = null;
      $("detail").hidden = true;
      for (const tr of $("requests").querySelectorAll("tr.selected")) tr.classList.remove("selected");
      renderMap();
    });
    let resizeTimer = null;
    window.addEventListener("resize", () => {
      clearTimeout(resizeTimer);
      resizeTimer = setTimeout(() => refreshMap().catch(reportError), 200);
    });
    document.addEventListener("visibilitychange", () => {
      if (!document.hidden) refresh();
    });
    connectStream();
    refresh();
    setInterval(refresh, REFRESH_MS);
  }

  window.pagekeeperDashboard = { app, refresh, selectRequest };
  init();
})();
