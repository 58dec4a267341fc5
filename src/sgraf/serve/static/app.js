// sgraf serve: the search page. Plain script, no library, nothing fetched from elsewhere.
"use strict";

const $ = (id) => document.getElementById(id);
// explainTicket / searchTicket: the number of the latest explanation / search asked for; an
// answer to an older one (or an explanation asked before a newer search) is dropped, as the
// network may answer out of order. allowUnknown: how the results on the page were found, which
// their explanations follow.
const state = { query: "", explanation: null, picture: null, word: null, explainTicket: 0, searchTicket: 0,
                allowUnknown: false };

function setStatus(message, isError) {
  const status = $("status");
  status.textContent = message || "";
  status.className = isError ? "error" : "";
}

// A busy server (503 with Retry-After: its queue was full; 429: this address has as many requests
// waiting as one client may) is asked again after the seconds it names, up to BUSY_RETRIES times,
// while `current()` says the answer is still wanted (no newer search or explanation); a 503 without
// Retry-After (the data changed) needs a restart: not retried.
const BUSY_RETRIES = 3;
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

async function getJSON(url, current) {
  for (let attempt = 0; ; attempt += 1) {
    let response;
    try {
      response = await fetch(url);
    } catch (error) {     // the browser's "Failed to fetch" says nothing of why
      throw new Error("cannot reach the server (is sgraf serve still running?)");
    }
    let body = null;
    try { body = await response.json(); } catch (e) { body = null; }
    if (response.ok) return body;
    const message = body && body.error ? body.error : `HTTP ${response.status}`;
    const retry = response.headers.get("Retry-After");
    const seconds = Math.min(Math.max(Number(retry) || 1, 1), 30);
    const busy = response.status === 503 || response.status === 429;
    if (!busy || !retry || !current || attempt >= BUSY_RETRIES || !current()) {
      throw new Error(retry ? `${message} (retry in ${retry} s)` : message);
    }
    setStatus(`${message.replace(/; retry (shortly|once they are answered)$/, "")}: asking again in ${seconds} s\u2026`);
    await sleep(1000 * seconds);
    if (!current()) throw new Error("superseded");     // the caller drops it: a newer one was asked for
    setStatus(`asking again (${attempt + 2} of ${BUSY_RETRIES + 1})\u2026`);
  }
}

function el(tag, attributes, text) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attributes || {})) {
    if (value !== null && value !== undefined) node.setAttribute(key, value);
  }
  if (text !== undefined) node.textContent = text;
  return node;
}

function fmt(value, digits) {
  return value === null || value === undefined ? "-" : Number(value).toFixed(digits === undefined ? 4 : digits);
}

// ------------------------------------------------------------------------- health
async function loadHealth() {
  try {
    const health = await getJSON("/api/health");
    const models = health.models.map((m) => `${m.module} (${m.weights_sha256.slice(0, 8)})`).join(" + ");
    $("gallery-info").textContent =
      `${health.gallery.images} pictures, ${health.gallery.captions} captions; models ${models}; ` +
      `${health.device}, ${health.precision}, shortlist ${health.shortlist}` +
      (health.pictures ? "" : "; this gallery has no pictures") +
      (health.explain ? "" : "; explanations are off");
    $("image-id").max = String(health.gallery.images - 1);
  } catch (error) {
    $("gallery-info").textContent = `health check failed: ${error.message}`;
  }
}

// ------------------------------------------------------------------------- text -> images
function searchText(event) {
  event.preventDefault();
  runTextSearch($("query").value, $("top-k").value, $("allow-unknown").checked, true);
}

// the search in the address bar, so that a reload, Back or a shared link shows it again
function remember(params, push) {
  const url = `${location.pathname}?${params}`;
  if (push && url !== location.pathname + location.search) history.pushState(null, "", url);
}

async function runTextSearch(text, topK, allowUnknown, push) {
  const params = new URLSearchParams({ text, top_k: topK });
  if (allowUnknown) params.set("allow_unknown", "true");
  setStatus("searching\u2026");
  const ticket = ++state.searchTicket;
  try {
    const answer = await getJSON(`/api/search?${params}`, () => ticket === state.searchTicket);
    if (ticket !== state.searchTicket) return;      // a newer search was asked for
    state.query = answer.query;
    state.allowUnknown = allowUnknown;
    forgetExplanation();
    $("captions-panel").hidden = true;   // the captions of a picture of the earlier search
    showResults(answer);
    remember(params, push);
    setStatus(`${answer.results.length} pictures in ${fmt(answer.ms, 0)} ms`);
  } catch (error) {
    if (ticket !== state.searchTicket) return;
    // the earlier search's pictures under its title would read as this query's answer
    forgetExplanation();
    $("captions-panel").hidden = true;
    $("results").replaceChildren();
    $("results-panel").hidden = true;
    const unknown = / not in the model's vocabulary /.test(error.message) && !allowUnknown;
    setStatus(unknown ? `${error.message.split("; rephrase")[0]}: rephrase, or tick \u201cunknown words as ` +
                        `<unk>\u201d to search anyway` : error.message, true);
  }
}

