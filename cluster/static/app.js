// ditserve playground: plain browser JavaScript over the public HTTP API (no build step, no network
// beyond this server). Every request carries the API key typed in the header, when there is one.
"use strict";

const $ = (sel, root = document) => root.querySelector(sel);
const $$ = (sel, root = document) => Array.from(root.querySelectorAll(sel));
const byId = (id) => $(`[data-testid="${id}"]`);
const HISTORY_KEY = "ditserve.history";
const HISTORY_MAX = 24;

const keyInput = $("#api-key");
keyInput.value = sessionStorage.getItem("ditserve.key") || "";

function headers(json = true) {
  const h = json ? { "content-type": "application/json" } : {};
  if (keyInput.value) h.authorization = `Bearer ${keyInput.value}`;
  return h;
}

class ApiError extends Error {
  constructor(message, param) {
    super(message);
    this.param = param || "";
  }
}

async function apiError(res) {
  let body = null;
  try {
    body = await res.json();
  } catch (_) {
    /* not JSON */
  }
  const err = body && body.error;
  if (err && err.message) return new ApiError(err.message, err.param);
  if (body && Array.isArray(body.detail) && body.detail[0]) {  // FastAPI's own validation shape
    const d = body.detail[0];
    return new ApiError(d.msg, (d.loc || []).filter((p) => p !== "body").join("."));
  }
  return new ApiError(`HTTP ${res.status} ${res.statusText}`);
}

async function api(method, path, body) {
  const res = await fetch(path, {
    method,
    headers: headers(body !== undefined),
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (!res.ok) throw await apiError(res);
  return res;
}

// -- errors next to the field they name --------------------------------------------------------------
function clearErrors(form) {
  for (const el of $$(".err", form)) {
    el.textContent = "";
    el.removeAttribute("data-testid");
  }
}

function showError(form, err) {
  const param = (err.param || "").split(".")[0];
  const slot = $(`.err[data-param="${param}"]`, form) || $('.err[data-param=""]', form);
  slot.textContent = err.message || String(err);
  slot.setAttribute("data-testid", "error");
  const field = form.elements[param];
  if (field && field.focus) field.focus();
}

// Runs `work` with the form's submit button disabled; whatever happens, nothing stays busy.
async function busy(form, work) {
  clearErrors(form);
  const buttons = $$("button", form);
  buttons.forEach((b) => (b.disabled = true));
  try {
    await work();
  } catch (err) {
    showError(form, err);
  } finally {
    buttons.forEach((b) => (b.disabled = false));
  }
}

// The adapters ticked on the Images tab, as a request's "lora" list (the Sessions tab uses them too).
function chosenLoras() {
  return $$("#gen-loras input[type=checkbox]:checked").map((c) => ({
    name: c.dataset.name,
    scale: Number(byId(`lora-scale-${c.dataset.name}`).value),
  }));
}

function numberField(form, name, body) {
  const v = form.elements[name].value.trim();
  if (v !== "") body[name] = Number(v);
}

function textField(form, name, body) {
  const v = form.elements[name].value.trim();
  if (v !== "") body[name] = v;
}

// -- tabs ---------------------------------------------------------------------------------------------
for (const b of $$("nav button")) {
  b.addEventListener("click", () => {
    $$("nav button").forEach((x) => x.classList.toggle("active", x === b));
    $$(".tab").forEach((t) => t.classList.toggle("active", t.id === b.dataset.tab));
    if (b.dataset.tab === "cluster") refreshCluster();
  });
}

keyInput.addEventListener("change", () => {
  sessionStorage.setItem("ditserve.key", keyInput.value);
  refreshLoras();
});

// -- models and adapters -------------------------------------------------------------------------------
async function loadModels() {
  const select = $('#gen-form [name="model"]');
  try {
    const models = (await (await api("GET", "/v1/models")).json()).data;
    select.innerHTML = "";
    for (const m of models) {
      const opt = new Option(`${m.id} (${m.kind})`, m.id);
      opt.dataset.kind = m.kind;
      select.add(opt);
    }
  } catch (err) {
    showError($("#gen-form"), err);
  }
}

let loras = [];
async function refreshLoras() {
  const box = $("#gen-loras");
  try {
    loras = (await (await api("GET", "/v1/loras")).json()).data;
  } catch (err) {
    loras = [];
    box.innerHTML = "";
    box.append(Object.assign(document.createElement("em"), { textContent: `adapters need the admin key: ${err.message}` }));
    renderLoraList();
    return;
  }
  box.innerHTML = "";
  if (!loras.length) box.append(Object.assign(document.createElement("em"), { textContent: "none loaded" }));
  for (const l of loras) {
    const row = document.createElement("label");
    row.className = "row";
    row.innerHTML = '<input type="checkbox"> <span></span> scale <input type="number" step="0.1">';
    const [check, scale] = $$("input", row);
    check.dataset.name = l.name;
    check.setAttribute("data-testid", `lora-use-${l.name}`);
    $("span", row).textContent = l.name;
    scale.value = l.scale;
    scale.setAttribute("data-testid", `lora-scale-${l.name}`);
    box.append(row);
  }
  renderLoraList();
}

// -- generate (server-sent events) ---------------------------------------------------------------------
async function* sseEvents(res) {
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      let event = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).trim());
      }
      const text = data.join("\n");
      if (text === "[DONE]") return;
      yield { event, data: JSON.parse(text) };
    }
  }
}

