// The chat page: conversations kept in this browser, answers streamed from /v1/chat/completions.
//
// A conversation is {id, title, messages: [{role, content, stats?}]}; all of them live in
// localStorage, as do the settings. Stopping an answer aborts its fetch(): the server sees the
// connection close and aborts the request in the engine, which frees its KV cache at once.
"use strict";

const CONVERSATIONS = "yaie.conversations";
const SETTINGS = "yaie.settings";
const SETTING_FIELDS = ["system-prompt", "temperature", "top-p", "max-tokens", "seed"];

let conversations = JSON.parse(localStorage.getItem(CONVERSATIONS) ?? "[]");
let current = null; // the conversation on screen
let inFlight = null; // the AbortController of the answer streaming now
let modelName = null; // what the server calls its model; requests must name it

const $ = (id) => document.getElementById(id);

function save() {
  localStorage.setItem(CONVERSATIONS, JSON.stringify(conversations));
}

// -- settings ------------------------------------------------------------------------------

function loadSettings() {
  const saved = JSON.parse(localStorage.getItem(SETTINGS) ?? "{}");
  for (const id of SETTING_FIELDS) {
    if (id in saved) $(id).value = saved[id];
    $(id).addEventListener("change", saveSettings);
  }
}

function saveSettings() {
  localStorage.setItem(SETTINGS, JSON.stringify(Object.fromEntries(SETTING_FIELDS.map((id) => [id, $(id).value]))));
}

// The request's sampling fields; empty ones are left to the server's defaults.
function samplingFields() {
  const fields = {};
  const number = (id) => ($(id).value.trim() === "" ? null : Number($(id).value));
  for (const [name, id] of [["temperature", "temperature"], ["top_p", "top-p"], ["max_tokens", "max-tokens"], ["seed", "seed"]]) {
    const value = number(id);
    if (value !== null) fields[name] = value;
  }
  return fields;
}

// -- conversations -------------------------------------------------------------------------

function newConversation() {
  current = { id: crypto.randomUUID?.() ?? String(Date.now()), title: "New chat", messages: [] };
  conversations.unshift(current);
  showConversation();
}

function showConversation() {
  const list = $("conversations");
  list.replaceChildren(
    ...conversations.map((conversation) =>
      h("li", { class: conversation === current ? "current" : "" },
        h("a", { href: "#", onclick: (event) => { event.preventDefault(); open(conversation); } }, conversation.title),
        h("button", { type: "button", title: "Delete", class: "delete", onclick: () => remove(conversation) }, "×"))
    )
  );
  $("messages").replaceChildren(...current.messages.map(messageElement));
}

function open(conversation) {
  if (inFlight) return; // one answer at a time
  current = conversation;
  showConversation();
}

function remove(conversation) {
  if (inFlight && conversation === current) return;
  conversations = conversations.filter((c) => c !== conversation);
  save();
  if (conversation === current) {
    if (conversations.length) current = conversations[0];
    else return newConversation();
  }
  showConversation();
}

function messageElement(message) {
  const content = h("div", { class: "content" });
  // An assistant message is "done" unless `send` is streaming it.
  const element = h("div", { class: `message ${message.role}${message.role === "assistant" ? " done" : ""}` }, content);
  fillMessage(element, message);
  return element;
}

function fillMessage(element, message) {
  const content = element.querySelector(".content");
  element.dataset.text = message.content; // the raw text, as the model wrote it
  if (message.role === "assistant") content.innerHTML = renderMarkdown(message.content);
  else content.textContent = message.content;
  element.querySelector(".stats")?.remove();
  if (message.stats) element.append(h("div", { class: "stats" }, message.stats));
  element.querySelector(".error")?.remove();
  if (message.error) element.append(h("div", { class: "error" }, message.error));
}

// -- answering -----------------------------------------------------------------------------

async function send(text) {
  if (!current.messages.length) current.title = text.slice(0, 40);
  current.messages.push({ role: "user", content: text });
  const answer = { role: "assistant", content: "" };
  const history = current.messages.map(({ role, content }) => ({ role, content }));
  const system = $("system-prompt").value.trim();
  if (system) history.unshift({ role: "system", content: system });
  current.messages.push(answer);
  save();
  showConversation();
  const element = $("messages").lastElementChild;
  element.classList.replace("done", "streaming");

  inFlight = new AbortController();
  $("send").hidden = true;
  $("stop").hidden = false;
  const started = performance.now();
  let firstTokenAt = null;
  let lastTokenAt = null;
  let usage = null;
  try {
    modelName ??= await fetchModelName();
    const response = await apiFetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({
        model: modelName, messages: history, stream: true, stream_options: { include_usage: true }, ...samplingFields(),
      }),
      signal: inFlight.signal,
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    for await (const data of readEvents(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const delta = chunk.choices?.[0]?.delta?.content;
      if (delta) {
        lastTokenAt = performance.now();
        firstTokenAt ??= lastTokenAt;
        answer.content += delta;
        fillMessage(element, answer);
        element.scrollIntoView({ block: "end" });
      }
    }
    answer.stats = statsLine(usage, started, firstTokenAt, lastTokenAt);
  } catch (error) {
    if (error.name === "AbortError") answer.stats = "stopped";
    else answer.error = error.message;
  } finally {
    inFlight = null;
    $("send").hidden = false;
    $("stop").hidden = true;
    element.classList.remove("streaming");
    element.classList.add("done");
    fillMessage(element, answer);
    save();
  }
}

function statsLine(usage, started, firstTokenAt, lastTokenAt) {
  if (!usage || firstTokenAt === null) return "";
  const tokens = usage.completion_tokens;
  // Decode speed: the tokens after the first, over the time after the first.
  const seconds = (lastTokenAt - firstTokenAt) / 1000;
  const speed = tokens > 1 && seconds > 0 ? `${((tokens - 1) / seconds).toFixed(1)} tok/s` : "– tok/s";
  const cached = usage.prompt_tokens_details?.cached_tokens ?? 0;
  return `${tokens} tokens · ${speed} · TTFT ${Math.round(firstTokenAt - started)} ms · ` +
    `${cached} of ${usage.prompt_tokens} prompt tokens cached`;
}

async function fetchModelName() {
  const response = await apiFetch("/v1/models");
  if (!response.ok) throw new Error(await errorMessage(response));
  return (await response.json()).data[0].id;
}

// -- wiring --------------------------------------------------------------------------------

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || inFlight) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => inFlight?.abort());
$("new-chat").addEventListener("click", () => { if (!inFlight) newConversation(); });

setUpKeyForm();
loadSettings();
if (conversations.length) {
  current = conversations[0];
  showConversation();
} else {
  newConversation();
}
// Now, rather than with the first message: this is also when the page asks for the key.
fetchModelName().then(
  (name) => { modelName = name; document.title = `yaie · chat · ${name}`; },
  (error) => console.warn("cannot reach the server:", error),
);