function showResults(answer) {
  const list = $("results");
  list.replaceChildren();
  $("results-title").textContent = `Pictures for \u201c${answer.query}\u201d`;
  answer.results.forEach((hit, rank) => {
    const card = el("li", { class: "card", tabindex: "0", "data-id": String(hit.id), "data-rank": String(rank + 1),
                            "aria-label": `picture ${hit.id}, #${rank + 1}, score ${fmt(hit.score, 3)}: ` +
                                          "Enter explains why it matches" });
    if (hit.image) {
      card.appendChild(el("img", { src: hit.image, alt: hit.name || `picture ${hit.id}`, title: hit.name,
                                   loading: "lazy" }));
    } else {
      card.appendChild(el("div", { class: "no-picture" }, hit.name || `image ${hit.id}`));
    }
    const meta = el("div", { class: "meta" });
    meta.appendChild(el("span", { class: "rank" }, `#${rank + 1}`));
    meta.appendChild(el("span", { class: "id" }, `image ${hit.id}`));
    card.appendChild(meta);
    if (hit.name) card.appendChild(el("div", { class: "name", title: hit.name }, hit.name));
    card.appendChild(el("div", { class: "score", title: "SGRAF score" }, `score ${fmt(hit.score, 3)}`));
    const captions = el("button", { class: "captions-link", type: "button",
                                    "aria-label": `the best captions of picture ${hit.id}` }, "its best captions");
    captions.addEventListener("click", (event) => { event.stopPropagation(); searchImage(hit.id); });
    card.appendChild(captions);
    const open = () => {
      for (const other of list.children) other.classList.remove("selected");
      card.classList.add("selected");
      explain(hit.id, state.query);
    };
    card.addEventListener("click", open);
    card.addEventListener("keydown", (event) => {
      if (event.target !== card) return;        // Enter on its captions button is that button's
      if (event.key === "Enter" || event.key === " ") { event.preventDefault(); open(); }
    });
    list.appendChild(card);
  });
  $("results-panel").hidden = false;
}

// ------------------------------------------------------------------------- image -> captions
async function searchImage(imageId, push = true) {
  setStatus("searching\u2026");
  const params = new URLSearchParams({ image_id: String(imageId), top_k: $("top-k").value });
  const ticket = ++state.searchTicket;
  try {
    const answer = await getJSON(`/api/search?${params}`, () => ticket === state.searchTicket);
    if (ticket !== state.searchTicket) return;
    forgetExplanation();   // the explanation belonged to the earlier search
    const list = $("captions");
    list.replaceChildren();
    const named = answer.query.name ? ` (${answer.query.name})` : "";
    $("captions-title").textContent = `Best captions for picture ${answer.query.image_id}${named}`;
    const picture = $("captions-picture");
    if (answer.query.image) { picture.src = answer.query.image; picture.hidden = false; } else { picture.hidden = true; }
    picture.alt = `picture ${answer.query.image_id}`;
    for (const hit of answer.results) {
      // a gallery caption past the text limit cannot be explained: shown, not offered
      const item = hit.explainable
        ? el("li", { "data-id": String(hit.id), tabindex: "0" })
        : el("li", { "data-id": String(hit.id), class: "unexplainable",
                     title: "too long to explain (the text limit of an explanation)" });
      item.appendChild(el("span", { class: "caption" }, hit.caption));
      item.appendChild(el("span", { class: "score" }, fmt(hit.score, 3)));
      if (hit.explainable) {
        const open = () => explain(answer.query.image_id, hit.caption, true);
        item.addEventListener("click", open);
        item.addEventListener("keydown", (event) => {
          if (event.key === "Enter" || event.key === " ") { event.preventDefault(); open(); }
        });
      }
      list.appendChild(item);
    }
    $("captions-panel").hidden = false;
    if (!$("results").children.length) $("results-panel").hidden = true;
    remember(params, push);
    setStatus(`${answer.results.length} captions in ${fmt(answer.ms, 0)} ms`);
    $("captions-panel").scrollIntoView({ block: "nearest" });   // below ten pictures it had answered out of sight
  } catch (error) {
    if (ticket !== state.searchTicket) return;
    $("captions-panel").hidden = true;        // the earlier picture's captions under this error
    setStatus(error.message, true);
  }
}