// The step cache fields: only the chosen policy's setting shows.
const cachePolicy = byId("cache-policy");
function showCacheOptions() {
  for (const el of $$(".cache-opt")) el.hidden = el.dataset.policy !== cachePolicy.value;
}
cachePolicy.addEventListener("change", showCacheOptions);
showCacheOptions();

function cacheSetting(form) {
  const policy = cachePolicy.value;
  if (!policy) return undefined;  // the server's default (--cache-policy)
  const cache = { policy };
  const threshold = form.elements.cache_threshold.value.trim();
  const interval = form.elements.cache_interval.value.trim();
  if (policy === "fbcache" && threshold !== "") cache.threshold = Number(threshold);
  if (policy === "taylorseer" && interval !== "") cache.interval = Number(interval);
  return cache;
}

$("#image-clear").addEventListener("click", () => {
  byId("image").value = "";
});

function showUsage(usage) {
  byId("transformer-forwards").textContent = usage ? usage.transformer_forwards : "";
  byId("cached-forwards").textContent = usage ? usage.cached_forwards : "";
  byId("cache-used").textContent = usage ? usage.cache_policy || "none" : "";
}

// An uploaded image: POST /v1/images/edits (multipart, as OpenAI's client sends it; the answer is whole).
async function generateFromImage(form, body, files) {
  const data = new FormData();
  for (const [k, v] of Object.entries(body)) {
    if (k === "stream" || k === "preview") continue;
    data.append(k, typeof v === "object" ? JSON.stringify(v) : String(v));
  }
  numberField(form, "strength", body);
  if (body.strength !== undefined) data.append("strength", String(body.strength));
  const name = files.length > 1 ? "image[]" : "image";
  for (const f of files) data.append(name, f, f.name);
  const res = await fetch("/v1/images/edits", { method: "POST", headers: headers(false), body: data });
  if (!res.ok) throw await apiError(res);
  byId("replica").textContent = res.headers.get("x-ditserve-replica") || "";
  return res.json();
}

