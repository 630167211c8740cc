// Sluicegate chat page: submits to ingress's native API, then reads the reply's token stream from the
// result service over WebSocket, resuming with last_id after a dropped connection.
"use strict";

const STORAGE_KEY = "sluicegate.chat.settings";
// Close codes after which reconnecting cannot help (see result_service/websocket.py).
const FINAL_CLOSE_CODES = new Set([1000, 1008, 4404]);
const MAX_BACKOFF_MS = 8000;

const $ = (selector) => document.querySelector(selector);
const log = $("#log");
const statusLine = $("#status");
const settingsForm = $("#settings");
const composer = $("#composer");
const sendButton = $("#send");
const stopButton = $("#stop");

let settings = {};
let conversation = []; // [{role, content}] sent with every turn
let current = null; // the ReplyStream being received

// --- settings -----------------------------------------------------------------------------------

async function loadSettings() {
  let defaults = {};
  try {
    const response = await fetch("/config.json");
    if (response.ok) defaults = await response.json();
  } catch (err) {
    console.warn("no /config.json", err);
  }
  let saved = {};
  try {
    saved = JSON.parse(localStorage.getItem(STORAGE_KEY) || "{}");
  } catch {
    saved = {};
  }
  settings = {
    ingressUrl: defaults.ingress_url || `${location.protocol}//${location.hostname}:8000`,
    apiKey: "",
    model: (defaults.models || [])[0] || "",
    maxTokens: 256,
    temperature: 0.7,
    system: "",
    ...saved,
  };
  showModels(defaults.models || []);
  for (const [name, value] of Object.entries(settings)) {
    if (settingsForm.elements[name]) settingsForm.elements[name].value = value;
  }
  if (!settings.apiKey || !settings.model) openSettings(true);
  if (settings.apiKey) refreshModels();
}

function saveSettings() {
  const form = settingsForm.elements;
  settings = {
    ingressUrl: form.ingressUrl.value.trim().replace(/\/+$/, ""),
    apiKey: form.apiKey.value.trim(),
    model: form.model.value.trim(),
    maxTokens: Number(form.maxTokens.value) || 256,
    temperature: Number(form.temperature.value),
    system: form.system.value,
  };
  localStorage.setItem(STORAGE_KEY, JSON.stringify(settings));
  setStatus("settings saved");
}

function showModels(models) {
  const list = $("#models");
  list.replaceChildren(...models.map((id) => Object.assign(document.createElement("option"), { value: id })));
}

async function refreshModels() {
  try {
    const response = await fetch(`${settings.ingressUrl}/v1/models`, { headers: authHeaders() });
    if (!response.ok) throw new Error(await errorText(response));
    const models = ((await response.json()).data || []).map((m) => m.id);
    showModels(models);
    if (!settings.model && models.length) {
      settingsForm.elements.model.value = models[0];
      saveSettings();
    }
  } catch (err) {
    setStatus(`could not list models: ${err.message}`);
  }
}

function openSettings(open) {
  settingsForm.classList.toggle("open", open);
  $("#toggle-settings").setAttribute("aria-expanded", String(open));
}

function authHeaders() {
  return settings.apiKey ? { Authorization: `Bearer ${settings.apiKey}` } : {};
}

// --- rendering ----------------------------------------------------------------------------------

function setStatus(text) {
  statusLine.textContent = text;
}

function addMessage(role, text) {
  const element = document.createElement("div");
  element.className = `message ${role}`;
  const label = Object.assign(document.createElement("span"), { className: "role", textContent: role });
  const body = Object.assign(document.createElement("span"), { className: "text", textContent: text });
  const note = Object.assign(document.createElement("span"), { className: "note" });
  element.append(label, body, note);
  log.append(element);
  log.scrollTop = log.scrollHeight;
  return { element, body, note };
}

async function errorText(response) {
  const raw = await response.text();
  try {
    const body = JSON.parse(raw);
    const detail = body.error?.message ?? body.detail ?? raw;
    return `${response.status}: ${typeof detail === "string" ? detail : JSON.stringify(detail)}`;
  } catch {
    return `${response.status}: ${raw || response.statusText}`;
  }
}

// --- one reply's stream -------------------------------------------------------------------------

class ReplyStream {
  constructor(streamUrl, token, view) {
    const url = new URL(streamUrl, location.href);
    if (url.protocol === "http:") url.protocol = "ws:";
    if (url.protocol === "https:") url.protocol = "wss:";
    url.searchParams.set("token", token);
    this.url = url;
    this.view = view;
    this.pieces = new Map(); // seq -> text, in seq order
    this.lastSeq = -1;
    this.lastId = null;
    this.attempt = 0;
    this.cancelRequested = false;
    this.socket = null;
    this.finished = new Promise((resolve) => (this.resolve = resolve));
    this.outcome = null;
    view.element.classList.add("streaming");
    this.connect();
  }

  connect() {
    const url = new URL(this.url);
    if (this.lastId) url.searchParams.set("last_id", this.lastId);
    const socket = new WebSocket(url);
    this.socket = socket;
    socket.onopen = () => {
      setStatus(this.attempt ? "reconnected" : "streaming");
      if (this.cancelRequested) socket.send(JSON.stringify({ type: "cancel" }));
    };
    socket.onmessage = (message) => this.onEvent(JSON.parse(message.data));
    socket.onclose = (event) => this.onClose(event);
  }

