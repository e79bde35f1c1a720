// The Todos board's live updates: one EventSource on /todos/events, no build step.
//
// Correctness does not rest on the stream. Every time the stream (re)connects the server
// subscribes first and then sends `sync`; the page then re-fetches its rows, so a change made
// while the connection was down is picked up. Rows carry a version (their latest todo event id,
// which grows in commit order per todo), and an older copy of a row never replaces a newer one,
// whichever of the snapshot and the stream arrives first.
(function () {
  "use strict";
  var table = document.getElementById("board");
  var SB = window.Switchboard;
  var relativeTimes = SB.relativeTimes;
  relativeTimes(document);
  setInterval(function () { relativeTimes(document); }, 15000);
  var glance = SB.glance(document.getElementById("glance"));
  if (!table || !window.EventSource) return;
  var tbody = document.getElementById("rows");
  var live = document.getElementById("live");
  var csrfMeta = document.querySelector('meta[name="csrf-token"]');
  var csrf = csrfMeta ? csrfMeta.content : "";
  var buffered = null; // stream changes that arrive while a re-sync is in flight

  function idOf(row) { return parseInt(row.getAttribute("data-todo"), 10); }
  // A row re-rendered live keeps the operator's tick in its bulk checkbox: a change or a
  // re-sync arriving between the tick and the bulk button must not drop it from the selection.
  function keepSelection(from, to) {
    var was = from && from.querySelector("input[name=ids]");
    var now = to.querySelector("input[name=ids]");
    if (was && now) now.checked = was.checked;
    return to;
  }
  function versionOf(row) { return parseInt(row.getAttribute("data-version") || "0", 10); }

  // Rows rendered for the stream carry a blank CSRF token: the page's token fills it.
  function fillCsrf(root) {
    root.querySelectorAll('input[name="csrfmiddlewaretoken"]').forEach(function (input) {
      if (!input.value) input.value = csrf;
    });
  }

  function rowsFrom(html) {
    var holder = document.createElement("tbody");
    holder.innerHTML = html.trim();
    fillCsrf(holder);
    return Array.prototype.slice.call(holder.children);
  }

  function insertNewestFirst(row) {
    var id = idOf(row);
    for (var i = 0; i < tbody.children.length; i++) {
      if (idOf(tbody.children[i]) < id) { tbody.insertBefore(row, tbody.children[i]); return; }
    }
    tbody.appendChild(row);
  }

  function setStatus(text, on) {
    if (!live) return;
    live.textContent = text;
    live.classList.toggle("on", !!on);
  }

  // The banner of todos awaiting approval: re-read whenever a row enters or leaves that state
  // (it counts every visible endpoint's, not only the rows shown).
  var approvalsUrl = table.dataset.approvalsUrl;
  var approvalsDue = false;
  function refreshApprovals() {
    if (approvalsDue || !approvalsUrl) return;
    approvalsDue = true;
    setTimeout(function () {
      approvalsDue = false;
      fetch(approvalsUrl, { credentials: "same-origin", cache: "no-store" })
        .then(function (response) { return response.ok ? response.text() : null; })
        .then(function (html) {
          var banner = document.getElementById("approvals");
          if (html === null || !banner) return;
          var holder = document.createElement("div");
          holder.innerHTML = html.trim();
          if (holder.firstElementChild) banner.replaceWith(holder.firstElementChild);
        })
        .catch(function () { /* the next change or re-sync tries again */ });
    }, 200);
  }

  // A button that asks first (cancel): the browser's own dialog, no inline script.
  document.addEventListener("submit", function (event) {
    var button = event.submitter;
    var question = button && button.getAttribute("data-confirm");
    if (question && !window.confirm(question)) event.preventDefault();
  });

  function apply(change) {
    if (buffered) { buffered.push(change); return; }
    var existing = document.getElementById("todo-" + change.todo_id);
    if (existing && versionOf(existing) >= change.version) return;
    if (change.state === "awaiting_approval" ||
        (existing && existing.getAttribute("data-state") === "awaiting_approval")) {
      refreshApprovals();
    }
    if (!change.html) { if (existing) existing.remove(); return; }
    var row = rowsFrom(change.html)[0];
    row.classList.add("flash");
    relativeTimes(row);
    if (existing) existing.replaceWith(keepSelection(existing, row)); else insertNewestFirst(row);
    var empty = document.getElementById("empty");
    if (empty) empty.remove();
  }

  var again = false; // a sync arrived while a fetch was in flight

  function resync() {
    glance.refetch();
    // A fetch already in flight may have read its snapshot before this (newer) subscription
    // existed, so it cannot stand in for this sync: run one more fetch after it.
    if (buffered) { again = true; return; }
    buffered = [];
    fetch(table.dataset.rowsUrl, { credentials: "same-origin", cache: "no-store" })
      .then(function (response) {
        if (!response.ok) throw new Error("rows " + response.status);
        return response.text();
      })
      .then(function (html) {
        var current = {};
        Array.prototype.forEach.call(tbody.children, function (row) { current[idOf(row)] = row; });
        var merged = rowsFrom(html).map(function (row) {
          var mine = current[idOf(row)];
          return mine && versionOf(mine) > versionOf(row) ? mine : keepSelection(mine, row);
        });
        tbody.replaceChildren.apply(tbody, merged);
        refreshApprovals();
        relativeTimes(tbody);
      })
      .catch(function () { /* the next reconnect re-syncs */ })
      .then(function () {
        var pending = buffered;
        buffered = null;
        pending.forEach(apply);
        table.dataset.synced = String((parseInt(table.dataset.synced || "0", 10)) + 1);
        if (again) { again = false; resync(); }
      });
  }

  var source = new EventSource(table.dataset.eventsUrl);
  source.addEventListener("open", function () { setStatus("live", true); });
  source.addEventListener("sync", resync);
  source.addEventListener("todo", function (event) { apply(JSON.parse(event.data)); });
  source.addEventListener("glance", function (event) { glance.merge(JSON.parse(event.data)); });
  source.addEventListener("error", function () {
    // EventSource reconnects by itself (sending Last-Event-ID); a refused stream (signed out)
    // closes for good.
    setStatus(source.readyState === EventSource.CLOSED ? "offline — reload the page" : "reconnecting…", false);
  });
})();