$("#gen-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const form = e.target;
  const progress = byId("progress");
  const status = byId("status");
  const steps = byId("previews");
  const partials = byId("partials");
  const live = byId("preview-image");
  const img = byId("result");
  busy(form, async () => {
    const files = Array.from(byId("image").files);
    const body = { prompt: form.elements.prompt.value, stream: true };
    if (form.elements.preview.checked) body.preview = true;
    textField(form, "negative_prompt", body);
    textField(form, "model", body);
    textField(form, "size", body);
    numberField(form, "num_inference_steps", body);
    numberField(form, "guidance_scale", body);
    numberField(form, "seed", body);
    const chosen = chosenLoras();
    if (chosen.length) body.lora = chosen;
    const cache = cacheSetting(form);
    if (cache) body.cache = cache;
    progress.value = 0;
    progress.removeAttribute("data-done");
    steps.innerHTML = "";
    partials.innerHTML = "";
    live.hidden = true;
    live.removeAttribute("src");
    showUsage(null);
    status.textContent = "queued";
    byId("replica").textContent = "";
    const finish = (b64, seed, size, usage) => {
      live.hidden = true;
      img.src = `data:image/png;base64,${b64}`;
      img.hidden = false;
      byId("result-seed").textContent = seed;
      showUsage(usage);
      progress.value = progress.max;
      progress.dataset.done = "1";
      status.textContent = `done (${size})`;
      remember({ prompt: body.prompt, seed, src: img.src, replica: byId("replica").textContent });
    };
    try {
      if (files.length) {
        status.textContent = `editing ${files.length} image${files.length > 1 ? "s" : ""}`;
        const answer = await generateFromImage(form, body, files);
        finish(answer.data[0].b64_json, answer.seed, answer.size, answer.usage);
        return;
      }
      const res = await api("POST", "/v1/images/generations", body);
      byId("replica").textContent = res.headers.get("x-ditserve-replica") || "";
      for await (const { event, data } of sseEvents(res)) {
        if (event === "error") throw new ApiError(data.error.message, data.error.param);
        if (event === "image_generation.progress") {
          progress.max = data.total;
          progress.value = data.step;
          status.textContent = `step ${data.step} / ${data.total}`;
          const tick = document.createElement("span");
          tick.className = "tick";
          tick.dataset.step = data.step;
          tick.textContent = "▮";
          steps.append(tick);
        } else if (event === "image_generation.partial_image") {
          const src = `data:image/png;base64,${data.partial_image_b64}`;
          const thumb = Object.assign(document.createElement("img"), { src, alt: `step ${data.step}` });
          thumb.dataset.step = data.step;
          thumb.dataset.index = data.partial_image_index;
          thumb.title = `step ${data.step} / ${data.total} (latents)`;
          partials.append(thumb);
          live.src = src;
          live.dataset.step = data.step;
          live.hidden = false;
        } else if (event === "image_generation.completed") {
          finish(data.b64_json, data.seed, data.size, data.usage);
        }
      }
    } catch (err) {
      status.textContent = "failed";
      live.hidden = true;
      throw err;
    }
  });
});

// -- history (this browser's local storage) --------------------------------------------------------------
function history() {
  try {
    return JSON.parse(localStorage.getItem(HISTORY_KEY)) || [];
  } catch (_) {
    return [];
  }
}

function remember(item) {
  const items = [item, ...history()].slice(0, HISTORY_MAX);
  while (items.length) {
    try {
      localStorage.setItem(HISTORY_KEY, JSON.stringify(items));
      break;
    } catch (_) {
      items.pop();  // full: drop the oldest
    }
  }
  renderHistory();
}

function renderHistory() {
  const box = $("#history");
  box.innerHTML = "";
  for (const [i, h] of history().entries()) {
    const a = document.createElement("a");
    a.href = h.src;
    a.download = `ditserve-${h.seed}.png`;
    a.title = `${h.prompt} (seed ${h.seed}, replica ${h.replica})`;
    a.setAttribute("data-testid", `history-${i}`);
    a.append(Object.assign(document.createElement("img"), { src: h.src, alt: h.prompt }));
    box.append(a);
  }
}

$("#history-clear").addEventListener("click", () => {
  localStorage.removeItem(HISTORY_KEY);
  renderHistory();
});

// -- videos --------------------------------------------------------------------------------------------
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

$("#video-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const form = e.target;
  const progress = byId("video-progress");
  const status = byId("video-status");
  const player = byId("video");
  busy(form, async () => {
    const body = { prompt: form.elements.prompt.value };
    textField(form, "size", body);
    numberField(form, "num_frames", body);
    numberField(form, "num_inference_steps", body);
    numberField(form, "seed", body);
    progress.value = 0;
    player.hidden = true;
    status.textContent = "creating";
    try {
      let job = await (await api("POST", "/v1/videos", body)).json();
      while (job.status !== "completed" && job.status !== "failed") {
        progress.value = job.progress || 0;
        status.textContent = `${job.status} ${job.progress || 0}%`;
        await sleep(400);
        job = await (await api("GET", `/v1/videos/${encodeURIComponent(job.id)}`)).json();
      }
      if (job.status === "failed") throw new ApiError((job.error && job.error.message) || "the video job failed");
      const res = await api("GET", `/v1/videos/${encodeURIComponent(job.id)}/content`);
      player.src = URL.createObjectURL(await res.blob());
      player.hidden = false;
      progress.value = 100;
      status.textContent = `completed (${job.id})`;
      await player.play().catch(() => {});
    } catch (err) {
      status.textContent = "failed";
      throw err;
    }
  });
});

// -- sessions ------------------------------------------------------------------------------------------
let session = null;

$("#session-new").addEventListener("click", () => {
  session = null;
  byId("session-id").textContent = "";
  byId("session-step-no").textContent = "";
  byId("session-result").hidden = true;
});

