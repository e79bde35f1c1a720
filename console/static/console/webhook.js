// A webhook page's live delivery log: one EventSource on /todos/webhooks/<slug>/events.
//
// As on the Todos board, correctness does not rest on the stream: the server subscribes first
// and then sends `sync`, and every `sync` or `delivery` event re-fetches the table body (one
// fetch in flight at a time; events during a fetch ask for one more afterwards).
(function () {
  "use strict";
  var table = document.getElementById("deliveries");
  if (!table || !window.EventSource) return;
  var tbody = document.getElementById("delivery-rows");
  var live = document.getElementById("live");
  var csrfMeta = document.querySelector('meta[name="csrf-token"]');
  var csrf = csrfMeta ? csrfMeta.content : "";
  var inFlight = false, again = false;

  function setStatus(text, on) {
    if (!live) return;
    live.textContent = text;
    live.classList.toggle("on", !!on);
  }

  function refresh() {
    if (inFlight) { again = true; return; }
    inFlight = true;
    fetch(table.dataset.rowsUrl, { credentials: "same-origin", cache: "no-store" })
      .then(function (response) {
        if (!response.ok) throw new Error("rows " + response.status);
        return response.text();
      })
      .then(function (html) {
        var known = {};
        Array.prototype.forEach.call(tbody.children, function (row) { known[row.id] = true; });
        tbody.innerHTML = html;
        tbody.querySelectorAll('input[name="csrfmiddlewaretoken"]').forEach(function (input) {
          if (!input.value) input.value = csrf;
        });
        Array.prototype.forEach.call(tbody.children, function (row) {
          if (!known[row.id]) row.classList.add("flash");
        });
      })
      .catch(function () { /* the next event or reconnect refreshes */ })
      .then(function () {
        inFlight = false;
        table.dataset.synced = String((parseInt(table.dataset.synced || "0", 10)) + 1);
        if (again) { again = false; refresh(); }
      });
  }

  var source = new EventSource(table.dataset.eventsUrl);
  source.addEventListener("open", function () { setStatus("live", true); });
  source.addEventListener("sync", refresh);
  source.addEventListener("delivery", refresh);
  source.addEventListener("error", function () {
    setStatus(source.readyState === EventSource.CLOSED ? "offline — reload the page" : "reconnecting…", false);
  });
})();
