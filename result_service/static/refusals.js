// Refused requests, read and explained: an error response (OpenAI's shape, FastAPI's, or plain text) parsed into
// its status, code, param, message and Retry-After, and the sentence the person reads for it, with whether the fix
// is made in Settings. No page state: chat.js decides what to show and open.
"use strict";

/** Parse an error response (OpenAI's shape, FastAPI's, or plain text) into {status, code, param, message}. */
async function readError(response) {
  const raw = await response.text();
  let message = raw || response.statusText;
  let code = null;
  let param = null;
  try {
    const body = JSON.parse(raw);
    const detail = body.error?.message ?? body.detail ?? raw;
    message = typeof detail === "string" ? detail : JSON.stringify(detail);
    code = body.error?.code ?? null;
    param = body.error?.param ?? null;
  } catch {
    // not JSON: the raw text is the message
  }
  return { status: response.status, code, param, message, retryAfter: retryAfterSeconds(response, message) };
}

function retryAfterSeconds(response, message) {
  // Retry-After is readable only when ingress exposes it to this origin (CORS); its message says it too.
  const header = Number(response.headers.get("Retry-After"));
  if (Number.isFinite(header) && header > 0) return header;
  const said = /retry after (\d+(?:\.\d+)?) ?s/i.exec(message);
  return said ? Number(said[1]) : null;
}

/** What the person reads for a refused request (what happened, the server's words, what to do), and whether the fix
 * is made in Settings (the page then opens them). ``systemPrompt``: whether the conversation has one. */
function explainRefusal({ status, code, param, message, retryAfter }, { systemPrompt = false } = {}) {
  const plain = (text) => ({ text, fixInSettings: false });
  const inSettings = (text) => ({ text, fixInSettings: true });
  if (status === 401 || status === 403) {
    return inSettings(`Not authorised (${status}): ${message} Check the API key in Settings.`);
  }
  if (status === 404 && (code === "model_not_found" || /model/i.test(message))) {
    return inSettings(`Model not found (404): ${message} Pick another model in Settings.`);
  }
  if (status === 429 && code === "insufficient_quota") {
    // Its message names the reset time already; a quota is not a rate limit that passes in seconds.
    return plain(`Token quota used up (429): ${message}`);
  }
  if (code === "context_length_exceeded") return explainContext(status, param, message, systemPrompt);
  if (status === 429) {
    // Said once: ingress's own message already names the wait ("Retry after N s.").
    const wait = retryAfter && !/retry after/i.test(message) ? ` Try again in ${retryAfter} s.` : "";
    return plain(`Too many requests (429): ${message}${wait}`);
  }
  if (status >= 500) return plain(`The service failed (${status}): ${message} Try again shortly.`);
  return plain(`Request refused (${status}): ${message}`);
}

/** A request past the model's context, as left after the page's own trimming of older turns (chat.js, submit): Max
 * tokens is the advice only when lowering it would make the request fit; messages that fill the context alone must be
 * shortened. The message is vLLM's: "maximum context length is 8192 tokens ... (9041 in the messages, 256 in the
 * completion)". */
function explainContext(status, param, message, systemPrompt) {
  const context = Number(/maximum context length is (\d+)/i.exec(message)?.[1]);
  const prompt = Number(/\((\d+) in the (?:messages|prompt)/i.exec(message)?.[1]);
  const counted = context > 0 && Number.isFinite(prompt) && prompt > 0;
  if (/^max_(?:completion_)?tokens$/.test(param ?? "") || (counted && prompt < context)) {
    const room = counted ? ` (this message leaves room for at most ${context - prompt})` : "";
    return { text: `Too long for the model (${status}): ${message} Lower Max tokens in Settings${room}.`, fixInSettings: true };
  }
  const what = systemPrompt ? "the message or the system prompt" : "the message";
  const text = counted
    ? `Message too long for the model (${status}): ${message} Shorten ${what} and send it again.`
    : `Too long for the model (${status}): ${message} Shorten ${what}, or lower Max tokens in Settings.`;
  return { text, fixInSettings: false };
}