$("#session-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const form = e.target;
  busy(form, async () => {
    if (!session) {
      const open = {};
      textField(form, "size", open);
      session = await (await api("POST", "/v1/sessions", open)).json();
      byId("session-id").textContent = session.id;
    }
    const body = { prompt: form.elements.prompt.value };
    textField(form, "negative_prompt", body);
    numberField(form, "strength", body);
    numberField(form, "num_inference_steps", body);
    numberField(form, "guidance_scale", body);
    numberField(form, "seed", body);
    const chosen = chosenLoras();
    if (chosen.length) body.lora = chosen;
    let answer;
    try {
      answer = await (await api("POST", `/v1/sessions/${encodeURIComponent(session.id)}/generate`, body)).json();
    } catch (err) {
      if (/expired|gone|does not exist/i.test(err.message)) session = null;  // the next step opens a new one
      throw err;
    }
    const img = byId("session-result");
    img.src = `data:image/png;base64,${answer.data[0].b64_json}`;
    img.hidden = false;
    byId("session-step-no").textContent = answer.step;
  });
});

// -- realtime video (WebSocket, msgpack maps in binary frames) ------------------------------------------
// The browser's WebSocket cannot send an Authorization header: a server that requires the key for
// generation (--api-key-for-generation) refuses the socket, and the page shows why.
const rt = { ws: null, header: null, frames: [], timer: null, eventId: 0, chunks: 0, shown: 0 };

function rtSetState(state) {
  byId("rt-state").textContent = state;
  const open = rt.ws !== null;
  byId("rt-start").disabled = open;
  byId("rt-stop").disabled = !open;
  byId("rt-send").disabled = !open;
}

function rtError(message) {
  const slot = $('#rt-form .err[data-param=""]');
  slot.textContent = message;
  slot.setAttribute("data-testid", "error");
}

function rtSend(map) {
  rt.ws.send(msgpack.encode(map));
}

// Frames are drawn at the session's fps, in order, as their batches arrive.
function rtDraw() {
  const next = rt.frames.shift();
  if (!next) return;
  const canvas = byId("rt-canvas");
  if (canvas.width !== next.width || canvas.height !== next.height) {
    canvas.width = next.width;
    canvas.height = next.height;
  }
  canvas.getContext("2d").drawImage(next, 0, 0);
  next.close();
  rt.shown += 1;
  byId("rt-frames-done").textContent = rt.shown;
  canvas.dataset.frames = rt.shown;
}

async function rtFrameBatch(header, payload) {
  byId("rt-replica").textContent = header.replica;
  const lengths = header.payload_lengths || [];
  let at = 0;
  for (const n of lengths) {
    const blob = new Blob([payload.subarray(at, at + n)], { type: header.content_type });
    at += n;
    rt.frames.push(await createImageBitmap(blob));
  }
}

function rtMessage(data) {
  const bytes = new Uint8Array(data);
  if (rt.header) {  // the payload of a "frame_batch_header": raw bytes, not msgpack
    const header = rt.header;
    rt.header = null;
    return rtFrameBatch(header, bytes);
  }
  const m = msgpack.decode(bytes);
  if (m.type === "frame_batch") return rtFrameBatch(m, m.payload);
  if (m.type === "frame_batch_header") rt.header = m;
  else if (m.type === "chunk_stats") {
    rt.chunks += 1;
    byId("rt-chunks-done").textContent = rt.chunks;
    byId("rt-replica").textContent = m.replica;
    const echo = m.event_id === null || m.event_id === undefined ? "" : ` · event ${m.event_id}`;
    byId("rt-stats").textContent =
      `#${m.chunk_index}: ${m.num_frames} frames in ${m.chunk_total_ms} ms ` +
      `(forward ${m.scheduler_forward_ms} ms, encode ${m.frame_encode_ms} ms, ${m.ws_payload_bytes} bytes)${echo}`;
    // batches still decoding when the socket closed must not turn "closed" back into "streaming"
    if (rt.ws) rtSetState("streaming");
  } else if (m.type === "error") rtError(m.content);
}

