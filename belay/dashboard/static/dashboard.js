// The belay dashboard's only script: keeps each page live from the JSON
// endpoints (every 2 s) and sends the job actions. It builds every element
// with createElement and sets text with textContent; data never becomes
// markup. Settings come from <body data-…> (base, page, api, auth, csrf).
(function () {
  "use strict";

  const body = document.body;
  const cfg = body.dataset;
  const base = cfg.base || "";
  const STATES = ["ready", "running", "awaiting", "held", "paused", "succeeded", "failed",
    "cancelled"];
  const EVERY_MS = 2000;
  const last = {};
  let polls = 0;
  let timer = null;
  let inflight = false;

  // -- Building elements ------------------------------------------------------------

  function el(tag, props, children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(props || {})) {
      if (value === null || value === undefined) continue;
      if (key === "text") node.textContent = String(value);
      else if (key === "className") node.className = value;
      else node.setAttribute(key, String(value));
    }
    for (const child of children || []) {
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function url(path, query) {
    const params = new URLSearchParams();
    for (const [key, value] of Object.entries(query || {})) {
      if (value !== null && value !== undefined && value !== "") params.set(key, value);
    }
    const text = params.toString();
    return base + path + (text ? "?" + text : "");
  }

  function stateClass(state) {
    return STATES.includes(state) ? "st-" + state : "st-unknown";
  }

  function badge(state) {
    return el("span", { className: "badge " + stateClass(state), text: state });
  }

  function link(href, text) {
    return el("a", { href: href, text: text });
  }

  // Mirrors of pages.py's formatting.
  function when(iso) {
    return iso ? String(iso).replace("T", " ").slice(0, 19) : "—";
  }

  function usd(value) {
    return value === null || value === undefined ? "—" : "$" + Number(value).toFixed(4);
  }

  // One line when short (with Python's ", " and ": "), indented otherwise.
  function pretty(value) {
    if (typeof value === "string") return value;
    const sorted = sortKeys(value);
    const line = oneLine(sorted);
    return line.length <= 72 ? line : JSON.stringify(sorted, null, 2);
  }

  function oneLine(value) {
    if (Array.isArray(value)) return "[" + value.map(oneLine).join(", ") + "]";
    if (value && typeof value === "object") {
      return "{" + Object.keys(value).map((k) => JSON.stringify(k) + ": " + oneLine(value[k])).join(", ") + "}";
    }
    return JSON.stringify(value);
  }

  function sortKeys(value) {
    if (Array.isArray(value)) return value.map(sortKeys);
    if (value && typeof value === "object") {
      const out = {};
      for (const key of Object.keys(value).sort()) out[key] = sortKeys(value[key]);
      return out;
    }
    return value;
  }

  function limitText(limit) {
    if (limit && typeof limit === "object") return limit.min + " to " + limit.max;
    return limit === null || limit === undefined ? "—" : String(limit);
  }

  function rateText(rate) {
    if (!rate || typeof rate !== "object") return "—";
    return rate.allowed + " / " + rate.period + "s" + (rate.resource ? " (" + rate.resource + ")" : "");
  }

  function partitionText(partition) {
    if (Array.isArray(partition)) return partition.join(".") || "—";
    return partition === null || partition === undefined ? "—" : String(partition);
  }

  function replaceRows(id, rows) {
    const tbody = document.getElementById(id);
    if (!tbody) return;
    tbody.replaceChildren(...rows);
    const table = tbody.closest("table");
    if (table && table.classList.contains("jobs")) table.hidden = rows.length === 0;
    const empty = document.querySelector('[data-empty="' + id + '"]');
    if (empty) empty.hidden = rows.length > 0;
  }

  // "showing the newest 200 of 5,000" under a part the detail holds only some of.
  function setShown(part, count, total) {
    const note = document.getElementById(part + "-shown");
    if (!note || typeof total !== "number") return;
    note.hidden = total <= count;
    note.textContent = "showing the " + note.dataset.which + " " + count + " of " + total.toLocaleString("en-US");
  }

  function changed(key, value) {
    const text = JSON.stringify(value);
    if (last[key] === text) return false;
    last[key] = text;
    return true;
  }

  function setField(name, text) {
    for (const node of document.querySelectorAll("[data-field]")) {
      if (node.getAttribute("data-field") === name) node.textContent = text;
    }
  }

  // -- Rows and tiles (the same markup pages.py renders) -----------------------------

  function jobRow(j) {
    const workflow = j.workflow_id
      ? link(url("/workflow", { id: j.workflow_id }), j.wf_name || j.workflow_id) : "—";
    const parent = j.parent_id ? link(url("/jobs/" + j.parent_id), j.parent_id) : "—";
    return el("tr", { "data-id": j.id }, [
      el("td", {}, [link(url("/jobs/" + j.id), j.id)]),
      el("td", { className: "kind", text: j.kind }),
      el("td", { text: j.queue }),
      el("td", {}, [badge(j.state)]),
      el("td", { text: j.attempt + "/" + j.max_attempts }),
      el("td", {}, [workflow]),
      el("td", {}, [parent]),
      el("td", { text: usd(j.spent_usd) }),
      el("td", { text: when(j.inserted_at) }),
      el("td", { text: when(j.finished_at) }),
    ]);
  }

  // A count, or "10,000+" where counting stopped at the cap (ops.queue_overview),
  // as belay.cliformat.count writes it on the server.
  function countText(q, s) {
    const capped = q.capped || [];
    const n = (v) => Number(v || 0).toLocaleString("en-US");
    if (s === undefined) return n(q.total) + (capped.length ? "+" : "");
    if (capped.includes(s)) return n(q.count_cap) + "+";
    return n(q.counts[s]);
  }

  function tile(q) {
    const counts = STATES.map((s) => el("a", {
      className: "count " + stateClass(s) + (q.counts[s] ? "" : " zero"),
      href: url("/jobs", { queue: q.queue, state: s }),
    }, [el("b", { text: countText(q, s) }), el("span", { text: s })]));
    const opts = q.options;
    const options = opts === null || opts === undefined
      ? el("p", { className: "muted", text: "static options (no belay_queues row)" })
      : el("dl", { className: "opts" }, [
        el("dt", { text: "limit" }), el("dd", { text: limitText(opts.limit) }),
        el("dt", { text: "global" }), el("dd", { text: opts.global_limit || "—" }),
        el("dt", { text: "rate" }), el("dd", { text: rateText(opts.rate) }),
        el("dt", { text: "partition" }), el("dd", { text: partitionText(opts.partition) }),
      ]);
    const minute = q.last_minute;
    const head = [el("h3", {}, [link(url("/jobs", { queue: q.queue }), q.queue)])];
    if (q.paused) head.push(el("span", { className: "badge paused", text: "paused" }));
    head.push(el("span", { className: "muted", text: countText(q) + " jobs" }));
    return el("section", { className: "tile", "data-queue": q.queue }, [
      el("header", {}, head),
      el("div", { className: "counts" }, counts),
      options,
      el("p", { className: "minute" }, ["last minute: ", el("b", { text: minute.succeeded || 0 }),
        " succeeded · ", el("b", { text: minute.failed || 0 }), " failed · ",
        el("b", { text: minute.cancelled || 0 }), " cancelled"]),
      el("p", { className: "muted", text: "unfinished jobs spent " + usd(q.spent_usd) + " · " + q.spent_tokens + " tokens" }),
    ]);
  }

  function updateDag(members) {
    const box = document.getElementById("dag");
    if (!box) return;
    const byName = new Map(members.map((m) => [m.name, m]));
    for (const node of box.querySelectorAll("g.node")) {
      const member = byName.get(node.getAttribute("data-name"));
      if (!member) continue;
      const current = node.classList.contains("current") ? " current" : "";
      node.setAttribute("class", "node " + stateClass(member.state) + current);
      const label = node.querySelector("text.state");
      if (label) label.textContent = member.state;
      const title = node.querySelector("title");
      if (title) title.textContent = member.name + " · job " + member.id + " · " + member.kind + " · " + member.state;
    }
  }

  // -- Pages -------------------------------------------------------------------------

  const render = {
    overview(data) {
      if (changed("tiles", data.queues)) {
        const tiles = document.getElementById("tiles");
        if (tiles) {
          tiles.replaceChildren(...data.queues.map(tile));
          if (!data.queues.length) {
            tiles.append(el("p", { className: "muted", text: "No queues yet: enqueue a job or put_queue() one." }));
          }
        }
      }
      if (changed("recent", data.recent)) replaceRows("recent", data.recent.map(jobRow));
    },

    jobs(data) {
      if (changed("jobs", data.jobs)) replaceRows("jobs", data.jobs.map(jobRow));
    },

    job(data) {
      const j = data.job;
      if (changed("state", j.state)) {
        const holder = document.getElementById("job-state");
        if (holder) holder.replaceChildren(badge(j.state));
      }
      const budget = j.budget_usd !== null || j.budget_tokens !== null
        ? usd(j.budget_usd) + " · " + (j.budget_tokens || "—") + " tokens" : "—";
      const fields = {
        queue: j.queue,
        attempt: j.attempt + "/" + j.max_attempts,
        priority: String(j.priority),
        spent: usd(j.spent_usd) + " · " + (j.spent_tokens || 0) + " tokens",
        budget: budget,
        partition_key: j.partition_key || "—",
        unique_key: j.unique_key || "—",
        cron_name: j.cron_name || "—",
        await: j.await_name ? j.await_scope + " / " + j.await_name : "—",
        leased_by: j.leased_by || "—",
        cancel_requested: j.cancel_requested ? "yes" : "no",
        inserted_at: when(j.inserted_at),
        ready_at: when(j.ready_at),
        started_at: when(j.started_at),
        finished_at: when(j.finished_at),
        lease_until: when(j.lease_until),
      };
      for (const [name, text] of Object.entries(fields)) setField(name, text);
      const result = document.getElementById("result");
      if (result) result.textContent = j.result === null ? "—" : pretty(j.result);
      if (changed("errors", j.errors)) {
        replaceRows("errors", (j.errors || []).map((entry) => {
          if (entry && typeof entry === "object" && !Array.isArray(entry) && "error" in entry) {
            const rest = {};
            for (const key of Object.keys(entry)) {
              if (key !== "error" && key !== "attempt") rest[key] = entry[key];
            }
            const item = el("li", {}, [el("span", { className: "muted", text: "attempt " + (entry.attempt ?? "?") }),
              " ", el("code", { text: pretty(entry.error) })]);
            if (Object.keys(rest).length) {
              item.append(el("details", {}, [el("summary", { text: "details" }), el("pre", { text: pretty(rest) })]));
            }
            return item;
          }
          return el("li", {}, [el("pre", { text: pretty(entry) })]);
        }));
      }
      if (changed("steps", data.steps)) {
        replaceRows("steps", data.steps.map((s) => el("tr", {}, [
          el("td", { text: s.seq }), el("td", { className: "kind", text: s.name }),
          el("td", {}, [el("pre", { text: pretty(s.value) })]),
          el("td", { className: "num", text: usd(s.usd) }), el("td", { className: "num", text: s.tokens }),
          el("td", { text: when(s.inserted_at) }),
        ])));
        const cost = data.journal_cost;
        const usdCell = document.getElementById("journal-usd");
        const tokenCell = document.getElementById("journal-tokens");
        if (usdCell) usdCell.textContent = usd(cost.usd);
        if (tokenCell) tokenCell.textContent = String(cost.tokens);
      }
      if (changed("events", data.events)) {
        replaceRows("events", data.events.map((e) => el("tr", {}, [
          el("td", { text: e.seq }), el("td", {}, [el("pre", { text: pretty(e.payload) })]),
          el("td", { text: when(e.inserted_at) }),
        ])));
      }
      if (changed("children", data.children)) replaceRows("children", data.children.map(jobRow));
      for (const part of ["steps", "events", "children"]) setShown(part, data[part].length, data[part + "_total"]);
      if (data.workflow) updateDag(data.workflow.jobs);
    },

    workflow(data) {
      updateDag(data.jobs);
      setField("done", data.done ? "done" : "in progress");
      if (changed("counts", data.counts)) {
        const counts = document.getElementById("wf-counts");
        if (counts) {
          counts.replaceChildren(...Object.keys(data.counts).sort().map((s) =>
            el("span", { className: "badge " + stateClass(s), text: data.counts[s] + " " + s })));
        }
      }
      if (changed("members", data.jobs)) {
        replaceRows("members", data.jobs.map((m) => el("tr", {}, [
          el("td", { className: "kind", text: m.name }),
          el("td", {}, [link(url("/jobs/" + m.id), m.id)]),
          el("td", { className: "kind", text: m.kind }),
          el("td", {}, [badge(m.state)]),
          el("td", { text: m.deps.join(", ") || "—" }),
        ])));
      }
    },
  };

  // -- Live updates ------------------------------------------------------------------

  function setLive(ok) {
    const live = document.getElementById("live");
    if (!live) return;
    live.className = "live " + (ok ? "on" : "off");
    live.textContent = ok ? "live " + new Date().toTimeString().slice(0, 8) : "offline — retrying";
  }

  function schedule(ms) {
    clearTimeout(timer);
    timer = setTimeout(poll, ms);
  }

  function poll() {
    if (inflight) return;
    if (document.hidden) {
      schedule(EVERY_MS);
      return;
    }
    inflight = true;
    fetch(cfg.api, { headers: { Accept: "application/json" }, credentials: "same-origin", cache: "no-store" })
      .then((response) => (response.ok ? response.json() : Promise.reject(new Error(String(response.status)))))
      .then((data) => {
        render[cfg.page](data);
        polls += 1;
        body.dataset.polls = String(polls);
        setLive(true);
      })
      .catch(() => setLive(false))
      .finally(() => {
        inflight = false;
        schedule(EVERY_MS);
      });
  }

  // -- Actions -----------------------------------------------------------------------

  const tokenKey = "belay-dashboard-token " + location.host + base;
  let pending = null;

  function status(text, ok) {
    const line = document.getElementById("action-status");
    if (!line) return;
    line.className = "status " + (ok ? "ok" : "bad");
    line.textContent = text;
  }

  function askToken(note, then) {
    const form = document.getElementById("token-form");
    if (!form) return;
    pending = then;
    form.hidden = false;
    document.getElementById("token-note").textContent = note;
    document.getElementById("token-input").focus();
  }

  function showForget() {
    const forget = document.getElementById("token-forget");
    if (forget) forget.hidden = !sessionStorage.getItem(tokenKey);
  }

  function describe(action, data) {
    if (action === "cancel") return "cancel: " + data.status;
    if (action === "retry") return "retried: the job is " + data.job.state + " again";
    if (action === "top-up") {
      if (data.resumed) return "topped up: the job resumes";
      const paused = (data.job.await_name || "").startsWith("$top_up");
      return "topped up" + (paused ? ": still paused, a cap is still short" : "");
    }
    const woke = data.woken.length ? " (woke job " + data.woken.join(", ") + ")" : "";
    if (action === "signal") return "signal " + data.signal + " delivered" + woke;
    return "steering delivered" + woke;
  }

  function act(action, args) {
    const headers = { "Content-Type": "application/json", Accept: "application/json" };
    if (cfg.auth === "token") {
      const token = sessionStorage.getItem(tokenKey);
      if (!token) {
        askToken("Enter the dashboard's token to " + action + ".", () => act(action, args));
        return;
      }
      headers.Authorization = "Bearer " + token;
    }
    if (cfg.auth === "session" && cfg.csrf) headers["X-CSRFToken"] = cfg.csrf;
    status(action + "…", true);
    fetch(url("/api/jobs/" + cfg.jobId + "/" + action), {
      method: "POST", headers: headers, body: JSON.stringify(args), credentials: "same-origin",
    })
      .then((response) => response.json()
        .catch(() => ({ error: "HTTP " + response.status + ": refused before it reached the dashboard (reload the page and try again)" }))
        .then((data) => ({ response: response, data: data })))
      .then(({ response, data }) => {
        if (response.status === 401 && cfg.auth === "token") {
          sessionStorage.removeItem(tokenKey);
          showForget();
          status(data.error, false);
          askToken(data.error, () => act(action, args));
          return;
        }
        status(response.ok ? describe(action, data) : data.error, response.ok);
        if (response.ok) schedule(0);
      })
      .catch((error) => status(action + " failed: " + error, false));
  }

  function wireActions() {
    const tokenForm = document.getElementById("token-form");
    if (tokenForm) {
      tokenForm.addEventListener("submit", (event) => {
        event.preventDefault();
        const input = document.getElementById("token-input");
        const token = input.value.trim();
        if (!token) return;
        sessionStorage.setItem(tokenKey, token);
        input.value = "";
        tokenForm.hidden = true;
        showForget();
        const then = pending;
        pending = null;
        if (then) then();
      });
      const forget = document.getElementById("token-forget");
      forget.addEventListener("click", () => {
        sessionStorage.removeItem(tokenKey);
        showForget();
      });
      showForget();
    }
    for (const button of document.querySelectorAll("button[data-action]")) {
      button.addEventListener("click", () => {
        const action = button.getAttribute("data-action");
        if (action === "cancel" && button.dataset.armed !== "1") {
          button.dataset.armed = "1";
          button.textContent = "Confirm cancel";
          setTimeout(() => {
            button.dataset.armed = "";
            button.textContent = "Cancel";
          }, 4000);
          return;
        }
        button.dataset.armed = "";
        button.textContent = action === "cancel" ? "Cancel" : button.textContent;
        act(action, {});
      });
    }
    const signalForm = document.getElementById("signal-form");
    if (signalForm) {
      signalForm.addEventListener("submit", (event) => {
        event.preventDefault();
        const name = document.getElementById("signal-name").value.trim();
        const raw = document.getElementById("signal-payload").value.trim();
        let payload = {};
        if (raw) {
          try {
            payload = JSON.parse(raw);
          } catch (error) {
            status("the payload is not JSON: " + error.message, false);
            return;
          }
        }
        act("signal", { name: name, payload: payload });
      });
    }
    const topUpForm = document.getElementById("top-up-form");
    if (topUpForm) {
      topUpForm.addEventListener("submit", (event) => {
        event.preventDefault();
        const args = {};
        const usd = document.getElementById("top-up-usd").value.trim();
        const tokens = document.getElementById("top-up-tokens").value.trim();
        if (usd) args.usd = Number(usd);
        if (tokens) args.tokens = Number(tokens);
        if ((usd && !Number.isFinite(args.usd)) || (tokens && !Number.isInteger(args.tokens))) {
          status("a top-up is dollars and/or a whole number of tokens", false);
          return;
        }
        act("top-up", args);
      });
    }
    const steerForm = document.getElementById("steer-form");
    if (steerForm) {
      steerForm.addEventListener("submit", (event) => {
        event.preventDefault();
        const input = document.getElementById("steer-text");
        act("steer", { payload: { instruction: input.value } });
      });
    }
  }

  wireActions();
  if (cfg.api && render[cfg.page]) schedule(0);
})();
