// One reply's token stream over the result service's WebSocket: renders text as it arrives, resumes
// from last_id after a dropped connection (no token twice, none missed), sends the cancel message for
// Stop, and measures what the person sees: time to first token and tokens per second.
"use strict";

// Close codes after which reconnecting cannot help (see result_service/websocket.py).
const FINAL_CLOSE_CODES = new Set([1000, 1008, 4404]);
const MAX_BACKOFF_MS = 8000;
// Consecutive connections that ended before delivering a single event: past this the stream is given up.
const MAX_RESUME_ATTEMPTS = 8;

function formatDuration(ms) {
  return ms < 1000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(2)} s`;
}

class ReplyStream {
  /**
   * @param {string} streamUrl  the 202's stream_url (ws:// or http://)
   * @param {string} token      the 202's stream_token
   * @param {{element: HTMLElement, body: HTMLElement, note: HTMLElement}} view  where the reply renders
   * @param {{startedAt: number | null, onStatus: (text: string) => void, onChange: () => void}} hooks
   *   startedAt: performance.now() when the person pressed Send (TTFT counts from there); null for a reply
   *   followed again after a reload (no TTFT or rate then)
   */
  constructor(streamUrl, token, view, hooks) {
    const url = new URL(streamUrl, location.href);
    if (url.protocol === "http:") url.protocol = "ws:";
    if (url.protocol === "https:") url.protocol = "wss:";
    url.searchParams.set("token", token);
    this.url = url;
    this.view = view;
    this.hooks = hooks;
    this.pieces = new Map(); // seq -> text, in seq order
    this.lastSeq = -1;
    this.lastId = null;
    this.attempt = 0;
    this.cancelRequested = false;
    this.socket = null;
    // One entry per connection: the last_id it resumed from and the seq of the first event it brought.
    // Tests read these to check a resume started exactly after the last event seen.
    this.connections = [];
    this.firstTokenAt = null;
    this.lastTokenAt = null;
    this.tokenCount = 0; // token ids received (usage.completion_tokens wins when the stream ends)
    this.finished = new Promise((resolve) => (this.resolve = resolve));
    this.outcome = null;
    this.setState("streaming");
    this.connect();
  }

  setState(state) {
    this.view.element.dataset.state = state;
    this.view.element.classList.toggle("streaming", state === "streaming");
  }

  connect() {
    const url = new URL(this.url);
    if (this.lastId) url.searchParams.set("last_id", this.lastId);
    const socket = new WebSocket(url);
    const connection = { lastId: this.lastId, firstSeq: null, closeCode: null, droppedByPage: false };
    this.connections.push(connection);
    this.socket = socket;
    socket.onopen = () => {
      if (this.cancelRequested) {
        socket.send(JSON.stringify({ type: "cancel" })); // the status still says "stopping ..."
        return;
      }
      this.hooks.onStatus(this.connections.length > 1 ? "reconnected" : "streaming");
    };
    socket.onmessage = (message) => {
      const event = JSON.parse(message.data);
      if (connection.firstSeq === null) connection.firstSeq = event.seq;
      this.onEvent(event);
    };
    socket.onclose = (event) => {
      connection.closeCode = event.code;
      // The server echoes whatever code the page closed with; a drop the page made is always resumable.
      if (socket === this.socket) this.onClose(connection.droppedByPage ? { code: 4000, reason: "" } : event);
    };
  }

  /** Test hook and the model of a network drop: close the socket as if the connection were lost. */
  dropConnection() {
    if (!this.socket || this.socket.readyState > WebSocket.OPEN) return false;
    this.connections[this.connections.length - 1].droppedByPage = true;
    this.socket.close(4000, "dropped by the page");
    return true;
  }

  onEvent(event) {
    // A resumed connection starts after lastId, but never trust that blindly: no token twice.
    if (event.seq <= this.lastSeq) return;
    this.lastSeq = event.seq;
    this.lastId = event.id;
    this.attempt = 0;
    if (event.type === "token") {
      const now = performance.now();
      if (this.firstTokenAt === null && event.token_ids.length) this.firstTokenAt = now;
      this.lastTokenAt = now;
      this.tokenCount += event.token_ids.length;
      this.pieces.set(event.seq, event.text);
    } else if (event.type === "restart") {
      for (const seq of [...this.pieces.keys()]) if (seq > event.discard_after_seq) this.pieces.delete(seq);
      this.view.note.textContent = "generation restarted on another worker";
    } else if (event.type === "done") {
      this.finish({ ok: true, reason: event.finish_reason, usage: event.usage });
    } else if (event.type === "error") {
      this.finish({ ok: false, reason: `Generation failed (${event.code}): ${event.message}` });
    }
    this.view.show(this.text);
    this.hooks.onChange();
  }

  get text() {
    return [...this.pieces.values()].join("");
  }

  onClose(event) {
    if (this.outcome) return;
    if (FINAL_CLOSE_CODES.has(event.code)) {
      const why = event.reason || `closed with code ${event.code}`;
      const title = event.code === 4404 ? "The stream expired" : "The stream ended early";
      this.finish({ ok: false, reason: `${title}: ${why}` });
      return;
    }
    if (this.attempt >= MAX_RESUME_ATTEMPTS) {
      this.finish({
        ok: false,
        reason:
          `Connection lost: could not resume the stream after ${this.attempt} attempts ` +
          `(last close code ${event.code}${event.reason ? `, ${event.reason}` : ""}). The reply may be incomplete.`,
      });
      return;
    }
    // 1013: the service dropped us for lagging (resume at once, the first time); anything else: the
    // network or the service restarting. Resume either way, backing off while nothing gets through.
    const immediate = (event.code === 1013 || event.code === 4000) && this.attempt === 0;
    const delay = immediate ? 0 : Math.min(MAX_BACKOFF_MS, 250 * 2 ** this.attempt);
    this.attempt += 1;
    this.hooks.onStatus(`connection lost; resuming in ${(delay / 1000).toFixed(1)} s (attempt ${this.attempt})`);
    setTimeout(() => this.connect(), delay * (0.8 + 0.4 * Math.random()));
  }

  cancel() {
    this.cancelRequested = true;
    if (this.socket && this.socket.readyState === WebSocket.OPEN) {
      this.socket.send(JSON.stringify({ type: "cancel" }));
    }
    this.hooks.onStatus("stopping ...");
  }

  /** "TTFT 120 ms · 48.2 tok/s · 64 tokens" (the parts that can be known so far). */
  metrics(completionTokens) {
    const parts = [];
    const tokens = completionTokens ?? this.tokenCount;
    // Followed again after a reload, the reply's earlier tokens arrive in one burst from the stream's history:
    // neither a first-token time nor a rate would mean anything, so only the count is shown.
    if (this.hooks.startedAt === null) return tokens ? [`${tokens} token${tokens === 1 ? "" : "s"}`] : [];
    if (this.firstTokenAt !== null) parts.push(`TTFT ${formatDuration(this.firstTokenAt - this.hooks.startedAt)}`);
    // Decode rate: the tokens after the first over the time after the first (TTFT is reported apart).
    const span = (this.lastTokenAt ?? 0) - (this.firstTokenAt ?? 0);
    if (tokens > 1 && span > 0) parts.push(`${((1000 * (tokens - 1)) / span).toFixed(1)} tok/s`);
    if (tokens) parts.push(`${tokens} token${tokens === 1 ? "" : "s"}`);
    return parts;
  }

  finish(outcome) {
    if (this.outcome) return;
    this.outcome = outcome;
    const metrics = this.metrics(outcome.usage?.completion_tokens);
    this.view.metrics.textContent = metrics.join(" · ");
    if (!outcome.ok) {
      this.setState("failed");
      this.view.element.classList.add("failed");
      this.view.note.textContent = outcome.reason;
    } else {
      const stopped = outcome.reason === "abort";
      this.setState(stopped ? "stopped" : "done");
      this.view.element.classList.toggle("stopped", stopped);
      const why = { stop: "finished", length: "finished: reached max tokens" }[outcome.reason];
      this.view.note.textContent = stopped ? "stopped" : why ?? `finished: ${outcome.reason}`;
    }
    if (this.socket && this.socket.readyState <= WebSocket.OPEN) this.socket.close(1000);
    this.resolve(outcome);
  }
}