function searchImageForm(event) {
  event.preventDefault();
  const value = $("image-id").value.trim();
  if (!/^\d+$/.test(value)) { setStatus("give a picture number (0, 1, 2, ...)", true); return; }
  searchImage(value);
}

// ------------------------------------------------------------------------- explanation
function forgetExplanation() {
  state.explainTicket += 1;
  state.explanation = null;
  state.picture = null;
  state.word = null;
  $("explain-panel").hidden = true;
  $("words").replaceChildren();
  for (const card of $("results").children) card.classList.remove("selected");
}

async function explain(imageId, text, allowUnknown) {
  const params = new URLSearchParams({ image_id: String(imageId), text });
  // a result's explanation reads its query as the search did (the box may have changed since)
  if (allowUnknown || state.allowUnknown) params.set("allow_unknown", "true");
  setStatus("explaining\u2026");
  const ticket = ++state.explainTicket;
  try {
    const answer = await getJSON(`/api/explain?${params}`, () => ticket === state.explainTicket);
    if (ticket !== state.explainTicket) return;   // a newer search or explanation was asked for
    state.explanation = answer;
    $("explain-title").textContent = `Why picture ${answer.image_id} matches \u201c${answer.text}\u201d`;
    $("explain-scores").textContent = "scores: " +
      Object.entries(answer.scores).map(([name, value]) => `${name} ${fmt(value)}`).join(", ");
    $("explain-png").href = `/api/explain.png?${params}`;
    showWords(answer);
    state.picture = null;
    if (answer.image) {
      const picture = new Image();
      picture.onload = () => { if (ticket === state.explainTicket) { state.picture = picture; drawAttention(); } };
      picture.onerror = () => drawAttention();
      picture.src = answer.image;
    }
    $("explain-panel").hidden = false;
    drawAttention();
    setStatus(`explained in ${fmt(answer.ms, 0)} ms`);
    $("explain-panel").scrollIntoView({ block: "nearest" });
  } catch (error) {
    if (ticket !== state.explainTicket) return;
    forgetExplanation();            // the earlier picture's explanation under this error
    setStatus(error.message, true);
  }
}

function showWords(answer) {
  const list = $("words");
  list.replaceChildren();
  const betas = answer.nodes.map((n) => n.saf_beta || 0);
  const maxBeta = Math.max(1e-12, ...betas);
  const offset = answer.nodes.length && answer.nodes[0].label === "[global]" ? 1 : 0;
  const tokens = answer.attention ? answer.attention.tokens : [];
  const unknown = new Set(answer.unknown || []);
  state.word = null;
  let bestBeta = -1;
  answer.nodes.forEach((node, p) => {
    const row = el("li");
    const word = p - offset;
    const hasMap = answer.attention && word >= 0 && word < tokens.length;
    const isUnknown = unknown.has(word);
    const label = isUnknown ? `${node.label} \u2192 <unk>` : node.label;
    const button = el("button", { type: "button", "data-word": hasMap ? String(word) : null,
                                  title: isUnknown ? "not in the model's vocabulary: the model read <unk>" : null },
                      label);
    button.disabled = !hasMap;
    if (isUnknown) button.classList.add("unknown");
    if (hasMap) {
      button.addEventListener("click", () => { state.word = word; drawAttention(); });
      // start with the known word SAF weighs most (or the first word without SAF)
      const beta = node.saf_beta === null ? 0 : node.saf_beta;
      if (!/^<.*>$/.test(node.label) && !isUnknown && (state.word === null || beta > bestBeta)) {
        state.word = word;
        bestBeta = beta;
      }
    }
    row.appendChild(button);
    const bar = el("div", { class: "bar", title: `SAF beta ${fmt(node.saf_beta)}` });
    bar.style.width = node.saf_beta === null ? "0" : `${(100 * node.saf_beta / maxBeta).toFixed(1)}%`;
    row.appendChild(bar);
    row.appendChild(el("span", { class: "sgr", title: "SGR: cosine of the reasoned read-out with this alignment" },
      fmt(node.sgr_alignment, 2)));
    list.appendChild(row);
  });
  if (state.word === null && tokens.length) state.word = 0;
}