$("#rt-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const form = e.target;
  clearErrors(form);
  const init = { type: "init", prompt: form.elements.prompt.value, realtime_output_format: "jpeg" };
  const model = $('#gen-form [name="model"]').value;
  if (model) init.model = model;
  textField(form, "size", init);
  for (const name of ["num_frames", "num_inference_steps", "seed", "fps", "max_chunks"]) numberField(form, name, init);
  clearInterval(rt.timer);
  rt.frames.forEach((f) => f.close());
  Object.assign(rt, { header: null, frames: [], eventId: 0, chunks: 0, shown: 0 });
  byId("rt-chunks-done").textContent = "0";
  byId("rt-frames-done").textContent = "0";
  byId("rt-stats").textContent = "";
  byId("rt-replica").textContent = "";
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  const ws = new WebSocket(`${scheme}://${location.host}/v1/realtime_video/generate`);
  ws.binaryType = "arraybuffer";
  rt.ws = ws;
  rtSetState("connecting");
  let chain = Promise.resolve();  // frame batches decode in order
  let timer = null;  // this session's drawing clock
  ws.onopen = () => {
    rtSend(init);
    rtSetState("waiting for the first chunk");
    timer = setInterval(rtDraw, 1000 / (init.fps || 16));
    rt.timer = timer;
  };
  ws.onmessage = (ev) => {
    chain = chain.then(() => rtMessage(ev.data)).catch((err) => rtError(String(err)));
  };
  ws.onclose = (ev) => {
    rt.ws = null;
    chain.then(() => {
      const drain = setInterval(() => {  // show what arrived, then stop the clock
        if (!rt.frames.length || rt.ws !== null) {  // drawn, or a new session took over
          clearInterval(drain);
          clearInterval(timer);
        }
      }, 50);
    });
    rtSetState(`closed (${ev.code}${ev.reason ? `: ${ev.reason}` : ""})`);
  };
});

$("#rt-stop").addEventListener("click", () => {
  if (rt.ws) rt.ws.close(1000, "stopped by the user");
});

$("#rt-send").addEventListener("click", () => {
  const text = $('#rt-form [name="event_prompt"]').value.trim();
  if (!rt.ws || !text) return;
  rt.eventId += 1;
  rtSend({ type: "event", kind: "prompt", payload: text, event_id: rt.eventId });
  byId("rt-state").textContent = `prompt event ${rt.eventId} sent`;
});

// -- cluster (admin) ------------------------------------------------------------------------------------
const cell = (v) => (v === undefined || v === null ? "" : typeof v === "object" ? JSON.stringify(v) : String(v));

async function refreshCluster() {
  const body = $('[data-testid="replicas"] tbody');
  const note = $("#replicas-note");
  try {
    const answer = await (await api("GET", "/v1/replicas")).json();
    body.innerHTML = "";
    for (const r of answer.data) {
      const tr = document.createElement("tr");
      const gpus = r.gpus ?? r.device;
      for (const v of [r.replica_id, r.health, r.node ?? r.host, gpus, r.layout, r.control_version]) {
        tr.append(Object.assign(document.createElement("td"), { textContent: cell(v) }));
      }
      body.append(tr);
    }
    note.textContent = `${answer.data.length} of ${answer.expected} replicas answered; desired control version ${answer.desired_version}`;
  } catch (err) {
    note.textContent = err.message;
  }
  refreshLoras();
}

function renderLoraList() {
  const list = $("#lora-list");
  list.innerHTML = "";
  for (const l of loras) {
    const li = document.createElement("li");
    li.textContent = `${l.name} (scale ${l.scale}) `;
    const b = Object.assign(document.createElement("button"), { type: "button", textContent: "unload" });
    b.setAttribute("data-testid", `lora-unload-${l.name}`);
    b.addEventListener("click", () =>
      busy($("#lora-form"), async () => {
        await api("DELETE", `/v1/loras/${encodeURIComponent(l.name)}`);
        await refreshLoras();
      })
    );
    li.append(b);
    list.append(li);
  }
}

$("#replicas-refresh").addEventListener("click", refreshCluster);

$("#lora-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const form = e.target;
  busy(form, async () => {
    const body = { name: form.elements.name.value.trim(), path: form.elements.path.value.trim() };
    numberField(form, "scale", body);
    await api("POST", "/v1/loras", body);
    await refreshCluster();
  });
});

for (const b of $$("#memory-form button")) {
  b.addEventListener("click", () =>
    busy($("#memory-form"), async () => {
      const answer = await (await api("POST", `/v1/admin/memory/${b.dataset.action}`)).json();
      byId("memory-status").textContent = `${b.dataset.action}: ${answer.ok === false ? "failed" : "ok"}`;
    })
  );
}

loadModels();
refreshLoras();
renderHistory();
