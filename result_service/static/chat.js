// Sluicegate chat page: settings, submitting a turn to ingress's native API and showing its errors to
// the person. The reply's stream (WebSocket, resumed with last_id after a drop, TTFT and tokens/s) is
// reply_stream.js's job.
"use strict";

const STORAGE_KEY = "sluicegate.chat.settings";

const $ = (selector) => document.querySelector(selector);
const log = $("#log");
const statusLine = $("#status");
const settingsForm = $("#settings");
const composer = $("#composer");
const sendButton = $("#send");
const stopButton = $("#stop");
const newChatButton = $("#new-chat");
const promptInput = composer.elements.prompt;
// Within this many pixels of the bottom the chat follows a streaming reply; scrolled further up, it stays put.
const FOLLOW_SLACK_PX = 48;

let settings = {};
let conversation = []; // [{role, content}] sent with every turn
let busy = false; // a turn is being submitted or received: set at once, so a second Enter cannot start another
let pending = null; // the turn in flight once ingress accepted it: {prompt, messages, streamUrl, token, requestId}
let inFlight = []; // the turn in flight's two message elements: kept for a reload as the pending turn, not as shown
let current = null; // the ReplyStream being received
let latest = null; // the most recent ReplyStream, kept after its turn ends (for tests)
let stopRequested = false; // Stop pressed for the turn in flight, possibly before ingress accepted it
let atEnd = true; // the chat is scrolled to (or near) its bottom: new text keeps it there

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
  fillSettingsForm();
  if (!settings.apiKey || !settings.model) openSettings(true);
  if (settings.apiKey) refreshModels();
}

/** Show the settings in effect in the form: at load, and when Settings closes without a Save, so that what the
 * form shows next time is what the chat uses (an edit left unsaved is dropped, as Cancel would drop it). */
function fillSettingsForm() {
  for (const [name, value] of Object.entries(settings)) {
    if (settingsForm.elements[name]) settingsForm.elements[name].value = value;
  }
  fitSystemPrompt();
}

/** Save the form's values as shown, once the browser finds them valid (else it points at the field and says why);
 * false when they were not saved. Both Save and Refresh models come here: no value is stored unchecked. Refresh
 * models may leave the model empty (``modelRequired`` false): the list it fetches is how one is picked. */
function saveSettings({ modelRequired = true } = {}) {
  const modelField = settingsForm.elements.model;
  modelField.required = modelRequired;
  const valid = settingsForm.reportValidity();
  modelField.required = true;
  if (!valid) {
    setStatus("settings not saved: fix the marked field");
    return false;
  }
  const form = settingsForm.elements;
  settings = {
    ingressUrl: form.ingressUrl.value.trim().replace(/\/+$/, ""),
    apiKey: form.apiKey.value.trim(),
    model: form.model.value.trim(),
    maxTokens: Number(form.maxTokens.value),
    temperature: Number(form.temperature.value),
    system: form.system.value,
  };
  localStorage.setItem(STORAGE_KEY, JSON.stringify(settings));
  setStatus("settings saved");
  return true;
}

/** The system prompt's box grows with its text (up to the CSS max-height, then it scrolls). */
function fitSystemPrompt() {
  const box = settingsForm.elements.system;
  if (!box.offsetParent) return; // Settings closed: nothing to measure (fitted again when it opens)
  box.style.height = "auto";
  box.style.height = `${box.scrollHeight + box.offsetHeight - box.clientHeight}px`;
}

function showModels(models) {
  const list = $("#models");
  list.replaceChildren(...models.map((id) => Object.assign(document.createElement("option"), { value: id })));
}

