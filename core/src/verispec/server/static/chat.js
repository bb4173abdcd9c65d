// The chat page of `verispec serve`. Each turn sends the whole conversation to this server's
// /v1/chat/completions with "stream": true (so the server reuses its cached prefix), reads the
// Server-Sent Events from fetch's stream, and writes under the answer the numbers of the last
// chunk's `verispec` field: tokens, decode speed, time to first token, drafted/accepted, the
// speculator and why it speculated or not. Model text only ever goes through textContent.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "verispec.apiKey";
const conversation = [];  // {role, content}, resent whole each turn
let running = null;       // the AbortController of the turn that streams now

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function requestHeaders() {
  const headers = {"Content-Type": "application/json"};
  const key = $("api-key").value.trim();
  if (key) headers.Authorization = "Bearer " + key;
  return headers;
}

// The JSON payloads of an SSE body, until "data: [DONE]" or the end of the stream.
async function* sseEvents(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, {stream: true});
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart()).join("\n");
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

// A failed response's message: OpenAI's error body when there is one; 401 says what to do.
async function problem(response) {
  let message = response.statusText;
  try { message = (await response.json()).error.message; } catch (e) { /* not OpenAI's body */ }
  if (response.status === 401) {
    return "401: this server needs its API key. Enter it in the API key field above (it is sent as " +
      "'Authorization: Bearer KEY'). The server said: " + message;
  }
  return `HTTP ${response.status}: ${message}`;
}

function addTurn(prompt) {
  const turn = element("article", "turn");
  const answer = element("div", "answer");
  const stats = element("div", "stats pending", "waiting for the first token…");
  turn.append(element("div", "user", prompt), answer, stats);
  $("turns").append(turn);
  turn.scrollIntoView({block: "end"});
  return {turn, answer, stats};
}

const fixed = (x, digits) => (x === null || x === undefined ? "–" : x.toFixed(digits));

// The stats line: one span per figure, then the reason's code and text.
function showStats(stats, info, numTokens) {
  const drafted = info.num_draft_tokens, accepted = info.num_accepted_tokens;
  const rate = drafted ? ` (${Math.round(100 * accepted / drafted)}%)` : "";
  const parts = [
    ["tokens", `${numTokens} tokens`],
    ["tps", `${fixed(info.decode_tokens_per_s, 1)} tok/s`],
    ["ttft", `first token ${fixed(info.ttft_ms, 0)} ms`],
    ["drafts", `drafted ${drafted}, accepted ${accepted}${rate}`],
    ["speculator", `speculator ${info.speculator || "none"}`],
    ["reused", `reused ${info.reused_prefix_tokens} prefix tokens`],
  ];
  if (info.queued_ms >= 1) parts.push(["queued", `queued ${fixed(info.queued_ms, 0)} ms`]);
  stats.replaceChildren();
  stats.className = "stats";
  for (const [name, text] of parts) stats.append(element("span", name, text));
  stats.append(element("span", `reason-code code-${info.reason.code}`, info.reason.code),
               element("span", "reason-text", info.reason.text));
  stats.title = info.governor || "";  // the governor's one-line state, on hover
}

function fail(view, message) {
  view.turn.classList.add("failed");
  view.stats.className = "stats error";
  view.stats.textContent = message;
}

async function send(prompt) {
  conversation.push({role: "user", content: prompt});
  const view = addTurn(prompt);
  const body = {messages: conversation, stream: true, stream_options: {include_usage: true},
                temperature: Number($("temperature").value)};
  if ($("max-tokens").value) body.max_tokens = Number($("max-tokens").value);
  if (!$("speculation").checked) body.verispec = {speculation: false};
  running = new AbortController();
  setBusy(true);
  let text = "", numTokens = 0, info = null, usage = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: requestHeaders(), body: JSON.stringify(body), signal: running.signal});
    if (!response.ok) throw new Error(await problem(response));
    for await (const chunk of sseEvents(response.body)) {
      const choice = chunk.choices && chunk.choices[0];
      if (choice && choice.delta && "content" in choice.delta && !("role" in choice.delta)) {
        numTokens += 1;  // one chunk per token; its text may be "" while a character is held back
        text += choice.delta.content;
        view.answer.textContent = text;
        view.stats.textContent = "streaming…";
      }
      if (chunk.verispec) info = chunk.verispec;
      if (chunk.usage) usage = chunk.usage;
    }
    if (info === null) throw new Error("the stream ended before its last chunk (see the server's log)");
    conversation.push({role: "assistant", content: text});
    showStats(view.stats, info, usage ? usage.completion_tokens : numTokens);
  } catch (error) {
    if (error.name === "AbortError") {
      if (text) conversation.push({role: "assistant", content: text});  // the next turn continues from it
      else conversation.pop();
      view.stats.className = "stats stopped";
      view.stats.textContent = `stopped after ${numTokens} tokens (aborted: the server ends the request)`;
    } else {
      conversation.pop();  // the next turn is sent without this message
      fail(view, error instanceof TypeError ? `cannot reach the server: ${error.message}` : error.message);
    }
  } finally {
    running = null;
    setBusy(false);
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("new-chat").disabled = busy;
  $("stop").disabled = !busy;
}

function showSpeculation() {
  const on = $("speculation").checked;
  $("speculation-state").textContent = on ? "on" : "off (the next turn decodes plainly)";
}

async function showServer() {
  try {
    const health = await (await fetch("/health")).json();
    $("server").textContent = `server: speculator ${health.speculator || "none"}`;
  } catch (error) {
    $("server").textContent = "server: not reachable";
  }
}

function start() {
  try { $("api-key").value = localStorage.getItem(KEY_STORE) || ""; } catch (e) { /* storage blocked */ }
  $("api-key").addEventListener("input", () => {
    try { localStorage.setItem(KEY_STORE, $("api-key").value.trim()); } catch (e) { /* storage blocked */ }
  });
  $("speculation").addEventListener("change", showSpeculation);
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const prompt = $("prompt").value;
    if (!prompt.trim() || running) return;
    $("prompt").value = "";
    send(prompt);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => running && running.abort());
  $("new-chat").addEventListener("click", () => {
    conversation.length = 0;
    $("turns").replaceChildren();
  });
  showSpeculation();
  showServer();
}

start();
