// The chat's session in this tab (sessionStorage): what a reload brings back. Two things are kept apart: the
// conversation sent to the model as context (finished and stopped turns only) and every message as it was shown
// (failed turns too, with its state, note, metrics and aside), plus the turn in flight, whose reply is followed
// again from its stream. A session written before messages were kept ({conversation, pending}) still loads: its
// conversation is shown as before.
"use strict";

const SESSION_KEY = "sluicegate.chat.session";
const ENDED_STATES = new Set(["done", "stopped", "failed"]);

/** One shown message (an element addMessage made) as plain data, to be shown again by showAgain. */
function describeMessage(element) {
  const part = (name) => element.querySelector(`:scope > .${name}`);
  return {
    role: element.classList.contains("user") ? "user" : "assistant",
    text: part("text")?.dataset.source ?? "",
    state: element.dataset.state ?? null,
    requestId: element.dataset.requestId ?? null,
    note: part("note")?.textContent ?? "",
    metrics: part("metrics")?.textContent ?? "",
    aside: part("aside")?.textContent ?? "",
  };
}

/** Put back on a freshly added message's ``view`` what describeMessage kept: its state (and its styling), request
 * id, note, metrics and aside. */
function showAgain(view, saved) {
  const { element } = view;
  if (ENDED_STATES.has(saved.state)) {
    element.dataset.state = saved.state;
    if (saved.state !== "done") element.classList.add(saved.state);
  }
  if (saved.requestId) element.dataset.requestId = saved.requestId;
  view.note.textContent = saved.note || "";
  view.metrics.textContent = saved.metrics || "";
  view.aside.textContent = saved.aside || "";
}

/** The tab's stored text under ``key`` ("" when none, or storage is refused). */
function readStored(key) {
  try {
    return sessionStorage.getItem(key) || "";
  } catch {
    return "";
  }
}

/** Store ``text`` under ``key`` for a reload ("" removes it); ``what`` names it if storage is refused. */
function store(key, text, what) {
  try {
    if (text) sessionStorage.setItem(key, text);
    else sessionStorage.removeItem(key);
  } catch (err) {
    console.warn(`could not keep ${what}`, err);
  }
}

/** {conversation, pending, shown} as kept; shown is null for a session written before messages were kept. */
function readSession() {
  let saved = {};
  try {
    saved = JSON.parse(readStored(SESSION_KEY) || "{}") || {};
  } catch {
    saved = {};
  }
  const valid = (m) => m && typeof m === "object" && (m.role === "user" || m.role === "assistant");
  return {
    conversation: Array.isArray(saved.conversation) ? saved.conversation : [],
    pending: saved.pending || null,
    shown: Array.isArray(saved.shown) ? saved.shown.filter(valid) : null,
  };
}

function writeSession(session) {
  store(SESSION_KEY, JSON.stringify(session), "the conversation for a reload");
}

const DRAFT_KEY = "sluicegate.chat.draft";

/** The message being typed (or put back after a failed send), kept so that a reload does not lose it. */
function keepDraft(text) {
  store(DRAFT_KEY, text, "the message being typed");
}

function readDraft() {
  return readStored(DRAFT_KEY);
}
