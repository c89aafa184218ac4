// What both pages share: the API key, reading event streams, and a few DOM helpers.
//
// The server sends the pages to anyone, but answers their requests only with the API key when
// it was started with --api-key. A page learns that from a 401, asks for the key once, and
// keeps it in this browser's localStorage. Event streams are read with fetch(), not
// EventSource, because EventSource cannot send the key's header.
"use strict";

const KEY_STORAGE = "yaie.apiKey";

function authHeaders(headers = {}) {
  const key = localStorage.getItem(KEY_STORAGE);
  return key ? { ...headers, Authorization: `Bearer ${key}` } : headers;
}

// fetch(), with the key; on a 401, ask for the key and try again.
async function apiFetch(url, options = {}) {
  let rejected = false;
  for (;;) {
    const response = await fetch(url, { ...options, headers: authHeaders(options.headers) });
    if (response.status !== 401) return response;
    await askForKey(rejected || localStorage.getItem(KEY_STORAGE) !== null);
    rejected = true;
  }
}

let keyWaiters = [];

// Show the key form (every page has one, hidden) until the user enters a key.
function askForKey(wrongKey) {
  const form = document.getElementById("key-form");
  form.hidden = false;
  document.getElementById("key-error").hidden = !wrongKey;
  document.getElementById("key-input").focus();
  return new Promise((resolve) => keyWaiters.push(resolve));
}

function setUpKeyForm() {
  const form = document.getElementById("key-form");
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    localStorage.setItem(KEY_STORAGE, document.getElementById("key-input").value.trim());
    form.hidden = true;
    const waiters = keyWaiters;
    keyWaiters = [];
    waiters.forEach((resolve) => resolve());
  });
}

// The `data:` payloads of a server-sent event stream, as they arrive.
async function* readEvents(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const lines = buffer.slice(0, end).split("\n");
      buffer = buffer.slice(end + 2);
      const data = lines
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(line.startsWith("data: ") ? 6 : 5))
        .join("\n");
      if (data) yield data;
    }
  }
}

// The message of an OpenAI-style error body, or the status line.
async function errorMessage(response) {
  try {
    const body = await response.json();
    return body.error?.message ?? `${response.status} ${response.statusText}`;
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

// An element with attributes and children (strings become text).
function h(tag, attributes = {}, ...children) {
  const element = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (name === "class") element.className = value;
    else if (name.startsWith("on")) element.addEventListener(name.slice(2), value);
    else element.setAttribute(name, value);
  }
  element.append(...children);
  return element;
}