  onEvent(event) {
    // A resumed connection starts after lastId, but never trust that blindly: no token twice.
    if (event.seq <= this.lastSeq) return;
    this.lastSeq = event.seq;
    this.lastId = event.id;
    this.attempt = 0;
    if (event.type === "token") {
      this.pieces.set(event.seq, event.text);
    } else if (event.type === "restart") {
      for (const seq of [...this.pieces.keys()]) if (seq > event.discard_after_seq) this.pieces.delete(seq);
      this.view.note.textContent = "generation restarted";
    } else if (event.type === "done") {
      this.finish({ ok: true, reason: event.finish_reason, usage: event.usage });
    } else if (event.type === "error") {
      this.finish({ ok: false, reason: `${event.code}: ${event.message}` });
    }
    this.view.body.textContent = this.text;
    log.scrollTop = log.scrollHeight;
  }

  get text() {
    return [...this.pieces.values()].join("");
  }

  onClose(event) {
    if (this.outcome) return;
    if (FINAL_CLOSE_CODES.has(event.code)) {
      this.finish({ ok: false, reason: event.reason || `stream closed (${event.code})` });
      return;
    }
    // 1013: the service dropped us for lagging (resume at once, the first time); anything else: the
    // network or the service restarting. Resume either way, backing off while nothing gets through.
    const immediate = event.code === 1013 && this.attempt === 0;
    const delay = immediate ? 0 : Math.min(MAX_BACKOFF_MS, 250 * 2 ** this.attempt);
    this.attempt += 1;
    setStatus(`connection lost; reconnecting in ${(delay / 1000).toFixed(1)} s (attempt ${this.attempt})`);
    setTimeout(() => this.connect(), delay * (0.8 + 0.4 * Math.random()));
  }

  cancel() {
    this.cancelRequested = true;
    if (this.socket && this.socket.readyState === WebSocket.OPEN) {
      this.socket.send(JSON.stringify({ type: "cancel" }));
    }
    setStatus("stopping ...");
  }

  finish(outcome) {
    if (this.outcome) return;
    this.outcome = outcome;
    this.view.element.classList.remove("streaming");
    if (!outcome.ok) {
      this.view.element.classList.add("failed");
      this.view.note.textContent = outcome.reason;
    } else {
      const usage = outcome.usage ? `, ${outcome.usage.completion_tokens} tokens` : "";
      const stopped = outcome.reason === "abort" ? "stopped" : outcome.reason;
      this.view.note.textContent = `${stopped}${usage}`;
    }
    if (this.socket && this.socket.readyState <= WebSocket.OPEN) this.socket.close(1000);
    this.resolve(outcome);
  }
}

// --- a turn -------------------------------------------------------------------------------------

async function submit(prompt) {
  addMessage("user", prompt);
  const messages = [...conversation, { role: "user", content: prompt }];
  if (settings.system) messages.unshift({ role: "system", content: settings.system });
  const view = addMessage("assistant", "");
  setBusy(true);
  try {
    setStatus("submitting ...");
    const response = await fetch(`${settings.ingressUrl}/v1/requests`, {
      method: "POST",
      headers: { "Content-Type": "application/json", ...authHeaders() },
      body: JSON.stringify({
        model: settings.model,
        messages,
        max_tokens: settings.maxTokens,
        temperature: settings.temperature,
      }),
    });
    if (!response.ok) throw new Error(await errorText(response));
    const { request_id: requestId, stream_url: streamUrl, stream_token: token } = await response.json();
    setStatus(`queued as ${requestId}`);
    current = new ReplyStream(streamUrl, token, view);
    const outcome = await current.finished;
    // Keep the turn (a stopped one too) so the next message has its context; drop a failed one.
    if (outcome.ok) {
      conversation = [...messages.filter((m) => m.role !== "system"), { role: "assistant", content: current.text }];
    }
    setStatus(outcome.ok ? "idle" : "failed");
  } catch (err) {
    view.element.classList.add("failed");
    view.note.textContent = err.message;
    setStatus("failed");
  } finally {
    current = null;
    setBusy(false);
  }
}

function setBusy(busy) {
  sendButton.disabled = busy;
  stopButton.disabled = !busy;
}

// --- wiring -------------------------------------------------------------------------------------

composer.addEventListener("submit", (event) => {
  event.preventDefault();
  const prompt = composer.elements.prompt.value.trim();
  if (!prompt || current) return;
  if (!settings.apiKey || !settings.model) {
    openSettings(true);
    setStatus("set the API key and model first");
    return;
  }
  composer.elements.prompt.value = "";
  submit(prompt);
});

composer.elements.prompt.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    composer.requestSubmit();
  }
});

stopButton.addEventListener("click", () => current && current.cancel());

settingsForm.addEventListener("submit", (event) => {
  event.preventDefault();
  saveSettings();
  openSettings(false);
  refreshModels();
});

$("#refresh-models").addEventListener("click", () => {
  saveSettings();
  refreshModels();
});

$("#toggle-settings").addEventListener("click", () => openSettings(!settingsForm.classList.contains("open")));

$("#new-chat").addEventListener("click", () => {
  if (current) return;
  conversation = [];
  log.replaceChildren();
  setStatus("idle");
});

loadSettings();
