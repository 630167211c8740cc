// Assistant replies shown as Markdown (lists, emphasis, code, tables): marked parses GitHub-flavoured Markdown,
// raw HTML in a reply is shown as text (a model's "<b>" is something it wrote, not markup for the page), and
// DOMPurify strips whatever active content is left (javascript: links, event handlers) before it reaches the
// page. Both libraries are vendored under /static/vendor (the page must work without the internet).
"use strict";

const escapeHtml = (text) =>
  text.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);

const markdownReady = typeof marked !== "undefined" && typeof DOMPurify !== "undefined";
if (markdownReady) {
  marked.use({ gfm: true, breaks: true, async: false, renderer: { html: (token) => escapeHtml(token.text) } });
}

/** Show `source` in `element`: as sanitized Markdown, or as plain text if the libraries did not load. The
 * source itself is kept in `data-source` (what the conversation sends back, and what tests compare). */
function showMarkdown(element, source) {
  element.dataset.source = source;
  if (!markdownReady) {
    element.textContent = source;
    return;
  }
  element.innerHTML = DOMPurify.sanitize(marked.parse(source));
  for (const link of element.querySelectorAll("a[href]")) {
    link.target = "_blank";
    link.rel = "noopener noreferrer";
  }
}
