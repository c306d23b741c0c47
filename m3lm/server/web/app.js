// The m3lm chat page. It speaks this server's OpenAI-compatible API (/v1/models and streamed
// /v1/chat/completions) and nothing else. Every text from the model or the user enters the page
// as text (textContent and text nodes), never as markup.
"use strict";

const KEY_STORE = "m3lm.apiKey"; // sessionStorage: the key lives as long as the tab

const state = {
  model: null, // the served model's id, from /v1/models
  history: [], // the conversation as API messages; the system prompt comes from the settings
  controller: null, // the AbortController of the reply being streamed
  epoch: 0, // counts clears: a reply that ends after one does not join the new conversation
};

const $ = (id) => document.getElementById(id);

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

const number = (n) => (typeof n === "number" ? n.toLocaleString("en-US") : "?");

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// The server's OpenAI error object as an ApiError (the status line when the body is not one).
async function failure(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch (_) {
    // not JSON: keep the status line
  }
  return new ApiError(response.status, message);
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = sessionStorage.getItem(KEY_STORE);
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

function showError(message) {
  $("error").textContent = message;
}

function setStatus(text) {
  $("status").textContent = text;
}

// loading | ready | streaming | locked (waiting for a key)
function setState(name) {
  document.body.dataset.state = name;
  const streaming = name === "streaming";
  $("prompt").disabled = name === "loading" || name === "locked";
  $("send").disabled = name !== "ready";
  $("stop").disabled = !streaming;
  for (const button of document.querySelectorAll(".tool-reply button")) button.disabled = name !== "ready";
  setStatus({ loading: "connecting…", ready: "ready", streaming: "replying…", locked: "needs a key" }[name]);
}

// ---- the server's card and the API key ----

async function loadInfo() {
  const response = await fetch("/v1/models", { headers: headers() });
  if (response.status === 401) {
    const refused = sessionStorage.getItem(KEY_STORE) !== null;
    askForKey(refused ? `The server refused this key: ${(await failure(response)).message}.` : "");
    return;
  }
  if (!response.ok) throw await failure(response);
  const card = (await response.json()).data[0];
  state.model = card.id;
  $("model").textContent = card.id;
  $("context").textContent = `${number(card.max_model_len)} tokens`;
  $("capacity").textContent =
    `${number(card.max_num_seqs)} sequences at once, ${number(card.kv_cache_tokens)} tokens of KV cache`;
  $("key-form").hidden = true;
  setState("ready");
  $("prompt").focus();
}

function askForKey(message) {
  sessionStorage.removeItem(KEY_STORE);
  $("key-form").hidden = false;
  $("key-error").textContent = message;
  setState("locked");
  $("key-input").focus();
}

async function onKey(event) {
  event.preventDefault();
  const key = $("key-input").value.trim();
  if (!key) return;
  sessionStorage.setItem(KEY_STORE, key);
  $("key-input").value = "";
  $("key-error").textContent = "";
  try {
    await loadInfo();
  } catch (e) {
    $("key-error").textContent = `Cannot reach the server: ${e.message}`;
  }
}

// ---- the request ----

// The tools box as an OpenAI `tools` list (null when empty); throws with a readable message.
function readTools() {
  const text = $("tools").value.trim();
  if (!text) return null;
  let tools;
  try {
    tools = JSON.parse(text);
  } catch (e) {
    throw new Error(`Tools: not valid JSON (${e.message})`);
  }
  if (!Array.isArray(tools)) throw new Error("Tools: give a JSON array of tools");
  return tools.map((tool, i) => {
    if (tool && typeof tool === "object" && tool.function) return { type: "function", ...tool };
    if (tool && typeof tool === "object" && typeof tool.name === "string") return { type: "function", function: tool };
    throw new Error(`Tools: item ${i} is neither {"type": "function", "function": {...}} nor a function`);
  });
}

// The settings' numbers; throws when one is out of its range.
function sampling() {
  const out = {};
  for (const [id, field] of [["temperature", "temperature"], ["top-p", "top_p"], ["max-tokens", "max_tokens"]]) {
    const input = $(id);
    if (input.value === "") continue;
    if (!input.checkValidity()) {
      throw new Error(`${input.parentElement.firstChild.textContent.trim()}: ${input.validationMessage}`);
    }
    out[field] = Number(input.value);
  }
  return out;
}

function requestBody(tools, settings) {
  const messages = [...state.history];
  const system = $("system").value;
  if (system.trim()) messages.unshift({ role: "system", content: system });
  const body = {
    model: state.model,
    messages,
    stream: true,
    stream_options: { include_usage: true },
    chat_template_kwargs: { thinking_mode: $("thinking").value },
    ...settings,
  };
  if (tools) body.tools = tools;
  return body;
}

// Calls `onData` with each Server-Sent Event's JSON until `data: [DONE]`.
async function readEvents(response, onData) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""))
        .join("\n");
      if (!data) continue; // a keep-alive comment
      if (data === "[DONE]") return;
      onData(JSON.parse(data));
    }
  }
}