async function refreshModels() {
  try {
    const response = await reachIngress(`${settings.ingressUrl}/v1/models`, { headers: authHeaders() });
    if (!response.ok) throw new Error(explainError(await readError(response)));
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
  const wasOpen = settingsForm.classList.contains("open");
  settingsForm.classList.toggle("open", open);
  $("#toggle-settings").setAttribute("aria-expanded", String(open));
  if (!open && wasOpen) fillSettingsForm();
  if (open) fitSystemPrompt();
  // Opened for the person to fill something in: put the cursor in the first empty field (the API key, at first);
  // with every field filled (a wrong key, an unknown model) the focus stays where the person is.
  if (open && !wasOpen) [...settingsForm.querySelectorAll("input")].find((input) => !input.value)?.focus();
  followToEnd(); // the chat's box changed height: a person at its end stays there
}

function authHeaders() {
  return settings.apiKey ? { Authorization: `Bearer ${settings.apiKey}` } : {};
}

// --- rendering ----------------------------------------------------------------------------------

function setStatus(text) {
  statusLine.textContent = text;
  statusLine.title = text; // the header shows one line of it (ellipsized); the whole text on hover
}

function addMessage(role, text) {
  const element = document.createElement("div");
  element.className = `message ${role}`;
  const label = Object.assign(document.createElement("span"), { className: "role", textContent: role });
  const body = Object.assign(document.createElement("div"), { className: "text" });
  // The person's words as typed; the model's as Markdown (markdown.js).
  const show = (source) => {
    if (role === "assistant") return showMarkdown(body, source);
    body.textContent = source;
    body.dataset.source = source;
  };
  show(text);
  const metrics = Object.assign(document.createElement("span"), { className: "metrics" });
  const note = Object.assign(document.createElement("span"), { className: "note" });
  const aside = Object.assign(document.createElement("span"), { className: "aside" }); // about the turn's context
  element.append(label, aside, body, metrics, note);
  log.append(element);
  followToEnd();
  return { element, body, metrics, note, aside, show };
}

/** What the person reads for a refused request (refusals.js), opening Settings where the fix is made there. */
function explainError(error) {
  const { text, fixInSettings } = explainRefusal(error, { systemPrompt: Boolean(settings.system) });
  if (fixInSettings) openSettings(true);
  return text;
}

// --- a turn -------------------------------------------------------------------------------------

async function submit(prompt) {
  const startedAt = performance.now();
  atEnd = true; // the person just sent: show their message and follow the reply
  const asked = addMessage("user", prompt);
  const messages = [...conversation, { role: "user", content: prompt }];
  if (settings.system) messages.unshift({ role: "system", content: settings.system });
  const view = addMessage("assistant", "");
  inFlight = [asked.element, view.element];
  setBusy(true);
  stopRequested = false;
  let accepted = false;
  try {
    setStatus("submitting ...");
    let response;
    let leftOut = 0;
    for (;;) {
      response = await reachIngress(`${settings.ingressUrl}/v1/requests`, {
        method: "POST",
        headers: { "Content-Type": "application/json", ...authHeaders() },
        body: JSON.stringify({
          model: settings.model,
          messages,
          max_tokens: settings.maxTokens,
          temperature: settings.temperature,
          // A person is waiting: ahead of standard and batch work (a key capped lower gets its cap).
          priority: "interactive",
        }),
      });
      if (response.ok) break;
      const error = await readError(response);
      // A conversation past the model's context (prompt + max tokens): leave out its oldest turn and ask again,
      // as chat apps do, until it fits or only the new message is left (then the refusal is shown).
      // (Max tokens alone past the context: no turn left out would help.)
      const fits = error.code !== "context_length_exceeded" || error.param === "max_tokens";
      if (!fits && stopRequested) throw new StoppedBeforeAccepted(); // the person stopped it: ask no more
      if (fits || !dropOldestTurn(messages)) throw new Error(explainError(error));
      leftOut += 1;
    }
    accepted = true;
    if (leftOut) {
      view.aside.textContent = `${leftOut} earlier turn${leftOut === 1 ? "" : "s"} left out to fit the model's context`;
    }
    const { request_id: requestId, stream_url: streamUrl, stream_token: token } = await response.json();
    pending = { prompt, messages, streamUrl, token, requestId, aside: view.aside.textContent };
    saveSession();
    setStatus(`queued as ${requestId}`);
    await follow(pending, view, startedAt);
  } catch (err) {
    if (err instanceof StoppedBeforeAccepted) showStopped(view);
    else showFailure(view, err.message);
    // Nothing was queued: the words go back into the box to send again (unless the person typed anew meanwhile).
    if (!accepted) restorePrompt(prompt);
  } finally {
    endTurn();
  }
}

class StoppedBeforeAccepted extends Error {}

function restorePrompt(prompt) {
  if (promptInput.value.trim()) return;
  promptInput.value = prompt;
  keepDraft(prompt);
  checkPrompt();
}

/** Remove the oldest turn (a user message and the replies up to the next one) from ``messages``, never the system
 * prompt or the newest message; false when there is none to remove. */
function dropOldestTurn(messages) {
  const start = messages.findIndex((m) => m.role !== "system");
  if (start < 0 || start >= messages.length - 1) return false;
  let end = start + 1;
  while (end < messages.length - 1 && messages[end].role !== "user") end += 1;
  messages.splice(start, end - start);
  return true;
}

/** Receive an accepted turn's reply into ``view``; keep the turn (a stopped one too) as context, drop a failed one. */
async function follow(turn, view, startedAt) {
  view.element.dataset.requestId = turn.requestId;
  current = new ReplyStream(turn.streamUrl, turn.token, view, {
    startedAt,
    onStatus: setStatus,
    onChange: followToEnd,
  });
  latest = current;
  // Stop pressed while the request was still being submitted: cancel it now that it has a stream (the cancel goes
  // out as the socket opens; a request still queued is dropped at pickup), and the reply ends as stopped.
  if (stopRequested) current.cancel();
  const outcome = await current.finished;
  // A reply with no text (stopped before its first token) is shown but kept out of the context, its question too:
  // an empty assistant turn taught the model to answer the next question with nothing.
  if (outcome.ok && current.text.trim()) {
    conversation = [...turn.messages.filter((m) => m.role !== "system"), { role: "assistant", content: current.text }];
  }
  setStatus(outcome.ok ? "idle" : "failed");
}

function showStopped(view) {
  view.element.classList.add("stopped");
  view.element.dataset.state = "stopped";
  view.note.textContent = "stopped before it was sent";
  setStatus("stopped");
}

function showFailure(view, message) {
  view.element.classList.add("failed");
  view.element.dataset.state = "failed";
  view.note.textContent = message;
  setStatus("failed");
}

function endTurn() {
  current = null;
  pending = null;
  inFlight = [];
  stopRequested = false;
  saveSession();
  setBusy(false);
  followToEnd(); // the outcome's note (an error, a stop) is the last thing on the page: show it
}

/** Keep the newest text in view, but only for a person already at (or near) the bottom: one who scrolled up to
 * read stays where they are while the reply streams on (scrolling back down follows it again). */
function followToEnd() {
  noteScroll(); // a scroll whose event has not fired yet counts too: a token must not undo it
  if (!atEnd) return;
  log.scrollTop = log.scrollHeight;
  lastScrollTop = log.scrollTop;
}

let lastScrollTop = 0;

/** Where the person has scrolled since last looked: any move up leaves the end (the page itself only ever scrolls
 * down, to the end), even a small one within the slack; a move down to near the end follows the reply again; no
 * move keeps what was (text that grew below a followed end is followed, however much it grew). */
function noteScroll() {
  const top = log.scrollTop;
  const distance = log.scrollHeight - top - log.clientHeight;
  if (top < lastScrollTop) atEnd = distance < 1;
  else if (top > lastScrollTop) atEnd = distance <= FOLLOW_SLACK_PX;
  lastScrollTop = top;
}

log.addEventListener("scroll", noteScroll);

/** Keep the tab's session (chat_session.js): the context, the turn in flight, every other message as shown. */
function saveSession() {
  const shown = [...log.querySelectorAll(":scope > .message")].filter((e) => !inFlight.includes(e));
  writeSession({ conversation, pending, shown: shown.map(describeMessage) });
}

/** After a reload: the messages as they were shown (a session from before they were kept: its conversation), and
 * the reply that was arriving followed from its stream. */
function restoreSession() {
  const saved = readSession();
  conversation = saved.conversation;
  if (saved.shown) for (const message of saved.shown) showAgain(addMessage(message.role, message.text), message);
  else for (const message of conversation) addMessage(message.role, message.content);
  promptInput.value = readDraft(); // what was being typed, or a failed send's message put back
  checkPrompt();
  // Shown as it was, and at its end: each message scrolled there before its note and figures filled in.
  atEnd = true;
  followToEnd();
  if (!settingsForm.classList.contains("open")) promptInput.focus(); // Settings, opened first, keep it
  const turn = saved.pending;
  if (!turn || !turn.streamUrl || !turn.token) return;
  pending = turn;
  const asked = addMessage("user", turn.prompt);
  const view = addMessage("assistant", "");
  view.aside.textContent = turn.aside || ""; // "n earlier turns left out", said when it was sent
  inFlight = [asked.element, view.element];
  setBusy(true);
  setStatus(`following ${turn.requestId} again`);
  follow(turn, view, null)
    .catch((err) => showFailure(view, err.message))
    .finally(endTurn);
}

/** fetch, with a network failure (ingress down, CORS refused) turned into words for the person. */
async function reachIngress(url, init) {
  try {
    return await fetch(url, init);
  } catch (err) {
    throw new Error(`Could not reach ingress at ${settings.ingressUrl} (${err.message}). Is it running, and is the URL in Settings right?`);
  }
}

function setBusy(on) {
  busy = on;
  // A disabled button loses the focus to <body>: keep it where the next message is typed.
  if (!on && document.activeElement === stopButton) promptInput.focus();
  sendButton.disabled = on;
  stopButton.disabled = !on;
  newChatButton.disabled = on; // the reply would land in the cleared chat: Stop first
}

/** A message of spaces and blank lines alone is not sent: the browser says so (as it does for an empty one). */
function checkPrompt() {
  const blank = promptInput.value !== "" && !promptInput.value.trim();
  promptInput.setCustomValidity(blank ? "Type a message: spaces and blank lines alone are not sent." : "");
}

// --- wiring -------------------------------------------------------------------------------------

composer.addEventListener("submit", (event) => {
  event.preventDefault();
  const prompt = promptInput.value.trim();
  if (!prompt || busy) return;
  if (!settings.apiKey || !settings.model) {
    openSettings(true);
    setStatus("set the API key and model first");
    return;
  }
  promptInput.value = "";
  keepDraft("");
  checkPrompt();
  submit(prompt);
});

promptInput.addEventListener("input", () => {
  keepDraft(promptInput.value);
  checkPrompt();
});

promptInput.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    checkPrompt();
    composer.requestSubmit(); // validates first: an empty or blank message gets the browser's message, not a send
  }
});

