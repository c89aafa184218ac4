// A small markdown renderer for the chat's answers: fenced code blocks, headings, lists,
// paragraphs, and inline code, bold and italics. Everything is escaped before any tag is
// added, so a model's output can never inject HTML. An unclosed fence (an answer still
// streaming) renders as code up to the end.
"use strict";

const FENCE = /^\s*```\s*([\w+#.-]*)\s*$/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const LIST_ITEM = { ul: /^\s*[-*+]\s+/, ol: /^\s*\d+[.)]\s+/ };

function listKind(line) {
  if (LIST_ITEM.ul.test(line)) return "ul";
  if (LIST_ITEM.ol.test(line)) return "ol";
  return null;
}

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || listKind(line) !== null;
}

function renderInline(text) {
  // Code spans first: nothing inside them is markdown.
  return text
    .split(/(`[^`\n]+`)/)
    .map((part, i) => {
      if (i % 2 === 1) return `<code>${escapeHtml(part.slice(1, -1))}</code>`;
      return escapeHtml(part)
        .replace(/\*\*(\S(?:.*?\S)?)\*\*/g, "<strong>$1</strong>")
        .replace(/(^|[^*\w])\*(\S(?:.*?\S)?)\*(?![*\w])/g, "$1<em>$2</em>");
    })
    .join("");
}

function renderMarkdown(source) {
  const lines = source.split("\n");
  const html = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(FENCE);
    if (fence) {
      const code = [];
      i++;
      while (i < lines.length && !FENCE.test(lines[i])) code.push(lines[i++]);
      i++; // the closing fence
      const language = fence[1] ? ` data-language="${escapeHtml(fence[1])}"` : "";
      html.push(`<pre${language}><code>${escapeHtml(code.join("\n"))}</code></pre>`);
    } else if (!line.trim()) {
      i++;
    } else if (HEADING.test(line)) {
      const [, hashes, title] = line.match(HEADING);
      const level = Math.min(hashes.length + 2, 6); // an answer's headings sit below the page's
      html.push(`<h${level}>${renderInline(title)}</h${level}>`);
      i++;
    } else if (listKind(line)) {
      const kind = listKind(line);
      const items = [];
      while (i < lines.length && listKind(lines[i]) === kind) {
        items.push(`<li>${renderInline(lines[i].replace(LIST_ITEM[kind], ""))}</li>`);
        i++;
      }
      html.push(`<${kind}>${items.join("")}</${kind}>`);
    } else {
      const paragraph = [];
      while (i < lines.length && lines[i].trim() && !startsBlock(lines[i])) paragraph.push(lines[i++]);
      html.push(`<p>${paragraph.map(renderInline).join("<br>")}</p>`);
    }
  }
  return html.join("");
}