// ---- the conversation on the page ----

function addTurn(role, label) {
  const root = el("li", `msg ${role}`);
  root.append(el("div", "who", label));
  $("conversation").append(root);
  return root;
}

function showUser(text) {
  const root = addTurn("user", "you");
  root.append(el("div", "text", text));
  scrollDown();
  return root;
}

function scrollDown() {
  const nearBottom = window.innerHeight + window.scrollY >= document.body.scrollHeight - 160;
  if (nearBottom) window.scrollTo(0, document.body.scrollHeight);
}

// One assistant reply on the page, filled in as its deltas arrive.
class Reply {
  constructor() {
    this.root = addTurn("assistant", state.model || "assistant");
    this.content = el("div", "content");
    this.calls = el("ol", "tool-calls");
    this.note = el("p", "note");
    this.stats = el("p", "stats");
    this.root.append(this.content, this.calls, this.note, this.stats);
    this.reasoning = null;
    this.callNodes = [];
  }

  addReasoning(text) {
    if (!this.reasoning) {
      const details = el("details", "reasoning"); // folded until opened
      details.append(el("summary", null, "reasoning"), el("div", "reasoning-text"));
      this.root.insertBefore(details, this.content);
      this.reasoning = details.lastChild.appendChild(document.createTextNode(""));
    }
    this.reasoning.appendData(text);
  }

  addContent(text) {
    if (!this.contentText) this.contentText = this.content.appendChild(document.createTextNode(""));
    this.contentText.appendData(text);
  }

  showCall(index, call) {
    let node = this.callNodes[index];
    if (!node) {
      node = el("li", "tool-call");
      node.append(el("div", "call-name"), el("pre", "call-args"));
      this.calls.append(node);
      this.callNodes[index] = node;
    }
    node.querySelector(".call-name").textContent = `${call.name}(…)`;
    node.querySelector(".call-args").textContent = pretty(call.arguments);
  }

  setNote(text, failed = false) {
    this.note.textContent = text;
    this.note.classList.toggle("failed", failed);
  }
}

// A call's JSON arguments indented when they parse (they do once the call is whole).
function pretty(args) {
  try {
    return JSON.stringify(JSON.parse(args), null, 2);
  } catch (_) {
    return args;
  }
}

function statsLine(got) {
  const u = got.usage;
  if (!u) return "";
  const cached = (u.prompt_tokens_details && u.prompt_tokens_details.cached_tokens) || 0;
  const parts = [
    `prompt ${number(u.prompt_tokens)} tokens (${number(cached)} cached)`,
    `reply ${number(u.completion_tokens)} tokens`,
  ];
  // decode speed: the tokens after the first, over the time since the first
  const seconds = (got.end - got.first) / 1000;
  if (u.completion_tokens > 1 && seconds > 0) parts.push(`${((u.completion_tokens - 1) / seconds).toFixed(1)} tok/s`);
  if (got.first !== null) parts.push(`first token ${Math.round(got.first - got.start)} ms`);
  if (got.finish) parts.push(`finish: ${got.finish}`);
  return parts.join(" · ");
}

function onChunk(chunk, got, reply) {
  if (chunk.error) throw new ApiError(chunk.error.code || 500, chunk.error.message || "the server failed");
  if (chunk.usage) got.usage = chunk.usage;
  for (const choice of chunk.choices || []) {
    const delta = choice.delta || {};
    // the server sends the reasoning under both names; one is enough
    const reasoning = delta.reasoning_content ?? delta.reasoning;
    const seen = reasoning || delta.content || (delta.tool_calls && delta.tool_calls.length);
    if (seen && got.first === null) got.first = performance.now();
    if (reasoning) {
      got.reasoning += reasoning;
      reply.addReasoning(reasoning);
    }
    if (delta.content) {
      got.content += delta.content;
      reply.addContent(delta.content);
    }
    for (const part of delta.tool_calls || []) {
      const call = (got.calls[part.index] ||= { id: "", name: "", arguments: "" });
      if (part.id) call.id = part.id;
      if (part.function && part.function.name) call.name = part.function.name;
      if (part.function && part.function.arguments) call.arguments += part.function.arguments;
      reply.showCall(part.index, call);
    }
    if (choice.finish_reason) got.finish = choice.finish_reason;
  }
  scrollDown();
}