function drawAttention() {
  const answer = state.explanation;
  const canvas = $("attention");
  const context = canvas.getContext("2d");
  const width = canvas.width, height = canvas.height;
  context.clearRect(0, 0, width, height);
  for (const button of $("words").querySelectorAll("button")) {
    button.classList.toggle("active", button.dataset.word === String(state.word));
  }
  if (!answer) return;
  const regions = answer.regions;
  const weights = answer.attention && state.word !== null ? answer.attention.weights[state.word] : null;
  // the picture keeps its shape: fitted inside the canvas, centred (a 400 x 300 photo had been squashed)
  const natural = state.picture ? [state.picture.naturalWidth, state.picture.naturalHeight]
    : [regions.width || width, regions.height || height];
  const fit = Math.min(width / natural[0], height / natural[1]);
  const frameW = natural[0] * fit, frameH = natural[1] * fit;
  const left = (width - frameW) / 2, topEdge = (height - frameH) / 2;
  canvas.dataset.frame = [left, topEdge, frameW, frameH].map((v) => v.toFixed(1)).join(",");
  if (state.picture) context.drawImage(state.picture, left, topEdge, frameW, frameH);
  canvas.dataset.picture = state.picture ? "drawn" : "none";
  if (!weights) {
    $("attention-caption").textContent = "no word attention for these models";
    canvas.dataset.drawn = "picture";
    return;
  }
  const top = Math.max(1e-12, ...weights);
  const best = weights.indexOf(Math.max(...weights));
  if (regions.kind === "grid") {
    const cellW = frameW / regions.cols, cellH = frameH / regions.rows;
    weights.forEach((weight, k) => {
      const x = left + (k % regions.cols) * cellW, y = topEdge + Math.floor(k / regions.cols) * cellH;
      const share = weight / top;
      if (state.picture) {
        context.fillStyle = `rgba(0, 0, 0, ${(0.75 * (1 - share)).toFixed(3)})`;   // darken what it ignores
      } else {
        context.fillStyle = `rgba(255, 190, 40, ${share.toFixed(3)})`;
      }
      context.fillRect(x, y, cellW, cellH);
    });
    context.strokeStyle = "yellow";
    context.lineWidth = 2;
    context.strokeRect(left + (best % regions.cols) * cellW + 1, topEdge + Math.floor(best / regions.cols) * cellH + 1,
      cellW - 2, cellH - 2);
  } else {
    const sx = frameW / (regions.width || natural[0]), sy = frameH / (regions.height || natural[1]);
    weights.forEach((weight, k) => {
      const [x0, y0, x1, y1] = regions.boxes[k];
      context.fillStyle = `rgba(255, 190, 40, ${(0.6 * weight / top).toFixed(3)})`;
      context.fillRect(left + x0 * sx, topEdge + y0 * sy, (x1 - x0) * sx, (y1 - y0) * sy);
    });
    const [x0, y0, x1, y1] = regions.boxes[best];
    context.strokeStyle = "yellow";
    context.lineWidth = 2;
    context.strokeRect(left + x0 * sx, topEdge + y0 * sy, (x1 - x0) * sx, (y1 - y0) * sy);
  }
  const token = answer.attention.tokens[state.word];
  const read = (answer.unknown || []).includes(state.word) ? " (read as <unk>)" : "";
  $("attention-caption").textContent =
    `\u201c${token}\u201d${read}: attention over the ${weights.length} regions (${answer.attention.model} model); ` +
    `brighter = more weight, yellow frame = the most`;
  canvas.setAttribute("aria-label", $("attention-caption").textContent);
  canvas.dataset.drawn = token;
}

// the search the address names (a reload, Back, a shared link): run again, without a new entry
function fromAddress() {
  const params = new URLSearchParams(location.search);
  if (params.has("top_k") && [...$("top-k").options].some((o) => o.value === params.get("top_k"))) {
    $("top-k").value = params.get("top_k");
  }
  if (params.get("text")) {
    $("query").value = params.get("text");
    $("allow-unknown").checked = params.get("allow_unknown") === "true";
    runTextSearch(params.get("text"), $("top-k").value, $("allow-unknown").checked, false);
  } else if (/^\d+$/.test(params.get("image_id") || "")) {
    $("image-id").value = params.get("image_id");
    searchImage(params.get("image_id"), false);
  } else {                                   // back to the page before any search
    state.searchTicket += 1;
    forgetExplanation();
    $("results").replaceChildren();
    for (const panel of ["results-panel", "captions-panel"]) $(panel).hidden = true;
    setStatus("");
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("text-form").addEventListener("submit", searchText);
  $("image-form").addEventListener("submit", searchImageForm);
  window.addEventListener("popstate", fromAddress);
  loadHealth();
  fromAddress();
});