stopButton.addEventListener("click", () => {
  if (current) current.cancel();
  else if (busy) {
    // Still being submitted: remembered, and the request is cancelled the moment ingress accepts it (follow).
    stopRequested = true;
    setStatus("stopping ...");
  }
  promptInput.focus(); // Stop disables itself: the focus goes where the next message is typed
});

settingsForm.addEventListener("submit", (event) => {
  event.preventDefault();
  if (!saveSettings()) return;
  openSettings(false);
  promptInput.focus(); // Save is hidden with the form: the focus goes where the next message is typed
  refreshModels();
});

$("#refresh-models").addEventListener("click", () => {
  if (saveSettings({ modelRequired: false })) refreshModels();
});

settingsForm.elements.system.addEventListener("input", fitSystemPrompt);

$("#toggle-settings").addEventListener("click", () => openSettings(!settingsForm.classList.contains("open")));

document.addEventListener("keydown", (event) => {
  if (event.key !== "Escape" || !settingsForm.classList.contains("open")) return;
  const inside = settingsForm.contains(document.activeElement);
  openSettings(false);
  if (inside) $("#toggle-settings").focus(); // the focused field is hidden now: back to the button that opens it
});

newChatButton.addEventListener("click", () => {
  if (busy) return;
  conversation = [];
  log.replaceChildren();
  saveSession();
  setStatus("idle");
});

// For tests and the curious: the reply being received and the latest one (connections, text, dropConnection()).
window.sluicegateChat = {
  get current() {
    return current;
  },
  get latest() {
    return latest;
  },
};

loadSettings();
restoreSession();