// Streams one reply to the history as it stands. "refused" when the server turned the request
// down before any output (the caller then takes the turn back).
async function streamReply(tools, settings) {
  const reply = new Reply();
  const epoch = state.epoch;
  const controller = new AbortController();
  state.controller = controller;
  setState("streaming");
  const got = { content: "", reasoning: "", calls: [], usage: null, finish: null, start: performance.now(), first: null };
  let outcome = "done";
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers(),
      body: JSON.stringify(requestBody(tools, settings)),
      signal: controller.signal,
    });
    if (!response.ok) throw await failure(response);
    await readEvents(response, (chunk) => onChunk(chunk, got, reply));
  } catch (e) {
    if (e.name === "AbortError") {
      outcome = "stopped";
      reply.setNote("stopped");
    } else if (e instanceof ApiError && got.first === null) {
      reply.root.remove();
      showError(e.message);
      if (e.status === 401) askForKey(`The server refused the key: ${e.message}.`);
      outcome = "refused";
    } else {
      outcome = "failed";
      reply.setNote(`error: ${e.message}`, true);
    }
  } finally {
    got.end = performance.now();
    if (state.controller === controller) state.controller = null;
  }
  if (outcome !== "refused" && epoch === state.epoch) keepReply(reply, got, outcome);
  if (document.body.dataset.state === "streaming") setState("ready");
  return outcome;
}

// The reply joins the history (a stopped one with what it had; calls only when whole).
function keepReply(reply, got, outcome) {
  reply.stats.textContent = statsLine(got);
  const calls = outcome === "done" ? got.calls.filter((c) => c && c.name) : [];
  if (!got.content && !got.reasoning && !calls.length) {
    if (outcome === "done") reply.setNote("(an empty reply)");
    return;
  }
  const message = { role: "assistant", content: got.content };
  if (got.reasoning) message.reasoning_content = got.reasoning;
  if (calls.length) {
    message.tool_calls = calls.map((c) => ({
      id: c.id,
      type: "function",
      function: { name: c.name, arguments: c.arguments || "{}" },
    }));
  }
  state.history.push(message);
  message.tool_calls?.forEach((call, i) => askForResult(reply.callNodes[i], call, message));
}

// A form under a call for its result, typed by hand; when every call of the reply has one, the
// conversation goes on.
function askForResult(node, call, message) {
  if (!node) return;
  node.querySelector(".call-name").textContent = `${call.function.name}(…)`;
  const form = el("form", "tool-reply");
  const label = el("label", null, `result of ${call.function.name}`);
  const input = el("textarea");
  input.rows = 2;
  label.append(input);
  const row = el("div", "row");
  const button = el("button", null, "Send result");
  button.type = "submit";
  row.append(button);
  form.append(label, row);
  node.append(form);
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    if (state.controller) return;
    let tools, settings;
    try {
      tools = readTools();
      settings = sampling();
    } catch (e) {
      showError(e.message);
      return;
    }
    showError("");
    state.history.push({ role: "tool", tool_call_id: call.id, content: input.value });
    const result = el("p", "tool-result", `→ ${input.value}`);
    form.replaceWith(result);
    const answered = new Set(state.history.filter((m) => m.role === "tool").map((m) => m.tool_call_id));
    if (message.tool_calls.every((c) => answered.has(c.id))) await streamReply(tools, settings);
  });
}

async function onSend(event) {
  event.preventDefault();
  if (state.controller || document.body.dataset.state !== "ready") return;
  let tools, settings;
  try {
    tools = readTools();
    settings = sampling();
  } catch (e) {
    showError(e.message);
    return;
  }
  showError("");
  const text = $("prompt").value;
  const last = state.history[state.history.length - 1];
  if (!text.trim()) {
    if (last && last.role === "tool") await streamReply(tools, settings); // go on after results
    return;
  }
  state.history.push({ role: "user", content: text });
  const turn = showUser(text);
  $("prompt").value = "";
  if ((await streamReply(tools, settings)) === "refused") {
    state.history.pop(); // nothing was lost: the message goes back to the box
    turn.remove();
    if (!$("prompt").value) $("prompt").value = text;
  }
}

function onStop() {
  if (state.controller) state.controller.abort();
}

function onClear() {
  onStop();
  state.epoch += 1;
  state.history = [];
  $("conversation").replaceChildren();
  showError("");
}

function onPromptKey(event) {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
}

function start() {
  $("composer").addEventListener("submit", onSend);
  $("prompt").addEventListener("keydown", onPromptKey);
  $("stop").addEventListener("click", onStop);
  $("clear").addEventListener("click", onClear);
  $("key-form").addEventListener("submit", onKey);
  setState("loading");
  loadInfo().catch((e) => {
    setStatus("unreachable");
    showError(`Cannot reach the server: ${e.message}`);
  });
}

start();
