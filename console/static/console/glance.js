// The console's shared live pieces, no build step: relative times ("3 min ago", the absolute
// time on hover), and the board header ("at a glance": counts per endpoint, queue and state,
// the oldest pending todo, the throughput chart), fed by the board's stream (`glance` events
// carry the endpoints a batch touched) and re-fetched whole on every (re)connect.
(function () {
  "use strict";
  var SB = window.Switchboard = window.Switchboard || {};
  var skewMs = 0; // server clock minus this browser's, from the last glance snapshot

  function now() { return Date.now() + skewMs; }

  function span(seconds) {
    seconds = Math.max(0, Math.round(seconds));
    if (seconds < 60) return seconds + " s";
    if (seconds < 3600) return Math.round(seconds / 60) + " min";
    if (seconds < 86400) return (seconds / 3600).toFixed(seconds < 36000 ? 1 : 0) + " h";
    return Math.round(seconds / 86400) + " d";
  }
  SB.span = span;

  function absolute(ms) { return new Date(ms).toISOString().replace("T", " ").slice(0, 19) + " UTC"; }

  SB.relativeTimes = function (root) {
    root.querySelectorAll("time[data-relative]").forEach(function (el) {
      var at = Date.parse(el.getAttribute("datetime"));
      if (isNaN(at)) return;
      if (!el.title) el.title = absolute(at);
      var diff = (at - now()) / 1000;
      el.textContent = diff > 1 ? "in " + span(diff) : span(-diff) + " ago";
    });
  };

  function labelOf(column) {
    return column.replace(/_24h$/, "").replace(/_/g, " ") + (/_24h$/.test(column) ? " · 24 h" : "");
  }
  function stateOf(column) { return column.replace(/_24h$/, ""); }

  function el(tag, attrs, text) {
    var node = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (key) { node.setAttribute(key, attrs[key]); });
    if (text !== undefined) node.textContent = text;
    return node;
  }

  var SVG = "http://www.w3.org/2000/svg";
  function svg(tag, attrs) {
    var node = document.createElementNS(SVG, tag);
    Object.keys(attrs).forEach(function (key) { node.setAttribute(key, attrs[key]); });
    return node;
  }

  SB.glance = function (section) {
    var state = { columns: [], endpoints: {}, span: "minute" };
    var dataNode = document.getElementById("glance-data");
    var api = { merge: function () {}, refetch: function () {}, state: state };
    if (!section) return api;
    var filterEndpoint = section.dataset.endpoint || "";
    var filterQueue = section.dataset.queue || "";

    function take(snapshot, whole) {
      if (snapshot.now) skewMs = Date.parse(snapshot.now) - Date.now();
      if (snapshot.columns) state.columns = snapshot.columns;
      if (whole) state.endpoints = {};
      (snapshot.endpoints || []).forEach(function (entry) { state.endpoints[entry.endpoint] = entry; });
      render();
    }

    function included() {
      return Object.keys(state.endpoints).sort().filter(function (slug) {
        return !filterEndpoint || slug === filterEndpoint;
      }).map(function (slug) { return state.endpoints[slug]; });
    }

    function queuesOf(entry) {
      return Object.keys(entry.queues || {}).sort().filter(function (queue) {
        return !filterQueue || queue === filterQueue;
      });
    }

    function totals() {
      var sum = {}, oldest = null;
      state.columns.forEach(function (column) { sum[column] = 0; });
      included().forEach(function (entry) {
        queuesOf(entry).forEach(function (queue) {
          var counts = entry.queues[queue];
          state.columns.forEach(function (column) { sum[column] += counts[column] || 0; });
          if (counts.oldest_pending_at) {
            var at = Date.parse(counts.oldest_pending_at);
            if (oldest === null || at < oldest) oldest = at;
          }
        });
      });
      return { sum: sum, oldest: oldest };
    }

    function renderCards(total) {
      var cards = document.getElementById("glance-cards");
      if (!cards) return;
      var nodes = state.columns.map(function (column) {
        var card = el("div", { "class": "glance-card" + (total.sum[column] ? "" : " zero"), "data-column": column });
        card.appendChild(el("div", { "class": "n" }, String(total.sum[column])));
        var what = el("div", { "class": "what" });
        what.appendChild(el("span", { "class": "badge state state-" + stateOf(column) }, labelOf(column)));
        card.appendChild(what);
        return card;
      });
      var oldest = el("div", { "class": "glance-card oldest", id: "oldest-pending" });
      if (total.oldest === null) {
        oldest.appendChild(el("div", { "class": "n" }, "—"));
      } else {
        var n = el("div", { "class": "n" });
        n.appendChild(el("time", { datetime: new Date(total.oldest).toISOString(), title: absolute(total.oldest) },
                         span((now() - total.oldest) / 1000)));
        oldest.appendChild(n);
      }
      oldest.appendChild(el("div", { "class": "what muted" }, "oldest pending"));
      nodes.push(oldest);
      cards.replaceChildren.apply(cards, nodes);
    }

    function renderTabs(total) {
      document.querySelectorAll("#state-tabs [data-count]").forEach(function (node) {
        var column = node.getAttribute("data-count");
        node.textContent = column in total.sum ? String(total.sum[column]) : "·";
      });
    }

    function retryAllLink(slug, queue) {
      var params = new URLSearchParams({ endpoint: slug, queue: queue, state: "dead",
                                         next: section.dataset.next || "" });
      return el("a", { "class": "retry-all", href: section.dataset.bulkUrl + "?" + params.toString() }, "retry all…");
    }

    function renderTable() {
      var table = document.getElementById("glance-table");
      if (!table) return;
      var head = el("tr");
      ["endpoint", "queue"].concat(state.columns.map(labelOf), ["oldest pending"]).forEach(function (name) {
        head.appendChild(el("th", {}, name));
      });
      table.tHead.replaceChildren(head);
      var rows = [];
      included().forEach(function (entry) {
        queuesOf(entry).forEach(function (queue) {
          var counts = entry.queues[queue];
          var row = el("tr", { "data-endpoint": entry.endpoint, "data-queue": queue });
          var link = el("a", { href: section.dataset.boardUrl + "?" + new URLSearchParams({ endpoint: entry.endpoint, queue: queue }) }, queue);
          row.appendChild(el("td", {}, entry.endpoint));
          var q = el("td"); q.appendChild(link); row.appendChild(q);
          state.columns.forEach(function (column) {
            var cell = el("td", { "data-col": column }, String(counts[column] || 0));
            if (column === "dead" && counts.dead && section.dataset.bulkUrl) cell.appendChild(retryAllLink(entry.endpoint, queue));
            row.appendChild(cell);
          });
          var oldest = counts.oldest_pending_at ? Date.parse(counts.oldest_pending_at) : null;
          row.appendChild(el("td", { "data-col": "oldest" }, oldest === null ? "—" : span((now() - oldest) / 1000)));
          rows.push(row);
        });
      });
      if (!rows.length) {
        var none = el("tr"); none.appendChild(el("td", { colspan: String(state.columns.length + 3), "class": "muted" }, "no open todos and none finished in the last 24 h"));
        rows.push(none);
      }
      table.tBodies[0].replaceChildren.apply(table.tBodies[0], rows);
    }

    function series() {
      var step = state.span === "minute" ? 60 : 3600, count = state.span === "minute" ? 60 : 24;
      var last = Math.floor(now() / 1000 / step) * step, first = last - (count - 1) * step;
      var out = { created: [], done: [], failed: [], first: first, step: step };
      for (var i = 0; i < count; i++) { out.created.push(0); out.done.push(0); out.failed.push(0); }
      included().forEach(function (entry) {
        var byMeasure = (entry.series || {})[state.span] || {};
        ["created", "done", "failed"].forEach(function (measure) {
          var buckets = byMeasure[measure] || {};
          Object.keys(buckets).forEach(function (stamp) {
            var index = (parseInt(stamp, 10) - first) / step;
            if (index >= 0 && index < count) out[measure][index] += buckets[stamp];
          });
        });
      });
      return out;
    }

    function renderChart() {
      var chart = document.getElementById("chart");
      if (!chart) return;
      var data = series(), count = data.created.length, width = 600, height = 130, pad = 4;
      var max = Math.max(1, Math.max.apply(null, data.created.concat(data.done, data.failed)));
      var x = function (i) { return (i + 0.5) * width / count; };
      var y = function (v) { return height - pad - v * (height - 2 * pad) / max; };
      var nodes = [0, 0.5, 1].map(function (f) {
        return svg("line", { "class": "grid", x1: 0, x2: width, y1: y(max * f), y2: y(max * f) });
      });
      var barWidth = Math.max(1, width / count - 2);
      data.created.forEach(function (v, i) {
        if (!v) return;
        var bar = svg("rect", { "class": "bar-created", x: x(i) - barWidth / 2, width: barWidth, y: y(v), height: height - pad - y(v) });
        var title = svg("title", {}); title.textContent = v + " created";
        bar.appendChild(title);
        nodes.push(bar);
      });
      ["done", "failed"].forEach(function (measure) {
        var points = data[measure].map(function (v, i) { return x(i).toFixed(1) + "," + y(v).toFixed(1); }).join(" ");
        nodes.push(svg("polyline", { "class": "line-" + measure, points: points }));
      });
      chart.replaceChildren.apply(chart, nodes);
      chart.setAttribute("data-total-created", String(data.created.reduce(function (a, b) { return a + b; }, 0)));
      chart.setAttribute("data-total-done", String(data.done.reduce(function (a, b) { return a + b; }, 0)));
      chart.setAttribute("data-total-failed", String(data.failed.reduce(function (a, b) { return a + b; }, 0)));
      var from = document.getElementById("chart-from"), top = document.getElementById("chart-max");
      if (from) from.textContent = state.span === "minute" ? "60 min ago" : "24 h ago";
      if (top) top.textContent = "peak " + max + (state.span === "minute" ? " / min" : " / h");
    }

    function render() {
      var total = totals();
      renderCards(total);
      renderTabs(total);
      renderTable();
      renderChart();
      section.setAttribute("data-rendered", String(parseInt(section.getAttribute("data-rendered") || "0", 10) + 1));
    }

    section.querySelectorAll(".seg button").forEach(function (button) {
      button.addEventListener("click", function () {
        state.span = button.getAttribute("data-span");
        section.querySelectorAll(".seg button").forEach(function (other) {
          other.setAttribute("aria-pressed", String(other === button));
        });
        renderChart();
      });
    });

    api.merge = function (snapshot) { take(snapshot, false); };
    api.refetch = function () {
      var url = section.dataset.glanceUrl + (filterEndpoint ? "?endpoint=" + encodeURIComponent(filterEndpoint) : "");
      fetch(url, { credentials: "same-origin", cache: "no-store" })
        .then(function (response) { if (!response.ok) throw new Error("glance " + response.status); return response.json(); })
        .then(function (snapshot) { take(snapshot, true); })
        .catch(function () { /* the next reconnect re-fetches */ });
    };
    if (dataNode) take(JSON.parse(dataNode.textContent), true);
    // Ages and the chart's window move with the clock even when nothing changes.
    setInterval(render, 30000);
    return api;
  };

  // The endpoint page: its queues' counts follow the board's stream (filtered to this
  // endpoint), and its live sessions are re-read on every change and every 15 s (a session
  // connecting changes no todo, so no batch announces it).
  SB.followEndpoint = function (table) {
    var slug = table.dataset.endpoint, live = document.getElementById("live");
    var sessionsBody = document.querySelector("#sessions tbody");
    var dataNode = document.getElementById("glance-data");
    var columns = dataNode ? JSON.parse(dataNode.textContent).columns : [];

    function apply(snapshot) {
      (snapshot.endpoints || []).forEach(function (entry) {
        if (entry.endpoint !== slug) return;
        var body = table.tBodies[0], queues = Object.keys(entry.queues || {}).sort();
        var none = body.querySelector("tr.none");
        if (none && queues.length) none.remove();
        queues.forEach(function (queue) {
          var row = body.querySelector('tr[data-queue="' + CSS.escape(queue) + '"]');
          if (!row) {
            row = el("tr", { "data-queue": queue });
            var first = el("td");
            first.appendChild(el("a", { href: table.dataset.boardUrl + "?" + new URLSearchParams({ endpoint: slug, queue: queue }) }, queue));
            row.appendChild(first);
            columns.forEach(function (column) { row.appendChild(el("td", { "class": "n-" + stateOf(column) }, "0")); });
            body.appendChild(row);
          }
          columns.forEach(function (column) {
            var cell = row.querySelector(".n-" + stateOf(column));
            if (cell) cell.textContent = String(entry.queues[queue][column] || 0);
          });
        });
      });
    }

    function refreshSessions() {
      if (!sessionsBody) return;
      fetch(table.dataset.sessionsUrl, { credentials: "same-origin", cache: "no-store" })
        .then(function (response) { if (!response.ok) throw new Error("sessions " + response.status); return response.text(); })
        .then(function (html) { sessionsBody.innerHTML = html; SB.relativeTimes(sessionsBody); })
        .catch(function () { /* tried again on the next change or tick */ });
    }

    function refetch() {
      fetch(table.dataset.glanceUrl, { credentials: "same-origin", cache: "no-store" })
        .then(function (response) { if (!response.ok) throw new Error("glance " + response.status); return response.json(); })
        .then(function (snapshot) { apply(snapshot); table.setAttribute("data-synced", "1"); })
        .catch(function () { /* the next reconnect re-fetches */ });
      refreshSessions();
    }

    SB.relativeTimes(document);
    setInterval(refreshSessions, 15000);
    if (!window.EventSource) return;
    var source = new EventSource(table.dataset.eventsUrl);
    source.addEventListener("open", function () { if (live) { live.textContent = "live"; live.classList.add("on"); } });
    source.addEventListener("sync", refetch);
    source.addEventListener("glance", function (event) { apply(JSON.parse(event.data)); refreshSessions(); });
    source.addEventListener("error", function () {
      if (live) { live.textContent = source.readyState === EventSource.CLOSED ? "offline — reload the page" : "reconnecting…"; live.classList.remove("on"); }
    });
  };

  document.addEventListener("DOMContentLoaded", function () {
    var counts = document.getElementById("queue-counts");
    if (counts && counts.dataset.eventsUrl) SB.followEndpoint(counts);
  });
})();
